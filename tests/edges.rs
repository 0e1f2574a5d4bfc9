//! The edges, end to end: reject rules, request transforms (cch strip, include_usage
//! injected and its frame removed again), response post-processing, cache accounting.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

const RULES: &str = r#"
reject_rules_enabled = true
reject_rules_status = 422

[[reject_rules]]
name = "too-big"
field = "input_bytes"
op = "gt"
value = 2000
status = 413
message = "prompt too large for this tier"

[[reject_rules]]
name = "too-many-turns"
field = "messages_count"
op = "gt"
value = 3

[[reject_rules]]
name = "nested"
any = [
  { field = "model", op = "eq", value = "banned-model" },
  { all = [ { field = "stream", op = "eq", value = true }, { field = "max_tokens", op = "gt", value = 1000 } ] },
]

[[reject_rules]]
name = "tenant"
field = "metadata.tenant"
op = "eq"
value = "blocked-co"
status = 403

[[reject_rules]]
name = "secrets"
field = "messages"
op = "exists"

[[reject_rules]]
name = "broken"
field = "model"
op = "match"
value = "(unclosed"
"#;

fn chat(env: &Env, route: &str, body: serde_json::Value) -> Resp {
    request(
        env.public(),
        &post_json(
            &format!("/{route}/v1/chat/completions"),
            &body.to_string(),
            "",
        ),
    )
}

