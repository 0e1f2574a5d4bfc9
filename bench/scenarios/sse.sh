# bench/scenarios/sse.sh — scenario "sse" for bench/run (sourced; uses its helpers).
#
#   sse        SSE at scale: SSE_STREAMS (default "1000 10000") concurrent, mostly idle streaming
#              chat completions from warmroute-mock (paced at SSE_DECODE_TPS tokens/s) through
#              warmroute (two joined processes of one worker each, pinned to the two cores;
#              SSE_WR_PROCS=1: one process of two workers), nginx (2 worker processes,
#              worker_cpu_affinity auto) and straight to the mock (direct), one party at a
#              time with a fresh mock and proxy. Driver: warmroute-bench sse (bench/src/sse.rs).
#              Per party: completed streams, extra delay per inter-event gap (p50/p99/p999),
#              token events that arrived batched, CPU seconds per million events and per-core
#              busy % over a steady window with all streams open, RSS per open stream
#              ((RSS with all open - RSS idle) / open).
#              Knobs: SSE_STREAMS, SSE_PARTIES ("direct warmroute nginx"), SSE_DECODE_TPS (2),
#              SSE_MAX_TOKENS (64; with 2 tokens/s a stream lasts ~32 s), SSE_TTFT_MS (200),
#              SSE_RAMP_MS (5000), SSE_OPEN_TIMEOUT_MS (8000: the window starts then at the latest,
#              even if not all streams could be opened), SSE_SETTLE_S (1), SSE_WINDOW_S (12),
#              SSE_MOCK_WORKERS (1), SSE_WR_PROCS (2 or 1), SSE_NOFILE (65536; above the hard
#              limit, which needs CAP_SYS_RESOURCE to raise, N is reduced to what fits).
#              Quick check: SSE_STREAMS=200.

SSE_STREAMS=${SSE_STREAMS:-1000 10000}
SSE_PARTIES=${SSE_PARTIES:-direct warmroute nginx}
SSE_DECODE_TPS=${SSE_DECODE_TPS:-2}
SSE_MAX_TOKENS=${SSE_MAX_TOKENS:-64}
SSE_TTFT_MS=${SSE_TTFT_MS:-200}
SSE_RAMP_MS=${SSE_RAMP_MS:-5000}
SSE_SETTLE_S=${SSE_SETTLE_S:-1}
SSE_WINDOW_S=${SSE_WINDOW_S:-12}
SSE_OPEN_TIMEOUT_MS=${SSE_OPEN_TIMEOUT_MS:-8000}
SSE_MOCK_WORKERS=${SSE_MOCK_WORKERS:-1}
SSE_NOFILE=${SSE_NOFILE:-65536}
SSE_WR_PROCS=${SSE_WR_PROCS:-2}

# sse_pids_of PID — PID and its descendants (nginx: master and workers).
sse_pids_of() {
  local pid=$1 child
  echo "$pid"
  for child in $(pgrep -P "$pid" || true); do
    sse_pids_of "$child"
  done
}

