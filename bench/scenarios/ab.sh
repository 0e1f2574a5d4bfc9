# bench/scenarios/ab.sh — scenario "ab" for bench/run (sourced; uses its helpers).
#
#   ab         two warmroute binaries side by side, to tell whether a change made the request
#              cheaper: A (AB_A, required: e.g. a build of the previous commit) and B (AB_B,
#              default the release build), each pinned to the proxy core in front of the same
#              static nginx backend; AB_ROUNDS rounds of wrk -c CONNS alternating between them
#              (A then B in odd rounds, B then A in even ones), under a CPU quota of
#              BENCH_PROXY_QUOTA percent of a core (default 50: the proxy, not the load core,
#              is then the limit, so req/s follows the proxy's CPU per request). Prints each
#              round's req/s and p99 and the medians of B/A over rounds (p99 under a quota is
#              mostly how long the quota stalls the proxy); writes bench/out/ab-TS.json. No
#              section of RESULTS.md: the notes quote it with its command.
#              Knobs: AB_A, AB_B, AB_A_SERVER and AB_B_SERVER (lines added to A's or B's server
#              file, e.g. AB_B_SERVER="busy_poll_us = 200" with AB_A=AB_B to try an option),
#              AB_ROUNDS (6), AB_CASE (json, stream or prompt; default json),
#              AB_ID (body, header or none; default body), AB_ACCESS_LOG (off, default, or
#              on: each router logs to a file in its work directory), BENCH_DURATION,
#              BENCH_CONNS.
#              Example: git worktree add /tmp/prev HEAD~1 && (cd /tmp/prev && cargo build
#              --release) && AB_A=/tmp/prev/target/release/warmroute bench/run ab
AB_ROUNDS=${AB_ROUNDS:-6}
AB_CASE=${AB_CASE:-json}
AB_ID=${AB_ID:-body}
AB_ACCESS_LOG=${AB_ACCESS_LOG:-off}

scenario_ab() {
  [[ -n ${AB_A:-} && -x ${AB_A:-} ]] || die "ab: set AB_A to a warmroute binary (the baseline)"
  local a=$AB_A b=${AB_B:-$WARMROUTE_BIN}
  [[ -x $b ]] || die "ab: AB_B ($b) is not an executable"
  begin_scenario ab
  local ts=$TS p=$BASE_PORT
  make_proxy_cgroup "${BENCH_PROXY_QUOTA:-50}"
  start_backend_nginx "$p" "$BACKEND_CPU"
  wait_http backend "http://127.0.0.1:$p/health" 200
  local name bin port
  for name in A B; do
    local extra
    if [[ $name == A ]]; then
      bin=$a port=$((p + 10)) extra=${AB_A_SERVER:-}
    else
      bin=$b port=$((p + 20)) extra=${AB_B_SERVER:-}
    fi
    local dir=$WORK/wr-$name
    write_warmroute_config "$dir" "$port" $((port + 1)) "$p" /dev/shm/warmroute-bench-ab-$port "$extra"
    [[ -z $extra ]] || echo "# wr-$name server file adds: $extra" >>"$WORK/commands.txt"
    local log_arg=off
    [[ $AB_ACCESS_LOG == on ]] && log_arg=$dir/access.log
    spawn "wr-$name" "$PROXY_CPU" "$WORK/wr-$name.log" "$bin" serve --config "$dir/warmroute.toml" \
      --access-log "$log_arg" --workers 1 --no-pin
    wait_http "wr-$name" "http://127.0.0.1:$((port + 1))/readyz" 200
  done
  place pinned "$(seq -s, 0 $(($(nproc) - 1)))"
  local round order
  : >"$WORK/results.jsonl"
  for ((round = 1; round <= AB_ROUNDS; round++)); do
    if ((round % 2)); then order="A B"; else order="B A"; fi
    for name in $order; do
      if [[ $name == A ]]; then port=$((p + 10)); else port=$((p + 20)); fi
      check_alive
      log "round $round/$AB_ROUNDS: $name ($WARMUP warm-up, $DURATION at -c$CONNS)"
      WRK_ID=$AB_ID run_wrk "wr-$name" pinned "http://127.0.0.1:$port" /bench/v1/chat/completions \
        "$AB_CASE" "$CONNS" "$WARMUP" warmup "$round"
      WRK_ID=$AB_ID run_wrk "wr-$name" pinned "http://127.0.0.1:$port" /bench/v1/chat/completions \
        "$AB_CASE" "$CONNS" "$DURATION" throughput "$round"
    done
  done
  local json_out=$OUT_DIR/ab-$ts.json
  python3 - "$WORK/results.jsonl" "$json_out" "$a" "$b" "$AB_CASE" "${BENCH_PROXY_QUOTA:-50}" "$(git_rev)" <<'EOF'
import json, os, statistics, sys
res, out, a, b, case, quota, git = sys.argv[1:8]
rps = {"wr-A": {}, "wr-B": {}}
p99 = {"wr-A": {}, "wr-B": {}}
for line in open(res):
    r = json.loads(line)
    if r["kind"] == "throughput":
        rps[r["party"]][r["round"]] = r["wrk"]["requests"] / (r["wrk"]["duration_us"] / 1e6)
        p99[r["party"]][r["round"]] = r["wrk"]["latency_us"]["p99"]
rounds = sorted(set(rps["wr-A"]) & set(rps["wr-B"]))
ratios = [rps["wr-B"][i] / rps["wr-A"][i] for i in rounds]
p99_ratios = [p99["wr-B"][i] / p99["wr-A"][i] for i in rounds if p99["wr-A"][i] > 0]
for i, q in zip(rounds, ratios):
    print(f"  round {i}: A {rps['wr-A'][i]:9.0f}  B {rps['wr-B'][i]:9.0f} req/s  B/A {q:.3f}"
          f"   p99 A {p99['wr-A'][i] / 1000:6.3f}  B {p99['wr-B'][i] / 1000:6.3f} ms")
def med(v):
    return round(statistics.median(v), 4) if v else None
summary = {
    "a": a, "b": b, "a_server": os.environ.get("AB_A_SERVER", ""),
    "b_server": os.environ.get("AB_B_SERVER", ""), "case": case, "proxy_quota_pct": int(quota), "git": git,
    "rounds": [{"round": i, "a_rps": rps["wr-A"][i], "b_rps": rps["wr-B"][i],
                "a_p99_us": p99["wr-A"][i], "b_p99_us": p99["wr-B"][i]} for i in rounds],
    "median_b_over_a": med(ratios),
    "min_b_over_a": round(min(ratios), 4) if ratios else None,
    "max_b_over_a": round(max(ratios), 4) if ratios else None,
    "median_p99_b_over_a": med(p99_ratios),
}
json.dump(summary, open(out, "w"), indent=2)
print(f"  B/A median {summary['median_b_over_a']} (min {summary['min_b_over_a']}, max {summary['max_b_over_a']}) "
      f"over {len(ratios)} rounds, {case}, proxies capped at {quota}% of a core; "
      f"p99 B/A median {summary['median_p99_b_over_a']}")
EOF
  log "results: $json_out"
}
