//! One route file → `RouteConfig`.
//!
//! Contract: reads a parsed TOML table, never the file system (peer host names are resolved,
//! which is the one lookup done at load). Every problem is recorded in the file's `Diag` and
//! the walk continues, so one pass reports all of them. Options come from the catalog: the
//! defaults first, then the file's values through the same `apply`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{json, Value as Json};

use crate::rules::{self, RuleSet};

use super::catalog::{self, OptDefault, OptKind, OptSpec, ROUTE_OPTS};
use super::server::{ServerConfig, ServerDefaults};
use super::value::{self, join, Diag};

/// Most peers one route may list, over all its pools (SPEC §14).
pub const MAX_PEERS_PER_ROUTE: usize = 1024;
/// Default `max_concurrency` of a peer.
pub const DEFAULT_PEER_MAX_CONCURRENCY: u32 = 20;

/// One backend.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerConfig {
    pub host: String,
    pub port: u16,
    /// `host:port` resolved at load (an IPv4 address is preferred when the name has both).
    pub addr: SocketAddr,
    /// Display name; `host:port` when the file gives none. Unique within its pool.
    pub name: String,
    /// Higher is preferred; traffic goes to the highest tier with a healthy member.
    pub priority: i32,
    pub max_concurrency: u32,
    /// Probe path for this peer, replacing the route's `health_probe_path`.
    pub probe: Option<String>,
    /// Label only.
    pub gpu: Option<String>,
}

/// A set of peers that serves a request; a route has one flat pool or one per model.
#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    /// `None` for the flat `peers` pool.
    pub model: Option<String>,
    /// In file order (the order crc32 affinity indexes).
    pub peers: Vec<PeerConfig>,
}

/// A validated route.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteConfig {
    /// The file stem, `[a-z0-9._-]+`.
    pub name: String,
    pub file: PathBuf,
    /// One flat pool, or one per `peers_by_model` key sorted by model.
    pub pools: Vec<Pool>,
    /// Models this route serves: `models = [...]` plus the `peers_by_model` keys, sorted, unique.
    pub models: Vec<String>,
    pub opts: RouteOpts,
}

impl RouteConfig {
    /// The pool serving `model`: the flat pool for any model, else the matching sub-pool.
    pub fn pool(&self, model: Option<&str>) -> Option<&Pool> {
        match self.pools.first() {
            Some(p) if p.model.is_none() => Some(p),
            _ => {
                let model = model?;
                self.pools
                    .iter()
                    .find(|p| p.model.as_deref() == Some(model))
            }
        }
    }

    /// True when the route picks sub-pools by the body's model.
    pub fn by_model(&self) -> bool {
        self.pools.iter().any(|p| p.model.is_some())
    }
}

/// `affinity_hash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityHash {
    /// `crc32(sid) % n` over the tier in file order (the reference router's function).
    Crc32Mod,
    /// Highest random weight over the tier.
    Rendezvous,
    /// A new session goes to the least loaded peer of the tier; the shared segment remembers
    /// where each session was placed (a bounded table: sessions unused longest are forgotten).
    StickyTable,
}

impl AffinityHash {
    pub fn as_str(self) -> &'static str {
        match self {
            AffinityHash::Crc32Mod => "crc32_mod",
            AffinityHash::Rendezvous => "rendezvous",
            AffinityHash::StickyTable => "sticky_table",
        }
    }
}

/// How many entries `ttft_metrics` / `tps_metrics` may list: each entry after the first
/// keeps its EWMA in three cells of the pool's window slot (`pool_state::win::EXTRA`).
pub const MAX_METRICS: usize = 8;

/// One entry of `ttft_metrics` / `tps_metrics`. Every entry is measured (its statistic of
/// each window folded into its own EWMA); the gate sheds when any entry with a threshold
/// is over it.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricSpec {
    /// Name, e.g. "p80" or "avg".
    pub metric: String,
    /// Quantile in (0, 1); `None` only for "avg".
    pub q: Option<f64>,
    /// Threshold; a metric without one is measured but never judged.
    pub threshold: Option<f64>,
}

/// One row of `session_prio_table`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrioBucket {
    pub min_turn: u64,
    pub share: f64,
    pub tol: f64,
}

/// Every route option, typed, named as its catalog key.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteOpts {
    pub health_check_interval: u64,
    pub health_ban_ttl: u64,
    pub health_probe_path: String,
    pub session_affinity: bool,
    pub body_user_affinity: bool,
    pub affinity_hash: AffinityHash,
    /// `at_max` or `bounded_load` (see the catalog).
    pub affinity_overflow: String,
    pub cross_tier_fallback: bool,
    pub max_more_tries: u32,
    pub models: Vec<String>,
    pub max_body_size: u64,
    pub load_rate_limit: bool,
    pub rt_limit_factor: f64,
    pub connect_timeout_ms: u64,
    pub first_byte_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub expose_routed_headers: bool,
    /// The route's own key → owner table; `None` = the shared key file.
    pub api_keys: Option<BTreeMap<String, String>>,
    pub upstream_api_key: Option<String>,
    pub ttft_limit_ms: Option<f64>,
    pub ttft_limit_by_model: BTreeMap<String, f64>,
    pub ttft_metrics: Vec<MetricSpec>,
    pub ttft_ewma_alpha: f64,
    pub ttft_window: u64,
    pub ttft_ttl: u64,
    pub ttft_probe_window: u64,
    pub ttft_probe_per_window: u32,
    pub tps_limit_tps: Option<f64>,
    pub tps_limit_by_model: BTreeMap<String, f64>,
    pub tps_metrics: Vec<MetricSpec>,
    pub tps_ewma_alpha: f64,
    pub tps_window: u64,
    pub tps_ttl: u64,
    pub tps_probe_window: u64,
    pub tps_probe_per_window: u32,
    pub tps_min_tokens: u64,
    pub tps_min_decode_s: f64,
    pub adaptive_cc: bool,
    pub adaptive_cc_min: Option<u32>,
    pub adaptive_cc_init: Option<u32>,
    pub adaptive_cc_init_frac: Option<f64>,
    pub adaptive_cc_hold_when_idle: bool,
    pub adaptive_cc_use_ttft: bool,
    pub adaptive_cc_inc: f64,
    pub adaptive_cc_dec: f64,
    /// Follows `tps_window` unless the route sets it.
    pub adaptive_cc_interval: u64,
    pub adaptive_cc_ttl: u64,
    pub adaptive_cc_pressure_frac: f64,
    /// Kept below `adaptive_cc_pressure_frac` (when unset, lowered to min(0.7, pressure × 0.8)).
    pub adaptive_cc_slack_frac: f64,
    pub adaptive_cc_abs: f64,
    pub adaptive_cc_min_frac: f64,
    pub session_prio: bool,
    pub session_prio_full_turn: u64,
    pub session_prio_r_new: f64,
    pub session_prio_severe: f64,
    pub session_prio_release: f64,
    pub session_prio_t1_probes: u32,
    pub session_prio_warn_frac: f64,
    /// `None` = the built-in bucket table.
    pub session_prio_table: Option<Vec<PrioBucket>>,
    /// Raw rule tables, as the route file gives them (shown by `/_route_opts`).
    pub reject_rules: Vec<toml::Value>,
    /// `reject_rules` compiled by `crate::rules` at load; invalid rules are left out (and
    /// reported as soft errors `reject_rules[<i>]`, counted from 0 like every other list
    /// position; the default rule names `rule<i>` count from 1, as the reference's).
    pub reject_rules_compiled: Arc<RuleSet>,
    pub reject_rules_status: u16,
    pub reject_rules_enabled: bool,
    /// Handler name, "" = none.
    pub postprocess: String,
    pub cch_strip: bool,
    pub kimi_normalize: bool,
    pub include_usage: bool,
    pub bodylog: bool,
    pub bodylog_pct: u8,
    /// Keys the route file set (validly); everything else is a default.
    pub set_by_route: BTreeSet<&'static str>,
}

