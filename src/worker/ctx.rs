//! Per-worker state: plain owned values behind `Rc`/`Cell`/`RefCell`, never shared across
//! threads.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::{Arc, Weak};

use warmroute_shm::WorkerId;

use super::{AccessLog, AccessLogTarget, LocalNotify, Shared};
use crate::snapshot::{RouteRt, Snapshot};
use crate::upstream::UpstreamPool;

/// The busy polling the server file asks for, off on the epoll fallback, and `"auto"` off
/// under a CPU quota smaller than the worker count (see [`super::busy_poll`]).
fn busy_poll_mode(s: &Snapshot, driver: &str, workers: usize) -> super::busy_poll::Mode {
    use super::busy_poll::Mode;
    use crate::config::BusyPoll;
    if driver != "io_uring" {
        return Mode::Off;
    }
    match s.config.server.busy_poll {
        BusyPoll::Off => Mode::Off,
        BusyPoll::Window(us) => Mode::Window(std::time::Duration::from_micros(us)),
        BusyPoll::Auto if super::quota::room_to_poll(workers) => Mode::Auto,
        BusyPoll::Auto => Mode::Off,
    }
}

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
    /// The routes of snapshots this worker swapped out, for as long as anything (a request,
    /// a health probe) still holds them: their peer and route slots are stamped as in use
    /// ([`WorkerCtx::touch_slots`]) until the last holder lets go.
    retired: RefCell<Vec<Weak<RouteRt>>>,
    /// The same for the swapped-out snapshots themselves (a request holds its snapshot),
    /// for the rows of their key owners.
    retired_snaps: RefCell<Vec<Weak<Snapshot>>>,
    pub upstreams: RefCell<UpstreamPool>,
    pub drain: LocalNotify,
    pub active_conns: Cell<usize>,
    /// Listeners still accepting (a draining worker finishes only when they have closed).
    pub accepting: Cell<usize>,
    rng: Cell<u64>,
    pub driver: &'static str,
    pub access_log: RefCell<AccessLog>,
    /// Spare relay buffers, so a request does not allocate its read buffer.
    bufs: Spares,
    /// Spare body tails (see `relay::Tail`), for the same reason.
    tails: Spares,
    /// Spare head buffers: the request for the peer and the response head for the client.
    heads: Spares,
    /// Spare client read buffers, given back by connections that do not need theirs for a
    /// while (an event stream, a closed connection).
    inbufs: Spares,
    /// Spare per-request peer-load lists (see [`WorkerCtx::loads`]).
    loads: SpareVecs<crate::pipeline::peer_select::Load>,
    /// Spare request-body buffers for large bodies (see [`SpareBodies`]).
    pub bodies: SpareBodies,
    /// The body-log sender for the server file's `[bodylog] listener`, replaced when a
    /// reload names another listener (or none).
    bodylog: RefCell<Option<Rc<crate::bodylog::sender::Sender>>>,
    /// Wall-clock milliseconds for the monotonic times a request already took.
    pub wall: WallClock,
    /// Requests started and finished, for the busy-poll task (`busy_poll_us`).
    pub busy_poll: super::busy_poll::Activity,
}

/// A bounded free list of small vectors: at most `SPARE_BUFS_MAX` kept, none with room
/// for more than [`SPARE_VEC_LEN_MAX`] items (a list sized for a very large pool is freed).
pub struct SpareVecs<T> {
    list: RefCell<Vec<Vec<T>>>,
}

/// The largest capacity a [`SpareVecs`] keeps.
const SPARE_VEC_LEN_MAX: usize = 64;

impl<T> Default for SpareVecs<T> {
    fn default() -> Self {
        SpareVecs {
            list: RefCell::new(Vec::new()),
        }
    }
}

impl<T> SpareVecs<T> {
    /// An empty vector, a kept one when there is one.
    fn take(&self) -> Vec<T> {
        self.list.borrow_mut().pop().unwrap_or_default()
    }

