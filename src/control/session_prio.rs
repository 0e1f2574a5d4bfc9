//! Session turn priority (SPEC §5.7; the reference README's "Session turn priority"): the
//! `x-phanrouter-session` header, the turn buckets and their shares, and the graded
//! concurrency, TTFT and decode-rate gates. Pure: plain inputs in, a decision out; the caller
//! owns the counters, probe slots and the turn-1 hold flag (all `u64` cells).
//!
//! # Reads, decides, writes
//! - Reads: the header value, the bucket table ([`default_table`] or the route's
//!   `session_prio_table`), the gate's EWMA and threshold, the probe counters of the current
//!   probe window, the hold flag.
//! - Decides: the bucket of a request, whether the concurrency gate admits it, and
//!   [`Graded`] (verdict + next hold flag) at the TTFT / TPS gates.
//! - Writes: nothing. On [`PrioGate::Probe`] the caller takes a warm probe slot, on
//!   [`PrioGate::T1Probe`] a turn-1 slot, and it stores [`Graded::hold`] (only while the
//!   rate-limit master switch is on: with it off the flag is neither set nor released).
//!
//! # Buckets
//! Turns 1 / 2–3 / 4–7 / … / `full_turn`+ (bucket starts at the powers of two below
//! `full_turn`, then `full_turn`; 6 buckets for the default 32). Shares rise linearly from
//! `r_new` (turn 1) to 1.0 (fully warm): 0.85, 0.88, 0.91, 0.94, 0.97, 1.0 by default.
//! A request without a usable header is graded as the top bucket (fully warm) and counted
//! under its [`NoHdr`] reason.
//!
//! # Concurrency
//! Admit while `in-flight < ⌈limit × rt_limit_factor × share⌉` (README), so under load
//! turn 1 is turned away first while a warm session still fits. Products within 1e-9 of an
//! integer count as that integer, so float noise (`20 × 0.85`) never adds a slot.
//!
//! # Graded TTFT gate (TPS: the same, inverted)
//! With `e` the EWMA, `T` the threshold, `b` the request's bucket:
//! - no `e` or no `T` → pass, and the hold flag is released (the EWMA expired);
//! - `e ≥ T × severe`: hard trip — every bucket is refused, whatever its tolerance;
//! - `e ≥ T × tol(b)`: soft zone — bucket `b` is refused; warmer buckets with a larger
//!   tolerance keep flowing until their own `T × tol` (or the hard trip);
//! - a refused warm request (`b ≥ 1`) may take a warm probe slot (`ttft_probe_per_window`
//!   per probe window, as the plain gate) — "warmer ones keep a probe slot";
//! - a refused turn-1 request never takes a warm slot: it gets one of `t1_probes` turn-1
//!   slots per probe window, only while the gate is actually tripped (`e ≥ T`) and no warm
//!   request has probed in that window yet (0 restores never-probe);
//! - hold flag: set whenever turn 1 is refused; while set, turn 1 is held out with no probe
//!   slot until `e < T × release` (or the EWMA expires), even below `T`.
//!
//! The default tolerance is 1.0 for every bucket, so with the built-in table a warm or
//! header-less request meets exactly the plain gate (trip at `T`, same probe budget) and
//! only turn 1 is graded; a `session_prio_table` with `tol > 1` lets warm buckets through
//! the band `[T, T × min(tol, severe))`.
//!
//! Decode rate: refused when `e ≤ T / tol(b)`, hard at `e ≤ T / severe`, tripped at
//! `e ≤ T`, released when `e > T / release`.

use crate::config::PrioBucket;
use crate::control::ewma::{probe_admit, Dir};

/// The request header the client gateway sets.
pub const HEADER: &str = "x-phanrouter-session";
/// Largest valid turn.
pub const MAX_TURN: u64 = 1_000_000_000;
/// Longest valid session id, in characters.
pub const MAX_SID_CHARS: usize = 256;
/// Option defaults (README).
pub const DEFAULT_R_NEW: f64 = 0.85;
pub const DEFAULT_FULL_TURN: u64 = 32;
pub const DEFAULT_SEVERE: f64 = 1.5;
pub const DEFAULT_RELEASE: f64 = 0.9;
pub const DEFAULT_T1_PROBES: u32 = 1;
pub const DEFAULT_WARN_FRAC: f64 = 0.2;
/// Tolerance of every bucket of the built-in table.
pub const DEFAULT_TOL: f64 = 1.0;

/// A usable `x-phanrouter-session` header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionHeader {
    pub session_id: String,
    pub turn: u64,
}

