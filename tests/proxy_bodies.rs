//! Bodies through the router are the bodies the backend sent and received, byte for byte;
//! SSE events are relayed as they are produced, never batched.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::time::{Duration, Instant};

use common::*;

fn normalise(s: &str) -> String {
    let re = regex::Regex::new(r#""created":\d+|"id":"[^"]*""#).unwrap();
    re.replace_all(s, "").into_owned()
}

#[test]
fn non_stream_and_stream_bodies_match_a_direct_request() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    for stream in [false, true] {
        let body = chat_body("the quick brown fox jumps over the lazy dog", stream);
        let via = request(
            env.public(),
            &post_json("/r/v1/chat/completions", &body, ""),
        );
        let direct = request(m.addr(), &post_json("/v1/chat/completions", &body, ""));
        assert_eq!(via.status, 200);
        assert_eq!(via.header("x-mock-peer"), Some("m0"));
        assert_eq!(via.header("x-routed-peer"), Some("p0"));
        assert_eq!(
            normalise(&via.text()),
            normalise(&direct.text()),
            "stream={stream}"
        );
        // The control: the body really is a completion, not an empty match.
        assert!(via.text().contains("tok0"), "{}", via.text());
        if stream {
            assert_eq!(via.header("content-type"), Some("text/event-stream"));
            assert!(via.text().ends_with("data: [DONE]\n\n"));
        }
    }
    assert_eq!(inflight_total(&env, "r"), 0);
}

#[test]
fn request_bodies_arrive_intact_json_binary_prompt_sized_and_5_mib() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let mut big = Vec::with_capacity(5 * 1024 * 1024);
    let mut x = 1u32;
    while big.len() < 5 * 1024 * 1024 {
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        big.push((x >> 24) as u8);
    }
    // Prompt-sized bodies reuse a worker's spare buffers: a smaller one after a larger,
    // each with bytes of its own, so a leftover of the one before would show.
    let prompts = [40_000usize, 30_000, 17_000, 60_000]
        .iter()
        .enumerate()
        .map(|(i, &n)| big[i * 7..i * 7 + n].to_vec());
    for body in [
        b"{\"model\":\"m\",\"messages\":[]}".to_vec(),
        vec![0u8, 255, 13, 10, 0, 1],
    ]
    .into_iter()
    .chain(prompts.clone())
    .chain([big.clone()])
    .chain(prompts)
    {
        let mut raw = format!(
            "POST /r/v1/echo?q=1 HTTP/1.1\r\nHost: t\r\nx-mock-echo: 1\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        raw.extend_from_slice(&body);
        let r = request(env.public(), &raw);
        assert_eq!(r.status, 200, "{} bytes: {}", body.len(), r.text());
        assert_eq!(r.body.len(), body.len());
        assert!(r.body == body, "echoed body differs");
    }
}

#[test]
fn chunked_request_body_is_forwarded_with_a_length() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let raw = b"POST /r/v1/x HTTP/1.1\r\nHost: t\r\nx-mock-echo: 1\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n";
    let r = request(env.public(), raw);
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"hello world");
    let headers: Vec<(String, String)> =
        serde_json::from_str(r.header("x-mock-echo-headers").unwrap()).unwrap();
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    assert_eq!(get("content-length").as_deref(), Some("11"));
    assert_eq!(get("transfer-encoding"), None);
    assert_eq!(get("x-real-ip").as_deref(), Some("127.0.0.1"));
    assert_eq!(get("x-forwarded-for").as_deref(), Some("127.0.0.1"));
    assert_eq!(get("x-forwarded-proto").as_deref(), Some("http"));
}

