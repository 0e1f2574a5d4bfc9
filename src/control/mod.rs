//! What the lease holder runs. Every worker starts `run`; the one holding the lease in the
//! segment (renewed while it lives, taken over by another worker within a few seconds of
//! its death) probes the peers. Results go to the segment only.

pub mod aimd;
pub mod ewma;
pub mod health;
pub mod latency;
pub mod pool_state;
pub mod prio_state;
pub mod session_prio;

use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::util::{race, Either};
use crate::worker::WorkerCtx;

/// How often each worker tries to take or renew the lease.
const LEASE_TICK: Duration = Duration::from_millis(500);
/// Lease lifetime: a dead holder is replaced within this plus one tick.
const LEASE_TTL_MS: u64 = 2_000;
/// How long a dead process's worker row must have gone without a heartbeat (live workers
/// beat every 50 ms) before the lease holder frees it.
const DEAD_ROW_QUIET_MS: u64 = 2_000;
/// A peer or route slot nobody has stamped as in use for this long (a peer's also with
/// nothing in flight) is freed for reuse: the peers, routes, pools, rules and key owners
/// that no reload, no draining router and no request uses any more. Every worker of every
/// process stamps its slots each second (`worker::SLOT_STAMP`); the margin covers a
/// startup between building the first snapshot (which stamps it) and the workers' first
/// stamp.
pub const SLOT_IDLE_MS: u64 = 10_000;
/// Nothing is freed while some worker row has gone this long without a heartbeat: a
/// stalled process stamps nothing either.
pub const SLOT_BEAT_MS: u64 = 2_000;
/// How often the lease holder looks for idle slots.
const SLOT_SWEEP: Duration = Duration::from_secs(1);
/// A wall clock that moved this much more (or less) than the monotonic clock between two
/// ticks was stepped, and no slot is freed for `CLOCK_STEP_QUIET` after it.
const CLOCK_STEP_MS: i128 = 1_000;
const CLOCK_STEP_QUIET: Duration = Duration::from_secs(3);

/// Watches the wall clock against the monotonic one. Peer-slot stamps are wall-clock ms
/// (every process compares them), so a clock stepped forward would make every slot look
/// unused until the workers stamp again (each second) and the sweep could free slots live
/// configurations use. After a step, in either direction, no slot is freed until every
/// worker has stamped on the new clock.
struct ClockSteps {
    wall_ms: u64,
    mono: Instant,
    quiet_until: Instant,
}

impl ClockSteps {
    fn new(wall_ms: u64, mono: Instant) -> ClockSteps {
        ClockSteps {
            wall_ms,
            mono,
            quiet_until: mono,
        }
    }

    /// Whether slots may be freed at wall `wall_ms`, read at `mono`.
    fn steady(&mut self, wall_ms: u64, mono: Instant) -> bool {
        let elapsed = mono.saturating_duration_since(self.mono).as_millis() as i128;
        let moved = i128::from(wall_ms) - i128::from(self.wall_ms);
        if (moved - elapsed).abs() > CLOCK_STEP_MS {
            self.quiet_until = mono + CLOCK_STEP_QUIET;
        }
        self.wall_ms = wall_ms;
        self.mono = mono;
        mono >= self.quiet_until
    }
}

/// When each route's next health round is due. Monotonic time: these are this process's
/// own deadlines, and a wall clock stepped back (an NTP correction, a VM resumed from a
/// snapshot) must not postpone every probe by the size of the step.
#[derive(Default)]
struct Rounds {
    /// When each route's last round ran.
    last: HashMap<String, Instant>,
}

impl Rounds {
    /// Whether `route`'s round is due at `now` (its first one is): `every` after its last
    /// one, with the interval in force now, so a reload that shortens it applies at once
    /// (the next round used to wait out the old interval).
    fn due(&mut self, route: &str, now: Instant, every: Duration) -> bool {
        match self.last.get_mut(route) {
            Some(at) if now < *at + every => false,
            Some(at) => {
                *at = now;
                true
            }
            None => {
                self.last.insert(route.to_string(), now);
                true
            }
        }
    }
}

/// Routers sharing the segment (`--join`) that serve other routes or peers than the lease
/// holder: the holder probes, folds EWMAs and steps adaptive limits for its own routes
/// only, so routes that only the others serve would go without. Said once per new set of
/// differing digests that has lasted [`OTHER_ROUTES_MS`]: a change reaches the routers
/// some seconds apart (each watches the files every second, looks its peers' names up
/// every 10 s and publishes its digest every second); a draining router publishes none.
#[derive(Default)]
struct OtherRoutes {
    /// The differing digests seen, and since when.
    seen: Vec<u64>,
    since_ms: u64,
    said: Vec<u64>,
}

const OTHER_ROUTES_MS: u64 = 20_000;

impl OtherRoutes {
    fn check(&mut self, seg: &warmroute_shm::Segment, snap: &crate::snapshot::Snapshot, now: u64) {
        let mine = snap.routes_digest;
        let mut other: Vec<u64> = seg
            .beating_rows(now, crate::worker::BEATING_MS)
            .into_iter()
            .map(|(_, _, d)| d)
            .filter(|&d| d != 0 && d != mine)
            .collect();
        other.sort_unstable();
        other.dedup();
        if other != self.seen {
            self.seen = other;
            self.since_ms = now;
            return;
        }
        if other.is_empty() {
            self.said.clear();
        } else if other != self.said && now.saturating_sub(self.since_ms) >= OTHER_ROUTES_MS {
            tracing::warn!(
                routes = snap.routes.len(),
                other_route_sets = other.len(),
                "routers sharing this segment have served other routes or peers than this \
                 one for 20 s: health checks, EWMAs and adaptive limits run on the lease \
                 holder's routes only, so routes and peers that only the others serve go \
                 without; give every router on the segment the same route files, and reload \
                 them together"
            );
            self.said = other;
        }
    }
}

