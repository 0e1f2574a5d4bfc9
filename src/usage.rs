//! Token usage of a response (SPEC §5.2): `prompt_tokens`, `completion_tokens` and
//! `prompt_tokens_details.cached_tokens`, read from a JSON response's tail or an SSE usage
//! frame. The byte parser reads only the three counts in one pass: no value tree, at most two
//! small allocations, whatever else the object holds.

use serde_json::Value;

use crate::bytescan::{find_either, rfind};

/// Token counts of a response (SPEC §5.2).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// `prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
}

/// A count: a non-negative integer, or a float with an integral value in `u64`'s range.
fn float_count(f: f64) -> Option<u64> {
    (f >= 0.0 && f.fract() == 0.0 && f < 1.8e19).then_some(f as u64)
}

fn count(v: Option<&Value>) -> Option<u64> {
    let v = v?;
    if let Some(n) = v.as_u64() {
        return Some(n);
    }
    float_count(v.as_f64()?)
}

/// Usage from a JSON response (its top-level `usage` object) or from a usage object itself
/// (e.g. the usage frame a filter removed). `None` without a usage object.
pub fn usage_from_json(v: &Value) -> Option<Usage> {
    let u = match v.get("usage") {
        Some(u @ Value::Object(_)) => u,
        _ if v.get("prompt_tokens").is_some() || v.get("completion_tokens").is_some() => v,
        _ => return None,
    };
    Some(Usage {
        prompt_tokens: count(u.get("prompt_tokens")),
        completion_tokens: count(u.get("completion_tokens")),
        cached_tokens: count(
            u.get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens")),
        ),
    })
}

/// [`usage_from_json`] over the bytes of one JSON value, without building it: a single pass
/// that reads only the three counts and skips everything else byte by byte. It gives the
/// same answer as [`usage_from_json`] for every well-formed value (tested against it);
/// on malformed bytes it gives `None` or whatever counts it read before the damage — this
/// is accounting, not validation. Bytes after the value are ignored. Never panics, never
/// recurses more than two objects deep.
pub fn usage_from_slice(bytes: &[u8]) -> Option<Usage> {
    let mut sc = Scan { b: bytes, i: 0 };
    sc.ws();
    if sc.peek() != Some(b'{') {
        return None;
    }
    let top = sc.object(2)?;
    top.usage.or_else(|| top.has_counts.then(|| top.counts()))
}

/// The usage of a non-streaming JSON response, from the last `"usage"` object in its tail.
pub fn usage_in_json_tail(tail: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\"";
    // Backwards from `g` to `g`: the usage object's own keys hold none, so the first `g`
    // from the end is usually the key's, one search away (a quote-to-quote walk stops at
    // every key of the usage object first).
    let mut end = tail.len();
    let at = loop {
        let g = rfind(&tail[..end], b'g')?;
        if g >= 4 && tail[g - 4..].starts_with(KEY) {
            break g - 4;
        }
        end = g;
    };
    let after = at + KEY.len();
    let open = after + tail[after..].iter().position(|&b| b == b'{')?;
    usage_from_slice(&tail[open..])
}

/// Whether the JSON object or array that `data` starts with (after whitespace) is cut short:
/// its closing bracket is not in `data`. Structural only: strings and their escapes, and
/// brackets, are followed; other tokens are not validated.
pub fn container_is_cut(data: &[u8]) -> bool {
    let mut sc = Scan { b: data, i: 0 };
    sc.ws();
    matches!(sc.peek(), Some(b'{' | b'[')) && sc.skip().is_none()
}

/// What one object holds of interest: its own counts and, read when `depth` allows, the
/// counts of its `usage` object and the `cached_tokens` of its `prompt_tokens_details`.
#[derive(Default, Clone, Copy)]
struct Probe {
    object: bool,
    /// A `prompt_tokens` or `completion_tokens` key was present (with any value).
    has_counts: bool,
    prompt: Option<u64>,
    completion: Option<u64>,
    cached: Option<u64>,
    /// The last `usage` key's counts, when its value was an object.
    usage: Option<Usage>,
    /// The last `prompt_tokens_details` key's `cached_tokens`, when its value was an object.
    details_cached: Option<u64>,
}

impl Probe {
    fn counts(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt,
            completion_tokens: self.completion,
            cached_tokens: self.details_cached,
        }
    }
}

/// The keys the probe reads; everything else is `Other`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Key {
    Prompt,
    Completion,
    Cached,
    Usage,
    Details,
    Other,
}

impl Key {
    /// By length first: one or two comparisons instead of one per known key.
    fn of(raw: &[u8]) -> Key {
        match raw.len() {
            5 if raw == b"usage" => Key::Usage,
            13 if raw == b"prompt_tokens" => Key::Prompt,
            13 if raw == b"cached_tokens" => Key::Cached,
            17 if raw == b"completion_tokens" => Key::Completion,
            21 if raw == b"prompt_tokens_details" => Key::Details,
            _ => Key::Other,
        }
    }
}