#[test]
fn hop_by_hop_headers_are_dropped_and_forwarding_headers_appended() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let raw = b"GET /r/v1/x HTTP/1.1\r\nHost: t\r\nx-mock-echo: 1\r\nConnection: keep-alive, X-Drop-Me\r\nX-Drop-Me: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nX-Forwarded-For: 10.1.1.1\r\nAuthorization: Bearer k\r\nX-Keep: yes\r\n\r\n";
    let r = request(env.public(), raw);
    assert_eq!(r.status, 200);
    let headers: Vec<(String, String)> =
        serde_json::from_str(r.header("x-mock-echo-headers").unwrap()).unwrap();
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    for gone in ["connection", "x-drop-me", "keep-alive", "te"] {
        assert_eq!(get(gone), None, "{gone} must not be forwarded");
    }
    assert_eq!(get("x-keep").as_deref(), Some("yes"));
    assert_eq!(get("authorization").as_deref(), Some("Bearer k"));
    assert_eq!(
        get("x-forwarded-for").as_deref(),
        Some("10.1.1.1, 127.0.0.1")
    );
    assert_eq!(
        get("host").as_deref(),
        Some(format!("127.0.0.1:{}", m.addr().port()).as_str())
    );
}

/// Names that read as a framing or forwarding header once `_` is read as `-`
/// (`Transfer_Encoding`, `X_Real_IP`) do not reach the peer: a CGI- or WSGI-style stack
/// names both `HTTP_TRANSFER_ENCODING`, and would read a framing the router never checked,
/// or a client address the client chose. Other names with `_` pass (the control), and so
/// does everything when sent with `-` as the router sets it. A chain the client lists in
/// `Connection` is its own hop's: the peer gets only the client's address.
#[test]
fn underscored_lookalikes_of_framing_and_forwarding_headers_are_dropped() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let body = "abc";
    let raw = format!(
        "POST /r/v1/x HTTP/1.1\r\nHost: t\r\nx-mock-echo: 1\r\nTransfer_Encoding: chunked\r\nX_Real_IP: 6.6.6.6\r\nx_forwarded_for: 6.6.6.6\r\nKeep_Alive: 1\r\nX_Custom_Id: kept\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let r = request(env.public(), raw.as_bytes());
    assert_eq!(r.status, 200);
    let headers: Vec<(String, String)> =
        serde_json::from_str(r.header("x-mock-echo-headers").unwrap()).unwrap();
    let names: Vec<String> = headers
        .iter()
        .map(|(k, _)| k.to_ascii_lowercase())
        .collect();
    for gone in [
        "transfer_encoding",
        "x_real_ip",
        "x_forwarded_for",
        "keep_alive",
    ] {
        assert!(!names.iter().any(|n| n == gone), "{gone}: {names:?}");
    }
    assert!(names.iter().any(|n| n == "x_custom_id"), "{names:?}");
    assert!(names.iter().any(|n| n == "x-real-ip"), "{names:?}");
    assert_eq!(r.text(), body, "the body as the router framed it");

    let raw = b"GET /r/v1/x HTTP/1.1\r\nHost: t\r\nx-mock-echo: 1\r\nConnection: X-Forwarded-For\r\nX-Forwarded-For: 6.6.6.6\r\n\r\n";
    let r = request(env.public(), raw);
    let headers: Vec<(String, String)> =
        serde_json::from_str(r.header("x-mock-echo-headers").unwrap()).unwrap();
    let xff: Vec<&str> = headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case("x-forwarded-for"))
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(xff, ["127.0.0.1"]);
}

#[test]
fn sse_events_300ms_apart_arrive_300ms_apart() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let body = chat_body("hello", true);
    let mut s = connect(env.public());
    s.write_all(&post_json(
        "/r/v1/chat/completions",
        &body,
        "x-mock-tokens: 5\r\nx-mock-interval-ms: 300\r\nx-mock-ttft-ms: 0\r\n",
    ))
    .unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    let mut arrivals = Vec::new();
    let t0 = Instant::now();
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap() == 0 {
            break;
        }
        if line.starts_with("data: {") && line.contains("\"content\"") {
            arrivals.push(t0.elapsed());
        }
        if line.starts_with("data: [DONE]") {
            break;
        }
    }
    assert_eq!(arrivals.len(), 5, "five token events");
    for w in arrivals.windows(2) {
        let gap = w[1] - w[0];
        // Batching would show as gaps near 0 (events in the same read) followed by a long
        // one. One event held up on a loaded machine arrives late and shortens the next
        // gap, so the floor is well above a batch's and well below 300 ms.
        assert!(
            gap >= Duration::from_millis(50) && gap <= Duration::from_millis(1500),
            "gap {gap:?} in {arrivals:?}"
        );
    }
    // And the stream as a whole keeps the engine's pace: four gaps of 300 ms.
    let span = arrivals[4] - arrivals[0];
    assert!(span >= Duration::from_millis(1000), "{arrivals:?}");
}

