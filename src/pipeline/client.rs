//! The client side of a connection: reading heads and bodies, writing responses, and
//! watching for the client going away while the peer works.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use monoio::buf::IoBufMut;
use monoio::io::{
    AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt, CancelableAsyncReadRent, OwnedReadHalf,
    OwnedWriteHalf,
};
use monoio::net::TcpStream;
use monoio::time::{Instant, Sleep};

use crate::http::{self, BodyFraming, ChunkedDecoder, HeadParse, RequestHead};
use crate::limits::{BODY_BUF_FIRST_BYTES, CLIENT_READ_BUF_BYTES};
use crate::worker::SpareBodies;

use super::error_response::ProxyError;

pub struct ClientConn {
    pub rd: OwnedReadHalf<TcpStream>,
    pub wr: OwnedWriteHalf<TcpStream>,
    /// Bytes received and not yet consumed (the start of the next head, pipelined requests).
    pub inbuf: Vec<u8>,
    pub addr: SocketAddr,
    /// The client's IP as text, formatted once per connection for the forwarding headers.
    pub ip: String,
    /// The connection's one timer, moved to each wait's deadline (see [`until`]).
    pub timer: Timer,
    /// When the last response was complete, if the request path took that time: the
    /// idle wait for the next head counts from it instead of reading the clock again.
    pub idle_since: Option<std::time::Instant>,
    /// When `read_body` last had to wait for body bytes (`None`: the body came with the
    /// head, and a request's start time stands for its body's too).
    pub body_read_at: Option<std::time::Instant>,
}

/// A timer made once per connection and reset for each wait: a fresh timeout per read
/// would build, register and drop a timer entry (about 400 bytes, cache-line padded)
/// every time, for every request and every streamed event.
pub type Timer = Pin<Box<Sleep>>;

/// A new connection timer, not armed until a wait sets its deadline.
pub fn new_timer() -> Timer {
    Box::pin(monoio::time::sleep(Duration::from_secs(365 * 24 * 3600)))
}

/// A wait's deadline passed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedOut;

/// Run `fut` unless `deadline` passes first, on the connection's timer.
///
/// `fut` comes pinned by the caller (`pin!` in its own state) and this is a plain
/// function returning a `poll_fn`: an `async fn` would keep the future twice, once as
/// its argument and once pinned, and the caller's state would hold that again — the
/// sizes add up per nesting level (a race over a `write_all` was 816 bytes for a
/// 240-byte write), and each level is copied when it is built.
pub fn until<'a, F: Future + Unpin + 'a>(
    timer: &'a mut Timer,
    deadline: Instant,
    mut fut: F,
) -> impl Future<Output = Result<F::Output, TimedOut>> + 'a {
    std::future::poll_fn(move |cx| {
        if let Poll::Ready(v) = Pin::new(&mut fut).poll(cx) {
            return Poll::Ready(Ok(v));
        }
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(TimedOut));
        }
        Poll::Pending
    })
}

/// `until`, with the deadline cut to the drain's own deadline once a drain has begun: a
/// wait for a request body ends there (the worker is about to stop), not later. As in
/// [`race_until_drained!`], the wait listens for a drain only once it has gone on for
/// [`DRAIN_LISTEN_AFTER`] (most end sooner, and pay nothing for it); a drain that began
/// before the wait cuts it at once.
fn until_drain_deadline<'a, F: Future + Unpin + 'a>(
    timer: &'a mut Timer,
    mut deadline: Instant,
    drain: &'a DrainWatch<'a>,
    mut fut: F,
) -> impl Future<Output = Result<F::Output, TimedOut>> + 'a {
    let mut listen_at = Some(Instant::now() + DRAIN_LISTEN_AFTER);
    if drain.started.is_fired() {
        listen_at = None;
        if let Some(end) = drain.deadline() {
            deadline = deadline.min(end);
        }
    }
    let mut fired: Option<crate::worker::Fired> = None;
    std::future::poll_fn(move |cx| {
        if let Poll::Ready(v) = Pin::new(&mut fut).poll(cx) {
            return Poll::Ready(Ok(v));
        }
        loop {
            if let Some(f) = fired.as_mut() {
                if Pin::new(f).poll(cx).is_ready() {
                    fired = None;
                    if let Some(end) = drain.deadline() {
                        deadline = deadline.min(end);
                    }
                }
            }
            let at = listen_at.map_or(deadline, |l: Instant| l.min(deadline));
            if timer.deadline() != at {
                timer.as_mut().reset(at);
            }
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            match listen_at.take() {
                // Time to listen: register with the drain and go round once more.
                Some(l) if l < deadline => fired = Some(drain.started.wait()),
                _ => return Poll::Ready(Err(TimedOut)),
            }
        }
    })
}

