//! End-to-end tests of the mock over real sockets (std clients).
//! Run them also with `MONOIO_FORCE_LEGACY_DRIVER=1`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;
use warmroute_mock::{MockConfig, MockEvent, MockServer};

fn fast_cfg() -> MockConfig {
    MockConfig {
        name: "peer-a".into(),
        ttft_base_ms: 0,
        ttft_per_uncached_token_us: 0,
        decode_tps: 0.0,
        ..MockConfig::default()
    }
}

fn start(cfg: MockConfig) -> MockServer {
    MockServer::start("127.0.0.1:0".parse().unwrap(), cfg).expect("start mock")
}

#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Body chunks as received (chunked responses only).
    chunks: Vec<Vec<u8>>,
    /// Whether the chunked body ended with the terminating chunk.
    complete: bool,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("bad json {e}: {:?}", String::from_utf8_lossy(&self.body)))
    }
    /// SSE payloads (`data: ...` of each chunk); asserts one event per chunk.
    fn events(&self) -> Vec<String> {
        self.chunks
            .iter()
            .map(|c| {
                let s = std::str::from_utf8(c).unwrap();
                assert!(s.starts_with("data: ") && s.ends_with("\n\n"), "{s:?}");
                assert_eq!(s.matches("\n\n").count(), 1, "one event per chunk: {s:?}");
                s["data: ".len()..s.len() - 2].to_string()
            })
            .collect()
    }
}

struct Client {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    fn connect(addr: SocketAddr) -> Client {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        Client { s, buf: Vec::new() }
    }

    fn send(&mut self, raw: &[u8]) {
        self.s.write_all(raw).unwrap();
    }

    /// Read more bytes; false on EOF or reset.
    fn fill(&mut self) -> bool {
        let mut tmp = [0u8; 16384];
        match self.s.read(&mut tmp) {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&tmp[..n]);
                true
            }
        }
    }

    fn line(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let l = String::from_utf8(self.buf[..i].to_vec()).unwrap();
                self.buf.drain(..i + 2);
                return Some(l);
            }
            if !self.fill() {
                return None;
            }
        }
    }

    fn take(&mut self, n: usize) -> Option<Vec<u8>> {
        while self.buf.len() < n {
            if !self.fill() {
                return None;
            }
        }
        Some(self.buf.drain(..n).collect())
    }

    fn read_head(&mut self) -> Option<(u16, Vec<(String, String)>)> {
        let status_line = self.line()?;
        let status: u16 = status_line.split(' ').nth(1)?.parse().ok()?;
        let mut headers = Vec::new();
        loop {
            let l = self.line()?;
            if l.is_empty() {
                break;
            }
            let (n, v) = l.split_once(':').unwrap();
            headers.push((n.trim().to_string(), v.trim().to_string()));
        }
        Some((status, headers))
    }

    /// Read a whole response (Content-Length, chunked, or until close).
    fn response(&mut self) -> Resp {
        self.response_to(false)
    }

    fn response_to(&mut self, head_request: bool) -> Resp {
        let (status, headers) = self.read_head().expect("response head");
        let mut r = Resp {
            status,
            headers,
            body: Vec::new(),
            chunks: Vec::new(),
            complete: true,
        };
        if head_request || status == 204 || status == 304 {
            return r;
        }
        if let Some(cl) = r.header("content-length") {
            let n: usize = cl.parse().unwrap();
            r.body = self.take(n).expect("body");
        } else if r.header("transfer-encoding") == Some("chunked") {
            r.complete = false;
            while let Some(size_line) = self.line() {
                let size = usize::from_str_radix(size_line.trim(), 16).unwrap();
                if size == 0 {
                    assert_eq!(self.line().as_deref(), Some(""));
                    r.complete = true;
                    break;
                }
                let Some(data) = self.take(size) else { break };
                assert_eq!(self.take(2).as_deref(), Some(&b"\r\n"[..]));
                r.body.extend_from_slice(&data);
                r.chunks.push(data);
            }
        } else {
            while self.fill() {}
            r.body = std::mem::take(&mut self.buf);
        }
        r
    }

    /// True when the server closed the connection (EOF) without sending anything more.
    fn at_eof(&mut self) -> bool {
        self.buf.is_empty() && !self.fill()
    }
}

