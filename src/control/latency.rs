//! The pools' latency measurement and control, on the segment: which thresholds apply, the
//! request-path TTFT/decode-rate gates with their probe slots, the rate-limit master
//! switch, and what the elected worker does each tick (fold windows into EWMAs, step the
//! adaptive limit, sample the cluster average). The math is in `ewma` and `aimd`.

use warmroute_shm::Segment;

use super::aimd::{self, AimdInput, AimdParams};
use super::ewma::{self, Dir, EwmaCfg, Stat};
use super::pool_state::{self as ps, ctl, win};
use crate::cells::Relaxed;
use crate::config::{MetricSpec, RouteOpts};
use crate::measure::{TPS_BOUNDS, TTFT_BOUNDS_MS};
use crate::snapshot::PoolRt;

/// How often the cluster average samples pool in-flight, and how many samples it keeps.
pub const CLUSTER_AVG_INTERVAL_S: u64 = 30;
pub const CLUSTER_AVG_SAMPLES: u64 = 10;

/// Which of the two measured signals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Ttft,
    Tps,
}

impl Signal {
    pub fn bounds(self) -> &'static [f64] {
        match self {
            Signal::Ttft => &TTFT_BOUNDS_MS,
            Signal::Tps => &TPS_BOUNDS,
        }
    }
    pub fn dir(self) -> Dir {
        match self {
            Signal::Ttft => Dir::High,
            Signal::Tps => Dir::Low,
        }
    }
    /// The route's declared metric list for this signal (empty: the single threshold).
    pub fn metrics(self, opts: &RouteOpts) -> &[MetricSpec] {
        match self {
            Signal::Ttft => &opts.ttft_metrics,
            Signal::Tps => &opts.tps_metrics,
        }
    }
    /// The quantile of the single default metric (p80 for TTFT, the low tail for TPS).
    pub fn default_q(self) -> f64 {
        match self {
            Signal::Ttft => ewma::TTFT_DEFAULT_Q,
            Signal::Tps => ewma::TPS_DEFAULT_Q,
        }
    }
    pub fn slot(self, pool: &PoolRt) -> warmroute_shm::RouteSlot {
        match self {
            Signal::Ttft => pool.slots.ttft,
            Signal::Tps => pool.slots.tps,
        }
    }
    /// The signal's index in per-signal tables: TTFT 0, decode rate 1.
    pub fn index(self) -> usize {
        match self {
            Signal::Ttft => 0,
            Signal::Tps => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Signal::Ttft => "ttft",
            Signal::Tps => "tps",
        }
    }
}

/// A signal's settings for a route: window, TTL, α and the probe allowance (the metrics'
/// statistics are [`metric_stat`]'s, their names [`metric_name`]'s: this is read on the
/// request path).
pub struct SignalCfg {
    pub ewma: EwmaCfg,
    pub probe_window_s: u64,
    pub probe_per_window: u32,
}

pub fn signal_cfg(opts: &RouteOpts, sig: Signal) -> SignalCfg {
    let (window_s, ttl_s, alpha, pw, ppw) = match sig {
        Signal::Ttft => (
            opts.ttft_window,
            opts.ttft_ttl,
            opts.ttft_ewma_alpha,
            opts.ttft_probe_window,
            opts.ttft_probe_per_window,
        ),
        Signal::Tps => (
            opts.tps_window,
            opts.tps_ttl,
            opts.tps_ewma_alpha,
            opts.tps_probe_window,
            opts.tps_probe_per_window,
        ),
    };
    SignalCfg {
        ewma: EwmaCfg {
            window_s: window_s.max(1),
            ttl_s,
            alpha,
        },
        probe_window_s: pw,
        probe_per_window: ppw,
    }
}

/// The statistic metric `i` of the resolved list takes of each window: a declared
/// entry's, or the single default metric's when the route declares none.
fn metric_stat(opts: &RouteOpts, sig: Signal, i: usize) -> Stat {
    match sig.metrics(opts).get(i) {
        Some(m) if m.metric == "avg" => Stat::Avg,
        Some(m) => Stat::Quantile(m.q.unwrap_or(sig.default_q())),
        None => Stat::Quantile(sig.default_q()),
    }
}

