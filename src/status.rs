//! `warmroute status`: read a running router's shared segment and print it as a table,
//! without HTTP.

use std::collections::HashMap;
use std::fmt::Write;
use std::path::Path;

use warmroute_shm::{now_ms, pid_alive, Segment};

use crate::cells::peer;
use crate::config::Config;

/// What `render` found: the table, and whether any live process owns a worker row.
pub struct Status {
    pub text: String,
    pub running: bool,
}

/// The table of a segment. With `config` (the files the router was started from), each
/// peer row gets its name and `max_concurrency`, and rows the configuration no longer
/// has (routes or peers removed by a reload) are marked, as their counts stay in the
/// segment.
/// The EWMA lifetimes shown without a configuration: the `ttft_ttl` and `tps_ttl` defaults.
const DEFAULT_EWMA_TTLS: [u64; 2] = [
    crate::control::ewma::DEFAULT_TTL_S,
    crate::control::ewma::DEFAULT_TTL_S,
];

pub fn render(path: &Path, config: Option<&Config>) -> std::io::Result<Status> {
    let seg = Segment::open_existing(path)?;
    let now = now_ms();
    let mut out = String::new();
    let caps = seg.caps();
    let _ = writeln!(
        out,
        "segment {} (workers {}, peers {}, routes {})",
        path.display(),
        caps.workers,
        caps.peers,
        caps.routes
    );
    // One read of the rows. Each row's core and the digest of its process's routes and
    // peers: joined routers that serve other routes show another digest; a draining
    // router, and a router from before these fields, show "-".
    let workers = seg.worker_infos();
    let running = workers.iter().any(|w| pid_alive(w.pid));
    let _ = writeln!(
        out,
        "\nWORKER  PID       TAG  ALIVE  HEARTBEAT_AGE_MS  CORE  ROUTES"
    );
    for w in &workers {
        let _ = writeln!(
            out,
            "{:<7} {:<9} {:<4} {:<6} {:<17} {:<5} {}",
            w.id.0,
            w.pid,
            w.tag,
            if pid_alive(w.pid) { "yes" } else { "no" },
            now.saturating_sub(w.heartbeat_ms),
            w.core.map_or_else(|| "-".to_string(), |c| c.to_string()),
            if w.routes_digest == 0 {
                "-".to_string()
            } else {
                format!("{:016x}", w.routes_digest)
            }
        );
    }
    if !running {
        let _ = writeln!(
            out,
            "no running router owns this segment: the figures below are what the last one left"
        );
    }
    let (holder, expires) = seg.lease();
    if holder != 0 && running {
        let _ = writeln!(
            out,
            "\nlease holder {holder:#x}, expires in {} ms",
            expires.saturating_sub(now) as i64
        );
    }
    // Segment key -> (peer name, max_concurrency, its route's ttft_ttl and tps_ttl) for the
    // configured peers.
    type Configured<'c> = (&'c str, u32, [u64; 2]);
    let configured: Option<HashMap<String, Configured>> = config.map(|c| {
        c.routes
            .iter()
            .flat_map(|r| {
                r.pools.iter().flat_map(move |pool| {
                    pool.peers.iter().map(move |p| {
                        (
                            crate::snapshot::peer_key(&r.name, pool.model.as_deref(), p.addr),
                            (
                                p.name.as_str(),
                                p.max_concurrency,
                                [r.opts.ttft_ttl, r.opts.tps_ttl],
                            ),
                        )
                    })
                })
            })
            .collect()
    });
    let _ = writeln!(
        out,
        "\n{:<60} {:<16} {:>8} {:>6} {:>12} {:>6} {:>12} {:>10}",
        "PEER (route/pool/address)",
        "NAME",
        "INFLIGHT",
        "MAX",
        "BANNED_FOR_S",
        "BANS",
        "TTFT_EWMA_MS",
        "TOKENS_S"
    );
    let mut peers = seg.peer_keys();
    peers.sort_by(|a, b| a.1.cmp(&b.1));
    let mut stale = 0;
    for (slot, key) in peers {
        let until = seg.banned_until_ms(slot);
        let banned = if until > now {
            format!("{}", (until - now) / 1000)
        } else {
            "-".into()
        };
        let (name, max, ttls) = match configured.as_ref().map(|m| m.get(&key)) {
            None => ("?".to_string(), "?".to_string(), DEFAULT_EWMA_TTLS),
            Some(Some((n, m, ttls))) => (n.to_string(), m.to_string(), *ttls),
            Some(None) => {
                stale += 1;
                ("(removed)".to_string(), "-".to_string(), DEFAULT_EWMA_TTLS)
            }
        };
        // An EWMA older than its route's TTL is shown as none, as `_health_status` does.
        let ewma = |cells: (usize, usize), ttl_s: u64| {
            shown_ewma(crate::measure::peer_ewma(
                &seg,
                slot,
                cells,
                now / 1000,
                ttl_s,
            ))
        };
        let bans = seg
            .peer_cell(slot, peer::BANS)
            .load(std::sync::atomic::Ordering::Relaxed);
        let _ = writeln!(
            out,
            "{:<60} {:<16} {:>8} {:>6} {:>12} {:>6} {:>12} {:>10}",
            key,
            name,
            seg.inflight(slot),
            max,
            banned,
            bans,
            ewma(crate::measure::PEER_TTFT, ttls[0]),
            ewma(crate::measure::PEER_TPS, ttls[1]),
        );
    }
    if stale > 0 {
        let _ = writeln!(
            out,
            "{stale} row(s) marked (removed): no longer in the configuration (a reload dropped them); their slots are freed once no request or draining router uses them"
        );
    }
    match config {
        Some(c) => pools(&mut out, &seg, c, now),
        None => {
            let _ = writeln!(
                out,
                "\npools: give --config for each pool's limits and EWMAs (the segment does not name them)"
            );
        }
    }
    Ok(Status { text: out, running })
}

