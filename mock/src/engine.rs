//! Request dispatch and the simulated inference engine.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/messages`
//! (answered like chat), `GET /v1/models`, `GET /health`, `GET /_stats`,
//! `GET /_echo_headers`.
//!
//! Per-request overrides (request headers, precedence over the config):
//! - `x-mock-status: N` (200..=599): answer with this status and an OpenAI-shaped JSON error
//!   (204/304: empty; other 2xx: normal processing). Applies to completions, `/health` and
//!   `/v1/models`. A hang (`x-mock-hang-ms` / `hang_ms`) is waited before it.
//! - `x-mock-ttft-ms: N`: TTFT is exactly N ms (no base, cache cost or slow start).
//! - `x-mock-hang-ms: N`: silent wait before the response head.
//! - `x-mock-tokens: N`: completion tokens.
//! - `x-mock-interval-ms: N`: gap between generated tokens (instead of `decode_tps`).
//! - `x-mock-close-after: N`: close the connection after N SSE events.
//! - `x-mock-echo: 1`: any method/path: 200 `application/octet-stream` with the exact request
//!   body, and header `x-mock-echo-headers` = the request headers as a JSON array of
//!   `[name, value]` pairs (ASCII only).
//! - `x-mock-no-length: 1`: non-stream responses carry no Content-Length and are delimited by
//!   closing the connection.
//!
//! Timing: the stream head is written after the hang; the first token after hang + TTFT;
//! token `i` at first-token time + `i` × interval. Non-stream: the response after
//! hang + TTFT + tokens × interval. During every wait the socket is watched and a client that
//! closes is recorded at once as [`crate::MockEvent::ClientGone`].

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::cache::block_hashes;
use crate::conn::{write_all, Rd, Watch, Wr};
use crate::http::{self, Head, RespLen};
use crate::{bump, MockConfig, MockEvent, Shared};

/// Cap on completion tokens of one request.
pub const MAX_COMPLETION_TOKENS: u32 = 1_000_000;
/// Poll period while queued for a concurrency slot (`busy_429 = false`).
const QUEUE_POLL: Duration = Duration::from_millis(2);
/// Cap on any single simulated wait (keeps `Instant` arithmetic far from overflow).
const MAX_WAIT: Duration = Duration::from_secs(7 * 86_400);

/// Per-request overrides taken from `x-mock-*` headers.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Overrides {
    pub status: Option<u16>,
    pub ttft_ms: Option<u64>,
    pub hang_ms: Option<u64>,
    pub tokens: Option<u32>,
    pub interval_ms: Option<u64>,
    pub close_after: Option<u32>,
    pub echo: bool,
    pub no_length: bool,
}

fn flag(head: &Head, name: &str) -> bool {
    matches!(head.header_str(name), Some(v) if v == "1" || v.eq_ignore_ascii_case("true"))
}

impl Overrides {
    /// Parse the override headers; an unparsable value is an error naming the header.
    pub fn from_head(head: &Head) -> Result<Overrides, String> {
        fn num<T: std::str::FromStr>(head: &Head, name: &str) -> Result<Option<T>, String> {
            match head.header(name) {
                None => Ok(None),
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .map(Some)
                    .ok_or_else(|| format!("invalid {name} header")),
            }
        }
        let status: Option<u16> = num(head, "x-mock-status")?;
        if status.is_some_and(|s| !(200..=599).contains(&s)) {
            return Err("x-mock-status must be within 200..=599".into());
        }
        Ok(Overrides {
            status,
            ttft_ms: num(head, "x-mock-ttft-ms")?,
            hang_ms: num(head, "x-mock-hang-ms")?,
            tokens: num(head, "x-mock-tokens")?,
            interval_ms: num(head, "x-mock-interval-ms")?,
            close_after: num(head, "x-mock-close-after")?,
            echo: flag(head, "x-mock-echo"),
            no_length: flag(head, "x-mock-no-length"),
        })
    }
}

/// Error `type` of an OpenAI-shaped error body for a status.
fn error_kind(status: u16) -> &'static str {
    match status {
        400 | 405 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        500..=599 => "server_error",
        _ => "mock_error",
    }
}

