//! The request lifecycle, one phase per module, composed here only.
//!
//! `serve_client` runs a client connection: heads in, one `handle_request` per head.
//! `proxy` reads top to bottom: body → peer selection → forward (with retries on
//! connect failures and 502/503) → relay → account. Phase modules never import each
//! other; this file is the only one that knows the order.

mod client;
pub mod dispatch;
pub mod error_response;
pub mod forward;
pub mod peer_select;
pub mod relay;

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use monoio::io::{CancelableAsyncReadRent, Splitable};
use monoio::net::TcpStream;
use serde_json::json;
use warmroute_shm::{PeerSlot, Segment, WorkerId};

use crate::http::{
    is_hop_by_hop, status_reason, write_header, RequestHead, ResponseFraming, ResponseHead,
};
use crate::snapshot::{PeerRt, RouteRt, Snapshot};
use crate::worker::{PortKind, WorkerCtx};

use client::{ClientConn, ClientWatch, HeadRead};
use dispatch::Dispatch;
use error_response::{json_response, ProxyError};
use forward::{ExchangeError, Timeouts};
use peer_select::{Load, PeerChoice};
use relay::{RelayEnd, RelayPlan, RelayStats};

/// Largest body accepted on debug and admin endpoints.
const ENDPOINT_BODY_BYTES_MAX: u64 = 1024 * 1024;
/// Read timeout for each piece of a request body.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Bytes the client-watch read may take of a pipelined next request.
const WATCH_BUF_BYTES: usize = 1024;

/// Counts a connection as active for as long as it lives (drain waits for zero).
struct ConnCount(Rc<WorkerCtx>);
impl Drop for ConnCount {
    fn drop(&mut self) {
        self.0.active_conns.set(self.0.active_conns.get() - 1);
    }
}

/// One in-flight unit on a peer, released exactly once: on drop, whatever the path.
pub struct Inflight<'a> {
    seg: &'a Segment,
    wid: WorkerId,
    slot: PeerSlot,
}

impl<'a> Inflight<'a> {
    pub fn acquire(seg: &'a Segment, wid: WorkerId, slot: PeerSlot) -> Self {
        seg.inflight_add(wid, slot, 1);
        Inflight { seg, wid, slot }
    }
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        self.seg.inflight_add(self.wid, self.slot, -1);
    }
}

/// Serve one client connection until it closes, idles out, or the worker drains.
pub async fn serve_client(ctx: Rc<WorkerCtx>, stream: TcpStream, addr: SocketAddr, kind: PortKind) {
    ctx.active_conns.set(ctx.active_conns.get() + 1);
    let _count = ConnCount(ctx.clone());
    let (rd, wr) = stream.into_split();
    let mut conn = ClientConn {
        rd,
        wr,
        inbuf: Vec::new(),
        addr,
    };
    loop {
        let (idle, head_timeout) = {
            let snap = ctx.snapshot();
            let s = &snap.config.server;
            (
                Duration::from_millis(s.client_idle_timeout_ms),
                Duration::from_millis(s.client_head_timeout_ms),
            )
        };
        match conn.read_head(idle, head_timeout, &ctx.drain).await {
            HeadRead::Closed => return,
            HeadRead::Refuse(e) => {
                let resp = json_response(e.status(), &e.body(None), e.headers(), true);
                if conn.write_all_bytes(resp).await.is_ok() {
                    conn.linger_close().await;
                }
                return;
            }
            HeadRead::Head(head) => {
                let keep = handle_request(&ctx, &mut conn, head, kind).await;
                if !keep {
                    conn.linger_close().await;
                    return;
                }
                if ctx.drain.is_fired() {
                    return;
                }
            }
        }
    }
}

