//! `warmroute status`: read a running router's shared segment and print it as a table,
//! without HTTP.

use std::fmt::Write;
use std::path::Path;

use warmroute_shm::{now_ms, pid_alive, Segment};

pub fn render(path: &Path) -> std::io::Result<String> {
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
    let (holder, expires) = seg.lease();
    if holder != 0 {
        let _ = writeln!(
            out,
            "\nlease holder {holder:#x}, expires in {} ms",
            expires.saturating_sub(now) as i64
        );
    }
    let _ = writeln!(
        out,
        "\n{:<60} {:>8} {:>12}",
        "PEER (route/pool/address)", "INFLIGHT", "BANNED_FOR_S"
    );
    let mut peers = seg.peer_keys();
    peers.sort_by(|a, b| a.1.cmp(&b.1));
    for (slot, key) in peers {
        let until = seg.banned_until_ms(slot);
        let banned = if until > now {
            format!("{}", (until - now) / 1000)
        } else {
            "-".into()
        };
        let _ = writeln!(out, "{:<60} {:>8} {:>12}", key, seg.inflight(slot), banned);
    }
    Ok(out)
}
