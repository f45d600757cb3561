#!/usr/bin/env bash
# The 27B shape (Qwen3.5/3.6-27B layout, random weights: --load-format dummy) on real SGLang,
# each engine started from genfleet's own argv (`genfleet worker --print-engine-command`).
# Run after `device.sh setup` in the same call (it unpacks /tmp/site):
#
#   OUT=$OUT bash bench/real_sglang/device.sh setup
#   OUT=$OUT NAME=old PLAN=old LENGTHS="512 2048" bash bench/real_sglang/big.sh build point
#   OUT=$OUT NAME=plan512 MAXTOK=512 GF=1 bash bench/real_sglang/big.sh point
#   OUT=$OUT NAME=c120 CAP=120 MAXTOK=512 bash bench/real_sglang/big.sh point
#   OUT=$OUT MAXTOK=512 bash bench/real_sglang/big.sh tune     # `genfleet tune` on the 27B
#
# A point is one engine: PLAN=plan (genfleet's default plan for MAXTOK-token answers; CAP pins
# its --max-running-requests, MTP=on|off pins MTP) or PLAN=old (the argv before the plan:
# --no-engine-plan --no-mtp --mem-fraction-static 0.9, cap 256). On it, for each answer length
# of LENGTHS (default MAXTOK): a saturating direct client for STEADY_S seconds, its output
# tok/s read from the engine's own generated-token counter where the engine ran >= 90 % of its
# most running requests (summarize.py). With GF=1 also N prompts (GF_WAVES waves of the cap)
# through the direct client, then through genfleet's worker + control on the same engine
# (power-watch every 20 s, `genfleet top` every 15 s). NVML and /metrics are sampled
# throughout. Each point: $OUT/point_$NAME.json (and .tar.gz with logs).
# With CONT=1, before genfleet's phase: `harness/continuation.py` on the same engine (CONT_PROMPTS
# prompts of MAXTOK tokens drawn whole twice at temperature 0, and drawn to CONT_CUT tokens then
# on from prompt + those ids, compared id by id) -> $W/continuation.json.
# Env: BUDGET_S (570: seconds from T0 the call may use), T0, ATTN (triton: what the carried
# SGLang runs), STEADY_S (40; 0: no steady phase), GF_WAVES (2), ENGINE_MORE (flags added to
# the engine's, e.g. --enable-deterministic-inference), MEMFRAC (pins --mem-fraction-static),
# MODEL (another checkpoint, e.g. /tmp/m/q35 of device.sh's models), CONT_PROMPTS (32),
# CONT_CUT (193).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/big-out}; mkdir -p "$OUT"
cd "$REPO" || exit 1
exec > >(tee -a "$OUT/big_log.txt") 2>&1
T0=${T0:-$(date +%s)}
BUDGET_S=${BUDGET_S:-570}
say() { echo "=== +$(( $(date +%s) - T0 ))s $*"; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
export PYTHONPATH=/tmp/site:/tmp/stubs:$REPO
export PATH=/tmp/site/bin:/tmp/redis/bin:$PATH
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export SGLANG_HOST_IP=127.0.0.1 HOST_IP=127.0.0.1 NO_PROXY=127.0.0.1,localhost
export TOKENIZERS_PARALLELISM=false
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
M=${MODEL:-/tmp/m/q36_27b}  # MODEL: another checkpoint (a build_model.py one)
NAME=${NAME:-point}; PLAN=${PLAN:-plan}; MAXTOK=${MAXTOK:-512}; LENGTHS=${LENGTHS:-$MAXTOK}
PORT=30700; RPORT=6392
ENGINE_EXTRA="--sampling-backend pytorch --grammar-backend none --load-format dummy${ENGINE_MORE:+ $ENGINE_MORE}"
W=/tmp/big/$NAME
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null; done
  sleep 2
  for p in "${PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null; done
  redis-cli -p $RPORT shutdown nosave >/dev/null 2>&1
}
trap cleanup EXIT
healthy() { python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=3).status != 200)" 2>/dev/null; }
mark() { echo "$1 $(date +%s.%N)" >>"$W/phases.txt"; }
stop_pg() { kill -TERM -- "-$1" 2>/dev/null; for _ in $(seq 16); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 0.5; done; kill -KILL -- "-$1" 2>/dev/null; }

