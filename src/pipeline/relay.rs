//! Relay: stream the response body to the client as it arrives — one client write per
//! upstream read, never batched, so SSE events keep their timing — while tracking the
//! body's framing to know when it ends and whether the connection can be reused.

use std::future::Future;
use std::time::{Duration, Instant};

use monoio::buf::IoBufMut;
use monoio::io::AsyncReadRent;
use monoio::net::TcpStream;
use monoio::BufResult;

use crate::http::{ChunkedDecoder, ResponseFraming};
use crate::limits::RELAY_READ_BUF_BYTES;

use monoio::io::OwnedWriteHalf;

use super::client::{write_client, ClientWatch};

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
}

/// What the relay measured.
#[derive(Debug, Default, Clone, Copy)]
pub struct RelayStats {
    pub body_bytes: u64,
    /// First non-empty body bytes, for TTFT.
    pub first_body_at: Option<Instant>,
}

pub struct RelayPlan {
    pub framing: ResponseFraming,
    /// Decode chunked framing for an HTTP/1.0 client instead of passing it through.
    pub dechunk: bool,
    pub idle_timeout: Duration,
}

/// Body state machine over the upstream bytes.
enum Tracker {
    None,
    Length(u64),
    Chunked(ChunkedDecoder),
    UntilClose,
}

/// Relay the response: `first` (head plus any body bytes already read) goes out in the
/// first write, then each upstream read becomes one client write.
pub async fn relay<F: Future<Output = BufResult<usize, Vec<u8>>>>(
    client: &mut OwnedWriteHalf<TcpStream>,
    up: &mut TcpStream,
    head_bytes: Vec<u8>,
    leftover: Vec<u8>,
    plan: &RelayPlan,
    watch: &mut ClientWatch<'_, F>,
    stats: &mut RelayStats,
) -> RelayEnd {
    let mut tracker = match plan.framing {
        ResponseFraming::None => Tracker::None,
        ResponseFraming::Length(n) => Tracker::Length(n),
        ResponseFraming::Chunked => Tracker::Chunked(ChunkedDecoder::default()),
        ResponseFraming::UntilClose => Tracker::UntilClose,
    };
    let mut out = head_bytes;
    let mut pending = leftover;
    loop {
        // Account for the bytes in `pending`, appending what the client should see to `out`.
        let mut finished = false;
        let mut clean = true;
        match &mut tracker {
            Tracker::None => {
                finished = true;
                clean = pending.is_empty();
            }
            Tracker::Length(rem) => {
                let take = (*rem).min(pending.len() as u64) as usize;
                note_body(stats, take);
                out.extend_from_slice(&pending[..take]);
                *rem -= take as u64;
                if *rem == 0 {
                    finished = true;
                    clean = take == pending.len();
                }
            }
            Tracker::Chunked(dec) => {
                let mut data_bytes = 0usize;
                let used = if plan.dechunk {
                    let mut data = Vec::new();
                    let r = dec.feed(&pending, &mut |d| data.extend_from_slice(d));
                    out.extend_from_slice(&data);
                    data_bytes = data.len();
                    r
                } else {
                    dec.feed(&pending, &mut |d| data_bytes += d.len())
                };
                let used = match used {
                    Ok(u) => u,
                    Err(_) => return RelayEnd::UpstreamError("malformed chunked response body"),
                };
                if !plan.dechunk {
                    out.extend_from_slice(&pending[..used]);
                }
                note_body(stats, data_bytes);
                if dec.is_done() {
                    finished = true;
                    clean = used == pending.len();
                }
            }
            Tracker::UntilClose => {
                note_body(stats, pending.len());
                out.extend_from_slice(&pending);
            }
        }
        if !out.is_empty() {
            // One client write per upstream read.
            match write_client(client, out).await {
                Ok(b) => out = b,
                Err(_) => return RelayEnd::ClientGone,
            }
            out.clear();
        }
        if finished {
            return RelayEnd::Done { reusable: clean };
        }
        // Read the next piece from the peer into the spent buffer.
        pending.clear();
        if pending.capacity() < RELAY_READ_BUF_BYTES {
            pending.reserve(RELAY_READ_BUF_BYTES);
        }
        let cap = pending.capacity();
        let read = monoio::time::timeout(plan.idle_timeout, up.read(pending.slice_mut(0..cap)));
        let (res, slice) = match watch.race(read).await {
            Err(_) => return RelayEnd::ClientGone,
            Ok(Err(_)) => return RelayEnd::UpstreamError("peer idle longer than the idle timeout"),
            Ok(Ok(r)) => r,
        };
        pending = slice.into_inner();
        match res {
            Ok(0) | Err(_) => {
                if let Tracker::UntilClose = tracker {
                    // The close is the end of the body; the client learns it the same way.
                    return RelayEnd::Done { reusable: false };
                }
                return RelayEnd::UpstreamError("peer closed before the body was complete");
            }
            Ok(_) => {}
        }
    }
}

fn note_body(stats: &mut RelayStats, n: usize) {
    if n > 0 {
        if stats.first_body_at.is_none() {
            stats.first_body_at = Some(Instant::now());
        }
        stats.body_bytes += n as u64;
    }
}
