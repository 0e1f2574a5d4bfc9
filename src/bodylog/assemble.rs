//! Frame → JSONL record, for the listener (notes-edges §3.7 "record assembly"). Pure: the
//! caller passes the sender's address and the current time.
//!
//! # The record (one JSON object per line, keys sorted)
//! * every meta field, as sent (see [`crate::bodylog`] for the list);
//! * `source_addr`: the sending router's IP, from the TCP connection (overrides meta);
//! * `ts` (when meta has `ts_ms` but no `ts`): `YYYY-MM-DDTHH:MM:SS.mmmZ`; `ts_end` = start +
//!   `rt` in the same format, when both are known;
//! * `req_body`: the request body as text; `req_body_lossy: true` when it was not valid UTF-8
//!   (invalid sequences became U+FFFD; the reference base64-encodes instead);
//! * `resp_body`: for `status < 400` (or no status), the reassembled content when the body is
//!   one JSON completion or an SSE stream (`data:` lines; OpenAI `choices[].text`,
//!   `delta`/`message` `content`; Anthropic `delta.text`, `content_block.text`, `content[]`
//!   text blocks) concatenated into one string; otherwise the raw body as text.
//!   `resp_body_lossy: true` as for the request;
//! * `resp_format`: `"json"`, `"sse"` (content was extracted) or `"raw"`;
//! * `resp_meta` (only members that are present): `id`, `model`, `finish_reason` (last
//!   non-empty), `stop_reason`, `reasoning` (concatenated `reasoning_content` / `reasoning` /
//!   Anthropic `thinking`), `tool_calls` (fragments grouped by `index`, first value wins
//!   except `function.arguments`, which is concatenated; sorted by index), `error`;
//! * `usage`: the last `usage` object seen in the response (absent if none).

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::frame::Record;

/// What the listener needs besides the line: where it goes and what it counts.
#[derive(Debug, Clone, PartialEq)]
pub struct Assembled {
    /// The JSON object plus `\n`.
    pub line: Vec<u8>,
    /// Unix ms that picks the hourly file: meta `ts_ms`, else the `now_ms` passed in.
    pub ts_ms: u64,
    pub summary: Summary,
}

/// The numbers `/metrics` aggregates.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Summary {
    /// Meta `route`, `unknown` when absent.
    pub route: String,
    /// Meta `owner`, `-` when absent.
    pub owner: String,
    /// Meta `status`, 0 when absent.
    pub status: u16,
    /// Meta `prompt_tokens`, else usage `prompt_tokens` / `input_tokens`.
    pub prompt_tokens: Option<u64>,
    /// Meta `cached_tokens`, else usage `prompt_tokens_details.cached_tokens` /
    /// `cache_read_input_tokens`.
    pub cached_tokens: Option<u64>,
    /// Meta `completion_tokens`, else usage `completion_tokens` / `output_tokens`.
    pub completion_tokens: Option<u64>,
    /// Meta `first_chunk_t` (> 0), only for streams (meta `stream: true`, or no `stream`
    /// field and an SSE response).
    pub ttft_s: Option<f64>,
}