/// A value converted by its catalog kind, ready for `RouteOpts::apply`.
#[derive(Debug, Clone)]
enum Val {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Unset,
    Raw(toml::Value),
}

impl Val {
    fn default_of(spec: &OptSpec, server: &ServerDefaults) -> Val {
        match spec.default {
            OptDefault::Bool(b) => Val::Bool(b),
            OptDefault::Int(i) => Val::Int(i),
            OptDefault::Float(f) => Val::Float(f),
            OptDefault::Size(s) => Val::Int(i64::try_from(s).unwrap_or(i64::MAX)),
            OptDefault::Str(s) => Val::Str(s.to_string()),
            OptDefault::None => Val::Unset,
            OptDefault::ServerDefault(key) => match key {
                "postprocess" => Val::Str(server.postprocess.clone()),
                "load_rate_limit" => Val::Bool(server.load_rate_limit),
                "adaptive_cc_hold_when_idle" => Val::Bool(server.adaptive_cc_hold_when_idle),
                "session_affinity" => Val::Bool(server.session_affinity),
                _ => Val::Unset,
            },
        }
    }

    /// Reads `v` as `spec` says; `None` after recording the problem.
    fn read(spec: &OptSpec, v: &toml::Value, field: &str, d: &mut Diag) -> Option<Val> {
        match spec.kind {
            OptKind::Bool => value::boolean(v, field, d).map(Val::Bool),
            OptKind::Int { min, max } => value::integer(v, min, max, field, d).map(Val::Int),
            OptKind::Float { min, max } => value::number(v, min, max, field, d).map(Val::Float),
            OptKind::Size => {
                value::size(v, field, d).map(|s| Val::Int(i64::try_from(s).unwrap_or(i64::MAX)))
            }
            OptKind::Str => value::string(v, field, d).map(Val::Str),
            OptKind::Enum(allowed) => value::one_of(v, allowed, field, d).map(Val::Str),
            OptKind::Map | OptKind::List => Some(Val::Raw(v.clone())),
        }
    }

    fn bool(&self) -> bool {
        matches!(self, Val::Bool(true))
    }

    fn int(&self) -> i64 {
        match self {
            Val::Int(i) => *i,
            _ => 0,
        }
    }

    fn uint(&self) -> u64 {
        u64::try_from(self.int()).unwrap_or(0)
    }

    fn u32(&self) -> u32 {
        u32::try_from(self.int()).unwrap_or(u32::MAX)
    }

    fn opt_u32(&self) -> Option<u32> {
        match self {
            Val::Int(_) => Some(self.u32()),
            _ => None,
        }
    }

    fn float(&self) -> f64 {
        match self {
            Val::Float(f) => *f,
            Val::Int(i) => *i as f64,
            _ => 0.0,
        }
    }

    fn opt_float(&self) -> Option<f64> {
        match self {
            Val::Float(_) | Val::Int(_) => Some(self.float()),
            _ => None,
        }
    }

    fn string(&self) -> String {
        match self {
            Val::Str(s) => s.clone(),
            _ => String::new(),
        }
    }

    fn opt_string(&self) -> Option<String> {
        match self {
            Val::Str(s) => Some(s.clone()),
            _ => None,
        }
    }
}

impl RouteOpts {
    /// Every option at its catalog default (`ServerDefault` ones from `server`).
    pub fn defaults(server: &ServerDefaults) -> RouteOpts {
        let mut o = RouteOpts::zeroed();
        let mut sink = Diag::new("(catalog)");
        for spec in ROUTE_OPTS {
            o.apply(spec.key, Val::default_of(spec, server), spec.key, &mut sink);
        }
        debug_assert!(sink.errors.is_empty(), "{:?}", sink.errors);
        o
    }

    /// Placeholder values, all overwritten by `defaults` from the catalog.
    fn zeroed() -> RouteOpts {
        RouteOpts {
            health_check_interval: 0,
            health_ban_ttl: 0,
            health_probe_path: String::new(),
            session_affinity: false,
            body_user_affinity: false,
            affinity_hash: AffinityHash::Crc32Mod,
            affinity_overflow: String::new(),
            cross_tier_fallback: false,
            max_more_tries: 0,
            models: Vec::new(),
            max_body_size: 0,
            load_rate_limit: false,
            rt_limit_factor: 0.0,
            connect_timeout_ms: 0,
            first_byte_timeout_ms: 0,
            idle_timeout_ms: 0,
            expose_routed_headers: false,
            api_keys: None,
            upstream_api_key: None,
            ttft_limit_ms: None,
            ttft_limit_by_model: BTreeMap::new(),
            ttft_metrics: Vec::new(),
            ttft_ewma_alpha: 0.0,
            ttft_window: 0,
            ttft_ttl: 0,
            ttft_probe_window: 0,
            ttft_probe_per_window: 0,
            tps_limit_tps: None,
            tps_limit_by_model: BTreeMap::new(),
            tps_metrics: Vec::new(),
            tps_ewma_alpha: 0.0,
            tps_window: 0,
            tps_ttl: 0,
            tps_probe_window: 0,
            tps_probe_per_window: 0,
            tps_min_tokens: 0,
            tps_min_decode_s: 0.0,
            adaptive_cc: false,
            adaptive_cc_min: None,
            adaptive_cc_init: None,
            adaptive_cc_init_frac: None,
            adaptive_cc_hold_when_idle: false,
            adaptive_cc_use_ttft: false,
            adaptive_cc_inc: 0.0,
            adaptive_cc_dec: 0.0,
            adaptive_cc_interval: 0,
            adaptive_cc_ttl: 0,
            adaptive_cc_pressure_frac: 0.0,
            adaptive_cc_slack_frac: 0.0,
            adaptive_cc_abs: 0.0,
            adaptive_cc_min_frac: 0.0,
            session_prio: false,
            session_prio_full_turn: 0,
            session_prio_r_new: 0.0,
            session_prio_severe: 0.0,
            session_prio_release: 0.0,
            session_prio_t1_probes: 0,
            session_prio_warn_frac: 0.0,
            session_prio_table: None,
            reject_rules: Vec::new(),
            reject_rules_compiled: Arc::default(),
            reject_rules_status: 0,
            reject_rules_enabled: false,
            postprocess: String::new(),
            cch_strip: false,
            kimi_normalize: false,
            include_usage: false,
            bodylog: false,
            bodylog_pct: 0,
            set_by_route: BTreeSet::new(),
        }
    }

