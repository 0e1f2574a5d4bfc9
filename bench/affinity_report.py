#!/usr/bin/env python3
"""Turn one `bench/run affinity` work directory into a JSON result file, a section of
RESULTS.md (between `<!-- bench:affinity:begin -->` and `<!-- bench:affinity:end -->`) and,
when matplotlib is importable, a PNG chart (hit rate and warm-turn TTFT vs load per party).

Called by bench/run; standard library only (matplotlib optional).
"""

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import (CHART_SKIPPED, add_common_args, machine_info, machine_line, pyplot, read,  # noqa: E402
                    run_line, section_date, write_outputs)

PARTY_ORDER = ["wr-crc32", "wr-crc32-bounded", "wr-crc32-prio", "wr-crc32-noshed", "wr-table-bounded", "wr-table-prio", "wr-table-noshed", "wr-rendezvous", "wr-noid", "haproxy-sticky", "haproxy-rr"]
PARTY_TITLES = {
    "wr-crc32": "warmroute crc32",
    "wr-crc32-bounded": "warmroute crc32, affinity_overflow = bounded_load",
    "wr-table-bounded": "warmroute sticky_table, affinity_overflow = bounded_load",
    "wr-crc32-prio": "warmroute crc32, bounded_load, session_prio (first turns shed first)",
    "wr-crc32-noshed": "warmroute crc32, bounded_load, rt_limit_factor = 3 (no 429: engines queue)",
    "wr-table-prio": "warmroute sticky_table, bounded_load, session_prio",
    "wr-table-noshed": "warmroute sticky_table, bounded_load, rt_limit_factor = 3 (no 429: engines queue)",
    "wr-rendezvous": "warmroute rendezvous",
    "wr-noid": "warmroute, no id (least conn)",
    "haproxy-sticky": "haproxy sticky (hdr, consistent)",
    "haproxy-rr": "haproxy round robin",
}


def load_runs(work):
    runs = []
    for path in sorted(glob.glob(os.path.join(work, "runs", "*.json"))):
        with open(path) as f:
            r = json.load(f)
        name = os.path.basename(path)[: -len(".json")]
        party, _, c = name.rpartition("-c")
        r["party"] = party
        r["load"] = int(c)
        runs.append(r)
    order = {p: i for i, p in enumerate(PARTY_ORDER)}
    runs.sort(key=lambda r: (r["load"], order.get(r["party"], 99), r["party"]))
    return runs


def pct(v):
    return "—" if v is None else f"{100 * v:.1f}%"


