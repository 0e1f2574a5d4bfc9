//! Reading request bodies that are JSON but that `serde_json` refuses.
//!
//! Some texts that engines read as JSON stop `serde_json::from_slice`: a number too large
//! for an `f64` (`1e999`), a `\u` escape of a lone surrogate (`"\ud800"`, which a client
//! that cuts a string in the middle of an emoji sends), nesting deeper than its recursion
//! limit (128), Python's `NaN`, `Infinity` and `-Infinity`, and a leading UTF-8 byte-order
//! mark. The engines behind the router read such bodies (Python's `json.loads` takes them
//! all), so a content rule that skipped them could be passed by adding one field.
//! [`parse`] reads them: a number too large or an infinity becomes the largest finite
//! `f64` of its sign, `NaN` becomes `null`, a lone surrogate becomes U+FFFD, a container
//! nested deeper than [`MAX_DEPTH`] becomes `null` (no rule path reaches that deep), and
//! the byte-order mark is dropped. Only the copy that is parsed is changed, never what is
//! forwarded. The repair runs only after `serde_json` has refused a body that starts as
//! an object or array, so well-formed bodies, and bodies that are not JSON at all, cost
//! nothing more.

use serde_json::Value;

/// The deepest container kept; deeper ones are read as `null`. Below serde_json's limit.
pub const MAX_DEPTH: usize = 100;

/// `body` parsed as JSON, repaired as the module says when `serde_json` refuses it as it
/// is. `None` when it is not JSON even then.
pub fn parse(body: &[u8]) -> Option<Value> {
    match crate::util::json_value(body) {
        Ok(v) => Some(v),
        Err(_) => {
            let text = body.strip_prefix(BOM).unwrap_or(body);
            let first = text.iter().find(|b| !b.is_ascii_whitespace())?;
            if !matches!(first, b'{' | b'[') {
                return None;
            }
            match repaired(text) {
                Some(fixed) => crate::util::json_value(&fixed).ok(),
                // Only the byte-order mark was in the way.
                None if text.len() < body.len() => crate::util::json_value(text).ok(),
                None => None,
            }
        }
    }
}

/// A UTF-8 byte-order mark.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// The largest finite `f64`, as JSON, by sign.
const MAX: [&str; 2] = ["1.7976931348623157e308", "-1.7976931348623157e308"];