/// The tag of metric `i` of the resolved list in the segment ([`ps::win::EXTRA`],
/// [`ps::win::FIRST_TAG`]): its statistic, which is what its EWMA means; never 0.
pub fn metric_tag(opts: &RouteOpts, sig: Signal, i: usize) -> u64 {
    match metric_stat(opts, sig, i) {
        Stat::Avg => u64::MAX,
        Stat::Quantile(q) => q.to_bits().max(1),
    }
}

/// The name of metric `i` of the signal's resolved list (the single default metric when
/// the route declares none).
pub fn metric_name(opts: &RouteOpts, sig: Signal, i: usize) -> String {
    match sig.metrics(opts).get(i) {
        Some(m) => m.metric.clone(),
        None => format!("p{}", (sig.default_q() * 100.0).round()),
    }
}

/// How far a metric's EWMA is into its threshold's side: ≥ 1 at or beyond it (the
/// non-strict hit), > 1 strictly beyond it. For TTFT `ewma / threshold`, for the decode
/// rate (low is bad) `threshold / ewma`; a zero divisor is infinitely far unless both are 0.
fn load(dir: Dir, e: f64, t: f64) -> f64 {
    let (num, den) = match dir {
        Dir::High => (e, t),
        Dir::Low => (t, e),
    };
    if den > 0.0 {
        num / den
    } else if num > 0.0 {
        f64::INFINITY
    } else {
        1.0
    }
}

/// A pool's signal judged over the whole resolved metric list (notes-control §1.5–1.6).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Judged {
    /// The first metric's live EWMA (what status shows as `ewma`, and what the adaptive
    /// controller needs before it moves at all).
    pub first_ewma: Option<f64>,
    /// Whether any metric has a threshold.
    pub has_threshold: bool,
    /// Of the metrics with both a live EWMA and a threshold, the one furthest into its
    /// threshold (the first of equals): the list hits, strictly or not, exactly when this
    /// one does (the adaptive controller's strict test reads it), and a graded gate (turn
    /// priority), whose grades scale each threshold by one factor, grades by it (up to
    /// the rounding of the ratio).
    pub binding: Option<Binding>,
    /// The first metric in list order at or beyond its threshold: the one a shed names,
    /// as the reference's does.
    pub first_hit: Option<Binding>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Binding {
    pub ewma: f64,
    pub threshold: f64,
    /// Its index in the resolved list.
    pub metric: usize,
}

/// Judge `sig` for `pool`: the first metric with the threshold [`threshold`] resolves for
/// it (declared, else the runtime override, per-model or route value), each later entry of
/// a declared list with its own declared threshold.
pub fn judge(opts: &RouteOpts, sig: Signal, pool: &PoolRt, seg: &Segment, now_s: u64) -> Judged {
    let slot = sig.slot(pool);
    let metrics = sig.metrics(opts);
    let t0 = threshold(opts, sig, pool, seg, now_s).map(|t| t.0);
    let ttl = match sig {
        Signal::Ttft => opts.ttft_ttl,
        Signal::Tps => opts.tps_ttl,
    };
    let e0 = ps::metric_ewma(seg, slot, 0, metric_tag(opts, sig, 0), now_s, ttl);
    let mut out = Judged {
        first_ewma: e0,
        has_threshold: t0.is_some(),
        binding: None,
        first_hit: None,
    };
    let mut consider = |i: usize, e: Option<f64>, t: Option<f64>| {
        let (Some(e), Some(t)) = (e, t) else {
            return;
        };
        let this = Binding {
            ewma: e,
            threshold: t,
            metric: i,
        };
        let l = load(sig.dir(), e, t);
        if out
            .binding
            .is_none_or(|b| l > load(sig.dir(), b.ewma, b.threshold))
        {
            out.binding = Some(this);
        }
        if out.first_hit.is_none() && ewma::hit(sig.dir(), Some(e), Some(t), false) {
            out.first_hit = Some(this);
        }
    };
    consider(0, e0, t0);
    for (i, m) in metrics.iter().enumerate().skip(1) {
        let t = m.threshold.filter(|t| t.is_finite() && *t >= 0.0);
        out.has_threshold |= t.is_some();
        if t.is_some() {
            let tag = metric_tag(opts, sig, i);
            consider(i, ps::metric_ewma(seg, slot, i, tag, now_s, ttl), t);
        }
    }
    out
}

