//! Body logging through the router, as an operator runs it: 1,000 streamed requests give
//! 1,000 JSONL records with both bodies and usage; a listener that dies costs no request
//! (the drops are counted) and logging resumes when it comes back.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::Value;
use warmroute::bodylog::listener::{run_listener_with, ListenerConfig, ListenerHandle};
use warmroute_mock::MockServer;

fn listener(addr: SocketAddr, dir: &Path) -> ListenerHandle {
    run_listener_with(ListenerConfig {
        listen: addr,
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        dir: dir.to_path_buf(),
        stop: Arc::new(AtomicBool::new(false)),
    })
    .expect("listener starts")
}

/// A record directory (`shm_path(tag)`), a listener writing into it on a free port, and a
/// router whose route `r` (one mock peer) logs bodies to that listener.
fn logged_route(tag: &str) -> (PathBuf, SocketAddr, ListenerHandle, MockServer, Env) {
    let dir = shm_path(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let l = listener(port, &dir);
    let m = mock("m0");
    let env = start(
        &[("r", route_for(&[m.addr()], ""))],
        &format!("[bodylog]\nlistener = \"{port}\"\n"),
    );
    (dir, port, l, m, env)
}

/// Every JSONL record under `dir`.
fn records(dir: &Path) -> Vec<Value> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p: PathBuf = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "jsonl") {
                // The listener may be appending while the file is read: a last line
                // without its newline is not written yet.
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                for line in text.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
                    out.push(serde_json::from_str(line).expect("each line is JSON"));
                }
            }
        }
    }
    out
}

