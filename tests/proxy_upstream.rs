//! The peer side: cancellation reaches the engine, the pool survives stale connections,
//! every response framing is relayed correctly, in-flight always returns to zero.

mod common;

use std::io::{BufReader, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use common::*;
use warmroute_mock::MockEvent;

fn client_gone_events(m: &warmroute_mock::MockServer) -> Vec<(Instant, &'static str)> {
    m.events()
        .into_iter()
        .filter_map(|e| match e {
            MockEvent::ClientGone { at, during } => Some((at, during)),
            _ => None,
        })
        .collect()
}

/// A client that leaves during a silent prefill is noticed at once, also one that sent
/// something while its request was served (a stray CRLF after its body, a pipelined next
/// request) before leaving: the watch keeps those bytes and reads on. It used to stop at
/// the first bytes, so the engine went on for a client long gone and its in-flight unit
/// stayed held until the peer finished. The first case, a client that sends nothing more,
/// is the plain silent-prefill case.
#[test]
fn client_gone_during_silent_prefill_closes_upstream_within_100ms() {
    for extra in ["", "\r\n", "GET /r/v1/models HTTP/1.1\r\nHost: t\r\n\r\n"] {
        let m = mock("m0");
        let env = start(&[("r", route_for(&[m.addr()], ""))], "");
        let mut s = connect(env.public());
        s.write_all(&post_json(
            "/r/v1/chat/completions",
            &chat_body("think hard", true),
            "x-mock-hang-ms: 5000\r\n",
        ))
        .unwrap();
        eventually(Duration::from_secs(5), "request reaches the mock", || {
            m.stats().active == 1
        });
        assert_eq!(
            inflight_total(&env, "r"),
            1,
            "the request counts as in flight"
        );
        // Past the watch's arm delay, then the extra bytes, read by the armed watch.
        std::thread::sleep(Duration::from_millis(100));
        s.write_all(extra.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(client_gone_events(&m).is_empty(), "{extra:?}: not gone yet");
        let dropped_at = Instant::now();
        s.shutdown(Shutdown::Both).unwrap();
        drop(s);
        eventually(
            Duration::from_secs(3),
            &format!("{extra:?}: mock sees the client gone"),
            || !client_gone_events(&m).is_empty(),
        );
        let (at, during) = client_gone_events(&m)[0];
        let lag = at.saturating_duration_since(dropped_at);
        assert_eq!(during, "prefill");
        assert!(
            lag < Duration::from_millis(100),
            "{extra:?}: upstream closed {lag:?} after the client left"
        );
        eventually(Duration::from_secs(2), "in-flight back to 0", || {
            inflight_total(&env, "r") == 0
        });
    }
}

#[test]
fn client_gone_mid_stream_stops_generation() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let mut s = connect(env.public());
    s.write_all(&post_json(
        "/r/v1/chat/completions",
        &chat_body("go", true),
        "x-mock-tokens: 1000\r\nx-mock-interval-ms: 20\r\n",
    ))
    .unwrap();
    let mut first = [0u8; 64];
    s.read_exact(&mut first).unwrap();
    let dropped_at = Instant::now();
    drop(s);
    eventually(Duration::from_secs(3), "mock sees the client gone", || {
        !client_gone_events(&m).is_empty()
    });
    let (at, during) = client_gone_events(&m)[0];
    assert_eq!(during, "stream");
    assert!(at.saturating_duration_since(dropped_at) < Duration::from_millis(200));
    assert!(m.stats().completion_tokens < 1000);
    eventually(Duration::from_secs(2), "in-flight back to 0", || {
        inflight_total(&env, "r") == 0
    });
}

#[test]
fn upstream_closing_mid_stream_truncates_and_closes_the_client() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let mut s = connect(env.public());
    s.write_all(&post_json(
        "/r/v1/chat/completions",
        &chat_body("go", true),
        "x-mock-tokens: 50\r\nx-mock-close-after: 3\r\n",
    ))
    .unwrap();
    let mut all = Vec::new();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let n = s.read_to_end(&mut all).unwrap_or(0);
    let text = String::from_utf8_lossy(&all[..n.max(all.len())]);
    assert!(text.starts_with("HTTP/1.1 200"));
    assert!(!text.contains("[DONE]"), "stream was cut, not completed");
    assert!(
        !text.ends_with("0\r\n\r\n"),
        "no terminating chunk: the client can tell the body is truncated"
    );
    // The count drops just after the client has its last byte (and another worker may
    // answer the count first).
    eventually(Duration::from_secs(2), "in-flight back to 0", || {
        inflight_total(&env, "r") == 0
    });
}

/// A peer's answer the router cannot carry is a 502 that says which limit it broke: more
/// headers than the router keeps, or a head longer than it reads. A control answer just
/// inside both limits goes through.
#[test]
fn a_response_head_over_a_limit_is_a_502_that_names_the_limit() {
    let with_headers = |n: usize, value_len: usize| {
        let mut r = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n".to_vec();
        for i in 0..n {
            r.extend(format!("X-H{i}: {}\r\n", "v".repeat(value_len)).bytes());
        }
        r.extend(b"\r\nok");
        r
    };
    for (resp, status, message) in [
        (with_headers(100, 1), 200, None),
        (with_headers(200, 1), 502, Some("too many response headers")),
        (
            with_headers(20, 8 * 1024),
            502,
            Some("response head too large"),
        ),
    ] {
        let b = raw_backend(vec![resp], 1);
        let env = start(&[("r", route_for(&[b.addr], "max_more_tries = 0\n"))], "");
        let r = request(env.public(), &get("/r/x"));
        assert_eq!(r.status, status, "{message:?}");
        if let Some(m) = message {
            assert_eq!(r.json()["error"]["type"], "bad_upstream_response");
            let got = r.json()["error"]["message"].as_str().unwrap().to_string();
            assert!(got.ends_with(m), "{got}");
        } else {
            assert_eq!(r.text(), "ok");
        }
    }
}