def ms(v):
    return "—" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def render_md(args, data):
    m = data["machine"]
    runs = data["runs"]
    cfg = runs[0]["config"] if runs else {}
    when = section_date(args.timestamp)
    out = []
    add = out.append
    add(f"## affinity — multi-turn replay against 8 mock engines with bounded prefix caches ({when})")
    add("")
    add(run_line(args, "affinity", when))
    add(machine_line(m, " (the machine is shared with other work, so absolute TTFTs are noisy; "
                        "hit rates are not timing-sensitive except through spills); "
                        f"{m['haproxy']}"))
    add(f"- **Engines**: 8 × `warmroute-mock {args.mock}` — a miss costs "
        f"{args.mock_ttft_us} µs per uncached prompt token of TTFT (a cold {cfg.get('system_tokens', 0) + cfg.get('turn_tokens', 0)}-token "
        f"first turn ≈ {(cfg.get('system_tokens', 0) + cfg.get('turn_tokens', 0)) * args.mock_ttft_us / 1000:.0f} ms "
        f"over a warm one); each engine's LRU block cache holds {args.cache_tokens} tokens "
        f"(a conversation reaches {cfg.get('system_tokens', 0) + cfg.get('turns', 0) * (cfg.get('turn_tokens', 0) + cfg.get('max_tokens', 0)) - cfg.get('max_tokens', 0)} tokens), "
        f"so the larger loads' live sessions overflow one engine but fit the 8 together. "
        f"Engines queue above their concurrency (first come, first served; a queued "
        f"request's prefill starts when it gets a slot); fresh engines (empty caches) "
        f"for every run.")
    add(f"- **Replay** (`warmroute-bench replay`, bench/src/main.rs): per run, "
        f"4 × concurrency sessions (at least 32) × {cfg.get('turns')} turns; turn prompt = "
        f"a per-session system prompt of {cfg.get('system_tokens')} words + all previous user "
        f"turns and the replies received + a new {cfg.get('turn_tokens')}-word user message; "
        f"`max_tokens` {cfg.get('max_tokens')}, streaming with `include_usage`, no think time, "
        f"a UUID-shaped session id in `X-Session-ID` (none for *no id*), seed {cfg.get('seed')}; 429/5xx/connection "
        f"errors are retried by the client after 10–320 ms (TTFT columns are of the successful attempt; *incl. 429 retries* counts from the turn's first attempt). Hit rate = Σcached / Σprompt tokens "
        f"from the usage frames; ideal = what one engine with an unbounded cache would give for "
        f"the same prompts (every turn after the first hits the previous prompt's whole "
        f"{cfg.get('block_tokens')}-token blocks). Stickiness = share of turns answered by the "
        f"engine of the session's previous turn (`x-mock-peer`); fallback = turns with "
        f"`X-Routed-Mode: hash_fallback`.")
    add(f"- **Parties** (each its own process, one at a time): warmroute `--workers 1 --no-pin` "
        f"with one route of the 8 engines (`max_concurrency = {args.mock_conc}` each, the engines' "
        f"own limit, so the pool takes {8 * args.mock_conc} requests at once and sheds 429 above that), `affinity_hash = \"crc32_mod\"`, `\"rendezvous\"` or `\"sticky_table\"` (new sessions placed on the least loaded engine, then kept there), `affinity_overflow = \"at_max\"` unless the party says `bounded_load`; for the session_prio parties `session_prio = true`, their driver also sending `x-phanrouter-session: {{\"session_id\": …, \"turn\": N}}`; the crc32 config driven "
        f"without ids (least connections); haproxy `nbthread 1` with `balance hdr(X-Session-ID)` + "
        f"`hash-type consistent`, or `balance roundrobin` (servers `maxconn 4096`: the engines queue) and `option http-no-delay` (without it haproxy 2.6 delivered each small SSE stream in one piece at its end). "
        f"Proxies under `taskset -c {args.proxy_cpu}`; engines and the driver "
        f"{'under `taskset -c ' + args.load_cpu + '`' if args.load_cpu else 'unpinned'}.")
    add("")
    add("### Hit rate and TTFT by load")
    add("")
    add("| in flight | party | turns | hit rate | ideal | hit / ideal | TTFT p50 / p99 turn 1 (ms) | TTFT p50 / p99 later turns (ms) | same, incl. 429 retries | sticky | fallback | 429 | 5xx / failed | turns/s |")
    add("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        t = r["totals"]
        f1, fl, fr = t["ttft_first_turn_ms"], t["ttft_later_turns_ms"], t["ttft_incl_retries_later_turns_ms"]
        rel = (t["hit_rate"] / t["ideal_hit_rate"]) if t["hit_rate"] is not None and t["ideal_hit_rate"] else None
        add(f"| {r['load']} | {PARTY_TITLES.get(r['party'], r['party'])} | {t['ok']}/{t['turns']} | "
            f"{pct(t['hit_rate'])} | {pct(t['ideal_hit_rate'])} | {pct(rel)} | "
            f"{ms(f1['p50'])} / {ms(f1['p99'])} | {ms(fl['p50'])} / {ms(fl['p99'])} | {ms(fr['p50'])} / {ms(fr['p99'])} | "
            f"{pct(t['stickiness'])} | {t['hash_fallback']} | {t['status_429']} | "
            f"{t['status_5xx']} / {t['failed_turns']} | {t['turns_per_s']:.0f} |")
    add("")
    add("### TTFT p50 / p99 (ms) and hit rate per turn")
    add("")
    turns = cfg.get("turns", 0)
    add("| in flight | party | " + " | ".join(f"turn {i}" for i in range(1, turns + 1)) + " |")
    add("|---:|---|" + "---:|" * turns)
    for r in runs:
        cells = []
        for pt in r["per_turn"]:
            cells.append(f"{ms(pt['ttft_p50_ms'])} / {ms(pt['ttft_p99_ms'])} · {pct(pt['hit_rate'])}")
        add(f"| {r['load']} | {PARTY_TITLES.get(r['party'], r['party'])} | " + " | ".join(cells) + " |")
    add("")
    add("### Turns per engine (balance)")
    add("")
    add("| in flight | party | turns per engine e0…e7 |")
    add("|---:|---|---|")
    for r in runs:
        per = r["totals"]["turns_per_peer"]
        add(f"| {r['load']} | {PARTY_TITLES.get(r['party'], r['party'])} | "
            + " / ".join(str(per.get(f"e{i}", 0)) for i in range(8)) + " |")
    if args.chart_note:
        add("")
        add(args.chart_note)
    return "\n".join(out)


def draw_chart(path, runs):
    plt = pyplot()
    if plt is None:
        return CHART_SKIPPED
    loads = sorted({r["load"] for r in runs})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ideal = {}
    for party in PARTY_ORDER:
        rs = [r for r in runs if r["party"] == party]
        if not rs:
            continue
        xs = [r["load"] for r in rs]
        ax1.plot(xs, [100 * (r["totals"]["hit_rate"] or 0) for r in rs], marker="o",
                 label=PARTY_TITLES[party])
        ax2.plot(xs, [r["totals"]["ttft_later_turns_ms"]["p50"] or 0 for r in rs], marker="o",
                 label=PARTY_TITLES[party])
        for r in rs:
            ideal.setdefault(r["load"], 100 * (r["totals"]["ideal_hit_rate"] or 0))
    ax1.plot(loads, [ideal[x] for x in loads], "k--", label="ideal (one unbounded cache)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads)
        ax.set_xticklabels([str(x) for x in loads])
        ax.set_xlabel("sessions in flight")
        ax.grid(True, alpha=0.3)
    ax1.set_ylabel("prefix-cache hit rate (%)")
    ax1.set_ylim(0, 100)
    ax1.set_title("Cache hit rate vs load (8 mock engines)")
    ax2.set_ylabel("TTFT p50, turns 2+ (ms)")
    ax2.set_title("Warm-turn TTFT vs load")
    ax1.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return "![affinity chart](affinity.png) — `bench/affinity.png`: hit rate and warm-turn TTFT p50 vs load per party."


def main():
    ap = argparse.ArgumentParser()
    add_common_args(ap, "bench/run affinity")
    ap.add_argument("--proxy-cpu", default="")
    ap.add_argument("--load-cpu", default="")
    ap.add_argument("--mock", default="")
    args = ap.parse_args()
    mock = args.mock.split()

    def flag(name, default):
        return mock[mock.index(name) + 1] if name in mock else default

    args.mock_ttft_us = int(flag("--ttft-per-token-us", "0"))
    args.cache_tokens = int(flag("--cache-tokens", "0"))
    args.mock_conc = int(flag("--max-concurrency", "0"))
    runs = load_runs(args.work)
    if not runs:
        sys.exit(f"no runs in {args.work}/runs")
    args.chart_note = draw_chart(args.chart, runs) if args.chart else ""
    data = {
        "scenario": "affinity",
        "timestamp": args.timestamp,
        "git": args.git,
        "command": args.command,
        "mock": args.mock,
        "machine": machine_info("n/a", read(os.path.join(args.work, "loadavg-before"))),
        "commands": read(os.path.join(args.work, "commands.txt")).splitlines(),
        "runs": runs,
    }
    write_outputs(args, "affinity", data, render_md(args, data))


if __name__ == "__main__":
    main()