    /// Keep `v`, emptied, unless the list is full or `v` is too large.
    fn put(&self, mut v: Vec<T>) {
        let mut list = self.list.borrow_mut();
        if list.len() < SPARE_BUFS_MAX && v.capacity() <= SPARE_VEC_LEN_MAX {
            v.clear();
            list.push(v);
        }
    }
}

/// A request's peer-load list, lent by [`WorkerCtx::loads`] and given back when dropped.
pub struct SpareLoads<'a> {
    spares: &'a SpareVecs<crate::pipeline::peer_select::Load>,
    v: Vec<crate::pipeline::peer_select::Load>,
}

impl std::ops::Deref for SpareLoads<'_> {
    type Target = Vec<crate::pipeline::peer_select::Load>;
    fn deref(&self) -> &Self::Target {
        &self.v
    }
}

impl std::ops::DerefMut for SpareLoads<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.v
    }
}

impl Drop for SpareLoads<'_> {
    fn drop(&mut self) {
        self.spares.put(std::mem::take(&mut self.v));
    }
}

/// Wall-clock milliseconds (`warmroute_shm::now_ms`'s clock) for a monotonic `Instant` the
/// caller already has, without a second clock read per request: the wall time is read
/// once, with the `Instant` it goes with, and later times are that plus the monotonic
/// time since (an `Instant` before the anchor is counted back from it). Read again once an
/// `Instant` is [`WALL_ANCHOR_MAX`] past the anchor, so a stepped or slewed wall clock is
/// followed within that long.
#[derive(Default)]
pub struct WallClock {
    anchor: Cell<Option<(std::time::Instant, u64)>>,
}

/// How old a [`WallClock`] anchor may get before the wall clock is read again.
pub const WALL_ANCHOR_MAX: std::time::Duration = std::time::Duration::from_secs(1);

impl WallClock {
    /// Wall-clock milliseconds at `at`.
    pub fn ms_at(&self, at: std::time::Instant) -> u64 {
        self.ms_at_with(at, || (std::time::Instant::now(), warmroute_shm::now_ms()))
    }

    /// [`Self::ms_at`], reading both clocks through `now` when the anchor is missing or
    /// more than [`WALL_ANCHOR_MAX`] older than `at`.
    fn ms_at_with(
        &self,
        at: std::time::Instant,
        now: impl FnOnce() -> (std::time::Instant, u64),
    ) -> u64 {
        let (t, ms) = match self.anchor.get() {
            Some((t, ms)) if at.saturating_duration_since(t) < WALL_ANCHOR_MAX => (t, ms),
            _ => {
                let fresh = now();
                self.anchor.set(Some(fresh));
                fresh
            }
        };
        match at.checked_duration_since(t) {
            Some(d) => ms + d.as_millis() as u64,
            None => ms.saturating_sub(t.duration_since(at).as_millis() as u64),
        }
    }
}

/// Spare buffers of each kind kept per worker.
const SPARE_BUFS_MAX: usize = 256;

/// Head buffers start this large: a usual request head with its JSON body, or a usual
/// response head, fits without growing; one that grew up to 4x is still kept.
const HEAD_BUF_BYTES: usize = 2048;

/// A bounded free list of byte buffers of one size: a buffer given back is cleared and
/// kept (up to `SPARE_BUFS_MAX`) unless its capacity has left `size..=4 * size` — a
/// relay that shrank its buffer for a slow stream, or one that grew for a large head.
/// Buffers above glibc's per-thread cache limit (1 KiB) cost a trip through the general
/// allocator each time, which the profile showed at ~1% of a request per buffer.
pub struct Spares {
    list: RefCell<Vec<Vec<u8>>>,
    size: usize,
}

impl Spares {
    pub fn new(size: usize) -> Spares {
        Spares {
            list: RefCell::new(Vec::new()),
            size,
        }
    }

    /// An empty buffer of at least `size` bytes' capacity.
    pub fn take(&self) -> Vec<u8> {
        self.list
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.size))
    }

    pub fn put(&self, mut b: Vec<u8>) {
        let mut list = self.list.borrow_mut();
        if list.len() < SPARE_BUFS_MAX && (self.size..=4 * self.size).contains(&b.capacity()) {
            b.clear();
            list.push(b);
        }
    }

    /// Buffers kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.list.borrow().len()
    }
}

