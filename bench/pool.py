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

`--section` also writes what it printed as the `overhead-pooled` section of bench/RESULTS.md
(between its markers, after the overhead-capped section), with each run's CPU per request
and p99 against B's and the verdict against the 1.2x target, and the chart
bench/overhead-pooled.png (when matplotlib is installed):
`python3 bench/pool.py --section bench/rounds/overhead-capped-*.json`.

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


def rounds_of(result, party, case):
    """Round number -> that round's throughput record of `party` and `case`."""
    return {r["round"]: r for r in result.get("runs", [])
            if r.get("party") == party and r.get("case") == case
            and r.get("kind") == "throughput" and r.get("rps")}


def cpu_and_p99(result, a, b, case):
    """A's CPU per request over B's (the rounds' sums), and the median of A's p99 over B's per
    paired round; None for what the rounds do not carry (p99 under either key: a result
    file's `latency_us`, or a kept file's `p99_us`)."""
    ra, rb = rounds_of(result, a, case), rounds_of(result, b, case)
    both = sorted(set(ra) & set(rb))

    def p99(r):
        return r.get("p99_us") or (r.get("latency_us") or {}).get("p99")

    def cpu(rs):
        if any(not r.get("proc_cpu_ns") or not r.get("requests") for r in rs):
            return None
        return sum(r["proc_cpu_ns"] for r in rs) / sum(r["requests"] for r in rs)

    ca, cb = cpu([ra[k] for k in both]), cpu([rb[k] for k in both])
    p99s = [p99(ra[k]) / p99(rb[k]) for k in both if p99(ra[k]) and p99(rb[k])]
    return (ca / cb if ca and cb else None), (median(p99s) if p99s else None)


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


TARGET = 1.2


def pool_case(results, a, b, case):
    """The figures of one case: per run, all rounds together and the runs as samples."""
    runs = []
    for path, res in results:
        p = pairs_of(res, a, b, case)
        if not p:
            continue
        cpu, p99 = cpu_and_p99(res, a, b, case)
        runs.append({"file": path.rsplit("/", 1)[-1], "date": res.get("date", "?"),
                     "git": res.get("git", "?"), "pairs": p,
                     "median": median(x / y for x, y in p), "mean": ratio_of_sums(p),
                     "interval": interval([p], reps=2000), "cpu": cpu, "p99": p99})
    if not runs:
        return None
    groups = [r["pairs"] for r in runs]
    every = [x for g in groups for x in g]
    out = {"runs": runs, "rounds": len(every), "median": median(x / y for x, y in every),
           "mean": ratio_of_sums(every), "interval": interval(groups), "samples": None}
    if len(groups) >= 2:
        out["samples"] = t_interval([r["mean"] for r in runs])
    return out


def verdict(m, lo, what):
    if m < TARGET:
        return f"below the {TARGET}× target ({what}: {m:.3f}×)"
    if lo >= TARGET:
        return f"above the {TARGET}× target, the whole interval too ({what}: {m:.3f}×, from {lo:.3f}×)"
    return (f"estimate above the {TARGET}× target, but the interval dips below it ({what}: "
            f"{m:.3f}×, from {lo:.3f}×): not shown yet")


def fmt(x, spec=".2f", suffix="×"):
    return "—" if x is None else f"{x:{spec}}{suffix}"


