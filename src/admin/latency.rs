//! Endpoints of measurement and control (SPEC §5, §10): `_ttft_status`, `_tps_status`,
//! `_cluster_avg`, `_rate_limit_status`, and the loopback-only `_ttft_toggle`,
//! `_ttft_limit`, `_tps_toggle`, `_tps_limit`, `_rate_limit_toggle`. Everything is per pool
//! (keyed by model, `_` for a flat route) and lives in the segment, so it holds on every
//! worker and survives reloads.

use serde_json::{json, Map, Value};

use super::{query_param, Response};
use crate::cells::Relaxed;
use crate::control::latency::{self, Signal};
use crate::control::pool_state::{self as ps, ctl, win};
use crate::control::{aimd, ewma, prio_state, session_prio};
use crate::pipeline::error_response::ProxyError;
use crate::snapshot::{PoolRt, RouteRt};
use crate::worker::WorkerCtx;

fn pool_key(p: &PoolRt) -> String {
    p.model.clone().unwrap_or_else(|| "_".into())
}

fn pools_for<'a>(r: &'a RouteRt, model: Option<&str>) -> Vec<&'a PoolRt> {
    r.pools
        .iter()
        .filter(|p| model.is_none() || p.model.as_deref() == model)
        .collect()
}

/// One metric of a pool's resolved list, as the status endpoints show it.
struct Shown {
    name: String,
    q: Option<f64>,
    ewma: Option<f64>,
    threshold: Option<f64>,
}