/// How long a draining worker still waits for the next request on a kept connection.
pub const DRAIN_IDLE_GRACE: Duration = Duration::from_millis(500);

/// `until`, with the deadline cut to `grace` from the moment `drain` fires.
fn until_drain<'a, F: Future + Unpin + 'a>(
    timer: &'a mut Timer,
    mut deadline: Instant,
    drain: &'a crate::worker::LocalNotify,
    grace: Duration,
    mut fut: F,
) -> impl Future<Output = Result<F::Output, TimedOut>> + 'a {
    let mut fired = Some(drain.wait());
    std::future::poll_fn(move |cx| {
        if let Poll::Ready(v) = Pin::new(&mut fut).poll(cx) {
            return Poll::Ready(Ok(v));
        }
        if let Some(f) = fired.as_mut() {
            if Pin::new(f).poll(cx).is_ready() {
                fired = None;
                deadline = deadline.min(Instant::now() + grace);
            }
        }
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(TimedOut));
        }
        Poll::Pending
    })
}

/// Read more bytes into `inbuf`. Ok(0) = EOF.
async fn fill(rd: &mut OwnedReadHalf<TcpStream>, inbuf: &mut Vec<u8>) -> std::io::Result<usize> {
    if inbuf.capacity() - inbuf.len() < 1024 {
        inbuf.reserve(CLIENT_READ_BUF_BYTES);
    }
    let buf = std::mem::take(inbuf);
    let len = buf.len();
    let cap = buf.capacity();
    let (res, slice) = rd.read(buf.slice_mut(len..cap)).await;
    *inbuf = slice.into_inner();
    res
}

/// What waiting for a request head produced.
pub enum HeadRead {
    Head(RequestHead),
    /// Clean end: EOF between requests, idle timeout, or drain.
    Closed,
    /// A refusal to send before closing (malformed head, too large, timeout mid-head), and
    /// how long the head had been arriving (zero for a head refused in its first read).
    Refuse(ProxyError, Duration),
}

/// Drops the CR and LF bytes at the start of `buf`: empty lines before a request line.
fn skip_empty_lines(buf: &mut Vec<u8>) {
    let n = buf
        .iter()
        .take_while(|&&b| b == b'\r' || b == b'\n')
        .count();
    if n > 0 {
        buf.drain(..n);
    }
}

