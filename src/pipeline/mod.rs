//! The request lifecycle, one phase per module, composed here only.
//!
//! `serve_client` runs a client connection: heads in, one `handle_request` per head.
//! `proxy` reads top to bottom: route, key and body → local answers → pool → session id
//! → 503 and 429 gates → peer selection → forward (with retries on connect failures and
//! 502/503) → relay → account. Phase modules never import each
//! other; this file is the only one that knows the order.

pub mod admission;
mod body_scan;
mod client;
pub mod dispatch;
pub mod error_response;
pub mod forward;
pub mod peer_select;
pub mod relay;
pub mod session_id;

use std::borrow::Cow;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use monoio::io::Splitable;
use monoio::net::TcpStream;
use serde_json::json;
use warmroute_shm::{PeerSlot, Segment, WorkerId};

use crate::auth::{self, AuthDecision};
use crate::cells::{self, Relaxed};
use crate::control::{
    self,
    latency::{self, Signal},
};
use crate::http::{
    is_framing, is_hop_by_hop, name_is, push_date_header, push_decimal, push_status_line,
    write_header, RequestHead, ResponseFraming, ResponseHead,
};
use crate::snapshot::{PeerRt, RouteRt, Snapshot};
use crate::worker::{PortKind, WorkerCtx};

use admission::Admission;
use client::{ClientConn, ClientWatch, HeadRead};
use dispatch::Dispatch;
use error_response::{json_response, ProxyError};
use forward::{ExchangeError, Timeouts};
use peer_select::{Affinity, PeerChoice};
use relay::{ClientFraming, FilterChain, RelayEnd, RelayPlan, RelayStats};
use session_id::{BodyFields, SidOptions};

/// Largest body accepted on debug and admin endpoints.
const ENDPOINT_BODY_BYTES_MAX: u64 = 1024 * 1024;
/// How long a connection accepted while draining may take to send its first request.
const DRAIN_FIRST_REQUEST_WAIT: Duration = Duration::from_secs(2);
/// Read timeout for each piece of a request body.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);

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
    /// The peer's [`cells::peer::INFLIGHT_EPOCH`] when the unit was taken.
    epoch: u64,
}

impl<'a> Inflight<'a> {
    pub fn acquire(seg: &'a Segment, wid: WorkerId, slot: PeerSlot) -> Self {
        let epoch = seg
            .peer_cell(slot, cells::peer::INFLIGHT_EPOCH)
            .load(Relaxed);
        seg.inflight_add(wid, slot, 1);
        Inflight {
            seg,
            wid,
            slot,
            epoch,
        }
    }
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        // A count set by hand since this unit was taken (`_active_conns_set`) no longer
        // holds it: giving it back would take the count below what was set.
        let epoch = self
            .seg
            .peer_cell(self.slot, cells::peer::INFLIGHT_EPOCH)
            .load(Relaxed);
        if epoch == self.epoch {
            self.seg.inflight_add(self.wid, self.slot, -1);
        }
    }
}

/// Read a request's body of at most `limit` bytes, with the worker's spare buffers, the
/// body timeout and its drain's deadline.
async fn read_body(
    ctx: &WorkerCtx,
    conn: &mut ClientConn,
    head: &RequestHead,
    limit: u64,
) -> Result<Bytes, ProxyError> {
    let drain = client::DrainWatch {
        deadline_ms: &ctx.shared.drain_deadline_ms,
        started: &ctx.drain,
    };
    conn.read_body(head, limit, BODY_READ_TIMEOUT, &ctx.bodies, &drain)
        .await
}

/// Serve one client connection until it closes, idles out, or the worker drains.
pub async fn serve_client(ctx: Rc<WorkerCtx>, stream: TcpStream, addr: SocketAddr, kind: PortKind) {
    ctx.active_conns.set(ctx.active_conns.get() + 1);
    let _count = ConnCount(ctx.clone());
    let (rd, wr) = stream.into_split();
    let mut served = 0u32;
    let mut conn = ClientConn {
        rd,
        wr,
        inbuf: Vec::new(),
        addr,
        ip: addr.ip().to_string(),
        timer: client::new_timer(),
        idle_since: None,
        body_read_at: None,
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
        // While draining, a connection's next request is still awaited, briefly: a client
        // connected (or kept its connection) expecting an answer, and a busy one sends its
        // next request at once. Its answer says `Connection: close`. A first request gets
        // longer (a drain may have accepted the connection from the queue).
        let first = served == 0;
        let draining = ctx.drain.is_fired();
        let grace = if first {
            DRAIN_FIRST_REQUEST_WAIT
        } else {
            client::DRAIN_IDLE_GRACE
        };
        let idle = if draining { idle.min(grace) } else { idle };
        served += 1;
        if conn.inbuf.capacity() == 0 {
            conn.inbuf = ctx.take_inbuf();
        }
        match conn
            .read_head(idle, head_timeout, Some((&ctx.drain, grace)))
            .await
        {
            HeadRead::Closed => {
                ctx.put_inbuf(std::mem::take(&mut conn.inbuf));
                return;
            }
            HeadRead::Refuse(e, waited) => {
                let resp = json_response(e.status(), &e.body(None), e.headers(), true);
                let body_bytes = error_response::head_len(&resp).map_or(0, |h| resp.len() - h);
                let sent = conn.write_all_bytes(resp).await.is_ok();
                // Logged after the write: the bytes are those the client got.
                let body_bytes = if sent { body_bytes as u64 } else { 0 };
                unparsed_access_log(&ctx, e.status(), body_bytes, waited);
                if sent {
                    conn.linger_close().await;
                }
                return;
            }
            HeadRead::Head(head) => {
                // Busy polling (when on) keeps the worker awake for the backend's answer and
                // for this client's next request.
                ctx.busy_poll.kick();
                let keep = handle_request(&ctx, &mut conn, head, kind).await;
                ctx.busy_poll.kick();
                if !keep {
                    conn.linger_close().await;
                    return;
                }
                // Kept although the worker drains: the answer went out before the drain
                // began, so the client may be sending its next request already. The next
                // wait (cut to `DRAIN_IDLE_GRACE`) answers it with `Connection: close`.
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
    // The route `resolve` asks about is kept: one lookup by name per request.
    let found = std::cell::Cell::new(None);
    let d = dispatch::resolve(head.target(), |n| {
        found.set(snap.route(n));
        found.get().is_some()
    });
    match (kind, d) {
        (PortKind::Public, Dispatch::Proxy { route, target }) => {
            let route = found
                .get()
                .filter(|r| r.name() == route)
                .or_else(|| snap.route(route))
                .expect("dispatch only names known routes");
            proxy(ctx, conn, &head, &snap, Entry::Route(route, target)).await
        }
        (PortKind::Public, Dispatch::Bare { target }) => {
            proxy(ctx, conn, &head, &snap, Entry::Bare(target)).await
        }
        (_, d) => {
            // Only a route's debug endpoints read a body (overrides, toggles). Anything
            // else is answered from the head: a long prompt sent to a mistyped route gets
            // its 404 at once, not a 413 or a 404 after the upload. A body that came whole
            // with the head is dropped and the connection kept; one still arriving is left
            // unread and the connection closes.
            let reads_body = matches!(d, Dispatch::Debug { .. });
            let body = if reads_body {
                match read_body(ctx, conn, &head, ENDPOINT_BODY_BYTES_MAX).await {
                    Ok(b) => b,
                    Err(e) => return refuse(conn, &head, &e, None, false).await,
                }
            } else {
                Bytes::new()
            };
            // A client's request to a route that does not exist gets its access line (the
            // router's own endpoints, scraped and probed all day, do not).
            let unknown = matches!(
                (kind, &d),
                (PortKind::Public, Dispatch::UnknownRoute { .. })
            );
            let started = Instant::now();
            let loopback = crate::admin::is_local_admin(conn.addr);
            let resp = crate::admin::answer(ctx, &snap, d, kind, &head, &body, loopback);
            let (status, body_bytes) = (resp.status, resp.body.len() as u64);
            let body_unread = !reads_body && !conn.drop_buffered_body(&head);
            let keep = head.keep_alive && !ctx.drain.is_fired() && !body_unread;
            let resp = error_response::for_request(&head, resp.into_bytes(keep));
            let sent = conn.write_all_bytes(resp).await.is_ok();
            if unknown {
                let stats = RelayStats {
                    body_bytes: if !sent || head.method_bytes() == b"HEAD" {
                        0
                    } else {
                        body_bytes
                    },
                    ..RelayStats::default()
                };
                Refused::early(None, None, 0).write(
                    ctx,
                    &head,
                    status,
                    &stats,
                    relay::END_COMPLETE,
                    started,
                );
            }
            sent && keep
        }
    }
}

/// Answer with an error; returns whether the connection may continue.
async fn refuse(
    conn: &mut ClientConn,
    head: &RequestHead,
    e: &ProxyError,
    route: Option<&str>,
    keep: bool,
) -> bool {
    refuse_counted(conn, head, e, route, keep).await.0
}

/// `refuse`, also returning the bytes of body written (for the access line).
async fn refuse_counted(
    conn: &mut ClientConn,
    head: &RequestHead,
    e: &ProxyError,
    route: Option<&str>,
    keep: bool,
) -> (bool, u64) {
    refuse_counted_with(conn, head, e, route, keep, &[], None).await
}

/// [`refuse_counted`] with `lines` (whole header lines, each ending in CRLF) after the
/// error's own headers, and the answer's body fed to `capture` (a body-log record's).
async fn refuse_counted_with(
    conn: &mut ClientConn,
    head: &RequestHead,
    e: &ProxyError,
    route: Option<&str>,
    keep: bool,
    lines: &[u8],
    capture: Option<&mut crate::bodylog::capture::Capture>,
) -> (bool, u64) {
    if matches!(e, ProxyError::ClientGone) {
        return (false, 0);
    }
    let keep = keep && !e.closes();
    let resp = error_response::json_response_with_lines(
        e.status(),
        &e.body(route),
        e.headers(),
        lines,
        !keep,
    );
    let head_len = error_response::head_len(&resp).unwrap_or(resp.len());
    // What `for_request` leaves of the body (none for HEAD).
    let resp = error_response::for_request(head, resp);
    let body = (resp.len() - head_len) as u64;
    if let Some(c) = capture {
        c.push_response(&resp[head_len..]);
    }
    let sent = conn.write_all_bytes(resp).await.is_ok();
    (sent && keep, if sent { body } else { 0 })
}

/// How the request entered: with a route prefix, or bare `/v1/...` routed by model.
enum Entry<'a> {
    Route(&'a Arc<RouteRt>, Cow<'a, str>),
    Bare(&'a str),
}

/// A request that passed the body-free checks: its route, body and what the body says.
struct Prepared<'a> {
    route: &'a Arc<RouteRt>,
    target: Cow<'a, str>,
    body: Bytes,
    fields: Option<BodyFields>,
    owner: Option<String>,
}

/// Why `prepare` refused: the error, and the route and the key's owner when known.
type PrepareError<'a> = (ProxyError, Option<&'a Arc<RouteRt>>, Option<String>);

/// Route, API key and body. Errors come with the route and the owner when they are known.
async fn prepare<'a>(
    ctx: &WorkerCtx,
    conn: &mut ClientConn,
    head: &RequestHead,
    snap: &'a Snapshot,
    entry: Entry<'a>,
) -> Result<Prepared<'a>, PrepareError<'a>> {
    let seg = &ctx.shared.seg;
    let ceiling = snap.config.server.max_body_size_ceiling;
    let authorize = |route: &'a Arc<RouteRt>| match auth::authorize(&head.headers, &route.keys) {
        AuthDecision::Open => Ok(None),
        AuthDecision::Allowed(owner) => Ok(Some(owner)),
        AuthDecision::Denied => {
            seg.route_cell(route.slot, cells::route::UNAUTHORIZED)
                .fetch_add(1, Relaxed);
            Err((ProxyError::Unauthorized, Some(route), None))
        }
    };
    match entry {
        Entry::Route(route, target) => {
            // The key is checked before the body is read.
            let owner = authorize(route)?;
            let limit = route.cfg.opts.max_body_size.min(ceiling);
            let body = match read_body(ctx, conn, head, limit).await {
                Ok(b) => b,
                Err(e) => return Err((e, Some(route), owner)),
            };
            // The body is parsed once, and only when something needs it: a session id no
            // header gave, or the model of a sub-pool route.
            let needs_body = route.by_model() || !session_id::header_decides(&head.headers);
            let fields = if needs_body {
                session_id::parse_body(&body)
            } else {
                None
            };
            Ok(Prepared {
                route,
                target,
                body,
                fields,
                owner,
            })
        }
        Entry::Bare(target) => {
            // The route comes from the body's model, so its limit is not known yet: the
            // bound before reading is the largest limit of a route that lists models, so a
            // body no route would take gets 413 before it is read, as on a route's path.
            let Some(limit) = snap
                .routes
                .iter()
                .filter(|r| !r.models_sorted.is_empty())
                .map(|r| r.cfg.opts.max_body_size.min(ceiling))
                .max()
            else {
                return Err((
                    ProxyError::ModelNotSupported {
                        model: None,
                        supported: Vec::new(),
                    },
                    None,
                    None,
                ));
            };
            let body = read_body(ctx, conn, head, limit)
                .await
                .map_err(|e| (e, None, None))?;
            let fields = session_id::parse_body(&body);
            let model = fields.as_ref().and_then(|f| f.model.clone());
            let Some(route) = model.as_deref().and_then(|m| snap.route_for_model(m)) else {
                // The supported list names only the models the request's key opens; a key
                // that opens none gets the 401 any of their routes would give.
                let Some(visible) = snap.models_for(&head.headers) else {
                    return Err((ProxyError::Unauthorized, None, None));
                };
                let mut supported: Vec<String> =
                    visible.into_iter().map(|(m, _)| m.to_string()).collect();
                supported.dedup();
                return Err((
                    ProxyError::ModelNotSupported { model, supported },
                    None,
                    None,
                ));
            };
            let owner = authorize(route)?;
            let limit = route.cfg.opts.max_body_size.min(ceiling);
            if body.len() as u64 > limit {
                return Err((ProxyError::BodyTooLarge { limit }, Some(route), owner));
            }
            Ok(Prepared {
                route,
                target: Cow::Borrowed(target),
                body,
                fields,
                owner,
            })
        }
    }
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
        /// How the relay ended (`relay::END_*`).
        end: &'static str,
    },
}

