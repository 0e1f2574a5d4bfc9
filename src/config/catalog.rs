//! The route option catalog: one entry per option a route file may set.
//!
//! Contract: this table is the single source of every route option's key, type, bounds,
//! default and description. Parsing (`route.rs`) validates against it, `RouteOpts` is built
//! from its defaults before the route file's values are applied, and the `/_route_opts`
//! endpoint renders it. Nothing else may hold a literal default for a route option.
//! `peers` and `peers_by_model` are structure, not options, and are not listed here.

/// The type of an option's value, with inclusive bounds for numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptKind {
    /// A TOML boolean (also the strings yes/no, on/off, 1/0, true/false, with a warning).
    Bool,
    /// An integer within `min..=max`.
    Int { min: i64, max: i64 },
    /// A number (TOML integer or float) within `min..=max`.
    Float { min: f64, max: f64 },
    /// A byte size: `"10m"`, `"512k"`, `"1g"` (powers of 1024, any case) or integer bytes.
    Size,
    /// A free-form string.
    Str,
    /// A string that must be one of the listed values.
    Enum(&'static [&'static str]),
    /// A table, validated by the option's own rule.
    Map,
    /// An array, validated by the option's own rule.
    List,
}

impl OptKind {
    /// Short name used by `/_route_opts`.
    pub fn name(&self) -> &'static str {
        match self {
            OptKind::Bool => "bool",
            OptKind::Int { .. } => "int",
            OptKind::Float { .. } => "float",
            OptKind::Size => "size",
            OptKind::Str => "string",
            OptKind::Enum(_) => "enum",
            OptKind::Map => "map",
            OptKind::List => "list",
        }
    }
}

/// The value an option has when the route file does not set it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptDefault {
    Bool(bool),
    Int(i64),
    Float(f64),
    Size(u64),
    Str(&'static str),
    /// Unset: the feature the option controls stays off, or an empty collection.
    None,
    /// Taken from the server file's `[defaults]` table under this key.
    ServerDefault(&'static str),
}

/// One route option.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptSpec {
    pub key: &'static str,
    pub label: &'static str,
    pub group: &'static str,
    pub kind: OptKind,
    pub default: OptDefault,
    pub description: &'static str,
    /// Engine internals: settable, but not something an operator is expected to tune.
    pub advanced: bool,
}

/// Values accepted by `affinity_hash`.
pub const AFFINITY_HASHES: &[&str] = &["crc32_mod", "rendezvous", "sticky_table"];
/// Values accepted by `affinity_overflow`.
pub const AFFINITY_OVERFLOWS: &[&str] = &["at_max", "bounded_load"];
/// Values accepted by `postprocess` ("" = no handler).
pub const POSTPROCESS_HANDLERS: &[&str] = &["", "strip_actual_usage", "vllm_format"];

const SECS_MAX: i64 = 86_400;
const MS_MAX: i64 = 86_400_000;

const fn opt(
    key: &'static str,
    label: &'static str,
    group: &'static str,
    kind: OptKind,
    default: OptDefault,
    description: &'static str,
) -> OptSpec {
    OptSpec {
        key,
        label,
        group,
        kind,
        default,
        description,
        advanced: false,
    }
}

const fn adv(
    key: &'static str,
    label: &'static str,
    group: &'static str,
    kind: OptKind,
    default: OptDefault,
    description: &'static str,
) -> OptSpec {
    OptSpec {
        key,
        label,
        group,
        kind,
        default,
        description,
        advanced: true,
    }
}

const fn int(min: i64, max: i64) -> OptKind {
    OptKind::Int { min, max }
}

const fn float(min: f64, max: f64) -> OptKind {
    OptKind::Float { min, max }
}

use OptDefault as D;
use OptKind as K;

