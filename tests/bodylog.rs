//! Body logging over real sockets: the per-worker sender in a monoio runtime (io_uring or
//! epoll, and the legacy driver explicitly), the listener writing hourly JSONL, the listener
//! going away and coming back, disk errors and framing errors.

use std::future::Future;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use warmroute::bodylog::capture::{scrub_headers, Capture};
use warmroute::bodylog::frame::{encode, Record};
use warmroute::bodylog::listener::{run_listener_with, ListenerConfig, ListenerHandle};
use warmroute::bodylog::sender::Sender;

/// 2024-05-06T12:53:20Z: every record of the run lands in `2024-05-06/12.jsonl`.
const T0_MS: u64 = 1_715_000_000_000;

static SEQ: AtomicU32 = AtomicU32::new(0);

fn temp_dir(tag: &str) -> PathBuf {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!(
        "warmroute-bodylog-{tag}-{}-{n}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn start(listen: SocketAddr, dir: &Path) -> ListenerHandle {
    run_listener_with(ListenerConfig {
        listen,
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        dir: dir.to_path_buf(),
        stop: Arc::new(AtomicBool::new(false)),
    })
    .expect("listener starts")
}

type LocalFut = Pin<Box<dyn Future<Output = ()>>>;

/// Run `f` on a fresh monoio runtime on its own thread: the default FusionDriver (io_uring,
/// or epoll under MONOIO_FORCE_LEGACY_DRIVER=1), or the legacy driver explicitly.
fn on_runtime(legacy: bool, f: impl FnOnce() -> LocalFut + Send + 'static) {
    std::thread::spawn(move || {
        if legacy {
            monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
                .enable_timer()
                .build()
                .unwrap()
                .block_on(f());
        } else {
            monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
                .enable_timer()
                .build()
                .unwrap()
                .block_on(f());
        }
    })
    .join()
    .expect("runtime thread");
}

async fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        monoio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A record as the request path would build it. Even `i`: an SSE stream for owner alice;
/// odd: a JSON completion for owner bob.
fn record(phase: &str, i: u64) -> Record {
    let req = format!(r#"{{"model":"m","stream":{},"n":{i}}}"#, i & 1 == 0);
    let mut cap = Capture::new(req.as_bytes());
    let usage = json!({"prompt_tokens": 2000, "completion_tokens": 3,
                       "prompt_tokens_details": {"cached_tokens": 512}});
    if i & 1 == 0 {
        for part in ["hel", "lo ", &format!("{phase}-{i}")] {
            let ev = json!({"choices": [{"delta": {"content": part}}]});
            cap.push_response(format!("data: {ev}\n\n").as_bytes());
        }
        let fin = json!({"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": usage});
        cap.push_response(format!("data: {fin}\n\ndata: [DONE]\n\n").as_bytes());
    } else {
        let body = json!({"id": "x", "choices": [{"message": {"content": format!("hello {phase}-{i}")},
                          "finish_reason": "stop"}], "usage": usage});
        cap.push_response(body.to_string().as_bytes());
    }
    let headers: Vec<(&str, &[u8])> = vec![
        ("Authorization", b"Bearer secret"),
        ("Content-Type", b"application/json"),
    ];
    let meta = json!({
        "ts_ms": T0_MS + i,
        "route": "r1",
        "owner": if i & 1 == 0 { "alice" } else { "bob" },
        "phase": phase,
        "i": i,
        "status": 200,
        "stream": i & 1 == 0,
        "first_chunk_t": 0.2,
        "rt": 1.0,
        "req_headers": Value::Object(scrub_headers(headers)),
    });
    cap.finish(meta)
}

fn read_lines(dir: &Path) -> Vec<Value> {
    let p = dir.join("2024-05-06").join("12.jsonl");
    let text = std::fs::read_to_string(&p).unwrap_or_default();
    text.lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect()
}

fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn check_phase(lines: &[Value], phase: &str, expect: impl Iterator<Item = u64>) {
    let mut got: Vec<u64> = lines
        .iter()
        .filter(|v| v["phase"] == phase)
        .map(|v| v["i"].as_u64().unwrap())
        .collect();
    got.sort_unstable();
    assert_eq!(got, expect.collect::<Vec<_>>(), "records of phase {phase}");
}

fn scenario(legacy: bool) {
    on_runtime(legacy, move || {
        Box::pin(async move {
            let dir = temp_dir(if legacy { "legacy" } else { "fusion" });
            let h = start("127.0.0.1:0".parse().unwrap(), &dir);
            let addr = h.addr;
            let sender = Sender::with_limits(addr, 200, 64 << 20);
            let task = monoio::spawn(sender.clone().run());

            // Phase 1: 1,000 records, pacing on the queue like a busy worker would not need to.
            for i in 0..1000 {
                while sender.stats().queued_frames >= 150 {
                    monoio::time::sleep(Duration::from_millis(1)).await;
                }
                assert!(sender.try_send(record("p1", i)));
            }
            wait_for("1,000 lines written", Duration::from_secs(30), || {
                h.stats().records_written == 1000
            })
            .await;
            let st = sender.stats();
            assert_eq!((st.written, st.dropped, st.encode_errors), (1000, 0, 0));
            assert_eq!(st.connects, 1, "one persistent connection");
            assert!(st.last_write_ms > 0);

            let lines = read_lines(&dir);
            assert_eq!(lines.len(), 1000);
            check_phase(&lines, "p1", 0..1000);
            for v in &lines {
                let i = v["i"].as_u64().unwrap();
                assert_eq!(v["resp_body"], format!("hello p1-{i}"), "{v}");
                assert_eq!(v["resp_format"], if i & 1 == 0 { "sse" } else { "json" });
                assert_eq!(v["usage"]["prompt_tokens"], 2000);
                assert_eq!(v["resp_meta"]["finish_reason"], "stop");
                assert_eq!(v["source_addr"], "127.0.0.1");
                assert_eq!(
                    v["req_body"].as_str().unwrap(),
                    format!(r#"{{"model":"m","stream":{},"n":{i}}}"#, i & 1 == 0)
                );
                assert_eq!(
                    v["req_headers"],
                    json!({"content-type": "application/json"})
                );
                assert_eq!(v["resp_body_truncated"], false);
                assert!(v["ts"].as_str().unwrap().starts_with("2024-05-06T12:53:2"));
            }
            assert_eq!(h.stats().decode_errors, 0);

            let m = http_get(h.metrics_addr, "/metrics");
            assert!(m.starts_with("HTTP/1.1 200"), "{m}");
            for needle in [
                "warmroute_bodylog_requests_total{route=\"r1\",owner=\"alice\",status_class=\"2xx\"} 500",
                "warmroute_bodylog_requests_total{route=\"r1\",owner=\"bob\",status_class=\"2xx\"} 500",
                "warmroute_bodylog_prompt_tokens_total{route=\"r1\",owner=\"alice\"} 1000000",
                "warmroute_bodylog_cached_tokens_total{route=\"r1\",owner=\"bob\"} 256000",
                "warmroute_bodylog_completion_tokens_total{route=\"r1\",owner=\"alice\"} 1500",
                // TTFT only for the streamed half.
                "warmroute_bodylog_ttft_seconds_count{route=\"r1\",owner=\"alice\",prompt_bucket=\"1k-4k\"} 500",
                "warmroute_bodylog_ttft_seconds_bucket{route=\"r1\",owner=\"alice\",prompt_bucket=\"1k-4k\",le=\"0.25\"} 500",
                "warmroute_bodylog_ttft_seconds_bucket{route=\"r1\",owner=\"alice\",prompt_bucket=\"1k-4k\",le=\"0.1\"} 0",
                "warmroute_bodylog_records_written_total 1000",
                "warmroute_bodylog_decode_errors_total 0",
            ] {
                assert!(m.contains(needle), "missing {needle} in\n{m}");
            }
            assert!(
                !m.contains("owner=\"bob\",prompt_bucket"),
                "no TTFT for non-streams"
            );
            assert!(http_get(h.metrics_addr, "/healthz").ends_with("ok\n"));

            // Phase 2: the listener goes away. try_send stays synchronous and cheap; the
            // queue (200 frames) fills and the rest is dropped and counted.
            h.stop();
            assert!(
                TcpStream::connect(addr).is_err(),
                "control: the listener is down"
            );
            wait_for("the sender to notice", Duration::from_secs(5), || {
                !sender.stats().connected
            })
            .await;
            let t = Instant::now();
            let accepted = (0..500)
                .filter(|&i| sender.try_send(record("p2", i)))
                .count();
            let took = t.elapsed();
            assert!(took < Duration::from_secs(2), "500 try_send took {took:?}");
            assert_eq!(accepted, 200);
            let st = sender.stats();
            assert_eq!((st.dropped, st.queued_frames, st.written), (300, 200, 1000));

            // Phase 3: the listener returns on the same port; the queued frames and new ones
            // arrive over a new connection.
            monoio::time::sleep(Duration::from_millis(300)).await;
            let h2 = start(addr, &dir);
            wait_for("the queue to drain", Duration::from_secs(15), || {
                sender.stats().written == 1200
            })
            .await;
            for i in 0..50 {
                assert!(sender.try_send(record("p3", i)));
            }
            wait_for("250 lines after restart", Duration::from_secs(15), || {
                h2.stats().records_written == 250
            })
            .await;
            let st = sender.stats();
            assert_eq!((st.written, st.dropped, st.connects), (1250, 300, 2));
            let lines = read_lines(&dir);
            assert_eq!(lines.len(), 1250, "appended to the same hourly file");
            check_phase(&lines, "p2", 0..200);
            check_phase(&lines, "p3", 0..50);

            sender.stop();
            task.await;
            assert!(!sender.try_send(record("p4", 0)), "stopped sender drops");
            h2.stop();
            let _ = std::fs::remove_dir_all(&dir);
        })
    });
}

#[test]
fn thousand_records_then_listener_restart() {
    scenario(false);
}

#[test]
fn thousand_records_then_listener_restart_legacy_driver() {
    scenario(true);
}

fn frame(rec: &Record) -> Vec<u8> {
    let mut b = Vec::new();
    encode(rec, &mut b).unwrap();
    b
}

fn wait_blocking(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn write_errors_and_bad_frames_are_counted_and_survived() {
    let dir = temp_dir("errors");
    let h = start("127.0.0.1:0".parse().unwrap(), &dir);
    // The day directory cannot be created (a file is in the way): like a full disk, every
    // record for that hour fails to write.
    std::fs::write(dir.join("2024-05-06"), b"").unwrap();
    let mut good = TcpStream::connect(h.addr).unwrap();
    let rec = |ts: u64| Record {
        meta: json!({"ts_ms": ts, "route": "r", "status": 200}),
        request: b"{}".to_vec(),
        response: b"{\"choices\":[{\"message\":{\"content\":\"x\"}}]}".to_vec(),
    };
    for _ in 0..3 {
        good.write_all(&frame(&rec(T0_MS))).unwrap();
    }
    wait_blocking("3 write errors", || h.stats().write_errors == 3);
    // Next day: written.
    for _ in 0..2 {
        good.write_all(&frame(&rec(T0_MS + 86_400_000))).unwrap();
    }
    wait_blocking("2 writes", || h.stats().records_written == 2);
    let text = std::fs::read_to_string(dir.join("2024-05-07/12.jsonl")).unwrap();
    assert_eq!(text.lines().count(), 2);

    // A garbage length prefix closes that connection only.
    let mut bad = TcpStream::connect(h.addr).unwrap();
    bad.write_all(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3]).unwrap();
    bad.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(bad.read(&mut b).unwrap_or(0), 0, "closed by the listener");
    wait_blocking("decode error", || h.stats().decode_errors == 1);
    // A frame with a meta_len pointing past the frame, on another connection.
    let mut f = frame(&rec(T0_MS + 86_400_000));
    f[4] = 0xff;
    f[5] = 0xff;
    let mut bad2 = TcpStream::connect(h.addr).unwrap();
    bad2.write_all(&f).unwrap();
    wait_blocking("second decode error", || h.stats().decode_errors == 2);
    // The good connection still works.
    good.write_all(&frame(&rec(T0_MS + 86_400_000))).unwrap();
    wait_blocking("3 writes", || h.stats().records_written == 3);
    let m = http_get(h.metrics_addr, "/metrics");
    assert!(m.contains("warmroute_bodylog_write_errors_total 3"), "{m}");
    assert!(m.contains("warmroute_bodylog_decode_errors_total 2"), "{m}");
    h.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn external_stop_flag_ends_the_listener() {
    let dir = temp_dir("flag");
    let stop = Arc::new(AtomicBool::new(false));
    let h = run_listener_with(ListenerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        dir: dir.clone(),
        stop: stop.clone(),
    })
    .unwrap();
    let addr = h.addr;
    let _conn = TcpStream::connect(addr).unwrap();
    wait_blocking("connection", || h.stats().connections_open == 1);
    let waiter = std::thread::spawn(move || h.wait());
    stop.store(true, Ordering::SeqCst);
    waiter.join().unwrap();
    assert!(
        TcpStream::connect(addr).is_err(),
        "port closed after the flag"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
