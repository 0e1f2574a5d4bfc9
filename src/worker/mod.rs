//! Workers: one monoio runtime per pinned core, each with its own SO_REUSEPORT listeners,
//! upstream pool and config snapshot.
//!
//! Reads: the listeners handed over by the main thread, config snapshots from a channel.
//! Decides: when to stop accepting and when the worker is done draining.
//! Writes: its own in-flight row and heartbeat in the segment. Never: blocks on another
//! thread; the only cross-thread traffic is the segment's atomics and the snapshot channel.

mod access_log;
pub mod busy_poll;
pub mod contain;
mod ctx;
mod listen;
pub use listen::served as port_served;
pub use listen::{freed_within as port_freed_within, PORT_FREE_WAIT};
mod notify;
mod pin;
pub mod quota;
pub mod stderr;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use warmroute_shm::{Segment, WorkerId};

pub use access_log::{AccessLog, Line};
pub use ctx::{PortKind, SpareBodies, Spares, WorkerCtx};
pub use listen::bind_shared;
pub use notify::{Fired, LocalNotify};

use crate::snapshot::Snapshot;
use crate::util::{race, Either};

/// How often each worker looks at the snapshot channel, the drain flag and its heartbeat.
const TICK: Duration = Duration::from_millis(50);
/// How often each worker stamps the peer and route slots it may use (see
/// [`WorkerCtx::touch_slots`]): well within `control::SLOT_IDLE_MS`, less the
/// heartbeat silence that stops the freeing (`control::SLOT_BEAT_MS`).
const SLOT_STAMP: Duration = Duration::from_secs(1);
/// How long after the drain deadline a worker waits for the responses cut there to write
/// their access lines.
const DRAIN_CUT_GRACE: Duration = Duration::from_millis(100);

/// State every worker and the main thread share: atomics and the segment only.
pub struct Shared {
    pub seg: Arc<Segment>,
    pub draining: AtomicBool,
    pub drain_deadline_ms: AtomicU64,
    /// Bumped to have every worker reopen its access-log file (SIGUSR1, SIGHUP: after a
    /// log rotation moved it away).
    pub log_reopens: AtomicU64,
    pub workers_ready: AtomicUsize,
    pub workers_total: usize,
    pub public_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub started: Instant,
    /// What each worker publishes about itself, by worker index.
    pub per_worker: Vec<WorkerCells>,
}

/// What one worker publishes about itself outside the segment.
#[derive(Default)]
pub struct WorkerCells {
    /// Its driver, an index into [`DRIVER_NAMES`] ("io_uring" or "epoll"), set as it starts.
    pub driver: AtomicUsize,
    /// Its thread's CPU time in nanoseconds as of its last quota settle
    /// ([`quota::settle`]); 0 before the first.
    pub cpu_ns: AtomicU64,
    /// Time it has spent busy polling ([`busy_poll`]), in nanoseconds.
    pub busy_poll_ns: AtomicU64,
    /// Connection tasks that panicked and were ended alone ([`contain`]).
    pub panics: AtomicU64,
}

impl Shared {
    pub fn ready(&self) -> bool {
        self.workers_ready.load(Ordering::Acquire) == self.workers_total
            && !self.draining.load(Ordering::Acquire)
    }
}

/// The segment rows claimed for a router's workers, each with the core it is pinned to.
pub type WorkerRows = Vec<(WorkerId, Option<usize>)>;

pub struct StartOptions {
    /// One worker per row claimed for this process in the segment, with the core it is
    /// pinned to (`None`: not pinned).
    pub rows: WorkerRows,
    /// The affinity mask's cores the rows' cores were chosen from (empty: not pinned);
    /// a worker moves among them ([`Pin::rebalance`]).
    pub cores: Vec<usize>,
    pub public: SocketAddr,
    pub admin: SocketAddr,
    /// Share the ports with the routers already serving them (`--takeover`, `--join`)
    /// instead of refusing to start.
    pub share_ports: bool,
    pub access_log: AccessLogTarget,
}