/// Handle one request; returns whether the connection may carry another.
async fn handle_request(
    ctx: &Rc<WorkerCtx>,
    conn: &mut ClientConn,
    head: RequestHead,
    kind: PortKind,
) -> bool {
    let snap = ctx.snapshot();
    let target = head.target().to_string();
    let d = dispatch::resolve(&target, |n| snap.route(n).is_some());
    match (kind, d) {
        (PortKind::Public, Dispatch::Proxy { route, target }) => {
            let route = snap
                .route(route)
                .expect("dispatch only names known routes")
                .clone();
            proxy(ctx, conn, head, &snap, route, target).await
        }
        (_, d) => {
            let body = match conn
                .read_body(&head, ENDPOINT_BODY_BYTES_MAX, BODY_READ_TIMEOUT)
                .await
            {
                Ok(b) => b,
                Err(e) => return refuse(conn, &e, None, false).await,
            };
            let loopback = conn.addr.ip().is_loopback();
            let resp = crate::admin::answer(ctx, &snap, d, kind, &head, &body, loopback);
            let keep = head.keep_alive && !ctx.drain.is_fired();
            let resp = resp.into_bytes(keep);
            conn.write_all_bytes(resp).await.is_ok() && keep
        }
    }
}

/// Answer with an error; returns whether the connection may continue.
async fn refuse(conn: &mut ClientConn, e: &ProxyError, route: Option<&str>, keep: bool) -> bool {
    if matches!(e, ProxyError::ClientGone) {
        return false;
    }
    let keep = keep && !e.closes();
    let resp = json_response(e.status(), &e.body(route), e.headers(), !keep);
    conn.write_all_bytes(resp).await.is_ok() && keep
}

/// How a request was routed, for headers and the access log.
struct Routed<'a> {
    peer: &'a PeerRt,
    mode: &'static str,
    retries: u32,
}

/// How the forwarding phase ended.
enum Phase<'a> {
    Failed(ProxyError, Option<Routed<'a>>),
    Relayed {
        status: u16,
        keep: bool,
        stats: RelayStats,
        routed: Routed<'a>,
    },
}

