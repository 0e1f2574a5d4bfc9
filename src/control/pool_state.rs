//! Where a pool's measurement and control state lives in the segment, and the IO-free
//! operations on it. A pool is a route's flat peer list or one `peers_by_model` entry;
//! each pool owns three slots: TTFT and decode-rate ("tps") windows, and control.
//!
//! Windows: every worker adds its samples to the bank of the current window
//! (`window id % 2`); the elected worker folds the previous window's bank into the EWMA
//! once per window and clears it (single writer for the EWMA). A sample racing the fold at
//! a window edge may land in a bank already folded and is then counted in the next fold
//! of that bank — a bounded, harmless smear.

use std::sync::atomic::AtomicU64;

use warmroute_shm::{RouteSlot, Segment};

use crate::cells::Relaxed;

/// Cells of a window slot (TTFT or tps).
pub mod win {
    /// Two banks of (14 bucket counts, sum × 1000, count).
    pub const BANK_CELLS: usize = 16;
    pub const BANK0: usize = 0;
    /// The EWMA as f64 bits, and when it was last folded (s; 0 = no EWMA).
    pub const EWMA_BITS: usize = 32;
    pub const EWMA_AT_S: usize = 33;
    /// The last window id folded.
    pub const FOLDED_WIN: usize = 34;
    /// Probe slots: the probe window id and requests admitted as probes in it.
    pub const PROBE_WIN: usize = 35;
    pub const PROBE_USED: usize = 36;
    /// Runtime threshold override: f64 bits, and when it expires (s; 0 = none, u64::MAX = never).
    pub const OVERRIDE_BITS: usize = 37;
    pub const OVERRIDE_UNTIL_S: usize = 38;
    /// Runtime off switch for the gate (1 = off; measurement continues).
    pub const OFF: usize = 39;
    /// Requests that tripped this gate while the rate-limit master switch was off.
    pub const TRIPS_WHILE_OFF: usize = 40;
    /// The EWMAs of a declared metric list's later entries (the first entry's is
    /// `EWMA_BITS`): entry `i ≥ 1` has `EXTRA_CELLS` cells from `EXTRA + (i - 1) ×
    /// EXTRA_CELLS`: the EWMA's f64 bits, when it was last folded (s; 0 = none), and the
    /// tag of the statistic it was folded from (`latency::metric_tag`), so that an EWMA is
    /// not read as another metric's after a reload reorders or changes the list. Cells
    /// 41–61 for the seven later entries of a list of eight.
    pub const EXTRA: usize = 41;
    pub const EXTRA_CELLS: usize = 3;
    /// The same tag for the first entry's EWMA (`EWMA_BITS`). 0 = folded by a build that
    /// did not tag it (an older router sharing the segment in a takeover), taken as it is.
    pub const FIRST_TAG: usize = 62;
}

const _: () = assert!(
    win::EXTRA + (crate::config::MAX_METRICS - 1) * win::EXTRA_CELLS <= win::FIRST_TAG
        && win::FIRST_TAG < warmroute_shm::ROUTE_CELLS
);

/// Cells of a pool's control slot.
pub mod ctl {
    /// The adaptive limit as f64 bits, and when it was written (s; 0 = unset).
    pub const AIMD_BITS: usize = 0;
    pub const AIMD_AT_S: usize = 1;
    /// Concurrency 429s since the last AIMD tick (read and cleared by the tick).
    pub const REJ: usize = 2;
    /// 1 once the pool has taken its route's route-wide overrides (see
    /// [`super::seed_from_route_wide`]); a new slot is all zeros.
    pub const SEEDED: usize = 3;
    /// Rate-limit master switch override: 0 = none, 1 = on, 2 = off.
    pub const RATE_LIMIT: usize = 4;
    /// Concurrency-gate trips while the master switch was off.
    pub const TRIPS_CONCURRENCY: usize = 5;
    /// When the last AIMD tick ran (s).
    pub const AIMD_TICK_S: usize = 6;
    /// Cluster average: ten sampled in-flight sums, one per `CLUSTER_AVG_INTERVAL_S`, each
    /// stored as value + 1 (0 = empty), and the bucket index of each sample.
    pub const CLUSTER_BUCKETS: usize = 8; // ..18
    pub const CLUSTER_STAMP: usize = 18; // ..28: the sample's time (s)
}

/// The three slots of one pool.
#[derive(Debug, Clone, Copy)]
pub struct PoolSlots {
    pub ttft: RouteSlot,
    pub tps: RouteSlot,
    pub ctl: RouteSlot,
}

impl PoolSlots {
    pub fn new(seg: &Segment, route: &str, model: Option<&str>) -> Option<PoolSlots> {
        Self::with(route, model, |k| seg.route_slot(k))
    }

