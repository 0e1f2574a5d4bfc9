//! Per-worker keep-alive pool of upstream connections, keyed by peer address.
//!
//! Bounded: at most `per_peer_max` idle connections per peer, each kept at most
//! `idle_timeout`. Taking returns the most recently used connection (warmest, least
//! likely to have been closed by the peer). A connection the peer closed while idle is
//! found out on use; the caller retries once on a fresh connection.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use monoio::net::TcpStream;

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
            if now.duration_since(since) < self.idle_timeout {
                return Some(s);
            }
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
