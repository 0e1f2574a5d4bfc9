//! The server file (`warmroute.toml`) → `ServerConfig`.
//!
//! Contract: reads a parsed TOML table and the two environment overrides handed in by the
//! caller; touches no file. Every key has a default, so an absent file is an empty table.

use std::net::SocketAddr;
use std::path::PathBuf;

use super::catalog::{self, OptKind};
use super::value::{self, join, Diag};

/// Server-wide values for route options declared `ServerDefault` in the catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerDefaults {
    /// Post-processing handler for routes that name none ("" = none).
    pub postprocess: String,
    pub load_rate_limit: bool,
    pub adaptive_cc_hold_when_idle: bool,
    pub session_affinity: bool,
}

impl Default for ServerDefaults {
    fn default() -> Self {
        ServerDefaults {
            postprocess: String::new(),
            load_rate_limit: true,
            adaptive_cc_hold_when_idle: true,
            session_affinity: true,
        }
    }
}

/// The validated server file.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    /// 0 = one per usable core.
    pub workers: usize,
    /// As written, or resolved to an absolute path by `load`.
    pub routes_dir: PathBuf,
    pub shm_path: PathBuf,
    /// `shm_path` was not written, so it follows the public port: a `--listen` that moves
    /// the port moves the default segment with it.
    pub shm_path_is_default: bool,
    pub api_keys_file: Option<PathBuf>,
    /// No route's `max_body_size` may exceed it.
    pub max_body_size_ceiling: u64,
    pub drain_timeout_s: u64,
    /// Keep-alive idle timeout toward clients.
    pub client_idle_timeout_ms: u64,
    /// Time allowed to receive a complete request head.
    pub client_head_timeout_ms: u64,
    /// Lifetime of an idle pooled upstream connection. The default, 4 s, is under the 5 s
    /// the engines' HTTP servers keep an idle connection (uvicorn for vLLM and SGLang,
    /// llama.cpp's server): the router closes first, instead of sending a request into a
    /// connection the engine is closing and paying a round trip to retry it.
    pub upstream_idle_timeout_ms: u64,
    /// Most idle pooled connections per peer per worker. Large enough by default to keep
    /// every connection a busy worker had open to a peer: a pool smaller than the
    /// concurrency a peer serves closes the surplus after each response and connects
    /// anew for the next request (measured: 64 idle at 256 concurrent requests cost a
    /// quarter of a worker's throughput).
    pub upstream_idle_per_peer: usize,
    /// Whether and how long a worker keeps polling instead of waiting after a request
    /// starts or finishes (`busy_poll_us`; see `worker::busy_poll`).
    pub busy_poll: BusyPoll,
    pub defaults: ServerDefaults,
    /// Body-log listener `host:port`; `None` = body logging off.
    pub bodylog_listener: Option<String>,
}

pub const DEFAULT_LISTEN: &str = "0.0.0.0:8080";
pub const DEFAULT_ADMIN_LISTEN: &str = "0.0.0.0:8090";
pub const DEFAULT_MAX_BODY_SIZE_CEILING: u64 = 200 * 1024 * 1024;
/// The key file read when the server file names none (SPEC §2.1); `api_keys_file = ""`
/// turns key files off.
pub const DEFAULT_API_KEYS_FILE: &str = "/etc/warmroute/api-keys/keys";

/// Environment variable that replaces `api_keys_file`.
pub const ENV_API_KEYS_FILE: &str = "WARMROUTE_API_KEYS_FILE";
/// Environment variable that replaces `[bodylog] listener`.
pub const ENV_BODYLOG_LISTENER: &str = "BODYLOG_LISTENER_HOST";
/// The port for a `BODYLOG_LISTENER_HOST` given without one, as the reference reads them
/// (default [`DEFAULT_BODYLOG_PORT`]; a value that is not a port gives the default too).
pub const ENV_BODYLOG_LISTENER_PORT: &str = "BODYLOG_LISTENER_PORT";
pub const DEFAULT_BODYLOG_PORT: u16 = 9999;

