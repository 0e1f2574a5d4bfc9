//! Forwarding: build the upstream request, get a connection (pooled or fresh), send, and
//! wait for the response head — all raced against the client going away.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use monoio::buf::{IoBuf, IoBufMut, VecBuf};
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

use crate::http::{self, is_hop_by_hop, write_header, HeadParse, RequestHead, ResponseHead};
use crate::limits::{INLINE_BODY_BYTES_MAX, INTERIM_RESPONSES_MAX, RELAY_READ_BUF_BYTES};
use crate::snapshot::PeerRt;
use crate::upstream::UpstreamPool;

use super::client::{race_until_drained, ClientWatch, DrainWatch, Stopped, DRAIN_LISTEN_AFTER};

/// Headers the proxy sets itself and so never copies from the client.
#[inline(always)]
fn replaced_by_proxy(name: &[u8]) -> bool {
    let is = |h: &[u8]| http::name_is(name, h);
    // Dispatch on the length first: most names match no candidate's length.
    match name.len() {
        4 => is(b"host"),
        6 => is(b"expect"),
        9 => is(b"x-real-ip"),
        14 => is(b"content-length"),
        15 => is(b"x-forwarded-for"),
        17 => is(b"transfer-encoding") || is(b"x-forwarded-proto"),
        _ => false,
    }
}

/// A name that reads as one the router removes or sets itself once its `_` are read as `-`
/// (`Transfer_Encoding`, `X_Real_IP`). A peer stack that maps `_` to `-` (CGI and WSGI both
/// name them `HTTP_TRANSFER_ENCODING`) would take it for the real one: a framing header
/// the router never checked, or a client address the client chose. nginx drops every name
/// with a `_` by default; these are the ones that matter to framing and forwarding. Names
/// of other lengths are not looked at.
#[inline(always)]
fn underscored_lookalike(name: &[u8]) -> bool {
    matches!(name.len(), 9 | 10 | 14..=LONGEST_LOOKALIKE)
        && name.contains(&b'_')
        && dashed_is_ours(name)
}

const LONGEST_LOOKALIKE: usize = "proxy-authorization".len();

/// Whether `name` with its `_` read as `-` is a name the router removes or sets.
#[cold]
#[inline(never)]
fn dashed_is_ours(name: &[u8]) -> bool {
    with_dashes(name, |dashed| {
        is_hop_by_hop(dashed) || replaced_by_proxy(dashed)
    })
}

/// Whether `name` with its `_` read as `-` is `lower`.
#[cold]
#[inline(never)]
fn dashed_is(name: &[u8], lower: &[u8]) -> bool {
    with_dashes(name, |dashed| http::name_is(dashed, lower))
}

/// `f` of `name` with its `_` read as `-` (names up to [`LONGEST_LOOKALIKE`] bytes; longer
/// ones are none of those names).
fn with_dashes(name: &[u8], f: impl FnOnce(&[u8]) -> bool) -> bool {
    let mut buf = [0u8; LONGEST_LOOKALIKE];
    let Some(dashed) = buf.get_mut(..name.len()) else {
        return false;
    };
    for (d, &s) in dashed.iter_mut().zip(name) {
        *d = if s == b'_' { b'-' } else { s };
    }
    f(dashed)
}