/// The model list a `peers_by_model` route answers itself.
fn model_list(models: &[String]) -> Vec<u8> {
    let data: Vec<serde_json::Value> = models
        .iter()
        .map(|m| json!({"id": m, "object": "model"}))
        .collect();
    serde_json::to_vec(&json!({"object": "list", "data": data})).unwrap_or_default()
}

/// Proxy one request: prepare → local answers → session id → rules → pool → gates → select →
/// forward with retries → relay → account.
async fn proxy(
    ctx: &Rc<WorkerCtx>,
    conn: &mut ClientConn,
    head: &RequestHead,
    snap: &Snapshot,
    entry: Entry<'_>,
) -> bool {
    let started = Instant::now();
    // Every request, refused ones too: a flood of refusals keeps a worker busy as well.
    crate::worker::quota::settle(started);
    // Asked when the answer is written, not when the request came: a request that started
    // before a drain is answered with `Connection: close`, so the client reconnects (to the
    // router taking over) instead of sending its next request into a closing socket.
    let keep_client = || head.keep_alive && !ctx.drain.is_fired();
    let seg = &*ctx.shared.seg;

    // 1. Route, key (401) and body (413).
    // A route's path checks the key before the body is read; a bare request reads the body
    // first, for its model.
    let key_before_body = matches!(entry, Entry::Route(..));
    let mut p = match prepare(ctx, conn, head, snap, entry).await {
        Ok(p) => p,
        Err((e, route, owner)) => {
            if let Some(r) = route {
                seg.route_cell(r.slot, cells::route::REQUESTS)
                    .fetch_add(1, Relaxed);
            }
            if let Some(slot) = owner.as_deref().and_then(|o| snap.owner_slot(o)) {
                seg.route_cell(slot, cells::owner::REQUESTS)
                    .fetch_add(1, Relaxed);
            }
            // A refusal made from the head (a route's 401; a bare request when no route
            // lists models) drops a body that came whole with the head and keeps the
            // connection; a body still arriving stays on the wire, and the connection
            // closes. A bare request's 401 comes after its body was read: nothing to drop.
            let from_head = match &e {
                ProxyError::Unauthorized => key_before_body,
                // Only `prepare`'s refusal before the body is read has an empty list: one
                // made after it names the models some route serves, which are never none
                // there. An empty list from a later refusal would drop the next request.
                ProxyError::ModelNotSupported { supported, .. } => supported.is_empty(),
                _ => false,
            };
            let body_unread = from_head && !conn.drop_buffered_body(head);
            let log = Refused::early(route.map(|r| &**r), owner.as_deref(), 0);
            let keep = keep_client() && !body_unread;
            return refuse_logged(ctx, conn, head, &e, keep, log, started).await;
        }
    };
    let route: &RouteRt = p.route;
    let req_bytes = p.body.len();
    let opts = &route.cfg.opts;
    let rcell = |i: usize| seg.route_cell(route.slot, i);
    rcell(cells::route::REQUESTS).fetch_add(1, Relaxed);
    // A request with a key counts for the key's owner too (`warmroute_owner_*`).
    let owner_slot = p.owner.as_deref().and_then(|o| snap.owner_slot(o));
    if let Some(slot) = owner_slot {
        seg.route_cell(slot, cells::owner::REQUESTS)
            .fetch_add(1, Relaxed);
    }
    // The body came with the head unless reading it had to wait.
    let body_read_at = conn.body_read_at.unwrap_or(started);
    let model = p.fields.as_ref().and_then(|f| f.model.as_deref());
    let upstream_path =
        crate::bytescan::split_once_ascii(&p.target, b'?').map_or(&*p.target, |(p, _)| p);

    // 2. A sub-pool route lists its models itself.
    if route.by_model() && upstream_path == "/v1/models" {
        let body = model_list(&route.models_sorted);
        let mut out = b"HTTP/1.1 200 OK\r\n".to_vec();
        crate::http::push_date_header(&mut out);
        out.extend_from_slice(
            format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            )
            .as_bytes(),
        );
        let keep = keep_client();
        if !keep {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&body);
        let stats = RelayStats {
            body_bytes: body.len() as u64,
            ..RelayStats::default()
        };
        let log = Refused::early(Some(route), p.owner.as_deref(), req_bytes);
        log.write(ctx, head, 200, &stats, relay::END_COMPLETE, started);
        let out = error_response::for_request(head, out);
        return conn.write_all_bytes(out).await.is_ok() && keep;
    }

    // 3. Session id: read before the rules and the pool, so that the access line and the
    //    body-log record of every refusal from here on name the session.
    let sid_opts = SidOptions {
        session_affinity: opts.session_affinity,
        body_user_affinity: opts.body_user_affinity,
    };
    let (sid, source) = session_id::extract(&head.headers, p.fields.as_ref(), &sid_opts);
    let refused_log = || Refused {
        route: Some(route),
        owner: p.owner.as_deref(),
        req_bytes,
        session: session_id::header_value(sid.as_ref().map(|s| &*s.id)),
        source: source.label(),
        logged: Some(LoggedRequest::read(
            &p.body,
            p.fields.as_ref(),
            sid.as_ref().map(|s| &*s.id),
        )),
    };

    // 4. Reject rules, on the client's original body (a client's GET /v1/models is exempt).
    if upstream_path != "/v1/models"
        && !opts.reject_rules_compiled.is_empty()
        && cells::toggle(
            seg,
            route.slot,
            cells::route::TOGGLE_REJECT_RULES,
            opts.reject_rules_enabled,
        )
    {
        if let Some(hit) = opts.reject_rules_compiled.evaluate(&p.body) {
            rcell(cells::route::REJECT_RULE).fetch_add(1, Relaxed);
            if let Some(slot) = route.rule_slots.get(hit.index).copied().flatten() {
                seg.route_cell(slot, cells::route::RULE_HITS)
                    .fetch_add(1, Relaxed);
            }
            let e = ProxyError::RejectedByRule {
                rule: hit.rule.name.clone(),
                message: hit.rule.message_or_default().into_owned(),
                status: hit.rule.status.unwrap_or(opts.reject_rules_status),
            };
            return refuse_logged(ctx, conn, head, &e, keep_client(), refused_log(), started).await;
        }
    }

    // 5. The pool (400 for a model no sub-pool serves).
    let Some(pool) = route.pool_for(model) else {
        rcell(cells::route::MODEL_NOT_SUPPORTED).fetch_add(1, Relaxed);
        let e = ProxyError::ModelNotSupported {
            model: model.map(String::from),
            supported: route.models_sorted.clone(),
        };
        return refuse_logged(ctx, conn, head, &e, keep_client(), refused_log(), started).await;
    };

    // 6. Loads, then the 503 gate and the load gates — concurrency (static or adaptive
    //    limit), TTFT, and decode rate (only without adaptive concurrency). A client's
    //    GET /v1/models is exempt from the load gates, being the backends' own health
    //    probe. With the rate-limit master switch off the gates still measure and count
    //    their trips, but let the request through.
    let now_ms = ctx.wall.ms_at(body_read_at);
    let now_s = now_ms / 1000;
    let mut loads = ctx.loads();
    pool.loads_into(seg, now_ms, &mut loads);
    let Some(mut fig) = admission::figures(&loads, opts.rt_limit_factor) else {
        rcell(cells::route::UNAVAILABLE).fetch_add(1, Relaxed);
        let e = ProxyError::NoHealthyPeer;
        return refuse_logged(ctx, conn, head, &e, keep_client(), refused_log(), started).await;
    };
    let mut prio_bucket: Option<(warmroute_shm::RouteSlot, usize)> = None;
    if upstream_path != "/v1/models" {
        let ctl_cell = |i| control::pool_state::ctl_cell(seg, pool.slots.ctl, i);
        let rate_on = latency::rate_limit_on(opts, pool, seg);
        let pool_limit = fig.limit;
        fig.limit = latency::concurrency_limit(opts, pool, seg, now_s, pool_limit);
        // Session turn priority, when on: the request's turn bucket grades the gates.
        let prio = Some(route.prio_slot)
            .filter(|&slot| control::prio_state::enabled(seg, slot, opts))
            .map(|slot| {
                let table = &route.prio_table;
                let header = head
                    .headers
                    .get_known(crate::http::Known::X_PHANROUTER_SESSION);
                let bucket = control::prio_state::classify(
                    seg,
                    slot,
                    route.name(),
                    opts,
                    table,
                    header,
                    now_s,
                );
                (slot, table, bucket)
            });
        let mut shed: Option<ProxyError> = None;
        let conc_shed = match &prio {
            Some((_, table, b)) => !control::session_prio::concurrency_admit(
                fig.inflight as f64,
                fig.limit,
                fig.rt_factor,
                table[*b].share,
            ),
            None => matches!(admission::concurrency_gate(&fig), Admission::Shed(_)),
        };
        if conc_shed {
            if rate_on {
                rcell(cells::route::REJECT_CONCURRENCY).fetch_add(1, Relaxed);
                let in_force = latency::adaptive_in_force(opts, pool, seg);
                if in_force {
                    // Unmet demand, for the adaptive limit (not the static one's 429s).
                    ctl_cell(control::pool_state::ctl::REJ).fetch_add(1, Relaxed);
                }
                fig.avg_5min = latency::cluster_avg(pool, seg, now_s).0;
                // The graded gate's own figures: a turn-1 refusal below `limit` says why.
                let graded = prio.as_ref().map(|(_, table, b)| {
                    let share = table[*b].share;
                    let ceiling = control::session_prio::ceiling(fig.limit, fig.rt_factor, share);
                    Box::new((*b, table[*b].min_turn, share, ceiling))
                });
                let adaptive = in_force.then_some(pool_limit);
                shed = Some(ProxyError::ConcurrencyLimit(fig, graded, adaptive));
            } else {
                latency::count_trip(seg, pool, "concurrency");
            }
        }
        let signals: &[Signal] = if opts.adaptive_cc {
            &[Signal::Ttft]
        } else {
            &[Signal::Ttft, Signal::Tps]
        };
        for &sig in signals {
            if shed.is_some() {
                break;
            }
            // With the switch off a gate that would refuse or hand out a probe slot
            // reports a trip instead, and spends nothing of the probe budget.
            let verdict = match &prio {
                Some((slot, table, b)) => {
                    graded_gate(seg, opts, sig, pool, *slot, table, *b, now_s, rate_on)
                }
                None => latency::gate(opts, sig, pool, seg, now_s, rate_on),
            };
            match verdict {
                latency::Verdict::Shed {
                    ewma,
                    threshold,
                    metric,
                } => {
                    rcell(if sig == Signal::Ttft {
                        cells::route::REJECT_TTFT
                    } else {
                        cells::route::REJECT_TPS
                    })
                    .fetch_add(1, Relaxed);
                    shed = Some(ProxyError::LatencyShed {
                        gate: sig.name(),
                        ewma,
                        threshold,
                        names: Box::new((
                            pool.model.clone().or_else(|| model.map(String::from)),
                            latency::metric_name(opts, sig, metric),
                        )),
                        healthy_peers: fig.healthy_peers,
                        active_level: fig.active_level,
                        avg_5min: latency::cluster_avg(pool, seg, now_s).0,
                    });
                }
                latency::Verdict::Trip => latency::count_trip(seg, pool, sig.name()),
                latency::Verdict::Pass | latency::Verdict::Probe => {}
            }
        }
        if let Some((slot, _, b)) = &prio {
            control::prio_state::count(seg, *slot, *b, shed.is_none());
            prio_bucket = Some((*slot, *b));
        }
        if let Some(e) = shed {
            return refuse_logged(ctx, conn, head, &e, keep_client(), refused_log(), started).await;
        }
    }

    // 7. Select; then the request transforms, on the body that goes to the peer.
    let algo = Affinity::from(opts.affinity_hash);
    let sid_bytes = sid.as_ref().map(|s| session_id::hash_bytes(&s.id));
    let placement = pool.placement(seg, algo, sid_bytes, now_s);
    let choice = peer_select::select(
        &loads,
        sid_bytes,
        algo,
        peer_select::Overflow::from_name(&opts.affinity_overflow),
        placement.and_then(|(_, peer)| peer),
        ctx.random(),
    );
    if let (Some((k, _)), PeerChoice::LeastConn(i)) = (placement, choice) {
        pool.place_session(seg, k, i, now_s);
    }
    let Some(first) = choice.index() else {
        rcell(cells::route::UNAVAILABLE).fetch_add(1, Relaxed);
        let e = ProxyError::NoHealthyPeer;
        return refuse_logged(ctx, conn, head, &e, keep_client(), refused_log(), started).await;
    };
    rcell(match choice {
        PeerChoice::Hash(_) => cells::route::MODE_HASH,
        PeerChoice::HashFallback(_) => cells::route::MODE_HASH_FALLBACK,
        _ => cells::route::MODE_LEAST_CONN,
    })
    .fetch_add(1, Relaxed);
    let mode = choice.mode();
    let timeouts = Timeouts {
        connect: Duration::from_millis(opts.connect_timeout_ms),
        first_byte: Duration::from_millis(opts.first_byte_timeout_ms),
        idle: Duration::from_millis(opts.idle_timeout_ms),
        head_request: head.method_bytes() == b"HEAD",
        drain: Some(client::DrainWatch {
            deadline_ms: &ctx.shared.drain_deadline_ms,
            started: &ctx.drain,
        }),
    };
    let authorization = opts
        .upstream_api_key
        .as_ref()
        .map(|k| format!("Bearer {k}"));
    let Transformed {
        new: mut transformed,
        usage_injected,
        inserted_at,
    } = transform_body(seg, route, &mut p.body, p.fields.as_ref(), upstream_path);
    let routing = RoutingHeaders {
        expose: opts.expose_routed_headers,
        session: session_id::header_value(sid.as_ref().map(|s| &*s.id)),
        source: source.label(),
        mode,
    };

    // 8. From here on the client is watched: if it leaves, the upstream is closed at
    //    once. The block scopes the watch's borrow of the connection.
    let (phase, pipelined) = {
        let mut watch = ClientWatch::new(&mut conn.rd, &mut conn.timer, body_read_at);

        // 9. Forward; retry on connect failures and 502/503 while nothing reached the
        //    client. Retry targets are lined up only when a first attempt failed.
        let mut outcome = None;
        let mut fallback: Option<std::vec::IntoIter<usize>> = None;
        let mut idx = first;
        // Whether an earlier attempt failed on its peer's side (a 502/503, or a connect
        // this host could make): only then has a retry moved the session.
        let mut peer_failed = false;
        let mut buf = ctx.take_buf();
        let mut req_buf = ctx.take_head_buf();
        // The client's body itself unless a transform changed it: no second owner (a clone
        // of a Vec-backed Bytes allocates) for the usual request, whose body is copied into
        // the request buffer anyway. A body too large to copy there leaves with the head in
        // one vectored write, which must own it: it is moved out of its `Bytes` (no copy,
        // nothing else holds it yet) and put back after the exchanges.
        let sent = transformed.as_mut().unwrap_or(&mut p.body);
        let mut big_body = (sent.len() > crate::limits::INLINE_BODY_BYTES_MAX)
            .then(|| Vec::from(std::mem::take(sent)));
        let big = big_body.is_some();
        for retries in 0..=opts.max_more_tries {
            if big && big_body.is_none() {
                // Only a client that left mid-write takes the body with it.
                outcome = Some(Err((ProxyError::ClientGone, None)));
                break;
            }
            let upstream_body: &[u8] = match &big_body {
                Some(b) => b,
                None => transformed.as_ref().unwrap_or(&p.body),
            };
            let peer = &pool.peers[idx];
            let inflight = Inflight::acquire(seg, ctx.wid, peer.slot);
            seg.peer_cell(peer.slot, cells::peer::REQUESTS)
                .fetch_add(1, Relaxed);
            if retries > 0 {
                rcell(cells::route::RETRIES).fetch_add(1, Relaxed);
            }
            let (req, inline) = forward::build_request(
                std::mem::take(&mut req_buf),
                head,
                &p.target,
                peer,
                &conn.ip,
                upstream_body,
                authorization.as_deref(),
                usage_injected,
            );
            debug_assert_eq!(inline, !big, "build_request splits at the same size");
            // The body's arrival is a current time for the first attempt.
            let now = if retries == 0 {
                body_read_at
            } else {
                Instant::now()
            };
            let res = forward::exchange(
                &ctx.upstreams,
                now,
                peer,
                req,
                &mut big_body,
                std::mem::take(&mut buf),
                &timeouts,
                &mut watch,
            )
            .await;
            // The next peer to try, worked out only when this attempt failed.
            let mut next = || {
                fallback
                    .get_or_insert_with(|| {
                        peer_select::fallback_order(
                            &loads,
                            first,
                            opts.cross_tier_fallback,
                            ctx.random(),
                        )
                        .into_iter()
                    })
                    .next()
                    .filter(|_| retries < opts.max_more_tries)
            };
            let fail = |e: ProxyError| {
                Some(Err((
                    e,
                    Some(Routed {
                        peer,
                        mode,
                        retries,
                    }),
                )))
            };
            let retry_5xx = matches!(&res, Ok(ex) if matches!(ex.head.status, 502 | 503));
            let retry_connect = matches!(&res, Err(e) if e.is_connect());
            let next = if retry_5xx || retry_connect {
                next()
            } else {
                None
            };
            // A 502/503 is the peer's failure, whether a retry follows it or it is relayed
            // as the last answer (no peer left to try).
            if retry_5xx {
                seg.peer_cell(peer.slot, cells::peer::FAILURES)
                    .fetch_add(1, Relaxed);
            }
            match res {
                Ok(ex) if retry_5xx && next.is_some() => {
                    peer_failed = true;
                    tracing::warn!(route = route.name(), peer = %peer.name, status = ex.head.status, "peer answered 5xx; trying another peer");
                    buf = ex.buf;
                    req_buf = ex.req;
                }
                Ok(ex) => {
                    // A session a retry moved lives on the peer that served it now: its
                    // next turn goes there, to the prefix this turn left in that cache.
                    // Only after a failure of a peer's own (not this host's, out of
                    // descriptors); not for a one-off overflow (`HashFallback`: its own peer
                    // was full, not gone); not onto a peer whose 502/503 is relayed as the
                    // last answer.
                    // (Looked up again here rather than kept across the awaits above,
                    // which would grow every request's future.)
                    if peer_failed
                        && mode != PeerChoice::HashFallback(0).mode()
                        && !matches!(ex.head.status, 502 | 503)
                    {
                        let sid_bytes = sid.as_ref().map(|s| session_id::hash_bytes(&s.id));
                        if let Some((k, _)) = pool.placement(seg, algo, sid_bytes, now_s) {
                            pool.place_session(seg, k, idx, now_s);
                        }
                    }
                    outcome = Some(Ok((
                        ex,
                        Routed {
                            peer,
                            mode,
                            retries,
                        },
                        inflight,
                    )));
                    break;
                }
                Err(ExchangeError::ClientGone) => {
                    // Gone while the peer worked on it (a prefill the user stopped waiting for).
                    seg.peer_cell(peer.slot, cells::peer::CUT_BY_CLIENT)
                        .fetch_add(1, Relaxed);
                    outcome = fail(ProxyError::ClientGone);
                    break;
                }
                Err(e) if e.is_connect() => {
                    // A connect this host could not make (out of descriptors or ports) is
                    // not the peer's failure: it is tried elsewhere, but nobody is banned.
                    if !matches!(&e, ExchangeError::Connect(io) if control::health::local_connect_error(io))
                    {
                        peer_failed = true;
                        seg.peer_cell(peer.slot, cells::peer::FAILURES)
                            .fetch_add(1, Relaxed);
                        control::health::ban_on_connect_failure(ctx, route, peer);
                    }
                    if next.is_some() {
                        tracing::warn!(route = route.name(), peer = %peer.name, error = ?e, "connect failed; trying another peer");
                    } else {
                        outcome = fail(match e {
                            ExchangeError::ConnectTimeout => ProxyError::ConnectTimeout {
                                peer: peer.name.clone(),
                            },
                            ExchangeError::Connect(io) => ProxyError::ConnectFailed {
                                peer: peer.name.clone(),
                                detail: io.to_string(),
                            },
                            _ => unreachable!("is_connect covers exactly these"),
                        });
                        break;
                    }
                }
                Err(ExchangeError::Timeout) => {
                    outcome = fail(ProxyError::UpstreamTimeout {
                        peer: peer.name.clone(),
                    });
                    break;
                }
                Err(ExchangeError::Shutdown) => {
                    outcome = fail(ProxyError::ShuttingDown {
                        peer: Some(peer.name.clone()),
                    });
                    break;
                }
                Err(ExchangeError::Closed) => {
                    outcome = fail(ProxyError::UpstreamClosed {
                        peer: peer.name.clone(),
                    });
                    break;
                }
                Err(ExchangeError::Bad(d)) => {
                    outcome = fail(ProxyError::BadUpstreamResponse {
                        peer: peer.name.clone(),
                        detail: d,
                    });
                    break;
                }
                Err(ExchangeError::Connect(_) | ExchangeError::ConnectTimeout) => {
                    unreachable!("handled above")
                }
            }
            match next {
                Some(n) => idx = n,
                None => break,
            }
        }
        let outcome = outcome.unwrap_or(Err((ProxyError::NoHealthyPeer, None)));
        if let Some(b) = big_body.take() {
            *transformed.as_mut().unwrap_or(&mut p.body) = Bytes::from(b);
        }

        // 10. Relay the response.
        match outcome {
            Err((e, routed)) => (Phase::Failed(e, routed), watch.finish().await),
            Ok((mut ex, routed, inflight)) => {
                // Body filters for this response, then how the client's copy is framed:
                // as the peer framed it unless a filter rewrites the body (re-chunked) or
                // an HTTP/1.0 client cannot take chunks (raw, then close).
                let mut filters = response_filters(route, &ex.head, usage_injected);
                let has_body = ex.head.framing != ResponseFraming::None;
                let client = if has_body && !filters.is_empty() {
                    if head.minor_version == 0 {
                        ClientFraming::Raw
                    } else {
                        ClientFraming::Chunked
                    }
                } else if head.minor_version == 0 && ex.head.framing == ResponseFraming::Chunked {
                    ClientFraming::Raw
                } else {
                    ClientFraming::Passthrough
                };
                let body_closes = client == ClientFraming::Raw
                    || (client == ClientFraming::Passthrough
                        && ex.head.framing == ResponseFraming::UntilClose);
                let keep = keep_client() && !body_closes;
                // The request's buffer, sent, takes the client's head (after any interim
                // heads): one spare buffer per request.
                let mut out = std::mem::take(&mut ex.req);
                out.clear();
                // No 1xx goes to an HTTP/1.0 client, which would take it for the answer
                // (RFC 9110 §15.2).
                if head.minor_version == 0 {
                    ex.interim.clear();
                }
                out.append(&mut ex.interim);
                client_head(&mut out, &ex.head, head, &routing, &routed, keep, client);
                let event_stream = ex
                    .head
                    .headers
                    .get_known(crate::http::Known::CONTENT_TYPE)
                    .is_some_and(|ct| {
                        crate::postprocess::media_type(ct)
                            .eq_ignore_ascii_case(b"text/event-stream")
                    });
                let plan = RelayPlan {
                    framing: ex.head.framing,
                    client,
                    idle_timeout: Duration::from_millis(opts.idle_timeout_ms),
                    head_at: ex.head_at,
                    event_stream,
                    drain: Some(client::DrainWatch {
                        deadline_ms: &ctx.shared.drain_deadline_ms,
                        started: &ctx.drain,
                    }),
                };
                let mut stats = RelayStats {
                    capture: bodylog_capture(ctx, route, &p.body, inserted_at, p.fields.as_ref()),
                    // The usage-frame filter reads the usage as the events pass: no tail then.
                    tail: (!filters.reads_usage()).then(|| ctx.take_tail(!event_stream)),
                    ..RelayStats::default()
                };
                // Nothing is retried once a response is relayed: a long stream should not
                // hold a long prompt (a body-log capture keeps its own reference).
                ctx.bodies.put(std::mem::take(&mut p.body));
                drop(transformed.take());
                // An event stream holds the connection for its whole length: give back the
                // client's read buffer meanwhile (the next request head takes a spare one).
                if conn.inbuf.is_empty() && event_stream {
                    ctx.put_inbuf(std::mem::take(&mut conn.inbuf));
                }
                let rbuf = std::mem::take(&mut ex.buf);
                let mut inflight = Some(inflight);
                let (end, rbuf) = relay::relay(
                    &mut conn.wr,
                    &mut ex.stream,
                    &mut inflight,
                    out,
                    rbuf,
                    ex.start,
                    &plan,
                    &mut filters,
                    &mut watch,
                    &mut stats,
                    ctx.spare_bufs(),
                    ctx.spare_heads(),
                )
                .await;
                drop(inflight);
                if let Some(b) = rbuf {
                    ctx.put_buf(b);
                }
                let end_name = end.name();
                let keep = match end {
                    RelayEnd::Done { reusable } => {
                        if reusable && ex.head.reusable {
                            let done_at = stats.last_body_at.unwrap_or(ex.head_at);
                            ctx.upstreams.borrow_mut().put(
                                routed.peer.addr,
                                ex.stream,
                                done_at,
                                ex.looked,
                            );
                        }
                        keep
                    }
                    RelayEnd::ClientGone => {
                        seg.peer_cell(routed.peer.slot, cells::peer::CUT_BY_CLIENT)
                            .fetch_add(1, Relaxed);
                        false
                    }
                    RelayEnd::UpstreamError(why) => {
                        seg.peer_cell(routed.peer.slot, cells::peer::CUT_BY_PEER)
                            .fetch_add(1, Relaxed);
                        tracing::warn!(route = route.name(), peer = %routed.peer.name, why, "response truncated");
                        false
                    }
                    RelayEnd::Shutdown => false,
                };
                if (200..300).contains(&ex.head.status) {
                    // On a 2xx, an SSE body (`postprocess::mode_for`) is exactly an event stream.
                    let sse = event_stream;
                    let tail = stats.tail.as_ref().map_or(&[][..], relay::Tail::bytes);
                    stats.usage = match filters.seen_usage() {
                        Some(seen) => seen,
                        None if sse => crate::transform::usage_from_sse(tail),
                        None => crate::usage::usage_in_json_tail(tail).or_else(|| {
                            let early = stats.tail.as_ref().map(relay::Tail::early_usage);
                            crate::usage::usage_in_json_tail(early.unwrap_or_default())
                        }),
                    };
                    if let Some(u) = stats.usage {
                        account_usage(seg, route, routed.peer, &u);
                        if let Some(slot) = owner_slot {
                            for (cell, v) in [
                                (cells::owner::PROMPT_TOKENS, u.prompt_tokens),
                                (cells::owner::CACHED_TOKENS, u.cached_tokens),
                                (cells::owner::COMPLETION_TOKENS, u.completion_tokens),
                            ] {
                                if let Some(v) = v.filter(|&v| v > 0) {
                                    seg.route_cell(slot, cell).fetch_add(v, Relaxed);
                                }
                            }
                        }
                        if let Some((slot, b)) = prio_bucket {
                            control::prio_state::add_tokens(
                                seg,
                                slot,
                                b,
                                u.prompt_tokens.unwrap_or(0),
                                u.cached_tokens.unwrap_or(0),
                            );
                        }
                    }
                    // TTFT (streams) and decode rate, always measured: into the route's
                    // histogram and the pool's window, which feeds the EWMA.
                    let first = stats.first_body_at;
                    let end = Instant::now();
                    // The next head's idle wait counts from here too.
                    conn.idle_since = Some(end);
                    // Worked out only for a sample to record (most JSON responses have none).
                    let end_s = || ctx.wall.ms_at(end) / 1000;
                    if let (true, Some(f)) = (sse, first) {
                        let ms = f.duration_since(body_read_at).as_secs_f64() * 1000.0;
                        latency::record_sample(
                            seg,
                            opts,
                            route.slot,
                            pool,
                            routed.peer.slot,
                            Signal::Ttft,
                            ms,
                            end_s(),
                        );
                    }
                    let tokens = stats.usage.and_then(|u| u.completion_tokens).unwrap_or(0);
                    let secs = match (sse, first, stats.last_body_at) {
                        (true, Some(f), Some(l)) => l.duration_since(f).as_secs_f64(),
                        _ => end.duration_since(started).as_secs_f64(),
                    };
                    if let Some(rate) = crate::measure::decode_rate(
                        tokens,
                        secs,
                        opts.tps_min_tokens,
                        opts.tps_min_decode_s,
                    ) {
                        latency::record_sample(
                            seg,
                            opts,
                            route.slot,
                            pool,
                            routed.peer.slot,
                            Signal::Tps,
                            rate,
                            end_s(),
                        );
                    }
                }
                if let Some(capture) = stats.capture.take() {
                    let entry = BodylogEntry {
                        start_ms: ctx.wall.ms_at(started),
                        started,
                        head,
                        route,
                        owner: p.owner.as_deref(),
                        client_ip: &conn.ip,
                        routed: Some(&routed),
                        sid: sid.as_ref().map(|s| &*s.id),
                        source: &routing.source,
                        status: ex.head.status,
                        stats: &stats,
                    };
                    bodylog_send(ctx, seg, *capture, &entry);
                }
                if let Some(t) = stats.tail.take() {
                    ctx.put_tail(t);
                }
                let phase = Phase::Relayed {
                    status: ex.head.status,
                    keep,
                    stats,
                    routed,
                    end: end_name,
                };
                (phase, watch.finish().await)
            }
        }
    };
    if let Some(b) = pipelined {
        conn.inbuf.extend_from_slice(&b);
    }
    let (status, keep, stats, routed, end) = match phase {
        Phase::Failed(e, routed) => {
            // A request that reached a peer keeps its routing headers on the router's own
            // error answer (502, 504): which peer failed and after how many attempts
            // (SPEC §3.7).
            let mut lines = Vec::new();
            if let Some(r) = &routed {
                push_routed_headers(&mut lines, &routing, r);
            }
            // The body-log record of the router's own answer: the client's body (the
            // router's usage member left out), the peer tried.
            let logged = LoggedRequest {
                body: &p.body,
                inserted_at,
                body_lost: p.body.is_empty() && req_bytes > 0,
                fields: p.fields.as_ref(),
                sid: sid.as_ref().map(|s| &*s.id),
                routed: routed.as_ref(),
            };
            let mut capture = logged.capture(ctx, route);
            let (keep, body_bytes) = refuse_counted_with(
                conn,
                head,
                &e,
                Some(route.name()),
                keep_client(),
                &lines,
                capture.as_mut(),
            )
            .await;
            let end = refusal_end(&e);
            let stats = RelayStats {
                body_bytes,
                ..RelayStats::default()
            };
            if let Some(c) = capture {
                logged.send(
                    ctx,
                    c,
                    route,
                    head,
                    p.owner.as_deref(),
                    &conn.ip,
                    &routing.source,
                    e.status(),
                    &stats,
                    started,
                );
            }
            (e.status(), keep, stats, routed, end)
        }
        Phase::Relayed {
            status,
            keep,
            stats,
            routed,
            end,
        } => (status, keep, stats, Some(routed), end),
    };
    access_log(
        ctx,
        &AccessEntry {
            route: Some(route),
            head,
            status,
            routed: routed.as_ref(),
            session: &routing.session,
            source: &routing.source,
            owner: p.owner.as_deref(),
            req_bytes,
            stats: &stats,
            end,
            body_read_at,
            started,
        },
    );
    keep
}