/// The threshold in force and where it comes from: declared metrics > runtime override >
/// per-model > route (SPEC §5.1). Of a declared list, this is the first entry's; a later
/// entry is judged by its own declared threshold ([`judge`]).
pub fn threshold(
    opts: &RouteOpts,
    sig: Signal,
    pool: &PoolRt,
    seg: &Segment,
    now_s: u64,
) -> Option<(f64, &'static str)> {
    let (declared, by_model, route) = match sig {
        Signal::Ttft => (
            opts.ttft_metrics.first().and_then(|m| m.threshold),
            &opts.ttft_limit_by_model,
            opts.ttft_limit_ms,
        ),
        Signal::Tps => (
            opts.tps_metrics.first().and_then(|m| m.threshold),
            &opts.tps_limit_by_model,
            opts.tps_limit_tps,
        ),
    };
    let over = ps::threshold_override(seg, sig.slot(pool), now_s).map(|v| (v, 0));
    let model = pool.model.as_deref().and_then(|m| by_model.get(m).copied());
    ewma::resolve_threshold(declared, over, model, route, now_s)
}

/// The live EWMA of a pool's signal.
pub fn current_ewma(
    opts: &RouteOpts,
    sig: Signal,
    pool: &PoolRt,
    seg: &Segment,
    now_s: u64,
) -> Option<f64> {
    let ttl = signal_cfg(opts, sig).ewma.ttl_s;
    ps::metric_ewma(seg, sig.slot(pool), 0, metric_tag(opts, sig, 0), now_s, ttl)
}

/// Record one sample of a signal everywhere it is kept: the route's histogram, the pool's
/// window (which feeds the EWMA the gates use) and the peer's per-sample EWMA.
#[allow(clippy::too_many_arguments)]
pub fn record_sample(
    seg: &Segment,
    opts: &RouteOpts,
    route_slot: warmroute_shm::RouteSlot,
    pool: &PoolRt,
    peer_slot: warmroute_shm::PeerSlot,
    sig: Signal,
    v: f64,
    now_s: u64,
) {
    use crate::measure;
    let (hist, peer_cells, window, alpha, ttl) = match sig {
        Signal::Ttft => (
            measure::TTFT,
            measure::PEER_TTFT,
            opts.ttft_window,
            opts.ttft_ewma_alpha,
            opts.ttft_ttl,
        ),
        Signal::Tps => (
            measure::TPS,
            measure::PEER_TPS,
            opts.tps_window,
            opts.tps_ewma_alpha,
            opts.tps_ttl,
        ),
    };
    measure::record(seg, route_slot, hist, v);
    ps::record(seg, sig.slot(pool), sig.bounds(), v, now_s, window);
    measure::peer_ewma_update(seg, peer_slot, peer_cells, v, alpha, now_s, ttl);
}

/// A request's verdict at one latency gate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    Pass,
    Probe,
    Shed {
        ewma: f64,
        threshold: f64,
        /// The metric of the resolved list that was over its threshold.
        metric: usize,
    },
    /// Tripped while the rate-limit master switch is off: let through and counted as a
    /// trip (SPEC §5.6). No probe slot is taken — there is nothing to probe past — so the
    /// window's budget is whole when the switch comes back on.
    Trip,
}

/// The TTFT or decode-rate gate for one request (SPEC §5.1/§5.2). Off unless a threshold
/// is configured; a runtime toggle can switch it off while measurement goes on. `enforce`
/// is the rate-limit master switch: without it a hit is a `Trip`, whatever the probe
/// budget holds.
pub fn gate(
    opts: &RouteOpts,
    sig: Signal,
    pool: &PoolRt,
    seg: &Segment,
    now_s: u64,
    enforce: bool,
) -> Verdict {
    let slot = sig.slot(pool);
    if ps::gate_off(seg, slot) {
        return Verdict::Pass;
    }
    // The usual route has no threshold at all: decided before any EWMA is read.
    if sig.metrics(opts).len() <= 1 && threshold(opts, sig, pool, seg, now_s).is_none() {
        return Verdict::Pass;
    }
    // Any metric at or beyond its threshold trips the gate; the first in list order is
    // the one judged and named.
    let Some(b) = judge(opts, sig, pool, seg, now_s).first_hit else {
        return Verdict::Pass;
    };
    let (e, thr) = (Some(b.ewma), Some(b.threshold));
    if !enforce {
        return Verdict::Trip;
    }
    let cfg = signal_cfg(opts, sig);
    let used = ps::take_probe(seg, slot, now_s, cfg.probe_window_s);
    match match sig {
        Signal::Ttft => ewma::ttft_gate(e, thr, used, cfg.probe_per_window),
        Signal::Tps => ewma::tps_gate(e, thr, used, cfg.probe_per_window),
    } {
        ewma::Gate::Pass => Verdict::Pass,
        ewma::Gate::Probe => Verdict::Probe,
        ewma::Gate::Shed { ewma, threshold } => Verdict::Shed {
            ewma,
            threshold,
            metric: b.metric,
        },
    }
}

