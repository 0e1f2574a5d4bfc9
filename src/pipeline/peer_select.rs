//! Peer selection. Pure: candidates, their loads, the session id and a random number in;
//! a decision out. No IO, no clock.
//!
//! - Candidates are the peers of the active tier: the highest priority with a healthy peer.
//! - With a session id, `crc32_mod` picks `crc32(sid) % n` over the tier in file order
//!   (banned peers included, so a ban moves only the banned peer's sessions);
//!   `rendezvous` picks the highest hash of (sid, peer) over the tier, so adding or
//!   removing a peer moves only ~1/n of the sessions. If that peer is banned or at its
//!   `max_concurrency`, least connections over the tier's healthy peers picks instead.
//! - `sticky_table`: the caller looks the session up in the shared placement table and passes
//!   the peer it found; a session without one (new, forgotten, or whose peer left the tier or
//!   is banned) is placed by least connections, and the caller records that choice.
//! - Without one: least connections by in-flight / max_concurrency, ties at random.

use std::cmp::Ordering;

/// What selection decided; the index is into the pool's peer list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerChoice {
    Hash(usize),
    HashFallback(usize),
    LeastConn(usize),
    NoHealthyPeer,
}

impl PeerChoice {
    pub fn index(&self) -> Option<usize> {
        match *self {
            PeerChoice::Hash(i) | PeerChoice::HashFallback(i) | PeerChoice::LeastConn(i) => Some(i),
            PeerChoice::NoHealthyPeer => None,
        }
    }
    pub fn mode(&self) -> &'static str {
        match self {
            PeerChoice::Hash(_) => "hash",
            PeerChoice::HashFallback(_) => "hash_fallback",
            PeerChoice::LeastConn(_) | PeerChoice::NoHealthyPeer => "least_conn",
        }
    }
}

/// One peer as selection sees it.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub inflight: i64,
    pub max_concurrency: u32,
    pub healthy: bool,
    pub priority: i32,
    /// Stable per-peer hash (of its address) for rendezvous.
    pub key_hash: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affinity {
    Crc32Mod,
    Rendezvous,
    /// Placement by least connections, remembered by the caller's table.
    Table,
}

impl From<crate::config::AffinityHash> for Affinity {
    fn from(h: crate::config::AffinityHash) -> Affinity {
        match h {
            crate::config::AffinityHash::Crc32Mod => Affinity::Crc32Mod,
            crate::config::AffinityHash::Rendezvous => Affinity::Rendezvous,
            crate::config::AffinityHash::StickyTable => Affinity::Table,
        }
    }
}

/// Highest priority that has a healthy peer.
pub fn active_tier(loads: &[Load]) -> Option<i32> {
    loads.iter().filter(|l| l.healthy).map(|l| l.priority).max()
}

/// Compare load ratios inflight/max exactly (cross products).
fn ratio_cmp(a: &Load, b: &Load) -> Ordering {
    let lhs = a.inflight.max(0) as u128 * b.max_concurrency.max(1) as u128;
    let rhs = b.inflight.max(0) as u128 * a.max_concurrency.max(1) as u128;
    lhs.cmp(&rhs)
}

/// Least loaded among `loads` whose index passes `allow`; ties broken uniformly at random.
pub fn least_conn_where(
    loads: &[Load],
    random: u64,
    allow: impl Fn(usize, &Load) -> bool,
) -> Option<usize> {
    let mut best: Option<usize> = None;
    let mut ties = 0u64;
    let mut rnd = random;
    for (i, l) in loads.iter().enumerate() {
        if !allow(i, l) {
            continue;
        }
        match best.map_or(Ordering::Less, |b| ratio_cmp(l, &loads[b])) {
            Ordering::Less => {
                best = Some(i);
                ties = 1;
            }
            Ordering::Equal => {
                // Reservoir sampling: the k-th tied peer replaces the pick with chance 1/k.
                ties += 1;
                rnd = rnd
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                if (rnd >> 33).is_multiple_of(ties) {
                    best = Some(i);
                }
            }
            Ordering::Greater => {}
        }
    }
    best
}