/// The body filters a response gets: the route's post-processing handler (or the server's
/// default) for 2xx SSE and JSON bodies.
fn response_filters(route: &RouteRt, up: &ResponseHead, usage_injected: bool) -> FilterChain {
    let mut chain = FilterChain::default();
    // The usage-only frame the router's own include_usage injection caused is removed, so
    // the client sees exactly the stream it asked for.
    if usage_injected
        && crate::postprocess::mode_for(
            up.status,
            up.headers.get_known(crate::http::Known::CONTENT_TYPE),
        ) == Some(crate::postprocess::Mode::Sse)
    {
        chain.set_usage(crate::transform::UsageFrameFilter::new());
    }
    // The route's value, with the server's `[defaults]` already applied when the route
    // sets none: an explicit `""` turns post-processing off for the route.
    if let Some(handler) = crate::postprocess::Handler::from_name(&route.cfg.opts.postprocess) {
        if let Some(mode) = crate::postprocess::mode_for(
            up.status,
            up.headers.get_known(crate::http::Known::CONTENT_TYPE),
        ) {
            chain.push(Box::new(crate::postprocess::PostProcessor::new(
                handler, mode,
            )));
        }
    }
    chain
}

impl relay::BodyFilter for crate::transform::UsageFrameFilter {
    fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) {
        crate::transform::UsageFrameFilter::feed(self, data, out)
    }
    fn finish(&mut self, out: &mut Vec<u8>) {
        crate::transform::UsageFrameFilter::finish(self, out)
    }
}

