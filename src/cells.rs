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
}

pub use std::sync::atomic::Ordering::Relaxed;