impl ClientConn {
    /// Wait for the next request head. `idle` bounds the wait for its first byte,
    /// `head_timeout` the time to receive the rest.
    pub async fn read_head(
        &mut self,
        idle: Duration,
        head_timeout: Duration,
        drain: Option<(&crate::worker::LocalNotify, Duration)>,
    ) -> HeadRead {
        // Empty lines before a request line are ignored (RFC 9112 §2.2; some clients send
        // a CRLF after a body): they neither start the head's timeout nor restart the idle
        // wait.
        skip_empty_lines(&mut self.inbuf);
        let mut started = !self.inbuf.is_empty();
        let mut deadline = None;
        // Taken whatever happens: it describes the response just finished, never a later one.
        let idle_since = self.idle_since.take();
        let mut idle_deadline = None;
        // Once a drain has fired, when its grace ends: fixed at the first wait after it,
        // so empty lines cannot stretch it.
        let mut grace_end: Option<Instant> = None;
        // The head's first wait began at `deadline - head_timeout`.
        let waited = |deadline: Option<Instant>| {
            deadline.map_or(Duration::ZERO, |d| {
                Instant::now().saturating_duration_since(d - head_timeout)
            })
        };
        loop {
            if !self.inbuf.is_empty() {
                match http::parse_request(&self.inbuf) {
                    Ok(HeadParse::Complete(head, used)) => {
                        self.inbuf.drain(..used);
                        return HeadRead::Head(head);
                    }
                    Ok(HeadParse::Partial) => {}
                    // `HTTP/1.2` is read as HTTP/1.1 (RFC 9110 §2.5): the digit is
                    // rewritten in place and the head parsed again.
                    Err(http::HeadError::LaterMinor { at }) => {
                        self.inbuf[at] = b'1';
                        continue;
                    }
                    Err(e) => {
                        return HeadRead::Refuse(ProxyError::BadRequestHead(e), waited(deadline))
                    }
                }
            }
            let wait = if started {
                *deadline.get_or_insert_with(|| Instant::now() + head_timeout)
            } else {
                let idle_at = *idle_deadline.get_or_insert_with(|| {
                    idle_since.map_or_else(Instant::now, Instant::from_std) + idle
                });
                match drain {
                    Some((drain, grace)) if drain.is_fired() => {
                        idle_at.min(*grace_end.get_or_insert_with(|| Instant::now() + grace))
                    }
                    _ => idle_at,
                }
            };
            let r = {
                let fill = pin!(fill(&mut self.rd, &mut self.inbuf));
                match drain {
                    // Between requests, a drain cuts the wait to its grace: a request already
                    // on its way is read (by the same receive: nothing is lost to a cancelled
                    // one) and answered; an idle connection closes when the grace ends.
                    Some((drain, grace)) if !started => {
                        until_drain(&mut self.timer, wait, drain, grace, fill).await
                    }
                    _ => until(&mut self.timer, wait, fill).await,
                }
            };
            match r {
                Err(_elapsed) if started => {
                    return HeadRead::Refuse(ProxyError::HeadTimeout, waited(deadline))
                }
                Err(_elapsed) => return HeadRead::Closed,
                Ok(Ok(0)) | Ok(Err(_)) => return HeadRead::Closed,
                Ok(Ok(_)) => {
                    if !started {
                        skip_empty_lines(&mut self.inbuf);
                    }
                    started = !self.inbuf.is_empty();
                }
            }
        }
    }

    /// For a request refused from its head: whether its body is off the wire, so the
    /// connection can serve the next request. It is when there is none, or when a
    /// `Content-Length` body came whole with the head (it is dropped here). A body still
    /// arriving, or a chunked one, stays unread, and the connection must close.
    pub fn drop_buffered_body(&mut self, head: &RequestHead) -> bool {
        match head.body {
            BodyFraming::None => true,
            BodyFraming::Length(n) if self.inbuf.len() as u64 >= n => {
                self.inbuf.drain(..n as usize);
                true
            }
            _ => false,
        }
    }