/// The request for the peer, in one buffer: method, rewritten target, the client's
/// end-to-end headers, the proxy's own (`Host`, `Content-Length`, forwarding headers)
/// and — when it is small — the body, so head and body leave in one write.
/// `authorization`, when set (`upstream_api_key`), replaces the client's credentials.
/// `identity`: ask for an uncompressed response (`Accept-Encoding: identity` in place of
/// the client's, when it sent one), because the router must read the stream: it removes the usage frame its
/// own `include_usage` injection causes, and a compressed stream would carry that frame to
/// the client unread (and its tokens uncounted).
/// Written into `out` (cleared first); returns it and whether the body is in it.
#[allow(clippy::too_many_arguments)]
pub fn build_request(
    mut out: Vec<u8>,
    head: &RequestHead,
    target: &str,
    peer: &PeerRt,
    client_ip: &str,
    body: &[u8],
    authorization: Option<&str>,
    identity: bool,
) -> (Vec<u8>, bool) {
    let inline = body.len() <= INLINE_BODY_BYTES_MAX;
    out.clear();
    out.reserve(384 + head.headers.len() * 48 + if inline { body.len() } else { 0 });
    out.extend_from_slice(head.method_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    write_header(&mut out, b"Host", peer.host_header.as_bytes());
    let listed = head.headers.connection_names_headers();
    // Whether a client's `Accept-Encoding` was left out for `identity` (one that sent none
    // gets no compressed answer either way).
    let mut asked_encoding = false;
    head.headers.write_lines(&mut out, |name, _| {
        let encoding = identity && http::name_is(name, b"accept-encoding");
        asked_encoding |= encoding;
        !(is_hop_by_hop(name)
            || replaced_by_proxy(name)
            || (listed && head.headers.connection_lists(name))
            || underscored_lookalike(name)
            || (authorization.is_some()
                && (http::name_is(name, b"authorization")
                    || http::name_is(name, b"x-api-key")
                    // A client's key by another spelling would stand next to the route's.
                    || (name.len() == 9 && name.contains(&b'_') && dashed_is(name, b"x-api-key"))))
            || encoding)
    });
    if asked_encoding {
        out.extend_from_slice(b"Accept-Encoding: identity\r\n");
    }
    // X-Forwarded-For: the client's chain, then the client's address. A chain the client
    // lists in `Connection` is its own hop's, and is not passed on (RFC 9110 §7.6.1). A
    // client can so drop the chain a proxy in front of it was given, which loses the
    // addresses before it but lets it claim none.
    out.extend_from_slice(b"X-Forwarded-For: ");
    if !(listed && head.headers.connection_lists(b"x-forwarded-for")) {
        for v in head.headers.all_known(http::Known::X_FORWARDED_FOR) {
            out.extend_from_slice(v);
            out.extend_from_slice(b", ");
        }
    }
    out.extend_from_slice(client_ip.as_bytes());
    out.extend_from_slice(b"\r\nX-Real-IP: ");
    out.extend_from_slice(client_ip.as_bytes());
    out.extend_from_slice(b"\r\nX-Forwarded-Proto: http\r\n");
    if let Some(a) = authorization {
        write_header(&mut out, b"Authorization", a.as_bytes());
    }
    if !body.is_empty()
        || !matches!(head.body, http::BodyFraming::None)
        || matches!(head.method_bytes(), b"POST" | b"PUT" | b"PATCH")
    {
        out.extend_from_slice(b"Content-Length: ");
        http::push_decimal(&mut out, body.len() as u64);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if inline {
        out.extend_from_slice(body);
    }
    (out, inline)
}

/// Why an exchange with a peer failed.
#[derive(Debug)]
pub enum ExchangeError {
    Connect(io::Error),
    ConnectTimeout,
    /// No response head within the first-byte timeout.
    Timeout,
    /// The peer closed or reset before sending a complete head.
    Closed,
    /// The peer sent something that is not an HTTP response.
    Bad(&'static str),
    ClientGone,
    /// No response head by the router's drain deadline.
    Shutdown,
}

impl ExchangeError {
    /// Failed before anything reached the peer's application: safe to try another peer.
    pub fn is_connect(&self) -> bool {
        matches!(
            self,
            ExchangeError::Connect(_) | ExchangeError::ConnectTimeout
        )
    }
}

/// A response head received from a peer, with the connection and what followed the head.
pub struct Exchanged {
    pub stream: TcpStream,
    pub head: ResponseHead,
    /// The read buffer; `buf[start..]` are body bytes that arrived with the head.
    pub buf: Vec<u8>,
    pub start: usize,
    /// Raw 1xx interim heads to relay before the final head.
    pub interim: Vec<u8>,
    /// When the first response byte arrived.
    pub first_byte_at: Instant,
    /// When the rest of the head arrived (with `buf[start..]`).
    pub head_at: Instant,
    /// The request's buffer, sent, for reuse.
    pub req: Vec<u8>,
    /// When the connection was last looked at for bytes nobody asked for (or made), for
    /// the pool ([`UpstreamPool::take`]).
    pub looked: Instant,
}

/// Per-request settings of an exchange.
pub struct Timeouts<'a> {
    pub connect: Duration,
    pub first_byte: Duration,
    /// The most the peer may pause between two reads of its head, once it has sent a
    /// first byte (the route's `idle_timeout_ms`, as between the body's reads).
    pub idle: Duration,
    /// The request is HEAD: the response has no body whatever its headers say.
    pub head_request: bool,
    /// The router's drain: the wait for the response head ends at its deadline at the
    /// latest (`ExchangeError::Shutdown`).
    pub drain: Option<DrainWatch<'a>>,
}

/// Send one request to `peer` and wait for its response head. A pooled connection that
/// turns out closed before any response byte is replaced by a fresh one, once. `now`: a
/// current time, to tell the pool's expired connections (the caller's latest).
///
/// `body`: a body too large for `req` ([`build_request`] left it out), sent right after
/// the head in the same vectored write. The write owns it while the kernel may read it;
/// it is back in `body` when the exchange returns, unless the client left mid-write.
#[allow(clippy::too_many_arguments)]
pub async fn exchange(
    pool: &std::cell::RefCell<UpstreamPool>,
    now: Instant,
    peer: &PeerRt,
    req: Vec<u8>,
    body: &mut Option<Vec<u8>>,
    buf: Vec<u8>,
    t: &Timeouts<'_>,
    watch: &mut ClientWatch<'_>,
) -> Result<Exchanged, ExchangeError> {
    let pooled = pool.borrow_mut().take(peer.addr, now);
    let mut reused = pooled.is_some();
    let mut buf = buf;
    let mut req = req;
    let (mut stream, mut looked) = match pooled {
        Some(p) => p,
        None => (connect(peer.addr, t.connect, watch).await?, now),
    };
    loop {
        buf.clear();
        match send_and_read_head(&mut stream, req, body, buf, t, reused, watch).await {
            Ok((head, buf, start, interim, [first_byte_at, head_at], req)) => {
                return Ok(Exchanged {
                    stream,
                    head,
                    buf,
                    start,
                    interim,
                    first_byte_at,
                    head_at,
                    req,
                    looked,
                })
            }
            Err((SendError::BeforeAnyByte, b, Some(r))) if reused => {
                buf = b;
                req = r;
                // A keep-alive connection the peer closed while idle: not a retry.
                reused = false;
                stream = connect(peer.addr, t.connect, watch).await?;
                looked = now;
            }
            Err((SendError::BeforeAnyByte, ..)) => return Err(ExchangeError::Closed),
            Err((SendError::Fatal(e), ..)) => return Err(e),
        }
    }
}

async fn connect(
    addr: SocketAddr,
    timeout: Duration,
    watch: &mut ClientWatch<'_>,
) -> Result<TcpStream, ExchangeError> {
    let deadline = monoio::time::Instant::now() + timeout;
    // Boxed: connecting is rare (pooled connections are the rule) and its future is
    // large, which would otherwise size every exchange, twice (two call sites).
    let connecting = Box::pin(TcpStream::connect_addr(addr));
    match watch.race_until(Some(deadline), connecting).await {
        Err(Stopped::ClientGone) => Err(ExchangeError::ClientGone),
        Err(Stopped::TimedOut) => Err(ExchangeError::ConnectTimeout),
        Ok(Err(e)) => Err(ExchangeError::Connect(e)),
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
    }
}

/// Write `req` and then `body`: in one vectored write when the socket takes both at once
/// (the usual case: one write op and one TCP send, the peer woken once with the whole
/// request), the rest of a partial write with plain writes. Not monoio's
/// `write_vectored_all`: after a partial write, 0.2.4's `IoVecMeta::consume` shortens the
/// iovec without moving its start, so the bytes already sent go out again. Both buffers
/// come back whatever happens.
async fn write_head_and_body(
    stream: &mut TcpStream,
    req: Vec<u8>,
    body: Vec<u8>,
) -> (io::Result<usize>, Vec<u8>, Vec<u8>) {
    let total = req.len() + body.len();
    let (res, bufs) = stream.writev(VecBuf::from(vec![req, body])).await;
    let mut bufs = Vec::<Vec<u8>>::from(bufs);
    let body = bufs.pop().unwrap_or_default();
    let req = bufs.pop().unwrap_or_default();
    let n = match res {
        Ok(0) if total > 0 => return (Err(io::ErrorKind::WriteZero.into()), req, body),
        Ok(n) => n,
        Err(e) => return (Err(e), req, body),
    };
    if n >= total {
        return (Ok(n), req, body);
    }
    let req = if n < req.len() {
        let (res, rest) = stream.write_all(req.slice(n..)).await;
        let req = rest.into_inner();
        if let Err(e) = res {
            return (Err(e), req, body);
        }
        req
    } else {
        req
    };
    let (res, rest) = stream
        .write_all(body.slice(n.saturating_sub(req.len())..))
        .await;
    (res.map(|_| total), req, rest.into_inner())
}

enum SendError {
    BeforeAnyByte,
    Fatal(ExchangeError),
}

/// The head, the read buffer, where the body starts in it, the interim heads, when the
/// first and the last of the head's bytes arrived, and the request's buffer.
type HeadResult = (ResponseHead, Vec<u8>, usize, Vec<u8>, [Instant; 2], Vec<u8>);

/// Why sending failed, with the read buffer and (when still at hand) the request bytes,
/// so a retry on a fresh connection needs no copy.
type SendFailure = (SendError, Vec<u8>, Option<Vec<u8>>);

/// Write the request (head and `body` in one vectored write when there is a separate
/// body), then read until a final response head. The read buffer comes back in every case,
/// for the caller to reuse; so does `body`, into its slot, unless the client left while
/// it was being written.
async fn send_and_read_head(
    stream: &mut TcpStream,
    req: Vec<u8>,
    body: &mut Option<Vec<u8>>,
    mut buf: Vec<u8>,
    t: &Timeouts<'_>,
    reused: bool,
    watch: &mut ClientWatch<'_>,
) -> Result<HeadResult, SendFailure> {
    let (head_request, first_byte, idle) = (t.head_request, t.first_byte, t.idle);
    let gone = || SendError::Fatal(ExchangeError::ClientGone);
    let sent = match body.take() {
        None => {
            let write = std::pin::pin!(stream.write_all(req));
            watch.race(write).await
        }
        Some(b) => {
            let write = std::pin::pin!(write_head_and_body(stream, req, b));
            watch.race(write).await.map(|(res, req, b)| {
                *body = Some(b);
                (res, req)
            })
        }
    };
    // A failed write on a fresh connection is not the end: a peer that refuses a request
    // before reading all of it (a 413 or 401 from a proxy in front of the engine) answers
    // and closes, and its answer is already here to read; nothing to read means it just
    // closed. On a pooled connection whatever is there may predate the request (a 408 sent
    // when the peer closed it idle), so that one is sent again on a fresh connection, as
    // before. A connection whose write failed is never pooled.
    let (req, send_failed) = match sent {
        Err(_) => return Err((gone(), buf, None)),
        Ok((Err(_), req)) if reused => return Err((SendError::BeforeAnyByte, buf, Some(req))),
        Ok((Err(_), req)) => (req, true),
        Ok((Ok(_), req)) => (req, false),
    };
    let mut req = Some(req);
    macro_rules! bail {
        ($e:expr) => {
            return Err(($e, buf, req.take()))
        };
    }
    // The first-byte wait starts once the request is written (a peer may read a large
    // body slowly).
    let start = monoio::time::Instant::now();
    let (deadline, listen_at) = (start + first_byte, start + DRAIN_LISTEN_AFTER);
    let mut interim = Vec::new();
    let mut interims = 0;
    let mut first_byte_at = None;
    // When the latest read completed (set by every read before the head is parsed).
    let mut read_at: Instant;
    let mut start = 0;
    loop {
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(RELAY_READ_BUF_BYTES);
        }
        let len = buf.len();
        let cap = buf.capacity();
        // Until the first byte, the first-byte deadline; then the idle timeout from the
        // last read, as for the body (a head that starts at once and then stalls is cut
        // by the idle timeout, and a slow but steady one is not cut by the first-byte one).
        let deadline = if first_byte_at.is_some() {
            monoio::time::Instant::now() + idle
        } else {
            deadline
        };
        let got = {
            let read = std::pin::pin!(stream.read(buf.slice_mut(len..cap)));
            race_until_drained!(watch, deadline, listen_at, read, t.drain)
        };
        let (res, slice) = match got {
            Err(Stopped::ClientGone) => return Err((gone(), Vec::new(), None)),
            Err(Stopped::TimedOut) if t.drain.is_some_and(|d| d.passed()) => {
                return Err((SendError::Fatal(ExchangeError::Shutdown), Vec::new(), None))
            }
            Err(Stopped::TimedOut) => {
                return Err((SendError::Fatal(ExchangeError::Timeout), Vec::new(), None))
            }
            Ok(r) => r,
        };
        buf = slice.into_inner();
        match res {
            Ok(0) | Err(_) if first_byte_at.is_none() => bail!(SendError::BeforeAnyByte),
            Ok(0) | Err(_) => bail!(SendError::Fatal(ExchangeError::Closed)),
            Ok(_) => {
                let now = Instant::now();
                first_byte_at.get_or_insert(now);
                read_at = now;
            }
        }
        loop {
            match http::parse_response(&buf[start..], head_request) {
                Ok(HeadParse::Partial) => break,
                Ok(HeadParse::Complete(h, used)) => {
                    if h.is_interim() && h.status != 101 {
                        interims += 1;
                        if interims > INTERIM_RESPONSES_MAX {
                            bail!(SendError::Fatal(ExchangeError::Bad(
                                "too many interim responses"
                            )));
                        }
                        // 100 Continue answers an expectation we never send upstream.
                        if h.status != 100 {
                            push_interim_head(&mut interim, &h);
                        }
                        start += used;
                        continue;
                    }
                    if h.status == 101 {
                        bail!(SendError::Fatal(ExchangeError::Bad(
                            "protocol upgrades are not supported"
                        )));
                    }
                    let mut h = h;
                    h.reusable &= !send_failed;
                    let first = first_byte_at.unwrap_or(read_at);
                    let req = req.take().unwrap_or_default();
                    return Ok((h, buf, start + used, interim, [first, read_at], req));
                }
                Err(e) => bail!(SendError::Fatal(ExchangeError::Bad(match e {
                    http::HeadError::TooLarge => "response head too large",
                    http::HeadError::TooManyHeaders => "too many response headers",
                    _ => "malformed response head",
                }))),
            }
        }
    }
}

/// An interim (1xx) head as the client gets it: the peer's status, reason and end-to-end
/// headers, with CRLF line ends. The hop-by-hop headers, those its `Connection` lists, any
/// framing header (a 1xx has no body) and the peer's own `X-Routed-*` are the peer's hop's.
fn push_interim_head(out: &mut Vec<u8>, h: &http::ResponseHead) {
    http::push_status_line(out, h.status, h.reason());
    let listed = h.headers.connection_names_headers();
    h.headers.write_lines(out, |name, _| {
        !(is_hop_by_hop(name)
            || (listed && h.headers.connection_lists(name))
            || http::is_framing(name)
            || super::peer_routing_header(name))
    });
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A request the socket does not take in one write still arrives whole and in order,
    /// and both buffers come back unchanged: with a head larger than what the socket takes
    /// at once (the rest of the head, then the body, after the vectored write), and with a
    /// body larger than that (the head whole, the rest of the body after).
    #[test]
    fn a_partial_vectored_write_is_finished_in_order() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let pattern = |n: usize, seed: u8| -> Vec<u8> {
            (0..n)
                .map(|i| {
                    (i as u8)
                        .wrapping_mul(31)
                        .wrapping_add((i >> 8) as u8 ^ seed)
                })
                .collect()
        };
        for (head_len, body_len) in [(4 << 20, 1000), (300, 4 << 20)] {
            let (req, body) = (pattern(head_len, 1), pattern(body_len, 7));
            let want: Vec<u8> = req.iter().chain(&body).copied().collect();
            let l = l.try_clone().unwrap();
            let reader = std::thread::spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                // Nothing is read at first: the first write cannot take it all.
                std::thread::sleep(Duration::from_millis(200));
                let mut got = Vec::new();
                s.read_to_end(&mut got).unwrap();
                got
            });
            let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
                .enable_timer()
                .build()
                .unwrap();
            let (res, req_back, body_back) = rt.block_on(async {
                let mut s = TcpStream::connect_addr(addr).await.unwrap();
                let out = write_head_and_body(&mut s, req.clone(), body.clone()).await;
                // The reader reads to the end.
                let _ = s.shutdown().await;
                out
            });
            assert_eq!(res.unwrap(), want.len(), "head {head_len}, body {body_len}");
            assert!(req_back == req && body_back == body, "buffers changed");
            let got = reader.join().unwrap();
            assert_eq!(got.len(), want.len(), "head {head_len}, body {body_len}");
            assert!(
                got == want,
                "head {head_len}, body {body_len}: bytes differ"
            );
        }
    }
}
