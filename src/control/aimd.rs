//! Adaptive concurrency: the AIMD update of one pool's limit (SPEC §5.4; notes-control §4;
//! the reference README's "Adaptive concurrency" paragraph, which wins over the notes on
//! init and hold-when-idle). Pure: the elected worker's tick reads the pool's cells, calls
//! [`step`] with plain numbers and writes what it returns.
//!
//! # Reads, decides, writes
//! - Reads: [`AimdParams`] (from the route options), [`AimdInput`] (the stored limit if alive,
//!   the sampled pool in-flight, the concurrency 429s since the last tick, the TPS and TTFT
//!   EWMAs with their thresholds, the static max).
//! - Decides: the next limit, or `None` = write nothing (no decode-rate EWMA, or no capacity).
//! - Writes: nothing. The caller stores the limit as f64 bits plus the time it was written,
//!   and clears its 429 counter exactly when [`step`] returned `Some` (the reference's
//!   read-and-clear happens after the early stops, so a skipped tick keeps the count).
//!
//! # The rule (one tick)
//! `overload` = decode-rate EWMA strictly below its threshold, or (with `use_ttft`) TTFT EWMA
//! strictly above its threshold. `desired = max(conc / mid, conc + abs)` with
//! `mid = (pressure_frac + slack_frac) / 2`.
//! 1. overload → `cur × dec` (may go below init, down to the floor);
//! 2. else 429s since the last tick (unmet demand) → `cur × inc`;
//! 3. else pressure (`conc ≥ cur × pressure_frac` or fewer than `abs` free slots) →
//!    `min(cur × inc, desired)`; slack (`0 < conc < cur × slack_frac` with more than `abs`
//!    spare, `cur > init`, hold off) → `max(cur × dec, desired, init)`; otherwise unchanged;
//!    then a limit below init climbs back towards it by `× inc` (capped at init) — except with
//!    hold-when-idle and no traffic (`conc = 0`), which holds whatever value the limit has
//!    (README: "climbs back to init only once traffic returns").
//! 4. clamp into `[floor, static max]`; values stay fractional.
//!
//! Without a decode-rate threshold only the clamp applies (the value is refreshed).
//! Lifetime: the limit expires `ttl_s` after its last write, never with hold-when-idle
//! ([`load`]); an absent limit starts at [`start`].

/// Reference defaults (notes §4.1; README: hold-when-idle on by default).
pub const DEFAULT_MIN_FRAC: f64 = 0.4;
pub const DEFAULT_INC: f64 = 1.02;
pub const DEFAULT_DEC: f64 = 0.97;
pub const DEFAULT_PRESSURE_FRAC: f64 = 0.9;
pub const DEFAULT_SLACK_FRAC: f64 = 0.7;
pub const DEFAULT_ABS: f64 = 5.0;
pub const DEFAULT_TTL_S: u64 = 300;
pub const DEFAULT_INTERVAL_S: u64 = 20;

/// A route's (validated) adaptive-concurrency options, as numbers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AimdParams {
    /// `adaptive_cc_min` (slots, ≥ 1); `None` = `min_frac` of the static max.
    pub min: Option<f64>,
    pub min_frac: f64,
    /// `adaptive_cc_init` (slots); wins over `init_frac`.
    pub init: Option<f64>,
    pub init_frac: Option<f64>,
    pub hold_when_idle: bool,
    pub use_ttft: bool,
    pub inc: f64,
    pub dec: f64,
    pub pressure_frac: f64,
    /// Kept below `pressure_frac` by the config.
    pub slack_frac: f64,
    pub abs: f64,
    pub ttl_s: u64,
}

impl Default for AimdParams {
    fn default() -> Self {
        AimdParams {
            min: None,
            min_frac: DEFAULT_MIN_FRAC,
            init: None,
            init_frac: None,
            hold_when_idle: true,
            use_ttft: true,
            inc: DEFAULT_INC,
            dec: DEFAULT_DEC,
            pressure_frac: DEFAULT_PRESSURE_FRAC,
            slack_frac: DEFAULT_SLACK_FRAC,
            abs: DEFAULT_ABS,
            ttl_s: DEFAULT_TTL_S,
        }
    }
}

