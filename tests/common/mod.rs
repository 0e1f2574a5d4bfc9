//! Shared helpers for the end-to-end tests: start the router and mock engines in-process
//! on port 0, a small blocking HTTP/1.1 client, and scripted raw backends.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use warmroute::server::{ConfigSource, Overrides, Router};
use warmroute::worker::AccessLogTarget;
use warmroute_mock::{MockConfig, MockServer};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A unique path for this test's shared segment.
pub fn shm_path(tag: &str) -> PathBuf {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("warmroute-test-{tag}-{}-{n}", std::process::id()))
}

pub fn mock(name: &str) -> MockServer {
    mock_with(name, |_| {})
}

pub fn mock_with(name: &str, f: impl FnOnce(&mut MockConfig)) -> MockServer {
    let mut cfg = MockConfig {
        name: name.into(),
        ttft_base_ms: 0,
        ttft_per_uncached_token_us: 0,
        decode_tps: 0.0,
        ..MockConfig::default()
    };
    f(&mut cfg);
    MockServer::start("127.0.0.1:0".parse().unwrap(), cfg).expect("mock starts")
}

/// A route file whose peers are the given addresses (names p0, p1, ...).
pub fn route_for(addrs: &[SocketAddr], extra: &str) -> String {
    let mut s = String::from("peers = [\n");
    for (i, a) in addrs.iter().enumerate() {
        s.push_str(&format!(
            "  {{ host = \"{}\", port = {}, name = \"p{i}\" }},\n",
            a.ip(),
            a.port()
        ));
    }
    s.push_str("]\n");
    s.push_str(extra);
    s
}

pub struct Env {
    pub router: Option<Router>,
    pub shm: PathBuf,
}

impl Env {
    pub fn public(&self) -> SocketAddr {
        self.router.as_ref().unwrap().public_addr()
    }
    pub fn admin(&self) -> SocketAddr {
        self.router.as_ref().unwrap().admin_addr()
    }
    pub fn router(&self) -> &Router {
        self.router.as_ref().unwrap()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(r) = self.router.take() {
            r.shutdown(Duration::from_secs(2));
        }
        let _ = std::fs::remove_file(&self.shm);
    }
}

/// Start the router in-process with these routes and an optional extra server TOML.
pub fn start(routes: &[(&str, String)], server_extra: &str) -> Env {
    start_logging(routes, server_extra, AccessLogTarget::Off)
}

/// `start`, with the access log going to `access_log`.
pub fn start_logging(
    routes: &[(&str, String)],
    server_extra: &str,
    access_log: AccessLogTarget,
) -> Env {
    let shm = shm_path("e2e");
    let server = format!("listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshm_path = \"{}\"\n{server_extra}", shm.display());
    let source = ConfigSource::Embedded {
        server: Some(server),
        routes: routes
            .iter()
            .map(|(n, t)| (n.to_string(), t.clone()))
            .collect(),
    };
    let overrides = Overrides {
        workers: Some(2),
        no_pin: true,
        access_log: Some(access_log),
        ..Overrides::default()
    };
    let router = Router::start(source, overrides).unwrap_or_else(|e| panic!("router starts: {e}"));
    wait_ready(router.admin_addr());
    Env {
        router: Some(router),
        shm,
    }
}

pub fn wait_ready(admin: SocketAddr) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        if let Ok(r) = try_request(admin, &get("/readyz")) {
            if r.status == 200 {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("router not ready");
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("json body ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").into_bytes()
}

pub fn post_json(path: &str, body: &str, extra_headers: &str) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra_headers}\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body.as_bytes());
    r
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// Send `raw` on the connection `r` reads and read one response (`head`: the request was
/// HEAD), leaving the connection open for the next.
pub fn exchange(r: &mut BufReader<TcpStream>, raw: &[u8], head: bool) -> Resp {
    r.get_mut().write_all(raw).unwrap();
    read_response(r, head).unwrap()
}

pub fn request(addr: SocketAddr, raw: &[u8]) -> Resp {
    try_request(addr, raw).unwrap_or_else(|e| panic!("request failed: {e}"))
}

pub fn try_request(addr: SocketAddr, raw: &[u8]) -> std::io::Result<Resp> {
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    s.write_all(raw)?;
    let mut r = BufReader::new(s);
    read_response(&mut r, raw.starts_with(b"HEAD "))
}

/// Read one response (head + body framed by Content-Length, chunked, or close).
pub fn read_response<R: BufRead>(r: &mut R, head_request: bool) -> std::io::Result<Resp> {
    let mut line = String::new();
    let mut status;
    let mut headers;
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "no response",
            ));
        }
        status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
        headers = Vec::new();
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            let (n, v) = l
                .split_once(':')
                .ok_or_else(|| std::io::Error::other("bad header"))?;
            headers.push((n.trim().to_string(), v.trim().to_string()));
        }
        if !(100..200).contains(&status) {
            break;
        }
    }
    let find = |n: &str| {
        headers
            .iter()
            .find(|(k, _): &&(String, String)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if head_request || status == 204 || status == 304 {
    } else if find("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| std::io::Error::other(format!("bad chunk size {line:?}")))?;
            if size == 0 {
                loop {
                    line.clear();
                    r.read_line(&mut line)?;
                    if line.trim_end().is_empty() {
                        break;
                    }
                }
                break;
            }
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk[..size]);
        }
    } else if let Some(n) = find("content-length") {
        let n: usize = n
            .parse()
            .map_err(|_| std::io::Error::other("bad content-length"))?;
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok(Resp {
        status,
        headers,
        body,
    })
}