fn post_raw(path: &str, body: &[u8], extra: &[(&str, &str)]) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: mock\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (n, v) in extra {
        r.push_str(&format!("{n}: {v}\r\n"));
    }
    r.push_str("\r\n");
    let mut out = r.into_bytes();
    out.extend_from_slice(body);
    out
}

fn post(addr: SocketAddr, path: &str, body: &Value, extra: &[(&str, &str)]) -> Resp {
    let mut c = Client::connect(addr);
    c.send(&post_raw(path, body.to_string().as_bytes(), extra));
    c.response()
}

fn get(addr: SocketAddr, path: &str) -> Resp {
    let mut c = Client::connect(addr);
    c.send(format!("GET {path} HTTP/1.1\r\nHost: mock\r\n\r\n").as_bytes());
    c.response()
}

fn chat(prompt: &str, extra: Value) -> Value {
    let mut v = serde_json::json!({
        "model": "mock-model",
        "messages": [{"role": "user", "content": prompt}],
    });
    if let (Value::Object(o), Value::Object(e)) = (&mut v, extra) {
        o.extend(e);
    }
    v
}

fn words(prefix: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{prefix}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn stream_frames_without_usage() {
    let m = start(fast_cfg());
    let r = post(
        m.addr(),
        "/v1/chat/completions",
        &chat(
            "hello there world",
            serde_json::json!({"stream": true, "max_tokens": 4}),
        ),
        &[],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-mock-peer"), Some("peer-a"));
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert!(r.complete);
    let ev = r.events();
    assert_eq!(ev.len(), 4 + 1 + 1, "{ev:?}");
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let mut text = String::new();
    for (i, e) in ev[..4].iter().enumerate() {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(v["model"], "mock-model");
        assert!(v["choices"][0]["finish_reason"].is_null());
        if i == 0 {
            assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
        }
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap());
    }
    assert_eq!(text, "tok0 tok1 tok2 tok3");
    let fin: Value = serde_json::from_str(&ev[4]).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    assert!(fin.get("usage").is_none());
    let s = m.stats();
    assert_eq!((s.requests, s.completions, s.completion_tokens), (1, 1, 4));
    assert_eq!(s.prompt_tokens, 3);
    assert_eq!(s.active, 0);
}

#[test]
fn stream_frames_with_usage_and_text_completion() {
    let m = start(fast_cfg());
    let body = chat(
        "one two three four five",
        serde_json::json!({"stream": true, "max_tokens": 3, "stream_options": {"include_usage": true}}),
    );
    let r = post(m.addr(), "/v1/chat/completions", &body, &[]);
    let ev = r.events();
    assert_eq!(ev.len(), 3 + 1 + 1 + 1, "{ev:?}");
    let usage: Value = serde_json::from_str(&ev[4]).unwrap();
    assert_eq!(usage["choices"], serde_json::json!([]));
    assert_eq!(usage["usage"]["prompt_tokens"], 5);
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    assert_eq!(usage["usage"]["total_tokens"], 8);
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(ev[5], "[DONE]");

    // Legacy completions, overriding the token count by header.
    let body = serde_json::json!({"model": "m", "prompt": "a b", "stream": true});
    let r = post(
        m.addr(),
        "/v1/completions",
        &body,
        &[("x-mock-tokens", "2")],
    );
    let ev = r.events();
    assert_eq!(ev.len(), 2 + 1 + 1);
    let v: Value = serde_json::from_str(&ev[1]).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], " tok1");
    assert_eq!(v["model"], "m");
}

