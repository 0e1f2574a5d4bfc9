//! `/metrics` on the admin port: the Prometheus text exposition format, version 0.0.4.
//!
//! Every value comes from the snapshot and the shared segment, so any worker answers for
//! the whole process. Each family is one small function in `FAMILIES`: it opens the family
//! (name, type, help) and writes its samples; `Sources` holds the label sets, pre-rendered
//! once per scrape, of every route, pool and peer. Names use no `:` (reserved for recording
//! rules), counters end in `_total`, and label values are escaped as the format requires.
//!
//! Not rendered yet (SPEC §10 / issue 6), to be added as families here when the data
//! exists: requests by response status, EWMAs (TTFT, decode rate) and adaptive limits,
//! TTFT and decode-rate histograms, prompt/cached tokens, body-log drops, health
//! transitions other than bans/unbans (e.g. probe outcomes by result).

use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use warmroute_shm::{PeerSlot, Segment};

use super::Response;
use crate::cells::{self, Relaxed};
use crate::pipeline::admission;
use crate::pipeline::peer_select::Load;
use crate::snapshot::{PeerRt, RouteRt, Snapshot};
use crate::worker::{WorkerCtx, DRIVER_NAMES};

/// The exposition format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Answer `GET /metrics`.
pub fn response(ctx: &WorkerCtx, snap: &Snapshot) -> Response {
    let src = Sources::new(
        &ctx.shared.seg,
        snap,
        warmroute_shm::now_ms(),
        ctx.shared
            .per_worker
            .iter()
            .map(|w| WorkerView {
                driver: w.driver.load(Ordering::Acquire),
                cpu_ns: w.cpu_ns.load(Ordering::Relaxed),
                busy_poll_ns: w.busy_poll_ns.load(Ordering::Relaxed),
                panics: w.panics.load(Ordering::Relaxed),
            })
            .collect(),
        ctx.index,
        ctx.access_log.borrow().dropped(),
    );
    Response {
        status: 200,
        content_type: CONTENT_TYPE,
        body: render(&src).into_bytes(),
        headers: Vec::new(),
    }
}

/// One family: writes its header and samples.
type Family = fn(&mut Exposition, &Sources);

/// Every family, in output order. Adding a series = one function + one entry here.
const FAMILIES: &[Family] = &[
    build_info,
    workers,
    worker_driver,
    worker_cpu,
    worker_busy_poll,
    worker_panics,
    config_generation,
    segment_slots,
    access_log_dropped,
    log_dropped,
    route_requests,
    route_responses,
    route_rejected,
    route_unavailable,
    route_unauthorized,
    route_model_not_supported,
    route_retries,
    route_routing_mode,
    pool_limit,
    pool_inflight,
    peer_requests,
    peer_failures,
    peer_responses_cut,
    peer_inflight,
    peer_max_concurrency,
    peer_banned,
    peer_bans,
    peer_unbans,
    peer_probes,
    peer_probe_latency,
    route_prompt_tokens,
    route_cached_tokens,
    route_completion_tokens,
    peer_prompt_tokens,
    peer_cached_tokens,
    route_bodylog_dropped,
    route_ttft_histogram,
    route_decode_rate_histogram,
    pool_ttft_ewma,
    pool_decode_rate_ewma,
    pool_effective_limit,
    peer_ttft_ewma,
    peer_decode_rate_ewma,
    owner_requests,
    owner_tokens,
];

/// Requests per key owner (SPEC §7: the owner, never the key, appears in metrics).
fn owner_requests(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_owner_requests_total",
        Kind::Counter,
        "Requests whose API key belongs to this owner (refused ones included), every route.",
    );
    for (owner, slot) in &s.snap.owners {
        f.sample(
            &Labels::new(&[("owner", owner)]),
            s.seg
                .route_cell(*slot, cells::owner::REQUESTS)
                .load(Relaxed),
        );
    }
}

/// Tokens per key owner, from the responses' usage.
fn owner_tokens(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_owner_tokens_total",
        Kind::Counter,
        "Tokens the backends reported for this owner's requests, by kind (prompt, cached, completion).",
    );
    for (owner, slot) in &s.snap.owners {
        let labels = Labels::new(&[("owner", owner)]);
        for (kind, cell) in [
            ("prompt", cells::owner::PROMPT_TOKENS),
            ("cached", cells::owner::CACHED_TOKENS),
            ("completion", cells::owner::COMPLETION_TOKENS),
        ] {
            f.sample_with(
                &labels,
                &[("kind", kind)],
                s.seg.route_cell(*slot, cell).load(Relaxed),
            );
        }
    }
}

fn pool_signal_ewma(
    x: &mut Exposition,
    s: &Sources,
    name: &'static str,
    help: &str,
    sig: crate::control::latency::Signal,
    scale: f64,
) {
    let mut f = x.family(name, Kind::Gauge, help);
    let now_s = s.now_ms / 1000;
    for p in &s.pools {
        if let Some(v) =
            crate::control::latency::current_ewma(&p.route.cfg.opts, sig, p.rt, s.seg, now_s)
        {
            f.sample(&p.labels, v * scale);
        }
    }
}

