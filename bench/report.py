#!/usr/bin/env python3
"""Turn one bench/run work directory into a JSON result file and a section of RESULTS.md.

Called by bench/run; standard library only. The section for a scenario sits between
`<!-- bench:SCENARIO:begin -->` and `<!-- bench:SCENARIO:end -->` and is replaced on each run;
anything outside the markers is left alone.
"""

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
from datetime import datetime, timezone
from statistics import median

GROUP_TITLES = {
    "pinned": "pinned",
    "shared": "shared",
}


def sh(cmd):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


def machine_info(driver, loadavg_before):
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            io_uring_disabled = f.read().strip()
    except OSError:
        io_uring_disabled = "n/a"
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpus_online": os.cpu_count(),
        "cpu_model": cpu,
        "kernel": platform.release(),
        "io_uring_disabled_sysctl": io_uring_disabled,
        "loadavg_before": loadavg_before,
        "warmroute_driver": driver,
        "nginx": (sh(["nginx", "-v"]).splitlines() or [""])[0],
        "haproxy": " ".join(sh(["haproxy", "-v"]).splitlines()[0].split()[:3]),
        "wrk": " ".join(sh(["wrk", "-v"]).splitlines()[0].split()[:3]),
    }


def read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def load_jsonl(path):
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def flatten(rec):
    w = rec["wrk"]
    lat = w["latency_us"]
    secs = w["duration_us"] / 1e6
    return {
        "party": rec["party"],
        "group": rec["group"],
        "case": rec["case"],
        "kind": rec["kind"],
        "round": rec.get("round", 1),
        "conns": rec["conns"],
        "requests": w["requests"],
        "duration_s": round(secs, 3),
        "rps": round(w["requests"] / secs, 1),
        "bytes": w["bytes"],
        "non2xx": rec["non2xx"],
        "errors": w["errors"],
        "latency_us": lat,
        "cpu_busy_pct": rec.get("cpu_busy_pct", {}),
        "proc_cpu_ns": rec.get("proc_cpu_ns"),
    }


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def med(recs, key):
    vals = [key(r) for r in recs or []]
    vals = [v for v in vals if v is not None]
    return median(vals) if vals else None


# Every overhead party, in table order, with what it is and where it gets the session id.
PARTIES = [
    ("direct", "pinned", "the backend itself (wrk → nginx `return 200`)", "`X-Session-ID` (ignored)"),
    ("warmroute-1w", "pinned", "warmroute `--workers 1 --no-pin`", "`X-Session-ID` header"),
    ("warmroute-1w-body", "pinned", "the same warmroute process", "`metadata.session_id` in the JSON body (no header)"),
    ("warmroute-bp-body", "pinned", "a second warmroute `--workers 1 --no-pin`, with `busy_poll_us = {bp}`",
     "`metadata.session_id` in the JSON body (no header)"),
    ("nginx-1w", "pinned", "nginx `worker_processes 1`, `hash $http_x_session_id consistent`", "`X-Session-ID` header"),
    ("nginx-lua-1w", "pinned", "nginx `worker_processes 1` + Lua module, `balancer_by_lua_block`: "
     "peer = `ngx.crc32_long(id) % n`", "`X-Session-ID` header"),
    ("haproxy-1t", "pinned", "haproxy `nbthread 1`, `balance hdr(X-Session-ID)` + `hash-type consistent`",
     "`X-Session-ID` header"),
    ("vllm-router", "pinned", "vllm-router `--policy consistent_hash`", "`X-Session-ID` header"),
    ("sglang-router", "pinned", "sglang-router `--policy manual`", "`X-SMG-Routing-Key` header"),
    ("direct-shared", "shared", "the backend itself, wrk unpinned", "`X-Session-ID` (ignored)"),
    ("warmroute-2w", "shared", "warmroute `--workers 2` (pins its workers)", "`X-Session-ID` header"),
    ("warmroute-2w-body", "shared", "the same warmroute process", "`metadata.session_id` in the JSON body (no header)"),
    ("nginx-2w", "shared", "nginx `worker_processes 2`, `worker_cpu_affinity auto`, `reuseport`", "`X-Session-ID` header"),
    ("nginx-lua-2w", "shared", "as nginx-lua-1w with 2 workers", "`X-Session-ID` header"),
    ("haproxy-2t", "shared", "haproxy `nbthread 2` + `cpu-map`", "`X-Session-ID` header"),
]
PARTY_ORDER = {p[0]: i for i, p in enumerate(PARTIES)}