/// Least connections over the healthy peers of the active tier.
pub fn least_conn(loads: &[Load], random: u64) -> PeerChoice {
    let Some(tier) = active_tier(loads) else {
        return PeerChoice::NoHealthyPeer;
    };
    match least_conn_where(loads, random, |_, l| l.healthy && l.priority == tier) {
        Some(i) => PeerChoice::LeastConn(i),
        None => PeerChoice::NoHealthyPeer,
    }
}

/// splitmix64 finaliser: spreads a 64-bit value over all bits.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a, for peer keys and rendezvous session hashes.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_extend(FNV1A64_OFFSET, bytes)
}

/// FNV-1a's starting state.
pub const FNV1A64_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a continued from state `h` over `bytes` (for hashing in pieces).
pub fn fnv1a64_extend(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// Rendezvous score of one peer for a session (higher wins).
pub fn rendezvous_score(sid_hash: u64, key_hash: u64) -> u64 {
    mix64(sid_hash ^ mix64(key_hash))
}

/// The peer a session maps to inside the active tier, banned or not ("natural target").
/// `placed` is the table's peer for [`Affinity::Table`] (ignored otherwise); it counts only
/// while it is in the active tier.
pub fn natural_target(
    loads: &[Load],
    sid: &[u8],
    algo: Affinity,
    placed: Option<usize>,
) -> Option<usize> {
    let tier = active_tier(loads)?;
    // The tier's peers in pool order, without collecting them (this runs per request).
    let tier_peers = || (0..loads.len()).filter(move |&i| loads[i].priority == tier);
    match algo {
        Affinity::Table => placed.filter(|&i| loads.get(i).is_some_and(|l| l.priority == tier)),
        Affinity::Crc32Mod => {
            let h = crc32fast::hash(sid) as usize;
            tier_peers().nth(h % tier_peers().count())
        }
        Affinity::Rendezvous => {
            let s = fnv1a64(sid);
            tier_peers()
                .max_by_key(|&i| (rendezvous_score(s, loads[i].key_hash), std::cmp::Reverse(i)))
        }
    }
}

/// When a session's peer is busy, what makes it "full".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// Full at its max_concurrency (SPEC §3.5).
    AtMax,
    /// Full only when also loaded more than `BOUNDED_LOAD_FACTOR` × the tier's average
    /// (consistent hashing with bounded loads) or `BOUNDED_LOAD_CAP` × its own
    /// max_concurrency: a uniformly saturated pool keeps sessions on their peers instead of
    /// re-prefilling them elsewhere.
    BoundedLoad,
}

impl Overflow {
    pub fn from_name(s: &str) -> Overflow {
        if s == "bounded_load" {
            Overflow::BoundedLoad
        } else {
            Overflow::AtMax
        }
    }
}

/// How far above the tier's average load a pinned peer may go under `BoundedLoad`.
pub const BOUNDED_LOAD_FACTOR: f64 = 2.0;

/// The most a pinned peer may carry under `BoundedLoad`, as a multiple of its
/// `max_concurrency`, however busy the tier: what is above `max_concurrency` waits in the
/// engine's queue.
///
/// Below the tier's capacity a short queue on the session's engine beats re-prefilling the
/// conversation on a cold one. At capacity every engine is full, and an engine that queues
/// more live conversations than its prefix cache holds evicts the waiting ones. The replay
/// bench (`bench/run affinity`, 8 engines taking 48 at once, seeds 1–3) measured crc32's
/// hit rate, as % of the ideal at 32 / 48 / 64 / 96 in flight (seed means), at 98.7 / 93.5 /
/// 93.7 / 91.4 with twice the share and no cap, 97.5 / 96.7 / 96.2 / 95.1 with 1.5 times
/// the share and no cap, and 98.7 / 96.9 / 96.3 / 93.9 with twice the share and this cap.
pub const BOUNDED_LOAD_CAP: f64 = 1.5;