/// The segment of a router whose server file names none: one per public port.
pub fn default_shm_path(listen: &SocketAddr) -> PathBuf {
    PathBuf::from(format!("/dev/shm/warmroute-{}", listen.port()))
}

impl Default for ServerConfig {
    fn default() -> Self {
        let listen: SocketAddr = DEFAULT_LISTEN
            .parse()
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 8080)));
        ServerConfig {
            listen,
            admin_listen: DEFAULT_ADMIN_LISTEN
                .parse()
                .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 8090))),
            workers: 0,
            routes_dir: PathBuf::from("routes"),
            shm_path: default_shm_path(&listen),
            shm_path_is_default: true,
            api_keys_file: Some(PathBuf::from(DEFAULT_API_KEYS_FILE)),
            max_body_size_ceiling: DEFAULT_MAX_BODY_SIZE_CEILING,
            drain_timeout_s: 300,
            client_idle_timeout_ms: 75_000,
            client_head_timeout_ms: 30_000,
            upstream_idle_timeout_ms: 4_000,
            upstream_idle_per_peer: 1024,
            busy_poll: BusyPoll::Auto,
            defaults: ServerDefaults::default(),
            bodylog_listener: None,
        }
    }
}

const MS_MAX: i64 = 86_400_000;
/// The largest `busy_poll_us`: one second.
const BUSY_POLL_US_MAX: i64 = 1_000_000;

/// `busy_poll_us`: a number of microseconds (0 = off), or `"auto"` (the default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BusyPoll {
    /// The worker always waits.
    Off,
    /// After each request start or finish, poll for this many microseconds.
    Window(u64),
    /// Poll only while it pays: request gaps shorter than [`BusyPoll::AUTO_MAX_US`], no
    /// other task wanting the worker's core, and no CPU quota below the worker count.
    Auto,
}

impl BusyPoll {
    /// The longest window `"auto"` grows to, in microseconds.
    pub const AUTO_MAX_US: u64 = 200;
}

/// The server file's keys, for the message about one that is not among them.
pub(crate) const SERVER_KEYS: [&str; 15] = [
    "listen",
    "admin_listen",
    "workers",
    "routes_dir",
    "shm_path",
    "api_keys_file",
    "max_body_size_ceiling",
    "drain_timeout_s",
    "client_idle_timeout_ms",
    "client_head_timeout_ms",
    "upstream_idle_timeout_ms",
    "upstream_idle_per_peer",
    "busy_poll_us",
    "defaults",
    "bodylog",
];

/// A near miss gets its likely key; anything else gets the list (it is short).
fn unknown_server_key(key: &str) -> String {
    match value::near_key(key, SERVER_KEYS) {
        Some(k) => format!("unknown key (did you mean {k:?}?)"),
        None => format!("unknown key (expected one of: {})", SERVER_KEYS.join(", ")),
    }
}

/// Result of reading the server table: the config and whether `routes_dir` was set.
pub(crate) struct ParsedServer {
    pub config: ServerConfig,
    pub routes_dir_set: bool,
}