#[test]
fn non_stream_usage_and_body() {
    let m = start(MockConfig {
        max_tokens_default: 5,
        ..fast_cfg()
    });
    let r = post(
        m.addr(),
        "/v1/chat/completions",
        &chat("a b c d e f g", serde_json::json!({})),
        &[],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "tok0 tok1 tok2 tok3 tok4"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens"], 7);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], 12);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let body = serde_json::json!({"prompt": "x y", "max_completion_tokens": 2});
    let v = post(m.addr(), "/v1/completions", &body, &[]).json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "tok0 tok1");

    // Array content parts and /v1/messages treated like chat.
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "p q r"}]}],
        "max_tokens": 1
    });
    let v = post(m.addr(), "/v1/messages", &body, &[]).json();
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["choices"][0]["message"]["content"], "tok0");
}

#[test]
fn prefix_cache_shortens_ttft() {
    let m = start(MockConfig {
        ttft_base_ms: 0,
        ttft_per_uncached_token_us: 2000,
        block_tokens: 4,
        decode_tps: 0.0,
        ..MockConfig::default()
    });
    let timed = |prompt: &str| {
        let t = Instant::now();
        let r = post(
            m.addr(),
            "/v1/chat/completions",
            &chat(prompt, serde_json::json!({"max_tokens": 1})),
            &[],
        );
        assert_eq!(r.status, 200);
        (t.elapsed(), r.json()["usage"].clone())
    };
    let base = words("w", 100);
    let (cold, u1) = timed(&base);
    assert_eq!(u1["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(cold >= Duration::from_millis(190), "cold {cold:?}");
    let extended = format!("{base} {}", words("x", 6));
    let (warm, u2) = timed(&extended);
    assert_eq!(u2["prompt_tokens"], 106);
    assert_eq!(u2["prompt_tokens_details"]["cached_tokens"], 100);
    assert!(warm < cold / 2, "warm {warm:?} cold {cold:?}");
    // An unrelated prompt of the same size is cold again.
    let (cold2, u3) = timed(&words("z", 100));
    assert_eq!(u3["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(cold2 >= Duration::from_millis(190), "cold2 {cold2:?}");
    let s = m.stats();
    assert_eq!(s.cached_tokens, 100);
    assert_eq!(s.prompt_tokens, 306);
}

#[test]
fn lru_eviction_with_tiny_capacity() {
    let m = start(MockConfig {
        cache_capacity_tokens: 8,
        block_tokens: 4,
        ..fast_cfg()
    });
    let cached = |prompt: &str| {
        let r = post(
            m.addr(),
            "/v1/chat/completions",
            &chat(prompt, serde_json::json!({"max_tokens": 1})),
            &[],
        );
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let a = words("a", 8);
    let b = words("b", 8);
    assert_eq!(cached(&a), 0);
    assert_eq!(cached(&a), 8);
    assert_eq!(cached(&b), 0); // evicts a's two blocks
    assert_eq!(cached(&b), 8);
    assert_eq!(cached(&a), 0);
    // A partial block is never cached.
    assert_eq!(cached(&words("c", 3)), 0);
    assert_eq!(cached(&words("c", 3)), 0);
    // Disabled cache.
    m.set_config(|c| c.cache_capacity_tokens = 0);
    assert_eq!(cached(&a), 0);
    assert_eq!(cached(&a), 0);
}

#[test]
fn busy_429_then_queue() {
    let m = start(MockConfig {
        max_concurrency: 1,
        ..fast_cfg()
    });
    let addr = m.addr();
    let slow = || {
        std::thread::spawn(move || {
            post(
                addr,
                "/v1/chat/completions",
                &chat("x", serde_json::json!({"max_tokens": 1})),
                &[("x-mock-ttft-ms", "400")],
            )
        })
    };
    let h = slow();
    assert!(wait_for(Duration::from_secs(5), || (m.stats().active == 1)
        .then_some(()))
    .is_some());
    let r = post(
        addr,
        "/v1/chat/completions",
        &chat("y", serde_json::json!({})),
        &[],
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["type"], "busy");
    assert_eq!(r.header("x-mock-peer"), Some("peer-a"));
    assert_eq!(h.join().unwrap().status, 200);
    assert_eq!(m.stats().rejected_busy, 1);
    assert!(m
        .events()
        .iter()
        .any(|e| matches!(e, MockEvent::RejectedBusy { .. })));

    // Queue instead of 429.
    m.set_config(|c| c.busy_429 = false);
    let h = slow();
    assert!(wait_for(Duration::from_secs(5), || (m.stats().active == 1)
        .then_some(()))
    .is_some());
    let t = Instant::now();
    let r = post(
        addr,
        "/v1/chat/completions",
        &chat("y", serde_json::json!({})),
        &[],
    );
    assert_eq!(r.status, 200);
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(h.join().unwrap().status, 200);
    let s = m.stats();
    assert_eq!(s.rejected_busy, 1);
    assert_eq!(s.max_active, 1);
    assert_eq!(s.active, 0);
}

#[test]
fn queued_requests_are_served_first_come_first_served() {
    let m = start(MockConfig {
        max_concurrency: 1,
        busy_429: false,
        ..fast_cfg()
    });
    let addr = m.addr();
    let send = |name: &'static str, ttft_ms: &'static str| {
        std::thread::spawn(move || {
            let r = post(
                addr,
                "/v1/chat/completions",
                &chat(name, serde_json::json!({"max_tokens": 1})),
                &[("x-mock-ttft-ms", ttft_ms)],
            );
            (r.status, Instant::now())
        })
    };
    // One request holds the only slot while the others queue up behind it, in order.
    let holder = send("holder", "300");
    assert!(wait_for(Duration::from_secs(5), || (m.stats().active == 1)
        .then_some(()))
    .is_some());
    let mut waiters = Vec::new();
    for name in ["w0", "w1", "w2", "w3", "w4", "w5"] {
        waiters.push(send(name, "40"));
        std::thread::sleep(Duration::from_millis(15));
    }
    let (status, held_until) = holder.join().unwrap();
    assert_eq!(status, 200);
    let done: Vec<Instant> = waiters
        .into_iter()
        .map(|h| {
            let (status, at) = h.join().unwrap();
            assert_eq!(status, 200);
            at
        })
        .collect();
    // A queued request's prefill (40 ms) starts when it gets the slot, not while it waits:
    // had it started on arrival, the first waiter would be done with the holder. The
    // margin is for the holder's thread, which reads the clock once it is scheduled again.
    let first = done[0] - held_until;
    assert!(first >= Duration::from_millis(25), "{first:?}");
    // Control: they did wait for one another (one slot), so the order is the queue's.
    let span = *done.last().unwrap() - done[0];
    assert!(span >= Duration::from_millis(160), "{span:?}");
    assert!(
        done.windows(2).all(|w| w[0] < w[1]),
        "served out of arrival order: {:?}",
        done.iter().map(|d| *d - done[0]).collect::<Vec<_>>()
    );
    let s = m.stats();
    assert_eq!((s.max_active, s.active, s.rejected_busy), (1, 0, 0));
}

#[test]
fn fail_status_and_status_override() {
    let m = start(fast_cfg());
    let body = chat("x", serde_json::json!({"stream": true}));
    m.set_config(|c| c.fail_status = Some(503));
    let r = post(m.addr(), "/v1/chat/completions", &body, &[]);
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["type"], "server_error");
    assert_eq!(r.header("x-mock-peer"), Some("peer-a"));
    m.set_config(|c| c.fail_status = None);
    let r = post(m.addr(), "/v1/chat/completions", &body, &[]);
    assert_eq!(r.status, 200);
    let r = post(
        m.addr(),
        "/v1/chat/completions",
        &body,
        &[("x-mock-status", "502")],
    );
    assert_eq!(r.status, 502);
    assert!(r.json()["error"]["message"].is_string());
    let r = post(
        m.addr(),
        "/v1/chat/completions",
        &body,
        &[("x-mock-status", "abc")],
    );
    assert_eq!(r.status, 400);
    let r = post(
        m.addr(),
        "/v1/chat/completions",
        &body,
        &[("x-mock-status", "204")],
    );
    assert_eq!(r.status, 204);
    // Health knob.
    assert_eq!(get(m.addr(), "/health").status, 200);
    m.set_config(|c| c.health_status = Some(503));
    assert_eq!(get(m.addr(), "/health").status, 503);
    assert!(m
        .events()
        .iter()
        .any(|e| matches!(e, MockEvent::Failed { status: 502, .. })));
}

#[test]
fn echo_is_byte_identical() {
    let m = start(fast_cfg());
    let mut body: Vec<u8> = (0..=255u8).collect();
    body.extend_from_slice(b"{\"model\":\"x\"}\r\n\r\nGET / HTTP/1.1\r\n\r\n");
    let mut c = Client::connect(m.addr());
    c.send(&post_raw(
        "/v1/chat/completions",
        &body,
        &[("x-mock-echo", "1"), ("X-Custom", "v\u{e9}")],
    ));
    let r = c.response();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/octet-stream"));
    assert_eq!(r.body, body);
    let hj: Vec<(String, String)> =
        serde_json::from_str(r.header("x-mock-echo-headers").unwrap()).unwrap();
    assert!(hj.contains(&("X-Custom".to_string(), "v\u{e9}".to_string())));
    assert!(hj.contains(&("Host".to_string(), "mock".to_string())));
    assert_eq!(hj[0].0, "Host", "received order is kept");
    // Same connection still usable; GET /_echo_headers.
    c.send(b"GET /_echo_headers HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 1.2.3.4\r\n\r\n");
    let r = c.response();
    let hj: Vec<(String, String)> = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        hj,
        vec![
            ("Host".to_string(), "h".to_string()),
            ("X-Forwarded-For".to_string(), "1.2.3.4".to_string())
        ]
    );
    assert_eq!(m.stats().requests, 0, "echo is not a completion");
}

#[test]
fn chunked_request_body() {
    let m = start(fast_cfg());
    let json = chat("alpha beta gamma", serde_json::json!({"max_tokens": 2})).to_string();
    let bytes = json.as_bytes();
    let mut raw =
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: m\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    for part in bytes.chunks(7) {
        raw.extend_from_slice(format!("{:X};ext=1\r\n", part.len()).as_bytes());
        raw.extend_from_slice(part);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\nX-Trailer: t\r\n\r\n");
    let mut c = Client::connect(m.addr());
    // Send in small pieces to exercise incremental decoding.
    for piece in raw.chunks(5) {
        c.send(piece);
        std::thread::sleep(Duration::from_micros(200));
    }
    let r = c.response();
    assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["usage"]["prompt_tokens"], 3);

    // Echo returns the decoded body.
    let mut raw =
        b"POST /x HTTP/1.1\r\nHost: m\r\nx-mock-echo: 1\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    raw.extend_from_slice(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n");
    c.send(&raw);
    let r = c.response();
    assert_eq!(r.body, b"abcde");
    // Bad chunk size: 400 and close.
    c.send(b"POST /x HTTP/1.1\r\nHost: m\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n");
    let r = c.response();
    assert_eq!(r.status, 400);
    assert_eq!(r.header("connection"), Some("close"));
    assert!(c.at_eof());
}

/// Poll the event log for the first ClientGone.
fn client_gone(m: &MockServer) -> Option<(Instant, &'static str)> {
    wait_for(Duration::from_secs(3), || {
        m.events().iter().find_map(|e| match e {
            MockEvent::ClientGone { at, during } => Some((*at, *during)),
            _ => None,
        })
    })
}

#[test]
fn client_gone_during_prefill_hang() {
    let m = start(fast_cfg());
    let mut c = Client::connect(m.addr());
    c.send(&post_raw(
        "/v1/chat/completions",
        chat("x", serde_json::json!({"stream": true}))
            .to_string()
            .as_bytes(),
        &[("x-mock-hang-ms", "2000")],
    ));
    assert!(wait_for(Duration::from_secs(5), || (m.stats().active == 1)
        .then_some(()))
    .is_some());
    std::thread::sleep(Duration::from_millis(100));
    let dropped = Instant::now();
    drop(c);
    let (at, during) = client_gone(&m).expect("ClientGone recorded");
    assert_eq!(during, "prefill");
    let lag = at.saturating_duration_since(dropped);
    assert!(lag < Duration::from_millis(100), "noticed after {lag:?}");
    let s = m.stats();
    assert_eq!(s.client_disconnects, 1);
    assert!(wait_for(Duration::from_secs(2), || (m.stats().active == 0)
        .then_some(()))
    .is_some());
    assert_eq!(m.stats().completions, 0);
}

#[test]
fn client_gone_between_stream_events() {
    let m = start(fast_cfg());
    let mut c = Client::connect(m.addr());
    c.send(&post_raw(
        "/v1/chat/completions",
        chat("x", serde_json::json!({"stream": true, "max_tokens": 50}))
            .to_string()
            .as_bytes(),
        &[("x-mock-interval-ms", "1000")],
    ));
    let (status, _) = c.read_head().unwrap();
    assert_eq!(status, 200);
    let size = c.line().unwrap();
    assert!(usize::from_str_radix(&size, 16).unwrap() > 0);
    std::thread::sleep(Duration::from_millis(50));
    let dropped = Instant::now();
    drop(c);
    let (at, during) = client_gone(&m).expect("ClientGone recorded");
    assert_eq!(during, "stream");
    assert!(at.saturating_duration_since(dropped) < Duration::from_millis(100));
    assert!(wait_for(Duration::from_secs(2), || (m.stats().active == 0)
        .then_some(()))
    .is_some());
    let s = m.stats();
    assert_eq!(s.completion_tokens, 1);
    assert_eq!(s.client_disconnects, 1);
}

#[test]
fn close_after_n_events() {
    let m = start(fast_cfg());
    let body = chat("x", serde_json::json!({"stream": true, "max_tokens": 10}));
    let r = post(
        m.addr(),
        "/v1/chat/completions",
        &body,
        &[("x-mock-close-after", "2")],
    );
    assert_eq!(r.status, 200);
    assert!(!r.complete, "must end without the terminating chunk");
    assert_eq!(r.events().len(), 2);
    // From the config, and pacing does not batch events.
    m.set_config(|c| c.close_after_events = Some(3));
    let mut c = Client::connect(m.addr());
    c.send(&post_raw(
        "/v1/chat/completions",
        body.to_string().as_bytes(),
        &[("x-mock-interval-ms", "30")],
    ));
    let r = c.response();
    assert_eq!(r.events().len(), 3);
    assert!(!r.complete);
    assert_eq!(m.stats().mid_stream_closes, 2);
    assert!(m
        .events()
        .iter()
        .any(|e| matches!(e, MockEvent::ClosedMidStream { events: 3, .. })));
}

#[test]
fn events_are_paced_and_not_batched() {
    let m = start(fast_cfg());
    let mut c = Client::connect(m.addr());
    c.send(&post_raw(
        "/v1/chat/completions",
        chat("x", serde_json::json!({"stream": true, "max_tokens": 4}))
            .to_string()
            .as_bytes(),
        &[("x-mock-interval-ms", "100"), ("x-mock-ttft-ms", "50")],
    ));
    let t0 = Instant::now();
    c.read_head().unwrap();
    let mut arrivals = Vec::new();
    for _ in 0..4 {
        let size = usize::from_str_radix(&c.line().unwrap(), 16).unwrap();
        c.take(size + 2).unwrap();
        arrivals.push(t0.elapsed());
    }
    assert!(arrivals[0] >= Duration::from_millis(40), "{arrivals:?}");
    for w in arrivals.windows(2) {
        let gap = w[1] - w[0];
        assert!(
            gap >= Duration::from_millis(70),
            "gap {gap:?} in {arrivals:?}"
        );
    }
}

#[test]
fn keep_alive_and_pipelining() {
    let m = start(fast_cfg());
    let mut c = Client::connect(m.addr());
    let body = chat("a b", serde_json::json!({"max_tokens": 1})).to_string();
    c.send(&post_raw("/v1/chat/completions", body.as_bytes(), &[]));
    assert_eq!(c.response().status, 200);
    c.send(&post_raw("/v1/chat/completions", body.as_bytes(), &[]));
    assert_eq!(c.response().status, 200);
    // Two pipelined requests in one write, the first a stream.
    let sbody = chat("a b", serde_json::json!({"max_tokens": 3, "stream": true})).to_string();
    let mut raw = post_raw("/v1/chat/completions", sbody.as_bytes(), &[]);
    raw.extend_from_slice(b"GET /health HTTP/1.1\r\nHost: m\r\n\r\n");
    c.send(&raw);
    let r1 = c.response();
    assert_eq!(r1.events().len(), 5);
    let r2 = c.response();
    assert_eq!(r2.json()["status"], "ok");
    // Connection: close is honoured.
    c.send(b"GET /health HTTP/1.1\r\nHost: m\r\nConnection: close\r\n\r\n");
    let r = c.response();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("connection"), Some("close"));
    assert!(c.at_eof());
    let s = m.stats();
    assert_eq!(s.connections, 1);
    assert_eq!(s.completions, 3);
    assert_eq!(s.http_requests, 5);
}

#[test]
fn malformed_requests_get_400_and_close() {
    let m = start(fast_cfg());
    let cases: &[&[u8]] = &[
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\nabc",
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        b"\x00\x01\x02\x03\xff\xfe\r\n\r\n",
    ];
    for raw in cases {
        let mut c = Client::connect(m.addr());
        c.send(raw);
        let r = c.response();
        assert_eq!(r.status, 400, "{:?}", String::from_utf8_lossy(raw));
        assert_eq!(r.header("x-mock-peer"), Some("peer-a"));
        assert!(r.json()["error"]["message"].is_string());
        assert!(c.at_eof());
    }
    // Not JSON → 400 but the connection stays usable.
    let mut c = Client::connect(m.addr());
    c.send(&post_raw("/v1/chat/completions", b"not json", &[]));
    assert_eq!(c.response().status, 400);
    c.send(b"GET /health HTTP/1.1\r\n\r\n");
    assert_eq!(c.response().status, 200);
    // Head too large → 431.
    let mut c = Client::connect(m.addr());
    let mut raw = b"GET / HTTP/1.1\r\nX-Big: ".to_vec();
    raw.extend(vec![b'a'; warmroute_mock::http::HEAD_LIMIT + 1]);
    raw.extend_from_slice(b"\r\n\r\n");
    c.send(&raw);
    assert_eq!(c.response().status, 431);
    // Garbage of every byte value never crashes the server.
    for seed in 0u8..32 {
        let mut c = Client::connect(m.addr());
        let junk: Vec<u8> = (0..200u32)
            .map(|i| (i as u8).wrapping_mul(seed).wrapping_add(seed))
            .collect();
        let _ = c.s.write_all(&junk);
        let _ = c.s.shutdown(std::net::Shutdown::Write);
        while c.fill() {}
    }
    assert_eq!(get(m.addr(), "/health").status, 200);
}

#[test]
fn info_endpoints() {
    let m = start(MockConfig {
        models: vec!["m1".into(), "m2".into()],
        ..fast_cfg()
    });
    let v = get(m.addr(), "/v1/models").json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][1]["id"], "m2");
    assert_eq!(v["data"][0]["owned_by"], "peer-a");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(get(m.addr(), "/health").json()["status"], "ok");
    assert_eq!(get(m.addr(), "/nope").status, 404);
    assert_eq!(get(m.addr(), "/v1/chat/completions").status, 405);
    post(
        m.addr(),
        "/v1/chat/completions",
        &chat("a b c", serde_json::json!({"max_tokens": 2})),
        &[],
    );
    let s = get(m.addr(), "/_stats").json();
    assert_eq!(s["requests"], 1);
    assert_eq!(s["completions"], 1);
    assert_eq!(s["prompt_tokens"], 3);
    assert_eq!(s["completion_tokens"], 2);
    assert_eq!(s["active"], 0);
    // HEAD gets the head only.
    let mut c = Client::connect(m.addr());
    c.send(b"HEAD /health HTTP/1.1\r\n\r\n");
    let r = c.response_to(true);
    assert_eq!(r.status, 200);
    c.send(b"GET /health HTTP/1.1\r\n\r\n");
    assert_eq!(c.response().json()["status"], "ok");
}

