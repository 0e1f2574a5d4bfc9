//! Measurement and control end to end: TTFT shedding with probe slots and recovery, the
//! rate-limit master switch, and the adaptive concurrency limit following the decode rate.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn stream(env: &Env, extra: &str) -> Resp {
    let body = json!({"model": "m", "stream": true, "max_tokens": 2, "messages": [{"role": "user", "content": "hi there"}]});
    request(
        env.public(),
        &post_json("/r/v1/chat/completions", &body.to_string(), extra),
    )
}

fn burst(env: &Env, n: usize) -> Vec<Resp> {
    let addr = env.public();
    let hs: Vec<_> = (0..n)
        .map(|_| {
            std::thread::spawn(move || {
                let body = json!({"model": "m", "stream": true, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
                request(addr, &post_json("/r/v1/chat/completions", &body.to_string(), ""))
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn ttft_shedding_probes_recovery_and_the_master_switch() {
    let m = mock_with("m0", |c| c.ttft_base_ms = 600);
    let route = route_for(
        &[m.addr()],
        "ttft_metrics = [ { metric = \"avg\", threshold = 200 } ]\nttft_window = 1\nttft_ttl = 30\nttft_probe_window = 2\nttft_probe_per_window = 2\n",
    );
    let env = start(&[("r", route)], "");
    // Slow first tokens until the EWMA is above the limit.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(15) {
        let r = stream(&env, "");
        if r.status == 429 {
            break;
        }
    }
    let st = request(env.public(), &get("/r/_ttft_status")).json();
    let ewma = st["pools"]["_"]["ewma"].as_f64().expect("an EWMA exists");
    assert!(ewma >= 200.0, "{st}");
    // A burst: mostly 429 with the figures, a few probes let through.
    let rs = burst(&env, 12);
    let shed: Vec<&Resp> = rs.iter().filter(|r| r.status == 429).collect();
    let passed = rs.iter().filter(|r| r.status == 200).count();
    assert!(
        shed.len() >= 9,
        "most of the burst is shed: {} shed, {passed} passed",
        shed.len()
    );
    assert!(passed <= 2, "at most the probe allowance passes: {passed}");
    let e = &shed[0].json()["error"];
    assert_eq!(e["type"], "ttft_limit_exceeded");
    assert_eq!(e["ttft_limit"], 200.0);
    assert!(e["ttft_ewma"].as_f64().unwrap() >= 200.0);
    // The metric the gate judged, as the reference's body names it.
    assert_eq!(e["metric"], "avg");
    assert!(
        e["avg_5min"].is_number(),
        "the cluster average (SPEC §5.5): {e}"
    );
    assert_eq!(shed[0].header("retry-after"), Some("1"));
    assert!(
        request(env.public(), &get("/r/_429_status")).json()["by_reason"]["ttft"]
            .as_u64()
            .unwrap()
            >= 9
    );
    // The master switch off: the same burst passes, and the trips are counted.
    let r = request(env.public(), &get("/r/_rate_limit_toggle?on=0")).json();
    assert_eq!(r["pools"]["_"]["enabled"], false);
    let rs = burst(&env, 12);
    assert!(
        rs.iter().all(|r| r.status == 200),
        "{:?}",
        rs.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    let st = request(env.public(), &get("/r/_rate_limit_status")).json();
    assert!(
        st["pools"]["_"]["trips"]["ttft"].as_u64().unwrap() >= 10,
        "{st}"
    );
    request(env.public(), &get("/r/_rate_limit_toggle?reset=1"));
    // The engine recovers: probes carry fast samples in and the route recovers on its own.
    m.set_config(|c| c.ttft_base_ms = 10);
    let t0 = Instant::now();
    let mut recovered = false;
    while t0.elapsed() < Duration::from_secs(20) {
        let rs = burst(&env, 4);
        if rs.iter().all(|r| r.status == 200) {
            recovered = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(
        recovered,
        "{}",
        request(env.public(), &get("/r/_ttft_status")).json()
    );
    assert!(
        request(env.public(), &get("/r/_ttft_status")).json()["pools"]["_"]["ewma"]
            .as_f64()
            .unwrap()
            < 200.0
    );
}

/// Every entry of `ttft_metrics` is measured and judged: a pool whose average first token
/// is far under its limit but whose slow tail (p90) is over the second entry's is shed,
/// and the 429 and `_ttft_status` name the metric that tripped. Controls: the same list
/// sent only fast requests never sheds (the slow tail is what trips it), and a route with
/// the list's first entry alone, sent the same requests, never sheds.
#[test]
fn a_later_metric_of_a_list_over_its_threshold_sheds() {
    let m = mock("m0");
    let opts = "ttft_window = 1\nttft_ttl = 30\nttft_probe_per_window = 0\n";
    let both = format!(
        "{opts}ttft_metrics = [ {{ metric = \"avg\", threshold = 100000 }}, {{ metric = \"p90\", q = 0.9, threshold = 300 }} ]\n"
    );
    let first = format!("{opts}ttft_metrics = [ {{ metric = \"avg\", threshold = 100000 }} ]\n");
    let env = start(
        &[
            ("a", route_for(&[m.addr()], &both)),
            ("fast", route_for(&[m.addr()], &both)),
            ("b", route_for(&[m.addr()], &first)),
        ],
        "",
    );
    let send = |route: &str, slow: bool| {
        let body = json!({"model": "m", "stream": true, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
        let extra = if slow { "x-mock-ttft-ms: 400\r\n" } else { "" };
        request(
            env.public(),
            &post_json(
                &format!("/{route}/v1/chat/completions"),
                &body.to_string(),
                extra,
            ),
        )
    };
    // A third of the first tokens take 400 ms: the average stays near 140 ms, and p90 is
    // the histogram's 500 ms bucket (the fast ones fall in its first, 250 ms).
    let t0 = Instant::now();
    let mut shed = None;
    while shed.is_none() && t0.elapsed() < Duration::from_secs(15) {
        for slow in [false, false, true] {
            let r = send("a", slow);
            if r.status == 429 {
                shed = Some(r);
                break;
            }
            assert_eq!(r.status, 200, "{}", r.text());
            let r = send("b", slow);
            assert_eq!(
                r.status,
                200,
                "the first entry alone never sheds: {}",
                r.text()
            );
            let r = send("fast", false);
            assert_eq!(r.status, 200, "fast first tokens never shed: {}", r.text());
        }
    }
    let shed = shed.expect("route a sheds on its p90");
    let e = &shed.json()["error"];
    assert_eq!(e["type"], "ttft_limit_exceeded", "{e}");
    assert_eq!(e["metric"], "p90", "{e}");
    assert_eq!(e["ttft_limit"], 300.0, "{e}");
    assert!(e["ttft_ewma"].as_f64().unwrap() >= 300.0, "{e}");
    let st = request(env.public(), &get("/a/_ttft_status")).json();
    let pool = &st["pools"]["_"];
    assert_eq!(pool["hit"], true, "{st}");
    assert_eq!(pool["hit_metric"], "p90", "{st}");
    assert!(
        pool["ewma"].as_f64().unwrap() < 1_000.0,
        "the average: {st}"
    );
    assert_eq!(pool["metrics"][1]["metric"], "p90", "{st}");
    assert!(
        pool["metrics"][1]["ewma"].as_f64().unwrap() >= 300.0,
        "{st}"
    );
    // The same in the reference's route-level shape (notes-edges §4.1).
    assert_eq!(st["ewma_ms"]["_"], pool["ewma"], "{st}");
    let list = &st["metrics"][0];
    assert_eq!(
        (&list["model"], &list["source"]),
        (&json!("_"), &json!("declared"))
    );
    assert_eq!(
        list["items"][0],
        json!({"metric": "avg", "threshold_ms": 100000.0, "ewma_ms": pool["ewma"]})
    );
    assert_eq!(list["items"][1]["q"], 0.9, "{st}");
    assert_eq!(list["items"][1]["threshold_ms"], 300.0, "{st}");
    assert_eq!(
        list["items"][1]["ewma_ms"], pool["metrics"][1]["ewma"],
        "{st}"
    );
    assert_eq!(st["ttl"], 30, "{st}");
    // The controls measured their traffic and did not trip.
    for route in ["b", "fast"] {
        let st = request(env.public(), &get(&format!("/{route}/_ttft_status"))).json();
        assert!(st["pools"]["_"]["ewma"].as_f64().is_some(), "{st}");
        assert_eq!(st["pools"]["_"]["hit"], false, "{st}");
    }
}

#[test]
fn routes_without_a_threshold_never_shed_on_latency() {
    let m = mock_with("m0", |c| c.ttft_base_ms = 300);
    let env = start(&[("r", route_for(&[m.addr()], "ttft_window = 1\n"))], "");
    for _ in 0..8 {
        assert_eq!(stream(&env, "").status, 200);
    }
    std::thread::sleep(Duration::from_millis(1600));
    assert!(burst(&env, 10).iter().all(|r| r.status == 200));
    // Measurement still ran (the control that the feature was exercised).
    let st = request(env.public(), &get("/r/_ttft_status")).json();
    assert!(st["pools"]["_"]["ewma"].as_f64().unwrap() >= 250.0, "{st}");
    assert_eq!(st["pools"]["_"]["active"], false);
    // In the reference's shape: the default metric, no threshold, a static source; a
    // runtime override is named as one.
    let list = &st["metrics"][0];
    assert_eq!(list["source"], "static", "{st}");
    assert_eq!(list["items"][0]["metric"], "p80", "{st}");
    assert_eq!(list["items"][0]["q"], 0.8, "{st}");
    assert!(list["items"][0].get("threshold_ms").is_none(), "{st}");
    assert!(st.get("ttft_limit_ms").is_none(), "{st}");
    request(env.public(), &get("/r/_ttft_limit?ms=900"));
    let st = request(env.public(), &get("/r/_ttft_status")).json();
    assert_eq!(st["metrics"][0]["source"], "override", "{st}");
    assert_eq!(st["metrics"][0]["items"][0]["threshold_ms"], 900.0, "{st}");
}

#[test]
fn adaptive_limit_falls_with_the_decode_rate_and_climbs_back() {
    let a = mock_with("a", |c| c.decode_tps = 20.0);
    let b = mock_with("b", |c| c.decode_tps = 20.0);
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, max_concurrency = 10 }}, {{ host = \"127.0.0.1\", port = {}, max_concurrency = 10 }} ]\n\
         adaptive_cc = true\nadaptive_cc_init = 16\nadaptive_cc_min = 4\nadaptive_cc_interval = 1\nadaptive_cc_hold_when_idle = true\n\
         tps_limit_tps = 40\ntps_window = 1\ntps_ttl = 30\ntps_min_tokens = 16\ntps_min_decode_s = 0.5\n",
        a.addr().port(),
        b.addr().port()
    );
    let env = start(&[("r", route)], "");
    let limit = || {
        request(env.public(), &get("/r/_tps_status")).json()["pools"]["_"]["adaptive_cc_limit"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(limit(), 16.0, "starts at init");
    let load = |secs: u64, tokens: u32| {
        let addr = env.public();
        let hs: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    let t0 = Instant::now();
                    while t0.elapsed() < Duration::from_secs(secs) {
                        let body = json!({"model": "m", "stream": true, "max_tokens": tokens, "messages": [{"role": "user", "content": "go"}]});
                        let _ = request(addr, &post_json("/r/v1/chat/completions", &body.to_string(), ""));
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    };
    // 20 tokens/s is below the 40 limit: overload, the limit falls (never below the floor).
    load(6, 16);
    let low = limit();
    assert!(
        (4.0..16.0).contains(&low),
        "the limit fell below init/static max: {low}"
    );
    // The engines recover (fast decode; enough tokens to measure): it climbs back.
    a.set_config(|c| c.decode_tps = 200.0);
    b.set_config(|c| c.decode_tps = 200.0);
    load(6, 120);
    let high = limit();
    assert!(high > low, "climbs back after recovery: {low} -> {high}");
    // Idle with hold_when_idle: it stays where it is.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(limit(), high);
}

/// TTFT switched off at run time (`_ttft_toggle?on=0`) is no signal for the adaptive
/// controller either: under a TTFT above the limit and a healthy decode rate, the route
/// with TTFT on shrinks its limit (the control), the route with it off does not.
#[test]
fn a_ttft_switched_off_no_longer_shrinks_the_adaptive_limit() {
    let m = mock_with("slow-first-token", |c| {
        c.ttft_base_ms = 150;
        c.decode_tps = 400.0;
    });
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, max_concurrency = 10 }} ]\n\
         adaptive_cc = true\nadaptive_cc_init = 8\nadaptive_cc_interval = 1\nadaptive_cc_hold_when_idle = true\n\
         tps_limit_tps = 40\ntps_window = 1\ntps_ttl = 30\ntps_min_tokens = 16\ntps_min_decode_s = 0.2\n\
         ttft_limit_ms = 50\nttft_window = 1\nttft_ttl = 30\n",
        m.addr().port()
    );
    let env = start(&[("on", route.clone()), ("off", route)], "");
    request(env.public(), &get("/off/_ttft_toggle?on=0"));
    let limit = |r: &str| {
        request(env.public(), &get(&format!("/{r}/_route_state"))).json()["limit"]
            .as_f64()
            .unwrap()
    };
    assert_eq!((limit("on"), limit("off")), (8.0, 8.0));
    let addr = env.public();
    let hs: Vec<_> = ["on", "off"]
        .iter()
        .flat_map(|r| std::iter::repeat_n(*r, 3))
        .map(|r| {
            std::thread::spawn(move || {
                let t0 = Instant::now();
                while t0.elapsed() < Duration::from_secs(5) {
                    let body = json!({"model": "m", "stream": true, "max_tokens": 120, "messages": [{"role": "user", "content": "go"}]});
                    let resp = request(
                        addr,
                        &post_json(&format!("/{r}/v1/chat/completions"), &body.to_string(), ""),
                    );
                    if resp.status != 200 {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let (on, off) = (limit("on"), limit("off"));
    assert!(on < 8.0, "TTFT on: the limit shrinks ({on})");
    assert!(off >= 8.0, "TTFT off: no TTFT shrink ({off})");
}

#[test]
fn session_priority_refuses_turn_one_first_near_the_limit() {
    let m = mock("m0");
    let route = format!("peers = [ {{ host = \"127.0.0.1\", port = {}, max_concurrency = 10 }} ]\nsession_prio = true\n", m.addr().port());
    let env = start(&[("r", route)], "");
    let addr = env.public();
    let turn =
        |n: u32| format!("x-phanrouter-session: {{\"session_id\":\"s{n}\",\"turn\":{n}}}\r\n");
    // Nine warm requests (turn 5) held in flight.
    let held: Vec<_> = (0..9)
        .map(|_| held_chat(addr, &format!("{}x-mock-ttft-ms: 1500\r\n", turn(5))))
        .collect();
    eventually(Duration::from_secs(5), "nine in flight", || {
        inflight_total(&env, "r") == 9
    });
    // Limit 10: turn 1's ceiling is ceil(10 × 0.85) = 9 (full), a warm turn's is 10.
    let t1 = request(
        addr,
        &post_json("/r/v1/chat/completions", &chat_body("x", false), &turn(1)),
    );
    assert_eq!(t1.status, 429);
    assert_eq!(t1.json()["error"]["type"], "concurrency_limit_exceeded");
    // The body gives the graded gate's figures: 9 in flight is under `limit` (10), at the
    // turn-1 bucket's ceiling.
    let e = &t1.json()["error"];
    assert_eq!(
        (
            e["limit"].as_u64(),
            e["inflight"].as_u64(),
            e["turn_bucket"].as_u64(),
            e["bucket_min_turn"].as_u64(),
            e["share"].as_f64(),
            e["bucket_limit"].as_u64()
        ),
        (Some(10), Some(9), Some(0), Some(1), Some(0.85), Some(9)),
        "{e}"
    );
    let warm_h = format!("{}x-mock-ttft-ms: 1500\r\n", turn(8));
    let warm = std::thread::spawn(move || {
        request(
            addr,
            &post_json("/r/v1/chat/completions", &chat_body("x", false), &warm_h),
        )
    });
    eventually(
        Duration::from_secs(5),
        "the warm request is admitted",
        || inflight_total(&env, "r") == 10,
    );
    // The control: with the feature off, the same turn-1 request fits under the static limit.
    request(addr, &get("/r/_session_prio_toggle?on=0"));
    for h in held {
        assert_eq!(h.join().unwrap().status, 200);
    }
    assert_eq!(warm.join().unwrap().status, 200);
    let st = request(addr, &get("/r/_session_status")).json();
    assert_eq!(st["enabled"], false);
    assert_eq!(st["table"][0]["rejected"], 1, "{st}");
    assert_eq!(
        st["table"][0]["bucket"].as_str().map(|s| !s.is_empty()),
        Some(true)
    );
    request(addr, &get("/r/_session_prio_toggle?reset=1"));
    // Requests without the header are treated as fully warm and counted.
    assert_eq!(
        request(
            addr,
            &post_json("/r/v1/chat/completions", &chat_body("x", false), "")
        )
        .status,
        200
    );
    assert_eq!(
        request(addr, &get("/r/_session_status")).json()["no_header"]["bnohdr:missing"],
        1
    );
}

/// One non-streaming request on route `r` that the mock answers after `ms`, on its own
/// thread.
fn held_request(env: &Env, ms: u32) -> std::thread::JoinHandle<Resp> {
    held_chat(env.public(), &format!("x-mock-ttft-ms: {ms}\r\n"))
}

/// Hold `n` slow non-streaming requests on route `r` in flight (each takes `ms` to answer).
fn hold(env: &Env, n: usize, ms: u32) -> Vec<std::thread::JoinHandle<Resp>> {
    let held: Vec<_> = (0..n).map(|_| held_request(env, ms)).collect();
    eventually(Duration::from_secs(5), "requests in flight", || {
        inflight_total(env, "r") == n as i64
    });
    held
}

/// `_active_conns_set` with requests in flight: the count set stays what was set when they
/// end, so the limit holds after it (a flush with two in flight used to leave the sum at
/// -2, read as 0, and let four requests past a limit of two until a restart).
#[test]
fn a_count_set_by_hand_is_not_undone_by_the_requests_it_replaced() {
    let m = mock("m0");
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, name = \"p0\", max_concurrency = 2 }} ]\n",
        m.addr().port()
    );
    let env = start(&[("r", route)], "");
    let statuses = |n: usize| -> Vec<u16> {
        let held = hold_one_at_a_time(&env, n, 1200);
        let mut s: Vec<u16> = held.into_iter().map(|h| h.join().unwrap().status).collect();
        s.sort();
        s
    };
    // Control: the limit admits two of four.
    assert_eq!(statuses(4), [200, 200, 429, 429]);
    // A flush while two are in flight, then they end.
    let held = hold(&env, 2, 800);
    let r = request(env.public(), &get("/r/_active_conns_set?flush=1"));
    assert_eq!(r.json()["ok"], true);
    assert_eq!(inflight_total(&env, "r"), 0);
    for h in held {
        assert_eq!(h.join().unwrap().status, 200);
    }
    assert_eq!(inflight_total(&env, "r"), 0);
    assert_eq!(statuses(4), [200, 200, 429, 429], "the limit after a flush");
    // A value set while two are in flight is the count once they end.
    let held = hold(&env, 2, 800);
    request(env.public(), &get("/r/_active_conns_set?peer=p0&value=1"));
    for h in held {
        assert_eq!(h.join().unwrap().status, 200);
    }
    assert_eq!(inflight_total(&env, "r"), 1);
    assert_eq!(
        statuses(3),
        [200, 429, 429],
        "one of two taken by the count set"
    );
    request(env.public(), &get("/r/_active_conns_set?flush=1"));
    assert_eq!(inflight_total(&env, "r"), 0);
    assert_eq!(statuses(3), [200, 200, 429]);
}

/// `n` requests held `ms` at the mock, sent one at a time through the gate: each is sent
/// once the one before has been counted in flight or answered (two that reach two workers
/// at the same instant can both pass the last free unit; the gate's check and count are
/// not one atomic step).
fn hold_one_at_a_time(env: &Env, n: usize, ms: u32) -> Vec<std::thread::JoinHandle<Resp>> {
    let mut held: Vec<std::thread::JoinHandle<Resp>> = Vec::new();
    for _ in 0..n {
        let before = inflight_total(env, "r");
        let h = held_request(env, ms);
        eventually(Duration::from_secs(5), "counted or answered", || {
            h.is_finished() || inflight_total(env, "r") > before
        });
        held.push(h);
    }
    held
}

#[test]
fn route_state_shows_the_adaptive_limit_in_force_and_the_static_one() {
    let m = mock("m0");
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, max_concurrency = 8 }} ]\n\
         adaptive_cc = true\nadaptive_cc_init = 3\nadaptive_cc_interval = 600\n",
        m.addr().port()
    );
    // Without a decode-rate threshold adaptive concurrency has nothing to steer by: it is
    // off, and the static limit applies (notes-control §4.1; it held the pool at 3).
    let env = start(
        &[
            ("r", format!("{route}tps_limit_tps = 5\n")),
            ("nosignal", route),
        ],
        "",
    );
    let st = request(env.public(), &get("/nosignal/_route_state")).json();
    assert_eq!(
        (&st["limit"], &st["adaptive_cc_in_force"]),
        (&json!(8), &json!(false)),
        "{st}"
    );
    // Decided by the configuration: a runtime threshold override does not turn it on.
    request(env.public(), &get("/nosignal/_tps_limit?limit=5"));
    let st = request(env.public(), &get("/nosignal/_route_state")).json();
    assert_eq!(
        (&st["limit"], &st["adaptive_cc_in_force"]),
        (&json!(8), &json!(false))
    );
    let st = request(env.public(), &get("/r/_route_state")).json();
    assert_eq!(st["limit"], 3, "the adaptive limit: {st}");
    assert_eq!(st["adaptive_cc_in_force"], true, "{st}");
    assert_eq!(
        st["pool_limit"], 8,
        "the static capacity stays visible: {st}"
    );
    assert_eq!(st["adaptive_cc"], true, "{st}");
    // The control: the gate applies that limit — three in flight, a fourth is refused by
    // the same figure, and _route_state says so while it happens.
    let held = hold(&env, 3, 1500);
    let r = request(
        env.public(),
        &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
    );
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["limit"], 3);
    // The adaptive limit says so, with the static limit it moves under.
    assert_eq!(
        (
            &r.json()["error"]["adaptive_cc"],
            &r.json()["error"]["pool_limit"]
        ),
        (&json!(3), &json!(8))
    );
    assert!(r.json()["error"]["avg_5min"].is_number(), "{}", r.text());
    let st = request(env.public(), &get("/r/_route_state")).json();
    assert_eq!(
        (st["limit"].clone(), st["inflight"].clone()),
        (json!(3), json!(3)),
        "{st}"
    );
    // Switching the decode rate off at run time puts the static limit back at once (the
    // operator's way out of a limit stuck low), and on again the adaptive one.
    let limit = |toggle: &str| {
        request(env.public(), &get(&format!("/r/_tps_toggle?on={toggle}")));
        let st = request(env.public(), &get("/r/_route_state")).json();
        (st["limit"].clone(), st["adaptive_cc_in_force"].clone())
    };
    assert_eq!(limit("0"), (json!(8), json!(false)));
    let tps = request(env.public(), &get("/r/_tps_status")).json()["pools"]["_"].clone();
    assert_eq!(
        (&tps["adaptive_cc_in_force"], &tps["adaptive_cc_limit"]),
        (&json!(false), &serde_json::Value::Null),
        "{tps}"
    );
    let r = request(
        env.public(),
        &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
    );
    assert_eq!(r.status, 200, "a fourth request fits the static limit");
    assert_eq!(limit("1"), (json!(3), json!(true)));
    let tps = request(env.public(), &get("/r/_tps_status")).json()["pools"]["_"].clone();
    assert_eq!(tps["adaptive_cc_limit"], 3.0, "{tps}");
    for h in held {
        assert_eq!(h.join().unwrap().status, 200);
    }
}

/// Only a 429 under the adaptive limit is unmet demand for it: one under the static limit
/// (adaptive concurrency switched off at run time) is not counted, so switching it back on
/// does not grow the limit by it. The control: a 429 under the adaptive limit is counted.
#[test]
fn only_the_adaptive_limits_429s_count_as_its_unmet_demand() {
    let m = mock("m0");
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, max_concurrency = 2 }} ]\n\
         adaptive_cc = true\nadaptive_cc_init = 1\nadaptive_cc_interval = 600\ntps_limit_tps = 5\n",
        m.addr().port()
    );
    let env = start(&[("r", route)], "");
    let rej = || {
        request(env.public(), &get("/r/_tps_status")).json()["pools"]["_"]["adaptive_cc_rej"]
            .as_u64()
            .unwrap()
    };
    let refused = || {
        let r = request(
            env.public(),
            &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
        );
        assert_eq!(r.status, 429, "{}", r.text());
        r
    };
    // The adaptive limit (1): one held, the next refused and counted.
    let held = hold(&env, 1, 1500);
    let r = refused();
    assert_eq!(r.json()["error"]["adaptive_cc"], 1, "{}", r.text());
    assert_eq!(rej(), 1);
    for h in held {
        assert_eq!(h.join().unwrap().status, 200);
    }
    // The static limit (2): the count is dropped while it applies, and its 429 is not one.
    request(env.public(), &get("/r/_tps_toggle?on=0"));
    eventually(Duration::from_secs(5), "the count dropped", || rej() == 0);
    let held = hold(&env, 2, 1500);
    let r = refused();
    assert!(r.json()["error"]["adaptive_cc"].is_null(), "{}", r.text());
    assert_eq!(rej(), 0);
    for h in held {
        assert_eq!(h.join().unwrap().status, 200);
    }
}

#[test]
fn rate_limit_status_names_the_layer_that_set_the_switch() {
    let m = mock("m0");
    let one = |extra: &str| {
        format!(
            "peers = [ {{ host = \"127.0.0.1\", port = {}, max_concurrency = 1 }} ]\n{extra}",
            m.addr().port()
        )
    };
    // "r" inherits the server default (off); "own" sets the same value itself; "on" sets
    // the opposite of the default.
    let env = start(
        &[
            ("r", one("")),
            ("own", one("load_rate_limit = false\n")),
            ("on", one("load_rate_limit = true\n")),
        ],
        "[defaults]\nload_rate_limit = false\n",
    );
    let st =
        |route: &str| request(env.public(), &get(&format!("/{route}/_rate_limit_status"))).json();
    let r = st("r");
    assert_eq!(r["pools"]["_"]["enabled"], false, "{r}");
    assert_eq!(r["pools"]["_"]["source"], "server_default", "{r}");
    assert_eq!(r["route_option"], serde_json::Value::Null, "{r}");
    assert_eq!(r["server_default"], false, "{r}");
    let own = st("own");
    assert_eq!(own["pools"]["_"]["source"], "route", "{own}");
    assert_eq!(
        (own["route_option"].clone(), own["server_default"].clone()),
        (json!(false), json!(false)),
        "{own}"
    );
    let on = st("on");
    assert_eq!(on["pools"]["_"]["enabled"], true, "{on}");
    assert_eq!(on["pools"]["_"]["source"], "route", "{on}");
    assert_eq!(
        (on["route_option"].clone(), on["server_default"].clone()),
        (json!(true), json!(false)),
        "{on}"
    );
    // The control: the inherited default is what is in force — one request held on a limit
    // of one, a second goes through and counts a trip.
    let held = hold(&env, 1, 1500);
    let r2 = request(
        env.public(),
        &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
    );
    assert_eq!(r2.status, 200, "{}", r2.text());
    assert_eq!(st("r")["pools"]["_"]["trips"]["concurrency"], 1);
    for h in held {
        assert_eq!(h.join().unwrap().status, 200);
    }
    // The runtime override is named as such while it is in place.
    request(env.public(), &get("/r/_rate_limit_toggle?on=1"));
    assert_eq!(st("r")["pools"]["_"]["source"], "runtime");
    request(env.public(), &get("/r/_rate_limit_toggle?reset=1"));
    assert_eq!(st("r")["pools"]["_"]["source"], "server_default");
}

#[test]
fn a_concurrency_429_carries_the_five_minute_cluster_average() {
    let m = mock("m0");
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, max_concurrency = 1 }} ]\n",
        m.addr().port()
    );
    let env = start(&[("r", route)], "");
    // The control: the sampler ran, so the average exists (SPEC §5.5).
    let avg = || {
        let c = request(env.public(), &get("/r/_cluster_avg")).json();
        assert!(c["pools"]["_"]["samples"].as_u64().unwrap() >= 1, "{c}");
        // The reference's route-wide shape too; one pool, so the same figures.
        assert_eq!(c["avg_5min"], c["pools"]["_"]["avg_5min"], "{c}");
        assert_eq!(c["samples"], c["pools"]["_"]["samples"], "{c}");
        let buckets = c["buckets"].as_object().unwrap();
        assert_eq!(buckets.len() as u64, c["samples"].as_u64().unwrap(), "{c}");
        assert!(c["cur_bucket_idx"].as_u64().unwrap() < 10, "{c}");
        assert!(c["realtime_sum"].is_u64(), "{c}");
        c["pools"]["_"]["avg_5min"].clone()
    };
    eventually(Duration::from_secs(5), "a cluster sample", || {
        request(env.public(), &get("/r/_cluster_avg")).json()["pools"]["_"]["samples"]
            .as_u64()
            .unwrap()
            >= 1
    });
    let held = hold(&env, 1, 1500);
    let r = request(
        env.public(),
        &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
    );
    assert_eq!(r.status, 429, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["type"], "concurrency_limit_exceeded");
    assert!(e["avg_5min"].is_number(), "{e}");
    assert_eq!(e["avg_5min"], avg(), "{e}");
    for h in held {
        assert_eq!(h.join().unwrap().status, 200);
    }
}

/// `_cluster_avg` route-wide adds up a `peers_by_model` route's pools: one request held in
/// each of two pools is two in flight for the route and one for each pool, and the
/// route's five-minute average is the pools' added (their samples are taken together).
#[test]
fn the_route_wide_cluster_average_adds_the_pools_up() {
    let (a, b) = (mock("a"), mock("b"));
    let route = format!(
        "[peers_by_model]\n\"llama\" = [ {{ host = \"127.0.0.1\", port = {} }} ]\n\"qwen\" = [ {{ host = \"127.0.0.1\", port = {} }} ]\n",
        a.addr().port(),
        b.addr().port()
    );
    let env = start(&[("bm", route)], "");
    let addr = env.public();
    let held: Vec<_> = ["llama", "qwen"]
        .into_iter()
        .map(|model| {
            std::thread::spawn(move || {
                let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
                request(
                    addr,
                    &post_json(
                        "/bm/v1/chat/completions",
                        &body.to_string(),
                        "x-mock-ttft-ms: 1500\r\n",
                    ),
                )
            })
        })
        .collect();
    let avg = || request(env.public(), &get("/bm/_cluster_avg")).json();
    eventually(Duration::from_secs(5), "both held", || {
        avg()["realtime_sum"] == 2
    });
    let c = avg();
    assert_eq!(c["pools"]["llama"]["realtime_sum"], 1, "{c}");
    assert_eq!(c["pools"]["qwen"]["realtime_sum"], 1, "{c}");
    let pools_avg = c["pools"]["llama"]["avg_5min"].as_f64().unwrap()
        + c["pools"]["qwen"]["avg_5min"].as_f64().unwrap();
    assert_eq!(c["avg_5min"].as_f64().unwrap(), pools_avg, "{c}");
    assert_eq!(c["samples"], c["pools"]["llama"]["samples"], "{c}");
    for h in held {
        assert_eq!(h.join().unwrap().status, 200);
    }
}

#[test]
fn with_the_switch_off_every_latency_trip_is_counted_and_no_probe_slot_is_spent() {
    let m = mock_with("m0", |c| c.ttft_base_ms = 400);
    // A long probe window with room for five: what the requests below would take from it
    // is plain to see, and the window does not turn over during the test.
    let opts = "load_rate_limit = false\nttft_metrics = [ { metric = \"avg\", threshold = 200 } ]\n\
                ttft_window = 1\nttft_ttl = 30\nttft_probe_window = 600\nttft_probe_per_window = 5\n";
    let env = start(
        &[
            ("r", route_for(&[m.addr()], opts)),
            (
                "p",
                route_for(&[m.addr()], &format!("{opts}session_prio = true\n")),
            ),
        ],
        "",
    );
    let turn1 = "x-phanrouter-session: {\"session_id\":\"s1\",\"turn\":1}\r\n";
    let send = |route: &str| {
        let body = json!({"model": "m", "stream": true, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
        request(
            env.public(),
            &post_json(
                &format!("/{route}/v1/chat/completions"),
                &body.to_string(),
                turn1,
            ),
        )
        .status
    };
    let ttft = |route: &str| {
        request(env.public(), &get(&format!("/{route}/_ttft_status"))).json()["pools"]["_"].clone()
    };
    let trips = |route: &str| {
        request(env.public(), &get(&format!("/{route}/_rate_limit_status"))).json()["pools"]["_"]
            ["trips"]["ttft"]
            .as_u64()
            .unwrap()
    };
    // Slow first tokens until each route's EWMA is over its limit; stop at once, so that
    // (before the fix) hardly any of the probe budget is gone.
    for route in ["r", "p"] {
        let t0 = Instant::now();
        while ttft(route)["hit"] != true {
            assert!(t0.elapsed() < Duration::from_secs(15), "{}", ttft(route));
            assert_eq!(send(route), 200);
        }
    }
    for route in ["r", "p"] {
        let before = trips(route);
        for _ in 0..4 {
            assert_eq!(
                send(route),
                200,
                "the switch is off: {route} lets it through"
            );
        }
        let st = ttft(route);
        // The control: the gate measured and is tripped.
        assert_eq!(st["hit"], true, "{st}");
        assert!(st["ewma"].as_f64().unwrap() >= 200.0, "{st}");
        assert_eq!(
            trips(route) - before,
            4,
            "every trip counted on {route}: {st}"
        );
        assert_eq!(st["trips_while_rate_limit_off"], trips(route));
        assert_eq!(
            st["probe_used_cur_window"], 0,
            "no probe slot spent on {route}: {st}"
        );
    }
    // Session priority's turn-1 hold flag is neither set nor released while the switch is off.
    let ss = request(env.public(), &get("/p/_session_status")).json();
    assert_eq!(ss["turn1_hold"], false, "{ss}");
    // With the switch back on, the whole probe budget is there: five pass, then 429.
    request(env.public(), &get("/r/_rate_limit_toggle?on=1"));
    // The probe windows are wall-clock aligned (epoch seconds / 600): keep the six requests
    // below out of the last seconds of one, where a new window would refill the budget.
    let into = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 600;
    if into >= 590 {
        std::thread::sleep(Duration::from_secs(601 - into));
    }
    let codes: Vec<u16> = (0..6).map(|_| send("r")).collect();
    assert_eq!(codes, [200, 200, 200, 200, 200, 429]);
}

/// Every toggle takes the same `on` values (the TTFT and decode-rate ones took only 1/0),
/// and an unknown endpoint is a 404 whatever its query (`?model=` gave a 400).
#[test]
fn every_toggle_takes_the_same_on_values_and_unknown_endpoints_are_404() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let get_json = |path: &str| {
        let r = request(env.public(), &get(path));
        (r.status, r.json())
    };
    let (st, v) = get_json("/r/_ttft_toggle?on=false");
    assert_eq!((st, v["active"].clone()), (200, json!(false)), "{v}");
    let (st, v) = get_json("/r/_tps_toggle?on=off");
    assert_eq!((st, v["active"].clone()), (200, json!(false)), "{v}");
    let (st, v) = get_json("/r/_ttft_toggle?on=yes");
    assert_eq!((st, v["active"].clone()), (200, json!(true)), "{v}");
    assert_eq!(get_json("/r/_rate_limit_toggle?on=true").0, 200);
    assert_eq!(get_json("/r/_session_prio_toggle?on=false").0, 200);
    // The control: a value that is none of them is still refused.
    assert_eq!(get_json("/r/_ttft_toggle?on=maybe").0, 400);
    assert_eq!(get_json("/r/_nope?model=zz").0, 404);
    assert_eq!(get_json("/r/_ttft_status?model=zz").0, 400);
}
