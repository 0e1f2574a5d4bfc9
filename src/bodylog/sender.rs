//! The per-worker body-log shipper (SPEC §9, notes-edges §3.5).
//!
//! Reads: [`Record`]s handed over by the request path. Decides: queue or drop. Writes: frames
//! to the listener over one persistent TCP connection. Never: blocks or awaits on the request
//! path, shares state with another thread, or holds more than its queue bounds.
//!
//! Single-thread by construction (`Rc`, `Cell`, `RefCell`): create one per worker inside
//! its runtime and spawn [`Sender::run`] there:
//!
//! ```ignore
//! let sender = Sender::new(listener_addr);
//! monoio::spawn(sender.clone().run());
//! // request path, after the response finished:
//! sender.try_send(capture.finish(meta));
//! // drain: flush what is queued (if connected) and end the task.
//! sender.stop();
//! ```
//!
//! Frames are encoded in [`Sender::try_send`] (so the byte bound is exact and encode errors are
//! reported at once) and queued while the listener is down; when the queue is full
//! ([`QUEUE_FRAMES_MAX`] frames or [`QUEUE_BYTES_MAX`] bytes) new frames are dropped and
//! counted. The writer task connects (1 s timeout), retries with exponential backoff
//! 100 ms → 5 s while the listener is down (or ends each connection within a second of
//! accepting it), batches queued frames into writes of up to
//! 256 KiB, and notices a listener that closed the connection while idle by keeping a read
//! pending (the listener never sends). A write that fails or stalls for 10 s loses the frames
//! in it (counted as dropped) and the connection is re-established; frames that the kernel
//! accepted just before the listener died are lost without being counted, as with any
//! unacknowledged TCP stream.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

use super::frame::{encode_parts, EncodeError, Record};
use super::{META_MAX_BYTES, QUEUE_BYTES_MAX, QUEUE_FRAMES_MAX};
use crate::util::{race, Either};

/// A connection that lasts less than this is a failure, retried after the backoff.
pub const STABLE_AFTER: Duration = Duration::from_secs(1);
/// First retry delay after a failed connect; doubles up to [`BACKOFF_MAX`].
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Connect timeout (the reference's logger uses 1 s).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// A write making no progress for this long is abandoned and the connection replaced.
pub const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Frames are coalesced into writes of at most this many bytes (a larger frame goes alone).
const BATCH_BYTES: usize = 256 * 1024;

/// A snapshot of the sender's counters (for `_bodylog_status` and `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SenderStats {
    /// Frames fully handed to the kernel.
    pub written: u64,
    /// Frames refused (queue full, stopped) or lost in a failed write.
    pub dropped: u64,
    /// Records whose frame could not be built (meta over 64 KiB even without headers, or a
    /// body over its cap).
    pub encode_errors: u64,
    /// Unix ms of the last successful write, 0 if none.
    pub last_write_ms: u64,
    /// Successful connects so far (1 after the first).
    pub connects: u64,
    pub connected: bool,
    pub queued_frames: usize,
    pub queued_bytes: usize,
}

/// One per worker; see the module doc.
pub struct Sender {
    addr: SocketAddr,
    frames_max: usize,
    bytes_max: usize,
    /// Encoded frames, each with the tag it was queued with ([`Sender::try_send_tagged`]).
    queue: RefCell<VecDeque<(Vec<u8>, usize)>>,
    queued_bytes: Cell<usize>,
    waker: RefCell<Option<Waker>>,
    stopping: Cell<bool>,
    connected: Cell<bool>,
    written: Cell<u64>,
    dropped: Cell<u64>,
    encode_errors: Cell<u64>,
    last_write_ms: Cell<u64>,
    connects: Cell<u64>,
    /// Told the tag of each queued frame that is lost after all: in a failed or stalled
    /// write, or still queued when the sender stops.
    on_lost: RefCell<Option<LossHook>>,
}

/// Told the tag of a frame lost after it was queued ([`Sender::set_on_lost`]).
pub type LossHook = Box<dyn Fn(usize)>;

/// The tag of a frame queued with [`Sender::try_send`].
pub const NO_TAG: usize = usize::MAX;

impl Sender {
    /// A sender with the default bounds ([`QUEUE_FRAMES_MAX`], [`QUEUE_BYTES_MAX`]).
    pub fn new(addr: SocketAddr) -> Rc<Sender> {
        Sender::with_limits(addr, QUEUE_FRAMES_MAX, QUEUE_BYTES_MAX)
    }