/// Build the JSONL record for one frame.
pub fn assemble(rec: Record, source_addr: Option<&str>, now_ms: u64) -> Assembled {
    let mut obj = match rec.meta {
        Value::Object(m) => m,
        Value::Null => Map::new(),
        other => {
            let mut m = Map::new();
            m.insert("meta".into(), other);
            m
        }
    };
    if let Some(a) = source_addr {
        obj.insert("source_addr".into(), Value::String(a.into()));
    }
    let ts_ms = obj.get("ts_ms").and_then(Value::as_u64);
    let rt = obj.get("rt").and_then(Value::as_f64);
    if let Some(ms) = ts_ms {
        if !obj.contains_key("ts") {
            obj.insert("ts".into(), Value::String(iso_utc(ms)));
        }
        if let (Some(rt), false) = (rt, obj.contains_key("ts_end")) {
            if rt.is_finite() && rt >= 0.0 {
                let end = ms.saturating_add((rt * 1000.0).round() as u64);
                obj.insert("ts_end".into(), Value::String(iso_utc(end)));
            }
        }
    }

    let (req, lossy) = text(&rec.request);
    obj.insert("req_body".into(), Value::String(req));
    if lossy {
        obj.insert("req_body_lossy".into(), Value::Bool(true));
    }

    let status = obj.get("status").and_then(Value::as_u64).unwrap_or(0);
    let ex = if status >= 400 {
        None
    } else {
        extract(&rec.response)
    };
    let format = match &ex {
        Some((_, true)) => "sse",
        Some((_, false)) => "json",
        None => "raw",
    };
    let (body, lossy, usage) = match ex {
        Some((e, _)) => {
            let usage = e.usage.clone();
            let (body, resp_meta) = e.into_parts();
            if !resp_meta.is_empty() {
                obj.insert("resp_meta".into(), Value::Object(resp_meta));
            }
            (body, false, usage)
        }
        None => {
            let (b, l) = text(&rec.response);
            (b, l, None)
        }
    };
    obj.insert("resp_body".into(), Value::String(body));
    if lossy {
        obj.insert("resp_body_lossy".into(), Value::Bool(true));
    }
    obj.insert("resp_format".into(), Value::String(format.into()));
    if let Some(u) = &usage {
        obj.insert("usage".into(), u.clone());
    }

    let meta_u64 = |k: &str| obj.get(k).and_then(Value::as_u64);
    let usage_u64 = |path: &[&str]| {
        let mut v = usage.as_ref()?;
        for p in path {
            v = v.get(p)?;
        }
        v.as_u64()
    };
    let stream = match obj.get("stream").and_then(Value::as_bool) {
        Some(s) => s,
        None => format == "sse",
    };
    let summary = Summary {
        route: str_or(&obj, "route", "unknown"),
        owner: str_or(&obj, "owner", "-"),
        status: status.min(u16::MAX as u64) as u16,
        prompt_tokens: meta_u64("prompt_tokens")
            .or_else(|| usage_u64(&["prompt_tokens"]))
            .or_else(|| usage_u64(&["input_tokens"])),
        cached_tokens: meta_u64("cached_tokens")
            .or_else(|| usage_u64(&["prompt_tokens_details", "cached_tokens"]))
            .or_else(|| usage_u64(&["cache_read_input_tokens"])),
        completion_tokens: meta_u64("completion_tokens")
            .or_else(|| usage_u64(&["completion_tokens"]))
            .or_else(|| usage_u64(&["output_tokens"])),
        ttft_s: obj
            .get("first_chunk_t")
            .and_then(Value::as_f64)
            .filter(|t| stream && t.is_finite() && *t > 0.0),
    };
    let mut line = serde_json::to_vec(&Value::Object(obj)).unwrap_or_else(|_| b"{}".to_vec());
    line.push(b'\n');
    Assembled {
        line,
        ts_ms: ts_ms.unwrap_or(now_ms),
        summary,
    }
}

fn str_or(obj: &Map<String, Value>, k: &str, default: &str) -> String {
    match obj.get(k).and_then(Value::as_str) {
        Some(s) if !s.is_empty() => s.to_string(),
        _ => default.to_string(),
    }
}

fn text(b: &[u8]) -> (String, bool) {
    match std::str::from_utf8(b) {
        Ok(s) => (s.to_string(), false),
        Err(_) => (String::from_utf8_lossy(b).into_owned(), true),
    }
}

/// Content pulled out of a completion body.
#[derive(Debug, Default)]
struct Extract {
    text: String,
    reasoning: String,
    finish_reason: Option<String>,
    stop_reason: Option<String>,
    id: Option<String>,
    model: Option<String>,
    usage: Option<Value>,
    error: Option<Value>,
    tools: BTreeMap<i64, Value>,
    next_synthetic: i64,
}

