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
    // Per sub-pool, the band adaptive concurrency moves in, from the functions the
    // controller itself uses (a second computation here once disagreed with it).
    let params = crate::control::latency::aimd_params(opts);
    let limit = crate::pipeline::error_response::limit_json;
    let pools: Vec<Value> = route
        .pools
        .iter()
        .map(|p| {
            let smax = crate::control::latency::static_max(p);
            json!({
                "model": p.model,
                "static_max": limit(smax),
                "floor": limit(crate::control::aimd::floor(&params, smax)),
                "start": limit(crate::control::aimd::start(&params, smax)),
            })
        })
        .collect();
    json!({
        "route": route.name(),
        "options": main,
        "advanced": advanced,
        "adaptive_cc_bounds": pools,
    })
}