    pub fn with_limits(addr: SocketAddr, frames_max: usize, bytes_max: usize) -> Rc<Sender> {
        Rc::new(Sender {
            addr,
            frames_max: frames_max.max(1),
            bytes_max,
            queue: RefCell::new(VecDeque::new()),
            queued_bytes: Cell::new(0),
            waker: RefCell::new(None),
            stopping: Cell::new(false),
            connected: Cell::new(false),
            written: Cell::new(0),
            dropped: Cell::new(0),
            encode_errors: Cell::new(0),
            last_write_ms: Cell::new(0),
            connects: Cell::new(0),
            on_lost: RefCell::new(None),
        })
    }

    /// Call `f` with the tag of every queued frame that is lost later (not with the frames
    /// [`Sender::try_send_tagged`] refuses: its caller counts those).
    pub fn set_on_lost(&self, f: LossHook) {
        *self.on_lost.borrow_mut() = Some(f);
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Queue a record for the listener. Never blocks, never awaits: returns `false` (and
    /// counts) when the frame is dropped — queue full, sender stopped, or not encodable. A
    /// meta over 64 KiB first loses its `req_headers` (replaced by
    /// `"req_headers_dropped": true`).
    pub fn try_send(&self, rec: Record) -> bool {
        self.try_send_tagged(rec, NO_TAG)
    }

    /// [`Sender::try_send`], with a tag (the route's slot) that the loss hook is told if
    /// the frame is lost after it was queued.
    pub fn try_send_tagged(&self, rec: Record, tag: usize) -> bool {
        if self.stopping.get() || self.queue.borrow().len() >= self.frames_max {
            self.count_drop();
            return false;
        }
        let frame = match encode_shrinking(rec) {
            Ok(f) => f,
            Err(e) => {
                let n = self.encode_errors.get() + 1;
                self.encode_errors.set(n);
                if n % 1000 == 1 {
                    tracing::warn!(error = %e, encode_errors = n, "bodylog record not encodable");
                }
                return false;
            }
        };
        let bytes = self.queued_bytes.get() + frame.len();
        if bytes > self.bytes_max {
            self.count_drop();
            return false;
        }
        self.queued_bytes.set(bytes);
        self.queue.borrow_mut().push_back((frame, tag));
        self.wake();
        true
    }

    /// Ask the writer task to flush what is queued (when connected) and end. Later
    /// `try_send` calls drop.
    pub fn stop(&self) {
        self.stopping.set(true);
        self.wake();
    }

    pub fn stats(&self) -> SenderStats {
        SenderStats {
            written: self.written.get(),
            dropped: self.dropped.get(),
            encode_errors: self.encode_errors.get(),
            last_write_ms: self.last_write_ms.get(),
            connects: self.connects.get(),
            connected: self.connected.get(),
            queued_frames: self.queue.borrow().len(),
            queued_bytes: self.queued_bytes.get(),
        }
    }

    /// The writer task: spawn once per sender on the worker's runtime. Returns after
    /// [`Sender::stop`].
    pub async fn run(self: Rc<Self>) {
        let mut backoff = BACKOFF_MIN;
        // Said once per outage: connects refused or timing out, and connections ended at once.
        let mut down_logged = false;
        let mut flapping = false;
        loop {
            if self.stopping.get() {
                self.drop_queue();
                return;
            }
            let conn =
                monoio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect_addr(self.addr)).await;
            let stream = match conn {
                Ok(Ok(s)) => s,
                other => {
                    if !down_logged {
                        let error = match other {
                            Ok(Err(e)) => e.to_string(),
                            _ => "connect timed out".to_string(),
                        };
                        tracing::warn!(addr = %self.addr, %error, "bodylog listener unreachable; retrying with backoff");
                        down_logged = true;
                    }
                    race(monoio::time::sleep(backoff), self.wait_stop()).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            down_logged = false;
            self.connects.set(self.connects.get() + 1);
            self.connected.set(true);
            if !flapping {
                tracing::info!(addr = %self.addr, "bodylog listener connected");
            }
            let since = Instant::now();
            let closed = self.serve(stream).await;
            self.connected.set(false);
            if since.elapsed() >= STABLE_AFTER {
                if closed {
                    tracing::warn!(addr = %self.addr, "bodylog listener closed the connection");
                }
                backoff = BACKOFF_MIN;
                flapping = false;
                continue;
            }
            // A connection that ends at once (a proxy in front of a listener that is down
            // accepts and closes) is retried with backoff, as a refused connect is; it was
            // retried at once, a core's worth of connects and log lines.
            if !flapping && !self.stopping.get() {
                tracing::warn!(addr = %self.addr, "bodylog listener ended the connection at once; retrying with backoff");
                flapping = true;
            }
            race(monoio::time::sleep(backoff), self.wait_stop()).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// Write queued frames until the connection fails or the sender stops; true when the
    /// listener closed it.
    async fn serve(&self, mut stream: TcpStream) -> bool {
        let mut batch: Vec<u8> = Vec::new();
        let mut tags: Vec<usize> = Vec::new();
        loop {
            loop {
                let n = self.fill_batch(&mut batch, &mut tags);
                if n == 0 {
                    break;
                }
                let buf = std::mem::take(&mut batch);
                let res = monoio::time::timeout(WRITE_STALL_TIMEOUT, stream.write_all(buf)).await;
                match res {
                    Ok((Ok(_), buf)) => {
                        self.written.set(self.written.get() + n);
                        self.last_write_ms.set(now_ms());
                        batch = buf;
                        batch.clear();
                        if batch.capacity() > 2 * BATCH_BYTES {
                            batch = Vec::new();
                        }
                    }
                    Ok((Err(e), _)) => {
                        self.lose(&tags, &e.to_string());
                        return false;
                    }
                    Err(_) => {
                        self.lose(&tags, "write stalled");
                        return false;
                    }
                }
            }
            if self.stopping.get() {
                return false;
            }
            // Idle: wait for a frame, or for the listener to close (it never sends).
            let probe = Vec::with_capacity(64);
            match race(self.wait_work(), stream.read(probe)).await {
                Either::Left(()) => {}
                Either::Right((Ok(0), _)) | Either::Right((Err(_), _)) => return true,
                Either::Right((Ok(_), _)) => {}
            }
        }
    }

    /// Move frames from the queue into `batch`, their tags into `tags`; returns how many.
    fn fill_batch(&self, batch: &mut Vec<u8>, tags: &mut Vec<usize>) -> u64 {
        let mut q = self.queue.borrow_mut();
        tags.clear();
        while let Some((front, _)) = q.front() {
            if !tags.is_empty() && batch.len() + front.len() > BATCH_BYTES {
                break;
            }
            let Some((f, tag)) = q.pop_front() else { break };
            self.queued_bytes.set(self.queued_bytes.get() - f.len());
            tags.push(tag);
            if batch.is_empty() && f.len() >= BATCH_BYTES {
                *batch = f;
                return 1;
            }
            batch.extend_from_slice(&f);
        }
        tags.len() as u64
    }

    /// Count the frames of a failed write as dropped, and tell the hook their tags.
    fn lose(&self, tags: &[usize], why: &str) {
        let frames = tags.len() as u64;
        self.dropped.set(self.dropped.get() + frames);
        self.report_lost(tags.iter().copied());
        tracing::warn!(addr = %self.addr, frames, error = why, "bodylog write failed; reconnecting");
    }

    fn report_lost(&self, tags: impl Iterator<Item = usize>) {
        if let Some(f) = &*self.on_lost.borrow() {
            tags.filter(|&t| t != NO_TAG).for_each(f);
        }
    }

    fn count_drop(&self) {
        let n = self.dropped.get() + 1;
        self.dropped.set(n);
        if n % 1000 == 1 {
            tracing::warn!(addr = %self.addr, dropped = n, "bodylog queue full; dropping frames");
        }
    }

    fn drop_queue(&self) {
        let lost: Vec<(Vec<u8>, usize)> = self.queue.borrow_mut().drain(..).collect();
        self.queued_bytes.set(0);
        self.dropped.set(self.dropped.get() + lost.len() as u64);
        self.report_lost(lost.into_iter().map(|(_, tag)| tag));
    }

    fn wake(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    fn wait_work(&self) -> impl std::future::Future<Output = ()> + '_ {
        poll_fn(move |cx| {
            if self.stopping.get() || !self.queue.borrow().is_empty() {
                return Poll::Ready(());
            }
            *self.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
    }

    fn wait_stop(&self) -> impl std::future::Future<Output = ()> + '_ {
        poll_fn(move |cx| {
            if self.stopping.get() {
                return Poll::Ready(());
            }
            *self.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
    }
}

/// The longest string a meta keeps once it had to shrink (bytes, before `...`).
pub const META_STRING_CUT: usize = 4096;

/// Encode `rec` into a fresh frame. A meta too large for the u16 field loses `req_headers`
/// first (`req_headers_dropped`); if it is still too large, each string longer than
/// [`META_STRING_CUT`] (a client's huge session id, model or URI) is cut there with `...`
/// (`meta_cut`), so a client cannot keep its requests out of the log.
pub fn encode_shrinking(mut rec: Record) -> Result<Vec<u8>, EncodeError> {
    let encode = |meta: &serde_json::Value| {
        serde_json::to_vec(meta).map_err(|e| EncodeError::Meta(e.to_string()))
    };
    let mut meta = encode(&rec.meta)?;
    if meta.len() > META_MAX_BYTES {
        if let Some(m) = rec.meta.as_object_mut() {
            if m.remove("req_headers").is_some() {
                m.insert("req_headers_dropped".into(), serde_json::Value::Bool(true));
                meta = encode(&rec.meta)?;
            }
        }
    }
    if meta.len() > META_MAX_BYTES {
        if let Some(m) = rec.meta.as_object_mut() {
            let mut cut = false;
            for v in m.values_mut() {
                if let serde_json::Value::String(text) = v {
                    if text.len() > META_STRING_CUT {
                        crate::util::truncate_with_ellipsis(text, META_STRING_CUT);
                        cut = true;
                    }
                }
            }
            if cut {
                m.insert("meta_cut".into(), serde_json::Value::Bool(true));
                meta = encode(&rec.meta)?;
            }
        }
    }
    let mut out = Vec::new();
    encode_parts(&meta, &rec.request, &rec.response, &mut out)?;
    Ok(out)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bodylog::frame::decode;
    use serde_json::json;

    fn rec(meta: serde_json::Value) -> Record {
        Record {
            meta,
            request: b"{}".to_vec(),
            response: b"ok".to_vec(),
        }
    }

    #[test]
    fn big_headers_are_dropped_to_fit() {
        let meta = json!({"route": "r", "req_headers": {"x": "h".repeat(70_000)}});
        let f = encode_shrinking(rec(meta)).unwrap();
        let (r, _) = decode(&f).unwrap().unwrap();
        assert_eq!(r.meta, json!({"route": "r", "req_headers_dropped": true}));
        // Then long strings (a client's session id, model, URI) are cut, headers kept
        // when that is enough.
        let meta = json!({
            "session_id": "s".repeat(70_000),
            "model": format!("{}é", "m".repeat(META_STRING_CUT - 1)),
            "route": "r",
            "req_headers": {"x": "h"},
        });
        let f = encode_shrinking(rec(meta)).unwrap();
        let (r, _) = decode(&f).unwrap().unwrap();
        assert_eq!(
            r.meta,
            json!({
                "session_id": format!("{}...", "s".repeat(META_STRING_CUT)),
                "model": format!("{}...", "m".repeat(META_STRING_CUT - 1)),
                "route": "r",
                "req_headers_dropped": true,
                "meta_cut": true,
            })
        );
        // A meta too large even then is an error.
        let meta: serde_json::Map<String, serde_json::Value> = (0..20)
            .map(|i| (format!("k{i}"), json!("v".repeat(META_STRING_CUT))))
            .collect();
        assert!(matches!(
            encode_shrinking(rec(meta.into())),
            Err(EncodeError::MetaTooLarge(_))
        ));
    }

    #[test]
    fn queue_bounds_drop_and_count_without_a_runtime() {
        // No writer task runs: everything queues until a bound is hit.
        let s = Sender::with_limits("127.0.0.1:9".parse().unwrap(), 3, 1 << 20);
        for _ in 0..3 {
            assert!(s.try_send(rec(json!({}))));
        }
        assert!(!s.try_send(rec(json!({}))));
        let st = s.stats();
        assert_eq!((st.queued_frames, st.dropped, st.written), (3, 1, 0));

        let one = encode_shrinking(rec(json!({}))).unwrap().len();
        let s = Sender::with_limits("127.0.0.1:9".parse().unwrap(), 100, one * 2);
        assert!(s.try_send(rec(json!({}))));
        assert!(s.try_send(rec(json!({}))));
        assert!(!s.try_send(rec(json!({}))));
        assert_eq!(s.stats().queued_bytes, one * 2);
        assert_eq!(s.stats().dropped, 1);

        let bad: serde_json::Map<String, serde_json::Value> = (0..20)
            .map(|i| (format!("k{i}"), json!("y".repeat(META_STRING_CUT))))
            .collect();
        let bad = rec(bad.into());
        assert!(!s.try_send(bad));
        assert_eq!(s.stats().encode_errors, 1);
        s.stop();
        assert!(!s.try_send(rec(json!({}))));
        assert_eq!(s.stats().dropped, 2);
    }

    #[test]
    fn frames_lost_after_queueing_report_their_tags() {
        let s = Sender::with_limits("127.0.0.1:9".parse().unwrap(), 100, usize::MAX);
        let lost = Rc::new(RefCell::new(Vec::new()));
        let l = lost.clone();
        s.set_on_lost(Box::new(move |tag| l.borrow_mut().push(tag)));
        assert!(s.try_send_tagged(rec(json!({})), 3));
        assert!(s.try_send_tagged(rec(json!({})), 5));
        assert!(s.try_send(rec(json!({}))));
        // A write that failed loses its batch: each tagged frame is reported.
        let (mut b, mut t) = (Vec::new(), Vec::new());
        assert_eq!(s.fill_batch(&mut b, &mut t), 3);
        s.lose(&t, "test");
        assert_eq!(*lost.borrow(), [3, 5], "untagged frames are not reported");
        assert_eq!(s.stats().dropped, 3);
        // Frames still queued when the sender stops are lost too.
        lost.borrow_mut().clear();
        assert!(s.try_send_tagged(rec(json!({})), 7));
        s.drop_queue();
        assert_eq!(*lost.borrow(), [7]);
        assert_eq!(s.stats().dropped, 4);
        // A frame refused at the door is its caller's to count, not the hook's.
        lost.borrow_mut().clear();
        s.stop();
        assert!(!s.try_send_tagged(rec(json!({})), 9));
        assert!(lost.borrow().is_empty());
    }

    #[test]
    fn batches_coalesce_small_frames_and_send_big_ones_alone() {
        let s = Sender::with_limits("127.0.0.1:9".parse().unwrap(), 100, usize::MAX);
        for _ in 0..3 {
            s.try_send(rec(json!({})));
        }
        let big = Record {
            meta: json!({}),
            request: vec![0; BATCH_BYTES],
            response: vec![],
        };
        s.try_send(big);
        s.try_send(rec(json!({})));
        let (mut b, mut t) = (Vec::new(), Vec::new());
        assert_eq!(s.fill_batch(&mut b, &mut t), 3);
        assert_eq!(t, [NO_TAG; 3]);
        b.clear();
        assert_eq!(s.fill_batch(&mut b, &mut t), 1);
        assert!(b.len() > BATCH_BYTES);
        b.clear();
        assert_eq!(s.fill_batch(&mut b, &mut t), 1);
        b.clear();
        assert_eq!(s.fill_batch(&mut b, &mut t), 0);
        assert_eq!(s.stats().queued_bytes, 0);
    }
}

#[cfg(test)]
mod reconnect_tests {
    use super::*;

    /// A listener that accepts and closes at once (a proxy in front of a listener that is
    /// down) is retried with backoff, as a refused connect is: it was reconnected at once,
    /// tens of thousands of times a second, with two log lines each.
    #[test]
    fn a_listener_that_closes_each_connection_at_once_is_retried_with_backoff() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(s);
            }
        });
        let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        let connects = rt.block_on(async move {
            let s = Sender::new(addr);
            let task = monoio::spawn(s.clone().run());
            monoio::time::sleep(Duration::from_millis(1600)).await;
            s.stop();
            task.await;
            s.stats().connects
        });
        let n = accepted.load(std::sync::atomic::Ordering::SeqCst);
        // 100 + 200 + 400 + 800 ms of backoff fit in 1.6 s: five connects at most.
        assert!(
            n <= 6 && connects <= 6,
            "{n} accepted, {connects} connects in 1.6 s"
        );
        // The control: it does keep trying.
        assert!(n >= 2, "{n} accepted");
    }
}
