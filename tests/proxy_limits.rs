//! Malformed and oversize requests get a clear error and the process keeps serving.

mod common;

use std::io::{BufReader, Read, Write};

use common::*;

#[test]
fn body_over_route_limit_is_413_before_reading() {
    let m = mock("m0");
    let env = start(
        &[("r", route_for(&[m.addr()], "max_body_size = \"10m\"\n"))],
        "",
    );
    let size = 11 * 1024 * 1024;
    // Send only the head: the answer must come without the body being sent.
    let mut s = connect(env.public());
    s.write_all(
        format!(
            "POST /r/v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {size}\r\n\r\n"
        )
        .as_bytes(),
    )
    .unwrap();
    let resp = read_response(&mut BufReader::new(s), false).unwrap();
    assert_eq!(resp.status, 413);
    assert_eq!(resp.json()["error"]["type"], "request_too_large");
    assert_eq!(resp.json()["error"]["route"], "r");
    // With the whole body sent too, the client still reads the 413.
    let mut raw = format!(
        "POST /r/v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {size}\r\n\r\n"
    )
    .into_bytes();
    raw.resize(raw.len() + size, b'a');
    let mut s = connect(env.public());
    let writer = {
        let mut w = s.try_clone().unwrap();
        std::thread::spawn(move || {
            let _ = w.write_all(&raw);
        })
    };
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    writer.join().unwrap();
    assert!(
        String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 413 "),
        "{}",
        String::from_utf8_lossy(&buf[..buf.len().min(200)])
    );
    // The control: just under the limit is accepted and forwarded.
    let ok = 1024 * 1024;
    let mut raw = format!(
        "POST /r/v1/x HTTP/1.1\r\nHost: t\r\nx-mock-echo: 1\r\nContent-Length: {ok}\r\n\r\n"
    )
    .into_bytes();
    raw.resize(raw.len() + ok, b'b');
    assert_eq!(request(env.public(), &raw).status, 200);
    assert_eq!(
        m.stats().http_requests,
        1,
        "the refused bodies never reached the backend"
    );
}

#[test]
fn expect_100_continue_is_answered() {
    let m = mock("m0");
    let env = start(
        &[("r", route_for(&[m.addr()], "max_body_size = \"1k\"\n"))],
        "",
    );
    let mut s = connect(env.public());
    s.write_all(b"POST /r/v1/x HTTP/1.1\r\nHost: t\r\nx-mock-echo: 1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n").unwrap();
    let mut first = [0u8; 25];
    s.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 100 Continue\r\n\r\n");
    s.write_all(b"hello").unwrap();
    let resp = read_response(&mut BufReader::new(s), false).unwrap();
    assert_eq!((resp.status, resp.body.as_slice()), (200, &b"hello"[..]));
    // Too large: 413 instead of 100.
    let mut s = connect(env.public());
    s.write_all(
        b"POST /r/v1/x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n",
    )
    .unwrap();
    assert_eq!(
        read_response(&mut BufReader::new(s), false).unwrap().status,
        413
    );
}

