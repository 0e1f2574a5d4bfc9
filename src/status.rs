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
    let workers = seg.workers();
    let running = workers.iter().any(|(_, pid, _, _)| pid_alive(*pid));
    let _ = writeln!(out, "\nWORKER  PID       TAG  ALIVE  HEARTBEAT_AGE_MS");
    for (id, pid, tag, hb) in &workers {
        let _ = writeln!(
            out,
            "{:<7} {:<9} {:<4} {:<6} {}",
            id.0,
            pid,
            tag,
            if pid_alive(*pid) { "yes" } else { "no" },
            now.saturating_sub(*hb)
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
    // Segment key -> (peer name, max_concurrency) for the configured peers.
    let configured: Option<HashMap<String, (&str, u32)>> = config.map(|c| {
        c.routes
            .iter()
            .flat_map(|r| {
                r.pools.iter().flat_map(move |pool| {
                    pool.peers.iter().map(move |p| {
                        (
                            crate::snapshot::peer_key(&r.name, pool.model.as_deref(), p.addr),
                            (p.name.as_str(), p.max_concurrency),
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
        let ewma = |bits: usize, at: usize| {
            let v = f64::from_bits(
                seg.peer_cell(slot, bits)
                    .load(std::sync::atomic::Ordering::Relaxed),
            );
            let sampled = seg
                .peer_cell(slot, at)
                .load(std::sync::atomic::Ordering::Relaxed)
                != 0;
            if sampled && v.is_finite() {
                format!("{v:.1}")
            } else {
                "-".into()
            }
        };
        let (name, max) = match configured.as_ref().map(|m| m.get(&key)) {
            None => ("?".to_string(), "?".to_string()),
            Some(Some((n, m))) => (n.to_string(), m.to_string()),
            Some(None) => {
                stale += 1;
                ("(removed)".to_string(), "-".to_string())
            }
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
            ewma(peer::TTFT_EWMA_BITS, peer::TTFT_EWMA_AT_S),
            ewma(peer::TPS_EWMA_BITS, peer::TPS_EWMA_AT_S),
        );
    }
    if stale > 0 {
        let _ = writeln!(
            out,
            "{stale} row(s) marked (removed): no longer in the configuration (a reload dropped them); their slots are freed once no request or draining router uses them"
        );
    }
    Ok(Status { text: out, running })
}
