//! What the request path keeps for a sampled request (notes-edges §3.1–§3.2). Pure: no IO,
//! no clock; the caller passes randomness and fills timings into the meta.
//!
//! Response storage deviates from the reference on purpose: the reference puts a chunk in
//! its 1.5 MiB head whenever it still fits (so a late small chunk can land in the head after
//! an earlier one overflowed) and evicts whole chunks from its tail ring. Here the head is
//! exactly the first [`RESP_HEAD_MAX_BYTES`] bytes of the response and the tail exactly the
//! last [`RESP_TAIL_MAX_BYTES`] bytes, byte-precise, so the kept body is always in stream
//! order and memory never exceeds the two caps (a chunk larger than the tail still leaves its
//! last 512 KiB instead of evicting itself).

use std::collections::VecDeque;

use serde_json::{Map, Value};

use super::frame::Record;
use super::{REQ_BODY_MAX_BYTES, RESP_HEAD_MAX_BYTES, RESP_TAIL_MAX_BYTES};

/// Request headers never written to a log (compared case-insensitively).
pub const SCRUBBED_HEADERS: [&str; 6] = [
    "authorization",
    "cookie",
    "x-api-key",
    "x-litellm-api-key",
    "x-auth-token",
    "proxy-authorization",
];

/// The per-request capture: fed by the request path, turned into a [`Record`] at the end.
#[derive(Debug)]
pub struct Capture {
    request: Vec<u8>,
    req_truncated: bool,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    resp_total: u64,
    chunk_count: u64,
    /// The body's `model` and `stream`, read from the whole body when the capture began (a
    /// copy cut at its cap is no longer JSON); `None` when not read, or not JSON.
    facts: Option<RequestFacts>,
}

/// What a record says of a request body beyond its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFacts {
    pub model: Option<String>,
    pub stream: bool,
}

impl Capture {
    /// Copy the client's original body, truncated to [`REQ_BODY_MAX_BYTES`].
    pub fn new(req_body: &[u8]) -> Capture {
        Capture::from_parts(&[req_body])
    }

    /// [`Capture::new`] for a request body given as consecutive parts.
    pub fn from_parts(parts: &[&[u8]]) -> Capture {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let keep = total.min(REQ_BODY_MAX_BYTES);
        let mut request = Vec::with_capacity(keep);
        for p in parts {
            let room = keep - request.len();
            request.extend_from_slice(&p[..p.len().min(room)]);
        }
        Capture {
            request,
            req_truncated: keep < total,
            head: Vec::new(),
            tail: VecDeque::new(),
            resp_total: 0,
            chunk_count: 0,
            facts: None,
        }
    }

    /// Keep what the whole body said of its model and stream flag.
    pub fn set_request_facts(&mut self, facts: Option<RequestFacts>) {
        self.facts = facts;
    }

    pub fn request_facts(&self) -> Option<&RequestFacts> {
        self.facts.as_ref()
    }

    /// Mark the request body as incomplete (e.g. it was streamed to the peer without being
    /// held in memory).
    pub fn set_request_truncated(&mut self) {
        self.req_truncated = true;
    }

    /// Feed the peer's response body bytes as they arrive (before the router's response
    /// filters: the record keeps the raw upstream body). Empty chunks are ignored.
    pub fn push_response(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        self.chunk_count += 1;
        self.resp_total += bytes.len() as u64;
        let room = RESP_HEAD_MAX_BYTES - self.head.len();
        let (to_head, rest) = bytes.split_at(room.min(bytes.len()));
        self.head.extend_from_slice(to_head);
        if rest.is_empty() {
            return;
        }
        if rest.len() >= RESP_TAIL_MAX_BYTES {
            self.tail.clear();
            self.tail.extend(&rest[rest.len() - RESP_TAIL_MAX_BYTES..]);
            return;
        }
        let over = (self.tail.len() + rest.len()).saturating_sub(RESP_TAIL_MAX_BYTES);
        self.tail.drain(..over);
        self.tail.extend(rest);
    }

    /// Response bytes seen so far (uncapped).
    pub fn resp_bytes(&self) -> u64 {
        self.resp_total
    }

    /// Bytes currently held (request + head + tail): bounded by the three caps.
    pub fn held_bytes(&self) -> usize {
        self.request.len() + self.head.len() + self.tail.len()
    }