/// Start a body-log copy of this request when a listener is configured, the route logs
/// bodies (runtime toggle, else the route option) and the sampling draw says so.
/// `inserted_at`: the router inserted the usage member into `body` there; the capture
/// keeps the client's body, without it. The record's model and stream flag come from
/// `fields` when routing read them, else from the whole body, read now (the copy may be
/// cut, and the body is given back before the response ends).
fn bodylog_capture(
    ctx: &WorkerCtx,
    route: &RouteRt,
    body: &[u8],
    inserted_at: Option<usize>,
    fields: Option<&BodyFields>,
) -> Option<Box<crate::bodylog::capture::Capture>> {
    if !ctx.bodylog_on() {
        return None;
    }
    let seg = &ctx.shared.seg;
    let opts = &route.cfg.opts;
    if !cells::toggle(seg, route.slot, cells::route::TOGGLE_BODYLOG, opts.bodylog) {
        return None;
    }
    let pct = match seg
        .route_cell(route.slot, cells::route::BODYLOG_PCT)
        .load(Relaxed)
    {
        0 => opts.bodylog_pct,
        p => (p - 1).min(100) as u8,
    };
    let original = inserted_at.and_then(|at| {
        Some([
            body.get(..at)?,
            body.get(at + crate::transform::USAGE_MEMBER.len()..)?,
        ])
    });
    if !crate::bodylog::capture::sampled(pct, ctx.random()) {
        return None;
    }
    let mut capture = match original {
        Some(parts) => crate::bodylog::capture::Capture::from_parts(&parts),
        // No insertion (or, defensively, a body too short to hold one): the body as it is.
        None => crate::bodylog::capture::Capture::new(body),
    };
    let facts = |f: &BodyFields| crate::bodylog::capture::RequestFacts {
        model: f.model.clone(),
        stream: f.stream,
    };
    capture.set_request_facts(match fields {
        Some(f) => Some(facts(f)),
        None => session_id::parse_body(body).as_ref().map(facts),
    });
    Some(Box::new(capture))
}

