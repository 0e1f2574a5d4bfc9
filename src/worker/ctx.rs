//! Per-worker state: plain owned values behind `Rc`/`Cell`/`RefCell`, never shared across
//! threads.

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io::Write;
use std::rc::Rc;
use std::sync::Arc;

use warmroute_shm::WorkerId;

use super::{AccessLogTarget, LocalNotify, Shared};
use crate::snapshot::Snapshot;
use crate::upstream::UpstreamPool;

/// Which listener a connection came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortKind {
    Public,
    Admin,
}

/// Everything one worker owns.
pub struct WorkerCtx {
    pub index: usize,
    pub wid: WorkerId,
    pub shared: Arc<Shared>,
    /// `Rc` around the shared `Arc`: taking it per request touches no shared refcount.
    #[allow(clippy::redundant_allocation)]
    snapshot: RefCell<Rc<Arc<Snapshot>>>,
    pub upstreams: RefCell<UpstreamPool>,
    pub drain: LocalNotify,
    pub active_conns: Cell<usize>,
    /// Listeners still accepting (a draining worker finishes only when they have closed).
    pub accepting: Cell<usize>,
    rng: Cell<u64>,
    pub driver: &'static str,
    pub access_log: RefCell<AccessLog>,
    /// Spare relay buffers, so a request does not allocate its read buffer.
    bufs: RefCell<Vec<Vec<u8>>>,
    /// This worker's body-log sender, when a listener is configured (fixed at start).
    pub bodylog: Option<Rc<crate::bodylog::sender::Sender>>,
}

/// Spare relay buffers kept per worker (each `RELAY_READ_BUF_BYTES`).
const SPARE_BUFS_MAX: usize = 256;

impl WorkerCtx {
    pub fn new(
        index: usize,
        wid: WorkerId,
        shared: Arc<Shared>,
        snapshot: Arc<Snapshot>,
        driver: &'static str,
        log: &AccessLogTarget,
    ) -> WorkerCtx {
        let server = &snapshot.config.server;
        let pool = UpstreamPool::new(
            server.upstream_idle_per_peer,
            std::time::Duration::from_millis(server.upstream_idle_timeout_ms),
        );
        let bodylog = server.bodylog_listener.as_deref().and_then(|l| {
            use std::net::ToSocketAddrs;
            match l.to_socket_addrs().map(|mut a| a.next()) {
                Ok(Some(addr)) => Some(crate::bodylog::sender::Sender::new(addr)),
                _ => {
                    tracing::error!(
                        listener = l,
                        "body-log listener address does not resolve; body logging is off"
                    );
                    None
                }
            }
        });
        let seed = (std::process::id() as u64) << 32
            ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ shared.started.elapsed().as_nanos() as u64;
        WorkerCtx {
            index,
            wid,
            shared,
            snapshot: RefCell::new(Rc::new(snapshot)),
            upstreams: RefCell::new(pool),
            drain: LocalNotify::default(),
            active_conns: Cell::new(0),
            accepting: Cell::new(0),
            rng: Cell::new(seed | 1),
            driver,
            access_log: RefCell::new(AccessLog::open(log)),
            bufs: RefCell::new(Vec::new()),
            bodylog,
        }
    }

    /// The snapshot new requests start with.
    pub fn snapshot(&self) -> Rc<Arc<Snapshot>> {
        self.snapshot.borrow().clone()
    }

    pub fn swap_snapshot(&self, s: Arc<Snapshot>) {
        let server = &s.config.server;
        self.upstreams.borrow_mut().configure(
            server.upstream_idle_per_peer,
            std::time::Duration::from_millis(server.upstream_idle_timeout_ms),
        );
        *self.snapshot.borrow_mut() = Rc::new(s);
    }

    /// A relay buffer: a spare one, or a new one.
    pub fn take_buf(&self) -> Vec<u8> {
        self.bufs
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(crate::limits::RELAY_READ_BUF_BYTES))
    }

    /// Give a relay buffer back for reuse (dropped when enough are spare, or when it grew
    /// or shrank: a streaming relay may end with a small one).
    pub fn put_buf(&self, mut b: Vec<u8>) {
        let mut bufs = self.bufs.borrow_mut();
        let cap = b.capacity();
        let full_size = (crate::limits::RELAY_READ_BUF_BYTES
            ..=4 * crate::limits::RELAY_READ_BUF_BYTES)
            .contains(&cap);
        if bufs.len() < SPARE_BUFS_MAX && full_size {
            b.clear();
            bufs.push(b);
        }
    }

    /// xorshift64*: cheap randomness for tie-breaks, no syscalls, no locks.
    pub fn random(&self) -> u64 {
        let mut x = self.rng.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng.set(x);
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Per-worker buffered access log: whole lines, flushed by the worker tick or when the
/// buffer fills, written with one `write` each so lines of different workers never mix.
pub struct AccessLog {
    out: Option<File>,
    buf: Vec<u8>,
    dropped: u64,
}

/// Flush when the buffer holds this much.
const ACCESS_LOG_FLUSH_BYTES: usize = 32 * 1024;
/// Never hold more than this; lines beyond it are dropped and counted (a stuck stderr must
/// not grow memory).
const ACCESS_LOG_BUF_MAX: usize = 1024 * 1024;

impl AccessLog {
    fn open(target: &AccessLogTarget) -> AccessLog {
        let out = match target {
            AccessLogTarget::Off => None,
            // O_APPEND on the same file stderr points to: safe when stderr is a file, a
            // pipe or a terminal.
            AccessLogTarget::Stderr => std::fs::OpenOptions::new()
                .append(true)
                .open("/proc/self/fd/2")
                .ok(),
            AccessLogTarget::File(p) => std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok(),
        };
        AccessLog {
            out,
            buf: Vec::new(),
            dropped: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        self.out.is_some()
    }

    /// Append one JSON line.
    pub fn line(&mut self, v: &serde_json::Value) {
        if self.out.is_none() {
            return;
        }
        if self.buf.len() > ACCESS_LOG_BUF_MAX {
            self.dropped += 1;
            return;
        }
        if serde_json::to_writer(&mut self.buf, v).is_ok() {
            self.buf.push(b'\n');
        }
        if self.buf.len() >= ACCESS_LOG_FLUSH_BYTES {
            self.flush();
        }
    }

    pub fn flush(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        if let Some(f) = self.out.as_mut() {
            let _ = f.write_all(&self.buf);
        }
        self.buf.clear();
    }

    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}
