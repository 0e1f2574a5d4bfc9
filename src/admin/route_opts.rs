//! `/_route_opts`: every route option from the one catalog that validation also reads —
//! key, label, group, kind, default, description — with the value in effect and whether
//! the route set it; engine internals under `advanced`.

use serde_json::{json, Value};

use crate::config::catalog::{OptDefault, OptKind, ROUTE_OPTS};
use crate::snapshot::{RouteRt, Snapshot};

fn default_json(d: OptDefault, snap: &Snapshot) -> Value {
    match d {
        OptDefault::Bool(b) => json!(b),
        OptDefault::Int(i) => json!(i),
        OptDefault::Float(f) => json!(f),
        OptDefault::Size(s) => json!(s),
        OptDefault::Str(s) => json!(s),
        OptDefault::None => Value::Null,
        OptDefault::ServerDefault(key) => {
            let d = &snap.config.server.defaults;
            match key {
                "postprocess" => json!(d.postprocess),
                "load_rate_limit" => json!(d.load_rate_limit),
                "adaptive_cc_hold_when_idle" => json!(d.adaptive_cc_hold_when_idle),
                "session_affinity" => json!(d.session_affinity),
                _ => Value::Null,
            }
        }
    }
}

fn kind_json(k: OptKind) -> Value {
    match k {
        OptKind::Int { min, max } => json!({"type": "int", "min": min, "max": max}),
        OptKind::Float { min, max } => json!({"type": "float", "min": min, "max": max}),
        OptKind::Enum(values) => json!({"type": "enum", "values": values}),
        other => json!({"type": other.name()}),
    }
}

pub fn render(snap: &Snapshot, route: &RouteRt) -> Value {
    let opts = &route.cfg.opts;
    let (mut main, mut advanced) = (Vec::new(), Vec::new());
    for spec in ROUTE_OPTS {
        let entry = json!({
            "key": spec.key,
            "label": spec.label,
            "group": spec.group,
            "kind": kind_json(spec.kind),
            "default": default_json(spec.default, snap),
            "description": spec.description,
            "value": opts.value_json(spec.key),
            "set_by_route": opts.set_by_route.contains(spec.key),
        });
        if spec.advanced {
            advanced.push(entry);
        } else {
            main.push(entry);
        }
    }
    // The static capacity per sub-pool: the highest tier's configured capacity, which is
    // the ceiling adaptive concurrency moves under.
    let pools: Vec<Value> = route
        .pools
        .iter()
        .map(|p| {
            let top = p.peers.iter().map(|x| x.priority).max();
            let static_max: u64 = p
                .peers
                .iter()
                .filter(|x| Some(x.priority) == top)
                .map(|x| x.max_concurrency as u64)
                .sum();
            let floor = opts
                .adaptive_cc_min
                .map(u64::from)
                .unwrap_or_else(|| {
                    ((static_max as f64 * opts.adaptive_cc_min_frac).floor() as u64).max(1)
                })
                .min(static_max);
            let start = opts
                .adaptive_cc_init
                .map(u64::from)
                .or_else(|| {
                    opts.adaptive_cc_init_frac
                        .map(|f| (static_max as f64 * f).floor() as u64)
                })
                .unwrap_or(floor)
                .clamp(floor, static_max.max(floor));
            json!({"model": p.model, "static_max": static_max, "floor": floor, "start": start})
        })
        .collect();
    json!({
        "route": route.name(),
        "options": main,
        "advanced": advanced,
        "adaptive_cc_bounds": pools,
    })
}