#[derive(Clone, Debug)]
pub enum AccessLogTarget {
    Off,
    Stderr,
    File(std::path::PathBuf),
}

/// The running set of workers.
pub struct Workers {
    pub shared: Arc<Shared>,
    senders: Vec<Sender<Arc<Snapshot>>>,
    handles: Vec<JoinHandle<()>>,
}

/// Worker count when not configured: cores in the affinity mask, capped by available parallelism.
pub fn default_worker_count() -> usize {
    let mask = core_affinity::get_core_ids().map(|c| c.len()).unwrap_or(1);
    let par = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    mask.min(par).max(1)
}

/// Starts a worker thread: `std::thread::Builder::spawn`, or a stand-in in tests.
type Spawn<'a> = dyn FnMut(std::thread::Builder, Box<dyn FnOnce() + Send + 'static>) -> io::Result<JoinHandle<()>>
    + 'a;

impl Workers {
    /// Bind the listeners and start one worker thread per row. When a thread cannot be
    /// started, the workers already running are stopped and joined before the error
    /// returns, so that the caller can give their rows and ports back.
    pub fn start(
        opts: StartOptions,
        snapshot: Arc<Snapshot>,
        seg: Arc<Segment>,
    ) -> io::Result<Workers> {
        Self::start_with(opts, snapshot, seg, &mut |b, f| b.spawn(f))
    }

    fn start_with(
        opts: StartOptions,
        snapshot: Arc<Snapshot>,
        seg: Arc<Segment>,
        spawn: &mut Spawn<'_>,
    ) -> io::Result<Workers> {
        let n = opts.rows.len();
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "no worker rows",
            ));
        }
        let (public, public_addr) = bind_shared(opts.public, n, opts.share_ports)?;
        let (admin, admin_addr) = bind_shared(opts.admin, n, opts.share_ports)?;
        let shared = Arc::new(Shared {
            seg,
            draining: AtomicBool::new(false),
            drain_deadline_ms: AtomicU64::new(0),
            log_reopens: AtomicU64::new(0),
            workers_ready: AtomicUsize::new(0),
            workers_total: n,
            public_addr,
            admin_addr,
            started: Instant::now(),
            per_worker: (0..n).map(|_| WorkerCells::default()).collect(),
        });
        let cores: Arc<[usize]> = opts.cores.into();
        let mut senders = Vec::with_capacity(n);
        let mut handles = Vec::with_capacity(n);
        for (idx, ((pl, al), &(wid, core))) in
            public.into_iter().zip(admin).zip(&opts.rows).enumerate()
        {
            let (tx, rx) = crossbeam_channel::bounded(4);
            senders.push(tx);
            let theirs = shared.clone();
            let snap = snapshot.clone();
            let cores = cores.clone();
            let log = opts.access_log.clone();
            let builder = std::thread::Builder::new().name(format!("warmroute-w{idx}"));
            let started = spawn(
                builder,
                Box::new(move || {
                    let pin = Pin { wid, core, cores };
                    worker_main(idx, pin, pl, al, rx, theirs, snap, log)
                }),
            );
            match started {
                Ok(h) => handles.push(h),
                Err(e) => {
                    // Stop the workers already serving: with nothing in flight each stops
                    // once its accept loops have closed its listeners, and gives its row
                    // back.
                    let partial = Workers {
                        shared,
                        senders,
                        handles,
                    };
                    partial.drain(Duration::ZERO);
                    partial.join();
                    return Err(e);
                }
            }
        }
        Ok(Workers {
            shared,
            senders,
            handles,
        })
    }

    /// Hand a new snapshot to every worker; each swaps it in between requests.
    pub fn publish(&self, snap: Arc<Snapshot>) {
        for tx in &self.senders {
            // A full channel means the worker has not picked up earlier snapshots yet; it
            // only ever uses the newest, so dropping this one would lose the newest: block
            // briefly instead (the main thread is not on the data path).
            let _ = tx.send_timeout(snap.clone(), Duration::from_secs(5));
        }
    }

    /// Have every worker reopen its access-log file on its next tick.
    pub fn reopen_logs(&self) {
        self.shared.log_reopens.fetch_add(1, Ordering::AcqRel);
    }

    /// Stop accepting; let in-flight requests finish until `timeout`.
    pub fn drain(&self, timeout: Duration) {
        let deadline = warmroute_shm::now_ms() + timeout.as_millis() as u64;
        self.shared
            .drain_deadline_ms
            .store(deadline, Ordering::Release);
        self.shared.draining.store(true, Ordering::Release);
    }

    /// Bring a drain's end forward to `timeout` from now, unless it comes sooner (a SIGINT
    /// during a SIGTERM's drain). Every worker stops by then, plus its cut grace. Requests
    /// still in flight end as at any drain deadline: a relay reads the new deadline at its
    /// next read and ends there with its access line; a wait that began before the cut and
    /// hears nothing more is dropped with the worker, without one.
    pub fn cut_drain(&self, timeout: Duration) {
        let deadline = warmroute_shm::now_ms() + timeout.as_millis() as u64;
        self.shared
            .drain_deadline_ms
            .fetch_min(deadline, Ordering::AcqRel);
    }

    pub fn is_finished(&self) -> bool {
        self.handles.iter().all(|h| h.is_finished())
    }

    pub fn join(self) {
        for h in self.handles {
            let _ = h.join();
        }
    }
}