/// Every route option, grouped as `/_route_opts` shows them.
pub static ROUTE_OPTS: &[OptSpec] = &[
    // --- health ---
    opt("health_check_interval", "Health check interval (s)", "health", int(1, SECS_MAX), D::Int(10),
        "Seconds between two probe rounds over every peer of the route."),
    opt("health_ban_ttl", "Ban duration (s)", "health", int(1, SECS_MAX), D::Int(300),
        "Seconds a peer stays banned after a failed probe or connect; refreshed while it keeps failing."),
    opt("health_probe_path", "Probe path", "health", K::Str, D::Str("/v1/models"),
        "Path probed with GET on each peer that has no probe of its own; must start with '/'."),
    // --- routing ---
    opt("session_affinity", "Session affinity", "routing", K::Bool, D::ServerDefault("session_affinity"),
        "Keep every request of a session on the peer its id hashes to; off spreads all traffic by least connections."),
    opt("body_user_affinity", "Use body `user` as session id", "routing", K::Bool, D::Bool(true),
        "Accept the OpenAI `user` body field as the last session id source."),
    opt("affinity_hash", "Affinity hash", "routing", K::Enum(AFFINITY_HASHES), D::Str("crc32_mod"),
        "How a session id picks a peer: crc32 modulo the tier size; rendezvous hashing (moves fewer sessions when peers change); or `sticky_table`: a session's first request goes to the least loaded peer and a table shared by all workers keeps the session there (no two busy sessions pile onto one peer by hash chance; a session whose peer is banned or removed is placed again; the table holds 65,536 sessions and forgets the least recently used)."),
    opt("affinity_overflow", "When a pinned peer overflows", "routing", K::Enum(AFFINITY_OVERFLOWS), D::Str("at_max"),
        "When a session's peer is busy: `at_max` moves the request to the least loaded peer once the pinned peer reaches its max_concurrency; `bounded_load` keeps it on its peer (max_concurrency is then a soft weight) unless that peer is also loaded above twice the tier's average or 1.5 times its own max_concurrency, which avoids re-prefilling warm sessions elsewhere when the whole pool is saturated."),
    opt("cross_tier_fallback", "Retry on lower tiers", "routing", K::Bool, D::Bool(false),
        "Let retries also try the least loaded peer of each lower-priority tier."),
    opt("max_more_tries", "Extra attempts", "routing", int(0, 32), D::Int(2),
        "Further attempts on other peers after a connect failure or a 502/503, while nothing has reached the client."),
    opt("models", "Served models", "routing", K::List, D::None,
        "Model names this route answers for on the unprefixed /v1 path, besides the keys of peers_by_model."),
    // --- limits ---
    opt("max_body_size", "Max request body", "limits", K::Size, D::Size(10 * 1024 * 1024),
        "Largest request body accepted (413 above it); never more than the server's max_body_size_ceiling. \"0\" = no limit of the route's own (the ceiling applies), as nginx's client_max_body_size 0."),
    opt("load_rate_limit", "Load-based 429s", "limits", K::Bool, D::ServerDefault("load_rate_limit"),
        "Route layer of the rate-limit switch: off lets requests through the concurrency, TTFT and decode-rate gates while they keep measuring."),
    adv("rt_limit_factor", "Concurrency limit factor", "limits", float(0.01, 100.0), D::Float(1.0),
        "Multiplier applied to the pool limit by the concurrency gate."),
    // --- forwarding ---
    adv("connect_timeout_ms", "Connect timeout (ms)", "forwarding", int(1, MS_MAX), D::Int(2_000),
        "Time allowed to open a connection to a peer before it counts as a connect failure."),
    adv("first_byte_timeout_ms", "First byte timeout (ms)", "forwarding", int(1, MS_MAX), D::Int(3_600_000),
        "Time allowed between sending the request and the peer's first response byte."),
    adv("idle_timeout_ms", "Idle timeout (ms)", "forwarding", int(1, MS_MAX), D::Int(3_600_000),
        "Longest silence allowed between two reads of the peer's response."),
    opt("expose_routed_headers", "X-Routed-* headers", "forwarding", K::Bool, D::Bool(true),
        "Add the X-Routed-Session/Source/Mode/Peer/Retries headers to proxied responses."),
    // --- auth ---
    opt("api_keys", "Route API keys", "auth", K::Map, D::None,
        "Table of key = owner used instead of the shared key file for this route."),
    opt("upstream_api_key", "Upstream API key", "auth", K::Str, D::None,
        "When set, the Authorization header sent to the peers carries this key instead of the client's; the health probes carry it too."),
    // --- ttft ---
    opt("ttft_limit_ms", "TTFT limit (ms)", "ttft", float(0.0, 1e9), D::None,
        "Shed with 429 while the pool's TTFT EWMA is at or above this many ms; unset = no TTFT shedding."),
    opt("ttft_limit_by_model", "TTFT limit per model (ms)", "ttft", K::Map, D::None,
        "Table of model = ms overriding ttft_limit_ms for that model's sub-pool."),
    adv("ttft_metrics", "TTFT metrics", "ttft", K::List, D::None,
        "List of up to 8 { metric, q, threshold } tables, each measured; any at or over its threshold sheds (instead of the single p80 threshold)."),
    adv("ttft_ewma_alpha", "TTFT EWMA weight", "ttft", float(0.0, 1.0), D::Float(0.3),
        "Weight of the newest window in the TTFT EWMA."),
    adv("ttft_window", "TTFT window (s)", "ttft", int(1, 3_600), D::Int(20),
        "Length of one TTFT histogram window."),
    adv("ttft_ttl", "TTFT EWMA lifetime (s)", "ttft", int(1, SECS_MAX), D::Int(60),
        "Seconds without new samples after which the TTFT EWMA is forgotten (the gate opens)."),
    adv("ttft_probe_window", "TTFT probe window (s)", "ttft", int(1, 3_600), D::Int(10),
        "Length of the window in which a few requests pass a tripped TTFT gate."),
    adv("ttft_probe_per_window", "TTFT probes per window", "ttft", int(0, 100_000), D::Int(5),
        "Requests let through a tripped TTFT gate per probe window, so the EWMA can recover."),
    // --- tps ---
    opt("tps_limit_tps", "Decode rate limit (tok/s)", "tps", float(0.0, 1e9), D::None,
        "Shed with 429 (adaptive concurrency off) or steer the adaptive limit while the low-tail decode rate EWMA is at or below this; unset = off."),
    opt("tps_limit_by_model", "Decode rate limit per model", "tps", K::Map, D::None,
        "Table of model = tok/s overriding tps_limit_tps for that model's sub-pool."),
    adv("tps_metrics", "Decode rate metrics", "tps", K::List, D::None,
        "List of up to 8 { metric, q, threshold } tables, each measured; any at or under its threshold sheds (instead of the single low-tail threshold)."),
    adv("tps_ewma_alpha", "Decode rate EWMA weight", "tps", float(0.0, 1.0), D::Float(0.3),
        "Weight of the newest window in the decode rate EWMA."),
    adv("tps_window", "Decode rate window (s)", "tps", int(1, 3_600), D::Int(20),
        "Length of one decode rate histogram window."),
    adv("tps_ttl", "Decode rate EWMA lifetime (s)", "tps", int(1, SECS_MAX), D::Int(60),
        "Seconds without new samples after which the decode rate EWMA is forgotten."),
    adv("tps_probe_window", "Decode rate probe window (s)", "tps", int(1, 3_600), D::Int(10),
        "Length of the window in which a few requests pass a tripped decode rate gate."),
    adv("tps_probe_per_window", "Decode rate probes per window", "tps", int(0, 100_000), D::Int(5),
        "Requests let through a tripped decode rate gate per probe window."),
    adv("tps_min_tokens", "Min tokens per sample", "tps", int(0, 1_000_000), D::Int(16),
        "Responses with fewer completion tokens give no decode rate sample."),
    adv("tps_min_decode_s", "Min duration per sample (s)", "tps", float(0.0, 3_600.0), D::Float(0.5),
        "Responses shorter than this give no decode rate sample."),
    // --- adaptive concurrency ---
    opt("adaptive_cc", "Adaptive concurrency", "adaptive_cc", K::Bool, D::Bool(false),
        "Move the pool's concurrency limit by AIMD against the decode rate and TTFT EWMAs instead of keeping it static."),
    opt("adaptive_cc_min", "Adaptive floor (slots)", "adaptive_cc", int(1, 1_000_000), D::None,
        "Lowest adaptive limit; unset = adaptive_cc_min_frac of the static maximum."),
    opt("adaptive_cc_init", "Adaptive start (slots)", "adaptive_cc", int(1, 1_000_000), D::None,
        "Limit a fresh or expired controller starts from, and that low traffic never shrinks below."),
    opt("adaptive_cc_init_frac", "Adaptive start (fraction)", "adaptive_cc", float(0.001, 1.0), D::None,
        "adaptive_cc_init given as a fraction of the static maximum."),
    opt("adaptive_cc_hold_when_idle", "Hold limit when idle", "adaptive_cc", K::Bool,
        D::ServerDefault("adaptive_cc_hold_when_idle"),
        "Low or absent traffic never lowers the adaptive limit and it never expires; overload still shrinks it."),
    opt("adaptive_cc_use_ttft", "TTFT steers the limit", "adaptive_cc", K::Bool, D::Bool(true),
        "Count a TTFT EWMA above its threshold as overload for the adaptive limit."),
    adv("adaptive_cc_inc", "Growth factor", "adaptive_cc", float(1.0, 10.0), D::Float(1.02),
        "Factor applied to the limit per interval under pressure or unmet demand."),
    adv("adaptive_cc_dec", "Shrink factor", "adaptive_cc", float(0.01, 1.0), D::Float(0.97),
        "Factor applied to the limit per interval under overload or slack."),
    adv("adaptive_cc_interval", "Update interval (s)", "adaptive_cc", int(1, 3_600), D::Int(20),
        "Seconds between two updates of the limit; when unset it follows tps_window."),
    adv("adaptive_cc_ttl", "Limit lifetime (s)", "adaptive_cc", int(1, SECS_MAX), D::Int(300),
        "Seconds an adaptive limit survives without updates (ignored while holding when idle)."),
    adv("adaptive_cc_pressure_frac", "Pressure fraction", "adaptive_cc", float(0.001, 1.0), D::Float(0.9),
        "In-flight at or above this share of the limit counts as pressure."),
    adv("adaptive_cc_slack_frac", "Slack fraction", "adaptive_cc", float(0.001, 1.0), D::Float(0.7),
        "In-flight below this share of the limit counts as slack; must stay below the pressure fraction."),
    adv("adaptive_cc_abs", "Headroom (slots)", "adaptive_cc", float(0.0, 1_000_000.0), D::Float(5.0),
        "Free slots under which the pool counts as under pressure whatever the fractions say."),
    adv("adaptive_cc_min_frac", "Floor fraction", "adaptive_cc", float(0.001, 1.0), D::Float(0.4),
        "Floor of the adaptive limit as a share of the static maximum, when adaptive_cc_min is unset."),
    // --- session turn priority ---
    opt("session_prio", "Session turn priority", "session_prio", K::Bool, D::Bool(false),
        "Grade the concurrency, TTFT and decode rate gates by the turn number in x-phanrouter-session."),
    adv("session_prio_full_turn", "Fully warm turn", "session_prio", int(1, 1_000_000_000), D::Int(32),
        "Turn from which a session gets the full share of the pool."),
    adv("session_prio_r_new", "Share of a new session", "session_prio", float(0.001, 1.0), D::Float(0.85),
        "Share of the concurrency limit a first turn may fill; warmer turns rise towards 1."),
    adv("session_prio_severe", "Hard trip factor", "session_prio", float(1.0, 100.0), D::Float(1.5),
        "EWMA beyond threshold times this rejects every turn bucket."),
    adv("session_prio_release", "Release factor", "session_prio", float(0.001, 1.0), D::Float(0.9),
        "First turns are held out until the TTFT EWMA falls below threshold times this."),
    adv("session_prio_t1_probes", "First-turn probes", "session_prio", int(0, 100_000), D::Int(1),
        "Probe slots per window reserved for first turns while the gate is tripped."),
    adv("session_prio_warn_frac", "Missing-header warn share", "session_prio", float(0.0, 1.0), D::Float(0.2),
        "Warn when more than this share of a minute's requests carry no usable session header."),
    adv("session_prio_table", "Turn bucket table", "session_prio", K::List, D::None,
        "Replacement bucket table: a list of { min_turn, share, tol } (or [min_turn, share, tol]), first min_turn 1, strictly ascending."),
    // --- content rules ---
    opt("reject_rules", "Reject rules", "rules", K::List, D::None,
        "Rules that refuse requests by their content; see [[reject_rules]]."),
    opt("reject_rules_status", "Reject status", "rules", int(400, 599), D::Int(429),
        "Status of a rejection when the matching rule names none."),
    opt("reject_rules_enabled", "Reject rules on", "rules", K::Bool, D::Bool(false),
        "Start with the reject rules switched on (a runtime toggle can change it)."),
    // --- transforms ---
    opt("postprocess", "Response post-processing", "transforms", K::Enum(POSTPROCESS_HANDLERS),
        D::ServerDefault("postprocess"),
        "Handler rewriting 2xx responses: strip_actual_usage, vllm_format, or \"\" for none."),
    opt("cch_strip", "Strip Claude Code billing prefix", "transforms", K::Bool, D::Bool(true),
        "Remove the per-request billing header line Claude Code puts in the system prompt, which defeats prefix caching."),
    opt("kimi_normalize", "Normalise Kimi tool-call ids", "transforms", K::Bool, D::Bool(true),
        "Renumber tool-call ids for Kimi models so the prompt prefix stays stable."),
    opt("include_usage", "Request usage in streams", "transforms", K::Bool, D::Bool(true),
        "Ask streaming backends for a final usage frame and hide it from clients that did not ask for it."),
    // --- body log ---
    opt("bodylog", "Body logging", "bodylog", K::Bool, D::Bool(true),
        "Send request and response bodies to the body-log listener; has effect only when a listener is configured."),
    opt("bodylog_pct", "Body log sampling (%)", "bodylog", int(0, 100), D::Int(100),
        "Percentage of requests whose bodies are logged."),
];