write_prompts() {  # write_prompts FILE N: N prompts of load.py's, as genfleet reads them
  python3 - "$1" "$2" <<PY
import json, sys
sys.path.insert(0, "$HERE")
from load import prompt
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        f.write(json.dumps({"id": f"p{i}", "prompt": prompt(i)}) + "\n")
PY
}

flags() {  # genfleet worker flags of this point
  local f=(--model "$M" --port $PORT --gpus 0 --attention-backend "${ATTN:-triton}" --max-tokens "$MAXTOK"
           --engine-extra-args "$ENGINE_EXTRA")
  if [ "$PLAN" = old ]; then
    f+=(--no-engine-plan --no-mtp --mem-fraction-static 0.9)
  else
    [ -n "${CAP:-}" ] && f+=(--max-running-requests "$CAP")
    [ "${MTP:-}" = off ] && f+=(--no-mtp)
    [ "${MTP:-}" = on ] && f+=(--mtp)
    [ -n "${MEMFRAC:-}" ] && f+=(--mem-fraction-static "$MEMFRAC")
  fi
  printf '%s\n' "${f[@]}"
}

step_build() {
  if [ ! -f $M/config.json ]; then
    say "build: $M"
    python3 "$HERE/build_27b.py" $M || return 1
  fi
  say "build: done"
}

step_point() {
  rm -rf "$W"; mkdir -p "$W/logs"
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "stray GPU process $p"; kill -9 "$p" 2>/dev/null
  done
  sleep 1
  mapfile -t f < <(flags)
  python3 -m genfleet.workers worker --print-engine-command "${f[@]}" >"$W/engine_command.txt" 2>&1
  cat "$W/engine_command.txt"
  local cmd; cmd=$(head -1 "$W/engine_command.txt")
  case "$cmd" in *"sglang serve"*) ;; *) say "point $NAME: no engine command"; pack; return 1;; esac
  setsid python3 "$HERE/sample.py" nvml "$W/power.jsonl" >/dev/null 2>&1 & PIDS+=($!)
  nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv | tee "$W/gpu.txt"
  mark engine_start
  setsid bash -c "exec env $cmd" >"$W/logs/engine.log" 2>&1 &
  local epg=$!; PIDS+=($epg)
  local t; t=$(date +%s)
  say "point $NAME: engine starting"
  until healthy $PORT; do
    sleep 2
    if ! kill -0 $epg 2>/dev/null || [ "$(left)" -lt 60 ]; then
      say "point $NAME: engine NOT ready"; grep -v "^\s*$" "$W/logs/engine.log" | tail -30; stop_pg $epg; pack; return 1
    fi
  done
  mark engine_ready
  say "point $NAME: engine ready in $(( $(date +%s) - t )) s"
  setsid python3 "$HERE/sample.py" metrics http://127.0.0.1:$PORT "$W/metrics.jsonl" >/dev/null 2>&1 & PIDS+=($!)
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/server_info').read().decode())" >"$W/server_info.json" 2>/dev/null
  local cap; cap=$(python3 -c "import json; d=json.load(open('$W/server_info.json')); s=(d.get('internal_states') or [{}])[0]; print(s.get('effective_max_running_requests_per_dp') or d.get('max_running_requests'))")
  local infl=$(( cap * 5 / 4 + 4 ))
  echo "$cap" >"$W/cap.txt"
  say "point $NAME: engine cap $cap, $infl in flight"
  timeout 120 python3 "$HERE/load.py" --url http://127.0.0.1:$PORT --model $M --concurrency $infl --prompts $infl --max-tokens 32 --json-out "$W/warm.json" >/dev/null
  for len in $LENGTHS; do
    [ "${STEADY_S:-40}" -eq 0 ] && continue
    [ "$(left)" -lt $(( ${STEADY_S:-40} + 30 )) ] && { say "steady $len skipped ($(left) s left)"; continue; }
    say "point $NAME: steady, $len-token answers, ${STEADY_S:-40} s"
    mark "steady$len"_start
    timeout $(( ${STEADY_S:-40} + 20 )) python3 "$HERE/load.py" --url http://127.0.0.1:$PORT --model $M --concurrency $infl \
      --duration-s "${STEADY_S:-40}" --max-tokens "$len" --json-out "$W/steady$len.json" >/dev/null
    mark "steady$len"_end
  done
  if [ -n "${CONT:-}" ]; then
    say "point $NAME: continuation by ids, ${CONT_PROMPTS:-32} prompts x $MAXTOK tokens, cut at ${CONT_CUT:-193}"
    mark cont_start
    timeout $(( $(left) - 30 )) python3 -m harness.continuation --url http://127.0.0.1:$PORT --model $M \
      --prompts "${CONT_PROMPTS:-32}" --budget "$MAXTOK" --cut "${CONT_CUT:-193}" >"$W/continuation.json"
    mark cont_end
    cat "$W/continuation.json"; echo
  fi
  if [ -n "${GF:-}" ]; then gf_phase "$cap" "$infl"; fi
  stop_pg $epg
  python3 "$HERE/summarize.py" "$W" >"$W/summary.txt" 2>&1; cat "$W/summary.txt" | head -40
  pack
}

