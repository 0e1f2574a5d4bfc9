# bench/scenarios/latency.sh — scenario "latency" for bench/run (sourced; uses its helpers).
#
#   latency    where the unloaded (-c1) latency a proxy adds goes: direct, warmroute (1 worker,
#              session id in the JSON body; as configured by default, and with busy_poll_us =
#              LAT_BUSY_POLL_US), nginx (1 worker) and haproxy (1 thread; by default, and with
#              its own busy-polling), in
#              LAT_ROUNDS interleaved rounds of wrk -c1 for BENCH_LAT_DURATION each, in three
#              placements:
#                across   the overhead scenario's: proxy on BENCH_PROXY_CPU, wrk and the backend
#                         on BENCH_LOAD_CPU, so each of the four hops wakes the other core;
#                awake    the same, with a SCHED_IDLE busy loop on every core (it runs only when
#                         the core has nothing else to do): no core ever halts, so no hop waits
#                         for a sleeping (virtual) CPU to be woken up;
#                local    the proxy moved onto the load core (taskset -apc): every hop is a
#                         context switch on one core.
#              The gap between across and awake is what waking a halted core costs; between
#              awake and local, what signalling another core costs; what is left in local is
#              the proxy's own work. Writes bench/out/latency-TS.json, a section of RESULTS.md
#              and bench/latency.png. Knobs: LAT_ROUNDS (3), LAT_PLACEMENTS ("across awake
#              local"), LAT_BUSY_POLL_US (200), BENCH_LAT_DURATION (3s).
LAT_ROUNDS=${LAT_ROUNDS:-3}
LAT_PLACEMENTS=${LAT_PLACEMENTS:-across awake local}
LAT_BUSY_POLL_US=${LAT_BUSY_POLL_US:-200}
LAT_PARTIES="direct warmroute-1w-body warmroute-bp nginx-1w haproxy-1t haproxy-bp"

# lat_party_url PARTY — "URL PATH ID" for wrk.
lat_party_url() {
  local p=$BASE_PORT
  case $1 in
    direct) echo "http://127.0.0.1:$p /v1/chat/completions header" ;;
    warmroute-1w-body) echo "http://127.0.0.1:$((p + 10)) /bench/v1/chat/completions body" ;;
    warmroute-bp) echo "http://127.0.0.1:$((p + 14)) /bench/v1/chat/completions body" ;;
    haproxy-bp) echo "http://127.0.0.1:$((p + 42)) /bench/v1/chat/completions header" ;;
    nginx-1w) echo "http://127.0.0.1:$((p + 30)) /bench/v1/chat/completions header" ;;
    haproxy-1t) echo "http://127.0.0.1:$((p + 40)) /bench/v1/chat/completions header" ;;
  esac
}

# lat_move_proxies CPUS — move every proxy party's process (not direct's backend) to CPUS.
lat_move_proxies() {
  local party proc
  for party in $LAT_PARTIES; do
    proc=$(lat_proc "$party")
    [[ -z $proc ]] || lat_move "$proc" "$1"
  done
}

# lat_hold PARTY STOP|CONT — haproxy with busy-polling spins all the time, so it is held
# stopped (SIGSTOP) except for its own runs: spinning on the proxy core would keep that core
# awake for every other party too. warmroute's busy polling only follows its own requests.
lat_hold() {
  [[ $1 == haproxy-bp ]] || return 0
  kill "-$2" "$(proc_pid haproxy-bp)"
  [[ $2 == STOP ]] || sleep 0.2
}

# lat_proc PARTY — the process a party runs in (none for direct).
lat_proc() {
  case $1 in
    warmroute-1w-body) echo warmroute-1w ;;
    direct) ;;
    *) echo "$1" ;;
  esac
}