#[test]
fn framing_conflicts_are_400_and_oversize_heads_431() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (b"POST /r/v1/x HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(), 400),
        (b"POST /r/v1/x HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello".to_vec(), 400),
        (b"POST /r/v1/x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".to_vec(), 400),
        // A trailer line ended by a bare LF used to hide the pipelined request after it.
        (b"POST /r/v1/x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-T: 1\n\r\nGET /r/v1/models HTTP/1.1\r\nHost: t\r\n\r\n".to_vec(), 400),
        (b"POST /r/v1/x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nno colon\r\n\r\n".to_vec(), 400),
        (b"POST /r/v1/x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n".to_vec(), 501),
        (b"BLAH\r\n\r\n".to_vec(), 400),
        (b"GET /r/v1/models HTTP/2.0\r\nHost: t\r\n\r\n".to_vec(), 505),
        (b"GET /r/v1/models HTTP/3.0\r\nHost: t\r\n\r\n".to_vec(), 505),
        // A later HTTP/1 minor version is read as HTTP/1.1, which requires a Host.
        (b"GET /r/v1/models HTTP/1.2\r\n\r\n".to_vec(), 400),
        // httparse calls these version errors too; they are malformed request lines.
        (b"GET /r/v1/a b HTTP/1.1\r\nHost: t\r\n\r\n".to_vec(), 400),
        (b"GET /r/v1/models http/1.1\r\nHost: t\r\n\r\n".to_vec(), 400),
        (b"GET /r/v1/models HTTP/1!\r\nHost: t\r\n\r\n".to_vec(), 400),
        (b"GET /r/v1/models HTTP/1.1\r\nHost: a b\r\n\r\n".to_vec(), 400),
        (b"GET /r/v1/models HTTP/1.1\r\nHost: evil/x\r\n\r\n".to_vec(), 400),
        (format!("GET /r/v1/x HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n", "a".repeat(70 * 1024)).into_bytes(), 431),
        // A request line that alone passes the head limit: 414 (RFC 9112 §3), as nginx.
        (format!("GET /r/v1/{} HTTP/1.1\r\nHost: t\r\n\r\n", "a".repeat(70 * 1024)).into_bytes(), 414),
        // TRACE would echo the client's credentials back; the router opens no tunnels.
        (b"TRACE /r/v1/models HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n\r\n".to_vec(), 405),
        (b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n".to_vec(), 405),
        ((0..101).fold(b"GET /r/v1/x HTTP/1.1\r\n".to_vec(), |mut v, i| { v.extend(format!("H{i}: v\r\n").bytes()); v }).into_iter().chain(*b"\r\n").collect(), 431),
    ];
    for (raw, status) in cases {
        let resp = request(env.public(), &raw);
        assert_eq!(
            resp.status,
            status,
            "{}",
            String::from_utf8_lossy(&raw[..raw.len().min(80)])
        );
        let kind = match status {
            501 => "not_implemented",
            505 => "http_version_not_supported",
            431 => "request_header_too_large",
            414 => "uri_too_long",
            405 => "method_not_allowed",
            _ => "bad_request",
        };
        assert_eq!(resp.json()["error"]["type"], kind);
        assert_eq!(resp.header("connection"), Some("close"));
        if status == 405 {
            // RFC 9110 §15.5.6.
            assert!(resp.header("allow").is_some_and(|a| a.contains("POST")));
        }
    }
    assert_eq!(
        m.stats().http_requests,
        0,
        "nothing malformed reached the backend"
    );
    // The process still serves.
    assert_eq!(
        request(
            env.public(),
            &post_json("/r/v1/chat/completions", &chat_body("x", false), "")
        )
        .status,
        200
    );
}

#[test]
fn unknown_route_is_404_listing_routes() {
    let m = mock("m0");
    let env = start(
        &[
            ("alpha", route_for(&[m.addr()], "")),
            ("beta", route_for(&[m.addr()], "")),
        ],
        "",
    );
    let r = request(env.public(), &get("/gamma/v1/models"));
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "unknown_route");
    assert_eq!(
        r.json()["error"]["routes"],
        serde_json::json!(["alpha", "beta"])
    );
    // Control: a known route with the same rest is proxied.
    let r = request(env.public(), &get("/alpha/v1/models"));
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-mock-peer"), Some("m0"));
}

