//! Body logging: per-request meta plus request and response bodies, shipped from each worker
//! to a separate listener process that writes hourly JSONL files and serves `/metrics`
//! (SPEC §9, notes-edges §3).
//!
//! Pieces, in the order a record travels:
//! * [`capture`] (pure): the request path feeds a [`capture::Capture`] with the client's body
//!   and the response chunks; it keeps bounded copies (request ≤ [`REQ_BODY_MAX_BYTES`],
//!   response head [`RESP_HEAD_MAX_BYTES`] + tail [`RESP_TAIL_MAX_BYTES`]) and turns them into
//!   a [`frame::Record`] with the meta object. Also header scrubbing and the sampling decision.
//! * [`frame`] (pure): the big-endian length-prefixed binary frame (notes §3.4) with checked
//!   lengths on both sides.
//! * [`sender`] (IO, one per worker, single-thread): a bounded queue that never blocks the
//!   request path, drained by one monoio task over one persistent TCP connection with
//!   reconnect and backoff.
//! * [`assemble`] (pure): frame → one JSON line (SSE content reassembled, usage extracted).
//! * [`listener`] (IO, its own process: `warmroute bodylog-listen`): accepts router
//!   connections, writes `DIR/YYYY-MM-DD/HH.jsonl`, serves Prometheus `/metrics`.
//!
//! # Which requests get a record
//! Every request on a route that body-logs it (toggle, sampling) once its key is checked and
//! its body read: those a peer answered, and those the router answered itself from there on
//! (a reject rule's 4xx, `model_not_supported`, 503, the 429 gates, a 502/504 after a peer
//! was tried, a client gone before the answer), with the router's answer as the response.
//! As in the reference, a 401, a 413 or a body that could not be read give no record (the
//! decision comes after them), nor does a request no route took (404, an unknown model on a
//! bare `/v1` path).
//!
//! # Meta fields (a JSON object; absent values are omitted, never null)
//! Filled by the request path; the listener copies every field into the JSONL record.
//!
//! | field | type | meaning |
//! |---|---|---|
//! | `ts_ms` | u64 | request start, Unix milliseconds (picks the hourly file; `ts` is derived from it when absent) |
//! | `ts` | string | request start as text (optional; the listener writes `YYYY-MM-DDTHH:MM:SS.mmmZ` from `ts_ms` if absent) |
//! | `request_id` | string | 32 hex |
//! | `route` | string | route name (a `/metrics` label) |
//! | `owner` | string | API-key owner, `-` when none (a `/metrics` label) |
//! | `client_ip` | string | client address |
//! | `method`, `uri` | string | request line (uri with query) |
//! | `req_headers` | object | scrubbed headers ([`capture::scrub_headers`]); repeated names become arrays |
//! | `req_body_truncated` | bool | set by [`capture::Capture::finish`] |
//! | `peer` | string | chosen `ip:port`, `ip:port (retry#N)` after a retry; absent if never routed |
//! | `forwarded_to` | string | upstream `X-Routed-Peer` response header |
//! | `session_id` | string | absent if none, or refused before it is read (a reject rule, `model_not_supported`; `session_src` is then `none`, as in the access line) |
//! | `session_src` | string | e.g. `header.x-session-id`, `body.metadata.session_id`, `none`, `affinity_off` |
//! | `peer_name` | string | the chosen peer's name; absent if never routed |
//! | `mode` | string | `hash` / `least_conn` / `hash_fallback` (`…\|4xx_to_501(orig=N)` on that path); absent if never routed |
//! | `model` | string | requested model, when known |
//! | `stream` | bool | the request asked for a stream, when known (TTFT is only recorded for streams) |
//! | `status` | u16 | status sent to the client |
//! | `chunk_count`, `resp_body_truncated` | u64/bool | set by [`capture::Capture::finish`] (over the peer's body as it arrived) |
//! | `resp_bytes` | u64 | body bytes the client received (the access log's `response_bytes`): without an injected usage frame the router removed, after post-processing; the recorded response body is the peer's, as it arrived |
//! | `first_chunk_t`, `last_chunk_t`, `rt` | f64 seconds, ms precision | first body chunk (TTFT), end of body, whole request |
//! | `prompt_tokens`, `cached_tokens`, `completion_tokens` | u64 | the router's own token counts, when it measured them; the listener falls back to the response's usage |
//!
//! Meta must encode to ≤ 65,535 bytes (the u16 length): [`sender::Sender::try_send`] first drops
//! `req_headers` (setting `req_headers_dropped: true`) and then gives up (`encode_errors`).

pub mod assemble;
pub mod capture;
pub mod frame;
pub mod listener;
pub mod sender;

/// Request body bytes kept per record. The reference moved from 2 MiB to 10 MiB; 2 MiB keeps a
/// full per-worker queue (1,024 frames) well inside its 64 MiB byte bound for typical bodies.
pub const REQ_BODY_MAX_BYTES: usize = 2 * 1024 * 1024;
/// First response bytes kept (reference: 1.5 MiB "head").
pub const RESP_HEAD_MAX_BYTES: usize = 1_572_864;
/// Last response bytes kept once the head is full (reference: 512 KiB ring).
pub const RESP_TAIL_MAX_BYTES: usize = 524_288;
/// Room for the `[BODYLOG_TRUNCATED N BYTES MISSING IN MIDDLE]` marker between head and tail.
pub const RESP_MARKER_MAX_BYTES: usize = 64;
/// Largest response field a frame may carry.
pub const RESP_BODY_MAX_BYTES: usize =
    RESP_HEAD_MAX_BYTES + RESP_TAIL_MAX_BYTES + RESP_MARKER_MAX_BYTES;
/// Largest meta JSON (u16 length field).
pub const META_MAX_BYTES: usize = u16::MAX as usize;
/// Largest `total_len` a frame may declare: what the fields above add up to. The decoder
/// rejects anything larger before allocating for it (the reference allows 64 MiB).
pub const FRAME_MAX_BYTES: usize =
    2 + META_MAX_BYTES + 4 + REQ_BODY_MAX_BYTES + 4 + RESP_BODY_MAX_BYTES;
/// Per-worker queue bound, frames.
pub const QUEUE_FRAMES_MAX: usize = 1024;
/// Per-worker queue bound, encoded bytes.
pub const QUEUE_BYTES_MAX: usize = 64 * 1024 * 1024;