/// Why a request has no usable header (the `bnohdr:<reason>` counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NoHdr {
    /// No header, or an empty / whitespace-only value.
    Missing,
    /// Not a JSON object.
    Malformed,
    /// `turn` missing, not an integer, or outside 1..=10^9.
    BadTurn,
    /// `session_id` missing, not a string, blank, or over 256 characters.
    BadSessionId,
}

impl NoHdr {
    pub const ALL: [NoHdr; 4] = [
        NoHdr::Missing,
        NoHdr::Malformed,
        NoHdr::BadTurn,
        NoHdr::BadSessionId,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            NoHdr::Missing => "missing",
            NoHdr::Malformed => "malformed",
            NoHdr::BadTurn => "bad_turn",
            NoHdr::BadSessionId => "bad_session_id",
        }
    }

    /// Index into a 4-cell counter row, in [`NoHdr::ALL`] order.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Parse the header value: `{"session_id":"...","turn":N}`. Other keys are ignored.
pub fn parse_header(value: Option<&[u8]>) -> Result<SessionHeader, NoHdr> {
    let raw = value.ok_or(NoHdr::Missing)?;
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Err(NoHdr::Missing);
    }
    let v = crate::util::json_value(raw).map_err(|_| NoHdr::Malformed)?;
    let obj = v.as_object().ok_or(NoHdr::Malformed)?;
    let sid = obj
        .get("session_id")
        .and_then(|s| s.as_str())
        .filter(|s| !s.trim().is_empty() && s.chars().count() <= MAX_SID_CHARS)
        .ok_or(NoHdr::BadSessionId)?;
    let turn = obj
        .get("turn")
        .and_then(|t| t.as_u64())
        .filter(|t| (1..=MAX_TURN).contains(t))
        .ok_or(NoHdr::BadTurn)?;
    Ok(SessionHeader {
        session_id: sid.to_string(),
        turn,
    })
}

/// Whether a minute's header-less share calls for the (rate-limited) WARN: strictly more
/// than `warn_frac` of the minute's requests.
pub fn nohdr_warn(nohdr_in_minute: u64, total_in_minute: u64, warn_frac: f64) -> bool {
    total_in_minute > 0 && nohdr_in_minute as f64 > warn_frac * total_in_minute as f64
}

/// The built-in table: buckets starting at 1, 2, 4, … (powers of two below `full_turn`)
/// and `full_turn`; shares from `r_new` up to 1.0 in equal steps; tolerance 1.0.
pub fn default_table(r_new: f64, full_turn: u64) -> Vec<PrioBucket> {
    let full = full_turn.clamp(1, MAX_TURN);
    let mut starts = Vec::new();
    let mut t = 1u64;
    while t < full {
        starts.push(t);
        t *= 2;
    }
    starts.push(full);
    let n = starts.len();
    starts
        .into_iter()
        .enumerate()
        .map(|(i, min_turn)| PrioBucket {
            min_turn,
            share: if n == 1 {
                1.0
            } else {
                r_new + (1.0 - r_new) * i as f64 / (n - 1) as f64
            },
            tol: DEFAULT_TOL,
        })
        .collect()
}

/// A custom table is usable when non-empty, its first `min_turn` is 1, `min_turn`s strictly
/// ascend, and every share is in (0, 1] and every tol > 0 (finite).
pub fn validate_table(table: &[PrioBucket]) -> Result<(), String> {
    let first = table.first().ok_or("the table has no bucket")?;
    if first.min_turn != 1 {
        return Err(format!(
            "the first bucket starts at {}, not 1",
            first.min_turn
        ));
    }
    for (i, b) in table.iter().enumerate() {
        if !(b.share > 0.0 && b.share <= 1.0) {
            return Err(format!("bucket {i}: share {} not in (0, 1]", b.share));
        }
        if !(b.tol > 0.0 && b.tol.is_finite()) {
            return Err(format!("bucket {i}: tol {} not above 0", b.tol));
        }
        if i > 0 && b.min_turn <= table[i - 1].min_turn {
            return Err(format!(
                "bucket {i}: min_turn {} not above {}",
                b.min_turn,
                table[i - 1].min_turn
            ));
        }
    }
    Ok(())
}

/// Index of the bucket of `turn`: the last bucket whose `min_turn ≤ turn` (turn 0 and an
/// empty table give 0).
pub fn bucket_of(turn: u64, table: &[PrioBucket]) -> usize {
    table.iter().rposition(|b| b.min_turn <= turn).unwrap_or(0)
}