/// Everything a handler needs to answer.
struct Ctx<'a> {
    shared: &'a Shared,
    cfg: &'a MockConfig,
    head_only: bool,
    close: bool,
}

impl Ctx<'_> {
    /// Write a complete response with a Content-Length (or without one, delimited by close,
    /// when `no_length`). Returns whether the connection stays open.
    async fn respond(
        &self,
        wr: &mut Wr,
        status: u16,
        content_type: &str,
        body: Vec<u8>,
        extra: &[(&str, &str)],
        no_length: bool,
    ) -> bool {
        let empty = status == 204 || status == 304;
        let (len, close) = if empty {
            (RespLen::None, self.close)
        } else if no_length {
            (RespLen::None, true)
        } else {
            (RespLen::Length(body.len()), self.close)
        };
        let ct = (!empty).then_some(content_type);
        let mut out = http::response_head(status, &self.cfg.name, ct, len, close, extra);
        if !self.head_only && !empty {
            out.extend_from_slice(&body);
        }
        write_all(wr, out).await.is_ok() && !close
    }

    async fn error(&self, wr: &mut Wr, status: u16, kind: &str, message: &str) -> bool {
        let body = http::error_body(status, kind, message);
        self.respond(wr, status, "application/json", body, &[], false)
            .await
    }

    async fn json(&self, wr: &mut Wr, status: u16, v: &Value) -> bool {
        self.respond(
            wr,
            status,
            "application/json",
            v.to_string().into_bytes(),
            &[],
            false,
        )
        .await
    }
}

/// Answer one request. Returns whether the connection may serve another request.
pub(crate) async fn handle(
    head: &Head,
    body: Vec<u8>,
    rd: &mut Rd,
    wr: &mut Wr,
    pending: &mut Vec<u8>,
    shared: &Shared,
) -> bool {
    let cfg = shared.config();
    let ctx = Ctx {
        shared,
        cfg: &cfg,
        head_only: head.method == "HEAD",
        close: !head.keep_alive(),
    };
    let ov = match Overrides::from_head(head) {
        Ok(o) => o,
        Err(msg) => return ctx.error(wr, 400, "invalid_request_error", &msg).await,
    };
    if ov.echo {
        let hj = head.headers_json();
        let ct = "application/octet-stream";
        return ctx
            .respond(
                wr,
                200,
                ct,
                body,
                &[("x-mock-echo-headers", &hj)],
                ov.no_length,
            )
            .await;
    }
    let get = head.method == "GET" || head.method == "HEAD";
    match head.path.as_str() {
        "/health" | "/v1/models" if get => {
            if let Some(st) = ov.status.filter(|s| !(200..300).contains(s) || *s == 204) {
                return ctx.error(wr, st, error_kind(st), "x-mock-status").await;
            }
            if head.path == "/health" {
                if let Some(st) = cfg.health_status.filter(|s| *s != 200) {
                    return ctx.error(wr, st, error_kind(st), "health_status").await;
                }
                return ctx
                    .json(wr, 200, &serde_json::json!({"status": "ok"}))
                    .await;
            }
            let data: Vec<Value> = cfg
                .models
                .iter()
                .map(|m| {
                    serde_json::json!({"id": m, "object": "model", "created": 0, "owned_by": cfg.name})
                })
                .collect();
            ctx.json(
                wr,
                200,
                &serde_json::json!({"object": "list", "data": data}),
            )
            .await
        }
        "/_stats" if get => {
            let v = serde_json::to_value(shared.snapshot()).unwrap_or(Value::Null);
            ctx.json(wr, 200, &v).await
        }
        "/_echo_headers" if get => {
            let hj = head.headers_json().into_bytes();
            ctx.respond(wr, 200, "application/json", hj, &[], false)
                .await
        }
        "/v1/chat/completions" | "/v1/messages" | "/v1/completions" if head.method == "POST" => {
            let chat = head.path != "/v1/completions";
            completion(&ctx, &ov, chat, &body, rd, wr, pending).await
        }
        "/health"
        | "/v1/models"
        | "/_stats"
        | "/_echo_headers"
        | "/v1/chat/completions"
        | "/v1/messages"
        | "/v1/completions" => {
            ctx.error(wr, 405, "invalid_request_error", "method not allowed")
                .await
        }
        _ => {
            ctx.error(wr, 404, "not_found_error", "no such endpoint")
                .await
        }
    }
}

