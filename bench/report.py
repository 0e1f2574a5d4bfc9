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
import re
import subprocess
import sys
from datetime import datetime, timezone

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
    }


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def build_summary(runs):
    """Per case: each party's throughput and latency figures, and the comparison ratios.

    Throughput figures come from the round with the highest req/s (the least disturbed by
    the rest of the machine); every round's req/s is kept alongside.
    """
    best, rounds, lat = {}, {}, {}
    for r in runs:
        key = (r["case"], r["party"])
        if r["kind"] == "throughput":
            rounds.setdefault(key, []).append(r["rps"])
            if key not in best or r["rps"] > best[key]["rps"]:
                best[key] = r
        elif r["kind"] == "latency":
            lat[key] = r
    direct_of = {"pinned": "direct", "shared": "direct-shared"}
    cases = []
    for case in ("json", "stream"):
        parties = []
        for r in runs:
            if r["case"] == case and r["kind"] == "throughput" and r["party"] not in parties:
                parties.append(r["party"])
        if not parties:
            continue
        rows = []
        for p in parties:
            t = best[(case, p)]
            lat1 = lat.get((case, p))
            dname = direct_of.get(t["group"])
            direct = best.get((case, dname)) if dname and dname != p else None
            direct_lat = lat.get((case, dname)) if direct else None
            rows.append({
                "party": p,
                "group": t["group"],
                "rps": t["rps"],
                "rps_rounds": rounds[(case, p)],
                "p50_us": t["latency_us"]["p50"],
                "p99_us": t["latency_us"]["p99"],
                "c1_rps": lat1["rps"] if lat1 else None,
                "c1_p50_us": lat1["latency_us"]["p50"] if lat1 else None,
                "c1_p99_us": lat1["latency_us"]["p99"] if lat1 else None,
                "added_p50_us": (t["latency_us"]["p50"] - direct["latency_us"]["p50"]) if direct else None,
                "added_c1_p50_us": (lat1["latency_us"]["p50"] - direct_lat["latency_us"]["p50"])
                if lat1 and direct_lat else None,
                "cpu_busy_pct": t["cpu_busy_pct"],
                "errors": sum(sum(r["errors"].values()) for r in runs if r["case"] == case and r["party"] == p),
                "non2xx": sum(r["non2xx"] for r in runs if r["case"] == case and r["party"] == p),
            })
        by = {r["party"]: r for r in rows}

        def cmp(wr, other):
            a, b = by.get(wr), by.get(other)
            if not a or not b:
                return None
            return {
                "rps_ratio": ratio(a["rps"], b["rps"]),
                "p50_ratio": ratio(a["p50_us"], b["p50_us"]),
                "p99_ratio": ratio(a["p99_us"], b["p99_us"]),
                "c1_p50_ratio": ratio(a["c1_p50_us"], b["c1_p50_us"]),
            }

        cases.append({
            "case": case,
            "rows": rows,
            "ratios": {
                "warmroute-1w/haproxy-1t": cmp("warmroute-1w", "haproxy-1t"),
                "warmroute-1w/nginx-1w": cmp("warmroute-1w", "nginx-1w"),
                "warmroute-2w/haproxy-2t": cmp("warmroute-2w", "haproxy-2t"),
                "warmroute-2w/nginx-2w": cmp("warmroute-2w", "nginx-2w"),
            },
        })
    return cases


def ms(us):
    return "—" if us is None else f"{us / 1000:.3f}"


def plus_ms(us):
    return "—" if us is None else f"{us / 1000:+.3f}"


def busy(d):
    return " / ".join(f"{v:.0f}" for _, v in sorted(d.items(), key=lambda kv: int(kv[0][3:]))) or "—"


def x(v):
    return "—" if v is None else f"{v:.2f}×"