/// The catalog entry for `key`.
pub fn spec(key: &str) -> Option<&'static OptSpec> {
    ROUTE_OPTS.iter().find(|s| s.key == key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn keys_are_unique_and_well_formed() {
        let mut seen = BTreeSet::new();
        for s in ROUTE_OPTS {
            assert!(seen.insert(s.key), "duplicate key {}", s.key);
            assert!(!s.label.is_empty() && !s.description.is_empty() && !s.group.is_empty());
            assert!(s
                .key
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
            assert_eq!(spec(s.key), Some(s));
        }
        assert!(spec("peers").is_none() && spec("peers_by_model").is_none());
    }

    #[test]
    fn defaults_fit_kind_and_bounds() {
        for s in ROUTE_OPTS {
            match (s.kind, s.default) {
                (OptKind::Bool, OptDefault::Bool(_)) => {}
                (OptKind::Int { min, max }, OptDefault::Int(v)) => {
                    assert!(min <= v && v <= max, "{}", s.key)
                }
                (OptKind::Float { min, max }, OptDefault::Float(v)) => {
                    assert!(min <= v && v <= max, "{}", s.key)
                }
                (OptKind::Size, OptDefault::Size(_)) => {}
                (OptKind::Str, OptDefault::Str(_)) => {}
                (OptKind::Enum(vals), OptDefault::Str(v)) => {
                    assert!(vals.contains(&v), "{}", s.key)
                }
                (_, OptDefault::None) => {}
                (_, OptDefault::ServerDefault(k)) => assert_eq!(k, s.key),
                other => panic!("{}: default does not match kind: {other:?}", s.key),
            }
        }
    }
}
