//! Admission gates that need no body: the static concurrency gate (SPEC §5.4). Pure.
//!
//! Pool limit = sum of `max_concurrency` over the healthy peers of the active tier; pool
//! in-flight = sum over every peer of the pool. In-flight ≥ limit × `rt_limit_factor`
//! sheds with 429.

use super::error_response::ConcurrencyFigures;
use super::peer_select::{active_tier, Load};

/// The gate's decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admission {
    Admit,
    Shed(ConcurrencyFigures),
}

/// The figures of a pool right now.
pub fn figures(loads: &[Load], rt_limit_factor: f64) -> Option<ConcurrencyFigures> {
    let tier = active_tier(loads)?;
    let (mut limit, mut healthy_peers) = (0.0, 0);
    for l in loads.iter().filter(|l| l.healthy && l.priority == tier) {
        limit += l.max_concurrency as f64;
        healthy_peers += 1;
    }
    Some(ConcurrencyFigures {
        limit,
        inflight: loads.iter().map(|l| l.inflight.max(0)).sum(),
        rt_factor: rt_limit_factor,
        healthy_peers,
        active_level: tier,
        avg_5min: 0.0,
    })
}

/// The pool's healthy capacity: the sum of `max_concurrency` over the healthy peers of its
/// active priority tier, 0 when none is healthy (the limit of [`figures`], unscaled).
pub fn healthy_capacity(loads: &[Load]) -> f64 {
    figures(loads, 1.0).map_or(0.0, |f| f.limit)
}

pub fn concurrency_gate(f: &ConcurrencyFigures) -> Admission {
    if f.inflight as f64 >= f.limit * f.rt_factor {
        Admission::Shed(*f)
    } else {
        Admission::Admit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(inflight: i64, max: u32, healthy: bool, priority: i32) -> Load {
        Load {
            inflight,
            max_concurrency: max,
            healthy,
            priority,
            key_hash: 0,
        }
    }

    #[test]
    fn limit_is_the_active_tiers_healthy_capacity_inflight_counts_everyone() {
        let loads = [
            l(1, 1, true, 0),
            l(0, 1, true, 0),
            l(3, 5, false, 0),
            l(2, 50, true, -1),
        ];
        let f = figures(&loads, 1.0).unwrap();
        assert_eq!(
            (f.limit, f.inflight, f.healthy_peers, f.active_level),
            (2.0, 6, 2, 0)
        );
        assert!(matches!(concurrency_gate(&f), Admission::Shed(_)));
        let ok = [l(1, 1, true, 0), l(0, 1, true, 0)];
        let f = figures(&ok, 1.0).unwrap();
        assert_eq!(concurrency_gate(&f), Admission::Admit);
        // Exactly at the limit sheds; a factor above 1 lets more through.
        let full = [l(1, 1, true, 0), l(1, 1, true, 0)];
        assert!(matches!(
            concurrency_gate(&figures(&full, 1.0).unwrap()),
            Admission::Shed(_)
        ));
        assert_eq!(
            concurrency_gate(&figures(&full, 1.5).unwrap()),
            Admission::Admit
        );
        assert_eq!(figures(&[l(0, 1, false, 0)], 1.0), None);
    }
}
