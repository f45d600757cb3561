#!/usr/bin/env bash
# genfleet end to end on one GPU, then `genfleet tune`, in one command: what the H200 call runs.
#
#   bench/prepare_h200_carry.sh              # here, once: wheels + redis-server into .carry/
#   bench/h200_run.sh                        # there (carry .carry): transformers serve
#   ENGINE=emulator bench/h200_run.sh        # anywhere: the same path with the emulator
#
# The engine is `transformers serve` on a random-initialised Qwen3 (bench/real_sglang/
# build_model.py --arch qwen3), supervised by genfleet's generic command launcher; not SGLang.
# Steps: carried wheels and Redis, model, 400 prompts, `enqueue`, one `worker` on GPU 0 with
# NVML, a `control` worker running the power-watch beat, wait, `export`, `top --once --json`
# and `findings`, then `tune --mtp off` over C=1,4,16,64,128. Results and logs go to $OUT (at
# most 8 files).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/h200-out}
ENGINE=${ENGINE:-transformers}
PROMPTS=${PROMPTS:-400}
TUNE_CONCURRENCY=${TUNE_CONCURRENCY:-1,4,16,64,128}
TUNE_DURATION_S=${TUNE_DURATION_S:-20}
WORK=${WORK:-/tmp/genfleet-h200}
CARRY=$ROOT/.carry
REDIS_PORT=${REDIS_PORT:-6390}
mkdir -p "$OUT" "$WORK/logs"
exec > >(tee -a "$OUT/h200_log.txt") 2>&1
cd "$ROOT"
say() { echo "=== $(date -u +%H:%M:%S) $*"; }
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  sleep 3
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  [ -n "${REDIS_CLI:-}" ] && $REDIS_CLI shutdown nosave >/dev/null 2>&1
  cat "$WORK"/logs/*.log 2>/dev/null | tail -n 400 >"$OUT/h200_engine_logs.txt"
}
trap cleanup EXIT

say "python $(python3 --version 2>&1); engine $ENGINE"
if python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' && [ -d "$CARRY/wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$CARRY"/wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$WORK/py:$ROOT
else
  export PYTHONPATH=$WORK/py:$ROOT
fi
# The folders import as genfleet.common|producer|workers, as an install would name them.
mkdir -p "$WORK/py/genfleet"
for part in common producer workers; do ln -sfn "$ROOT/$part" "$WORK/py/genfleet/$part"; done
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,power.draw,power.limit,memory.used --format=csv 2>/dev/null

say "redis"
export LD_LIBRARY_PATH=$CARRY/redis/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
REDIS_CLI="$CARRY/redis/usr/bin/redis-cli -p $REDIS_PORT"
"$CARRY/redis/usr/bin/redis-server" --port "$REDIS_PORT" --bind 127.0.0.1 --save "" \
  --appendonly no --daemonize yes --dir "$WORK" --logfile "$WORK/logs/redis.txt" || exit 1
for _ in $(seq 50); do $REDIS_CLI ping >/dev/null 2>&1 && break; sleep 0.1; done
$REDIS_CLI flushall

genfleet() { python3 -c 'import sys; from genfleet.cli import main; sys.argv[0] = "genfleet"; main()' "$@"; }

export GENFLEET_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0
export GENFLEET_STORE=file://$WORK/store
export GENFLEET_LOG_DIR=$WORK/logs
export GENFLEET_MAX_TOKENS=64 GENFLEET_BATCH_SIZE=50 GENFLEET_WORKER_CONCURRENCY=3
export GENFLEET_POWER_WATCH_INTERVAL_S=10 GENFLEET_POWER_WINDOW_S=15 GENFLEET_STARTUP_TIMEOUT_S=300
if [ "$ENGINE" = transformers ]; then
  say "model"
  python3 bench/real_sglang/build_model.py "$WORK/model" --arch qwen3 || exit 1
  SERVE=$(command -v transformers || echo "$(dirname "$(command -v python3)")/transformers")
  export GENFLEET_ENGINE=command GENFLEET_MODEL=$WORK/model GENFLEET_SERVED_MODEL_NAME=$WORK/model
  export GENFLEET_ENGINE_COMMAND="$SERVE serve {model} --continuous-batching --host {host} --port {port}"
  export GENFLEET_ENGINE_HEALTH_PATH=/health GENFLEET_GPUS=0
  export GENFLEET_REASONING_PARSER=""  # transformers serve refuses non-OpenAI request keys
else
  export GENFLEET_ENGINE=emulator GENFLEET_EMULATOR_TIME_SCALE=${GENFLEET_EMULATOR_TIME_SCALE:-5}
  export GENFLEET_EMULATOR_LOAD_S=0.5 GENFLEET_EMULATOR_MEAN_COMPLETION_TOKENS=64
fi

say "dataset: $PROMPTS prompts"
python3 - "$WORK/prompts.jsonl" "$PROMPTS" <<'PY'
import json, sys
topics = ["hash maps", "lighthouses", "the French Revolution", "derivatives", "sorted lists",
          "the water cycle", "TCP and UDP", "vaccines", "microservices", "gradient descent"]
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        text = f"Prompt {i}: explain {topics[i % len(topics)]} in {20 + i % 50} words."
        f.write(json.dumps({"id": f"p{i}", "prompt": text}) + "\n")
PY

say "workers"
python3 -m genfleet.workers worker --hostname gpu0@h200 >"$WORK/logs/worker.txt" 2>&1 &
PIDS+=($!)
python3 -m genfleet.workers control --hostname control@h200 >"$WORK/logs/control.txt" 2>&1 &
PIDS+=($!)
genfleet enqueue "$WORK/prompts.jsonl" --run h200 || exit 1
STARTED=$(date +%s)
: >"$OUT/h200_top.jsonl"
for _ in $(seq 48); do
  sleep 5
  STATE=$(genfleet status h200 --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("state"))' 2>/dev/null)
  python3 -m genfleet.workers top --once --json 2>/dev/null | tr -d '\n' >>"$OUT/h200_top.jsonl" && echo >>"$OUT/h200_top.jsonl"
  echo "state=$STATE after $(( $(date +%s) - STARTED )) s"
  [ "$STATE" = done ] && break
  if ! kill -0 "${PIDS[0]}" 2>/dev/null; then echo "worker died"; tail -n 60 "$WORK/logs/worker.txt"; break; fi
done
ELAPSED=$(( $(date +%s) - STARTED ))
sleep 12  # one more power-watch pass over the tail of the run
{
  echo "{\"elapsed_s\": $ELAPSED, \"status\":"
  genfleet status h200 --json
  echo ", \"findings\":"
  genfleet findings --json
  echo "}"
} >"$OUT/h200_e2e.json" 2>>"$OUT/h200_log.txt"
genfleet export h200 --out "$WORK/outputs.jsonl" && wc -l "$WORK/outputs.jsonl" && head -c 3000 "$WORK/outputs.jsonl" >"$OUT/h200_outputs_head.jsonl"
grep -E "UNDERUSED|power_watch|succeeded" "$WORK/logs/control.txt" | tail -n 20
for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
PIDS=()

say "tune"
python3 -m genfleet.workers tune --mtp off --concurrency "$TUNE_CONCURRENCY" --duration-s "$TUNE_DURATION_S" \
  --warmup-s 5 --drain-s 30 --dataset "$WORK/prompts.jsonl" \
  --settings-out "$OUT/h200_tuned.env" --json-out "$OUT/h200_tune.json"
say "done"