#[test]
fn garbage_bytes_never_take_the_process_down() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let mut x = 0x9E37_79B9u32;
    for i in 0..200 {
        let mut junk = Vec::new();
        for _ in 0..(i * 7 % 300 + 1) {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            junk.push(match x % 6 {
                0 => b'\r',
                1 => b'\n',
                2 => b':',
                _ => (x >> 8) as u8,
            });
        }
        let prefix: &[u8] = if i % 2 == 0 {
            b"POST /r/v1/x HTTP/1.1\r\n"
        } else {
            b""
        };
        let mut s = connect(env.public());
        s.set_read_timeout(Some(std::time::Duration::from_millis(300)))
            .unwrap();
        let _ = s.write_all(prefix);
        let _ = s.write_all(&junk);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    assert_eq!(
        request(
            env.public(),
            &post_json("/r/v1/chat/completions", &chat_body("x", false), "")
        )
        .status,
        200
    );
}

#[test]
fn the_routers_own_answers_to_head_carry_no_body() {
    // A body after a HEAD answer is read by the client as the start of the next response:
    // each HEAD below is followed by a GET on the same connection, which must come out
    // whole.
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let cases: [(std::net::SocketAddr, &str, u16); 4] = [
        (env.admin(), "/metrics", 200),
        (env.admin(), "/healthz", 200),
        (env.public(), "/nope/v1/models", 404),
        (env.public(), "/r/_route_state", 200),
    ];
    for (addr, path, status) in cases {
        let mut r = BufReader::new(connect(addr));
        let got = exchange(
            &mut r,
            format!("HEAD {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes(),
            true,
        );
        assert_eq!(got.status, status, "HEAD {path}");
        // The length of the body a GET would get is announced.
        let len: usize = got.header("content-length").unwrap().parse().unwrap();
        assert!(len > 0, "HEAD {path}");
        let next = exchange(
            &mut r,
            format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes(),
            false,
        );
        assert_eq!(next.status, status, "GET {path} after HEAD");
        assert!(!next.body.is_empty(), "GET {path} after HEAD");
        // The router's own answers carry a Date (RFC 9110 §6.6.1).
        assert!(
            next.header("date").is_some_and(|d| d.ends_with(" GMT")),
            "{:?}",
            next.headers
        );
    }
    // A proxied HEAD was already right; it stays so (the control: the peer's length).
    let mut r = BufReader::new(connect(env.public()));
    let got = exchange(
        &mut r,
        b"HEAD /r/v1/models HTTP/1.1\r\nHost: t\r\n\r\n",
        true,
    );
    assert_eq!(got.status, 200);
    let next = exchange(
        &mut r,
        b"GET /r/v1/models HTTP/1.1\r\nHost: t\r\n\r\n",
        false,
    );
    assert_eq!(next.status, 200);
    assert!(next.json()["data"].is_array());
}

#[test]
fn a_peer_length_sent_next_to_chunked_does_not_reach_the_client() {
    let b = raw_backend(
        vec![b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n".to_vec()],
        usize::MAX,
    );
    let env = start(&[("r", route_for(&[b.addr], ""))], "");
    let mut r = BufReader::new(connect(env.public()));
    let got = exchange(&mut r, b"GET /r/v1/x HTTP/1.1\r\nHost: t\r\n\r\n", false);
    assert_eq!((got.status, got.body.as_slice()), (200, &b"ok"[..]));
    assert_eq!(got.header("content-length"), None, "{:?}", got.headers);
    assert!(got
        .header("transfer-encoding")
        .is_some_and(|v| v.contains("chunked")));
    // The connection is still in step.
    let next = exchange(&mut r, b"GET /r/v1/x HTTP/1.1\r\nHost: t\r\n\r\n", false);
    assert_eq!((next.status, next.body.as_slice()), (200, &b"ok"[..]));
}

#[test]
fn an_absolute_form_target_is_proxied_by_its_path_and_other_codings_get_501() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    // As a client configured with the router as its HTTP proxy sends it.
    let got = request(
        env.public(),
        b"GET http://llm.internal/r/v1/models HTTP/1.1\r\nHost: llm.internal\r\n\r\n",
    );
    assert_eq!(got.status, 200);
    assert!(got.json()["data"].is_array());
    // A coding besides chunked would reach the peer undone (the router de-chunks).
    let post = |te: &str| {
        let body = b"{\"model\":\"m\",\"messages\":[]}";
        let mut raw = format!(
            "POST /r/v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: {te}\r\n\r\n{:x}\r\n",
            body.len()
        )
        .into_bytes();
        raw.extend_from_slice(body);
        raw.extend_from_slice(b"\r\n0\r\n\r\n");
        request(env.public(), &raw).status
    };
    for te in ["gzip, chunked", "chunked, chunked"] {
        assert_eq!(post(te), 501, "{te}");
    }
    // The control: chunked alone is proxied.
    assert_eq!(post("chunked"), 200);
}

#[test]
fn unknown_routes_and_oversize_bare_requests_are_answered_before_the_body() {
    let m = mock("m0");
    let env = start(
        &[
            (
                "small",
                route_for(&[m.addr()], "max_body_size = \"1k\"\nmodels = [\"a\"]\n"),
            ),
            (
                "large",
                route_for(&[m.addr()], "max_body_size = \"2k\"\nmodels = [\"b\"]\n"),
            ),
        ],
        "",
    );
    let ask = |path: &str, len: usize| {
        let mut s = connect(env.public());
        s.write_all(
            format!("POST {path} HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: {len}\r\n\r\n")
                .as_bytes(),
        )
        .unwrap();
        let mut r = BufReader::new(s);
        read_response(&mut r, false).map(|resp| resp.status)
    };
    // A mistyped route with a long prompt: 404 at once, not 413 and not 100 Continue.
    assert_eq!(ask("/nope/v1/chat/completions", 5 << 20).unwrap(), 404);
    // A bare request larger than every model route's limit: 413 at once.
    assert_eq!(ask("/v1/chat/completions", 3000).unwrap(), 413);
    // The control: within the largest limit, the router asks for the body (100) and
    // routes by the model in it.
    let mut s = connect(env.public());
    let body = br#"{"model":"b","messages":[{"role":"user","content":"hi"}]}"#;
    s.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    )
    .unwrap();
    let mut first = [0u8; 25];
    s.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 100 Continue\r\n\r\n");
    s.write_all(body).unwrap();
    assert_eq!(
        read_response(&mut BufReader::new(s), false).unwrap().status,
        200
    );
}