#[test]
fn stale_pooled_connection_is_retried_fresh_without_counting_a_retry() {
    // The backend answers one request per connection and then closes without saying so.
    let resp = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec();
    let b = raw_backend(vec![resp], 1);
    let env = start(&[("r", route_for(&[b.addr], ""))], "");
    let c = connect(env.public());
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut c = c;
    for i in 0..4 {
        c.write_all(&get("/r/x")).unwrap();
        let resp = read_response(&mut r, false).unwrap();
        assert_eq!(
            (resp.status, resp.text().as_str()),
            (200, "ok"),
            "request {i}"
        );
        assert_eq!(resp.header("x-routed-retries"), Some("0"));
        // Long enough for the backend's close to arrive, short enough that the pool does
        // not look at the connection before reuse (`upstream::LOOK_AFTER`, 10 ms): the
        // close is found out on use.
        std::thread::sleep(Duration::from_millis(3));
    }
    assert!(
        b.accepted.load(std::sync::atomic::Ordering::SeqCst) >= 4,
        "each request needed a fresh connection"
    );
}

/// A backend that writes on an idle kept-alive connection (an unsolicited 408 when its
/// own idle timer fires): those bytes are not the next request's response. The pool drops
/// the connection and the request goes on a fresh one (they used to be read as its answer,
/// and every later client got the answer of the one before).
#[test]
fn bytes_a_peer_sends_on_an_idle_pooled_connection_are_not_the_next_answer() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let conns = std::sync::Arc::new(AtomicUsize::new(0));
    let count = conns.clone();
    serve_each(l, move |mut s| {
        let mut buf = Vec::new();
        let mut first = true;
        while let Some(head) = read_request(&mut s, &mut buf) {
            if is_health_probe(&head) {
                let _ = answer_health_probe(&mut s);
                return;
            }
            if first {
                count.fetch_add(1, SeqCst);
                first = false;
            }
            let text = String::from_utf8_lossy(&head).to_lowercase();
            let who = text
                .lines()
                .find_map(|l| l.strip_prefix("x-who:"))
                .unwrap_or("")
                .trim()
                .to_string();
            let body = format!("{{\"answer_for\":\"{who}\"}}");
            let resp = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            if s.write_all(resp.as_bytes()).is_err() {
                return;
            }
            // Idle a moment, then the backend's idle timer "fires"; the connection stays open.
            std::thread::sleep(Duration::from_millis(150));
            let _ = s.write_all(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n");
        }
    });
    let env = start(&[("r", route_for(&[addr], ""))], "");
    let c = connect(env.public());
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut c = c;
    for who in ["alice", "bob", "carol"] {
        c.write_all(
            format!("GET /r/v1/who HTTP/1.1\r\nHost: t\r\nx-who: {who}\r\n\r\n").as_bytes(),
        )
        .unwrap();
        let resp = read_response(&mut r, false).unwrap();
        assert_eq!(
            (resp.status, resp.text()),
            (200, format!("{{\"answer_for\":\"{who}\"}}")),
            "{who}"
        );
        std::thread::sleep(Duration::from_millis(400));
    }
    // The control: each request after the first found its pooled connection written to
    // and took a fresh one.
    assert_eq!(conns.load(SeqCst), 3);
}

