//! `warmroute bodylog-listen --listen ADDR --dir DIR [--metrics-listen ADDR]` (SPEC §9,
//! notes-edges §3.7): receives frames from the routers' senders, writes one JSON line per
//! record to `DIR/YYYY-MM-DD/HH.jsonl` and serves Prometheus `/metrics`.
//!
//! Not on the request path, so plain threads and blocking IO:
//! * an accept thread (at most [`MAX_CONNECTIONS`] router connections; more are closed);
//! * one thread per connection: reads a frame (the length prefix is validated before the
//!   buffer grows, so a connection holds at most one [`crate::bodylog::FRAME_MAX_BYTES`]
//!   frame), assembles the record ([`super::assemble`]), updates the metrics and hands the line
//!   to the writer through a bounded channel ([`WRITE_QUEUE_LINES`]) — when the disk is slow
//!   the connection threads block, the routers' queues fill and *they* drop and count. A
//!   framing error closes that connection and counts `decode_errors`;
//! * one writer thread owning the open hourly file. The hour is the record's UTC start
//!   (meta `ts_ms`; the listener's clock when absent — the reference uses its write-time
//!   clock). A change of hour closes the file and opens the next (append, created with its
//!   day directory). A failed open or write (disk full) drops that record, counts
//!   `write_errors` and retries the open on the next record;
//! * a metrics thread answering `GET /metrics` and `GET /healthz` (one request per
//!   connection).
//!
//! Stopping: set the `stop` flag (or call [`ListenerHandle::stop`]). The accept loops poll it
//! every 20 ms; connection sockets are shut down, lines already decoded are written, then
//! every thread is joined.
//!
//! # Metrics (Prometheus text format)
//! Per `route` and `owner` (meta fields; `unknown` / `-` when absent; at most
//! [`MAX_SERIES`] pairs, later pairs are folded into `route="_other",owner="_other"`):
//! * `warmroute_bodylog_requests_total{route,owner,status_class}` — `2xx`…`5xx`, `other`;
//! * `warmroute_bodylog_prompt_tokens_total`, `warmroute_bodylog_cached_tokens_total`,
//!   `warmroute_bodylog_completion_tokens_total` `{route,owner}`;
//! * `warmroute_bodylog_ttft_seconds{route,owner,prompt_bucket}` histogram of `first_chunk_t`
//!   for streamed requests; `le` buckets [`TTFT_BUCKETS_S`] seconds; `prompt_bucket` from
//!   prompt tokens in units of 1,024, left-closed: `0-1k`, `1k-4k`, `4k-16k`, `16k-32k`,
//!   `32k-64k`, `64k-128k`, `128k+`, `unknown` (no token count).
//!
//! Listener-wide: `warmroute_bodylog_records_total` (decoded), `_records_written_total`,
//! `_write_errors_total`, `_decode_errors_total`, `_partial_frames_total` (connection closed
//! mid-frame), `_connections_total`, `_connections_refused_total`, gauge
//! `warmroute_bodylog_connections`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, Receiver, Sender as ChanSender};

use super::assemble::{assemble, hour_path, Summary};
use super::frame::{decode, frame_len};

/// Router connections served at once (a router opens one per worker).
pub const MAX_CONNECTIONS: usize = 256;
/// Lines decoded but not yet written; beyond this the connection threads wait.
pub const WRITE_QUEUE_LINES: usize = 64;
/// (route, owner) pairs tracked in `/metrics`.
pub const MAX_SERIES: usize = 1024;
/// TTFT histogram upper bounds, seconds.
pub const TTFT_BUCKETS_S: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0,
];
/// Prompt-length buckets: (lower bound in 1,024-token units, label).
const PROMPT_BUCKETS: [(u64, &str); 7] = [
    (0, "0-1k"),
    (1, "1k-4k"),
    (4, "4k-16k"),
    (16, "16k-32k"),
    (32, "32k-64k"),
    (64, "64k-128k"),
    (128, "128k+"),
];
const PROMPT_UNKNOWN: usize = PROMPT_BUCKETS.len();
const POLL: Duration = Duration::from_millis(20);