    /// Stores `v` (already checked against the catalog kind) in the field named `key`.
    /// Structured options (maps, lists) are validated here. Returns false when `v` was
    /// rejected (the field keeps its previous value) or `key` has no field.
    fn apply(&mut self, key: &str, v: Val, field: &str, d: &mut Diag) -> bool {
        match key {
            "health_check_interval" => self.health_check_interval = v.uint(),
            "health_ban_ttl" => self.health_ban_ttl = v.uint(),
            "health_probe_path" => {
                let p = v.string();
                if let Some(e) = probe_path_problem(&p) {
                    d.error(field, e);
                    return false;
                }
                self.health_probe_path = p;
            }
            "session_affinity" => self.session_affinity = v.bool(),
            "body_user_affinity" => self.body_user_affinity = v.bool(),
            "affinity_hash" => {
                self.affinity_hash = match v.string().as_str() {
                    "rendezvous" => AffinityHash::Rendezvous,
                    "sticky_table" => AffinityHash::StickyTable,
                    _ => AffinityHash::Crc32Mod,
                }
            }
            "affinity_overflow" => self.affinity_overflow = v.string(),
            "cross_tier_fallback" => self.cross_tier_fallback = v.bool(),
            "max_more_tries" => self.max_more_tries = v.u32(),
            "models" => match read_models(&v, field, d) {
                Some(m) => self.models = m,
                None => return false,
            },
            "max_body_size" => self.max_body_size = v.uint(),
            "load_rate_limit" => self.load_rate_limit = v.bool(),
            "rt_limit_factor" => self.rt_limit_factor = v.float(),
            "connect_timeout_ms" => self.connect_timeout_ms = v.uint(),
            "first_byte_timeout_ms" => self.first_byte_timeout_ms = v.uint(),
            "idle_timeout_ms" => self.idle_timeout_ms = v.uint(),
            "expose_routed_headers" => self.expose_routed_headers = v.bool(),
            "api_keys" => match &v {
                Val::Raw(raw) => match read_api_keys(raw, field, d) {
                    Some(k) => self.api_keys = Some(k),
                    None => return false,
                },
                _ => self.api_keys = None,
            },
            "upstream_api_key" => {
                let k = v.opt_string();
                if k.as_deref()
                    .is_some_and(|k| k.trim().is_empty() || !field_value_safe(k))
                {
                    d.error(
                        field,
                        "must be non-blank, with no control character but tab (it is sent in \
                         the Authorization header)",
                    );
                    return false;
                }
                self.upstream_api_key = k;
            }
            "ttft_limit_ms" => self.ttft_limit_ms = v.opt_float(),
            "ttft_limit_by_model" => match read_by_model(&v, field, d) {
                Some(m) => self.ttft_limit_by_model = m,
                None => return false,
            },
            "ttft_metrics" => match read_metrics(&v, field, d) {
                Some(m) => self.ttft_metrics = m,
                None => return false,
            },
            "ttft_ewma_alpha" => self.ttft_ewma_alpha = v.float(),
            "ttft_window" => self.ttft_window = v.uint(),
            "ttft_ttl" => self.ttft_ttl = v.uint(),
            "ttft_probe_window" => self.ttft_probe_window = v.uint(),
            "ttft_probe_per_window" => self.ttft_probe_per_window = v.u32(),
            "tps_limit_tps" => self.tps_limit_tps = v.opt_float(),
            "tps_limit_by_model" => match read_by_model(&v, field, d) {
                Some(m) => self.tps_limit_by_model = m,
                None => return false,
            },
            "tps_metrics" => match read_metrics(&v, field, d) {
                Some(m) => self.tps_metrics = m,
                None => return false,
            },
            "tps_ewma_alpha" => self.tps_ewma_alpha = v.float(),
            "tps_window" => self.tps_window = v.uint(),
            "tps_ttl" => self.tps_ttl = v.uint(),
            "tps_probe_window" => self.tps_probe_window = v.uint(),
            "tps_probe_per_window" => self.tps_probe_per_window = v.u32(),
            "tps_min_tokens" => self.tps_min_tokens = v.uint(),
            "tps_min_decode_s" => self.tps_min_decode_s = v.float(),
            "adaptive_cc" => self.adaptive_cc = v.bool(),
            "adaptive_cc_min" => self.adaptive_cc_min = v.opt_u32(),
            "adaptive_cc_init" => self.adaptive_cc_init = v.opt_u32(),
            "adaptive_cc_init_frac" => self.adaptive_cc_init_frac = v.opt_float(),
            "adaptive_cc_hold_when_idle" => self.adaptive_cc_hold_when_idle = v.bool(),
            "adaptive_cc_use_ttft" => self.adaptive_cc_use_ttft = v.bool(),
            "adaptive_cc_inc" => self.adaptive_cc_inc = v.float(),
            "adaptive_cc_dec" => self.adaptive_cc_dec = v.float(),
            "adaptive_cc_interval" => self.adaptive_cc_interval = v.uint(),
            "adaptive_cc_ttl" => self.adaptive_cc_ttl = v.uint(),
            "adaptive_cc_pressure_frac" => self.adaptive_cc_pressure_frac = v.float(),
            "adaptive_cc_slack_frac" => self.adaptive_cc_slack_frac = v.float(),
            "adaptive_cc_abs" => self.adaptive_cc_abs = v.float(),
            "adaptive_cc_min_frac" => self.adaptive_cc_min_frac = v.float(),
            "session_prio" => self.session_prio = v.bool(),
            "session_prio_full_turn" => self.session_prio_full_turn = v.uint(),
            "session_prio_r_new" => self.session_prio_r_new = v.float(),
            "session_prio_severe" => self.session_prio_severe = v.float(),
            "session_prio_release" => self.session_prio_release = v.float(),
            "session_prio_t1_probes" => self.session_prio_t1_probes = v.u32(),
            "session_prio_warn_frac" => self.session_prio_warn_frac = v.float(),
            "session_prio_table" => match &v {
                Val::Raw(raw) => match read_prio_table(raw, field, d) {
                    Some(t) => self.session_prio_table = Some(t),
                    None => return false,
                },
                _ => self.session_prio_table = None,
            },
            "reject_rules" => match &v {
                Val::Raw(raw) => match value::array(raw, field, d) {
                    Some(a) => {
                        let (set, problems) = rules::compile_report(a);
                        for p in problems {
                            d.soft(&format!("{field}[{}]", p.index - 1), p.message);
                        }
                        // Hits are counted by name (as the reference does): two rules of
                        // one name would show each other's hits.
                        for (i, r) in set.rules.iter().enumerate() {
                            if set.rules[..i].iter().any(|o| o.name == r.name) {
                                d.warn(
                                    field,
                                    format!(
                                        "two rules are named {:?}: they share one hit counter",
                                        r.name
                                    ),
                                );
                            }
                        }
                        self.reject_rules = a.to_vec();
                        self.reject_rules_compiled = Arc::new(set);
                    }
                    None => return false,
                },
                _ => {
                    self.reject_rules = Vec::new();
                    self.reject_rules_compiled = Arc::default();
                }
            },
            "reject_rules_status" => {
                self.reject_rules_status = u16::try_from(v.int()).unwrap_or(429)
            }
            "reject_rules_enabled" => self.reject_rules_enabled = v.bool(),
            "postprocess" => self.postprocess = v.string(),
            "cch_strip" => self.cch_strip = v.bool(),
            "kimi_normalize" => self.kimi_normalize = v.bool(),
            "include_usage" => self.include_usage = v.bool(),
            "bodylog" => self.bodylog = v.bool(),
            "bodylog_pct" => self.bodylog_pct = u8::try_from(v.int()).unwrap_or(100),
            _ => return false,
        }
        true
    }