#[test]
fn pooled_connections_are_reused() {
    let resp = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec();
    let b = raw_backend(vec![resp], usize::MAX);
    let env = start(&[("r", route_for(&[b.addr], ""))], "");
    let c = connect(env.public());
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut c = c;
    for _ in 0..20 {
        c.write_all(&get("/r/x")).unwrap();
        assert_eq!(read_response(&mut r, false).unwrap().status, 200);
    }
    // One client connection lands on one worker, which keeps reusing its pooled connection.
    assert_eq!(b.accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[test]
fn an_idle_pooled_connection_is_closed_before_the_engines_five_seconds() {
    // Engines' HTTP servers (uvicorn for vLLM and SGLang, llama.cpp's) close a connection
    // idle for 5 s; the router's default (4 s) lets go of it first. The control keeps it
    // for 60 s and reuses it after the same pause.
    let resp = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec();
    let setups = ["", "upstream_idle_timeout_ms = 60000\n"].map(|extra| {
        let b = raw_backend(vec![resp.clone()], usize::MAX);
        let env = start(&[("r", route_for(&[b.addr], ""))], extra);
        let c = connect(env.public());
        (b, env, BufReader::new(c.try_clone().unwrap()), c)
    });
    let mut setups = setups;
    let round = |setups: &mut [(_, _, BufReader<std::net::TcpStream>, std::net::TcpStream)]| {
        for (_, _, r, c) in setups.iter_mut() {
            c.write_all(&get("/r/x")).unwrap();
            assert_eq!(read_response(r, false).unwrap().status, 200);
        }
    };
    round(&mut setups);
    std::thread::sleep(Duration::from_millis(4_600));
    round(&mut setups);
    let accepted = setups
        .iter()
        .map(|(b, ..)| b.accepted.load(std::sync::atomic::Ordering::SeqCst))
        .collect::<Vec<_>>();
    assert_eq!(
        accepted,
        [2, 1],
        "default: a fresh connection; 60 s: the pooled one"
    );
}

#[test]
fn every_response_framing_is_relayed() {
    let cases: Vec<(&str, &[u8], &[u8], &str)> = vec![
        ("GET", b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n", b"", "204"),
        // A peer's length on a 204 does not reach the client (RFC 9110 §8.6).
        ("GET", b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n", b"", "204+length"),
        // Nor its transfer coding (RFC 9112 §6.1).
        ("GET", b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n", b"", "204+te"),
        ("GET", b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n", b"", "304"),
        ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n", b"", "head"),
        ("GET", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n", b"abc", "chunked+trailer"),
        ("GET", b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi", b"hi", "103"),
        ("GET", b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil close", b"until close", "close-delimited"),
    ];
    for (method, wire, body, what) in cases {
        let close = what == "close-delimited";
        let b = raw_backend(vec![wire.to_vec()], if close { 1 } else { usize::MAX });
        let env = start(&[("r", route_for(&[b.addr], ""))], "");
        let c = connect(env.public());
        let mut r = BufReader::new(c.try_clone().unwrap());
        let mut c = c;
        // Twice on one connection: the first response must not leave junk behind.
        for round in 0..2 {
            c.write_all(format!("{method} /r/x HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())
                .unwrap();
            let resp = read_response(&mut r, method == "HEAD")
                .unwrap_or_else(|e| panic!("{what} round {round}: {e}"));
            assert_eq!(resp.body, body, "{what}");
            if what == "head" {
                assert_eq!(resp.header("content-length"), Some("1234"));
            }
            if what.starts_with("204") {
                assert_eq!(resp.header("content-length"), None, "{what}");
                assert_eq!(resp.header("transfer-encoding"), None, "{what}");
            }
            if close {
                assert_eq!(resp.header("connection"), Some("close"), "{what}");
                break;
            }
        }
        if what == "103" {
            // The interim response reaches the client before the final one.
            let mut c = connect(env.public());
            c.write_all(b"GET /r/x HTTP/1.1\r\nHost: t\r\n\r\n")
                .unwrap();
            let mut buf = [0u8; 30];
            c.read_exact(&mut buf).unwrap();
            assert!(
                buf.starts_with(b"HTTP/1.1 103 Early Hints\r\n"),
                "{}",
                String::from_utf8_lossy(&buf)
            );
            // An HTTP/1.0 client gets no 1xx (RFC 9110 §15.2): the final answer comes first.
            let mut c = connect(env.public());
            c.write_all(b"GET /r/x HTTP/1.0\r\n\r\n").unwrap();
            let mut got = Vec::new();
            c.read_to_end(&mut got).unwrap();
            let text = String::from_utf8_lossy(&got);
            assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
            assert!(
                text.ends_with("\r\n\r\nhi") && !text.contains("103"),
                "{text}"
            );
        }
    }
}

#[test]
fn connect_failure_moves_to_another_peer() {
    let m = mock("alive");
    // A port nobody listens on: port 1 is outside the range `bind(:0)` hands out, so no
    // other test's listener can take it (a port just freed by a dropped listener could be
    // given to a test running in parallel, making the "dead" peer answer).
    let dead: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
    assert!(
        std::net::TcpStream::connect(dead).is_err(),
        "nothing listens on {dead}"
    );
    // The first health round bans the dead peer too, and on a loaded machine it can come
    // before the first request: the ban then lasts 1 s, and no later round renews it.
    let env = start(
        &[(
            "r",
            route_for(
                &[dead, m.addr()],
                "max_more_tries = 2\nhealth_check_interval = 3600\nhealth_ban_ttl = 1\n",
            ),
        )],
        "",
    );
    let mut retried = 0;
    let t0 = Instant::now();
    let mut sent = 0;
    while sent < 10 || (retried == 0 && t0.elapsed() < Duration::from_secs(10)) {
        if sent >= 10 {
            std::thread::sleep(Duration::from_millis(100));
        }
        let r = request(
            env.public(),
            &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
        );
        sent += 1;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-routed-peer"), Some("p1"));
        if r.header("x-routed-retries") == Some("1") {
            retried += 1;
        }
    }
    assert!(
        retried > 0,
        "some requests first tried the dead peer and were retried"
    );
    // With retries off, the dead peer's failure reaches the client as 502.
    let env2 = start(&[("r", route_for(&[dead], "max_more_tries = 0\n"))], "");
    let r = request(env2.public(), &get("/r/x"));
    assert_eq!(r.status, 502);
    assert_eq!(r.json()["error"]["type"], "upstream_connect_failed");
    // The router's own 502 still says which peer failed and after how many attempts
    // (SPEC §3.7), as the proxied answers above do.
    assert_eq!(r.header("x-routed-peer"), Some("p0"));
    assert_eq!(r.header("x-routed-retries"), Some("0"));
    assert!(r.header("x-routed-mode").is_some());
    assert_eq!(inflight_total(&env, "r") + inflight_total(&env2, "r"), 0);
}

#[test]
fn many_concurrent_streams_release_every_inflight() {
    let m = mock("m0");
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, max_concurrency = 100 }} ]\n",
        m.addr().port()
    );
    let env = start(&[("r", route)], "");
    let addr = env.public();
    let handles: Vec<_> = (0..40)
        .map(|i| {
            std::thread::spawn(move || {
                let mut s = connect(addr);
                let extra = "x-mock-tokens: 20\r\nx-mock-interval-ms: 5\r\n";
                s.write_all(&post_json(
                    "/r/v1/chat/completions",
                    &chat_body("x y z", true),
                    extra,
                ))
                .unwrap();
                if i % 3 == 0 {
                    // Some clients leave early.
                    let mut b = [0u8; 100];
                    let _ = s.read(&mut b);
                    return;
                }
                let r = read_response(&mut BufReader::new(s), false).unwrap();
                assert_eq!(r.status, 200);
                assert!(r.text().contains("[DONE]"));
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    eventually(Duration::from_secs(3), "in-flight back to 0", || {
        inflight_total(&env, "r") == 0
    });
    assert_eq!(
        m.stats().completions,
        26,
        "every client that stayed got its whole stream"
    );
}

#[test]
fn a_peer_silent_past_the_first_byte_timeout_gets_a_504_and_a_prompt_one_does_not() {
    let m = mock("m0");
    let env = start(
        &[("r", route_for(&[m.addr()], "first_byte_timeout_ms = 400\n"))],
        "",
    );
    let quick = "x-mock-ttft-ms: 0\r\nx-mock-tokens: 1\r\nx-mock-interval-ms: 0\r\n";
    // Control: a pooled connection, a peer that answers after 100 ms: within the timeout.
    for _ in 0..2 {
        let ok = request(
            env.public(),
            &post_json(
                "/r/v1/chat/completions",
                &chat_body("hi", false),
                &format!("{quick}x-mock-hang-ms: 100\r\n"),
            ),
        );
        assert_eq!(ok.status, 200, "{}", ok.text());
    }
    // The same pooled connection, a peer that stays silent: 504 once the timeout passes.
    let t = Instant::now();
    let r = request(
        env.public(),
        &post_json(
            "/r/v1/chat/completions",
            &chat_body("hi", false),
            &format!("{quick}x-mock-hang-ms: 4000\r\n"),
        ),
    );
    let took = t.elapsed();
    assert_eq!(r.status, 504, "{}", r.text());
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_millis(2500),
        "answered after {took:?}"
    );
}

/// A peer that sends its status line at once and the rest of its head `gap` later.
fn split_head_backend(gap: Duration) -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                while let Some(req) = read_request(&mut s, &mut buf) {
                    if is_health_probe(&req) {
                        let _ = answer_health_probe(&mut s);
                        continue;
                    }
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\n");
                    std::thread::sleep(gap);
                    let _ = s.write_all(b"Content-Length: 2\r\n\r\nok");
                }
            });
        }
    });
    addr
}

/// The first-byte timeout ends at the first byte; from there the idle timeout applies to
/// the rest of the head, as to the body. A head that starts at once and is finished 800 ms
/// later is not cut by a 500 ms first-byte timeout (it used to get a 504); one whose rest
/// never comes in time is cut by a 300 ms idle timeout, not by the 3 s first-byte one. The
/// controls: each timeout still applies where it did.
#[test]
fn the_first_byte_timeout_ends_at_the_first_byte_and_the_idle_timeout_covers_the_rest_of_the_head()
{
    let slow_rest = split_head_backend(Duration::from_millis(800));
    let env = start(
        &[
            (
                "a",
                route_for(
                    &[slow_rest],
                    "first_byte_timeout_ms = 500\nidle_timeout_ms = 2000\n",
                ),
            ),
            (
                "b",
                route_for(
                    &[slow_rest],
                    "first_byte_timeout_ms = 3000\nidle_timeout_ms = 300\n",
                ),
            ),
        ],
        "",
    );
    let ask = |route: &str| {
        let t = Instant::now();
        let r = request(env.public(), &get(&format!("/{route}/v1/x")));
        (r.status, t.elapsed())
    };
    let (status, took) = ask("a");
    assert_eq!(status, 200, "after {took:?}");
    assert!(took >= Duration::from_millis(700), "{took:?}");
    let (status, took) = ask("b");
    assert_eq!(status, 504);
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(750),
        "cut by the idle timeout: {took:?}"
    );
}

/// Send a streamed chat request and read until the router closes the connection (or 8 s).
fn stream_until_close(env: &Env, extra: &str) -> (Vec<u8>, Duration) {
    let mut s = connect(env.public());
    s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
    s.write_all(&post_json(
        "/r/v1/chat/completions",
        &chat_body("go", true),
        &format!("Connection: close\r\nx-mock-ttft-ms: 0\r\n{extra}"),
    ))
    .unwrap();
    let t = Instant::now();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    (got, t.elapsed())
}

#[test]
fn a_stream_idle_past_the_idle_timeout_is_cut_and_a_steady_one_is_not() {
    let m = mock("m0");
    let env = start(
        &[("r", route_for(&[m.addr()], "idle_timeout_ms = 500\n"))],
        "",
    );
    // Control: events every 150 ms for ~1.5 s, longer than the idle timeout in all.
    let (got, _) = stream_until_close(&env, "x-mock-tokens: 10\r\nx-mock-interval-ms: 150\r\n");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("[DONE]"), "a steady stream completes: {text}");
    // A 2 s gap after the first event: cut after the idle timeout, without the end.
    let (got, took) = stream_until_close(&env, "x-mock-tokens: 3\r\nx-mock-interval-ms: 2000\r\n");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("data: "), "the first event arrived: {text}");
    assert!(!text.contains("[DONE]"), "the stream was cut: {text}");
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(1900),
        "cut after {took:?}"
    );
}

