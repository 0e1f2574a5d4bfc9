//! Response post-processing (SPEC §6.3): per-route handlers that rewrite 2xx upstream
//! responses before they reach the client, to hide backend quirks.
//!
//! Pure and streaming: the relay feeds de-chunked body bytes as they arrive and writes
//! whatever [`PostProcessor::feed`] appends. Two media types are handled:
//!
//! * `text/event-stream` — line oriented. Every complete line goes out with the chunk it
//!   arrived in; only the trailing incomplete line is held (at most [`SSE_LINE_BYTES_MAX`];
//!   a longer line is passed through unmodified). Each `data: {json}` line is transformed;
//!   a line with nothing to change, a non-data line, `[DONE]` or a payload that does not
//!   parse keeps its exact bytes. A changed line becomes `data: ` + compact JSON + its
//!   original terminator (`\r\n`, `\n`, or none at end of body).
//! * `application/json` — held until the body ends (at most [`JSON_HOLD_BYTES_MAX`]; past
//!   that, what is held is flushed unchanged and the rest passes through), then transformed.
//!
//! Fail-open everywhere: anything that does not parse, or has nothing to change, is emitted
//! byte-identical. A changed frame/body is re-encoded, so its key order and escaping may
//! differ from the backend's.
//!
//! Handler semantics follow the reference README ("Response post-processing") and
//! `notes-edges.md` §2.2 (`postprocess.lua@044ec8d`, the newest version: `stop_reason` is
//! dropped unconditionally, `eos_token` is not mapped, `delta` is not null-stripped).
//! `vllm_format` applies only to objects with a `choices` member that is an array or
//! object (as the reference does); `strip_actual_usage` applies to any top-level object.

use serde_json::{Map, Value};

/// Longest SSE line (including its terminator) that is parsed and possibly rewritten. A
/// longer line passes through unmodified, so the held partial line never exceeds this.
pub const SSE_LINE_BYTES_MAX: usize = 1024 * 1024;
/// Largest non-stream JSON body held for rewriting (reference: 8 MiB). A larger one is
/// flushed unchanged and the remainder passes through.
pub const JSON_HOLD_BYTES_MAX: usize = 8 * 1024 * 1024;

/// A post-processing handler a route can name (`postprocess = "<name>"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handler {
    /// Removes a top-level `actual_usage` (some sglang builds); nothing else.
    StripActualUsage,
    /// Normalizes vLLM's response shape.
    VllmFormat,
}

impl Handler {
    /// The handler a configuration name selects; unknown names → `None`.
    pub fn from_name(s: &str) -> Option<Handler> {
        match s {
            "strip_actual_usage" => Some(Handler::StripActualUsage),
            "vllm_format" => Some(Handler::VllmFormat),
            _ => None,
        }
    }

    /// The configuration name of this handler.
    pub fn name(self) -> &'static str {
        match self {
            Handler::StripActualUsage => "strip_actual_usage",
            Handler::VllmFormat => "vllm_format",
        }
    }

    /// Applies the handler to one decoded frame or body; true when anything changed.
    pub fn apply(self, v: &mut Value) -> bool {
        match self {
            Handler::StripActualUsage => strip_actual_usage(v),
            Handler::VllmFormat => vllm_format(v),
        }
    }
}

/// How a response body is post-processed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `text/event-stream`: line by line, never held beyond the incomplete line.
    Sse,
    /// `application/json`: held whole (bounded), rewritten at the end.
    Json,
}

/// The media type of a Content-Type value: before any parameters, trimmed.
pub fn media_type(ct: &[u8]) -> &[u8] {
    let media = match ct.iter().position(|&b| b == b';') {
        Some(i) => &ct[..i],
        None => ct,
    };
    media.trim_ascii()
}

/// Decide from the response status and Content-Type whether to post-process: 2xx only;
/// `text/event-stream` → Sse; `application/json` (parameters allowed) → Json; anything
/// else → None (pass through untouched).
pub fn mode_for(status: u16, content_type: Option<&[u8]>) -> Option<Mode> {
    if !(200..=299).contains(&status) {
        return None;
    }
    let media = media_type(content_type?);
    if media.eq_ignore_ascii_case(b"text/event-stream") {
        Some(Mode::Sse)
    } else if media.eq_ignore_ascii_case(b"application/json") {
        Some(Mode::Json)
    } else {
        None
    }
}

