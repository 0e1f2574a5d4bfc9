//! Worker threads, the accept loop, HTTP connection handling and the client-gone watch.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use monoio::buf::IoBufMut;
use monoio::io::{
    AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt, CancelableAsyncReadRent, Canceller,
    OwnedReadHalf, OwnedWriteHalf, Splitable,
};
use monoio::net::{ListenerOpts, TcpListener, TcpStream};

use crate::http::{self, BodyKind, ChunkedDecoder, HttpError, RespLen};
use crate::{bump, MockEvent, Shared};

pub(crate) type Rd = OwnedReadHalf<TcpStream>;
pub(crate) type Wr = OwnedWriteHalf<TcpStream>;

/// How often the accept loop checks the stop flag.
const STOP_POLL: Duration = Duration::from_millis(25);
/// Bytes read ahead (pipelined requests) while a response is produced before the watch stops
/// reading.
const PENDING_LIMIT: usize = 1024 * 1024;
const READ_CHUNK: usize = 16 * 1024;

/// Thread body of a worker: build the runtime, bind, report, serve until stopped.
pub(crate) fn worker(
    bind: SocketAddr,
    shared: Arc<Shared>,
    ready: mpsc::Sender<io::Result<SocketAddr>>,
) {
    let rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
        .enable_timer()
        .build();
    let mut rt = match rt {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    rt.block_on(serve(bind, shared, ready));
}

async fn serve(bind: SocketAddr, shared: Arc<Shared>, ready: mpsc::Sender<io::Result<SocketAddr>>) {
    let opts = ListenerOpts::new()
        .reuse_port(true)
        .reuse_addr(true)
        .backlog(4096);
    let listener = match TcpListener::bind_with_config(bind, &opts) {
        Ok(l) => l,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    match listener.local_addr() {
        Ok(a) => {
            let _ = ready.send(Ok(a));
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    }
    drop(ready);

    let stop = LocalSignal::default();
    let live = Rc::new(Cell::new(0usize));
    while let Some(accepted) = accept_or_stop(&listener, &shared).await {
        let (stream, _peer) = match accepted {
            Ok(x) => x,
            Err(_) => {
                // EMFILE and friends: back off instead of spinning.
                monoio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        bump(&shared.stats.connections, 1);
        let guard = LiveGuard::new(&live);
        let shared = shared.clone();
        let fired = stop.fired();
        monoio::spawn(async move {
            let _guard = guard;
            monoio::select! {
                biased;
                _ = fired => {}
                _ = handle_conn(stream, &shared) => {}
            }
        });
    }
    // Stop: close the listener, then every connection (their tasks drop their sockets), and
    // give the driver a few turns so that asynchronous closes are submitted.
    drop(listener);
    stop.fire();
    let deadline = Instant::now() + Duration::from_secs(2);
    while live.get() > 0 && Instant::now() < deadline {
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    for _ in 0..3 {
        monoio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Accept the next connection, or `None` once the instance is stopping.
async fn accept_or_stop(
    listener: &TcpListener,
    shared: &Shared,
) -> Option<io::Result<(TcpStream, SocketAddr)>> {
    if shared.stop.load(Ordering::SeqCst) {
        return None;
    }
    let canceller = Canceller::new();
    let mut accept = std::pin::pin!(listener.cancelable_accept(canceller.handle()));
    loop {
        let r = monoio::select! {
            biased;
            r = &mut accept => Some(r),
            _ = monoio::time::sleep(STOP_POLL) => None,
        };
        if let Some(r) = r {
            return Some(r);
        }
        if shared.stop.load(Ordering::SeqCst) {
            let _ = canceller.cancel();
            // An accept that won the race is dropped (closed) here.
            let _ = accept.await;
            return None;
        }
    }
}

struct LiveGuard(Rc<Cell<usize>>);

impl LiveGuard {
    fn new(live: &Rc<Cell<usize>>) -> Self {
        live.set(live.get() + 1);
        Self(live.clone())
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}

/// A one-shot, thread-local broadcast signal.
#[derive(Clone, Default)]
struct LocalSignal(Rc<RefCell<SignalInner>>);

#[derive(Default)]
struct SignalInner {
    fired: bool,
    next_key: u64,
    wakers: HashMap<u64, Waker>,
}

impl LocalSignal {
    fn fire(&self) {
        let wakers = {
            let mut s = self.0.borrow_mut();
            s.fired = true;
            std::mem::take(&mut s.wakers)
        };
        for w in wakers.into_values() {
            w.wake();
        }
    }

    fn fired(&self) -> Fired {
        Fired {
            signal: self.clone(),
            key: None,
        }
    }
}

/// Completes once the signal fired.
struct Fired {
    signal: LocalSignal,
    key: Option<u64>,
}

impl Future for Fired {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let mut s = this.signal.0.borrow_mut();
        if s.fired {
            return Poll::Ready(());
        }
        let key = *this.key.get_or_insert_with(|| {
            s.next_key += 1;
            s.next_key
        });
        s.wakers.insert(key, cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for Fired {
    fn drop(&mut self) {
        if let Some(k) = self.key {
            self.signal.0.borrow_mut().wakers.remove(&k);
        }
    }
}

/// Read more bytes, appending to `buf`. `Ok(0)` = end of stream.
async fn read_more(rd: &mut Rd, buf: &mut Vec<u8>) -> io::Result<usize> {
    buf.reserve(READ_CHUNK);
    let len = buf.len();
    let (r, slice) = rd.read(std::mem::take(buf).slice_mut(len..)).await;
    *buf = slice.into_inner();
    r
}

pub(crate) async fn write_all(wr: &mut Wr, data: Vec<u8>) -> io::Result<()> {
    let (r, _) = wr.write_all(data).await;
    r.map(|_| ())
}

/// Serve one connection: requests one after another (keep-alive) until close.
async fn handle_conn(stream: TcpStream, shared: &Shared) {
    let (mut rd, mut wr) = stream.into_split();
    let mut buf: Vec<u8> = Vec::new();
    loop {
        // Request head.
        let (head, head_len) = loop {
            if !buf.is_empty() {
                match http::parse_head(&buf) {
                    Ok(Some(x)) => break x,
                    Ok(None) => {}
                    Err(e) => {
                        reject(&mut rd, &mut wr, shared, &e).await;
                        return;
                    }
                }
            }
            match read_more(&mut rd, &mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        };
        buf.drain(..head_len);
        bump(&shared.stats.http_requests, 1);

        // Request body.
        let kind = match http::body_kind(&head) {
            Ok(k) => k,
            Err(e) => {
                reject(&mut rd, &mut wr, shared, &e).await;
                return;
            }
        };
        let complete = match kind {
            BodyKind::Empty => true,
            BodyKind::Length(n) => buf.len() >= n,
            BodyKind::Chunked => false,
        };
        if !complete
            && head.expects_continue()
            && write_all(&mut wr, b"HTTP/1.1 100 Continue\r\n\r\n".to_vec())
                .await
                .is_err()
        {
            return;
        }
        let body = match read_body(&mut rd, &mut buf, kind).await {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(e) => {
                reject(&mut rd, &mut wr, shared, &e).await;
                return;
            }
        };

        let keep = crate::engine::handle(&head, body, &mut rd, &mut wr, &mut buf, shared).await;
        if !keep {
            return;
        }
    }
}

/// Read the body; `Ok(None)` when the client closed before it was complete.
async fn read_body(
    rd: &mut Rd,
    buf: &mut Vec<u8>,
    kind: BodyKind,
) -> Result<Option<Vec<u8>>, HttpError> {
    match kind {
        BodyKind::Empty => Ok(Some(Vec::new())),
        BodyKind::Length(n) => {
            if buf.len() < n {
                buf.reserve(n - buf.len());
            }
            while buf.len() < n {
                match read_more(rd, buf).await {
                    Ok(0) | Err(_) => return Ok(None),
                    Ok(_) => {}
                }
            }
            if buf.len() == n {
                Ok(Some(std::mem::take(buf)))
            } else {
                Ok(Some(buf.drain(..n).collect()))
            }
        }
        BodyKind::Chunked => {
            let mut dec = ChunkedDecoder::new();
            let mut out = Vec::new();
            loop {
                let used = dec.feed(buf, &mut out)?;
                buf.drain(..used);
                if dec.is_done() {
                    return Ok(Some(out));
                }
                match read_more(rd, buf).await {
                    Ok(0) | Err(_) => return Ok(None),
                    Ok(_) => {}
                }
            }
        }
    }
}

/// Answer a framing error and close gracefully.
async fn reject(rd: &mut Rd, wr: &mut Wr, shared: &Shared, e: &HttpError) {
    let name = shared.config().name.clone();
    let body = http::error_body(e.status, "invalid_request_error", e.message);
    let mut out = http::response_head(
        e.status,
        &name,
        Some("application/json"),
        RespLen::Length(body.len()),
        true,
        &[],
    );
    out.extend_from_slice(&body);
    if write_all(wr, out).await.is_ok() {
        drain_close(rd, wr).await;
    }
}

/// Half-close and discard what the client still sends (bounded in time and size), so that
/// closing with unread data does not reset the connection before the client read our answer.
pub(crate) async fn drain_close(rd: &mut Rd, wr: &mut Wr) {
    let _ = wr.shutdown().await;
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut total = 0usize;
    while total < PENDING_LIMIT {
        let canceller = Canceller::new();
        let mut read =
            std::pin::pin!(rd.cancelable_read(Vec::with_capacity(READ_CHUNK), canceller.handle()));
        let left = deadline.saturating_duration_since(Instant::now());
        let r = monoio::select! {
            biased;
            r = &mut read => Some(r),
            _ = monoio::time::sleep(left) => None,
        };
        match r {
            Some((Ok(n), _)) if n > 0 => total += n,
            Some(_) => return,
            None => {
                let _ = canceller.cancel();
                let _ = read.await;
                return;
            }
        }
    }
}

type ReadFut<'a> = Pin<Box<dyn Future<Output = (&'a mut Rd, io::Result<usize>, Vec<u8>)> + 'a>>;

enum WatchState<'a> {
    /// Not reading right now.
    Idle(&'a mut Rd),
    /// A read is outstanding.
    Reading(ReadFut<'a>, Canceller),
    /// Too much read ahead: not watching anymore.
    Stopped(&'a mut Rd),
    /// End of stream or error seen: the client is gone.
    Closed,
}

/// Watches a connection for EOF/reset while a response is being produced: sleeps race a
/// read on the socket, which stays outstanding across sleeps (one read per response, not
/// one per event). Bytes that arrive meanwhile (pipelined requests) go to `pending`.
pub(crate) struct Watch<'a> {
    state: WatchState<'a>,
    shared: &'a Shared,
    recorded: bool,
}

impl<'a> Watch<'a> {
    pub fn new(rd: &'a mut Rd, shared: &'a Shared) -> Self {
        Self {
            state: WatchState::Idle(rd),
            shared,
            recorded: false,
        }
    }

    /// Record that the client went away (once), and stop watching.
    pub fn gone(&mut self, during: &'static str) {
        self.gone_at(Instant::now(), during);
    }

    fn gone_at(&mut self, at: Instant, during: &'static str) {
        self.state = WatchState::Closed;
        if !self.recorded {
            self.recorded = true;
            bump(&self.shared.stats.client_disconnects, 1);
            self.shared.event(MockEvent::ClientGone { at, during });
        }
    }

    /// Sleep until `deadline` unless the client goes away first. Returns true when the client
    /// is gone (recorded with `during`).
    pub async fn sleep_until(
        &mut self,
        deadline: Instant,
        pending: &mut Vec<u8>,
        during: &'static str,
    ) -> bool {
        loop {
            match std::mem::replace(&mut self.state, WatchState::Closed) {
                WatchState::Idle(rd) => {
                    let canceller = Canceller::new();
                    let handle = canceller.handle();
                    let fut: ReadFut<'a> = Box::pin(async move {
                        let (r, b) = rd
                            .cancelable_read(Vec::with_capacity(READ_CHUNK), handle)
                            .await;
                        (rd, r, b)
                    });
                    self.state = WatchState::Reading(fut, canceller);
                }
                WatchState::Closed => {
                    self.gone(during);
                    return true;
                }
                WatchState::Stopped(rd) => {
                    self.state = WatchState::Stopped(rd);
                    let left = deadline.saturating_duration_since(Instant::now());
                    if !left.is_zero() {
                        monoio::time::sleep(left).await;
                    }
                    return false;
                }
                s @ WatchState::Reading(..) => self.state = s,
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            let WatchState::Reading(fut, _) = &mut self.state else {
                return false;
            };
            let r = monoio::select! {
                biased;
                r = fut => Some(r),
                _ = monoio::time::sleep(deadline - now) => None,
            };
            let Some((rd, res, data)) = r else {
                return false;
            };
            match res {
                Ok(n) if n > 0 => {
                    pending.extend_from_slice(&data[..n]);
                    self.state = if pending.len() > PENDING_LIMIT {
                        WatchState::Stopped(rd)
                    } else {
                        WatchState::Idle(rd)
                    };
                }
                _ => {
                    self.gone_at(Instant::now(), during);
                    return true;
                }
            }
        }
    }

    /// Stop watching: cancel the outstanding read and keep what it got. Returns whether the
    /// connection is still usable.
    pub async fn finish(self, pending: &mut Vec<u8>) -> bool {
        match self.state {
            WatchState::Idle(_) | WatchState::Stopped(_) => true,
            WatchState::Closed => false,
            WatchState::Reading(fut, canceller) => {
                let _ = canceller.cancel();
                let (_rd, res, data) = fut.await;
                match res {
                    Ok(0) => false,
                    Ok(n) => {
                        pending.extend_from_slice(&data[..n]);
                        true
                    }
                    Err(e) => e.raw_os_error() == Some(125), // ECANCELED: our own cancel
                }
            }
        }
    }
}