#[test]
fn reject_rules_reject_with_their_status_and_count_hits() {
    let m = mock("m0");
    // The last-but-one rule would match everything: replace it with a regex rule.
    let rules = RULES.replace(
        "field = \"messages\"\nop = \"exists\"",
        "field = \"model\"\nop = \"match\"\nvalue = \"^evil-\\\\d+$\"",
    );
    let env = start(&[("r", route_for(&[m.addr()], &rules))], "");
    let msg = |n: usize| {
        (0..n)
            .map(|i| json!({"role": "user", "content": format!("m{i}")}))
            .collect::<Vec<_>>()
    };
    let cases = [
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(3000)}]}),
            413,
            "too-big",
        ),
        (
            json!({"model": "m", "messages": msg(4)}),
            422,
            "too-many-turns",
        ),
        (
            json!({"model": "banned-model", "messages": msg(1)}),
            422,
            "nested",
        ),
        (
            json!({"model": "m", "stream": true, "max_tokens": 5000, "messages": msg(1)}),
            422,
            "nested",
        ),
        (
            json!({"model": "m", "metadata": {"tenant": "blocked-co"}, "messages": msg(1)}),
            403,
            "tenant",
        ),
        (
            json!({"model": "evil-42", "messages": msg(1)}),
            422,
            "secrets",
        ),
    ];
    for (body, status, rule) in &cases {
        let r = chat(&env, "r", body.clone());
        assert_eq!(r.status, *status, "{rule}");
        let e = &r.json()["error"];
        assert_eq!(
            (e["type"].as_str(), e["rule"].as_str(), e["route"].as_str()),
            (Some("rejected_by_rule"), Some(*rule), Some("r"))
        );
    }
    assert_eq!(
        chat(&env, "r", json!({"model": "m", "messages": msg(1)})).json()["error"]["message"],
        serde_json::Value::Null
    );
    // Non-matching requests pass; the invalid rule was dropped while the route serves.
    for body in [
        json!({"model": "m", "messages": msg(2)}),
        json!({"model": "m", "stream": true, "max_tokens": 10, "messages": msg(1)}),
        json!({"model": "evil-x", "messages": msg(1)}),
    ] {
        assert_eq!(chat(&env, "r", body).status, 200);
    }
    let st = request(env.public(), &get("/r/_reject_rules_status")).json();
    let names: Vec<&str> = st["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["too-big", "too-many-turns", "nested", "tenant", "secrets"],
        "the broken rule is dropped"
    );
    let hits: Vec<u64> = st["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["hits"].as_u64().unwrap())
        .collect();
    assert_eq!(hits, [1, 1, 2, 1, 1]);
    assert_eq!(
        request(env.public(), &get("/r/_429_status")).json()["by_reason"]["rule"],
        6
    );
    // The runtime toggle turns them off (and on=default brings the route's setting back).
    assert_eq!(
        request(env.public(), &get("/r/_reject_rules_toggle?on=0")).json()["enabled"],
        false
    );
    assert_eq!(chat(&env, "r", cases[1].0.clone()).status, 200);
    let back = request(env.public(), &get("/r/_reject_rules_toggle?on=default")).json();
    assert_eq!(
        (&back["enabled"], &back["changes"]),
        (&json!(true), &json!({"enabled": "default"}))
    );
    assert_eq!(chat(&env, "r", cases[1].0.clone()).status, 422);
    // reset=1 zeroes the rules' hits (the reference's meaning) and leaves them on.
    let hits = |env: &Env| -> Vec<u64> {
        request(env.public(), &get("/r/_reject_rules_status")).json()["rules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["hits"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(hits(&env), [1, 2, 2, 1, 1]);
    let reset = request(env.public(), &get("/r/_reject_rules_toggle?reset=1")).json();
    assert_eq!(
        (&reset["enabled"], &reset["changes"]),
        (&json!(true), &json!({"counters_reset": true}))
    );
    assert_eq!(hits(&env), [0, 0, 0, 0, 0]);
    assert_eq!(chat(&env, "r", cases[1].0.clone()).status, 422);
    assert_eq!(hits(&env), [0, 1, 0, 0, 0]);
    // The status line carries the registered reason of a rule's own status (it read
    // "Unknown" for any code outside the router's built-in answers).
    for (body, line) in [
        (&cases[1].0, "HTTP/1.1 422 Unprocessable Content"),
        (&cases[4].0, "HTTP/1.1 403 Forbidden"),
    ] {
        use std::io::{BufRead, Write};
        let mut s = connect(env.public());
        s.write_all(&post_json("/r/v1/chat/completions", &body.to_string(), ""))
            .unwrap();
        let mut first = String::new();
        std::io::BufReader::new(s).read_line(&mut first).unwrap();
        assert_eq!(first.trim_end(), line);
    }
}

/// A body that is JSON to the engine but that serde_json refuses (a number too large for
/// an f64, a lone surrogate escape, nesting deeper than 128, Python's NaN and infinities,
/// a byte-order mark) is still evaluated: one such extra field
/// used to let a request past every rule. The control: each body without the matching
/// field passes.
#[test]
fn rules_see_json_that_serde_json_refuses() {
    // A backend that answers 200 whatever the body (the mock refuses what serde refuses).
    let b = raw_backend(
        vec![b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec()],
        usize::MAX,
    );
    // Without the rule that matches everything (as above).
    let rules = RULES.replace(
        "field = \"messages\"\nop = \"exists\"",
        "field = \"model\"\nop = \"match\"\nvalue = \"^evil-\\\\d+$\"",
    );
    let env = start(&[("r", route_for(&[b.addr], &rules))], "");
    let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    for pad in [
        "1e999",
        r#""cut \ud83d""#,
        deep.as_str(),
        "NaN",
        "-Infinity",
    ] {
        for (model, status) in [("banned-model", 422), ("m", 200)] {
            let body = format!(
                r#"{{"model":"{model}","messages":[{{"role":"user","content":"x"}}],"pad":{pad}}}"#
            );
            let r = request(
                env.public(),
                &post_json("/r/v1/chat/completions", &body, ""),
            );
            assert_eq!(
                r.status,
                status,
                "{model} with {}",
                &pad[..pad.len().min(20)]
            );
            if status == 422 {
                assert_eq!(r.json()["error"]["rule"], "nested");
            }
        }
    }
    let bom = format!(
        "\u{feff}{}",
        r#"{"model":"banned-model","messages":[{"role":"user","content":"x"}]}"#
    );
    let r = request(env.public(), &post_json("/r/v1/chat/completions", &bom, ""));
    assert_eq!(r.status, 422, "a byte-order mark in front");
    // A body too large is refused by `input_bytes` whatever else it holds.
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}],"pad":"\udc00"}}"#,
        "x".repeat(3000)
    );
    let r = request(env.public(), &post_json("/r/v1/chat/completions", &big, ""));
    assert_eq!(
        (r.status, r.json()["error"]["rule"].as_str()),
        (413, Some("too-big"))
    );
}

#[test]
fn rules_are_off_until_enabled() {
    let m = mock("m0");
    let rules = RULES.replace("reject_rules_enabled = true\n", "");
    let env = start(&[("r", route_for(&[m.addr()], &rules))], "");
    let body = json!({"model": "banned-model", "messages": []});
    assert_eq!(chat(&env, "r", body.clone()).status, 200);
    request(env.public(), &get("/r/_reject_rules_toggle?on=1"));
    assert_eq!(
        chat(&env, "r", body).status,
        422,
        "control: the same request is rejected once enabled"
    );
}