/// A request to a route that does not exist is answered from its head. When its body came
/// whole with the head, the body is dropped and the connection serves the next request;
/// before, every such 404 closed the connection (and lost a pipelined request behind it).
#[test]
fn a_404_keeps_the_connection_when_the_body_came_with_the_head() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let mut s = connect(env.public());
    let mut both = post_json("/nope/v1/chat/completions", &chat_body("x", false), "");
    both.extend_from_slice(&post_json(
        "/r/v1/chat/completions",
        &chat_body("y", false),
        "",
    ));
    s.write_all(&both).unwrap();
    let mut r = BufReader::new(s);
    let first = read_response(&mut r, false).unwrap();
    assert_eq!(first.status, 404);
    assert_ne!(first.header("connection"), Some("close"));
    let second = read_response(&mut r, false).unwrap();
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.header("x-mock-peer"), Some("m0"));
    // The control: a body still arriving is left unread, and the connection closes.
    let mut s = connect(env.public());
    s.write_all(b"POST /nope/v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"model\"")
        .unwrap();
    let mut r = BufReader::new(s);
    let first = read_response(&mut r, false).unwrap();
    assert_eq!(first.status, 404);
    assert_eq!(first.header("connection"), Some("close"));
    assert!(
        read_response(&mut r, false).is_err(),
        "closed after the 404"
    );
}