/// A peer that reads each proxied request whole and answers it 503 after `delay`. Its
/// health probes (`GET`) get a 200 at once: a failed probe bans a peer, and then no request
/// would try it any more.
fn peer_503_after(delay: Duration) -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    serve_each(l, move |mut s| {
        let mut buf = Vec::new();
        while let Some(req) = read_request(&mut s, &mut buf) {
            let resp: &[u8] = if req.starts_with(b"GET ") {
                b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
            } else {
                std::thread::sleep(delay);
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
            };
            if s.write_all(resp).is_err() {
                return;
            }
        }
    });
    addr
}

#[test]
fn a_retry_on_a_pooled_connection_gets_its_own_first_byte_window() {
    let slow = peer_503_after(Duration::from_millis(300));
    let m = mock("m0");
    let env = start(
        &[(
            "r",
            route_for(
                &[slow, m.addr()],
                "first_byte_timeout_ms = 400\nmax_more_tries = 1\n",
            ),
        )],
        "",
    );
    let s = connect(env.public());
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    let (mut statuses, mut retried) = (Vec::new(), 0);
    // The first attempt spends 300 ms on the 503; the retry (to the mock, on a pooled
    // connection after the first few) answers after 200 ms: within its own 400 ms.
    for _ in 0..16 {
        w.write_all(&post_json(
            "/r/v1/chat/completions",
            &chat_body("hi", false),
            "x-mock-ttft-ms: 0\r\nx-mock-tokens: 1\r\nx-mock-interval-ms: 0\r\nx-mock-hang-ms: 200\r\n",
        ))
        .unwrap();
        let resp = read_response(&mut r, false).unwrap();
        if resp.header("x-routed-retries") == Some("1") {
            retried += 1;
        }
        statuses.push(resp.status);
    }
    assert!(retried > 0, "some requests went to the 503 peer first");
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
}

#[test]
fn a_client_slow_to_read_is_not_an_idle_peer() {
    let m = mock("m0");
    let env = start(
        &[("r", route_for(&[m.addr()], "idle_timeout_ms = 500\n"))],
        "",
    );
    let mut s = connect(env.public());
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // ~11 MB of events as fast as the mock makes them, while the client does not read
    // for 1.5 s: the router's writes to it block for longer than the idle timeout.
    s.write_all(&post_json(
        "/r/v1/chat/completions",
        &chat_body("go", true),
        "Connection: close\r\nx-mock-ttft-ms: 0\r\nx-mock-tokens: 60000\r\nx-mock-interval-ms: 0\r\n",
    ))
    .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got);
    assert!(got.len() > 1_000_000, "got {} bytes", got.len());
    assert!(
        text.contains("[DONE]"),
        "the stream was cut: {:?}",
        &text[text.len().saturating_sub(200)..]
    );
}