/// The rate-limit master switch (SPEC §5.6): runtime override > route option (which already
/// holds the server default when the route does not set it).
pub fn rate_limit_on(opts: &RouteOpts, pool: &PoolRt, seg: &Segment) -> bool {
    match ps::ctl_cell(seg, pool.slots.ctl, ctl::RATE_LIMIT).load(Relaxed) {
        1 => true,
        2 => false,
        _ => opts.load_rate_limit,
    }
}

/// Where the master switch's state comes from, as `/_rate_limit_status` names the layer.
pub const RL_SRC_RUNTIME: &str = "runtime";
pub const RL_SRC_ROUTE: &str = "route";
pub const RL_SRC_SERVER_DEFAULT: &str = "server_default";

/// The master switch and the layer that set it: the runtime override, the route's own
/// `load_rate_limit`, or the server file's `[defaults]` value the route inherited. For the
/// status endpoints; the request path asks `rate_limit_on`.
pub fn rate_limit_state(opts: &RouteOpts, pool: &PoolRt, seg: &Segment) -> (bool, &'static str) {
    match ps::ctl_cell(seg, pool.slots.ctl, ctl::RATE_LIMIT).load(Relaxed) {
        1 => (true, RL_SRC_RUNTIME),
        2 => (false, RL_SRC_RUNTIME),
        _ if opts.set_by_route.contains("load_rate_limit") => (opts.load_rate_limit, RL_SRC_ROUTE),
        _ => (opts.load_rate_limit, RL_SRC_SERVER_DEFAULT),
    }
}

pub fn aimd_params(opts: &RouteOpts) -> AimdParams {
    AimdParams {
        min: opts.adaptive_cc_min.map(f64::from),
        min_frac: opts.adaptive_cc_min_frac,
        init: opts.adaptive_cc_init.map(f64::from),
        init_frac: opts.adaptive_cc_init_frac,
        hold_when_idle: opts.adaptive_cc_hold_when_idle,
        use_ttft: opts.adaptive_cc_use_ttft,
        inc: opts.adaptive_cc_inc,
        dec: opts.adaptive_cc_dec,
        pressure_frac: opts.adaptive_cc_pressure_frac,
        slack_frac: opts.adaptive_cc_slack_frac,
        abs: opts.adaptive_cc_abs,
        ttl_s: opts.adaptive_cc_ttl,
    }
}

/// The static capacity adaptive concurrency moves under: the largest per-tier sum of the
/// configured peers' max_concurrency (bans ignored).
pub fn static_max(pool: &PoolRt) -> f64 {
    let mut tiers: Vec<(i32, u64)> = Vec::new();
    for p in &pool.peers {
        match tiers.iter_mut().find(|(t, _)| *t == p.priority) {
            Some((_, s)) => *s += p.max_concurrency as u64,
            None => tiers.push((p.priority, p.max_concurrency as u64)),
        }
    }
    tiers.iter().map(|(_, s)| *s).max().unwrap_or(0) as f64
}

/// The stored adaptive limit (None = unset or expired).
pub fn aimd_current(opts: &RouteOpts, pool: &PoolRt, seg: &Segment, now_s: u64) -> Option<f64> {
    let p = aimd_params(opts);
    let c = |i| ps::ctl_cell(seg, pool.slots.ctl, i).load(Relaxed);
    aimd::load(&p, c(ctl::AIMD_BITS), c(ctl::AIMD_AT_S), now_s)
}

/// The concurrency limit the gate applies: the adaptive one (within the pool's healthy
/// capacity) when adaptive concurrency is on, else the pool's healthy capacity.
#[inline]
pub fn concurrency_limit(
    opts: &RouteOpts,
    pool: &PoolRt,
    seg: &Segment,
    now_s: u64,
    pool_limit: f64,
) -> f64 {
    // The usual route has no adaptive concurrency: decided here, before anything else is
    // looked at (this runs for every request).
    if !opts.adaptive_cc || !adaptive_in_force(opts, pool, seg) {
        return pool_limit;
    }
    aimd::gate_limit(
        &aimd_params(opts),
        aimd_current(opts, pool, seg, now_s),
        static_max(pool),
        pool_limit,
    )
}

