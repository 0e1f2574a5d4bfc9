//! Per-worker keep-alive pool of upstream connections, keyed by peer address.
//!
//! Bounded: at most `per_peer_max` idle connections per peer, each kept at most
//! `idle_timeout`. Taking returns the most recently used connection (warmest, least
//! likely to have been closed by the peer). A connection last looked at [`LOOK_EVERY`] or
//! more ago (or never: one made that long ago) is looked at first: one the peer wrote to
//! while it was idle (an unsolicited 408 when the peer's idle timer fired, the extra
//! bytes of a broken peer) or closed is dropped, since those bytes would be read as the
//! next request's response. A close that comes later is found out on use; the caller
//! retries once on a fresh connection.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use monoio::net::TcpStream;
use warmroute_shm::Pending;

/// How often a connection in use is looked at on reuse: at most once per this time, so
/// that a connection reused hundreds of times a second (under a benchmark's load) costs a
/// system call on a few of its reuses, not on each; one reused less often (an LLM
/// request's length apart) is looked at on every reuse. Bytes a broken peer sends after a
/// complete response (a second response, say) are read as the next request's response
/// when they come after that request took the connection; the next look ends it. The
/// answers of later requests, each read one request late, can so go to the wrong clients
/// for at most this time (it went on for as long as the connection stayed busy, when
/// only a connection idle this long was looked at).
pub const LOOK_EVERY: Duration = Duration::from_millis(10);

pub struct UpstreamPool {
    /// Per peer address, idle connections oldest first, with when each went idle and when
    /// it was last looked at. A short list scanned linearly: faster than hashing for the
    /// handful of peers a worker talks to.
    idle: Vec<(SocketAddr, VecDeque<Pooled>)>,
    per_peer_max: usize,
    idle_timeout: Duration,
}

/// An idle connection: since when, and when it was last looked at.
struct Pooled {
    stream: TcpStream,
    since: Instant,
    looked: Instant,
}

impl UpstreamPool {
    pub fn new(per_peer_max: usize, idle_timeout: Duration) -> UpstreamPool {
        UpstreamPool {
            idle: Vec::new(),
            per_peer_max,
            idle_timeout,
        }
    }

    pub fn configure(&mut self, per_peer_max: usize, idle_timeout: Duration) {
        self.per_peer_max = per_peer_max;
        self.idle_timeout = idle_timeout;
    }

    /// An idle connection to `addr`, and when it was last looked at (to hand back to
    /// [`put`](Self::put) with it).
    pub fn take(&mut self, addr: SocketAddr, now: Instant) -> Option<(TcpStream, Instant)> {
        let list = &mut self.idle.iter_mut().find(|(a, _)| *a == addr)?.1;
        while let Some(Pooled {
            stream,
            since,
            mut looked,
        }) = list.pop_back()
        {
            if now.saturating_duration_since(since) >= self.idle_timeout {
                continue;
            }
            if now.saturating_duration_since(looked) >= LOOK_EVERY {
                if warmroute_shm::socket_pending(stream.as_raw_fd()) != Pending::Nothing {
                    continue;
                }
                looked = now;
            }
            return Some((stream, looked));
        }
        None
    }

    /// Keep `stream` (idle from `now`; last looked at `looked`, or made then).
    pub fn put(&mut self, addr: SocketAddr, stream: TcpStream, now: Instant, looked: Instant) {
        if self.per_peer_max == 0 {
            return;
        }
        let i = match self.idle.iter().position(|(a, _)| *a == addr) {
            Some(i) => i,
            None => {
                self.idle.push((addr, VecDeque::new()));
                self.idle.len() - 1
            }
        };
        let list = &mut self.idle[i].1;
        if list.len() >= self.per_peer_max {
            list.pop_front();
        }
        list.push_back(Pooled {
            stream,
            since: now,
            looked,
        });
    }

    pub fn evict_expired(&mut self, now: Instant) {
        let t = self.idle_timeout;
        self.idle.retain_mut(|(_, list)| {
            list.retain(|p| now.duration_since(p.since) < t);
            !list.is_empty()
        });
    }

    /// Close every idle connection (a stopping worker, while its runtime can still submit
    /// the closes).
    pub fn clear(&mut self) {
        self.idle.clear();
    }

    pub fn idle_count(&self) -> usize {
        self.idle.iter().map(|(_, l)| l.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A connection is looked at on reuse once LOOK_EVERY has passed since it was last
    /// looked at (or made), however briefly it sat idle: one the peer wrote to is dropped
    /// then, and the quiet one taken instead. Within LOOK_EVERY it is not looked at (the
    /// control: the written-to connection is taken, no system call).
    #[test]
    fn a_connection_written_to_is_dropped_at_its_next_look() {
        let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        rt.block_on(async {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let mut pool = UpstreamPool::new(4, Duration::from_secs(4));
            let t0 = Instant::now();
            // Two pooled connections: the peer writes on one (an unsolicited 408, or a
            // broken peer's second response), the other stays quiet.
            let written = TcpStream::connect(addr).await.unwrap();
            let (mut peer_w, _) = l.accept().unwrap();
            let quiet = TcpStream::connect(addr).await.unwrap();
            let (_peer_q, _) = l.accept().unwrap();
            peer_w
                .write_all(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
                .unwrap();
            std::thread::sleep(Duration::from_millis(20));
            let fd = written.as_raw_fd();
            // Looked at less than LOOK_EVERY ago: not looked at again.
            pool.put(addr, written, t0, t0);
            let (s, looked) = pool.take(addr, t0 + Duration::from_millis(1)).unwrap();
            assert_eq!((s.as_raw_fd(), looked), (fd, t0));
            // Idle for only a moment, but last looked at LOOK_EVERY ago: looked at and
            // dropped; the quiet one is taken instead, and its look is recorded.
            let late = t0 + LOOK_EVERY;
            pool.put(addr, quiet, late, t0);
            let quiet_fd = pool.idle[0].1[0].stream.as_raw_fd();
            pool.put(addr, s, late, t0);
            let (got, looked) = pool.take(addr, late).unwrap();
            assert_eq!(
                got.as_raw_fd(),
                quiet_fd,
                "the written-to connection was reused"
            );
            assert_eq!(looked, late);
            assert_eq!(pool.idle_count(), 0);
        });
    }
}