    /// The slots a router took for the pool, without taking any (`None` if one is missing).
    pub fn find(seg: &Segment, route: &str, model: Option<&str>) -> Option<PoolSlots> {
        Self::with(route, model, |k| seg.find_route_slot(k))
    }

    fn with(
        route: &str,
        model: Option<&str>,
        slot: impl Fn(&str) -> Option<RouteSlot>,
    ) -> Option<PoolSlots> {
        let key = |kind: &str| {
            let k = format!("{route}#{kind}:{}", model.unwrap_or(""));
            if k.len() <= warmroute_shm::MAX_KEY_BYTES {
                k
            } else {
                format!("#{kind}:{:08x}", crc32fast::hash(k.as_bytes()))
            }
        };
        Some(PoolSlots {
            ttft: slot(&key("ttft"))?,
            tps: slot(&key("tps"))?,
            ctl: slot(&key("ctl"))?,
        })
    }
}

/// A route's route-wide record: the runtime switches and overrides an endpoint set for
/// the whole route (no `model=`), so that a pool added to the route later (by a reload)
/// takes them too ([`seed_from_route_wide`]). One slot, `<route>#wide`; no pool reads it.
/// The TTFT cells, then the decode-rate ones (by [`signal index`](wide::OFF)).
pub mod wide {
    pub const RATE_LIMIT: usize = 0;
    /// The gate turned off (1), per signal: TTFT, decode rate.
    pub const OFF: [usize; 2] = [1, 4];
    /// The threshold override's value (f64 bits) and expiry, as in a pool's cells.
    pub const BITS: [usize; 2] = [2, 5];
    pub const UNTIL: [usize; 2] = [3, 6];
}

/// The slot of `route`'s route-wide record ([`wide`]).
pub fn wide_slot(seg: &Segment, route: &str) -> Option<RouteSlot> {
    let k = format!("{route}#wide");
    if k.len() <= warmroute_shm::MAX_KEY_BYTES {
        seg.route_slot(&k)
    } else {
        seg.route_slot(&format!("#wide:{:08x}", crc32fast::hash(k.as_bytes())))
    }
}

/// A pool new to the segment takes the switches and overrides set for its whole route
/// before it existed (the record in `wide`, [`wide_slot`]): the rate-limit switch, the
/// TTFT and decode-rate gates turned off, and their threshold overrides. Only what is set
/// is copied, and only once per pool (a pool's own later settings stay its own). Workers
/// building their snapshots at once copy the same values.
pub fn seed_from_route_wide(seg: &Segment, pool: &PoolSlots, wide: RouteSlot) {
    let seeded = cell(seg, pool.ctl, ctl::SEEDED);
    if seeded.load(Relaxed) != 0 {
        return;
    }
    let copy = |from: usize, to: RouteSlot, to_cell: usize| {
        let v = cell(seg, wide, from).load(Relaxed);
        if v != 0 {
            cell(seg, to, to_cell).store(v, Relaxed);
        }
    };
    copy(wide::RATE_LIMIT, pool.ctl, ctl::RATE_LIMIT);
    for (i, p) in [pool.ttft, pool.tps].into_iter().enumerate() {
        copy(wide::OFF[i], p, win::OFF);
        // The override's value before its expiry, so that it is whole when it shows.
        if cell(seg, wide, wide::UNTIL[i]).load(Relaxed) != 0 {
            copy(wide::BITS[i], p, win::OVERRIDE_BITS);
            copy(wide::UNTIL[i], p, win::OVERRIDE_UNTIL_S);
        }
    }
    seeded.store(1, Relaxed);
}

/// Record in `wide` (the route-wide record) a gate turned off or on for the whole route.
pub fn set_wide_gate_off(seg: &Segment, wide: RouteSlot, signal: usize, off: bool) {
    cell(seg, wide, wide::OFF[signal]).store(off as u64, Relaxed);
}

/// Record in `wide` a threshold override set (or cleared) for the whole route.
pub fn set_wide_override(
    seg: &Segment,
    wide: RouteSlot,
    signal: usize,
    v: Option<(f64, u64)>,
    now_s: u64,
) {
    store_override(
        seg,
        wide,
        [wide::BITS[signal], wide::UNTIL[signal]],
        v,
        now_s,
    );
}

/// Record in `wide` the rate-limit switch set for the whole route (0 = none, 1 on, 2 off).
pub fn set_wide_rate_limit(seg: &Segment, wide: RouteSlot, v: u64) {
    cell(seg, wide, wide::RATE_LIMIT).store(v, Relaxed);
}

fn cell(seg: &Segment, slot: RouteSlot, i: usize) -> &AtomicU64 {
    seg.route_cell(slot, i)
}