/// Proxy one request to the route's pool.
async fn proxy(
    ctx: &Rc<WorkerCtx>,
    conn: &mut ClientConn,
    head: RequestHead,
    snap: &Arc<Snapshot>,
    route: Arc<RouteRt>,
    target: String,
) -> bool {
    let started = Instant::now();
    let opts = &route.cfg.opts;
    let server = &snap.config.server;
    let keep_client = head.keep_alive;
    // 1. Body, refused before reading when it is too large.
    let max_body = opts.max_body_size.min(server.max_body_size_ceiling);
    let body = match conn.read_body(&head, max_body, BODY_READ_TIMEOUT).await {
        Ok(b) => b,
        Err(e) => return refuse(conn, &e, Some(route.name()), keep_client).await,
    };
    let body_read_at = Instant::now();
    let seg = &*ctx.shared.seg;
    let pool = &route.pools[0];
    let timeouts = Timeouts {
        connect: Duration::from_millis(opts.connect_timeout_ms),
        first_byte: Duration::from_millis(opts.first_byte_timeout_ms),
    };
    let head_request = head.method() == "HEAD";

    // 2. From here on a pending read watches the client: if it leaves, the upstream is
    //    closed at once. The block scopes the read's borrow of the connection.
    let (phase, pipelined) = {
        let canceller = monoio::io::Canceller::new();
        let watch_fut = conn
            .rd
            .cancelable_read(Vec::with_capacity(WATCH_BUF_BYTES), canceller.handle());
        let mut watch_fut = std::pin::pin!(watch_fut);
        let mut watch = ClientWatch::new(watch_fut.as_mut());

        // 3. Select, forward, retry on connect failures and 502/503 before anything was sent.
        let mut tried: Vec<usize> = Vec::new();
        let mut retries = 0u32;
        let max_tries = 1 + opts.max_more_tries as usize;
        let outcome = loop {
            let now_ms = warmroute_shm::now_ms();
            let loads: Vec<Load> = pool
                .peers
                .iter()
                .enumerate()
                .map(|(i, p)| Load {
                    inflight: seg.inflight(p.slot),
                    max_concurrency: p.max_concurrency,
                    healthy: !tried.contains(&i) && !seg.is_banned(p.slot, now_ms),
                })
                .collect();
            let idx = match peer_select::least_conn(&loads, ctx.random()) {
                PeerChoice::LeastConn(i) => i,
                PeerChoice::NoHealthyPeer => break Err((ProxyError::NoHealthyPeer, None)),
            };
            tried.push(idx);
            let peer = &pool.peers[idx];
            let inflight = Inflight::acquire(seg, ctx.wid, peer.slot);
            let up_head = forward::build_request_head(&head, &target, peer, conn.addr, body.len());
            let res = forward::exchange(
                &ctx.upstreams,
                peer,
                Bytes::from(up_head),
                body.clone(),
                head_request,
                &timeouts,
                &mut watch,
            )
            .await;
            let last = tried.len() >= max_tries;
            let fail = |e: ProxyError| {
                Err((
                    e,
                    Some(Routed {
                        peer,
                        mode: "least_conn",
                        retries,
                    }),
                ))
            };
            match res {
                Ok(ex) if matches!(ex.head.status, 502 | 503) && !last => {
                    retries += 1;
                    drop(inflight);
                }
                Ok(ex) => {
                    break Ok((
                        ex,
                        Routed {
                            peer,
                            mode: "least_conn",
                            retries,
                        },
                        inflight,
                    ))
                }
                Err(ExchangeError::ClientGone) => break fail(ProxyError::ClientGone),
                Err(e) if e.is_connect() && !last => {
                    tracing::warn!(route = route.name(), peer = %peer.name, error = ?e, "connect failed; trying another peer");
                    retries += 1;
                }
                Err(ExchangeError::ConnectTimeout) => {
                    break fail(ProxyError::ConnectTimeout {
                        peer: peer.name.clone(),
                    })
                }
                Err(ExchangeError::Connect(io)) => {
                    break fail(ProxyError::ConnectFailed {
                        peer: peer.name.clone(),
                        detail: io.to_string(),
                    })
                }
                Err(ExchangeError::Timeout) => {
                    break fail(ProxyError::UpstreamTimeout {
                        peer: peer.name.clone(),
                    })
                }
                Err(ExchangeError::Closed) => {
                    break fail(ProxyError::UpstreamClosed {
                        peer: peer.name.clone(),
                    })
                }
                Err(ExchangeError::Bad(d)) => {
                    break fail(ProxyError::BadUpstreamResponse {
                        peer: peer.name.clone(),
                        detail: d,
                    })
                }
            }
        };

        // 4. Relay the response.
        match outcome {
            Err((e, routed)) => (Phase::Failed(e, routed), watch.finish(canceller).await),
            Ok((mut ex, routed, inflight)) => {
                let dechunk =
                    head.minor_version == 0 && ex.head.framing == ResponseFraming::Chunked;
                let body_closes = ex.head.framing == ResponseFraming::UntilClose || dechunk;
                let keep = keep_client && !body_closes && !ctx.drain.is_fired();
                let mut out = std::mem::take(&mut ex.interim);
                client_head(&mut out, &ex.head, &head, &routed, keep, dechunk);
                let plan = RelayPlan {
                    framing: ex.head.framing,
                    dechunk,
                    idle_timeout: Duration::from_millis(opts.idle_timeout_ms),
                };
                let mut stats = RelayStats::default();
                let leftover = std::mem::take(&mut ex.leftover);
                let end = relay::relay(
                    &mut conn.wr,
                    &mut ex.stream,
                    out,
                    leftover,
                    &plan,
                    &mut watch,
                    &mut stats,
                )
                .await;
                drop(inflight);
                let keep = match end {
                    RelayEnd::Done { reusable } => {
                        if reusable && ex.head.reusable {
                            ctx.upstreams.borrow_mut().put(
                                routed.peer.addr,
                                ex.stream,
                                Instant::now(),
                            );
                        }
                        keep
                    }
                    RelayEnd::ClientGone => false,
                    RelayEnd::UpstreamError(why) => {
                        tracing::warn!(route = route.name(), peer = %routed.peer.name, why, "response truncated");
                        false
                    }
                };
                let phase = Phase::Relayed {
                    status: ex.head.status,
                    keep,
                    stats,
                    routed,
                };
                (phase, watch.finish(canceller).await)
            }
        }
    };
    if let Some(b) = pipelined {
        conn.inbuf.extend_from_slice(&b);
    }
    let (status, keep, stats, routed) = match phase {
        Phase::Failed(e, routed) => {
            let keep = refuse(
                conn,
                &e,
                Some(route.name()),
                keep_client && !ctx.drain.is_fired(),
            )
            .await;
            (e.status(), keep, RelayStats::default(), routed)
        }
        Phase::Relayed {
            status,
            keep,
            stats,
            routed,
        } => (status, keep, stats, Some(routed)),
    };
    access_log(
        ctx,
        &route,
        &head,
        status,
        routed.as_ref(),
        body.len(),
        &stats,
        body_read_at,
        started,
    );
    keep
}