/// Whether the session's peer `t` takes the request.
fn takes(loads: &[Load], t: usize, overflow: Overflow) -> bool {
    let p = &loads[t];
    if !p.healthy {
        return false;
    }
    if p.inflight < p.max_concurrency as i64 {
        return true;
    }
    match overflow {
        Overflow::AtMax => false,
        Overflow::BoundedLoad => {
            let tier = loads
                .iter()
                .filter(|l| l.healthy && l.priority == p.priority);
            let (inflight, cap) = tier.fold((0i64, 0u64), |(i, c), l| {
                (i + l.inflight.max(0), c + l.max_concurrency as u64)
            });
            // Its share of the tier's load (this request included), allowed up to
            // BOUNDED_LOAD_FACTOR times its share of the capacity and never more than
            // BOUNDED_LOAD_CAP times its own.
            let max = p.max_concurrency as f64;
            let allowed = (BOUNDED_LOAD_FACTOR * max * (inflight + 1) as f64 / cap.max(1) as f64)
                .min(BOUNDED_LOAD_CAP * max);
            (p.inflight + 1) as f64 <= allowed.ceil()
        }
    }
}

/// Full selection for a request. `placed`: see [`natural_target`]. Under
/// [`Affinity::Table`] a `LeastConn` answer for a request with a session id is a (re)placement
/// the caller should record; `HashFallback` is a one-off overflow that should not move the
/// session.
pub fn select(
    loads: &[Load],
    sid: Option<&[u8]>,
    algo: Affinity,
    overflow: Overflow,
    placed: Option<usize>,
    random: u64,
) -> PeerChoice {
    let Some(sid) = sid else {
        return least_conn(loads, random);
    };
    let Some(target) = natural_target(loads, sid, algo, placed) else {
        return if algo == Affinity::Table {
            least_conn(loads, random)
        } else {
            PeerChoice::NoHealthyPeer
        };
    };
    if takes(loads, target, overflow) {
        return PeerChoice::Hash(target);
    }
    if algo == Affinity::Table && !loads[target].healthy {
        return least_conn(loads, random);
    }
    match least_conn(loads, random) {
        PeerChoice::LeastConn(i) => PeerChoice::HashFallback(i),
        other => other,
    }
}

