//! Which core each worker runs on. Routers that share a segment (`--join`, and the two
//! sides of a takeover) see each other's workers there, each with the core it is pinned
//! to, so a router's workers take the cores the others use least, and a worker that
//! shares its core while another core of the mask has no worker moves there (once the
//! router it was started next to has gone, say).

/// The cores for `n` new workers, given the cores of the workers already running (`taken`,
/// any order): each in turn takes the least used core of `cores`; between cores used
/// alike, the one fewer of the new workers took (one router's workers spread first), then
/// the earliest in `cores`. `cores` is the affinity mask's core ids; empty → no pinning.
pub fn assign(cores: &[usize], taken: &[usize], n: usize) -> Vec<usize> {
    if cores.is_empty() {
        return Vec::new();
    }
    let mut load: Vec<usize> = cores
        .iter()
        .map(|c| taken.iter().filter(|t| *t == c).count())
        .collect();
    let mut mine = vec![0usize; cores.len()];
    (0..n)
        .map(|_| {
            let i = (0..cores.len())
                .min_by_key(|&i| (load[i], mine[i], i))
                .unwrap_or(0);
            load[i] += 1;
            mine[i] += 1;
            cores[i]
        })
        .collect()
}

/// Where worker `me` (its row and core) should move, if anywhere: when a worker of a lower
/// row shares its core and some core of `cores` has no worker, the first such core. Only
/// the highest row on a shared core moves, so two workers never swap places; `live` is
/// every live worker with a known core, `me` included.
pub fn rebalance(cores: &[usize], me: (u32, usize), live: &[(u32, usize)]) -> Option<usize> {
    let (row, core) = me;
    let shared = live.iter().any(|&(r, c)| c == core && r < row);
    if !shared {
        return None;
    }
    cores
        .iter()
        .copied()
        .find(|c| !live.iter().any(|&(_, lc)| lc == *c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_router_takes_one_core_each_and_a_join_the_free_ones() {
        assert_eq!(assign(&[0, 1], &[], 2), [0, 1]);
        // A join next to a one-worker router on core 0 takes core 1.
        assert_eq!(assign(&[0, 1], &[0], 1), [1]);
        // A takeover whose predecessor holds cores 0 and 1: one each again, not both on 0.
        assert_eq!(assign(&[0, 1], &[0, 1], 2), [0, 1]);
        // One worker of the predecessor still draining on core 1 (the other's row freed).
        assert_eq!(assign(&[0, 1], &[1], 2), [0, 1]);
        // More workers than cores: round the mask.
        assert_eq!(assign(&[2, 3], &[], 3), [2, 3, 2]);
        // Cores outside the mask do not count.
        assert_eq!(assign(&[2, 3], &[0, 1, 3], 1), [2]);
        assert!(assign(&[], &[0], 2).is_empty());
    }

    #[test]
    fn the_higher_row_on_a_shared_core_moves_to_a_free_one() {
        // A (row 0) and B' (row 2) on core 0, B gone: B' moves to core 1, A stays.
        let live = [(0, 0), (2, 0)];
        assert_eq!(rebalance(&[0, 1], (2, 0), &live), Some(1));
        assert_eq!(rebalance(&[0, 1], (0, 0), &live), None);
        // No free core: nobody moves.
        let live = [(0, 0), (1, 1), (2, 0)];
        assert_eq!(rebalance(&[0, 1], (2, 0), &live), None);
        // Alone on its core: stays.
        assert_eq!(rebalance(&[0, 1], (0, 0), &[(0, 0)]), None);
    }
}
