//! Peer selection. Pure: peers, their loads and a random number in, a decision out.
//!
//! For now: least connections by in-flight / max_concurrency over the pool's healthy
//! peers, ties broken at random. Session affinity comes with the routing policy.

/// What selection decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerChoice {
    LeastConn(usize),
    NoHealthyPeer,
}

/// One candidate as selection sees it.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub inflight: i64,
    pub max_concurrency: u32,
    pub healthy: bool,
}

/// Index of the least-loaded healthy peer; `random` breaks ties uniformly.
pub fn least_conn(loads: &[Load], random: u64) -> PeerChoice {
    let mut best: Option<usize> = None;
    let mut ties = 0u64;
    let mut rnd = random;
    for (i, l) in loads.iter().enumerate() {
        if !l.healthy {
            continue;
        }
        let ord = match best {
            None => std::cmp::Ordering::Less,
            // inflight/max compared as a cross product, exact in integers.
            Some(b) => {
                let lhs = l.inflight.max(0) as u128 * loads[b].max_concurrency.max(1) as u128;
                let rhs = loads[b].inflight.max(0) as u128 * l.max_concurrency.max(1) as u128;
                lhs.cmp(&rhs)
            }
        };
        match ord {
            std::cmp::Ordering::Less => {
                best = Some(i);
                ties = 1;
            }
            std::cmp::Ordering::Equal => {
                // Reservoir sampling: each tied peer ends up chosen with equal chance.
                ties += 1;
                rnd = rnd
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                if (rnd >> 33).is_multiple_of(ties) {
                    best = Some(i);
                }
            }
            std::cmp::Ordering::Greater => {}
        }
    }
    match best {
        None => PeerChoice::NoHealthyPeer,
        Some(i) => PeerChoice::LeastConn(i),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(inflight: i64, max: u32) -> Load {
        Load {
            inflight,
            max_concurrency: max,
            healthy: true,
        }
    }

    #[test]
    fn picks_lowest_ratio() {
        assert_eq!(
            least_conn(&[l(3, 10), l(1, 10), l(2, 10)], 0),
            PeerChoice::LeastConn(1)
        );
        // 2/20 < 1/5
        assert_eq!(
            least_conn(&[l(1, 5), l(2, 20)], 0),
            PeerChoice::LeastConn(1)
        );
        let mut banned = l(0, 10);
        banned.healthy = false;
        assert_eq!(least_conn(&[banned, l(5, 10)], 0), PeerChoice::LeastConn(1));
        assert_eq!(least_conn(&[banned], 0), PeerChoice::NoHealthyPeer);
        assert_eq!(least_conn(&[], 0), PeerChoice::NoHealthyPeer);
    }

    #[test]
    fn ties_spread() {
        let loads = [l(0, 10), l(0, 10), l(0, 10)];
        let mut seen = [0u32; 3];
        let mut x = 0x1234_5678_9abc_def1u64;
        for _ in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if let PeerChoice::LeastConn(i) = least_conn(&loads, x) {
                seen[i] += 1;
            }
        }
        for s in seen {
            assert!(s > 700, "{seen:?}");
        }
    }
}