/// A backend that holds every response until `burst` requests are waiting at once, then
/// answers them all: the router must have `burst` upstream connections open together.
/// Counts the connections that carried burst requests (`GET /x`) and those requests.
fn gated_backend(
    burst: usize,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<AtomicUsize>,
    std::sync::Arc<AtomicUsize>,
) {
    use std::sync::{Arc, Condvar, Mutex};
    // A backlog for the whole burst: the router opens its connections all at once, and
    // std's default (128) would drop some SYNs while this thread is busy spawning.
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    sock.listen(4096).unwrap();
    let l: std::net::TcpListener = sock.into();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    // Requests seen so far; a request is answered once its whole burst has arrived.
    let gate = Arc::new((Mutex::new(0usize), Condvar::new()));
    let requests = Arc::new(AtomicUsize::new(0));
    let acc = accepted.clone();
    let req = requests.clone();
    serve_each(l, move |mut s| {
        let mut counted = false;
        let mut buf = Vec::new();
        while let Some(head) = read_request(&mut s, &mut buf) {
            // The router's health probes (GET /v1/models, from 0.5 s after it starts) are
            // answered at once and counted nowhere: counted, one would take a burst
            // request's place at the gate and leave that request waiting for a burst that
            // never comes (the test then failed whenever a probe fell inside a burst).
            if is_health_probe(&head) {
                if answer_health_probe(&mut s).is_err() {
                    return;
                }
                continue;
            }
            if !counted {
                counted = true;
                acc.fetch_add(1, SeqCst);
            }
            req.fetch_add(1, SeqCst);
            let (seen, cv) = &*gate;
            let mut n = seen.lock().unwrap();
            *n += 1;
            let release = (*n).div_ceil(burst) * burst;
            cv.notify_all();
            while *n < release {
                n = cv.wait(n).unwrap();
            }
            drop(n);
            if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .is_err()
            {
                return;
            }
        }
    });
    (addr, accepted, requests)
}

/// `bursts` rounds of `clients` concurrent GETs over the same client connections (so each
/// lands on the same worker every round); returns the backend's accepted connections.
fn bursts_through(server_extra: &str, clients: usize, bursts: usize) -> usize {
    let (b, accepted, requests) = gated_backend(clients);
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, max_concurrency = 10000 }} ]\n\
         connect_timeout_ms = 15000\n",
        b.port()
    );
    let env = start(&[("r", route)], server_extra);
    let conns: Vec<_> = (0..clients).map(|_| connect(env.public())).collect();
    for round in 0..bursts {
        let handles: Vec<_> = conns
            .iter()
            .map(|c| {
                let mut c = c.try_clone().unwrap();
                std::thread::spawn(move || {
                    c.write_all(&get("/r/x")).unwrap();
                    read_response(&mut BufReader::new(c), false).map(|r| r.status)
                })
            })
            .collect();
        let statuses: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        // On a failure, say how far the burst got: how many requests reached the backend
        // (it answers none of a burst until all of it has arrived) and on how many
        // connections.
        let ok = statuses.iter().filter(|s| matches!(s, Ok(200))).count();
        assert_eq!(
            ok,
            clients,
            "round {round}: {ok} of {clients} answered 200 (first failure: {:?}); the backend \
             read {} requests in all (want {}) on {} connections",
            statuses.iter().find(|s| !matches!(s, Ok(200))),
            requests.load(SeqCst),
            (round + 1) * clients,
            accepted.load(SeqCst)
        );
    }
    accepted.load(SeqCst)
}

#[test]
fn a_burst_wider_than_the_old_64_connection_pool_reuses_every_connection() {
    // 200 requests at once over two workers: ~100 upstream connections each, more than
    // the 64 idle connections per peer the pool used to keep.
    let clients = 200;
    assert_eq!(
        bursts_through("", clients, 3),
        clients,
        "the second and third bursts run on the first burst's connections"
    );
    // Control: a pool smaller than the burst closes the surplus, and the next burst
    // connects anew.
    let small = bursts_through("upstream_idle_per_peer = 16\n", clients, 2);
    assert!(
        small >= clients + clients - 2 * 16,
        "a 16-connection pool reconnects: {small} accepted"
    );
}

/// A backend that answers `GET .../fast` with a 200 at once and `GET .../slow` with a 500
/// after `slow`.
fn fast_and_slow_backend(slow: Duration) -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    serve_each(l, move |mut s| {
        let mut buf = Vec::new();
        while let Some(head) = read_request(&mut s, &mut buf) {
            let resp: &[u8] = if head.windows(5).any(|w| w == b"/slow") {
                std::thread::sleep(slow);
                b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
            } else {
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
            };
            if s.write_all(resp).is_err() {
                return;
            }
        }
    });
    addr
}

#[test]
fn the_client_idle_wait_counts_from_the_last_response_and_closes_after_the_timeout() {
    let b = fast_and_slow_backend(Duration::from_millis(1200));
    let env = start(
        &[("r", route_for(&[b], ""))],
        "client_idle_timeout_ms = 800\n",
    );
    let c = connect(env.public());
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut c = c;
    // Two pipelined requests: a quick 200, then a 500 that takes longer than the idle
    // timeout. The idle wait after the 500 counts from the 500, not from the 200.
    c.write_all(&[get("/r/fast"), get("/r/slow")].concat())
        .unwrap();
    assert_eq!(read_response(&mut r, false).unwrap().status, 200);
    assert_eq!(read_response(&mut r, false).unwrap().status, 500);
    std::thread::sleep(Duration::from_millis(200));
    c.write_all(&get("/r/fast")).unwrap();
    assert_eq!(
        read_response(&mut r, false).map(|x| x.status).ok(),
        Some(200),
        "the connection is still open 200 ms after the last response"
    );
    // Control: idle for longer than the timeout, the router closes the connection.
    std::thread::sleep(Duration::from_millis(1300));
    let _ = c.write_all(&get("/r/fast"));
    assert!(
        read_response(&mut r, false).is_err(),
        "closed after 1.3 s idle with an 800 ms idle timeout"
    );
}