    /// The value in effect for `key`, as JSON (for `/_route_opts`). Sizes are bytes; unset
    /// options are `null`. Secrets are never shown: `api_keys` gives the owners and a count,
    /// `upstream_api_key` gives `"(set)"`. Unknown keys give `null`.
    pub fn value_json(&self, key: &str) -> Json {
        match key {
            "health_check_interval" => json!(self.health_check_interval),
            "health_ban_ttl" => json!(self.health_ban_ttl),
            "health_probe_path" => json!(self.health_probe_path),
            "session_affinity" => json!(self.session_affinity),
            "body_user_affinity" => json!(self.body_user_affinity),
            "affinity_hash" => json!(self.affinity_hash.as_str()),
            "affinity_overflow" => json!(self.affinity_overflow),
            "cross_tier_fallback" => json!(self.cross_tier_fallback),
            "max_more_tries" => json!(self.max_more_tries),
            "models" => json!(self.models),
            "max_body_size" => json!(self.max_body_size),
            "load_rate_limit" => json!(self.load_rate_limit),
            "rt_limit_factor" => json!(self.rt_limit_factor),
            "connect_timeout_ms" => json!(self.connect_timeout_ms),
            "first_byte_timeout_ms" => json!(self.first_byte_timeout_ms),
            "idle_timeout_ms" => json!(self.idle_timeout_ms),
            "expose_routed_headers" => json!(self.expose_routed_headers),
            "api_keys" => match &self.api_keys {
                None => Json::Null,
                Some(k) => {
                    let owners: BTreeSet<&str> = k.values().map(String::as_str).collect();
                    json!({ "keys": k.len(), "owners": owners })
                }
            },
            "upstream_api_key" => match self.upstream_api_key {
                None => Json::Null,
                Some(_) => json!("(set)"),
            },
            "ttft_limit_ms" => json!(self.ttft_limit_ms),
            "ttft_limit_by_model" => json!(self.ttft_limit_by_model),
            "ttft_metrics" => metrics_json(&self.ttft_metrics),
            "ttft_ewma_alpha" => json!(self.ttft_ewma_alpha),
            "ttft_window" => json!(self.ttft_window),
            "ttft_ttl" => json!(self.ttft_ttl),
            "ttft_probe_window" => json!(self.ttft_probe_window),
            "ttft_probe_per_window" => json!(self.ttft_probe_per_window),
            "tps_limit_tps" => json!(self.tps_limit_tps),
            "tps_limit_by_model" => json!(self.tps_limit_by_model),
            "tps_metrics" => metrics_json(&self.tps_metrics),
            "tps_ewma_alpha" => json!(self.tps_ewma_alpha),
            "tps_window" => json!(self.tps_window),
            "tps_ttl" => json!(self.tps_ttl),
            "tps_probe_window" => json!(self.tps_probe_window),
            "tps_probe_per_window" => json!(self.tps_probe_per_window),
            "tps_min_tokens" => json!(self.tps_min_tokens),
            "tps_min_decode_s" => json!(self.tps_min_decode_s),
            "adaptive_cc" => json!(self.adaptive_cc),
            "adaptive_cc_min" => json!(self.adaptive_cc_min),
            "adaptive_cc_init" => json!(self.adaptive_cc_init),
            "adaptive_cc_init_frac" => json!(self.adaptive_cc_init_frac),
            "adaptive_cc_hold_when_idle" => json!(self.adaptive_cc_hold_when_idle),
            "adaptive_cc_use_ttft" => json!(self.adaptive_cc_use_ttft),
            "adaptive_cc_inc" => json!(self.adaptive_cc_inc),
            "adaptive_cc_dec" => json!(self.adaptive_cc_dec),
            "adaptive_cc_interval" => json!(self.adaptive_cc_interval),
            "adaptive_cc_ttl" => json!(self.adaptive_cc_ttl),
            "adaptive_cc_pressure_frac" => json!(self.adaptive_cc_pressure_frac),
            "adaptive_cc_slack_frac" => json!(self.adaptive_cc_slack_frac),
            "adaptive_cc_abs" => json!(self.adaptive_cc_abs),
            "adaptive_cc_min_frac" => json!(self.adaptive_cc_min_frac),
            "session_prio" => json!(self.session_prio),
            "session_prio_full_turn" => json!(self.session_prio_full_turn),
            "session_prio_r_new" => json!(self.session_prio_r_new),
            "session_prio_severe" => json!(self.session_prio_severe),
            "session_prio_release" => json!(self.session_prio_release),
            "session_prio_t1_probes" => json!(self.session_prio_t1_probes),
            "session_prio_warn_frac" => json!(self.session_prio_warn_frac),
            "session_prio_table" => match &self.session_prio_table {
                None => Json::Null,
                Some(t) => t
                    .iter()
                    .map(|b| json!({ "min_turn": b.min_turn, "share": b.share, "tol": b.tol }))
                    .collect(),
            },
            "reject_rules" => serde_json::to_value(&self.reject_rules).unwrap_or(Json::Null),
            "reject_rules_status" => json!(self.reject_rules_status),
            "reject_rules_enabled" => json!(self.reject_rules_enabled),
            "postprocess" => json!(self.postprocess),
            "cch_strip" => json!(self.cch_strip),
            "kimi_normalize" => json!(self.kimi_normalize),
            "include_usage" => json!(self.include_usage),
            "bodylog" => json!(self.bodylog),
            "bodylog_pct" => json!(self.bodylog_pct),
            _ => Json::Null,
        }
    }