def render_md(args, data):
    m = data["machine"]
    s = data["settings"]
    lines = []
    add = lines.append
    case_titles = {
        "json": "Non-streaming (POST JSON → `application/json` reply)",
        "stream": "Streaming (POST JSON with `\"stream\":true` → SSE reply of many small events)",
    }
    ref = {p["case"]: p for p in data["preflight"] if p["party"] == "direct"}
    jb = ref.get("json", {}).get("bytes", "?")
    sb = ref.get("stream", {}).get("bytes", "?")
    se = ref.get("stream", {}).get("sse_events", "?")
    backend_desc = {
        "nginx": f"static nginx (1 worker, `return 200`): a fixed {jb}-byte chat.completion JSON, or "
                 f"a fixed {se}-event SSE body ({sb} bytes, `Content-Length`-framed, so it reaches "
                 f"the proxy in one read) when the request accepts `text/event-stream`",
        "mock": "`warmroute-mock --workers 1 --ttft-base-ms 0 --ttft-per-token-us 0 --decode-tps 0 "
                "--max-tokens 8` (chunked SSE, one write per event)",
    }[s["backend"]]
    add(f"## overhead — proxy overhead over one backend ({data['date']})")
    add("")
    add(f"- **Date**: {data['date']} · **git**: `{data['git']}` · **backend**: {backend_desc}")
    add(f"- **Machine**: {m['nproc']} cores ({m['cpu_model']}), kernel `{m['kernel']}`, "
        f"`kernel.io_uring_disabled={m['io_uring_disabled_sysctl']}`; warmroute workers got "
        f"**{m['warmroute_driver']}**; load average before the run `{m['loadavg_before']}`")
    add(f"- **Tools**: {m['nginx']}; {m['haproxy']}; {m['wrk']}")
    add(f"- **Load**: per case, {s['rounds']} interleaved rounds over all parties of wrk `-t1 "
        f"-c{s['conns']}` for {s['duration']} (after a {s['warmup']} warm-up each); the table keeps "
        f"the round with the highest req/s and lists every round. Then `-t1 -c1` for "
        f"{s['lat_duration']} per party (unloaded latency, and a check for a Nagle/delayed-ACK "
        f"floor). {s['sessions']} rotating `X-Session-ID`s, script `bench/wrk/chat.lua`; all in one "
        f"run against the same backend process.")
    add(f"- **Placement** (2 cores shared by load generator, backend and proxy): *pinned* proxies "
        f"run under `taskset -c {s['proxy_cpu']}` with one worker/thread (warmroute `--workers 1 "
        f"--no-pin`, nginx `worker_processes 1`, haproxy `nbthread 1`) while wrk and the backend "
        f"are held on core {s['load_cpu'] or '(none)'}, so each proxy has one core to itself and the "
        f"comparison is of the proxies' per-core cost (the load core caps any party at roughly the "
        f"*direct* figure). *shared* proxies use both cores as they would in production "
        f"(warmroute `--workers 2`, pinning its workers itself; nginx `worker_processes 2` + "
        f"`worker_cpu_affinity auto` + `reuseport`; haproxy `nbthread 2` + `cpu-map`) with wrk and "
        f"the backend unpinned next to them; *direct-shared* is the backend with the same "
        f"unpinned wrk. Added latency is against the direct row of the same placement.")
    add("- **Proxy settings**: nginx `hash $http_x_session_id consistent`, `keepalive 64`, "
        "`proxy_http_version 1.1`, `proxy_set_header Connection \"\"`, `proxy_buffering off`, "
        "X-Forwarded-For/X-Real-IP/X-Forwarded-Proto set, `/bench/` prefix stripped; haproxy "
        "`balance hdr(X-Session-ID)`, `hash-type consistent`, `http-reuse always`, "
        "`option forwardfor`, `replace-path` stripping `/bench`; warmroute one route `bench` with "
        "one peer, `--access-log off`. No access logs anywhere. Configs are in the work directory "
        f"`bench/out/overhead-{data['timestamp']}/`.")
    add("")
    for c in data["cases"]:
        add(f"### {case_titles[c['case']]}")
        add("")
        add(f"| party | placement | req/s (c{s['conns']}) | rounds (k req/s) | p50 ms | p99 ms | "
            "+p50 vs direct | p50 ms (c1) | p99 ms (c1) | +p50 vs direct (c1) | cpu0 / cpu1 busy % | "
            "errors / non-2xx |")
        add("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
        for r in c["rows"]:
            rr = " / ".join(f"{v / 1000:.1f}" for v in r["rps_rounds"])
            add(f"| {r['party']} | {GROUP_TITLES.get(r['group'], r['group'])} | {r['rps']:,.0f} | {rr} | "
                f"{ms(r['p50_us'])} | {ms(r['p99_us'])} | {plus_ms(r['added_p50_us'])} | "
                f"{ms(r['c1_p50_us'])} | {ms(r['c1_p99_us'])} | {plus_ms(r['added_c1_p50_us'])} | "
                f"{busy(r['cpu_busy_pct'])} | {r['errors']} / {r['non2xx']} |")
        add("")
        add("| ratio | req/s | p50 | p99 | p50 (c1) |")
        add("|---|---:|---:|---:|---:|")
        for name, v in c["ratios"].items():
            if v:
                add(f"| {name} | {x(v['rps_ratio'])} | {x(v['p50_ratio'])} | {x(v['p99_ratio'])} | "
                    f"{x(v['c1_p50_ratio'])} |")
        add("")
    # Targets of issue 2 (recorded, not asserted).
    add("### Targets (issue 2: throughput ≥ 1.2× haproxy and ≥ nginx, p99 no worse than haproxy)")
    add("")
    add("| case | placement | req/s vs haproxy (≥ 1.20×) | req/s vs nginx (≥ 1.00×) | p99 vs haproxy (≤ 1.00×) |")
    add("|---|---|---:|---:|---:|")
    for c in data["cases"]:
        for grp, wr, hap, ngx in (("pinned", "warmroute-1w/haproxy-1t", None, "warmroute-1w/nginx-1w"),
                                  ("shared", "warmroute-2w/haproxy-2t", None, "warmroute-2w/nginx-2w")):
            h, n = c["ratios"].get(wr), c["ratios"].get(ngx)
            if not h or not n:
                continue

            def mark(v, ok):
                return "—" if v is None else f"{v:.2f}× {'✅' if ok(v) else '❌'}"

            add(f"| {c['case']} | {grp} | {mark(h['rps_ratio'], lambda v: v >= 1.2)} | "
                f"{mark(n['rps_ratio'], lambda v: v >= 1.0)} | {mark(h['p99_ratio'], lambda v: v <= 1.0)} |")
    add("")
    bad = [p for p in data["preflight"] if p["verdict"] != "ok"]
    if bad:
        add("**Preflight problems** (one curl request per party and case, body compared with the direct reply):")
        add("")
        for p in bad:
            add(f"- {p['party']} / {p['case']}: {p['verdict']}")
    else:
        add(f"Preflight: one curl request per party and case answered 200 with a body "
            f"{'byte-identical to' if s['backend'] == 'nginx' else 'with the same SSE event count as'} "
            f"the direct reply.")
    add("")
    add("Exact commands of this run (generated configs in the work directory):")
    add("")
    add("```")
    add(f"{args.command}   # CARGO_TARGET_DIR=/work/target-bench in this run")
    for cmd in data["commands"]:
        add(cmd.replace(args.work_prefix, "$WORK/") if args.work_prefix else cmd)
    add("```")
    return "\n".join(lines)


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--results-md", default="")
    ap.add_argument("--timestamp", required=True)
    ap.add_argument("--git", default="unknown")
    ap.add_argument("--driver", default="unknown")
    ap.add_argument("--backend", default="nginx")
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--warmup", default="1s")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lat-duration", default="3s")
    ap.add_argument("--proxy-cpu", default="0")
    ap.add_argument("--load-cpu", default="1")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--command", default="")
    args = ap.parse_args()
    args.work_prefix = args.work.rstrip("/") + "/"

    runs = [flatten(r) for r in load_jsonl(os.path.join(args.work, "results.jsonl"))]
    preflight = load_jsonl(os.path.join(args.work, "preflight.jsonl"))
    with open(os.path.join(args.work, "commands.txt")) as f:
        commands = [c for c in f.read().splitlines() if c]
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
            "proxy_cpu": args.proxy_cpu,
            "load_cpu": args.load_cpu,
            "sessions": args.sessions,
        },
        "command": args.command,
        "commands": commands,
        "preflight": preflight,
        "runs": runs,
        "cases": build_summary(runs),
    }
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    section = render_md(args, data)
    if args.results_md:
        update_md(args.results_md, args.scenario, section)
    print(section, file=sys.stderr)


if __name__ == "__main__":
    main()