/// Streaming post-processor for one response body.
#[derive(Debug)]
pub struct PostProcessor {
    handler: Handler,
    mode: Mode,
    /// Sse: the trailing incomplete line. Json: the body held so far.
    held: Vec<u8>,
    /// Sse: inside a line longer than the cap; bytes up to its `\n` pass through.
    /// Json: past the hold cap; everything passes through.
    passthrough: bool,
    changed: u64,
}

impl PostProcessor {
    pub fn new(handler: Handler, mode: Mode) -> Self {
        PostProcessor {
            handler,
            mode,
            held: Vec::new(),
            passthrough: false,
            changed: 0,
        }
    }

    /// Feed decoded body bytes (de-chunked) as they arrive; append what the client should
    /// get now to `out`.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<u8>) {
        match self.mode {
            Mode::Sse => self.feed_sse(chunk, out),
            Mode::Json => self.feed_json(chunk, out),
        }
    }

    /// End of body: flush whatever is held (transformed when possible).
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        let held = std::mem::take(&mut self.held);
        match self.mode {
            Mode::Sse => {
                if !held.is_empty() {
                    self.sse_line(&held, out);
                }
            }
            Mode::Json => {
                if !held.is_empty() {
                    self.json_body(&held, out);
                }
            }
        }
        self.passthrough = false;
    }

    /// Frames/bodies changed so far (for counters).
    pub fn changed(&self) -> u64 {
        self.changed
    }

    fn feed_sse(&mut self, mut chunk: &[u8], out: &mut Vec<u8>) {
        if self.passthrough {
            match memchr_nl(chunk) {
                Some(i) => {
                    out.extend_from_slice(&chunk[..=i]);
                    chunk = &chunk[i + 1..];
                    self.passthrough = false;
                }
                None => {
                    out.extend_from_slice(chunk);
                    return;
                }
            }
        }
        while let Some(i) = memchr_nl(chunk) {
            let (line, rest) = chunk.split_at(i + 1);
            if self.held.is_empty() {
                self.sse_line(line, out);
            } else {
                let mut full = std::mem::take(&mut self.held);
                full.extend_from_slice(line);
                self.sse_line(&full, out);
                // Keep the allocation for the next partial line.
                full.clear();
                self.held = full;
            }
            chunk = rest;
        }
        if chunk.is_empty() {
            return;
        }
        // A line that will exceed the cap whatever follows passes through unmodified.
        self.hold_or_pass(chunk, SSE_LINE_BYTES_MAX, out);
    }

    /// Hold `chunk` with what is already held, unless that would pass `cap`: then flush
    /// everything held plus `chunk` unchanged and pass the rest of the body through.
    fn hold_or_pass(&mut self, chunk: &[u8], cap: usize, out: &mut Vec<u8>) {
        if self.held.len() + chunk.len() > cap {
            out.append(&mut self.held);
            out.extend_from_slice(chunk);
            self.held = Vec::new();
            self.passthrough = true;
        } else {
            self.held.extend_from_slice(chunk);
        }
    }

    /// One complete SSE line (with its terminator, or none at end of body).
    fn sse_line(&mut self, line: &[u8], out: &mut Vec<u8>) {
        if line.len() <= SSE_LINE_BYTES_MAX {
            if let Some(rewritten) = rewrite_sse_line(self.handler, line) {
                self.changed += 1;
                out.extend_from_slice(&rewritten);
                return;
            }
        }
        out.extend_from_slice(line);
    }

    fn feed_json(&mut self, chunk: &[u8], out: &mut Vec<u8>) {
        if self.passthrough {
            out.extend_from_slice(chunk);
            return;
        }
        self.hold_or_pass(chunk, JSON_HOLD_BYTES_MAX, out);
    }

    fn json_body(&mut self, body: &[u8], out: &mut Vec<u8>) {
        if let Some(mut v) = parse_json(body) {
            if self.handler.apply(&mut v) {
                if let Ok(mut enc) = serde_json::to_vec(&v) {
                    // Keep the backend's trailing whitespace (usually a newline).
                    let trimmed = body.trim_ascii_end().len();
                    enc.extend_from_slice(&body[trimmed..]);
                    self.changed += 1;
                    out.extend_from_slice(&enc);
                    return;
                }
            }
        }
        out.extend_from_slice(body);
    }
}