    /// Fills in values that depend on other options, and checks rules across options.
    fn finish(&mut self, server: &ServerConfig, d: &mut Diag) {
        let set = |k: &str| self.set_by_route.contains(k);
        if !set("adaptive_cc_interval") {
            self.adaptive_cc_interval = self.tps_window;
        }
        if self.adaptive_cc_slack_frac >= self.adaptive_cc_pressure_frac {
            if set("adaptive_cc_slack_frac") {
                d.error(
                    "adaptive_cc_slack_frac",
                    format!(
                        "{} must be below adaptive_cc_pressure_frac ({})",
                        self.adaptive_cc_slack_frac, self.adaptive_cc_pressure_frac
                    ),
                );
            } else {
                self.adaptive_cc_slack_frac = (self.adaptive_cc_pressure_frac * 0.8).min(0.7);
            }
        }
        // The TTFT statistic is a bucket bound (`measure::TTFT_BOUNDS_MS`), never below the
        // first one: a limit at or under it sheds every request once a window has samples.
        let floor = crate::measure::TTFT_BOUNDS_MS[0];
        let low = |ms: f64| ms <= floor;
        if self.ttft_limit_ms.is_some_and(low) {
            d.warn(
                "ttft_limit_ms",
                format!(
                    "{} ms is at or below the smallest TTFT bucket ({floor} ms): the measured p80 is never lower, so every request is shed once TTFT is measured",
                    self.ttft_limit_ms.unwrap_or(0.0)
                ),
            );
        }
        for (model, ms) in self.ttft_limit_by_model.iter().filter(|(_, &ms)| low(ms)) {
            d.warn(
                &format!("ttft_limit_by_model.{model}"),
                format!(
                    "{ms} ms is at or below the smallest TTFT bucket ({floor} ms): the measured p80 is never lower, so every request is shed once TTFT is measured"
                ),
            );
        }
        if self.max_body_size == 0 && set("max_body_size") {
            // 0 is "no limit of the route's own", as nginx's client_max_body_size 0 (which
            // the reference renders this option into): the server's ceiling still holds.
            self.max_body_size = server.max_body_size_ceiling;
        } else if self.max_body_size > server.max_body_size_ceiling && !set("max_body_size") {
            // The default (10 MiB) is never above the server's ceiling (SPEC §3.2): a
            // lower ceiling lowers the routes that do not set their own limit.
            self.max_body_size = server.max_body_size_ceiling;
        } else if self.max_body_size > server.max_body_size_ceiling {
            d.error(
                "max_body_size",
                format!(
                    "{} bytes exceeds the server's max_body_size_ceiling of {} bytes",
                    self.max_body_size, server.max_body_size_ceiling
                ),
            );
        }
        if self.adaptive_cc_init.is_some() && self.adaptive_cc_init_frac.is_some() {
            d.warn(
                "adaptive_cc_init_frac",
                "adaptive_cc_init is also set and takes precedence",
            );
        }
        let route_tps =
            self.tps_limit_tps.is_some() || self.tps_metrics.iter().any(|m| m.threshold.is_some());
        if self.adaptive_cc && !route_tps {
            d.warn(
                "adaptive_cc",
                if self.tps_limit_by_model.is_empty() {
                    "without a decode rate threshold (tps_limit_tps, or a threshold in a tps_metrics entry) adaptive concurrency has nothing to steer by and is off: the static limit applies"
                } else {
                    "only the sub-pools tps_limit_by_model names have a decode rate threshold: the others have no adaptive concurrency and keep the static limit"
                },
            );
        }
    }
}

fn metrics_json(m: &[MetricSpec]) -> Json {
    m.iter()
        .map(|m| json!({ "metric": m.metric, "q": m.q, "threshold": m.threshold }))
        .collect()
}

fn raw(v: &Val) -> Option<&toml::Value> {
    match v {
        Val::Raw(r) => Some(r),
        _ => None,
    }
}

fn read_models(v: &Val, field: &str, d: &mut Diag) -> Option<Vec<String>> {
    let Some(r) = raw(v) else {
        return Some(Vec::new());
    };
    let items = value::array(r, field, d)?;
    let mut out = Vec::with_capacity(items.len());
    let mut ok = true;
    for (i, item) in items.iter().enumerate() {
        let f = format!("{field}[{i}]");
        match value::string(item, &f, d) {
            Some(s) if !s.trim().is_empty() => out.push(s),
            Some(_) => {
                d.error(&f, "model names must not be blank");
                ok = false;
            }
            None => ok = false,
        }
    }
    ok.then_some(out)
}

fn read_api_keys(r: &toml::Value, field: &str, d: &mut Diag) -> Option<BTreeMap<String, String>> {
    let t = value::table(r, field, d)?;
    if t.is_empty() {
        // It replaces the key file's keys for this route (SPEC §7): with none, the route is
        // open even when the key file protects the others.
        d.warn(
            field,
            "empty: this route accepts requests without a key, whatever the key file holds; \
             remove the table to use the key file's keys",
        );
    }
    let mut out = BTreeMap::new();
    let mut ok = true;
    for (key, owner) in t {
        // The key itself is a secret: name the entry by its owner or position only.
        let f = format!("{field}[{}]", out.len());
        if key.trim().is_empty() || key.contains([',', ':', '\r', '\n']) {
            d.error(
                &f,
                "an API key must be non-blank and contain no ',', ':' or line break",
            );
            ok = false;
        }
        match owner {
            toml::Value::String(o) if !o.trim().is_empty() => {
                out.insert(key.clone(), o.clone());
            }
            _ => {
                d.error(&f, "the owner of an API key must be a non-blank string");
                ok = false;
            }
        }
    }
    ok.then_some(out)
}