/// The core ids of the process's affinity mask (empty when it cannot be read).
pub fn mask_cores() -> Vec<usize> {
    core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect()
}

pub use pin::assign as assign_cores;

/// A worker's row and core, and the mask's cores (empty: not pinned).
struct Pin {
    wid: WorkerId,
    core: Option<usize>,
    cores: Arc<[usize]>,
}

impl Pin {
    /// Pin the calling thread to `core`.
    fn apply(idx: usize, core: usize) {
        if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
            tracing::warn!(worker = idx, core, "could not pin worker to its core");
        }
    }

    /// Move to a core no worker of the segment uses, when this worker shares its core with
    /// one of a lower row (a router it started next to has gone since, say).
    fn rebalance(&mut self, idx: usize, seg: &Segment, now: u64) {
        let Some(core) = self.core else { return };
        let live: Vec<(u32, usize)> = seg
            .beating_rows(now, BEATING_MS)
            .into_iter()
            .filter_map(|(w, c, _)| Some((w.0, c?)))
            .collect();
        if let Some(to) = pin::rebalance(&self.cores, (self.wid.0, core), &live) {
            Pin::apply(idx, to);
            seg.set_worker_core(self.wid, Some(to));
            self.core = Some(to);
            tracing::info!(
                worker = idx,
                from = core,
                to,
                "moved to a core no worker uses"
            );
        }
    }
}

/// A row beating within this long counts as a running worker for core placement (a live
/// router beats every 50 ms; a row just claimed counts from its claim).
pub const BEATING_MS: u64 = 2_000;

pub const DRIVER_NAMES: [&str; 3] = ["starting", "io_uring", "epoll"];