/// `Some((extract, is_sse))` when the body yielded content, reasoning, an error or a finish
/// reason; `None` → keep the raw body.
fn extract(body: &[u8]) -> Option<(Extract, bool)> {
    let mut e = Extract::default();
    if let Ok(v @ Value::Object(_)) = crate::util::json_value(body) {
        e.absorb(&v);
        if e.found() {
            return Some((e, false));
        }
        e = Extract::default();
    }
    for line in body.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(rest) = line.strip_prefix(b"data:") else {
            continue;
        };
        let start = rest
            .iter()
            .position(|&b| b != b' ' && b != b'\t')
            .unwrap_or(rest.len());
        let payload = &rest[start..];
        if payload.is_empty() || payload == b"[DONE]" {
            continue;
        }
        if let Ok(v) = crate::util::json_value(payload) {
            e.absorb(&v);
        }
    }
    e.found().then_some((e, true))
}

impl Extract {
    fn found(&self) -> bool {
        !self.text.is_empty()
            || !self.reasoning.is_empty()
            || self.error.is_some()
            || self.finish_reason.is_some()
            || self.stop_reason.is_some()
            || !self.tools.is_empty()
    }

    fn absorb(&mut self, v: &Value) {
        if !v.is_object() {
            return;
        }
        self.absorb_common(v);
        // Anthropic message_start carries id/model/usage inside `message`.
        if let Some(m) = v.get("message").filter(|m| m.is_object()) {
            self.absorb_common(m);
            self.absorb_blocks(m);
        }
        if let Some(choices) = v.get("choices").and_then(Value::as_array) {
            for c in choices {
                if let Some(t) = c.get("text").and_then(Value::as_str) {
                    self.text.push_str(t);
                }
                for part in [c.get("delta"), c.get("message")].into_iter().flatten() {
                    self.absorb_message_part(part);
                }
                set_nonempty(&mut self.finish_reason, c.get("finish_reason"));
            }
        }
        // Anthropic streaming events.
        let index = v.get("index").and_then(Value::as_i64);
        if let Some(d) = v.get("delta").filter(|d| d.is_object()) {
            if let Some(t) = d.get("text").and_then(Value::as_str) {
                self.text.push_str(t);
            }
            if let Some(t) = d.get("thinking").and_then(Value::as_str) {
                self.reasoning.push_str(t);
            }
            set_nonempty(&mut self.stop_reason, d.get("stop_reason"));
            if let (Some(j), Some(i)) = (d.get("partial_json").and_then(Value::as_str), index) {
                self.tool_fragment(&serde_json::json!({"index": i, "function": {"arguments": j}}));
            }
        }
        if let Some(b) = v.get("content_block").filter(|b| b.is_object()) {
            self.absorb_block(b, index);
        }
        self.absorb_blocks(v);
    }