fn signal_status(ctx: &WorkerCtx, r: &RouteRt, sig: Signal) -> Value {
    let seg = &ctx.shared.seg;
    let opts = &r.cfg.opts;
    let now_s = ps::now_s();
    let cfg = latency::signal_cfg(opts, sig);
    let first_metric = latency::metric_name(opts, sig, 0);
    let mut pools = Map::new();
    // The reference's route-level shape too (notes-edges §4.1): the first metric's EWMA per
    // pool, and per pool the resolved list with its thresholds and EWMAs.
    let unit = if sig == Signal::Ttft { "ms" } else { "tps" };
    let mut ewma_by_pool = Map::new();
    let mut lists = Vec::new();
    for p in &r.pools {
        let slot = sig.slot(p);
        let thr = latency::threshold(opts, sig, p, seg, now_s);
        let e = latency::current_ewma(opts, sig, p, seg, now_s);
        let judged = latency::judge(opts, sig, p, seg, now_s);
        let hit = judged.first_hit.is_some();
        if let Some(e) = e {
            ewma_by_pool.insert(pool_key(p), json!(e));
        }
        // Every metric of the resolved list (name, q, EWMA, threshold): the first with the
        // threshold in force, the later entries of a declared list with their own.
        let declared = sig.metrics(opts);
        let ttl = cfg.ewma.ttl_s;
        let resolved: Vec<Shown> = std::iter::once(Shown {
            name: first_metric.clone(),
            q: declared.first().map_or(Some(sig.default_q()), |d| d.q),
            ewma: e,
            threshold: thr.map(|t| t.0),
        })
        .chain(declared.iter().enumerate().skip(1).map(|(i, m)| {
            let tag = latency::metric_tag(opts, sig, i);
            Shown {
                name: m.metric.clone(),
                q: m.q,
                ewma: ps::metric_ewma(seg, slot, i, tag, now_s, ttl),
                threshold: m.threshold,
            }
        }))
        .collect();
        let metrics: Vec<Value> = resolved
            .iter()
            .map(|m| json!({"metric": m.name, "ewma": m.ewma, "threshold": m.threshold}))
            .collect();
        // The reference's items leave absent values out.
        let items: Vec<Value> = resolved
            .iter()
            .map(|m| {
                let mut item = Map::new();
                item.insert("metric".into(), json!(m.name));
                for (k, v) in [
                    ("q".to_string(), m.q),
                    (format!("threshold_{unit}"), m.threshold),
                    (format!("ewma_{unit}"), m.ewma),
                ] {
                    if let Some(v) = v {
                        item.insert(k, json!(v));
                    }
                }
                Value::Object(item)
            })
            .collect();
        // Where the first metric's threshold comes from: a declared list's first entry
        // without one takes the override or the static limit (`latency::threshold`).
        let source = match thr.map(|t| t.1) {
            Some(ewma::SRC_METRICS) => "declared",
            Some(ewma::SRC_OVERRIDE) => "override",
            None if !declared.is_empty() => "declared",
            _ => "static",
        };
        lists.push(json!({"model": pool_key(p), "source": source, "items": items}));
        let mut v = json!({
            "metric": first_metric,
            "ewma": e,
            "threshold": thr.map(|t| t.0),
            "threshold_source": thr.map(|t| t.1),
            "active": judged.has_threshold && !ps::gate_off(seg, slot),
            "enforcing": judged.has_threshold && !ps::gate_off(seg, slot) && (sig == Signal::Ttft || !opts.adaptive_cc),
            "hit": hit,
            "hit_metric": judged.first_hit.map(|b| latency::metric_name(opts, sig, b.metric)),
            "metrics": metrics,
            "runtime_off": ps::gate_off(seg, slot),
            "probe_used_cur_window": ps::probes_used(seg, slot, now_s, cfg.probe_window_s),
            "trips_while_rate_limit_off": seg.route_cell(slot, win::TRIPS_WHILE_OFF).load(Relaxed),
        });
        if sig == Signal::Tps && opts.adaptive_cc {
            let pr = latency::aimd_params(opts);
            let smax = latency::static_max(p);
            let cur = latency::aimd_current(opts, p, seg, now_s);
            // The same live value the controller's tick uses.
            let conc = latency::pool_inflight(p, seg) as f64;
            let (at_pressure, at_slack) = aimd::predict(
                &pr,
                cur.unwrap_or_else(|| aimd::start(&pr, smax)),
                conc,
                smax,
            );
            // The limit the gate applies now (the healthy capacity caps it), or none when
            // adaptive concurrency is not in force (`latency::adaptive_in_force`).
            let in_force = latency::adaptive_in_force(opts, p, seg);
            let loads = p.loads(seg, warmroute_shm::now_ms());
            let capacity = crate::pipeline::admission::healthy_capacity(&loads);
            v["adaptive_cc_in_force"] = json!(in_force);
            v["adaptive_cc"] = json!(cur);
            v["adaptive_cc_limit"] =
                json!(in_force.then(|| latency::concurrency_limit(opts, p, seg, now_s, capacity)));
            v["adaptive_cc_min"] = json!(aimd::floor(&pr, smax));
            v["adaptive_cc_max"] = json!(smax);
            v["adaptive_cc_init"] = json!(aimd::start(&pr, smax));
            v["adaptive_cc_conc"] = json!(conc);
            v["adaptive_cc_rej"] = json!(ps::ctl_cell(seg, p.slots.ctl, ctl::REJ).load(Relaxed));
            v["adaptive_cc_at_pressure"] = json!(at_pressure);
            v["adaptive_cc_at_slack"] = json!(at_slack);
        }
        pools.insert(pool_key(p), v);
    }
    let (limit, by_model) = match sig {
        Signal::Ttft => (opts.ttft_limit_ms, &opts.ttft_limit_by_model),
        Signal::Tps => (opts.tps_limit_tps, &opts.tps_limit_by_model),
    };
    let mut out = json!({
        "route": r.name(),
        "signal": sig.name(),
        "alpha": cfg.ewma.alpha,
        "window_s": cfg.ewma.window_s,
        "ttl_s": cfg.ewma.ttl_s,
        "ttl": cfg.ewma.ttl_s,
        "probe_window_s": cfg.probe_window_s,
        "probe_window": cfg.probe_window_s,
        "probe_per_window": cfg.probe_per_window,
        "adaptive_cc_on": opts.adaptive_cc,
        "adaptive_cc_hold_when_idle": opts.adaptive_cc_hold_when_idle,
        "adaptive_cc_interval": opts.adaptive_cc_interval,
        "metrics": lists,
        "pools": pools,
    });
    out[format!("ewma_{unit}")] = Value::Object(ewma_by_pool);
    let limit_key = if sig == Signal::Ttft {
        "ttft_limit_ms"
    } else {
        "tps_limit_tps"
    };
    if let Some(l) = limit {
        out[limit_key] = json!(l);
    }
    out[format!("{}_limit_by_model", sig.name())] = json!(by_model);
    out
}