/// A bounded free list of request-body buffers for large bodies (a prompt is tens to
/// hundreds of KB). Freeing such a buffer lets glibc give the top of its heap back to the
/// kernel, and the next body of that size then faults its pages in afresh as the kernel
/// copies into them: 5–8% of the CPU of a proxied 51.5 KB prompt (`perf`, page faults under
/// `_copy_to_iter`). Bodies below [`BODY_SPARE_MIN`] take an exact buffer from the
/// allocator's caches as before. Buffers are taken by first fit; new ones for pooled sizes
/// are rounded up to a power of two, so the growing prompt of a conversation finds a spare
/// for several turns. At most [`BODY_SPARES_MAX`] buffers and [`BODY_SPARE_BYTES_MAX`]
/// bytes are kept per worker; a buffer above [`BODY_SPARE_CAP_MAX`] is never kept.
#[derive(Default)]
pub struct SpareBodies {
    list: RefCell<Vec<Vec<u8>>>,
}

/// The smallest body that takes a pooled buffer.
pub const BODY_SPARE_MIN: usize = 16 * 1024;
/// The largest buffer kept.
pub const BODY_SPARE_CAP_MAX: usize = 1024 * 1024;
/// Buffers kept per worker.
pub const BODY_SPARES_MAX: usize = 16;
/// Capacity kept per worker, all buffers together.
pub const BODY_SPARE_BYTES_MAX: usize = 4 * 1024 * 1024;

impl SpareBodies {
    /// An empty buffer with room for `n` bytes, and for the member the usage injection
    /// may add (inserted in place, without a copy of the body).
    pub fn take(&self, n: usize) -> Vec<u8> {
        let n = n + crate::transform::USAGE_MEMBER.len();
        if n < BODY_SPARE_MIN {
            return Vec::with_capacity(n);
        }
        let mut list = self.list.borrow_mut();
        if let Some(i) = list.iter().position(|b| b.capacity() >= n) {
            return list.swap_remove(i);
        }
        if n <= BODY_SPARE_CAP_MAX {
            Vec::with_capacity(n.next_power_of_two())
        } else {
            Vec::with_capacity(n)
        }
    }

    /// Keep a body's buffer for a later body, when nothing else holds it (a body-log
    /// capture may) and it is of a size the list keeps.
    pub fn put(&self, body: bytes::Bytes) {
        if !(BODY_SPARE_MIN..=BODY_SPARE_CAP_MAX).contains(&body.len()) {
            return;
        }
        let Ok(mut b) = body.try_into_mut() else {
            return;
        };
        // Emptied first: the conversion to a Vec then moves no bytes.
        b.clear();
        let b = Vec::from(b);
        let mut list = self.list.borrow_mut();
        let kept: usize = list.iter().map(Vec::capacity).sum();
        if list.len() < BODY_SPARES_MAX
            && b.capacity() <= BODY_SPARE_CAP_MAX
            && kept + b.capacity() <= BODY_SPARE_BYTES_MAX
        {
            list.push(b);
        }
    }

