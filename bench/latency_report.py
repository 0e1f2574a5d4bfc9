#!/usr/bin/env python3
"""Report of bench/run latency: unloaded (-c1) latency of direct, warmroute, nginx and haproxy
(warmroute and haproxy also with busy polling) in three placements (across cores; across cores
with no core ever idle; all on one core), as JSON, a RESULTS.md section and a PNG chart.

Per round and placement, a party's added latency is its p50 minus direct's p50 in the same
round and placement; the tables give the median over rounds (and the range)."""

import argparse
import os
import statistics
import sys
from datetime import datetime, timezone

sys.dont_write_bytecode = True  # no bench/__pycache__ from importing report.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import (CHART_SKIPPED, add_common_args, load_jsonl, machine_info, machine_line, pyplot,  # noqa: E402
                    read, run_line, section_date, write_outputs)

PARTIES = ["direct", "warmroute-1w-body", "warmroute-bp", "nginx-1w", "haproxy-1t", "haproxy-bp"]
TITLES = {
    "direct": "direct (wrk → backend)",
    "warmroute-1w-body": "warmroute, 1 worker, id in the body",
    "warmroute-bp": "warmroute, the same with busy_poll_us = {bp}",
    "nginx-1w": "nginx, 1 worker (hash … consistent)",
    "haproxy-1t": "haproxy, 1 thread (balance hdr)",
    "haproxy-bp": "haproxy, the same with busy-polling",
}
# The proxies other than warmroute's default, as the target line and the split name them.
OTHERS = {
    "warmroute-bp": "warmroute busy_poll_us",
    "nginx-1w": "nginx",
    "haproxy-1t": "haproxy",
    "haproxy-bp": "haproxy busy-polling",
}
PLACEMENTS = ["across", "awake", "local"]
PLACEMENT_TITLES = {
    "across": "across cores",
    "awake": "across cores, no core idle",
    "local": "one core",
}
TARGET_US = 100


def med(v):
    return statistics.median(v) if v else None


def collect(rows):
    """{(party, placement): {"p50": [..], "p99": [..], "added": [..], "rps": [..]}} by round."""
    by_round = {}
    for r in rows:
        if r.get("kind") != "c1":
            continue
        lat = r["wrk"]["latency_us"]
        by_round[(r["party"], r["group"], r["round"])] = {
            "p50": lat["p50"],
            "p99": lat["p99"],
            "rps": r["wrk"]["requests"] / (r["wrk"]["duration_us"] / 1e6),
            "errors": sum(r["wrk"]["errors"].values()) + r.get("non2xx", 0),
        }
    out = {}
    for (party, placement, rnd), v in by_round.items():
        d = by_round.get(("direct", placement, rnd))
        o = out.setdefault((party, placement), {"p50": [], "p99": [], "added": [], "rps": [], "errors": 0})
        o["p50"].append(v["p50"])
        o["p99"].append(v["p99"])
        o["rps"].append(v["rps"])
        o["errors"] += v["errors"]
        if d is not None:
            o["added"].append(v["p50"] - d["p50"])
    return out


def fmt_us(v):
    return "—" if v is None else f"{v:.0f}"


