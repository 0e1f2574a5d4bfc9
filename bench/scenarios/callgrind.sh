# bench/scenarios/callgrind.sh — scenario "callgrind" for bench/run (sourced; uses its helpers).
#
#   callgrind  instructions per request, counted by valgrind's callgrind: repeatable where
#              wall-clock rounds are not (a shared VM, a noisy neighbour). Each binary in
#              CG_BINS (default: the release build) runs one worker under callgrind in front
#              of the static nginx backend. After CG_WARMUP of unmeasured load the counters
#              are zeroed, wrk drives CG_CONNS connections for CG_DURATION, and the counters are
#              dumped, so start-up is not counted. Prints, per binary, instructions per request
#              for the whole process and for the request task (pipeline::proxy, inclusive)
#              and writes bench/out/callgrind-TS.json. No section of RESULTS.md: the notes
#              quote it with its command.
#              Knobs: CG_BINS (space-separated warmroute binaries), CG_CASE (json, stream,
#              prompt or stream-prompt; default json), CG_ID (body, header or none; default body),
#              CG_ACCESS_LOG (off, default, or on: a file in the work dir), CG_WARMUP (2s),
#              CG_DURATION (10s), CG_CONNS (wrk connections, default 1: at 1 every request
#              pays a park of the runtime; 32 queues requests as a saturating load does,
#              so per-park costs are shared by many requests).
#              Example: CG_BINS="/tmp/prev/warmroute target/release/warmroute" CG_ACCESS_LOG=on
#              bench/run callgrind
#              Per-function counts (callgrind_annotate on the dumps in the run's directory)
#              need binaries linked by the system linker: valgrind 3.19 reads no symbols from
#              an lld-linked one (Rust's default since 1.90; it logs "ELF section outside all
#              mapped regions" under -v). Build them with RUSTFLAGS="-Clinker-features=-lld".
CG_CASE=${CG_CASE:-json}
CG_ID=${CG_ID:-body}
CG_ACCESS_LOG=${CG_ACCESS_LOG:-off}
CG_WARMUP=${CG_WARMUP:-2s}
CG_DURATION=${CG_DURATION:-10s}
CG_CONNS=${CG_CONNS:-1}

scenario_callgrind() {
  if ! command -v callgrind_control >/dev/null; then
    log "installing: valgrind"
    local sudo=()
    [[ $(id -u) -eq 0 ]] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq valgrind
  fi
  local bins=${CG_BINS:-$WARMROUTE_BIN}
  begin_scenario callgrind
  local ts=$TS p=$BASE_PORT
  start_backend_nginx "$p" "$BACKEND_CPU"
  wait_http backend "http://127.0.0.1:$p/health" 200
  : >"$WORK/results.tsv"
  local i=0 bin
  for bin in $bins; do
    [[ -x $bin ]] || die "callgrind: $bin is not an executable"
    i=$((i + 1))
    local name=cg-$i port=$((p + 10 * i)) dir=$WORK/cg-$i
    write_warmroute_config "$dir" "$port" $((port + 1)) "$p" /dev/shm/warmroute-bench-cg-$port
    local log_arg=off
    [[ $CG_ACCESS_LOG == on ]] && log_arg=$dir/access.log
    spawn "$name" "$PROXY_CPU" "$WORK/$name.log" valgrind --tool=callgrind \
      --callgrind-out-file="$dir/callgrind.out" "$bin" serve --config "$dir/warmroute.toml" \
      --access-log "$log_arg" --workers 1 --no-pin
    wait_http "$name" "http://127.0.0.1:$((port + 1))/readyz" 200
    local pid
    pid=$(proc_pid "$name")
    local url=http://127.0.0.1:$port args=(/bench/v1/chat/completions "$CG_CASE" 64 "$CG_ID")
    log "$name: $bin; $CG_WARMUP unmeasured, then $CG_DURATION at -c$CG_CONNS ($CG_CASE, id: $CG_ID, access log: $CG_ACCESS_LOG)"
    wrk -t1 -c"$CG_CONNS" -d"$CG_WARMUP" -s "$BENCH_DIR/wrk/chat.lua" "$url" -- "${args[@]}" >/dev/null
    callgrind_control -z "$pid" >/dev/null 2>&1
    wrk -t1 -c"$CG_CONNS" -d"$CG_DURATION" -s "$BENCH_DIR/wrk/chat.lua" "$url" -- "${args[@]}" >"$dir/wrk.txt"
    callgrind_control -d "$pid" >/dev/null 2>&1
    local dump requests total task
    # The first (and only) dump callgrind_control asked for.
    dump=$dir/callgrind.out.1
    [[ -s $dump ]] || die "$name: no callgrind dump at $dump"
    requests=$(awk '/requests in/{print $1}' "$dir/wrk.txt")
    total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/{gsub(",","",$1); print $1}')
    task=$(callgrind_annotate --inclusive=yes "$dump" 2>/dev/null |
      awk '/pipeline::proxy::\{\{closure\}\} \[/ && !seen {gsub(",","",$1); print $1; seen=1}')
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$bin" "$requests" "$total" "${task:-0}" >>"$WORK/results.tsv"
    log "$(awk -F'\t' -v n="$name" '$1==n{printf "%s: %d requests, %.0f instructions per request, %.0f in the request task", n, $3, $4/$3, $5/$3}' "$WORK/results.tsv")"
    forget_proc "$name"
  done
  local json_out=$OUT_DIR/callgrind-$ts.json
  python3 - "$WORK/results.tsv" "$json_out" "$CG_CASE" "$CG_ID" "$CG_ACCESS_LOG" "$(git_rev)" <<'EOF'
import json, sys
res, out, case, idw, alog, git = sys.argv[1:7]
rows = []
for line in open(res):
    name, binary, n, total, task = line.rstrip("\n").split("\t")
    n, total, task = int(n), int(total), int(task)
    rows.append({"name": name, "binary": binary, "requests": n,
                 "instructions_per_request": round(total / n),
                 "request_task_instructions_per_request": round(task / n)})
json.dump({"case": case, "id": idw, "access_log": alog, "git": git, "runs": rows},
          open(out, "w"), indent=1)
print(f"{'binary':<60} {'requests':>9} {'Ir/req':>9} {'task Ir/req':>12}")
for r in rows:
    print(f"{r['binary']:<60} {r['requests']:>9} {r['instructions_per_request']:>9} "
          f"{r['request_task_instructions_per_request']:>12}")
EOF
  log "results: $json_out"
}
