//! Session turn priority on the segment (SPEC §5.7, the reference README): per route, a
//! slot with per-bucket admits, rejections and tokens, the no-header counters, the turn-1
//! hold flag and probe budget, and the runtime toggle. The grading itself is
//! `session_prio`; with the feature off nothing here is touched.

use warmroute_shm::{RouteSlot, Segment};

use super::session_prio::{self as sp, NoHdr, SessionHeader};
use crate::cells::Relaxed;
use crate::config::{PrioBucket, RouteOpts};

/// Buckets the slot has room for (the default table has six).
pub const BUCKETS_MAX: usize = 8;

pub mod cell {
    pub const ADMITS: usize = 0; // ..8
    pub const REJECTS: usize = 8; // ..16
    pub const NOHDR: usize = 16; // ..20, by NoHdr::index()
    pub const PTOK: usize = 20; // ..28
    pub const CTOK: usize = 28; // ..36
    /// Turn-1 hold flag (1 = held out).
    pub const HOLD: usize = 36;
    /// Turn-1 probe window id and slots used in it.
    pub const T1_WIN: usize = 37;
    pub const T1_USED: usize = 38;
    /// Runtime toggle: 0 = route option, 1 = on, 2 = off.
    pub const TOGGLE: usize = 39;
    /// The current minute and requests / no-header requests in it (for the warning).
    pub const MINUTE: usize = 40;
    pub const MINUTE_TOTAL: usize = 41;
    pub const MINUTE_NOHDR: usize = 42;
    /// When the last no-header warning was logged (minute id).
    pub const WARNED_MINUTE: usize = 43;
}

/// The route's row; a long route name is shortened with its checksum as peer keys are, so
/// two long names never share a row.
pub fn slot(seg: &Segment, route: &str) -> Option<RouteSlot> {
    seg.route_slot(&crate::snapshot::shorten_key(format!("{route}#prio")))
}

pub fn enabled(seg: &Segment, slot: RouteSlot, opts: &RouteOpts) -> bool {
    match seg.route_cell(slot, cell::TOGGLE).load(Relaxed) {
        1 => true,
        2 => false,
        _ => opts.session_prio,
    }
}

/// The route's bucket table (custom or default).
pub fn table(opts: &RouteOpts) -> Vec<PrioBucket> {
    let t = match &opts.session_prio_table {
        Some(t) if sp::validate_table(t).is_ok() => t.clone(),
        _ => sp::default_table(opts.session_prio_r_new, opts.session_prio_full_turn),
    };
    t.into_iter().take(BUCKETS_MAX).collect()
}

/// Classify a request: its bucket, counting requests without a usable header (and warning,
/// at most once a minute, when their share of the minute passes `session_prio_warn_frac`).
pub fn classify(
    seg: &Segment,
    slot: RouteSlot,
    route: &str,
    opts: &RouteOpts,
    table: &[PrioBucket],
    header: Option<&[u8]>,
    now_s: u64,
) -> usize {
    let parsed: Result<SessionHeader, NoHdr> = sp::parse_header(header);
    let c = |i| seg.route_cell(slot, i);
    let minute = now_s / 60;
    if c(cell::MINUTE).swap(minute, Relaxed) != minute {
        c(cell::MINUTE_TOTAL).store(0, Relaxed);
        c(cell::MINUTE_NOHDR).store(0, Relaxed);
    }
    let total = c(cell::MINUTE_TOTAL).fetch_add(1, Relaxed) + 1;
    if let Err(reason) = &parsed {
        c(cell::NOHDR + reason.index()).fetch_add(1, Relaxed);
        let nohdr = c(cell::MINUTE_NOHDR).fetch_add(1, Relaxed) + 1;
        if sp::nohdr_warn(nohdr, total, opts.session_prio_warn_frac)
            && c(cell::WARNED_MINUTE).swap(minute, Relaxed) != minute
        {
            tracing::warn!(route, nohdr, total, "many requests on a session-priority route carry no usable {} header; they are treated as fully warm", sp::HEADER);
        }
    }
    sp::request_bucket(&parsed, table).min(BUCKETS_MAX - 1)
}

pub fn count(seg: &Segment, slot: RouteSlot, bucket: usize, admitted: bool) {
    let base = if admitted {
        cell::ADMITS
    } else {
        cell::REJECTS
    };
    seg.route_cell(slot, base + bucket.min(BUCKETS_MAX - 1))
        .fetch_add(1, Relaxed);
}

pub fn add_tokens(seg: &Segment, slot: RouteSlot, bucket: usize, ptok: u64, ctok: u64) {
    let b = bucket.min(BUCKETS_MAX - 1);
    // No atomic add of zero (the cached count of every cold turn), as in `account_usage`.
    for (c, n) in [(cell::PTOK + b, ptok), (cell::CTOK + b, ctok)] {
        if n > 0 {
            seg.route_cell(slot, c).fetch_add(n, Relaxed);
        }
    }
}

/// Take a turn-1 probe slot of the current probe window; returns how many came before.
pub fn take_t1_probe(seg: &Segment, slot: RouteSlot, now_s: u64, probe_window_s: u64) -> u64 {
    let w = now_s / probe_window_s.max(1);
    let wc = seg.route_cell(slot, cell::T1_WIN);
    if wc.swap(w, Relaxed) != w {
        seg.route_cell(slot, cell::T1_USED).store(0, Relaxed);
    }
    seg.route_cell(slot, cell::T1_USED).fetch_add(1, Relaxed)
}

pub fn graded_params(opts: &RouteOpts) -> sp::GradedParams {
    sp::GradedParams {
        severe: opts.session_prio_severe,
        release: opts.session_prio_release,
        t1_probes: opts.session_prio_t1_probes,
        probe_per_window: opts.ttft_probe_per_window,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_with_long_names_get_rows_of_their_own() {
        let tmp = crate::testutil::TempSegment::new("prio");
        let seg = &tmp.seg;
        // Two names that fill the key limit and differ only at their end.
        let (a, b) = (
            format!("{}a", "r".repeat(200)),
            format!("{}b", "r".repeat(200)),
        );
        let (sa, sb) = (slot(seg, &a).unwrap(), slot(seg, &b).unwrap());
        assert_ne!(sa, sb, "two long route names share one turn-priority row");
        // Each name keeps its row, and a short name's key is the name itself.
        assert_eq!(slot(seg, &a), Some(sa));
        assert_eq!(seg.find_route_slot("chat#prio"), None);
        let chat = slot(seg, "chat").unwrap();
        assert_eq!(seg.find_route_slot("chat#prio"), Some(chat));
        assert!([sa, sb].iter().all(|&s| s != chat));
        // The state itself stays apart: a toggle set on one is not the other's.
        seg.route_cell(sa, cell::TOGGLE).store(2, Relaxed);
        assert_eq!(seg.route_cell(sb, cell::TOGGLE).load(Relaxed), 0);
    }
}
