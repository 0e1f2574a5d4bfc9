//! Names of the segment's generic cells: what each per-peer, per-route and global u64
//! holds. One table, so readers (endpoints, `status`, metrics) and writers agree.
//!
//! Counters are incremented with `Relaxed` by whichever worker sees the event; gauges
//! have a single writer role, named per constant.

/// Per-peer cells.
pub mod peer {
    /// Attempts forwarded to this peer (every worker).
    pub const REQUESTS: usize = 0;
    /// Attempts that failed to connect or got 502/503 (every worker).
    pub const FAILURES: usize = 1;
    /// When the last probe finished, ms since the epoch (prober).
    pub const PROBE_AT_MS: usize = 2;
    /// Duration of the last probe, µs (prober).
    pub const PROBE_LATENCY_US: usize = 3;
    /// Outcome of the last probe: HTTP status, or 0 connect failure, 1 timeout (prober).
    pub const PROBE_STATUS: usize = 4;
    /// Transitions healthy → banned (prober and proxying workers).
    pub const BANS: usize = 5;
    /// Transitions banned → healthy (prober).
    pub const UNBANS: usize = 6;
    /// Probes sent (prober).
    pub const PROBES: usize = 7;
    /// Tokens from the responses' usage (every worker).
    pub const PROMPT_TOKENS: usize = 8;
    pub const CACHED_TOKENS: usize = 9;
    pub const COMPLETION_TOKENS: usize = 10;
    /// 2xx responses that reported usage.
    pub const USAGE_RESPONSES: usize = 11;
    /// Per-peer EWMAs (f64 bits, updated per sample by a CAS loop) and when each was last
    /// updated (s): TTFT in ms, decode rate in tokens/s. For status and metrics only; the
    /// gates use the pool's windowed EWMA.
    pub const TTFT_EWMA_BITS: usize = 12;
    pub const TTFT_EWMA_AT_S: usize = 13;
    pub const TPS_EWMA_BITS: usize = 14;
    pub const TPS_EWMA_AT_S: usize = 15;
    /// Responses from this peer that did not reach their end (every worker): the client
    /// went away mid-body, or the peer closed, went idle or broke its framing mid-body.
    pub const CUT_BY_CLIENT: usize = 16;
    pub const CUT_BY_PEER: usize = 17;
    /// Bumped by `_active_conns_set` before it sets the in-flight count: a request that
    /// took its unit under an earlier value does not give it back, since the count it was
    /// part of has been replaced.
    pub const INFLIGHT_EPOCH: usize = 18;
}

/// Cells of a key owner's row: a route row keyed `owner:<name>` (route names cannot hold
/// a `:`), written by every worker for requests whose key names that owner.
pub mod owner {
    pub const REQUESTS: usize = 0;
    pub const PROMPT_TOKENS: usize = 1;
    pub const CACHED_TOKENS: usize = 2;
    pub const COMPLETION_TOKENS: usize = 3;
}

/// Responses by status class, in a route slot of their own keyed `<route>#status`:
/// cell `c - 1` counts the `c`xx answers (1xx..5xx), the router's own included.
pub mod status {
    use warmroute_shm::{RouteSlot, Segment};

    /// The classes, in cell order, as the metric labels them.
    pub const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

    /// Cells 8..12: the route's rejection counts (`route::REJECT_CONCURRENCY`, `_TTFT`,
    /// `_TPS`, `_RULE`, in that order) when `_429_status?reset=1` last ran. The status view
    /// shows counts since then; the counters themselves, which `/metrics` exposes, only
    /// grow.
    pub const REJECT_BASE: usize = 8;

    /// The cell of `status`, or `None` outside 100..=599.
    pub fn cell(status: u16) -> Option<usize> {
        matches!(status, 100..=599).then(|| usize::from(status / 100) - 1)
    }

    /// The route's row; a long route name is shortened with its checksum as peer keys
    /// are, so two long names never share a row.
    pub fn slot(seg: &Segment, route: &str) -> Option<RouteSlot> {
        seg.route_slot(&crate::snapshot::shorten_key(format!("{route}#status")))
    }
}

