//! `warmroute-mock`: an OpenAI-compatible LLM backend simulator (SPEC §13).
//!
//! It simulates an inference engine with a prefix cache (LRU of chained token-block hashes),
//! a TTFT that grows with the uncached prompt tokens, a decode rate, a concurrency limit and
//! failure knobs, so that affinity routing has a measurable effect. Each worker thread runs
//! its own monoio runtime with a `SO_REUSEPORT` listener on the shared port.
//!
//! Per-request overrides (request headers, taking precedence over [`MockConfig`]):
//! `x-mock-status`, `x-mock-ttft-ms`, `x-mock-hang-ms`, `x-mock-tokens`,
//! `x-mock-interval-ms`, `x-mock-close-after`, `x-mock-echo: 1`, `x-mock-no-length: 1`.
//! See [`engine`] for their exact meaning and the timing model.
//!
//! ```no_run
//! use warmroute_mock::{MockConfig, MockServer};
//! let mock = MockServer::start(
//!     "127.0.0.1:0".parse().unwrap(),
//!     MockConfig { name: "a".into(), ..MockConfig::default() },
//! )
//! .unwrap();
//! println!("mock on {}", mock.addr());
//! mock.set_config(|c| c.fail_status = Some(503)); // fail from now on
//! mock.set_config(|c| c.fail_status = None); // recover
//! assert_eq!(mock.stats().active, 0);
//! mock.shutdown();
//! ```

#![forbid(unsafe_code)]

pub mod cache;
mod conn;
pub mod engine;
pub mod http;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

/// Knobs of a mock instance. Read at the start of every request; change them at runtime
/// with [`MockServer::set_config`].
#[derive(Clone, Debug)]
pub struct MockConfig {
    /// Sent as `x-mock-peer` on every response; the `owned_by` of the models.
    pub name: String,
    /// Served models, listed by `/v1/models`. Requests for other models are served anyway.
    pub models: Vec<String>,
    /// Fixed part of the time to first token.
    pub ttft_base_ms: u64,
    /// Prefill cost of each uncached prompt token.
    pub ttft_per_uncached_token_us: u64,
    /// Tokens per second while generating (0 = as fast as possible).
    pub decode_tps: f64,
    /// Completion tokens when the request has no `max_tokens` / `max_completion_tokens`.
    pub max_tokens_default: u32,
    /// Prefix cache size in tokens; 0 disables caching.
    pub cache_capacity_tokens: u64,
    /// Cache block size in tokens; 0 disables caching.
    pub block_tokens: u32,
    /// Active completion requests allowed at once (0 = unlimited).
    pub max_concurrency: u32,
    /// Above `max_concurrency`: true = answer 429, false = queue until a slot frees (first
    /// come, first served; the hang, prefill and decode start once the slot is taken).
    pub busy_429: bool,
    /// Answer every completion request with this status and an OpenAI-shaped error body.
    pub fail_status: Option<u16>,
    /// Answer `/health` with this status instead of 200.
    pub health_status: Option<u16>,
    /// Extra silent wait before the first response byte (a prefill hang).
    pub hang_ms: u64,
    /// Close the connection mid-stream after this many SSE events.
    pub close_after_events: Option<u32>,
    /// Requests during the first `slow_start_ms` after start get an extra TTFT delay that
    /// decays linearly from `slow_start_ms` to 0 over that window.
    pub slow_start_ms: u64,
    /// Runtime threads (each with its own listener on the shared port); fixed at start.
    pub workers: usize,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            name: "mock".to_string(),
            models: vec!["mock-model".to_string()],
            ttft_base_ms: 20,
            ttft_per_uncached_token_us: 50,
            decode_tps: 200.0,
            max_tokens_default: 16,
            cache_capacity_tokens: 1_000_000,
            block_tokens: 16,
            max_concurrency: 0,
            busy_429: true,
            fail_status: None,
            health_status: None,
            hang_ms: 0,
            close_after_events: None,
            slow_start_ms: 0,
            workers: 1,
        }
    }
}

/// Counters of a mock instance, also served at `GET /_stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    /// Completion requests received (any outcome).
    pub requests: u64,
    /// Completion requests answered in full with 200.
    pub completions: u64,
    /// Completion requests currently admitted (prefilling or generating).
    pub active: u64,
    /// Highest `active` seen.
    pub max_active: u64,
    /// Sum of prompt tokens of admitted completion requests.
    pub prompt_tokens: u64,
    /// Sum of prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Sum of completion tokens produced.
    pub completion_tokens: u64,
    /// Completion requests answered 429 because of `max_concurrency`.
    pub rejected_busy: u64,
    /// Requests whose client went away before the response was complete.
    pub client_disconnects: u64,
    /// Accepted TCP connections.
    pub connections: u64,
    /// HTTP requests of any kind (health checks, stats, ...).
    pub http_requests: u64,
    /// Connections closed on purpose mid-stream (`close_after_events` / `x-mock-close-after`).
    pub mid_stream_closes: u64,
}

/// A notable event, with the time it happened.
#[derive(Clone, Debug, serde::Serialize)]
pub enum MockEvent {
    /// The client closed or reset its connection before the response was complete.
    /// `during`: `"queue"` (waiting for a concurrency slot), `"prefill"` (before the first
    /// token: hang and TTFT), `"decode"` (non-stream generation) or `"stream"` (between SSE
    /// events or on a failed write).
    ClientGone {
        #[serde(skip)]
        at: Instant,
        during: &'static str,
    },
    /// The mock closed a stream on purpose after `events` SSE events.
    ClosedMidStream {
        #[serde(skip)]
        at: Instant,
        events: u32,
    },
    /// A completion request was rejected with 429 (concurrency limit).
    RejectedBusy {
        #[serde(skip)]
        at: Instant,
    },
    /// A completion request was answered with a configured or requested error status.
    Failed {
        #[serde(skip)]
        at: Instant,
        status: u16,
    },
    /// A completion request finished normally.
    Completed {
        #[serde(skip)]
        at: Instant,
        prompt_tokens: u64,
        cached_tokens: u64,
        completion_tokens: u64,
    },
}