/// A route checks the key before it reads the body, so its 401 is answered from the head
/// too. When the body came whole with the head it is dropped and the connection serves the
/// next request; before, such a 401 closed the connection and lost the request behind it.
#[test]
fn a_401_keeps_the_connection_when_the_body_came_with_the_head() {
    let m = mock("m0");
    let env = start(
        &[(
            "k",
            route_for(&[m.addr()], "api_keys = { \"sk\" = \"o\" }\n"),
        )],
        "",
    );
    let mut s = connect(env.public());
    let mut both = post_json("/k/v1/chat/completions", &chat_body("x", false), "");
    both.extend_from_slice(&post_json(
        "/k/v1/chat/completions",
        &chat_body("y", false),
        "authorization: Bearer sk\r\n",
    ));
    s.write_all(&both).unwrap();
    let mut r = BufReader::new(s);
    let first = read_response(&mut r, false).unwrap();
    assert_eq!(first.status, 401);
    assert_ne!(first.header("connection"), Some("close"));
    let second = read_response(&mut r, false).unwrap();
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.header("x-mock-peer"), Some("m0"));
    // The control: a body still arriving is left unread, and the connection closes.
    let mut s = connect(env.public());
    s.write_all(
        b"POST /k/v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"model\"",
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let first = read_response(&mut r, false).unwrap();
    assert_eq!(first.status, 401);
    assert_eq!(first.header("connection"), Some("close"));
    assert!(
        read_response(&mut r, false).is_err(),
        "closed after the 401"
    );
}