    /// Read the request body into memory, refusing bodies over `max_bytes` (413) before
    /// reading them when the length is announced. Answers `Expect: 100-continue`.
    ///
    /// A body still arriving at the drain deadline ends the wait there with
    /// [`ProxyError::ShuttingDown`] with no `peer`, answered and logged like any refusal.
    pub async fn read_body(
        &mut self,
        head: &RequestHead,
        max_bytes: u64,
        read_timeout: Duration,
        spares: &SpareBodies,
        drain: &DrainWatch<'_>,
    ) -> Result<Bytes, ProxyError> {
        // Why a wait ended without bytes: its own timeout, or the drain's deadline first.
        let timed_out = |deadline: Instant| {
            if Instant::now() < deadline {
                ProxyError::ShuttingDown { peer: None }
            } else {
                ProxyError::BodyTimeout
            }
        };
        match head.body {
            BodyFraming::None => {
                self.body_read_at = None;
                Ok(Bytes::new())
            }
            BodyFraming::Length(n) => {
                self.body_read_at = None;
                if n > max_bytes {
                    return Err(ProxyError::BodyTooLarge { limit: max_bytes });
                }
                let n = n as usize;
                if head.expect_continue && self.inbuf.len() < n {
                    self.write_all_bytes(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec())
                        .await?;
                }
                // The body gets a buffer of its own (a spare one for a large body); the
                // connection keeps its read buffer (and its capacity) for the next request.
                // The buffer follows the bytes that came, not the length the head declares:
                // heads alone must not reserve `max_body_size` each.
                let have = self.inbuf.len().min(n);
                let mut body = spares.take(n.min(have.max(BODY_BUF_FIRST_BYTES)));
                body.extend_from_slice(&self.inbuf[..have]);
                self.inbuf.drain(..have);
                // The length and the room the usage injection may use (as `take` leaves),
                // so that the injection never has to move the body.
                let room = n + crate::transform::USAGE_MEMBER.len();
                if (n..room).contains(&body.capacity()) {
                    // A first buffer that holds the length but not that room (a rounded-up
                    // or lent one) gets it now, while it holds only what came with the head.
                    body.reserve_exact(room - body.len());
                }
                while body.len() < n {
                    let len = body.len();
                    if body.capacity() == len {
                        // Full: double it, up to the length and its room.
                        let to = (2 * len).max(BODY_BUF_FIRST_BYTES);
                        let to = if to >= n { room } else { to };
                        body.reserve_exact(to - len);
                    }
                    let end = body.capacity().min(n);
                    let read = pin!(self.rd.read(body.slice_mut(len..end)));
                    let deadline = Instant::now() + read_timeout;
                    let (res, slice) =
                        match until_drain_deadline(&mut self.timer, deadline, drain, read).await {
                            Ok(r) => r,
                            Err(_) => return Err(timed_out(deadline)),
                        };
                    body = slice.into_inner();
                    match res {
                        Ok(0) | Err(_) => return Err(ProxyError::ClientGone),
                        Ok(_) => {}
                    }
                    self.body_read_at = Some(std::time::Instant::now());
                }
                Ok(Bytes::from(body))
            }
            BodyFraming::Chunked => {
                if head.expect_continue {
                    self.write_all_bytes(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec())
                        .await?;
                }
                let mut dec = ChunkedDecoder::default();
                let mut body = Vec::new();
                let mut over = false;
                loop {
                    if !self.inbuf.is_empty() {
                        let used = dec
                            .feed(&self.inbuf, &mut |d| {
                                if body.len() as u64 + d.len() as u64 > max_bytes {
                                    over = true;
                                } else {
                                    body.extend_from_slice(d);
                                }
                            })
                            .map_err(|_| ProxyError::BadChunkedBody)?;
                        self.inbuf.drain(..used);
                        if over {
                            return Err(ProxyError::BodyTooLarge { limit: max_bytes });
                        }
                        if dec.is_done() {
                            // Rare enough to take the time even when no read was needed.
                            self.body_read_at = Some(std::time::Instant::now());
                            return Ok(Bytes::from(body));
                        }
                    }
                    let deadline = Instant::now() + read_timeout;
                    let read = pin!(fill(&mut self.rd, &mut self.inbuf));
                    match until_drain_deadline(&mut self.timer, deadline, drain, read).await {
                        Err(_) => return Err(timed_out(deadline)),
                        Ok(Ok(0)) | Ok(Err(_)) => return Err(ProxyError::ClientGone),
                        Ok(Ok(_)) => {}
                    }
                }
            }
        }
    }

    pub async fn write_all_bytes(&mut self, buf: Vec<u8>) -> Result<Vec<u8>, ProxyError> {
        write_client(&mut self.wr, buf).await
    }

    /// Close after a refusal without losing the answer: stop writing, then read and drop
    /// what the client still sends for a short while, so the kernel does not reset the
    /// connection (and discard our response) because of unread request bytes.
    pub async fn linger_close(mut self) {
        let _ = self.wr.shutdown().await;
        let deadline = Instant::now() + LINGER;
        let mut discarded = 0usize;
        let mut buf = std::mem::take(&mut self.inbuf);
        while discarded < LINGER_BYTES_MAX {
            buf.clear();
            if buf.capacity() < CLIENT_READ_BUF_BYTES {
                buf.reserve(CLIENT_READ_BUF_BYTES);
            }
            let read = pin!(self.rd.read(buf));
            match until(&mut self.timer, deadline, read).await {
                Ok((Ok(n), b)) if n > 0 => {
                    discarded += n;
                    buf = b;
                }
                _ => return,
            }
        }
    }
}