/// Reads the server table. `env` looks up an environment variable.
pub(crate) fn parse_server(
    table: &toml::Table,
    env: &dyn Fn(&str) -> Option<String>,
    d: &mut Diag,
) -> ParsedServer {
    let mut c = ServerConfig::default();
    let mut shm_set = false;
    let mut routes_dir_set = false;
    for (key, v) in table {
        let k = key.as_str();
        match k {
            "listen" | "admin_listen" => {
                if let Some(s) = value::string(v, k, d) {
                    match s.parse::<SocketAddr>() {
                        Ok(a) if k == "listen" => c.listen = a,
                        Ok(a) => c.admin_listen = a,
                        Err(_) => d.error(
                            k,
                            format!("{s:?} is not an address:port such as \"0.0.0.0:8080\""),
                        ),
                    }
                }
            }
            "workers" => {
                if let Some(n) = value::integer(v, 0, 4096, k, d) {
                    c.workers = usize::try_from(n).unwrap_or(0);
                }
            }
            "routes_dir" | "shm_path" | "api_keys_file" => {
                let Some(s) = value::string(v, k, d) else {
                    continue;
                };
                if s.trim().is_empty() {
                    if k == "api_keys_file" {
                        // "" = no key file, not even the default one.
                        c.api_keys_file = None;
                    } else {
                        d.error(k, "must not be empty");
                    }
                    continue;
                }
                match k {
                    "routes_dir" => {
                        c.routes_dir = PathBuf::from(s);
                        routes_dir_set = true;
                    }
                    "shm_path" => {
                        c.shm_path = PathBuf::from(s);
                        c.shm_path_is_default = false;
                        shm_set = true;
                    }
                    _ => c.api_keys_file = Some(PathBuf::from(s)),
                }
            }
            "max_body_size_ceiling" => {
                if let Some(n) = value::size(v, k, d) {
                    if n == 0 {
                        d.error(k, "must be greater than 0");
                    } else {
                        c.max_body_size_ceiling = n;
                    }
                }
            }
            "drain_timeout_s" => {
                if let Some(n) = value::integer(v, 0, 86_400, k, d) {
                    c.drain_timeout_s = u64::try_from(n).unwrap_or(0);
                }
            }
            "client_idle_timeout_ms" | "client_head_timeout_ms" | "upstream_idle_timeout_ms" => {
                if let Some(n) = value::integer(v, 1, MS_MAX, k, d) {
                    let n = u64::try_from(n).unwrap_or(1);
                    match k {
                        "client_idle_timeout_ms" => c.client_idle_timeout_ms = n,
                        "client_head_timeout_ms" => c.client_head_timeout_ms = n,
                        _ => c.upstream_idle_timeout_ms = n,
                    }
                }
            }
            "upstream_idle_per_peer" => {
                if let Some(n) = value::integer(v, 0, 65_536, k, d) {
                    c.upstream_idle_per_peer = usize::try_from(n).unwrap_or(0);
                }
            }
            "busy_poll_us" => match v {
                toml::Value::String(s) if s == "auto" => c.busy_poll = BusyPoll::Auto,
                toml::Value::String(s) => d.error(
                    k,
                    format!("expected \"auto\" or a number of microseconds, found \"{s}\""),
                ),
                _ => {
                    if let Some(n) = value::integer(v, 0, BUSY_POLL_US_MAX, k, d) {
                        c.busy_poll = match u64::try_from(n).unwrap_or(0) {
                            0 => BusyPoll::Off,
                            us => BusyPoll::Window(us),
                        };
                    }
                }
            },
            "defaults" => {
                if let Some(t) = value::table(v, k, d) {
                    parse_defaults(t, &mut c.defaults, d);
                }
            }
            "bodylog" => {
                let Some(t) = value::table(v, k, d) else {
                    continue;
                };
                for (bk, bv) in t {
                    let f = join("bodylog", bk);
                    match bk.as_str() {
                        "listener" => {
                            if let Some(s) = value::string(bv, &f, d) {
                                c.bodylog_listener = listener(&s, &f, d);
                            }
                        }
                        _ => d.error(&f, "unknown key (expected listener)"),
                    }
                }
            }
            _ => d.error(k, unknown_server_key(k)),
        }
    }
    if !shm_set {
        c.shm_path = default_shm_path(&c.listen);
    }
    if let Some(msg) = listen_conflict(&c.listen, &c.admin_listen) {
        d.error("admin_listen", msg);
    }
    if let Some(path) = env(ENV_API_KEYS_FILE).filter(|p| !p.trim().is_empty()) {
        c.api_keys_file = Some(PathBuf::from(path));
    }
    if let Some(host) = env(ENV_BODYLOG_LISTENER).filter(|h| !h.trim().is_empty()) {
        let mut envd = Diag::new("(environment)");
        let host = with_env_port(host.trim(), env(ENV_BODYLOG_LISTENER_PORT).as_deref());
        c.bodylog_listener = listener(&host, ENV_BODYLOG_LISTENER, &mut envd);
        d.errors.append(&mut envd.errors);
    }
    ParsedServer {
        config: c,
        routes_dir_set,
    }
}