/// A body too large to share the request head's buffer leaves beside it in one vectored
/// write, and is there again for every further attempt: after a pooled connection the peer
/// had closed, after a 503 and after a refused connection, the peer that answers gets all
/// of it.
#[test]
fn a_large_body_is_sent_whole_on_every_attempt() {
    let content = letters(40_000);
    let body = chat_body(&content, false);
    assert!(body.len() > 40_000);

    // A peer that answers one request per connection and then closes without saying so:
    // every request after the first finds its pooled connection dead and is sent again.
    let resp = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec();
    let b = raw_backend(vec![resp], 1);
    let env = start(&[("r", route_for(&[b.addr], ""))], "");
    let c = connect(env.public());
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut c = c;
    for i in 0..4 {
        c.write_all(&post_json("/r/v1/chat/completions", &body, ""))
            .unwrap();
        let resp = read_response(&mut r, false).unwrap();
        assert_eq!((resp.status, resp.text().as_str()), (200, "ok"), "{i}");
        std::thread::sleep(Duration::from_millis(30));
    }
    let seen = b.requests.lock().unwrap().clone();
    assert!(seen.len() >= 4, "{} requests reached the peer", seen.len());
    for req in &seen {
        assert!(req.ends_with(body.as_bytes()), "a request lost its body");
    }
    assert!(
        b.accepted.load(SeqCst) >= 4,
        "each request needed a fresh connection"
    );

    // A peer that answers 503 (having read the whole request) and one that refuses
    // connections, before the mock that echoes the body it got.
    let busy = peer_503_after(Duration::ZERO);
    let dead: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
    let m = mock("m0");
    let env = start(
        &[(
            "r",
            route_for(&[busy, dead, m.addr()], "max_more_tries = 2\n"),
        )],
        "",
    );
    let mut retried = 0;
    for i in 0..12 {
        let r = request(
            env.public(),
            &post_json("/r/v1/echo", &body, "x-mock-echo: 1\r\n"),
        );
        assert_eq!(r.status, 200, "{i}");
        assert!(r.body == body.as_bytes(), "{i}: the echoed body differs");
        if r.header("x-routed-retries") != Some("0") {
            retried += 1;
        }
    }
    assert!(retried > 0, "no request was retried");
    // The count drops just after the client has its last byte (and another worker may
    // answer the count first).
    eventually(Duration::from_secs(2), "in-flight back to 0", || {
        inflight_total(&env, "r") == 0
    });
}

/// An engine behind its own key (vLLM's `--api-key`) wants it on `/v1/models` too, the
/// default health probe: the probe carries the route's `upstream_api_key`, or every peer
/// would be banned and the route would answer 503.
#[test]
fn health_probes_carry_the_upstream_api_key() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    serve_each(l, move |mut s| {
        let mut buf = Vec::new();
        while let Some(req) = read_request(&mut s, &mut buf) {
            let text = String::from_utf8_lossy(&req).to_lowercase();
            let resp: &[u8] = if !text.contains("\r\nauthorization: bearer up-key\r\n") {
                b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"
            } else if text.starts_with("get /v1/models ") {
                b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"data\":[]}"
            } else {
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
            };
            if s.write_all(resp).is_err() {
                return;
            }
        }
    });
    let keyed = route_for(
        &[addr],
        "upstream_api_key = \"up-key\"\nhealth_check_interval = 1\n",
    );
    // The control: the same peer probed without the key.
    let bare = route_for(&[addr], "health_check_interval = 1\n");
    let env = start(&[("keyed", keyed), ("bare", bare)], "");
    let probe = |route: &str| {
        let hs = request(env.public(), &get(&format!("/{route}/_health_status"))).json();
        let p = hs[addr.to_string()].clone();
        (p["last_probe"]["result"].clone(), p["banned"].clone())
    };
    eventually(Duration::from_secs(5), "both routes probed", || {
        !probe("keyed").0.is_null() && !probe("bare").0.is_null()
    });
    assert_eq!(
        probe("keyed"),
        (serde_json::json!(200), serde_json::json!(false))
    );
    assert_eq!(
        probe("bare"),
        (serde_json::json!(401), serde_json::json!(true))
    );
    let r = request(
        env.public(),
        &post_json("/keyed/v1/chat/completions", &chat_body("x", false), ""),
    );
    assert_eq!((r.status, r.text().as_str()), (200, "ok"));
}

/// A peer that refuses a request before reading its body (a proxy in front of the engine
/// with a smaller body limit, or an auth check) answers and closes with the body unread.
/// The router's write of the body then fails, but the answer is there to read: the client
/// gets the peer's own 413, not a 502, and the connection is not pooled.
#[test]
fn a_peers_answer_before_it_read_the_body_reaches_the_client() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let refused = std::sync::Arc::new(AtomicUsize::new(0));
    let count = refused.clone();
    serve_each(l, move |mut s| {
        let mut head = Vec::new();
        let mut b = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut b) {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&b[..n]),
            }
        }
        if is_health_probe(&head) {
            let _ = answer_health_probe(&mut s);
            return;
        }
        count.fetch_add(1, SeqCst);
        let body = br#"{"error":"request body too large for this proxy"}"#;
        let _ = s.write_all(
            &[
                format!(
                    "HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                )
                .as_bytes(),
                body,
            ]
            .concat(),
        );
        // Closed with most of the body unread: the peer's kernel answers it with a reset.
    });
    let env = start(
        &[("r", route_for(&[addr], "max_body_size = \"16m\"\n"))],
        "",
    );
    let big = chat_body(&"x".repeat(8 << 20), false);
    for i in 0..3 {
        let r = request(env.public(), &post_json("/r/v1/chat/completions", &big, ""));
        assert_eq!(r.status, 413, "{i}: {}", r.text());
        assert!(
            r.text().contains("too large for this proxy"),
            "{i}: {}",
            r.text()
        );
    }
    // The control: the peer did refuse each of them itself.
    assert_eq!(refused.load(SeqCst), 3);
    // A small request still goes through the same way.
    let r = request(
        env.public(),
        &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
    );
    assert_eq!(r.status, 413);
    // The count drops just after the client has its last byte (and another worker may
    // answer the count first).
    eventually(Duration::from_secs(2), "in-flight back to 0", || {
        inflight_total(&env, "r") == 0
    });
}