# Ratios printed per case (when both parties ran): warmroute with the id in the body first,
# since that is what the targets are about.
RATIOS = [
    ("warmroute-1w-body", "haproxy-1t"),
    ("warmroute-1w-body", "nginx-1w"),
    ("warmroute-1w-body", "nginx-lua-1w"),
    ("warmroute-1w-body", "vllm-router"),
    ("warmroute-1w-body", "sglang-router"),
    ("warmroute-1w", "haproxy-1t"),
    ("warmroute-1w", "nginx-1w"),
    ("warmroute-1w", "nginx-lua-1w"),
    ("warmroute-1w", "vllm-router"),
    ("warmroute-1w", "sglang-router"),
    ("warmroute-1w-body", "warmroute-1w"),
    ("warmroute-bp-body", "warmroute-1w-body"),
    ("warmroute-2w-body", "haproxy-2t"),
    ("warmroute-2w-body", "nginx-2w"),
    ("warmroute-2w-body", "nginx-lua-2w"),
    ("warmroute-2w", "haproxy-2t"),
    ("warmroute-2w", "nginx-2w"),
    ("warmroute-2w", "nginx-lua-2w"),
    ("warmroute-2w-body", "warmroute-2w"),
    ("warmroute-2w", "warmroute-1w"),
    ("warmroute-2w-body", "warmroute-1w-body"),
]

# c1 p50 at or above this looks like a per-request floor (Nagle / delayed ACK: ~40 ms).
FLOOR_US = 20000


def build_summary(runs, proxy_cpu=None):
    """Per case: each party's throughput and latency figures, and the comparison ratios.

    Throughput figures come from the round with the highest req/s (the least disturbed by
    the rest of the machine); every round's req/s is kept alongside.
    """
    best, rounds, lat, lat_local, task_us, paced = {}, {}, {}, {}, {}, {}
    for r in runs:
        key = (r["case"], r["party"])
        if r["kind"] == "paced":
            paced.setdefault(key, []).append(r)
        elif r["kind"] == "throughput":
            rounds.setdefault(key, []).append(r["rps"])
            if r.get("proc_cpu_ns") and r["requests"]:
                task_us.setdefault(key, []).append(r["proc_cpu_ns"] / 1000 / r["requests"])
            if key not in best or r["rps"] > best[key]["rps"]:
                best[key] = r
        elif r["kind"] == "latency":
            lat[key] = r
        elif r["kind"] == "latency-local":
            lat_local[key] = r
    direct_of = {"pinned": "direct", "shared": "direct-shared"}
    cases = []
    for case in ("json", "stream", "prompt"):
        parties = []
        for r in runs:
            if r["case"] == case and r["kind"] == "throughput" and r["party"] not in parties:
                parties.append(r["party"])
        if not parties:
            continue
        parties.sort(key=lambda p: PARTY_ORDER.get(p, len(PARTY_ORDER)))
        rows = []
        for p in parties:
            t = best[(case, p)]
            lat1 = lat.get((case, p))
            # Pinned proxies only: the -c1 run with the proxy moved onto the load core, against
            # the direct backend's -c1 (which runs on that core anyway).
            loc1 = lat_local.get((case, p))
            pr = paced.get((case, p), [])
            dname = direct_of.get(t["group"])
            direct = best.get((case, dname)) if dname and dname != p else None
            direct_lat = lat.get((case, dname)) if dname and dname != p else None
            rows.append({
                "party": p,
                "group": t["group"],
                "rps": t["rps"],
                "rps_rounds": rounds[(case, p)],
                "p50_us": t["latency_us"]["p50"],
                "p99_us": t["latency_us"]["p99"],
                "max_us": t["latency_us"]["max"],
                "c1_rps": lat1["rps"] if lat1 else None,
                "c1_p50_us": lat1["latency_us"]["p50"] if lat1 else None,
                "c1_p99_us": lat1["latency_us"]["p99"] if lat1 else None,
                "added_p50_us": (t["latency_us"]["p50"] - direct["latency_us"]["p50"]) if direct else None,
                "added_c1_p50_us": (lat1["latency_us"]["p50"] - direct_lat["latency_us"]["p50"])
                if lat1 and direct_lat else None,
                "c1_local_p50_us": loc1["latency_us"]["p50"] if loc1 else None,
                "added_c1_local_p50_us": (loc1["latency_us"]["p50"] - direct_lat["latency_us"]["p50"])
                if loc1 and direct_lat else None,
                "cpu_busy_pct": t["cpu_busy_pct"],
                # The pinned proxy's core's busy time per request (from /proc/stat, sampled at
                # timer ticks; biased when a quota throttles at those ticks).
                "core_cpu_us": (t["cpu_busy_pct"].get(f"cpu{proxy_cpu}", 0) * 1e4 / t["rps"])
                if proxy_cpu is not None and t["group"] == "pinned" and dname != p and t["rps"] else None,
                # What a request costs the proxy whatever caps the throughput (the load core is
                # often the limit): its processes' and threads' time on a CPU over each round
                # (/proc/TID/schedstat) ÷ that round's requests, median over the rounds.
                "proxy_cpu_us": median(task_us[(case, p)]) if task_us.get((case, p)) else None,
                # The equal-load runs (every connection thinks a fixed time after each
                # response): medians over the rounds.
                "paced_rounds": len(pr),
                "paced_rps": med(pr, lambda r: r["rps"]),
                "paced_p50_us": med(pr, lambda r: r["latency_us"]["p50"]),
                "paced_p99_us": med(pr, lambda r: r["latency_us"]["p99"]),
                "paced_p999_us": med(pr, lambda r: r["latency_us"].get("p999")),
                "errors": sum(sum(r["errors"].values()) for r in runs if r["case"] == case and r["party"] == p),
                "non2xx": sum(r["non2xx"] for r in runs if r["case"] == case and r["party"] == p),
            })
        by = {r["party"]: r for r in rows}

        def cmp(a_name, b_name):
            a, b = by.get(a_name), by.get(b_name)
            if not a or not b:
                return None
            return {
                "rps_ratio": ratio(a["rps"], b["rps"]),
                "p50_ratio": ratio(a["p50_us"], b["p50_us"]),
                "p99_ratio": ratio(a["p99_us"], b["p99_us"]),
                "c1_p50_ratio": ratio(a["c1_p50_us"], b["c1_p50_us"]),
            }

        ratios = {}
        for a_name, b_name in RATIOS:
            v = cmp(a_name, b_name)
            if v:
                ratios[f"{a_name}/{b_name}"] = v
        cases.append({"case": case, "rows": rows, "ratios": ratios})
    return cases


