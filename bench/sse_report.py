#!/usr/bin/env python3
"""Turn one `bench/run sse` work directory into a JSON result file, a section of RESULTS.md
(between `<!-- bench:sse:begin -->` and `<!-- bench:sse:end -->`) and, when matplotlib is
importable, a PNG chart (gap fidelity, CPU per million events and RSS per stream per party).

Inputs per run (party P, N streams) in WORK/runs/: P-nN.json (warmroute-bench sse),
P-nN.samples.jsonl (CPU ticks, VmRSS and /proc/stat at `idle`, `w0`, `w1`, `end`) and
P-nN.open (when all streams were open). Standard library only (matplotlib optional).
"""

import argparse
import glob
import json
import os
import sys
from datetime import datetime, timezone

sys.dont_write_bytecode = True  # no bench/__pycache__ from importing report.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import (CHART_SKIPPED, add_common_args, machine_info, machine_line, pyplot, read,  # noqa: E402
                    run_line, section_date, write_outputs)

PARTY_ORDER = ["direct", "warmroute", "nginx"]
PARTY_TITLES = {
    "direct": "direct (mock)",
    "warmroute": "warmroute, 2 workers",
    "nginx": "nginx, 2 workers",
}
TARGET_RSS_PER_STREAM = 16 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def load_jsonl(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    out.append(json.loads(line))
    except OSError:
        pass
    return out


def busy_pct(s0, s1):
    """Per-core busy % between two lists of /proc/stat cpuN lines."""
    def parse(lines):
        res = {}
        for line in lines:
            f = line.split()
            v = [int(x) for x in f[1:]]
            res[f[0]] = (sum(v), v[3] + v[4])
        return res

    a, b = parse(s0), parse(s1)
    return {c: round(100 * (1 - (b[c][1] - a[c][1]) / max(1, b[c][0] - a[c][0])), 1) for c in sorted(b) if c in a}


def events_between(tl, t0_ms, t1_ms):
    """Events of the driver's timeline between two wall-clock times (partial buckets prorated)."""
    start, bm, ev = tl["start_unix_ms"], tl["bucket_ms"], tl["events"]
    total = 0.0
    for i, n in enumerate(ev):
        b0, b1 = start + i * bm, start + (i + 1) * bm
        overlap = min(b1, t1_ms) - max(b0, t0_ms)
        if overlap > 0:
            total += n * overlap / bm
    return total


def open_between(tl, t0_ms, t1_ms):
    """Fewest and most streams open in the timeline buckets that overlap [t0, t1]."""
    start, bm, op = tl["start_unix_ms"], tl["bucket_ms"], tl["open"]
    vals = [n for i, n in enumerate(op) if start + (i + 1) * bm > t0_ms and start + i * bm < t1_ms]
    return (min(vals), max(vals)) if vals else (None, None)


def analyse(work, path):
    name = os.path.basename(path)[: -len(".json")]
    party, _, n = name.rpartition("-n")
    with open(path) as f:
        d = json.load(f)
    samples = {s["label"]: s for s in load_jsonl(os.path.join(work, "runs", name + ".samples.jsonl"))}
    run = {"party": party, "streams": int(n), "driver": d}
    idle, w0, w1 = samples.get("idle"), samples.get("w0"), samples.get("w1")
    if not (idle and w0 and w1):
        run["window"] = None
        return run
    tl = d["timeline"]
    secs = (w1["unix_ms"] - w0["unix_ms"]) / 1000
    events = events_between(tl, w0["unix_ms"], w1["unix_ms"])
    open_min, open_max = open_between(tl, w0["unix_ms"], w1["unix_ms"])
    procs = {}
    for p in sorted(w1["procs"]):
        a, b, i = w0["procs"].get(p), w1["procs"][p], idle["procs"].get(p)
        cpu_s = (b["cpu_ticks"] - a["cpu_ticks"]) / CLK_TCK if a else None
        rec = {
            "processes": b["procs"],
            "cpu_s": round(cpu_s, 3) if cpu_s is not None else None,
            "cpu_pct_of_one_core": round(100 * cpu_s / secs, 1) if cpu_s is not None and secs else None,
            "cpu_s_per_million_events": round(cpu_s / events * 1e6, 2) if cpu_s is not None and events else None,
            "rss_kb_w0": a["rss_kb"] if a else None,
            "rss_kb_w1": b["rss_kb"],
        }
        if i:
            rec["rss_kb_idle"] = i["rss_kb"]
            opened = open_min or 0
            rec["rss_bytes_per_open_stream"] = round((b["rss_kb"] - i["rss_kb"]) * 1024 / opened) if opened else None
            rec["rss_bytes_per_open_stream_w0"] = (
                round((a["rss_kb"] - i["rss_kb"]) * 1024 / opened) if opened and a else None)
        procs[p] = rec
    run["window"] = {
        "seconds": round(secs, 2),
        "events": round(events),
        "events_per_s": round(events / secs) if secs else None,
        "open_min": open_min,
        "open_max": open_max,
        "cpu_busy_pct": busy_pct(w0["cpu_stat"], w1["cpu_stat"]),
        "procs": procs,
    }
    return run


def fmt(v, nd=1):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def gaps(g):
    return f"{fmt(g['p50'], 2)} / {fmt(g['p99'], 1)} / {fmt(g['p999'], 1)} / {fmt(g['max'], 0)}"


def render_md(args, data):
    m = data["machine"]
    runs = data["runs"]
    when = section_date(args.timestamp)
    cfg = runs[0]["driver"]["config"] if runs else {}
    tps = cfg.get("decode_tps", 0)
    mt = cfg.get("max_tokens", 0)
    out = []
    add = out.append
    add(f"## sse — SSE at scale: concurrent, mostly idle streams ({when})")
    add("")
    add(run_line(args, "sse", when))
    add(machine_line(m, " (shared with other work: CPU figures are per process, but timing figures "
                        f"pick up the neighbours' noise); {m['nginx']}"))
    add(f"- **Backend**: `warmroute-mock {args.mock}`, unpinned: each stream is a head at once, "
        f"the first token after {args.mock.split('--ttft-base-ms ')[1].split()[0] if '--ttft-base-ms ' in args.mock else '?'} ms, "
        f"then one SSE event (one HTTP chunk, ~190 bytes) every {1000 / tps:.0f} ms on an absolute "
        f"schedule ({mt} tokens, then the finish event and `[DONE]`): a stream lasts "
        f"~{(mt - 1) / tps:.0f} s and is idle between events; N streams = {tps:g} × N events/s.")
    add(f"- **Driver**: `warmroute-bench sse` (bench/src/sse.rs, one monoio thread, unpinned): N "
        f"connections ramped up evenly over {args.ramp_ms} ms, one request each (`Connection: close`, "
        f"`X-Session-ID: sse-k`, `stream: true`, `max_tokens` {mt}); every `data:` event is timestamped "
        f"when its read completes. *Gap extra* = observed gap between consecutive token events − "
        f"nominal {1000 / tps:.0f} ms (p50 / p99 / p999 / max over all streams' gaps that end in the window; "
        f"*whole run* includes the ramp, when the single-threaded mock is busy accepting up to "
        f"{max(r['streams'] for r in runs) * 1000 / float(args.ramp_ms):.0f} new streams/s and its events run late; the direct row is the driver's and mock's own noise). "
        f"*Batched* = token events that arrived in the same read as an earlier token event of their "
        f"stream (a proxy that batches shows up here).")
    add(f"- **Window**: {args.settle_s} s after all N streams are open (or after the ramp + the open "
        f"timeout, when some could not be opened by then), {args.window_s} s long; over it, "
        f"CPU = utime + stime from `/proc/PID/stat` (nginx: master + workers) per million events "
        f"received by the driver, busy % per core from `/proc/stat`. **RSS per open stream** = "
        f"(VmRSS at the window's end − VmRSS idle before the first connect) / streams open (fresh "
        f"processes per run); the last column shows it at the window's start → end, as streams "
        f"receive more events.")
    if read(os.path.join(args.work, "warmroute_procs")).strip() == "2":
        wr = ("two processes, `serve --workers 1` and `serve --workers 1 --join` on the same port "
              "and segment (each pinned by its segment row: cores 0 and 1; each with its own fd "
              "limit, as nginx's two worker processes have), one route to the mock")
    else:
        wr = ("`serve --workers 2` (pins its workers to cores 0 and 1, as run in production), one "
              "route to the mock")
    add("- **Parties**, one at a time, each with a fresh mock: *direct* (driver → mock); *warmroute* "
        + wr + "; *nginx* `worker_processes 2; worker_cpu_affinity auto; worker_connections 32768` "
        "(`proxy_buffering off`, `hash $http_x_session_id consistent`, upstream keepalive 64; "
        "`bench/run`'s other scenarios use 8192 connections per worker, which would cap 2 workers "
        "at ~8k streams). fd limit "
        f"{args.nofile}.")
    reduced = read(os.path.join(args.work, "reduced"))
    if reduced != "unknown":
        pairs = ", ".join(" → ".join(l.split()) for l in reduced.splitlines())
        add(f"- **Streams reduced** ({pairs}): the fd limit here is {args.nofile} per process and "
            f"cannot be raised (the container lacks CAP_SYS_RESOURCE); a proxy process holds 2 fds "
            f"per stream and the driver and the mock one each, so every party ran the largest N in "
            f"hundreds that fits.")
    add("")
    add("| streams | party | completed | failed | open in window (min) | events/s in window | **gap extra in window** p50 / p99 / p999 / max (ms) | gap extra p99, whole run (ms) | batched in window / whole run | TTFE p50 / p99 (ms) | **proxy CPU s / M events** | proxy CPU % of a core | mock CPU s / M events | driver CPU s / M events | cores busy | proxy RSS idle → open (MiB) | **proxy RSS / open stream** |")
    add("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in runs:
        d = r["driver"]
        s, ev, w = d["streams"], d["events"], r.get("window")
        fails = ", ".join(f"{k}: {v}" for k, v in s["failures"].items())
        failed = f"{s['failed']}" + (f" ({fails})" if fails else "")
        sd = d.get("steady", {})
        batched = f"{sd.get('coalesced_token_events', '—')} / {ev['coalesced_token_events']}"
        px = w["procs"].get("proxy", {}) if w else {}
        mk = w["procs"].get("mock", {}) if w else {}
        dr = w["procs"].get("driver", {}) if w else {}
        busy = " ".join(f"{c}:{p:.0f}%" for c, p in w["cpu_busy_pct"].items()) if w else "—"
        if px:
            rss = f"{px['rss_kb_idle'] / 1024:.1f} → {px['rss_kb_w1'] / 1024:.1f}"
            per, per0 = px.get("rss_bytes_per_open_stream"), px.get("rss_bytes_per_open_stream_w0")
            per_s = "—" if per is None else f"**{per / 1024:.1f} KiB**"
            if per0 is not None and per is not None:
                per_s = f"{per0 / 1024:.1f} → " + per_s
        else:
            rss, per_s = "—", "—"
        add(f"| {r['streams']} | {PARTY_TITLES.get(r['party'], r['party'])} | {s['completed']}/{s['target']} | "
            f"{failed} | {w['open_min'] if w else '—'} | {fmt(w['events_per_s']) if w else '—'} | {gaps(sd['gap_extra_ms']) if sd else '—'} | "
            f"{fmt(d['gap_extra_ms']['p99'])} | {batched} | "
            f"{fmt(d['ttfe_ms']['p50'], 0)} / {fmt(d['ttfe_ms']['p99'], 0)} | "
            f"{fmt(px.get('cpu_s_per_million_events'))} | {fmt(px.get('cpu_pct_of_one_core'))} | "
            f"{fmt(mk.get('cpu_s_per_million_events'))} | {fmt(dr.get('cpu_s_per_million_events'))} | {busy} | "
            f"{rss} | {per_s} |")
    add("")
    mock_rows = [r for r in runs if r["party"] == "direct" and r.get("window")]
    if mock_rows:
        add("Mock RSS per open stream (direct runs, for scale): " + ", ".join(
            f"{r['streams']} streams {r['window']['procs']['mock'].get('rss_bytes_per_open_stream', 0) / 1024:.1f} KiB"
            for r in mock_rows) + ".")
        add("")
    add(data["verdict_md"])
    if args.chart_note:
        add("")
        add(args.chart_note)
    return "\n".join(out)


def verdict(runs):
    """The target for warmroute at the largest N: all streams, no batching, ≤ 16 KiB per stream."""
    wr = [r for r in runs if r["party"] == "warmroute"]
    if not wr:
        return {"checked": False}, "Target check: no warmroute run."
    r = max(wr, key=lambda x: x["streams"])
    d = r["driver"]
    direct = next((x for x in runs if x["party"] == "direct" and x["streams"] == r["streams"]), None)
    w = r.get("window") or {}
    per = (w.get("procs", {}).get("proxy") or {}).get("rss_bytes_per_open_stream")
    coalesced = d["steady"]["coalesced_token_events"]
    direct_coalesced = direct["driver"]["steady"]["coalesced_token_events"] if direct else None
    all_done = d["streams"]["completed"] == r["streams"]
    p99 = d["steady"]["gap_extra_ms"]["p99"]
    dp99 = direct["driver"]["steady"]["gap_extra_ms"]["p99"] if direct else None
    rss_ok = per is not None and per <= TARGET_RSS_PER_STREAM
    # Batching: more same-read token events than the direct run shows by itself.
    no_batch = direct_coalesced is not None and coalesced <= max(2 * direct_coalesced, d["steady"]["token_events"] // 10000)
    v = {
        "checked": True,
        "streams": r["streams"],
        "completed_all": all_done,
        "no_batching": no_batch,
        "coalesced_token_events": coalesced,
        "direct_coalesced_token_events": direct_coalesced,
        "gap_extra_p99_ms": p99,
        "direct_gap_extra_p99_ms": dp99,
        "rss_bytes_per_open_stream": per,
        "rss_target_bytes": TARGET_RSS_PER_STREAM,
        "rss_ok": rss_ok,
        "met": all_done and no_batch and rss_ok,
    }
    mark = lambda ok: "✅" if ok else "❌"  # noqa: E731
    md = (f"**Target** (warmroute: {r['streams']} concurrent streams on 2 cores, no batching, ≤ 16 KiB RSS "
          f"per idle stream): {mark(v['met'])} — streams completed {d['streams']['completed']}/{r['streams']} "
          f"{mark(all_done)}; batched token events in the window {coalesced} (direct: {direct_coalesced}) {mark(no_batch)}; "
          f"gap extra p99 in the window {fmt(p99, 1)} ms (direct {fmt(dp99, 1)} ms); RSS per open stream "
          f"{'—' if per is None else f'{per / 1024:.1f} KiB'} {mark(rss_ok)}.")
    return v, md


def draw_chart(path, runs):
    plt = pyplot()
    if plt is None:
        return CHART_SKIPPED
    counts = sorted({r["streams"] for r in runs})
    parties = [p for p in PARTY_ORDER if any(r["party"] == p for r in runs)]
    by = {(r["party"], r["streams"]): r for r in runs}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / max(1, len(parties))
    colors = {p: f"C{i}" for i, p in enumerate(PARTY_ORDER)}

    def bars(ax, value, title, ylabel, skip_direct=False):
        for j, p in enumerate(parties):
            if skip_direct and p == "direct":
                continue
            xs, ys = [], []
            for i, n in enumerate(counts):
                r = by.get((p, n))
                v = value(r) if r else None
                if v is not None:
                    xs.append(i + (j - (len(parties) - 1) / 2) * width)
                    ys.append(v)
            ax.bar(xs, ys, width=width, label=PARTY_TITLES.get(p, p), color=colors.get(p))
        ax.set_xticks(range(len(counts)))
        ax.set_xticklabels([f"{n} streams" for n in counts])
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend
        ax.grid(True, axis="y", alpha=0.3)

    def wproc(r, proc, key):
        w = r.get("window")
        return (w["procs"].get(proc) or {}).get(key) if w else None

    bars(axes[0], lambda r: r["driver"]["steady"]["gap_extra_ms"]["p99"], "Inter-event gap: p99 extra delay (window)", "ms over the nominal gap")
    bars(axes[1], lambda r: wproc(r, "proxy", "cpu_s_per_million_events") if r["party"] != "direct"
         else wproc(r, "mock", "cpu_s_per_million_events"),
         "CPU per million events (direct: the mock)", "CPU seconds")
    bars(axes[2], lambda r: (wproc(r, "proxy", "rss_bytes_per_open_stream") or 0) / 1024 if r["party"] != "direct" else None,
         "Proxy RSS per open stream", "KiB", skip_direct=True)
    axes[2].axhline(16, color="k", linestyle="--", linewidth=1, label="target 16 KiB")
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return "![sse chart](sse.png) — `bench/sse.png`: p99 extra inter-event delay, CPU per million events and proxy RSS per open stream."


def main():
    ap = argparse.ArgumentParser()
    add_common_args(ap, "bench/run sse")
    ap.add_argument("--mock", default="")
    ap.add_argument("--settle-s", default="1")
    ap.add_argument("--window-s", default="15")
    ap.add_argument("--ramp-ms", default="5000")
    ap.add_argument("--nofile", default="")
    args = ap.parse_args()
    if not args.nofile:
        args.nofile = read(os.path.join(args.work, "nofile"))
    paths = [p for p in sorted(glob.glob(os.path.join(args.work, "runs", "*-n*.json")))]
    runs = [analyse(args.work, p) for p in paths]
    if not runs:
        sys.exit(f"no runs in {args.work}/runs")
    order = {p: i for i, p in enumerate(PARTY_ORDER)}
    runs.sort(key=lambda r: (r["streams"], order.get(r["party"], 99), r["party"]))
    args.chart_note = draw_chart(args.chart, runs) if args.chart else ""
    v, vmd = verdict(runs)
    data = {
        "scenario": "sse",
        "timestamp": args.timestamp,
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": args.git,
        "command": args.command,
        "mock": args.mock,
        "window_s": float(args.window_s),
        "settle_s": float(args.settle_s),
        "ramp_ms": int(args.ramp_ms),
        "machine": machine_info("n/a", read(os.path.join(args.work, "loadavg-before"))),
        "commands": read(os.path.join(args.work, "commands.txt")).splitlines(),
        "verdict": v,
        "verdict_md": vmd,
        "runs": runs,
    }
    md = render_md(args, data)
    write_outputs(args, "sse", data, md)


if __name__ == "__main__":
    main()