def section(results, a, b, figures, argv):
    """The overhead-pooled section of bench/RESULTS.md (Markdown); `figures` is
    `[(case, pool_case(...))]`."""
    gits = sorted({res.get("git", "?") for _, res in results})
    dates = sorted(res.get("date", "?") for _, res in results)
    kernels = sorted({(res.get("machine") or {}).get("kernel", "?") for _, res in results})
    cmds = sorted({res.get("command", "?") for _, res in results})
    lines = [
        f"## overhead-pooled — {len(results)} capped runs pooled ({dates[0]} to {dates[-1]})",
        "",
        f"- **Generated by** `python3 bench/pool.py --section {' '.join(argv)}` from the "
        "rounds that `bench/pool.py --keep` copied into `bench/rounds/` (committed, so these "
        "figures can be recomputed from the repository).",
        f"- **Parties**: {a} over {b}, each pinned to core 0 under the quota the runs' "
        "command gives (see the overhead-capped section for the setup).",
        f"- **Builds**: {', '.join(f'`{g}`' for g in gits)}"
        + (" (the checkout's revision at each run: with `BENCH_NO_BUILD=1` the binary can "
           "be older; pool runs of one build only, and say which)" if len(gits) > 1 else "")
        + f"; **kernels**: {', '.join(f'`{k}`' for k in kernels)}.",
        f"- **Command of the runs**: {'; '.join(f'`{c}`' for c in cmds)}.",
        "- **Columns**: *median* is the median of the paired rounds' ratios (round k of each "
        "party ran back to back); *ratio* is A's mean req/s over B's, with a 95% bootstrap "
        "interval that resamples each run's pairs within the run (fixed seed; 10,000 "
        "resamples for the pooled rows, 2,000 for a run's); *CPU/req* is A's CPU per request over B's (the rounds' sums of "
        "`/proc/TID/schedstat` time and requests); *p99* is the median of the paired rounds' "
        "p99 ratios. *The runs as samples* takes each run's ratio as one sample (mean, 95% t "
        "interval): the host moves between runs as well as between rounds, so this is the "
        "wider interval and the one the verdict reads.",
        "",
    ]
    for case, f in figures:
        lines.append(f"### {case}")
        lines.append("")
        if f is None:
            lines += ["No paired rounds.", ""]
            continue
        lines += ["| run | git | rounds | median | ratio (95%) | CPU/req | p99 |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in f["runs"]:
            lo, hi = r["interval"]
            lines.append(f"| `{r['file']}` ({r['date']}) | `{r['git']}` | {len(r['pairs'])} | "
                         f"{r['median']:.3f}× | {r['mean']:.3f}× ({lo:.3f}–{hi:.3f}) | "
                         f"{fmt(r['cpu'])} | {fmt(r['p99'])} |")
        lo, hi = f["interval"]
        cpus = [r["cpu"] for r in f["runs"] if r["cpu"] is not None]
        p99s = [r["p99"] for r in f["runs"] if r["p99"] is not None]
        span = (lambda xs: f"{min(xs):.2f}–{max(xs):.2f}×" if xs else "—")
        lines.append(f"| **all {len(f['runs'])} runs, rounds pooled** | | {f['rounds']} | "
                     f"{f['median']:.3f}× | **{f['mean']:.3f}×** ({lo:.3f}–{hi:.3f}) | "
                     f"{span(cpus)} | {span(p99s)} |")
        if f["samples"]:
            m, h = f["samples"]
            lines.append(f"| **the runs as samples** | | {len(f['runs'])} runs | | "
                         f"**{m:.3f}×** ({m - h:.3f}–{m + h:.3f}, t, {len(f['runs']) - 1} df) | | |")
            lines += ["", f"Verdict: {verdict(m, m - h, 'the runs as samples')}.", ""]
        else:
            lines += ["", f"Verdict (one run only): {verdict(f['mean'], lo, 'rounds pooled')}.", ""]
    return "\n".join(lines).rstrip("\n")


def as_glob(argv, paths):
    """`argv` with the result files written as one pattern, `DIR/PREFIX*.json`, when that
    pattern names exactly those files (nine file names make a long command line)."""
    import glob
    import os
    d = {os.path.dirname(p) for p in paths}
    if len(paths) < 2 or len(d) != 1:
        return argv
    prefix = os.path.commonprefix([os.path.basename(p) for p in paths]).rsplit("-", 1)[0]
    pattern = os.path.join(d.pop(), prefix + "-*.json")
    if sorted(map(os.path.abspath, glob.glob(pattern))) != sorted(map(os.path.abspath, paths)):
        return argv
    named = set(paths)
    return [a for a in argv if a not in named] + [pattern]


def chart(figures, a, b, path):
    """bench/overhead-pooled.png: per case, each run's ratio with its interval, the pooled
    rounds and the run means taken as samples, against the 1.2x line. False when matplotlib
    is not installed (the chart is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = [(c, f) for c, f in figures if f is not None]
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4.2), squeeze=False)
    for ax, (case, f) in zip(axes[0], cases):
        ys = [r["mean"] for r in f["runs"]]
        los = [r["mean"] - r["interval"][0] for r in f["runs"]]
        his = [r["interval"][1] - r["mean"] for r in f["runs"]]
        xs = list(range(1, len(ys) + 1))
        ax.errorbar(xs, ys, yerr=[los, his], fmt="o", color="tab:blue", capsize=3,
                    label="one run (95% bootstrap)")
        n = len(xs) + 1.5
        lo, hi = f["interval"]
        ax.errorbar([n], [f["mean"]], yerr=[[f["mean"] - lo], [hi - f["mean"]]], fmt="s",
                    color="tab:green", capsize=4, label="rounds pooled")
        if f["samples"]:
            m, h = f["samples"]
            ax.errorbar([n + 1], [m], yerr=[[h], [h]], fmt="D", color="tab:red", capsize=4,
                        label="run means as samples (95% t)")
        ax.axhline(TARGET, color="gray", linestyle="--", linewidth=1, label=f"target {TARGET}×")
        ax.axhline(1.0, color="lightgray", linewidth=1)
        ax.set_xticks(xs + [n, n + 1] if f["samples"] else xs + [n])
        ax.set_xticklabels([str(x) for x in xs] + (["pooled", "runs"] if f["samples"] else ["pooled"]),
                           fontsize=8)
        ax.set_title(f"{case}: {a} / {b} req/s", fontsize=10)
        ax.set_xlabel("capped run")
        ax.set_ylabel("req/s ratio")
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_section(path, text):
    """Put `text` between the overhead-pooled markers of `path`: in place of the last one, or
    else after the overhead-capped section, or else at the end."""
    import re
    begin, end = "<!-- bench:overhead-pooled:begin -->", "<!-- bench:overhead-pooled:end -->"
    block = f"{begin}\n{text}\n{end}"
    with open(path) as f:
        md = f.read()
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    after = "<!-- bench:overhead-capped:end -->"
    if pat.search(md):
        md = pat.sub(lambda _m: block, md)
    elif after in md:
        md = md.replace(after, after + "\n\n" + block, 1)
    else:
        md = md.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(md)


def main():
    import os
    import sys
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="warmroute-1w-body")
    ap.add_argument("--b", default="haproxy-1t")
    ap.add_argument("--cases", default="json,stream")
    ap.add_argument("--keep", action="store_true",
                    help="copy each result's rounds into bench/rounds/ instead of pooling")
    ap.add_argument("--section", action="store_true",
                    help="also write the overhead-pooled section of bench/RESULTS.md")
    ap.add_argument("--results-md", metavar="PATH",
                    help="the RESULTS.md that --section writes (default: bench/RESULTS.md "
                         "next to this script)")
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
    # Each case's figures once: the bootstrap is the slow part, and the printout, the
    # section and the chart all read the same figures.
    figures = [(c, pool_case(results, args.a, args.b, c)) for c in args.cases.split(",")]
    for case, f in figures:
        print(f"{case}: {args.a} / {args.b}")
        if f is None:
            print("  no paired rounds")
            continue
        for r in f["runs"]:
            lo, hi = r["interval"]
            print(f"  {r['file']:<45} {r['git']:<16} rounds {len(r['pairs']):>3}  "
                  f"median {r['median']:.3f}  mean {r['mean']:.3f}  ({lo:.3f}-{hi:.3f})  "
                  f"cpu/req {fmt(r['cpu'], '.3f', '')}  p99 {fmt(r['p99'], '.3f', '')}")
        lo, hi = f["interval"]
        print(f"  {'all ' + str(len(f['runs'])) + ' runs':<62} rounds {f['rounds']:>3}  "
              f"median {f['median']:.3f}  mean {f['mean']:.3f}  ({lo:.3f}-{hi:.3f})")
        if f["samples"]:
            m, h = f["samples"]
            print(f"  {'the runs as samples':<62} runs {len(f['runs']):>5}  mean {m:.3f} +- {h:.3f}  "
                  f"({m - h:.3f}-{m + h:.3f}, t, {len(f['runs']) - 1} df)")
    if args.section:
        md = args.results_md or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "RESULTS.md")
        # The command as run from the repository's root, without --section's own options.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        files = [p for p, _ in results]
        argv, skip = [], False
        for a in sys.argv[1:]:
            if skip or a == "--section" or a.startswith("--results-md"):
                skip = a == "--results-md"
                continue
            argv.append(a)
        argv = as_glob(argv, files)
        argv = [os.path.relpath(os.path.abspath(a), root)
                if (a in files or a.endswith("-*.json")) and
                os.path.abspath(a).startswith(root + os.sep) else a for a in argv]
        png = os.path.join(os.path.dirname(os.path.abspath(md)), "overhead-pooled.png")
        text = section(results, args.a, args.b, figures, argv)
        if chart(figures, args.a, args.b, png):
            text += ("\n\n![pooled capped runs](overhead-pooled.png) — `bench/overhead-pooled.png`: "
                     "each run's ratio, the rounds pooled and the run means as samples, against "
                     f"the {TARGET}× line.")
        else:
            text += "\n\nChart: skipped (matplotlib is not installed)."
        write_section(md, text)
        print(f"wrote the overhead-pooled section of {md} and {png}")


if __name__ == "__main__":
    main()
