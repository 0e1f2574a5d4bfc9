//! The relay's re-framing path end to end: every response framing × client HTTP version ×
//! response-filter chain (the usage filter, postprocess, both, none), with the backend's bytes
//! written in random pieces: the client gets exactly what the filters make of the body.

mod common;

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use common::*;
use warmroute::postprocess::{Handler, Mode, PostProcessor};
use warmroute::transform::UsageFrameFilter;

#[derive(Clone, Copy, Debug)]
enum Framing {
    Length,
    Chunked,
    UntilClose,
}

/// A backend that answers every request with `body` framed as `framing`, writing the bytes in
/// pieces cut at `seed`-chosen places with short pauses.
fn backend(body: Vec<u8>, ct: &'static str, framing: Framing, seed: u64) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut seed = seed;
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            s.set_nodelay(true).ok();
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let body = body.clone();
            let my = seed;
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                while read_request(&mut s, &mut buf).is_some() {
                    let mut wire =
                        format!("HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\n").into_bytes();
                    let mut rng = my;
                    let mut next = || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng
                    };
                    match framing {
                        Framing::Length => {
                            wire.extend(format!("Content-Length: {}\r\n\r\n", body.len()).bytes());
                            wire.extend_from_slice(&body);
                        }
                        Framing::UntilClose => {
                            wire.extend_from_slice(b"Connection: close\r\n\r\n");
                            wire.extend_from_slice(&body);
                        }
                        Framing::Chunked => {
                            wire.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                            let mut i = 0;
                            while i < body.len() {
                                let n = (1 + next() as usize % 40).min(body.len() - i);
                                wire.extend(format!("{n:x}\r\n").bytes());
                                wire.extend_from_slice(&body[i..i + n]);
                                wire.extend_from_slice(b"\r\n");
                                i += n;
                            }
                            wire.extend_from_slice(b"0\r\n\r\n");
                        }
                    }
                    let mut i = 0;
                    while i < wire.len() {
                        let n = (1 + next() as usize % 60).min(wire.len() - i);
                        if s.write_all(&wire[i..i + n]).is_err() {
                            return;
                        }
                        i += n;
                        if next() % 4 == 0 {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                    if matches!(framing, Framing::UntilClose) {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Route, request body, whether the usage filter applies, the postprocess mode, the backend's
/// body.
type Case<'a> = (&'a str, &'a str, bool, Option<Mode>, &'a [u8]);

fn expected(body: &[u8], usage: bool, pp: Option<Mode>) -> Vec<u8> {
    let mut cur = body.to_vec();
    if usage {
        let mut f = UsageFrameFilter::new();
        let mut o = Vec::new();
        f.feed(&cur, &mut o);
        f.finish(&mut o);
        cur = o;
    }
    if let Some(m) = pp {
        let mut f = PostProcessor::new(Handler::VllmFormat, m);
        let mut o = Vec::new();
        f.feed(&cur, &mut o);
        f.finish(&mut o);
        cur = o;
    }
    cur
}

const SSE: &str = "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"reasoning\":\"r\"},\"stop_reason\":null}],\"service_tier\":null}\n\n\
: keepalive\n\n\
event: message\ndata: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\n\n\
data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"y\"}}]}\r\n\r\n\
data: {\"id\":\"c1\",\"choices\":[],\ndata: \"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n\
data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n\
data: [DONE]\n\n";

const JSON: &str = r#"{"id":"c1","object":"chat.completion","model":"m","service_tier":null,"choices":[{"index":0,"message":{"role":"assistant","content":"hi","reasoning":"because"},"logprobs":null,"finish_reason":"stop","stop_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;

fn ask(env: &Env, route: &str, body: &str, v10: bool) -> Resp {
    let ver = if v10 { "1.0" } else { "1.1" };
    let raw = format!(
        "POST /{route}/v1/chat/completions HTTP/{ver}\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut s = TcpStream::connect(env.public()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(raw.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    read_response(&mut r, false).unwrap()
}

#[test]
fn every_framing_client_version_and_filter_chain_gives_the_filtered_body() {
    let stream_req = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"a"}]}"#;
    let stream_req_usage = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"a"}]}"#;
    let json_req = r#"{"model":"m","messages":[{"role":"user","content":"a"}]}"#;
    let mut n = 0;
    for seed in 1..=6u64 {
        for framing in [Framing::Length, Framing::Chunked, Framing::UntilClose] {
            let sse = backend(SSE.into(), "text/event-stream", framing, seed);
            let json = backend(JSON.into(), "application/json", framing, seed);
            let env = start(
                &[
                    ("pp", route_for(&[sse], "postprocess = \"vllm_format\"\n")),
                    ("plain", route_for(&[sse], "")),
                    ("ppj", route_for(&[json], "postprocess = \"vllm_format\"\n")),
                ],
                "",
            );
            for v10 in [false, true] {
                let cases: [Case; 5] = [
                    // chain of two: usage filter + postprocess
                    ("pp", stream_req, true, Some(Mode::Sse), SSE.as_bytes()),
                    // usage filter only
                    ("plain", stream_req, true, None, SSE.as_bytes()),
                    // postprocess only (client asked for usage: nothing injected)
                    (
                        "pp",
                        stream_req_usage,
                        false,
                        Some(Mode::Sse),
                        SSE.as_bytes(),
                    ),
                    // no filter at all
                    ("plain", stream_req_usage, false, None, SSE.as_bytes()),
                    // JSON postprocess
                    ("ppj", json_req, false, Some(Mode::Json), JSON.as_bytes()),
                ];
                for (route, req, usage, pp, body) in cases {
                    let r = ask(&env, route, req, v10);
                    assert_eq!(r.status, 200);
                    let want = expected(body, usage, pp);
                    assert_eq!(
                        String::from_utf8_lossy(&r.body),
                        String::from_utf8_lossy(&want),
                        "seed {seed} {framing:?} v10={v10} route {route} usage={usage}"
                    );
                    n += 1;
                }
            }
        }
    }
    assert_eq!(n, 6 * 3 * 2 * 5);
}

