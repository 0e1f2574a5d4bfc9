//! Forwarding: build the upstream request, get a connection (pooled or fresh), send, and
//! wait for the response head — all raced against the client going away.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use monoio::BufResult;

use crate::http::{self, is_hop_by_hop, write_header, HeadParse, RequestHead, ResponseHead};
use crate::limits::{INLINE_BODY_BYTES_MAX, INTERIM_RESPONSES_MAX, RELAY_READ_BUF_BYTES};
use crate::snapshot::PeerRt;
use crate::upstream::UpstreamPool;

use super::client::{ClientGone, ClientWatch};

/// Headers the proxy sets itself and so never copies from the client.
fn replaced_by_proxy(name: &str) -> bool {
    const SET: [&str; 7] = [
        "host",
        "content-length",
        "transfer-encoding",
        "expect",
        "x-forwarded-for",
        "x-real-ip",
        "x-forwarded-proto",
    ];
    SET.iter().any(|h| h.eq_ignore_ascii_case(name))
}

/// The request head for the peer: method, rewritten target, the client's end-to-end
/// headers, and the proxy's own (`Host`, `Content-Length`, forwarding headers).
/// `authorization`, when set (`upstream_api_key`), replaces the client's credentials.
pub fn build_request_head(
    head: &RequestHead,
    target: &str,
    peer: &PeerRt,
    client: SocketAddr,
    body_len: usize,
    authorization: Option<&str>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 + head.headers.len() * 48);
    out.extend_from_slice(head.method().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    write_header(&mut out, "Host", peer.host_header.as_bytes());
    let ip = client.ip().to_string();
    let mut xff: Option<Vec<u8>> = None;
    for (name, value) in head.headers.iter() {
        if name.eq_ignore_ascii_case("x-forwarded-for") {
            let v = xff.get_or_insert_with(Vec::new);
            if !v.is_empty() {
                v.extend_from_slice(b", ");
            }
            v.extend_from_slice(value);
            continue;
        }
        if is_hop_by_hop(name)
            || replaced_by_proxy(name)
            || head.headers.has_token("connection", name)
        {
            continue;
        }
        write_header(&mut out, name, value);
    }
    let mut xff = xff.unwrap_or_default();
    if !xff.is_empty() {
        xff.extend_from_slice(b", ");
    }
    xff.extend_from_slice(ip.as_bytes());
    write_header(&mut out, "X-Forwarded-For", &xff);
    write_header(&mut out, "X-Real-IP", ip.as_bytes());
    write_header(&mut out, "X-Forwarded-Proto", b"http");
    if let Some(a) = authorization {
        write_header(&mut out, "Authorization", a.as_bytes());
    }
    if body_len > 0
        || !matches!(head.body, http::BodyFraming::None)
        || matches!(head.method(), "POST" | "PUT" | "PATCH")
    {
        write_header(&mut out, "Content-Length", body_len.to_string().as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out
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
    /// Body bytes that arrived with the head.
    pub leftover: Vec<u8>,
    /// Raw 1xx interim heads to relay before the final head.
    pub interim: Vec<u8>,
    /// When the first response byte arrived.
    pub first_byte_at: Instant,
}

pub struct Timeouts {
    pub connect: Duration,
    pub first_byte: Duration,
}

/// Send one request to `peer` and wait for its response head. A pooled connection that
/// turns out closed before any response byte is replaced by a fresh one, once.
pub async fn exchange<F: Future<Output = BufResult<usize, Vec<u8>>>>(
    pool: &std::cell::RefCell<UpstreamPool>,
    peer: &PeerRt,
    head: Bytes,
    body: Bytes,
    head_request: bool,
    t: &Timeouts,
    watch: &mut ClientWatch<'_, F>,
) -> Result<Exchanged, ExchangeError> {
    let pooled = pool.borrow_mut().take(peer.addr, Instant::now());
    let mut reused = pooled.is_some();
    let mut stream = match pooled {
        Some(s) => s,
        None => connect(peer.addr, t.connect, watch).await?,
    };
    loop {
        match send_and_read_head(
            &mut stream,
            head.clone(),
            body.clone(),
            head_request,
            t.first_byte,
            watch,
        )
        .await
        {
            Ok((head, leftover, interim, first_byte_at)) => {
                return Ok(Exchanged {
                    stream,
                    head,
                    leftover,
                    interim,
                    first_byte_at,
                })
            }
            Err(SendError::BeforeAnyByte) if reused => {
                // A keep-alive connection the peer closed while idle: not a retry.
                reused = false;
                stream = connect(peer.addr, t.connect, watch).await?;
            }
            Err(SendError::BeforeAnyByte) => return Err(ExchangeError::Closed),
            Err(SendError::Fatal(e)) => return Err(e),
        }
    }
}

async fn connect<F: Future<Output = BufResult<usize, Vec<u8>>>>(
    addr: SocketAddr,
    timeout: Duration,
    watch: &mut ClientWatch<'_, F>,
) -> Result<TcpStream, ExchangeError> {
    let fut = monoio::time::timeout(timeout, TcpStream::connect_addr(addr));
    match watch.race(fut).await {
        Err(ClientGone) => Err(ExchangeError::ClientGone),
        Ok(Err(_)) => Err(ExchangeError::ConnectTimeout),
        Ok(Ok(Err(e))) => Err(ExchangeError::Connect(e)),
        Ok(Ok(Ok(s))) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
    }
}

enum SendError {
    BeforeAnyByte,
    Fatal(ExchangeError),
}

type HeadResult = (ResponseHead, Vec<u8>, Vec<u8>, Instant);

async fn send_and_read_head<F: Future<Output = BufResult<usize, Vec<u8>>>>(
    stream: &mut TcpStream,
    head: Bytes,
    body: Bytes,
    head_request: bool,
    first_byte: Duration,
    watch: &mut ClientWatch<'_, F>,
) -> Result<HeadResult, SendError> {
    let gone = |_| SendError::Fatal(ExchangeError::ClientGone);
    if body.len() <= INLINE_BODY_BYTES_MAX {
        let mut one = Vec::with_capacity(head.len() + body.len());
        one.extend_from_slice(&head);
        one.extend_from_slice(&body);
        let (res, _) = watch.race(stream.write_all(one)).await.map_err(gone)?;
        res.map_err(|_| SendError::BeforeAnyByte)?;
    } else {
        let (res, _) = watch.race(stream.write_all(head)).await.map_err(gone)?;
        res.map_err(|_| SendError::BeforeAnyByte)?;
        let (res, _) = watch.race(stream.write_all(body)).await.map_err(gone)?;
        res.map_err(|_| SendError::BeforeAnyByte)?;
    }
    let deadline = monoio::time::Instant::now() + first_byte;
    let mut buf: Vec<u8> = Vec::with_capacity(RELAY_READ_BUF_BYTES);
    let mut interim = Vec::new();
    let mut interims = 0;
    let mut first_byte_at = None;
    loop {
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(RELAY_READ_BUF_BYTES);
        }
        let len = buf.len();
        let cap = buf.capacity();
        let read = monoio::time::timeout_at(deadline, stream.read(buf.slice_mut(len..cap)));
        let (res, slice) = match watch.race(read).await.map_err(gone)? {
            Ok(r) => r,
            Err(_) => return Err(SendError::Fatal(ExchangeError::Timeout)),
        };
        buf = slice.into_inner();
        match res {
            Ok(0) | Err(_) if first_byte_at.is_none() => return Err(SendError::BeforeAnyByte),
            Ok(0) | Err(_) => return Err(SendError::Fatal(ExchangeError::Closed)),
            Ok(_) => {
                first_byte_at.get_or_insert_with(Instant::now);
            }
        }
        loop {
            match http::parse_response(&buf, head_request) {
                Ok(HeadParse::Partial) => break,
                Ok(HeadParse::Complete(h, used)) => {
                    if h.is_interim() && h.status != 101 {
                        interims += 1;
                        if interims > INTERIM_RESPONSES_MAX {
                            return Err(SendError::Fatal(ExchangeError::Bad(
                                "too many interim responses",
                            )));
                        }
                        // 100 Continue answers an expectation we never send upstream.
                        if h.status != 100 {
                            interim.extend_from_slice(&buf[..used]);
                        }
                        buf.drain(..used);
                        continue;
                    }
                    if h.status == 101 {
                        return Err(SendError::Fatal(ExchangeError::Bad(
                            "protocol upgrades are not supported",
                        )));
                    }
                    let leftover = buf.split_off(used);
                    let at = first_byte_at.unwrap_or_else(Instant::now);
                    return Ok((h, leftover, interim, at));
                }
                Err(e) => {
                    return Err(SendError::Fatal(ExchangeError::Bad(match e {
                        http::HeadError::TooLarge | http::HeadError::TooManyHeaders => {
                            "response head too large"
                        }
                        _ => "malformed response head",
                    })))
                }
            }
        }
    }
}
