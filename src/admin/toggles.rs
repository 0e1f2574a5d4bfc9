//! Loopback-only runtime toggles of a route: `_reject_rules_toggle`, `_cch_strip_toggle`,
//! `_kimi_normalize_toggle`, `_include_usage_toggle`, `_bodylog_toggle`. Each takes
//! `on=1|0` (also true/false, on/off, yes/no) or `on=default` (back to the route option);
//! `_bodylog_toggle` also takes `pct=0..100`. `reset=1` zeroes the feature's counters, as
//! the reference's toggles do (rule hits; bodies parsed and stripped; Kimi id changes;
//! usage injections); on `_bodylog_toggle`, which has none, it is `on=default` and the
//! route's sample percentage. The answer says what changed (`changes`), as the reference's
//! does. Stored in the segment: they survive reloads and apply on every worker at once.

use serde_json::json;

use super::{query_param, Response};
use crate::cells::{self, route};
use crate::pipeline::error_response::ProxyError;
use crate::snapshot::RouteRt;
use crate::worker::WorkerCtx;

/// A toggle's `on` value: 1/0, true/false, on/off, yes/no, in any case.
pub(super) fn parse_on(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

/// Handle `/<route>/_<name>` when it is a toggle; None when `name` is not one.
pub fn handle(
    ctx: &WorkerCtx,
    r: &RouteRt,
    name: &str,
    query: Option<&str>,
    loopback: bool,
) -> Option<Response> {
    let opts = &r.cfg.opts;
    let (cell, default) = match name {
        "reject_rules_toggle" => (route::TOGGLE_REJECT_RULES, opts.reject_rules_enabled),
        "cch_strip_toggle" => (route::TOGGLE_CCH_STRIP, opts.cch_strip),
        "kimi_normalize_toggle" => (route::TOGGLE_KIMI_NORMALIZE, opts.kimi_normalize),
        "include_usage_toggle" => (route::TOGGLE_INCLUDE_USAGE, opts.include_usage),
        "bodylog_toggle" => (route::TOGGLE_BODYLOG, opts.bodylog),
        _ => return None,
    };
    if !loopback {
        return Some(Response::error(
            &ProxyError::Forbidden("toggles answer loopback (127.0.0.1, ::1) only"),
            Some(r.name()),
        ));
    }
    let seg = &ctx.shared.seg;
    let bad = |msg: &str| {
        Some(Response::json(
            400,
            &json!({"route": r.name(), "ok": false, "error": msg}),
        ))
    };
    // The feature's counters, which `reset=1` zeroes (none for the body log).
    let counters: Vec<(&str, usize)> = match name {
        "cch_strip_toggle" => vec![
            ("parsed_total", route::BODIES_PARSED),
            ("stripped_total", route::CCH_STRIPPED),
        ],
        "kimi_normalize_toggle" => vec![
            ("changes_total", route::KIMI_CHANGES),
            ("req_count", route::KIMI_REQUESTS),
        ],
        "include_usage_toggle" => vec![("injected_total", route::USAGE_INJECTED)],
        _ => Vec::new(),
    };
    // Every parameter is checked before anything changes.
    let on = match query_param(query, "on") {
        None => None,
        Some(v) if v.eq_ignore_ascii_case("default") => Some(None),
        Some(v) => match parse_on(&v) {
            Some(on) => Some(Some(on)),
            None => {
                return bad("use ?on=1 (enable), ?on=0 (disable), ?on=default (the route's setting) or ?reset=1 (zero the counters)")
            }
        },
    };
    let pct = match query_param(query, "pct") {
        Some(p) if name == "bodylog_toggle" => match p.parse::<u8>() {
            Ok(p) if p <= 100 => Some(p),
            _ => return bad("pct must be an integer from 0 to 100"),
        },
        _ => None,
    };
    let reset = query_param(query, "reset").as_deref() == Some("1");
    let mut changes = serde_json::Map::new();
    if reset {
        if name == "bodylog_toggle" {
            cells::set_toggle(seg, r.slot, cell, None);
            seg.route_cell(r.slot, route::BODYLOG_PCT)
                .store(0, cells::Relaxed);
            changes.insert("enabled".into(), json!("default"));
            changes.insert("sample_pct".into(), json!("default"));
        } else {
            for &(_, c) in &counters {
                seg.route_cell(r.slot, c).store(0, cells::Relaxed);
            }
            if name == "reject_rules_toggle" {
                for &s in r.rule_slots.iter().flatten() {
                    seg.route_cell(s, route::RULE_HITS).store(0, cells::Relaxed);
                }
            }
            changes.insert("counters_reset".into(), json!(true));
        }
    }
    if let Some(on) = on {
        cells::set_toggle(seg, r.slot, cell, on);
        changes.insert("enabled".into(), on.map_or(json!("default"), |b| json!(b)));
    }
    if let Some(p) = pct {
        seg.route_cell(r.slot, route::BODYLOG_PCT)
            .store(p as u64 + 1, cells::Relaxed);
        changes.insert("sample_pct".into(), json!(p));
    }
    let stored = seg.route_cell(r.slot, cell).load(cells::Relaxed);
    let mut body = json!({
        "route": r.name(),
        "ok": true,
        "changed": !changes.is_empty(),
        "changes": changes,
        "enabled": cells::toggle(seg, r.slot, cell, default),
        "source": if stored == 0 { "route" } else { "runtime" },
        "route_default": default,
    });
    for (key, c) in counters {
        body[key] = json!(seg.route_cell(r.slot, c).load(cells::Relaxed));
    }
    match name {
        "bodylog_toggle" => {
            let pct = seg
                .route_cell(r.slot, route::BODYLOG_PCT)
                .load(cells::Relaxed);
            body["sample_pct"] = json!(if pct == 0 {
                opts.bodylog_pct as u64
            } else {
                pct - 1
            });
        }
        "include_usage_toggle" => {
            body["note"] = json!(
                "the usage frame an injection causes is read for the token counts and removed from the client's stream"
            );
        }
        _ => {}
    }
    Some(Response::json(200, &body))
}