/// The prompt text of a request body: chat `messages[].content` (string or text parts, plus
/// an Anthropic-style `system`), or `prompt` (string, array of strings or token ids).
pub fn prompt_text(body: &Value) -> String {
    fn push_content(out: &mut String, c: &Value) {
        match c {
            Value::String(s) => {
                out.push_str(s);
                out.push('\n');
            }
            Value::Array(parts) => {
                for p in parts {
                    match p {
                        Value::String(s) => {
                            out.push_str(s);
                            out.push('\n');
                        }
                        Value::Object(o) => {
                            if let Some(Value::String(t)) = o.get("text") {
                                out.push_str(t);
                                out.push('\n');
                            }
                        }
                        Value::Number(n) => {
                            out.push_str(&format!("#{n} "));
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    let mut out = String::new();
    if let Some(s) = body.get("system") {
        push_content(&mut out, s);
    }
    if let Some(Value::Array(msgs)) = body.get("messages") {
        for m in msgs {
            if let Some(c) = m.get("content") {
                push_content(&mut out, c);
            }
        }
    }
    if let Some(p) = body.get("prompt") {
        push_content(&mut out, p);
    }
    out
}

/// Completion tokens asked for by the body, if any.
fn body_max_tokens(body: &Value) -> Option<u32> {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| body.get(*k).and_then(Value::as_u64))
        .map(|n| n.min(u64::from(MAX_COMPLETION_TOKENS)) as u32)
}

/// Extra TTFT of the slow-start window: decays linearly from `slow_start_ms` to 0.
fn slow_start_extra(cfg: &MockConfig, started: Instant) -> Duration {
    let window = Duration::from_millis(cfg.slow_start_ms);
    let elapsed = started.elapsed();
    if elapsed >= window {
        return Duration::ZERO;
    }
    window.mul_f64(1.0 - elapsed.as_secs_f64() / window.as_secs_f64())
}

/// Releases a concurrency slot on drop.
struct ActiveGuard<'a>(&'a Shared);

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.stats.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request's place in the admission queue (`busy_429 = false`). Waiting requests are served
/// first come, first served, as an engine's scheduler does (vLLM's default policy is `fcfs`):
/// a slot that frees goes to the oldest waiter, never to a newcomer or a waiter that happened
/// to poll first. Leaves the queue when dropped (served, or its client gone).
struct Ticket<'a> {
    shared: &'a Shared,
    id: u64,
}

impl<'a> Ticket<'a> {
    /// A slot, if this ticket is the oldest in the queue and one is free.
    fn take(&self, max: u32) -> Option<ActiveGuard<'a>> {
        let mut q = self.shared.queue();
        if q.front() != Some(&self.id) {
            return None;
        }
        let g = try_acquire(self.shared, max)?;
        q.pop_front();
        Some(g)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut q = self.shared.queue();
        if let Some(at) = q.iter().position(|&t| t == self.id) {
            q.remove(at);
        }
    }
}

/// A slot at once when nobody is waiting and one is free; otherwise a place at the back of
/// the queue.
fn admit_or_queue(shared: &Shared, max: u32) -> Result<ActiveGuard<'_>, Ticket<'_>> {
    let mut q = shared.queue();
    if q.is_empty() {
        if let Some(g) = try_acquire(shared, max) {
            return Ok(g);
        }
    }
    let id = shared.ticket();
    q.push_back(id);
    Err(Ticket { shared, id })
}

/// Take a slot if below `max` (0 = unlimited).
fn try_acquire(shared: &Shared, max: u32) -> Option<ActiveGuard<'_>> {
    let active = &shared.stats.active;
    let now = if max == 0 {
        active.fetch_add(1, Ordering::SeqCst) + 1
    } else {
        let prev = active
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |a| {
                (a < u64::from(max)).then_some(a + 1)
            })
            .ok()?;
        prev + 1
    };
    shared.stats.max_active.fetch_max(now, Ordering::Relaxed);
    Some(ActiveGuard(shared))
}

fn usage_json(prompt: u64, completion: u64, cached: u64) -> String {
    format!(
        "{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion},\"total_tokens\":{},\"prompt_tokens_details\":{{\"cached_tokens\":{cached}}}}}",
        prompt + completion
    )
}