/// The bucket a request is graded in: its turn's, or the top bucket without a usable header.
pub fn request_bucket(header: &Result<SessionHeader, NoHdr>, table: &[PrioBucket]) -> usize {
    match header {
        Ok(h) => bucket_of(h.turn, table),
        Err(_) => table.len().saturating_sub(1),
    }
}

/// A bucket's label for status pages: "1", "2-3", …, "32+".
pub fn bucket_label(i: usize, table: &[PrioBucket]) -> String {
    let Some(b) = table.get(i) else {
        return String::new();
    };
    match table.get(i + 1) {
        None => format!("{}+", b.min_turn),
        Some(next) if next.min_turn == b.min_turn + 1 => b.min_turn.to_string(),
        Some(next) => format!("{}-{}", b.min_turn, next.min_turn - 1),
    }
}

/// ⌈x⌉, with values within 1e-9 (relative) of an integer taken as that integer.
fn ceil_snapped(x: f64) -> f64 {
    let r = x.round();
    if (x - r).abs() <= 1e-9 * r.abs().max(1.0) {
        r
    } else {
        x.ceil()
    }
}

/// How many requests of a bucket may be in flight: `⌈limit × rt_factor × share⌉`.
pub fn ceiling(limit: f64, rt_factor: f64, share: f64) -> f64 {
    ceil_snapped(limit * rt_factor * share)
}

/// The graded concurrency gate: admit while `inflight < ⌈limit × rt_factor × share⌉`
/// (in-flight excludes this request).
pub fn concurrency_admit(inflight: f64, limit: f64, rt_factor: f64, share: f64) -> bool {
    inflight < ceiling(limit, rt_factor, share)
}

/// Whether turn 1 gets a lower ceiling than a fully warm session at this (integer) limit:
/// `limit × (1 − r_new) ≥ 1` (README).
pub fn turn1_separated(limit: f64, r_new: f64) -> bool {
    let x = limit * (1.0 - r_new);
    x >= 1.0 || (x - 1.0).abs() <= 1e-9
}

/// Gate parameters (route options; `probe_per_window` is the gate's own
/// `ttft_probe_per_window` / `tps_probe_per_window`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradedParams {
    pub severe: f64,
    pub release: f64,
    pub t1_probes: u32,
    pub probe_per_window: u32,
}

impl Default for GradedParams {
    fn default() -> Self {
        GradedParams {
            severe: DEFAULT_SEVERE,
            release: DEFAULT_RELEASE,
            t1_probes: DEFAULT_T1_PROBES,
            probe_per_window: crate::control::ewma::DEFAULT_PROBE_PER_WINDOW,
        }
    }
}

/// What one request brings to a graded gate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradedInput {
    /// Live EWMA of the gate's metric.
    pub ewma: Option<f64>,
    pub threshold: Option<f64>,
    /// The request's bucket ([`request_bucket`]).
    pub bucket: usize,
    /// The stored turn-1 hold flag.
    pub hold: bool,
    /// Warm probe slots already taken in this probe window (excluding this request).
    pub warm_probes_used: u64,
    /// Turn-1 probe slots already taken in this probe window.
    pub t1_probes_used: u64,
}

/// Why a graded gate refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShedKind {
    /// Beyond threshold × severe: every bucket.
    Hard,
    /// Beyond threshold × tol(bucket).
    Soft,
    /// Turn 1 held out by the hysteresis flag.
    Hold,
}

/// A graded gate's verdict for one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PrioGate {
    Pass,
    /// Refused warm request admitted on a warm probe slot (the caller takes it).
    Probe,
    /// Refused turn-1 request admitted on a turn-1 probe slot (the caller takes it).
    T1Probe,
    /// 429; `limit` is the effective limit that tripped (threshold × factor, or ÷ for TPS).
    Shed {
        kind: ShedKind,
        ewma: f64,
        threshold: f64,
        limit: f64,
    },
}

/// Verdict plus the hold flag to store.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Graded {
    pub gate: PrioGate,
    pub hold: bool,
}

/// The graded TTFT gate (see the module doc).
pub fn ttft_graded(p: &GradedParams, table: &[PrioBucket], i: &GradedInput) -> Graded {
    graded(Dir::High, p, table, i)
}

/// The graded decode-rate gate (adaptive concurrency off): the TTFT grading inverted.
pub fn tps_graded(p: &GradedParams, table: &[PrioBucket], i: &GradedInput) -> Graded {
    graded(Dir::Low, p, table, i)
}