fn memchr_nl(b: &[u8]) -> Option<usize> {
    b.iter().position(|&c| c == b'\n')
}

fn parse_json(b: &[u8]) -> Option<Value> {
    // Cheap precheck: only objects can change; skips `[DONE]`, numbers, arrays.
    if b.trim_ascii().first() != Some(&b'{') {
        return None;
    }
    crate::util::json_value(b)
        .ok()
        .filter(crate::util::json_numbers_exact)
}

/// The rewritten line when a `data:` line's JSON payload changed; `None` keeps the original.
fn rewrite_sse_line(handler: Handler, line: &[u8]) -> Option<Vec<u8>> {
    let (body, term): (&[u8], &[u8]) = if let Some(b) = line.strip_suffix(b"\r\n") {
        (b, b"\r\n")
    } else if let Some(b) = line.strip_suffix(b"\n") {
        (b, b"\n")
    } else {
        (line, b"")
    };
    let payload = body.strip_prefix(b"data:")?;
    let mut v = parse_json(payload)?;
    if !handler.apply(&mut v) {
        return None;
    }
    let enc = serde_json::to_vec(&v).ok()?;
    let mut o = Vec::with_capacity(6 + enc.len() + term.len());
    o.extend_from_slice(b"data: ");
    o.extend_from_slice(&enc);
    o.extend_from_slice(term);
    Some(o)
}

fn strip_actual_usage(v: &mut Value) -> bool {
    match v {
        Value::Object(o) => o.remove("actual_usage").is_some(),
        _ => false,
    }
}

/// Top-level fields deleted when JSON null.
const TOP_NULL: &[&str] = &[
    "prompt_logprobs",
    "prompt_token_ids",
    "prompt_text",
    "metrics",
    "logprobs",
    "token_ids",
];
/// Top-level fields deleted whatever their value.
const TOP_ALWAYS: &[&str] = &[
    "service_tier",
    "system_fingerprint",
    "kv_transfer_params",
    "ec_transfer_params",
    "actual_usage",
];
/// Per-choice fields deleted when JSON null.
const CHOICE_NULL: &[&str] = &[
    "logprobs",
    "token_ids",
    "routed_experts",
    "prompt_token_ids",
    "prompt_text",
];
/// `message` fields deleted when JSON null (not applied to `delta`).
const MESSAGE_NULL: &[&str] = &["refusal", "annotations", "audio", "function_call"];

fn remove_if_null(o: &mut Map<String, Value>, key: &str) -> bool {
    if matches!(o.get(key), Some(Value::Null)) {
        o.remove(key);
        true
    } else {
        false
    }
}

/// `reasoning` → `reasoning_content`, whenever present (even null), overwriting.
fn rename_reasoning(o: &mut Map<String, Value>) -> bool {
    match o.remove("reasoning") {
        Some(r) => {
            o.insert("reasoning_content".to_owned(), r);
            true
        }
        None => false,
    }
}