/// A cursor over JSON bytes.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    /// Expect `c` (after whitespace) and step over it.
    fn eat(&mut self, c: u8) -> Option<()> {
        self.ws();
        (self.peek()? == c).then(|| self.i += 1)
    }

    /// A string at the cursor (its opening quote): its raw bytes, escapes left as they are.
    fn string(&mut self) -> Option<&'a [u8]> {
        self.i += 1;
        let start = self.i;
        let b: &'a [u8] = self.b;
        loop {
            let at = self.i + find_either(b.get(self.i..)?, b'"', b'\\')?;
            if b[at] == b'"' {
                self.i = at + 1;
                return Some(&b[start..at]);
            }
            self.i = at + 2;
        }
    }

    /// Skip the value at the cursor: strings with their escapes, containers by counting
    /// brackets outside strings (no recursion), scalars up to the next delimiter.
    fn skip(&mut self) -> Option<()> {
        self.ws();
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match *self.b.get(self.i)? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
            }
            _ => {
                let start = self.i;
                while !matches!(
                    self.peek(),
                    None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
                ) {
                    self.i += 1;
                }
                (self.i > start).then_some(())
            }
        }
    }

    /// The value at the cursor read as a count: `None` for anything but a number that is
    /// a non-negative integer (or an integral float) in range; the value is consumed.
    fn count(&mut self) -> Option<Option<u64>> {
        self.ws();
        let start = self.i;
        if !matches!(self.peek()?, b'-' | b'0'..=b'9') {
            self.skip()?;
            return Some(None);
        }
        // The usual case, a plain integer of at most 19 digits (no overflow), without the
        // token's UTF-8 check and `str::parse`.
        let mut n = 0u64;
        while let Some(d @ b'0'..=b'9') = self.peek() {
            n = n.wrapping_mul(10).wrapping_add(u64::from(d - b'0'));
            self.i += 1;
        }
        let digits = self.i - start;
        if (1..=19).contains(&digits)
            && matches!(
                self.peek(),
                None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            )
        {
            return Some(Some(n));
        }
        self.i = start;
        self.skip()?;
        let tok = std::str::from_utf8(&self.b[start..self.i]).ok()?;
        if tok.bytes().all(|c| c.is_ascii_digit()) {
            if let Ok(n) = tok.parse::<u64>() {
                return Some(Some(n));
            }
        }
        Some(tok.parse::<f64>().ok().and_then(float_count))
    }

    /// The object at the cursor (its `{`), reading nested `usage` / `prompt_tokens_details`
    /// objects while `depth` lasts. Later duplicate keys win, as in a value tree.
    fn object(&mut self, depth: u8) -> Option<Probe> {
        self.i += 1;
        let mut p = Probe {
            object: true,
            ..Probe::default()
        };
        self.ws();
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(p);
        }
        loop {
            self.ws();
            if self.peek()? != b'"' {
                return None;
            }
            let key = Key::of(self.string()?);
            self.eat(b':')?;
            self.ws();
            match key {
                Key::Prompt => {
                    p.has_counts = true;
                    p.prompt = self.count()?;
                }
                Key::Completion => {
                    p.has_counts = true;
                    p.completion = self.count()?;
                }
                Key::Cached => p.cached = self.count()?,
                Key::Usage | Key::Details => {
                    let nested = if depth > 0 && self.peek()? == b'{' {
                        self.object(depth - 1)?
                    } else {
                        self.skip()?;
                        Probe::default()
                    };
                    if key == Key::Usage {
                        p.usage = nested.object.then(|| nested.counts());
                    } else {
                        p.details_cached = nested.cached.filter(|_| nested.object);
                    }
                }
                _ => self.skip()?,
            }
            self.ws();
            match self.peek()? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    return Some(p);
                }
                _ => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::XorShift;
    use serde_json::json;

    #[test]
    fn counts_from_bytes_and_tails() {
        let body = br#"{"id":"x","choices":[{"message":{"content":"usage"}}],"usage":{"prompt_tokens":100,"completion_tokens":20.0,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        let want = Usage {
            prompt_tokens: Some(100),
            completion_tokens: Some(20),
            cached_tokens: Some(64),
        };
        assert_eq!(usage_from_slice(body), Some(want));
        // The tail of a response: from the last "usage" key's object.
        assert_eq!(usage_in_json_tail(&body[30..]), Some(want));
        assert_eq!(usage_in_json_tail(br#"{"id":"x"}"#), None);
        // `g`s after the key (in the usage object, or in a value) are stepped over; a
        // "usage" that is not a key-shaped string is not taken for one.
        let gs = br#"{"usage":{"prompt_tokens":7,"tag":"gg\"usage\"g"},"log":"g"}"#;
        assert_eq!(
            usage_in_json_tail(gs).and_then(|u| u.prompt_tokens),
            Some(7)
        );
        assert_eq!(usage_in_json_tail(br#"{"a":"usage"}"#), None);
        assert_eq!(usage_in_json_tail(b"g\"usage\""), None);
        assert_eq!(usage_in_json_tail(br#"{"usage":{"prompt_tok"#), None);
        assert_eq!(usage_from_slice(b"not json"), None);
        assert_eq!(
            usage_from_slice(br#"{"usage":{"prompt_tokens":-1,"completion_tokens":"3"}}"#),
            Some(Usage::default())
        );
    }

    /// A random JSON value over the keys the probe knows, nested a few levels.
    fn value(rng: &mut XorShift, depth: u32) -> Value {
        const KEYS: [&str; 7] = [
            "usage",
            "prompt_tokens",
            "completion_tokens",
            "prompt_tokens_details",
            "cached_tokens",
            "id",
            "choices",
        ];
        let leaf = |rng: &mut XorShift| match rng.below(8) {
            0 => json!(null),
            1 => json!(true),
            2 => json!(rng.below(1000)),
            3 => json!(-(rng.below(5) as i64) - 1),
            4 => json!(rng.below(100) as f64),
            5 => json!(1.5),
            6 => json!("7"),
            _ => json!(u64::MAX),
        };
        if depth == 0 {
            return leaf(rng);
        }
        match rng.below(4) {
            0 => leaf(rng),
            1 => Value::Array((0..rng.below(3)).map(|_| value(rng, depth - 1)).collect()),
            _ => {
                let mut m = serde_json::Map::new();
                for _ in 0..rng.below(5) {
                    let k = KEYS[rng.below(KEYS.len())];
                    m.insert(k.to_string(), value(rng, depth - 1));
                }
                Value::Object(m)
            }
        }
    }

    #[test]
    fn streaming_probe_agrees_with_the_value_parser() {
        let mut rng = XorShift::new(7);
        let mut found = 0;
        for _ in 0..50_000 {
            let v = value(&mut rng, 4);
            let bytes = serde_json::to_vec(&v).unwrap();
            let want = usage_from_json(&v);
            found += usize::from(want.is_some_and(|u| u.cached_tokens.is_some()));
            assert_eq!(usage_from_slice(&bytes), want, "{v}");
        }
        // The generator reaches the nested case (usage → details → cached).
        assert!(found > 10, "{found}");
    }

    #[test]
    fn cut_containers_are_told_from_complete_ones() {
        for (data, cut) in [
            (&br#"{"a":"}","b":[1,{"c":2}]}"#[..], false),
            (br#"  [1, "x\"]", {}]  "#, false),
            (br#"{"a":"}""#, true),
            (br#"{"a":[1,2"#, true),
            (br#"{"a":"x\"#, true),
            (b"{", true),
            (b"", false),
            (b"42", false),
        ] {
            assert_eq!(
                container_is_cut(data),
                cut,
                "{}",
                String::from_utf8_lossy(data)
            );
        }
        // Every proper prefix of an object is cut (whatever token it ends in: where
        // serde_json calls it an end of input, and where it calls a cut number invalid),
        // the whole object is not.
        let v = br#"{"id":"c\"1","choices":[{"delta":{"content":"a}b]c"}}],"n":[1.5e3,true,null]}"#;
        for cut in 1..v.len() {
            assert!(container_is_cut(&v[..cut]), "{cut}");
            let eof = serde_json::from_slice::<serde::de::IgnoredAny>(&v[..cut])
                .err()
                .is_some_and(|e| e.is_eof());
            assert!(!eof || container_is_cut(&v[..cut]));
        }
        assert!(!container_is_cut(v));
    }

    #[test]
    fn damaged_bytes_never_panic() {
        let mut rng = XorShift::new(11);
        let body = br#"{"id":"x\"y","usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":8},"x":[1,{"a":"}"}]}}"#;
        assert_eq!(usage_from_slice(body).unwrap().cached_tokens, Some(8));
        for cut in 0..=body.len() {
            let _ = usage_from_slice(&body[..cut]);
            let _ = usage_in_json_tail(&body[..cut]);
        }
        const ALPHABET: &[u8] = b"{}[]\",:0-9e. \\";
        for _ in 0..20_000 {
            let mut b = body.to_vec();
            for _ in 0..1 + rng.below(4) {
                let at = rng.below(b.len());
                b[at] = ALPHABET[rng.below(ALPHABET.len())];
            }
            let _ = usage_from_slice(&b);
        }
    }
}
