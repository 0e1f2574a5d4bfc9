#!/usr/bin/env python3
"""Pool the rounds of one or more overhead results (bench/out/overhead*-*.json) into one ratio
of two parties' req/s per case, with a bootstrap interval.

    python3 bench/pool.py [--a warmroute-1w-body] [--b haproxy-1t] [--cases json,stream] RESULT.json...
    python3 bench/pool.py --keep RESULT.json...   # copies the rounds into bench/rounds/

A run's rounds interleave the parties, so round k of party A and round k of party B ran close
in time: they form a pair. Per case this prints, for each run and for all runs together:
- the median of the paired ratios (what the targets table calls "median of paired rounds");
- the ratio of the summed req/s (A's mean over B's mean: the ratio of the expected req/s);
- a 95% interval of that ratio from a bootstrap that resamples each run's pairs within the run
  (10,000 resamples, fixed seed, so the same files give the same interval);
- with two runs or more, the runs' own ratios taken as samples: their mean and a 95% t interval
  (the host moves between runs too, so this interval is the wider and the more honest one).

bench/out is not committed. `--keep` writes each result's throughput rounds (party, case,
round, requests, req/s, p99, proxy CPU) with its date, git, machine and command to
bench/rounds/<same name> (about 22 KB for a 16-round run of two cases), so a pooled figure
quoted in bench/RESULTS.md can be recomputed from the repository:
`python3 bench/pool.py bench/rounds/overhead-capped-*.json`.

On a machine whose speed moves by a third from one round to the next, a single run of 8-12
rounds has an interval about ±0.08 wide around a ratio near 1.2: pooling runs is how the
ratio gets pinned down. Standard library only.
"""

import argparse
import json
import random
from statistics import median


def pairs_of(result, a, b, case):
    """(A's req/s, B's req/s) per round of `case` in one result file, in round order."""
    by = {}
    for r in result.get("runs", []):
        if r.get("case") != case or r.get("kind") != "throughput" or not r.get("rps"):
            continue
        if r.get("party") in (a, b):
            by.setdefault(r["round"], {})[r["party"]] = r["rps"]
    return [(v[a], v[b]) for _, v in sorted(by.items()) if a in v and b in v]


def ratio_of_sums(pairs):
    return sum(x for x, _ in pairs) / sum(y for _, y in pairs)


def interval(groups, reps=10000, seed=1):
    """95% bootstrap interval of the pooled ratio of sums, resampling within each group."""
    rng = random.Random(seed)
    stats = []
    for _ in range(reps):
        sa = sb = 0.0
        for g in groups:
            n = len(g)
            for _ in range(n):
                x, y = g[rng.randrange(n)]
                sa += x
                sb += y
        stats.append(sa / sb)
    stats.sort()
    return stats[int(0.025 * reps)], stats[int(0.975 * reps) - 1]


# Two-sided 95% quantiles of Student's t, by degrees of freedom 1-30 (31-60: 2.0; beyond: 1.96).
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
       2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
       2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t_interval(xs):
    """Mean of `xs` and the half-width of its 95% t interval (two samples at least)."""
    n = len(xs)
    m = sum(xs) / n
    sd = (sum((x - m) ** 2 for x in xs) / (n - 1)) ** 0.5
    df = n - 1
    t = T95[df - 1] if df <= len(T95) else 2.0 if df <= 60 else 1.96
    return m, t * sd / n ** 0.5


KEEP_FIELDS = ("party", "group", "case", "kind", "round", "conns", "requests", "duration_s",
               "rps", "non2xx", "proc_cpu_ns")


def keep(path):
    """Write the throughput rounds of one result to bench/rounds/ (see the module comment)."""
    import os
    with open(path) as f:
        res = json.load(f)
    rounds = []
    for r in res.get("runs", []):
        if r.get("kind") != "throughput":
            continue
        k = {f: r.get(f) for f in KEEP_FIELDS}
        k["p99_us"] = (r.get("latency_us") or {}).get("p99")
        rounds.append(k)
    out = {f: res.get(f) for f in ("scenario", "timestamp", "date", "git", "machine", "command")}
    out["runs"] = rounds
    dest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rounds",
                        os.path.basename(path))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    # One round per line: small, and a diff or grep shows rounds whole.
    text = json.dumps(out, indent=1, sort_keys=True)
    for r in rounds:
        text = text.replace(json.dumps(r, indent=1, sort_keys=True).replace("\n", "\n  "),
                            json.dumps(r, sort_keys=True), 1)
    with open(dest, "w") as f:
        f.write(text + "\n")
    print(f"{path} -> {dest} ({len(rounds)} rounds)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="warmroute-1w-body")
    ap.add_argument("--b", default="haproxy-1t")
    ap.add_argument("--cases", default="json,stream")
    ap.add_argument("--keep", action="store_true",
                    help="copy each result's rounds into bench/rounds/ instead of pooling")
    ap.add_argument("results", nargs="+")
    args = ap.parse_args()
    if args.keep:
        for path in args.results:
            keep(path)
        return
    results = []
    for path in args.results:
        with open(path) as f:
            results.append((path, json.load(f)))
    for case in args.cases.split(","):
        print(f"{case}: {args.a} / {args.b}")
        groups = []
        for path, res in results:
            p = pairs_of(res, args.a, args.b, case)
            if not p:
                continue
            groups.append(p)
            lo, hi = interval([p], reps=2000)
            med = median(x / y for x, y in p)
            print(f"  {path.rsplit('/', 1)[-1]:<45} {res.get('git', '?'):<16} rounds {len(p):>3}  "
                  f"median {med:.3f}  mean {ratio_of_sums(p):.3f}  ({lo:.3f}-{hi:.3f})")
        if not groups:
            print("  no paired rounds")
            continue
        every = [x for g in groups for x in g]
        lo, hi = interval(groups)
        print(f"  {'all ' + str(len(groups)) + ' runs':<62} rounds {len(every):>3}  "
              f"median {median(x / y for x, y in every):.3f}  mean {ratio_of_sums(every):.3f}  "
              f"({lo:.3f}-{hi:.3f})")
        if len(groups) >= 2:
            m, h = t_interval([ratio_of_sums(g) for g in groups])
            print(f"  {'the runs as samples':<62} runs {len(groups):>5}  mean {m:.3f} +- {h:.3f}  "
                  f"({m - h:.3f}-{m + h:.3f}, t, {len(groups) - 1} df)")


if __name__ == "__main__":
    main()