fn pool_ttft_ewma(x: &mut Exposition, s: &Sources) {
    pool_signal_ewma(
        x,
        s,
        "warmroute_pool_ttft_ewma_seconds",
        "The pool's TTFT EWMA (the windowed p80, or the first entry of the route's ttft_metrics; _ttft_status shows every entry).",
        crate::control::latency::Signal::Ttft,
        0.001,
    );
}

fn pool_decode_rate_ewma(x: &mut Exposition, s: &Sources) {
    pool_signal_ewma(x, s, "warmroute_pool_decode_rate_ewma", "The pool's decode-rate EWMA in tokens per second (the windowed low tail, or the first entry of the route's tps_metrics; _tps_status shows every entry).", crate::control::latency::Signal::Tps, 1.0);
}

fn pool_effective_limit(x: &mut Exposition, s: &Sources) {
    let mut f = x.family("warmroute_pool_effective_limit", Kind::Gauge, "The concurrency limit the gate applies: the adaptive limit (within the healthy capacity) when adaptive concurrency is on, else the healthy capacity.");
    let now_s = s.now_ms / 1000;
    for p in &s.pools {
        let cap = admission::healthy_capacity(&p.loads);
        f.sample(
            &p.labels,
            crate::control::latency::concurrency_limit(&p.route.cfg.opts, p.rt, s.seg, now_s, cap),
        );
    }
}

/// A per-peer EWMA family (`which`: 0 TTFT, 1 decode rate), each peer's shown for its
/// route's TTL, as `_health_status` shows it.
fn peer_ewma_family(x: &mut Exposition, s: &Sources, name: &'static str, help: &str, which: usize) {
    let now_s = s.now_ms / 1000;
    let (cell, scale) = match which {
        0 => (crate::measure::PEER_TTFT, 1000.0),
        _ => (crate::measure::PEER_TPS, 1.0),
    };
    let mut f = x.family(name, Kind::Gauge, help);
    for p in &s.peers {
        let ttl = p.ewma_ttl_s[which];
        if let Some(v) = crate::measure::peer_ewma(s.seg, p.rt.slot, cell, now_s, ttl) {
            f.sample(&p.labels, v / scale);
        }
    }
}

fn peer_ttft_ewma(x: &mut Exposition, s: &Sources) {
    peer_ewma_family(
        x,
        s,
        "warmroute_peer_ttft_ewma_seconds",
        "Per-peer TTFT EWMA (per sample), for comparing peers.",
        0,
    );
}

fn peer_decode_rate_ewma(x: &mut Exposition, s: &Sources) {
    peer_ewma_family(
        x,
        s,
        "warmroute_peer_decode_rate_ewma",
        "Per-peer decode-rate EWMA in tokens per second (per sample).",
        1,
    );
}

// ---------------------------------------------------------------------------------------
// Families: tokens, body log, latency histograms.

fn route_prompt_tokens(x: &mut Exposition, s: &Sources) {
    route_counter(
        x,
        s,
        "warmroute_prompt_tokens_total",
        "Prompt tokens reported in the responses' usage.",
        cells::route::PROMPT_TOKENS,
    );
}

fn route_cached_tokens(x: &mut Exposition, s: &Sources) {
    route_counter(x, s, "warmroute_cached_tokens_total", "Prompt tokens the backends served from their prefix cache (usage.prompt_tokens_details.cached_tokens); divided by prompt tokens: the cache hit rate.", cells::route::CACHED_TOKENS);
}

fn route_completion_tokens(x: &mut Exposition, s: &Sources) {
    route_counter(
        x,
        s,
        "warmroute_completion_tokens_total",
        "Completion tokens reported in the responses' usage.",
        cells::route::COMPLETION_TOKENS,
    );
}

fn peer_prompt_tokens(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_peer_prompt_tokens_total",
        Kind::Counter,
        "Prompt tokens reported by this peer.",
    );
    for p in &s.peers {
        f.sample(&p.labels, s.peer_cell(p.rt, cells::peer::PROMPT_TOKENS));
    }
}

fn peer_cached_tokens(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_peer_cached_tokens_total",
        Kind::Counter,
        "Prompt tokens this peer served from its prefix cache.",
    );
    for p in &s.peers {
        f.sample(&p.labels, s.peer_cell(p.rt, cells::peer::CACHED_TOKENS));
    }
}

fn route_bodylog_dropped(x: &mut Exposition, s: &Sources) {
    route_counter(
        x,
        s,
        "warmroute_bodylog_dropped_total",
        "Body-log records dropped: the worker's queue was full, or a write to the listener failed or stalled (listener slow or down).",
        cells::route::BODYLOG_DROPPED,
    );
}

