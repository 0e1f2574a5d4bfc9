//! Window → statistic → EWMA math and the TTFT/TPS gate decisions (SPEC §5.1, §5.2;
//! notes-control §1.4–§1.6, §2.4–§2.6). Pure: every function takes the counts, the state and
//! `now_s` as arguments; no IO, no clock, no shared memory.
//!
//! # Reads, decides, writes
//! - Reads: one window's histogram counts (bucket bounds `crate::measure::TTFT_BOUNDS_MS` /
//!   `crate::measure::TPS_BOUNDS`, plus an overflow bucket), a pool's [`WindowState`], the
//!   probe counter of the current probe window, the candidate thresholds.
//! - Decides: the window statistic (quantile or average), the folded EWMA, whether the EWMA is
//!   still alive, which threshold applies, and [`Gate`] for one request.
//! - Writes: nothing. Callers store [`WindowState`] as three `u64` cells.
//!
//! # Folding design: one writer, folded on the lease holder's tick
//! The reference folds lazily on the request path and elects a folder per window with an
//! atomic add (`fd:<w>`). warmroute already has one elected worker running a 500 ms tick, so
//! that worker is the **only writer** of every pool's [`WindowState`]: on each tick it calls
//! [`advance`] per pool (and metric) with the current window id. No fold election, no
//! per-window keys to delete, and the EWMA moves at the window boundary instead of waiting for
//! the next sample (the reference's "EWMA reflects windows only after a later sample").
//!
//! [`advance`] follows the reference rule exactly: a fresh state (`win == 0`) only records the
//! current window; when the window id moved on, every closed window in
//! `[max(win, cur − horizon), cur − 1]` is folded in order (horizon = ⌈ttl / W⌉), then
//! `win = cur`. The per-window statistic comes from a closure, so any histogram storage
//! works. Two that fit a single writer:
//! - per-window banks (e.g. two banks picked by `window id % 2`, the writer folding and
//!   clearing the previous one): pass the bank's statistic for `w == cur − 1` and `None` for
//!   older windows, whose bank was reused — [`advance_merged`] does exactly that;
//! - cumulative histograms (workers only `fetch_add`) minus a baseline the writer keeps in
//!   its own memory and retakes at each window change ([`delta_counts`]). A new leader has
//!   no baseline: its first tick stores one and folds nothing (`advance_merged(.., None)`),
//!   losing at most one window, like the reference when `ewin` expires.
//!
//! Either way a tick that stalled across several windows folds what it has once, as the last
//! closed window.
//!
//! Readers (every worker) load `ewma_bits` and `last_fold_s`; the writer stores `ewma_bits`
//! first, then `last_fold_s`, so a reader never sees a timestamp without its value.
//! A zeroed cell triple means "nothing yet" ([`WindowState::default`]).

use std::ops::Range;

/// Reference defaults (SPEC §5.1/§5.2, notes §1.4–§1.6, §2.4).
pub const DEFAULT_ALPHA: f64 = 0.3;
pub const DEFAULT_WINDOW_S: u64 = 20;
pub const DEFAULT_TTL_S: u64 = 60;
pub const DEFAULT_PROBE_WINDOW_S: u64 = 10;
pub const DEFAULT_PROBE_PER_WINDOW: u32 = 5;
/// Default quantile of the TTFT metric ("p80").
pub const TTFT_DEFAULT_Q: f64 = 0.8;
/// Default quantile of the decode-rate metric: named "p80" too, but the low tail (q 0.2).
pub const TPS_DEFAULT_Q: f64 = 0.2;
/// Default lifetime of a runtime threshold override (`/_ttft_limit`, `/_tps_limit`).
pub const DEFAULT_OVERRIDE_TTL_S: u64 = 7200;

/// Window id = ⌊now / window⌋ (a zero window length counts as 1 s).
pub fn window_id(now_s: u64, window_s: u64) -> u64 {
    now_s / window_s.max(1)
}

