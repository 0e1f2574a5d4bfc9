#!/usr/bin/env python3
"""Pool the rounds of one or more overhead results (bench/out/overhead*-*.json) into one ratio
of two parties' req/s per case, with a bootstrap interval.

    python3 bench/pool.py [--a warmroute-1w-body] [--b haproxy-1t] [--cases json,stream] RESULT.json...

A run's rounds interleave the parties, so round k of party A and round k of party B ran close
in time: they form a pair. Per case this prints, for each run and for all runs together:
- the median of the paired ratios (what the targets table calls "median of paired rounds");
- the ratio of the summed req/s (A's mean over B's mean: the ratio of the expected req/s);
- a 95% interval of that ratio from a bootstrap that resamples each run's pairs within the run
  (10,000 resamples, fixed seed, so the same files give the same interval).

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="warmroute-1w-body")
    ap.add_argument("--b", default="haproxy-1t")
    ap.add_argument("--cases", default="json,stream")
    ap.add_argument("results", nargs="+")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
