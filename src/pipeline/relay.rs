//! Relay: stream the response body to the client as it arrives — one client write per
//! upstream read, never batched, so SSE events keep their timing — while tracking the
//! body's framing to know when it ends and whether the connection can be reused.

use std::time::{Duration, Instant};

use monoio::buf::{IoBuf, IoBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

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
#[allow(clippy::too_many_arguments)]
pub async fn relay(
    client: &mut OwnedWriteHalf<TcpStream>,
    up: &mut TcpStream,
    head_bytes: Vec<u8>,
    buf: Vec<u8>,
    start: usize,
    plan: &RelayPlan,
    watch: &mut ClientWatch<'_>,
    stats: &mut RelayStats,
) -> (RelayEnd, Option<Vec<u8>>) {
    let mut tracker = match plan.framing {
        ResponseFraming::None => Tracker::None,
        ResponseFraming::Length(n) => Tracker::Length(n),
        ResponseFraming::Chunked => Tracker::Chunked(ChunkedDecoder::default()),
        ResponseFraming::UntilClose => Tracker::UntilClose,
    };
    let mut out = head_bytes;
    let mut pending = buf;
    let mut pstart = start;
    loop {
        // Account for the new bytes in `pending[pstart..]`: `emit` is the part the client
        // gets as is; decoded data (HTTP/1.0 clients of a chunked peer) goes to `out`.
        let data = &pending[pstart..];
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
                note_body(stats, take);
                *rem -= take as u64;
                if *rem == 0 {
                    finished = true;
                    clean = take == data.len();
                }
                take
            }
            Tracker::Chunked(dec) => {
                let mut data_bytes = 0usize;
                let used = if plan.dechunk {
                    dec.feed(data, &mut |d| {
                        out.extend_from_slice(d);
                        data_bytes += d.len();
                    })
                } else {
                    dec.feed(data, &mut |d| data_bytes += d.len())
                };
                let Ok(used) = used else {
                    return (
                        RelayEnd::UpstreamError("malformed chunked response body"),
                        Some(pending),
                    );
                };
                note_body(stats, data_bytes);
                if dec.is_done() {
                    finished = true;
                    clean = used == data.len();
                }
                if plan.dechunk {
                    0
                } else {
                    used
                }
            }
            Tracker::UntilClose => {
                note_body(stats, data.len());
                data.len()
            }
        };
        // One client write per upstream read: the head (first time) and the new bytes
        // together, or the new bytes straight from the read buffer.
        if out.is_empty() && emit > 0 {
            let (res, slice) = client.write_all(pending.slice(pstart..pstart + emit)).await;
            pending = slice.into_inner();
            if res.is_err() {
                return (RelayEnd::ClientGone, Some(pending));
            }
        } else if !out.is_empty() || emit > 0 {
            out.extend_from_slice(&pending[pstart..pstart + emit]);
            match write_client(client, out).await {
                Ok(b) => out = b,
                Err(_) => return (RelayEnd::ClientGone, Some(pending)),
            }
            out.clear();
        }
        if finished {
            return (RelayEnd::Done { reusable: clean }, Some(pending));
        }
        // Read the next piece from the peer into the spent buffer.
        pending.clear();
        pstart = 0;
        if pending.capacity() < RELAY_READ_BUF_BYTES {
            pending.reserve(RELAY_READ_BUF_BYTES);
        }
        let cap = pending.capacity();
        let read = monoio::time::timeout(plan.idle_timeout, up.read(pending.slice_mut(0..cap)));
        let (res, slice) = match watch.race(read).await {
            Err(_) => return (RelayEnd::ClientGone, None),
            Ok(Err(_)) => {
                return (
                    RelayEnd::UpstreamError("peer idle longer than the idle timeout"),
                    None,
                )
            }
            Ok(Ok(r)) => r,
        };
        pending = slice.into_inner();
        match res {
            Ok(0) | Err(_) => {
                if let Tracker::UntilClose = tracker {
                    // The close is the end of the body; the client learns it the same way.
                    return (RelayEnd::Done { reusable: false }, Some(pending));
                }
                return (
                    RelayEnd::UpstreamError("peer closed before the body was complete"),
                    Some(pending),
                );
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