/// A peer may leave the reason phrase out of its status line (`HTTP/1.1 200` + CRLF), or
/// send one that is not UTF-8. The client gets the standard phrase for the code, the body
/// as sent, and the worker goes on serving; a peer's own phrase is still relayed.
#[test]
fn a_status_line_without_a_usable_reason_is_relayed_with_the_standard_one() {
    let b = raw_backend(
        vec![
            b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\n{}".to_vec(),
            b"HTTP/1.1 404 Not \xff Found\r\nContent-Length: 2\r\n\r\nno".to_vec(),
            b"HTTP/1.1 201 Made\r\nContent-Length: 2\r\n\r\nok".to_vec(),
        ],
        usize::MAX,
    );
    let env = start(&[("r", route_for(&[b.addr], ""))], "");
    let want: [&[u8]; 3] = [
        b"HTTP/1.1 200 OK\r\n",
        b"HTTP/1.1 404 Not Found\r\n",
        b"HTTP/1.1 201 Made\r\n",
    ];
    let bodies: [&[u8]; 3] = [b"{}", b"no", b"ok"];
    // Each on a connection of its own, so both workers take some; the script goes round.
    for i in 0..12 {
        let mut c = connect(env.public());
        c.write_all(b"GET /r/x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        let text = String::from_utf8_lossy(&got);
        assert!(got.starts_with(want[i % 3]), "request {i}: {text:?}");
        assert!(got.ends_with(bodies[i % 3]), "request {i}: {text:?}");
    }
    // No connection task panicked; the counter is there to say so.
    let metrics = request(env.admin(), &get("/metrics")).text();
    let panics: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("warmroute_worker_panics_total{"))
        .collect();
    assert_eq!(panics.len(), 2, "{metrics}");
    assert!(panics.iter().all(|l| l.ends_with(" 0")), "{panics:?}");
}

/// A JSON response whose `usage` is followed by more than the tail the relay keeps (vLLM
/// writes `prompt_logprobs` and `prompt_token_ids` after it): the tokens are still counted
/// (they went unread, with no TTFT/decode-rate sample and no cache figures).
#[test]
fn a_json_usage_followed_by_a_long_token_list_is_still_counted() {
    let mut body = br#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3000,"completion_tokens":8,"total_tokens":3008,"prompt_tokens_details":{"cached_tokens":2900}},"prompt_token_ids":["#.to_vec();
    body.extend((0..3000).flat_map(|i| format!("{i},").into_bytes()));
    body.extend_from_slice(b"1]}");
    let mut resp = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    resp.extend_from_slice(&body);
    let b = raw_backend(vec![resp], usize::MAX);
    let env = start(&[("r", route_for(&[b.addr], ""))], "");
    let r = request(
        env.public(),
        &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
    );
    assert_eq!((r.status, r.body.len()), (200, body.len()));
    let mut st = serde_json::Value::Null;
    eventually(Duration::from_secs(5), "the tokens recorded", || {
        st = request(env.public(), &get("/r/_route_state")).json();
        st["cache"]["completion_tokens"] != 0
    });
    assert_eq!(
        (
            st["cache"]["prompt_tokens"].as_u64(),
            st["cache"]["cached_tokens"].as_u64()
        ),
        (Some(3000), Some(2900)),
        "{st}"
    );
}

/// A broken peer that sends a second, complete response 3 ms after its answer to
/// `/overlong`, and otherwise answers with the path it was asked for, 1 ms after the
/// request.
/// Also returns how many connections it accepted.
fn double_answer_backend() -> (std::net::SocketAddr, std::sync::Arc<AtomicUsize>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            counter.fetch_add(1, SeqCst);
            s.set_nodelay(true).ok();
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                while let Some(req) = read_request(&mut s, &mut buf) {
                    if is_health_probe(&req) {
                        let _ = answer_health_probe(&mut s);
                        continue;
                    }
                    let head = String::from_utf8_lossy(&req).into_owned();
                    let path = head.split(' ').nth(1).unwrap_or("").to_string();
                    if path == "/overlong" {
                        let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello");
                        std::thread::sleep(Duration::from_millis(3));
                        let _ =
                            s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nSMUGGLED");
                        continue;
                    }
                    // A moment's work: each answer comes after the router has read the
                    // one before it.
                    std::thread::sleep(Duration::from_millis(1));
                    let body = format!("you asked for {path}");
                    let _ = s.write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    );
                }
            });
        }
    });
    (addr, accepted)
}

