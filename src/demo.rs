//! `warmroute demo`: three in-process mock engines and the router on an embedded route,
//! with ready-to-paste curl lines. Needs no files.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use warmroute_mock::{MockConfig, MockServer};

use crate::server::{ConfigSource, Overrides, Router, StartError};

/// The route the demo serves, with the mocks' ports filled in.
pub fn demo_route(ports: &[u16]) -> String {
    let mut s = String::from("# Embedded demo route: three local mock engines.\npeers = [\n");
    for (i, p) in ports.iter().enumerate() {
        s.push_str(&format!(
            "  {{ host = \"127.0.0.1\", port = {p}, name = \"mock-{}\", max_concurrency = 32 }},\n",
            (b'a' + i as u8) as char
        ));
    }
    s.push_str("]\nhealth_check_interval = 5\n");
    s
}

/// The demo's shared segment for the public port `port`: its own name, so that a demo
/// never opens the segment of a router serving on the same port.
pub fn shm_path(port: u16) -> PathBuf {
    PathBuf::from(format!("/dev/shm/warmroute-demo-{port}"))
}

pub struct Demo {
    pub mocks: Vec<MockServer>,
    pub router: Router,
}

pub fn start(
    listen: SocketAddr,
    admin: SocketAddr,
    overrides: Overrides,
) -> Result<Demo, StartError> {
    let mut mocks = Vec::new();
    for name in ["mock-a", "mock-b", "mock-c"] {
        let cfg = MockConfig {
            name: name.to_string(),
            decode_tps: 20.0,
            ttft_base_ms: 50,
            ..MockConfig::default()
        };
        mocks.push(
            MockServer::start("127.0.0.1:0".parse().expect("literal address"), cfg)
                .map_err(StartError::Io)?,
        );
    }
    let ports: Vec<u16> = mocks.iter().map(|m| m.addr().port()).collect();
    let server = format!(
        "listen = \"{listen}\"\nadmin_listen = \"{admin}\"\nshm_path = \"{}\"\napi_keys_file = \"\"\n",
        shm_path(listen.port()).display()
    );
    let source = ConfigSource::Embedded {
        server: Some(server),
        routes: vec![("demo".to_string(), demo_route(&ports))],
    };
    let router = Router::start(source, overrides)?;
    Ok(Demo { mocks, router })
}

/// The curl lines printed by the demo, and the `status` command that reads its segment
/// (`exe`: this program, as it can be run again).
pub fn curl_lines(public: SocketAddr, admin: SocketAddr, exe: &str, shm: &Path) -> String {
    let base = format!("http://{public}");
    let shm = shm.display();
    format!(
        r#"warmroute demo is up: route "demo" → mock-a, mock-b, mock-c (in-process mock engines)

# stream a chat completion through the router (tokens arrive one by one):
curl -N {base}/demo/v1/chat/completions -H 'Content-Type: application/json' -H 'X-Session-Id: conv-1' \
  -d '{{"model":"mock-model","stream":true,"stream_options":{{"include_usage":true}},"max_tokens":20,"messages":[{{"role":"user","content":"hello there, how are you"}}]}}'

# the same without streaming; response headers show the peer and routing mode:
curl -si {base}/demo/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{{"model":"mock-model","max_tokens":5,"messages":[{{"role":"user","content":"hi"}}]}}'

# models, in-flight per peer, health:
curl -s {base}/demo/v1/models
curl -s {base}/demo/_active_conns
curl -s http://{admin}/healthz; echo
curl -s http://{admin}/_routes

# workers, peers, in-flight counts and bans, read from the shared segment:
{exe} status --shm {shm}

Ctrl-C stops the demo (and removes its segment).
"#
    )
}