/// Everything `bodylog-listen` needs.
#[derive(Debug, Clone)]
pub struct ListenerConfig {
    pub listen: SocketAddr,
    /// Default: the listen port + 1 (port 0 stays 0).
    pub metrics_listen: Option<SocketAddr>,
    pub dir: PathBuf,
    pub stop: Arc<AtomicBool>,
}

impl ListenerConfig {
    /// Parse `--listen ADDR --dir DIR [--metrics-listen ADDR]` (the arguments after the
    /// subcommand). `--flag=value` is accepted too.
    pub fn parse_args(args: &[String], stop: Arc<AtomicBool>) -> Result<ListenerConfig, String> {
        let (mut listen, mut metrics, mut dir) = (None, None, None);
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let (flag, inline) = match a.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
                _ => (a.as_str(), None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| it.next().cloned())
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            match flag {
                "--listen" => listen = Some(parse_addr(flag, &value()?)?),
                "--metrics-listen" => metrics = Some(parse_addr(flag, &value()?)?),
                "--dir" => dir = Some(PathBuf::from(value()?)),
                other => return Err(format!("unknown argument {other}")),
            }
        }
        Ok(ListenerConfig {
            listen: listen.ok_or("--listen ADDR is required")?,
            metrics_listen: metrics,
            dir: dir.ok_or("--dir DIR is required")?,
            stop,
        })
    }
}

fn parse_addr(flag: &str, v: &str) -> Result<SocketAddr, String> {
    v.parse()
        .map_err(|e| format!("{flag} {v}: {e} (expected IP:PORT)"))
}

/// Counters, as a snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListenerStats {
    pub records: u64,
    pub records_written: u64,
    pub write_errors: u64,
    pub decode_errors: u64,
    pub partial_frames: u64,
    pub connections_total: u64,
    pub connections_refused: u64,
    pub connections_open: u64,
}

#[derive(Default)]
struct Counters {
    records: AtomicU64,
    records_written: AtomicU64,
    write_errors: AtomicU64,
    decode_errors: AtomicU64,
    partial_frames: AtomicU64,
    connections_total: AtomicU64,
    connections_refused: AtomicU64,
    connections_open: AtomicU64,
}

struct Shared {
    stop: Arc<AtomicBool>,
    counters: Counters,
    /// Clones of the open router sockets, to shut them down on stop.
    conns: Mutex<HashMap<u64, TcpStream>>,
    metrics: Mutex<Metrics>,
}

/// A running listener.
pub struct ListenerHandle {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl ListenerHandle {
    pub fn stats(&self) -> ListenerStats {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ListenerStats {
            records: g(&c.records),
            records_written: g(&c.records_written),
            write_errors: g(&c.write_errors),
            decode_errors: g(&c.decode_errors),
            partial_frames: g(&c.partial_frames),
            connections_total: g(&c.connections_total),
            connections_refused: g(&c.connections_refused),
            connections_open: g(&c.connections_open),
        }
    }

    /// The `/metrics` text, as served.
    pub fn metrics_text(&self) -> String {
        render_metrics(&self.shared)
    }

    /// Set the stop flag and wait for every thread (lines already decoded are written).
    /// Both ports are closed when this returns.
    pub fn stop(self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.wait();
    }