/// Retry targets after `chosen` failed: the other healthy peers of its tier, least loaded
/// first, equally loaded ones in an order drawn from `random` (as least connections
/// breaks ties; file order would send every retry to the same peer first); with
/// `cross_tier` also the least-loaded healthy peer of each lower tier.
pub fn fallback_order(loads: &[Load], chosen: usize, cross_tier: bool, random: u64) -> Vec<usize> {
    let tier = loads[chosen].priority;
    let mut same: Vec<usize> = (0..loads.len())
        .filter(|&i| i != chosen && loads[i].healthy && loads[i].priority == tier)
        .collect();
    let tie = |i: usize| mix64(random ^ i as u64);
    same.sort_by(|&a, &b| ratio_cmp(&loads[a], &loads[b]).then(tie(a).cmp(&tie(b))));
    if cross_tier {
        let mut lower: Vec<i32> = loads
            .iter()
            .filter(|l| l.healthy && l.priority < tier)
            .map(|l| l.priority)
            .collect();
        lower.sort_unstable_by(|a, b| b.cmp(a));
        lower.dedup();
        for p in lower {
            if let Some(i) = least_conn_where(loads, random, |_, l| l.healthy && l.priority == p) {
                same.push(i);
            }
        }
    }
    same
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(inflight: i64, max: u32) -> Load {
        Load {
            inflight,
            max_concurrency: max,
            healthy: true,
            priority: 0,
            key_hash: 0,
        }
    }

    fn pool(n: usize) -> Vec<Load> {
        (0..n)
            .map(|i| Load {
                key_hash: fnv1a64(format!("10.0.0.{i}:8000").as_bytes()),
                ..l(0, 10)
            })
            .collect()
    }

    #[test]
    fn least_conn_picks_lowest_ratio_in_the_active_tier() {
        assert_eq!(
            least_conn(&[l(3, 10), l(1, 10), l(2, 10)], 0),
            PeerChoice::LeastConn(1)
        );
        assert_eq!(
            least_conn(&[l(1, 5), l(2, 20)], 0),
            PeerChoice::LeastConn(1)
        );
        let mut banned = l(0, 10);
        banned.healthy = false;
        assert_eq!(least_conn(&[banned, l(5, 10)], 0), PeerChoice::LeastConn(1));
        assert_eq!(least_conn(&[banned], 0), PeerChoice::NoHealthyPeer);
        assert_eq!(least_conn(&[], 0), PeerChoice::NoHealthyPeer);
        // A busy higher tier still takes everything; a lower tier only when it is all banned.
        let mut low = l(0, 10);
        low.priority = -1;
        assert_eq!(least_conn(&[l(9, 10), low], 0), PeerChoice::LeastConn(0));
        let mut hi = l(0, 10);
        hi.healthy = false;
        assert_eq!(least_conn(&[hi, low], 0), PeerChoice::LeastConn(1));
    }

    #[test]
    fn ties_spread_evenly() {
        let loads = [l(0, 10), l(0, 10), l(0, 10)];
        let mut seen = [0u32; 3];
        let mut x = 0x1234_5678_9abc_def1u64;
        for _ in 0..3000 {
            x = mix64(x);
            seen[least_conn(&loads, x).index().unwrap()] += 1;
        }
        assert!(seen.iter().all(|&s| s > 800), "{seen:?}");
    }

    #[test]
    fn crc32_mod_matches_the_reference_function() {
        let loads = pool(3);
        for sid in ["a", "session-42", "conv-1", "ünïcode"] {
            let want = crc32fast::hash(sid.as_bytes()) as usize % 3;
            assert_eq!(
                select(
                    &loads,
                    Some(sid.as_bytes()),
                    Affinity::Crc32Mod,
                    Overflow::AtMax,
                    None,
                    7
                ),
                PeerChoice::Hash(want)
            );
        }
    }

    #[test]
    fn a_ban_moves_only_the_banned_peers_sessions() {
        for algo in [Affinity::Crc32Mod, Affinity::Rendezvous] {
            let mut loads = pool(4);
            let sids: Vec<String> = (0..400).map(|i| format!("s{i}")).collect();
            let before: Vec<usize> = sids
                .iter()
                .map(|s| {
                    select(&loads, Some(s.as_bytes()), algo, Overflow::AtMax, None, 1)
                        .index()
                        .unwrap()
                })
                .collect();
            loads[2].healthy = false;
            for (s, &b) in sids.iter().zip(&before) {
                let c = select(&loads, Some(s.as_bytes()), algo, Overflow::AtMax, None, 1);
                if b == 2 {
                    assert!(
                        matches!(c, PeerChoice::HashFallback(i) if i != 2),
                        "{algo:?}"
                    );
                } else {
                    assert_eq!(
                        c,
                        PeerChoice::Hash(b),
                        "{algo:?}: only banned peer's sessions move"
                    );
                }
            }
        }
    }

    #[test]
    fn rendezvous_moves_about_one_nth_when_a_peer_is_added() {
        let sids: Vec<String> = (0..4000).map(|i| format!("conversation-{i}")).collect();
        let four = pool(4);
        let five = pool(5);
        let moved = sids
            .iter()
            .filter(|s| {
                natural_target(&four, s.as_bytes(), Affinity::Rendezvous, None)
                    != natural_target(&five, s.as_bytes(), Affinity::Rendezvous, None)
            })
            .count();
        // Ideal 1/5 = 800; crc32 % n would move ~4/5.
        assert!((600..1000).contains(&moved), "moved {moved}");
        let moved_mod = sids
            .iter()
            .filter(|s| {
                natural_target(&four, s.as_bytes(), Affinity::Crc32Mod, None)
                    != natural_target(&five, s.as_bytes(), Affinity::Crc32Mod, None)
            })
            .count();
        assert!(
            moved_mod > 2500,
            "control: modulo hashing moves most sessions ({moved_mod})"
        );
        // And spreads evenly.
        let mut counts = [0; 5];
        for s in &sids {
            counts[natural_target(&five, s.as_bytes(), Affinity::Rendezvous, None).unwrap()] += 1;
        }
        assert!(
            counts.iter().all(|&c| (600..1000).contains(&c)),
            "{counts:?}"
        );
    }

    #[test]
    fn bounded_load_keeps_sessions_home_when_the_pool_is_evenly_busy() {
        let mut loads = pool(3);
        let sid = b"x";
        let t = natural_target(&loads, sid, Affinity::Crc32Mod, None).unwrap();
        // Everyone at max: bounded load stays home, at_max spills.
        for l in &mut loads {
            l.inflight = 10;
        }
        assert_eq!(
            select(
                &loads,
                Some(sid),
                Affinity::Crc32Mod,
                Overflow::BoundedLoad,
                None,
                1
            ),
            PeerChoice::Hash(t)
        );
        assert!(matches!(
            select(
                &loads,
                Some(sid),
                Affinity::Crc32Mod,
                Overflow::AtMax,
                None,
                1
            ),
            PeerChoice::HashFallback(_)
        ));
        // A hot spot: the pinned peer far above the others spills even under bounded load.
        for (i, l) in loads.iter_mut().enumerate() {
            l.inflight = if i == t { 20 } else { 2 };
        }
        assert!(
            matches!(select(&loads, Some(sid), Affinity::Crc32Mod, Overflow::BoundedLoad, None, 1), PeerChoice::HashFallback(i) if i != t)
        );
        // Banned is banned either way.
        loads[t].healthy = false;
        loads[t].inflight = 0;
        assert!(matches!(
            select(
                &loads,
                Some(sid),
                Affinity::Crc32Mod,
                Overflow::BoundedLoad,
                None,
                1
            ),
            PeerChoice::HashFallback(_)
        ));
    }

    #[test]
    fn bounded_load_allows_twice_the_share_up_to_one_and_a_half_times_the_max() {
        // 8 peers of max_concurrency 10.
        let mut loads = pool(8);
        let sid = b"x";
        let t = natural_target(&loads, sid, Affinity::Crc32Mod, None).unwrap();
        // With the others at `others`, the session's peer takes its `last`th request and
        // spills the one after.
        let mut edge = |others: i64, last: i64| {
            for l in &mut loads {
                l.inflight = others;
            }
            let mut pick = |inflight: i64| {
                loads[t].inflight = inflight;
                select(
                    &loads,
                    Some(sid),
                    Affinity::Crc32Mod,
                    Overflow::BoundedLoad,
                    None,
                    1,
                )
            };
            assert_eq!(pick(last - 1), PeerChoice::Hash(t), "others at {others}");
            assert!(
                matches!(pick(last), PeerChoice::HashFallback(i) if i != t),
                "others at {others}"
            );
        };
        // Below capacity, twice the share: its 12th request, 12 <= ceil(2 x 10 x 47 / 80)
        // = 12, stays; its 13th (48 / 80 -> 12) spills.
        edge(5, 12);
        // At capacity twice the share would allow 22; the cap is 15.
        edge(10, 15);
    }

    #[test]
    fn full_pinned_peer_falls_back() {
        let mut loads = pool(3);
        let sid = b"x";
        let t = natural_target(&loads, sid, Affinity::Crc32Mod, None).unwrap();
        loads[t].inflight = 10;
        let c = select(
            &loads,
            Some(sid),
            Affinity::Crc32Mod,
            Overflow::AtMax,
            None,
            3,
        );
        assert!(matches!(c, PeerChoice::HashFallback(i) if i != t));
        assert_eq!(c.mode(), "hash_fallback");
    }

    #[test]
    fn hash_is_over_the_active_tier_only() {
        let mut loads = pool(4);
        loads[2].priority = -1;
        loads[3].priority = -1;
        for i in 0..100 {
            let s = format!("s{i}");
            let c = select(
                &loads,
                Some(s.as_bytes()),
                Affinity::Crc32Mod,
                Overflow::AtMax,
                None,
                0,
            );
            assert_eq!(
                c,
                PeerChoice::Hash(crc32fast::hash(s.as_bytes()) as usize % 2)
            );
        }
        loads[0].healthy = false;
        loads[1].healthy = false;
        for i in 0..100 {
            let s = format!("s{i}");
            let c = select(
                &loads,
                Some(s.as_bytes()),
                Affinity::Crc32Mod,
                Overflow::AtMax,
                None,
                0,
            );
            assert_eq!(
                c,
                PeerChoice::Hash(2 + crc32fast::hash(s.as_bytes()) as usize % 2),
                "lower tier serves when the higher is down"
            );
        }
    }

    #[test]
    fn sticky_table_places_by_load_keeps_placements_and_replaces_banned_ones() {
        let sel = |loads: &[Load], placed, overflow| {
            select(loads, Some(b"s"), Affinity::Table, overflow, placed, 7)
        };
        let mut loads = vec![l(3, 10), l(1, 10), l(2, 10)];
        // New session: least connections, to be recorded by the caller.
        assert_eq!(sel(&loads, None, Overflow::AtMax), PeerChoice::LeastConn(1));
        // Placed: it stays, however loaded, while under its max.
        assert_eq!(sel(&loads, Some(0), Overflow::AtMax), PeerChoice::Hash(0));
        assert_eq!(
            natural_target(&loads, b"s", Affinity::Table, Some(2)),
            Some(2)
        );
        // At its max: a one-off fallback (not to be recorded), as for hashing.
        loads[0].inflight = 10;
        assert_eq!(
            sel(&loads, Some(0), Overflow::AtMax),
            PeerChoice::HashFallback(1)
        );
        // Under bounded_load it stays while the whole tier is busy too.
        loads[1].inflight = 8;
        loads[2].inflight = 9;
        assert_eq!(
            sel(&loads, Some(0), Overflow::BoundedLoad),
            PeerChoice::Hash(0)
        );
        loads[1].inflight = 1;
        loads[2].inflight = 2;
        // Banned: placed again.
        loads[0].inflight = 0;
        loads[0].healthy = false;
        assert_eq!(
            sel(&loads, Some(0), Overflow::AtMax),
            PeerChoice::LeastConn(1)
        );
        // A placement outside the active tier (or past the list) does not count.
        loads[0].healthy = true;
        loads[0].inflight = 3;
        loads[2].priority = -1;
        assert_eq!(
            sel(&loads, Some(2), Overflow::AtMax),
            PeerChoice::LeastConn(1)
        );
        assert_eq!(
            sel(&loads, Some(9), Overflow::AtMax),
            PeerChoice::LeastConn(1)
        );
        assert_eq!(natural_target(&loads, b"s", Affinity::Table, Some(2)), None);
        // No session id: plain least connections, nothing to record.
        assert_eq!(
            select(&loads, None, Affinity::Table, Overflow::AtMax, Some(0), 7),
            PeerChoice::LeastConn(1)
        );
        // The other algorithms ignore a placement.
        assert_eq!(
            natural_target(&loads, b"s", Affinity::Crc32Mod, Some(1)),
            natural_target(&loads, b"s", Affinity::Crc32Mod, None)
        );
    }

    #[test]
    fn fallback_order_is_least_loaded_first_then_one_per_lower_tier() {
        let mut loads = vec![l(5, 10), l(1, 10), l(3, 10), l(0, 10), l(0, 10), l(2, 10)];
        loads[3].healthy = false;
        loads[4].priority = -1;
        loads[5].priority = -2;
        assert_eq!(fallback_order(&loads, 0, false, 7), vec![1, 2]);
        assert_eq!(fallback_order(&loads, 0, true, 7), vec![1, 2, 4, 5]);
    }

    /// Equally loaded retry targets come in an order that varies with the draw, each first
    /// about as often; the least loaded still always comes first.
    #[test]
    fn fallback_ties_are_broken_at_random() {
        let loads = vec![l(0, 10), l(0, 10), l(0, 10), l(0, 10)];
        let mut first = [0u32; 4];
        for r in 0..4000u64 {
            let order = fallback_order(&loads, 0, false, mix64(r));
            assert_eq!(order.len(), 3);
            first[order[0]] += 1;
        }
        assert_eq!(first[0], 0);
        for n in &first[1..] {
            assert!((1100..1600).contains(n), "{first:?}");
        }
        let mut busy = loads.clone();
        busy[2].inflight = 5;
        busy[3].inflight = 1;
        for r in 0..100u64 {
            assert_eq!(fallback_order(&busy, 0, false, r), vec![1, 3, 2]);
        }
    }
}
