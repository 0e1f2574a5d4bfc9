"""Summarise a `bench/run policy` run: best round per party, ratios, and a RESULTS.md section."""
import json
import os
import re
import sys

res, out, md, ts, rev, rounds, dur, conns = sys.argv[1:9]
rows = [json.loads(line) for line in open(res) if line.strip()]
best, per_round = {}, {}
for r in rows:
    w = r["wrk"]
    rps = w["requests"] / (w["duration_us"] / 1e6)
    per_round.setdefault(r["party"], []).append(rps)
    b = best.get(r["party"])
    if b is None or rps > b[0]:
        errs = r["non2xx"] + sum(w["errors"].values())
        best[r["party"]] = (rps, w["latency_us"]["p50"] / 1000, w["latency_us"]["p99"] / 1000, errs)
json.dump({"timestamp": ts, "git": rev, "best": best, "rows": rows}, open(out, "w"), indent=1)


def ratio(a, b):
    return best[a][0] / best[b][0] if a in best and b in best else float("nan")


order = ["direct", "warmroute-no-id", "warmroute-header-id", "warmroute-body-id", "haproxy-1t"]
lines = [
    f"## policy — what the routing policy costs ({ts[:4]}-{ts[4:6]}-{ts[6:8]} {ts[9:11]}:{ts[11:13]} UTC)",
    "",
    f"- **git** `{rev}`; static nginx backend and wrk on core 1, the proxy alone on core 0 (warmroute "
    f"`--workers 1 --no-pin`, haproxy `nbthread 1`); wrk `-t1 -c{conns}` for {dur} per party, {rounds} "
    "interleaved rounds, best kept; non-streaming JSON, 64 rotating session ids.",
    "- `warmroute-no-id`: no session id anywhere (plain least-connections proxying, the core issue's plain-proxy "
    "case); `-header-id`: `X-Session-ID` (crc32 affinity; the body is not parsed); `-body-id`: "
    "`metadata.session_id` in the JSON body (one-pass body parse per request).",
    "",
    "| party | req/s | rounds (k req/s) | p50 ms | p99 ms | errors |",
    "|---|---:|---:|---:|---:|---:|",
]
for p in order:
    if p in best:
        r = best[p]
        rs = " / ".join(f"{x / 1000:.1f}" for x in per_round[p])
        lines.append(f"| {p} | {r[0]:,.0f} | {rs} | {r[1]:.3f} | {r[2]:.3f} | {r[3]} |")
lines += [
    "",
    f"- body-id / no-id: **{ratio('warmroute-body-id', 'warmroute-no-id'):.2f}×** (target ≥ 0.90×); "
    f"header-id / no-id: {ratio('warmroute-header-id', 'warmroute-no-id'):.2f}×; "
    f"body-id / haproxy: {ratio('warmroute-body-id', 'haproxy-1t'):.2f}×",
    "",
    f"Command: `BENCH_ROUNDS={rounds} bench/run policy`",
    "",
]
section = "<!-- bench:policy:begin -->\n" + "\n".join(lines) + "<!-- bench:policy:end -->\n"
if md:
    text = open(md).read() if os.path.exists(md) else ""
    if "<!-- bench:policy:begin -->" in text:
        text = re.sub(r"<!-- bench:policy:begin -->.*?<!-- bench:policy:end -->\n?", lambda m: section, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    open(md, "w").write(text)
print("\n".join(lines))