/// What a body-log record says about its request.
struct BodylogEntry<'a> {
    start_ms: u64,
    started: Instant,
    head: &'a RequestHead,
    route: &'a RouteRt,
    owner: Option<&'a str>,
    client_ip: &'a str,
    /// `None`: answered by the router before a peer was chosen.
    routed: Option<&'a Routed<'a>>,
    sid: Option<&'a str>,
    source: &'a str,
    status: u16,
    stats: &'a RelayStats,
}

/// Queue the record on this worker's sender; never blocks (a full queue drops and counts).
fn bodylog_send(
    ctx: &WorkerCtx,
    seg: &Segment,
    capture: crate::bodylog::capture::Capture,
    e: &BodylogEntry<'_>,
) {
    let Some(sender) = ctx.bodylog() else {
        return;
    };
    let secs = |t: Option<Instant>| {
        t.map(|t| (t.duration_since(e.started).as_secs_f64() * 1000.0).round() / 1000.0)
    };
    // The body's model and stream flag, as the capture took them when it began; a body
    // that is not JSON leaves both out.
    let facts = capture.request_facts();
    let (model, stream) = (facts.and_then(|f| f.model.clone()), facts.map(|f| f.stream));
    let mut meta = json!({
        "ts_ms": e.start_ms,
        "request_id": format!("{:016x}{:016x}", ctx.random(), ctx.random()),
        "route": e.route.name(),
        "owner": e.owner.unwrap_or("-"),
        "client_ip": e.client_ip,
        "method": e.head.method(),
        "uri": e.head.target(),
        "req_headers": crate::bodylog::capture::scrub_headers(e.head.headers.iter()),
        "session_src": e.source,
        "status": e.status,
        "rt": (e.started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
    });
    let m = meta.as_object_mut().expect("a JSON object literal");
    let mut put = |k: &str, v: serde_json::Value| {
        if !v.is_null() {
            m.insert(k.into(), v);
        }
    };
    if let Some(r) = e.routed {
        put(
            "peer",
            json!(if r.retries > 0 {
                format!("{} (retry#{})", r.peer.addr, r.retries)
            } else {
                r.peer.addr.to_string()
            }),
        );
        put("peer_name", json!(r.peer.name));
        put("mode", json!(r.mode));
    }
    put("session_id", json!(e.sid));
    put("stream", json!(stream));
    put("model", json!(model));
    put("first_chunk_t", json!(secs(e.stats.first_body_at)));
    put("last_chunk_t", json!(secs(e.stats.last_body_at)));
    if let Some(u) = e.stats.usage {
        put("prompt_tokens", json!(u.prompt_tokens));
        put("cached_tokens", json!(u.cached_tokens));
        put("completion_tokens", json!(u.completion_tokens));
    }
    let mut record = capture.finish(meta);
    // `resp_bytes` is what the client received, as in the access line; the capture keeps
    // the peer's body (an injected usage frame the client never got stays in the record).
    if let Some(m) = record.meta.as_object_mut() {
        m.insert("resp_bytes".into(), e.stats.body_bytes.into());
    }
    let cell = if sender.try_send_tagged(record, e.route.slot.0 as usize) {
        cells::route::BODYLOG_QUEUED
    } else {
        cells::route::BODYLOG_DROPPED
    };
    seg.route_cell(e.route.slot, cell).fetch_add(1, Relaxed);
}

/// The TTFT or decode-rate gate graded by the request's turn bucket (session priority):
/// warm requests may take the pool's probe slots, turn-1 requests their own small budget,
/// and a hysteresis flag holds turn 1 out until the EWMA falls back.
#[allow(clippy::too_many_arguments)]
fn graded_gate(
    seg: &Segment,
    opts: &crate::config::RouteOpts,
    sig: Signal,
    pool: &crate::snapshot::PoolRt,
    prio_slot: warmroute_shm::RouteSlot,
    table: &[crate::config::PrioBucket],
    bucket: usize,
    now_s: u64,
    enforce: bool,
) -> latency::Verdict {
    use control::pool_state as ps;
    use control::prio_state::cell;
    use control::session_prio::{self as sp, PrioGate};
    let slot = sig.slot(pool);
    if ps::gate_off(seg, slot) {
        return latency::Verdict::Pass;
    }
    if sig.metrics(opts).len() <= 1 && latency::threshold(opts, sig, pool, seg, now_s).is_none() {
        return latency::Verdict::Pass;
    }
    // The grades scale the threshold, so the metric furthest into its own is the one that
    // reaches each grade first.
    let judged = latency::judge(opts, sig, pool, seg, now_s);
    if !judged.has_threshold {
        return latency::Verdict::Pass;
    }
    let cfg = latency::signal_cfg(opts, sig);
    let hold_cell = seg.route_cell(prio_slot, cell::HOLD);
    let t1_win = now_s / cfg.probe_window_s.max(1);
    let input = sp::GradedInput {
        ewma: judged.binding.map(|b| b.ewma),
        threshold: judged.binding.map(|b| b.threshold),
        bucket,
        hold: hold_cell.load(Relaxed) == 1,
        warm_probes_used: ps::probes_used(seg, slot, now_s, cfg.probe_window_s),
        t1_probes_used: if seg.route_cell(prio_slot, cell::T1_WIN).load(Relaxed) == t1_win {
            seg.route_cell(prio_slot, cell::T1_USED).load(Relaxed)
        } else {
            0
        },
    };
    let p = control::prio_state::graded_params(opts);
    let g = match sig {
        Signal::Ttft => sp::ttft_graded(&p, table, &input),
        Signal::Tps => sp::tps_graded(&p, table, &input),
    };
    // With the master switch off the gate only reports: anything but a pass is a trip,
    // no probe slot is taken, and turn 1's hold flag is neither set nor released (the
    // first request after the switch comes back on re-evaluates it).
    if !enforce {
        return match g.gate {
            PrioGate::Pass => latency::Verdict::Pass,
            _ => latency::Verdict::Trip,
        };
    }
    if sig == Signal::Ttft {
        hold_cell.store(g.hold as u64, Relaxed);
    }
    match g.gate {
        PrioGate::Pass => latency::Verdict::Pass,
        PrioGate::Probe => {
            ps::take_probe(seg, slot, now_s, cfg.probe_window_s);
            latency::Verdict::Probe
        }
        PrioGate::T1Probe => {
            control::prio_state::take_t1_probe(seg, prio_slot, now_s, cfg.probe_window_s);
            latency::Verdict::Probe
        }
        PrioGate::Shed { ewma, limit, .. } => latency::Verdict::Shed {
            ewma,
            threshold: limit,
            metric: judged.binding.map_or(0, |b| b.metric),
        },
    }
}

/// Add a response's tokens to its route's and peer's counters (SPEC §5.3: the prefix-cache
/// hit rate is cached / prompt tokens).
fn account_usage(seg: &Segment, route: &RouteRt, peer: &PeerRt, u: &crate::transform::Usage) {
    for (rc, pc, v) in [
        (
            cells::route::PROMPT_TOKENS,
            cells::peer::PROMPT_TOKENS,
            u.prompt_tokens,
        ),
        (
            cells::route::CACHED_TOKENS,
            cells::peer::CACHED_TOKENS,
            u.cached_tokens,
        ),
        (
            cells::route::COMPLETION_TOKENS,
            cells::peer::COMPLETION_TOKENS,
            u.completion_tokens,
        ),
        (
            cells::route::USAGE_RESPONSES,
            cells::peer::USAGE_RESPONSES,
            Some(1),
        ),
    ] {
        // Adding zero changes nothing and would still cost two atomic writes to shared lines
        // (`cached_tokens` is 0 on every cold turn).
        if let Some(v) = v.filter(|&v| v > 0) {
            seg.route_cell(route.slot, rc).fetch_add(v, Relaxed);
            seg.peer_cell(peer.slot, pc).fetch_add(v, Relaxed);
        }
    }
}

/// Bytes whose presence makes a body a candidate for some transform; absent → the body is
/// forwarded untouched without being parsed again.
fn transform_candidate(body: &[u8]) -> bool {
    static RE: std::sync::OnceLock<regex::bytes::Regex> = std::sync::OnceLock::new();
    RE.get_or_init(|| {
        regex::bytes::Regex::new(r#"x-anthropic-billing-header|"stream"|[Kk]imi|"system""#)
            .expect("literal regex")
    })
    .is_match(body)
}

/// What [`transform_body`] did to the client's body.
struct Transformed {
    /// A new body to forward instead of the client's (`None`: the client's, as it is now).
    new: Option<Bytes>,
    /// Usage reporting was injected (then the response's usage frame is removed again).
    usage_injected: bool,
    /// The usage member was inserted into the client's body itself at this offset (the
    /// usual injection: no copy of the body); the client's original is the body without
    /// the [`crate::transform::USAGE_MEMBER`] bytes there.
    inserted_at: Option<usize>,
}

/// Apply the route's request transforms (cch_strip, kimi_normalize, include_usage) as
/// toggled at runtime, counting what they did. The usual injection (a member before the
/// closing brace) is made in the client's body buffer; any other change builds a new body.
fn transform_body(
    seg: &Segment,
    route: &RouteRt,
    body: &mut Bytes,
    fields: Option<&BodyFields>,
    path: &str,
) -> Transformed {
    use cells::route as c;
    let mut done = Transformed {
        new: None,
        usage_injected: false,
        inserted_at: None,
    };
    if body.is_empty() {
        return done;
    }
    let opts = &route.cfg.opts;
    let t = |cell, default| cells::toggle(seg, route.slot, cell, default);
    let topts = crate::transform::TransformOptions {
        cch_strip: t(c::TOGGLE_CCH_STRIP, opts.cch_strip),
        kimi_normalize: t(c::TOGGLE_KIMI_NORMALIZE, opts.kimi_normalize),
        include_usage: t(c::TOGGLE_INCLUDE_USAGE, opts.include_usage),
        messages_path: path == "/v1/messages",
    };
    // With every transform off and no `/v1/messages` system hoist to do, nothing can
    // change. A body the router has read already (`fields`) is decided from its facts
    // below, without a scan; any other is only parsed when it holds a byte sequence some
    // transform looks for.
    let any = topts.cch_strip || topts.kimi_normalize || topts.include_usage;
    // (`/v1/messages` bodies are not decided from facts: they keep the scan.)
    let scan = fields.is_none() || topts.messages_path;
    if !(any || topts.messages_path) || (scan && !transform_candidate(body)) {
        return done;
    }
    // The usual body is decided from the fields the router reads anyway (one streaming
    // pass); only the rest is decoded into a tree.
    let parsed;
    let fields = match fields {
        Some(f) => Some(f),
        None => {
            parsed = session_id::parse_body(body);
            parsed.as_ref()
        }
    };
    let quick = fields.and_then(|f| {
        let facts = crate::transform::BodyFacts {
            model: f.model.as_deref(),
            stream: f.stream,
            has_stream_options: f.has_stream_options,
            billing_prefix: f.billing_prefix,
        };
        crate::transform::decide_with_facts(body, &facts, &topts)
    });
    let (new, report) = match quick {
        Some((at, report)) => {
            if let Some(at) = at {
                // Nothing else holds the body yet, so this takes its buffer without a copy,
                // and only the closing brace moves; the buffer has room (see
                // `SpareBodies::take`).
                let mut v = Vec::from(std::mem::take(body));
                crate::transform::insert_usage_member(&mut v, at);
                *body = Bytes::from(v);
                done.inserted_at = Some(at);
            }
            (None, report)
        }
        None => crate::transform::apply(body, &topts),
    };
    let bump = |cell: usize, n: u64| {
        if n > 0 {
            seg.route_cell(route.slot, cell).fetch_add(n, Relaxed);
        }
    };
    bump(c::BODIES_PARSED, report.parsed as u64);
    bump(c::CCH_STRIPPED, report.cch_stripped as u64);
    bump(c::KIMI_CHANGES, report.kimi_changes as u64);
    bump(c::KIMI_REQUESTS, (report.kimi_changes > 0) as u64);
    bump(c::USAGE_INJECTED, report.usage_injected as u64);
    done.new = new.map(Bytes::from);
    done.usage_injected = report.usage_injected;
    done
}

impl relay::BodyFilter for crate::postprocess::PostProcessor {
    fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) {
        crate::postprocess::PostProcessor::feed(self, data, out)
    }
    fn finish(&mut self, out: &mut Vec<u8>) {
        crate::postprocess::PostProcessor::finish(self, out)
    }
}

/// The `X-Routed-*` lines of a routed request (SPEC §3.7), when the route exposes them: on
/// the peer's answer and on the router's own error answer after a peer was tried.
fn push_routed_headers(out: &mut Vec<u8>, routing: &RoutingHeaders<'_>, routed: &Routed<'_>) {
    if !routing.expose {
        return;
    }
    write_header(out, b"X-Routed-Session", routing.session.as_bytes());
    write_header(out, b"X-Routed-Source", routing.source.as_bytes());
    write_header(out, b"X-Routed-Mode", routing.mode.as_bytes());
    write_header(out, b"X-Routed-Peer", routed.peer.name.as_bytes());
    out.extend_from_slice(b"X-Routed-Retries: ");
    push_decimal(out, u64::from(routed.retries));
    out.extend_from_slice(b"\r\n");
}

/// The `X-Routed-*` values of a request.
struct RoutingHeaders<'a> {
    expose: bool,
    session: Cow<'a, str>,
    source: std::borrow::Cow<'static, str>,
    mode: &'static str,
}