/// The lease-holder loop, started on every worker.
pub async fn run(ctx: Rc<WorkerCtx>) {
    let holder = ((std::process::id() as u64) << 16) | (ctx.index as u64 + 1);
    let seg = ctx.shared.seg.clone();
    let mut rounds = Rounds::default();
    let mut held = false;
    let mut next_sweep = Instant::now();
    let mut clock = ClockSteps::new(warmroute_shm::now_ms(), Instant::now());
    let mut strangers = OtherRoutes::default();
    loop {
        if let Either::Right(()) = race(monoio::time::sleep(LEASE_TICK), ctx.drain.wait()).await {
            if held {
                seg.release_lease(holder);
            }
            return;
        }
        let now = warmroute_shm::now_ms();
        let mono = Instant::now();
        let steady_clock = clock.steady(now, mono);
        let has = seg.try_lease(holder, now, LEASE_TTL_MS);
        if has != held {
            tracing::info!(
                worker = ctx.index,
                leader = has,
                "control lease {}",
                if has { "acquired" } else { "lost" }
            );
            held = has;
            rounds.last.clear();
        }
        if !has {
            continue;
        }
        // A process that died without freeing its rows (killed while it drained after a
        // takeover) would hold its in-flight counts against the pools' limits for good:
        // its rows are freed once it has been silent for DEAD_ROW_QUIET_MS (SPEC §11).
        let reclaimed = seg.reclaim_dead_quiet(now, DEAD_ROW_QUIET_MS);
        if reclaimed > 0 {
            tracing::warn!(
                rows = reclaimed,
                "reclaimed worker rows of a dead process, with their in-flight counts"
            );
        }
        if mono >= next_sweep {
            strangers.check(&seg, &ctx.snapshot(), now);
        }
        if steady_clock && mono >= next_sweep {
            next_sweep = mono + SLOT_SWEEP;
            // Peers and routes that reloads dropped would otherwise hold their slots for
            // the life of the segment, which takeovers keep, until reloads are refused for
            // want of one.
            let freed = seg.free_idle_peer_slots(now, SLOT_IDLE_MS, SLOT_BEAT_MS);
            if freed > 0 {
                tracing::info!(
                    slots = freed,
                    "freed the segment slots of peers no longer used"
                );
            }
            let freed = seg.free_idle_route_slots(now, SLOT_IDLE_MS, SLOT_BEAT_MS);
            if freed > 0 {
                tracing::info!(
                    slots = freed,
                    "freed the segment slots of routes, pools, rules and key owners no longer used"
                );
            }
        }
        let snap = ctx.snapshot();
        let now_s = now / 1000;
        for route in &snap.routes {
            for pool in &route.pools {
                latency::tick(&route.cfg.opts, pool, &seg, now_s);
            }
            let every = Duration::from_secs(route.cfg.opts.health_check_interval.max(1));
            if rounds.due(route.name(), mono, every) {
                monoio::spawn(health::probe_route(ctx.clone(), route.clone()));
            }
        }
        rounds.last.retain(|name, _| snap.route(name).is_some());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_rounds_are_due_by_the_monotonic_clock() {
        let t0 = Instant::now();
        let every = Duration::from_secs(5);
        let mut r = Rounds::default();
        // A route's first round is due at once, the next one `every` later.
        assert!(r.due("a", t0, every));
        assert!(!r.due("a", t0 + Duration::from_millis(4_999), every));
        assert!(r.due("a", t0 + every, every));
        assert!(!r.due("a", t0 + every + Duration::from_secs(1), every));
        // Each route keeps its own schedule.
        assert!(r.due("b", t0 + Duration::from_secs(6), every));
        assert!(r.due("a", t0 + Duration::from_secs(10), every));
        assert!(!r.due("b", t0 + Duration::from_secs(10), every));
        // A reload that shortens the interval applies at once: 60 s, then 1 s.
        let long = Duration::from_secs(60);
        assert!(r.due("c", t0, long));
        assert!(!r.due("c", t0 + Duration::from_secs(2), long));
        assert!(r.due("c", t0 + Duration::from_secs(2), Duration::from_secs(1)));
        assert!(!r.due(
            "c",
            t0 + Duration::from_millis(2_500),
            Duration::from_secs(1)
        ));
    }

    #[test]
    fn a_stepped_wall_clock_holds_the_peer_slot_sweep_for_a_while() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut c = ClockSteps::new(1_000_000, t0);
        // Ticks where both clocks move alike (within the step margin): steady.
        assert!(c.steady(1_000_500, at(500)));
        assert!(c.steady(1_001_400, at(1_000)));
        // The wall clock jumps 20 s ahead: held for CLOCK_STEP_QUIET of monotonic time.
        assert!(!c.steady(1_021_900, at(1_500)));
        assert!(!c.steady(1_022_400, at(2_000)));
        assert!(!c.steady(1_024_400, at(4_000)));
        assert!(c.steady(1_024_900, at(4_500)));
        // Stepped back: held too (stamps stay ahead of the clock, which is harmless, but a
        // later forward correction would not be).
        assert!(!c.steady(1_010_000, at(5_000)));
        assert!(c.steady(1_013_000, at(8_000)));
    }
}