/// The response head for the client: the peer's status and end-to-end headers, the
/// routing headers, and our own connection handling.
fn client_head(
    out: &mut Vec<u8>,
    up: &ResponseHead,
    req: &RequestHead,
    routed: &Routed<'_>,
    keep: bool,
    dechunk: bool,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(up.status.to_string().as_bytes());
    out.push(b' ');
    let reason = up.reason();
    out.extend_from_slice(
        if reason.is_empty() {
            status_reason(up.status)
        } else {
            reason
        }
        .as_bytes(),
    );
    out.extend_from_slice(b"\r\n");
    for (name, value) in up.headers.iter() {
        if is_hop_by_hop(name) || up.headers.has_token("connection", name) {
            continue;
        }
        if dechunk && name.eq_ignore_ascii_case("transfer-encoding") {
            continue;
        }
        write_header(out, name, value);
    }
    write_header(out, "X-Routed-Session", b"-");
    write_header(out, "X-Routed-Source", b"none");
    write_header(out, "X-Routed-Mode", routed.mode.as_bytes());
    write_header(out, "X-Routed-Peer", routed.peer.name.as_bytes());
    write_header(
        out,
        "X-Routed-Retries",
        routed.retries.to_string().as_bytes(),
    );
    if !keep {
        out.extend_from_slice(b"Connection: close\r\n");
    } else if req.minor_version == 0 {
        out.extend_from_slice(b"Connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[allow(clippy::too_many_arguments)]
fn access_log(
    ctx: &WorkerCtx,
    route: &RouteRt,
    head: &RequestHead,
    status: u16,
    routed: Option<&Routed<'_>>,
    req_bytes: usize,
    stats: &RelayStats,
    body_read_at: Instant,
    started: Instant,
) {
    let mut log = ctx.access_log.borrow_mut();
    if !log.enabled() {
        return;
    }
    let ttft_ms = stats
        .first_body_at
        .map(|t| t.duration_since(body_read_at).as_secs_f64() * 1000.0);
    log.line(&json!({
        "ts": warmroute_shm::now_ms() as f64 / 1000.0,
        "route": route.name(),
        "method": head.method(),
        "path": head.path(),
        "status": status,
        "session": "-",
        "source": "none",
        "mode": routed.map(|r| r.mode),
        "peer": routed.map(|r| r.peer.name.as_str()),
        "retries": routed.map_or(0, |r| r.retries),
        "request_bytes": req_bytes,
        "response_bytes": stats.body_bytes,
        "ttft_ms": ttft_ms,
        "total_ms": started.elapsed().as_secs_f64() * 1000.0,
        "worker": ctx.index,
    }));
}