scenario_latency() {
  command -v chrt >/dev/null || die "latency: chrt (util-linux) is needed for the awake placement"
  [[ -n $LOAD_CPU ]] || die "latency: BENCH_LOAD_CPU must name a core (the placements pin wrk)"
  [[ $LOAD_CPU != "$PROXY_CPU" ]] || die "latency: BENCH_PROXY_CPU and BENCH_LOAD_CPU must differ"
  [[ $LAT_DURATION != 0 ]] || die "latency: BENCH_LAT_DURATION is 0"
  begin_scenario latency
  local ts=$TS p=$BASE_PORT
  start_backend_nginx "$p" "$BACKEND_CPU"
  wait_http backend "http://127.0.0.1:$p/health" 200
  local proc
  for proc in warmroute-1w nginx-1w haproxy-1t; do
    ovh_start "$proc" || die "latency: $proc did not start: $OVH_START_ERR"
  done
  OVH_BUSY_POLL_US=$LAT_BUSY_POLL_US ovh_start warmroute-bp || die "latency: warmroute-bp did not start"
  start_haproxy haproxy-bp "$PROXY_CPU" $((p + 42)) "$p" 1 busy-polling
  local all
  all=$(seq -s, 0 $(($(nproc) - 1)))
  place pinned "$all"
  local party
  for party in $LAT_PARTIES; do
    local url path id
    read -r url path id <<<"$(lat_party_url "$party")"
    preflight "$party" "$url" "$path" json "$id" || die "latency: $party failed its preflight"
  done
  lat_hold haproxy-bp STOP
  echo "# haproxy-bp is held with SIGSTOP except during its own runs (SIGCONT before, SIGSTOP after)" >>"$WORK/commands.txt"
  : >"$WORK/results.jsonl"
  local round placement mark cpu n=0 total
  total=$((LAT_ROUNDS * $(wc -w <<<"$LAT_PLACEMENTS") * $(wc -w <<<"$LAT_PARTIES")))
  for ((round = 1; round <= LAT_ROUNDS; round++)); do
    for placement in $LAT_PLACEMENTS; do
      mark=${#PIDS[@]}
      case $placement in
        across) ;;
        awake)
          for cpu in ${all//,/ }; do
            # Bounded: it stops by itself even if this script is killed with SIGKILL.
            spawn "idle-loop-$cpu" "$cpu" "$WORK/idle-loop-$cpu.log" \
              timeout 600 chrt -i 0 sh -c 'while :; do :; done'
          done
          ;;
        local) lat_move_proxies "$LOAD_CPU" ;;
        *) die "latency: unknown placement $placement (across, awake or local)" ;;
      esac
      # Reverse order in even rounds, so no party always runs right after a placement change.
      local order=$LAT_PARTIES
      ((round % 2)) || order=$(tr ' ' '\n' <<<"$LAT_PARTIES" | tac | tr '\n' ' ')
      for party in $order; do
        n=$((n + 1))
        check_alive
        local url path id
        read -r url path id <<<"$(lat_party_url "$party")"
        log "[$n/$total] round $round, $placement: $party ($LAT_DURATION at -c1)"
        lat_hold "$party" CONT
        WRK_ID=$id run_wrk "$party" "$placement" "$url" "$path" json 1 1s warmup "$round"
        WRK_ID=$id run_wrk "$party" "$placement" "$url" "$path" json 1 "$LAT_DURATION" c1 "$round"
        lat_hold "$party" STOP
      done
      case $placement in
        awake) stop_from "$mark" ;;
        local) lat_move_proxies "$PROXY_CPU" ;;
      esac
    done
  done
  local json_out=$OUT_DIR/latency-$ts.json
  python3 "$BENCH_DIR/latency_report.py" --work "$WORK" --out "$json_out" \
    --results-md "$RESULTS_MD" --timestamp "$ts" --git "$(git_rev)" \
    --chart "$CHART_DIR/latency.png" --command "bench/run latency" \
    --rounds "$LAT_ROUNDS" --duration "$LAT_DURATION" --proxy-cpu "$PROXY_CPU" --load-cpu "$LOAD_CPU" \
    --busy-poll-us "$LAT_BUSY_POLL_US"
  log "results: $json_out"
}