/// How long a refused connection keeps draining client bytes before closing.
const LINGER: Duration = Duration::from_secs(2);
/// Most bytes drained from a refused connection.
const LINGER_BYTES_MAX: usize = 32 * 1024 * 1024;

/// Write a whole buffer to the client, handing the buffer back for reuse.
pub async fn write_client(
    wr: &mut OwnedWriteHalf<TcpStream>,
    buf: Vec<u8>,
) -> Result<Vec<u8>, ProxyError> {
    let (res, buf) = wr.write_all(buf).await;
    res.map_err(|_| ProxyError::ClientGone)?;
    Ok(buf)
}

/// A read on the client kept pending while the peer works: it completes with EOF when
/// the client goes away (also during a silent prefill), so the upstream can be closed at
/// once. Pipelined bytes it reads (a next request, a stray CRLF after a body) are kept and
/// handed back at the end, and the watch goes on reading after them: a client that sends
/// something and then leaves is still noticed. It stops only when it has kept
/// [`WATCH_KEEP_BYTES_MAX`].
///
/// Armed lazily: a request answered within `WATCH_ARM_DELAY` never issues the read (nor
/// its cancellation), which is most of the cost of watching on short requests. A client
/// that leaves is still noticed at most that delay late.
pub struct ClientWatch<'a> {
    rd: Option<&'a mut OwnedReadHalf<TcpStream>>,
    /// The connection's timer: the arm time and the deadline of each wait share it.
    timer: &'a mut Timer,
    fut: Option<WatchRead<'a>>,
    /// Made with the first read it cancels: most requests never arm the watch.
    canceller: Option<monoio::io::Canceller>,
    /// The client's bytes read while watching.
    kept: Vec<u8>,
    /// The client closed its connection (or it failed) while we waited.
    gone: bool,
    arm_at: Instant,
}

/// The armed watch read: the read's result, the buffer it appended to, and the read half
/// back for the next read.
type WatchRead<'a> = Pin<
    Box<
        dyn Future<
                Output = (
                    std::io::Result<usize>,
                    Vec<u8>,
                    &'a mut OwnedReadHalf<TcpStream>,
                ),
            > + 'a,
    >,
>;

/// The client closed its connection (or it failed) while we waited.
#[derive(Debug)]
pub struct ClientGone;

/// The router's drain as a long wait sees it: the deadline (ms since the epoch, 0 while
/// not draining) and the worker's signal that the drain began.
#[derive(Clone, Copy)]
pub struct DrainWatch<'a> {
    pub deadline_ms: &'a std::sync::atomic::AtomicU64,
    pub started: &'a crate::worker::LocalNotify,
}

impl DrainWatch<'_> {
    /// When the drain ends, if the router drains.
    fn deadline(&self) -> Option<Instant> {
        let ms = self.deadline_ms.load(std::sync::atomic::Ordering::Relaxed);
        (ms != 0).then(|| {
            Instant::now() + Duration::from_millis(ms.saturating_sub(warmroute_shm::now_ms()))
        })
    }

    /// Whether the drain deadline has passed.
    pub fn passed(&self) -> bool {
        let ms = self.deadline_ms.load(std::sync::atomic::Ordering::Relaxed);
        ms != 0 && warmroute_shm::now_ms() >= ms
    }
}

/// How long a wait goes before it also listens for the drain: most waits end sooner, and
/// pay nothing for it.
pub const DRAIN_LISTEN_AFTER: Duration = Duration::from_secs(1);