fn route_histogram(
    x: &mut Exposition,
    s: &Sources,
    name: &'static str,
    help: &str,
    h: crate::measure::HistCells,
    scale: f64,
) {
    let mut f = x.family(name, Kind::Histogram, help);
    let bounds: Vec<f64> = h.bounds.iter().map(|b| b * scale).collect();
    for r in &s.routes {
        let counts: Vec<u64> = (0..=h.bounds.len())
            .map(|i| s.route_cell(r.rt, h.base + i))
            .collect();
        let sum = s.route_cell(r.rt, h.sum_cell()) as f64 / 1000.0 * scale;
        f.histogram(&r.labels, &bounds, &counts, sum);
    }
}

fn route_ttft_histogram(x: &mut Exposition, s: &Sources) {
    route_histogram(x, s, "warmroute_ttft_seconds", "Time to first token of 2xx streamed responses, from the request being read to the first body bytes.", crate::measure::TTFT, 0.001);
}

fn route_decode_rate_histogram(x: &mut Exposition, s: &Sources) {
    route_histogram(
        x,
        s,
        "warmroute_decode_rate_tokens_per_second",
        "Completion tokens per second of responses with enough tokens and time to measure.",
        crate::measure::TPS,
        1.0,
    );
}

/// Render every family.
pub fn render(src: &Sources) -> String {
    let mut out = Exposition::default();
    for f in FAMILIES {
        f(&mut out, src);
    }
    out.buf
}

// ---------------------------------------------------------------------------------------
// What the families read.

/// A route with its labels (`route`).
pub struct RouteView<'a> {
    pub rt: &'a RouteRt,
    pub labels: Labels,
}

/// A pool with its labels (`route`, `model`) and its peers' loads read once.
pub struct PoolView<'a> {
    pub loads: Vec<Load>,
    pub labels: Labels,
    pub rt: &'a crate::snapshot::PoolRt,
    pub route: &'a RouteRt,
}

/// A peer with its labels (`route`, `model`, `peer`, `addr`, `priority`). A slot appears
/// once even if a pool lists the same address twice, so no series is duplicated.
pub struct PeerView<'a> {
    pub rt: &'a PeerRt,
    pub labels: Labels,
    /// Its route's `ttft_ttl` and `tps_ttl`: how long its EWMAs stay shown, as in
    /// `_health_status`.
    pub ewma_ttl_s: [u64; 2],
}

/// What a scrape reports of one worker that the segment does not hold.
pub struct WorkerView {
    /// An index into `DRIVER_NAMES`.
    pub driver: usize,
    /// Its thread's CPU time as of its last quota settle, in nanoseconds.
    pub cpu_ns: u64,
    /// Time it has spent busy polling, in nanoseconds.
    pub busy_poll_ns: u64,
    /// Connection tasks that panicked and were ended alone.
    pub panics: u64,
}

/// Everything a scrape reads, gathered once.
pub struct Sources<'a> {
    pub seg: &'a Segment,
    pub snap: &'a Snapshot,
    pub now_ms: u64,
    /// Per worker, what the process keeps outside the segment.
    pub workers: Vec<WorkerView>,
    /// The worker answering this scrape and its own (unshared) access-log drop count.
    pub worker: usize,
    pub access_log_dropped: u64,
    pub routes: Vec<RouteView<'a>>,
    pub pools: Vec<PoolView<'a>>,
    pub peers: Vec<PeerView<'a>>,
}

impl<'a> Sources<'a> {
    pub fn new(
        seg: &'a Segment,
        snap: &'a Snapshot,
        now_ms: u64,
        workers: Vec<WorkerView>,
        worker: usize,
        access_log_dropped: u64,
    ) -> Sources<'a> {
        let mut routes = Vec::with_capacity(snap.routes.len());
        let mut pools = Vec::new();
        let mut peers = Vec::new();
        let mut seen: HashSet<PeerSlot> = HashSet::new();
        for r in &snap.routes {
            routes.push(RouteView {
                rt: r,
                labels: Labels::new(&[("route", r.name())]),
            });
            for p in &r.pools {
                let model = p.model.as_deref().unwrap_or("");
                let pool_labels = Labels::new(&[("route", r.name()), ("model", model)]);
                for peer in &p.peers {
                    if !seen.insert(peer.slot) {
                        continue;
                    }
                    peers.push(PeerView {
                        rt: peer,
                        ewma_ttl_s: [r.cfg.opts.ttft_ttl, r.cfg.opts.tps_ttl],
                        labels: pool_labels.with(&[
                            ("peer", &peer.name),
                            ("addr", &peer.addr.to_string()),
                            ("priority", &peer.priority.to_string()),
                        ]),
                    });
                }
                pools.push(PoolView {
                    loads: p.loads(seg, now_ms),
                    labels: pool_labels,
                    rt: p,
                    route: r,
                });
            }
        }
        Sources {
            seg,
            snap,
            now_ms,
            workers,
            worker,
            access_log_dropped,
            routes,
            pools,
            peers,
        }
    }

    fn route_cell(&self, r: &RouteRt, i: usize) -> u64 {
        self.seg.route_cell(r.slot, i).load(Relaxed)
    }

    fn peer_cell(&self, p: &PeerRt, i: usize) -> u64 {
        self.seg.peer_cell(p.slot, i).load(Relaxed)
    }
}

