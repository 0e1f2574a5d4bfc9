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
        (b"POST /r/v1/x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n".to_vec(), 501),
        (b"BLAH\r\n\r\n".to_vec(), 400),
        (format!("GET /r/v1/x HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n", "a".repeat(70 * 1024)).into_bytes(), 431),
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
        assert!(resp.json()["error"]["type"].is_string());
        assert_eq!(resp.header("connection"), Some("close"));
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
