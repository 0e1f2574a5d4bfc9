//! Active health checks: `GET <probe path>` to every peer of a route.
//!
//! 2xx → healthy (unban). 429 or a timeout → alive but busy: no change. Refused, reset,
//! a connect that does not complete within the route's `connect_timeout_ms` (a host that is
//! down drops the SYN), a broken answer or any other status → banned for `health_ban_ttl`
//! (refreshed while it keeps failing). A connect that fails on this host (out of file
//! descriptors or local ports) says nothing of the peer: no change. Writes bans,
//! transitions and probe figures to the segment.

use std::io;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

use crate::cells::{peer, Relaxed};
use crate::snapshot::{PeerRt, RouteRt};
use crate::worker::WorkerCtx;

/// What one probe saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeOutcome {
    Status(u16),
    Timeout,
    ConnectFailed,
    Broken,
    /// The connect failed on this host: [`local_connect_error`].
    LocalError,
}

/// Whether a failed connect is this host's failure rather than the peer's: out of file
/// descriptors, memory or buffers. Neither a probe nor a proxied request bans a peer for
/// one (every peer would be banned by a brief descriptor spike). `EADDRNOTAVAIL` is not
/// among them: it also means a peer address this host cannot use at all.
pub fn local_connect_error(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// What a probe outcome means for the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthVerdict {
    Healthy,
    Busy,
    Failed,
}

/// The rule, pure.
pub fn verdict(o: ProbeOutcome) -> HealthVerdict {
    match o {
        ProbeOutcome::Status(s) if (200..300).contains(&s) => HealthVerdict::Healthy,
        ProbeOutcome::Status(429) | ProbeOutcome::Timeout | ProbeOutcome::LocalError => {
            HealthVerdict::Busy
        }
        _ => HealthVerdict::Failed,
    }
}

/// Probe every peer of a route concurrently and apply the verdicts.
pub async fn probe_route(ctx: Rc<WorkerCtx>, route: Arc<RouteRt>) {
    let opts = &route.cfg.opts;
    let timeout = Duration::from_millis((opts.health_check_interval * 1000).clamp(500, 10_000));
    let mut tasks = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (pi, pool) in route.pools.iter().enumerate() {
        for (i, p) in pool.peers.iter().enumerate() {
            if !seen.insert(p.slot) {
                continue;
            }
            let (ctx, route) = (ctx.clone(), route.clone());
            tasks.push(monoio::spawn(async move {
                let peer = &route.pools[pi].peers[i];
                let path = peer
                    .probe
                    .as_deref()
                    .unwrap_or(&route.cfg.opts.health_probe_path);
                // A peer that wants the router's key for its API (vLLM's --api-key) wants it
                // for /v1/models, the default probe, too.
                let key = route.cfg.opts.upstream_api_key.as_deref();
                let t0 = Instant::now();
                let connect_timeout = Duration::from_millis(route.cfg.opts.connect_timeout_ms);
                let outcome = probe(peer, path, key, connect_timeout, timeout).await;
                apply(&ctx, &route, peer, outcome, t0.elapsed());
            }));
        }
    }
    for t in tasks {
        t.await;
    }
}

/// Send one probe, with `Authorization: Bearer <key>` when the route has an
/// `upstream_api_key`. The connect has `connect_timeout` (as a proxied request's has) and
/// the whole probe `timeout`: a peer that accepts and is slow to answer is busy, one that
/// never accepts is down.
pub async fn probe(
    peer: &PeerRt,
    path: &str,
    key: Option<&str>,
    connect_timeout: Duration,
    timeout: Duration,
) -> ProbeOutcome {
    // The connect on its own clock (a connect that never completes is a failure, never
    // "busy"), then the rest of the probe in what is left of `timeout`.
    let t0 = Instant::now();
    let connect = TcpStream::connect_addr(peer.addr);
    let s = match monoio::time::timeout(connect_timeout.min(timeout), connect).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) if local_connect_error(&e) => {
            // Once per peer and round while descriptors are short; the accept loop's
            // warning says so for the whole process.
            tracing::debug!(peer = %peer.name, addr = %peer.addr, error = %e, "health probe could not open a connection on this host; the peer's state is left as it was");
            return ProbeOutcome::LocalError;
        }
        Ok(Err(_)) | Err(_) => return ProbeOutcome::ConnectFailed,
    };
    let rest = timeout.saturating_sub(t0.elapsed());
    match monoio::time::timeout(rest, probe_inner(s, peer, path, key)).await {
        Err(_) => ProbeOutcome::Timeout,
        Ok(Ok(o)) => o,
        Ok(Err(_)) => ProbeOutcome::Broken,
    }
}