// ---------------------------------------------------------------------------------------
// Families: process.

fn build_info(x: &mut Exposition, _: &Sources) {
    x.family(
        "warmroute_build_info",
        Kind::Gauge,
        "Always 1; the version label names the running build.",
    )
    .sample(
        &Labels::new(&[("version", env!("CARGO_PKG_VERSION"))]),
        1u64,
    );
}

fn workers(x: &mut Exposition, s: &Sources) {
    x.family(
        "warmroute_workers",
        Kind::Gauge,
        "Worker threads configured.",
    )
    .sample(&Labels::none(), s.workers.len());
}

fn worker_driver(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_worker_driver",
        Kind::Gauge,
        "Always 1; the driver label names each worker's I/O driver (io_uring, epoll, or starting).",
    );
    for (i, w) in s.workers.iter().enumerate() {
        let name = DRIVER_NAMES.get(w.driver).copied().unwrap_or("unknown");
        f.sample(
            &Labels::new(&[("worker", &i.to_string()), ("driver", name)]),
            1u64,
        );
    }
}

fn worker_cpu(x: &mut Exposition, s: &Sources) {
    worker_counter(
        x,
        s,
        "warmroute_worker_cpu_seconds_total",
        "CPU time of each worker thread as the worker last read it: the request and relay paths read it at most every 250 us (the read that keeps a CPU quota's books current); idle time and admin requests do not update it.",
        |w| w.cpu_ns as f64 / 1e9,
    );
}

fn worker_busy_poll(x: &mut Exposition, s: &Sources) {
    worker_counter(
        x,
        s,
        "warmroute_worker_busy_poll_seconds_total",
        "Time each worker spent polling instead of waiting (busy_poll_us; 0 when off or on the epoll fallback).",
        |w| w.busy_poll_ns as f64 / 1e9,
    );
}

fn worker_panics(x: &mut Exposition, s: &Sources) {
    worker_counter(
        x,
        s,
        "warmroute_worker_panics_total",
        "Connection tasks that panicked; each closed its own connection and its worker served on. Any is a bug: the log has the message.",
        |w| w.panics as f64,
    );
}

/// A counter with one sample per worker, labelled by its index.
fn worker_counter(
    x: &mut Exposition,
    s: &Sources,
    name: &'static str,
    help: &str,
    value: fn(&WorkerView) -> f64,
) {
    let mut f = x.family(name, Kind::Counter, help);
    for (i, w) in s.workers.iter().enumerate() {
        f.sample(&Labels::new(&[("worker", &i.to_string())]), value(w));
    }
}

fn config_generation(x: &mut Exposition, s: &Sources) {
    x.family(
        "warmroute_config_generation",
        Kind::Gauge,
        "Configuration generation in effect; increases by one on every successful reload.",
    )
    .sample(&Labels::none(), s.snap.generation);
}

/// How full the shared segment's slot tables are: slots no configuration uses any more are
/// freed after a while, and a reload that finds no free slot is refused.
fn segment_slots(x: &mut Exposition, s: &Sources) {
    let (peers, routes) = s.seg.slots_taken();
    let caps = s.seg.caps();
    let mut f = x.family(
        "warmroute_segment_slots",
        Kind::Gauge,
        "Slots of the shared segment's peer and route tables: taken, and the capacity fixed when the segment was created.",
    );
    for (table, taken, cap) in [("peer", peers, caps.peers), ("route", routes, caps.routes)] {
        f.sample(&Labels::new(&[("table", table), ("state", "taken")]), taken);
        f.sample(
            &Labels::new(&[("table", table), ("state", "capacity")]),
            cap,
        );
    }
}

/// The access log's buffer is per worker and not in the segment: only the worker answering
/// the scrape reports its own count, under its `worker` label.
fn access_log_dropped(x: &mut Exposition, s: &Sources) {
    x.family(
        "warmroute_access_log_dropped_total",
        Kind::Counter,
        "Access-log lines dropped because the worker's buffer was full (reported by the worker answering the scrape).",
    )
    .sample(
        &Labels::new(&[("worker", &s.worker.to_string())]),
        s.access_log_dropped,
    );
}

fn log_dropped(x: &mut Exposition, _: &Sources) {
    x.family(
        "warmroute_log_dropped_total",
        Kind::Counter,
        "Lines of the router's own log dropped because stderr (a pipe or terminal nobody read) was full.",
    )
    .sample(&Labels::none(), crate::worker::stderr::log_lines_dropped());
}

// ---------------------------------------------------------------------------------------
// Families: per route.

/// A counter family with one sample per route, read from one route cell.
fn route_counter(x: &mut Exposition, s: &Sources, name: &'static str, help: &str, cell: usize) {
    let mut f = x.family(name, Kind::Counter, help);
    for r in &s.routes {
        f.sample(&r.labels, s.route_cell(r.rt, cell));
    }
}

fn route_requests(x: &mut Exposition, s: &Sources) {
    route_counter(
        x,
        s,
        "warmroute_requests_total",
        "Requests received on the route's proxy endpoints.",
        cells::route::REQUESTS,
    );
}