#[allow(clippy::too_many_arguments)]
fn worker_main(
    idx: usize,
    mut pin: Pin,
    public: TcpListener,
    admin: TcpListener,
    rx: Receiver<Arc<Snapshot>>,
    shared: Arc<Shared>,
    snapshot: Arc<Snapshot>,
    log: AccessLogTarget,
) {
    if let Some(core) = pin.core {
        Pin::apply(idx, core);
    }
    let wid = pin.wid;
    let uring = monoio::utils::detect_uring();
    let driver = if uring { "io_uring" } else { "epoll" };
    shared.per_worker[idx]
        .driver
        .store(if uring { 1 } else { 2 }, Ordering::Release);
    quota::publish_to(shared.clone(), idx);
    let mut rt = match build_runtime(uring) {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(worker = idx, error = %e, "cannot build the worker runtime");
            std::process::exit(1);
        }
    };
    if uring {
        tracing::info!(worker = idx, driver, "worker started");
    } else {
        tracing::warn!(
            worker = idx,
            driver,
            "io_uring unavailable or disabled; worker uses the epoll fallback"
        );
    }
    rt.block_on(async move {
        let digest = snapshot.routes_digest;
        let ctx = Rc::new(WorkerCtx::new(idx, wid, shared.clone(), snapshot, driver, &log));
        shared.seg.set_worker_routes_digest(wid, digest);
        for (l, kind) in [(public, PortKind::Public), (admin, PortKind::Admin)] {
            match monoio::net::TcpListener::from_std(l) {
                Ok(l) => {
                    monoio::spawn(accept_loop(ctx.clone(), l, kind));
                }
                Err(e) => {
                    tracing::error!(worker = idx, error = %e, "cannot register listener");
                    std::process::exit(1);
                }
            }
        }
        monoio::spawn(crate::control::run(ctx.clone()));
        if uring {
            monoio::spawn(busy_poll::run(ctx.clone()));
        } else if let crate::config::BusyPoll::Window(_) = ctx.snapshot().config.server.busy_poll {
            tracing::warn!(
                worker = idx,
                "busy_poll_us is ignored on the epoll fallback; the worker waits for events as usual"
            );
        }
        if let Some(sender) = ctx.bodylog() {
            monoio::spawn(sender.run());
        }
        shared.workers_ready.fetch_add(1, Ordering::AcqRel);
        let mut log_reopens = shared.log_reopens.load(Ordering::Acquire);
        let mut stamped = Instant::now();
        // When this worker saw the drain (ms), to bound its wait for the accept loops.
        let mut drain_fired_at: Option<u64> = None;
        ctx.touch_slots(warmroute_shm::now_ms());
        loop {
            monoio::time::sleep(TICK).await;
            let now = warmroute_shm::now_ms();
            // Stamp before the heartbeat: a worker seen beating has stamped recently.
            if stamped.elapsed() >= SLOT_STAMP {
                stamped = Instant::now();
                ctx.touch_slots(now);
                // A draining router no longer reloads: its routes are the past, not a
                // set the lease holder should warn about.
                let digest = if shared.draining.load(Ordering::Acquire) {
                    0
                } else {
                    ctx.snapshot().routes_digest
                };
                shared.seg.set_worker_routes_digest(wid, digest);
                pin.rebalance(idx, &shared.seg, now);
            }
            shared.seg.heartbeat(wid, now);
            let mut newest = None;
            while let Ok(s) = rx.try_recv() {
                newest = Some(s);
            }
            if let Some(s) = newest {
                ctx.swap_snapshot(s);
            }
            ctx.upstreams.borrow_mut().evict_expired(Instant::now());
            ctx.access_log.borrow_mut().flush();
            let reopens = shared.log_reopens.load(Ordering::Acquire);
            if reopens != log_reopens {
                log_reopens = reopens;
                ctx.access_log.borrow_mut().reopen(&log);
            }
            if shared.draining.load(Ordering::Acquire) {
                let fired = *drain_fired_at.get_or_insert_with(|| {
                    if !ctx.drain.is_fired() {
                        ctx.drain.fire();
                        tracing::info!(worker = idx, conns = ctx.active_conns.get(), "draining");
                    }
                    now
                });
                // Responses still going at the deadline end there themselves (the relay
                // waits no later) and log their line; a tick later the worker stops.
                let deadline = shared.drain_deadline_ms.load(Ordering::Acquire);
                let past = deadline + DRAIN_CUT_GRACE.as_millis() as u64;
                // Past the deadline too, the worker waits for its accept loops to close
                // their listeners (they take the connections already queued first, for
                // at most DRAIN_ACCEPT_MAX): a loop still parked when the runtime ends
                // leaves its listener open in the process, and the port taken.
                let listeners_closed = ctx.accepting.get() == 0
                    || now >= fired + LISTENERS_CLOSE_WAIT.as_millis() as u64;
                if listeners_closed && (ctx.active_conns.get() == 0 || now >= past) {
                    break;
                }
            }
        }
        // The worker is done serving. Its idle upstream connections close now: the tasks
        // still parked when the runtime ends keep the worker's state, and with it the pool,
        // alive until the process exits, so a peer would see them open until then. A turn
        // of the runtime submits the closes.
        ctx.upstreams.borrow_mut().clear();
        monoio::time::sleep(Duration::from_millis(1)).await;
        // A stuck stderr may hold the worker up to a second here.
        ctx.access_log.borrow_mut().finish(Duration::from_secs(1));
        if let Some(sender) = ctx.bodylog() {
            sender.stop();
        }
        shared.seg.release_worker(wid);
        tracing::info!(worker = idx, left = ctx.active_conns.get(), "worker stopped");
    });
}