/// What one tick sees for one pool.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AimdInput {
    /// The stored limit; `None` = unset or expired (then [`start`] applies).
    pub current: Option<f64>,
    /// Pool in-flight, sampled (the reference: the last request's snapshot).
    pub concurrency: f64,
    /// Concurrency 429s of this pool since the last tick that returned `Some`.
    pub rejected_since_last: u64,
    /// Live decode-rate EWMA; `None` = the tick writes nothing.
    pub tps_ewma: Option<f64>,
    pub tps_threshold: Option<f64>,
    /// Live TTFT EWMA; pass `None` when TTFT measurement or its toggle is off.
    pub ttft_ewma: Option<f64>,
    pub ttft_threshold: Option<f64>,
    /// Static max: the largest per-priority sum of configured peers' `max_concurrency`.
    pub static_max: f64,
}

/// The lowest the limit goes: `min` (floored, ≥ 1) if set, else `max(1, ⌊static_max ×
/// min_frac⌋)`; never above `static_max`.
pub fn floor(p: &AimdParams, static_max: f64) -> f64 {
    let f = match p.min {
        Some(m) => m.floor().max(1.0),
        None => (static_max * p.min_frac).floor().max(1.0),
    };
    f.min(static_max.max(0.0))
}

/// Where a fresh or expired limit starts, and what low traffic never shrinks it below:
/// `init` (floored), else `max(1, ⌊static_max × init_frac⌋)`, else the floor; raised to the
/// floor, capped at `static_max`.
pub fn start(p: &AimdParams, static_max: f64) -> f64 {
    let lo = floor(p, static_max);
    let s = match (p.init, p.init_frac) {
        (Some(i), _) => i.floor().max(1.0),
        (None, Some(f)) => (static_max * f).floor().max(1.0),
        (None, None) => lo,
    };
    s.max(lo).min(static_max.max(0.0))
}

/// The limit in use by the concurrency gate: the stored value (or [`start`]) but never more
/// than the healthy pool's capacity `pool_limit`.
pub fn gate_limit(p: &AimdParams, current: Option<f64>, static_max: f64, pool_limit: f64) -> f64 {
    current
        .unwrap_or_else(|| start(p, static_max))
        .min(pool_limit)
}

/// The stored limit if still alive: `written_at_s = 0` = unset; it expires `ttl_s` after
/// its last write unless `hold_when_idle`.
pub fn load(p: &AimdParams, limit_bits: u64, written_at_s: u64, now_s: u64) -> Option<f64> {
    if written_at_s == 0 {
        return None;
    }
    let alive = p.hold_when_idle || now_s < written_at_s.saturating_add(p.ttl_s);
    alive.then(|| f64::from_bits(limit_bits))
}

/// `mid = (pressure + slack) / 2` and `desired = max(conc / mid, conc + abs)`.
pub fn desired(p: &AimdParams, conc: f64) -> f64 {
    let mid = (p.pressure_frac + p.slack_frac) / 2.0;
    let by_frac = if mid > 0.0 { conc / mid } else { conc };
    by_frac.max(conc + p.abs)
}

/// Pressure: in-flight within `1 − pressure_frac` of the limit, or fewer than `abs` free slots.
pub fn pressure(p: &AimdParams, cur: f64, conc: f64) -> bool {
    conc >= cur * p.pressure_frac || cur - conc < p.abs
}

/// Slack: some traffic, below `slack_frac` of the limit, with more than `abs` spare slots.
pub fn slack(p: &AimdParams, cur: f64, conc: f64) -> bool {
    conc > 0.0 && conc < cur * p.slack_frac && cur - conc > p.abs
}

/// Overload as the controller sees it (strict comparisons, notes §1.6/§2.6).
pub fn overload(p: &AimdParams, i: &AimdInput) -> bool {
    let tps_low = matches!((i.tps_ewma, i.tps_threshold), (Some(e), Some(t)) if e < t);
    let ttft_high =
        p.use_ttft && matches!((i.ttft_ewma, i.ttft_threshold), (Some(e), Some(t)) if e > t);
    tps_low || ttft_high
}