/// A three-way switch's new cell value from its query: `reset=1` → 0 (back to the
/// configuration), `on=1` → 1, `on=0` → 2; None when the query says neither.
fn switch_value(q: Option<&str>) -> Option<u64> {
    if query_param(q, "reset").as_deref() == Some("1") {
        return Some(0);
    }
    match query_param(q, "on")
        .as_deref()
        .and_then(super::toggles::parse_on)?
    {
        true => Some(1),
        false => Some(2),
    }
}

/// The endpoints this module answers, parsed from the name after the route's `_`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Status(Signal),
    Toggle(Signal),
    Limit(Signal),
    RateLimitToggle,
    RateLimitStatus,
    SessionPrioToggle,
    SessionStatus,
    ClusterAvg,
}

impl Endpoint {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "ttft_status" => Self::Status(Signal::Ttft),
            "tps_status" => Self::Status(Signal::Tps),
            "ttft_toggle" => Self::Toggle(Signal::Ttft),
            "tps_toggle" => Self::Toggle(Signal::Tps),
            "ttft_limit" => Self::Limit(Signal::Ttft),
            "tps_limit" => Self::Limit(Signal::Tps),
            "rate_limit_toggle" => Self::RateLimitToggle,
            "rate_limit_status" => Self::RateLimitStatus,
            "session_prio_toggle" => Self::SessionPrioToggle,
            "session_status" => Self::SessionStatus,
            "cluster_avg" => Self::ClusterAvg,
            _ => return None,
        })
    }

    /// The ones that change state answer loopback only.
    fn loopback_only(self) -> bool {
        matches!(
            self,
            Self::Toggle(_) | Self::Limit(_) | Self::RateLimitToggle | Self::SessionPrioToggle
        )
    }
}