fn route_responses(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_responses_total",
        Kind::Counter,
        "Answers on the route's proxy endpoints by status class, the router's own included.",
    );
    for r in &s.routes {
        for (i, class) in cells::status::CLASSES.iter().enumerate() {
            f.sample_with(
                &r.labels,
                &[("code", class)],
                s.seg.route_cell(r.rt.status_slot, i).load(Relaxed),
            );
        }
    }
}

fn route_rejected(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_rejected_total",
        Kind::Counter,
        "Requests rejected with 429 (or a reject rule's status), by gate.",
    );
    for r in &s.routes {
        for (gate, cell) in [
            ("concurrency", cells::route::REJECT_CONCURRENCY),
            ("ttft", cells::route::REJECT_TTFT),
            ("tps", cells::route::REJECT_TPS),
            ("rule", cells::route::REJECT_RULE),
        ] {
            f.sample_with(&r.labels, &[("gate", gate)], s.route_cell(r.rt, cell));
        }
    }
}

fn route_unavailable(x: &mut Exposition, s: &Sources) {
    route_counter(
        x,
        s,
        "warmroute_unavailable_total",
        "Requests answered 503 because no healthy peer could take them.",
        cells::route::UNAVAILABLE,
    );
}

fn route_unauthorized(x: &mut Exposition, s: &Sources) {
    route_counter(
        x,
        s,
        "warmroute_unauthorized_total",
        "Requests answered 401: missing or unknown API key.",
        cells::route::UNAUTHORIZED,
    );
}

fn route_model_not_supported(x: &mut Exposition, s: &Sources) {
    route_counter(
        x,
        s,
        "warmroute_model_not_supported_total",
        "Requests answered 400 because the route does not serve the requested model.",
        cells::route::MODEL_NOT_SUPPORTED,
    );
}

fn route_retries(x: &mut Exposition, s: &Sources) {
    route_counter(
        x,
        s,
        "warmroute_retries_total",
        "Further upstream attempts made after a first attempt failed.",
        cells::route::RETRIES,
    );
}

fn route_routing_mode(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_routing_mode_total",
        Kind::Counter,
        "Peer selections by mode: session hash, hash fallback (hashed peer banned or full), least connections.",
    );
    for r in &s.routes {
        for (mode, cell) in [
            ("hash", cells::route::MODE_HASH),
            ("hash_fallback", cells::route::MODE_HASH_FALLBACK),
            ("least_conn", cells::route::MODE_LEAST_CONN),
        ] {
            f.sample_with(&r.labels, &[("mode", mode)], s.route_cell(r.rt, cell));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Families: per pool (model is "" for a flat `peers` list).

fn pool_limit(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_pool_limit",
        Kind::Gauge,
        "Concurrency limit of the pool: sum of max_concurrency over the healthy peers of the active priority tier (0 when none is healthy).",
    );
    for p in &s.pools {
        f.sample(&p.labels, admission::healthy_capacity(&p.loads));
    }
}

fn pool_inflight(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_pool_inflight",
        Kind::Gauge,
        "Requests in flight over every peer of the pool.",
    );
    for p in &s.pools {
        f.sample(
            &p.labels,
            p.loads.iter().map(|l| l.inflight.max(0)).sum::<i64>(),
        );
    }
}

// ---------------------------------------------------------------------------------------
// Families: per peer.

/// A family with one sample per peer.
fn peer_family<V: Num>(
    x: &mut Exposition,
    s: &Sources,
    name: &'static str,
    kind: Kind,
    help: &str,
    value: impl Fn(&PeerRt) -> Option<V>,
) {
    let mut f = x.family(name, kind, help);
    for p in &s.peers {
        if let Some(v) = value(p.rt) {
            f.sample(&p.labels, v);
        }
    }
}

fn peer_requests(x: &mut Exposition, s: &Sources) {
    peer_family(
        x,
        s,
        "warmroute_peer_requests_total",
        Kind::Counter,
        "Attempts forwarded to the peer (retries included).",
        |p| Some(s.peer_cell(p, cells::peer::REQUESTS)),
    );
}

fn peer_failures(x: &mut Exposition, s: &Sources) {
    peer_family(
        x,
        s,
        "warmroute_peer_failures_total",
        Kind::Counter,
        "Attempts to the peer that failed to connect or got 502/503.",
        |p| Some(s.peer_cell(p, cells::peer::FAILURES)),
    );
}

fn peer_responses_cut(x: &mut Exposition, s: &Sources) {
    let mut f = x.family(
        "warmroute_peer_responses_cut_total",
        Kind::Counter,
        "Responses from the peer that did not reach their end: by=\"client\", the client went away first (while the peer worked or mid-body); by=\"peer\", the peer closed, went idle or broke its framing mid-body.",
    );
    for p in &s.peers {
        for (by, cell) in [
            ("client", cells::peer::CUT_BY_CLIENT),
            ("peer", cells::peer::CUT_BY_PEER),
        ] {
            f.sample_with(&p.labels, &[("by", by)], s.peer_cell(p.rt, cell));
        }
    }
}