/// One tick (see the module doc). `None` = write nothing and keep the 429 count.
pub fn step(p: &AimdParams, i: &AimdInput) -> Option<f64> {
    i.tps_ewma?;
    let max = i.static_max;
    if max.is_nan() || max <= 0.0 {
        return None;
    }
    let lo = floor(p, max);
    let init = start(p, max);
    let mut cur = i.current.filter(|c| c.is_finite()).unwrap_or(init);
    if i.tps_threshold.is_some() {
        let conc = if i.concurrency.is_finite() {
            i.concurrency.max(0.0)
        } else {
            0.0
        };
        if overload(p, i) {
            cur *= p.dec;
        } else if i.rejected_since_last > 0 {
            cur *= p.inc;
        } else {
            let prev = cur;
            if pressure(p, cur, conc) {
                cur = (cur * p.inc).min(desired(p, conc));
            } else if slack(p, cur, conc) && cur > init && !p.hold_when_idle {
                cur = (cur * p.dec).max(desired(p, conc)).max(init);
            }
            let idle_hold = p.hold_when_idle && conc <= 0.0;
            if prev < init && !idle_hold {
                cur = cur.max((prev * p.inc).min(init));
            }
        }
    }
    Some(cur.clamp(lo, max))
}

/// Predicted next limit under pressure and under slack from `cur` at in-flight `conc`
/// (`/_tps_status`'s `adaptive_cc_at_pressure` / `adaptive_cc_at_slack`), clamped.
pub fn predict(p: &AimdParams, cur: f64, conc: f64, static_max: f64) -> (f64, f64) {
    let lo = floor(p, static_max);
    let init = start(p, static_max);
    let hi = static_max.max(lo);
    let at_pressure = (cur * p.inc).min(desired(p, conc)).max(cur);
    let at_slack = if cur > init && !p.hold_when_idle {
        (cur * p.dec).max(desired(p, conc)).max(init)
    } else {
        cur
    };
    (at_pressure.clamp(lo, hi), at_slack.clamp(lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ewma::{fold, window_quantile, TPS_DEFAULT_Q};
    use crate::control::session_prio::concurrency_admit;
    use crate::measure::{bucket, TPS_BOUNDS};

    use crate::testutil::XorShift;

    /// Notes §4.7: 4 peers × 20 at one priority, `adaptive_cc_init = 48`, reference defaults
    /// (the notes' defaults have hold-when-idle off).
    fn example() -> AimdParams {
        AimdParams {
            init: Some(48.0),
            hold_when_idle: false,
            ..AimdParams::default()
        }
    }

    fn input(current: Option<f64>, conc: f64, rej: u64, ttft: Option<f64>) -> AimdInput {
        AimdInput {
            current,
            concurrency: conc,
            rejected_since_last: rej,
            tps_ewma: Some(30.0),
            tps_threshold: Some(20.0),
            ttft_ewma: ttft,
            ttft_threshold: Some(30000.0),
            static_max: 80.0,
        }
    }

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn derived_bounds() {
        let p = example();
        assert_eq!(floor(&p, 80.0), 32.0);
        assert_eq!(start(&p, 80.0), 48.0);
        let d = AimdParams::default();
        assert_eq!(start(&d, 80.0), 32.0, "without init, init = min");
        assert_eq!(
            start(
                &AimdParams {
                    init_frac: Some(0.75),
                    ..d
                },
                80.0
            ),
            60.0
        );
        assert_eq!(
            start(
                &AimdParams {
                    init: Some(50.9),
                    init_frac: Some(0.1),
                    ..d
                },
                80.0
            ),
            50.0,
            "init wins over init_frac, floored"
        );
        assert_eq!(
            start(
                &AimdParams {
                    init: Some(10.0),
                    ..d
                },
                80.0
            ),
            32.0,
            "raised to min"
        );
        assert_eq!(
            start(
                &AimdParams {
                    init: Some(500.0),
                    ..d
                },
                80.0
            ),
            80.0,
            "capped at max"
        );
        assert_eq!(
            floor(
                &AimdParams {
                    min: Some(7.5),
                    ..d
                },
                80.0
            ),
            7.0
        );
        assert_eq!(
            floor(
                &AimdParams {
                    min: Some(100.0),
                    ..d
                },
                80.0
            ),
            80.0
        );
        assert_eq!(floor(&d, 2.0), 1.0, "at least one slot");
        assert_eq!(floor(&d, 0.0), 0.0);
        assert_eq!(gate_limit(&p, None, 80.0, 60.0), 48.0);
        assert_eq!(
            gate_limit(&p, Some(70.0), 80.0, 60.0),
            60.0,
            "capped by healthy capacity"
        );
    }

    #[test]
    fn worked_example_notes_4_7() {
        let p = example();
        // tick 1: absent → init 48, conc 47, rej 12 → ×1.02.
        let t1 = step(&p, &input(None, 47.0, 12, None)).unwrap();
        assert!(close(t1, 48.96, 1e-9), "{t1}");
        assert!(close(desired(&p, 47.0), 58.75, 1e-9));
        // tick 2: rej 4 → ×1.02 (no cap at desired).
        let t2 = step(&p, &input(Some(t1), 47.0, 4, None)).unwrap();
        assert!(close(t2, 49.9392, 1e-9), "{t2}");
        // tick 3: pressure (46 ≥ 44.95) → min(50.938, 57.5).
        assert!(pressure(&p, t2, 46.0));
        let t3 = step(&p, &input(Some(t2), 46.0, 0, None)).unwrap();
        assert!(close(t3, 50.938, 1e-4), "{t3}");
        // tick 4: TTFT EWMA 32000 > 30000 → overload ×0.97.
        let t4 = step(&p, &input(Some(t3), 46.0, 0, Some(32000.0))).unwrap();
        assert!(close(t4, 49.4098, 1e-4), "{t4}");
        // tick 5: still overloaded → 47.9275, below init is allowed.
        let t5 = step(&p, &input(Some(t4), 45.0, 0, Some(32000.0))).unwrap();
        assert!(close(t5, 47.9275, 1e-4), "{t5}");
        // 14 more overloaded ticks: 13 reach 32.2565, the 14th is clamped to the floor 32.
        let mut cur = t5;
        for k in 1..=14 {
            cur = step(&p, &input(Some(cur), 45.0, 0, Some(32000.0))).unwrap();
            if k == 13 {
                assert!(close(cur, 32.2565, 1e-4), "{cur}");
            }
        }
        assert_eq!(cur, 32.0);
        // Healthy, trickle conc 3: no pressure (3 < 28.8, 29 ≥ 5); slack true but cur ≤ init;
        // climb-back → 32.64.
        assert!(!pressure(&p, 32.0, 3.0));
        assert!(slack(&p, 32.0, 3.0));
        assert_eq!(desired(&p, 3.0), 8.0);
        let healthy = step(&p, &input(Some(32.0), 3.0, 0, Some(1000.0))).unwrap();
        assert!(close(healthy, 32.64, 1e-9), "{healthy}");
        // ×1.02 per tick: 21 ticks from 32 to exactly 48 (capped at init).
        let mut cur = 32.0;
        let mut ticks = 0;
        while cur < 48.0 {
            cur = step(&p, &input(Some(cur), 3.0, 0, None)).unwrap();
            ticks += 1;
            assert!(ticks <= 21, "still {cur} after {ticks} ticks");
        }
        assert_eq!((ticks, cur), (21, 48.0));
        // And it stays at init under a trickle (slack needs cur > init).
        assert_eq!(step(&p, &input(Some(48.0), 3.0, 0, None)), Some(48.0));
    }

    #[test]
    fn worked_slack_example_notes_4_7() {
        let p = example();
        assert_eq!(desired(&p, 20.0), 25.0);
        let mut cur = 70.0;
        let mut seen = Vec::new();
        for _ in 0..4 {
            cur = step(&p, &input(Some(cur), 20.0, 0, None)).unwrap();
            seen.push(cur);
        }
        for (got, want) in seen.iter().zip([67.9, 65.863, 63.887, 61.970]) {
            assert!(close(*got, want, 1e-3), "{seen:?}");
        }
        for _ in 0..100 {
            cur = step(&p, &input(Some(cur), 20.0, 0, None)).unwrap();
        }
        assert_eq!(cur, 48.0, "slack never shrinks below init");
        // Control: with hold-when-idle the same traffic leaves the limit alone.
        let hold = AimdParams {
            hold_when_idle: true,
            ..p
        };
        assert_eq!(step(&hold, &input(Some(70.0), 20.0, 0, None)), Some(70.0));
        assert!(close(predict(&p, 70.0, 20.0, 80.0).1, 67.9, 1e-9));
        assert_eq!(predict(&hold, 70.0, 20.0, 80.0).1, 70.0);
    }

    #[test]
    fn worked_admission_notes_4_7() {
        // At cur = 50.938 requests are admitted while in-flight ≤ 50: at most 51 in flight.
        assert!(concurrency_admit(50.0, 50.938, 1.0, 1.0));
        assert!(!concurrency_admit(51.0, 50.938, 1.0, 1.0));
    }

    #[test]
    fn early_stops_write_nothing() {
        let p = example();
        // No decode-rate EWMA: TTFT alone never moves the limit.
        let mut i = input(Some(50.0), 46.0, 3, Some(99999.0));
        i.tps_ewma = None;
        assert_eq!(step(&p, &i), None);
        let mut i = input(Some(50.0), 46.0, 3, None);
        i.static_max = 0.0;
        assert_eq!(step(&p, &i), None);
        // No threshold: only the clamp, the value is refreshed.
        let mut i = input(Some(95.0), 46.0, 3, None);
        i.tps_threshold = None;
        assert_eq!(step(&p, &i), Some(80.0));
        i.current = Some(50.0);
        assert_eq!(step(&p, &i), Some(50.0));
    }

    #[test]
    fn boundaries_and_switches() {
        let p = example();
        // Strict: TPS EWMA equal to its threshold is not overload; the 429s then grow it.
        let mut i = input(Some(50.0), 10.0, 1, None);
        i.tps_ewma = Some(20.0);
        assert_eq!(step(&p, &i), Some(51.0));
        i.tps_ewma = Some(19.99);
        assert_eq!(step(&p, &i), Some(48.5));
        // TTFT equal to its threshold is not overload either.
        let i = input(Some(50.0), 10.0, 1, Some(30000.0));
        assert_eq!(step(&p, &i), Some(51.0));
        // use_ttft = false ignores TTFT.
        let no_ttft = AimdParams {
            use_ttft: false,
            ..p
        };
        let i = input(Some(50.0), 10.0, 1, Some(99999.0));
        assert_eq!(step(&no_ttft, &i), Some(51.0));
        assert_eq!(step(&p, &i), Some(48.5));
        // Overload wins over unmet demand.
        assert!(overload(&p, &i));
        // Growth is clamped at the static max.
        assert_eq!(step(&p, &input(Some(79.9), 79.0, 5, None)), Some(80.0));
        // Pressure never exceeds desired and never decreases.
        let g = step(&p, &input(Some(50.0), 49.0, 0, None)).unwrap();
        assert_eq!(g, 51.0);
        // Idle with hold: below init it stays put; without hold it climbs back.
        let hold = AimdParams {
            hold_when_idle: true,
            ..p
        };
        assert_eq!(step(&hold, &input(Some(40.0), 0.0, 0, None)), Some(40.0));
        assert_eq!(step(&p, &input(Some(40.0), 0.0, 0, None)), Some(40.8));
        // ... and once traffic returns the held limit climbs back too.
        assert_eq!(step(&hold, &input(Some(40.0), 2.0, 0, None)), Some(40.8));
    }

    #[test]
    fn lifetime() {
        let p = example();
        let bits = 50.5f64.to_bits();
        assert_eq!(load(&p, bits, 0, 10), None, "unset");
        assert_eq!(load(&p, bits, 1000, 1299), Some(50.5));
        assert_eq!(load(&p, bits, 1000, 1300), None, "expired after ttl");
        let hold = AimdParams {
            hold_when_idle: true,
            ..p
        };
        assert_eq!(
            load(&hold, bits, 1000, u64::MAX),
            Some(50.5),
            "never expires"
        );
    }

    /// A synthetic backend with capacity `c`: every request decodes at `base` tok/s while the
    /// pool holds at most `c` in flight, and at `base × (c / n)^4` beyond (a steep fall); the
    /// threshold equals `base`, so a healthy window reads as the 50 tok/s bucket and 3 % over
    /// capacity already reads as 40. The
    /// offered load wants `demand` slots; the gate admits `ceil(limit)`; the rest are 429s
    /// (unmet demand). Each tick folds one window's low-tail (q 0.2) decode rate into the
    /// EWMA with α 0.3, quantised by the real TPS buckets.
    struct Sim {
        rng: XorShift,
        ewma: Option<f64>,
        cur: Option<f64>,
        p: AimdParams,
        static_max: f64,
        threshold: f64,
        base: f64,
    }

    impl Sim {
        fn new(seed: u64, p: AimdParams) -> Sim {
            Sim {
                rng: XorShift::new(seed),
                ewma: None,
                cur: None,
                p,
                static_max: 80.0,
                threshold: 45.0,
                base: 45.0,
            }
        }

        /// One tick; returns the limit after it.
        fn tick(&mut self, c: f64, demand: f64) -> f64 {
            let limit = self.cur.unwrap_or_else(|| start(&self.p, self.static_max));
            let mut admitted = 0.0;
            while admitted < demand && concurrency_admit(admitted, limit, 1.0, 1.0) {
                admitted += 1.0;
            }
            let rejected = (demand - admitted).max(0.0) as u64;
            if admitted > 0.0 {
                let rate = if admitted <= c {
                    self.base
                } else {
                    self.base * (c / admitted).powi(4)
                };
                let mut counts = [0u64; 14];
                for _ in 0..admitted as usize {
                    let noisy = rate * (0.95 + 0.1 * self.rng.unit());
                    counts[bucket(&TPS_BOUNDS, noisy)] += 1;
                }
                let v = window_quantile(&TPS_BOUNDS, &counts, TPS_DEFAULT_Q);
                self.ewma = fold(self.ewma, v, 0.3);
            }
            let i = AimdInput {
                current: self.cur,
                concurrency: admitted,
                rejected_since_last: rejected,
                tps_ewma: self.ewma,
                tps_threshold: Some(self.threshold),
                ttft_ewma: None,
                ttft_threshold: None,
                static_max: self.static_max,
            };
            if let Some(v) = step(&self.p, &i) {
                self.cur = Some(v);
            }
            self.cur.unwrap_or(limit)
        }

        /// Run `n` ticks, check the bounds on every one, return the mean of the last `tail`.
        fn run(&mut self, seed: u64, n: usize, tail: usize, c: f64) -> f64 {
            let lo = floor(&self.p, self.static_max);
            let mut sum = 0.0;
            for t in 0..n {
                let demand = (c * 1.6 + 20.0 * self.rng.unit()).round();
                let l = self.tick(c, demand);
                assert!(
                    l >= lo && l <= self.static_max,
                    "seed {seed}: tick {t} limit {l}"
                );
                if t >= n - tail {
                    sum += l;
                }
            }
            sum / tail as f64
        }
    }

    #[test]
    fn seeded_simulation_converges_and_tracks_capacity() {
        for seed in [1u64, 42, 0x5EED, 0xC0FFEE, 987_654_321] {
            let p = AimdParams {
                init: Some(48.0),
                ..AimdParams::default()
            };
            let mut sim = Sim::new(seed, p);
            // Capacity 60: from init 48 the limit grows on unmet demand and settles near 60.
            let m1 = sim.run(seed, 300, 100, 60.0);
            assert!(
                (54.0..=69.0).contains(&m1),
                "seed {seed}: settled at {m1}, capacity 60"
            );
            // Capacity drops to 36: the limit falls near it (never below the floor 32).
            let m2 = sim.run(seed, 300, 100, 36.0);
            assert!(
                (32.0..=42.0).contains(&m2),
                "seed {seed}: settled at {m2}, capacity 36"
            );
            assert!(m2 < m1 - 10.0, "seed {seed}: did not fall ({m1} → {m2})");
            // Capacity recovers: the limit climbs back.
            let m3 = sim.run(seed, 300, 100, 60.0);
            assert!(
                (54.0..=69.0).contains(&m3),
                "seed {seed}: climbed back to {m3}, capacity 60"
            );
            // Capacity far above the static max: pinned at 80, never above.
            let m4 = sim.run(seed, 300, 50, 500.0);
            assert!(m4 > 79.0, "seed {seed}: {m4}");
            // Capacity far below the floor: held at the floor 32, never below.
            let m5 = sim.run(seed, 300, 50, 5.0);
            assert!((32.0..=32.5).contains(&m5), "seed {seed}: {m5}");
        }
    }

    #[test]
    fn seeded_simulation_idle_hold() {
        for seed in [3u64, 77, 0xABCD] {
            let p = AimdParams {
                init: Some(48.0),
                ..AimdParams::default()
            };
            let mut sim = Sim::new(seed, p);
            sim.run(seed, 300, 10, 60.0);
            // Overload pushes it below init, then traffic stops (EWMA still alive).
            let overloaded = sim.run(seed, 100, 1, 5.0);
            assert!(overloaded < 48.0, "seed {seed}: {overloaded}");
            // The backend recovered (healthy EWMA), but nobody sends anything.
            sim.ewma = Some(50.0);
            for t in 0..200 {
                let l = sim.tick(5.0, 0.0);
                assert_eq!(
                    l, overloaded,
                    "seed {seed}: tick {t} moved an idle held limit"
                );
            }
            // Control: without hold, the same idle ticks climb back to init.
            let mut free = Sim::new(
                seed,
                AimdParams {
                    hold_when_idle: false,
                    ..p
                },
            );
            free.run(seed, 300, 10, 60.0);
            let low = free.run(seed, 100, 1, 5.0);
            assert!(low < 48.0, "seed {seed}: {low}");
            free.ewma = Some(50.0);
            let mut l = low;
            for _ in 0..200 {
                l = free.tick(5.0, 0.0);
            }
            assert_eq!(l, 48.0, "seed {seed}: no climb-back without hold");
            // With a trickle (slack) and hold: a high limit never shrinks.
            let mut held = Sim::new(seed, p);
            held.run(seed, 300, 10, 500.0);
            let high = held.cur.unwrap();
            for t in 0..100 {
                let l = held.tick(500.0, 3.0);
                assert_eq!(l, high, "seed {seed}: tick {t} slack-shrank a held limit");
            }
            // Control: without hold the trickle shrinks it down to init.
            let mut unheld = Sim::new(
                seed,
                AimdParams {
                    hold_when_idle: false,
                    ..p
                },
            );
            unheld.run(seed, 300, 10, 500.0);
            let mut l = 0.0;
            for _ in 0..100 {
                l = unheld.tick(500.0, 3.0);
            }
            assert_eq!(l, 48.0, "seed {seed}: slack without hold should reach init");
        }
    }

    #[test]
    fn seeded_random_inputs_stay_in_bounds() {
        let seed = 0xFEED_F00D;
        let mut rng = XorShift::new(seed);
        for n in 0..20_000 {
            let static_max = 1.0 + (rng.next() % 500) as f64;
            let p = AimdParams {
                init: (rng.unit() < 0.5).then(|| (rng.next() % 600) as f64),
                hold_when_idle: rng.unit() < 0.5,
                use_ttft: rng.unit() < 0.5,
                ..AimdParams::default()
            };
            let i = AimdInput {
                current: (rng.unit() < 0.67).then(|| rng.unit() * 1000.0),
                concurrency: (rng.next() % 600) as f64,
                rejected_since_last: rng.next() % 3,
                tps_ewma: Some(rng.unit() * 100.0),
                tps_threshold: (rng.unit() < 0.75).then(|| rng.unit() * 100.0),
                ttft_ewma: Some(rng.unit() * 1000.0),
                ttft_threshold: Some(500.0),
                static_max,
            };
            let v = step(&p, &i).unwrap();
            let lo = floor(&p, static_max);
            assert!(
                v >= lo && v <= static_max,
                "seed {seed} case {n}: {v} not in [{lo}, {static_max}]"
            );
            assert!(lo <= start(&p, static_max) && start(&p, static_max) <= static_max);
        }
    }
}