def ms(us):
    return "—" if us is None else f"{us / 1000:.3f}"


def plus_ms(us):
    return "—" if us is None else f"{us / 1000:+.3f}"


def busy(d):
    return " / ".join(f"{v:.0f}" for _, v in sorted(d.items(), key=lambda kv: int(kv[0][3:]))) or "—"


def us1(v):
    return "—" if v is None else f"{v:.1f}"


def x(v):
    return "—" if v is None else f"{v:.2f}×"


def mark(v, ok, fmt="{:.2f}×"):
    return "—" if v is None else f"{fmt.format(v)} {'✅' if ok(v) else '❌'}"


def paired_median(a, b):
    """The median over rounds of a's req/s over b's in the same round. The rounds interleave the
    parties, so each pair ran minutes apart at most: on a machine whose speed drifts by a third
    within a run (these do), the paired ratio is steadier than best against best."""
    rs = sorted(x / y for x, y in zip(a.get("rps_rounds") or [], b.get("rps_rounds") or []) if x and y)
    if not rs:
        return None
    m = len(rs) // 2
    return round(rs[m] if len(rs) % 2 else (rs[m - 1] + rs[m]) / 2, 3)


def mean_ratio(a, b, reps=4000, seed=1):
    """a's mean req/s over b's, over the paired rounds, with a 95% bootstrap interval of that
    ratio (the pairs resampled; fixed seed, so a run's file gives the same interval every
    time). None under 6 pairs, where an interval says little. bench/pool.py pools runs."""
    pairs = [(x, y) for x, y in zip(a.get("rps_rounds") or [], b.get("rps_rounds") or []) if x and y]
    if len(pairs) < 6:
        return None
    rng = random.Random(seed)
    n = len(pairs)
    stats = []
    for _ in range(reps):
        sa = sb = 0.0
        for _ in range(n):
            x, y = pairs[rng.randrange(n)]
            sa += x
            sb += y
        stats.append(sa / sb)
    stats.sort()
    point = sum(x for x, _ in pairs) / sum(y for _, y in pairs)
    return [round(point, 3), round(stats[int(0.025 * reps)], 3), round(stats[int(0.975 * reps) - 1], 3)]


def with_interval(v):
    if not v:
        return "—"
    return f"{v[0]:.2f}× ({v[1]:.2f}–{v[2]:.2f}) {'✅' if v[0] >= 1.2 else '❌'}"


def targets(c):
    """The targets, checked for warmroute with the session id in the JSON body (the id the other
    proxies cannot read), pinned (1 worker vs 1 thread) and shared (2 vs 2)."""
    by = {r["party"]: r for r in c["rows"]}
    out = []
    for grp, wr, hap, ngx, vllm in (("pinned", "warmroute-1w-body", "haproxy-1t", "nginx-1w", "vllm-router"),
                                   ("shared", "warmroute-2w-body", "haproxy-2t", "nginx-2w", None)):
        w = by.get(wr)
        if not w:
            continue
        h, n, v = by.get(hap), by.get(ngx), by.get(vllm) if vllm else None
        bp = by.get("warmroute-bp-body") if grp == "pinned" else None
        out.append({
            "case": c["case"],
            "group": grp,
            "party": wr,
            "rps_vs_haproxy": ratio(w["rps"], h["rps"]) if h else None,
            "rps_vs_haproxy_paired": paired_median(w, h) if h else None,
            "rps_vs_haproxy_mean": mean_ratio(w, h) if h else None,
            "cpu_vs_haproxy": ratio(w["proxy_cpu_us"], h["proxy_cpu_us"]) if h and w.get("proxy_cpu_us") and h.get("proxy_cpu_us") else None,
            "p99_vs_haproxy": ratio(w["p99_us"], h["p99_us"]) if h else None,
            "paced_p99_vs_haproxy": ratio(w.get("paced_p99_us"), h.get("paced_p99_us")) if h else None,
            "rps_vs_nginx": ratio(w["rps"], n["rps"]) if n else None,
            "rps_vs_vllm_router": ratio(w["rps"], v["rps"]) if v else None,
            "added_c1_p50_us": w["added_c1_p50_us"],
            "added_c1_local_p50_us": w.get("added_c1_local_p50_us"),
            "added_c1_p50_busy_poll_us": bp["added_c1_p50_us"] if bp else None,
        })
    return out