fn peer_inflight(x: &mut Exposition, s: &Sources) {
    peer_family(
        x,
        s,
        "warmroute_peer_inflight",
        Kind::Gauge,
        "Requests in flight to the peer, over every worker.",
        |p| Some(s.seg.inflight(p.slot)),
    );
}

fn peer_max_concurrency(x: &mut Exposition, s: &Sources) {
    peer_family(
        x,
        s,
        "warmroute_peer_max_concurrency",
        Kind::Gauge,
        "The peer's configured max_concurrency.",
        |p| Some(p.max_concurrency as u64),
    );
}

fn peer_banned(x: &mut Exposition, s: &Sources) {
    peer_family(
        x,
        s,
        "warmroute_peer_banned",
        Kind::Gauge,
        "1 while the peer is banned (unhealthy), else 0.",
        |p| Some(u64::from(s.seg.is_banned(p.slot, s.now_ms))),
    );
}

fn peer_bans(x: &mut Exposition, s: &Sources) {
    peer_family(
        x,
        s,
        "warmroute_peer_bans_total",
        Kind::Counter,
        "Transitions of the peer from healthy to banned.",
        |p| Some(s.peer_cell(p, cells::peer::BANS)),
    );
}

fn peer_unbans(x: &mut Exposition, s: &Sources) {
    peer_family(
        x,
        s,
        "warmroute_peer_unbans_total",
        Kind::Counter,
        "Transitions of the peer from banned to healthy.",
        |p| Some(s.peer_cell(p, cells::peer::UNBANS)),
    );
}

fn peer_probes(x: &mut Exposition, s: &Sources) {
    peer_family(
        x,
        s,
        "warmroute_peer_probes_total",
        Kind::Counter,
        "Health probes sent to the peer.",
        |p| Some(s.peer_cell(p, cells::peer::PROBES)),
    );
}

fn peer_probe_latency(x: &mut Exposition, s: &Sources) {
    peer_family(
        x,
        s,
        "warmroute_peer_probe_latency_seconds",
        Kind::Gauge,
        "Duration of the peer's last health probe (absent until a probe has run).",
        |p| {
            (s.peer_cell(p, cells::peer::PROBE_AT_MS) > 0)
                .then(|| s.peer_cell(p, cells::peer::PROBE_LATENCY_US) as f64 / 1e6)
        },
    );
}

// ---------------------------------------------------------------------------------------
// The text format.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// The output being built.
#[derive(Default)]
pub struct Exposition {
    buf: String,
}

impl Exposition {
    /// Open a family: writes `# HELP` and `# TYPE`; samples follow through the writer.
    pub fn family(&mut self, name: &'static str, kind: Kind, help: &str) -> FamilyWriter<'_> {
        debug_assert!(valid_name(name), "bad metric name {name}");
        debug_assert!(
            (kind == Kind::Counter) == name.ends_with("_total"),
            "{name}: counters and only counters end in _total"
        );
        let kind = match kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        let _ = writeln!(self.buf, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.buf, "# TYPE {name} {kind}");
        FamilyWriter {
            buf: &mut self.buf,
            name,
        }
    }
}

/// Writes the samples of one family.
pub struct FamilyWriter<'a> {
    buf: &'a mut String,
    name: &'static str,
}

impl FamilyWriter<'_> {
    pub fn sample(&mut self, labels: &Labels, v: impl Num) {
        self.sample_with(labels, &[], v);
    }

    /// A sample with `labels` plus a few more pairs.
    pub fn sample_with(&mut self, labels: &Labels, extra: &[(&str, &str)], v: impl Num) {
        self.buf.push_str(self.name);
        if !labels.0.is_empty() || !extra.is_empty() {
            self.buf.push('{');
            self.buf.push_str(&labels.0);
            for (i, (k, val)) in extra.iter().enumerate() {
                if i > 0 || !labels.0.is_empty() {
                    self.buf.push(',');
                }
                push_pair(self.buf, k, val);
            }
            self.buf.push('}');
        }
        self.buf.push(' ');
        v.write(self.buf);
        self.buf.push('\n');
    }
}

impl FamilyWriter<'_> {
    /// One histogram series: cumulative `_bucket`s (with `le`), `_sum` and `_count`.
    /// `counts` are per bucket (the last one unbounded); `sum` is in the sample's unit.
    pub fn histogram(&mut self, labels: &Labels, bounds: &[f64], counts: &[u64], sum: f64) {
        let mut cum = 0u64;
        for (i, c) in counts.iter().enumerate() {
            cum += c;
            let le = bounds
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |b| format!("{b}"));
            let _ = write!(self.buf, "{}_bucket{{", self.name);
            self.buf.push_str(&labels.0);
            if !labels.0.is_empty() {
                self.buf.push(',');
            }
            push_pair(self.buf, "le", &le);
            let _ = writeln!(self.buf, "}} {cum}");
        }
        let braces = if labels.0.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", labels.0)
        };
        let _ = writeln!(self.buf, "{}_sum{braces} {sum}", self.name);
        let _ = writeln!(self.buf, "{}_count{braces} {cum}", self.name);
    }
}

