//! The official Python SDKs talk to the router as they would to a backend: the `openai`
//! SDK streams through `/<route>/v1` and bare `/v1`; the `anthropic` SDK's
//! `metadata.user_id` pins its session on `/v1/messages`. `tests/run` installs both.

mod common;

use std::process::Command;

use common::*;

fn python(script: &str) -> serde_json::Value {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "python failed (are `openai` and `anthropic` installed? tests/run installs them):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn openai_sdk_streams_through_a_route_and_bare_v1() {
    let m = mock("m0");
    let env = start(
        &[("r", route_for(&[m.addr()], "models = [\"mock-model\"]\n"))],
        "",
    );
    for base in [
        format!("http://{}/r/v1", env.public()),
        format!("http://{}/v1", env.public()),
    ] {
        let v = python(&format!(
            r#"
import json
from openai import OpenAI
c = OpenAI(base_url="{base}", api_key="unused", max_retries=0)
parts = []
for ev in c.chat.completions.create(model="mock-model", stream=True, max_tokens=5,
        messages=[{{"role": "user", "content": "hello there"}}], extra_headers={{"x-session-id": "sdk-1"}}):
    if ev.choices and ev.choices[0].delta.content:
        parts.append(ev.choices[0].delta.content)
full = c.chat.completions.with_raw_response.create(model="mock-model", max_tokens=3,
        messages=[{{"role": "user", "content": "hi"}}], extra_headers={{"x-session-id": "sdk-1"}})
print(json.dumps({{"text": "".join(parts), "source": full.headers.get("x-routed-source"),
                   "content": full.parse().choices[0].message.content}}))
"#
        ));
        assert_eq!(v["text"], "tok0 tok1 tok2 tok3 tok4", "{base}");
        assert_eq!(v["source"], "header:x-session-id");
        assert_eq!(v["content"], "tok0 tok1 tok2");
    }
}

#[test]
fn anthropic_sdk_metadata_user_id_pins_the_session() {
    let mocks: Vec<_> = (0..3).map(|i| mock(&format!("m{i}"))).collect();
    let addrs: Vec<_> = mocks.iter().map(|m| m.addr()).collect();
    let env = start(&[("r", route_for(&addrs, ""))], "");
    let v = python(&format!(
        r#"
import json
from anthropic import Anthropic
c = Anthropic(base_url="http://{}/r", api_key="unused", max_retries=0)
seen = []
for uid in ["user_a_session_1", "user_b_session_2", "user_a_session_1"]:
    raw = c.messages.with_raw_response.create(model="mock-model", max_tokens=4,
        messages=[{{"role": "user", "content": "hi"}}], metadata={{"user_id": uid}})
    seen.append({{"uid": uid, "peer": raw.headers.get("x-routed-peer"), "source": raw.headers.get("x-routed-source"),
                 "mode": raw.headers.get("x-routed-mode"), "status": raw.status_code}})
print(json.dumps(seen))
"#,
        env.public()
    ));
    for s in v.as_array().unwrap() {
        let uid = s["uid"].as_str().unwrap();
        assert_eq!(s["status"], 200);
        assert_eq!(s["source"], "body:metadata.user_id");
        assert_eq!(s["mode"], "hash");
        assert_eq!(
            s["peer"],
            format!("p{}", crc32fast::hash(uid.as_bytes()) % 3).as_str(),
            "{uid}"
        );
    }
}