    /// Build the record. When `meta` is an object, sets `req_body_truncated`,
    /// `resp_body_truncated`, `resp_bytes` (the bytes fed; the request path replaces it with
    /// the bytes the client received) and `chunk_count` in it. The response is the head,
    /// then — if anything went past it — the marker
    /// `\n[BODYLOG_TRUNCATED <N> BYTES MISSING IN MIDDLE]\n` and the tail.
    pub fn finish(self, mut meta: Value) -> Record {
        let resp_truncated = !self.tail.is_empty();
        if let Value::Object(m) = &mut meta {
            m.insert("req_body_truncated".into(), Value::Bool(self.req_truncated));
            m.insert("resp_body_truncated".into(), Value::Bool(resp_truncated));
            m.insert("resp_bytes".into(), self.resp_total.into());
            m.insert("chunk_count".into(), self.chunk_count.into());
        }
        let mut response = self.head;
        if resp_truncated {
            let missing = self.resp_total - response.len() as u64 - self.tail.len() as u64;
            response.extend_from_slice(
                format!("\n[BODYLOG_TRUNCATED {missing} BYTES MISSING IN MIDDLE]\n").as_bytes(),
            );
            let (a, b) = self.tail.as_slices();
            response.extend_from_slice(a);
            response.extend_from_slice(b);
        }
        Record {
            meta,
            request: self.request,
            response,
        }
    }
}

/// The `req_headers` meta object: every header except [`SCRUBBED_HEADERS`], names lowercased,
/// a repeated name becomes an array in arrival order, values that are not UTF-8 are kept as
/// lossy text (the reference base64-encodes them; this crate carries no base64).
pub fn scrub_headers<'a, I>(headers: I) -> Map<String, Value>
where
    I: IntoIterator<Item = (&'a str, &'a [u8])>,
{
    let mut out = Map::new();
    for (name, value) in headers {
        if SCRUBBED_HEADERS
            .iter()
            .any(|s| s.eq_ignore_ascii_case(name))
        {
            continue;
        }
        let v = Value::String(String::from_utf8_lossy(value).into_owned());
        let key = name.to_ascii_lowercase();
        match out.get_mut(&key) {
            None => {
                out.insert(key, v);
            }
            Some(Value::Array(a)) => a.push(v),
            Some(prev) => {
                let first = prev.take();
                *prev = Value::Array(vec![first, v]);
            }
        }
    }
    out
}