/// What is wrong with an admin address next to the public one, if anything: the same
/// address, or an overlapping one. Checked on the files and again on the command line's
/// `--listen` / `--admin-listen`.
pub fn listen_conflict(listen: &SocketAddr, admin: &SocketAddr) -> Option<String> {
    if listen == admin && listen.port() != 0 {
        Some(format!("{admin} is also the public listen address"))
    } else if listeners_overlap(listen, admin) {
        Some(format!(
            "{admin} overlaps the public listen address {listen}: same port, and a wildcard \
             address takes in the other"
        ))
    } else {
        None
    }
}

/// Whether two listen addresses take some of the same connections: the same port (not 0)
/// and either the same address or a wildcard that covers the other. `0.0.0.0` covers every
/// IPv4 address; `[::]` covers every address, IPv4 too, as Linux binds it dual-stack by
/// default. The listeners share ports with SO_REUSEPORT, so the kernel would not refuse
/// the second bind: it would split connections between them.
fn listeners_overlap(a: &SocketAddr, b: &SocketAddr) -> bool {
    if a.port() != b.port() || a.port() == 0 {
        return false;
    }
    let covers = |w: &SocketAddr, o: &SocketAddr| match w.ip() {
        std::net::IpAddr::V6(ip) => ip.is_unspecified(),
        std::net::IpAddr::V4(ip) => ip.is_unspecified() && o.is_ipv4(),
    };
    a.ip() == b.ip() || covers(a, b) || covers(b, a)
}

/// `BODYLOG_LISTENER_HOST` as an address: as given when it names a port (`host:port`,
/// `[v6]:port`), else the host (an IPv6 one bracketed) with `BODYLOG_LISTENER_PORT`, or
/// 9999 when that is unset or not a port, as in the reference's deployment.
fn with_env_port(host: &str, port: Option<&str>) -> String {
    let names_port = if host.starts_with('[') {
        host.contains("]:")
    } else {
        host.matches(':').count() == 1
    };
    if names_port {
        return host.to_string();
    }
    let port = port
        .and_then(|p| p.trim().parse::<u16>().ok())
        .filter(|&p| p > 0)
        .unwrap_or(DEFAULT_BODYLOG_PORT);
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A body-log listener address: "" = off, else `host:port`.
fn listener(s: &str, field: &str, d: &mut Diag) -> Option<String> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    let ok = s
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if ok {
        Some(s.to_string())
    } else {
        d.error(field, format!("{s:?} is not host:port"));
        None
    }
}

fn parse_defaults(t: &toml::Table, out: &mut ServerDefaults, d: &mut Diag) {
    for (k, v) in t {
        let f = join("defaults", k);
        // The same kinds and value lists as the route options these defaults stand for.
        let kind = catalog::spec(k).map(|s| s.kind);
        match (k.as_str(), kind) {
            ("postprocess", Some(OptKind::Enum(allowed))) => {
                if let Some(s) = value::one_of(v, allowed, &f, d) {
                    out.postprocess = s;
                }
            }
            ("load_rate_limit" | "adaptive_cc_hold_when_idle" | "session_affinity", _) => {
                if let Some(b) = value::boolean(v, &f, d) {
                    match k.as_str() {
                        "load_rate_limit" => out.load_rate_limit = b,
                        "adaptive_cc_hold_when_idle" => out.adaptive_cc_hold_when_idle = b,
                        _ => out.session_affinity = b,
                    }
                }
            }
            _ => d.error(
                &f,
                "unknown key (expected postprocess, load_rate_limit, adaptive_cc_hold_when_idle, session_affinity)",
            ),
        }
    }
}
