//! Endpoints the router answers itself: admin (`/healthz`, `/readyz`, `/_routes`) and the
//! per-route debug endpoints (`/<route>/_<name>`). Reads the snapshot and the segment;
//! writes only through the loopback-only toggles.

mod latency;
mod metrics;
mod route_opts;
mod toggles;

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{json, Map, Value};
use warmroute_shm::Segment;

use crate::cells::{self, Relaxed};
use crate::pipeline::admission;
use crate::pipeline::peer_select::{self, Affinity};
use crate::pipeline::session_id::{self, SidOptions};
use crate::snapshot::{PeerRt, PoolRt};

use crate::http::{status_reason, RequestHead};
use crate::pipeline::dispatch::Dispatch;
use crate::pipeline::error_response::ProxyError;
use crate::snapshot::{RouteRt, Snapshot};
use crate::worker::{PortKind, WorkerCtx};

/// A response the router produces itself.
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub headers: Vec<(&'static str, String)>,
}

impl Response {
    pub fn json(status: u16, v: &Value) -> Response {
        Response {
            status,
            content_type: "application/json",
            body: serde_json::to_vec(v).unwrap_or_default(),
            headers: Vec::new(),
        }
    }

    pub fn text(status: u16, s: &str) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: s.as_bytes().to_vec(),
            headers: Vec::new(),
        }
    }

    pub fn error(e: &ProxyError, route: Option<&str>) -> Response {
        let mut r = Response::json(e.status(), &e.body(route));
        r.headers = e
            .headers()
            .iter()
            .map(|(k, v)| (*k, v.to_string()))
            .collect();
        r
    }

    pub fn into_bytes(self, keep: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(128 + self.body.len());
        out.extend_from_slice(
            format!(
                "HTTP/1.1 {} {}\r\n",
                self.status,
                status_reason(self.status)
            )
            .as_bytes(),
        );
        crate::http::push_date_header(&mut out);
        out.extend_from_slice(
            format!(
                "Content-Type: {}\r\nContent-Length: {}\r\n",
                self.content_type,
                self.body.len()
            )
            .as_bytes(),
        );
        for (k, v) in &self.headers {
            crate::http::write_header(&mut out, k.as_bytes(), v.as_bytes());
        }
        if !keep {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&self.body);
        out
    }
}

/// Answer a request that is not proxied.
pub fn answer(
    ctx: &WorkerCtx,
    snap: &Snapshot,
    d: Dispatch<'_>,
    kind: PortKind,
    head: &RequestHead,
    body: &[u8],
    loopback: bool,
) -> Response {
    match d {
        Dispatch::Server { endpoint } => server_endpoint(ctx, snap, endpoint, kind, head),
        Dispatch::Debug { route, endpoint } => match snap.route(route) {
            Some(r) => route_endpoint(ctx, snap, r, endpoint, head, body, loopback),
            None => Response::error(&ProxyError::NotFound, Some(route)),
        },
        Dispatch::Proxy { route, .. } => Response::error(
            &ProxyError::BadParam("the admin port does not proxy; use the public port".into()),
            Some(route),
        ),
        Dispatch::Bare { .. } | Dispatch::UnknownRoute { .. } => Response::error(
            &ProxyError::UnknownRoute {
                known: snap.route_names().into_iter().map(String::from).collect(),
            },
            None,
        ),
    }
}

fn server_endpoint(
    ctx: &WorkerCtx,
    snap: &Snapshot,
    endpoint: &str,
    kind: PortKind,
    head: &RequestHead,
) -> Response {
    match (endpoint, kind) {
        ("/healthz", PortKind::Admin) => Response::text(200, "ok"),
        ("/readyz", PortKind::Admin) => {
            if ctx.shared.ready() {
                Response::text(200, "ready")
            } else {
                Response::text(503, "not ready")
            }
        }
        ("/_routes", PortKind::Admin) => Response::json(200, &routes_json(ctx, snap)),
        ("/metrics", PortKind::Admin) => metrics::response(ctx, snap),
        ("/v1/models", PortKind::Public) => {
            // Only the models of the routes the request's key opens.
            let Some(models) = snap.models_for(&head.headers) else {
                return Response::error(&ProxyError::Unauthorized, None);
            };
            let data: Vec<Value> = models
                .iter()
                .map(|(m, r)| json!({"id": m, "object": "model", "owned_by": r}))
                .collect();
            Response::json(200, &json!({"object": "list", "data": data}))
        }
        _ => Response::error(
            &ProxyError::UnknownRoute {
                known: snap.route_names().into_iter().map(String::from).collect(),
            },
            None,
        ),
    }
}