/// The response head for the client: the peer's status and end-to-end headers, the
/// routing headers, and our own connection handling.
fn client_head(
    out: &mut Vec<u8>,
    up: &ResponseHead,
    req: &RequestHead,
    routing: &RoutingHeaders,
    routed: &Routed<'_>,
    keep: bool,
    client: ClientFraming,
) {
    out.reserve(512 + up.headers.len() * 48);
    push_status_line(out, up.status, up.reason());
    let listed = up.headers.connection_names_headers();
    let reframed = client != ClientFraming::Passthrough;
    // A peer that sent `Content-Length` next to `Transfer-Encoding: chunked` is read as
    // chunked (RFC 9112 §6.3); the length goes, or a client trusting it would lose its
    // place in the connection.
    let chunked_peer = up.framing == ResponseFraming::Chunked;
    // A 204 has no content and says no length (RFC 9110 §8.6) nor transfer coding (RFC
    // 9112 §6.1); the body is not read either way.
    let no_length = up.status == 204;
    // RFC 9112 §6.1: no `Transfer-Encoding` to an HTTP/1.0 client. A body it gets is
    // decoded (re-framed); one it does not get (HEAD, 304) loses the header here.
    let no_coding = no_length || (req.minor_version == 0 && up.framing == ResponseFraming::None);
    // A length the peer said twice (two lines, or `5, 5`; differing ones are refused) goes
    // out once, as one value, unless the peer's length goes anyway.
    let length_again = if reframed || chunked_peer || no_length {
        None
    } else {
        up.restated_length
    };
    let drop_length = chunked_peer || no_length || length_again.is_some();
    // Whether a `Date` goes out, noted on the way: a lookup would compare every name again.
    let mut dated = false;
    up.headers.write_lines(out, |name, _| {
        let keep = !(is_hop_by_hop(name)
            // The framing headers are not the peer's to drop by listing them in
            // `Connection`: a passed-through body keeps the framing it came with, or the
            // client could not tell where it ends.
            || (listed && up.headers.connection_lists(name) && !is_framing(name))
            // Re-framed bodies carry our framing, not the peer's.
            || (reframed && is_framing(name))
            || (drop_length && name_is(name, b"content-length"))
            || (no_coding && name_is(name, b"transfer-encoding"))
            || peer_routing_header(name));
        if keep && name.len() == 4 {
            dated |= name_is(name, b"date");
        }
        keep
    });
    // RFC 9110 §6.6.1: a recipient with a clock that forwards a response without `Date`
    // adds one, the time it was received.
    if !dated {
        push_date_header(out);
    }
    if let Some(n) = length_again {
        out.extend_from_slice(b"Content-Length: ");
        push_decimal(out, n);
        out.extend_from_slice(b"\r\n");
    }
    push_routed_headers(out, routing, routed);
    if client == ClientFraming::Chunked {
        out.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
    }
    if !keep {
        out.extend_from_slice(b"Connection: close\r\n");
    } else if req.minor_version == 0 {
        out.extend_from_slice(b"Connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// An `X-Routed-*` header from a peer: it never reaches the client, whose routing headers
/// describe this hop.
fn peer_routing_header(name: &[u8]) -> bool {
    name.len() > 9 && name_is(&name[..9], b"x-routed-")
}

/// One access-log line's inputs.
struct AccessEntry<'a> {
    /// `None`: refused before a route was found (an unknown model on a bare `/v1` path).
    route: Option<&'a RouteRt>,
    head: &'a RequestHead,
    status: u16,
    routed: Option<&'a Routed<'a>>,
    session: &'a str,
    source: &'a str,
    owner: Option<&'a str>,
    req_bytes: usize,
    stats: &'a RelayStats,
    /// How the response ended (`relay::END_*`).
    end: &'static str,
    body_read_at: Instant,
    started: Instant,
}

/// The access line of a request answered before it reached a peer (refused, or a model
/// list the route answers itself).
struct Refused<'a> {
    route: Option<&'a RouteRt>,
    owner: Option<&'a str>,
    req_bytes: usize,
    session: Cow<'a, str>,
    source: Cow<'static, str>,
    /// The request as a body-log record of the refusal shows it (`None`: no record, as for
    /// a refusal before the key check and the body read).
    logged: Option<LoggedRequest<'a>>,
}

/// What a body-log record of a request the router answered itself says of the request.
struct LoggedRequest<'a> {
    /// The body as read, with the usage member at `inserted_at` when the router added one.
    body: &'a [u8],
    inserted_at: Option<usize>,
    /// The whole body is not in `body` (a client that left while it was being sent took it).
    body_lost: bool,
    fields: Option<&'a BodyFields>,
    sid: Option<&'a str>,
    routed: Option<&'a Routed<'a>>,
}