/// Add a sample to the current window's bank.
pub fn record(seg: &Segment, slot: RouteSlot, bounds: &[f64], v: f64, now_s: u64, window_s: u64) {
    if !v.is_finite() || v < 0.0 {
        return;
    }
    let bank = win::BANK0 + ((now_s / window_s.max(1)) % 2) as usize * win::BANK_CELLS;
    cell(seg, slot, bank + crate::measure::bucket(bounds, v)).fetch_add(1, Relaxed);
    cell(seg, slot, bank + 14).fetch_add((v * 1000.0) as u64, Relaxed);
    cell(seg, slot, bank + 15).fetch_add(1, Relaxed);
}

/// The counts, sum and count of the bank of window `w`, then cleared.
pub fn take_bank(seg: &Segment, slot: RouteSlot, w: u64) -> ([u64; 14], f64, u64) {
    let bank = win::BANK0 + (w % 2) as usize * win::BANK_CELLS;
    let mut counts = [0u64; 14];
    for (i, c) in counts.iter_mut().enumerate() {
        *c = cell(seg, slot, bank + i).swap(0, Relaxed);
    }
    let sum = cell(seg, slot, bank + 14).swap(0, Relaxed) as f64 / 1000.0;
    let n = cell(seg, slot, bank + 15).swap(0, Relaxed);
    (counts, sum, n)
}

/// The runtime threshold override, when set and not expired.
pub fn threshold_override(seg: &Segment, slot: RouteSlot, now_s: u64) -> Option<f64> {
    let until = cell(seg, slot, win::OVERRIDE_UNTIL_S).load(Relaxed);
    (until != 0 && now_s < until)
        .then(|| f64::from_bits(cell(seg, slot, win::OVERRIDE_BITS).load(Relaxed)))
}

/// Set (Some(value, ttl_s; ttl 0 = never expires)) or clear (None) the override.
pub fn set_threshold_override(seg: &Segment, slot: RouteSlot, v: Option<(f64, u64)>, now_s: u64) {
    store_override(
        seg,
        slot,
        [win::OVERRIDE_BITS, win::OVERRIDE_UNTIL_S],
        v,
        now_s,
    );
}

/// An override's value and expiry, into cells `[bits, until]` of `slot`.
fn store_override(
    seg: &Segment,
    slot: RouteSlot,
    [bits, until]: [usize; 2],
    v: Option<(f64, u64)>,
    now_s: u64,
) {
    match v {
        Some((x, ttl)) => {
            cell(seg, slot, bits).store(x.to_bits(), Relaxed);
            cell(seg, slot, until)
                // A ttl too large to add (`ttl=18446744073709551615`) never expires,
                // rather than wrapping to a time already past.
                .store(
                    if ttl == 0 {
                        u64::MAX
                    } else {
                        now_s.saturating_add(ttl)
                    },
                    Relaxed,
                );
        }
        None => cell(seg, slot, until).store(0, Relaxed),
    }
}

/// Count a tripped request in the current probe window; returns how many came before it
/// in this window (the caller admits it as a probe while that is below the allowance).
pub fn take_probe(seg: &Segment, slot: RouteSlot, now_s: u64, probe_window_s: u64) -> u64 {
    let w = now_s / probe_window_s.max(1);
    let wc = cell(seg, slot, win::PROBE_WIN);
    let prev = wc.load(Relaxed);
    if prev != w && wc.compare_exchange(prev, w, Relaxed, Relaxed).is_ok() {
        cell(seg, slot, win::PROBE_USED).store(0, Relaxed);
    }
    cell(seg, slot, win::PROBE_USED).fetch_add(1, Relaxed)
}

pub fn probes_used(seg: &Segment, slot: RouteSlot, now_s: u64, probe_window_s: u64) -> u64 {
    let w = now_s / probe_window_s.max(1);
    if cell(seg, slot, win::PROBE_WIN).load(Relaxed) == w {
        cell(seg, slot, win::PROBE_USED).load(Relaxed)
    } else {
        0
    }
}

pub fn gate_off(seg: &Segment, slot: RouteSlot) -> bool {
    cell(seg, slot, win::OFF).load(Relaxed) == 1
}

pub fn set_gate_off(seg: &Segment, slot: RouteSlot, off: bool) {
    cell(seg, slot, win::OFF).store(off as u64, Relaxed);
}

/// The stored adaptive limit, if written within `ttl_s` (None = unset or expired; with
/// hold_when_idle the caller passes u64::MAX).
pub fn aimd_limit(seg: &Segment, ctl_slot: RouteSlot, now_s: u64, ttl_s: u64) -> Option<f64> {
    let at = cell(seg, ctl_slot, ctl::AIMD_AT_S).load(Relaxed);
    (at != 0 && now_s.saturating_sub(at) <= ttl_s)
        .then(|| f64::from_bits(cell(seg, ctl_slot, ctl::AIMD_BITS).load(Relaxed)))
}