#[test]
fn no_length_response_delimited_by_close() {
    let m = start(fast_cfg());
    let r = post(
        m.addr(),
        "/v1/chat/completions",
        &chat("a", serde_json::json!({"max_tokens": 2})),
        &[("x-mock-no-length", "1")],
    );
    assert_eq!(r.status, 200);
    assert!(r.header("content-length").is_none());
    assert_eq!(r.json()["choices"][0]["message"]["content"], "tok0 tok1");
}

#[test]
fn workers_share_port_and_shutdown_closes() {
    let m = start(MockConfig {
        workers: 3,
        ..fast_cfg()
    });
    let addr = m.addr();
    let threads: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..10 {
                    let r = post(
                        addr,
                        "/v1/chat/completions",
                        &chat("a b", serde_json::json!({"max_tokens": 2, "stream": true})),
                        &[],
                    );
                    assert_eq!(r.events().len(), 4);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = m.stats();
    assert_eq!(s.completions, 80);
    assert_eq!(s.connections, 80);
    // An idle keep-alive connection and one mid-hang are closed by shutdown.
    let mut idle = Client::connect(addr);
    idle.send(b"GET /health HTTP/1.1\r\n\r\n");
    assert_eq!(idle.response().status, 200);
    let mut hung = Client::connect(addr);
    hung.send(&post_raw(
        "/v1/chat/completions",
        chat("x", serde_json::json!({})).to_string().as_bytes(),
        &[("x-mock-hang-ms", "60000")],
    ));
    assert!(wait_for(Duration::from_secs(5), || (m.stats().active == 1)
        .then_some(()))
    .is_some());
    let t = Instant::now();
    m.shutdown();
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "shutdown took {:?}",
        t.elapsed()
    );
    assert!(idle.at_eof());
    assert!(hung.at_eof());
    assert!(TcpStream::connect(addr).is_err(), "port must be closed");
}

#[test]
fn many_concurrent_streams() {
    let m = start(MockConfig {
        decode_tps: 100.0,
        ..fast_cfg()
    });
    let addr = m.addr();
    // 200 concurrent streams of 10 tokens at 100 tok/s: ~0.1 s each if served concurrently.
    let t = Instant::now();
    let threads: Vec<_> = (0..200)
        .map(|_| {
            std::thread::spawn(move || {
                let r = post(
                    addr,
                    "/v1/chat/completions",
                    &chat("a", serde_json::json!({"max_tokens": 10, "stream": true})),
                    &[],
                );
                assert_eq!(r.events().len(), 12);
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(m.stats().max_active > 1);
}

#[test]
fn report_driver() {
    // Informational: which driver the FusionDriver picks in this environment.
    let legacy = std::env::var("MONOIO_FORCE_LEGACY_DRIVER").is_ok();
    eprintln!(
        "io_uring available: {}, forced legacy: {legacy}",
        monoio::utils::detect_uring()
    );
}