fn read_by_model(v: &Val, field: &str, d: &mut Diag) -> Option<BTreeMap<String, f64>> {
    let Some(r) = raw(v) else {
        return Some(BTreeMap::new());
    };
    let t = value::table(r, field, d)?;
    let mut out = BTreeMap::new();
    let mut ok = true;
    for (model, x) in t {
        match value::number(x, 0.0, 1e9, &join(field, model), d) {
            Some(x) => {
                out.insert(model.clone(), x);
            }
            None => ok = false,
        }
    }
    ok.then_some(out)
}

fn read_metrics(v: &Val, field: &str, d: &mut Diag) -> Option<Vec<MetricSpec>> {
    let Some(r) = raw(v) else {
        return Some(Vec::new());
    };
    let items = value::array(r, field, d)?;
    if items.is_empty() {
        d.error(
            field,
            "must list at least one metric (leave it out to use the single threshold)",
        );
        return None;
    }
    if items.len() > MAX_METRICS {
        d.error(
            field,
            format!(
                "lists {} metrics; at most {MAX_METRICS} are measured",
                items.len()
            ),
        );
        return None;
    }
    let mut out = Vec::with_capacity(items.len());
    let mut ok = true;
    for (i, item) in items.iter().enumerate() {
        let f = format!("{field}[{i}]");
        let Some(t) = value::table(item, &f, d) else {
            ok = false;
            continue;
        };
        let mut metric = None;
        let mut q = None;
        let mut threshold = None;
        let before = d.errors.len();
        for (k, x) in t {
            let kf = join(&f, k);
            match k.as_str() {
                "metric" => metric = value::string(x, &kf, d),
                "q" => q = value::number(x, 0.0, 1.0, &kf, d),
                "threshold" => threshold = value::number(x, 0.0, 1e9, &kf, d),
                _ => d.error(&kf, "unknown key (expected metric, q, threshold)"),
            }
        }
        match metric.as_deref() {
            Some(m) if m.trim().is_empty() => d.error(&join(&f, "metric"), "must not be blank"),
            Some("avg") => q = None,
            Some(_) => match q {
                Some(q) if q > 0.0 && q < 1.0 => {}
                Some(q) => d.error(
                    &join(&f, "q"),
                    format!("{q} must be strictly between 0 and 1"),
                ),
                None if t.contains_key("q") => {}
                None => d.error(
                    &join(&f, "q"),
                    "missing (required unless metric is \"avg\")",
                ),
            },
            None if t.contains_key("metric") => {}
            None => d.error(&join(&f, "metric"), "missing"),
        }
        if d.errors.len() != before {
            ok = false;
            continue;
        }
        if let Some(metric) = metric {
            out.push(MetricSpec {
                metric,
                q,
                threshold,
            });
        }
    }
    ok.then_some(out)
}

fn read_prio_table(r: &toml::Value, field: &str, d: &mut Diag) -> Option<Vec<PrioBucket>> {
    let items = value::array(r, field, d)?;
    if items.is_empty() {
        d.error(field, "must list at least one bucket");
        return None;
    }
    let before = d.errors.len();
    let mut out: Vec<PrioBucket> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let f = format!("{field}[{i}]");
        let (mt, share, tol) = match item {
            toml::Value::Array(a) if a.len() == 3 => (
                value::integer(&a[0], 1, 1_000_000_000, &format!("{f}[0]"), d),
                value::number(&a[1], 0.0, 1.0, &format!("{f}[1]"), d),
                value::number(&a[2], 0.0, 100.0, &format!("{f}[2]"), d),
            ),
            toml::Value::Table(t) => {
                let mut got = (None, None, None);
                for (k, x) in t {
                    let kf = join(&f, k);
                    match k.as_str() {
                        "min_turn" => got.0 = value::integer(x, 1, 1_000_000_000, &kf, d),
                        "share" => got.1 = value::number(x, 0.0, 1.0, &kf, d),
                        "tol" => got.2 = value::number(x, 0.0, 100.0, &kf, d),
                        _ => d.error(&kf, "unknown key (expected min_turn, share, tol)"),
                    }
                }
                for (name, missing) in [
                    ("min_turn", got.0.is_none()),
                    ("share", got.1.is_none()),
                    ("tol", got.2.is_none()),
                ] {
                    if missing && !t.contains_key(name) {
                        d.error(&join(&f, name), "missing");
                    }
                }
                got
            }
            other => {
                d.error(
                    &f,
                    format!(
                        "expected {{ min_turn, share, tol }} or [min_turn, share, tol], found {}",
                        value::type_name(other)
                    ),
                );
                continue;
            }
        };
        let (Some(mt), Some(share), Some(tol)) = (mt, share, tol) else {
            continue;
        };
        if share <= 0.0 || tol <= 0.0 {
            d.error(&f, "share and tol must be greater than 0");
        }
        let min_turn = u64::try_from(mt).unwrap_or(1);
        match out.last() {
            None if min_turn != 1 => d.error(&f, "the first bucket must start at min_turn 1"),
            Some(prev) if min_turn <= prev.min_turn => d.error(
                &f,
                format!(
                    "min_turn {min_turn} must be greater than the previous {}",
                    prev.min_turn
                ),
            ),
            _ => {}
        }
        out.push(PrioBucket {
            min_turn,
            share,
            tol,
        });
    }
    (d.errors.len() == before).then_some(out)
}

/// True when `name` is a valid route name (`[a-z0-9._-]+`).
pub fn valid_route_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        })
}

/// Names a route cannot take: its `/<name>/...` paths would hide the router's own.
fn reserved_route_name(name: &str) -> Option<&'static str> {
    match name {
        "v1" => Some("/v1/... is the path routed by the body's model"),
        "healthz" | "readyz" | "metrics" | "_routes" => Some("the router answers that path itself"),
        "." | ".." => Some("clients resolve it away in the request path"),
        _ => None,
    }
}

