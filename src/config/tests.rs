use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::json;

use super::catalog::{OptDefault, OptKind, ROUTE_OPTS};
use super::*;

fn no_env(_: &str) -> Option<String> {
    None
}

fn strs(server: Option<&str>, routes: &[(&str, &str)]) -> Result<Config, Vec<ConfigError>> {
    load_strs_with(server, routes, &no_env)
}

fn one(route: &str) -> Result<Config, Vec<ConfigError>> {
    strs(None, &[("r", route)])
}

fn errs(route: &str) -> Vec<ConfigError> {
    match one(route) {
        Ok(_) => panic!("expected errors for:\n{route}"),
        Err(e) => e,
    }
}

fn fields(errors: &[ConfigError]) -> Vec<&str> {
    errors.iter().map(|e| e.field.as_str()).collect()
}

const MIN_ROUTE: &str = r#"peers = [ { host = "127.0.0.1", port = 8000 } ]"#;

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "warmroute-config-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn write(&self, rel: &str, text: &str) -> PathBuf {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn defaults_with_no_files() {
    let dir = TempDir::new();
    let c = load_with(None, &dir.0, &no_env).unwrap();
    let s = &c.server;
    assert_eq!(s.listen.to_string(), "0.0.0.0:8080");
    assert_eq!(s.admin_listen.to_string(), "0.0.0.0:8090");
    assert_eq!(s.workers, 0);
    assert_eq!(s.routes_dir, dir.0.join("routes"));
    assert_eq!(s.shm_path, Path::new("/dev/shm/warmroute-8080"));
    assert_eq!(
        s.api_keys_file.as_deref(),
        Some(Path::new("/etc/warmroute/api-keys/keys"))
    );
    assert_eq!(s.max_body_size_ceiling, 200 << 20);
    assert_eq!(s.drain_timeout_s, 300);
    assert_eq!(s.client_idle_timeout_ms, 75_000);
    assert_eq!(s.client_head_timeout_ms, 30_000);
    assert_eq!(s.upstream_idle_timeout_ms, 4_000);
    assert_eq!(s.upstream_idle_per_peer, 1024);
    assert_eq!(s.busy_poll, BusyPoll::Auto);
    assert_eq!(s.defaults, ServerDefaults::default());
    assert_eq!(s.defaults.postprocess, "");
    assert!(
        s.defaults.load_rate_limit
            && s.defaults.adaptive_cc_hold_when_idle
            && s.defaults.session_affinity
    );
    assert_eq!(s.bodylog_listener, None);
    assert!(c.routes.is_empty() && c.server_file.is_none());
    assert!(c.soft_errors.is_empty() && c.warnings.is_empty());

    // The strings variant gives the same server.
    let c2 = strs(None, &[]).unwrap();
    assert_eq!(c2.server.listen, s.listen);
    assert_eq!(c2.server.shm_path, s.shm_path);
}