fn token_text(i: u32) -> String {
    if i == 0 {
        "tok0".to_string()
    } else {
        format!(" tok{i}")
    }
}

#[allow(clippy::too_many_arguments)]
async fn completion(
    ctx: &Ctx<'_>,
    ov: &Overrides,
    chat: bool,
    body: &[u8],
    rd: &mut Rd,
    wr: &mut Wr,
    pending: &mut Vec<u8>,
) -> bool {
    let shared = ctx.shared;
    let cfg = ctx.cfg;
    let arrived = Instant::now();
    bump(&shared.stats.requests, 1);
    let hang = Duration::from_millis(ov.hang_ms.unwrap_or(cfg.hang_ms)).min(MAX_WAIT);
    let mut watch = Watch::new(rd, shared);

    // Failure knobs.
    let fail = match ov.status {
        Some(s) if (200..300).contains(&s) && s != 204 => None,
        Some(s) => Some(s),
        None => cfg.fail_status,
    };
    if let Some(st) = fail {
        if watch.sleep_until(arrived + hang, pending, "prefill").await {
            return false;
        }
        let alive = watch.finish(pending).await;
        shared.event(MockEvent::Failed {
            at: Instant::now(),
            status: st,
        });
        let msg = format!("mock failure (status {st})");
        return ctx.error(wr, st, error_kind(st), &msg).await && alive;
    }

    let req: Value = match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            let alive = watch.finish(pending).await;
            let msg = "request body must be a JSON object";
            return ctx.error(wr, 400, "invalid_request_error", msg).await && alive;
        }
    };

    // Admission.
    let first = if cfg.busy_429 {
        try_acquire(shared, cfg.max_concurrency).ok_or(None)
    } else {
        admit_or_queue(shared, cfg.max_concurrency).map_err(Some)
    };
    let slot = match first {
        Ok(g) => g,
        Err(None) => {
            bump(&shared.stats.rejected_busy, 1);
            shared.event(MockEvent::RejectedBusy { at: Instant::now() });
            let alive = watch.finish(pending).await;
            let msg = format!("busy: {} requests active", cfg.max_concurrency);
            return ctx.error(wr, 429, "busy", &msg).await && alive;
        }
        Err(Some(ticket)) => loop {
            if watch
                .sleep_until(Instant::now() + QUEUE_POLL, pending, "queue")
                .await
            {
                return false; // the ticket leaves the queue on drop
            }
            if let Some(g) = ticket.take(cfg.max_concurrency) {
                break g;
            }
        },
    };
    // Service (hang, prefill, decode) starts when the request has its slot: a queued
    // request's wait comes before its prefill, as on an engine, not in parallel with it.
    let t0 = Instant::now();

    // Prompt, prefix cache, timing.
    let model = req
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| cfg.models.first().cloned())
        .unwrap_or_else(|| "mock-model".to_string());
    let text = prompt_text(&req);
    let tokens: Vec<&str> = text.split_whitespace().collect();
    let n_prompt = tokens.len() as u64;
    let caching = cfg.cache_capacity_tokens > 0 && cfg.block_tokens > 0;
    let hashes = if caching {
        block_hashes(&model, &tokens, cfg.block_tokens)
    } else {
        Vec::new()
    };
    let cached = if caching {
        shared.cache().leading_hits(&hashes) as u64 * u64::from(cfg.block_tokens)
    } else {
        0
    };
    bump(&shared.stats.prompt_tokens, n_prompt);
    bump(&shared.stats.cached_tokens, cached);
    let ttft = match ov.ttft_ms {
        Some(ms) => Duration::from_millis(ms),
        None => {
            let uncached = n_prompt - cached;
            Duration::from_millis(cfg.ttft_base_ms)
                + Duration::from_micros(uncached.saturating_mul(cfg.ttft_per_uncached_token_us))
                + slow_start_extra(cfg, shared.started)
        }
    }
    .min(MAX_WAIT);
    let n_out = ov
        .tokens
        .or_else(|| body_max_tokens(&req))
        .unwrap_or(cfg.max_tokens_default)
        .min(MAX_COMPLETION_TOKENS);
    let interval = match ov.interval_ms {
        Some(ms) => Duration::from_millis(ms),
        None if cfg.decode_tps.is_finite() && cfg.decode_tps > 0.0 => {
            Duration::from_secs_f64((1.0 / cfg.decode_tps).min(3600.0))
        }
        None => Duration::ZERO,
    }
    .min(MAX_WAIT);
    let gen_time = |n: u32| interval.checked_mul(n).unwrap_or(MAX_WAIT).min(MAX_WAIT);
    let stream = req.get("stream").and_then(Value::as_bool) == Some(true);
    let include_usage = req
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true);
    let seq = shared.seq.fetch_add(1, Ordering::Relaxed);
    let id = format!("{}-mock-{seq}", if chat { "chatcmpl" } else { "cmpl" });
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let model_json = serde_json::to_string(&model).unwrap_or_else(|_| "\"\"".into());
    let object = match (chat, stream) {
        (true, true) => "chat.completion.chunk",
        (true, false) => "chat.completion",
        (false, _) => "text_completion",
    };
    let prefix = format!(
        "{{\"id\":\"{id}\",\"object\":\"{object}\",\"created\":{created},\"model\":{model_json},"
    );
    let insert_blocks = || {
        if caching {
            let cap = (cfg.cache_capacity_tokens / u64::from(cfg.block_tokens)) as usize;
            shared.cache().insert(&hashes, cap);
        }
    };
    let first_token_at = t0 + hang + ttft;

    if !stream {
        if watch.sleep_until(first_token_at, pending, "prefill").await {
            return false;
        }
        insert_blocks();
        let done_at = Instant::now() + gen_time(n_out);
        if watch.sleep_until(done_at, pending, "decode").await {
            return false;
        }
        let alive = watch.finish(pending).await;
        let text: String = (0..n_out).map(token_text).collect();
        let choice = if chat {
            format!(
                "{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{text}\"}},\"finish_reason\":\"stop\"}}"
            )
        } else {
            format!(
                "{{\"index\":0,\"text\":\"{text}\",\"logprobs\":null,\"finish_reason\":\"stop\"}}"
            )
        };
        let usage = usage_json(n_prompt, u64::from(n_out), cached);
        let out = format!("{prefix}\"choices\":[{choice}],\"usage\":{usage}}}");
        bump(&shared.stats.completion_tokens, u64::from(n_out));
        // Account before the last byte goes out, so a client that has the whole response
        // also sees it in the stats.
        drop(slot);
        finished(shared, n_prompt, cached, u64::from(n_out));
        let ok = ctx
            .respond(
                wr,
                200,
                "application/json",
                out.into_bytes(),
                &[],
                ov.no_length,
            )
            .await;
        return ok && alive;
    }

    // Streaming: silent hang, head, TTFT, then one HTTP chunk per SSE event.
    if watch.sleep_until(t0 + hang, pending, "prefill").await {
        return false;
    }
    let head = http::response_head(
        200,
        &cfg.name,
        Some("text/event-stream"),
        RespLen::Chunked,
        ctx.close,
        &[("cache-control", "no-cache")],
    );
    if write_all(wr, head).await.is_err() {
        watch.gone("prefill");
        return false;
    }
    if watch.sleep_until(first_token_at, pending, "prefill").await {
        return false;
    }
    insert_blocks();
    let close_after = ov.close_after.or(cfg.close_after_events);
    let mut events = 0u32;
    let mut sent_tokens = 0u64;
    let choice_end = if chat {
        ",\"finish_reason\":null}]}"
    } else {
        ",\"logprobs\":null,\"finish_reason\":null}]}"
    };
    // Yields Err(()) when the stream must end now (closed on purpose or client gone).
    macro_rules! emit {
        ($data:expr) => {{
            if close_after == Some(events) {
                shared.event(MockEvent::ClosedMidStream {
                    at: Instant::now(),
                    events,
                });
                bump(&shared.stats.mid_stream_closes, 1);
                Err(())
            } else if write_all(wr, $data).await.is_err() {
                watch.gone("stream");
                Err(())
            } else {
                events += 1;
                Ok(())
            }
        }};
    }
    let mut ended = false;
    for i in 0..n_out {
        if i > 0
            && watch
                .sleep_until(first_token_at + gen_time(i), pending, "stream")
                .await
        {
            ended = true;
            break;
        }
        let tok = token_text(i);
        let body = if chat {
            let role = if i == 0 {
                "\"role\":\"assistant\","
            } else {
                ""
            };
            format!("{prefix}\"choices\":[{{\"index\":0,\"delta\":{{{role}\"content\":\"{tok}\"}}{choice_end}")
        } else {
            format!("{prefix}\"choices\":[{{\"index\":0,\"text\":\"{tok}\"{choice_end}")
        };
        if emit!(sse(&body)).is_err() {
            ended = true;
            break;
        }
        sent_tokens += 1;
    }
    bump(&shared.stats.completion_tokens, sent_tokens);
    if !ended {
        let fin = if chat {
            format!(
                "{prefix}\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"stop\"}}]}}"
            )
        } else {
            format!("{prefix}\"choices\":[{{\"index\":0,\"text\":\"\",\"logprobs\":null,\"finish_reason\":\"stop\"}}]}}")
        };
        ended = emit!(sse(&fin)).is_err();
    }
    if !ended && include_usage {
        let usage = usage_json(n_prompt, sent_tokens, cached);
        let u = format!("{prefix}\"choices\":[],\"usage\":{usage}}}");
        ended = emit!(sse(&u)).is_err();
    }
    if !ended {
        ended = emit!(http::chunk(b"data: [DONE]\n\n")).is_err();
    }
    if !ended {
        // The terminating chunk is not an event, but a close-after equal to the number of
        // events still cuts the body before it.
        if close_after == Some(events) {
            shared.event(MockEvent::ClosedMidStream {
                at: Instant::now(),
                events,
            });
            bump(&shared.stats.mid_stream_closes, 1);
            ended = true;
        } else {
            drop(slot);
            finished(shared, n_prompt, cached, sent_tokens);
            if write_all(wr, b"0\r\n\r\n".to_vec()).await.is_err() {
                watch.gone("stream");
                ended = true;
            }
        }
    }
    let alive = watch.finish(pending).await;
    !ended && alive && !ctx.close
}