/// A bare request (dispatched by its body's model) reads its body before the key is
/// checked, so its 401 leaves nothing on the wire and keeps the connection, whether the
/// body came with a length or chunked; the request behind it is served.
#[test]
fn a_bare_requests_401_keeps_the_connection() {
    let m = mock("m0");
    let env = start(
        &[(
            "k",
            route_for(
                &[m.addr()],
                "api_keys = { \"sk\" = \"o\" }\nmodels = [\"mock-model\"]\n",
            ),
        )],
        "",
    );
    let body = chat_body("x", false);
    let mut all = post_json("/v1/chat/completions", &body, "");
    all.extend_from_slice(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
             Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    all.extend_from_slice(&post_json(
        "/v1/chat/completions",
        &body,
        "authorization: Bearer sk\r\n",
    ));
    let mut s = connect(env.public());
    s.write_all(&all).unwrap();
    let mut r = BufReader::new(s);
    for framing in ["content-length", "chunked"] {
        let refused = read_response(&mut r, false).unwrap();
        assert_eq!(refused.status, 401, "{framing}: {}", refused.text());
        assert_ne!(refused.header("connection"), Some("close"), "{framing}");
    }
    let served = read_response(&mut r, false).unwrap();
    assert_eq!(served.status, 200, "{}", served.text());
    assert_eq!(served.header("x-mock-peer"), Some("m0"));
}

/// A POST to the route with `n` headers in all (`Host`, `Content-Type`, `Content-Length` and
/// `n - 3` more, the last padded) and a head of `head_len` bytes.
fn request_with_headers(n: usize, head_len: usize) -> Vec<u8> {
    let body = chat_body("x", false);
    let mut head = format!(
        "POST /r/v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for i in 0..n - 4 {
        head.push_str(&format!("x-h{i}: v\r\n"));
    }
    // The last header fills the head up to `head_len` (with its CRLF and the blank line).
    let pad = head_len - head.len() - "x-pad: \r\n\r\n".len();
    head.push_str(&format!("x-pad: {}\r\n\r\n", "p".repeat(pad)));
    assert_eq!(head.len(), head_len);
    let mut raw = head.into_bytes();
    raw.extend_from_slice(body.as_bytes());
    raw
}

#[test]
fn the_mock_takes_the_largest_request_the_router_forwards() {
    // The router accepts 100 headers and a 64 KiB head (SPEC §14) and adds its forwarding
    // headers on the way; the bundled mock backend must take what arrives.
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let r = request(env.public(), &request_with_headers(100, 64 * 1024 - 1));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-mock-peer"), Some("m0"));
    let r = request(env.public(), &request_with_headers(100, 2048));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(m.stats().http_requests, 2);
    // The control: one header more is the router's own 431, which never reaches the mock.
    let r = request(env.public(), &request_with_headers(101, 2048));
    assert_eq!(r.status, 431);
    assert_eq!(r.header("x-mock-peer"), None);
    assert_eq!(m.stats().http_requests, 2);
}

/// An HTTP/1.0 client that asks for keep-alive keeps its connection only when the answer
/// says `Connection: keep-alive` (RFC 9112 §9.3, C.2.2). The router's own answers (a 404,
/// a debug endpoint, a 401) said nothing while keeping the connection, so such a client
/// (`ab -k`) waited for a close that came only at the idle timeout.
#[test]
fn http_1_0_keep_alive_clients_are_told_on_the_routers_own_answers() {
    let m = mock("m0");
    let env = start(
        &[
            ("r", route_for(&[m.addr()], "")),
            (
                "k",
                route_for(&[m.addr()], "api_keys = { \"sk\" = \"o\" }\n"),
            ),
        ],
        "",
    );
    let c = connect(env.public());
    let mut rd = BufReader::new(c.try_clone().unwrap());
    let mut c = c;
    let ka = "Connection: keep-alive\r\n";
    let asks = [
        (format!("GET /nope/v1/x HTTP/1.0\r\n{ka}\r\n"), 404),
        (format!("GET /r/_route_state HTTP/1.0\r\n{ka}\r\n"), 200),
        (format!("GET /k/v1/models HTTP/1.0\r\n{ka}\r\n"), 401),
        (format!("HEAD /nope/v1/x HTTP/1.0\r\n{ka}\r\n"), 404),
        // The control: a proxied answer said so already.
        (format!("GET /r/v1/models HTTP/1.0\r\n{ka}\r\n"), 200),
    ];
    for (raw, status) in &asks {
        c.write_all(raw.as_bytes()).unwrap();
        let head = raw.starts_with("HEAD");
        let resp = read_response(&mut rd, head).unwrap();
        assert_eq!(resp.status, *status, "{raw}");
        assert_eq!(resp.header("connection"), Some("keep-alive"), "{raw}");
    }
    // Without keep-alive an HTTP/1.0 answer says close, and the router closes.
    c.write_all(b"GET /nope/v1/x HTTP/1.0\r\n\r\n").unwrap();
    let resp = read_response(&mut rd, false).unwrap();
    assert_eq!(
        (resp.status, resp.header("connection")),
        (404, Some("close"))
    );
    let mut rest = Vec::new();
    rd.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}

/// A chunked body whose framing breaks in the peer's first read: the client gets the
/// response head and what came before the break, then the cut, as when it breaks in a
/// later read (it used to get an empty reply while the access line said 200).
#[test]
fn a_chunked_body_broken_in_its_first_read_still_gives_the_client_the_head() {
    for (what, json) in [("sse", false), ("json", true)] {
        let ctype = if json {
            "application/json"
        } else {
            "text/event-stream"
        };
        let b = raw_backend(
            vec![format!(
                "HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nTransfer-Encoding: chunked\r\n\r\n\
                 f\r\ndata: {{\"x\":1}}\n\n\r\nzz\r\n"
            )
            .into_bytes()],
            usize::MAX,
        );
        let env = start(&[("r", route_for(&[b.addr], ""))], "");
        let mut c = connect(env.public());
        c.write_all(b"GET /r/v1/x HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{what}: {text:?}");
        // The control: the response is cut, not completed (no last chunk).
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        assert!(!body.contains("0\r\n\r\n"), "{what}: {text:?}");
        // Passed through, the read's complete chunk before the break reaches the client
        // as it came (it used to be dropped with the rest of the read).
        assert_eq!(body, "f\r\ndata: {\"x\":1}\n\n\r\n", "{what}: {text:?}");
        // An HTTP/1.0 client gets the body de-chunked: what decoded before the break
        // reaches it.
        let mut c = connect(env.public());
        c.write_all(b"GET /r/v1/x HTTP/1.0\r\n\r\n").unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{what}: {text:?}");
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        assert!(body.starts_with("data: {\"x\":1}\n"), "{what}: {text:?}");
    }
}

/// Empty lines before a request line are ignored (RFC 9112 §2.2): a CRLF a client sends
/// after a body neither starts the head timeout (an unasked-for 408 came then) nor keeps
/// the connection past its idle timeout, and a request after it is served.
#[test]
fn a_crlf_after_a_body_is_not_the_start_of_a_request() {
    let m = mock("m0");
    let env = start(
        &[("r", route_for(&[m.addr()], ""))],
        "client_idle_timeout_ms = 1500\nclient_head_timeout_ms = 400\n",
    );
    let c = connect(env.public());
    let mut rd = BufReader::new(c.try_clone().unwrap());
    let mut c = c;
    let mut req = post_json("/r/v1/chat/completions", &chat_body("x", false), "");
    req.extend_from_slice(b"\r\n");
    c.write_all(&req).unwrap();
    assert_eq!(read_response(&mut rd, false).unwrap().status, 200);
    // A request after empty lines, even in pieces, is served.
    c.write_all(b"\r\n\r\n").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(600));
    c.write_all(b"GET /r/v1/models HTTP/1.1\r\nHost: t\r\n\r\n\r\n")
        .unwrap();
    assert_eq!(read_response(&mut rd, false).unwrap().status, 200);
    // Then nothing: the connection closes at the idle timeout with no 408.
    let t = std::time::Instant::now();
    let mut rest = Vec::new();
    rd.read_to_end(&mut rest).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&rest),
        "",
        "no answer to an empty line"
    );
    let waited = t.elapsed();
    assert!(
        waited >= std::time::Duration::from_millis(1200),
        "closed after {waited:?}, before the idle timeout"
    );
}