use std::rc::Rc;

type Runtime = monoio::FusionRuntime<
    monoio::time::TimeDriver<monoio::IoUringDriver>,
    monoio::time::TimeDriver<monoio::LegacyDriver>,
>;

/// The worker's runtime. On io_uring, ask the kernel to run completion work only when
/// the worker enters it to wait (`DEFER_TASKRUN`, Linux 6.1+, with `SINGLE_ISSUER`: only
/// this thread touches the ring) — the completion work queued while the worker runs is
/// done in one batch when it next waits, instead of by notifying it per completion
/// (pinned A/B: ~4% less CPU per request). Older kernels refuse the
/// flags: fall back to cooperative task running (5.19+: no IPI per completion, which the
/// profile showed at ~10% of a busy worker), then to plain io_uring.
///
/// With deferred task running, completions are only delivered when the run queue is empty
/// and the worker waits (monoio's mid-loop `submit` does not collect them): a task that
/// re-wakes itself in a loop (`yield_now` spinning) would starve every socket and timer
/// of its worker. None does; keep it so.
fn build_runtime(uring: bool) -> std::io::Result<Runtime> {
    let base = || {
        monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .with_entries(4096)
            .enable_timer()
    };
    if uring {
        let mut deferred = io_uring::IoUring::builder();
        deferred.setup_single_issuer().setup_defer_taskrun();
        if let Ok(rt) = base().uring_builder(deferred).build() {
            return Ok(rt);
        }
        let mut coop = io_uring::IoUring::builder();
        coop.setup_coop_taskrun();
        if let Ok(rt) = base().uring_builder(coop).build() {
            tracing::info!("io_uring without DEFER_TASKRUN (kernel older than 6.1)");
            return Ok(rt);
        }
        tracing::info!("io_uring without COOP_TASKRUN (kernel older than 5.19)");
    }
    base().build()
}