fn routes_json(ctx: &WorkerCtx, snap: &Snapshot) -> Value {
    let routes: Vec<Value> = snap
        .routes
        .iter()
        .map(|r| {
            json!({
                "name": r.name(),
                "file": r.cfg.file.display().to_string(),
                "models": r.cfg.models,
                "pools": r.pools.iter().map(|p| json!({
                    "model": p.model,
                    "peers": p.peers.iter().map(|peer| json!({
                        "name": peer.name,
                        "addr": peer.addr.to_string(),
                        "priority": peer.priority,
                        "max_concurrency": peer.max_concurrency,
                        "inflight": ctx.shared.seg.inflight(peer.slot),
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "routes": routes, "generation": snap.generation })
}

/// Toggles and resets answer only these peers: 127.0.0.1 and ::1 (SPEC §8). The socket's
/// own peer address decides; forwarding headers never count.
pub fn is_local_admin(addr: std::net::SocketAddr) -> bool {
    match addr.ip() {
        std::net::IpAddr::V4(v4) => v4 == std::net::Ipv4Addr::LOCALHOST,
        std::net::IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped() == Some(std::net::Ipv4Addr::LOCALHOST)
        }
    }
}

/// `a=b&c=d` with percent-decoding; repeated keys: first wins.
pub fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    let q = query?;
    q.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (percent_decode(k) == key).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn meta(ctx: &WorkerCtx, snap: &Snapshot, route: &RouteRt) -> Value {
    let kf = &snap.keys;
    let _ = ctx;
    json!({
        "api_keys_configured": !kf.table.is_empty(),
        "route_auth_enabled": !route.keys.is_empty(),
        "key_file_status": kf.status.as_str(),
        // The file reads empty or unreadable now, and the keys of its last good read are
        // still in force (so `api_keys_configured` stays true and auth stays on).
        "kept_previous_keys": kf.kept_previous,
    })
}

/// A pool's tiers and its concurrency limit. `limit` is the limit the gate applies now —
/// the adaptive one on an `adaptive_cc` route (SPEC §5.4), the same figure its 429 bodies
/// and `warmroute_pool_effective_limit` show — and `pool_limit` the healthy capacity of the
/// active tier, which is the static limit and the adaptive limit's ceiling.
fn tier_json(seg: &Segment, opts: &crate::config::RouteOpts, pool: &PoolRt, now: u64) -> Value {
    let loads = pool.loads(seg, now);
    let active = peer_select::active_tier(&loads);
    let fig = admission::figures(&loads, 1.0);
    let pool_limit = fig.map_or(0.0, |f| f.limit);
    let limit = crate::control::latency::concurrency_limit(opts, pool, seg, now / 1000, pool_limit);
    let mut by_priority: BTreeMap<i32, Vec<usize>> = BTreeMap::new();
    for (i, l) in loads.iter().enumerate() {
        by_priority.entry(l.priority).or_default().push(i);
    }
    let mut tiers = Map::new();
    for (prio, idxs) in by_priority.iter().rev() {
        let healthy = idxs.iter().filter(|&&i| loads[i].healthy).count();
        tiers.insert(
            prio.to_string(),
            json!({
                "priority": prio,
                "healthy": healthy,
                "banned": idxs.len() - healthy,
                "active": idxs.iter().filter(|&&i| loads[i].healthy).map(|&i| loads[i].inflight).sum::<i64>(),
                "max": idxs.iter().filter(|&&i| loads[i].healthy).map(|&i| loads[i].max_concurrency as u64).sum::<u64>(),
                "peers": idxs.iter().map(|&i| json!({
                    "name": pool.peers[i].name,
                    "peer": pool.peers[i].addr.to_string(),
                    "banned": !loads[i].healthy,
                    "active": loads[i].inflight,
                    "max": loads[i].max_concurrency,
                })).collect::<Vec<_>>(),
            }),
        );
    }
    json!({
        "active_level": active.unwrap_or(0),
        "limit": crate::pipeline::error_response::limit_json(limit),
        "pool_limit": crate::pipeline::error_response::limit_json(pool_limit),
        "adaptive_cc": opts.adaptive_cc,
        // Whether `limit` is the adaptive value now (`latency::adaptive_in_force`).
        "adaptive_cc_in_force": crate::control::latency::adaptive_in_force(opts, pool, seg),
        "inflight": loads.iter().map(|l| l.inflight).sum::<i64>(),
        "healthy_peers_in_level": fig.map_or(0, |f| f.healthy_peers),
        "by_priority": tiers,
    })
}

/// The route's rejection cells, in the order of `cells::status::REJECT_BASE`'s copies.
const REJECT_CELLS: [usize; 4] = [
    cells::route::REJECT_CONCURRENCY,
    cells::route::REJECT_TTFT,
    cells::route::REJECT_TPS,
    cells::route::REJECT_RULE,
];

/// Rejections by gate since the last `_429_status?reset=1`.
fn reject_counts(seg: &Segment, route: &RouteRt) -> Value {
    let c = |k: usize| {
        let now = seg.route_cell(route.slot, REJECT_CELLS[k]).load(Relaxed);
        let base = seg
            .route_cell(route.status_slot, cells::status::REJECT_BASE + k)
            .load(Relaxed);
        now.saturating_sub(base)
    };
    json!({
        "concurrency": c(0),
        "ttft": c(1),
        "tps": c(2),
        "rule": c(3),
    })
}

fn route_endpoint(
    ctx: &WorkerCtx,
    snap: &Snapshot,
    route: &RouteRt,
    endpoint: &str,
    head: &RequestHead,
    body: &[u8],
    loopback: bool,
) -> Response {
    let seg = &ctx.shared.seg;
    let now = warmroute_shm::now_ms();
    let q = head.query();
    match endpoint {
        "active_conns" => {
            let mut m = Map::new();
            for p in route.all_peers() {
                let v = seg.inflight(p.slot);
                // Keyed by address, as the reference's (notes-edges §4.1): an address
                // several model pools share is summed, whatever each pool names it.
                let e = m.entry(p.addr.to_string()).or_insert(json!(0));
                *e = json!(e.as_i64().unwrap_or(0) + v);
            }
            Response::json(200, &Value::Object(m))
        }
        "health_status" => {
            let mut m = Map::new();
            for p in route.all_peers() {
                let until = seg.banned_until_ms(p.slot);
                let cell = |i| seg.peer_cell(p.slot, i).load(Relaxed);
                let probe_at = cell(cells::peer::PROBE_AT_MS);
                // An address several model pools share is one entry, as in
                // `_active_conns`: its in-flight summed, banned when any pool's is; the
                // rest is the first pool's.
                if let Some(Value::Object(e)) = m.get_mut(&p.addr.to_string()) {
                    let active = e["active"].as_i64().unwrap_or(0) + seg.inflight(p.slot);
                    e.insert("active".into(), json!(active));
                    if until > now {
                        e.insert("banned".into(), json!(true));
                    }
                    continue;
                }
                m.insert(
                    p.addr.to_string(),
                    json!({
                        "name": p.name,
                        "active": seg.inflight(p.slot),
                        "banned": until > now,
                        "banned_for_s": until.saturating_sub(now) / 1000,
                        "bans": cell(cells::peer::BANS),
                        "unbans": cell(cells::peer::UNBANS),
                        "probes": cell(cells::peer::PROBES),
                        "ttft_ewma_ms": crate::measure::peer_ewma(seg, p.slot, crate::measure::PEER_TTFT, now / 1000, route.cfg.opts.ttft_ttl),
                        "tps_ewma": crate::measure::peer_ewma(seg, p.slot, crate::measure::PEER_TPS, now / 1000, route.cfg.opts.tps_ttl),
                        "last_probe": (probe_at > 0).then(|| json!({
                            "ago_ms": now.saturating_sub(probe_at),
                            "latency_ms": cell(cells::peer::PROBE_LATENCY_US) as f64 / 1000.0,
                            "result": match cell(cells::peer::PROBE_STATUS) { 0 => json!("connect_failed"), 1 => json!("timeout"), 2 => json!("broken"), 3 => json!("local_error"), s => json!(s) },
                        })),
                    }),
                );
            }
            m.insert("_meta".into(), meta(ctx, snap, route));
            if route.all_peers().next().is_none() {
                m.insert("error".into(), json!("no peers configured"));
                m.insert("route".into(), json!(route.name()));
                return Response::json(503, &Value::Object(m));
            }
            Response::json(200, &Value::Object(m))
        }
        "route_state" => {
            let mut v = Map::new();
            v.insert("route".into(), json!(route.name()));
            if route.by_model() {
                let pools: Map<String, Value> = route
                    .pools
                    .iter()
                    .map(|p| {
                        (
                            p.model.clone().unwrap_or_default(),
                            tier_json(seg, &route.cfg.opts, p, now),
                        )
                    })
                    .collect();
                v.insert("pools".into(), Value::Object(pools));
            } else if let Some(p) = route.pools.first() {
                if let Value::Object(t) = tier_json(seg, &route.cfg.opts, p, now) {
                    v.extend(t);
                }
            }
            let c = |i| seg.route_cell(route.slot, i).load(Relaxed);
            v.insert("requests".into(), json!(c(cells::route::REQUESTS)));
            v.insert("modes".into(), json!({"hash": c(cells::route::MODE_HASH), "hash_fallback": c(cells::route::MODE_HASH_FALLBACK), "least_conn": c(cells::route::MODE_LEAST_CONN)}));
            v.insert("retries".into(), json!(c(cells::route::RETRIES)));
            v.insert("rejected".into(), reject_counts(seg, route));
            v.insert(
                "unavailable_503".into(),
                json!(c(cells::route::UNAVAILABLE)),
            );
            v.insert(
                "unauthorized_401".into(),
                json!(c(cells::route::UNAUTHORIZED)),
            );
            v.insert(
                "model_not_supported_400".into(),
                json!(c(cells::route::MODEL_NOT_SUPPORTED)),
            );
            v.insert(
                "cache".into(),
                cache_json(
                    c(cells::route::PROMPT_TOKENS),
                    c(cells::route::CACHED_TOKENS),
                    c(cells::route::COMPLETION_TOKENS),
                    c(cells::route::USAGE_RESPONSES),
                ),
            );
            let peers: Map<String, Value> = route
                .all_peers()
                .map(|p| {
                    let pc = |i| seg.peer_cell(p.slot, i).load(Relaxed);
                    (
                        p.name.clone(),
                        cache_json(
                            pc(cells::peer::PROMPT_TOKENS),
                            pc(cells::peer::CACHED_TOKENS),
                            pc(cells::peer::COMPLETION_TOKENS),
                            pc(cells::peer::USAGE_RESPONSES),
                        ),
                    )
                })
                .collect();
            v.insert("cache_by_peer".into(), Value::Object(peers));
            let t = |i| seg.route_cell(route.slot, i).load(Relaxed);
            v.insert("transforms".into(), json!({
                "bodies_parsed": t(cells::route::BODIES_PARSED),
                "cch_stripped": t(cells::route::CCH_STRIPPED),
                "kimi_changes": t(cells::route::KIMI_CHANGES),
                "kimi_requests": t(cells::route::KIMI_REQUESTS),
                "usage_injected": t(cells::route::USAGE_INJECTED),
                "cch_strip": cells::toggle(seg, route.slot, cells::route::TOGGLE_CCH_STRIP, route.cfg.opts.cch_strip),
                "kimi_normalize": cells::toggle(seg, route.slot, cells::route::TOGGLE_KIMI_NORMALIZE, route.cfg.opts.kimi_normalize),
                "include_usage": cells::toggle(seg, route.slot, cells::route::TOGGLE_INCLUDE_USAGE, route.cfg.opts.include_usage),
            }));
            Response::json(200, &Value::Object(v))
        }
        "route_debug" => {
            let sid = query_param(q, "sid").unwrap_or_else(|| "default".into());
            let model = query_param(q, "model");
            let Some(pool) = route.pool_for(model.as_deref()) else {
                return Response::json(
                    200,
                    &json!({"route": route.name(), "error": "model_not_supported", "model": model, "supported_models": route.models_sorted}),
                );
            };
            let loads = pool.loads(seg, now);
            let algo = Affinity::from(route.cfg.opts.affinity_hash);
            let sid_bytes = session_id::hash_bytes(&sid);
            // A blank id is no id (SPEC §3.3): a request with it goes by least connections.
            let id = (!session_id::is_blank(&sid)).then_some(sid_bytes);
            // Read-only: a debug lookup shows a sticky_table placement but never makes one.
            let placed = id
                .and_then(|id| pool.placement(seg, algo, Some(id), now / 1000))
                .and_then(|(_, peer)| peer);
            let natural = id.and_then(|id| peer_select::natural_target(&loads, id, algo, placed));
            let pick = peer_select::select(
                &loads,
                id.filter(|_| route.cfg.opts.session_affinity),
                algo,
                peer_select::Overflow::from_name(&route.cfg.opts.affinity_overflow),
                placed,
                ctx.random(),
            );
            let sid_hash = peer_select::fnv1a64(sid_bytes);
            let tier = peer_select::active_tier(&loads);
            let scores: Vec<Value> = pool.peers.iter().enumerate().map(|(i, p)| json!({
                "idx": i,
                "name": p.name,
                "peer": p.addr.to_string(),
                "priority": p.priority,
                "in_active_tier": Some(p.priority) == tier,
                "banned": !loads[i].healthy,
                "active": loads[i].inflight,
                "max": loads[i].max_concurrency,
                "score": match algo {
                    Affinity::Rendezvous if id.is_some() => json!(peer_select::rendezvous_score(sid_hash, p.key_hash)),
                    Affinity::Rendezvous | Affinity::Crc32Mod | Affinity::Table => Value::Null,
                },
            })).collect();
            Response::json(
                200,
                &json!({
                    "route": route.name(),
                    "session_id": sid,
                    "model": model,
                    "algorithm": route.cfg.opts.affinity_hash.as_str(),
                    "crc32": id.map(crc32fast::hash),
                    "natural_target": natural.map(|i| pool.peers[i].name.clone()),
                    "natural_banned": natural.map(|i| !loads[i].healthy),
                    "actual_pick": pick.index().map(|i| pool.peers[i].name.clone()),
                    "actual_mode": pick.mode(),
                    "session_affinity_enabled": route.cfg.opts.session_affinity,
                    "scores": scores,
                }),
            )
        }
        "route_inspect" => {
            let fields = session_id::parse_body(body);
            let opts = SidOptions {
                session_affinity: route.cfg.opts.session_affinity,
                body_user_affinity: route.cfg.opts.body_user_affinity,
            };
            let (sid, source) = session_id::extract(&head.headers, fields.as_ref(), &opts);
            let model = fields.as_ref().and_then(|f| f.model.clone());
            let sid_json = sid.as_ref().map(|s| s.id.clone());
            let Some(pool) = route.pool_for(model.as_deref()) else {
                return Response::json(
                    200,
                    &json!({"route": route.name(), "session_id": sid_json, "source": source.label(), "error": "model_not_supported", "model": model, "supported_models": route.models_sorted}),
                );
            };
            let loads = pool.loads(seg, now);
            let sid_bytes = sid.as_ref().map(|s| session_id::hash_bytes(&s.id));
            let algo = Affinity::from(route.cfg.opts.affinity_hash);
            // A dry run: it reads a sticky_table placement but never records one.
            let placed = pool
                .placement(seg, algo, sid_bytes, now / 1000)
                .and_then(|(_, peer)| peer);
            let choice = peer_select::select(
                &loads,
                sid_bytes,
                algo,
                peer_select::Overflow::from_name(&route.cfg.opts.affinity_overflow),
                placed,
                ctx.random(),
            );
            let Some(i) = choice.index() else {
                return Response::error(&ProxyError::NoHealthyPeer, Some(route.name()));
            };
            let mut r = Response::json(
                200,
                &json!({
                    "route": route.name(),
                    "session_id": sid_json,
                    "source": source.label(),
                    "model": model,
                    "mode": choice.mode(),
                    "pick": pool.peers[i].name,
                    "peer": pool.peers[i].addr.to_string(),
                    "active_level": pool.peers[i].priority,
                }),
            );
            r.headers
                .push(("X-Routed-Active-Level", pool.peers[i].priority.to_string()));
            r
        }
        "429_status" => {
            let all = query_param(q, "all").as_deref() == Some("1");
            let scope: Vec<&Arc<RouteRt>> = if all {
                snap.routes.iter().collect()
            } else {
                snap.route(route.name()).into_iter().collect()
            };
            if query_param(q, "reset").as_deref() == Some("1") {
                if !loopback {
                    return Response::error(
                        &ProxyError::Forbidden("reset is allowed from loopback only"),
                        Some(route.name()),
                    );
                }
                // The view starts again from zero; the counters behind warmroute_rejected_total
                // keep counting (a Prometheus counter only grows).
                for r in &scope {
                    for (k, i) in REJECT_CELLS.into_iter().enumerate() {
                        let now = seg.route_cell(r.slot, i).load(Relaxed);
                        seg.route_cell(r.status_slot, cells::status::REJECT_BASE + k)
                            .store(now, Relaxed);
                    }
                }
                return Response::json(
                    200,
                    &json!({"reset": true, "scope": if all { "all" } else { route.name() }}),
                );
            }
            let mut by_route = Map::new();
            let mut totals = [0u64; 4];
            for r in &scope {
                let v = reject_counts(seg, r);
                for (t, k) in totals
                    .iter_mut()
                    .zip(["concurrency", "ttft", "tps", "rule"])
                {
                    *t += v[k].as_u64().unwrap_or(0);
                }
                by_route.insert(r.name().to_string(), v);
            }
            Response::json(
                200,
                &json!({
                    "scope": if all { "all" } else { route.name() },
                    "total": totals.iter().sum::<u64>(),
                    "by_reason": {"concurrency": totals[0], "ttft": totals[1], "tps": totals[2], "rule": totals[3]},
                    "by_route": by_route,
                    "rate_limit": scope.iter().map(|r| (r.name().to_string(), latency::rate_limit_status(ctx, r))).collect::<Map<String, Value>>(),
                    "worker_id": ctx.index,
                }),
            )
        }
        "route_opts" => Response::json(200, &route_opts::render(snap, route)),
        "bodylog_status" => {
            let opts = &route.cfg.opts;
            let pct = match seg
                .route_cell(route.slot, cells::route::BODYLOG_PCT)
                .load(Relaxed)
            {
                0 => opts.bodylog_pct as u64,
                p => p - 1,
            };
            let mut v = json!({
                "route": route.name(),
                "listener": snap.config.server.bodylog_listener,
                "enabled": ctx.bodylog_on() && cells::toggle(seg, route.slot, cells::route::TOGGLE_BODYLOG, opts.bodylog),
                "sample_pct": pct,
                "route_queued": seg.route_cell(route.slot, cells::route::BODYLOG_QUEUED).load(Relaxed),
                "route_dropped": seg.route_cell(route.slot, cells::route::BODYLOG_DROPPED).load(Relaxed),
                "worker_id": ctx.index,
                "worker_pid": std::process::id(),
                "now": warmroute_shm::now_ms(),
            });
            if let Some(sender) = &ctx.bodylog() {
                let st = sender.stats();
                v["logger_initted"] = json!(true);
                v["write_count"] = json!(st.written);
                v["drop_count"] = json!(st.dropped);
                v["encode_errs"] = json!(st.encode_errors);
                v["connected"] = json!(st.connected);
                v["queued_frames"] = json!(st.queued_frames);
                if st.last_write_ms > 0 {
                    v["last_log_ts"] = json!(st.last_write_ms);
                }
            }
            Response::json(200, &v)
        }
        "reject_rules_status" => {
            let opts = &route.cfg.opts;
            let rules: Vec<Value> = opts
                .reject_rules_compiled
                .rules
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let hits = route.rule_slots.get(i).copied().flatten().map_or(0, |s| seg.route_cell(s, cells::route::RULE_HITS).load(Relaxed));
                    json!({"name": r.name, "condition": r.source, "status": r.status.unwrap_or(opts.reject_rules_status), "message": r.message_or_default(), "hits": hits})
                })
                .collect();
            let stored = seg
                .route_cell(route.slot, cells::route::TOGGLE_REJECT_RULES)
                .load(Relaxed);
            Response::json(
                200,
                &json!({
                    "route": route.name(),
                    "enabled": cells::toggle(seg, route.slot, cells::route::TOGGLE_REJECT_RULES, opts.reject_rules_enabled),
                    "source": if stored == 0 { "route" } else { "runtime" },
                    "default_status": opts.reject_rules_status,
                    "rules": rules,
                    "total_hits": seg.route_cell(route.slot, cells::route::REJECT_RULE).load(Relaxed),
                }),
            )
        }
        "active_conns_set" => {
            if !loopback {
                return Response::error(
                    &ProxyError::Forbidden("allowed from loopback only"),
                    Some(route.name()),
                );
            }
            active_conns_set(ctx, route, q)
        }
        other => toggles::handle(ctx, route, other, q, loopback)
            .or_else(|| latency::handle(ctx, route, other, q, loopback))
            .unwrap_or_else(|| Response::error(&ProxyError::NotFound, Some(route.name()))),
    }
}

/// Token counts and the prefix-cache hit rate (cached / prompt tokens).
fn cache_json(ptok: u64, ctok: u64, completion: u64, responses: u64) -> Value {
    json!({
        "prompt_tokens": ptok,
        "cached_tokens": ctok,
        "completion_tokens": completion,
        "responses_with_usage": responses,
        "hit_rate": if ptok > 0 { ctok as f64 / ptok as f64 } else { 0.0 },
    })
}

/// Correct in-flight counts by hand. The segment lets a worker write only its own row, so
/// "set the total to N" writes this worker's row to N minus the other rows' sum. The peer's
/// in-flight epoch is bumped first, so the requests in flight now do not give their units
/// back when they end: the count stays N plus what starts after (it used to drift below N,
/// and a flush with requests in flight let the limit be exceeded until a restart).
///
/// Limits: a request that takes its unit in the few instructions between another worker's
/// epoch read and its add can be counted once too often or too few, until the next set.
/// The rows then offset each other (this worker's below zero, others' above), which holds
/// while they belong to one process; a takeover that overlaps a set, or a router from
/// before the epoch sharing the segment, can leave the sum off again until the next set.
fn active_conns_set(ctx: &WorkerCtx, route: &RouteRt, q: Option<&str>) -> Response {
    let seg = &ctx.shared.seg;
    let set_total = |slot, total: i64| {
        seg.peer_cell(slot, cells::peer::INFLIGHT_EPOCH)
            .fetch_add(1, Relaxed);
        let own = seg.inflight_of(ctx.wid, slot);
        let others = seg.inflight_sum(slot) - own;
        seg.inflight_set(ctx.wid, slot, total - others);
    };
    let bad = |msg: &str| {
        Response::json(
            400,
            &json!({"ok": false, "route": route.name(), "error": msg}),
        )
    };
    if query_param(q, "flush").as_deref() == Some("1") {
        for p in route.all_peers() {
            set_total(p.slot, 0);
        }
        return Response::json(
            200,
            &json!({"ok": true, "route": route.name(), "action": "flush_all"}),
        );
    }
    let Some(peer) = query_param(q, "peer") else {
        return bad("need peer=<host:port or name>&value=N | peer=...&delete=1 | flush=1");
    };
    let targets: Vec<&PeerRt> = route
        .all_peers()
        .filter(|p| p.addr.to_string() == peer || p.name == peer)
        .collect();
    if targets.is_empty() {
        return bad("no such peer on this route");
    }
    if query_param(q, "delete").as_deref() == Some("1") {
        for p in &targets {
            set_total(p.slot, 0);
        }
        return Response::json(
            200,
            &json!({"ok": true, "route": route.name(), "action": "delete", "peer": peer}),
        );
    }
    match query_param(q, "value").map(|v| v.parse::<i64>()) {
        Some(Ok(v)) if v >= 0 => {
            for p in &targets {
                set_total(p.slot, v);
            }
            Response::json(
                200,
                &json!({"ok": true, "route": route.name(), "action": "set", "peer": peer, "value": v}),
            )
        }
        Some(_) => bad("value must be a non-negative integer"),
        None => bad("need value=N or delete=1"),
    }
}