/// How many closed windows a fold looks back at most: ⌈ttl / window⌉, at least 1.
pub fn horizon(ttl_s: u64, window_s: u64) -> u64 {
    ttl_s.div_ceil(window_s.max(1)).max(1)
}

/// The windowed statistic a metric folds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stat {
    /// Bucket-quantised quantile, q in (0, 1).
    Quantile(f64),
    /// sum / count of the window.
    Avg,
}

/// Quantile of one window's histogram (notes §1.4): total = Σ counts (empty → `None`, never
/// 0); the first bucket whose running total reaches total × q yields its upper bound; the
/// overflow bucket (index `bounds.len()`) yields last bound × 2. Missing trailing counts are 0.
pub fn window_quantile(bounds: &[f64], counts: &[u64], q: f64) -> Option<f64> {
    let last = *bounds.last()?;
    let n = bounds.len() + 1;
    let total: u64 = counts.iter().take(n).sum();
    if total == 0 {
        return None;
    }
    let target = total as f64 * q.clamp(0.0, 1.0);
    let mut run = 0u64;
    for (i, &c) in counts.iter().take(n).enumerate() {
        run += c;
        if run as f64 >= target {
            return Some(bounds.get(i).copied().unwrap_or(last * 2.0));
        }
    }
    // Unreachable for q ≤ 1 (the running total ends at total ≥ target); kept total.
    Some(last * 2.0)
}

/// `avg` metric of one window: sum / count, `None` for an empty window.
pub fn window_avg(sum: f64, count: u64) -> Option<f64> {
    (count > 0).then(|| sum / count as f64)
}

/// The statistic of one window for `stat`.
pub fn window_stat(
    stat: Stat,
    bounds: &[f64],
    counts: &[u64],
    sum: f64,
    count: u64,
) -> Option<f64> {
    match stat {
        Stat::Quantile(q) => window_quantile(bounds, counts, q),
        Stat::Avg => window_avg(sum, count),
    }
}

/// Per-bucket difference `now − base` of two cumulative histograms (wrapping, so a counter
/// reset never panics), written to `out` (the shortest of the three lengths).
pub fn delta_counts(now: &[u64], base: &[u64], out: &mut [u64]) {
    for ((o, &n), &b) in out.iter_mut().zip(now).zip(base) {
        *o = n.wrapping_sub(b);
    }
}

/// One EWMA step: `α·v + (1−α)·ewma`, or `v` when there is no previous value; an empty window
/// (`v = None`, or a non-finite value) leaves the EWMA untouched. α is clamped into [0, 1].
pub fn fold(ewma: Option<f64>, v: Option<f64>, alpha: f64) -> Option<f64> {
    match (ewma, v.filter(|x| x.is_finite())) {
        (e, None) => e,
        (None, Some(v)) => Some(v),
        (Some(e), Some(v)) => {
            let a = if alpha.is_nan() {
                DEFAULT_ALPHA
            } else {
                alpha.clamp(0.0, 1.0)
            };
            Some(a * v + (1.0 - a) * e)
        }
    }
}

/// Whether an EWMA last written at `last_fold_s` is still alive at `now_s` (it expires `ttl_s`
/// after its last fold; `last_fold_s = 0` = never written; `ttl_s = 0` = never expires).
pub fn ewma_alive(last_fold_s: u64, now_s: u64, ttl_s: u64) -> bool {
    last_fold_s != 0 && (ttl_s == 0 || now_s < last_fold_s.saturating_add(ttl_s))
}

/// Window/EWMA parameters of one measured quantity (from `*_window`, `*_ttl`, `*_ewma_alpha`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EwmaCfg {
    pub window_s: u64,
    pub ttl_s: u64,
    pub alpha: f64,
}

impl Default for EwmaCfg {
    fn default() -> Self {
        EwmaCfg {
            window_s: DEFAULT_WINDOW_S,
            ttl_s: DEFAULT_TTL_S,
            alpha: DEFAULT_ALPHA,
        }
    }
}