async fn probe_inner(
    mut s: TcpStream,
    peer: &PeerRt,
    path: &str,
    key: Option<&str>,
) -> io::Result<ProbeOutcome> {
    let _ = s.set_nodelay(true);
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let req = format!("GET {path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: warmroute-health\r\n{auth}Connection: close\r\n\r\n", peer.host_header);
    let (r, _) = s.write_all(req.into_bytes()).await;
    r?;
    let mut head = Vec::with_capacity(256);
    loop {
        let buf = Vec::with_capacity(512);
        let (r, buf) = s.read(buf).await;
        let n = r?;
        if n == 0 {
            return Ok(ProbeOutcome::Broken);
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = head.windows(2).position(|w| w == b"\r\n") {
            let line = &head[..end];
            let status = std::str::from_utf8(line)
                .ok()
                .filter(|l| l.starts_with("HTTP/1."))
                .and_then(|l| l.split(' ').nth(1))
                .and_then(|c| c.parse::<u16>().ok());
            return Ok(status.map_or(ProbeOutcome::Broken, ProbeOutcome::Status));
        }
        if head.len() > 4096 {
            return Ok(ProbeOutcome::Broken);
        }
    }
}

fn apply(ctx: &WorkerCtx, route: &RouteRt, p: &PeerRt, outcome: ProbeOutcome, took: Duration) {
    let seg = &ctx.shared.seg;
    let now = warmroute_shm::now_ms();
    seg.peer_cell(p.slot, peer::PROBES).fetch_add(1, Relaxed);
    seg.peer_cell(p.slot, peer::PROBE_AT_MS).store(now, Relaxed);
    seg.peer_cell(p.slot, peer::PROBE_LATENCY_US)
        .store(took.as_micros() as u64, Relaxed);
    let code = match outcome {
        ProbeOutcome::Status(s) => s as u64,
        ProbeOutcome::ConnectFailed => 0,
        ProbeOutcome::Timeout => 1,
        ProbeOutcome::Broken => 2,
        ProbeOutcome::LocalError => 3,
    };
    seg.peer_cell(p.slot, peer::PROBE_STATUS)
        .store(code, Relaxed);
    let was_banned = seg.is_banned(p.slot, now);
    match verdict(outcome) {
        HealthVerdict::Healthy => {
            if seg.banned_until_ms(p.slot) != 0 {
                seg.unban(p.slot);
                if was_banned {
                    seg.peer_cell(p.slot, peer::UNBANS).fetch_add(1, Relaxed);
                    tracing::info!(route = route.name(), peer = %p.name, addr = %p.addr, "peer recovered");
                }
            }
        }
        HealthVerdict::Busy => {}
        HealthVerdict::Failed => {
            if seg.ban_from(p.slot, now, now + route.cfg.opts.health_ban_ttl * 1000) {
                seg.peer_cell(p.slot, peer::BANS).fetch_add(1, Relaxed);
                tracing::warn!(route = route.name(), peer = %p.name, addr = %p.addr, ?outcome, "peer banned by health check");
            }
        }
    }
}

/// Ban a peer now because proxying could not connect to it.
pub fn ban_on_connect_failure(ctx: &WorkerCtx, route: &RouteRt, p: &PeerRt) {
    let seg = &ctx.shared.seg;
    let now = warmroute_shm::now_ms();
    if seg.ban_from(p.slot, now, now + route.cfg.opts.health_ban_ttl * 1000) {
        seg.peer_cell(p.slot, peer::BANS).fetch_add(1, Relaxed);
        tracing::warn!(route = route.name(), peer = %p.name, addr = %p.addr, "peer banned: connect failed while proxying");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        assert_eq!(verdict(ProbeOutcome::Status(200)), HealthVerdict::Healthy);
        assert_eq!(verdict(ProbeOutcome::Status(204)), HealthVerdict::Healthy);
        assert_eq!(verdict(ProbeOutcome::Status(429)), HealthVerdict::Busy);
        assert_eq!(verdict(ProbeOutcome::Timeout), HealthVerdict::Busy);
        assert_eq!(verdict(ProbeOutcome::LocalError), HealthVerdict::Busy);
        assert_eq!(verdict(ProbeOutcome::Status(500)), HealthVerdict::Failed);
        assert_eq!(verdict(ProbeOutcome::Status(404)), HealthVerdict::Failed);
        assert_eq!(verdict(ProbeOutcome::ConnectFailed), HealthVerdict::Failed);
        assert_eq!(verdict(ProbeOutcome::Broken), HealthVerdict::Failed);
    }
}