/// A copy of `body` with the three repairs made, or `None` when there was nothing to
/// repair (or a container deeper than [`MAX_DEPTH`] never closes). Iterative, one pass.
fn repaired(body: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len());
    let mut changed = false;
    let mut depth = 0usize;
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'"' => {
                let end = string_end(body, i);
                changed |= copy_string(&body[i..end], &mut out);
                i = end;
            }
            b @ (b'[' | b'{') => {
                if depth >= MAX_DEPTH {
                    i = container_end(body, i)?;
                    out.extend_from_slice(b"null");
                    changed = true;
                } else {
                    depth += 1;
                    out.push(b);
                    i += 1;
                }
            }
            b @ (b']' | b'}') => {
                depth = depth.saturating_sub(1);
                out.push(b);
                i += 1;
            }
            b'N' if body[i..].starts_with(b"NaN") => {
                out.extend_from_slice(b"null");
                changed = true;
                i += 3;
            }
            b'I' if body[i..].starts_with(b"Infinity") => {
                out.extend_from_slice(MAX[0].as_bytes());
                changed = true;
                i += 8;
            }
            b'-' if body[i..].starts_with(b"-Infinity") => {
                out.extend_from_slice(MAX[1].as_bytes());
                changed = true;
                i += 9;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < body.len()
                    && matches!(body[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    i += 1;
                }
                let token = &body[start..i];
                let too_large = std::str::from_utf8(token)
                    .ok()
                    .and_then(|t| t.parse::<f64>().ok())
                    .is_some_and(f64::is_infinite);
                if too_large {
                    out.extend_from_slice(MAX[usize::from(token[0] == b'-')].as_bytes());
                    changed = true;
                } else {
                    out.extend_from_slice(token);
                }
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    changed.then_some(out)
}

/// The index just past the string that opens at `start` (its closing quote), or the end
/// of `body` when it never closes.
fn string_end(body: &[u8], start: usize) -> usize {
    let mut i = start + 1;
    while i < body.len() {
        match body[i] {
            b'"' => return i + 1,
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
    body.len()
}

/// The index just past the container that opens at `start`, skipping strings; `None`
/// when it never closes.
fn container_end(body: &[u8], start: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = start;
    while i < body.len() {
        match body[i] {
            b'"' => {
                i = string_end(body, i);
                continue;
            }
            b'[' | b'{' => depth += 1,
            b']' | b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Copies one string token (quotes included), its lone-surrogate escapes replaced by
/// `\ufffd`; whether it replaced any.
fn copy_string(s: &[u8], out: &mut Vec<u8>) -> bool {
    let mut changed = false;
    let mut i = 0;
    while i < s.len() {
        if s[i] != b'\\' {
            out.push(s[i]);
            i += 1;
            continue;
        }
        match escaped_unit(s, i) {
            Some(0xD800..=0xDBFF) => {
                if escaped_unit(s, i + 6).is_some_and(|lo| (0xDC00..=0xDFFF).contains(&lo)) {
                    out.extend_from_slice(&s[i..i + 12]);
                    i += 12;
                } else {
                    out.extend_from_slice(b"\\ufffd");
                    changed = true;
                    i += 6;
                }
            }
            Some(0xDC00..=0xDFFF) => {
                out.extend_from_slice(b"\\ufffd");
                changed = true;
                i += 6;
            }
            _ => {
                // Any other escape: its two bytes as they are (a `\u` escape's digits
                // follow as plain bytes).
                let end = (i + 2).min(s.len());
                out.extend_from_slice(&s[i..end]);
                i = end;
            }
        }
    }
    changed
}

/// The code unit of the `\uXXXX` escape at `at`, if there is one.
fn escaped_unit(s: &[u8], at: usize) -> Option<u32> {
    let esc = s.get(at..at + 6)?;
    if esc[0] != b'\\' || esc[1] != b'u' {
        return None;
    }
    u32::from_str_radix(std::str::from_utf8(&esc[2..]).ok()?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bodies_serde_refuses_are_read_with_the_repairs() {
        for (raw, want) in [
            (
                r#"{"model":"m","pad":1e999}"#,
                json!({"model":"m","pad":f64::MAX}),
            ),
            (
                r#"{"model":"m","pad":[-1E+999, 1e-999]}"#,
                json!({"model":"m","pad":[f64::MIN, 0.0]}),
            ),
            (
                r#"{"model":"m","pad":"a\ud800b"}"#,
                json!({"model":"m","pad":"a\u{fffd}b"}),
            ),
            (
                r#"{"model":"m","pad":"\udc00\ud83d"}"#,
                json!({"model":"m","pad":"\u{fffd}\u{fffd}"}),
            ),
            (
                r#"{"model":"m","pad":[NaN, Infinity, -Infinity, "NaN"]}"#,
                json!({"model":"m","pad":[null, f64::MAX, f64::MIN, "NaN"]}),
            ),
            ("\u{feff}{\"model\":\"m\"}", json!({"model":"m"})),
            ("\u{feff} [1e999]", json!([f64::MAX])),
            // A valid pair next to a lone one: the pair is kept.
            (
                r#"{"model":"m","pad":"\ud83d\ude00\ud800"}"#,
                json!({"model":"m","pad":"😀\u{fffd}"}),
            ),
        ] {
            assert!(serde_json::from_slice::<Value>(raw.as_bytes()).is_err());
            assert_eq!(parse(raw.as_bytes()), Some(want), "{raw}");
        }
    }

    #[test]
    fn containers_nested_too_deep_read_as_null_and_the_rest_is_kept() {
        let deep = |n: usize, inner: &str| {
            format!(
                r#"{{"model":"m","pad":{}{inner}{},"stream":true}}"#,
                "[".repeat(n),
                "]".repeat(n)
            )
        };
        // Brackets inside strings do not count.
        let body = deep(5000, r#""]]}}[{\"""#);
        assert!(serde_json::from_slice::<Value>(body.as_bytes()).is_err());
        let v = parse(body.as_bytes()).unwrap();
        assert_eq!((&v["model"], &v["stream"]), (&json!("m"), &json!(true)));
        let mut at = &v["pad"];
        let mut levels = 1;
        while let Some(a) = at.as_array() {
            at = &a[0];
            levels += 1;
        }
        assert_eq!((at, levels), (&Value::Null, MAX_DEPTH));
        // Within serde's limit nothing is touched.
        let shallow = deep(50, "1");
        assert_eq!(
            parse(shallow.as_bytes()),
            serde_json::from_slice(shallow.as_bytes()).ok()
        );
        assert_eq!(repaired(shallow.as_bytes()), None);
    }

    /// Client bytes never panic it: cuts and byte flips of bodies that need each repair.
    #[test]
    fn mangled_bodies_never_panic() {
        let seeds = [
            r#"{"a":"\ud83d\ude00\ud800","b":[1e999,-2E+999,{"c":"\"]}"}]}"#.to_string(),
            format!(r#"{{"d":{}"x\\"{}}}"#, "[".repeat(120), "]".repeat(120)),
        ];
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for seed in &seeds {
            let seed = seed.as_bytes();
            for cut in 0..=seed.len() {
                let _ = parse(&seed[..cut]);
            }
            for _ in 0..2000 {
                let mut b = seed.to_vec();
                for _ in 0..1 + next() % 4 {
                    let at = (next() % b.len() as u64) as usize;
                    b[at] = b"\\\"u[]{}0e9-dD8"[(next() % 14) as usize];
                }
                let _ = parse(&b);
            }
        }
    }

    #[test]
    fn what_is_not_json_stays_unread() {
        for raw in [
            &b"not json"[..],
            b"{\"a\":1e999",
            b"{\"a\":[[[",
            b"{\"a\":\"\\ud800}",
            b"\xff\xfe",
            b"",
            b"NaN",
            b"\xEF\xBB\xBF\"x\"",
            b"  Infinity",
        ] {
            assert_eq!(parse(raw), None, "{}", String::from_utf8_lossy(raw));
        }
        // A never-closing container deeper than the limit.
        let open = format!("{{\"a\":{}", "[".repeat(500));
        assert_eq!(parse(open.as_bytes()), None);
    }
}