# sse_sample LABEL FILE NAME=PID[,PID...]... — append one JSON line: wall time, utime+stime
# (clock ticks) and VmRSS (KiB) summed over each named process (or processes) and their
# descendants, and the per-core lines of /proc/stat.
sse_sample() {
  local label=$1 file=$2
  shift 2
  local now entry name pid p procs="" ticks rss n stat t r
  now=$(date +%s%3N)
  for entry in "$@"; do
    name=${entry%%=*}
    pid=${entry#*=}
    ticks=0 rss=0 n=0
    for p in $(for q in ${pid//,/ }; do sse_pids_of "$q"; done); do
      # Fields after the ")" that ends comm: utime and stime are the 12th and 13th.
      t=$(sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | awk '{print $12 + $13}') || continue
      r=$(awk '/^VmRSS:/ {print $2}' "/proc/$p/status" 2>/dev/null) || continue
      [[ -n $t && -n $r ]] || continue
      ticks=$((ticks + t))
      rss=$((rss + r))
      n=$((n + 1))
    done
    procs+="${procs:+,}\"$name\":{\"pid\":\"$pid\",\"procs\":$n,\"cpu_ticks\":$ticks,\"rss_kb\":$rss}"
  done
  stat=$(grep '^cpu[0-9]' /proc/stat | awk '{printf "%s\"%s\"", (NR>1?",":""), $0}')
  printf '{"label":"%s","unix_ms":%s,"procs":{%s},"cpu_stat":[%s]}\n' "$label" "$now" "$procs" "$stat" >>"$file"
}

# sse_progress DRIVER_LOG — log the driver's latest "[sse]" progress line, once per new line
# (SSE_LAST_PROGRESS remembers the last one logged).
sse_progress() {
  local line
  line=$(grep '^\[sse\]' "$1" 2>/dev/null | tail -n 1 || true)
  if [[ -n $line && $line != "$SSE_LAST_PROGRESS" ]]; then
    log "  $line"
    SSE_LAST_PROGRESS=$line
  fi
}

# sse_free_ports PORT — PORT, or the next multiple-of-4 step after it, such that PORT..PORT+3
# have no listener: the mock, nginx and warmroute all bind with SO_REUSEPORT, so a leftover
# process of another run on the same port would silently take half of the connections.
sse_free_ports() {
  local p=$1 tries
  for ((tries = 0; tries < 200; tries++)); do
    if [[ -z $(ss -Hltn "sport >= :$p and sport <= :$((p + 3))" 2>/dev/null) ]]; then
      echo "$p"
      return 0
    fi
    p=$((p + 400))
  done
  die "no free block of 4 ports found from $1"
}

# sse_start_nginx NAME PORT BACKEND_PORT WORKERS — start_nginx_proxy's configuration, with
# room for 10k streams: each takes 2 connections of a worker, and start_nginx_proxy's
# worker_connections 8192 per worker would cap the two workers at ~8k streams.
sse_start_nginx() {
  local name=$1 port=$2 bport=$3 workers=$4
  local dir=$WORK/$name
  mkdir -p "$dir/logs" "$dir/tmp"
  cat >"$dir/nginx.conf" <<EOF
# nginx as a session-affinity proxy for bench/run sse (generated)
worker_processes $workers;
worker_cpu_affinity auto;
worker_rlimit_nofile $SSE_NOFILE;
daemon off;
master_process on;
pid $dir/nginx.pid;
error_log $dir/logs/error.log warn;
events { worker_connections 32768; }
http {
    access_log off;
    client_body_temp_path $dir/tmp/body;
    proxy_temp_path $dir/tmp/proxy;
    fastcgi_temp_path $dir/tmp/fastcgi;
    uwsgi_temp_path $dir/tmp/uwsgi;
    scgi_temp_path $dir/tmp/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
    client_body_buffer_size 64k;
    upstream bench {
        hash \$http_x_session_id consistent;
        server 127.0.0.1:$bport max_fails=0;
        keepalive 64;
        keepalive_requests 10000000;
        keepalive_timeout 300s;
    }
    server {
        listen 127.0.0.1:$port reuseport backlog=4096;
        location /bench/ {
            proxy_pass http://bench/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
            proxy_set_header X-Real-IP \$remote_addr;
            proxy_set_header X-Forwarded-Proto \$scheme;
            proxy_buffering off;
            proxy_request_buffering off;
        }
    }
}
EOF
  spawn "$name" "" "$WORK/$name.log" "$NGINX" -p "$dir" -e "$dir/logs/error.log" -c "$dir/nginx.conf"
  wait_http "$name" "http://127.0.0.1:$port/"
}

# sse_preflight PARTY URL — one short stream (3 tokens, 1 ms apart via the mock's override
# headers) through the party; dies unless it answers 200 with 5 events ending in [DONE].
sse_preflight() {
  local party=$1 url=$2 out=$WORK/runs/preflight-$1.body code events
  code=$(curl -s -o "$out" -w '%{http_code}' --max-time 10 -X POST "$url" \
    -H 'Content-Type: application/json' -H 'Accept: text/event-stream' \
    -H 'X-Session-ID: preflight' -H 'x-mock-tokens: 3' -H 'x-mock-interval-ms: 1' -H 'x-mock-ttft-ms: 1' \
    --data-binary '{"model":"mock-model","messages":[{"role":"user","content":"preflight"}],"stream":true,"max_tokens":3}' || true)
  events=$(grep -c '^data:' "$out" || true)
  if [[ $code != 200 || $events != 5 ]] || ! grep -q '^data: \[DONE\]' "$out"; then
    die "preflight through $party failed: status $code, $events events (see $out)"
  fi
}

scenario_sse() {
  local scenario=sse
  begin_scenario "$scenario"
  local ts=$TS
  local driver=$BIN_DIR/warmroute-bench
  [[ -x $driver ]] || die "missing $driver"
  local parties counts
  read -r -a parties <<<"$SSE_PARTIES"
  read -r -a counts <<<"$SSE_STREAMS"

  # File descriptors: the proxy holds 2 per stream, the mock and the driver 1 each.
  local max_n=0 c
  for c in "${counts[@]}"; do
    if ((c > max_n)); then
      max_n=$c
    fi
  done
  local want=$((2 * max_n + 128)) hard
  ((SSE_NOFILE >= want)) || SSE_NOFILE=$want
  hard=$(ulimit -Hn)
  if [[ $hard != unlimited ]] && ((hard < SSE_NOFILE)); then
    ulimit -Hn "$SSE_NOFILE" 2>/dev/null ||
      log "WARNING: cannot raise the hard fd limit from $hard to $SSE_NOFILE (no CAP_SYS_RESOURCE here)"
    hard=$(ulimit -Hn)
    if [[ $hard != unlimited ]] && ((hard < SSE_NOFILE)); then
      SSE_NOFILE=$hard
    fi
  fi
  ulimit -n "$SSE_NOFILE" || die "cannot set the fd limit to $SSE_NOFILE"
  ulimit -n >"$WORK/nofile"
  log "fd limit: $(ulimit -n)"
  # A proxy process holds 2 fds per stream plus ~100 of its own, the mock and the driver one
  # each. Two proxy processes (nginx's workers, warmroute's joined routers) split the streams
  # by the kernel's SO_REUSEPORT hash, unevenly: 10% is left for that. Above that, every
  # party runs the largest N that fits, in hundreds.
  local procs=2
  ((SSE_WR_PROCS == 2)) || procs=1
  local cap=$(((SSE_NOFILE - 128) * procs / 2)) i
  ((procs == 1)) || cap=$((cap * 9 / 10))
  ((cap <= SSE_NOFILE - 128)) || cap=$((SSE_NOFILE - 128))
  cap=$((cap / 100 * 100))
  for i in "${!counts[@]}"; do
    if ((counts[i] > cap)); then
      log "WARNING: $(ulimit -n) fds per process fit at most $cap streams through a proxy: running $cap instead of ${counts[i]}"
      echo "# fd limit $(ulimit -n) (hard): ${counts[i]} streams reduced to $cap" >>"$WORK/commands.txt"
      echo "${counts[i]} $cap" >>"$WORK/reduced"
      counts[i]=$cap
    fi
  done
  local lo hi
  read -r lo hi </proc/sys/net/ipv4/ip_local_port_range
  ((hi - lo > 2 * max_n)) || log "WARNING: ephemeral port range $lo-$hi may be too small for $max_n streams through a proxy"

  local secs_per_stream
  secs_per_stream=$(awk -v m="$SSE_MAX_TOKENS" -v t="$SSE_DECODE_TPS" -v f="$SSE_TTFT_MS" 'BEGIN {printf "%.1f", f / 1000 + (m - 1) / t}')
  {
    echo "# mock: warmroute-mock --workers $SSE_MOCK_WORKERS --decode-tps $SSE_DECODE_TPS --max-tokens $SSE_MAX_TOKENS --ttft-base-ms $SSE_TTFT_MS (unpinned)"
    if ((SSE_WR_PROCS == 2)); then
      echo "# warmroute: two processes of --workers 1, the second with --join (pinned by segment row to cores 0 and 1); nginx 2 workers, worker_cpu_affinity auto; driver unpinned"
    else
      echo "# warmroute --workers 2 (pins its workers to cores 0 and 1); nginx 2 workers, worker_cpu_affinity auto; driver unpinned"
    fi
    echo "# fd limit $(ulimit -n); a stream lasts ~${secs_per_stream}s; window: ${SSE_SETTLE_S}s after all streams are open, ${SSE_WINDOW_S}s long"
  } >>"$WORK/commands.txt"
  log "streams ${SSE_STREAMS}; parties ${SSE_PARTIES}; ${SSE_DECODE_TPS} events/s per stream for ~${secs_per_stream}s, ramp ${SSE_RAMP_MS} ms, window ${SSE_WINDOW_S}s"

  local total=$((${#parties[@]} * ${#counts[@]})) n=0
  local count party base mport pport aport mark id url samples mock_pid party_pid target_pids
  local open_file dlog dpid out deadline
  for count in "${counts[@]}"; do
    for party in "${parties[@]}"; do
      n=$((n + 1))
      base=$(sse_free_ports $((BASE_PORT + 4900 + n * 4)))
      [[ -n $base ]] || die "no free ports for run $n"
      mport=$base
      pport=$((base + 1))
      aport=$((base + 2))
      id=$party-n$count
      mark=${#PIDS[@]}
      echo "# --- [$n/$total] $party, $count streams" >>"$WORK/commands.txt"
      log "[$n/$total] $party, $count streams"
      spawn "mock-$n" "" "$WORK/mock-$n.log" "$BIN_DIR/warmroute-mock" --listen "127.0.0.1:$mport" \
        --name m --workers "$SSE_MOCK_WORKERS" --ttft-base-ms "$SSE_TTFT_MS" --ttft-per-token-us 0 \
        --decode-tps "$SSE_DECODE_TPS" --max-tokens "$SSE_MAX_TOKENS" --cache-tokens 0
      mock_pid=${PIDS[-1]}
      wait_http "mock-$n" "http://127.0.0.1:$mport/health"
      party_pid=""
      case $party in
        direct) url=http://127.0.0.1:$mport/v1/chat/completions ;;
        warmroute)
          if ((SSE_WR_PROCS == 2)); then
            # Two routers on one port and segment: each its own process (and fd limit),
            # one worker each, pinned by segment row to cores 0 and 1; the second joins the
            # first, with an admin port of its own for its readiness.
            start_warmroute "warmroute-$n" "" "$pport" "$aport" "$mport" --workers 1
            party_pid=${PIDS[-1]}
            spawn "warmroute-$n-join" "" "$WORK/warmroute-$n-join.log" "$WARMROUTE_BIN" serve \
              --config "$WORK/warmroute-$n/warmroute.toml" --access-log off --workers 1 --join \
              --admin-listen "127.0.0.1:$((base + 3))"
            party_pid+=",${PIDS[-1]}"
            wait_http "warmroute-$n-join" "http://127.0.0.1:$((base + 3))/readyz" 200
          else
            start_warmroute "warmroute-$n" "" "$pport" "$aport" "$mport" --workers 2
            party_pid=${PIDS[-1]}
          fi
          url=http://127.0.0.1:$pport/bench/v1/chat/completions
          ;;
        nginx)
          sse_start_nginx "nginx-$n" "$pport" "$mport" 2
          party_pid=${PIDS[-1]}
          url=http://127.0.0.1:$pport/bench/v1/chat/completions
          ;;
        *) die "unknown sse party $party (direct, warmroute, nginx)" ;;
      esac
      sse_preflight "$party" "$url"
      sleep 1
      samples=$WORK/runs/$id.samples.jsonl
      target_pids=("mock=$mock_pid")
      [[ -n $party_pid ]] && target_pids+=("proxy=$party_pid")
      sse_sample idle "$samples" "${target_pids[@]}"

      open_file=$WORK/runs/$id.open
      dlog=$WORK/runs/$id.driver.log
      out=$WORK/runs/$id.json
      spawn "driver-$n" "" "$dlog" "$driver" sse --target "$url" --streams "$count" \
        --ramp-ms "$SSE_RAMP_MS" --max-tokens "$SSE_MAX_TOKENS" --decode-tps "$SSE_DECODE_TPS" \
        --steady-after-s "$SSE_SETTLE_S" --steady-s "$SSE_WINDOW_S" --open-timeout-ms "$SSE_OPEN_TIMEOUT_MS" \
        --open-file "$open_file" --label "$party $count" --out "$out"
      dpid=${PIDS[-1]}
      target_pids+=("driver=$dpid")

      # Wait until all streams are open (the driver stops waiting SSE_OPEN_TIMEOUT_MS after
      # the ramp).
      deadline=$((SECONDS + SSE_RAMP_MS / 1000 + 40))
      SSE_LAST_PROGRESS=""
      while [[ ! -s $open_file ]]; do
        kill -0 "$dpid" 2>/dev/null || break
        ((SECONDS < deadline)) || die "driver did not report open streams in time; see $dlog"
        sse_progress "$dlog"
        sleep 0.2
      done
      if [[ -s $open_file ]]; then
        log "  open: $(cat "$open_file")"
        sleep "$SSE_SETTLE_S"
        sse_sample w0 "$samples" "${target_pids[@]}"
        sleep "$SSE_WINDOW_S"
        sse_sample w1 "$samples" "${target_pids[@]}"
        log "  window sampled; waiting for the streams to end"
      else
        log "  WARNING: the driver exited before reporting open streams; see $dlog"
      fi
      # Let the streams finish (bounded), then collect the driver.
      deadline=$((SECONDS + ${secs_per_stream%.*} + SSE_RAMP_MS / 1000 + 60))
      while kill -0 "$dpid" 2>/dev/null; do
        ((SECONDS < deadline)) || {
          log "  WARNING: driver still running; stopping it"
          break
        }
        sse_progress "$dlog"
        sleep 0.5
      done
      if ! kill -0 "$dpid" 2>/dev/null; then
        local rc=0
        wait "$dpid" 2>/dev/null || rc=$?
        ((rc == 0)) || log "  WARNING: driver exited with status $rc; see $dlog"
        # Reaped: forget its pid so that stop_from never signals a recycled one.
        PIDS=("${PIDS[@]:0:${#PIDS[@]}-1}")
        PID_NAMES=("${PID_NAMES[@]:0:${#PID_NAMES[@]}-1}")
      fi
      sse_sample end "$samples" "${target_pids[@]:0:${#target_pids[@]}-1}"
      grep -v '^\[sse\]' "$dlog" | tail -n 3 >&2 || true
      if [[ $party == nginx ]]; then
        cp "$WORK/nginx-$n/logs/error.log" "$WORK/runs/$id.nginx-error.log" 2>/dev/null || true
      fi
      stop_from "$mark"
    done
  done

  echo "$SSE_WR_PROCS" >"$WORK/warmroute_procs"
  local json_out=$OUT_DIR/$scenario-$ts.json
  python3 "$BENCH_DIR/sse_report.py" --work "$WORK" --out "$json_out" \
    --results-md "$RESULTS_MD" --timestamp "$ts" --git "$(git_rev)" \
    --chart "$CHART_DIR/sse.png" --command "bench/run sse" \
    --mock "--workers $SSE_MOCK_WORKERS --ttft-base-ms $SSE_TTFT_MS --ttft-per-token-us 0 --decode-tps $SSE_DECODE_TPS --max-tokens $SSE_MAX_TOKENS --cache-tokens 0" \
    --settle-s "$SSE_SETTLE_S" --window-s "$SSE_WINDOW_S" --ramp-ms "$SSE_RAMP_MS"
  log "results: $json_out"
}
