//! Routing policy end to end: session affinity from every source, tiers, health bans and
//! recovery, concurrency and availability gates, retries, sub-pools and bare /v1.

mod common;

use std::io::{BufReader, Write};
use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use serde_json::json;

fn three() -> (Vec<warmroute_mock::MockServer>, Vec<SocketAddr>) {
    let mocks: Vec<_> = (0..3).map(|i| mock(&format!("m{i}"))).collect();
    let addrs = mocks.iter().map(|m| m.addr()).collect();
    (mocks, addrs)
}

fn expected_peer(id: &str, n: usize) -> String {
    format!("p{}", crc32fast::hash(id.as_bytes()) as usize % n)
}

fn chat(env: &Env, path: &str, body: serde_json::Value, headers: &str) -> Resp {
    request(env.public(), &post_json(path, &body.to_string(), headers))
}

#[test]
fn every_session_source_pins_to_crc32_mod_n() {
    let (_m, addrs) = three();
    let env = start(&[("r", route_for(&addrs, ""))], "");
    let make = |label: &str, id: &str| -> (serde_json::Value, String) {
        let mut b = json!({"model": "mock-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
        let mut h = String::new();
        match label {
            "header:x-litellm-session-id" => h = format!("x-litellm-session-id: {id}\r\n"),
            "header:x-claude-code-session-id" => h = format!("x-claude-code-session-id: {id}\r\n"),
            "header:x-session-id" => h = format!("X-Session-Id: {id}\r\n"),
            "body:metadata.session_id" => b["metadata"] = json!({"session_id": id}),
            "body:litellm_metadata.session_id" => b["litellm_metadata"] = json!({"session_id": id}),
            "body:metadata.user_id.session_id" => {
                b["metadata"] = json!({"user_id": {"session_id": id}})
            }
            "json-string" => {
                b["metadata"] = json!({"user_id": json!({"session_id": id}).to_string()})
            }
            "body:metadata.user_id" => b["metadata"] = json!({"user_id": id}),
            "body:user" => b["user"] = json!(id),
            other => unreachable!("{other}"),
        }
        (b, h)
    };
    let cases = [
        ("header:x-litellm-session-id", "header:x-litellm-session-id"),
        (
            "header:x-claude-code-session-id",
            "header:x-claude-code-session-id",
        ),
        ("header:x-session-id", "header:x-session-id"),
        ("body:metadata.session_id", "body:metadata.session_id"),
        (
            "body:litellm_metadata.session_id",
            "body:litellm_metadata.session_id",
        ),
        (
            "body:metadata.user_id.session_id",
            "body:metadata.user_id.session_id",
        ),
        ("json-string", "body:metadata.user_id.session_id"),
        ("body:metadata.user_id", "body:metadata.user_id"),
        ("body:user", "body:user"),
    ];
    let mut peers_seen = std::collections::HashSet::new();
    for (kind, label) in cases {
        for k in 0..6 {
            let id = format!("session-{k}-{kind}");
            for _ in 0..2 {
                let (body, headers) = make(kind, &id);
                let r = chat(&env, "/r/v1/chat/completions", body, &headers);
                assert_eq!(r.status, 200);
                assert_eq!(r.header("x-routed-source"), Some(label), "{id}");
                assert_eq!(r.header("x-routed-mode"), Some("hash"));
                assert_eq!(r.header("x-routed-session"), Some(id.as_str()));
                let want = expected_peer(&id, 3);
                assert_eq!(
                    r.header("x-routed-peer"),
                    Some(want.as_str()),
                    "{label} {id}"
                );
                peers_seen.insert(want);
            }
        }
    }
    assert_eq!(peers_seen.len(), 3, "ids spread over every peer");
}

#[test]
fn blank_ids_and_no_ids_go_least_conn_and_spread() {
    let (mocks, addrs) = three();
    let env = start(&[("r", route_for(&addrs, ""))], "");
    let body =
        json!({"model": "m", "metadata": {"session_id": "   "}, "user": "\t", "messages": []});
    let r = chat(
        &env,
        "/r/v1/chat/completions",
        body,
        "x-session-id:    \r\n",
    );
    assert_eq!(r.header("x-routed-mode"), Some("least_conn"));
    assert_eq!(r.header("x-routed-source"), Some("none"));
    assert_eq!(r.header("x-routed-session"), Some("-"));
    // The control: a real id in the same body is used.
    let body =
        json!({"model": "m", "metadata": {"session_id": "   "}, "user": "u-1", "messages": []});
    let r = chat(&env, "/r/v1/chat/completions", body, "");
    assert_eq!(r.header("x-routed-source"), Some("body:user"));
    for _ in 0..60 {
        let r = chat(
            &env,
            "/r/v1/chat/completions",
            json!({"model": "m", "messages": []}),
            "",
        );
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-routed-mode"), Some("least_conn"));
    }
    for m in &mocks {
        assert!(
            m.stats().completions >= 8,
            "60 requests spread over 3 peers: {:?}",
            mocks
                .iter()
                .map(|m| m.stats().completions)
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn affinity_off_and_body_user_off_are_respected() {
    let (_m, addrs) = three();
    let env = start(
        &[
            ("off", route_for(&addrs, "session_affinity = false\n")),
            ("nouser", route_for(&addrs, "body_user_affinity = false\n")),
        ],
        "",
    );
    let r = chat(
        &env,
        "/off/v1/chat/completions",
        json!({"messages": []}),
        "x-session-id: abc\r\n",
    );
    assert_eq!(
        (r.header("x-routed-source"), r.header("x-routed-mode")),
        (Some("affinity_off"), Some("least_conn"))
    );
    let r = chat(
        &env,
        "/nouser/v1/chat/completions",
        json!({"user": "abc", "messages": []}),
        "",
    );
    assert_eq!(r.header("x-routed-source"), Some("none"));
    let r = chat(
        &env,
        "/nouser/v1/chat/completions",
        json!({"metadata": {"user_id": "abc"}, "messages": []}),
        "",
    );
    assert_eq!(
        r.header("x-routed-source"),
        Some("body:metadata.user_id"),
        "control: other body sources still count"
    );
}

#[test]
fn a_dead_peer_is_banned_its_sessions_move_and_come_back() {
    let (mut mocks, addrs) = three();
    let env = start(
        &[(
            "r",
            route_for(&addrs, "health_check_interval = 1\nhealth_ban_ttl = 60\n"),
        )],
        "",
    );
    // Ids that map to each peer.
    let ids: Vec<String> = (0..30).map(|i| format!("conv-{i}")).collect();
    let target = |id: &str| crc32fast::hash(id.as_bytes()) as usize % 3;
    let route_of = |id: &str| {
        let r = chat(
            &env,
            "/r/v1/chat/completions",
            json!({"messages": []}),
            &format!("x-session-id: {id}\r\n"),
        );
        assert_eq!(r.status, 200);
        (
            r.header("x-routed-peer").unwrap().to_string(),
            r.header("x-routed-mode").unwrap().to_string(),
        )
    };
    let victim = 1;
    let dead = mocks.remove(victim);
    let dead_addr = dead.addr();
    dead.shutdown();
    eventually(
        Duration::from_secs(5),
        "peer banned within two intervals",
        || {
            request(env.public(), &get("/r/_health_status")).json()[dead_addr.to_string()]["banned"]
                == true
        },
    );
    for id in &ids {
        let (peer, mode) = route_of(id);
        if target(id) == victim {
            assert_ne!(peer, format!("p{victim}"));
            assert_eq!(mode, "hash_fallback", "{id}");
        } else {
            assert_eq!(
                (peer, mode),
                (format!("p{}", target(id)), "hash".to_string()),
                "other sessions stay"
            );
        }
    }
    // Bring it back on the same port: it is unbanned and its sessions return.
    let back = warmroute_mock::MockServer::start(
        dead_addr,
        warmroute_mock::MockConfig {
            name: "m1-again".into(),
            ttft_base_ms: 0,
            ttft_per_uncached_token_us: 0,
            decode_tps: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    eventually(Duration::from_secs(5), "peer recovered", || {
        request(env.public(), &get("/r/_health_status")).json()[dead_addr.to_string()]["banned"]
            == false
    });
    for id in ids.iter().filter(|id| target(id) == victim) {
        assert_eq!(route_of(id), (format!("p{victim}"), "hash".to_string()));
    }
    assert!(back.stats().completions > 0);
    let hs = request(env.public(), &get("/r/_health_status")).json();
    assert_eq!(hs[dead_addr.to_string()]["bans"], 1);
    assert_eq!(hs[dead_addr.to_string()]["unbans"], 1);
}

#[test]
fn higher_tier_takes_everything_lower_tier_serves_when_it_is_down() {
    let hi = mock("hi");
    let lo = mock("lo");
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, name = \"hi\", priority = 1 }}, {{ host = \"127.0.0.1\", port = {}, name = \"lo\", priority = 0 }} ]\nhealth_check_interval = 1\nhealth_probe_path = \"/health\"\n",
        hi.addr().port(),
        lo.addr().port()
    );
    let env = start(&[("r", route)], "");
    for i in 0..10 {
        let r = chat(
            &env,
            "/r/v1/chat/completions",
            json!({"messages": []}),
            &format!("x-session-id: s{i}\r\n"),
        );
        assert_eq!(r.header("x-routed-peer"), Some("hi"));
    }
    hi.set_config(|c| c.health_status = Some(500));
    eventually(Duration::from_secs(5), "hi banned", || {
        request(env.public(), &get("/r/_route_state")).json()["active_level"] == 0
    });
    for i in 0..10 {
        let r = chat(
            &env,
            "/r/v1/chat/completions",
            json!({"messages": []}),
            &format!("x-session-id: s{i}\r\n"),
        );
        assert_eq!(
            (r.header("x-routed-peer"), r.header("x-routed-mode")),
            (Some("lo"), Some("hash"))
        );
    }
    hi.set_config(|c| c.health_status = None);
    eventually(Duration::from_secs(5), "hi back", || {
        request(env.public(), &get("/r/_route_state")).json()["active_level"] == 1
    });
}

#[test]
fn concurrency_gate_429_and_all_banned_503() {
    let a = mock("a");
    let b = mock("b");
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, name = \"a\", max_concurrency = 1 }}, {{ host = \"127.0.0.1\", port = {}, name = \"b\", max_concurrency = 1 }} ]\nhealth_check_interval = 1\nhealth_probe_path = \"/health\"\n",
        a.addr().port(),
        b.addr().port()
    );
    let env = start(&[("r", route)], "");
    let addr = env.public();
    let slow = || held_chat(addr, "x-mock-ttft-ms: 800\r\n");
    let h1 = slow();
    let h2 = slow();
    eventually(Duration::from_secs(5), "two in flight", || {
        inflight_total(&env, "r") == 2
    });
    let third = request(
        addr,
        &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
    );
    assert_eq!(third.status, 429);
    assert_eq!(third.header("retry-after"), Some("1"));
    let e = &third.json()["error"];
    assert_eq!(
        (
            e["type"].as_str(),
            e["limit"].as_u64(),
            e["inflight"].as_i64()
        ),
        (Some("concurrency_limit_exceeded"), Some(2), Some(2))
    );
    // A static limit: no adaptive figures.
    assert_eq!(
        (&e["adaptive_cc"], &e["pool_limit"]),
        (&serde_json::Value::Null, &serde_json::Value::Null)
    );
    let statuses = [h1.join().unwrap().status, h2.join().unwrap().status];
    assert_eq!(statuses, [200, 200]);
    let s = request(addr, &get("/r/_429_status")).json();
    assert_eq!(s["by_reason"]["concurrency"], 1);
    // Capacity is back: the same request passes.
    assert_eq!(
        request(
            addr,
            &post_json("/r/v1/chat/completions", &chat_body("x", false), "")
        )
        .status,
        200
    );
    // Reset is loopback-only: from 127.0.0.2 it is refused.
    let s = std::net::TcpStream::connect(addr);
    drop(s);
    let sock = socket2_free_connect_from("127.0.0.2", addr);
    if let Some(mut c) = sock {
        c.write_all(&get("/r/_429_status?reset=1")).unwrap();
        assert_eq!(
            read_response(&mut BufReader::new(c), false).unwrap().status,
            403
        );
    }
    assert_eq!(
        request(addr, &get("/r/_429_status?reset=1")).json()["reset"],
        true
    );
    assert_eq!(request(addr, &get("/r/_429_status")).json()["total"], 0);
    // The reset is the view's: the Prometheus counter keeps its count (a counter that
    // went back to 0 would read as a restart to rate()).
    let metrics = request(env.admin(), &get("/metrics")).text();
    assert!(
        metrics.contains("warmroute_rejected_total{route=\"r\",gate=\"concurrency\"} 1\n"),
        "{metrics}"
    );
    // All peers down → 503 with Retry-After: 5.
    a.set_config(|c| c.health_status = Some(503));
    b.set_config(|c| c.health_status = Some(503));
    eventually(Duration::from_secs(5), "all banned", || {
        request(
            addr,
            &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
        )
        .status
            == 503
    });
    let r = request(
        addr,
        &post_json("/r/v1/chat/completions", &chat_body("x", false), ""),
    );
    assert_eq!(r.header("retry-after"), Some("5"));
    assert_eq!(r.json()["error"]["type"], "no_healthy_upstream");
}

/// SPEC §8: every toggle and reset answers only 127.0.0.1 / ::1. From 127.0.0.2 each is
/// refused with 403 and changes nothing; the control sends the same from 127.0.0.1 and
/// gets 200.
#[test]
fn every_toggle_refuses_a_client_that_is_not_127_0_0_1() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let addr = env.public();
    let toggles = [
        "/r/_ttft_toggle?on=0",
        "/r/_tps_toggle?on=0",
        "/r/_ttft_limit?limit=5000",
        "/r/_tps_limit?limit=5",
        "/r/_bodylog_toggle?on=0",
        "/r/_reject_rules_toggle?on=0",
        "/r/_cch_strip_toggle?on=0",
        "/r/_kimi_normalize_toggle?on=0",
        "/r/_include_usage_toggle?on=0",
        "/r/_rate_limit_toggle?on=0",
        "/r/_session_prio_toggle?on=1",
        "/r/_429_status?reset=1",
        "/r/_active_conns_set?peer=p0&value=0",
    ];
    let Some(_) = socket2_free_connect_from("127.0.0.2", addr) else {
        eprintln!("skipped: 127.0.0.2 cannot be bound here");
        return;
    };
    for t in toggles {
        let mut c = socket2_free_connect_from("127.0.0.2", addr).unwrap();
        c.write_all(&get(t)).unwrap();
        let r = read_response(&mut BufReader::new(c), false).unwrap();
        assert_eq!(r.status, 403, "{t} from 127.0.0.2");
        assert_eq!(r.json()["error"]["type"], "forbidden", "{t}");
    }
    // Nothing was changed by the refused calls.
    let st = request(addr, &get("/r/_session_status")).json();
    assert_eq!(st["enabled"], false, "{st}");
    // The control: from 127.0.0.1 each is answered.
    for t in toggles {
        assert_eq!(request(addr, &get(t)).status, 200, "{t} from 127.0.0.1");
    }
    let st = request(addr, &get("/r/_session_status")).json();
    assert_eq!(st["enabled"], true, "{st}");
}

/// Connect from a specific loopback source address (127.0.0.2 is loopback but not 127.0.0.1).
fn socket2_free_connect_from(src: &str, dst: SocketAddr) -> Option<std::net::TcpStream> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
    let src: SocketAddr = format!("{src}:0").parse().ok()?;
    sock.bind(&src.into()).ok()?;
    sock.connect(&dst.into()).ok()?;
    Some(sock.into())
}

#[test]
fn a_refusing_peer_is_retried_elsewhere_and_banned() {
    let alive = mock("alive");
    // Port 1: never handed out by `bind(:0)`, so no parallel test can start listening
    // on the "dead" peer.
    let dead: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
    let env = start(
        &[(
            "r",
            route_for(&[dead, alive.addr()], "health_check_interval = 3600\n"),
        )],
        "",
    );
    // A session pinned to the dead peer (index 0).
    let id = (0..)
        .map(|i| format!("s{i}"))
        .find(|s| crc32fast::hash(s.as_bytes()).is_multiple_of(2))
        .unwrap();
    let r = chat(
        &env,
        "/r/v1/chat/completions",
        json!({"messages": []}),
        &format!("x-session-id: {id}\r\n"),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-routed-peer"), Some("p1"));
    assert_eq!(r.header("x-routed-retries"), Some("1"));
    // The connect failure banned it at once: the next request goes straight to p1.
    let r = chat(
        &env,
        "/r/v1/chat/completions",
        json!({"messages": []}),
        &format!("x-session-id: {id}\r\n"),
    );
    assert_eq!(
        (r.header("x-routed-retries"), r.header("x-routed-mode")),
        (Some("0"), Some("hash_fallback"))
    );
    assert_eq!(
        request(env.public(), &get("/r/_health_status")).json()[dead.to_string()]["banned"],
        true
    );
}

/// A peer that never completes a connect (a host that is down drops the SYN) is banned by
/// the health check: its probe's connect has the route's connect timeout and fails, rather
/// than running into the probe's own timeout, which reads as "busy" and left the peer in
/// the pool to cost each request a connect timeout. The control: a live peer probed in the
/// same rounds stays unbanned.
#[test]
fn a_peer_that_never_accepts_a_connection_is_banned_by_the_health_check() {
    let alive = mock("alive");
    // A listener nobody accepts on, its accept queue filled: the kernel then drops every
    // further SYN to it, as a host that is down does.
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hole_addr = hole.local_addr().unwrap();
    let mut queued = Vec::new();
    loop {
        match std::net::TcpStream::connect_timeout(&hole_addr, Duration::from_millis(200)) {
            Ok(s) => queued.push(s),
            Err(_) => break,
        }
        assert!(queued.len() < 5000, "the accept queue never filled");
    }
    let env = start(
        &[(
            "r",
            route_for(
                &[hole_addr, alive.addr()],
                "health_check_interval = 1\nconnect_timeout_ms = 200\nhealth_ban_ttl = 60\n",
            ),
        )],
        "",
    );
    let status = || request(env.public(), &get("/r/_health_status")).json();
    eventually(
        Duration::from_secs(6),
        "the unreachable peer banned",
        || status()[hole_addr.to_string()]["banned"] == true,
    );
    let hs = status();
    assert_eq!(
        hs[hole_addr.to_string()]["last_probe"]["result"],
        "connect_failed",
        "{hs}"
    );
    assert_eq!(hs[alive.addr().to_string()]["banned"], false, "{hs}");
    assert!(hs[alive.addr().to_string()]["probes"].as_u64().unwrap() > 0);
    // No request has been sent: the ban is the probe's.
    assert_eq!(alive.stats().completions, 0);
    drop(queued);
}

#[test]
fn sub_pools_by_model_and_bare_v1() {
    let a = mock("a");
    let b = mock("b");
    let route = format!(
        "[peers_by_model]\n\"llama\" = [ {{ host = \"127.0.0.1\", port = {} , name = \"a\" }} ]\n\"qwen\" = [ {{ host = \"127.0.0.1\", port = {}, name = \"b\" }} ]\n",
        a.addr().port(),
        b.addr().port()
    );
    let flat = route_for(&[a.addr()], "models = [\"solo\"]\n");
    let env = start(&[("bm", route), ("flat", flat)], "");
    let r = chat(
        &env,
        "/bm/v1/chat/completions",
        json!({"model": "qwen", "messages": []}),
        "",
    );
    assert_eq!((r.status, r.header("x-routed-peer")), (200, Some("b")));
    let r = chat(
        &env,
        "/bm/v1/chat/completions",
        json!({"model": "gpt", "messages": []}),
        "",
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "model_not_supported");
    assert_eq!(
        r.json()["error"]["supported_models"],
        json!(["llama", "qwen"])
    );
    let r = request(env.public(), &get("/bm/v1/models"));
    assert_eq!(
        r.json(),
        json!({"object": "list", "data": [{"id": "llama", "object": "model"}, {"id": "qwen", "object": "model"}]})
    );
    assert_eq!(
        a.stats().http_requests + b.stats().http_requests - a.stats().requests - b.stats().requests,
        probes_only(&a, &b),
        "the model list was answered locally"
    );
    // Bare /v1: the model picks the route.
    let r = chat(
        &env,
        "/v1/chat/completions",
        json!({"model": "llama", "messages": []}),
        "",
    );
    assert_eq!((r.status, r.header("x-routed-peer")), (200, Some("a")));
    let r = chat(
        &env,
        "/v1/chat/completions",
        json!({"model": "solo", "messages": []}),
        "",
    );
    assert_eq!((r.status, r.header("x-routed-peer")), (200, Some("p0")));
    let r = chat(
        &env,
        "/v1/chat/completions",
        json!({"model": "nope", "messages": []}),
        "",
    );
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json()["error"]["supported_models"],
        json!(["llama", "qwen", "solo"])
    );
    let ids: Vec<String> = request(env.public(), &get("/v1/models")).json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["llama", "qwen", "solo"]);
}

/// Requests without a route prefix see only the models of the routes their key opens
/// (SPEC §3.4: the key comes first), and a 401 names the scheme it takes.
#[test]
fn bare_model_lists_show_only_the_routes_a_key_opens() {
    let m = mock("m0");
    let open = route_for(&[m.addr()], "models = [\"solo\"]\n");
    let private = route_for(
        &[m.addr()],
        "models = [\"secret\"]\napi_keys = { \"sk-p\" = \"pat\" }\n",
    );
    let env = start(&[("open", open), ("priv", private.clone())], "");
    let ids = |extra: &str| -> Vec<String> {
        let r = request(
            env.public(),
            format!("GET /v1/models HTTP/1.1\r\nHost: t\r\n{extra}\r\n").as_bytes(),
        );
        assert_eq!(r.status, 200);
        r.json()["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        ids(""),
        ["solo"],
        "a private route's model was listed to no key"
    );
    // Control: the route's key shows its model.
    assert_eq!(ids("Authorization: Bearer sk-p\r\n"), ["secret", "solo"]);
    // The same for the supported list of a bare request with an unknown model.
    let r = chat(
        &env,
        "/v1/chat/completions",
        json!({"model": "nope", "messages": []}),
        "",
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["supported_models"], json!(["solo"]));
    let r = chat(
        &env,
        "/v1/chat/completions",
        json!({"model": "nope", "messages": []}),
        "x-api-key: sk-p\r\n",
    );
    assert_eq!(
        r.json()["error"]["supported_models"],
        json!(["secret", "solo"])
    );
    // A 401 says which scheme it takes.
    let r = chat(
        &env,
        "/priv/v1/chat/completions",
        json!({"model": "secret", "messages": []}),
        "",
    );
    assert_eq!(
        (r.status, r.header("www-authenticate")),
        (401, Some("Bearer"))
    );

    // When every model's route needs a key, a request without one gets 401, not a list.
    let env = start(&[("priv", private)], "");
    let r = request(env.public(), &get("/v1/models"));
    assert_eq!(
        (r.status, r.header("www-authenticate")),
        (401, Some("Bearer"))
    );
    let r = chat(
        &env,
        "/v1/chat/completions",
        json!({"model": "nope", "messages": []}),
        "",
    );
    assert_eq!(r.status, 401);
    let r = request(
        env.public(),
        b"GET /v1/models HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer sk-p\r\n\r\n",
    );
    assert_eq!(r.status, 200);
}

fn probes_only(a: &warmroute_mock::MockServer, b: &warmroute_mock::MockServer) -> u64 {
    // Everything the mocks saw that was not a completion: health probes only.
    a.stats().http_requests + b.stats().http_requests - a.stats().requests - b.stats().requests
}

#[test]
fn debug_endpoints_explain_and_dry_run_routing() {
    let (mocks, addrs) = three();
    let env = start(&[("r", route_for(&addrs, ""))], "");
    let d = request(env.public(), &get("/r/_route_debug?sid=conv-7")).json();
    let want = expected_peer("conv-7", 3);
    assert_eq!(d["natural_target"], want.as_str());
    assert_eq!(d["actual_pick"], want.as_str());
    assert_eq!(d["actual_mode"], "hash");
    // A blank id is no id (SPEC §3.3), here as for a request: least connections.
    for blank in ["", "%20%09"] {
        let d = request(env.public(), &get(&format!("/r/_route_debug?sid={blank}"))).json();
        assert_eq!(
            (&d["actual_mode"], &d["natural_target"], &d["crc32"]),
            (&json!("least_conn"), &json!(null), &json!(null)),
            "{blank:?}: {d}"
        );
    }
    let body =
        json!({"model": "m", "metadata": {"session_id": "conv-7"}, "messages": []}).to_string();
    let i = request(env.public(), &post_json("/r/_route_inspect", &body, "")).json();
    assert_eq!(
        (i["pick"].as_str(), i["source"].as_str(), i["mode"].as_str()),
        (
            Some(want.as_str()),
            Some("body:metadata.session_id"),
            Some("hash")
        )
    );
    assert_eq!(
        mocks.iter().map(|m| m.stats().requests).sum::<u64>(),
        0,
        "inspect forwards nothing"
    );
    let s = request(env.public(), &get("/r/_route_state")).json();
    assert_eq!(
        (
            s["active_level"].as_i64(),
            s["limit"].as_u64(),
            s["healthy_peers_in_level"].as_u64()
        ),
        (Some(0), Some(60), Some(3))
    );
    let admin = request(env.admin(), &get("/_routes")).json();
    assert_eq!(admin["routes"][0]["name"], "r");
    // _active_conns_set writes only from loopback and changes what the gate sees.
    let r = request(env.public(), &get("/r/_active_conns_set?peer=p0&value=5"));
    assert_eq!(r.json()["ok"], true);
    let conns = request(env.public(), &get("/r/_active_conns")).json();
    let by_addr = conns.as_object().unwrap();
    assert_eq!(
        by_addr
            .values()
            .filter_map(|v| v.as_i64())
            .collect::<Vec<_>>()
            .iter()
            .sum::<i64>(),
        5,
        "{conns}"
    );
    assert!(
        by_addr
            .keys()
            .all(|k| k.parse::<std::net::SocketAddr>().is_ok()),
        "{conns}"
    );
    request(env.public(), &get("/r/_active_conns_set?flush=1"));
    assert_eq!(inflight_total(&env, "r"), 0);
    if let Some(mut c) = socket2_free_connect_from("127.0.0.2", env.public()) {
        c.write_all(&get("/r/_active_conns_set?flush=1")).unwrap();
        assert_eq!(
            read_response(&mut BufReader::new(c), false).unwrap().status,
            403
        );
    }
}

/// A sticky-table session whose peer died is placed where its retry was served: its next
/// turn goes to that peer's cache as a placed session (mode `hash`). It used to keep
/// pointing at the dead peer, so each later turn was placed anew by load.
#[test]
fn a_sticky_session_moved_by_a_retry_stays_where_it_was_served() {
    let mut mocks: Vec<_> = (0..2).map(|i| mock(&format!("m{i}"))).collect();
    let addrs: Vec<SocketAddr> = mocks.iter().map(|m| m.addr()).collect();
    let env = start(
        &[(
            "table",
            route_for(
                &addrs,
                "affinity_hash = \"sticky_table\"\nhealth_check_interval = 3600\n",
            ),
        )],
        "",
    );
    let send = |id: &str| {
        let r = chat(
            &env,
            "/table/v1/chat/completions",
            json!({"messages": []}),
            &format!("x-session-id: {id}\r\n"),
        );
        assert_eq!(r.status, 200);
        (
            r.header("x-routed-peer").unwrap().to_string(),
            r.header("x-routed-retries").unwrap().to_string(),
            r.header("x-routed-mode").unwrap().to_string(),
        )
    };
    let (first, _, mode) = send("s");
    assert_eq!(mode, "least_conn");
    assert_eq!(
        send("s").2,
        "hash",
        "the control: a placed session's next turn"
    );
    let dead: usize = first[1..].parse().unwrap();
    mocks.remove(dead).shutdown();
    let (moved, retries, _) = send("s");
    assert_eq!(retries, "1");
    assert_ne!(moved, first);
    assert_eq!(
        send("s"),
        (moved.clone(), "0".to_string(), "hash".to_string())
    );
    let dbg = request(env.public(), &get("/table/_route_debug?sid=s")).json();
    assert_eq!(dbg["natural_target"], json!(moved));
}

#[test]
fn sticky_table_places_new_sessions_by_load_and_keeps_them_there() {
    // Two sessions that crc32 puts on the same one of two peers.
    let same: Vec<String> = (0..)
        .map(|i| format!("conv-{i}"))
        .filter(|id| crc32fast::hash(id.as_bytes()).is_multiple_of(2))
        .take(2)
        .collect();
    let (a, b) = (same[0].as_str(), same[1].as_str());
    // Every reply waits a moment, so a request can be held in flight while another arrives.
    let mocks: Vec<_> = (0..2)
        .map(|i| mock_with(&format!("m{i}"), |c| c.hang_ms = 400))
        .collect();
    let addrs: Vec<SocketAddr> = mocks.iter().map(|m| m.addr()).collect();
    let env = start(
        &[
            ("hashed", route_for(&addrs, "")),
            (
                "table",
                route_for(&addrs, "affinity_hash = \"sticky_table\"\n"),
            ),
        ],
        "",
    );
    let send = |route: &str, id: &str| {
        let r = chat(
            &env,
            &format!("/{route}/v1/chat/completions"),
            json!({"messages": []}),
            &format!("x-session-id: {id}\r\n"),
        );
        assert_eq!(r.status, 200);
        (
            r.header("x-routed-peer").unwrap().to_string(),
            r.header("x-routed-mode").unwrap().to_string(),
        )
    };
    // `first` in flight, then `second` arrives: the peers each lands on.
    let overlapped = |route: &str, first: &str, second: &str| {
        std::thread::scope(|s| {
            let held = s.spawn(|| send(route, first));
            eventually(Duration::from_secs(5), "first request in flight", || {
                inflight_total(&env, route) == 1
            });
            let later = send(route, second);
            (held.join().unwrap(), later)
        })
    };

    // Control: hashing puts both on one peer, load or not.
    let ((pa, ma), (pb, mb)) = overlapped("hashed", a, b);
    assert_eq!((ma.as_str(), mb.as_str()), ("hash", "hash"));
    assert_eq!(pa, pb, "crc32 pins {a} and {b} together");

    // The table: the second new session goes to the idle peer.
    let ((pa, ma), (pb, mb)) = overlapped("table", a, b);
    assert_eq!((ma.as_str(), mb.as_str()), ("least_conn", "least_conn"));
    assert_ne!(pa, pb, "placed by load, not by hash");

    // Placed sessions stay put: a second turn of `a` while `a` is busy goes to `a`'s peer,
    // not to the idler one (over fresh connections, whichever worker takes them).
    let ((pa2, ma2), (pa3, ma3)) = overlapped("table", a, a);
    assert_eq!((pa2.as_str(), ma2.as_str()), (pa.as_str(), "hash"));
    assert_eq!((pa3.as_str(), ma3.as_str()), (pa.as_str(), "hash"));
    assert_eq!(send("table", b), (pb.clone(), "hash".to_string()));

    // The debug endpoint shows the placement without making one.
    let dbg = request(env.public(), &get(&format!("/table/_route_debug?sid={b}"))).json();
    assert_eq!(dbg["algorithm"], "sticky_table");
    assert_eq!(dbg["natural_target"], json!(pb));
    let fresh = request(env.public(), &get("/table/_route_debug?sid=never-seen")).json();
    assert_eq!(fresh["natural_target"], serde_json::Value::Null);
    assert_eq!(fresh["actual_mode"], "least_conn");
    let again = request(env.public(), &get("/table/_route_debug?sid=never-seen")).json();
    assert_eq!(
        again["natural_target"],
        serde_json::Value::Null,
        "debug placed nothing"
    );
}

/// `_active_conns` and `_health_status` key peers by address, as the reference does, and
/// agree with each other: an address several model pools share is one entry with their
/// in-flight summed, and two pools' peers that share a name but not an address stay two
/// entries. `_active_conns` summed by name, mixing two addresses, and `_health_status` kept
/// only the last pool's entry of a shared address.
#[test]
fn the_peer_endpoints_key_by_address_and_agree_on_shared_addresses() {
    let (a, b) = (mock("a"), mock("b"));
    let (pa, pb) = (a.addr().port(), b.addr().port());
    let route = format!(
        "[peers_by_model]\n\
         \"m1\" = [ {{ host = \"127.0.0.1\", port = {pa}, name = \"x\" }} ]\n\
         \"m2\" = [ {{ host = \"127.0.0.1\", port = {pb}, name = \"x\" }} ]\n\
         \"m3\" = [ {{ host = \"127.0.0.1\", port = {pa} }} ]\n"
    );
    let env = start(&[("r", route)], "");
    let (ka, kb) = (a.addr().to_string(), b.addr().to_string());
    for (peer, v) in [(&kb, 5), (&ka, 3)] {
        let r = request(
            env.public(),
            &get(&format!("/r/_active_conns_set?peer={peer}&value={v}")),
        );
        assert_eq!(r.json()["ok"], true);
    }
    // m1 and m3 both hold 3 at address a: 6 there; 5 at b.
    let conns = request(env.public(), &get("/r/_active_conns")).json();
    assert_eq!(conns, serde_json::json!({ka.clone(): 6, kb.clone(): 5}));
    let health = request(env.public(), &get("/r/_health_status")).json();
    assert_eq!(
        (&health[&ka]["active"], &health[&kb]["active"]),
        (&serde_json::json!(6), &serde_json::json!(5)),
        "{health}"
    );
    request(env.public(), &get("/r/_active_conns_set?flush=1"));
    assert_eq!(inflight_total(&env, "r"), 0);
}
