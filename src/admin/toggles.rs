//! Loopback-only runtime toggles of a route: `_reject_rules_toggle`, `_cch_strip_toggle`,
//! `_kimi_normalize_toggle`, `_include_usage_toggle`, `_bodylog_toggle`. Each takes
//! `on=1|0` (also true/false, on/off, yes/no) or `reset=1` (back to the route option);
//! `_bodylog_toggle` also takes `pct=0..100`. Stored in the segment: they survive reloads
//! and apply on every worker at once.

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
    let mut changed = false;
    if query_param(query, "reset").as_deref() == Some("1") {
        cells::set_toggle(seg, r.slot, cell, None);
        if name == "bodylog_toggle" {
            seg.route_cell(r.slot, route::BODYLOG_PCT)
                .store(0, cells::Relaxed);
        }
        changed = true;
    }
    if let Some(v) = query_param(query, "on") {
        match parse_on(&v) {
            Some(on) => {
                cells::set_toggle(seg, r.slot, cell, Some(on));
                changed = true;
            }
            None => return bad("use ?on=1 (enable), ?on=0 (disable) or ?reset=1"),
        }
    }
    if name == "bodylog_toggle" {
        if let Some(p) = query_param(query, "pct") {
            match p.parse::<u8>() {
                Ok(p) if p <= 100 => {
                    seg.route_cell(r.slot, route::BODYLOG_PCT)
                        .store(p as u64 + 1, cells::Relaxed);
                    changed = true;
                }
                _ => return bad("pct must be an integer from 0 to 100"),
            }
        }
    }
    let stored = seg.route_cell(r.slot, cell).load(cells::Relaxed);
    let mut body = json!({
        "route": r.name(),
        "ok": true,
        "changed": changed,
        "enabled": cells::toggle(seg, r.slot, cell, default),
        "source": if stored == 0 { "route" } else { "runtime" },
        "route_default": default,
    });
    if name == "bodylog_toggle" {
        let pct = seg
            .route_cell(r.slot, route::BODYLOG_PCT)
            .load(cells::Relaxed);
        body["sample_pct"] = json!(if pct == 0 {
            opts.bodylog_pct as u64
        } else {
            pct - 1
        });
    }
    Some(Response::json(200, &body))
}