fn stream_requests(addr: SocketAddr, n: usize, threads: usize, tag: &str) -> usize {
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let tag = tag.to_string();
            std::thread::spawn(move || {
                let mut ok = 0;
                for i in 0..n / threads {
                    let body = serde_json::json!({"model": "m", "stream": true, "max_tokens": 3, "stream_options": {"include_usage": true},
                        "messages": [{"role": "user", "content": format!("{tag} request {t}-{i} words here")}]});
                    let r = request(addr, &post_json("/r/v1/chat/completions", &body.to_string(), &format!("x-session-id: {tag}-{t}\r\n")));
                    if r.status == 200 && r.text().contains("[DONE]") {
                        ok += 1;
                    }
                }
                ok
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).sum()
}

#[test]
fn a_thousand_streams_give_a_thousand_records_and_a_dead_listener_costs_nothing() {
    let (dir, port, l, _m, env) = logged_route("bodylog-dir");
    assert_eq!(stream_requests(env.public(), 1000, 4, "first"), 1000);
    eventually(Duration::from_secs(20), "1,000 records written", || {
        records(&dir).len() == 1000
    });
    let recs = records(&dir);
    let r = &recs[0];
    assert_eq!(r["route"], "r");
    assert_eq!(r["status"], 200);
    assert_eq!(r["resp_format"], "sse");
    assert_eq!(r["resp_body"], "tok0 tok1 tok2", "{r}");
    assert!(r["req_body"].as_str().unwrap().contains("request"));
    assert_eq!(r["usage"]["completion_tokens"], 3);
    assert!(r["session_id"].as_str().unwrap().starts_with("first-"));
    assert!(recs.iter().all(|r| r
        .get("req_headers")
        .is_some_and(|h| h.get("authorization").is_none())));

    // The listener dies: requests keep succeeding, the records are dropped and counted.
    l.stop();
    let ok = stream_requests(env.public(), 200, 4, "down");
    assert_eq!(ok, 200, "a dead listener costs no request");
    let status =
        |route: &str| request(env.public(), &get(&format!("/{route}/_bodylog_status"))).json();
    eventually(Duration::from_secs(10), "drops counted", || {
        let s = status("r");
        s["route_dropped"].as_u64().unwrap_or(0) + s["drop_count"].as_u64().unwrap_or(0) > 0
            || s["queued_frames"].as_u64().unwrap_or(0) > 0
    });
    // It comes back on the same address: logging resumes.
    let l2 = listener(port, &dir);
    let before = records(&dir).len();
    assert_eq!(stream_requests(env.public(), 100, 2, "back"), 100);
    eventually(Duration::from_secs(20), "records resume", || {
        records(&dir)
            .iter()
            .filter(|r| {
                r["session_id"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("back-"))
            })
            .count()
            == 100
    });
    assert!(records(&dir).len() >= before + 100);
    l2.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A prompt-sized request body (sent to the peer beside the request head, not copied into
/// it) is logged whole, as the client sent it.
#[test]
fn a_prompt_sized_request_body_is_logged_whole() {
    let (dir, _port, l, _m, env) = logged_route("bodylog-big");
    let content = letters(50_000);
    let bodies: Vec<String> = (0..3)
        .map(|i| chat_body(&format!("{i} {content}"), false))
        .collect();
    for (i, body) in bodies.iter().enumerate() {
        let r = request(
            env.public(),
            &post_json(
                "/r/v1/chat/completions",
                body,
                &format!("x-session-id: big-{i}\r\n"),
            ),
        );
        assert_eq!(r.status, 200, "{i}");
    }
    eventually(Duration::from_secs(20), "3 records written", || {
        records(&dir).len() == 3
    });
    for r in records(&dir) {
        let i: usize = r["session_id"].as_str().unwrap()["big-".len()..]
            .parse()
            .unwrap();
        assert!(
            r["req_body"].as_str() == Some(bodies[i].as_str()),
            "record {i}: the logged body differs ({} bytes)",
            r["req_body"].as_str().map_or(0, str::len)
        );
    }
    l.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A body over the capture's 2 MiB copy, whose session id came from a header (so routing
/// did not parse it): its record still says the request streamed and names its model (the
/// whole body is read for them, not the cut copy, which is not JSON). A body that is not
/// JSON says neither: no `stream: false` for "unknown".
#[test]
fn a_body_over_the_capture_cap_keeps_its_model_and_stream_flag() {
    let (dir, _port, l, _m, env) = logged_route("bodylog-cap");
    let content = letters(3_000_000);
    let big = chat_body(&content, true);
    let r = request(
        env.public(),
        &post_json("/r/v1/chat/completions", &big, "x-session-id: cap-big\r\n"),
    );
    assert_eq!(r.status, 200);
    let r = request(
        env.public(),
        &post_json(
            "/r/v1/chat/completions",
            "not json",
            "x-session-id: cap-text\r\n",
        ),
    );
    assert!(
        r.status > 0,
        "answered (the mock's status does not matter here)"
    );
    eventually(Duration::from_secs(20), "2 records written", || {
        records(&dir).len() == 2
    });
    let recs = records(&dir);
    let by = |sid: &str| {
        recs.iter()
            .find(|r| r["session_id"] == sid)
            .unwrap_or_else(|| panic!("no record of {sid}: {recs:?}"))
    };
    let big = by("cap-big");
    assert_eq!(big["req_body_truncated"], true, "control: the copy was cut");
    assert_eq!(
        (big["model"].as_str(), big["stream"].as_bool()),
        (Some("mock-model"), Some(true))
    );
    let text = by("cap-text");
    assert!(
        text.get("stream").is_none() && text.get("model").is_none(),
        "{text}"
    );
    l.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A streamed request without `stream_options` gets `include_usage` from the router, which
/// inserts it into the body's own buffer (no copy of the body). The peer gets it (the
/// record has the usage of the frame the router then removes), the client does not see
/// that frame, and the log keeps the body the client sent, byte for byte: small bodies
/// (sent with the head) and prompt-sized ones (sent beside it).
#[test]
fn the_log_keeps_the_clients_body_when_the_router_injects_include_usage() {
    let (dir, _port, l, _m, env) = logged_route("bodylog-inject");
    let long = letters(40_000);
    let bodies: Vec<String> = ["short", long.as_str()]
        .iter()
        .enumerate()
        .map(|(i, c)| chat_body(&format!("{i} {c}"), true))
        .collect();
    for (i, body) in bodies.iter().enumerate() {
        assert!(!body.contains("stream_options"));
        let r = request(
            env.public(),
            &post_json(
                "/r/v1/chat/completions",
                body,
                &format!("x-session-id: inject-{i}\r\n"),
            ),
        );
        assert_eq!(r.status, 200, "{i}");
        let text = r.text();
        assert!(text.contains("[DONE]"), "{i}: {text}");
        assert!(
            !text.contains("\"usage\":{"),
            "{i}: the injected usage frame reached the client: {text}"
        );
    }
    eventually(Duration::from_secs(20), "2 records written", || {
        records(&dir).len() == 2
    });
    for r in records(&dir) {
        let i: usize = r["session_id"].as_str().unwrap()["inject-".len()..]
            .parse()
            .unwrap();
        // The session id came from a header, so the router had no need to parse the
        // body for routing: the record still names the body's model and stream flag.
        assert_eq!(
            (r["model"].as_str(), r["stream"].as_bool()),
            (Some("mock-model"), Some(true)),
            "record {i}"
        );
        // The peer was asked for usage: the frame it sent is in the record.
        assert_eq!(
            r["usage"]["completion_tokens"], 4,
            "record {i}: {}",
            r["usage"]
        );
        assert!(
            r["req_body"].as_str() == Some(bodies[i].as_str()),
            "record {i}: the logged body is not the client's ({} bytes, starts {:?})",
            r["req_body"].as_str().map_or(0, str::len),
            r["req_body"].as_str().map(|b| &b[..b.len().min(120)])
        );
    }
    l.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The access log's lines in `path`, parsed.
fn access_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("each access line is JSON"))
        .collect()
}

/// `response_bytes` (access log) and `resp_bytes` (body log) are the body bytes the client
/// received: a usage frame the router asked for (include_usage) and removed again is not
/// among them. The control, a client that asked for usage itself, gets the frame and both
/// counts include it.
#[test]
fn response_bytes_count_what_the_client_received_not_the_removed_usage_frame() {
    let dir = shm_path("bodylog-bytes");
    std::fs::create_dir_all(&dir).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let l = listener(port, &dir);
    let m = mock("m0");
    let log = shm_path("bytes-access");
    let env = start_logging(
        &[("r", route_for(&[m.addr()], ""))],
        &format!("[bodylog]\nlistener = \"{port}\"\n"),
        warmroute::worker::AccessLogTarget::File(log.clone()),
    );
    let ask = |sid: &str, own_usage: bool| {
        let mut body: Value = serde_json::from_str(&chat_body("count my bytes", true)).unwrap();
        if own_usage {
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        let r = request(
            env.public(),
            &post_json(
                "/r/v1/chat/completions",
                &body.to_string(),
                &format!("x-session-id: {sid}\r\n"),
            ),
        );
        assert_eq!(r.status, 200);
        assert!(r.text().contains("[DONE]"), "{}", r.text());
        r
    };
    let injected = ask("bytes-injected", false);
    let own = ask("bytes-own", true);
    // The feature ran: the router's frame was removed from the first, the second has its own.
    assert!(
        !injected.text().contains("\"usage\":{"),
        "{}",
        injected.text()
    );
    assert!(own.text().contains("\"usage\":{"), "{}", own.text());
    assert!(own.body.len() > injected.body.len());

    let line = |sid: &str| {
        let mut found = None;
        eventually(Duration::from_secs(10), "the access line", || {
            found = access_lines(&log).into_iter().find(|l| l["session"] == sid);
            found.is_some()
        });
        found.unwrap()
    };
    let (li, lo) = (line("bytes-injected"), line("bytes-own"));
    // The router did read the removed frame: its tokens are logged.
    assert_eq!(li["completion_tokens"], 4, "{li}");
    assert_eq!(li["response_bytes"], injected.body.len() as u64, "{li}");
    assert_eq!(lo["response_bytes"], own.body.len() as u64, "{lo}");

    eventually(Duration::from_secs(20), "2 records written", || {
        records(&dir).len() == 2
    });
    for r in records(&dir) {
        let want = match r["session_id"].as_str() {
            Some("bytes-injected") => injected.body.len(),
            Some("bytes-own") => own.body.len(),
            other => panic!("unexpected record {other:?}"),
        };
        assert_eq!(r["resp_bytes"], want as u64, "{}", r["session_id"]);
    }
    l.stop();
    drop(env);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&log);
}

/// Requests the router answers itself reach the body log as peer-answered ones do: a
/// content-rule refusal, a concurrency 429, a `model_not_supported` 400 and a 502 for a
/// peer's broken answer each give a record with the request body as the client sent it
/// and the router's own answer as the response (a peer only where one was tried). The
/// control: a request a peer answered gives its record beside them.
#[test]
fn refused_requests_reach_the_body_log_with_the_routers_answer() {
    let dir = shm_path("bodylog-refused");
    std::fs::create_dir_all(&dir).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let l = listener(port, &dir);
    let m = mock("m0");
    // A peer that answers with garbage: the router answers 502 itself.
    let bad = raw_backend(vec![b"HTTP/1.1 garbage\r\n\r\n".to_vec()], 1);
    let limited = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, name = \"solo\", max_concurrency = 1 }} ]\n\
         reject_rules_enabled = true\n\
         reject_rules = [ {{ name = \"no3\", field = \"messages_count\", op = \"gt\", value = 2, status = 422 }} ]\n",
        m.addr().port()
    );
    let m2 = mock("m1");
    let by_model = format!(
        "[peers_by_model]\n\"llama\" = [ {{ host = \"127.0.0.1\", port = {}, name = \"a\" }} ]\n",
        m2.addr().port()
    );
    let access = shm_path("refused-access");
    let env = start_logging(
        &[
            ("r", limited),
            ("pm", by_model),
            ("bad", route_for(&[bad.addr], "max_more_tries = 0\n")),
        ],
        &format!("[bodylog]\nlistener = \"{port}\"\n"),
        warmroute::worker::AccessLogTarget::File(access.clone()),
    );
    let body = |tag: &str, turns: usize| {
        let msgs: Vec<Value> = (0..turns)
            .map(|i| serde_json::json!({"role": "user", "content": format!("{tag} {i}")}))
            .collect();
        serde_json::json!({"model": "llama", "messages": msgs}).to_string()
    };
    let send = |path: &str, b: &str, extra: &str| {
        request(
            env.public(),
            &post_json(path, b, &format!("x-session-id: s-{path}\r\n{extra}")),
        )
    };

    // Control: answered by the peer.
    let ok = body("answered", 1);
    assert_eq!(send("/r/v1/chat/completions", &ok, "").status, 200);
    // A content rule refuses it (3 messages).
    let ruled = body("ruled", 3);
    assert_eq!(send("/r/v1/chat/completions", &ruled, "").status, 422);
    // The one slot is held: the next request gets the concurrency 429.
    let public = env.public();
    let hold = std::thread::spawn(move || {
        request(
            public,
            &post_json(
                "/r/v1/chat/completions",
                &chat_body("hold", false),
                "x-mock-hang-ms: 1500\r\nx-session-id: hold\r\n",
            ),
        )
        .status
    });
    eventually(Duration::from_secs(10), "the slot is held", || {
        inflight_total(&env, "r") == 1
    });
    let over = body("over the limit", 1);
    assert_eq!(send("/r/v1/chat/completions", &over, "").status, 429);
    assert_eq!(hold.join().unwrap(), 200);
    // No sub-pool serves the model.
    let unknown = body("unknown model", 1).replace("llama", "nope");
    assert_eq!(send("/pm/v1/chat/completions", &unknown, "").status, 400);
    // The peer's answer is not HTTP.
    let unanswered = body("unanswered", 1);
    assert_eq!(
        send("/bad/v1/chat/completions", &unanswered, "").status,
        502
    );

    eventually(Duration::from_secs(20), "6 records written", || {
        records(&dir).len() == 6
    });
    let recs = records(&dir);
    let find = |req: &str| {
        recs.iter()
            .find(|r| r["req_body"].as_str() == Some(req))
            .unwrap_or_else(|| panic!("no record of {req}: {recs:?}"))
    };
    let answered = find(&ok);
    assert_eq!(answered["status"], 200);
    assert_eq!(answered["peer_name"], "solo");
    for (req, route, status, kind, peer) in [
        (&ruled, "r", 422, "rejected_by_rule", None),
        (&over, "r", 429, "concurrency_limit_exceeded", None),
        (&unknown, "pm", 400, "model_not_supported", None),
        (&unanswered, "bad", 502, "bad_upstream_response", Some("p0")),
    ] {
        let r = find(req);
        assert_eq!(r["route"], route, "{r}");
        assert_eq!(r["status"], status, "{r}");
        assert_eq!(r["method"], "POST", "{r}");
        assert_eq!(r["req_body_truncated"], false, "{r}");
        let answer: Value = serde_json::from_str(r["resp_body"].as_str().unwrap()).unwrap();
        assert_eq!(answer["error"]["type"], kind, "{r}");
        assert_eq!(
            r["resp_bytes"],
            r["resp_body"].as_str().unwrap().len() as u64,
            "{r}"
        );
        assert_eq!(r["peer_name"].as_str(), peer, "{r}");
        assert_eq!(r.get("mode").is_some(), peer.is_some(), "{r}");
    }
    // Every refusal after the body was read names the session the request carried, in its
    // record and in its access line: a rule's and the pool's refusals too (they come before
    // the gates, but the id is read before them).
    for (req, path) in [
        (&ruled, "/r/v1/chat/completions"),
        (&over, "/r/v1/chat/completions"),
        (&unknown, "/pm/v1/chat/completions"),
        (&unanswered, "/bad/v1/chat/completions"),
    ] {
        let sid = format!("s-{path}");
        assert_eq!(find(req)["session_id"], sid.as_str(), "{req}");
    }
    // The control: a request with no id has none in its record.
    let anonymous = body("anonymous", 3);
    let r = request(
        env.public(),
        &post_json("/r/v1/chat/completions", &anonymous, ""),
    );
    assert_eq!(r.status, 422);
    eventually(Duration::from_secs(20), "the 7th record", || {
        records(&dir).len() == 7
    });
    let recs = records(&dir);
    let rec = recs
        .iter()
        .find(|r| r["req_body"].as_str() == Some(&*anonymous))
        .unwrap();
    assert!(rec.get("session_id").is_none_or(Value::is_null), "{rec}");
    eventually(Duration::from_secs(10), "the access lines", || {
        access_lines(&access).len() == 7
    });
    let lines = access_lines(&access);
    let mut refused: Vec<(u64, &str, &str)> = lines
        .iter()
        .filter(|l| matches!(l["status"].as_u64(), Some(400 | 422)))
        .map(|l| {
            (
                l["status"].as_u64().unwrap(),
                l["session"].as_str().unwrap(),
                l["source"].as_str().unwrap(),
            )
        })
        .collect();
    refused.sort();
    let header = "header:x-session-id";
    assert_eq!(
        refused,
        [
            (400, "s-/pm/v1/chat/completions", header),
            (422, "-", "none"),
            (422, "s-/r/v1/chat/completions", header),
        ],
        "{lines:?}"
    );
    l.stop();
    drop(env);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&access);
}

/// A client's huge session id or model does not keep its request out of the body log: the
/// record's meta cuts them (it was dropped as too large to encode). The control: a
/// request with a short id is logged whole.
#[test]
fn a_request_with_a_huge_session_id_is_still_logged() {
    let (dir, _port, l, _m, env) = logged_route("bodylog-huge-meta");
    let huge = "h".repeat(70_000);
    for sid in ["short-one", huge.as_str()] {
        let body = serde_json::json!({
            "model": "mock-model",
            "metadata": {"session_id": sid},
            "messages": [{"role": "user", "content": "x"}],
        })
        .to_string();
        let r = request(
            env.public(),
            &post_json("/r/v1/chat/completions", &body, ""),
        );
        assert_eq!(r.status, 200);
    }
    eventually(Duration::from_secs(20), "2 records written", || {
        records(&dir).len() == 2
    });
    let mut ids: Vec<(usize, bool)> = records(&dir)
        .iter()
        .map(|r| {
            (
                r["session_id"].as_str().unwrap().len(),
                r["meta_cut"] == true,
            )
        })
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        [
            ("short-one".len(), false),
            (warmroute::bodylog::sender::META_STRING_CUT + 3, true)
        ]
    );
    l.stop();
    let _ = std::fs::remove_dir_all(&dir);
}
