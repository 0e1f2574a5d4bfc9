//! Endpoints the router answers itself: admin (`/healthz`, `/readyz`, `/_routes`) and the
//! per-route debug endpoints (`/<route>/_<name>`). Reads the snapshot and the segment;
//! writes only through the loopback-only toggles.

use serde_json::{json, Map, Value};

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
        out.extend_from_slice(
            format!(
                "Content-Type: {}\r\nContent-Length: {}\r\n",
                self.content_type,
                self.body.len()
            )
            .as_bytes(),
        );
        for (k, v) in &self.headers {
            crate::http::write_header(&mut out, k, v.as_bytes());
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
    _body: &[u8],
    loopback: bool,
) -> Response {
    match d {
        Dispatch::Server { endpoint } => server_endpoint(ctx, snap, endpoint, kind),
        Dispatch::Debug { route, endpoint } => match snap.route(route) {
            Some(r) => route_endpoint(ctx, r, endpoint, head, loopback),
            None => Response::error(&ProxyError::NotFound, Some(route)),
        },
        Dispatch::Proxy { route, .. } => Response::error(
            &ProxyError::BadParam("the admin port does not proxy; use the public port".into()),
            Some(route),
        ),
        Dispatch::UnknownRoute { .. } => Response::error(
            &ProxyError::UnknownRoute {
                known: snap.route_names().into_iter().map(String::from).collect(),
            },
            None,
        ),
    }
}

fn server_endpoint(ctx: &WorkerCtx, snap: &Snapshot, endpoint: &str, kind: PortKind) -> Response {
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

fn route_endpoint(
    ctx: &WorkerCtx,
    route: &RouteRt,
    endpoint: &str,
    _head: &RequestHead,
    _loopback: bool,
) -> Response {
    let seg = &ctx.shared.seg;
    match endpoint {
        "active_conns" => {
            let mut m = Map::new();
            for p in route.all_peers() {
                let v = seg.inflight(p.slot);
                // Peers shared by several model pools are summed under one name.
                let e = m.entry(p.name.clone()).or_insert(json!(0));
                *e = json!(e.as_i64().unwrap_or(0) + v);
            }
            Response::json(200, &Value::Object(m))
        }
        _ => Response::error(&ProxyError::NotFound, Some(route.name())),
    }
}