/// `race_until_drained!(watch, deadline, listen_at, fut, drain)`, with `fut` pinned:
/// `watch.race_until(Some(deadline), fut)`, where the wait also ends at the router's drain
/// deadline (`Stopped::TimedOut`; [`DrainWatch::passed`] tells the two apart). A wait that
/// starts while the router drains is cut there, and so is one that began before the drain
/// and still goes on: it listens for the drain's start from `listen_at` (the wait's start
/// plus [`DRAIN_LISTEN_AFTER`], from the caller's clock reading). A response cut so ends
/// with its access line, instead of being dropped with the worker.
///
/// A macro, not an async fn, so that the usual short wait costs what a plain `race_until`
/// does (an async fn around it cost about 120 instructions per json request in callgrind).
macro_rules! race_until_drained {
    ($watch:expr, $deadline:expr, $listen_at:expr, $fut:expr, $drain:expr) => {{
        let (deadline, drain) = ($deadline, $drain);
        let mut fut = $fut;
        let leg = $crate::pipeline::client::ClientWatch::first_leg(deadline, $listen_at, drain);
        match $watch.race_until(Some(leg), fut.as_mut()).await {
            Err($crate::pipeline::client::Stopped::TimedOut) if leg < deadline => {
                $watch.race_rest_drained(deadline, fut, drain).await
            }
            r => r,
        }
    }};
}
pub(crate) use race_until_drained;

/// Why a watched wait ended without its result.
#[derive(Debug, PartialEq, Eq)]
pub enum Stopped {
    ClientGone,
    /// The wait's deadline passed.
    TimedOut,
}

impl<'a> ClientWatch<'a> {
    /// `since`: when the request started waiting on the peer; the watch arms
    /// `WATCH_ARM_DELAY` after it.
    pub fn new(
        rd: &'a mut OwnedReadHalf<TcpStream>,
        timer: &'a mut Timer,
        since: std::time::Instant,
    ) -> Self {
        ClientWatch {
            rd: Some(rd),
            timer,
            fut: None,
            canceller: None,
            kept: Vec::new(),
            gone: false,
            arm_at: Instant::from_std(since) + WATCH_ARM_DELAY,
        }
    }

    fn gone(&self) -> bool {
        self.gone
    }

    /// Issue a watch read that appends to `buf` (with room made for it), unless the watch
    /// has kept all it may: then it stops, and keeps `buf`.
    fn arm(&mut self, rd: &'a mut OwnedReadHalf<TcpStream>, mut buf: Vec<u8>) {
        if buf.len() >= WATCH_KEEP_BYTES_MAX {
            self.kept = buf;
            return;
        }
        if buf.len() == buf.capacity() {
            buf.reserve((buf.len().max(WATCH_BUF_BYTES)).min(WATCH_KEEP_BYTES_MAX - buf.len()));
        }
        let handle = self
            .canceller
            .get_or_insert_with(monoio::io::Canceller::new)
            .handle();
        self.fut = Some(Box::pin(async move {
            let (len, cap) = (buf.len(), buf.capacity());
            let (r, slice) = rd.cancelable_read(buf.slice_mut(len..cap), handle).await;
            (r, slice.into_inner(), rd)
        }));
    }

    /// Run `other` to completion unless the client goes away first. `other` comes pinned
    /// by the caller, for the reason given at [`until`].
    pub fn race<'s, F: Future + Unpin + 's>(
        &'s mut self,
        mut other: F,
    ) -> impl Future<Output = Result<F::Output, ClientGone>> + use<'s, 'a, F> {
        std::future::poll_fn(move |cx| {
            self.poll_race(cx, None, &mut other)
                .map(|r| r.map_err(|_| ClientGone))
        })
    }

    /// Run `other` to completion unless the client goes away or `deadline` passes first.
    pub fn race_until<'s, F: Future + Unpin + 's>(
        &'s mut self,
        deadline: Option<Instant>,
        mut other: F,
    ) -> impl Future<Output = Result<F::Output, Stopped>> + use<'s, 'a, F> {
        std::future::poll_fn(move |cx| self.poll_race(cx, deadline, &mut other))
    }

    /// The deadline of the first leg of a `race_until_drained!` wait: `deadline`, or the
    /// drain deadline when the router already drains, or `listen_at` when that comes
    /// first. The first leg (all of a short wait) is a plain `race_until`; only a wait
    /// that reaches `listen_at` goes on in [`ClientWatch::race_rest_drained`].
    pub fn first_leg(
        deadline: Instant,
        listen_at: Instant,
        drain: Option<DrainWatch<'_>>,
    ) -> Instant {
        match drain {
            None => deadline,
            Some(d) if d.started.is_fired() => d.deadline().map_or(deadline, |x| x.min(deadline)),
            Some(_) => deadline.min(listen_at),
        }
    }