impl EwmaCfg {
    pub fn window_id(&self, now_s: u64) -> u64 {
        window_id(now_s, self.window_s)
    }
    pub fn horizon(&self) -> u64 {
        horizon(self.ttl_s, self.window_s)
    }
}

/// One pool's (and metric's) EWMA state, three `u64` cells. All zero = nothing yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowState {
    /// Last window id seen by the folder; 0 = never (window 0 is 1970).
    pub win: u64,
    /// `f64::to_bits` of the EWMA; meaningful only when `last_fold_s != 0`.
    pub ewma_bits: u64,
    /// When the EWMA was last written (s); 0 = no EWMA.
    pub last_fold_s: u64,
}

impl WindowState {
    /// The stored EWMA, ignoring expiry.
    pub fn ewma(&self) -> Option<f64> {
        (self.last_fold_s != 0).then(|| f64::from_bits(self.ewma_bits))
    }

    /// The EWMA as the gates see it: `None` once it expired.
    pub fn live_ewma(&self, now_s: u64, ttl_s: u64) -> Option<f64> {
        if ewma_alive(self.last_fold_s, now_s, ttl_s) {
            self.ewma()
        } else {
            None
        }
    }
}

/// The closed windows a fold at `cur_win` covers (empty when nothing closed, or when the
/// state is fresh): `[max(last_win, cur_win − horizon), cur_win)`.
pub fn pending_windows(last_win: u64, cur_win: u64, horizon: u64) -> Range<u64> {
    if last_win == 0 || cur_win <= last_win {
        return cur_win..cur_win;
    }
    last_win.max(cur_win.saturating_sub(horizon.max(1)))..cur_win
}

/// Advance a pool's state to `now_s` (see the module doc): fold the statistic of every pending
/// window (`stat_of(w)`, `None` = empty window) into the EWMA, oldest first, then record the
/// current window. An expired EWMA is treated as absent before folding (the next value
/// starts it afresh). A window that yields a value refreshes `last_fold_s` to `now_s`.
pub fn advance(
    st: WindowState,
    cfg: &EwmaCfg,
    now_s: u64,
    mut stat_of: impl FnMut(u64) -> Option<f64>,
) -> WindowState {
    let cur = cfg.window_id(now_s);
    if st.win == 0 {
        return WindowState { win: cur, ..st };
    }
    if cur <= st.win {
        return st;
    }
    let mut out = WindowState { win: cur, ..st };
    let mut ewma = st.live_ewma(now_s, cfg.ttl_s);
    for w in pending_windows(st.win, cur, cfg.horizon()) {
        let v = stat_of(w).filter(|x| x.is_finite());
        if v.is_some() {
            ewma = fold(ewma, v, cfg.alpha);
            if let Some(e) = ewma {
                out.ewma_bits = e.to_bits();
                out.last_fold_s = now_s.max(1);
            }
        }
    }
    out
}

/// [`advance`] for a single statistic covering everything since the last window change (the
/// cumulative-minus-baseline design): `merged` is folded once, as the last closed window.
pub fn advance_merged(
    st: WindowState,
    cfg: &EwmaCfg,
    now_s: u64,
    merged: Option<f64>,
) -> WindowState {
    let last = cfg.window_id(now_s).saturating_sub(1);
    advance(st, cfg, now_s, |w| if w == last { merged } else { None })
}

/// Half-open probe slot: `used_in_window` is how many slots this probe window already gave
/// out, not counting this request (the value a `fetch_add(1)` returns). Admit iff
/// `used_in_window < per_window`, i.e. the first `per_window` tripped requests of each
/// window pass.
pub fn probe_admit(used_in_window: u64, per_window: u32) -> bool {
    used_in_window < u64::from(per_window)
}

/// Which side of a threshold is bad.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Bad when high (TTFT).
    High,
    /// Bad when low (decode rate).
    Low,
}