/// A label set rendered once: `a="x",b="y"` (escaped, without braces).
#[derive(Clone, Debug, Default)]
pub struct Labels(String);

impl Labels {
    pub fn none() -> Labels {
        Labels::default()
    }

    pub fn new(pairs: &[(&str, &str)]) -> Labels {
        Labels::none().with(pairs)
    }

    /// These labels followed by more.
    pub fn with(&self, pairs: &[(&str, &str)]) -> Labels {
        let mut s = self.0.clone();
        for (k, v) in pairs {
            if !s.is_empty() {
                s.push(',');
            }
            push_pair(&mut s, k, v);
        }
        Labels(s)
    }
}

fn push_pair(out: &mut String, k: &str, v: &str) {
    debug_assert!(valid_label_name(k), "bad label name {k}");
    out.push_str(k);
    out.push_str("=\"");
    escape_label_value_into(out, v);
    out.push('"');
}

/// A label value as the format requires: `\` → `\\`, `"` → `\"`, newline → `\n`.
pub fn escape_label_value_into(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Help text: `\` → `\\`, newline → `\n`.
fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`: the metric-name grammar without `:`.
fn valid_name(n: &str) -> bool {
    valid_label_name(n)
}

fn valid_label_name(n: &str) -> bool {
    let mut b = n.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// A sample value.
pub trait Num {
    fn write(&self, out: &mut String);
}

macro_rules! int_num {
    ($($t:ty),*) => {$(
        impl Num for $t {
            fn write(&self, out: &mut String) {
                let _ = write!(out, "{self}");
            }
        }
    )*};
}
int_num!(u64, i64, u32, usize);

impl Num for f64 {
    fn write(&self, out: &mut String) {
        if self.is_nan() {
            out.push_str("NaN");
        } else if self.is_infinite() {
            out.push_str(if *self > 0.0 { "+Inf" } else { "-Inf" });
        } else {
            let _ = write!(out, "{self}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use warmroute_shm::Capacities;

    use super::*;

    fn esc(v: &str) -> String {
        let mut s = String::new();
        escape_label_value_into(&mut s, v);
        s
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(esc("plain-1.2:3/x"), "plain-1.2:3/x");
        assert_eq!(esc(r#"a"b"#), r#"a\"b"#);
        assert_eq!(esc(r"a\b"), r"a\\b");
        assert_eq!(esc("a\nb"), r"a\nb");
        assert_eq!(esc("é\t"), "é\t");
        assert_eq!(
            Labels::new(&[("route", "r\"1"), ("peer", "\\")]).0,
            r#"route="r\"1",peer="\\""#
        );
        assert_eq!(escape_help("a\\b\nc"), r"a\\b\nc");
    }

    #[test]
    fn sample_values_and_label_joins() {
        let mut x = Exposition::default();
        let mut f = x.family("t_g", Kind::Gauge, "h");
        f.sample(&Labels::none(), 0.25f64);
        f.sample_with(&Labels::none(), &[("a", "1")], f64::INFINITY);
        f.sample_with(&Labels::new(&[("b", "2")]), &[("a", "1")], -3i64);
        f.sample(&Labels::none(), f64::NAN);
        assert_eq!(
            x.buf,
            "# HELP t_g h\n# TYPE t_g gauge\nt_g 0.25\nt_g{a=\"1\"} +Inf\nt_g{b=\"2\",a=\"1\"} -3\nt_g NaN\n"
        );
    }

    struct Tmp(PathBuf);
    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn fixture() -> (Tmp, Segment, Snapshot) {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "warmroute-metrics-unit-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let tmp = Tmp(path.clone());
        let seg = Segment::open_or_create(
            &path,
            Capacities {
                workers: 2,
                peers: 16,
                routes: 32,
            },
        )
        .unwrap();
        let cfg = crate::config::load_from_strs(
            None,
            &[
                (
                    "chat",
                    r#"peers = [ { host = "127.0.0.1", port = 8001, name = "a\"q\\b", max_concurrency = 3 },
                                 { host = "127.0.0.1", port = 8002, name = "b", priority = -1 } ]"#,
                ),
                (
                    "bm",
                    "[peers_by_model]\n\"llama\" = [ { host = \"127.0.0.1\", port = 8003, name = \"c\" } ]\n",
                ),
            ],
        )
        .unwrap_or_else(|e| panic!("config: {e:?}"));
        let keys = Arc::new(crate::auth::load_key_file(None));
        let snap = Snapshot::build(Arc::new(cfg), keys, &seg, 7).unwrap();
        (tmp, seg, snap)
    }

    /// Worker views from `(driver, cpu_ns)` pairs.
    fn views(w: &[(usize, u64)]) -> Vec<WorkerView> {
        w.iter()
            .map(|&(driver, cpu_ns)| WorkerView {
                driver,
                cpu_ns,
                busy_poll_ns: 0,
                panics: 0,
            })
            .collect()
    }

    #[test]
    fn rejected_family_is_preinitialised_per_gate() {
        let (_t, seg, snap) = fixture();
        let chat = snap.route("chat").unwrap();
        seg.route_cell(chat.slot, cells::route::REJECT_CONCURRENCY)
            .store(5, Relaxed);
        let src = Sources::new(&seg, &snap, 1, views(&[(1, 0), (2, 0)]), 0, 0);
        let mut x = Exposition::default();
        route_rejected(&mut x, &src);
        assert_eq!(
            x.buf,
            "# HELP warmroute_rejected_total Requests rejected with 429 (or a reject rule's status), by gate.\n\
             # TYPE warmroute_rejected_total counter\n\
             warmroute_rejected_total{route=\"bm\",gate=\"concurrency\"} 0\n\
             warmroute_rejected_total{route=\"bm\",gate=\"ttft\"} 0\n\
             warmroute_rejected_total{route=\"bm\",gate=\"tps\"} 0\n\
             warmroute_rejected_total{route=\"bm\",gate=\"rule\"} 0\n\
             warmroute_rejected_total{route=\"chat\",gate=\"concurrency\"} 5\n\
             warmroute_rejected_total{route=\"chat\",gate=\"ttft\"} 0\n\
             warmroute_rejected_total{route=\"chat\",gate=\"tps\"} 0\n\
             warmroute_rejected_total{route=\"chat\",gate=\"rule\"} 0\n"
        );
    }

    #[test]
    fn whole_exposition_is_well_formed() {
        let (_t, seg, snap) = fixture();
        let w = seg.claim_worker(std::process::id(), 0).unwrap();
        let chat = snap.route("chat").unwrap();
        let a = &chat.pools[0].peers[0];
        seg.inflight_add(w, a.slot, 2);
        seg.ban(chat.pools[0].peers[1].slot, u64::MAX);
        seg.peer_cell(a.slot, cells::peer::PROBE_AT_MS)
            .store(1, Relaxed);
        seg.peer_cell(a.slot, cells::peer::PROBE_LATENCY_US)
            .store(1500, Relaxed);
        let src = Sources::new(&seg, &snap, 1, views(&[(1, 1_500_000_000), (2, 0)]), 1, 3);
        let text = render(&src);
        let has = |line: &str| assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        let peer_a = r#"route="chat",model="",peer="a\"q\\b",addr="127.0.0.1:8001",priority="0""#;
        has(&format!("warmroute_peer_inflight{{{peer_a}}} 2"));
        has(&format!("warmroute_peer_max_concurrency{{{peer_a}}} 3"));
        has(&format!(
            "warmroute_peer_probe_latency_seconds{{{peer_a}}} 0.0015"
        ));
        has(
            r#"warmroute_peer_banned{route="chat",model="",peer="b",addr="127.0.0.1:8002",priority="-1"} 1"#,
        );
        has(
            r#"warmroute_peer_inflight{route="bm",model="llama",peer="c",addr="127.0.0.1:8003",priority="0"} 0"#,
        );
        // Only the healthy top tier counts toward the limit.
        has(r#"warmroute_pool_limit{route="chat",model=""} 3"#);
        has(r#"warmroute_pool_inflight{route="chat",model=""} 2"#);
        has(r#"warmroute_worker_driver{worker="0",driver="io_uring"} 1"#);
        has(r#"warmroute_worker_driver{worker="1",driver="epoll"} 1"#);
        has(r#"warmroute_worker_cpu_seconds_total{worker="0"} 1.5"#);
        has(r#"warmroute_worker_cpu_seconds_total{worker="1"} 0"#);
        has("warmroute_workers 2");
        has("warmroute_config_generation 7");
        has(r#"warmroute_access_log_dropped_total{worker="1"} 3"#);
        has(&format!(
            "warmroute_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        ));
        // Never probed: no latency sample.
        assert!(!text
            .contains("warmroute_peer_probe_latency_seconds{route=\"chat\",model=\"\",peer=\"b\""));
        // Structure: every sample belongs to the family whose HELP/TYPE precede it, each
        // family appears once, counters end in _total, no ':' in names.
        let mut current = String::new();
        let mut families = HashSet::new();
        let mut series = HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                current = rest.split(' ').next().unwrap().to_string();
                assert!(families.insert(current.clone()), "family {current} twice");
                assert!(!current.contains(':'));
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert_eq!(name, current);
                assert_eq!(kind == "counter", name.ends_with("_total"), "{name}");
            } else {
                let name = line.split(['{', ' ']).next().unwrap();
                // A histogram's samples are its name plus _bucket, _sum or _count.
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suf| name.strip_suffix(suf).filter(|b| *b == current))
                    .unwrap_or(name);
                assert_eq!(base, current, "{line}");
                let (id, value) = line.rsplit_once(' ').unwrap();
                assert!(series.insert(id.to_string()), "duplicate series {id}");
                assert!(value.parse::<f64>().is_ok(), "{line}");
            }
        }
        assert_eq!(families.len(), FAMILIES.len());
        seg.release_worker(w);
    }
}