    /// Block until the stop flag is set (by a signal handler, say) and everything ended.
    pub fn wait(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// Start a listener with metrics on the listen port + 1.
pub fn run_listener(
    listen: SocketAddr,
    dir: PathBuf,
    stop: Arc<AtomicBool>,
) -> io::Result<ListenerHandle> {
    run_listener_with(ListenerConfig {
        listen,
        metrics_listen: None,
        dir,
        stop,
    })
}

pub fn run_listener_with(cfg: ListenerConfig) -> io::Result<ListenerHandle> {
    std::fs::create_dir_all(&cfg.dir)?;
    let listener = TcpListener::bind(cfg.listen)?;
    let addr = listener.local_addr()?;
    let metrics_listen = match cfg.metrics_listen {
        Some(a) => a,
        None => {
            let mut a = cfg.listen;
            if a.port() != 0 {
                let p = a.port().checked_add(1).ok_or_else(|| {
                    io::Error::new(ErrorKind::InvalidInput, "no port after 65535 for metrics")
                })?;
                a.set_port(p);
            }
            a
        }
    };
    let metrics = TcpListener::bind(metrics_listen)?;
    let metrics_addr = metrics.local_addr()?;
    listener.set_nonblocking(true)?;
    metrics.set_nonblocking(true)?;

    let shared = Arc::new(Shared {
        stop: cfg.stop,
        counters: Counters::default(),
        conns: Mutex::new(HashMap::new()),
        metrics: Mutex::new(Metrics::default()),
    });
    let (tx, rx) = bounded::<Line>(WRITE_QUEUE_LINES);
    let mut threads = Vec::new();
    let s = shared.clone();
    let dir = cfg.dir.clone();
    threads.push(spawn("bodylog-writer", move || writer_loop(&s, &dir, rx))?);
    let s = shared.clone();
    threads.push(spawn("bodylog-accept", move || {
        accept_loop(&s, listener, tx)
    })?);
    let s = shared.clone();
    threads.push(spawn("bodylog-metrics", move || metrics_loop(&s, metrics))?);
    tracing::info!(%addr, %metrics_addr, dir = %cfg.dir.display(), "bodylog listener started");
    Ok(ListenerHandle {
        addr,
        metrics_addr,
        shared,
        threads,
    })
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name.into()).spawn(f)
}

struct Line {
    ts_ms: u64,
    bytes: Vec<u8>,
}

fn accept_loop(shared: &Arc<Shared>, listener: TcpListener, tx: ChanSender<Line>) {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    while !shared.stop.load(Ordering::SeqCst) {
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                workers.retain(|w| !w.is_finished());
                std::thread::sleep(POLL);
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "bodylog accept failed");
                std::thread::sleep(POLL);
                continue;
            }
        };
        let c = &shared.counters;
        if c.connections_open.load(Ordering::Relaxed) as usize >= MAX_CONNECTIONS {
            c.connections_refused.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        }
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        if stream.set_nonblocking(false).is_err() {
            continue;
        }
        next_id += 1;
        let id = next_id;
        lock(&shared.conns).insert(id, clone);
        c.connections_total.fetch_add(1, Ordering::Relaxed);
        c.connections_open.fetch_add(1, Ordering::Relaxed);
        let s = shared.clone();
        let tx = tx.clone();
        let r = spawn("bodylog-conn", move || {
            conn_loop(&s, stream, peer, &tx);
            lock(&s.conns).remove(&id);
            s.counters.connections_open.fetch_sub(1, Ordering::Relaxed);
        });
        match r {
            Ok(h) => workers.push(h),
            Err(e) => {
                tracing::warn!(error = %e, "bodylog: cannot start a connection thread");
                lock(&shared.conns).remove(&id);
                c.connections_open.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
    drop(listener);
    for (_, s) in lock(&shared.conns).iter() {
        let _ = s.shutdown(Shutdown::Both);
    }
    for w in workers {
        let _ = w.join();
    }
}

fn conn_loop(shared: &Shared, mut stream: TcpStream, peer: SocketAddr, tx: &ChanSender<Line>) {
    let source = peer.ip().to_string();
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let mut prefix = [0u8; 4];
        match read_full(&mut stream, &mut prefix) {
            Ok(0) => return,
            Ok(4) => {}
            Ok(_) | Err(_) => {
                shared
                    .counters
                    .partial_frames
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let total = match frame_len(prefix) {
            Ok(t) => t,
            Err(e) => return bad_frame(shared, peer, &e.to_string()),
        };
        buf.clear();
        buf.extend_from_slice(&prefix);
        buf.resize(4 + total, 0);
        match read_full(&mut stream, &mut buf[4..]) {
            Ok(n) if n == total => {}
            _ => {
                shared
                    .counters
                    .partial_frames
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let rec = match decode(&buf) {
            Ok(Some((rec, _))) => rec,
            Ok(None) => return bad_frame(shared, peer, "incomplete frame"),
            Err(e) => return bad_frame(shared, peer, &e.to_string()),
        };
        // Do not keep a multi-MiB buffer around for the next small frame.
        if buf.capacity() > 1 << 20 {
            buf = Vec::new();
        }
        shared.counters.records.fetch_add(1, Ordering::Relaxed);
        let a = assemble(rec, Some(&source), now_ms());
        lock(&shared.metrics).observe(&a.summary);
        if tx
            .send(Line {
                ts_ms: a.ts_ms,
                bytes: a.line,
            })
            .is_err()
        {
            return;
        }
    }
}

fn bad_frame(shared: &Shared, peer: SocketAddr, why: &str) {
    shared
        .counters
        .decode_errors
        .fetch_add(1, Ordering::Relaxed);
    tracing::warn!(%peer, error = why, "bodylog framing error; closing the connection");
}

/// Read until `buf` is full or EOF; returns the bytes read.
fn read_full(s: &mut TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match s.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn writer_loop(shared: &Shared, dir: &Path, rx: Receiver<Line>) {
    let mut current: Option<((String, String), File)> = None;
    for line in rx {
        let key = hour_path(line.ts_ms);
        if current.as_ref().map(|(k, _)| k) != Some(&key) {
            current = None;
            match open_hour(dir, &key) {
                Ok(f) => current = Some((key.clone(), f)),
                Err(e) => {
                    write_error(shared, &e, &key);
                    continue;
                }
            }
        }
        let Some((_, f)) = current.as_mut() else {
            continue;
        };
        match f.write_all(&line.bytes) {
            Ok(()) => {
                shared
                    .counters
                    .records_written
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                write_error(shared, &e, &key);
                // Reopen on the next record: the file may have been removed or the disk
                // freed; a partial line is possible after a short write on a full disk.
                current = None;
            }
        }
    }
}

fn open_hour(dir: &Path, key: &(String, String)) -> io::Result<File> {
    let day = dir.join(&key.0);
    std::fs::create_dir_all(&day)?;
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(day.join(&key.1))
}

fn write_error(shared: &Shared, e: &io::Error, key: &(String, String)) {
    let n = shared.counters.write_errors.fetch_add(1, Ordering::Relaxed) + 1;
    if n % 1000 == 1 {
        tracing::warn!(error = %e, file = %format!("{}/{}", key.0, key.1), write_errors = n, "bodylog write failed; record dropped");
    }
}

fn metrics_loop(shared: &Shared, listener: TcpListener) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, _)) => {
                let _ = serve_metrics(shared, s);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

fn serve_metrics(shared: &Shared, mut s: TcpStream) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut chunk)?;
        if n == 0 || head.len() > 8192 {
            break;
        }
        head.extend_from_slice(&chunk[..n]);
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or(&[]);
    let mut parts = line.split(|&b| b == b' ');
    let method = parts.next().unwrap_or(&[]);
    let target = parts.next().unwrap_or(&[]);
    let path = target.split(|&b| b == b'?').next().unwrap_or(&[]);
    let (status, ctype, body) = match (method, path) {
        (b"GET", b"/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            render_metrics(shared),
        ),
        (b"GET", b"/healthz") => ("200 OK", "text/plain", "ok\n".to_string()),
        _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(resp.as_bytes())
}

#[derive(Default)]
struct Series {
    /// 2xx, 3xx, 4xx, 5xx, other.
    requests: [u64; 5],
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
    /// Per prompt bucket (+ unknown).
    ttft: [Option<Hist>; PROMPT_BUCKETS.len() + 1],
}

#[derive(Default, Clone)]
struct Hist {
    counts: [u64; TTFT_BUCKETS_S.len()],
    count: u64,
    sum: f64,
}

#[derive(Default)]
struct Metrics {
    series: HashMap<(String, String), Series>,
}

const STATUS_CLASSES: [&str; 5] = ["2xx", "3xx", "4xx", "5xx", "other"];

fn prompt_bucket(tokens: Option<u64>) -> usize {
    match tokens {
        None => PROMPT_UNKNOWN,
        Some(t) => {
            let k = t / 1024;
            PROMPT_BUCKETS
                .iter()
                .rposition(|(lo, _)| k >= *lo)
                .unwrap_or(0)
        }
    }
}

impl Metrics {
    fn observe(&mut self, s: &Summary) {
        let mut key = (s.route.clone(), s.owner.clone());
        if !self.series.contains_key(&key) && self.series.len() >= MAX_SERIES {
            key = ("_other".into(), "_other".into());
        }
        let e = self.series.entry(key).or_default();
        let class = match s.status {
            200..=299 => 0,
            300..=399 => 1,
            400..=499 => 2,
            500..=599 => 3,
            _ => 4,
        };
        e.requests[class] += 1;
        e.prompt_tokens += s.prompt_tokens.unwrap_or(0);
        e.cached_tokens += s.cached_tokens.unwrap_or(0);
        e.completion_tokens += s.completion_tokens.unwrap_or(0);
        if let Some(t) = s.ttft_s {
            let h = e.ttft[prompt_bucket(s.prompt_tokens)].get_or_insert_with(Hist::default);
            for (i, le) in TTFT_BUCKETS_S.iter().enumerate() {
                if t <= *le {
                    h.counts[i] += 1;
                }
            }
            h.count += 1;
            h.sum += t;
        }
    }
}

fn esc(v: &str) -> String {
    let mut o = String::with_capacity(v.len());
    for ch in v.chars() {
        match ch {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
    o
}

fn render_metrics(shared: &Shared) -> String {
    let mut out = String::new();
    let c = &shared.counters;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let globals: [(&str, &str, &str, u64); 8] = [
        (
            "warmroute_bodylog_records_total",
            "counter",
            "Frames decoded.",
            g(&c.records),
        ),
        (
            "warmroute_bodylog_records_written_total",
            "counter",
            "JSONL records written.",
            g(&c.records_written),
        ),
        (
            "warmroute_bodylog_write_errors_total",
            "counter",
            "Records dropped because the file could not be opened or written.",
            g(&c.write_errors),
        ),
        (
            "warmroute_bodylog_decode_errors_total",
            "counter",
            "Connections closed on a framing error.",
            g(&c.decode_errors),
        ),
        (
            "warmroute_bodylog_partial_frames_total",
            "counter",
            "Connections that ended in the middle of a frame.",
            g(&c.partial_frames),
        ),
        (
            "warmroute_bodylog_connections_total",
            "counter",
            "Router connections accepted.",
            g(&c.connections_total),
        ),
        (
            "warmroute_bodylog_connections_refused_total",
            "counter",
            "Router connections closed at once (too many open).",
            g(&c.connections_refused),
        ),
        (
            "warmroute_bodylog_connections",
            "gauge",
            "Router connections open.",
            g(&c.connections_open),
        ),
    ];
    for (name, kind, help, v) in globals {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    }
    let m = lock(&shared.metrics);
    let mut keys: Vec<&(String, String)> = m.series.keys().collect();
    keys.sort();
    let lbl = |k: &(String, String)| format!("route=\"{}\",owner=\"{}\"", esc(&k.0), esc(&k.1));

    let name = "warmroute_bodylog_requests_total";
    let _ = writeln!(
        out,
        "# HELP {name} Logged requests by status class.\n# TYPE {name} counter"
    );
    for k in &keys {
        let s = &m.series[*k];
        for (i, class) in STATUS_CLASSES.iter().enumerate() {
            if s.requests[i] > 0 {
                let _ = writeln!(
                    out,
                    "{name}{{{},status_class=\"{class}\"}} {}",
                    lbl(k),
                    s.requests[i]
                );
            }
        }
    }
    type Field = fn(&Series) -> u64;
    let tokens: [(&str, &str, Field); 3] = [
        (
            "warmroute_bodylog_prompt_tokens_total",
            "Prompt tokens.",
            |s| s.prompt_tokens,
        ),
        (
            "warmroute_bodylog_cached_tokens_total",
            "Prompt tokens served from the prefix cache.",
            |s| s.cached_tokens,
        ),
        (
            "warmroute_bodylog_completion_tokens_total",
            "Completion tokens.",
            |s| s.completion_tokens,
        ),
    ];
    for (name, help, f) in tokens {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for k in &keys {
            let _ = writeln!(out, "{name}{{{}}} {}", lbl(k), f(&m.series[*k]));
        }
    }
    let name = "warmroute_bodylog_ttft_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Time to the first response byte of streamed requests, by prompt length.\n# TYPE {name} histogram"
    );
    for k in &keys {
        for (b, h) in m.series[*k].ttft.iter().enumerate() {
            let Some(h) = h else { continue };
            let pb = PROMPT_BUCKETS.get(b).map_or("unknown", |p| p.1);
            let l = format!("{},prompt_bucket=\"{pb}\"", lbl(k));
            for (i, le) in TTFT_BUCKETS_S.iter().enumerate() {
                let _ = writeln!(out, "{name}_bucket{{{l},le=\"{le}\"}} {}", h.counts[i]);
            }
            let _ = writeln!(out, "{name}_bucket{{{l},le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(out, "{name}_sum{{{l}}} {}", h.sum);
            let _ = writeln!(out, "{name}_count{{{l}}} {}", h.count);
        }
    }
    out
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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

    #[test]
    fn args_parse_with_defaults_and_errors() {
        let stop = Arc::new(AtomicBool::new(false));
        let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let c = ListenerConfig::parse_args(
            &a(&["--listen", "127.0.0.1:9999", "--dir=/x"]),
            stop.clone(),
        )
        .unwrap();
        assert_eq!(c.listen, "127.0.0.1:9999".parse().unwrap());
        assert_eq!(c.metrics_listen, None);
        assert_eq!(c.dir, PathBuf::from("/x"));
        let c = ListenerConfig::parse_args(
            &a(&[
                "--dir",
                "d",
                "--listen",
                "0.0.0.0:1",
                "--metrics-listen",
                "0.0.0.0:2",
            ]),
            stop.clone(),
        )
        .unwrap();
        assert_eq!(c.metrics_listen, Some("0.0.0.0:2".parse().unwrap()));
        assert!(ListenerConfig::parse_args(&a(&["--dir", "d"]), stop.clone()).is_err());
        assert!(
            ListenerConfig::parse_args(&a(&["--listen", "nope", "--dir", "d"]), stop.clone())
                .is_err()
        );
        assert!(ListenerConfig::parse_args(&a(&["--listen"]), stop.clone()).is_err());
        assert!(ListenerConfig::parse_args(&a(&["--bogus", "1"]), stop).is_err());
    }

    #[test]
    fn prompt_buckets_are_left_closed() {
        let b = |t: u64| PROMPT_BUCKETS[prompt_bucket(Some(t))].1;
        assert_eq!(b(0), "0-1k");
        assert_eq!(b(1023), "0-1k");
        assert_eq!(b(1024), "1k-4k");
        assert_eq!(b(4095), "1k-4k");
        assert_eq!(b(4096), "4k-16k");
        assert_eq!(b(200_000), "128k+");
        assert_eq!(prompt_bucket(None), PROMPT_UNKNOWN);
    }

    #[test]
    fn series_are_bounded_and_histograms_cumulative() {
        let mut m = Metrics::default();
        for i in 0..(MAX_SERIES + 10) {
            m.observe(&Summary {
                route: format!("r{i}"),
                owner: "o".into(),
                status: 200,
                prompt_tokens: Some(2000),
                ttft_s: Some(0.3),
                ..Summary::default()
            });
        }
        assert_eq!(m.series.len(), MAX_SERIES + 1);
        let other = &m.series[&("_other".to_string(), "_other".to_string())];
        assert_eq!(other.requests[0], 10);
        let h = other.ttft[1].as_ref().unwrap();
        assert_eq!(h.counts[2], 0, "0.3 > 0.25");
        assert_eq!(h.counts[3], 10, "0.3 <= 0.5");
        assert_eq!(h.counts[TTFT_BUCKETS_S.len() - 1], 10);
    }
}