    /// Buffers kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.list.borrow().len()
    }
}

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
        let bodylog = RefCell::new(bodylog_sender(
            server.bodylog_listener.as_deref(),
            &shared.seg,
        ));
        let seed = (std::process::id() as u64) << 32
            ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ shared.started.elapsed().as_nanos() as u64;
        let ctx = WorkerCtx {
            index,
            wid,
            shared,
            snapshot: RefCell::new(Rc::new(snapshot)),
            retired: RefCell::new(Vec::new()),
            retired_snaps: RefCell::new(Vec::new()),
            upstreams: RefCell::new(pool),
            drain: LocalNotify::default(),
            active_conns: Cell::new(0),
            accepting: Cell::new(0),
            rng: Cell::new(seed | 1),
            driver,
            access_log: RefCell::new(AccessLog::open(log)),
            bufs: Spares::new(crate::limits::RELAY_READ_BUF_BYTES),
            tails: Spares::new(crate::pipeline::relay::TAIL_BYTES),
            heads: Spares::new(HEAD_BUF_BYTES),
            inbufs: Spares::new(crate::limits::CLIENT_READ_BUF_BYTES),
            bodylog,
            wall: WallClock::default(),
            loads: SpareVecs::default(),
            bodies: SpareBodies::default(),
            busy_poll: Default::default(),
        };
        ctx.busy_poll.set_mode(busy_poll_mode(
            &ctx.snapshot.borrow(),
            driver,
            ctx.shared.workers_total,
        ));
        ctx
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
        self.busy_poll
            .set_mode(busy_poll_mode(&s, self.driver, self.shared.workers_total));
        let listener = s.config.server.bodylog_listener.clone();
        let before = std::mem::replace(&mut *self.snapshot.borrow_mut(), Rc::new(s));
        self.retired
            .borrow_mut()
            .extend(before.routes.iter().map(Arc::downgrade));
        self.retired_snaps
            .borrow_mut()
            .push(Arc::downgrade(&before));
        if before.config.server.bodylog_listener != listener {
            // A reload that names another body-log listener, or none: the old sender stops
            // (what it still queued is dropped and counted) and a new one starts.
            let fresh = bodylog_sender(listener.as_deref(), &self.shared.seg);
            if let Some(sender) = &fresh {
                monoio::spawn(sender.clone().run());
            }
            if let Some(old) = self.bodylog.replace(fresh) {
                old.stop();
            }
            tracing::info!(
                worker = self.index,
                listener = listener.as_deref().unwrap_or("(off)"),
                "body-log listener changed"
            );
        }
    }

    /// Stamp every peer and route slot this worker may still use as in use at `now_ms`:
    /// those of its snapshot and of the swapped-out routes and snapshots something still
    /// holds (a request started on an older configuration, a health probe), forgetting the
    /// ones nobody holds any more. The lease holder frees slots nobody has stamped for a
    /// while (`control::SLOT_IDLE_MS`), so a slot is never freed under a request or a task
    /// of this process.
    pub fn touch_slots(&self, now_ms: u64) {
        let seg = &self.shared.seg;
        let snap = self.snapshot();
        let touch = |r: &RouteRt| {
            r.all_peers().for_each(|p| seg.touch_peer(p.slot, now_ms));
            r.route_slots().for_each(|s| seg.touch_route(s, now_ms));
        };
        let touch_owners = |s: &Snapshot| {
            s.owners
                .iter()
                .for_each(|(_, slot)| seg.touch_route(*slot, now_ms))
        };
        snap.routes.iter().for_each(|r| touch(r));
        touch_owners(&snap);
        self.retired.borrow_mut().retain(|w| match w.upgrade() {
            Some(r) => {
                touch(&r);
                true
            }
            None => false,
        });
        self.retired_snaps
            .borrow_mut()
            .retain(|w| match w.upgrade() {
                Some(s) => {
                    touch_owners(&s);
                    true
                }
                None => false,
            });
    }

    /// The running body-log sender, if body logging has a listener.
    pub fn bodylog(&self) -> Option<Rc<crate::bodylog::sender::Sender>> {
        self.bodylog.borrow().clone()
    }

    /// Whether body logging has a listener: no reference count is touched.
    pub fn bodylog_on(&self) -> bool {
        self.bodylog.borrow().is_some()
    }

    /// A relay buffer: a spare one, or a new one.
    pub fn take_buf(&self) -> Vec<u8> {
        self.bufs.take()
    }

    /// Give a relay buffer back for reuse.
    pub fn put_buf(&self, b: Vec<u8>) {
        self.bufs.put(b)
    }

    /// The spare relay buffers themselves, for a relay that gives one back midway.
    pub fn spare_bufs(&self) -> &Spares {
        &self.bufs
    }

    /// A buffer to write a head (and a small body) into.
    pub fn take_head_buf(&self) -> Vec<u8> {
        self.heads.take()
    }

    /// The spare head buffers, for the relay to give the client's head buffer back to.
    pub fn spare_heads(&self) -> &Spares {
        &self.heads
    }

    /// A client read buffer: a spare one, or a new one.
    pub fn take_inbuf(&self) -> Vec<u8> {
        self.inbufs.take()
    }

    /// Give a client read buffer back for reuse (its bytes are dropped).
    pub fn put_inbuf(&self, b: Vec<u8>) {
        self.inbufs.put(b)
    }

    /// A body tail for a relay; `json`: it also keeps a `usage` that leaves it.
    pub fn take_tail(&self, json: bool) -> crate::pipeline::relay::Tail {
        let mut t = crate::pipeline::relay::Tail::with_buf(self.tails.take());
        if json {
            t.watch_json();
        }
        t
    }

    pub fn put_tail(&self, t: crate::pipeline::relay::Tail) {
        self.tails.put(t.into_buf())
    }

    /// An empty list for a request's peer loads, handed back to the worker when dropped
    /// (at most `SPARE_BUFS_MAX` kept): a request does not allocate one.
    pub fn loads(&self) -> SpareLoads<'_> {
        SpareLoads {
            spares: &self.loads,
            v: self.loads.take(),
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

/// A body-log sender for `listener` (`None` or unresolvable: body logging is off). A
/// record lost after it was queued (a failed or stalled write, a stop) counts as dropped
/// for its route, as one the full queue refused does.
fn bodylog_sender(
    listener: Option<&str>,
    seg: &Arc<warmroute_shm::Segment>,
) -> Option<Rc<crate::bodylog::sender::Sender>> {
    use std::net::ToSocketAddrs;
    let l = listener?;
    match l.to_socket_addrs().map(|mut a| a.next()) {
        Ok(Some(addr)) => {
            let sender = crate::bodylog::sender::Sender::new(addr);
            let seg = seg.clone();
            sender.set_on_lost(Box::new(move |slot| {
                let Ok(slot) = u32::try_from(slot) else {
                    return;
                };
                seg.route_cell(
                    warmroute_shm::RouteSlot(slot),
                    crate::cells::route::BODYLOG_DROPPED,
                )
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }));
            Some(sender)
        }
        _ => {
            tracing::error!(
                listener = l,
                "body-log listener address does not resolve; body logging is off"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spares_hand_back_the_same_buffer_cleared_and_drop_the_odd_sizes() {
        let s = Spares::new(1024);
        let mut b = s.take();
        assert!(b.capacity() >= 1024);
        b.extend_from_slice(b"left over");
        let ptr = b.as_ptr();
        s.put(b);
        assert_eq!(s.len(), 1);
        let again = s.take();
        assert_eq!(again.as_ptr(), ptr, "the spare buffer is reused");
        assert!(again.is_empty(), "a reused buffer comes back cleared");
        assert_eq!(s.len(), 0);
        // Shrunk (a slow stream's small buffer) or grown past 4x: not kept.
        s.put(Vec::with_capacity(100));
        s.put(Vec::with_capacity(8 * 1024));
        assert_eq!(s.len(), 0);
        // At most SPARE_BUFS_MAX kept.
        for _ in 0..SPARE_BUFS_MAX + 10 {
            s.put(Vec::with_capacity(1024));
        }
        assert_eq!(s.len(), SPARE_BUFS_MAX);
    }

    #[test]
    fn spare_bodies_reuse_large_buffers_within_their_bounds() {
        use bytes::Bytes;
        let s = SpareBodies::default();
        // Small bodies take a buffer of their size, with room for the usage member the
        // injection may insert, and are never kept.
        let small = s.take(100);
        assert_eq!(small.capacity(), 100 + crate::transform::USAGE_MEMBER.len());
        s.put(Bytes::from(vec![b'x'; 100]));
        assert_eq!(s.len(), 0);
        // A large body's buffer comes back, emptied, for the next body that fits.
        let mut b = s.take(50_000);
        assert_eq!(b.capacity(), 65_536, "rounded up to a power of two");
        b.resize(50_000, b'x');
        let ptr = b.as_ptr();
        s.put(Bytes::from(b));
        assert_eq!(s.len(), 1);
        let again = s.take(60_000);
        assert_eq!(again.as_ptr(), ptr, "the spare buffer is reused");
        assert!(again.is_empty() && again.capacity() >= 60_000);
        assert_eq!(s.len(), 0);
        // A body someone else still holds (a body-log capture) is not taken.
        let held = Bytes::from(vec![b'x'; 20_000]);
        let capture = held.clone();
        s.put(held);
        assert_eq!(s.len(), 0);
        drop(capture);
        // No spare fits: a new buffer, the spare stays.
        s.put(Bytes::from(vec![b'x'; 20_000]));
        assert_eq!(s.take(30_000).capacity(), 32_768);
        assert_eq!(s.len(), 1);
        // Bounded in count and in bytes; oversized buffers are not kept.
        s.put(Bytes::from(vec![b'x'; BODY_SPARE_CAP_MAX + 1]));
        assert_eq!(s.len(), 1);
        for _ in 0..BODY_SPARES_MAX + 4 {
            s.put(Bytes::from(vec![b'x'; BODY_SPARE_MIN]));
        }
        assert_eq!(s.len(), BODY_SPARES_MAX);
        let s = SpareBodies::default();
        for _ in 0..BODY_SPARES_MAX {
            s.put(Bytes::from(vec![b'x'; BODY_SPARE_CAP_MAX]));
        }
        assert_eq!(s.len(), BODY_SPARE_BYTES_MAX / BODY_SPARE_CAP_MAX);
    }

    #[test]
    fn wall_clock_reads_the_wall_once_per_anchor_and_follows_the_monotonic_time() {
        use std::time::{Duration, Instant};
        let w = WallClock::default();
        let t0 = Instant::now();
        let reads = Cell::new(0);
        let now = |t: Instant, ms: u64| {
            reads.set(reads.get() + 1);
            (t, ms)
        };
        // The first time anchors.
        assert_eq!(w.ms_at_with(t0, || now(t0, 1_000_000)), 1_000_000);
        // Within the anchor's second: no read, the monotonic time since added.
        let t1 = t0 + Duration::from_millis(250);
        assert_eq!(w.ms_at_with(t1, || now(t1, 0)), 1_000_250);
        // An earlier time than the anchor: counted back, no read.
        assert_eq!(w.ms_at_with(t0, || now(t0, 0)), 1_000_000);
        assert_eq!(reads.get(), 1);
        // A second on: the wall clock is read again, and a step in it is followed.
        let t2 = t0 + WALL_ANCHOR_MAX;
        assert_eq!(w.ms_at_with(t2, || now(t2, 5_000_000)), 5_000_000);
        assert_eq!(reads.get(), 2);
        let t3 = t2 + Duration::from_millis(10);
        assert_eq!(w.ms_at_with(t3, || now(t3, 0)), 5_000_010);
        // An anchor read after `at` (a time the caller took earlier) counts back to it.
        let w = WallClock::default();
        let late = t0 + Duration::from_millis(3);
        assert_eq!(w.ms_at_with(t0, || (late, 2_000_003)), 2_000_000);
        // The real clocks agree with warmroute_shm::now_ms to within a few milliseconds.
        let w = WallClock::default();
        let a = w.ms_at(Instant::now());
        let b = warmroute_shm::now_ms();
        assert!(b.abs_diff(a) < 50, "{a} vs {b}");
    }

    #[test]
    fn spare_vecs_hand_back_emptied_vectors_and_drop_large_ones() {
        let s: SpareVecs<u64> = SpareVecs::default();
        let mut v = s.take();
        v.extend([1, 2, 3]);
        let ptr = v.as_ptr();
        s.put(v);
        let again = s.take();
        assert!(again.is_empty(), "no stale items");
        assert_eq!(again.as_ptr(), ptr, "the same allocation");
        s.put(Vec::with_capacity(SPARE_VEC_LEN_MAX + 1));
        assert!(s.take().capacity() == 0, "a large vector is not kept");
        for _ in 0..SPARE_BUFS_MAX + 10 {
            s.put(Vec::with_capacity(4));
        }
        assert_eq!(s.list.borrow().len(), SPARE_BUFS_MAX);
    }
}