#[test]
fn busy_poll_us_is_read() {
    let c = strs(Some("busy_poll_us = 200"), &[]).unwrap();
    assert_eq!(c.server.busy_poll, BusyPoll::Window(200));
    let c = strs(Some("busy_poll_us = 0"), &[]).unwrap();
    assert_eq!(c.server.busy_poll, BusyPoll::Off);
    let c = strs(Some(r#"busy_poll_us = "auto""#), &[]).unwrap();
    assert_eq!(c.server.busy_poll, BusyPoll::Auto);
    for bad in [
        "busy_poll_us = -1",
        r#"busy_poll_us = "fast""#,
        "busy_poll_us = 2.5",
    ] {
        let e = strs(Some(bad), &[]).unwrap_err();
        assert_eq!(fields(&e), ["busy_poll_us"], "{bad}");
    }
}

#[test]
fn shm_path_follows_listen_port() {
    let c = strs(Some(r#"listen = "127.0.0.1:9999""#), &[]).unwrap();
    assert_eq!(c.server.shm_path, Path::new("/dev/shm/warmroute-9999"));
    let c = strs(
        Some("listen = \"127.0.0.1:9999\"\nshm_path = \"/tmp/x\""),
        &[],
    )
    .unwrap();
    assert_eq!(c.server.shm_path, Path::new("/tmp/x"));
}

#[test]
fn env_overrides() {
    let env = |k: &str| match k {
        "WARMROUTE_API_KEYS_FILE" => Some("/run/keys".to_string()),
        "BODYLOG_LISTENER_HOST" => Some("10.1.2.3:9000".to_string()),
        _ => None,
    };
    let server = "api_keys_file = \"/etc/keys\"\n[bodylog]\nlistener = \"\"";
    let c = load_strs_with(Some(server), &[], &env).unwrap();
    assert_eq!(
        c.server.api_keys_file.as_deref(),
        Some(Path::new("/run/keys"))
    );
    assert_eq!(c.server.bodylog_listener.as_deref(), Some("10.1.2.3:9000"));
    // Control: without the environment the file's values stand.
    let c = load_strs_with(Some(server), &[], &no_env).unwrap();
    assert_eq!(
        c.server.api_keys_file.as_deref(),
        Some(Path::new("/etc/keys"))
    );
    assert_eq!(c.server.bodylog_listener, None);
    // "" turns key files off, the default path included.
    let c = load_strs_with(Some("api_keys_file = \"\""), &[], &no_env).unwrap();
    assert_eq!(c.server.api_keys_file, None);
    // A host without a port takes BODYLOG_LISTENER_PORT, else 9999 (as the reference).
    let bare = |port: Option<&'static str>| {
        move |k: &str| match k {
            "BODYLOG_LISTENER_HOST" => Some(" logs.internal ".to_string()),
            "BODYLOG_LISTENER_PORT" => port.map(str::to_string),
            _ => None,
        }
    };
    for (port, want) in [
        (Some("9000"), "logs.internal:9000"),
        (None, "logs.internal:9999"),
        (Some("nine"), "logs.internal:9999"),
    ] {
        let c = load_strs_with(None, &[], &bare(port)).unwrap();
        assert_eq!(c.server.bodylog_listener.as_deref(), Some(want), "{port:?}");
    }
    let v6 = |k: &str| (k == "BODYLOG_LISTENER_HOST").then(|| "::1".to_string());
    let c = load_strs_with(None, &[], &v6).unwrap();
    assert_eq!(c.server.bodylog_listener.as_deref(), Some("[::1]:9999"));
    // A bad value from the environment is an error too.
    let bad = |k: &str| (k == "BODYLOG_LISTENER_HOST").then(|| "10.1.2.3:port".to_string());
    let e = load_strs_with(None, &[], &bad).unwrap_err();
    assert_eq!(fields(&e), ["BODYLOG_LISTENER_HOST"]);
}

#[test]
fn server_file_errors_are_all_collected() {
    let server = r#"
listen = "nope"
workers = -1
colour = "blue"
busy_poll_us = 1000001
max_body_size_ceiling = "lots"
[defaults]
postprocess = "gzip"
sesion_affinity = true
[bodylog]
listener = "x:y"
port = 1
"#;
    let e = strs(Some(server), &[]).unwrap_err();
    let mut f = fields(&e);
    f.sort();
    assert_eq!(
        f,
        [
            "bodylog.listener",
            "bodylog.port",
            "busy_poll_us",
            "colour",
            "defaults.postprocess",
            "defaults.sesion_affinity",
            "listen",
            "max_body_size_ceiling",
            "workers"
        ]
    );
    assert!(e
        .iter()
        .all(|e| e.file == Path::new("(embedded)/warmroute.toml")));
}

#[test]
fn full_example_route() {
    let server = r#"
[defaults]
postprocess = "vllm_format"
load_rate_limit = false
"#;
    let route = r#"
peers = [
  { host = "127.0.0.1", port = 8001, name = "a", priority = 1, max_concurrency = 64, probe = "/health", gpu = "h100" },
  { host = "127.0.0.1", port = 8002 },
]
models = ["m1"]
health_check_interval = 5
health_ban_ttl = 60
health_probe_path = "/ping"
cross_tier_fallback = true
max_more_tries = 0
max_body_size = "20m"
session_affinity = false
body_user_affinity = false
affinity_hash = "rendezvous"
api_keys = { "sk-one" = "alice", "sk-two" = "bob" }
upstream_api_key = "sk-upstream"
ttft_limit_ms = 15000
ttft_metrics = [ { metric = "p80", q = 0.8, threshold = 15000 }, { metric = "avg" } ]
tps_limit_tps = 12.5
adaptive_cc = true
adaptive_cc_min = 4
adaptive_cc_slack_frac = 0.5
tps_window = 30
session_prio = true
session_prio_table = [ [1, 0.8, 1.0], { min_turn = 4, share = 1.0, tol = 1.2 } ]
reject_rules_enabled = true
reject_rules_status = 413
connect_timeout_ms = 500
bodylog_pct = 10
[[reject_rules]]
name = "too-long"
field = "input_bytes"
op = "gt"
value = 100000
"#;
    let c = strs(Some(server), &[("full", route)]).unwrap();
    // No warning: both ttft_metrics entries are measured (the second, without a
    // threshold, is not judged).
    assert!(
        c.soft_errors.is_empty() && c.warnings.is_empty(),
        "{:?} {:?}",
        c.soft_errors,
        c.warnings
    );
    let r = c.route("full").unwrap();
    assert_eq!(r.name, "full");
    assert_eq!(r.pools.len(), 1);
    let p = &r.pools[0];
    assert_eq!(p.model, None);
    assert_eq!(p.peers.len(), 2);
    let a = &p.peers[0];
    assert_eq!(
        (a.name.as_str(), a.priority, a.max_concurrency),
        ("a", 1, 64)
    );
    assert_eq!(a.probe.as_deref(), Some("/health"));
    assert_eq!(a.gpu.as_deref(), Some("h100"));
    assert_eq!(a.addr.to_string(), "127.0.0.1:8001");
    let b = &p.peers[1];
    assert_eq!(
        (b.name.as_str(), b.priority, b.max_concurrency),
        ("127.0.0.1:8002", 0, 20)
    );
    assert_eq!(r.models, ["m1"]);
    assert_eq!(r.pool(Some("anything")).unwrap().peers.len(), 2);
    assert!(!r.by_model());

    let o = &r.opts;
    assert_eq!(o.health_check_interval, 5);
    assert_eq!(o.health_probe_path, "/ping");
    assert!(o.cross_tier_fallback);
    assert_eq!(o.max_more_tries, 0);
    assert_eq!(o.max_body_size, 20 << 20);
    assert!(!o.session_affinity && !o.body_user_affinity);
    assert_eq!(o.affinity_hash, AffinityHash::Rendezvous);
    assert_eq!(o.api_keys.as_ref().unwrap()["sk-two"], "bob");
    assert_eq!(o.upstream_api_key.as_deref(), Some("sk-upstream"));
    assert_eq!(o.ttft_limit_ms, Some(15000.0));
    assert_eq!(o.ttft_metrics.len(), 2);
    assert_eq!(
        o.ttft_metrics[1],
        MetricSpec {
            metric: "avg".into(),
            q: None,
            threshold: None
        }
    );
    assert_eq!(o.tps_limit_tps, Some(12.5));
    assert!(o.adaptive_cc);
    assert_eq!(o.adaptive_cc_min, Some(4));
    assert_eq!(
        o.adaptive_cc_interval, 30,
        "the AIMD interval follows tps_window when unset"
    );
    assert_eq!(o.adaptive_cc_slack_frac, 0.5);
    assert!(o.session_prio);
    assert_eq!(
        o.session_prio_table.as_ref().unwrap()[1],
        PrioBucket {
            min_turn: 4,
            share: 1.0,
            tol: 1.2
        }
    );
    assert_eq!(o.reject_rules.len(), 1);
    assert!(o.reject_rules_enabled);
    assert_eq!(o.reject_rules_status, 413);
    assert_eq!(o.connect_timeout_ms, 500);
    assert_eq!(o.bodylog_pct, 10);
    // Server [defaults] reach the options the route leaves alone.
    assert_eq!(o.postprocess, "vllm_format");
    assert!(!o.load_rate_limit);
    assert!(!o.set_by_route.contains("postprocess"));
    assert!(o.set_by_route.contains("max_body_size") && o.set_by_route.contains("reject_rules"));

    // Secrets never show in value_json.
    assert_eq!(
        o.value_json("api_keys"),
        json!({ "keys": 2, "owners": ["alice", "bob"] })
    );
    assert_eq!(o.value_json("upstream_api_key"), json!("(set)"));
    assert_eq!(o.value_json("max_body_size"), json!(20 << 20));
    assert_eq!(o.value_json("reject_rules")[0]["op"], json!("gt"));
}

#[test]
fn by_model_route() {
    let route = r#"
models = ["extra"]
[peers_by_model]
"zeta" = [ { host = "127.0.0.1", port = 8001 } ]
"alpha" = [ { host = "127.0.0.1", port = 8002, name = "x" }, { host = "127.0.0.1", port = 8003, name = "y" } ]
"#;
    let c = strs(None, &[("bm", route)]).unwrap();
    let r = c.route("bm").unwrap();
    let models: Vec<_> = r
        .pools
        .iter()
        .map(|p| p.model.as_deref().unwrap())
        .collect();
    assert_eq!(models, ["alpha", "zeta"]);
    assert_eq!(r.models, ["alpha", "extra", "zeta"]);
    assert!(r.by_model());
    assert_eq!(r.pool(Some("alpha")).unwrap().peers.len(), 2);
    assert!(r.pool(Some("nope")).is_none() && r.pool(None).is_none());
    assert!(c.route_for_model("extra").is_some());
}

#[test]
fn route_names_that_would_hide_the_routers_own_paths_are_refused() {
    for name in ["v1", "healthz", "readyz", "metrics", "_routes", ".", ".."] {
        let e = strs(None, &[(name, MIN_ROUTE)]).unwrap_err();
        assert_eq!(fields(&e), ["name"], "{name}");
        assert!(e[0].message.contains("is reserved"), "{name}: {}", e[0]);
    }
    // The control: names that only look alike are routes like any other.
    for name in ["v2", "v1-chat", "health", "_metrics", "..x"] {
        assert!(strs(None, &[(name, MIN_ROUTE)]).is_ok(), "{name}");
    }
}

#[test]
fn the_admin_port_may_not_take_the_public_ports_connections() {
    let check = |listen: &str, admin: &str| {
        strs(
            Some(&format!(
                "listen = \"{listen}\"\nadmin_listen = \"{admin}\""
            )),
            &[("r", MIN_ROUTE)],
        )
        .err()
        .map(|e| {
            assert_eq!(fields(&e), ["admin_listen"], "{e:?}");
            e[0].message.clone()
        })
    };
    // The same address, and a wildcard that covers the other one, either way round.
    for (l, a) in [
        ("127.0.0.1:9000", "127.0.0.1:9000"),
        ("0.0.0.0:9000", "127.0.0.1:9000"),
        ("127.0.0.1:9000", "0.0.0.0:9000"),
        ("[::]:9000", "127.0.0.1:9000"),
        ("[::1]:9000", "[::]:9000"),
        ("0.0.0.0:9000", "[::]:9000"),
    ] {
        let msg = check(l, a).unwrap_or_else(|| panic!("{l} and {a} were accepted"));
        assert!(
            msg.contains(a) && msg.contains("public listen address"),
            "{msg}"
        );
    }
    // Control: other ports, two distinct addresses, a v4 wildcard and a v6 address, and
    // port 0 (any free port) are fine.
    for (l, a) in [
        ("0.0.0.0:9000", "0.0.0.0:9001"),
        ("127.0.0.1:9000", "127.0.0.2:9000"),
        ("0.0.0.0:9000", "[::1]:9000"),
        ("0.0.0.0:0", "127.0.0.1:0"),
    ] {
        assert_eq!(check(l, a), None, "{l} and {a}");
    }
}

#[test]
fn an_unknown_server_key_names_the_one_meant_or_lists_them() {
    let e = strs(
        Some("admin_listn = \"127.0.0.1:1\"\nlisten_port = 8080"),
        &[("r", MIN_ROUTE)],
    )
    .unwrap_err();
    let msg = |f: &str| e.iter().find(|e| e.field == f).unwrap().message.clone();
    assert_eq!(e.len(), 2, "{e:#?}");
    assert_eq!(
        msg("admin_listn"),
        "unknown key (did you mean \"admin_listen\"?)"
    );
    let list = msg("listen_port");
    assert!(
        list.starts_with("unknown key (expected one of: listen, admin_listen, workers,"),
        "{list}"
    );
    // Every listed key is one the server file reads: a value of the wrong type for it is a
    // type error, not an unknown key.
    for k in super::server::SERVER_KEYS {
        let e = strs(Some(&format!("{k} = [[1]]")), &[("r", MIN_ROUTE)]).unwrap_err();
        assert!(
            e.iter().all(|e| !e.message.starts_with("unknown key")),
            "{k}: {e:#?}"
        );
    }
}

#[test]
fn every_error_is_collected_at_once() {
    let route = r#"
peers = [ { host = "127.0.0.1", port = 70000 } ]
max_more_tries = "two"
helth_check_interval = 5
"#;
    let e = errs(route);
    assert_eq!(e.len(), 3, "{e:#?}");
    let mut f = fields(&e);
    f.sort();
    assert_eq!(
        f,
        ["helth_check_interval", "max_more_tries", "peers[0].port"]
    );
    assert!(e.iter().all(|e| e.file == Path::new("(embedded)/r.toml")));
    let typo = e
        .iter()
        .find(|e| e.field == "helth_check_interval")
        .unwrap();
    assert!(typo.message.contains("health_check_interval"), "{typo}");
    assert!(typo
        .to_string()
        .starts_with("(embedded)/r.toml: helth_check_interval: unknown key"));

    // Errors of several files come together.
    let e = strs(
        Some("workers = \"x\""),
        &[("a", "max_more_tries = 1"), ("b", "peers = 3")],
    )
    .unwrap_err();
    let files: Vec<_> = e.iter().map(|e| e.file.display().to_string()).collect();
    assert_eq!(
        files,
        [
            "(embedded)/warmroute.toml",
            "(embedded)/a.toml",
            "(embedded)/b.toml"
        ]
    );
}

#[test]
fn unknown_key_in_peer_table() {
    let e = errs(
        r#"peers = [ { host = "127.0.0.1", port = 8000 }, { host = "127.0.0.1", port = 8001, weight = 3 } ]"#,
    );
    assert_eq!(fields(&e), ["peers[1].weight"]);
    assert!(e[0].message.contains("unknown"));
    let e = errs("[peers_by_model]\nm = [ { host = \"127.0.0.1\", port = 1, prio = 1 } ]");
    assert_eq!(fields(&e), ["peers_by_model.m[0].prio"]);
}

#[test]
fn peer_validation() {
    let e = errs(
        r#"peers = [ { host = "127.0.0.1", port = 8000, name = "a" }, { host = "127.0.0.1", port = 8001, name = "a" } ]"#,
    );
    assert_eq!(fields(&e), ["peers[1].name"]);
    let e = errs(r#"peers = [ { port = 0, probe = "health", max_concurrency = 0 } ]"#);
    let mut f = fields(&e);
    f.sort();
    assert_eq!(
        f,
        [
            "peers[0].host",
            "peers[0].max_concurrency",
            "peers[0].port",
            "peers[0].probe"
        ]
    );
    let e = errs(r#"peers = [ { host = "no-such-host.invalid", port = 8000 } ]"#);
    assert_eq!(fields(&e), ["peers[0].host"]);
    // What goes into a header or a probe's request line can hold no control character
    // (a name with a newline was written raw into X-Routed-Peer), and a probe path no
    // space; every such field is reported at once.
    let e = errs(
        "peers = [ { host = \"127.0.0.1\", port = 8000, name = \"a\\nb\", probe = \"/health x\" },\n\
         { host = \"127.0.0.1\\u0000\", port = 8001, name = \"c\\u0000\" } ]\n\
         health_probe_path = \"/v1/models\\r\\nX-Evil: 1\"\nupstream_api_key = \"sk\\u0000\"",
    );
    let mut f = fields(&e);
    f.sort();
    assert_eq!(
        f,
        [
            "health_probe_path",
            "peers[0].name",
            "peers[0].probe",
            "peers[1].host",
            "peers[1].name",
            "upstream_api_key"
        ],
        "{e:?}"
    );
    assert!(
        e.iter().any(|e| e.message.contains("X-Routed-Peer")),
        "{e:?}"
    );
    // Control: printable names (spaces, quotes, non-ASCII) and a tab are fine, and so is a
    // probe path with a query.
    let ok = one(
        "peers = [ { host = \"127.0.0.1\", port = 8000, name = \"gpu 0 \\\"a\\\" é\\tx\", probe = \"/health?full=1\" } ]\n\
         upstream_api_key = \"sk-1\"",
    )
    .unwrap();
    assert_eq!(ok.routes[0].pools[0].peers[0].name, "gpu 0 \"a\" é\tx");
    // The same name in two different pools is fine.
    let ok = "[peers_by_model]\na = [ { host = \"127.0.0.1\", port = 1, name = \"n\" } ]\nb = [ { host = \"127.0.0.1\", port = 2, name = \"n\" } ]";
    assert!(one(ok).is_ok());
}

#[test]
fn pools_shape() {
    assert_eq!(fields(&errs("max_more_tries = 1")), ["peers"]);
    let both = "peers = []\n[peers_by_model]\nm = []";
    assert_eq!(fields(&errs(both)), ["peers"]);
    assert_eq!(fields(&errs("[peers_by_model]")), ["peers_by_model"]);
    // An explicitly empty flat pool loads (every request will get 503).
    let c = one("peers = []").unwrap();
    assert!(c.routes[0].pools[0].peers.is_empty());
}

#[test]
fn too_many_peers() {
    let peers: Vec<String> = (0..1025)
        .map(|i| format!("{{ host = \"127.0.0.1\", port = {} }}", 1000 + i))
        .collect();
    let e = errs(&format!("peers = [{}]", peers.join(",")));
    assert_eq!(fields(&e), ["peers"]);
    let ok: Vec<String> = peers[..1024].to_vec();
    assert!(one(&format!("peers = [{}]", ok.join(","))).is_ok());
}

#[test]
fn bad_route_name() {
    for bad in ["Upper", "sp ace", "", "ü"] {
        let e = strs(None, &[(bad, MIN_ROUTE)]).unwrap_err();
        assert_eq!(fields(&e), ["name"], "{bad:?}");
    }
    for good in ["a", "llama-3.1_70b", "0"] {
        assert!(strs(None, &[(good, MIN_ROUTE)]).is_ok(), "{good:?}");
    }
    let e = strs(None, &[("a", MIN_ROUTE), ("a", MIN_ROUTE)]).unwrap_err();
    assert_eq!(fields(&e), ["name"]);
}

#[test]
fn max_body_size_above_ceiling() {
    let route = format!("{MIN_ROUTE}\nmax_body_size = \"300m\"");
    let e = errs(&route);
    assert_eq!(fields(&e), ["max_body_size"]);
    assert!(e[0].message.contains(&(300u64 << 20).to_string()));
    assert!(
        e[0].message.contains("max_body_size_ceiling")
            && e[0].message.contains(&(200u64 << 20).to_string())
    );
    // Control: a higher ceiling admits it.
    assert!(strs(Some("max_body_size_ceiling = \"1g\""), &[("r", &route)]).is_ok());
    // A route that does not set its limit takes the default (10m) cut to the ceiling
    // (SPEC §3.2: "never above the server ceiling"); only a limit it sets is an error.
    let c = strs(Some("max_body_size_ceiling = \"1m\""), &[("r", MIN_ROUTE)]).unwrap();
    assert_eq!(c.routes[0].opts.max_body_size, 1 << 20);
    let e = strs(
        Some("max_body_size_ceiling = \"1m\""),
        &[("r", &format!("{MIN_ROUTE}\nmax_body_size = \"2m\""))],
    )
    .unwrap_err();
    assert_eq!(fields(&e), ["max_body_size"]);
    // "0" is no limit of the route's own: the ceiling (as nginx's client_max_body_size 0).
    let zero = format!("{MIN_ROUTE}\nmax_body_size = \"0\"");
    let c = strs(Some("max_body_size_ceiling = \"1m\""), &[("r", &zero)]).unwrap();
    assert_eq!(c.routes[0].opts.max_body_size, 1 << 20);
    let c = strs(None, &[("r", &zero)]).unwrap();
    assert_eq!(c.routes[0].opts.max_body_size, 200 << 20);
}

#[test]
fn bool_leniency() {
    let c = one(&format!(
        "{MIN_ROUTE}\ncross_tier_fallback = \"Yes\"\ncch_strip = \"OFF\"\ninclude_usage = \"0\""
    ))
    .unwrap();
    let o = &c.routes[0].opts;
    assert!(o.cross_tier_fallback && !o.cch_strip && !o.include_usage);
    assert_eq!(c.warnings.len(), 3);
    assert!(c.soft_errors.is_empty());
    let mut f = fields(&c.warnings);
    f.sort();
    assert_eq!(f, ["cch_strip", "cross_tier_fallback", "include_usage"]);
    assert!(c
        .warnings
        .iter()
        .all(|w| w.file == Path::new("(embedded)/r.toml")));

    // Anything else: a soft error, and the default applies (adaptive_cc_hold_when_idle's
    // default comes from the server, here true).
    let c = one(&format!(
        "{MIN_ROUTE}\ncross_tier_fallback = \"False-ish\"\nadaptive_cc_hold_when_idle = 3"
    ))
    .unwrap();
    let o = &c.routes[0].opts;
    assert!(!o.cross_tier_fallback && o.adaptive_cc_hold_when_idle);
    assert!(!o.set_by_route.contains("cross_tier_fallback"));
    assert_eq!(c.soft_errors.len(), 2);
    let e = c
        .soft_errors
        .iter()
        .find(|e| e.field == "cross_tier_fallback")
        .unwrap();
    assert!(e.message.contains("False-ish"));
    assert!(c.warnings.is_empty());

    // A real error elsewhere: soft errors come along in the error list.
    let e = errs(&format!(
        "{MIN_ROUTE}\ncross_tier_fallback = \"maybe\"\nmax_more_tries = -1"
    ));
    assert_eq!(fields(&e), ["max_more_tries", "cross_tier_fallback"]);
}

#[test]
fn sizes_in_route_files() {
    for (text, bytes) in [
        ("\"512k\"", 512 << 10),
        ("\"1M\"", 1 << 20),
        ("4096", 4096),
        // "0": no limit of the route's own, the server's ceiling (200m by default).
        ("\"0\"", 200 << 20),
    ] {
        let c = one(&format!("{MIN_ROUTE}\nmax_body_size = {text}")).unwrap();
        assert_eq!(c.routes[0].opts.max_body_size, bytes, "{text}");
    }
    assert_eq!(
        fields(&errs(&format!("{MIN_ROUTE}\nmax_body_size = \"10 megs\""))),
        ["max_body_size"]
    );
    let c = strs(Some("max_body_size_ceiling = \"1G\""), &[]).unwrap();
    assert_eq!(c.server.max_body_size_ceiling, 1 << 30);
}

#[test]
fn numbers_types_and_bounds() {
    let route = format!(
        "{MIN_ROUTE}\nreject_rules_status = 200\nbodylog_pct = 101\nttft_ewma_alpha = \"x\"\nrt_limit_factor = 0\naffinity_hash = \"md5\"\nadaptive_cc_slack_frac = 0.95\nhealth_probe_path = \"v1\""
    );
    let mut f = fields(&errs(&route))
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    f.sort();
    assert_eq!(
        f,
        [
            "adaptive_cc_slack_frac",
            "affinity_hash",
            "bodylog_pct",
            "health_probe_path",
            "reject_rules_status",
            "rt_limit_factor",
            "ttft_ewma_alpha"
        ]
    );
    // Floats accept integers.
    let c = one(&format!("{MIN_ROUTE}\nrt_limit_factor = 2")).unwrap();
    assert_eq!(c.routes[0].opts.rt_limit_factor, 2.0);
    // An unset slack fraction is kept below a low pressure fraction.
    let c = one(&format!("{MIN_ROUTE}\nadaptive_cc_pressure_frac = 0.5")).unwrap();
    assert_eq!(c.routes[0].opts.adaptive_cc_slack_frac, 0.4);
}

#[test]
fn structured_options() {
    let bad = format!(
        "{MIN_ROUTE}\nttft_metrics = [ {{ metric = \"p80\" }}, {{ metric = \"p50\", q = 1.5 }}, {{ q = 0.5, extra = 1 }} ]\n\
         session_prio_table = [ [2, 0.5, 1.0], [1, 0.9, 1.0] ]\napi_keys = {{ \"k\" = 1 }}\nmodels = [\"\"]\ntps_limit_by_model = {{ m = -1 }}\nreject_rules = 5"
    );
    let mut f = fields(&errs(&bad))
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    f.sort();
    assert_eq!(
        f,
        [
            "api_keys[0]",
            "models[0]",
            "reject_rules",
            "session_prio_table[0]",
            "session_prio_table[1]",
            "tps_limit_by_model.m",
            "ttft_metrics[0].q",
            "ttft_metrics[1].q",
            "ttft_metrics[2].extra",
            "ttft_metrics[2].metric",
        ]
    );
    // An API key never appears in an error.
    let e = errs(&format!(
        "{MIN_ROUTE}\napi_keys = {{ \"sk-secret\" = \"\" }}"
    ));
    assert!(!e[0].to_string().contains("sk-secret"));
}

#[test]
fn toml_syntax_error_has_line_and_column() {
    let e = errs("peers = [\n  { host = \"a\", port = 1 }\n]\nmax_more_tries = = 2\n");
    assert_eq!(fields(&e), ["(toml)"]);
    assert!(e[0].message.contains("line 4, column"), "{}", e[0]);
}

#[test]
fn models_are_unique_across_routes() {
    let a = "models = [\"m\"]\npeers = []";
    let b = "[peers_by_model]\nm = []";
    let e = strs(None, &[("b", b), ("a", a)]).unwrap_err();
    assert_eq!(fields(&e), ["models"]);
    assert_eq!(e[0].file, Path::new("(embedded)/b.toml"));
}

/// Every catalog default equals what a route that sets nothing runs with, so the catalog
/// and `RouteOpts` cannot drift apart.
#[test]
fn catalog_defaults_match_route_opts() {
    let server = ServerDefaults::default();
    let c = one(MIN_ROUTE).unwrap();
    let o = &c.routes[0].opts;
    assert!(o.set_by_route.is_empty());
    assert_eq!(o, &RouteOpts::defaults(&server));
    for spec in ROUTE_OPTS {
        let got = o.value_json(spec.key);
        let want = match spec.default {
            OptDefault::Bool(b) => json!(b),
            OptDefault::Int(i) => json!(i),
            OptDefault::Float(f) => json!(f),
            OptDefault::Size(s) => json!(s),
            OptDefault::Str(s) => json!(s),
            OptDefault::None => match spec.kind {
                OptKind::List if got == json!([]) => got.clone(),
                OptKind::Map if got == json!({}) => got.clone(),
                _ => serde_json::Value::Null,
            },
            OptDefault::ServerDefault(k) => match k {
                "postprocess" => json!(server.postprocess),
                "load_rate_limit" => json!(server.load_rate_limit),
                "adaptive_cc_hold_when_idle" => json!(server.adaptive_cc_hold_when_idle),
                "session_affinity" => json!(server.session_affinity),
                other => panic!("unknown server default {other}"),
            },
        };
        // Integers and floats compare as numbers (json!(20) vs json!(20.0)).
        let same = match (got.as_f64(), want.as_f64()) {
            (Some(a), Some(b)) => a == b,
            _ => got == want,
        };
        assert!(
            same,
            "{}: RouteOpts has {got}, catalog says {want}",
            spec.key
        );
    }
    // Spot checks against the SPEC, so a wrong catalog entry is caught too.
    assert_eq!(o.max_body_size, 10 << 20);
    assert_eq!((o.health_check_interval, o.health_ban_ttl), (10, 300));
    assert_eq!(o.health_probe_path, "/v1/models");
    assert_eq!(
        (o.max_more_tries, o.reject_rules_status, o.bodylog_pct),
        (2, 429, 100)
    );
    assert_eq!(
        (
            o.connect_timeout_ms,
            o.first_byte_timeout_ms,
            o.idle_timeout_ms
        ),
        (2_000, 3_600_000, 3_600_000)
    );
    assert!(!o.adaptive_cc && o.ttft_limit_ms.is_none() && o.tps_limit_tps.is_none());
    assert!(o.session_affinity && o.body_user_affinity && o.expose_routed_headers);
    assert_eq!(o.affinity_hash, AffinityHash::Crc32Mod);
}

/// A route that sets every option: each one is applied, recorded in `set_by_route`, and
/// shows a non-default value, so no catalog key lacks a field.
#[test]
fn every_catalog_option_is_settable() {
    let mut lines = vec![MIN_ROUTE.to_string()];
    for spec in ROUTE_OPTS {
        let v = match (spec.key, spec.kind) {
            ("health_probe_path", _) => "\"/ready\"".to_string(),
            ("models", _) => "[\"m\"]".to_string(),
            ("api_keys", _) => "{ k = \"o\" }".to_string(),
            ("ttft_metrics" | "tps_metrics", _) => {
                "[ { metric = \"p90\", q = 0.9, threshold = 1 } ]".to_string()
            }
            ("session_prio_table", _) => "[ [1, 0.5, 1.0] ]".to_string(),
            ("reject_rules", _) => "[ { field = \"stream\", op = \"exists\" } ]".to_string(),
            ("ttft_limit_by_model" | "tps_limit_by_model", _) => "{ m = 1 }".to_string(),
            ("postprocess", _) => "\"strip_actual_usage\"".to_string(),
            ("adaptive_cc_slack_frac", _) => "0.3".to_string(),
            ("adaptive_cc_pressure_frac", _) => "0.8".to_string(),
            (_, OptKind::Bool) => match spec.default {
                OptDefault::Bool(true) | OptDefault::ServerDefault(_) => "false".to_string(),
                _ => "true".to_string(),
            },
            (_, OptKind::Int { min, .. }) => match spec.default {
                OptDefault::Int(d) if d == min => (min + 1).to_string(),
                _ => min.to_string(),
            },
            (_, OptKind::Float { min, max }) => match spec.default {
                OptDefault::Float(d) if d == max => ((min + max) / 2.0).to_string(),
                _ => max.to_string(),
            },
            (_, OptKind::Size) => "\"1m\"".to_string(),
            (_, OptKind::Str) => "\"x\"".to_string(),
            (_, OptKind::Enum(vals)) => format!("{:?}", vals[vals.len() - 1]),
            (k, kind) => panic!("no test value for {k} ({kind:?})"),
        };
        lines.push(format!("{} = {v}", spec.key));
    }
    let text = lines.join("\n");
    let c = one(&text).unwrap_or_else(|e| panic!("{e:#?}\n{text}"));
    let o = &c.routes[0].opts;
    let d = RouteOpts::defaults(&ServerDefaults::default());
    for spec in ROUTE_OPTS {
        assert!(
            o.set_by_route.contains(spec.key),
            "{} not recorded as set",
            spec.key
        );
        assert_ne!(
            o.value_json(spec.key),
            d.value_json(spec.key),
            "{} did not change",
            spec.key
        );
    }
    assert_eq!(o.set_by_route.len(), ROUTE_OPTS.len());
}

#[test]
fn load_from_a_directory() {
    let dir = TempDir::new();
    let server = dir.write(
        "etc/warmroute.toml",
        "routes_dir = \"conf.d\"\nlisten = \"127.0.0.1:18080\"\n[defaults]\nsession_affinity = false\n",
    );
    dir.write("etc/conf.d/b.toml", MIN_ROUTE);
    dir.write(
        "etc/conf.d/a.toml",
        &format!("{MIN_ROUTE}\nsession_affinity = true"),
    );
    dir.write("etc/conf.d/notes.txt", "not a route");
    dir.write("etc/conf.d/.hidden.toml", "garbage = ");
    let c = load_with(Some(&server), Path::new("/nonexistent-cwd"), &no_env).unwrap();
    let names: Vec<_> = c.routes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(c.server.routes_dir, dir.0.join("etc/conf.d"));
    assert_eq!(c.server_file.as_deref(), Some(server.as_path()));
    assert!(c.route("a").unwrap().opts.session_affinity);
    assert!(
        !c.route("b").unwrap().opts.session_affinity,
        "server [defaults] apply"
    );
    assert_eq!(c.route("b").unwrap().file, dir.0.join("etc/conf.d/b.toml"));
    assert!(c.route("c").is_none());

    // Errors name the real files.
    dir.write("etc/conf.d/c.toml", "peers = [ { host = \"127.0.0.1\" } ]");
    dir.write("etc/conf.d/Bad.toml", MIN_ROUTE);
    let e = load_with(Some(&server), Path::new("/"), &no_env).unwrap_err();
    let got: Vec<_> = e
        .iter()
        .map(|e| (e.file.clone(), e.field.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            (dir.0.join("etc/conf.d/Bad.toml"), "name"),
            (dir.0.join("etc/conf.d/c.toml"), "peers[0].port")
        ]
    );

    // A routes_dir the server file names must exist; the implicit default need not.
    let server2 = dir.write("etc/other.toml", "routes_dir = \"missing\"");
    let e = load_with(Some(&server2), Path::new("/"), &no_env).unwrap_err();
    assert_eq!(fields(&e), ["routes_dir"]);
    assert_eq!(e[0].file, server2);
    let server3 = dir.write("etc/empty/warmroute.toml", "");
    let c = load_with(Some(&server3), Path::new("/"), &no_env).unwrap();
    assert!(c.routes.is_empty());

    // A server file that does not exist is an error.
    let e = load_with(Some(&dir.0.join("nope.toml")), Path::new("/"), &no_env).unwrap_err();
    assert_eq!(fields(&e), ["(file)"]);
}

/// The example files shipped in `routes/` are valid.
#[test]
fn shipped_example_routes_are_valid() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let c = load_with(None, root, &no_env).unwrap_or_else(|e| panic!("{e:#?}"));
    let count = std::fs::read_dir(root.join("routes"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "toml")
        })
        .count();
    assert!(count >= 2);
    assert_eq!(c.routes.len(), count);
    assert!(
        c.soft_errors.is_empty() && c.warnings.is_empty(),
        "{:?} {:?}",
        c.soft_errors,
        c.warnings
    );
    let ex = c.route("example").unwrap();
    assert_eq!(ex.pools[0].peers.len(), 3);
    let bm = c.route("by-model").unwrap();
    assert!(bm.by_model());
}

#[test]
fn one_backend_listed_twice_in_a_pool_is_an_error() {
    // Named apart, the same address: the two would share one in-flight slot.
    let e = errs(
        r#"peers = [ { host = "127.0.0.1", port = 8000, name = "x" }, { host = "127.0.0.1", port = 8000, name = "y" } ]"#,
    );
    assert_eq!(fields(&e), ["peers[1].port"]);
    assert!(e[0].message.contains("peers[0]") && e[0].message.contains("\"x\""));
    // The control: another port is another backend; and one address in two sub-pools is
    // allowed (each pool has its own slots).
    assert!(one(
        r#"peers = [ { host = "127.0.0.1", port = 8000, name = "x" }, { host = "127.0.0.1", port = 8001, name = "y" } ]"#,
    )
    .is_ok());
    let by_model = "[peers_by_model]\na = [ { host = \"127.0.0.1\", port = 8000 } ]\nb = [ { host = \"127.0.0.1\", port = 8000 } ]";
    assert!(one(by_model).is_ok(), "{:?}", one(by_model).err());
}

#[test]
fn a_ttft_limit_at_or_under_the_first_bucket_is_warned_about() {
    // The TTFT statistic is a bucket bound, 250 ms at the least: a 200 ms limit would shed
    // every request on a fast backend.
    let c = one(&format!(
        "{MIN_ROUTE}\nttft_limit_ms = 200\n[ttft_limit_by_model]\nfast = 100\nslow = 5000\n"
    ))
    .unwrap();
    let fields: Vec<&str> = c.warnings.iter().map(|w| w.field.as_str()).collect();
    assert_eq!(
        fields,
        ["ttft_limit_ms", "ttft_limit_by_model.fast"],
        "{:?}",
        c.warnings
    );
    assert!(c.warnings[0]
        .message
        .contains("smallest TTFT bucket (250 ms)"));
    // The control: a limit above the first bucket is not.
    let c = one(&format!("{MIN_ROUTE}\nttft_limit_ms = 300\n")).unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn an_empty_key_table_and_an_empty_peer_list_are_warned_about() {
    // Each loads (an empty pool answers 503, an empty key table opens the route), but
    // `check` says so.
    let c = one("peers = []\napi_keys = {}\n").unwrap();
    let mut fields: Vec<&str> = c.warnings.iter().map(|w| w.field.as_str()).collect();
    fields.sort();
    assert_eq!(fields, ["api_keys", "peers"], "{:?}", c.warnings);
    assert!(
        c.warnings
            .iter()
            .any(|w| w.message.contains("without a key")),
        "{:?}",
        c.warnings
    );
    // The control: a key table with a key, and a pool with a peer, are not.
    let c = one(&format!("{MIN_ROUTE}\napi_keys = {{ \"sk\" = \"o\" }}\n")).unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

/// Two reject rules of one name share a hit counter: the route loads, with a warning.
/// The control: distinct names (and unnamed rules, `rule1`, `rule2`) give none.
#[test]
fn reject_rules_sharing_a_name_are_warned_about() {
    let rules = |a: &str, b: &str| {
        format!(
            "{MIN_ROUTE}\nreject_rules = [ {{ {a} field = \"x\", op = \"exists\" }}, {{ {b} field = \"y\", op = \"exists\" }} ]\n"
        )
    };
    let c = one(&rules("name = \"dup\",", "name = \"dup\",")).unwrap();
    assert_eq!(fields(&c.warnings), ["reject_rules"], "{:?}", c.warnings);
    assert!(
        c.warnings[0].message.contains("\"dup\""),
        "{:?}",
        c.warnings
    );
    assert!(c.soft_errors.is_empty(), "{:?}", c.soft_errors);
    for (a, b) in [("name = \"a\",", "name = \"b\","), ("", "")] {
        let c = one(&rules(a, b)).unwrap();
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }
}

/// A metric list is loaded whole (every entry is measured and judged) without a warning,
/// up to `MAX_METRICS` entries; a longer one is refused with the field named. The control:
/// the same list one entry shorter loads.
#[test]
fn metric_lists_load_whole_up_to_their_limit() {
    let route = |n: usize| {
        let list: Vec<String> = (0..n)
            .map(|i| {
                format!(
                    "{{ metric = \"p{}\", q = 0.{}, threshold = {} }}",
                    10 + i,
                    10 + i,
                    100 + i
                )
            })
            .collect();
        format!(
            "peers = [ {{ host = \"127.0.0.1\", port = 8001 }} ]\nttft_metrics = [ {} ]\n",
            list.join(", ")
        )
    };
    let ok = route(crate::config::MAX_METRICS);
    let c = strs(None, &[("r", ok.as_str())]).unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert_eq!(
        c.routes[0].opts.ttft_metrics.len(),
        crate::config::MAX_METRICS
    );
    let long = route(crate::config::MAX_METRICS + 1);
    let e = strs(None, &[("r", long.as_str())]).unwrap_err();
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(e[0].field, "ttft_metrics");
    assert!(e[0].message.contains("at most 8"), "{}", e[0]);
}

/// A `*.toml` name in the routes directory that is not a file to read (a directory, a
/// symlink to nothing) is skipped with a warning naming it, so `check` shows why a route is
/// missing; a hidden file is skipped without one.
#[test]
fn route_names_that_are_not_files_are_skipped_with_a_warning() {
    let dir = TempDir::new();
    let server = dir.write("warmroute.toml", "");
    dir.write("routes/a.toml", MIN_ROUTE);
    dir.write("routes/.swap.toml", MIN_ROUTE);
    std::fs::create_dir_all(dir.0.join("routes/d.toml")).unwrap();
    std::os::unix::fs::symlink(dir.0.join("gone.toml"), dir.0.join("routes/l.toml")).unwrap();
    let c = load_with(Some(&server), Path::new("/"), &no_env).unwrap_or_else(|e| panic!("{e:#?}"));
    // The control: the route file loads.
    assert_eq!(c.routes.len(), 1);
    assert!(c.route("a").is_some());
    let warned: Vec<&str> = c.warnings.iter().map(|w| w.message.as_str()).collect();
    assert_eq!(warned.len(), 2, "{warned:?}");
    assert!(
        warned[0].contains("routes/d.toml") && warned[0].contains("skipped"),
        "{warned:?}"
    );
    assert!(warned[1].contains("routes/l.toml"), "{warned:?}");
}