/// Whether the pool's limit is the adaptive one: `adaptive_cc` on, a decode-rate threshold
/// configured to steer by (without one adaptive concurrency is off and the static limit
/// applies, `reference/notes-control.md` §4.1; decided by the configuration, as the
/// reference decides it at registration, so a runtime `_tps_limit` override does not turn
/// it on or off), and the decode-rate signal not switched off at run time
/// (`_tps_toggle?on=0` puts the static pool limit back at once, as the reference's does;
/// on again, the stored adaptive value applies again).
pub fn adaptive_in_force(opts: &RouteOpts, pool: &PoolRt, seg: &Segment) -> bool {
    opts.adaptive_cc && tps_configured(opts, pool) && !ps::gate_off(seg, pool.slots.tps)
}

/// Whether the configuration gives the pool a decode-rate threshold: a `tps_metrics`
/// entry's, its model's `tps_limit_by_model`, or `tps_limit_tps`.
pub fn tps_configured(opts: &RouteOpts, pool: &PoolRt) -> bool {
    opts.tps_limit_tps.is_some()
        || opts.tps_metrics.iter().any(|m| m.threshold.is_some())
        || pool
            .model
            .as_deref()
            .is_some_and(|m| opts.tps_limit_by_model.contains_key(m))
}

/// One tick of the elected worker for one pool: fold closed windows, step the adaptive
/// limit when its interval came round, sample the cluster average.
pub fn tick(opts: &RouteOpts, pool: &PoolRt, seg: &Segment, now_s: u64) {
    for sig in [Signal::Ttft, Signal::Tps] {
        let slot = sig.slot(pool);
        let cfg = signal_cfg(opts, sig);
        let cur = cfg.ewma.window_id(now_s);
        if ps::window_state(seg, slot, 0, metric_tag(opts, sig, 0)).win == cur {
            continue;
        }
        let (counts, sum, n) = ps::take_bank(seg, slot, cur.saturating_sub(1));
        // Every metric of the list takes its own statistic of the same window, folded as
        // of the same last window: the first last, as its store moves the window id on.
        for i in (0..sig.metrics(opts).len().max(1)).rev() {
            let tag = metric_tag(opts, sig, i);
            let stat = metric_stat(opts, sig, i);
            let v = ewma::window_stat(stat, sig.bounds(), &counts, sum, n);
            let prev = ps::window_state(seg, slot, i, tag);
            let next = ewma::advance_merged(prev, &cfg.ewma, now_s, v);
            ps::store_window_state(seg, slot, i, tag, next);
        }
    }
    let c = |i| ps::ctl_cell(seg, pool.slots.ctl, i);
    let in_force = adaptive_in_force(opts, pool, seg);
    if !in_force {
        // Unmet demand is counted only under the adaptive limit; what was counted before
        // it went out of force (switched off at run time, say) is not demand it should
        // grow by when it is back.
        c(ctl::REJ).store(0, Relaxed);
    }
    if in_force && now_s >= c(ctl::AIMD_TICK_S).load(Relaxed) + opts.adaptive_cc_interval.max(1) {
        c(ctl::AIMD_TICK_S).store(now_s, Relaxed);
        let p = aimd_params(opts);
        // Each signal's list as one (EWMA, threshold): the metric furthest into its
        // threshold, so the controller's strict overload test holds when any metric's does.
        let tps = judge(opts, Signal::Tps, pool, seg, now_s);
        let ttft = judge(opts, Signal::Ttft, pool, seg, now_s);
        let input = AimdInput {
            current: aimd_current(opts, pool, seg, now_s),
            // The pool's live in-flight at this tick (the segment has it exactly; zero when
            // idle, which is what lets hold_when_idle hold).
            concurrency: pool_inflight(pool, seg) as f64,
            rejected_since_last: c(ctl::REJ).load(Relaxed),
            // No first-metric EWMA: the tick writes nothing (notes-control §4.4).
            tps_ewma: tps
                .first_ewma
                .and(tps.binding.map(|b| b.ewma).or(tps.first_ewma)),
            tps_threshold: tps.binding.map(|b| b.threshold),
            // TTFT switched off at run time is no signal for the controller either.
            ttft_ewma: ttft
                .binding
                .map(|b| b.ewma)
                .filter(|_| !ps::gate_off(seg, pool.slots.ttft)),
            ttft_threshold: ttft.binding.map(|b| b.threshold),
            static_max: static_max(pool),
        };
        if let Some(v) = aimd::step(&p, &input) {
            ps::set_aimd_limit(seg, pool.slots.ctl, v, now_s);
            // Take away what this step read, not all: a 429 counted by another worker since
            // the read is left for the next step.
            let _ = c(ctl::REJ).fetch_update(Relaxed, Relaxed, |r| {
                Some(r.saturating_sub(input.rejected_since_last))
            });
        }
    }
    let stamp = now_s / CLUSTER_AVG_INTERVAL_S;
    let idx = (stamp % CLUSTER_AVG_SAMPLES) as usize;
    if c(ctl::CLUSTER_STAMP + idx).load(Relaxed) != stamp {
        c(ctl::CLUSTER_BUCKETS + idx).store(pool_inflight(pool, seg) + 1, Relaxed);
        c(ctl::CLUSTER_STAMP + idx).store(stamp, Relaxed);
    }
}

