//! Per-worker keep-alive pool of upstream connections, keyed by peer address.
//!
//! Bounded: at most `per_peer_max` idle connections per peer, each kept at most
//! `idle_timeout`. Taking returns the most recently used connection (warmest, least
//! likely to have been closed by the peer). A connection idle for [`LOOK_AFTER`] or more
//! is looked at first: one the peer wrote to while it was idle (an unsolicited 408 when
//! the peer's idle timer fired) or closed is dropped, since those bytes would be read as
//! the next request's response. A close that comes later is found out on use; the caller
//! retries once on a fresh connection.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use monoio::net::TcpStream;
use warmroute_shm::Pending;

/// How long a connection sits idle before it is looked at on reuse. A peer writes on an
/// idle connection when a timer of its own fires, after seconds; a connection reused
/// sooner (every one, under load) costs no system call. Bytes a broken peer sends after
/// its response within this window are still read as the next response.
pub const LOOK_AFTER: Duration = Duration::from_millis(10);

pub struct UpstreamPool {
    /// Per peer address, idle connections oldest first. A short list scanned linearly:
    /// faster than hashing for the handful of peers a worker talks to.
    idle: Vec<(SocketAddr, VecDeque<(TcpStream, Instant)>)>,
    per_peer_max: usize,
    idle_timeout: Duration,
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

    pub fn take(&mut self, addr: SocketAddr, now: Instant) -> Option<TcpStream> {
        let list = &mut self.idle.iter_mut().find(|(a, _)| *a == addr)?.1;
        while let Some((s, since)) = list.pop_back() {
            let idle = now.saturating_duration_since(since);
            if idle >= self.idle_timeout {
                continue;
            }
            if idle >= LOOK_AFTER
                && warmroute_shm::socket_pending(s.as_raw_fd()) != Pending::Nothing
            {
                continue;
            }
            return Some(s);
        }
        None
    }

    pub fn put(&mut self, addr: SocketAddr, stream: TcpStream, now: Instant) {
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
        list.push_back((stream, now));
    }

    pub fn evict_expired(&mut self, now: Instant) {
        let t = self.idle_timeout;
        self.idle.retain_mut(|(_, list)| {
            list.retain(|(_, since)| now.duration_since(*since) < t);
            !list.is_empty()
        });
    }

    pub fn idle_count(&self) -> usize {
        self.idle.iter().map(|(_, l)| l.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_connection_written_to_while_idle_is_dropped_once_idle_long_enough_to_look() {
        let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        rt.block_on(async {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let mut pool = UpstreamPool::new(4, Duration::from_secs(4));
            let t0 = Instant::now();
            // Two pooled connections: the peer writes on one while it is idle (an
            // unsolicited 408), the other stays quiet.
            let written = TcpStream::connect(addr).await.unwrap();
            let (mut peer_w, _) = l.accept().unwrap();
            let quiet = TcpStream::connect(addr).await.unwrap();
            let (_peer_q, _) = l.accept().unwrap();
            peer_w
                .write_all(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
                .unwrap();
            std::thread::sleep(Duration::from_millis(20));
            let fd = written.as_raw_fd();
            // Reused within LOOK_AFTER: not looked at (no system call under load).
            pool.put(addr, written, t0);
            let s = pool.take(addr, t0 + Duration::from_millis(1)).unwrap();
            assert_eq!(s.as_raw_fd(), fd);
            // Idle past LOOK_AFTER: looked at and dropped; the quiet one is taken instead.
            pool.put(addr, quiet, t0);
            let quiet_fd = pool.idle[0].1[0].0.as_raw_fd();
            pool.put(addr, s, t0);
            let got = pool.take(addr, t0 + LOOK_AFTER).unwrap();
            assert_eq!(
                got.as_raw_fd(),
                quiet_fd,
                "the written-to connection was reused"
            );
            assert_eq!(pool.idle_count(), 0);
        });
    }
}