/// Parses one route file's table. Returns `None` when the route has errors (all recorded).
pub(crate) fn parse_route(
    name: &str,
    file: PathBuf,
    table: &toml::Table,
    server: &ServerConfig,
    d: &mut Diag,
) -> Option<RouteConfig> {
    let before = d.errors.len();
    if !valid_route_name(name) {
        d.error(
            "name",
            format!("route name {name:?} (the file stem) must match [a-z0-9._-]+"),
        );
    } else if let Some(why) = reserved_route_name(name) {
        d.error(
            "name",
            format!("route name {name:?} (the file stem) is reserved: {why}"),
        );
    }
    let mut opts = RouteOpts::defaults(&server.defaults);
    let mut pools = Vec::new();
    let mut saw_flat = false;
    let mut saw_by_model = false;
    for (key, v) in table {
        match key.as_str() {
            "peers" => {
                saw_flat = true;
                if let Some(peers) = parse_peers(v, "peers", d) {
                    pools.push(Pool { model: None, peers });
                }
            }
            "peers_by_model" => {
                saw_by_model = true;
                let Some(t) = value::table(v, "peers_by_model", d) else {
                    continue;
                };
                if t.is_empty() {
                    d.error("peers_by_model", "lists no model");
                }
                for (model, list) in t {
                    let f = join("peers_by_model", model);
                    if model.trim().is_empty() {
                        d.error(&f, "model names must not be blank");
                        continue;
                    }
                    if let Some(peers) = parse_peers(list, &f, d) {
                        pools.push(Pool {
                            model: Some(model.clone()),
                            peers,
                        });
                    }
                }
            }
            _ => match catalog::spec(key) {
                Some(spec) => {
                    if let Some(val) = Val::read(spec, v, key, d) {
                        if opts.apply(spec.key, val, key, d) {
                            opts.set_by_route.insert(spec.key);
                        }
                    }
                }
                None => d.error(key, unknown_key_message(key)),
            },
        }
    }
    match (saw_flat, saw_by_model) {
        (true, true) => d.error("peers", "set either peers or peers_by_model, not both"),
        (false, false) => d.error(
            "peers",
            "missing: set peers = [...] or a [peers_by_model] table",
        ),
        _ => {}
    }
    let total: usize = pools.iter().map(|p| p.peers.len()).sum();
    if total > MAX_PEERS_PER_ROUTE {
        let f = if saw_by_model {
            "peers_by_model"
        } else {
            "peers"
        };
        d.error(
            f,
            format!("{total} peers; a route may have at most {MAX_PEERS_PER_ROUTE}"),
        );
    }
    opts.finish(server, d);

    let mut models: BTreeSet<String> = opts.models.iter().cloned().collect();
    models.extend(pools.iter().filter_map(|p| p.model.clone()));
    if saw_by_model {
        for (opt, map) in [
            ("ttft_limit_by_model", &opts.ttft_limit_by_model),
            ("tps_limit_by_model", &opts.tps_limit_by_model),
        ] {
            for model in map.keys().filter(|m| !models.contains(*m)) {
                d.warn(&join(opt, model), "this route serves no such model");
            }
        }
    }
    if d.errors.len() != before {
        return None;
    }
    Some(RouteConfig {
        name: name.to_string(),
        file,
        pools,
        models: models.into_iter().collect(),
        opts,
    })
}

fn unknown_key_message(key: &str) -> String {
    let known = ROUTE_OPTS
        .iter()
        .map(|s| s.key)
        .chain(["peers", "peers_by_model"]);
    match value::near_key(key, known) {
        Some(k) => format!("unknown key (did you mean {k:?}?)"),
        None => "unknown key".to_string(),
    }
}

const PEER_KEYS: &str = "host, port, name, priority, max_concurrency, probe, gpu";

/// Parses an array of peer tables; `None` when any peer has an error.
fn parse_peers(v: &toml::Value, field: &str, d: &mut Diag) -> Option<Vec<PeerConfig>> {
    let items = value::array(v, field, d)?;
    if items.is_empty() {
        d.warn(
            field,
            "no peers: every request to this pool gets 503 no_healthy_peer",
        );
    }
    let before = d.errors.len();
    let mut out: Vec<PeerConfig> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let f = format!("{field}[{i}]");
        if let Some(peer) = parse_peer(item, &f, d) {
            if out.iter().any(|p| p.name == peer.name) {
                d.error(
                    &join(&f, "name"),
                    format!("duplicate peer name {:?} in this pool", peer.name),
                );
            }
            // A peer's in-flight count, ban and EWMAs live in the segment by address: two
            // entries for one backend would share them, and each request would count twice.
            if let Some((j, other)) = out.iter().enumerate().find(|(_, p)| p.addr == peer.addr) {
                d.error(
                    &join(&f, "port"),
                    format!(
                        "{} is also {field}[{j}] ({:?}): one backend listed twice in a pool",
                        peer.addr, other.name
                    ),
                );
            }
            out.push(peer);
        }
    }
    (d.errors.len() == before).then_some(out)
}

fn parse_peer(v: &toml::Value, f: &str, d: &mut Diag) -> Option<PeerConfig> {
    let t = value::table(v, f, d)?;
    let before = d.errors.len();
    let mut host = None;
    let mut port = None;
    let mut name = None;
    let mut priority = 0i32;
    let mut max_concurrency = DEFAULT_PEER_MAX_CONCURRENCY;
    let mut probe = None;
    let mut gpu = None;
    for (k, x) in t {
        let kf = join(f, k);
        match k.as_str() {
            "host" => match value::string(x, &kf, d) {
                Some(h) if h.is_empty() || !h.bytes().all(|b| b.is_ascii_graphic()) => {
                    d.error(&kf, format!("{h:?} is not a host name or address"))
                }
                h => host = h,
            },
            "port" => {
                port = value::integer(x, 1, 65_535, &kf, d).and_then(|p| u16::try_from(p).ok())
            }
            "name" => match value::string(x, &kf, d) {
                Some(n) if n.trim().is_empty() => d.error(&kf, "must not be blank"),
                Some(n) if !field_value_safe(&n) => d.error(
                    &kf,
                    format!(
                        "{n:?} holds a control character; the name is sent in the X-Routed-Peer \
                         header, where HTTP allows none but tab"
                    ),
                ),
                n => name = n,
            },
            "priority" => {
                if let Some(p) = value::integer(x, i64::from(i32::MIN), i64::from(i32::MAX), &kf, d)
                {
                    priority = i32::try_from(p).unwrap_or(0);
                }
            }
            "max_concurrency" => {
                if let Some(m) = value::integer(x, 1, 1_000_000, &kf, d) {
                    max_concurrency = u32::try_from(m).unwrap_or(DEFAULT_PEER_MAX_CONCURRENCY);
                }
            }
            "probe" => {
                if let Some(p) = value::string(x, &kf, d) {
                    match probe_path_problem(&p) {
                        Some(e) => d.error(&kf, e),
                        None => probe = Some(p),
                    }
                }
            }
            "gpu" => gpu = value::string(x, &kf, d),
            _ => d.error(&kf, format!("unknown peer key (expected {PEER_KEYS})")),
        }
    }
    if !t.contains_key("host") {
        d.error(&join(f, "host"), "missing");
    }
    if !t.contains_key("port") {
        d.error(&join(f, "port"), "missing");
    }
    let (Some(host), Some(port)) = (host, port) else {
        return None;
    };
    let addr = match resolve(&host, port) {
        Ok(a) => a,
        Err(e) => {
            d.error(&join(f, "host"), format!("cannot resolve {host:?}: {e}"));
            return None;
        }
    };
    if d.errors.len() != before {
        return None;
    }
    let name = name.unwrap_or_else(|| {
        if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        }
    });
    Some(PeerConfig {
        host,
        port,
        addr,
        name,
        priority,
        max_concurrency,
        probe,
        gpu,
    })
}