/// Sum of in-flight over every peer of a route, read from `/_active_conns`.
pub fn inflight_total(env: &Env, route: &str) -> i64 {
    let r = request(env.public(), &get(&format!("/{route}/_active_conns")));
    assert_eq!(r.status, 200);
    r.json()
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_i64().unwrap())
        .sum()
}

/// Wait until a condition holds (polling), or panic after `limit`.
pub fn eventually(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("timed out waiting for: {what}");
}

/// A scripted backend: for each accepted connection, reads requests and answers each with
/// the next canned response from `script` (raw bytes). `close_after` closes the connection
/// after that many responses on it. Returns its address and a handle.
///
/// The router's health probes (`GET /v1/models`, the default probe path, sent from about
/// 0.5 s after it starts) get a 200 at once and count nowhere: not in `requests`, not in
/// `accepted`, not against the script or `close_after`. Counted, a probe that fell inside
/// a slow test run shifted the script and the counts the test asserts on.
pub struct RawBackend {
    pub addr: SocketAddr,
    pub requests: std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
    /// Connections that carried at least one request other than a health probe.
    pub accepted: std::sync::Arc<AtomicU32>,
    _h: JoinHandle<()>,
}

/// Whether `head` is the router's default health probe (`GET /v1/models`).
pub fn is_health_probe(head: &[u8]) -> bool {
    head.starts_with(b"GET /v1/models ")
}

/// A test backend's answer to a health probe: a 200 with an empty model list.
pub fn answer_health_probe(s: &mut TcpStream) -> std::io::Result<()> {
    s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"data\":[]}")
}

pub fn raw_backend(responses: Vec<Vec<u8>>, close_after: usize) -> RawBackend {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let accepted = std::sync::Arc::new(AtomicU32::new(0));
    let (rq, acc) = (requests.clone(), accepted.clone());
    let responses = std::sync::Arc::new(responses);
    let h = std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { continue };
            let (rq, acc, responses) = (rq.clone(), acc.clone(), responses.clone());
            std::thread::spawn(move || serve_script(s, &rq, &acc, &responses, close_after));
        }
    });
    RawBackend {
        addr,
        requests,
        accepted,
        _h: h,
    }
}

fn serve_script(
    mut s: TcpStream,
    rq: &std::sync::Mutex<Vec<Vec<u8>>>,
    accepted: &AtomicU32,
    responses: &[Vec<u8>],
    close_after: usize,
) {
    s.set_nodelay(true).ok();
    let mut served = 0;
    let mut buf = Vec::new();
    while let Some(req) = read_request(&mut s, &mut buf) {
        if is_health_probe(&req) {
            if answer_health_probe(&mut s).is_err() {
                break;
            }
            continue;
        }
        if served == 0 {
            accepted.fetch_add(1, Ordering::SeqCst);
        }
        // The script advances per request across all connections.
        let n = {
            let mut all = rq.lock().unwrap();
            all.push(req);
            all.len() - 1
        };
        let resp = &responses[n % responses.len()];
        if s.write_all(resp).is_err() {
            break;
        }
        served += 1;
        if served >= close_after {
            break;
        }
    }
}

/// The next request on `s` (its head and a `Content-Length` body) for a test backend; `buf`
/// keeps bytes read past it (pipelined requests) for the next call. `None` at EOF or on an
/// error.
pub fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut tmp = [0u8; 65536];
    loop {
        if let Some(end) = find_head_end(buf) {
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            let cl = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if buf.len() >= end + cl {
                return Some(buf.drain(..end + cl).collect());
            }
        }
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
}

/// Run `serve` on a thread of its own for every connection `l` accepts (a test backend).
pub fn serve_each(l: TcpListener, serve: impl Fn(TcpStream) + Clone + Send + 'static) {
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { continue };
            let serve = serve.clone();
            std::thread::spawn(move || serve(s));
        }
    });
}

fn find_head_end(b: &[u8]) -> Option<usize> {
    b.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

/// One non-streaming chat request to route `r` with `headers` (whole lines, each ending in
/// CRLF: a mock delay such as `x-mock-ttft-ms`, which holds it in flight), on its own
/// thread.
pub fn held_chat(addr: SocketAddr, headers: &str) -> JoinHandle<Resp> {
    let headers = headers.to_string();
    std::thread::spawn(move || {
        request(
            addr,
            &post_json("/r/v1/chat/completions", &chat_body("x", false), &headers),
        )
    })
}

/// `n` letters `abc…zab…`: a large message content with nothing to escape.
pub fn letters(n: u32) -> String {
    (0..n).map(|i| char::from(b'a' + (i % 26) as u8)).collect()
}

pub fn chat_body(content: &str, stream: bool) -> String {
    serde_json::json!({
        "model": "mock-model",
        "stream": stream,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": content}],
    })
    .to_string()
}