/// The pool's in-flight requests now, summed over its peers and all workers.
pub fn pool_inflight(pool: &PoolRt, seg: &Segment) -> u64 {
    pool.peers
        .iter()
        .map(|p| seg.inflight(p.slot))
        .sum::<i64>()
        .max(0) as u64
}

/// The cluster average: mean of the samples of the last five minutes (SPEC §5.5).
pub fn cluster_avg(pool: &PoolRt, seg: &Segment, now_s: u64) -> (f64, u64) {
    let (mut sum, mut n) = (0u64, 0u64);
    for v in cluster_samples(pool, seg, now_s).into_iter().flatten() {
        sum += v;
        n += 1;
    }
    (if n > 0 { sum as f64 / n as f64 } else { 0.0 }, n)
}

/// The cluster average's ring of samples, by bucket index: the pool's in-flight sum at
/// each of the last ten sampling instants, None where a bucket is empty or too old.
pub fn cluster_samples(
    pool: &PoolRt,
    seg: &Segment,
    now_s: u64,
) -> [Option<u64>; CLUSTER_AVG_SAMPLES as usize] {
    let now_stamp = now_s / CLUSTER_AVG_INTERVAL_S;
    std::array::from_fn(|i| {
        let stamp = ps::ctl_cell(seg, pool.slots.ctl, ctl::CLUSTER_STAMP + i).load(Relaxed);
        let v = ps::ctl_cell(seg, pool.slots.ctl, ctl::CLUSTER_BUCKETS + i).load(Relaxed);
        (v > 0 && now_stamp.saturating_sub(stamp) < CLUSTER_AVG_SAMPLES).then(|| v - 1)
    })
}