def render_md(args, data):
    m = data["machine"]
    s = data["settings"]
    lines = []
    add = lines.append
    case_titles = {
        "json": "Non-streaming (POST JSON → `application/json` reply)",
        "stream": "Streaming (POST JSON with `\"stream\":true` → SSE reply of many small events)",
        "prompt": "Non-streaming with a realistic prompt (POST of a 50 KB JSON conversation — 40 turns "
                  "of prose and code, an escape every ~27 bytes — → `application/json` reply)",
    }
    ref = {p["case"]: p for p in data["preflight"] if p["party"] == "direct"}
    jb = ref.get("json", {}).get("bytes", "?")
    sb = ref.get("stream", {}).get("bytes", "?")
    se = ref.get("stream", {}).get("sse_events", "?")
    backend_desc = {
        "nginx": f"static nginx (1 worker, `return 200`): a fixed {jb}-byte chat.completion JSON, or "
                 f"a fixed {se}-event SSE body ({sb} bytes, `Content-Length`-framed, so it reaches "
                 f"the proxy in one read) when the request accepts `text/event-stream`; `/health` and "
                 f"`/v1/models` answer for the routers' probes",
        "mock": "`warmroute-mock --workers 1 --ttft-base-ms 0 --ttft-per-token-us 0 --decode-tps 0 "
                "--max-tokens 8` (chunked SSE, one write per event)",
    }[s["backend"]]
    tools = f"{m['nginx']}; {m['haproxy']}; {m['wrk']}"
    if data.get("router_versions"):
        tools += f"; {data['router_versions']} (PyPI wheels, in a venv outside the repository)"
    quota = s.get("proxy_quota_pct")
    if quota:
        add(f"## overhead-capped — the pinned proxies limited to {quota}% of a core ({data['date']})")
    else:
        add(f"## overhead — proxy overhead over one backend ({data['date']})")
    add("")
    add(f"- **Date**: {data['date']} · **git**: `{data['git']}` · **backend**: {backend_desc}")
    add(f"- **Machine**: {m['nproc']} cores ({m['cpu_model']}), kernel `{m['kernel']}`, "
        f"`kernel.io_uring_disabled={m['io_uring_disabled_sysctl']}`; warmroute workers got "
        f"**{m['warmroute_driver']}**; load average before the run `{m['loadavg_before']}`")
    add(f"- **Tools**: {tools}")
    add(f"- **Load**: per case, {s['rounds']} interleaved rounds over all parties of wrk `-t1 "
        f"-c{s['conns']}` for {s['duration']} (after a {s['warmup']} warm-up each); the table keeps "
        f"the round with the highest req/s and lists every round. Then `-t1 -c1` for "
        f"{s['lat_duration']} per party (unloaded latency, and a check for a Nagle/delayed-ACK "
        f"floor). {s['sessions']} rotating session ids, script `bench/wrk/chat.lua` (POST "
        f"`/v1/chat/completions`, through the `/bench` route prefix for warmroute, nginx and haproxy); "
        f"all in one run against the same backend process.")
    add(f"- **Placement** (2 cores shared by load generator, backend and proxy): *pinned* proxies "
        f"run under `taskset -c {s['proxy_cpu']}` with one worker/thread where they have the knob "
        f"(warmroute `--workers 1 --no-pin`, nginx `worker_processes 1`, haproxy `nbthread 1`; the "
        f"two LLM routers size their tokio runtimes from the one CPU they are given — thread counts "
        f"below) while wrk and the backend are held on core {s['load_cpu'] or '(none)'}, so each proxy "
        f"has one core to itself and the comparison is of the proxies' per-core cost (the load core "
        f"caps any party at roughly the *direct* figure). *shared* proxies use both cores as they "
        f"would in production with wrk and the backend unpinned next to them; *direct-shared* is the "
        f"backend with the same unpinned wrk. Added latency is against the direct row of the same "
        f"placement.")
    if quota:
        add(f"- **Capped**: every pinned proxy (not *direct*, not the backend, not wrk) runs in a CPU "
            f"cgroup with a quota of {quota}% of one core ({quota * 100} µs per 10 ms period, like "
            f"`docker run --cpus {quota / 100:g}`), so the proxy is the limit and its req/s measures "
            f"what a request costs it, not what the load core can drive. The quota stalls a proxy "
            f"that has used its share until the next period, so every party's p99 here is mostly "
            f"those stalls: compare p99 in the uncapped section.")
    add("- **CPU per request**: *proxy CPU µs/req* is the time the proxy's processes and threads "
        "spent on a CPU during each round (the first field of `/proc/TID/schedstat`, summed over the "
        "process, its threads and its descendants before and after the round; the scheduler adds to "
        "it at every switch, so it is exact) ÷ the round's requests, median over the rounds. It "
        "includes the kernel's work done in the proxy's context (the loopback delivery of what it "
        "sends, softirqs run while it is on a CPU). *core busy µs/req* is the older figure: the pinned proxy's core's "
        "busy share in `/proc/stat` ÷ req/s in the best round. That split is sampled at timer ticks "
        "and can misplace time, notably under a CPU quota, which also acts at ticks.")
    add("- **Proxy settings**: nginx `keepalive 64`, `proxy_http_version 1.1`, "
        "`proxy_set_header Connection \"\"`, `proxy_buffering off`, X-Forwarded-For/X-Real-IP/"
        "X-Forwarded-Proto set, `/bench/` prefix stripped (nginx + Lua: the same, the peer chosen "
        "in `balancer_by_lua_block` with `ngx.balancer.set_current_peer`, Debian "
        f"`libnginx-mod-http-lua` loaded from `{data.get('lua_module_dir') or '?'}`); haproxy "
        "`balance hdr(X-Session-ID)`, `hash-type consistent`, `http-reuse always`, "
        "`option http-no-delay`, `option forwardfor`, `replace-path` stripping `/bench`; warmroute "
        "one route `bench` with one peer, `--access-log off`, busy polling at its default "
        f"(`\"auto\"`; warmroute-bp: `busy_poll_us = {s.get('busy_poll_us')}`); vllm-router "
        "`--policy consistent_hash "
        "--log-level warning` and sglang-router `--policy manual --log-level warn` (at their default "
        "`info` both log every request), Prometheus exporters on 127.0.0.1. No access logs anywhere. "
        f"Configs are in the work directory `bench/out/overhead-{data['timestamp']}/`.")
    add("")
    ran = {r["party"] for c in data["cases"] for r in c["rows"]}
    add("| party | placement | what | session id sent in |")
    add("|---|---|---|---|")
    for name, grp, what, sid in PARTIES:
        if name in ran or name in data.get("parties", []):
            add(f"| {name} | {grp} | {what.format(bp=s.get('busy_poll_us'))} | {sid} |")
    add("")
    skipped = data.get("skipped", [])
    if skipped:
        add("**Skipped / unavailable parties:**")
        add("")
        for sk in skipped:
            where = f" ({sk['case']})" if sk.get("case") else ""
            add(f"- **{sk['party']}**{where}: {sk['reason']}")
        add("")
    for c in data["cases"]:
        add(f"### {case_titles[c['case']]}")
        add("")
        add(f"| party | placement | req/s (c{s['conns']}) | rounds (k req/s) | p50 ms | p99 ms | "
            "+p50 vs direct | p50 ms (c1) | p99 ms (c1) | +p50 vs direct (c1) | "
            "p50 ms (c1, one core) | +p50 vs direct (c1, one core) | cpu0 / cpu1 busy % | "
            "core busy µs/req | proxy CPU µs/req | errors / non-2xx |")
        add("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
        for r in c["rows"]:
            rr = " / ".join(f"{v / 1000:.1f}" for v in r["rps_rounds"])
            floor = " ⚠" if r["c1_p50_us"] is not None and r["c1_p50_us"] >= FLOOR_US else ""
            add(f"| {r['party']} | {GROUP_TITLES.get(r['group'], r['group'])} | {r['rps']:,.0f} | {rr} | "
                f"{ms(r['p50_us'])} | {ms(r['p99_us'])} | {plus_ms(r['added_p50_us'])} | "
                f"{ms(r['c1_p50_us'])}{floor} | {ms(r['c1_p99_us'])} | {plus_ms(r['added_c1_p50_us'])} | "
                f"{ms(r.get('c1_local_p50_us'))} | {plus_ms(r.get('added_c1_local_p50_us'))} | "
                f"{busy(r['cpu_busy_pct'])} | {us1(r.get('core_cpu_us'))} | {us1(r.get('proxy_cpu_us'))} | "
                f"{r['errors']} / {r['non2xx']} |")
        add("")
        floors = [r["party"] for r in c["rows"] if r["c1_p50_us"] is not None and r["c1_p50_us"] >= FLOOR_US]
        if floors:
            add(f"⚠ c1 p50 ≥ {FLOOR_US // 1000} ms — a per-request floor on a reused keep-alive "
                f"connection (the Nagle/delayed-ACK signature): {', '.join(floors)}.")
            add("")
        if any(r.get("paced_rounds") for r in c["rows"]):
            add(f"At equal load: wrk `-c{s['conns']}` again, but every connection waits "
                f"{s.get('paced_ms')} ms after each response before its next request (`WRK_DELAY_MS`, "
                f"wrk's `delay()`), so each party is offered about the same rate and none is "
                f"saturated; medians over {max(r.get('paced_rounds') or 0 for r in c['rows'])} rounds "
                f"(one per round, after its throughput run). At saturation the closed loop's latency "
                f"is mostly queueing behind the slowest stage "
                f"({'the quota' if quota else 'the load core, in the pinned placement'}); here no "
                f"stage is saturated, so the differences between parties are the proxies' own.")
            add("")
            add("| party | placement | req/s | p50 ms | p99 ms | p99.9 ms |")
            add("|---|---|---:|---:|---:|---:|")
            for r in c["rows"]:
                if not r.get("paced_rounds"):
                    continue
                add(f"| {r['party']} | {GROUP_TITLES.get(r['group'], r['group'])} | "
                    f"{r['paced_rps']:,.0f} | {ms(r['paced_p50_us'])} | {ms(r['paced_p99_us'])} | "
                    f"{ms(r['paced_p999_us'])} |")
            add("")
        add("| ratio | req/s | p50 | p99 | p50 (c1) |")
        add("|---|---:|---:|---:|---:|")
        for name, v in c["ratios"].items():
            add(f"| {name} | {x(v['rps_ratio'])} | {x(v['p50_ratio'])} | {x(v['p99_ratio'])} | "
                f"{x(v['c1_p50_ratio'])} |")
        add("")
    add("### Targets (warmroute with the session id read from the JSON body)")
    add("")
    add("≥ 1.2× haproxy's req/s with p99 no worse than haproxy's, ≥ nginx's req/s, ≥ 4× "
        "vllm-router's req/s, and ≤ 100 µs added to the unloaded (c1) p50 over direct. Pinned = "
        "warmroute-1w-body against the 1-thread proxies; shared = warmroute-2w-body against the "
        "2-thread ones (the LLM routers run pinned only).")
    add("")
    add("| case | placement | req/s vs haproxy (≥ 1.20×) | same, median of paired rounds | "
        "same, mean of the rounds (95% interval) | "
        "p99 vs haproxy (≤ 1.00×) | same, at equal load | req/s vs nginx (≥ 1.00×) | "
        "req/s vs vllm-router (≥ 4×) | +p50 vs direct, c1 (≤ 100 µs) | same, c1 on one core (≤ 100 µs) | "
        f"same, c1, with busy_poll_us = {s.get('busy_poll_us')} (≤ 100 µs) | proxy CPU per request vs haproxy |")
    add("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in data["targets"]:
        add(f"| {t['case']} | {t['group']} | {mark(t['rps_vs_haproxy'], lambda v: v >= 1.2)} | "
            f"{mark(t.get('rps_vs_haproxy_paired'), lambda v: v >= 1.2)} | "
            f"{with_interval(t.get('rps_vs_haproxy_mean'))} | "
            f"{mark(t['p99_vs_haproxy'], lambda v: v <= 1.0)} | "
            f"{mark(t.get('paced_p99_vs_haproxy'), lambda v: v <= 1.0)} | {mark(t['rps_vs_nginx'], lambda v: v >= 1.0)} | "
            f"{mark(t['rps_vs_vllm_router'], lambda v: v >= 4.0)} | "
            f"{mark(t['added_c1_p50_us'], lambda v: v <= 100, '{:+.0f} µs')} | "
            f"{mark(t.get('added_c1_local_p50_us'), lambda v: v <= 100, '{:+.0f} µs')} | "
            f"{mark(t.get('added_c1_p50_busy_poll_us'), lambda v: v <= 100, '{:+.0f} µs')} | "
            f"{x(t.get('cpu_vs_haproxy'))} |")
    add("")
    add("*Mean of the rounds*: the ratio of the two parties' mean req/s over the paired rounds, "
        "with a 95% bootstrap interval (the pairs resampled, fixed seed), from 6 rounds up. A "
        "party's rounds move by up to a third within a run on this machine, so one run's interval "
        "is wide; `python3 bench/pool.py bench/out/overhead-capped-*.json` pools the rounds of "
        "several runs.")
    add("")
    add("The c1 columns: with one connection every hop of the pinned placement (wrk → proxy → "
        "backend → proxy → wrk) wakes a process on the other core; *one core* repeats the run with "
        "the pinned proxy moved onto the load core (`taskset -apc`), where the added latency is the "
        "proxy's own work and not the machine's cross-core wake-up time (the shared rows have no "
        "such run). " + (
            "The other warmroute parties run at the default, `busy_poll_us = \"auto\"`: a worker polls "
            "instead of waiting while requests come less than 200 µs apart (README, busy polling), so "
            "the hops to the proxy find it running. *With busy_poll_us = 0*: the warmroute-bp-body "
            "party, a second warmroute with busy polling off."
            if not s.get('busy_poll_us') else
            "*With busy_poll_us*: the warmroute-bp-body party, whose worker polls instead of "
            "waiting for that long after each request it starts or finishes (README, busy polling), so "
            "the hops to the proxy find it running; the other warmroute parties run at the default, "
            "`busy_poll_us = \"auto\"`."))
    add("")
    if data.get("threads"):
        add("Processes / threads after the load (`/proc/PID/status`, the process and its children) "
            "and the CPUs its main thread may run on (`taskset -pc`; warmroute `--workers 2` and "
            "haproxy `cpu-map` pin their worker threads themselves):")
        add("")
        add("| process | processes | threads | cpus (main thread) |")
        add("|---|---:|---:|---|")
        for t in data["threads"]:
            add(f"| {t['proc']} | {t['processes']} | {t['threads']} | {t['cpus']} |")
        add("")
    bad = [p for p in data["preflight"] if p["verdict"] != "ok"]
    if bad:
        add("**Preflight problems** (one curl request per party and case, body compared with the direct reply):")
        add("")
        for p in bad:
            add(f"- {p['party']} / {p['case']}: {p['verdict']}")
        add("")
    else:
        add(f"Preflight: one curl request per party and case answered 200 with a body "
            f"{'byte-identical to' if s['backend'] == 'nginx' else 'with the same SSE event count as'} "
            f"the direct reply.")
        add("")
    if data.get("chart"):
        add(f"Chart: `{data['chart']}` (req/s at c{s['conns']} and p99 per party and case).")
        add("")
    add("Exact commands of this run (generated configs in the work directory):")
    add("")
    add("```")
    add(f"{args.command}   # CARGO_TARGET_DIR={args.target_dir} in this run")
    for cmd in data["commands"]:
        add(cmd.replace(args.work_prefix, "$WORK/") if args.work_prefix else cmd)
    add("```")
    return "\n".join(lines)


def write_chart(path, data):
    """bench/overhead.png: per case, req/s (c32) and p99 per party, pinned and shared groups
    side by side. Optional: returns False when matplotlib is not importable."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        return False
    cases = data["cases"]
    if not cases:
        return False
    s = data["settings"]
    colors = {"pinned": "#4c72b0", "shared": "#dd8452"}
    fig, axes = plt.subplots(len(cases), 2, figsize=(15, 4.6 * len(cases)), squeeze=False)
    for row, c in zip(axes, cases):
        names = [r["party"] for r in c["rows"]]
        # top to bottom in table order, with a gap between the pinned and the shared group
        ypos, y = [], 0.0
        for i, r in enumerate(c["rows"]):
            if i and r["group"] != c["rows"][i - 1]["group"]:
                y += 0.6
            ypos.append(-y)
            y += 1
        for ax, key, title, scale in ((row[0], "rps", f"req/s at {s['conns']} connections (higher is better)", 1.0),
                                      (row[1], "p99_us", f"p99 latency at {s['conns']} connections, ms, log scale "
                                                         "(lower is better)", 1e-3)):
            vals = [r[key] * scale for r in c["rows"]]
            bars = ax.barh(ypos, vals, color=[colors.get(r["group"], "#888") for r in c["rows"]],
                           edgecolor=["black" if r["party"].startswith("warmroute") else "none" for r in c["rows"]],
                           linewidth=1.2)
            for b, v in zip(bars, vals):
                ax.text(b.get_width(), b.get_y() + b.get_height() / 2,
                        f" {v:,.0f}" if key == "rps" else f" {v:.2f}", va="center", fontsize=8)
            ax.set_yticks(ypos)
            ax.set_yticklabels(names, fontsize=9)
            if key == "p99_us":
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_minor_formatter(NullFormatter())
                ax.set_xlim(min(vals) / 1.5, max(vals) * 2.2)
            else:
                ax.set_xlim(0, max(vals) * 1.18 if vals else 1)
            ax.set_title(f"{c['case']}: {title}", fontsize=10)
            ax.grid(axis="x", alpha=0.3)
    quota = data["settings"].get("proxy_quota_pct")
    pinned_label = "pinned: proxy alone on 1 core, wrk + backend on the other"
    if quota:
        pinned_label = f"pinned, capped at {quota}% of its core: wrk + backend on the other"
    handles = [Patch(color=colors["pinned"], label=pinned_label),
               Patch(color=colors["shared"], label="shared: 2 workers/threads, everything on both cores"),
               Patch(facecolor="white", edgecolor="black", label="warmroute (-body: id in the JSON body)")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False)
    skipped = sorted({sk["party"] + (f" ({sk['case']})" if sk.get("case") else "") for sk in data.get("skipped", [])})
    sub = f"; skipped: {', '.join(skipped)}" if skipped else ""
    fig.suptitle(f"warmroute overhead over one static backend — {data['date']}, git {data['git']}, "
                 f"{data['machine']['nproc']} cores, shared machine (indicative){sub}", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


HEADER = """# warmroute benchmark results

Figures are ratios measured side by side in one run on one machine (see
`../shared/BENCHMARKING.md`); absolute numbers on these shared machines are noisy. Each section
below is regenerated by `bench/run SCENARIO` (between its markers); machine-readable results
of every run go to `bench/out/SCENARIO-TIMESTAMP.json` (git-ignored).
"""


def update_md(path, scenario, section):
    begin = f"<!-- bench:{scenario}:begin -->"
    end = f"<!-- bench:{scenario}:end -->"
    block = f"{begin}\n{section}\n{end}"
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = HEADER
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pat.search(text):
        text = pat.sub(lambda _m: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


CHART_SKIPPED = "Chart: skipped (matplotlib is not installed; `pip install matplotlib` and re-run)."


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display), or None when matplotlib is not
    installed: the charts are optional."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_outputs(args, scenario, data, md):
    """A scenario report's outputs: the JSON file, the scenario's section of RESULTS.md
    (when there is one to update) and the section on stdout."""
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    if args.results_md:
        update_md(args.results_md, scenario, md)
    print(md)

def section_date(timestamp):
    """A run's timestamp (`YYYYmmddTHHMMSSZ`, as bench/run names it) as a section shows it."""
    return datetime.strptime(timestamp, "%Y%m%dT%H%M%SZ").strftime("%Y-%m-%d %H:%M UTC")


def run_line(args, scenario, when):
    """The **Date** bullet of a scenario report's section: date, git revision, command, work
    directory and results file."""
    return (f"- **Date**: {when} · **git**: `{args.git}` · **command**: `{args.command}` "
            f"(work directory `bench/out/{scenario}-{args.timestamp}/`, exact commands in its "
            f"`commands.txt`; results `bench/out/{scenario}-{args.timestamp}.json`)")


def machine_line(m, rest):
    """The **Machine** bullet: cores, CPU model, kernel and load average before the run, then
    `rest` (what the scenario adds: tool versions, a word on noise)."""
    return (f"- **Machine**: {m['nproc']} cores ({m['cpu_model']}), kernel `{m['kernel']}`; load "
            f"average before the run `{m['loadavg_before']}`{rest}")


def add_common_args(ap, command=""):
    """The arguments bench/run gives every scenario report: its work directory, the JSON file to
    write, the RESULTS.md to update, the run's timestamp and git revision, the chart path and
    the command line to quote."""
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--results-md", default="")
    ap.add_argument("--timestamp", required=True)
    ap.add_argument("--git", default="unknown")
    ap.add_argument("--chart", default="")
    ap.add_argument("--command", default=command)


def main():
    ap = argparse.ArgumentParser()
    add_common_args(ap)
    ap.add_argument("scenario")
    ap.add_argument("--driver", default="unknown")
    ap.add_argument("--backend", default="nginx")
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--warmup", default="1s")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lat-duration", default="3s")
    ap.add_argument("--paced-ms", default="")
    ap.add_argument("--proxy-cpu", default="0")
    ap.add_argument("--proxy-quota", default="")
    ap.add_argument("--load-cpu", default="1")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--parties", default="")
    ap.add_argument("--cases", default="json stream prompt")
    ap.add_argument("--router-versions", default="")
    ap.add_argument("--lua-module-dir", default="")
    ap.add_argument("--target-dir", default="target")
    ap.add_argument("--busy-poll-us", type=int, default=0)
    args = ap.parse_args()
    args.work_prefix = args.work.rstrip("/") + "/"

    runs = [flatten(r) for r in load_jsonl(os.path.join(args.work, "results.jsonl"))]
    preflight = load_jsonl(os.path.join(args.work, "preflight.jsonl"))
    with open(os.path.join(args.work, "commands.txt")) as f:
        commands = [c for c in f.read().splitlines() if c]

    def optional_jsonl(name):
        path = os.path.join(args.work, name)
        return load_jsonl(path) if os.path.exists(path) else []

    cases = build_summary(runs, args.proxy_cpu)
    ts = datetime.strptime(args.timestamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    data = {
        "scenario": args.scenario,
        "timestamp": args.timestamp,
        "date": ts.strftime("%Y-%m-%d %H:%M UTC"),
        "git": args.git,
        "machine": machine_info(args.driver, read(os.path.join(args.work, "loadavg-before"))),
        "settings": {
            "backend": args.backend,
            "conns": args.conns,
            "duration": args.duration,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "lat_duration": args.lat_duration,
            "paced_ms": args.paced_ms,
            "proxy_cpu": args.proxy_cpu,
            "proxy_quota_pct": int(args.proxy_quota) if args.proxy_quota else None,
            "load_cpu": args.load_cpu,
            "sessions": args.sessions,
            "busy_poll_us": args.busy_poll_us,
        },
        "command": args.command,
        "parties": args.parties.split(),
        "router_versions": args.router_versions,
        "lua_module_dir": args.lua_module_dir,
        "commands": commands,
        "preflight": preflight,
        "skipped": optional_jsonl("skipped.jsonl"),
        "threads": optional_jsonl("threads.jsonl"),
        "runs": runs,
        "cases": cases,
        "targets": [t for c in cases for t in targets(c)],
        "chart": "",
    }
    if args.chart:
        if write_chart(args.chart, data):
            data["chart"] = os.path.relpath(args.chart, os.path.dirname(os.path.dirname(os.path.abspath(args.chart))))
        else:
            print("matplotlib not importable: no chart", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    section = render_md(args, data)
    if args.results_md:
        update_md(args.results_md, args.scenario, section)
    print(section, file=sys.stderr)


if __name__ == "__main__":
    main()