pub fn set_aimd_limit(seg: &Segment, ctl_slot: RouteSlot, v: f64, now_s: u64) {
    cell(seg, ctl_slot, ctl::AIMD_BITS).store(v.to_bits(), Relaxed);
    cell(seg, ctl_slot, ctl::AIMD_AT_S).store(now_s.max(1), Relaxed);
}

pub fn ctl_cell(seg: &Segment, ctl_slot: RouteSlot, i: usize) -> &AtomicU64 {
    cell(seg, ctl_slot, i)
}

/// The cells `[bits, at_s, tag]` of metric `i`'s EWMA: the first entry's, or a later
/// entry's (see [`win::EXTRA`]).
fn metric_cells(i: usize) -> [usize; 3] {
    if i == 0 {
        return [win::EWMA_BITS, win::EWMA_AT_S, win::FIRST_TAG];
    }
    let base = win::EXTRA + (i - 1) * win::EXTRA_CELLS;
    [base, base + 1, base + 2]
}

/// Whether the EWMA stored for metric `i` was folded for `tag`'s statistic (the first
/// entry's untagged 0 included, see [`win::FIRST_TAG`]).
fn folded_for(seg: &Segment, slot: RouteSlot, i: usize, tag: u64) -> bool {
    let stored = cell(seg, slot, metric_cells(i)[2]).load(Relaxed);
    stored == tag || (i == 0 && stored == 0)
}

/// The live EWMA of metric `i` of the resolved list, or None when there is none, it
/// expired (`ttl_s` without a fold), or it was folded for another statistic than `tag`'s.
pub fn metric_ewma(
    seg: &Segment,
    slot: RouteSlot,
    i: usize,
    tag: u64,
    now_s: u64,
    ttl_s: u64,
) -> Option<f64> {
    if !folded_for(seg, slot, i, tag) {
        return None;
    }
    let [bits, at, _] = metric_cells(i);
    let at = cell(seg, slot, at).load(Relaxed);
    (at != 0 && now_s.saturating_sub(at) <= ttl_s)
        .then(|| f64::from_bits(cell(seg, slot, bits).load(Relaxed)))
}

/// The folder's state of metric `i`'s EWMA, as of the slot's last folded window; an EWMA
/// folded for another statistic than `tag`'s counts as none.
pub fn window_state(
    seg: &Segment,
    slot: RouteSlot,
    i: usize,
    tag: u64,
) -> super::ewma::WindowState {
    let win = cell(seg, slot, win::FOLDED_WIN).load(Relaxed);
    if !folded_for(seg, slot, i, tag) {
        return super::ewma::WindowState {
            win,
            ..Default::default()
        };
    }
    let [bits, at, _] = metric_cells(i);
    super::ewma::WindowState {
        win,
        ewma_bits: cell(seg, slot, bits).load(Relaxed),
        last_fold_s: cell(seg, slot, at).load(Relaxed),
    }
}

/// Store metric `i`'s folded state under `tag`: the value before the time that makes it
/// live. The first entry's also moves the slot's window id on, so it is stored last.
pub fn store_window_state(
    seg: &Segment,
    slot: RouteSlot,
    i: usize,
    tag: u64,
    st: super::ewma::WindowState,
) {
    let [bits, at, t] = metric_cells(i);
    cell(seg, slot, bits).store(st.ewma_bits, Relaxed);
    cell(seg, slot, at).store(st.last_fold_s, Relaxed);
    cell(seg, slot, t).store(tag, Relaxed);
    if i == 0 {
        cell(seg, slot, win::FOLDED_WIN).store(st.win, Relaxed);
    }
}

/// Seconds since the epoch.
pub fn now_s() -> u64 {
    warmroute_shm::now_ms() / 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_override_with_a_ttl_too_large_to_add_never_expires() {
        let tmp = crate::testutil::TempSegment::new("pool");
        let seg = &tmp.seg;
        let slots = PoolSlots::new(seg, "r", None).unwrap();
        let now = 1_800_000_000;
        // Control: an ordinary ttl holds until it runs out.
        set_threshold_override(seg, slots.ttft, Some((500.0, 60)), now);
        assert_eq!(threshold_override(seg, slots.ttft, now + 59), Some(500.0));
        assert_eq!(threshold_override(seg, slots.ttft, now + 60), None);
        // The largest ttl a query can give used to wrap to a time already past.
        set_threshold_override(seg, slots.ttft, Some((700.0, u64::MAX)), now);
        assert_eq!(threshold_override(seg, slots.ttft, now), Some(700.0));
        assert_eq!(
            threshold_override(seg, slots.ttft, now + 10_000_000),
            Some(700.0)
        );
        set_threshold_override(seg, slots.ttft, None, now);
        assert_eq!(threshold_override(seg, slots.ttft, now), None);
    }
}