fn graded(dir: Dir, p: &GradedParams, table: &[PrioBucket], i: &GradedInput) -> Graded {
    let (Some(e), Some(t)) = (i.ewma, i.threshold) else {
        return Graded {
            gate: PrioGate::Pass,
            hold: false,
        };
    };
    let limit = |f: f64| match dir {
        Dir::High => t * f,
        Dir::Low => t / f,
    };
    let beyond = |f: f64| match dir {
        Dir::High => e >= limit(f),
        Dir::Low => e <= limit(f),
    };
    let tol = |b: usize| table.get(b).map_or(DEFAULT_TOL, |x| x.tol);
    let hard = beyond(p.severe);
    let refused_at = |b: usize| {
        if hard {
            Some((ShedKind::Hard, limit(p.severe)))
        } else if beyond(tol(b)) {
            Some((ShedKind::Soft, limit(tol(b))))
        } else {
            None
        }
    };
    let t1_refused = refused_at(0);
    let hold = if t1_refused.is_some() {
        true
    } else if !beyond(p.release) {
        false
    } else {
        i.hold
    };
    let shed = |kind, lim| PrioGate::Shed {
        kind,
        ewma: e,
        threshold: t,
        limit: lim,
    };
    let gate = if i.bucket == 0 {
        match t1_refused {
            Some((kind, lim)) => {
                let tripped = beyond(1.0);
                if tripped && i.warm_probes_used == 0 && probe_admit(i.t1_probes_used, p.t1_probes)
                {
                    PrioGate::T1Probe
                } else {
                    shed(kind, lim)
                }
            }
            None if hold => shed(ShedKind::Hold, limit(p.release)),
            None => PrioGate::Pass,
        }
    } else {
        match refused_at(i.bucket) {
            Some((kind, lim)) => {
                if probe_admit(i.warm_probes_used, p.probe_per_window) {
                    PrioGate::Probe
                } else {
                    shed(kind, lim)
                }
            }
            None => PrioGate::Pass,
        }
    };
    Graded { gate, hold }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ewma::{tps_gate, ttft_gate, Gate};

    use crate::testutil::XorShift;

    fn table() -> Vec<PrioBucket> {
        default_table(DEFAULT_R_NEW, DEFAULT_FULL_TURN)
    }

    #[test]
    fn default_buckets_and_shares() {
        let t = table();
        let starts: Vec<u64> = t.iter().map(|b| b.min_turn).collect();
        assert_eq!(starts, [1, 2, 4, 8, 16, 32]);
        for (b, want) in t.iter().zip([0.85, 0.88, 0.91, 0.94, 0.97, 1.0]) {
            assert!((b.share - want).abs() < 1e-12, "{t:?}");
            assert_eq!(b.tol, 1.0);
        }
        assert!(validate_table(&t).is_ok());
        let labels: Vec<String> = (0..t.len()).map(|i| bucket_label(i, &t)).collect();
        assert_eq!(labels, ["1", "2-3", "4-7", "8-15", "16-31", "32+"]);
        let got: Vec<usize> = [0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 33, MAX_TURN]
            .iter()
            .map(|&turn| bucket_of(turn, &t))
            .collect();
        assert_eq!(got, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 5]);
        // Other full turns.
        let s = |ft| -> Vec<u64> { default_table(0.85, ft).iter().map(|b| b.min_turn).collect() };
        assert_eq!(s(1), [1]);
        assert_eq!(default_table(0.85, 1)[0].share, 1.0);
        assert_eq!(s(2), [1, 2]);
        assert_eq!(s(5), [1, 2, 4, 5]);
        assert_eq!(s(0), [1]);
        let t5 = default_table(0.5, 5);
        assert_eq!(bucket_label(2, &t5), "4");
        assert_eq!(bucket_label(3, &t5), "5+");
        assert_eq!(bucket_label(9, &t5), "");
    }

    #[test]
    fn custom_tables() {
        let b = |min_turn, share, tol| PrioBucket {
            min_turn,
            share,
            tol,
        };
        let t = [b(1, 0.8, 1.0), b(4, 1.0, 1.2)];
        assert!(validate_table(&t).is_ok());
        assert_eq!(bucket_of(3, &t), 0);
        assert_eq!(bucket_of(4, &t), 1);
        assert!(validate_table(&[]).is_err());
        assert!(
            validate_table(&[b(2, 0.5, 1.0)]).is_err(),
            "first min_turn 1"
        );
        assert!(
            validate_table(&[b(1, 0.5, 1.0), b(1, 0.6, 1.0)]).is_err(),
            "strictly ascending"
        );
        assert!(validate_table(&[b(1, 0.5, 1.0), b(3, 0.6, 1.0), b(2, 1.0, 1.0)]).is_err());
        assert!(validate_table(&[b(1, 0.0, 1.0)]).is_err());
        assert!(validate_table(&[b(1, 1.1, 1.0)]).is_err());
        assert!(validate_table(&[b(1, 0.5, 0.0)]).is_err());
    }

    #[test]
    fn readme_ceilings_table() {
        let t = table();
        let rows: [(f64, [f64; 6]); 4] = [
            (6.0, [6.0, 6.0, 6.0, 6.0, 6.0, 6.0]),
            (7.0, [6.0, 7.0, 7.0, 7.0, 7.0, 7.0]),
            (10.0, [9.0, 9.0, 10.0, 10.0, 10.0, 10.0]),
            (20.0, [17.0, 18.0, 19.0, 19.0, 20.0, 20.0]),
        ];
        for (limit, want) in rows {
            let got: Vec<f64> = t.iter().map(|b| ceiling(limit, 1.0, b.share)).collect();
            assert_eq!(got, want, "limit {limit}");
            // The gate admits exactly `ceiling` requests of each bucket.
            for (b, &c) in t.iter().zip(&want) {
                assert!(concurrency_admit(c - 1.0, limit, 1.0, b.share));
                assert!(!concurrency_admit(c, limit, 1.0, b.share));
            }
        }
        // Turn 1 is first separated at limit 7 with the default r_new.
        assert!(!turn1_separated(6.0, 0.85));
        assert!(turn1_separated(7.0, 0.85));
        // rt_limit_factor scales the ceiling.
        assert_eq!(ceiling(10.0, 2.0, 0.85), 17.0);
        // With share 1 the gate is the plain one: admit while in-flight < limit × factor.
        assert!(concurrency_admit(50.0, 50.938, 1.0, 1.0));
        assert!(!concurrency_admit(51.0, 50.938, 1.0, 1.0));
        assert!(!concurrency_admit(0.0, 0.0, 1.0, 1.0));
    }

    #[test]
    fn separation_criterion_matches_the_ceilings() {
        // limit × (1 − r_new) ≥ 1  ⇔  ⌈limit × r_new⌉ < ⌈limit⌉, for integer limits.
        for step in 1..100u32 {
            let r_new = f64::from(step) / 100.0;
            for l in 1..=200u32 {
                let limit = f64::from(l);
                let separated = ceiling(limit, 1.0, r_new) < ceiling(limit, 1.0, 1.0);
                assert_eq!(
                    separated,
                    turn1_separated(limit, r_new),
                    "limit {limit}, r_new {r_new}"
                );
            }
        }
    }

    #[test]
    fn header_parsing() {
        let p = |s: &str| parse_header(Some(s.as_bytes()));
        assert_eq!(
            p(r#"{"session_id":"abc","turn":3}"#),
            Ok(SessionHeader {
                session_id: "abc".into(),
                turn: 3
            })
        );
        assert_eq!(
            p(r#" {"turn":1000000000, "session_id":" x ", "extra":[1]} "#)
                .unwrap()
                .turn,
            MAX_TURN
        );
        assert_eq!(parse_header(None), Err(NoHdr::Missing));
        assert_eq!(p("  "), Err(NoHdr::Missing));
        assert_eq!(p(""), Err(NoHdr::Missing));
        assert_eq!(p("{"), Err(NoHdr::Malformed));
        assert_eq!(p("[1,2]"), Err(NoHdr::Malformed));
        assert_eq!(p("\"abc\""), Err(NoHdr::Malformed));
        assert_eq!(p(r#"{"session_id":"a","turn":0}"#), Err(NoHdr::BadTurn));
        assert_eq!(
            p(r#"{"session_id":"a","turn":1000000001}"#),
            Err(NoHdr::BadTurn)
        );
        assert_eq!(p(r#"{"session_id":"a","turn":2.5}"#), Err(NoHdr::BadTurn));
        assert_eq!(p(r#"{"session_id":"a","turn":2.0}"#), Err(NoHdr::BadTurn));
        assert_eq!(p(r#"{"session_id":"a","turn":"2"}"#), Err(NoHdr::BadTurn));
        assert_eq!(p(r#"{"session_id":"a","turn":-1}"#), Err(NoHdr::BadTurn));
        assert_eq!(p(r#"{"session_id":"a"}"#), Err(NoHdr::BadTurn));
        assert_eq!(
            p(r#"{"session_id":"  ","turn":1}"#),
            Err(NoHdr::BadSessionId)
        );
        assert_eq!(p(r#"{"session_id":7,"turn":1}"#), Err(NoHdr::BadSessionId));
        assert_eq!(p(r#"{"turn":1}"#), Err(NoHdr::BadSessionId));
        let long = "é".repeat(256);
        assert!(
            p(&format!(r#"{{"session_id":"{long}","turn":1}}"#)).is_ok(),
            "256 chars ok"
        );
        assert_eq!(
            p(&format!(r#"{{"session_id":"{long}x","turn":1}}"#)),
            Err(NoHdr::BadSessionId)
        );
        let labels: Vec<&str> = NoHdr::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            labels,
            ["missing", "malformed", "bad_turn", "bad_session_id"]
        );
        assert!(NoHdr::ALL.iter().enumerate().all(|(i, r)| r.index() == i));
        // A header-less request is graded as fully warm.
        let t = table();
        assert_eq!(request_bucket(&Err(NoHdr::Malformed), &t), 5);
        assert_eq!(request_bucket(&p(r#"{"session_id":"a","turn":5}"#), &t), 2);
    }

    #[test]
    fn nohdr_warning_threshold() {
        assert!(!nohdr_warn(0, 0, 0.2));
        assert!(!nohdr_warn(2, 10, 0.2), "exactly the share does not warn");
        assert!(nohdr_warn(3, 10, 0.2));
        assert!(nohdr_warn(1, 10, 0.0));
    }

    fn inp(e: f64, bucket: usize) -> GradedInput {
        GradedInput {
            ewma: Some(e),
            threshold: Some(1000.0),
            bucket,
            hold: false,
            warm_probes_used: 0,
            t1_probes_used: 0,
        }
    }

    #[test]
    fn graded_ttft_default_table_warm_buckets_meet_the_plain_gate() {
        let p = GradedParams::default();
        let t = table();
        let mut rng = XorShift::new(99);
        for n in 0..5000 {
            let e = rng.unit() * 3000.0;
            let used = rng.next() % 8;
            let b = 1 + (rng.next() % 5) as usize;
            let i = GradedInput {
                warm_probes_used: used,
                ..inp(e, b)
            };
            let g = ttft_graded(&p, &t, &i).gate;
            let plain = ttft_gate(Some(e), Some(1000.0), used, p.probe_per_window);
            let same = matches!(
                (g, plain),
                (PrioGate::Pass, Gate::Pass)
                    | (PrioGate::Probe, Gate::Probe)
                    | (PrioGate::Shed { .. }, Gate::Shed { .. })
            );
            assert!(
                same,
                "seed 99 case {n}: e {e} bucket {b}: {g:?} vs {plain:?}"
            );
        }
    }

    #[test]
    fn graded_ttft_turn1() {
        let p = GradedParams::default();
        let t = table();
        // Below threshold, no hold: pass; flag stays clear.
        let g = ttft_graded(&p, &t, &inp(950.0, 0));
        assert_eq!(
            g,
            Graded {
                gate: PrioGate::Pass,
                hold: false
            }
        );
        // Tripped: turn 1 gets its own probe slot while no warm request probed this window.
        let g = ttft_graded(&p, &t, &inp(1000.0, 0));
        assert_eq!(g.gate, PrioGate::T1Probe);
        assert!(g.hold, "a refused turn 1 sets the hold flag");
        // ... but only t1_probes of them per window.
        let i = GradedInput {
            t1_probes_used: 1,
            ..inp(1200.0, 0)
        };
        assert!(
            matches!(ttft_graded(&p, &t, &i).gate, PrioGate::Shed { kind: ShedKind::Soft, limit, .. } if limit == 1000.0)
        );
        // ... and never once a warm request probed in this window.
        let i = GradedInput {
            warm_probes_used: 1,
            ..inp(1200.0, 0)
        };
        assert!(matches!(
            ttft_graded(&p, &t, &i).gate,
            PrioGate::Shed { .. }
        ));
        // t1_probes = 0 restores never-probe.
        let never = GradedParams { t1_probes: 0, ..p };
        assert!(matches!(
            ttft_graded(&never, &t, &inp(1200.0, 0)).gate,
            PrioGate::Shed { .. }
        ));
        // Hard trip: still refused (turn-1 budget applies while tripped).
        let g = ttft_graded(
            &p,
            &t,
            &GradedInput {
                t1_probes_used: 1,
                ..inp(1500.0, 0)
            },
        );
        assert!(
            matches!(g.gate, PrioGate::Shed { kind: ShedKind::Hard, limit, .. } if limit == 1500.0)
        );
        // Hysteresis: below threshold but above release, the flag holds turn 1 out, no probe.
        let held = GradedInput {
            hold: true,
            ..inp(950.0, 0)
        };
        let g = ttft_graded(&p, &t, &held);
        assert!(
            matches!(g.gate, PrioGate::Shed { kind: ShedKind::Hold, limit, .. } if (limit - 900.0).abs() < 1e-9)
        );
        assert!(g.hold);
        // Warm turns are not held.
        assert_eq!(
            ttft_graded(&p, &t, &GradedInput { bucket: 1, ..held }).gate,
            PrioGate::Pass
        );
        // Released below threshold × release; a warm request's evaluation releases it too.
        let g = ttft_graded(
            &p,
            &t,
            &GradedInput {
                hold: true,
                ..inp(899.0, 3)
            },
        );
        assert_eq!(
            g,
            Graded {
                gate: PrioGate::Pass,
                hold: false
            }
        );
        let g = ttft_graded(
            &p,
            &t,
            &GradedInput {
                hold: true,
                ..inp(899.0, 0)
            },
        );
        assert_eq!(
            g,
            Graded {
                gate: PrioGate::Pass,
                hold: false
            }
        );
        // Expired EWMA or no threshold: pass and release.
        let g = ttft_graded(
            &p,
            &t,
            &GradedInput {
                ewma: None,
                hold: true,
                ..inp(0.0, 0)
            },
        );
        assert_eq!(
            g,
            Graded {
                gate: PrioGate::Pass,
                hold: false
            }
        );
        let g = ttft_graded(
            &p,
            &t,
            &GradedInput {
                threshold: None,
                hold: true,
                ..inp(5e9, 0)
            },
        );
        assert_eq!(
            g,
            Graded {
                gate: PrioGate::Pass,
                hold: false
            }
        );
    }

    #[test]
    fn graded_ttft_custom_tolerances() {
        let p = GradedParams::default();
        let b = |min_turn, share, tol| PrioBucket {
            min_turn,
            share,
            tol,
        };
        // Turn 1 refused already at 0.95 T (but no turn-1 probe until actually tripped);
        // turns 2-7 at T; turns 8+ tolerated up to 1.3 T; hard trip at 1.5 T for everyone.
        let t = [b(1, 0.8, 0.95), b(2, 0.9, 1.0), b(8, 1.0, 1.3)];
        let gate = |e: f64, bucket: usize, warm: u64| {
            ttft_graded(
                &p,
                &t,
                &GradedInput {
                    warm_probes_used: warm,
                    ..inp(e, bucket)
                },
            )
            .gate
        };
        assert!(matches!(
            gate(960.0, 0, 0),
            PrioGate::Shed {
                kind: ShedKind::Soft,
                ..
            }
        ));
        assert_eq!(gate(960.0, 1, 0), PrioGate::Pass);
        assert_eq!(gate(1000.0, 0, 0), PrioGate::T1Probe);
        assert_eq!(gate(1100.0, 1, 0), PrioGate::Probe);
        assert!(matches!(
            gate(1100.0, 1, 5),
            PrioGate::Shed {
                kind: ShedKind::Soft,
                ..
            }
        ));
        assert_eq!(
            gate(1100.0, 2, 5),
            PrioGate::Pass,
            "warm bucket within its tolerance"
        );
        assert_eq!(gate(1299.0, 2, 5), PrioGate::Pass);
        assert!(matches!(
            gate(1301.0, 2, 5),
            PrioGate::Shed {
                kind: ShedKind::Soft,
                ..
            }
        ));
        assert_eq!(gate(1301.0, 2, 4), PrioGate::Probe);
        // A tolerance above severe is capped by the hard trip.
        let t2 = [b(1, 0.8, 1.0), b(2, 1.0, 3.0)];
        let g = ttft_graded(
            &p,
            &t2,
            &GradedInput {
                warm_probes_used: 5,
                ..inp(1500.0, 1)
            },
        )
        .gate;
        assert!(matches!(
            g,
            PrioGate::Shed {
                kind: ShedKind::Hard,
                ..
            }
        ));
        assert_eq!(ttft_graded(&p, &t2, &inp(1499.0, 1)).gate, PrioGate::Pass);
    }

    #[test]
    fn graded_tps_is_inverted() {
        let p = GradedParams::default();
        let b = |min_turn, share, tol| PrioBucket {
            min_turn,
            share,
            tol,
        };
        let t = [b(1, 0.8, 1.0), b(2, 1.0, 1.25)];
        let i = |e: f64, bucket: usize, warm: u64, hold: bool| GradedInput {
            ewma: Some(e),
            threshold: Some(20.0),
            bucket,
            hold,
            warm_probes_used: warm,
            t1_probes_used: 0,
        };
        // Above threshold: pass.
        assert_eq!(
            tps_graded(&p, &t, &i(25.0, 0, 0, false)).gate,
            PrioGate::Pass
        );
        // At threshold (≤): tripped; turn 1 refused (t1 probe), warm within tolerance (16).
        assert_eq!(
            tps_graded(&p, &t, &i(20.0, 0, 0, false)).gate,
            PrioGate::T1Probe
        );
        assert_eq!(
            tps_graded(&p, &t, &i(17.0, 1, 5, false)).gate,
            PrioGate::Pass
        );
        // Warm refused at ≤ T / tol = 16.
        let g = tps_graded(&p, &t, &i(16.0, 1, 5, false)).gate;
        assert!(matches!(g, PrioGate::Shed { kind: ShedKind::Soft, limit, .. } if limit == 16.0));
        // Hard at ≤ T / severe.
        let g = tps_graded(&p, &t, &i(13.0, 1, 5, false)).gate;
        assert!(matches!(
            g,
            PrioGate::Shed {
                kind: ShedKind::Hard,
                ..
            }
        ));
        // Hold released only above T / release (22.2…).
        let g = tps_graded(&p, &t, &i(22.0, 0, 0, true));
        assert!(
            matches!(
                g.gate,
                PrioGate::Shed {
                    kind: ShedKind::Hold,
                    ..
                }
            ) && g.hold
        );
        let g = tps_graded(&p, &t, &i(22.3, 0, 0, true));
        assert_eq!(
            g,
            Graded {
                gate: PrioGate::Pass,
                hold: false
            }
        );
        // Default table: warm buckets meet the plain TPS gate.
        let d = table();
        for (e, used) in [(19.0, 0), (19.0, 5), (21.0, 9), (20.0, 4)] {
            let g = tps_graded(&p, &d, &i(e, 3, used, false)).gate;
            let plain = tps_gate(Some(e), Some(20.0), used, 5);
            assert!(
                matches!(
                    (g, plain),
                    (PrioGate::Pass, Gate::Pass)
                        | (PrioGate::Probe, Gate::Probe)
                        | (PrioGate::Shed { .. }, Gate::Shed { .. })
                ),
                "{e} {used}: {g:?} vs {plain:?}"
            );
        }
    }

    /// Seeded simulation of one probe window under a tripped EWMA with mixed traffic: warm
    /// requests take at most `probe_per_window` slots, turn 1 at most `t1_probes` and only
    /// before the first warm probe; a pool of only new sessions still trickles through.
    #[test]
    fn seeded_probe_budgets() {
        let p = GradedParams::default();
        let t = table();
        for seed in [5u64, 11, 0xBEEF] {
            let mut rng = XorShift::new(seed);
            for new_share in [0.0, 0.5, 0.95, 1.0] {
                let (mut warm, mut t1, mut hold) = (0u64, 0u64, false);
                for _ in 0..200 {
                    let b = if rng.unit() < new_share {
                        0
                    } else {
                        1 + (rng.next() % 5) as usize
                    };
                    let g = ttft_graded(
                        &p,
                        &t,
                        &GradedInput {
                            hold,
                            warm_probes_used: warm,
                            t1_probes_used: t1,
                            ..inp(1200.0, b)
                        },
                    );
                    hold = g.hold;
                    match g.gate {
                        PrioGate::Probe => warm += 1,
                        PrioGate::T1Probe => {
                            assert_eq!(warm, 0, "seed {seed}: turn-1 probe after a warm probe");
                            t1 += 1;
                        }
                        PrioGate::Pass => panic!("seed {seed}: pass while tripped"),
                        PrioGate::Shed { .. } => {}
                    }
                }
                assert!(warm <= 5 && t1 <= 1, "seed {seed}: warm {warm}, t1 {t1}");
                if new_share == 1.0 {
                    assert_eq!(
                        (warm, t1),
                        (0, 1),
                        "seed {seed}: new-only pool must trickle"
                    );
                }
                if new_share == 0.0 {
                    assert_eq!((warm, t1), (5, 0), "seed {seed}");
                }
                assert!(hold, "seed {seed}: tripped sets the hold flag");
            }
        }
    }
}