/// Whether `s` can go into an HTTP field value as it is: no control character but tab
/// (RFC 9110 §5.5 forbids CR, LF and NUL there, and strict clients refuse the others).
fn field_value_safe(s: &str) -> bool {
    !s.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f)
}

/// What is wrong with `p` as a health probe's request target, if anything: it must be an
/// absolute path, `/` then visible ASCII (a space or a control character would break the
/// probe's request line; non-ASCII goes percent-encoded).
fn probe_path_problem(p: &str) -> Option<String> {
    if !p.starts_with('/') {
        Some(format!("{p:?} must start with '/'"))
    } else if !p.bytes().all(|b| b.is_ascii_graphic()) {
        Some(format!(
            "{p:?} must be visible ASCII, with no space or control character \
             (percent-encode them)"
        ))
    } else {
        None
    }
}

/// Whether `host` is an address already (no name to look up again).
pub fn is_ip_literal(host: &str) -> bool {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse::<std::net::IpAddr>().is_ok()
}

/// Resolves `host:port`: the lowest IPv4 address it gives, else the lowest address
/// (backends and the mock listen on IPv4 by default, and "localhost" often resolves to ::1
/// first; the lowest, so a name whose answers rotate keeps giving the same one).
pub fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    let addrs = resolve_all(host, port)?;
    pick_address(&addrs).ok_or_else(|| "no address found".to_string())
}

/// Every address `host:port` gives.
pub fn resolve_all(host: &str, port: u16) -> Result<Vec<SocketAddr>, String> {
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    Ok((host, port)
        .to_socket_addrs()
        .map_err(|e| e.to_string())?
        .collect())
}

fn pick_address(addrs: &[SocketAddr]) -> Option<SocketAddr> {
    let v4 = addrs.iter().filter(|a| a.is_ipv4()).min();
    v4.or_else(|| addrs.iter().min()).copied()
}

#[cfg(test)]
mod resolve_tests {
    use super::*;

    #[test]
    fn the_lowest_ipv4_address_is_the_one_used_whatever_the_order() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let answers = [
            a("10.0.0.9:80"),
            a("[::1]:80"),
            a("10.0.0.2:80"),
            a("10.0.0.5:80"),
        ];
        let mut rotated = answers;
        rotated.rotate_left(2);
        assert_eq!(pick_address(&answers), Some(a("10.0.0.2:80")));
        assert_eq!(pick_address(&rotated), Some(a("10.0.0.2:80")));
        assert_eq!(
            pick_address(&[a("[::2]:80"), a("[::1]:80")]),
            Some(a("[::1]:80"))
        );
        assert_eq!(pick_address(&[]), None);
    }
}

#[cfg(test)]
mod reject_rules_tests {
    use std::path::PathBuf;

    /// One valid and one invalid rule: the route loads with the valid rule compiled, and the
    /// invalid one is a soft error naming the file and `reject_rules[1]`.
    #[test]
    fn invalid_reject_rule_is_a_soft_error_and_the_route_loads() {
        let route = r#"
peers = [ { host = "127.0.0.1", port = 8001 } ]
reject_rules_enabled = true
[[reject_rules]]
name = "too-long"
status = 413
field = "input_bytes"
op = "gt"
value = 10
[[reject_rules]]
name = "broken"
field = "model"
op = "like"
value = "x"
"#;
        let c = crate::config::load_from_strs(None, &[("r", route)]).expect("the route loads");
        let o = &c.route("r").expect("route r").opts;
        assert_eq!(o.reject_rules.len(), 2, "the raw list is kept as written");
        let set = &o.reject_rules_compiled;
        assert_eq!(set.rules.len(), 1);
        assert_eq!(set.rules[0].name, "too-long");
        assert_eq!(set.rules[0].status, Some(413));
        assert_eq!(set.rules[0].source, "input_bytes gt 10");
        let hit = set
            .evaluate(br#"{"model":"m","messages":[]}"#)
            .expect("input_bytes gt 10");
        assert_eq!(hit.rule.name, "too-long");
        assert!(set.evaluate(b"{}").is_none());

        assert_eq!(c.soft_errors.len(), 1, "{:?}", c.soft_errors);
        let e = &c.soft_errors[0];
        assert_eq!(e.file, PathBuf::from("(embedded)/r.toml"));
        assert_eq!(e.field, "reject_rules[1]");
        assert!(
            e.message.contains("\"broken\"") && e.message.contains("unknown op \"like\""),
            "{e}"
        );
        assert!(o.set_by_route.contains("reject_rules"));
    }

    /// A route without rules, and one whose only rule is invalid, compile to empty sets.
    #[test]
    fn no_rules_compile_to_an_empty_set() {
        let base = "peers = [ { host = \"127.0.0.1\", port = 8001 } ]\n";
        let c = crate::config::load_from_strs(None, &[("r", base)]).unwrap();
        assert!(c.routes[0].opts.reject_rules_compiled.is_empty());
        let bad = format!("{base}reject_rules = [ {{ all = [] }} ]\n");
        let c = crate::config::load_from_strs(None, &[("r", &bad)]).unwrap();
        assert!(c.routes[0].opts.reject_rules_compiled.is_empty());
        assert_eq!(c.soft_errors[0].field, "reject_rules[0]");
        assert!(c.soft_errors[0].message.contains("\"rule1\" dropped"));
    }
}