gf_phase() {  # N prompts direct, then the same through genfleet on the same engine
  local cap=$1 infl=$2
  local n=$(( cap * ${GF_WAVES:-2} ))
  local need; need=$(python3 -c "print(int(2.4 * $n * $MAXTOK / max(1.0, 30.0 * $cap)) + 80)")
  [ "$(left)" -lt "$need" ] && { say "genfleet phase skipped: needs ~$need s, $(left) left"; return 0; }
  say "direct: $n prompts x $MAXTOK tokens"
  mark direct_start
  timeout $(( ($(left) - 40) / 2 )) python3 "$HERE/load.py" --url http://127.0.0.1:$PORT --model $M --concurrency $infl \
    --prompts $n --max-tokens $MAXTOK --stream --json-out "$W/direct.json" >/dev/null
  mark direct_end
  local direct_end_s; direct_end_s=$(date +%s)
  cat "$W/direct.json"; echo
  redis-server --port $RPORT --bind 127.0.0.1 --save "" --appendonly no --daemonize yes --dir "$W" --logfile "$W/logs/redis.txt"
  for _ in $(seq 50); do redis-cli -p $RPORT ping >/dev/null 2>&1 && break; sleep 0.1; done
  # The run is made for the engine the worker serves (an external one): its model.json says so.
  export GENFLEET_ENGINE=external GENFLEET_ENGINE_URL=http://127.0.0.1:$PORT GENFLEET_REDIS_URL=redis://127.0.0.1:$RPORT/0 GENFLEET_STORE=file://$W/store GENFLEET_LOG_DIR=$W/logs
  export GENFLEET_MAX_TOKENS=$MAXTOK GENFLEET_BATCH_SIZE=$(( cap > 16 ? cap : 16 )) GENFLEET_TOP_P=1.0
  # Random weights: answers run to max_tokens, which the quality gate would pause the run for.
  export GENFLEET_POWER_WATCH_INTERVAL_S=20 GENFLEET_POWER_WINDOW_S=20 GENFLEET_QUALITY_GATE=false
  write_prompts "$W/prompts.jsonl" "$n"
  local mtp_flag=--no-mtp; grep -q "speculative-algorithm" "$W/engine_command.txt" && mtp_flag=--mtp
  setsid python3 -m genfleet.workers worker --engine external --engine-url http://127.0.0.1:$PORT --model $M \
    $mtp_flag --hostname "gpu0@big" >"$W/logs/worker.txt" 2>&1 & local wpg=$!; PIDS+=($wpg)
  setsid python3 -m genfleet.workers control --hostname "control@big" >"$W/logs/control.txt" 2>&1 & local cpg=$!; PIDS+=($cpg)
  for _ in $(seq 120); do grep -q "feeding http" "$W/logs/worker.txt" && break; sleep 0.5; done
  # `top`'s first window (GENFLEET_POWER_WINDOW_S) holds none of the direct client's tokens.
  local quiet=$(( 21 - ($(date +%s) - direct_end_s) ))
  [ "$quiet" -gt 0 ] && sleep "$quiet"
  mark gf_start
  local t_enq; t_enq=$(date +%s.%N)
  genfleet enqueue "$W/prompts.jsonl" --run "big-$NAME" --model $M 2>&1 | tail -2
  local state="" last_top=0
  while :; do
    state=$(genfleet status "big-$NAME" --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["state"], d.get("prompts_done"))' 2>/dev/null)
    [ "${state%% *}" = done ] && break
    if [ $(( $(date +%s) - last_top )) -ge 15 ]; then
      last_top=$(date +%s)
      { echo "## t=$(date +%s.%N)"; timeout 20 genfleet top --once --json 2>&1; } >>"$W/top.txt"
    fi
    [ "$(left)" -lt 30 ] && { say "genfleet: deadline, state $state"; break; }
    case "${state%% *}" in paused|failed|cancelled) say "genfleet: run $state"; break;; esac
    sleep 1
  done
  local t_done; t_done=$(date +%s.%N)
  mark gf_end
  genfleet status "big-$NAME" --json >"$W/genfleet_status.json" 2>/dev/null
  genfleet findings --json >"$W/findings.json" 2>/dev/null
  # Done when the last output is in the store (its object's mtime), from the moment the
  # enqueue command started: the status polls and `top` of this loop are not genfleet's time.
  python3 - "$W" "$t_enq" "$t_done" "big-$NAME" <<'PY'