/// Handle a measurement/control endpoint; None when `name` is not one of them.
pub fn handle(
    ctx: &WorkerCtx,
    r: &RouteRt,
    name: &str,
    q: Option<&str>,
    loopback: bool,
) -> Option<Response> {
    // Another endpoint's name is not this module's to answer (not even with a 400 for
    // its `model`): an unknown one gets its 404.
    let endpoint = Endpoint::parse(name)?;
    let seg = &ctx.shared.seg;
    let now_s = ps::now_s();
    let model = query_param(q, "model");
    if endpoint.loopback_only() && !loopback {
        return Some(Response::error(
            &ProxyError::Forbidden("toggles answer loopback (127.0.0.1, ::1) only"),
            Some(r.name()),
        ));
    }
    let bad = |msg: &str| {
        Some(Response::json(
            400,
            &json!({"route": r.name(), "ok": false, "error": msg}),
        ))
    };
    let pools = pools_for(r, model.as_deref());
    if pools.is_empty() {
        return bad("no such model on this route");
    }
    // What is set for the whole route (no `model=`) is also kept in the route's record,
    // for the pools a reload adds later.
    let route_wide = model.is_none();
    match endpoint {
        Endpoint::Status(sig) => Some(Response::json(200, &signal_status(ctx, r, sig))),
        Endpoint::Toggle(sig) => {
            // The same values as every other toggle: 1/0, true/false, on/off, yes/no.
            let on = match query_param(q, "on")
                .as_deref()
                .and_then(super::toggles::parse_on)
            {
                Some(on) => on,
                None => return bad("use ?on=0 (disable) | ?on=1 (enable)"),
            };
            for p in &pools {
                ps::set_gate_off(seg, sig.slot(p), !on);
            }
            if route_wide {
                ps::set_wide_gate_off(seg, r.wide, sig.index(), !on);
            }
            Some(Response::json(
                200,
                &json!({"route": r.name(), "ok": true, "signal": sig.name(), "active": on}),
            ))
        }
        Endpoint::Limit(sig) => {
            let key = if sig == Signal::Ttft { "ms" } else { "tps" };
            let ttl = match query_param(q, "ttl").map(|t| t.parse::<u64>()) {
                None => ewma::DEFAULT_OVERRIDE_TTL_S,
                Some(Ok(t)) => t,
                Some(Err(_)) => {
                    return bad("ttl must be a whole number of seconds (0 = never expires)")
                }
            };
            if let Some(v) = query_param(q, key) {
                match v.parse::<f64>() {
                    Ok(x) if x == 0.0 || (x > 0.0 && x.is_finite()) => {
                        let v = (x > 0.0).then_some((x, ttl));
                        for p in &pools {
                            ps::set_threshold_override(seg, sig.slot(p), v, now_s);
                        }
                        if route_wide {
                            ps::set_wide_override(seg, r.wide, sig.index(), v, now_s);
                        }
                    }
                    _ => return bad("the limit must be a number ≥ 0 (0 clears the override)"),
                }
            }
            let per: Map<String, Value> = pools
                .iter()
                .map(|p| {
                    let t = latency::threshold(&r.cfg.opts, sig, p, seg, now_s);
                    (pool_key(p), json!({"override": ps::threshold_override(seg, sig.slot(p), now_s), "threshold": t.map(|t| t.0), "source": t.map(|t| t.1)}))
                })
                .collect();
            Some(Response::json(
                200,
                &json!({"route": r.name(), "ok": true, "signal": sig.name(), "pools": per}),
            ))
        }
        Endpoint::RateLimitToggle => {
            let Some(v) = switch_value(q) else {
                return bad("use ?on=0 | ?on=1 | ?reset=1");
            };
            for p in &pools {
                ps::ctl_cell(seg, p.slots.ctl, ctl::RATE_LIMIT).store(v, Relaxed);
            }
            if route_wide {
                ps::set_wide_rate_limit(seg, r.wide, v);
            }
            Some(Response::json(200, &rate_limit_status(ctx, r)))
        }
        Endpoint::RateLimitStatus => Some(Response::json(200, &rate_limit_status(ctx, r))),
        Endpoint::SessionPrioToggle => {
            let slot = r.prio_slot;
            let Some(v) = switch_value(q) else {
                return bad("use ?on=0 | ?on=1 | ?reset=1");
            };
            seg.route_cell(slot, prio_state::cell::TOGGLE)
                .store(v, Relaxed);
            Some(Response::json(200, &session_status(ctx, r)))
        }
        Endpoint::SessionStatus => Some(Response::json(200, &session_status(ctx, r))),
        Endpoint::ClusterAvg => {
            // Per pool, and route-wide as the reference shows it (notes-edges §4.1): the
            // pools' samples, taken at the same instants, added bucket by bucket.
            let mut per = Map::new();
            let mut buckets = [None::<u64>; latency::CLUSTER_AVG_SAMPLES as usize];
            let mut realtime_sum = 0;
            for p in &r.pools {
                let (avg, samples) = latency::cluster_avg(p, seg, now_s);
                let realtime = latency::pool_inflight(p, seg);
                realtime_sum += realtime;
                for (b, v) in buckets
                    .iter_mut()
                    .zip(latency::cluster_samples(p, seg, now_s))
                {
                    if let Some(v) = v {
                        *b = Some(b.unwrap_or(0) + v);
                    }
                }
                per.insert(
                    pool_key(p),
                    json!({"realtime_sum": realtime, "avg_5min": avg, "samples": samples}),
                );
            }
            let set: Map<String, Value> = buckets
                .iter()
                .enumerate()
                .filter_map(|(i, b)| b.map(|v| (i.to_string(), json!(v))))
                .collect();
            let samples = set.len() as u64;
            let sum: u64 = buckets.iter().flatten().sum();
            let avg = if samples > 0 {
                sum as f64 / samples as f64
            } else {
                0.0
            };
            let cur = (now_s / latency::CLUSTER_AVG_INTERVAL_S) % latency::CLUSTER_AVG_SAMPLES;
            Some(Response::json(
                200,
                &json!({
                    "route": r.name(),
                    "interval_s": latency::CLUSTER_AVG_INTERVAL_S,
                    "realtime_sum": realtime_sum,
                    "buckets": set,
                    "samples": samples,
                    "avg_5min": avg,
                    "cur_bucket_idx": cur,
                    "pools": per,
                }),
            ))
        }
    }
}