async fn accept_loop(ctx: Rc<WorkerCtx>, listener: monoio::net::TcpListener, kind: PortKind) {
    ctx.accepting.set(ctx.accepting.get() + 1);
    // Accept failures since the last line about them, and when that line was written: a
    // router out of descriptors retries every 20 ms, and says so once per `ACCEPT_LOG_EVERY`.
    let mut failed: u64 = 0;
    let mut logged_at: Option<std::time::Instant> = None;
    loop {
        let accepted = match race(listener.accept(), ctx.drain.wait()).await {
            Either::Left(r) => r,
            Either::Right(()) => {
                // Closing a SO_REUSEPORT listener resets the connections already queued on
                // it: take those first (until the queue stays empty for a moment), so a
                // drain — a takeover in particular — loses no client that already connected.
                let until = monoio::time::Instant::now() + DRAIN_ACCEPT_MAX;
                while monoio::time::Instant::now() < until {
                    match monoio::time::timeout(DRAIN_ACCEPT_QUIET, listener.accept()).await {
                        Ok(Ok((stream, addr))) => serve(&ctx, stream, addr, kind),
                        _ => break,
                    }
                }
                drop(listener);
                ctx.accepting.set(ctx.accepting.get() - 1);
                return;
            }
        };
        match accepted {
            Ok((stream, addr)) => serve(&ctx, stream, addr, kind),
            Err(e) => {
                // EMFILE and friends: back off instead of spinning on the error.
                failed += 1;
                if logged_at.is_none_or(|t| t.elapsed() >= ACCEPT_LOG_EVERY) {
                    tracing::warn!(worker = ctx.index, error = %e, failures = failed, "accept failed; retrying every 20 ms (the next such line in 10 s at the earliest)");
                    failed = 0;
                    logged_at = Some(std::time::Instant::now());
                }
                monoio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// The least time between two log lines about failed accepts.
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);

/// How long a draining listener must see no new connection before it closes, and the
/// most it keeps accepting (under steady traffic the queue never stays empty). A
/// connection that arrives between the last accept and the close is reset by the kernel
/// unless `net.ipv4.tcp_migrate_req = 1` (Linux 5.14+), which moves it to another
/// listener of the port — the new router's in a takeover.
const DRAIN_ACCEPT_QUIET: Duration = Duration::from_millis(100);
const DRAIN_ACCEPT_MAX: Duration = Duration::from_millis(500);

/// The most a draining worker waits for its accept loops to close their listeners: the
/// longest a loop can take (its last accept may start just before DRAIN_ACCEPT_MAX and wait
/// DRAIN_ACCEPT_QUIET), and a margin.
const LISTENERS_CLOSE_WAIT: Duration = Duration::from_millis(1_000);

fn serve(
    ctx: &Rc<WorkerCtx>,
    stream: monoio::net::TcpStream,
    addr: std::net::SocketAddr,
    kind: PortKind,
) {
    let _ = stream.set_nodelay(true);
    let (cx, index) = (ctx.clone(), ctx.index);
    let c = ctx.clone();
    monoio::spawn(contain::contained(
        move || crate::pipeline::serve_client(c, stream, addr, kind),
        move |panic| {
            cx.shared.per_worker[index]
                .panics
                .fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                worker = index,
                client = %addr,
                panic,
                "a connection task panicked: that connection is closed and the worker serves on; this is a bug: please report it with this line and the \"panicked\" line before it (its location)"
            );
        },
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loopback port nobody listens on (bound and let go).
    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn start_two(seg: &Arc<Segment>, public: u16, spawn: &mut Spawn<'_>) -> io::Result<Workers> {
        start_two_to(seg, public, 9, spawn)
    }

    /// Two workers on `public` in front of one peer at 127.0.0.1:`peer` (route `a`).
    fn start_two_to(
        seg: &Arc<Segment>,
        public: u16,
        peer: u16,
        spawn: &mut Spawn<'_>,
    ) -> io::Result<Workers> {
        let route = format!("peers = [ {{ host = \"127.0.0.1\", port = {peer} }} ]\n");
        let cfg = crate::config::load_from_strs(None, &[("a", route.as_str())])
            .unwrap_or_else(|e| panic!("config: {e:?}"));
        let keys = Arc::new(crate::auth::load_key_file(None));
        let snapshot = Arc::new(Snapshot::build(Arc::new(cfg), keys, seg, 1).unwrap());
        let me = std::process::id();
        let rows = (0..2)
            .map(|i| (seg.claim_worker(me, i).unwrap(), None))
            .collect();
        let opts = StartOptions {
            rows,
            cores: Vec::new(),
            public: SocketAddr::from(([127, 0, 0, 1], public)),
            admin: "127.0.0.1:0".parse().unwrap(),
            share_ports: false,
            access_log: AccessLogTarget::Off,
        };
        Workers::start_with(opts, snapshot, seg.clone(), spawn)
    }

    /// Whether a plain bind of the loopback `port` succeeds within 2 s: the kernel closes
    /// an io_uring's files a moment after the ring is gone (about 10 ms here), so a port
    /// its worker has let go can still look taken right after the join.
    fn port_freed(port: u16) -> bool {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        TcpListener::bind(addr).is_ok() || listen::freed_within(addr, Duration::from_secs(2))
    }

    /// A thread that cannot be started part-way through: the worker already started is
    /// stopped (a zero drain) and joined before the error returns, so its port is free and
    /// its row given back. The worker that drains at once still waits for its accept loops
    /// to close its listeners. Control: with both threads started the port is taken and both
    /// rows are owned, until a zero drain.
    #[test]
    fn a_failed_thread_start_stops_the_workers_already_started() {
        let t = crate::testutil::TempSegment::with_workers("spawn-fails", 2);
        let port = free_port();
        let ran = Arc::new(AtomicBool::new(false));
        let mut calls = 0;
        let ran_in = ran.clone();
        let mut second_fails = |b: std::thread::Builder, f: Box<dyn FnOnce() + Send>| {
            calls += 1;
            if calls == 2 {
                return Err(io::Error::other("no more threads"));
            }
            let ran = ran_in.clone();
            b.spawn(move || {
                ran.store(true, Ordering::Release);
                f()
            })
        };
        let err = start_two(&t.seg, port, &mut second_fails)
            .err()
            .expect("an error");
        assert_eq!(err.to_string(), "no more threads");
        assert!(ran.load(Ordering::Acquire), "the first worker ran");
        assert!(port_freed(port), "the first worker's listener is closed");
        let owned: Vec<u32> = t.seg.workers().iter().map(|r| r.0 .0).collect();
        assert_eq!(
            owned,
            [1],
            "the first worker gave its row back; the caller owns the other"
        );
        t.seg.release_worker(WorkerId(1));

        // Control: both started.
        let port = free_port();
        let workers = start_two(&t.seg, port, &mut |b, f| b.spawn(f)).expect("started");
        let until = Instant::now() + Duration::from_secs(10);
        while !workers.shared.ready() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(workers.shared.ready(), "both workers ready");
        assert!(
            TcpListener::bind(("127.0.0.1", port)).is_err(),
            "the port is served"
        );
        assert_eq!(t.seg.workers().len(), 2);
        workers.drain(Duration::ZERO);
        workers.join();
        assert!(t.seg.workers().is_empty(), "each worker gave its row back");
        assert!(port_freed(port), "a zero drain closes the listeners too");
    }

    /// A peer that answers every request with `200 {}` and keeps the connection, and says
    /// on `events` when a connection that carried a POST closes.
    fn keepalive_peer(events: std::sync::mpsc::Sender<&'static str>) -> u16 {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let events = events.clone();
                std::thread::spawn(move || {
                    let mut out = conn.try_clone().unwrap();
                    let mut rd = BufReader::new(conn);
                    let mut posted = false;
                    loop {
                        let mut line = String::new();
                        if rd.read_line(&mut line).unwrap_or(0) == 0 {
                            break;
                        }
                        posted |= line.starts_with("POST ");
                        let mut length = 0usize;
                        loop {
                            let mut h = String::new();
                            if rd.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                                break;
                            }
                            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:")
                            {
                                length = v.trim().parse().unwrap_or(0);
                            }
                        }
                        let mut body = vec![0; length];
                        if rd.read_exact(&mut body).is_err() {
                            break;
                        }
                        let reply = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
                        if out.write_all(reply.as_bytes()).is_err() {
                            break;
                        }
                    }
                    if posted {
                        let _ = events.send("closed");
                    }
                });
            }
        });
        port
    }

    /// A stopping worker closes its idle upstream connections: the peer sees the pooled
    /// connection end when the workers are joined, not when the process exits. Control: it
    /// stays open while the workers serve.
    #[test]
    fn a_stopping_worker_closes_its_pooled_upstream_connections() {
        use std::io::{Read, Write};
        let t = crate::testutil::TempSegment::with_workers("pool-close", 2);
        let (tx, events) = std::sync::mpsc::channel();
        let peer = keepalive_peer(tx);
        let port = free_port();
        let workers = start_two_to(&t.seg, port, peer, &mut |b, f| b.spawn(f)).expect("started");
        let until = Instant::now() + Duration::from_secs(10);
        while !workers.shared.ready() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            c,
            "POST /a/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut reply = String::new();
        c.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(
            events.recv_timeout(Duration::from_millis(300)).is_err(),
            "control: the upstream connection is kept while the worker serves"
        );
        workers.drain(Duration::ZERO);
        workers.join();
        assert_eq!(
            events.recv_timeout(Duration::from_secs(2)),
            Ok("closed"),
            "the pooled connection is closed when the workers stop"
        );
    }
}
