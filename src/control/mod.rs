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
use std::time::Duration;

use crate::util::{race, Either};
use crate::worker::WorkerCtx;

/// How often each worker tries to take or renew the lease.
const LEASE_TICK: Duration = Duration::from_millis(500);
/// Lease lifetime: a dead holder is replaced within this plus one tick.
const LEASE_TTL_MS: u64 = 2_000;
/// How long a dead process's worker row must have gone without a heartbeat (live workers
/// beat every 50 ms) before the lease holder frees it.
const DEAD_ROW_QUIET_MS: u64 = 2_000;
/// A peer slot nobody has stamped as in use for this long, with nothing in flight, is
/// freed for reuse (peers that no reload, no draining router and no request uses any
/// more). Every worker of every process stamps its slots each second
/// (`worker::PEER_SLOT_STAMP`); the margin covers a startup between building the first
/// snapshot (which stamps it) and the workers' first stamp.
pub const PEER_SLOT_IDLE_MS: u64 = 10_000;
/// Nothing is freed while some worker row has gone this long without a heartbeat: a
/// stalled process stamps nothing either.
pub const PEER_SLOT_BEAT_MS: u64 = 2_000;
/// How often the lease holder looks for idle peer slots.
const PEER_SLOT_SWEEP_MS: u64 = 1_000;

/// The lease-holder loop, started on every worker.
pub async fn run(ctx: Rc<WorkerCtx>) {
    let holder = ((std::process::id() as u64) << 16) | (ctx.index as u64 + 1);
    let seg = ctx.shared.seg.clone();
    let mut next_round_ms: HashMap<String, u64> = HashMap::new();
    let mut held = false;
    let mut next_sweep_ms = 0;
    loop {
        if let Either::Right(()) = race(monoio::time::sleep(LEASE_TICK), ctx.drain.wait()).await {
            if held {
                seg.release_lease(holder);
            }
            return;
        }
        let now = warmroute_shm::now_ms();
        let has = seg.try_lease(holder, now, LEASE_TTL_MS);
        if has != held {
            tracing::info!(
                worker = ctx.index,
                leader = has,
                "control lease {}",
                if has { "acquired" } else { "lost" }
            );
            held = has;
            next_round_ms.clear();
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
        if now >= next_sweep_ms {
            next_sweep_ms = now + PEER_SLOT_SWEEP_MS;
            // Peers that reloads dropped would otherwise hold their slots for the life of
            // the segment, which takeovers keep, until reloads are refused for want of one.
            let freed = seg.free_idle_peer_slots(now, PEER_SLOT_IDLE_MS, PEER_SLOT_BEAT_MS);
            if freed > 0 {
                tracing::info!(
                    slots = freed,
                    "freed the segment slots of peers no longer used"
                );
            }
        }
        let snap = ctx.snapshot();
        let now_s = now / 1000;
        for route in &snap.routes {
            for pool in &route.pools {
                latency::tick(&route.cfg.opts, pool, &seg, now_s);
            }
            let due = next_round_ms.entry(route.name().to_string()).or_insert(0);
            if now >= *due {
                *due = now + route.cfg.opts.health_check_interval.max(1) * 1000;
                monoio::spawn(health::probe_route(ctx.clone(), route.clone()));
            }
        }
        next_round_ms.retain(|name, _| snap.route(name).is_some());
    }
}