/// Whether `ewma` is on the bad side of `threshold`. Request path: non-strict (TTFT ≥, TPS ≤);
/// the AIMD uses `strict` (TTFT >, TPS <), so at exact equality the request gate sheds while
/// the controller does not shrink (notes §1.6, §2.6 — deliberate).
pub fn hit(dir: Dir, ewma: Option<f64>, threshold: Option<f64>, strict: bool) -> bool {
    let (Some(e), Some(t)) = (ewma, threshold) else {
        return false;
    };
    match (dir, strict) {
        (Dir::High, false) => e >= t,
        (Dir::High, true) => e > t,
        (Dir::Low, false) => e <= t,
        (Dir::Low, true) => e < t,
    }
}

/// The first metric of a declared list that hits (`(ewma, threshold)` per metric), if any.
pub fn first_hit(dir: Dir, strict: bool, metrics: &[(Option<f64>, Option<f64>)]) -> Option<usize> {
    metrics.iter().position(|&(e, t)| hit(dir, e, t, strict))
}

/// One request's verdict at a TTFT or TPS gate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gate {
    /// Not tripped (or no threshold, or no live EWMA).
    Pass,
    /// Tripped, admitted on a half-open probe slot: the caller takes the slot.
    Probe,
    /// Tripped and no slot left: 429 with these figures.
    Shed { ewma: f64, threshold: f64 },
}

fn gate(dir: Dir, ewma: Option<f64>, threshold: Option<f64>, used: u64, per_window: u32) -> Gate {
    match (ewma, threshold) {
        (Some(e), Some(t)) if hit(dir, Some(e), Some(t), false) => {
            if probe_admit(used, per_window) {
                Gate::Probe
            } else {
                Gate::Shed {
                    ewma: e,
                    threshold: t,
                }
            }
        }
        _ => Gate::Pass,
    }
}

/// TTFT gate (request path): EWMA ≥ threshold sheds unless a probe slot is left
/// (`probe_used` as in [`probe_admit`]). No threshold or no live EWMA → `Pass`.
pub fn ttft_gate(
    ewma_ms: Option<f64>,
    threshold_ms: Option<f64>,
    probe_used: u64,
    probe_per_window: u32,
) -> Gate {
    gate(
        Dir::High,
        ewma_ms,
        threshold_ms,
        probe_used,
        probe_per_window,
    )
}

/// Decode-rate gate (request path, adaptive concurrency off): EWMA ≤ threshold sheds unless a
/// probe slot is left. No threshold or no live EWMA → `Pass`.
pub fn tps_gate(
    ewma_tps: Option<f64>,
    threshold_tps: Option<f64>,
    probe_used: u64,
    probe_per_window: u32,
) -> Gate {
    gate(
        Dir::Low,
        ewma_tps,
        threshold_tps,
        probe_used,
        probe_per_window,
    )
}

/// Threshold source labels, as `/_ttft_status` and `/_tps_status` show them.
pub const SRC_METRICS: &str = "metrics";
pub const SRC_OVERRIDE: &str = "override";
pub const SRC_MODEL: &str = "model";
pub const SRC_ROUTE: &str = "route";

/// The threshold that applies, first that is set (notes §1.5, §2.5): the declared `*_metrics`
/// threshold > the runtime override `(value, expires_s)` while alive (`expires_s = 0` = never
/// expires) > the per-model static value > the route's static value. Non-finite or negative
/// values count as unset. Returns the value and its source label.
pub fn resolve_threshold(
    declared: Option<f64>,
    override_: Option<(f64, u64)>,
    by_model: Option<f64>,
    route: Option<f64>,
    now_s: u64,
) -> Option<(f64, &'static str)> {
    let ok = |v: f64| v.is_finite() && v >= 0.0;
    if let Some(v) = declared.filter(|&v| ok(v)) {
        return Some((v, SRC_METRICS));
    }
    if let Some((v, exp)) = override_ {
        if ok(v) && (exp == 0 || now_s < exp) {
            return Some((v, SRC_OVERRIDE));
        }
    }
    if let Some(v) = by_model.filter(|&v| ok(v)) {
        return Some((v, SRC_MODEL));
    }
    route.filter(|&v| ok(v)).map(|v| (v, SRC_ROUTE))
}

