//! Relay: stream the response body to the client as it arrives — one client write per
//! upstream read, never batched, so SSE events keep their timing — while tracking the
//! body's framing to know when it ends and whether the connection can be reused.

use std::time::{Duration, Instant};

use monoio::buf::{IoBuf, IoBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

use crate::http::{ChunkedDecoder, ResponseFraming};
use crate::limits::RELAY_READ_BUF_BYTES;
use crate::transform::UsageFrameFilter;

use monoio::io::OwnedWriteHalf;

use super::client::{
    race_until_drained, write_client, ClientWatch, DrainWatch, Stopped, DRAIN_LISTEN_AFTER,
};
use crate::worker::Spares;

/// How the relay ended.
#[derive(Debug)]
pub enum RelayEnd {
    /// The whole body reached the client. `reusable`: the upstream connection is clean.
    Done { reusable: bool },
    /// The client went away; the upstream connection is dropped (closed).
    ClientGone,
    /// The peer failed mid-body (closed early, timed out, broke framing). The client
    /// connection must close, since its response is truncated.
    UpstreamError(&'static str),
    /// The router's drain deadline came first: the response is cut (and logged so).
    Shutdown,
}

impl RelayEnd {
    /// How the response ended, as the access log's `end` field says it.
    pub fn name(&self) -> &'static str {
        match self {
            RelayEnd::Done { .. } => END_COMPLETE,
            RelayEnd::ClientGone => END_CLIENT_GONE,
            RelayEnd::UpstreamError(_) => END_PEER_CUT,
            RelayEnd::Shutdown => END_SHUTDOWN,
        }
    }
}

/// The access log's `end` values: the response reached its end (the router's own error
/// replies included), the client went away first, or the peer cut the body short.
pub const END_COMPLETE: &str = "complete";
pub const END_CLIENT_GONE: &str = "client_gone";
pub const END_PEER_CUT: &str = "peer_cut";
/// Cut by the router itself at the end of a drain (`drain_timeout_s`, SIGINT's 5 s).
pub const END_SHUTDOWN: &str = "shutdown";

/// What the relay measured.
#[derive(Debug, Default)]
pub struct RelayStats {
    /// Body bytes the client received, without the framing: what the response filters made
    /// of the peer's body (an injected usage frame removed, post-processing), or the peer's
    /// body as it is when no filter runs (the access log's `response_bytes`).
    pub body_bytes: u64,
    /// First non-empty body bytes, for TTFT.
    pub first_body_at: Option<Instant>,
    /// The last bytes of the (de-chunked) body, where the usage arrives. `None`: not kept,
    /// as the usage-frame filter reads the usage as the events pass (`FilterChain::seen_usage`).
    pub tail: Option<Tail>,
    /// Tokens the response reported (filled by the caller from the usage-frame filter, or
    /// else from `tail`).
    pub usage: Option<crate::transform::Usage>,
    /// The body-log copy of the response, when this request is body-logged.
    pub capture: Option<Box<crate::bodylog::capture::Capture>>,
    /// When the last body bytes arrived.
    pub last_body_at: Option<Instant>,
}

impl RelayStats {
    /// Record decoded body bytes as they pass.
    fn body(&mut self, d: &[u8]) {
        if let Some(t) = self.tail.as_mut() {
            t.push(d);
        }
        if let Some(c) = self.capture.as_mut() {
            c.push_response(d);
        }
    }
}

/// The read buffer of a relay whose reads have been small, e.g. an SSE stream.
const SMALL_READ_BUF_BYTES: usize = 2048;
/// Small reads in a row before the relay switches to the small buffer.
const SMALL_READS_TO_SHRINK: u32 = 4;

/// The read buffer size after `small_reads` small reads in a row.
fn read_buf_bytes(small_reads: u32) -> usize {
    if small_reads >= SMALL_READS_TO_SHRINK {
        SMALL_READ_BUF_BYTES
    } else {
        RELAY_READ_BUF_BYTES
    }
}

/// The small-read streak after a read of `n` bytes into a `cap`-byte buffer: a read that
/// filled its buffer or took more than half the small buffer ends it.
fn count_small_read(streak: u32, n: usize, cap: usize) -> u32 {
    if n == cap || n > SMALL_READ_BUF_BYTES / 2 {
        0
    } else {
        streak.saturating_add(1)
    }
}

/// The last `TAIL_BYTES` bytes of a body, kept as it streams past; for a JSON body also
/// the last `"usage"` key that has left them, with what followed it.
#[derive(Debug, Default, Clone)]
pub struct Tail {
    buf: Vec<u8>,
    /// For a JSON body (`Some`; an event stream's is `None`): the last `"usage"` key that
    /// left `buf` and up to [`EARLY_USAGE_BYTES`] after it. vLLM writes its `usage` before
    /// `prompt_logprobs` and `prompt_token_ids`, which can be megabytes.
    early: Option<Vec<u8>>,
}

/// Enough for a final usage frame (and `[DONE]`) or a JSON body's closing `usage`.
pub const TAIL_BYTES: usize = 2048;
/// How much of a JSON body is kept from a `"usage"` key that has left the tail.
pub const EARLY_USAGE_BYTES: usize = 1024;
const USAGE_KEY: &[u8] = b"\"usage\"";

impl Tail {
    /// A tail kept in `buf` (cleared first; a buffer of `TAIL_BYTES` is never grown).
    pub fn with_buf(mut buf: Vec<u8>) -> Tail {
        buf.clear();
        Tail { buf, early: None }
    }

    /// Also keep the last `"usage"` key that leaves the tail (a JSON body's).
    pub fn watch_json(&mut self) {
        self.early = Some(Vec::new());
    }

    /// The buffer, for reuse.
    pub fn into_buf(self) -> Vec<u8> {
        self.buf
    }

    pub fn push(&mut self, d: &[u8]) {
        if d.len() >= TAIL_BYTES {
            let cut = d.len() - TAIL_BYTES;
            if self.early.is_some() {
                self.catch_usage(self.buf.len(), d, cut);
            }
            self.buf.clear();
            self.buf.extend_from_slice(&d[cut..]);
            return;
        }
        let over = (self.buf.len() + d.len()).saturating_sub(TAIL_BYTES);
        if over > 0 {
            if self.early.is_some() {
                self.catch_usage(over, d, 0);
            }
            self.buf.drain(..over);
        }
        if self.buf.capacity() - self.buf.len() < d.len() {
            // Grow straight to the final size: a doubling Vec overshoots it by up to half
            // again, held by every open stream.
            self.buf.reserve_exact(TAIL_BYTES - self.buf.len());
        }
        self.buf.extend_from_slice(d);
    }

    /// `buf[..from_buf]` and `d[..from_d]` are about to leave the tail: keep the last
    /// `"usage"` key that starts in them, with what follows it in `buf` and `d`. (A key
    /// split between `buf` and `d` is not seen: a JSON body's usage then goes unread.)
    fn catch_usage(&mut self, from_buf: usize, d: &[u8], from_d: usize) {
        let keep = |early: &mut Vec<u8>, parts: [&[u8]; 2]| {
            early.clear();
            for p in parts {
                let room = EARLY_USAGE_BYTES - early.len();
                early.extend_from_slice(&p[..p.len().min(room)]);
            }
        };
        // The last `"usage"` starting in `hay[..n]` that is a key opening an object: a
        // string "usage" (a token in vLLM's `prompt_logprobs`) is passed over.
        // `then`: the bytes that follow `hay`.
        let within = |hay: &[u8], n: usize, then: &[u8]| {
            let mut end = (n + USAGE_KEY.len() - 1).min(hay.len());
            while let Some(at) = memchr::memmem::rfind(&hay[..end], USAGE_KEY) {
                if at >= n {
                    end = at + USAGE_KEY.len() - 1;
                    continue;
                }
                let mut rest = hay[at + USAGE_KEY.len()..]
                    .iter()
                    .chain(then)
                    .filter(|b| !b.is_ascii_whitespace());
                // Bytes not there yet (at the end of `hay`) give it the benefit of the doubt.
                if matches!(rest.next(), Some(b':') | None)
                    && matches!(rest.next(), Some(b'{') | None)
                {
                    return Some(at);
                }
                end = at + USAGE_KEY.len() - 1;
            }
            None
        };
        let Some(early) = self.early.as_mut() else {
            return;
        };
        if let Some(at) = within(d, from_d, &[]) {
            keep(early, [&d[at..], &[]]);
        } else if let Some(at) = within(&self.buf, from_buf, d) {
            keep(early, [&self.buf[at..], d]);
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The last `"usage"` key that left the tail, with what followed it (empty if none).
    pub fn early_usage(&self) -> &[u8] {
        self.early.as_deref().unwrap_or_default()
    }
}

/// How the client's copy of the body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientFraming {
    /// The peer's bytes exactly as framed (the fast path: no decoding work beyond
    /// finding the end).
    Passthrough,
    /// Decoded body bytes without framing: an HTTP/1.0 client; the connection closes.
    Raw,
    /// Decoded (and filtered) body bytes re-encoded as chunks.
    Chunked,
}

/// Something that rewrites a response body as it streams: fed decoded body bytes, it
/// appends what the client should get now.
pub trait BodyFilter {
    fn feed(&mut self, data: &[u8], out: &mut Vec<u8>);
    fn finish(&mut self, out: &mut Vec<u8>);
}

/// Filters applied in order: the usage-frame remover first when there is one, then the
/// others. The remover is held inline: it is the one filter a stream with the router's
/// usage injection usually has, and a response should not allocate for it.
#[derive(Default)]
pub struct FilterChain {
    usage: Option<UsageFrameFilter>,
    rest: Vec<Box<dyn BodyFilter>>,
    scratch: Scratch,
}

/// The buffers a chain of two or more filters passes its bytes along in, kept from one read
/// to the next (a single filter writes straight to the caller's buffer).
#[derive(Default)]
struct Scratch(Vec<u8>, Vec<u8>);

impl FilterChain {
    /// The usage-frame remover, which runs before every other filter.
    pub fn set_usage(&mut self, f: UsageFrameFilter) {
        self.usage = Some(f);
    }

    pub fn push(&mut self, f: Box<dyn BodyFilter>) {
        self.rest.push(f);
    }

    pub fn is_empty(&self) -> bool {
        self.usage.is_none() && self.rest.is_empty()
    }

    /// Whether the chain has the usage-frame filter, which reads every event's usage object
    /// as it passes: then the body's tail need not be kept for [`Self::seen_usage`].
    pub fn reads_usage(&self) -> bool {
        self.usage.is_some()
    }

    /// The usage the usage-frame filter saw (the last usage object of the stream), when the
    /// chain has that filter (`None`); `Some(None)` when the stream had none.
    pub fn seen_usage(&self) -> Option<Option<crate::transform::Usage>> {
        let f = self.usage.as_ref()?;
        Some(f.usage().and_then(crate::transform::usage_from_json))
    }

    /// Run `data` through every filter, appending what the last one gives to `out`.
    fn run(&mut self, data: &[u8], finish: bool, out: &mut Vec<u8>) {
        let FilterChain {
            usage,
            rest,
            scratch: Scratch(a, b),
        } = self;
        let mut filters = usage
            .iter_mut()
            .map(|u| u as &mut dyn BodyFilter)
            .chain(rest.iter_mut().map(|f| &mut **f as &mut dyn BodyFilter));
        let feed = |f: &mut dyn BodyFilter, data: &[u8], out: &mut Vec<u8>| {
            f.feed(data, out);
            if finish {
                f.finish(out);
            }
        };
        let Some(first) = filters.next() else {
            out.extend_from_slice(data);
            return;
        };
        let Some(mut next) = filters.next() else {
            feed(first, data, out);
            return;
        };
        a.clear();
        feed(first, data, a);
        for f in filters {
            b.clear();
            feed(next, a, b);
            std::mem::swap(a, b);
            next = f;
        }
        feed(next, a, out);
        // A burst does not keep its buffers' size for the rest of a long stream.
        shed_burst(a);
        shed_burst(b);
    }
}

pub struct RelayPlan<'a> {
    pub framing: ResponseFraming,
    pub client: ClientFraming,
    pub idle_timeout: Duration,
    /// When the response head arrived, with the body bytes that came along with it.
    pub head_at: Instant,
    /// An event stream: read into the small buffer from the start (events come a few
    /// at a time and the stream mostly waits), giving the head's full-size buffer back.
    pub event_stream: bool,
    /// The router's drain. A wait for the peer ends at the drain deadline at the latest
    /// (whether it began before the drain or during it), so a response still going at the
    /// deadline ends here, with its access line, instead of being dropped with the worker.
    pub drain: Option<DrainWatch<'a>>,
}

/// Body state machine over the upstream bytes.
enum Tracker {
    None,
    Length(u64),
    Chunked(ChunkedDecoder),
    UntilClose,
}

/// The largest client-write buffer a re-framed body keeps from one write to the next.
const DECODE_OUT_KEEP_BYTES: usize = 4 * 1024;

/// Free a buffer a burst grew past [`DECODE_OUT_KEEP_BYTES`], so that a stream which goes on
/// at a trickle does not hold it.
fn shed_burst(v: &mut Vec<u8>) {
    if v.capacity() > DECODE_OUT_KEEP_BYTES {
        *v = Vec::new();
    }
}

/// Relay the response: `head_bytes` (the client's response head) goes out with the first
/// body bytes, then each upstream read becomes one client write. `buf[start..]` holds body
/// bytes that arrived with the head. Returns how it ended and the read buffer for reuse.
///
/// `inflight`, the request's unit on its peer, is released as soon as the peer's response
/// is complete, before the last client write: the peer is done with the request then, and
/// a client that sends its next request the moment it has this response must find the
/// unit free (a pool at its `max_concurrency` would refuse it otherwise). On every other
/// end the caller drops it.
#[allow(clippy::too_many_arguments)]
pub async fn relay(
    client: &mut OwnedWriteHalf<TcpStream>,
    up: &mut TcpStream,
    inflight: &mut Option<super::Inflight<'_>>,
    head_bytes: Vec<u8>,
    buf: Vec<u8>,
    start: usize,
    plan: &RelayPlan<'_>,
    filters: &mut FilterChain,
    watch: &mut ClientWatch<'_>,
    stats: &mut RelayStats,
    spares: &Spares,
    heads: &Spares,
) -> (RelayEnd, Option<Vec<u8>>) {
    let mut tracker = match plan.framing {
        ResponseFraming::None => Tracker::None,
        ResponseFraming::Length(n) => Tracker::Length(n),
        ResponseFraming::Chunked => Tracker::Chunked(ChunkedDecoder::default()),
        ResponseFraming::UntilClose => Tracker::UntilClose,
    };
    let decode = plan.client != ClientFraming::Passthrough;
    let mut out = head_bytes;
    let mut pending = buf;
    let mut pstart = start;
    // Decoded body bytes of the current read (only when the client's framing differs and
    // the peer's is chunked: other bodies are filtered straight from the read buffer), and
    // the filters' output, both kept from one read to the next. Both come from the spare
    // head buffers when first needed and go back there at the end, and while a stream of
    // small reads waits for its peer.
    let mut decoded: Vec<u8> = Vec::new();
    let mut body: Vec<u8> = Vec::new();
    let mut eof = false;
    // Consecutive upstream reads that were small (see the read at the end of the loop).
    let mut small_reads = if plan.event_stream {
        SMALL_READS_TO_SHRINK
    } else {
        0
    };
    // When the bytes in `pending` arrived.
    let mut read_at = plan.head_at;
    loop {
        // Account for the new bytes in `pending[pstart..]`: `emit` is the part the client
        // gets as is (pass-through); decoded bytes go to `decoded`.
        let data = &pending[pstart..];
        let mut broken = None;
        let mut finished = false;
        let mut clean = true;
        let emit = match &mut tracker {
            Tracker::None => {
                finished = true;
                clean = data.is_empty();
                0
            }
            Tracker::Length(rem) => {
                let take = (*rem).min(data.len() as u64) as usize;
                note_body(stats, read_at, take, !decode);
                stats.body(&data[..take]);
                *rem -= take as u64;
                if *rem == 0 {
                    finished = true;
                    clean = take == data.len();
                }
                take
            }
            Tracker::Chunked(dec) => {
                if decode && decoded.capacity() == 0 {
                    decoded = heads.take();
                }
                let mut data_bytes = 0usize;
                let used = dec.feed(data, &mut |d| {
                    if decode {
                        decoded.extend_from_slice(d);
                    }
                    stats.body(d);
                    data_bytes += d.len();
                });
                // Broken framing: the head, if it has not gone yet, still reaches the
                // client (below), and so does what came before the break: decoded, when
                // the body is re-framed; passed through, the read's complete chunks. Then
                // the response is cut. The client of a first read that broke used to get
                // nothing at all.
                let used = used.unwrap_or_else(|_| {
                    broken = Some("malformed chunked response body");
                    if decode {
                        0
                    } else {
                        dec.boundary()
                    }
                });
                note_body(stats, read_at, data_bytes, !decode);
                if dec.is_done() {
                    finished = true;
                    clean = used == data.len();
                }
                used
            }
            Tracker::UntilClose => {
                note_body(stats, read_at, data.len(), !decode);
                stats.body(data);
                finished = eof;
                clean = false;
                data.len()
            }
        };
        if finished {
            inflight.take();
        }
        let has_body = !matches!(tracker, Tracker::None);
        if decode && has_body {
            // Filter and re-frame the new body bytes (decoded from chunks, or as read); at
            // the end, flush the filters and close the chunked body.
            let new_bytes: &[u8] = match tracker {
                Tracker::Chunked(_) => &decoded,
                _ => &pending[pstart..pstart + emit],
            };
            if body.capacity() == 0 {
                body = heads.take();
            }
            body.clear();
            // Filters mostly pass bytes through: room for all of them, grown once.
            body.reserve(new_bytes.len() + 64);
            filters.run(new_bytes, finished, &mut body);
            // What the client gets of the body is what the filters gave.
            stats.body_bytes += body.len() as u64;
            decoded.clear();
            if out.capacity() == 0 {
                out = heads.take();
            }
            match plan.client {
                ClientFraming::Chunked => {
                    if !body.is_empty() {
                        crate::http::encode_chunk(&body, &mut out);
                    }
                    if finished {
                        out.extend_from_slice(b"0\r\n\r\n");
                    }
                }
                _ => out.extend_from_slice(&body),
            }
        }
        // One client write per upstream read: the head (first time) and the new bytes
        // together, or the new bytes straight from the read buffer.
        if !decode && out.is_empty() && emit > 0 {
            let (res, slice) = client.write_all(pending.slice(pstart..pstart + emit)).await;
            pending = slice.into_inner();
            if res.is_err() {
                return (RelayEnd::ClientGone, Some(pending));
            }
        } else {
            if !decode {
                out.extend_from_slice(&pending[pstart..pstart + emit]);
            }
            if !out.is_empty() {
                match write_client(client, out).await {
                    // Pass-through writes straight from the read buffer after the head: the
                    // head's buffer is not kept for the rest of a long stream.
                    // Re-framed bodies keep a buffer for their chunks, but not the head's:
                    // it may be the request's buffer, sized for an inlined prompt.
                    Ok(b) if decode && b.capacity() <= DECODE_OUT_KEEP_BYTES => out = b,
                    Ok(b) => {
                        heads.put(b);
                        out = Vec::new();
                    }
                    Err(_) => return (RelayEnd::ClientGone, Some(pending)),
                }
                out.clear();
            }
        }
        if let Some(why) = broken {
            give_back(heads, [&mut out, &mut body, &mut decoded]);
            if decode {
                flush_before_cut(client, filters, plan, stats, heads).await;
            }
            return (RelayEnd::UpstreamError(why), Some(pending));
        }
        if finished {
            // The write, filter and decode buffers go back for the next request's head (the
            // spares keep only those whose size suits them).
            give_back(heads, [&mut out, &mut body, &mut decoded]);
            return (
                RelayEnd::Done {
                    reusable: clean && !eof,
                },
                Some(pending),
            );
        }
        // Read the next piece from the peer into the spent buffer. A stream of small
        // reads (events a token at a time) reads into a small buffer, so a stream that
        // mostly waits holds 2 KiB instead of 16; a read that fills it switches back.
        pending.clear();
        pstart = 0;
        let want = read_buf_bytes(small_reads);
        if pending.capacity() < want {
            pending.reserve(want);
        } else if pending.capacity() > 2 * want {
            // Shrinking: the full-size buffer goes back to the worker's spares, for the
            // next request's head, instead of to the allocator (whose free memory an
            // open stream's process keeps as RSS).
            spares.put(std::mem::replace(&mut pending, Vec::with_capacity(want)));
        }
        // A stream of small reads does not hold its decode and filter buffers while it
        // waits: they go back to the spares (which keep them unless a burst grew them) and
        // the next read takes one. Bulk bodies keep theirs from read to read.
        if want == SMALL_READ_BUF_BYTES {
            give_back(heads, [&mut out, &mut body, &mut decoded]);
        }
        let cap = pending.capacity();
        // Idle: nothing from the peer for `idle_timeout` from now, after the client's
        // write — not from the peer's last bytes: a client slow to take them is not an
        // idle peer (and on io_uring the read's first poll only submits it, so an
        // already passed deadline would win even with bytes waiting).
        let now = monoio::time::Instant::now();
        let (deadline, listen_at) = (now + plan.idle_timeout, now + DRAIN_LISTEN_AFTER);
        let read = std::pin::pin!(up.read(pending.slice_mut(0..cap)));
        let (res, slice) = match race_until_drained!(watch, deadline, listen_at, read, plan.drain) {
            Err(Stopped::ClientGone) => return (RelayEnd::ClientGone, None),
            Err(Stopped::TimedOut) if plan.drain.is_some_and(|d| d.passed()) => {
                return (RelayEnd::Shutdown, None)
            }
            Err(Stopped::TimedOut) => {
                return (
                    RelayEnd::UpstreamError("peer idle longer than the idle timeout"),
                    None,
                )
            }
            Ok(r) => r,
        };
        pending = slice.into_inner();
        read_at = Instant::now();
        crate::worker::quota::settle(read_at);
        match res {
            Ok(0) | Err(_) => {
                if let Tracker::UntilClose = tracker {
                    // The close is the end of the body: one more turn flushes the filters
                    // and closes the client's framing.
                    pending.clear();
                    eof = true;
                    continue;
                }
                give_back(heads, [&mut out, &mut body, &mut decoded]);
                if decode {
                    flush_before_cut(client, filters, plan, stats, heads).await;
                }
                return (
                    RelayEnd::UpstreamError("peer closed before the body was complete"),
                    Some(pending),
                );
            }
            Ok(n) => small_reads = count_small_read(small_reads, n, cap),
        }
    }
}

/// The peer cut a filtered body short, or broke its framing: what the filters still hold
/// (the start of a line whose end they were waiting for) goes to the client before the
/// cut, as those bytes would have gone without a filter. Best effort: the response is cut
/// either way, and the client's chunked framing is left open so that the cut shows.
async fn flush_before_cut(
    client: &mut OwnedWriteHalf<TcpStream>,
    filters: &mut FilterChain,
    plan: &RelayPlan<'_>,
    stats: &mut RelayStats,
    heads: &Spares,
) {
    if filters.is_empty() {
        return;
    }
    let mut held = heads.take();
    held.clear();
    filters.run(&[], true, &mut held);
    if !held.is_empty() {
        stats.body_bytes += held.len() as u64;
        let mut out = heads.take();
        out.clear();
        match plan.client {
            ClientFraming::Chunked => crate::http::encode_chunk(&held, &mut out),
            _ => out.extend_from_slice(&held),
        }
        if let Ok(b) = write_client(client, out).await {
            heads.put(b);
        }
    }
    heads.put(held);
}

/// `n` body bytes arrived from the peer at `now`. `sent`: they reach the client as they
/// are (no filter rewrites the body), so they count as the client's bytes too; otherwise
/// the filters' output is counted where it is made.
fn note_body(stats: &mut RelayStats, now: Instant, n: usize, sent: bool) {
    if n > 0 {
        stats.last_body_at = Some(now);
        if stats.first_body_at.is_none() {
            stats.first_body_at = Some(now);
        }
        if sent {
            stats.body_bytes += n as u64;
        }
    }
}

/// Hands the relay's per-response buffers to the spares, leaving them empty (the next
/// use takes a spare one).
fn give_back(heads: &Spares, bufs: [&mut Vec<u8>; 3]) {
    for b in bufs {
        heads.put(std::mem::take(b));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_bytes() {
        let mut t = Tail::default();
        t.push(b"abc");
        t.push(b"def");
        assert_eq!(t.bytes(), b"abcdef");
        let big = vec![b'x'; TAIL_BYTES + 10];
        t.push(&big);
        assert_eq!(t.bytes().len(), TAIL_BYTES);
        t.push(b"END");
        assert_eq!(t.bytes().len(), TAIL_BYTES);
        assert!(t.bytes().ends_with(b"xxEND"));
    }

    #[test]
    fn a_json_bodys_usage_is_kept_when_megabytes_follow_it() {
        // vLLM's order: usage, then prompt_logprobs / prompt_token_ids.
        let mut body = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":30000,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":29000}},"prompt_token_ids":["#.to_vec();
        for i in 0..30_000 {
            body.extend_from_slice(format!("{i},").as_bytes());
        }
        body.extend_from_slice(b"1],\"prompt_logprobs\":[");
        // A token "usage" in the logprobs is a string, not the key.
        for i in 0..300 {
            body.extend_from_slice(
                format!("{{\"{i}\":{{\"logprob\":-1.5,\"decoded_token\":\"usage\"}}}},").as_bytes(),
            );
        }
        body.extend_from_slice(b"null]}");
        for step in [1, 7, 100, 2047, 2048, 5000, 16384, body.len()] {
            let mut t = Tail::default();
            t.watch_json();
            for piece in body.chunks(step) {
                t.push(piece);
            }
            assert!(crate::usage::usage_in_json_tail(t.bytes()).is_none());
            let u = crate::usage::usage_in_json_tail(t.early_usage())
                .unwrap_or_else(|| panic!("no usage kept, pieces of {step}"));
            assert_eq!(
                (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
                (Some(30000), Some(8), Some(29000)),
                "pieces of {step}"
            );
            assert!(t.early_usage().len() <= EARLY_USAGE_BYTES);
        }
        // The control: an event stream's tail (not watched) keeps nothing early.
        let mut t = Tail::default();
        for piece in body.chunks(5000) {
            t.push(piece);
        }
        assert!(t.early_usage().is_empty());
    }

    #[test]
    fn a_token_stream_reads_into_the_small_buffer_and_a_burst_switches_back() {
        // A stream of ~200-byte events: after the streak, the relay holds 2 KiB, not 16.
        let mut streak = 0;
        let mut sizes = Vec::new();
        for _ in 0..6 {
            let cap = read_buf_bytes(streak);
            sizes.push(cap);
            streak = count_small_read(streak, 200, cap);
        }
        assert_eq!(&sizes[..4], &[RELAY_READ_BUF_BYTES; 4]);
        assert_eq!(&sizes[4..], &[SMALL_READ_BUF_BYTES; 2]);
        // A read that fills the small buffer (a burst) goes back to the full size at once.
        streak = count_small_read(streak, SMALL_READ_BUF_BYTES, SMALL_READ_BUF_BYTES);
        assert_eq!(read_buf_bytes(streak), RELAY_READ_BUF_BYTES);
        // Large reads never shrink it.
        for _ in 0..10 {
            streak = count_small_read(streak, 9000, RELAY_READ_BUF_BYTES);
        }
        assert_eq!(read_buf_bytes(streak), RELAY_READ_BUF_BYTES);
    }

    #[test]
    fn tail_of_a_long_event_stream_stays_at_its_size() {
        // Held by every open stream: events pass, the memory does not grow past the tail.
        let mut t = Tail::default();
        for i in 0..10_000 {
            t.push(format!("data: {{\"i\":{i}}}\n\n").as_bytes());
            assert!(t.buf.capacity() <= TAIL_BYTES, "{}", t.buf.capacity());
        }
        assert_eq!(t.bytes().len(), TAIL_BYTES);
        assert!(t.bytes().ends_with(b"{\"i\":9999}\n\n"));
    }

    #[test]
    fn a_waiting_stream_gives_its_decode_filter_and_write_buffers_back() {
        use monoio::io::Splitable;
        use std::io::Write;
        // The peer: a chunked event stream, one event per chunk; after three it waits for
        // the test's go before the last event and the end of the body.
        let up_l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let up_addr = up_l.local_addr().unwrap();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let event = |i: usize| {
            format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n")
        };
        let peer = std::thread::spawn(move || {
            let (mut s, _) = up_l.accept().unwrap();
            let chunk = |e: &str| format!("{:x}\r\n{e}\r\n", e.len());
            for i in 0..3 {
                s.write_all(chunk(&event(i)).as_bytes()).unwrap();
                std::thread::sleep(Duration::from_millis(10));
            }
            go_rx.recv().unwrap();
            s.write_all(format!("{}0\r\n\r\n", chunk(&event(3))).as_bytes())
                .unwrap();
        });
        let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        let (held_while_waiting, kept_after, got, end) = rt.block_on(async move {
            let l = monoio::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let mut client = TcpStream::connect_addr(l.local_addr().unwrap())
                .await
                .unwrap();
            let (conn, _) = l.accept().await.unwrap();
            let (mut rd, mut wr) = conn.into_split();
            let mut up = TcpStream::connect_addr(up_addr).await.unwrap();
            let spares = Spares::new(RELAY_READ_BUF_BYTES);
            let heads = Spares::new(2048);
            assert_eq!(heads.len(), 0, "no spare head buffers before the relay");
            let mut timer = crate::pipeline::client::new_timer();
            let mut watch = ClientWatch::new(&mut rd, &mut timer, Instant::now());
            let mut filters = FilterChain::default();
            filters.set_usage(UsageFrameFilter::new());
            let plan = RelayPlan {
                framing: ResponseFraming::Chunked,
                client: ClientFraming::Chunked,
                idle_timeout: Duration::from_secs(10),
                head_at: Instant::now(),
                event_stream: true,
                drain: None,
            };
            let mut stats = RelayStats::default();
            let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
            let mut unit = None;
            let relay = relay(
                &mut wr,
                &mut up,
                &mut unit,
                head,
                Vec::with_capacity(RELAY_READ_BUF_BYTES),
                0,
                &plan,
                &mut filters,
                &mut watch,
                &mut stats,
                &spares,
                &heads,
            );
            let heads_ref = &heads;
            let probe = async move {
                let mut got = Vec::new();
                let mut held = None;
                loop {
                    let (n, b) = client.read(Vec::with_capacity(4096)).await;
                    let n = n.unwrap();
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&b[..n]);
                    let text = String::from_utf8_lossy(&got).into_owned();
                    if held.is_none() && text.contains("t2") {
                        // The relay has written the third event and waits for the peer.
                        monoio::time::sleep(Duration::from_millis(50)).await;
                        held = Some(heads_ref.len());
                        go_tx.send(()).unwrap();
                    }
                    if text.ends_with("0\r\n\r\n") {
                        break;
                    }
                }
                (held, got)
            };
            let ((end, _), (held, got)) = monoio::join!(relay, probe);
            (held, heads.len(), got, end)
        });
        peer.join().unwrap();
        assert!(matches!(end, RelayEnd::Done { reusable: true }), "{end:?}");
        let got = String::from_utf8(got).unwrap();
        for i in 0..4 {
            assert!(got.contains(&event(i)), "event {i} missing: {got:?}");
        }
        // While the stream waited: its decode buffer, the filter's output buffer and the
        // client-write buffer were all spares, none held by the stream.
        assert_eq!(held_while_waiting, Some(3));
        // At the end they are spares again.
        assert_eq!(kept_after, 3);
    }

    /// The request's unit on its peer is free before the client has the response's last
    /// byte, so a client that sends its next request at once never finds its own finished
    /// request still counted against the peer's `max_concurrency`.
    #[test]
    fn the_peers_unit_is_released_before_the_last_client_write() {
        use monoio::io::Splitable;
        use std::io::Write;
        let path =
            std::env::temp_dir().join(format!("warmroute-relay-unit-{}", std::process::id()));
        let seg = warmroute_shm::Segment::open_or_create(
            &path,
            warmroute_shm::Capacities {
                workers: 2,
                peers: 4,
                routes: 4,
            },
        )
        .unwrap();
        let _ = std::fs::remove_file(&path);
        let wid = seg.claim_worker(std::process::id(), 1).unwrap();
        let slot = seg.peer_slot("127.0.0.1:1").unwrap();
        // The peer sends the body in two parts, 20 ms apart.
        let up_l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let up_addr = up_l.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let (mut s, _) = up_l.accept().unwrap();
            s.write_all(b"hello ").unwrap();
            std::thread::sleep(Duration::from_millis(20));
            s.write_all(b"world").unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        let seg = &seg;
        let (seen_mid, seen_at_end, end, held_after) = rt.block_on(async move {
            let l = monoio::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let mut client = TcpStream::connect_addr(l.local_addr().unwrap())
                .await
                .unwrap();
            let (conn, _) = l.accept().await.unwrap();
            let (mut rd, mut wr) = conn.into_split();
            let mut up = TcpStream::connect_addr(up_addr).await.unwrap();
            let spares = Spares::new(RELAY_READ_BUF_BYTES);
            let heads = Spares::new(2048);
            let mut timer = crate::pipeline::client::new_timer();
            let mut watch = ClientWatch::new(&mut rd, &mut timer, Instant::now());
            let mut filters = FilterChain::default();
            let plan = RelayPlan {
                framing: ResponseFraming::Length(11),
                client: ClientFraming::Passthrough,
                idle_timeout: Duration::from_secs(10),
                head_at: Instant::now(),
                event_stream: false,
                drain: None,
            };
            let mut stats = RelayStats::default();
            let head = b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n".to_vec();
            let mut unit = Some(crate::pipeline::Inflight::acquire(seg, wid, slot));
            // Had the relay left the unit to its caller, the client would still see it
            // when it has the last byte: the caller drops it only after the join below.
            let relay = relay(
                &mut wr,
                &mut up,
                &mut unit,
                head,
                Vec::with_capacity(RELAY_READ_BUF_BYTES),
                0,
                &plan,
                &mut filters,
                &mut watch,
                &mut stats,
                &spares,
                &heads,
            );
            let probe = async {
                let mut got = Vec::new();
                let mut seen_mid = None;
                loop {
                    let (n, b) = client.read(Vec::with_capacity(4096)).await;
                    let n = n.unwrap();
                    assert!(n > 0, "closed after {got:?}");
                    got.extend_from_slice(&b[..n]);
                    if got.ends_with(b"hello world") {
                        break;
                    }
                    if got.ends_with(b"hello ") {
                        seen_mid = Some(seg.inflight(slot));
                    }
                }
                (seen_mid, seg.inflight(slot))
            };
            let ((end, _), (seen_mid, seen_at_end)) = monoio::join!(relay, probe);
            let held_after = unit.is_some();
            drop(unit);
            (seen_mid, seen_at_end, end, held_after)
        });
        peer.join().unwrap();
        assert!(matches!(end, RelayEnd::Done { reusable: true }), "{end:?}");
        // Control: while the peer was still sending, the unit was held.
        assert_eq!(seen_mid, Some(1));
        // The client had every byte, and the unit was already free.
        assert_eq!(seen_at_end, 0);
        assert!(!held_after);
        assert_eq!(seg.inflight(slot), 0);
    }
}
