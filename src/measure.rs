//! Measurement that is always on (SPEC §5.1–§5.3): time to first token and decode rate
//! as per-route histograms in the segment, fed by every worker. Pure bucket math here;
//! the request path records, `/metrics` renders.
//!
//! TTFT: 2xx `text/event-stream` responses, from the request being fully read to the first
//! non-empty body bytes. Decode rate: completion tokens over (last − first body bytes) for
//! streams, over the whole request otherwise; only samples with at least `tps_min_tokens`
//! tokens and `tps_min_decode_s` seconds count.

use crate::cells::{self, Relaxed};

/// TTFT bucket upper bounds, ms (the reference's; a last, unbounded bucket follows).
pub const TTFT_BOUNDS_MS: [f64; 13] = [
    250.0, 500.0, 1000.0, 1500.0, 2000.0, 3000.0, 5000.0, 8000.0, 12000.0, 20000.0, 30000.0,
    50000.0, 80000.0,
];
/// Decode-rate bucket upper bounds, tokens/s.
pub const TPS_BOUNDS: [f64; 13] = [
    5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0,
];

/// Index of the bucket a sample falls in: the first bound ≥ the sample, else the last.
pub fn bucket(bounds: &[f64], v: f64) -> usize {
    bounds.iter().position(|&b| v <= b).unwrap_or(bounds.len())
}

/// A histogram's layout in a route's cells: `base..base+bounds+1` counts (not cumulative),
/// then a sum (in milli-units) and a count.
#[derive(Clone, Copy, Debug)]
pub struct HistCells {
    pub base: usize,
    pub bounds: &'static [f64],
}

impl HistCells {
    pub fn sum_cell(&self) -> usize {
        self.base + self.bounds.len() + 1
    }
    pub fn count_cell(&self) -> usize {
        self.sum_cell() + 1
    }
}

pub const TTFT: HistCells = HistCells {
    base: cells::route::TTFT_HIST,
    bounds: &TTFT_BOUNDS_MS,
};
pub const TPS: HistCells = HistCells {
    base: cells::route::TPS_HIST,
    bounds: &TPS_BOUNDS,
};

/// Add one sample to a route's histogram.
pub fn record(seg: &warmroute_shm::Segment, slot: warmroute_shm::RouteSlot, h: HistCells, v: f64) {
    if !v.is_finite() || v < 0.0 {
        return;
    }
    seg.route_cell(slot, h.base + bucket(h.bounds, v))
        .fetch_add(1, Relaxed);
    seg.route_cell(slot, h.sum_cell())
        .fetch_add((v * 1000.0) as u64, Relaxed);
    seg.route_cell(slot, h.count_cell()).fetch_add(1, Relaxed);
}

/// Fold a sample into a per-peer EWMA cell pair (value bits, time); lock-free (CAS loop),
/// any worker may update it. A value older than `ttl_s` restarts from the sample.
pub fn peer_ewma_update(
    seg: &warmroute_shm::Segment,
    slot: warmroute_shm::PeerSlot,
    cells: (usize, usize),
    v: f64,
    alpha: f64,
    now_s: u64,
    ttl_s: u64,
) {
    if !v.is_finite() {
        return;
    }
    let at = seg.peer_cell(slot, cells.1);
    let fresh = now_s.saturating_sub(at.load(Relaxed)) > ttl_s;
    let _ = seg
        .peer_cell(slot, cells.0)
        .fetch_update(Relaxed, Relaxed, |bits| {
            let old = f64::from_bits(bits);
            Some(
                if fresh || !old.is_finite() {
                    v
                } else {
                    alpha * v + (1.0 - alpha) * old
                }
                .to_bits(),
            )
        });
    at.store(now_s.max(1), Relaxed);
}

/// A per-peer EWMA, when updated within `ttl_s`.
pub fn peer_ewma(
    seg: &warmroute_shm::Segment,
    slot: warmroute_shm::PeerSlot,
    cells: (usize, usize),
    now_s: u64,
    ttl_s: u64,
) -> Option<f64> {
    let at = seg.peer_cell(slot, cells.1).load(Relaxed);
    (at != 0 && now_s.saturating_sub(at) <= ttl_s)
        .then(|| f64::from_bits(seg.peer_cell(slot, cells.0).load(Relaxed)))
}

/// The TTFT and decode-rate cell pairs of a peer.
pub const PEER_TTFT: (usize, usize) = (cells::peer::TTFT_EWMA_BITS, cells::peer::TTFT_EWMA_AT_S);
pub const PEER_TPS: (usize, usize) = (cells::peer::TPS_EWMA_BITS, cells::peer::TPS_EWMA_AT_S);

/// The decode rate of a response, when it qualifies as a sample.
pub fn decode_rate(
    completion_tokens: u64,
    seconds: f64,
    min_tokens: u64,
    min_seconds: f64,
) -> Option<f64> {
    (completion_tokens >= min_tokens && seconds >= min_seconds && seconds > 0.0)
        .then(|| completion_tokens as f64 / seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_take_the_first_bound_at_or_above() {
        assert_eq!(bucket(&TTFT_BOUNDS_MS, 0.0), 0);
        assert_eq!(bucket(&TTFT_BOUNDS_MS, 250.0), 0);
        assert_eq!(bucket(&TTFT_BOUNDS_MS, 250.1), 1);
        assert_eq!(bucket(&TTFT_BOUNDS_MS, 2999.0), 5);
        assert_eq!(bucket(&TTFT_BOUNDS_MS, 90000.0), 13, "overflow bucket");
        assert_eq!(bucket(&TPS_BOUNDS, 42.0), 7);
    }

    #[test]
    fn decode_rate_needs_enough_tokens_and_time() {
        assert_eq!(decode_rate(32, 1.0, 16, 0.5), Some(32.0));
        assert_eq!(decode_rate(15, 1.0, 16, 0.5), None);
        assert_eq!(decode_rate(100, 0.4, 16, 0.5), None);
    }

    #[test]
    fn layouts_fit_the_route_cells() {
        assert!(TTFT.count_cell() < TPS.base, "histograms must not overlap");
        assert!(TPS.count_cell() < warmroute_shm::ROUTE_CELLS);
    }
}