impl<'a> LoggedRequest<'a> {
    /// A request refused before it was routed, with the body read whole.
    fn read(body: &'a [u8], fields: Option<&'a BodyFields>, sid: Option<&'a str>) -> Self {
        LoggedRequest {
            body,
            inserted_at: None,
            body_lost: false,
            fields,
            sid,
            routed: None,
        }
    }

    /// Start the record's capture when the route logs this request (sampling included).
    fn capture(
        &self,
        ctx: &WorkerCtx,
        route: &RouteRt,
    ) -> Option<crate::bodylog::capture::Capture> {
        let mut c = bodylog_capture(ctx, route, self.body, self.inserted_at, self.fields)?;
        if self.body_lost {
            c.set_request_truncated();
        }
        Some(*c)
    }

    /// Queue the record of the router's answer (`status`, body bytes in `capture`).
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        ctx: &WorkerCtx,
        capture: crate::bodylog::capture::Capture,
        route: &RouteRt,
        head: &RequestHead,
        owner: Option<&str>,
        client_ip: &str,
        source: &str,
        status: u16,
        stats: &RelayStats,
        started: Instant,
    ) {
        let entry = BodylogEntry {
            start_ms: ctx.wall.ms_at(started),
            started,
            head,
            route,
            owner,
            client_ip,
            routed: self.routed,
            sid: self.sid,
            source,
            status,
            stats,
        };
        bodylog_send(ctx, &ctx.shared.seg, capture, &entry);
    }
}