/// A broken peer's extra response, read as the next request's answer, used to shift every
/// later answer on that pooled connection by one for as long as requests kept it busy
/// (each one reads its predecessor's answer): client B got client A's completion. The pool
/// now looks at a connection at least every 10 ms of use, which ends the shift. Requests
/// 2 ms apart on one client connection (so one worker, one pooled connection): a few of the
/// first answers may be wrong, all the later ones are right. The control: the peer's extra
/// response was seen, either read as an answer or found by a look (which drops the
/// connection, so the peer accepts another).
#[test]
fn a_peers_extra_response_shifts_the_answers_of_a_pooled_connection_for_10_ms_at_most() {
    let (be, accepted) = double_answer_backend();
    let env = start(&[("r", route_for(&[be], ""))], "");
    let c = connect(env.public());
    let mut rd = BufReader::new(c.try_clone().unwrap());
    let mut c = c;
    let mut ask = |path: &str| {
        c.write_all(format!("GET /r{path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())
            .unwrap();
        let r = read_response(&mut rd, false).unwrap();
        String::from_utf8_lossy(&r.body).into_owned()
    };
    assert_eq!(ask("/overlong"), "hello");
    std::thread::sleep(Duration::from_millis(1));
    let mut answers = Vec::new();
    for i in 0..60 {
        answers.push((i, ask(&format!("/c{i}"))));
        std::thread::sleep(Duration::from_millis(2));
    }
    let wrong: Vec<_> = answers
        .iter()
        .filter(|(i, a)| *a != format!("you asked for /c{i}"))
        .collect();
    assert!(
        answers.iter().any(|(_, a)| a == "SMUGGLED") || accepted.load(SeqCst) > 1,
        "the control: the extra response was never seen: {answers:?}"
    );
    assert!(
        wrong.len() <= 10,
        "{} wrong answers: {wrong:?}",
        wrong.len()
    );
    assert!(
        wrong.iter().all(|(i, _)| *i < 20),
        "the shift ended: {wrong:?}"
    );
}

/// A peer's response without `Date` gets one (RFC 9110 §6.6.1: a recipient with a clock
/// that forwards such a response adds it); a peer's own `Date` is passed on as it is, and
/// no second one is added.
#[test]
fn a_response_without_date_gets_one_and_a_peer_date_is_kept() {
    let undated = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec();
    let dated =
        b"HTTP/1.1 200 OK\r\ndate: Sun, 06 Nov 1994 08:49:37 GMT\r\nContent-Length: 2\r\n\r\nok"
            .to_vec();
    // A `Date` the peer's `Connection` lists is dropped as hop-by-hop, and replaced.
    let listed = b"HTTP/1.1 200 OK\r\nConnection: Date\r\nDate: Sun, 06 Nov 1994 08:49:37 GMT\r\nContent-Length: 2\r\n\r\nok".to_vec();
    for (wire, own) in [(undated, false), (dated, true), (listed, false)] {
        let b = raw_backend(vec![wire], usize::MAX);
        let env = start(&[("r", route_for(&[b.addr], ""))], "");
        let r = request(env.public(), &get("/r/x"));
        assert_eq!((r.status, r.text().as_str()), (200, "ok"));
        let dates: Vec<&str> = r
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("date"))
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(dates.len(), 1, "exactly one Date: {:?}", r.headers);
        if own {
            assert_eq!(dates[0], "Sun, 06 Nov 1994 08:49:37 GMT");
        } else {
            // IMF-fixdate of now: `Mon, 07 Dec 2026 23:59:59 GMT`, this year.
            let d = dates[0];
            assert!(d.len() == 29 && d.ends_with(" GMT"), "{d}");
            let year: u32 = d[12..16].parse().unwrap();
            assert!(year >= 2024, "{d}");
        }
    }
}

/// A peer's `Connection` header that lists `Content-Length` or `Transfer-Encoding` does not
/// take the framing off a body that is passed through: the client got the body with no
/// length and no chunked coding on a kept-alive connection, so it could not tell where the
/// response ended (and read the next response as part of it). Two requests on one
/// connection: both come out whole.
#[test]
fn a_peer_cannot_strip_the_framing_by_listing_it_in_connection() {
    let cases: [(&[u8], &str); 2] = [
        (
            b"HTTP/1.1 200 OK\r\nConnection: Content-Length\r\nContent-Length: 2\r\n\r\nok",
            "content-length",
        ),
        (
            b"HTTP/1.1 200 OK\r\nConnection: Transfer-Encoding, X-Gone\r\nX-Gone: 1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            "transfer-encoding",
        ),
    ];
    for (wire, framing) in cases {
        let b = raw_backend(vec![wire.to_vec()], usize::MAX);
        let env = start(&[("r", route_for(&[b.addr], ""))], "");
        let c = connect(env.public());
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut r = BufReader::new(c);
        for round in 0..2 {
            let resp = exchange(&mut r, &get("/r/x"), false);
            assert_eq!(
                (resp.status, resp.text().as_str()),
                (200, "ok"),
                "{framing} round {round}"
            );
            assert!(
                resp.header(framing).is_some(),
                "{framing}: {:?}",
                resp.headers
            );
            // Control: what the peer's `Connection` lists besides the framing still goes.
            assert_eq!(resp.header("x-gone"), None);
        }
    }
}

/// An interim head reaches the client as the final head does: without the peer's
/// hop-by-hop headers or those its `Connection` lists, and with CRLF line ends where the
/// peer used bare LFs. Its end-to-end headers (`Link`) are kept.
#[test]
fn an_interim_head_is_relayed_without_hop_by_hop_headers_and_with_crlf() {
    let wire = b"HTTP/1.1 103 Early Hints\nConnection: X-Secret\nX-Secret: s\nKeep-Alive: 1\nLink: </a>\nX-Routed-Peer: inner\n\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi";
    let b = raw_backend(vec![wire.to_vec()], usize::MAX);
    let env = start(&[("r", route_for(&[b.addr], ""))], "");
    let mut c = connect(env.public());
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.write_all(b"GET /r/x HTTP/1.1\r\nHost: t\r\n\r\n")
        .unwrap();
    let want = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\n";
    let mut got = vec![0u8; want.len()];
    c.read_exact(&mut got).unwrap();
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(want));
}

/// A length the peer said twice (two equal lines, or `2, 2` on one) reaches the client once,
/// as one value; a strict client may refuse the repeat. And no `Transfer-Encoding` goes to
/// an HTTP/1.0 client (RFC 9112 §6.1), also on a HEAD answer, which carries no body to
/// decode; an HTTP/1.1 client still gets it (the control).
#[test]
fn a_repeated_length_goes_out_once_and_no_coding_reaches_an_http10_client() {
    let lengths = |r: &Resp| -> Vec<String> {
        r.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .map(|(_, v)| v.clone())
            .collect()
    };
    for wire in [
        &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nok"[..],
        b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok",
    ] {
        let b = raw_backend(vec![wire.to_vec()], usize::MAX);
        let env = start(&[("r", route_for(&[b.addr], ""))], "");
        // Twice on one connection: the length sent is the body's.
        let mut r = BufReader::new(connect(env.public()));
        for round in 0..2 {
            let resp = exchange(&mut r, &get("/r/x"), false);
            assert_eq!((resp.status, resp.text().as_str()), (200, "ok"), "{round}");
            assert_eq!(lengths(&resp), ["2"], "{:?}", resp.headers);
        }
    }
    // A HEAD answer says the length a GET would get: once too.
    let b = raw_backend(
        vec![b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\n".to_vec()],
        usize::MAX,
    );
    let env = start(&[("r", route_for(&[b.addr], ""))], "");
    let mut r = BufReader::new(connect(env.public()));
    let resp = exchange(&mut r, b"HEAD /r/x HTTP/1.1\r\nHost: t\r\n\r\n", true);
    assert_eq!(lengths(&resp), ["2"], "HEAD: {:?}", resp.headers);
    for (status, method) in [("200 OK", "HEAD"), ("304 Not Modified", "GET")] {
        let b = raw_backend(
            vec![
                format!("HTTP/1.1 {status}\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n")
                    .into_bytes(),
            ],
            usize::MAX,
        );
        let env = start(&[("r", route_for(&[b.addr], ""))], "");
        for (version, coding) in [("1.1", Some("chunked")), ("1.0", None)] {
            let raw = format!("{method} /r/x HTTP/{version}\r\nHost: t\r\n\r\n");
            let resp = exchange(
                &mut BufReader::new(connect(env.public())),
                raw.as_bytes(),
                true,
            );
            assert_eq!(resp.header("x-a"), Some("1"), "{status} HTTP/{version}");
            assert_eq!(
                resp.header("transfer-encoding"),
                coding,
                "{status} HTTP/{version}"
            );
        }
    }
}