/// Count a gate trip while the master switch is off (never added to the real 429 counters).
pub fn count_trip(seg: &Segment, pool: &PoolRt, gate: &str) {
    let cell = match gate {
        "concurrency" => ps::ctl_cell(seg, pool.slots.ctl, ctl::TRIPS_CONCURRENCY),
        "ttft" => seg.route_cell(pool.slots.ttft, win::TRIPS_WHILE_OFF),
        _ => seg.route_cell(pool.slots.tps, win::TRIPS_WHILE_OFF),
    };
    cell.fetch_add(1, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServerDefaults;

    /// A segment, one pool in it, and a route's defaults with 1 s windows, a 60 s TTL and
    /// no probe allowance for both signals.
    fn fixture(name: &str) -> (crate::testutil::TempSegment, PoolRt, RouteOpts) {
        let tmp = crate::testutil::TempSegment::new(name);
        let pool = PoolRt {
            model: None,
            peers: Vec::new(),
            slots: ps::PoolSlots::new(&tmp.seg, "r", None).unwrap(),
        };
        let mut opts = RouteOpts::defaults(&ServerDefaults::default());
        (opts.ttft_window, opts.ttft_ttl, opts.ttft_probe_per_window) = (1, 60, 0);
        (opts.tps_window, opts.tps_ttl, opts.tps_probe_per_window) = (1, 60, 0);
        (tmp, pool, opts)
    }

    /// Record `samples` of `sig` in the window of `at`.
    fn window(
        seg: &Segment,
        pool: &PoolRt,
        sig: Signal,
        at: u64,
        samples: impl IntoIterator<Item = f64>,
    ) {
        for v in samples {
            ps::record(seg, sig.slot(pool), sig.bounds(), v, at, 1);
        }
    }

    fn spec(metric: &str, q: Option<f64>, threshold: Option<f64>) -> MetricSpec {
        MetricSpec {
            metric: metric.into(),
            q,
            threshold,
        }
    }

    /// Every entry of a declared list is folded into its own EWMA from the same windows,
    /// and the gate sheds when any one is over its threshold, naming that one. The
    /// control: the same samples judged by the list's first entry alone pass. A reload
    /// that puts another metric in the second place does not read the old one's EWMA.
    #[test]
    fn every_metric_of_a_list_is_measured_and_any_one_over_its_threshold_sheds() {
        let (tmp, pool, mut opts) = fixture("metrics");
        let seg = &tmp.seg;
        opts.ttft_metrics = vec![
            spec("avg", None, Some(100_000.0)),
            spec("p90", Some(0.9), Some(2_000.0)),
            spec("p50", Some(0.5), None),
        ];
        let t0 = 1_800_000_000;
        tick(&opts, &pool, seg, t0);
        // One window: eight fast first tokens and two slow ones.
        window(
            seg,
            &pool,
            Signal::Ttft,
            t0,
            [100.0; 8].into_iter().chain([9_000.0; 2]),
        );
        tick(&opts, &pool, seg, t0 + 1);
        let j = judge(&opts, Signal::Ttft, &pool, seg, t0 + 1);
        assert_eq!(j.first_ewma, Some(1_880.0), "the average of the window");
        assert!(j.has_threshold);
        let b = j.binding.expect("two metrics have an EWMA and a threshold");
        assert_eq!(b.metric, 1, "{j:?}");
        assert!(b.ewma >= 9_000.0 && b.threshold == 2_000.0, "{b:?}");
        // The metric without a threshold is measured all the same.
        let tag = metric_tag(&opts, Signal::Ttft, 2);
        let p50 = ps::metric_ewma(seg, pool.slots.ttft, 2, tag, t0 + 1, 60);
        assert!(p50.is_some_and(|v| v < 1_000.0), "{p50:?}");
        match gate(&opts, Signal::Ttft, &pool, seg, t0 + 1, true) {
            Verdict::Shed { metric, .. } => {
                assert_eq!(metric_name(&opts, Signal::Ttft, metric), "p90")
            }
            v => panic!("{v:?}"),
        }
        // The control: the first entry alone is under its threshold.
        let mut first_only = opts.clone();
        first_only.ttft_metrics.truncate(1);
        assert_eq!(
            gate(&first_only, Signal::Ttft, &pool, seg, t0 + 1, true),
            Verdict::Pass
        );
        // Another metric in the second place starts without an EWMA, and is folded from
        // the next window on.
        let mut reloaded = opts.clone();
        reloaded.ttft_metrics[1] = spec("p95", Some(0.95), Some(2_000.0));
        assert_eq!(
            gate(&reloaded, Signal::Ttft, &pool, seg, t0 + 1, true),
            Verdict::Pass
        );
        window(
            seg,
            &pool,
            Signal::Ttft,
            t0 + 1,
            [100.0; 8].into_iter().chain([9_000.0; 2]),
        );
        tick(&reloaded, &pool, seg, t0 + 2);
        assert!(matches!(
            gate(&reloaded, Signal::Ttft, &pool, seg, t0 + 2, true),
            Verdict::Shed { metric: 1, .. }
        ));
    }

    /// A reload that swaps a list's entries does not read one metric's EWMA as the other's,
    /// the first entry's included: the new first entry starts without an EWMA. (Untagged,
    /// the old p99 EWMA read as the new first entry's average would shed.)
    #[test]
    fn a_reordered_list_starts_its_moved_metrics_fresh() {
        let (tmp, pool, mut opts) = fixture("reorder");
        let seg = &tmp.seg;
        opts.ttft_metrics = vec![
            spec("p99", Some(0.99), Some(30_000.0)),
            spec("avg", None, Some(5_000.0)),
        ];
        let t0 = 1_800_000_000;
        tick(&opts, &pool, seg, t0);
        window(
            seg,
            &pool,
            Signal::Ttft,
            t0,
            [100.0; 9].into_iter().chain([9_000.0]),
        );
        tick(&opts, &pool, seg, t0 + 1);
        // The control: both measured, neither over its threshold.
        let j = judge(&opts, Signal::Ttft, &pool, seg, t0 + 1);
        assert_eq!(j.first_ewma, Some(12_000.0), "{j:?}");
        assert_eq!(j.binding.map(|b| b.metric), Some(0), "{j:?}");
        assert_eq!(
            gate(&opts, Signal::Ttft, &pool, seg, t0 + 1, true),
            Verdict::Pass
        );
        let mut swapped = opts.clone();
        swapped.ttft_metrics.swap(0, 1);
        let j = judge(&swapped, Signal::Ttft, &pool, seg, t0 + 1);
        assert_eq!((j.first_ewma, j.binding), (None, None), "{j:?}");
        assert_eq!(
            gate(&swapped, Signal::Ttft, &pool, seg, t0 + 1, true),
            Verdict::Pass
        );
        // From the next window each is folded under its own tag again.
        window(
            seg,
            &pool,
            Signal::Ttft,
            t0 + 1,
            [100.0; 9].into_iter().chain([9_000.0]),
        );
        tick(&swapped, &pool, seg, t0 + 2);
        let j = judge(&swapped, Signal::Ttft, &pool, seg, t0 + 2);
        assert_eq!(j.first_ewma, Some(990.0), "the average: {j:?}");
        assert_eq!(j.first_hit, None, "{j:?}");
    }

    /// The concurrency 429s counted as unmet demand are dropped while adaptive concurrency
    /// is not in force, so that switching it back on does not grow the limit by them; the
    /// control: in force, a tick that writes nothing (no decode-rate EWMA yet) keeps them.
    #[test]
    fn unmet_demand_is_not_carried_over_while_adaptive_concurrency_is_off() {
        let (tmp, pool, mut opts) = fixture("unmet");
        let seg = &tmp.seg;
        opts.adaptive_cc = true;
        opts.tps_limit_tps = Some(20.0);
        let rej = ps::ctl_cell(seg, pool.slots.ctl, ctl::REJ);
        let t0 = 1_800_000_000;
        rej.store(5, Relaxed);
        tick(&opts, &pool, seg, t0);
        assert_eq!(rej.load(Relaxed), 5, "in force: kept for the next step");
        ps::set_gate_off(seg, pool.slots.tps, true);
        assert!(!adaptive_in_force(&opts, &pool, seg));
        tick(&opts, &pool, seg, t0 + 1);
        assert_eq!(rej.load(Relaxed), 0);
    }

    /// The decode rate's list sheds when any metric is at or under its threshold, and the
    /// adaptive controller's strict test sees the metric furthest under.
    #[test]
    fn a_decode_rate_list_binds_on_the_metric_furthest_under_its_threshold() {
        let (tmp, pool, mut opts) = fixture("tpsmetrics");
        let seg = &tmp.seg;
        opts.tps_metrics = vec![
            spec("avg", None, Some(10.0)),
            spec("p10", Some(0.1), Some(20.0)),
        ];
        let t0 = 1_800_000_000;
        tick(&opts, &pool, seg, t0);
        window(
            seg,
            &pool,
            Signal::Tps,
            t0,
            [5.0].into_iter().chain([100.0; 9]),
        );
        tick(&opts, &pool, seg, t0 + 1);
        let j = judge(&opts, Signal::Tps, &pool, seg, t0 + 1);
        // The average (90.5) is well over 10; the low tail is under 20.
        assert!(j.first_ewma.is_some_and(|e| e > 10.0), "{j:?}");
        let b = j.binding.unwrap();
        assert_eq!(b.metric, 1, "{j:?}");
        assert!(b.ewma < b.threshold, "{b:?}");
        assert!(matches!(
            gate(&opts, Signal::Tps, &pool, seg, t0 + 1, true),
            Verdict::Shed { metric: 1, .. }
        ));
        assert!(tps_configured(&opts, &pool));
        opts.tps_metrics.truncate(1);
        assert_eq!(
            gate(&opts, Signal::Tps, &pool, seg, t0 + 1, true),
            Verdict::Pass
        );
    }
}