impl MockEvent {
    /// When the event happened.
    pub fn at(&self) -> Instant {
        match self {
            MockEvent::ClientGone { at, .. }
            | MockEvent::ClosedMidStream { at, .. }
            | MockEvent::RejectedBusy { at }
            | MockEvent::Failed { at, .. }
            | MockEvent::Completed { at, .. } => *at,
        }
    }
}

/// Events kept by [`MockServer::events`].
pub const EVENT_LOG_LEN: usize = 1024;

#[derive(Default)]
pub(crate) struct Stats {
    pub requests: AtomicU64,
    pub completions: AtomicU64,
    pub active: AtomicU64,
    pub max_active: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub rejected_busy: AtomicU64,
    pub client_disconnects: AtomicU64,
    pub connections: AtomicU64,
    pub http_requests: AtomicU64,
    pub mid_stream_closes: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Stats {
    fn snapshot(&self) -> StatsSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            requests: g(&self.requests),
            completions: g(&self.completions),
            active: g(&self.active),
            max_active: g(&self.max_active),
            prompt_tokens: g(&self.prompt_tokens),
            cached_tokens: g(&self.cached_tokens),
            completion_tokens: g(&self.completion_tokens),
            rejected_busy: g(&self.rejected_busy),
            client_disconnects: g(&self.client_disconnects),
            connections: g(&self.connections),
            http_requests: g(&self.http_requests),
            mid_stream_closes: g(&self.mid_stream_closes),
        }
    }
}

/// State shared by the workers of one instance.
pub(crate) struct Shared {
    cfg: Mutex<Arc<MockConfig>>,
    pub stats: Stats,
    events: Mutex<VecDeque<MockEvent>>,
    pub cache: Mutex<cache::PrefixCache>,
    pub started: Instant,
    pub stop: AtomicBool,
    pub seq: AtomicU64,
    /// Requests waiting for a concurrency slot (`busy_429 = false`), by ticket, oldest first.
    queue: Mutex<VecDeque<u64>>,
    tickets: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub fn config(&self) -> Arc<MockConfig> {
        lock(&self.cfg).clone()
    }

    pub fn event(&self, e: MockEvent) {
        let mut ev = lock(&self.events);
        if ev.len() >= EVENT_LOG_LEN {
            ev.pop_front();
        }
        ev.push_back(e);
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    pub fn cache(&self) -> MutexGuard<'_, cache::PrefixCache> {
        lock(&self.cache)
    }

    pub fn queue(&self) -> MutexGuard<'_, VecDeque<u64>> {
        lock(&self.queue)
    }

    pub fn ticket(&self) -> u64 {
        self.tickets.fetch_add(1, Ordering::Relaxed)
    }
}

/// A running mock instance. Dropping it shuts it down.
pub struct MockServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl MockServer {
    /// Bind `addr` (port 0 allowed) and serve on `cfg.workers` threads (at least 1), each with
    /// its own monoio runtime and a `SO_REUSEPORT` listener on the same port.
    pub fn start(addr: SocketAddr, cfg: MockConfig) -> std::io::Result<MockServer> {
        let workers = cfg.workers.max(1);
        let shared = Arc::new(Shared {
            cfg: Mutex::new(Arc::new(cfg)),
            stats: Stats::default(),
            events: Mutex::new(VecDeque::new()),
            cache: Mutex::new(cache::PrefixCache::new()),
            started: Instant::now(),
            stop: AtomicBool::new(false),
            seq: AtomicU64::new(0),
            queue: Mutex::new(VecDeque::new()),
            tickets: AtomicU64::new(0),
        });
        let mut server = MockServer {
            addr,
            shared,
            threads: Vec::with_capacity(workers),
        };
        for i in 0..workers {
            let (tx, rx) = mpsc::channel();
            let shared = server.shared.clone();
            let bind = server.addr;
            let t = std::thread::Builder::new()
                .name(format!("mock-worker-{i}"))
                .spawn(move || conn::worker(bind, shared, tx))?;
            server.threads.push(t);
            match rx.recv() {
                Ok(Ok(bound)) => server.addr = bound,
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(std::io::Error::other("mock worker died while starting")),
            }
        }
        Ok(server)
    }

    /// The bound address (with the real port when started on port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Current counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.snapshot()
    }

    /// Current configuration.
    pub fn config(&self) -> MockConfig {
        (*self.shared.config()).clone()
    }

    /// Change knobs at runtime; requests starting afterwards see the new values.
    /// `workers` cannot be changed after start.
    pub fn set_config(&self, f: impl FnOnce(&mut MockConfig)) {
        let mut g = lock(&self.shared.cfg);
        let mut c = (**g).clone();
        f(&mut c);
        *g = Arc::new(c);
    }

    /// Empty the prefix cache.
    pub fn clear_cache(&self) {
        self.shared.cache().evict_to(0);
    }

    /// The last [`EVENT_LOG_LEN`] notable events, oldest first.
    pub fn events(&self) -> Vec<MockEvent> {
        lock(&self.shared.events).iter().cloned().collect()
    }

    /// Stop accepting, close every connection and join the worker threads.
    pub fn shutdown(self) {
        drop(self);
    }

    fn stop_and_join(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

impl std::fmt::Debug for MockServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockServer")
            .field("addr", &self.addr)
            .field("workers", &self.threads.len())
            .finish()
    }
}