fn vllm_format(v: &mut Value) -> bool {
    let Value::Object(obj) = v else {
        return false;
    };
    if !matches!(obj.get("choices"), Some(Value::Array(_) | Value::Object(_))) {
        return false;
    }
    let mut changed = false;
    for k in TOP_NULL {
        changed |= remove_if_null(obj, k);
    }
    for k in TOP_ALWAYS {
        changed |= obj.remove(*k).is_some();
    }
    if let Some(Value::Object(usage)) = obj.get_mut("usage") {
        if let Some(Value::Object(ptd)) = usage.get_mut("prompt_tokens_details") {
            changed |= remove_if_null(ptd, "multimodal_tokens");
            // A rename that never overwrites an existing cache_write_tokens.
            if let Some(c) = ptd.remove("created_cache_tokens") {
                changed = true;
                if !ptd.contains_key("cache_write_tokens") {
                    ptd.insert("cache_write_tokens".to_owned(), c);
                }
            }
        }
    }
    if let Some(Value::Array(choices)) = obj.get_mut("choices") {
        for choice in choices.iter_mut() {
            let Value::Object(c) = choice else { continue };
            for k in CHOICE_NULL {
                changed |= remove_if_null(c, k);
            }
            changed |= rename_reasoning(c);
            if let Some(Value::Object(d)) = c.get_mut("delta") {
                changed |= rename_reasoning(d);
            }
            if let Some(Value::Object(m)) = c.get_mut("message") {
                changed |= rename_reasoning(m);
                for k in MESSAGE_NULL {
                    changed |= remove_if_null(m, k);
                }
            }
            changed |= c.remove("stop_reason").is_some();
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(h: Handler, mode: Mode, chunks: &[&[u8]]) -> (Vec<u8>, u64) {
        let mut p = PostProcessor::new(h, mode);
        let mut out = Vec::new();
        for c in chunks {
            p.feed(c, &mut out);
        }
        p.finish(&mut out);
        (out, p.changed())
    }

    fn keys(v: &Value) -> Vec<&str> {
        let mut k: Vec<&str> = v.as_object().unwrap().keys().map(|s| s.as_str()).collect();
        k.sort_unstable();
        k
    }

    fn sorted(mut k: Vec<&'static str>) -> Vec<&'static str> {
        k.sort_unstable();
        k
    }

    const CHAT_CHUNK_REASONING: &str = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":null,"choices":[{"index":0,"delta":{"role":"assistant","reasoning":"hmm","content":null},"logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":null}],"prompt_token_ids":null}"#;
    const CHAT_CHUNK_CLEAN: &str = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#;
    const CHAT_CHUNK_USAGE: &str = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7,"prompt_tokens_details":{"cached_tokens":3,"created_cache_tokens":2,"multimodal_tokens":null}},"kv_transfer_params":{"a":1}}"#;

    /// A frame or body with an integer beyond 64 bits is left as the peer sent it: a
    /// re-encoding would write the number rounded. The control: the same frame with a small
    /// number is rewritten.
    #[test]
    fn a_number_a_rewrite_would_round_leaves_the_text_as_it_is() {
        let big = CHAT_CHUNK_REASONING.replace(
            r#""created":1"#,
            r#""created":123456789012345678901234567890"#,
        );
        for (handler, body) in [
            (Handler::VllmFormat, big.clone()),
            (
                Handler::StripActualUsage,
                r#"{"seed":18446744073709551616,"actual_usage":{}}"#.to_string(),
            ),
        ] {
            let sse = format!("data: {body}\n\n");
            assert_eq!(
                run(handler, Mode::Sse, &[sse.as_bytes()]),
                (sse.clone().into_bytes(), 0)
            );
            assert_eq!(
                run(handler, Mode::Json, &[body.as_bytes()]),
                (body.clone().into_bytes(), 0)
            );
            let small = body
                .replace("123456789012345678901234567890", "1")
                .replace("18446744073709551616", "1");
            let sse = format!("data: {small}\n\n");
            assert_eq!(
                run(handler, Mode::Sse, &[sse.as_bytes()]).1,
                1,
                "{handler:?}"
            );
            assert_eq!(
                run(handler, Mode::Json, &[small.as_bytes()]).1,
                1,
                "{handler:?}"
            );
        }
    }

    fn sample_stream() -> Vec<u8> {
        let mut s = Vec::new();
        s.extend_from_slice(b": keep-alive comment\n");
        s.extend_from_slice(b"event: message\r\n");
        s.extend_from_slice(format!("data: {CHAT_CHUNK_REASONING}\r\n\r\n").as_bytes());
        s.extend_from_slice(format!("data:{CHAT_CHUNK_CLEAN}\n\n").as_bytes());
        s.extend_from_slice(b"data: {\"choices\":[{\"stop_reason\": \n\n");
        s.extend_from_slice(b"id: 7\n");
        s.extend_from_slice(format!("data:  {CHAT_CHUNK_USAGE}  \n\n").as_bytes());
        s.extend_from_slice(b"data: [DONE]\n\n");
        s.extend_from_slice(format!("data: {CHAT_CHUNK_REASONING}").as_bytes());
        s
    }

    #[test]
    fn handler_names() {
        assert_eq!(
            Handler::from_name("strip_actual_usage"),
            Some(Handler::StripActualUsage)
        );
        assert_eq!(Handler::from_name("vllm_format"), Some(Handler::VllmFormat));
        assert_eq!(Handler::from_name("VLLM_FORMAT"), None);
        assert_eq!(Handler::from_name(""), None);
        for h in [Handler::StripActualUsage, Handler::VllmFormat] {
            assert_eq!(Handler::from_name(h.name()), Some(h));
        }
    }

    #[test]
    fn mode_for_status_and_content_type() {
        assert_eq!(mode_for(200, Some(b"text/event-stream")), Some(Mode::Sse));
        assert_eq!(
            mode_for(201, Some(b"Text/Event-Stream; charset=utf-8")),
            Some(Mode::Sse)
        );
        assert_eq!(mode_for(200, Some(b"application/json")), Some(Mode::Json));
        assert_eq!(
            mode_for(299, Some(b" application/JSON ; charset=UTF-8")),
            Some(Mode::Json)
        );
        assert_eq!(mode_for(199, Some(b"application/json")), None);
        assert_eq!(mode_for(300, Some(b"application/json")), None);
        assert_eq!(mode_for(400, Some(b"application/json")), None);
        assert_eq!(mode_for(500, Some(b"text/event-stream")), None);
        assert_eq!(mode_for(200, None), None);
        assert_eq!(mode_for(200, Some(b"text/plain")), None);
        assert_eq!(mode_for(200, Some(b"application/x-ndjson")), None);
        assert_eq!(mode_for(200, Some(b"application/jsonx")), None);
        assert_eq!(mode_for(200, Some(b"")), None);
    }

    #[test]
    fn sse_split_at_every_byte_gives_same_output() {
        let s = sample_stream();
        for h in [Handler::VllmFormat, Handler::StripActualUsage] {
            let (whole, whole_changed) = run(h, Mode::Sse, &[&s]);
            for i in 0..=s.len() {
                let (a, b) = s.split_at(i);
                let (out, changed) = run(h, Mode::Sse, &[a, b]);
                assert_eq!(out, whole, "split at {i}");
                assert_eq!(changed, whole_changed);
            }
            let bytes: Vec<&[u8]> = s.chunks(1).collect();
            assert_eq!(run(h, Mode::Sse, &bytes).0, whole);
            let threes: Vec<&[u8]> = s.chunks(3).collect();
            assert_eq!(run(h, Mode::Sse, &threes).0, whole);
        }
    }

    #[test]
    fn sse_vllm_stream_renamed_and_pruned() {
        let s = sample_stream();
        let (out, changed) = run(Handler::VllmFormat, Mode::Sse, &[&s]);
        assert_eq!(changed, 3);
        let text = String::from_utf8(out).unwrap();
        // Split keeping terminators to check them exactly.
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        assert_eq!(lines[0], ": keep-alive comment\n");
        assert_eq!(lines[1], "event: message\r\n");
        // Changed frame: `data: ` + compact JSON + original CRLF.
        let l2 = lines[2];
        assert!(l2.starts_with("data: {") && l2.ends_with("}\r\n"), "{l2:?}");
        let v: Value = serde_json::from_str(&l2[6..l2.len() - 2]).unwrap();
        assert_eq!(
            keys(&v),
            sorted(vec!["id", "object", "created", "model", "choices"])
        );
        let c = &v["choices"][0];
        assert_eq!(keys(c), sorted(vec!["index", "delta", "finish_reason"]));
        assert_eq!(
            keys(&c["delta"]),
            sorted(vec!["role", "reasoning_content", "content"])
        );
        assert_eq!(c["delta"]["reasoning_content"], json!("hmm"));
        assert_eq!(c["finish_reason"], Value::Null);
        assert_eq!(lines[3], "\r\n");
        // Unchanged frame: byte-identical, including the missing space after `data:`.
        assert_eq!(lines[4], format!("data:{CHAT_CHUNK_CLEAN}\n"));
        assert_eq!(lines[5], "\n");
        // Malformed frame untouched.
        assert_eq!(lines[6], "data: {\"choices\":[{\"stop_reason\": \n");
        assert_eq!(lines[7], "\n");
        assert_eq!(lines[8], "id: 7\n");
        // Usage frame: created_cache_tokens renamed, null multimodal_tokens and
        // kv_transfer_params dropped; extra whitespace around the payload normalised.
        let l9 = lines[9];
        assert!(l9.starts_with("data: {") && l9.ends_with("}\n"), "{l9:?}");
        let v: Value = serde_json::from_str(&l9[6..l9.len() - 1]).unwrap();
        assert_eq!(
            keys(&v),
            sorted(vec!["id", "object", "created", "model", "choices", "usage"])
        );
        assert_eq!(
            v["usage"]["prompt_tokens_details"],
            json!({"cached_tokens": 3, "cache_write_tokens": 2})
        );
        assert_eq!(lines[10], "\n");
        assert_eq!(lines[11], "data: [DONE]\n");
        assert_eq!(lines[12], "\n");
        // Final line without terminator: rewritten, still without terminator.
        let last = lines[13];
        assert!(last.starts_with("data: {") && last.ends_with('}'));
        assert_eq!(lines.len(), 14);
    }

    #[test]
    fn sse_unchanged_stream_is_byte_identical() {
        let mut s = Vec::new();
        s.extend_from_slice(b"retry: 100\r\n");
        s.extend_from_slice(format!("data: {CHAT_CHUNK_CLEAN}\r\n\r\n").as_bytes());
        s.extend_from_slice(format!("data: {CHAT_CHUNK_CLEAN} \n\n").as_bytes());
        // Key order and spacing unusual: must still be preserved verbatim.
        s.extend_from_slice(b"data: { \"z\" : 1, \"choices\" : [ ], \"a\":\"\\/x\" }\n\n");
        s.extend_from_slice(b"data: \n\ndata:\n\n: comment\n");
        s.extend_from_slice(b"data: [DONE]\n\ndata: 42\n\ndata: [1,2]\n\n");
        s.extend_from_slice(b"event: ping\ndata: {\"no_choices\":{\"stop_reason\":1}}\n\n");
        for h in [Handler::VllmFormat, Handler::StripActualUsage] {
            let (out, changed) = run(h, Mode::Sse, &[&s]);
            assert_eq!(out, s);
            assert_eq!(changed, 0);
        }
    }

    #[test]
    fn sse_complete_lines_not_held() {
        let mut p = PostProcessor::new(Handler::VllmFormat, Mode::Sse);
        let mut out = Vec::new();
        let first = format!("data: {CHAT_CHUNK_CLEAN}\n\ndata: [DO");
        p.feed(first.as_bytes(), &mut out);
        assert_eq!(out, format!("data: {CHAT_CHUNK_CLEAN}\n\n").as_bytes());
        out.clear();
        p.feed(b"NE]", &mut out);
        assert!(out.is_empty());
        p.feed(b"\n\n", &mut out);
        assert_eq!(out, b"data: [DONE]\n\n");
        out.clear();
        p.finish(&mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn sse_malformed_and_done_untouched() {
        let s =
            b"data: {\"choices\":[{\"reasoning\":\"x\"}]\n\ndata: {not json}\n\ndata: [DONE]\n\n";
        let (out, changed) = run(Handler::VllmFormat, Mode::Sse, &[s]);
        assert_eq!(out, s);
        assert_eq!(changed, 0);
    }

    #[test]
    fn sse_overlong_line_passes_through_unmodified() {
        let pad = "x".repeat(SSE_LINE_BYTES_MAX + 10);
        let long = format!(
            "data: {{\"choices\":[],\"actual_usage\":{{}},\"pad\":\"{pad}\"}}\n\ndata: {CHAT_CHUNK_REASONING}\n"
        );
        let s = long.as_bytes();
        // Whole, and in 64 KiB pieces: both pass the long line unmodified, rewrite the next.
        let (whole, wc) = run(Handler::VllmFormat, Mode::Sse, &[s]);
        let pieces: Vec<&[u8]> = s.chunks(64 * 1024).collect();
        let mut p = PostProcessor::new(Handler::VllmFormat, Mode::Sse);
        let mut out = Vec::new();
        for c in &pieces {
            p.feed(c, &mut out);
            assert!(p.held.len() <= SSE_LINE_BYTES_MAX);
        }
        p.finish(&mut out);
        assert_eq!(out, whole);
        assert_eq!(p.changed(), wc);
        assert_eq!(wc, 1);
        let first_len = long.find('\n').unwrap() + 1;
        assert_eq!(&whole[..first_len], &s[..first_len]);
        assert!(!whole[first_len..]
            .windows(b"reasoning\"".len())
            .any(|w| w == b"reasoning\""));
    }

    #[test]
    fn json_vllm_chat_completion_renamed_and_pruned() {
        let body = json!({
            "id": "chatcmpl-9",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "qwen",
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "4",
                    "refusal": null,
                    "annotations": null,
                    "audio": null,
                    "function_call": null,
                    "tool_calls": [],
                    "reasoning": "2+2"
                },
                "logprobs": null,
                "finish_reason": "stop",
                "stop_reason": 151645,
                "token_ids": null,
                "routed_experts": null
            }],
            "service_tier": null,
            "system_fingerprint": null,
            "usage": {
                "prompt_tokens": 10,
                "total_tokens": 11,
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 8, "created_cache_tokens": 2}
            },
            "prompt_logprobs": null,
            "prompt_token_ids": null,
            "kv_transfer_params": null,
            "ec_transfer_params": {"x": 1},
            "actual_usage": {"prompt_tokens": 10}
        });
        let raw = format!("{body}\n");
        let (a, b) = raw.as_bytes().split_at(37);
        let (out, changed) = run(Handler::VllmFormat, Mode::Json, &[a, b]);
        assert_eq!(changed, 1);
        assert!(out.ends_with(b"}\n"));
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            keys(&v),
            sorted(vec!["id", "object", "created", "model", "choices", "usage"])
        );
        let c = &v["choices"][0];
        assert_eq!(keys(c), sorted(vec!["index", "message", "finish_reason"]));
        assert_eq!(
            keys(&c["message"]),
            sorted(vec!["role", "content", "tool_calls", "reasoning_content"])
        );
        assert_eq!(c["message"]["reasoning_content"], json!("2+2"));
        assert_eq!(c["finish_reason"], json!("stop"));
        assert_eq!(
            v["usage"],
            json!({
                "prompt_tokens": 10, "total_tokens": 11, "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 2}
            })
        );
    }

    #[test]
    fn vllm_null_only_drops_and_rename_rules() {
        // Non-null placeholders survive; reasoning overwrites; cache_write_tokens is not
        // overwritten; delta is not null-stripped; stop_reason goes even with null finish.
        let mut v = json!({
            "choices": [
                {"logprobs": {"content": []}, "token_ids": [1, 2], "stop_reason": null,
                 "finish_reason": null, "reasoning": null, "reasoning_content": "old",
                 "delta": {"refusal": null, "reasoning": "r"}},
                "not an object",
                {"message": {"refusal": "no", "annotations": [], "content": null}}
            ],
            "prompt_token_ids": [5],
            "metrics": null,
            "usage": {"prompt_tokens_details": {"created_cache_tokens": 1, "cache_write_tokens": 9,
                                                 "multimodal_tokens": 0}}
        });
        assert!(Handler::VllmFormat.apply(&mut v));
        assert_eq!(
            v,
            json!({
                "choices": [
                    {"logprobs": {"content": []}, "token_ids": [1, 2], "finish_reason": null,
                     "reasoning_content": null,
                     "delta": {"refusal": null, "reasoning_content": "r"}},
                    "not an object",
                    {"message": {"refusal": "no", "annotations": [], "content": null}}
                ],
                "prompt_token_ids": [5],
                "usage": {"prompt_tokens_details": {"cache_write_tokens": 9, "multimodal_tokens": 0}}
            })
        );
        // No `choices` member → vllm_format leaves the object alone.
        let mut e = json!({"error": {"message": "x"}, "service_tier": "a", "actual_usage": {}});
        let before = e.clone();
        assert!(!Handler::VllmFormat.apply(&mut e));
        assert_eq!(e, before);
    }

    #[test]
    fn json_unchanged_body_byte_identical() {
        let raw = br#"{ "z": 1, "choices": [ {"message": {"content": "a\/b", "refusal": "r"}} ],
  "usage": {"prompt_tokens": 1.50e0} }"#;
        for h in [Handler::VllmFormat, Handler::StripActualUsage] {
            let (out, changed) = run(h, Mode::Json, &[&raw[..10], &raw[10..]]);
            assert_eq!(out, raw);
            assert_eq!(changed, 0);
        }
    }

    #[test]
    fn json_malformed_or_non_object_passes_through() {
        for raw in [
            &b"{\"choices\":[{\"reasoning\":1}]"[..],
            b"[{\"actual_usage\":1}]",
            b"not json at all",
            b"{\"actual_usage\":1} trailing",
        ] {
            for h in [Handler::VllmFormat, Handler::StripActualUsage] {
                let (out, changed) = run(h, Mode::Json, &[raw]);
                assert_eq!(out, raw);
                assert_eq!(changed, 0);
            }
        }
        let (out, _) = run(Handler::VllmFormat, Mode::Json, &[]);
        assert!(out.is_empty());
    }

    #[test]
    fn json_body_held_until_finish() {
        let mut p = PostProcessor::new(Handler::StripActualUsage, Mode::Json);
        let mut out = Vec::new();
        p.feed(b"{\"usage\":{},", &mut out);
        p.feed(b"\"actual_usage\":{}}", &mut out);
        assert!(out.is_empty());
        p.finish(&mut out);
        assert_eq!(out, b"{\"usage\":{}}");
        assert_eq!(p.changed(), 1);
    }

    #[test]
    fn json_body_over_cap_passes_through_unchanged() {
        let pad = "y".repeat(JSON_HOLD_BYTES_MAX);
        let raw = format!(
            "{{\"choices\":[{{\"reasoning\":\"r\"}}],\"actual_usage\":{{}},\"pad\":\"{pad}\"}}"
        );
        let raw = raw.as_bytes();
        let mut p = PostProcessor::new(Handler::VllmFormat, Mode::Json);
        let mut out = Vec::new();
        let mut emitted_before_finish = false;
        for c in raw.chunks(256 * 1024) {
            p.feed(c, &mut out);
            emitted_before_finish |= !out.is_empty();
            assert!(p.held.len() <= JSON_HOLD_BYTES_MAX);
        }
        assert!(emitted_before_finish);
        p.finish(&mut out);
        assert_eq!(out, raw);
        assert_eq!(p.changed(), 0);
        // In one piece as well.
        let (out, changed) = run(Handler::VllmFormat, Mode::Json, &[raw]);
        assert_eq!(out, raw);
        assert_eq!(changed, 0);
    }

    #[test]
    fn json_body_at_cap_is_still_rewritten() {
        let head = "{\"actual_usage\":1,\"pad\":\"";
        let pad = "z".repeat(JSON_HOLD_BYTES_MAX - head.len() - 2);
        let raw = format!("{head}{pad}\"}}");
        assert_eq!(raw.len(), JSON_HOLD_BYTES_MAX);
        let (out, changed) = run(Handler::StripActualUsage, Mode::Json, &[raw.as_bytes()]);
        assert_eq!(changed, 1);
        assert_eq!(out, format!("{{\"pad\":\"{pad}\"}}").as_bytes());
    }

    #[test]
    fn strip_actual_usage_removes_only_actual_usage() {
        let frame = r#"{"id":"x","choices":[{"delta":{"reasoning":"r"},"stop_reason":null,"logprobs":null}],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"created_cache_tokens":1}},"actual_usage":{"prompt_tokens":3,"cached_tokens":0},"system_fingerprint":null,"service_tier":"default"}"#;
        let s = format!("data: {frame}\n\n");
        let (out, changed) = run(Handler::StripActualUsage, Mode::Sse, &[s.as_bytes()]);
        assert_eq!(changed, 1);
        let text = String::from_utf8(out).unwrap();
        let line = text
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        let got: Value = serde_json::from_str(line).unwrap();
        let mut want: Value = serde_json::from_str(frame).unwrap();
        want.as_object_mut().unwrap().remove("actual_usage");
        assert_eq!(got, want);
        // Nested actual_usage is not top-level: untouched, byte-identical.
        let nested = b"data: {\"usage\":{\"actual_usage\":1}}\n";
        let (out, changed) = run(Handler::StripActualUsage, Mode::Sse, &[nested]);
        assert_eq!(out, nested);
        assert_eq!(changed, 0);
        // Applies without `choices` too (e.g. a usage-only object).
        let mut v = json!({"usage": {}, "actual_usage": {}});
        assert!(Handler::StripActualUsage.apply(&mut v));
        assert_eq!(v, json!({"usage": {}}));
    }
}