def render_md(args, data):
    m = data["machine"]
    when = section_date(args.timestamp)
    out = []
    add = out.append
    add(f"## latency — where the unloaded latency a proxy adds goes ({when})")
    add("")
    add(run_line(args, "latency", when))
    add(machine_line(m, f"; {m['nginx']}; {m['haproxy']}; {m['wrk']}"))
    add(f"- **Load**: `wrk -t1 -c1 -d{args.duration}` (after a 1s warm-up) of the overhead scenario's "
        f"non-streaming JSON request (`bench/wrk/chat.lua`, 64 rotating session ids; warmroute reads "
        f"the id from `metadata.session_id`, nginx and haproxy from `X-Session-ID`) against one static "
        f"nginx backend; {args.rounds} rounds, the parties in reverse order every other round.")
    add(f"- **Busy polling**: warmroute with `busy_poll_us = {args.busy_poll_us}` in its server file (after "
        f"each request it starts or finishes, the worker polls its ring for {args.busy_poll_us} µs instead "
        f"of waiting) as its own process; haproxy with `busy-polling` in `global` (it never waits), held "
        f"stopped (SIGSTOP) except during its own runs, so its spinning does not keep the proxy core awake "
        f"for the other parties.")
    add(f"- **Placements**: *across cores* — the proxy on core {args.proxy_cpu}, wrk and the backend on "
        f"core {args.load_cpu} (the overhead scenario's c1 run): each of the four hops "
        f"(wrk → proxy → backend → proxy → wrk) wakes a process on the other core. *No core idle* — the "
        f"same, plus a `chrt -i 0` (SCHED_IDLE) busy loop on every core, which runs only when the core "
        f"has nothing else to run: no core halts, so no hop waits for a halted (virtual) CPU to be "
        f"woken. *One core* — the proxy moved onto core {args.load_cpu} (`taskset -apc`): every hop is "
        f"a context switch on one core, and what the proxy adds is its own work.")
    add("- **+p50** = the party's p50 minus direct's p50 in the same round and placement; median over "
        "rounds, with the range.")
    add("")
    head = "| party |"
    sep = "|---|"
    for pl in data["placements"]:
        head += f" p50 µs ({PLACEMENT_TITLES[pl]}) | +p50 µs ({PLACEMENT_TITLES[pl]}) | p99 µs |"
        sep += "---:|---:|---:|"
    add(head + " errors |")
    add(sep + "---:|")
    for party in PARTIES:
        row = f"| {TITLES[party].format(bp=args.busy_poll_us)} |"
        errors = 0
        for pl in data["placements"]:
            s = data["results"].get(f"{party}/{pl}")
            if not s:
                row += " — | — | — |"
                continue
            errors += s["errors"]
            rng = ""
            if party != "direct" and s["added_us"]:
                rng = f" ({min(s['added_us']):.0f}…{max(s['added_us']):.0f})"
            added = "—" if party == "direct" else fmt_us(s["added_median_us"]) + rng
            row += f" {fmt_us(s['p50_median_us'])} | {added} | {fmt_us(s['p99_median_us'])} |"
        add(row + f" {errors} |")
    add("")
    wr = {pl: data["results"].get(f"warmroute-1w-body/{pl}") for pl in data["placements"]}

    def added(pl, party="warmroute-1w-body"):
        s = data["results"].get(f"{party}/{pl}")
        return None if not s else s["added_median_us"]

    def mark(a):
        return "✅" if a <= TARGET_US else "❌"

    lines = []
    for pl in data["placements"]:
        a = added(pl)
        if a is None:
            continue
        bp = added(pl, "warmroute-bp")
        with_bp = "" if bp is None else f", with busy_poll_us = {args.busy_poll_us} +{bp:.0f} µs {mark(bp)}"
        others = ", ".join(
            f"{OTHERS[p]} {fmt_us(added(pl, p))} µs"
            for p in ("nginx-1w", "haproxy-1t", "haproxy-bp")
            if added(pl, p) is not None
        )
        lines.append(f"{PLACEMENT_TITLES[pl]}: +{a:.0f} µs {mark(a)}{with_bp} ({others})")
    add(f"**Target** — warmroute adds ≤ {TARGET_US} µs to the unloaded p50: " + "; ".join(lines) + ".")
    if all(wr.get(pl) for pl in ("across", "awake", "local")):
        a, w, lo = added("across"), added("awake"), added("local")
        add("")
        add(f"Where warmroute's +{a:.0f} µs across cores goes: about {a - w:.0f} µs is waking halted cores "
            f"(across − no core idle), about {w - lo:.0f} µs is signalling the other core (no core idle − "
            f"one core), and {lo:.0f} µs is the proxy's own work (one core).")
        others = []
        for p in OTHERS:
            a, w, lo = (added(pl, p) for pl in ("across", "awake", "local"))
            if None not in (a, w, lo):
                others.append(f"{OTHERS[p]} {a - w:.0f} / {w - lo:.0f} / {lo:.0f} µs")
        if others:
            add(f"The same split for the others (waking / signalling / own work): {'; '.join(others)}.")
    if args.chart_note:
        add("")
        add(args.chart_note)
    return "\n".join(out)


def draw_chart(path, data):
    plt = pyplot()
    if plt is None:
        return CHART_SKIPPED
    parties = [p for p in PARTIES if p != "direct"]
    pls = data["placements"]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(parties)
    for j, p in enumerate(parties):
        xs, ys = [], []
        for i, pl in enumerate(pls):
            s = data["results"].get(f"{p}/{pl}")
            if s and s["added_median_us"] is not None:
                xs.append(i + (j - (len(parties) - 1) / 2) * width)
                ys.append(s["added_median_us"])
        ax.bar(xs, ys, width=width, label=TITLES[p].format(bp=data["busy_poll_us"]), color=f"C{j}")
    ax.axhline(TARGET_US, color="red", linestyle="--", linewidth=1, label=f"target ({TARGET_US} µs)")
    ax.set_xticks(range(len(pls)))
    ax.set_xticklabels([PLACEMENT_TITLES[pl] for pl in pls])
    ax.set_ylabel("added p50 over direct at -c1 (µs)")
    ax.set_title("Unloaded latency a proxy adds, by placement")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"![latency chart]({os.path.basename(path)}) — `bench/{os.path.basename(path)}`: +p50 over direct per placement."


def main():
    ap = argparse.ArgumentParser()
    add_common_args(ap, "bench/run latency")
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--duration", required=True)
    ap.add_argument("--proxy-cpu", required=True)
    ap.add_argument("--load-cpu", required=True)
    ap.add_argument("--busy-poll-us", type=int, default=200)
    args = ap.parse_args()
    rows = load_jsonl(os.path.join(args.work, "results.jsonl"))
    stats = collect(rows)
    placements = [pl for pl in PLACEMENTS if any(k[1] == pl for k in stats)]
    results = {}
    for (party, pl), s in stats.items():
        results[f"{party}/{pl}"] = {
            "p50_us": s["p50"],
            "p99_us": s["p99"],
            "rps": [round(x) for x in s["rps"]],
            "added_us": s["added"],
            "p50_median_us": med(s["p50"]),
            "p99_median_us": med(s["p99"]),
            "added_median_us": med(s["added"]),
            "errors": s["errors"],
        }
    data = {
        "scenario": "latency",
        "timestamp": args.timestamp,
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": args.git,
        "command": args.command,
        "rounds": args.rounds,
        "duration": args.duration,
        "placements": placements,
        "busy_poll_us": args.busy_poll_us,
        "machine": machine_info("n/a", read(os.path.join(args.work, "loadavg-before"))),
        "commands": read(os.path.join(args.work, "commands.txt")).splitlines(),
        "results": results,
    }
    args.chart_note = draw_chart(args.chart, data) if args.chart else ""
    md = render_md(args, data)
    write_outputs(args, "latency", data, md)


if __name__ == "__main__":
    main()