impl<'a> Refused<'a> {
    /// Before the session id is read.
    fn early(route: Option<&'a RouteRt>, owner: Option<&'a str>, req_bytes: usize) -> Self {
        Refused {
            route,
            owner,
            req_bytes,
            session: Cow::Borrowed("-"),
            source: Cow::Borrowed("none"),
            logged: None,
        }
    }

    fn write(
        &self,
        ctx: &WorkerCtx,
        head: &RequestHead,
        status: u16,
        stats: &RelayStats,
        end: &'static str,
        started: Instant,
    ) {
        access_log(
            ctx,
            &AccessEntry {
                route: self.route,
                head,
                status,
                routed: None,
                session: &self.session,
                source: &self.source,
                owner: self.owner,
                req_bytes: self.req_bytes,
                stats,
                end,
                body_read_at: started,
                started,
            },
        );
    }
}

/// The access line's `end` for a request the router answered itself: the client went away,
/// the drain cut it, or the answer went out.
fn refusal_end(e: &ProxyError) -> &'static str {
    match e {
        ProxyError::ClientGone => relay::END_CLIENT_GONE,
        ProxyError::ShuttingDown { .. } => relay::END_SHUTDOWN,
        _ => relay::END_COMPLETE,
    }
}

/// `refuse`, and the request's access line.
async fn refuse_logged(
    ctx: &WorkerCtx,
    conn: &mut ClientConn,
    head: &RequestHead,
    e: &ProxyError,
    keep: bool,
    log: Refused<'_>,
    started: Instant,
) -> bool {
    // A refused request the route body-logs gets its record, with the router's answer as
    // the response (decided here, off the path of a request that reaches a peer).
    let logged = log.route.zip(log.logged.as_ref());
    let mut capture = logged.and_then(|(route, req)| req.capture(ctx, route));
    let (keep, body_bytes) = refuse_counted_with(
        conn,
        head,
        e,
        log.route.map(RouteRt::name),
        keep,
        &[],
        capture.as_mut(),
    )
    .await;
    let end = refusal_end(e);
    let stats = RelayStats {
        body_bytes,
        ..RelayStats::default()
    };
    log.write(ctx, head, e.status(), &stats, end, started);
    if let (Some(c), Some((route, req))) = (capture, logged) {
        req.send(
            ctx,
            c,
            route,
            head,
            log.owner,
            &conn.ip,
            &log.source,
            e.status(),
            &stats,
            started,
        );
    }
    keep
}

/// The access line of a request refused before its head could be used (malformed, too
/// large, an unsupported transfer coding, or not complete in time): the same fields, with
/// no method or path. `waited` is how long the head had been arriving.
fn unparsed_access_log(ctx: &WorkerCtx, status: u16, response_bytes: u64, waited: Duration) {
    let mut log = ctx.access_log.borrow_mut();
    if !log.enabled() {
        return;
    }
    log.line(|l| {
        l.thousandths("ts", warmroute_shm::now_ms());
        l.opt_str("route", None);
        l.opt_str("method", None);
        l.opt_str("path", None);
        l.u64("status", status.into());
        l.str("session", "-");
        l.str("source", "none");
        l.opt_str("mode", None);
        l.opt_str("peer", None);
        l.u64("retries", 0);
        l.u64("request_bytes", 0);
        l.u64("response_bytes", response_bytes);
        l.opt_thousandths("ttft_ms", None);
        l.opt_u64("prompt_tokens", None);
        l.opt_u64("cached_tokens", None);
        l.opt_u64("completion_tokens", None);
        l.thousandths("total_ms", waited.as_micros() as u64);
        l.str("end", relay::END_COMPLETE);
        l.opt_str("owner", None);
        l.u64("worker", ctx.index as u64);
    });
}

fn access_log(ctx: &WorkerCtx, e: &AccessEntry<'_>) {
    // Every answer on a route passes here once, logged or not: its status class is counted.
    if let (Some(r), Some(c)) = (e.route, cells::status::cell(e.status)) {
        ctx.shared
            .seg
            .route_cell(r.status_slot, c)
            .fetch_add(1, Relaxed);
    }
    let mut log = ctx.access_log.borrow_mut();
    if !log.enabled() {
        return;
    }
    let ttft_us = e
        .stats
        .first_body_at
        .map(|t| t.duration_since(e.body_read_at).as_micros() as u64);
    let routed = e.routed;
    let usage = e.stats.usage;
    log.line(|l| {
        l.thousandths("ts", warmroute_shm::now_ms());
        l.opt_str("route", e.route.map(RouteRt::name));
        l.str("method", e.head.method());
        l.str("path", e.head.path());
        l.u64("status", e.status.into());
        // The session id as sent in X-Routed-Session: sanitised and cut to 128 bytes.
        l.str("session", e.session);
        l.str("source", e.source);
        l.opt_str("mode", routed.map(|r| r.mode));
        l.opt_str("peer", routed.map(|r| r.peer.name.as_str()));
        l.u64("retries", routed.map_or(0, |r| r.retries.into()));
        l.u64("request_bytes", e.req_bytes as u64);
        l.u64("response_bytes", e.stats.body_bytes);
        l.opt_thousandths("ttft_ms", ttft_us);
        l.opt_u64("prompt_tokens", usage.and_then(|u| u.prompt_tokens));
        l.opt_u64("cached_tokens", usage.and_then(|u| u.cached_tokens));
        l.opt_u64("completion_tokens", usage.and_then(|u| u.completion_tokens));
        l.thousandths("total_ms", e.started.elapsed().as_micros() as u64);
        l.str("end", e.end);
        l.opt_str("owner", e.owner);
        l.u64("worker", ctx.index as u64);
    });
}