fn echo(env: &Env, route: &str, body: &str) -> Vec<u8> {
    let raw = post_json(
        &format!("/{route}/v1/chat/completions"),
        body,
        "x-mock-echo: 1\r\n",
    );
    request(env.public(), &raw).body
}

#[test]
fn cch_prefix_is_stripped_byte_preservingly_and_toggles_off() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let body = r#"{"model":"claude", "messages":[{"role":"user","content":"x-anthropic-billing-header: cc_version=1.0.3; cc_entrypoint=cli; cch=ab12cd; Hello there"}],  "max_tokens" :  7}"#;
    let got = echo(&env, "r", body);
    // The prefix goes up to and including the `;` after `cch=…`; what follows is kept.
    assert_eq!(
        String::from_utf8(got).unwrap(),
        body.replace(
            "x-anthropic-billing-header: cc_version=1.0.3; cc_entrypoint=cli; cch=ab12cd;",
            ""
        )
    );
    let st = request(env.public(), &get("/r/_route_state")).json();
    assert_eq!(st["transforms"]["cch_stripped"], 1);
    // The toggle answers with the counters and what it changed (notes-edges §4.3).
    let off = request(env.public(), &get("/r/_cch_strip_toggle?on=0")).json();
    assert_eq!(
        (&off["enabled"], &off["changes"], &off["stripped_total"]),
        (&json!(false), &json!({"enabled": false}), &json!(1))
    );
    assert_eq!(
        echo(&env, "r", body),
        body.as_bytes(),
        "control: off → forwarded byte-identical"
    );
    // reset=1 zeroes the counters and leaves the switch as it is.
    let reset = request(env.public(), &get("/r/_cch_strip_toggle?reset=1")).json();
    assert_eq!(
        (&reset["enabled"], &reset["changes"]),
        (&json!(false), &json!({"counters_reset": true}))
    );
    assert_eq!(
        (&reset["parsed_total"], &reset["stripped_total"]),
        (&json!(0), &json!(0))
    );
    let st = request(env.public(), &get("/r/_route_state")).json();
    assert_eq!(st["transforms"]["cch_stripped"], 0);
    // on=default: back to the route's setting (on), and the prefix goes again.
    let back = request(env.public(), &get("/r/_cch_strip_toggle?on=default")).json();
    assert_eq!(
        (&back["enabled"], &back["source"]),
        (&json!(true), &json!("route"))
    );
    assert_ne!(echo(&env, "r", body), body.as_bytes());
    let st = request(env.public(), &get("/r/_route_state")).json();
    assert_eq!(st["transforms"]["cch_stripped"], 1);
}