    fn absorb_common(&mut self, v: &Value) {
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(u.clone());
        }
        set_nonempty(&mut self.id, v.get("id"));
        set_nonempty(&mut self.model, v.get("model"));
        set_nonempty(&mut self.stop_reason, v.get("stop_reason"));
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            self.error = Some(err.clone());
        }
    }

    fn absorb_message_part(&mut self, part: &Value) {
        if let Some(t) = part.get("content").and_then(Value::as_str) {
            self.text.push_str(t);
        }
        for k in ["reasoning_content", "reasoning"] {
            if let Some(t) = part.get(k).and_then(Value::as_str) {
                self.reasoning.push_str(t);
            }
        }
        if let Some(calls) = part.get("tool_calls").and_then(Value::as_array) {
            for c in calls {
                self.tool_fragment(c);
            }
        }
    }

    /// Anthropic non-streamed `content: [blocks]`.
    fn absorb_blocks(&mut self, v: &Value) {
        if let Some(blocks) = v.get("content").and_then(Value::as_array) {
            for b in blocks {
                self.absorb_block(b, None);
            }
        }
    }

    fn absorb_block(&mut self, b: &Value, index: Option<i64>) {
        match b.get("type").and_then(Value::as_str) {
            Some("tool_use") => {
                let mut call = serde_json::json!({
                    "id": b.get("id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {"name": b.get("name").cloned().unwrap_or(Value::Null)},
                });
                match b.get("input") {
                    Some(input) if input.as_object().is_some_and(|o| !o.is_empty()) => {
                        call["function"]["arguments"] = Value::String(input.to_string());
                    }
                    _ => {}
                }
                if let Some(i) = index {
                    call["index"] = i.into();
                }
                self.tool_fragment(&call);
            }
            _ => {
                if let Some(t) = b.get("text").and_then(Value::as_str) {
                    self.text.push_str(t);
                }
                if let Some(t) = b.get("thinking").and_then(Value::as_str) {
                    self.reasoning.push_str(t);
                }
            }
        }
    }

    fn tool_fragment(&mut self, frag: &Value) {
        let Some(f) = frag.as_object() else { return };
        let idx = match f.get("index").and_then(Value::as_i64) {
            Some(i) => i,
            None => {
                self.next_synthetic -= 1;
                self.next_synthetic
            }
        };
        let acc = self
            .tools
            .entry(idx)
            .or_insert_with(|| Value::Object(Map::new()));
        let Some(acc) = acc.as_object_mut() else {
            return;
        };
        for (k, v) in f {
            if k == "function" {
                let Some(fv) = v.as_object() else { continue };
                let af = acc
                    .entry("function")
                    .or_insert_with(|| Value::Object(Map::new()));
                let Some(af) = af.as_object_mut() else {
                    continue;
                };
                for (fk, fvv) in fv {
                    if fk == "arguments" {
                        if let Some(s) = fvv.as_str() {
                            let cur = af
                                .entry("arguments")
                                .or_insert_with(|| Value::String(String::new()));
                            if let Value::String(c) = cur {
                                c.push_str(s);
                            }
                        }
                    } else if !af.contains_key(fk) {
                        af.insert(fk.clone(), fvv.clone());
                    }
                }
            } else if !acc.contains_key(k) && !v.is_null() {
                acc.insert(k.clone(), v.clone());
            }
        }
    }

    /// The response text and the `resp_meta` object.
    fn into_parts(self) -> (String, Map<String, Value>) {
        let mut m = Map::new();
        let mut put = |k: &str, v: Option<String>| {
            if let Some(v) = v.filter(|s| !s.is_empty()) {
                m.insert(k.into(), Value::String(v));
            }
        };
        put("id", self.id);
        put("model", self.model);
        put("finish_reason", self.finish_reason);
        put("stop_reason", self.stop_reason);
        put("reasoning", Some(self.reasoning));
        if let Some(u) = self.usage {
            m.insert("usage".into(), u);
        }
        if let Some(e) = self.error {
            m.insert("error".into(), e);
        }
        if !self.tools.is_empty() {
            m.insert(
                "tool_calls".into(),
                Value::Array(self.tools.into_values().collect()),
            );
        }
        (self.text, m)
    }
}

fn set_nonempty(slot: &mut Option<String>, v: Option<&Value>) {
    if let Some(s) = v.and_then(Value::as_str).filter(|s| !s.is_empty()) {
        *slot = Some(s.to_string());
    }
}