    /// The rest of a wait whose first leg ([`ClientWatch::first_leg`]) ended before
    /// `deadline`: it listens for the drain's start, then ends at the drain deadline.
    pub async fn race_rest_drained<F: Future>(
        &mut self,
        deadline: Instant,
        mut other: Pin<&mut F>,
        drain: Option<DrainWatch<'_>>,
    ) -> Result<F::Output, Stopped> {
        let Some(drain) = drain else {
            return self.race_until(Some(deadline), other).await;
        };
        if !drain.started.is_fired() {
            let either = pin!(crate::util::race(other.as_mut(), drain.started.wait()));
            match self.race_until(Some(deadline), either).await {
                Ok(crate::util::Either::Left(v)) => return Ok(v),
                Ok(crate::util::Either::Right(())) => {}
                Err(e) => return Err(e),
            }
        }
        let deadline = drain.deadline().map_or(deadline, |d| d.min(deadline));
        self.race_until(Some(deadline), other).await
    }

    /// One poll of a race. One timer serves both the watch's arm time and the deadline:
    /// it is set to whichever comes first, and moved on to the deadline once the watch is
    /// armed.
    fn poll_race<F: Future + Unpin>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        deadline: Option<Instant>,
        other: &mut F,
    ) -> Poll<Result<F::Output, Stopped>> {
        if self.gone() {
            return Poll::Ready(Err(Stopped::ClientGone));
        }
        if let Poll::Ready(v) = Pin::new(other).poll(cx) {
            return Poll::Ready(Ok(v));
        }
        loop {
            let arm = self.rd.is_some().then_some(self.arm_at);
            let due = match (arm, deadline) {
                (Some(a), Some(d)) => a.min(d),
                (Some(t), None) | (None, Some(t)) => t,
                (None, None) => break,
            };
            if self.timer.deadline() != due {
                self.timer.as_mut().reset(due);
            }
            if self.timer.as_mut().poll(cx).is_pending() {
                break;
            }
            if deadline.is_some_and(|d| d <= due) {
                return Poll::Ready(Err(Stopped::TimedOut));
            }
            // The arm time came: issue the watch read, then wait for the deadline.
            if let Some(rd) = self.rd.take() {
                self.arm(rd, Vec::with_capacity(WATCH_BUF_BYTES));
            }
        }
        // Bytes the client sent are kept, and the watch reads on after them.
        while let Some(f) = self.fut.as_mut() {
            let Poll::Ready((r, buf, rd)) = f.as_mut().poll(cx) else {
                break;
            };
            self.fut = None;
            match r {
                Ok(n) if n > 0 => self.arm(rd, buf),
                _ => {
                    self.gone = true;
                    return Poll::Ready(Err(Stopped::ClientGone));
                }
            }
        }
        Poll::Pending
    }

    /// Stop watching: cancel the pending read (if it was armed) and return the bytes the
    /// watch read.
    pub async fn finish(mut self) -> Option<Vec<u8>> {
        let kept = match self.fut.take() {
            Some(f) => {
                if let Some(c) = self.canceller.take() {
                    let _ = c.cancel();
                }
                // A read that completed before the cancellation took effect appended its
                // bytes; a cancelled one left the buffer as it was.
                f.await.1
            }
            None => std::mem::take(&mut self.kept),
        };
        (!kept.is_empty() && !self.gone).then_some(kept)
    }
}

/// How long a request may take before its client is watched for disconnects.
const WATCH_ARM_DELAY: std::time::Duration = std::time::Duration::from_millis(25);
/// The client-watch read's first buffer: room for a stray CRLF or a small next request.
const WATCH_BUF_BYTES: usize = 256;
/// The most the client watch keeps of what the client sends while its request is served
/// (a request head's limit, SPEC §14); past it the watch stops reading.
pub const WATCH_KEEP_BYTES_MAX: usize = 64 * 1024;