#[test]
fn keep_alive_and_pipelined_requests_on_one_connection() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let mut s = connect(env.public());
    let one = post_json("/r/v1/chat/completions", &chat_body("a b c", false), "");
    let mut two = one.clone();
    two.extend_from_slice(&one);
    // Two requests in one write, then a third after the answers.
    s.write_all(&two).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    for _ in 0..2 {
        let resp = read_response(&mut r, false).unwrap();
        assert_eq!(resp.status, 200);
        assert!(resp.text().contains("chat.completion"));
    }
    s.write_all(&one).unwrap();
    assert_eq!(read_response(&mut r, false).unwrap().status, 200);
    // Connection: close is honoured.
    s.write_all(&post_json(
        "/r/v1/chat/completions",
        &chat_body("x", false),
        "Connection: close\r\n",
    ))
    .unwrap();
    let resp = read_response(&mut r, false).unwrap();
    assert_eq!(resp.header("connection"), Some("close"));
    let mut rest = Vec::new();
    assert_eq!(
        r.read_to_end(&mut rest).unwrap(),
        0,
        "router closed the connection"
    );
    assert_eq!(m.stats().completions, 4);
}

#[test]
fn sequential_keep_alive_requests_have_no_delayed_ack_floor() {
    // With Nagle on either side a small request/response loop stalls ~40 ms per request.
    // 100 requests must therefore finish far below 100 × 40 ms.
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let mut s = connect(env.public());
    let mut r = BufReader::new(s.try_clone().unwrap());
    let req = post_json("/r/v1/chat/completions", &chat_body("hi", false), "");
    let t0 = Instant::now();
    for _ in 0..100 {
        // Head and body in two writes, as many clients do.
        let split = req.len() - 20;
        s.write_all(&req[..split]).unwrap();
        s.write_all(&req[split..]).unwrap();
        assert_eq!(read_response(&mut r, false).unwrap().status, 200);
    }
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(3000),
        "100 keep-alive requests took {took:?}"
    );
}

#[test]
fn upstream_api_key_replaces_the_clients_credentials() {
    let m = mock("m0");
    let env = start(
        &[
            (
                "swap",
                route_for(&[m.addr()], "upstream_api_key = \"backend-key\"\n"),
            ),
            ("plain", route_for(&[m.addr()], "")),
        ],
        "",
    );
    let echo = |route: &str| {
        let raw = format!("GET /{route}/v1/x HTTP/1.1\r\nHost: t\r\nx-mock-echo: 1\r\nAuthorization: Bearer client-key\r\nx-api-key: client-key\r\nX_Api_Key: client-key\r\n\r\n");
        let r = request(env.public(), raw.as_bytes());
        let headers: Vec<(String, String)> =
            serde_json::from_str(r.header("x-mock-echo-headers").unwrap()).unwrap();
        headers
    };
    let swapped = echo("swap");
    let auth: Vec<&String> = swapped
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case("authorization"))
        .map(|(_, v)| v)
        .collect();
    assert_eq!(
        auth,
        ["Bearer backend-key"],
        "exactly one Authorization, the route's"
    );
    // Nor by another spelling, which a CGI- or WSGI-style peer reads as `X-Api-Key`.
    assert!(!swapped
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("x-api-key") || k.eq_ignore_ascii_case("x_api_key")));
    // The control: without the option the client's credentials pass through.
    let plain = echo("plain");
    assert!(plain
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("authorization") && v == "Bearer client-key"));
    assert!(plain.iter().any(|(k, _)| k == "X_Api_Key"));
}