/// The pool table: what the gates compare (SPEC §5.1, §5.2, §5.4) — the pool's in-flight
/// count, its healthy capacity, the limit the concurrency gate applies (the adaptive one
/// when adaptive concurrency is in force) and the pool EWMAs the TTFT and decode-rate
/// gates read. Pools the segment has no state for (not loaded yet) are left out.
fn pools(out: &mut String, seg: &Segment, config: &Config, now_ms: u64) {
    use crate::control::latency::{self, Signal};
    let _ = writeln!(
        out,
        "\n{:<40} {:>8} {:>9} {:>7} {:>9} {:>12} {:>10}",
        "POOL (route/model)",
        "INFLIGHT",
        "CAPACITY",
        "LIMIT",
        "ADAPTIVE",
        "TTFT_EWMA_MS",
        "TOKENS_S"
    );
    let now_s = now_ms / 1000;
    for r in &config.routes {
        for pool in &r.pools {
            let Some(rt) = crate::snapshot::PoolRt::find(seg, &r.name, pool) else {
                continue;
            };
            let name = match &pool.model {
                Some(m) => format!("{}/{m}", r.name),
                None => r.name.clone(),
            };
            let loads = rt.loads(seg, now_ms);
            let capacity = crate::pipeline::admission::healthy_capacity(&loads);
            let limit = latency::concurrency_limit(&r.opts, &rt, seg, now_s, capacity);
            let adaptive = latency::adaptive_in_force(&r.opts, &rt, seg);
            let _ = writeln!(
                out,
                "{:<40} {:>8} {:>9} {:>7} {:>9} {:>12} {:>10}",
                name,
                latency::pool_inflight(&rt, seg),
                capacity,
                limit,
                if adaptive { "yes" } else { "no" },
                shown_ewma(latency::current_ewma(
                    &r.opts,
                    Signal::Ttft,
                    &rt,
                    seg,
                    now_s
                )),
                shown_ewma(latency::current_ewma(&r.opts, Signal::Tps, &rt, seg, now_s)),
            );
        }
    }
}

/// An EWMA as the tables show it: one decimal, `-` when there is none (or expired).
fn shown_ewma(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.1}"),
        _ => "-".into(),
    }
}
