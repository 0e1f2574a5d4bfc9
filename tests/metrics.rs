//! `/metrics` on the admin port: Prometheus text format with per-route and per-peer series
//! that follow real traffic, and `promtool check metrics` clean when promtool is installed.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// Series (name plus labels, exactly as rendered) → value.
fn scrape(env: &Env) -> (String, HashMap<String, f64>) {
    let r = request(env.admin(), &get("/metrics"));
    assert_eq!(r.status, 200);
    let ct = r.header("content-type").unwrap_or_default();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    let text = r.text();
    let mut series = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (id, v) = line.rsplit_once(' ').unwrap();
        let v: f64 = v.parse().unwrap_or_else(|_| panic!("bad value: {line}"));
        assert!(series.insert(id.to_string(), v).is_none(), "duplicate {id}");
    }
    (text, series)
}

fn val(series: &HashMap<String, f64>, id: &str) -> f64 {
    *series
        .get(id)
        .unwrap_or_else(|| panic!("no series {id} in {series:#?}"))
}

fn peer(route: &str, name: &str, addr: std::net::SocketAddr) -> String {
    format!(r#"route="{route}",model="",peer="{name}",addr="{addr}",priority="0""#)
}

#[test]
fn metrics_follow_traffic_and_pass_promtool() {
    let m0 = mock("m0");
    let m1 = mock("m1");
    let solo = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, name = \"solo\", max_concurrency = 1 }} ]\n",
        m1.addr().port()
    );
    let env = start(
        &[("r", route_for(&[m0.addr(), m1.addr()], "")), ("one", solo)],
        "",
    );
    let addr = env.public();
    let chat = |route: &str, hdrs: &str| {
        post_json(
            &format!("/{route}/v1/chat/completions"),
            &chat_body("hi", false),
            hdrs,
        )
    };

    // Before any traffic: every series is there, at zero.
    let (_, s) = scrape(&env);
    assert_eq!(val(&s, r#"warmroute_requests_total{route="r"}"#), 0.0);
    for gate in ["concurrency", "ttft", "tps", "rule"] {
        assert_eq!(
            val(
                &s,
                &format!(r#"warmroute_rejected_total{{route="one",gate="{gate}"}}"#)
            ),
            0.0
        );
    }

    for _ in 0..3 {
        assert_eq!(request(addr, &chat("r", "")).status, 200);
    }
    // 429: the only slot of `one` is held by a slow request.
    let slow = std::thread::spawn(move || request(addr, &chat("one", "x-mock-ttft-ms: 800\r\n")));
    eventually(Duration::from_secs(5), "slow request in flight", || {
        inflight_total(&env, "one") == 1
    });
    let (_, during) = scrape(&env);
    assert_eq!(
        val(
            &during,
            &format!(
                "warmroute_peer_inflight{{{}}}",
                peer("one", "solo", m1.addr())
            )
        ),
        1.0
    );
    assert_eq!(
        val(&during, r#"warmroute_pool_inflight{route="one",model=""}"#),
        1.0
    );
    assert_eq!(request(addr, &chat("one", "")).status, 429);
    assert_eq!(slow.join().unwrap().status, 200);
    // 404: a route that does not exist counts on no route.
    assert_eq!(request(addr, &chat("nope", "")).status, 404);

    let inflight_zero = |s: &HashMap<String, f64>| {
        s.iter()
            .filter(|(k, _)| k.starts_with("warmroute_peer_inflight{"))
            .all(|(_, v)| *v == 0.0)
    };
    eventually(Duration::from_secs(5), "in-flight back to 0", || {
        inflight_zero(&scrape(&env).1)
    });
    let (text, s) = scrape(&env);

    assert_eq!(val(&s, r#"warmroute_requests_total{route="r"}"#), 3.0);
    assert_eq!(val(&s, r#"warmroute_requests_total{route="one"}"#), 2.0);
    assert_eq!(
        val(
            &s,
            r#"warmroute_rejected_total{route="one",gate="concurrency"}"#
        ),
        1.0
    );
    assert_eq!(
        val(
            &s,
            r#"warmroute_rejected_total{route="r",gate="concurrency"}"#
        ),
        0.0
    );
    assert_eq!(
        val(&s, r#"warmroute_rejected_total{route="one",gate="ttft"}"#),
        0.0
    );
    assert_eq!(val(&s, r#"warmroute_unavailable_total{route="r"}"#), 0.0);
    assert_eq!(val(&s, r#"warmroute_retries_total{route="r"}"#), 0.0);
    let modes: f64 = ["hash", "hash_fallback", "least_conn"]
        .iter()
        .map(|m| {
            val(
                &s,
                &format!(r#"warmroute_routing_mode_total{{route="r",mode="{m}"}}"#),
            )
        })
        .sum();
    assert_eq!(modes, 3.0, "every request of r picked a peer once");
    let r_peers = [peer("r", "p0", m0.addr()), peer("r", "p1", m1.addr())];
    let forwarded: f64 = r_peers
        .iter()
        .map(|p| val(&s, &format!("warmroute_peer_requests_total{{{p}}}")))
        .sum();
    assert_eq!(forwarded, 3.0);
    let solo = peer("one", "solo", m1.addr());
    assert_eq!(
        val(&s, &format!("warmroute_peer_requests_total{{{solo}}}")),
        1.0
    );
    assert_eq!(
        val(&s, &format!("warmroute_peer_failures_total{{{solo}}}")),
        0.0
    );
    assert_eq!(
        val(&s, &format!("warmroute_peer_max_concurrency{{{solo}}}")),
        1.0
    );
    assert_eq!(val(&s, &format!("warmroute_peer_banned{{{solo}}}")), 0.0);
    assert_eq!(
        val(&s, &format!("warmroute_peer_bans_total{{{solo}}}")),
        0.0
    );
    assert_eq!(
        val(&s, r#"warmroute_pool_limit{route="one",model=""}"#),
        1.0
    );
    assert_eq!(
        val(&s, r#"warmroute_pool_inflight{route="one",model=""}"#),
        0.0
    );
    assert!(inflight_zero(&s));
    assert_eq!(val(&s, "warmroute_workers"), 2.0);
    let drivers: Vec<&String> = s
        .keys()
        .filter(|k| k.starts_with("warmroute_worker_driver{"))
        .collect();
    assert_eq!(drivers.len(), 2, "{drivers:?}");
    assert!(
        drivers
            .iter()
            .all(|k| k.contains(r#"driver="io_uring""#) || k.contains(r#"driver="epoll""#)),
        "{drivers:?}"
    );
    assert_eq!(
        val(
            &s,
            &format!(
                r#"warmroute_build_info{{version="{}"}}"#,
                env!("CARGO_PKG_VERSION")
            )
        ),
        1.0
    );
    // The public port does not serve it.
    assert_eq!(request(env.public(), &get("/metrics")).status, 404);

    // Failures: a 503 relayed by a peer with nobody left to try counts as that peer's
    // failure, alone on its route (no retry) and as the last of a retry chain.
    let failures = |s: &HashMap<String, f64>, p: &str| {
        val(s, &format!("warmroute_peer_failures_total{{{p}}}"))
    };
    let r = request(addr, &chat("one", "x-mock-status: 503\r\n"));
    assert_eq!(r.status, 503);
    assert_eq!(r.header("x-routed-retries"), Some("0"));
    let r = request(addr, &chat("r", "x-mock-status: 503\r\n"));
    assert_eq!(r.status, 503);
    assert_eq!(r.header("x-routed-retries"), Some("1"));
    let (_, s) = scrape(&env);
    assert_eq!(failures(&s, &solo), 1.0);
    let both: f64 = r_peers.iter().map(|p| failures(&s, p)).sum();
    assert_eq!(both, 2.0, "each peer of r answered 503 once");
    assert_eq!(val(&s, r#"warmroute_retries_total{route="r"}"#), 1.0);

    promtool_check(&text);
}

/// The access log file's lines, parsed.
fn access_lines(log: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn responses_cut_short_are_counted_by_who_cut_them_and_logged_with_their_end() {
    let m = mock("m0");
    let log = shm_path("cut-log");
    let env = start_logging(
        &[("r", route_for(&[m.addr()], ""))],
        "",
        warmroute::worker::AccessLogTarget::File(log.clone()),
    );
    let cut = |by: &str| {
        let id = format!(
            r#"warmroute_peer_responses_cut_total{{{},by="{by}"}}"#,
            peer("r", "p0", m.addr())
        );
        val(&scrape(&env).1, &id)
    };
    // The control: a response that reaches its end counts nowhere.
    let ok = request(
        env.public(),
        &post_json("/r/v1/chat/completions", &chat_body("a", false), ""),
    );
    assert_eq!(ok.status, 200);
    assert_eq!((cut("client"), cut("peer")), (0.0, 0.0));

    // The peer closes after 3 events of 50.
    let mut s = connect(env.public());
    s.write_all(&post_json(
        "/r/v1/chat/completions",
        &chat_body("b", true),
        "x-mock-tokens: 50\r\nx-mock-close-after: 3\r\n",
    ))
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut all = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut all);
    assert!(!String::from_utf8_lossy(&all).contains("[DONE]"));
    eventually(Duration::from_secs(3), "the peer's cut counted", || {
        cut("peer") == 1.0
    });

    // The client leaves after the first bytes of a long stream...
    let mut s = connect(env.public());
    s.write_all(&post_json(
        "/r/v1/chat/completions",
        &chat_body("c", true),
        "x-mock-tokens: 1000\r\nx-mock-interval-ms: 20\r\n",
    ))
    .unwrap();
    let mut first = [0u8; 64];
    std::io::Read::read_exact(&mut s, &mut first).unwrap();
    drop(s);
    // ... and another while the peer is still silent (before the response head).
    let mut s = connect(env.public());
    s.write_all(&post_json(
        "/r/v1/chat/completions",
        &chat_body("d", true),
        "x-mock-hang-ms: 5000\r\n",
    ))
    .unwrap();
    eventually(
        Duration::from_secs(5),
        "the request reaches the mock",
        || m.stats().active == 1,
    );
    drop(s);
    eventually(Duration::from_secs(3), "both clients' cuts counted", || {
        cut("client") == 2.0
    });
    assert_eq!(cut("peer"), 1.0);

    // One access line per request, each saying how it ended.
    let lines = || access_lines(&log);
    eventually(Duration::from_secs(3), "four access lines", || {
        lines().len() == 4
    });
    let mut ends: Vec<(String, u64)> = lines()
        .iter()
        .map(|l| {
            (
                l["end"].as_str().unwrap_or("(none)").to_string(),
                l["status"].as_u64().unwrap(),
            )
        })
        .collect();
    ends.sort();
    assert_eq!(
        ends,
        [
            ("client_gone".to_string(), 200),
            ("client_gone".to_string(), 499),
            ("complete".to_string(), 200),
            ("peer_cut".to_string(), 200),
        ]
    );
    let _ = std::fs::remove_file(&log);
}

#[test]
fn requests_refused_before_a_peer_get_their_access_line_too() {
    let m = mock("m0");
    let log = shm_path("refused-log");
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, name = \"p0\", max_concurrency = 1 }} ]\n\
         api_keys = {{ \"k1\" = \"alice\" }}\nmax_body_size = \"2k\"\n\
         reject_rules_enabled = true\nreject_rules_status = 422\n\
         [[reject_rules]]\nname = \"no-evil\"\nfield = \"model\"\nop = \"match\"\nvalue = \"^evil$\"\n",
        m.addr().port()
    );
    let env = start_logging(
        &[("r", route)],
        "",
        warmroute::worker::AccessLogTarget::File(log.clone()),
    );
    let addr = env.public();
    let chat = |body: &str, extra: &str| {
        post_json(
            "/r/v1/chat/completions",
            body,
            &format!("x-session-id: s-1\r\n{extra}"),
        )
    };
    let key = "authorization: Bearer k1\r\n";
    // The control: a request that reaches the peer.
    assert_eq!(
        request(addr, &chat(&chat_body("x", false), key)).status,
        200
    );
    assert_eq!(request(addr, &chat(&chat_body("x", false), "")).status, 401);
    assert_eq!(
        request(addr, &chat(&chat_body(&"x".repeat(3000), false), key)).status,
        413
    );
    let evil = r#"{"model":"evil","messages":[{"role":"user","content":"x"}]}"#;
    assert_eq!(request(addr, &chat(evil, key)).status, 422);
    // 429: the peer's only slot is held by a slow request.
    let slow = std::thread::spawn(move || {
        request(
            addr,
            &chat(
                &chat_body("x", false),
                &format!("{key}x-mock-ttft-ms: 3000\r\n"),
            ),
        )
    });
    eventually(Duration::from_secs(5), "one in flight", || {
        inflight_total(&env, "r") == 1
    });
    assert_eq!(
        request(addr, &chat(&chat_body("x", false), key)).status,
        429
    );
    assert_eq!(slow.join().unwrap().status, 200);
    // Refused before any route: a route that does not exist, and a head that does not
    // parse. Neither has a route; the malformed one has no method or path either.
    let nope = request(addr, &post_json("/nope/v1/chat/completions", "{}", ""));
    assert_eq!(nope.status, 404);
    let blah = request(addr, b"BLAH\r\n\r\n");
    assert_eq!(blah.status, 400);
    // The router's own endpoints are not logged (scraped and probed all day).
    assert_eq!(request(env.admin(), &get("/healthz")).status, 200);
    // Every request to the route counts, the refused ones (401, 413) included.
    let (_, series) = scrape(&env);
    assert_eq!(val(&series, r#"warmroute_requests_total{route="r"}"#), 6.0);
    // The key's owner, never the key: alice's five requests (not the 401, which had no
    // key), and the tokens of her two answered ones.
    assert_eq!(
        val(&series, r#"warmroute_owner_requests_total{owner="alice"}"#),
        5.0
    );
    assert!(
        val(
            &series,
            r#"warmroute_owner_tokens_total{owner="alice",kind="prompt"}"#
        ) > 0.0
    );
    assert!(
        !series.keys().any(|k| k.contains("k1")),
        "a key in the metrics"
    );

    let lines = || access_lines(&log);
    eventually(Duration::from_secs(3), "eight access lines", || {
        lines().len() == 8
    });
    let unrouted: Vec<(u64, String, String)> = lines()
        .iter()
        .filter(|l| l["route"].is_null())
        .map(|l| {
            (
                l["status"].as_u64().unwrap(),
                l["method"].as_str().unwrap_or("-").to_string(),
                l["path"].as_str().unwrap_or("-").to_string(),
            )
        })
        .collect();
    let mut unrouted = unrouted;
    unrouted.sort();
    // The 404's line counts the body its client got (it was logged as 0, before the answer).
    let line_404 = lines().into_iter().find(|l| l["status"] == 404).unwrap();
    assert_eq!(
        line_404["response_bytes"].as_u64(),
        Some(nope.body.len() as u64),
        "{line_404}"
    );
    let line_400 = lines().into_iter().find(|l| l["status"] == 400).unwrap();
    assert_eq!(
        line_400["response_bytes"].as_u64(),
        Some(blah.body.len() as u64),
        "{line_400}"
    );
    assert_eq!(
        unrouted,
        [
            (400, "-".to_string(), "-".to_string()),
            (
                404,
                "POST".to_string(),
                "/nope/v1/chat/completions".to_string()
            ),
        ]
    );
    let mut got: Vec<(u64, String, String, String)> = lines()
        .iter()
        .filter(|l| !l["route"].is_null())
        .map(|l| {
            (
                l["status"].as_u64().unwrap(),
                l["route"].as_str().unwrap_or("?").to_string(),
                l["owner"].as_str().unwrap_or("-").to_string(),
                l["session"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect();
    got.sort();
    let row = |st: u64, owner: &str, session: &str| {
        (st, "r".to_string(), owner.to_string(), session.to_string())
    };
    assert_eq!(
        got,
        [
            row(200, "alice", "s-1"),
            row(200, "alice", "s-1"),
            row(401, "-", "-"),
            // The body was too large to be read: no session id.
            row(413, "alice", "-"),
            // Refused by a rule, and shed by a gate, after the session id was read: the
            // line names the session.
            row(422, "alice", "s-1"),
            row(429, "alice", "s-1"),
        ]
    );
    // The router's own answers count their bytes like a peer's.
    for l in lines().iter().filter(|l| !l["route"].is_null()) {
        assert!(l["response_bytes"].as_u64().unwrap() > 0, "{l}");
    }
    let _ = std::fs::remove_file(&log);
}

/// The workers' `warmroute_worker_cpu_seconds_total`, summed.
fn worker_cpu(env: &Env) -> f64 {
    scrape(env)
        .1
        .iter()
        .filter(|(k, _)| k.starts_with("warmroute_worker_cpu_seconds_total{"))
        .map(|(_, v)| *v)
        .sum()
}

/// A worker reads its CPU clock (which settles a CPU quota's books, `worker::quota`) at the
/// start of every proxied request, refused ones included, and after the upstream reads of a
/// relay; `warmroute_worker_cpu_seconds_total` is what it read. So the series moves with each
/// of those paths and stays put while the router only answers scrapes.
#[test]
fn worker_cpu_is_read_on_the_request_and_relay_paths() {
    let m = mock("m");
    let env = start(
        &[
            (
                "locked",
                route_for(&[m.addr()], "api_keys = { \"k\" = \"kim\" }\n"),
            ),
            ("open", route_for(&[m.addr()], "")),
        ],
        // Busy polling also reads the clock, after any request (scrapes included).
        "busy_poll_us = 0\n",
    );
    // Idle, scrapes only: nothing reads the clock (the control for the moves below).
    let c0 = worker_cpu(&env);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(worker_cpu(&env), c0, "an idle router read its CPU clock");

    // Requests refused before any peer is asked (401, no key): the read at the start of the
    // request path, and nothing else.
    for _ in 0..40 {
        let r = request(
            env.public(),
            &post_json("/locked/v1/chat/completions", &chat_body("hi", false), ""),
        );
        assert_eq!(r.status, 401);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(m.stats().requests, 0, "the refusals reached the mock");
    let c1 = worker_cpu(&env);
    assert!(c1 > c0, "refused requests: {c0} -> {c1}");

    // One stream of 12 events 40 ms apart: its request-path read happens before the first
    // event; between two later points only the relay's reads can move the series.
    let mut s = connect(env.public());
    s.write_all(&post_json(
        "/open/v1/chat/completions",
        &chat_body("hi", true),
        "x-mock-tokens: 12\r\nx-mock-interval-ms: 40\r\n",
    ))
    .unwrap();
    let mut r = BufReader::new(s);
    let mut events = 0;
    let mut line = String::new();
    let mut read_events = |n: usize| {
        let want = events + n;
        while events < want {
            line.clear();
            assert!(r.read_line(&mut line).unwrap() > 0, "stream ended early");
            events += usize::from(line.starts_with("data: "));
        }
    };
    read_events(2);
    let c2 = worker_cpu(&env);
    read_events(5);
    let c3 = worker_cpu(&env);
    assert!(c3 > c2, "during a relay: {c2} -> {c3}");
}

/// The workers' `warmroute_worker_busy_poll_seconds_total`, summed, and whether every worker
/// runs io_uring (busy polling is off on the epoll fallback).
fn busy_poll(env: &Env) -> (f64, bool) {
    let s = scrape(env).1;
    let uring = s
        .keys()
        .filter(|k| k.starts_with("warmroute_worker_driver{"))
        .all(|k| k.contains(r#"driver="io_uring""#));
    let spent = s
        .iter()
        .filter(|(k, _)| k.starts_with("warmroute_worker_busy_poll_seconds_total{"))
        .map(|(_, v)| *v)
        .sum();
    (spent, uring)
}

/// Busy polling is off on the epoll fallback: there every reading must be 0, and the
/// caller stops (true). On io_uring, false.
fn off_the_ring(uring: bool, readings: [f64; 3]) -> bool {
    if !uring {
        assert_eq!(readings, [0.0; 3], "busy polled on the epoll fallback");
    }
    !uring
}

/// With `busy_poll_us` set to a window, a worker polls for that long after each request it
/// starts or finishes (scrapes included), and then waits as usual: the time it spent
/// polling grows with traffic and stops growing when the traffic does. With 0, nothing is
/// spent.
#[test]
fn busy_polling_follows_requests_and_stops_when_idle() {
    let m = mock("m");
    // Control: the option off.
    let off = start(&[("r", route_for(&[m.addr()], ""))], "busy_poll_us = 0\n");
    for _ in 0..20 {
        let r = request(
            off.public(),
            &post_json("/r/v1/chat/completions", &chat_body("hi", false), ""),
        );
        assert_eq!(r.status, 200);
    }
    assert_eq!(busy_poll(&off).0, 0.0, "busy polled with the option off");
    drop(off);

    let env = start(
        &[("r", route_for(&[m.addr()], ""))],
        "busy_poll_us = 10000\n",
    );
    let (b0, uring) = busy_poll(&env);
    // Each scrape is a request too: it opens a 10 ms window, and then the worker waits.
    std::thread::sleep(Duration::from_millis(500));
    let (b1, _) = busy_poll(&env);
    std::thread::sleep(Duration::from_millis(500));
    let (b2, _) = busy_poll(&env);
    if off_the_ring(uring, [b0, b1, b2]) {
        return;
    }
    assert!(
        b1 - b0 < 0.25 && b2 - b1 < 0.25,
        "kept polling while idle: {b0} -> {b1} -> {b2} s over two 500 ms pauses"
    );
    // Traffic: 50 requests 2 ms apart, each opening a 10 ms window.
    for _ in 0..50 {
        let r = request(
            env.public(),
            &post_json("/r/v1/chat/completions", &chat_body("hi", false), ""),
        );
        assert_eq!(r.status, 200);
        std::thread::sleep(Duration::from_millis(2));
    }
    let (b3, _) = busy_poll(&env);
    assert!(
        b3 - b2 >= 0.05,
        "50 requests over ~100 ms: busy polled {} s",
        b3 - b2
    );
}

/// `n` chat requests on one keep-alive connection to `route`, `pause` apart.
fn keepalive_chats(env: &Env, route: &str, n: usize, pause: Duration) {
    let conn = connect(env.public());
    let mut w = conn.try_clone().unwrap();
    let mut r = std::io::BufReader::new(conn);
    let req = post_json(
        &format!("/{route}/v1/chat/completions"),
        &chat_body("hi", false),
        "",
    );
    for _ in 0..n {
        w.write_all(&req).unwrap();
        let resp = read_response(&mut r, false).unwrap();
        assert_eq!(resp.status, 200);
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
    }
}

/// The default, `busy_poll_us = "auto"`, polls only where it pays: requests milliseconds
/// apart (an LLM's pace) get no polling, where a fixed 200 µs window would have spent that
/// much after each start and finish; a tight ping-pong of short requests does get it.
#[test]
fn auto_busy_polling_polls_a_ping_pong_but_not_requests_milliseconds_apart() {
    let fast = mock("fast");
    let slow = mock_with("slow", |c| c.ttft_base_ms = 4);
    let env = start(
        &[
            ("fast", route_for(&[fast.addr()], "")),
            ("slow", route_for(&[slow.addr()], "")),
        ],
        "",
    );
    let (b0, uring) = busy_poll(&env);
    // 60 requests taking 4 ms each, 3 ms apart: every gap between a start and a finish is
    // longer than the window can grow. A fixed 200 µs window would spend ≥ 24 ms here.
    keepalive_chats(&env, "slow", 60, Duration::from_millis(3));
    let (b1, _) = busy_poll(&env);
    // Control: the same router with requests back to back.
    keepalive_chats(&env, "fast", 2000, Duration::ZERO);
    let (b2, _) = busy_poll(&env);
    if off_the_ring(uring, [b0, b1, b2]) {
        return;
    }
    assert!(
        b1 - b0 < 0.010,
        "polled {} s for 60 requests milliseconds apart",
        b1 - b0
    );
    assert!(
        b2 > b1,
        "no polling for 2000 back-to-back requests: {b1} -> {b2} s"
    );
}

/// `promtool check metrics` exits 0 on the exposition, when promtool is on PATH.
fn promtool_check(text: &str) {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("promtool not on PATH: skipping `promtool check metrics`");
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed ({}):\n{}{}\n--- exposition ---\n{text}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn ttft_and_decode_rate_histograms_and_tokens() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    for _ in 0..2 {
        let body = chat_body("one two three four", true);
        let r = request(
            env.public(),
            &post_json(
                "/r/v1/chat/completions",
                &body,
                "x-mock-ttft-ms: 300\r\nx-mock-tokens: 20\r\nx-mock-interval-ms: 30\r\n",
            ),
        );
        assert_eq!(r.status, 200);
    }
    // A response's figures are recorded when its relay ends, which can be a moment after
    // the client has read the last byte.
    let mut scraped = scrape(&env);
    eventually(Duration::from_secs(5), "both responses recorded", || {
        scraped = scrape(&env);
        let at_least = |k: &str, n: f64| scraped.1.get(k).is_some_and(|&v| v >= n);
        at_least(
            r#"warmroute_decode_rate_tokens_per_second_count{route="r"}"#,
            2.0,
        ) && at_least(r#"warmroute_completion_tokens_total{route="r"}"#, 40.0)
    });
    let (text, s) = scraped;
    // Both TTFTs (300 ms plus a little) land at or below 0.5 s, none at or below 0.25 s.
    assert_eq!(val(&s, r#"warmroute_ttft_seconds_count{route="r"}"#), 2.0);
    assert_eq!(
        val(&s, r#"warmroute_ttft_seconds_bucket{route="r",le="0.5"}"#),
        2.0
    );
    assert_eq!(
        val(&s, r#"warmroute_ttft_seconds_bucket{route="r",le="0.25"}"#),
        0.0
    );
    assert_eq!(
        val(&s, r#"warmroute_ttft_seconds_bucket{route="r",le="+Inf"}"#),
        2.0
    );
    let ttft_sum = val(&s, r#"warmroute_ttft_seconds_sum{route="r"}"#);
    assert!((0.6..1.0).contains(&ttft_sum), "{ttft_sum}");
    // 20 tokens over ~0.57 s: ~35 tokens/s, in the 30–40 bucket.
    assert_eq!(
        val(
            &s,
            r#"warmroute_decode_rate_tokens_per_second_count{route="r"}"#
        ),
        2.0
    );
    assert_eq!(
        val(
            &s,
            r#"warmroute_decode_rate_tokens_per_second_bucket{route="r",le="30"}"#
        ),
        0.0
    );
    assert_eq!(
        val(
            &s,
            r#"warmroute_decode_rate_tokens_per_second_bucket{route="r",le="50"}"#
        ),
        2.0
    );
    assert_eq!(
        val(&s, r#"warmroute_completion_tokens_total{route="r"}"#),
        40.0
    );
    assert_eq!(
        val(&s, r#"warmroute_prompt_tokens_total{route="r"}"#),
        m.stats().prompt_tokens as f64
    );
    // Per-peer EWMAs: both samples on the one peer, ~0.3 s TTFT, ~35 tokens/s.
    let peer_series = |name: &str| {
        s.iter()
            .find(|(k, _)| k.starts_with(&format!("{name}{{")))
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("no {name}"))
    };
    assert!((0.25..1.0).contains(&peer_series("warmroute_peer_ttft_ewma_seconds")));
    assert!((20.0..50.0).contains(&peer_series("warmroute_peer_decode_rate_ewma")));
    assert!(s
        .keys()
        .any(|k| k.starts_with("warmroute_pool_effective_limit{")));
    promtool_check(&text);
}

/// SPEC §10: `/metrics` has the statuses. Each answer on a route counts once in its class:
/// the peer's 200 and 500, and the router's own 413 (a body over the route's limit).
#[test]
fn responses_are_counted_by_status_class() {
    let m = mock("m0");
    let env = start(
        &[("r", route_for(&[m.addr()], "max_body_size = \"1k\"\n"))],
        "",
    );
    let chat = |extra: &str, content: &str| {
        request(
            env.public(),
            &post_json("/r/v1/chat/completions", &chat_body(content, false), extra),
        )
        .status
    };
    for _ in 0..3 {
        assert_eq!(chat("", "x"), 200);
    }
    assert_eq!(chat("x-mock-status: 500\r\n", "x"), 500);
    assert_eq!(chat("", &"y".repeat(4096)), 413);
    let class = |c: &str| format!(r#"warmroute_responses_total{{route="r",code="{c}"}}"#);
    let (_, series) = scrape(&env);
    assert_eq!(val(&series, &class("2xx")), 3.0);
    assert_eq!(val(&series, &class("5xx")), 1.0);
    assert_eq!(val(&series, &class("4xx")), 1.0);
    assert_eq!(val(&series, &class("3xx")), 0.0);
}

/// A head refused before it parsed is logged with how long it had been arriving: a 408
/// for a head still incomplete at `client_head_timeout_ms` shows that wait (it showed 0),
/// and a malformed head refused in its first read shows about none.
#[test]
fn a_head_timeout_is_logged_with_the_time_the_head_took() {
    let m = mock("m0");
    let log = shm_path("head-timeout-log");
    let env = start_logging(
        &[("r", route_for(&[m.addr()], ""))],
        "client_head_timeout_ms = 400\n",
        warmroute::worker::AccessLogTarget::File(log.clone()),
    );
    let mut c = connect(env.public());
    c.write_all(b"GET /r/v1/models HTTP/1.1\r\nHost: t\r\n")
        .unwrap();
    let resp = read_response(&mut BufReader::new(c), false).unwrap();
    assert_eq!(resp.status, 408);
    // The control: refused at once.
    assert_eq!(request(env.public(), b"BLAH\r\n\r\n").status, 400);
    eventually(Duration::from_secs(3), "two access lines", || {
        access_lines(&log).len() == 2
    });
    let total = |status: u64| {
        let lines = access_lines(&log);
        let l = lines.iter().find(|l| l["status"] == status).unwrap();
        l["total_ms"].as_f64().unwrap()
    };
    assert!((390.0..2000.0).contains(&total(408)), "{}", total(408));
    assert!(total(400) < 100.0, "{}", total(400));
    let _ = std::fs::remove_file(&log);
}

/// A peer's EWMAs in `/metrics` expire with their route's `ttft_ttl` / `tps_ttl`, as
/// `_health_status` shows them (they stayed for 60 s whatever the route said). The
/// control: both are there right after the sample.
#[test]
fn peer_ewmas_in_metrics_expire_with_the_routes_ttl() {
    let m = mock_with("m0", |c| {
        c.ttft_base_ms = 100;
        c.decode_tps = 100.0;
    });
    let route = route_for(&[m.addr()], "ttft_ttl = 2\ntps_ttl = 2\n");
    let env = start(&[("r", route)], "");
    // 80 tokens at 100 tokens/s: long enough a decode to be measured.
    let body = serde_json::json!({"model": "m", "stream": true, "max_tokens": 80, "messages": [{"role": "user", "content": "go"}]});
    let r = request(
        env.public(),
        &post_json("/r/v1/chat/completions", &body.to_string(), ""),
    );
    assert_eq!(r.status, 200);
    let has = |name: &str| {
        scrape(&env)
            .1
            .keys()
            .any(|k| k.starts_with(&format!("{name}{{")))
    };
    let both = || {
        (
            has("warmroute_peer_ttft_ewma_seconds"),
            has("warmroute_peer_decode_rate_ewma"),
        )
    };
    // The samples are recorded a moment after the client has its last byte.
    eventually(Duration::from_secs(2), "both EWMAs shown", || {
        both() == (true, true)
    });
    std::thread::sleep(Duration::from_millis(3500));
    assert_eq!(both(), (false, false));
    let hs = request(env.public(), &get("/r/_health_status")).json();
    assert!(hs[m.addr().to_string()]["ttft_ewma_ms"].is_null(), "{hs}");
}