/// UTC calendar fields of a Unix-ms instant: (year, month 1-12, day 1-31, hour, minute,
/// second, millisecond). Howard Hinnant's `civil_from_days`; no calendar crate needed.
pub fn utc_fields(ms: u64) -> (i64, u32, u32, u32, u32, u32, u32) {
    let secs = (ms / 1000) as i64;
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (
        y,
        m,
        d,
        (sod / 3600) as u32,
        (sod % 3600 / 60) as u32,
        (sod % 60) as u32,
        (ms % 1000) as u32,
    )
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn iso_utc(ms: u64) -> String {
    let (y, mo, d, h, mi, s, milli) = utc_fields(ms);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{milli:03}Z")
}

/// The hourly file of an instant, relative to the log directory: `YYYY-MM-DD/HH.jsonl`.
pub fn hour_path(ms: u64) -> (String, String) {
    let (y, mo, d, h, ..) = utc_fields(ms);
    (format!("{y:04}-{mo:02}-{d:02}"), format!("{h:02}.jsonl"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(a: &Assembled) -> Value {
        assert_eq!(a.line.last(), Some(&b'\n'));
        assert_eq!(a.line.iter().filter(|&&b| b == b'\n').count(), 1);
        serde_json::from_slice(&a.line).unwrap()
    }

    #[test]
    fn calendar_matches_known_instants() {
        assert_eq!(iso_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso_utc(1_715_000_000_123), "2024-05-06T12:53:20.123Z");
        assert_eq!(iso_utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(iso_utc(4_102_444_799_999), "2099-12-31T23:59:59.999Z");
        assert_eq!(
            hour_path(1_715_000_000_123),
            ("2024-05-06".into(), "12.jsonl".into())
        );
        // Every day boundary for 5 years lands on hour 0 and increments the day.
        let mut prev = utc_fields(1_600_000_000_000 / 86_400_000 * 86_400_000);
        for day in 1..(5 * 366) {
            let ms = (1_600_000_000_000 / 86_400_000 + day) * 86_400_000;
            let f = utc_fields(ms);
            assert_eq!((f.3, f.4, f.5), (0, 0, 0));
            assert!((f.0, f.1, f.2) > (prev.0, prev.1, prev.2));
            prev = f;
        }
    }

    #[test]
    fn openai_sse_is_reassembled() {
        let body = concat!(
            "data: {\"id\":\"c1\",\"model\":\"m\",\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"think \"}}]}\n\n",
            "data:{\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\r\n\r\n",
            "data: \t{\"choices\":[{\"delta\":{\"content\":\"lo\"},\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"t1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\"\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"zz\",\"function\":{\"arguments\":\":1}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            "data: not json\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5000,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":4096}}}\n\n",
            "data: [DONE]\n\n",
        );
        let rec = Record {
            meta: json!({"route": "r1", "owner": "team", "status": 200, "ts_ms": 1_715_000_000_000u64, "rt": 1.5, "first_chunk_t": 0.25}),
            request: br#"{"stream":true}"#.to_vec(),
            response: body.as_bytes().to_vec(),
        };
        let a = assemble(rec, Some("10.0.0.7"), 0);
        let v = parse(&a);
        assert_eq!(v["resp_body"], "Hello");
        assert_eq!(v["resp_format"], "sse");
        assert_eq!(v["resp_meta"]["reasoning"], "think ");
        assert_eq!(v["resp_meta"]["finish_reason"], "stop");
        assert_eq!(v["resp_meta"]["id"], "c1");
        assert_eq!(
            v["resp_meta"]["tool_calls"],
            json!([{"index": 0, "id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}])
        );
        assert_eq!(v["usage"]["prompt_tokens"], 5000);
        assert_eq!(v["source_addr"], "10.0.0.7");
        assert_eq!(v["req_body"], r#"{"stream":true}"#);
        assert_eq!(v["ts"], "2024-05-06T12:53:20.000Z");
        assert_eq!(v["ts_end"], "2024-05-06T12:53:21.500Z");
        assert_eq!(a.ts_ms, 1_715_000_000_000);
        assert_eq!(
            a.summary,
            Summary {
                route: "r1".into(),
                owner: "team".into(),
                status: 200,
                prompt_tokens: Some(5000),
                cached_tokens: Some(4096),
                completion_tokens: Some(2),
                ttft_s: Some(0.25),
            }
        );
    }

    #[test]
    fn anthropic_sse_is_reassembled() {
        let body = concat!(
            "event: message_start\n",
            "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"claude\",\"content\":[],\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n",
            "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n",
            "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hmm\"}}\n\n",
            "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi \"}}\n\n",
            "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\"there\"}}\n\n",
            "data: {\"type\":\"content_block_start\",\"index\":2,\"content_block\":{\"type\":\"tool_use\",\"id\":\"tu\",\"name\":\"get\",\"input\":{}}}\n\n",
            "data: {\"type\":\"content_block_delta\",\"index\":2,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"q\\\":\"}}\n\n",
            "data: {\"type\":\"content_block_delta\",\"index\":2,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"2}\"}}\n\n",
            "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":7}}\n\n",
            "data: {\"type\":\"message_stop\"}\n\n",
        );
        let rec = Record {
            meta: json!({"status": 200, "stream": false, "first_chunk_t": 0.1}),
            request: vec![],
            response: body.as_bytes().to_vec(),
        };
        let a = assemble(rec, None, 42);
        let v = parse(&a);
        assert_eq!(v["resp_body"], "Hi there");
        assert_eq!(v["resp_meta"]["reasoning"], "hmm");
        assert_eq!(v["resp_meta"]["stop_reason"], "end_turn");
        assert_eq!(v["resp_meta"]["model"], "claude");
        assert_eq!(
            v["resp_meta"]["tool_calls"][0]["function"],
            json!({"name": "get", "arguments": "{\"q\":2}"})
        );
        assert_eq!(v["usage"], json!({"output_tokens": 7}));
        assert_eq!(a.ts_ms, 42, "no ts_ms → the listener's clock");
        assert_eq!(a.summary.route, "unknown");
        assert_eq!(a.summary.owner, "-");
        assert_eq!(a.summary.ttft_s, None, "meta says not a stream");
    }

    #[test]
    fn json_completion_and_raw_fallbacks() {
        let body = br#"{"id":"x","model":"m","choices":[{"message":{"content":"four","reasoning_content":"2+2"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
        let rec = Record {
            meta: json!({"status": 200, "first_chunk_t": 0.5, "prompt_tokens": 9}),
            request: vec![0xff, b'a'],
            response: body.to_vec(),
        };
        let a = assemble(rec, None, 0);
        let v = parse(&a);
        assert_eq!(v["resp_body"], "four");
        assert_eq!(v["resp_format"], "json");
        assert_eq!(v["resp_meta"]["reasoning"], "2+2");
        assert_eq!(v["req_body"], "\u{fffd}a");
        assert_eq!(v["req_body_lossy"], true);
        assert_eq!(a.summary.prompt_tokens, Some(9), "meta wins over usage");
        assert_eq!(a.summary.completion_tokens, Some(1));
        assert_eq!(a.summary.ttft_s, None, "not a stream");

        // An error status keeps the raw body even when it is JSON with content.
        let rec = Record {
            meta: json!({"status": 500}),
            request: vec![],
            response: body.to_vec(),
        };
        let v = parse(&assemble(rec, None, 0));
        assert_eq!(v["resp_body"], String::from_utf8_lossy(body).as_ref());
        assert_eq!(v["resp_format"], "raw");
        assert!(v.get("resp_meta").is_none() && v.get("usage").is_none());

        // Nothing recognisable → raw, lossy flagged.
        let rec = Record {
            meta: json!({"status": 200}),
            request: vec![],
            response: b"plain \xfe text".to_vec(),
        };
        let v = parse(&assemble(rec, None, 0));
        assert_eq!(v["resp_format"], "raw");
        assert_eq!(v["resp_body_lossy"], true);
    }

    #[test]
    fn truncated_sse_still_reassembles_what_is_left() {
        let mut body = Vec::new();
        for i in 0..10 {
            body.extend_from_slice(
                format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{i}\"}}}}]}}\n\n")
                    .as_bytes(),
            );
        }
        let cut = body.len() / 2 + 3;
        let mut b = body[..cut].to_vec();
        b.extend_from_slice(b"\n[BODYLOG_TRUNCATED 9 BYTES MISSING IN MIDDLE]\n");
        b.extend_from_slice(&body[cut + 9..]);
        let rec = Record {
            meta: json!({}),
            request: vec![],
            response: b,
        };
        let v = parse(&assemble(rec, None, 0));
        let s = v["resp_body"].as_str().unwrap();
        assert!(s.starts_with("0123") && s.ends_with("789"), "{s}");
    }
}