/// The sampling decision for one request: `pct ≥ 100` always, `0` never, otherwise true for
/// `pct` out of every 100 values of `random` (any uniformly distributed u64).
pub fn sampled(pct: u8, random: u64) -> bool {
    match pct {
        0 => false,
        100.. => true,
        p => random % 100 < p as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_request_in_parts_is_joined_and_truncated_at_the_cap() {
        let r = Capture::from_parts(&[b"{\"a\":1", b"}"]).finish(json!({}));
        assert_eq!(r.request, b"{\"a\":1}");
        assert_eq!(r.meta["req_body_truncated"], false);
        // The cap falls inside the second part: the first whole, the second cut.
        let first = vec![b'a'; REQ_BODY_MAX_BYTES - 3];
        let r = Capture::from_parts(&[&first, b"bcdef", b"g"]).finish(json!({}));
        assert_eq!(r.request.len(), REQ_BODY_MAX_BYTES);
        assert!(r.request.ends_with(b"abcd"));
        assert_eq!(r.meta["req_body_truncated"], true);
    }

    #[test]
    fn request_is_truncated_at_the_cap() {
        let body = vec![b'a'; REQ_BODY_MAX_BYTES + 10];
        let r = Capture::new(&body).finish(json!({}));
        assert_eq!(r.request.len(), REQ_BODY_MAX_BYTES);
        assert_eq!(r.meta["req_body_truncated"], true);
        let r = Capture::new(b"small").finish(json!({}));
        assert_eq!(r.request, b"small");
        assert_eq!(r.meta["req_body_truncated"], false);
    }

    #[test]
    fn small_response_is_kept_whole() {
        let mut c = Capture::new(b"");
        c.push_response(b"hello ");
        c.push_response(b"");
        c.push_response(b"world");
        let r = c.finish(json!({"status": 200}));
        assert_eq!(r.response, b"hello world");
        assert_eq!(r.meta["resp_body_truncated"], false);
        assert_eq!(r.meta["chunk_count"], 2);
        assert_eq!(r.meta["resp_bytes"], 11);
        assert_eq!(r.meta["status"], 200);
    }

    #[test]
    fn head_and_tail_kept_middle_dropped() {
        // Numbered 1 KiB chunks so we can check exactly which bytes survive.
        let chunk = |i: u32| -> Vec<u8> {
            let mut v = format!("<{i:08}>").into_bytes();
            v.resize(1024, b'.');
            v
        };
        let n = 5000u32; // ~5 MiB
        let mut c = Capture::new(b"");
        let mut all = Vec::new();
        for i in 0..n {
            let ch = chunk(i);
            all.extend_from_slice(&ch);
            c.push_response(&ch);
            assert!(c.held_bytes() <= RESP_HEAD_MAX_BYTES + RESP_TAIL_MAX_BYTES);
        }
        let r = c.finish(json!({}));
        let missing = all.len() - RESP_HEAD_MAX_BYTES - RESP_TAIL_MAX_BYTES;
        let marker = format!("\n[BODYLOG_TRUNCATED {missing} BYTES MISSING IN MIDDLE]\n");
        let expected = [
            &all[..RESP_HEAD_MAX_BYTES],
            marker.as_bytes(),
            &all[all.len() - RESP_TAIL_MAX_BYTES..],
        ]
        .concat();
        assert_eq!(r.response, expected);
        assert_eq!(r.meta["resp_body_truncated"], true);
        assert_eq!(r.meta["resp_bytes"], all.len() as u64);
        assert_eq!(r.meta["chunk_count"], n as u64);
        assert!(r.response.len() <= crate::bodylog::RESP_BODY_MAX_BYTES);
        // A middle chunk is gone, the first and last are there.
        let has = |i: u32| {
            let tag = format!("<{i:08}>");
            r.response.windows(tag.len()).any(|w| w == tag.as_bytes())
        };
        assert!(has(0) && has(n - 1) && !has(n / 2));
    }

    #[test]
    fn one_huge_chunk_keeps_head_and_last_tail_bytes() {
        let big: Vec<u8> = (0..4_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut c = Capture::new(b"");
        c.push_response(&big);
        c.push_response(b"END");
        let r = c.finish(json!({}));
        assert!(r.response.starts_with(&big[..RESP_HEAD_MAX_BYTES]));
        assert!(r.response.ends_with(b"END"));
        let tail_start = r.response.len() - RESP_TAIL_MAX_BYTES;
        assert_eq!(
            &r.response[tail_start..r.response.len() - 3],
            &big[big.len() - (RESP_TAIL_MAX_BYTES - 3)..]
        );
    }

    #[test]
    fn exactly_full_head_is_not_truncated() {
        let mut c = Capture::new(b"");
        c.push_response(&vec![1; RESP_HEAD_MAX_BYTES]);
        let r = c.finish(json!({}));
        assert_eq!(r.meta["resp_body_truncated"], false);
        assert_eq!(r.response.len(), RESP_HEAD_MAX_BYTES);
    }

    #[test]
    fn scrubbing_drops_secrets_and_groups_repeats() {
        let hs: Vec<(&str, &[u8])> = vec![
            ("Authorization", b"Bearer sk-1"),
            ("COOKIE", b"a=b"),
            ("x-api-key", b"k"),
            ("X-LiteLLM-Api-Key", b"k"),
            ("x-auth-token", b"t"),
            ("Proxy-Authorization", b"p"),
            ("Content-Type", b"application/json"),
            ("X-Tag", b"one"),
            ("x-tag", b"two"),
            ("x-tag", b"three"),
            ("x-bin", b"\xff\xfeok"),
        ];
        let m = scrub_headers(hs);
        assert_eq!(
            Value::Object(m),
            json!({
                "content-type": "application/json",
                "x-tag": ["one", "two", "three"],
                "x-bin": "\u{fffd}\u{fffd}ok",
            })
        );
    }

    #[test]
    fn sampling_rate_is_roughly_pct() {
        let mut s = 0x1234_5678_9abc_def1u64;
        for pct in [1u8, 10, 37, 50, 99] {
            let n = 100_000;
            let hits = (0..n)
                .filter(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    sampled(pct, s)
                })
                .count();
            let rate = hits as f64 / n as f64 * 100.0;
            assert!((rate - pct as f64).abs() < 1.0, "pct {pct} got {rate}");
        }
        assert!((0..1000).all(|r| sampled(100, r) && sampled(255, r) && !sampled(0, r)));
    }
}