/// One SSE event as one HTTP chunk.
fn sse(json: &str) -> Vec<u8> {
    let mut ev = Vec::with_capacity(json.len() + 8);
    ev.extend_from_slice(b"data: ");
    ev.extend_from_slice(json.as_bytes());
    ev.extend_from_slice(b"\n\n");
    http::chunk(&ev)
}

fn finished(shared: &Shared, prompt: u64, cached: u64, completion: u64) {
    bump(&shared.stats.completions, 1);
    shared.event(MockEvent::Completed {
        at: Instant::now(),
        prompt_tokens: prompt,
        cached_tokens: cached,
        completion_tokens: completion,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_extraction() {
        let v: Value = serde_json::from_str(
            r#"{"messages":[{"role":"system","content":"a b"},{"role":"user","content":[{"type":"text","text":"c d"},{"type":"image_url","image_url":{}}]}]}"#,
        )
        .unwrap();
        assert_eq!(prompt_text(&v).split_whitespace().count(), 4);
        let v: Value = serde_json::from_str(r#"{"prompt":["x y","z"]}"#).unwrap();
        assert_eq!(prompt_text(&v).split_whitespace().count(), 3);
        let v: Value = serde_json::from_str(r#"{"prompt":"hello"}"#).unwrap();
        assert_eq!(prompt_text(&v).trim(), "hello");
        let v: Value = serde_json::from_str(r#"{"max_tokens":7}"#).unwrap();
        assert_eq!(body_max_tokens(&v), Some(7));
        let v: Value =
            serde_json::from_str(r#"{"max_completion_tokens":9,"max_tokens":7}"#).unwrap();
        assert_eq!(body_max_tokens(&v), Some(9));
    }

    #[test]
    fn slow_start_decays() {
        let cfg = MockConfig {
            slow_start_ms: 1000,
            ..MockConfig::default()
        };
        let d = slow_start_extra(&cfg, Instant::now());
        assert!(d > Duration::from_millis(900) && d <= Duration::from_millis(1000));
        let cfg0 = MockConfig::default();
        assert_eq!(slow_start_extra(&cfg0, Instant::now()), Duration::ZERO);
    }
}