/// Session turn priority: the effective table with per-bucket admits, rejections and cache
/// hit rate, the no-header counters, and the route-wide hit rate.
pub fn session_status(ctx: &WorkerCtx, r: &RouteRt) -> Value {
    let seg = &ctx.shared.seg;
    let opts = &r.cfg.opts;
    let slot = r.prio_slot;
    let c = |i| seg.route_cell(slot, i).load(Relaxed);
    let table = &r.prio_table;
    let buckets: Vec<Value> = table
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let (ptok, ctok) = (c(prio_state::cell::PTOK + i), c(prio_state::cell::CTOK + i));
            json!({
                "bucket": session_prio::bucket_label(i, table),
                "min_turn": b.min_turn, "share": b.share, "tol": b.tol,
                "admitted": c(prio_state::cell::ADMITS + i),
                "rejected": c(prio_state::cell::REJECTS + i),
                "ptok": ptok, "ctok": ctok,
                "hit_rate": if ptok > 0 { ctok as f64 / ptok as f64 } else { 0.0 },
            })
        })
        .collect();
    let nohdr: Map<String, Value> = session_prio::NoHdr::ALL
        .iter()
        .map(|n| {
            (
                format!("bnohdr:{}", n.as_str()),
                json!(c(prio_state::cell::NOHDR + n.index())),
            )
        })
        .collect();
    let rc = |i| seg.route_cell(r.slot, i).load(Relaxed);
    let (ptok, ctok) = (
        rc(crate::cells::route::PROMPT_TOKENS),
        rc(crate::cells::route::CACHED_TOKENS),
    );
    json!({
        "route": r.name(),
        "enabled": prio_state::enabled(seg, slot, opts),
        "source": if c(prio_state::cell::TOGGLE) == 0 { "route" } else { "runtime" },
        "header": session_prio::HEADER,
        "turn1_hold": c(prio_state::cell::HOLD) == 1,
        "table": buckets,
        "no_header": nohdr,
        "ptok": ptok,
        "ctok": ctok,
        "hit_rate": if ptok > 0 { ctok as f64 / ptok as f64 } else { 0.0 },
    })
}

/// The master switch per pool: effective state, the layer it comes from, trips per gate;
/// and the two configured layers under the runtime override: the route's own option
/// (`null` when the route does not set it) and the server default.
pub fn rate_limit_status(ctx: &WorkerCtx, r: &RouteRt) -> Value {
    let seg = &ctx.shared.seg;
    let opts = &r.cfg.opts;
    let route_option = opts
        .set_by_route
        .contains("load_rate_limit")
        .then_some(opts.load_rate_limit);
    let server_default = match route_option {
        // Inherited: the route's value is the server default it was built with.
        None => opts.load_rate_limit,
        Some(_) => ctx.snapshot().config.server.defaults.load_rate_limit,
    };
    let per: Map<String, Value> = r
        .pools
        .iter()
        .map(|p| {
            let (on, source) = latency::rate_limit_state(opts, p, seg);
            (
                pool_key(p),
                json!({
                    "enabled": on,
                    "source": source,
                    "trips": {
                        "concurrency": ps::ctl_cell(seg, p.slots.ctl, ctl::TRIPS_CONCURRENCY).load(Relaxed),
                        "ttft": seg.route_cell(p.slots.ttft, win::TRIPS_WHILE_OFF).load(Relaxed),
                        "tps": seg.route_cell(p.slots.tps, win::TRIPS_WHILE_OFF).load(Relaxed),
                    },
                }),
            )
        })
        .collect();
    json!({"route": r.name(), "route_option": route_option, "server_default": server_default, "pools": per})
}