import json, sys
from pathlib import Path
w, t0, polled, run = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
st = json.load(open(f"{w}/genfleet_status.json"))
tok = st.get("completion_tokens") or 0
outputs = [p.stat().st_mtime for p in Path(w, "store", run, "outputs").glob("*.jsonl.gz")]
t1 = max(outputs) if outputs else polled
g = {"state": st.get("state"), "elapsed_s": round(t1 - t0, 2), "polled_s": round(polled - t0, 2),
     "completion_tokens": tok, "tokens_per_s": round(tok / (t1 - t0), 1),
     "prompts_done": st.get("prompts_done"), "errors": st.get("errors"), "outputs": len(outputs)}
json.dump(g, open(f"{w}/genfleet.json", "w"), indent=1)
print("genfleet", g)
PY
  stop_pg $wpg; stop_pg $cpg
}

step_tune() {  # `genfleet tune` itself on the 27B: the plan's sweep, each point a fresh engine
  local w=/tmp/big/tune$MAXTOK points=${TUNE_MTP:-off:plan*0.75,off:plan,off:plan*1.25,on:plan}
  mkdir -p "$w/logs"
  say "tune: --mtp $points at $MAXTOK-token answers, ${TUNE_DURATION_S:-40} s a point"
  write_prompts "$w/prompts.jsonl" 4000
  setsid python3 "$HERE/sample.py" nvml "$w/power.jsonl" >/dev/null 2>&1 & PIDS+=($!)
  GENFLEET_LOG_DIR=$w/logs timeout $(( $(left) - 15 )) python3 -m genfleet.workers tune --engine sglang --model "$M" \
    --gpus 0 --attention-backend "${ATTN:-triton}" --engine-extra-args "$ENGINE_EXTRA" --max-tokens "$MAXTOK" \
    --mtp "$points" --duration-s "${TUNE_DURATION_S:-40}" --warmup-s 5 --ramp-s 10 --drain-s "${TUNE_DRAIN_S:-10}" \
    --dataset "$w/prompts.jsonl" --settings-out "$w/tuned.env" --json-out "$w/tune.json" 2>&1 | tee "$w/tune.txt"
  cp "$w/tune.json" "$OUT/tune_$MAXTOK.json" 2>/dev/null
  for f in "$w"/logs/*.log; do [ -f "$f" ] && tail -c 100000 "$f" >"$f.tail" && rm -f "$f"; done
  tar -C /tmp/big -czf "$OUT/big_tune$MAXTOK.tar.gz" --exclude='prompts.jsonl' "tune$MAXTOK"
}

pack() {
  tail -c 200000 "$W/logs/engine.log" >"$W/logs/engine_tail.log" 2>/dev/null
  grep -E "Decode batch|max_total_num_tokens|mamba|KV Cache|max_running" "$W/logs/engine.log" | tail -400 >"$W/logs/engine_batches.log" 2>/dev/null
  rm -f "$W/logs/engine.log"
  tar -C /tmp/big -czf "$OUT/big_$NAME.tar.gz" --exclude='store' --exclude='prompts.jsonl' "$NAME"
  cp "$W/summary.json" "$OUT/point_$NAME.json" 2>/dev/null
}

for step in "$@"; do "step_$step" || say "step $step FAILED"; done