/// `expires_s` to store with an override set at `now_s` for `ttl_s` (0 = never expires).
pub fn override_expiry(now_s: u64, ttl_s: u64) -> u64 {
    if ttl_s == 0 {
        0
    } else {
        now_s.saturating_add(ttl_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::measure::{bucket, TPS_BOUNDS, TTFT_BOUNDS_MS};

    /// Tiny seeded PRNG (xorshift64*), so a failing run can be replayed from its seed.
    use crate::testutil::XorShift;

    fn hist(bounds: &[f64], samples: &[f64]) -> (Vec<u64>, f64, u64) {
        let mut c = vec![0u64; bounds.len() + 1];
        for &s in samples {
            c[bucket(bounds, s)] += 1;
        }
        (c, samples.iter().sum(), samples.len() as u64)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn worked_ttft_example_notes_1_7() {
        let s = [
            400.0, 700.0, 900.0, 1200.0, 1300.0, 1800.0, 2500.0, 2600.0, 4000.0, 9000.0,
        ];
        let (c, sum, n) = hist(&TTFT_BOUNDS_MS, &s);
        // bucket counts at bounds 500:1, 1000:2, 1500:2, 2000:1, 3000:2, 5000:1, 12000:1
        assert_eq!(c, vec![0, 1, 2, 2, 1, 2, 1, 0, 1, 0, 0, 0, 0, 0]);
        let p80 = window_quantile(&TTFT_BOUNDS_MS, &c, TTFT_DEFAULT_Q);
        assert_eq!(p80, Some(3000.0));
        assert_eq!(window_avg(sum, n), Some(2440.0));
        assert_eq!(
            window_stat(Stat::Avg, &TTFT_BOUNDS_MS, &c, sum, n),
            Some(2440.0)
        );
        let e = fold(Some(2000.0), p80, 0.3).unwrap();
        assert!(close(e, 2300.0), "{e}");
        // A single 90 000 ms sample lands in the overflow bucket: last bound × 2.
        let (c, _, _) = hist(&TTFT_BOUNDS_MS, &[90000.0]);
        assert_eq!(window_quantile(&TTFT_BOUNDS_MS, &c, 0.8), Some(160000.0));
        // One sample is enough; no minimum count.
        let (c, _, _) = hist(&TTFT_BOUNDS_MS, &[260.0]);
        assert_eq!(window_quantile(&TTFT_BOUNDS_MS, &c, 0.8), Some(500.0));
    }

    #[test]
    fn worked_tps_example_notes_2_7() {
        let s = [12.0, 18.0, 22.0, 35.0, 40.0, 45.0, 60.0, 80.0, 95.0, 120.0];
        let (c, _, _) = hist(&TPS_BOUNDS, &s);
        let p20 = window_quantile(&TPS_BOUNDS, &c, TPS_DEFAULT_Q);
        assert_eq!(p20, Some(20.0));
        // Request path: 20 ≤ 20 hits; the AIMD (strict) does not.
        assert!(hit(Dir::Low, p20, Some(20.0), false));
        assert!(!hit(Dir::Low, p20, Some(20.0), true));
        assert_eq!(
            tps_gate(p20, Some(20.0), 5, 5),
            Gate::Shed {
                ewma: 20.0,
                threshold: 20.0
            }
        );
        assert_eq!(tps_gate(p20, Some(19.9), 5, 5), Gate::Pass);
        let (c, _, _) = hist(&TPS_BOUNDS, &[1000.0]);
        assert_eq!(window_quantile(&TPS_BOUNDS, &c, 0.2), Some(600.0));
    }

    #[test]
    fn empty_windows_give_nothing_and_leave_the_ewma() {
        assert_eq!(window_quantile(&TTFT_BOUNDS_MS, &[0; 14], 0.8), None);
        assert_eq!(window_quantile(&TTFT_BOUNDS_MS, &[], 0.8), None);
        assert_eq!(window_quantile(&[], &[3], 0.8), None);
        assert_eq!(window_avg(0.0, 0), None);
        assert_eq!(fold(Some(1234.0), None, 0.3), Some(1234.0));
        assert_eq!(fold(None, None, 0.3), None);
        assert_eq!(fold(None, Some(7.0), 0.3), Some(7.0));
        assert_eq!(fold(Some(1.0), Some(f64::NAN), 0.3), Some(1.0));
        // α clamped into [0, 1].
        assert_eq!(fold(Some(10.0), Some(20.0), 5.0), Some(20.0));
        assert_eq!(fold(Some(10.0), Some(20.0), -1.0), Some(10.0));
        // Short count slices are padded with zeros.
        assert_eq!(
            window_quantile(&TTFT_BOUNDS_MS, &[0, 0, 4], 0.5),
            Some(1000.0)
        );
    }

    #[test]
    fn quantiles_walk_the_running_total() {
        let b = [1.0, 2.0, 3.0];
        assert_eq!(window_quantile(&b, &[1, 1, 1, 1], 0.25), Some(1.0));
        assert_eq!(window_quantile(&b, &[1, 1, 1, 1], 0.5), Some(2.0));
        assert_eq!(window_quantile(&b, &[1, 1, 1, 1], 0.75), Some(3.0));
        assert_eq!(window_quantile(&b, &[1, 1, 1, 1], 0.76), Some(6.0));
        assert_eq!(window_quantile(&b, &[0, 0, 0, 2], 0.1), Some(6.0));
    }

    #[test]
    fn expiry() {
        assert!(!ewma_alive(0, 5, 60), "never written");
        assert!(ewma_alive(100, 100, 60));
        assert!(ewma_alive(100, 159, 60));
        assert!(!ewma_alive(100, 160, 60), "gone 60 s after the last fold");
        assert!(ewma_alive(100, u64::MAX, 0), "ttl 0 never expires");
        let st = WindowState {
            win: 5,
            ewma_bits: 42.0f64.to_bits(),
            last_fold_s: 100,
        };
        assert_eq!(st.live_ewma(159, 60), Some(42.0));
        assert_eq!(st.live_ewma(160, 60), None);
        assert_eq!(WindowState::default().ewma(), None);
    }

    #[test]
    fn lazy_folding_follows_the_reference_rule() {
        let cfg = EwmaCfg::default();
        assert_eq!(cfg.horizon(), 3);
        assert_eq!(horizon(61, 20), 4);
        assert_eq!(horizon(0, 20), 1);
        assert_eq!(window_id(39, 20), 1);
        assert_eq!(window_id(40, 0), 40);
        // Fresh state: record the window, fold nothing.
        let mut asked = Vec::new();
        let st = advance(WindowState::default(), &cfg, 1000, |w| {
            asked.push(w);
            Some(1.0)
        });
        assert_eq!(st.win, 50);
        assert_eq!(st.ewma(), None);
        assert!(asked.is_empty());
        // Same window: untouched.
        let same = advance(st, &cfg, 1019, |_| panic!("nothing to fold"));
        assert_eq!(same, st);
        // Next window: window 50 folds.
        let st = advance(st, &cfg, 1020, |w| {
            asked.push(w);
            Some(3000.0)
        });
        assert_eq!(asked, vec![50]);
        assert_eq!(
            (st.win, st.ewma(), st.last_fold_s),
            (51, Some(3000.0), 1020)
        );
        // A gap of 10 windows folds only the last `horizon` (3) windows, oldest first.
        asked.clear();
        let st2 = advance(st, &cfg, 61 * 20 + 5, |w| {
            asked.push(w);
            Some(1000.0)
        });
        assert_eq!(asked, vec![58, 59, 60]);
        assert_eq!(st2.win, 61);
        // The EWMA had expired (last fold 1020, now 1225): the first window restarts it.
        let want = fold(fold(Some(1000.0), Some(1000.0), 0.3), Some(1000.0), 0.3);
        assert_eq!(st2.ewma(), want);
        // Empty windows leave value and timestamp alone.
        let st3 = advance(st, &cfg, 1045, |_| None);
        assert_eq!(
            (st3.win, st3.ewma(), st3.last_fold_s),
            (52, Some(3000.0), 1020)
        );
        // Live EWMA folds with α.
        let st4 = advance(st3, &cfg, 1060, |_| Some(2000.0));
        assert!(close(st4.ewma().unwrap(), 0.3 * 2000.0 + 0.7 * 3000.0));
        assert_eq!(pending_windows(0, 9, 3), 9..9);
        assert_eq!(pending_windows(9, 9, 3), 9..9);
        assert_eq!(pending_windows(7, 9, 3), 7..9);
    }

    #[test]
    fn merged_delta_folds_once_as_the_last_window() {
        let cfg = EwmaCfg::default();
        let cum_then = [0u64, 1, 2, 2, 1, 2, 1, 0, 1, 0, 0, 0, 0, 0];
        let cum_now = [0u64, 2, 4, 4, 2, 4, 2, 0, 2, 0, 0, 0, 0, 0];
        let mut d = [0u64; 14];
        delta_counts(&cum_now, &cum_then, &mut d);
        assert_eq!(d, cum_then);
        let v = window_quantile(&TTFT_BOUNDS_MS, &d, 0.8);
        let st = WindowState {
            win: 50,
            ewma_bits: 2000.0f64.to_bits(),
            last_fold_s: 1000,
        };
        let st = advance_merged(st, &cfg, 1041, v);
        assert_eq!(st.win, 52);
        assert!(close(st.ewma().unwrap(), 2300.0));
        // New leader without a baseline: store one, fold nothing.
        let fresh = advance_merged(st, &cfg, 1065, None);
        assert_eq!((fresh.win, fresh.ewma()), (53, st.ewma()));
    }

    #[test]
    fn probe_slots_first_n_of_each_window() {
        let admitted: Vec<bool> = (0..8).map(|used| probe_admit(used, 5)).collect();
        assert_eq!(
            admitted,
            [true, true, true, true, true, false, false, false]
        );
        assert!(!probe_admit(0, 0));
    }

    #[test]
    fn ttft_gate_decisions() {
        assert_eq!(ttft_gate(None, Some(200.0), 99, 5), Gate::Pass);
        assert_eq!(ttft_gate(Some(9e9), None, 99, 5), Gate::Pass);
        assert_eq!(ttft_gate(Some(199.9), Some(200.0), 99, 5), Gate::Pass);
        // At exact equality the request gate trips.
        assert_eq!(ttft_gate(Some(200.0), Some(200.0), 0, 5), Gate::Probe);
        assert_eq!(ttft_gate(Some(600.0), Some(200.0), 4, 5), Gate::Probe);
        assert_eq!(
            ttft_gate(Some(600.0), Some(200.0), 5, 5),
            Gate::Shed {
                ewma: 600.0,
                threshold: 200.0
            }
        );
        assert!(!hit(Dir::High, Some(200.0), Some(200.0), true));
        assert!(hit(Dir::High, Some(200.1), Some(200.0), true));
        let metrics = [
            (Some(100.0), Some(200.0)),
            (None, Some(1.0)),
            (Some(5.0), Some(5.0)),
        ];
        assert_eq!(first_hit(Dir::High, false, &metrics), Some(2));
        assert_eq!(first_hit(Dir::High, true, &metrics), None);
    }

    #[test]
    fn threshold_resolution_order() {
        let now = 1000;
        let all = resolve_threshold(Some(1.0), Some((2.0, 0)), Some(3.0), Some(4.0), now);
        assert_eq!(all, Some((1.0, SRC_METRICS)));
        assert_eq!(
            resolve_threshold(None, Some((2.0, 1001)), Some(3.0), Some(4.0), now),
            Some((2.0, SRC_OVERRIDE))
        );
        assert_eq!(
            resolve_threshold(None, Some((2.0, 1000)), Some(3.0), Some(4.0), now),
            Some((3.0, SRC_MODEL)),
            "an expired override no longer applies"
        );
        assert_eq!(
            resolve_threshold(None, Some((2.0, 0)), None, Some(4.0), u64::MAX),
            Some((2.0, SRC_OVERRIDE)),
            "expires 0 = never"
        );
        assert_eq!(
            resolve_threshold(None, None, None, Some(4.0), now),
            Some((4.0, SRC_ROUTE))
        );
        assert_eq!(resolve_threshold(None, None, None, None, now), None);
        assert_eq!(
            resolve_threshold(Some(f64::NAN), None, None, Some(4.0), now),
            Some((4.0, SRC_ROUTE))
        );
        assert_eq!(override_expiry(100, DEFAULT_OVERRIDE_TTL_S), 7300);
        assert_eq!(override_expiry(100, 0), 0);
    }

    /// Seeded simulation: a pool whose TTFT distribution shifts. The EWMA stays within the
    /// range of the folded window values, reaches the new level within a bounded number of
    /// windows, expires 60 s after traffic stops, and the gate sheds while letting exactly
    /// `per_window` probes through per probe window.
    #[test]
    fn seeded_window_simulation() {
        for seed in [1u64, 7, 0xDEAD_BEEF, 2024] {
            let mut rng = XorShift::new(seed);
            let cfg = EwmaCfg::default();
            let mut st = WindowState::default();
            let (mut lo, mut hi) = (f64::MAX, f64::MIN);
            let mut now = 10_000u64;
            let mut last_v = None;
            for win in 0..60u64 {
                let base = if win < 30 { 600.0 } else { 100.0 };
                let n = 1 + (rng.next() % 40) as usize;
                let samples: Vec<f64> = (0..n).map(|_| base * (0.5 + rng.unit())).collect();
                let (c, _, _) = hist(&TTFT_BOUNDS_MS, &samples);
                let v = window_quantile(&TTFT_BOUNDS_MS, &c, 0.8);
                // The leader ticks every 500 ms; the window closes at the first tick after it.
                now += cfg.window_s;
                st = advance(st, &cfg, now, |_| last_v);
                if let Some(x) = last_v {
                    lo = lo.min(x);
                    hi = hi.max(x);
                    let e = st.ewma().unwrap();
                    assert!(
                        e >= lo - 1e-9 && e <= hi + 1e-9,
                        "seed {seed}: {e} outside [{lo}, {hi}]"
                    );
                }
                last_v = v;
                if win == 29 {
                    assert!(st.ewma().unwrap() >= 500.0, "seed {seed}: {:?}", st.ewma());
                }
            }
            // 30 windows after the shift (0.7^29 ≈ 3e-5) the EWMA sits in the new band.
            let e = st.live_ewma(now, cfg.ttl_s).unwrap();
            assert!(
                e <= 250.0 + 1.0,
                "seed {seed}: EWMA {e} did not follow the shift down"
            );
            // The gate with a 200 ms threshold: tripped; probe slots let 5 per window through.
            let mut admitted = 0;
            let mut used = 0u64;
            for _ in 0..50 {
                match ttft_gate(Some(e), Some(200.0), used, 5) {
                    Gate::Probe => {
                        admitted += 1;
                        used += 1;
                    }
                    Gate::Shed { .. } => {}
                    Gate::Pass => panic!("seed {seed}: should be tripped at {e}"),
                }
            }
            assert_eq!(admitted, 5, "seed {seed}");
            // No samples any more: empty windows fold nothing, the EWMA expires after 60 s.
            let last_fold = st.last_fold_s;
            for _ in 0..5 {
                now += cfg.window_s;
                st = advance(st, &cfg, now, |_| None);
            }
            assert_eq!(st.last_fold_s, last_fold, "seed {seed}");
            assert_eq!(st.live_ewma(now, cfg.ttl_s), None, "seed {seed}");
            assert_eq!(
                ttft_gate(st.live_ewma(now, cfg.ttl_s), Some(200.0), 99, 5),
                Gate::Pass
            );
        }
    }
}