#[test]
fn injected_usage_is_recorded_but_removed_from_the_client_stream() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let ask = |body: serde_json::Value| {
        let r = request(
            env.public(),
            &post_json("/r/v1/chat/completions", &body.to_string(), ""),
        );
        assert_eq!(r.status, 200);
        r.text()
    };
    let plain = ask(
        json!({"model": "m", "stream": true, "max_tokens": 3, "messages": [{"role": "user", "content": "a b c d e f"}]}),
    );
    assert!(plain.contains("[DONE]") && plain.contains("tok2"));
    assert!(
        !plain.contains("\"usage\""),
        "the client did not ask for usage and gets none:\n{plain}"
    );
    // The tokens are recorded when the relay ends, which can be a moment after the client
    // has read the last byte, one counter after the other (prompt, cached, completion):
    // wait for the last one.
    let mut st = serde_json::Value::Null;
    eventually(
        Duration::from_secs(5),
        "the router records the tokens",
        || {
            st = request(env.public(), &get("/r/_route_state")).json();
            st["cache"]["prompt_tokens"] != 0 && st["cache"]["completion_tokens"] != 0
        },
    );
    assert_eq!(st["transforms"]["usage_injected"], 1);
    assert_eq!(
        st["cache"]["prompt_tokens"], 6,
        "the router still recorded the tokens"
    );
    assert_eq!(st["cache"]["completion_tokens"], 3);
    // A client that asked for usage gets it unchanged.
    let with = ask(
        json!({"model": "m", "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 3, "messages": [{"role": "user", "content": "a b c d e f"}]}),
    );
    assert!(with.contains("\"usage\""));
    assert_eq!(
        request(env.public(), &get("/r/_route_state")).json()["transforms"]["usage_injected"],
        1
    );
    // Its tokens are recorded too: read from the stream's tail, as no filter ran.
    eventually(
        Duration::from_secs(5),
        "the router records the second stream's tokens",
        || {
            st = request(env.public(), &get("/r/_route_state")).json();
            st["cache"]["prompt_tokens"] == 12
        },
    );
    assert_eq!(st["cache"]["completion_tokens"], 6);
}

#[test]
fn multi_turn_conversation_shows_cache_hits() {
    let m = mock_with("m0", |c| c.block_tokens = 4);
    let env = start(&[("r", route_for(&[m.addr()], ""))], "");
    let mut history = String::new();
    for turn in 0..4 {
        history.push_str(&format!(
            " turn {turn} has a few more words to grow the shared prefix"
        ));
        let body = json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": history}]});
        let r = request(
            env.public(),
            &post_json(
                "/r/v1/chat/completions",
                &body.to_string(),
                "x-session-id: conv-a\r\n",
            ),
        );
        assert_eq!(r.status, 200);
    }
    // The router counts a response's usage after its last byte went to the client, so the
    // state read right after may be a response behind: wait for all four.
    let mut st = serde_json::Value::Null;
    eventually(
        Duration::from_secs(5),
        "usage of 4 responses counted",
        || {
            st = request(env.public(), &get("/r/_route_state")).json();
            st["cache"]["responses_with_usage"] == 4
        },
    );
    let c = &st["cache"];
    assert!(c["cached_tokens"].as_u64().unwrap() > 0, "{c}");
    assert!(c["hit_rate"].as_f64().unwrap() > 0.3, "{c}");
    assert_eq!(c["responses_with_usage"], 4);
    assert_eq!(
        c["prompt_tokens"],
        m.stats().prompt_tokens,
        "the router's count matches the engine's"
    );
    assert_eq!(c["cached_tokens"], m.stats().cached_tokens);
}

const VLLM_JSON: &str = r#"{"id":"c1","object":"chat.completion","model":"m","service_tier":null,"system_fingerprint":null,"prompt_logprobs":null,"kv_transfer_params":null,"choices":[{"index":0,"message":{"role":"assistant","content":"hi","reasoning":"because","refusal":null,"tool_calls":[]},"logprobs":null,"finish_reason":"stop","stop_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":0,"created_cache_tokens":3}}}"#;

#[test]
fn vllm_format_renames_and_prunes_json_and_sse() {
    let json_resp = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{VLLM_JSON}", VLLM_JSON.len());
    let untouched = r#"data: {"id":"c1","choices":[{"index":0,"delta":{"content":"x"}}]}"#;
    let sse_body = format!(
        "data: {{\"id\":\"c1\",\"choices\":[{{\"index\":0,\"delta\":{{\"reasoning\":\"r\"}},\"stop_reason\":null}}],\"service_tier\":null}}\n\n{untouched}\n\ndata: {{broken json\n\ndata: [DONE]\n\n"
    );
    let sse_resp = format!("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {}\r\n\r\n{sse_body}", sse_body.len());
    let b = raw_backend(
        vec![json_resp.into_bytes(), sse_resp.into_bytes()],
        usize::MAX,
    );
    let env = start(
        &[
            ("r", route_for(&[b.addr], "postprocess = \"vllm_format\"\n")),
            ("raw", route_for(&[b.addr], "")),
        ],
        "",
    );
    let r = request(env.public(), &post_json("/r/v1/chat/completions", "{}", ""));
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    let v = r.json();
    let ch = &v["choices"][0];
    assert!(
        v.get("service_tier").is_none()
            && v.get("system_fingerprint").is_none()
            && v.get("kv_transfer_params").is_none()
    );
    assert!(ch.get("stop_reason").is_none() && ch.get("logprobs").is_none());
    assert_eq!(ch["message"]["reasoning_content"], "because");
    assert!(ch["message"].get("reasoning").is_none() && ch["message"].get("refusal").is_none());
    assert_eq!(v["usage"]["prompt_tokens_details"]["cache_write_tokens"], 3);
    let s = request(env.public(), &post_json("/r/v1/chat/completions", "{}", "")).text();
    assert!(
        s.contains("\"reasoning_content\":\"r\"")
            && !s.contains("stop_reason")
            && !s.contains("service_tier"),
        "{s}"
    );
    assert!(
        s.contains(&format!("{untouched}\n\n")),
        "unchanged frames pass byte-identical"
    );
    assert!(
        s.contains("data: {broken json\n\n") && s.ends_with("data: [DONE]\n\n"),
        "malformed frames pass untouched"
    );
    // The control: a route without the handler relays the backend's bytes unchanged.
    let raw = request(
        env.public(),
        &post_json("/raw/v1/chat/completions", "{}", ""),
    );
    assert_eq!(raw.text(), VLLM_JSON);
}

/// The server's `[defaults] postprocess` applies to a route that sets none, and a route's
/// own `postprocess = ""` turns it off (it used to fall back to the default again).
#[test]
fn a_routes_empty_postprocess_overrides_the_servers_default() {
    let json_resp = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{VLLM_JSON}", VLLM_JSON.len());
    let b = raw_backend(vec![json_resp.into_bytes()], usize::MAX);
    let env = start(
        &[
            ("inherits", route_for(&[b.addr], "")),
            ("off", route_for(&[b.addr], "postprocess = \"\"\n")),
        ],
        "[defaults]\npostprocess = \"vllm_format\"\n",
    );
    let body = |route: &str| {
        request(
            env.public(),
            &post_json(&format!("/{route}/v1/chat/completions"), "{}", ""),
        )
        .text()
    };
    // The control: the default is in force on the route that sets nothing.
    assert!(body("inherits").contains("reasoning_content"));
    assert_eq!(body("off"), VLLM_JSON);
    let opts = request(env.public(), &get("/off/_route_opts")).json();
    let pp = opts["options"]
        .as_array()
        .unwrap()
        .iter()
        .chain(opts["advanced"].as_array().unwrap())
        .find(|o| o["key"] == "postprocess")
        .cloned()
        .unwrap();
    assert_eq!(pp["value"], "", "{pp}");
}

#[test]
fn route_opts_lists_every_option_and_agrees_with_the_engine() {
    let m = mock("m0");
    let env = start(&[("r", route_for(&[m.addr()], "max_more_tries = 3\n"))], "");
    let v = request(env.public(), &get("/r/_route_opts")).json();
    let all: Vec<&serde_json::Value> = v["options"]
        .as_array()
        .unwrap()
        .iter()
        .chain(v["advanced"].as_array().unwrap())
        .collect();
    assert!(all.len() > 50, "every option of the catalog: {}", all.len());
    assert!(!v["advanced"].as_array().unwrap().is_empty());
    let find = |k: &str| {
        *all.iter()
            .find(|o| o["key"] == k)
            .unwrap_or_else(|| panic!("{k} missing"))
    };
    let mmt = find("max_more_tries");
    assert_eq!(
        (
            mmt["default"].as_i64(),
            mmt["value"].as_i64(),
            mmt["set_by_route"].as_bool()
        ),
        (Some(2), Some(3), Some(true))
    );
    for o in &all {
        for field in ["key", "label", "group", "kind", "description"] {
            assert!(!o[field].is_null(), "{} lacks {field}", o["key"]);
        }
        // What the engine runs with, for options the route did not set, is the documented default.
        if o["set_by_route"] == false && !o["default"].is_null() {
            assert_eq!(
                o["value"], o["default"],
                "{}: engine and catalog disagree",
                o["key"]
            );
        }
    }
    assert!(v["adaptive_cc_bounds"][0]["static_max"].as_u64().unwrap() >= 1);
}

/// `_route_opts` shows the band adaptive concurrency moves in as the controller computes
/// it, also when a lower tier is larger than the top one (it took the top tier's 20
/// where the controller takes 30). The control is `_tps_status`, the controller's view.
#[test]
fn route_opts_shows_the_adaptive_band_the_controller_uses() {
    let (a, b, c) = (mock("a"), mock("b"), mock("c"));
    let route = format!(
        "peers = [ {{ host = \"127.0.0.1\", port = {}, max_concurrency = 12 }}, \
         {{ host = \"127.0.0.1\", port = {}, max_concurrency = 8 }}, \
         {{ host = \"127.0.0.1\", port = {}, max_concurrency = 30, priority = -1 }} ]\n\
         adaptive_cc = true\nadaptive_cc_min = 3\nadaptive_cc_init_frac = 0.75\ntps_limit_tps = 10\n",
        a.addr().port(),
        b.addr().port(),
        c.addr().port()
    );
    let env = start(&[("r", route)], "");
    let band =
        request(env.public(), &get("/r/_route_opts")).json()["adaptive_cc_bounds"][0].clone();
    let engine = request(env.public(), &get("/r/_tps_status")).json()["pools"]["_"].clone();
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    assert_eq!(
        (f(&band["static_max"]), f(&band["floor"]), f(&band["start"])),
        (
            f(&engine["adaptive_cc_max"]),
            f(&engine["adaptive_cc_min"]),
            f(&engine["adaptive_cc_init"])
        ),
        "{band} {engine}"
    );
    assert_eq!(band["floor"], 3);
}