/// A request naming a later HTTP/1 minor version (`HTTP/1.2`) is served as HTTP/1.1, the
/// highest 1.x the router implements (RFC 9110 §2.5), as nginx serves it: forwarded, kept
/// alive, and its head read whole when it comes in pieces. Another major version is 505
/// (in `framing_conflicts_are_400_and_oversize_heads_431`).
#[test]
fn a_later_http1_minor_version_is_served_as_http11() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let mut r = BufReader::new(connect(env.public()));
    let body = chat_body("x", false);
    let req = |v: &str| {
        format!(
            "POST /r/v1/chat/completions HTTP/{v}\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    // Control: the same request as HTTP/1.1.
    let got = exchange(&mut r, req("1.1").as_bytes(), false);
    assert_eq!(got.status, 200, "{}", got.text());
    for v in ["1.2", "1.9"] {
        let got = exchange(&mut r, req(v).as_bytes(), false);
        assert_eq!(got.status, 200, "HTTP/{v}: {}", got.text());
        assert_eq!(got.header("connection"), None, "HTTP/{v} is kept alive");
    }
    // In pieces: the request line's version arrives before its line end.
    let raw = req("1.2");
    let (a, b) = raw
        .as_bytes()
        .split_at("POST /r/v1/chat/completions HTTP/1.2".len());
    r.get_mut().write_all(a).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let got = exchange(&mut r, b, false);
    assert_eq!(got.status, 200, "in pieces: {}", got.text());
    // Two in one write: each is read, and answered in order.
    let two = req("1.2").repeat(2);
    r.get_mut().write_all(two.as_bytes()).unwrap();
    for i in 0..2 {
        let got = read_response(&mut r, false).unwrap();
        assert_eq!(got.status, 200, "pipelined {i}: {}", got.text());
    }
    assert_eq!(m.stats().http_requests, 6, "every request reached the peer");
}