/// A usage frame whose data line comes after other SSE fields (`event:`, `id:`) is still the
/// frame the router's include_usage injection caused: removed from the client's copy, its
/// tokens logged. The control, a client that asked for usage itself, gets the stream as the
/// peer sent it, the frame with its fields included, and the same tokens.
#[test]
fn a_usage_frame_after_an_event_line_is_removed_and_counted() {
    const CONTENT: &str = "data: {\"id\":\"1\",\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n";
    const FRAME: &str = "event: message\nid: 7\ndata: {\"id\":\"1\",\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";
    let body = [CONTENT, FRAME, DONE].concat();
    let mut wire =
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    for part in [CONTENT, FRAME, DONE] {
        wire.extend(format!("{:x}\r\n{part}\r\n", part.len()).bytes());
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    let be = raw_backend(vec![wire], usize::MAX);
    let log = shm_path("event-usage-log");
    let env = start_logging(
        &[("r", route_for(&[be.addr], ""))],
        "",
        warmroute::worker::AccessLogTarget::File(log.clone()),
    );
    let ask = |sid: &str, own_usage: bool| {
        let opts = if own_usage {
            r#","stream_options":{"include_usage":true}"#
        } else {
            ""
        };
        let req = format!(
            r#"{{"model":"m","stream":true,"messages":[{{"role":"user","content":"a"}}]{opts}}}"#
        );
        let r = request(
            env.public(),
            &post_json(
                "/r/v1/chat/completions",
                &req,
                &format!("x-session-id: {sid}\r\n"),
            ),
        );
        assert_eq!(r.status, 200);
        r
    };
    let line = |sid: &str| {
        let mut found = None;
        eventually(Duration::from_secs(10), "the access line", || {
            found = std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
                .find(|l| l["session"] == sid);
            found.is_some()
        });
        found.unwrap()
    };
    let tokens = |l: &serde_json::Value| {
        (
            l["prompt_tokens"].as_u64(),
            l["cached_tokens"].as_u64(),
            l["completion_tokens"].as_u64(),
        )
    };

    // The router injected include_usage (the peer got it) and removed the whole event.
    let injected = ask("ev-injected", false);
    let sent = String::from_utf8_lossy(&be.requests.lock().unwrap()[0]).into_owned();
    assert!(sent.contains(r#""include_usage":true"#), "{sent}");
    assert_eq!(injected.text(), [CONTENT, DONE].concat());
    assert_eq!(tokens(&line("ev-injected")), (Some(11), Some(7), Some(3)));

    // Control: asked for by the client, the frame reaches it as sent.
    let own = ask("ev-own", true);
    assert_eq!(own.text(), body);
    assert_eq!(tokens(&line("ev-own")), (Some(11), Some(7), Some(3)));
    drop(env);
    let _ = std::fs::remove_file(&log);
}

/// A client's bytes to EOF: its request written, everything the router sends until it closes.
fn exchange_to_eof(env: &Env, raw: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut s = TcpStream::connect(env.public()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(raw).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    got
}

/// A peer that cuts an event stream short in the middle of a line: the start of that line
/// reaches the client when a filter holds it (the router's usage filter waits for the end of
/// each line), as it does when no filter runs. Both ways of cutting: a close before the
/// `Content-Length` is complete, and a broken chunk size. The control for each is the client
/// that asked for usage itself (no filter), which gets the same bytes.
#[test]
fn a_peer_that_cuts_a_filtered_stream_mid_line_still_delivers_the_start_of_the_line() {
    const EVENT: &str = "data: {\"id\":\"1\",\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n";
    const PARTIAL: &str = "data: {\"id\":\"1\",\"choices\":[{\"delta\":{\"content\":\"PARTIAL";
    let by_length = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 5000\r\n\r\n{EVENT}{PARTIAL}"
    );
    let by_chunks = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{EVENT}{PARTIAL}\r\nZZ\r\n",
        EVENT.len() + PARTIAL.len()
    );
    for (how, wire) in [("length", by_length), ("chunks", by_chunks)] {
        let be = raw_backend(vec![wire.into_bytes()], 1);
        let env = start(
            &[
                ("r", route_for(&[be.addr], "")),
                (
                    "pp",
                    route_for(&[be.addr], "postprocess = \"vllm_format\"\n"),
                ),
            ],
            "",
        );
        for route in ["r", "pp"] {
            for own_usage in [false, true] {
                let opts = if own_usage {
                    r#","stream_options":{"include_usage":true}"#
                } else {
                    ""
                };
                let req = format!(r#"{{"model":"m","stream":true{opts}}}"#);
                let got = exchange_to_eof(
                    &env,
                    &post_json(&format!("/{route}/v1/chat/completions"), &req, ""),
                );
                let text = String::from_utf8_lossy(&got);
                assert!(text.starts_with("HTTP/1.1 200"), "{how} {route}: {text}");
                assert!(
                    text.contains("\"content\":\"x\""),
                    "{how} {route} own_usage={own_usage}: the whole event: {text}"
                );
                assert!(
                    text.contains("PARTIAL"),
                    "{how} {route} own_usage={own_usage}: the start of the cut line: {text}"
                );
            }
        }
    }
}

/// The router's include_usage injection means it must read the stream (to remove the frame
/// the injection causes): it asks the peer for an uncompressed response in place of the
/// client's `Accept-Encoding`. A compressed stream would carry the frame to the client and
/// its tokens uncounted. The control, a client that asked for usage itself, keeps its own
/// `Accept-Encoding`.
#[test]
fn a_stream_the_router_must_read_is_asked_for_uncompressed() {
    let be = raw_backend(
        vec![b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 14\r\n\r\ndata: [DONE]\n\n".to_vec()],
        usize::MAX,
    );
    let env = start(&[("r", route_for(&[be.addr], ""))], "");
    for (n, own_usage) in [false, true].into_iter().enumerate() {
        let opts = if own_usage {
            r#","stream_options":{"include_usage":true}"#
        } else {
            ""
        };
        let req = format!(r#"{{"model":"m","stream":true{opts}}}"#);
        let r = request(
            env.public(),
            &post_json(
                "/r/v1/chat/completions",
                &req,
                "Accept-Encoding: gzip, br\r\n",
            ),
        );
        assert_eq!(r.status, 200);
        let sent = String::from_utf8_lossy(&be.requests.lock().unwrap()[n]).to_lowercase();
        let encodings: Vec<&str> = sent
            .lines()
            .filter_map(|l| l.strip_prefix("accept-encoding:"))
            .map(str::trim)
            .collect();
        if own_usage {
            assert!(!sent.contains("include_usage\":true,"), "{sent}");
            assert_eq!(encodings, ["gzip, br"], "{sent}");
        } else {
            assert!(sent.contains("\"include_usage\":true"), "{sent}");
            assert_eq!(encodings, ["identity"], "{sent}");
        }
    }
}