/// Per-route cells.
pub mod route {
    pub const REQUESTS: usize = 0;
    /// 429s by gate.
    pub const REJECT_CONCURRENCY: usize = 1;
    pub const REJECT_TTFT: usize = 2;
    pub const REJECT_TPS: usize = 3;
    pub const REJECT_RULE: usize = 4;
    /// 503: no healthy peer.
    pub const UNAVAILABLE: usize = 5;
    /// 401: missing or wrong key.
    pub const UNAUTHORIZED: usize = 6;
    /// 400: model_not_supported.
    pub const MODEL_NOT_SUPPORTED: usize = 7;
    /// Further attempts made after a first one failed.
    pub const RETRIES: usize = 8;
    /// Requests by selection mode.
    pub const MODE_HASH: usize = 9;
    pub const MODE_HASH_FALLBACK: usize = 10;
    pub const MODE_LEAST_CONN: usize = 11;
    /// Runtime toggles (loopback endpoints), tri-state: see `toggle` below.
    pub const TOGGLE_REJECT_RULES: usize = 12;
    pub const TOGGLE_CCH_STRIP: usize = 13;
    pub const TOGGLE_KIMI_NORMALIZE: usize = 14;
    pub const TOGGLE_INCLUDE_USAGE: usize = 15;
    pub const TOGGLE_BODYLOG: usize = 16;
    /// Body-log sampling override: 0 = route default, else percent + 1.
    pub const BODYLOG_PCT: usize = 17;
    /// Request transforms.
    pub const BODIES_PARSED: usize = 18;
    pub const CCH_STRIPPED: usize = 19;
    pub const KIMI_CHANGES: usize = 20;
    pub const KIMI_REQUESTS: usize = 21;
    pub const USAGE_INJECTED: usize = 22;
    pub const USAGE_FRAMES_REMOVED: usize = 23;
    /// Responses (JSON bodies or SSE frames) the post-processor changed.
    pub const POSTPROCESS_CHANGED: usize = 24;
    /// Body-log records queued / dropped (queue full or listener down).
    pub const BODYLOG_QUEUED: usize = 25;
    pub const BODYLOG_DROPPED: usize = 26;
    /// Tokens from the responses' usage, and how many 2xx responses reported it.
    pub const PROMPT_TOKENS: usize = 27;
    pub const CACHED_TOKENS: usize = 28;
    pub const COMPLETION_TOKENS: usize = 29;
    pub const USAGE_RESPONSES: usize = 30;
    /// Histograms (see `measure`): 14 bucket counts, a sum and a count each.
    pub const TTFT_HIST: usize = 31; // ..=46
    pub const TPS_HIST: usize = 47; // ..=62
    /// Per-rule hit counters live in their own route slots: see `rule_slot_key`.
    pub const RULE_HITS: usize = 0;
}

/// Tri-state runtime toggle stored in a route cell: 0 = not set (the route option
/// applies), 1 = forced on, 2 = forced off. Survives reloads (the segment does).
pub fn toggle(
    seg: &warmroute_shm::Segment,
    slot: warmroute_shm::RouteSlot,
    cell: usize,
    default: bool,
) -> bool {
    match seg.route_cell(slot, cell).load(Relaxed) {
        1 => true,
        2 => false,
        _ => default,
    }
}

/// Set (Some) or clear (None) a runtime toggle.
pub fn set_toggle(
    seg: &warmroute_shm::Segment,
    slot: warmroute_shm::RouteSlot,
    cell: usize,
    on: Option<bool>,
) {
    let v = match on {
        None => 0,
        Some(true) => 1,
        Some(false) => 2,
    };
    seg.route_cell(slot, cell).store(v, Relaxed);
}

/// Segment key of the slot that counts hits of one reject rule of a route.
pub fn rule_slot_key(route: &str, rule: &str) -> String {
    crate::snapshot::shorten_key(format!("{route}#rule:{rule}"))
}

pub use std::sync::atomic::Ordering::Relaxed;
