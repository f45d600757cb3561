#!/usr/bin/env bash
# On the GPU machine (no network): real SGLang 0.5.15 from the carried payload, driven by genfleet.
#
#   bash .carry/gf/bench/real_sglang/device.sh setup models golden crash tests bench harvest
#
# Steps run in the order given; each is skipped (not started) when less of BUDGET_S is left
# than it needs, so one call never overruns its limit. The payload (site.tar.xz, redis/,
# jitcache.tar.xz) comes from bench/real_sglang/prepare.sh in $PAYLOAD (default .carry/sgl);
# genfleet's code is the checkout this script sits in. Everything under /tmp is kept while the
# machine stays warm, so a later call skips what is already there.
#
#   setup    unpack the SGLang site into /tmp/site, stubs, Redis, the `sglang` and `genfleet`
#            launchers, patch_site.py, the JIT caches
#   models   build_model.py: /tmp/m/dense (Qwen3), /tmp/m/q35 (Qwen3.6 layout + mtp.*),
#            /tmp/m/q35_nomtp (the same without mtp.*)
#   golden   record_golden.py against q35 -> $OUT/golden.tar.gz (tests/golden/sglang-0.5.15)
#   crash    crash_probe.py: CUDA-graph variants under genfleet's load -> $OUT/crash.tar.gz
#   tests    python3 -m pytest -q -m gpu tests/workers/test_real_sglang_gpu.py -> $OUT/gpu_tests.txt
#            (TESTS_K: -k; TESTS_FILES: other modules, e.g. tests/workers/test_real_sglang_27b_gpu.py
#            after big.sh's build; GENFLEET_GPU_ENGINE_EXTRA: flags added to the engines the tests start)
#   bench    per model (BENCH_MODELS, default "q35 dense"): one engine with genfleet's argv, a
#            saturating direct client (plain, then streamed), then genfleet's worker + control
#            on the same engine
#            (enqueue, wait, export, findings); then `genfleet tune` -> $OUT/bench.tar.gz
#   harvest  the JIT caches -> $OUT/jitcache.tar.xz (carry it back to save ~40 s a start)
# Env: BUDGET_S (570), OUT, PAYLOAD, BENCH_PROMPTS (2000), BENCH_MAX_TOKENS (128),
#      TUNE_CONCURRENCY (16,64,256), TUNE_DURATION_S (10), CRASH_VARIANTS, CRASH_LOAD_S (30).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
GF=$(cd "$HERE/../.." && pwd)
PAYLOAD=${PAYLOAD:-$(pwd)/.carry/sgl}
OUT=${OUT:-/tmp/real-sglang-out}
mkdir -p "$OUT"
# `python3 -m` puts the working directory first on sys.path: run from this checkout, so the
# genfleet that runs is the one carried here, not the one the call's working tree holds.
cd "$GF" || exit 1
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
say() { echo "=== +$(( $(date +%s) - T0 ))s $*"; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
enough() {  # enough NAME SECONDS: true when the step fits in what is left
  if [ "$(left)" -lt "$2" ]; then say "$1: skipped, $(left) s left (needs $2)"; return 1; fi
}

export PYTHONPATH=/tmp/site:/tmp/stubs:$GF
export PATH=/tmp/site/bin:/tmp/redis/bin:$PATH
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# SGLang otherwise probes an outside address to learn its own IP (no network here).
export SGLANG_HOST_IP=127.0.0.1 HOST_IP=127.0.0.1 NO_PROXY=127.0.0.1,localhost
export TOKENIZERS_PARALLELISM=false
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# What the carried SGLang can run: triton attention (FA3 is not carried), no flashinfer JIT.
ENGINE_ARGS="--sampling-backend pytorch --grammar-backend none"

PGIDS=()
cleanup() {
  for pgid in "${PGIDS[@]}"; do kill -TERM -- "-$pgid" 2>/dev/null; done
  sleep 2
  for pgid in "${PGIDS[@]}"; do kill -KILL -- "-$pgid" 2>/dev/null; done
  say "end (budget left $(left) s)"
}
trap cleanup EXIT

healthy() {  # healthy PORT: /health answers 200
  python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=3).status != 200)" 2>/dev/null
}

launchers() {
  # The console scripts pip would write. The __main__ guard matters: SGLang's scheduler is a
  # multiprocessing spawn child, which re-imports the main module.
  mkdir -p /tmp/site/bin /tmp/redis/bin
  printf '#!/usr/bin/env python3\nimport sys\nfrom sglang.cli.main import main\nif __name__ == "__main__":\n    sys.exit(main())\n' >/tmp/site/bin/sglang
  printf '#!/usr/bin/env python3\nimport sys\nfrom genfleet.cli import main\nif __name__ == "__main__":\n    sys.exit(main())\n' >/tmp/site/bin/genfleet
  # Redis's Debian libraries for redis alone: the image's own libssl stays Python's.
  for prog in redis-server redis-cli; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/redis/usr/lib/x86_64-linux-gnu exec /tmp/redis/usr/bin/%s "$@"\n' "$prog" >/tmp/redis/bin/$prog
  done
  chmod +x /tmp/site/bin/* /tmp/redis/bin/*
}

step_setup() {
  if [ ! -f /tmp/site/.ok ]; then
    say "setup: unpack"
    rm -rf /tmp/site /tmp/stubs /tmp/redis
    tar -C /tmp -xJf "$PAYLOAD/site.tar.xz" || return 1
    cp -r "$HERE/stubs" /tmp/stubs
    mkdir -p /tmp/redis
    for deb in "$PAYLOAD"/redis/*.deb; do dpkg -x "$deb" /tmp/redis; done
    touch /tmp/site/.ok
  fi
  launchers
  python3 "$HERE/patch_site.py" /tmp/site || return 1
  if [ -f "$PAYLOAD/jitcache.tar.xz" ] && [ ! -d ~/.cache/tvm-ffi ]; then
    tar -C ~ -xJf "$PAYLOAD/jitcache.tar.xz"
  fi
  python3 -c "import importlib.metadata as m; print({p: m.version(p) for p in ('sglang', 'sglang-kernel', 'flashinfer-python', 'transformers', 'torch')})"
  nvidia-smi --query-gpu=name,driver_version,power.draw,power.limit,memory.used,memory.total --format=csv
  say "setup: done"
}

step_models() {
  if [ -f /tmp/m/.ok ]; then say "models: already there"; return 0; fi
  enough models 90 || return 1
  say "models: build"
  python3 "$HERE/build_model.py" /tmp/m/dense --arch qwen3 || return 1
  python3 "$HERE/build_model.py" /tmp/m/q35 --arch qwen3_5 --no-mtp-out /tmp/m/q35_nomtp || return 1
  touch /tmp/m/.ok
  say "models: done"
}

step_golden() {
  enough golden 180 || return 1
  say "golden: record from real SGLang (q35, MTP)"
  rm -rf /tmp/golden
  timeout $(( $(left) - 20 )) python3 "$HERE/record_golden.py" --model /tmp/m/q35 --out /tmp/golden --extra-args "$ENGINE_ARGS"
  local rc=$?
  tail -c 200000 /tmp/golden/engine.log >/tmp/golden/engine_tail.log 2>/dev/null; rm -f /tmp/golden/engine.log
  tar -C /tmp -czf "$OUT/golden.tar.gz" golden
  say "golden: rc=$rc, $(ls /tmp/golden | wc -l) files"
}

step_crash() {
  enough crash 170 || return 1
  local variants=${CRASH_VARIANTS:-"graphs=--cuda-graph-max-bs=256 below=--cuda-graph-max-bs=128"}
  local args=()
  for v in $variants; do args+=(--variant "$v"); done
  say "crash: $variants"
  mkdir -p /tmp/crash
  python3 "$HERE/crash_probe.py" --model /tmp/m/q35 --out /tmp/crash/crash_probe.json \
    --load-s "${CRASH_LOAD_S:-30}" --deadline $(( T0 + BUDGET_S - 15 )) --need-s 150 "${args[@]}"
  for f in /tmp/crash/probe_*.log; do [ -f "$f" ] && tail -c 60000 "$f" >"$f.tail" && rm -f "$f"; done
  tar -C /tmp -czf "$OUT/crash.tar.gz" crash
  python3 -c "import json; [print(r.get('variant'), 'survived' if r.get('survived') else 'DIED' if 'survived' in r else r.get('skipped') or r.get('error'), r.get('first_error'), (r.get('load') or {}).get('tokens_per_s')) for r in json.load(open('/tmp/crash/crash_probe.json'))]"
}

step_tests() {
  enough tests 240 || return 1
  say "tests: pytest -m gpu"
  mkdir -p /tmp/gpu-out
  (cd "$GF" && GENFLEET_GPU_OUT=/tmp/gpu-out timeout $(( $(left) - 15 )) python3 -m pytest -q -m gpu \
    -p no:cacheprovider -p no:unraisableexception -o addopts="" -rA ${TESTS_FILES:-tests/workers/test_real_sglang_gpu.py} ${TESTS_K:+-k "$TESTS_K"} \
    --basetemp=/tmp/gpu-tests 2>&1 | tee "$OUT/gpu_tests.txt")
  cp /tmp/gpu-out/*.json "$OUT/" 2>/dev/null
  tar -C /tmp -czf "$OUT/gpu_logs.tar.gz" --exclude='*.safetensors' --exclude='store' gpu-tests 2>/dev/null
}

# bench_model NAME: one engine with genfleet's own argv; the direct client, then genfleet's
# worker on the same engine (--engine external), the same prompts, one after the other.
bench_model() {
  local name=$1 model=/tmp/m/$1 port=30600 work=/tmp/bench/$1
  [ -f "$model/config.json" ] || { say "bench $name: no checkpoint $model"; return 1; }
  enough "bench $name" 200 || return 1
  rm -rf "$work"; mkdir -p "$work/logs"
  local extra=(--attention-backend triton --mem-fraction-static 0.6 --engine-extra-args "$ENGINE_ARGS")
  [ "$name" = dense ] && extra+=(--no-mtp)
  local cmd
  cmd=$(python3 -m genfleet.workers worker --print-engine-command --model "$model" --port $port --gpus 0 "${extra[@]}")
  echo "$cmd" | tee "$work/engine_command.txt"
  setsid bash -c "exec env $(echo "$cmd" | head -1)" >"$work/logs/engine.log" 2>&1 &
  local pgid=$!; PGIDS+=("$pgid")
  local t=$(date +%s)
  until healthy $port; do
    sleep 2
    if ! kill -0 "$pgid" 2>/dev/null || [ $(( $(date +%s) - t )) -gt 300 ]; then
      say "bench $name: engine not ready"; tail -30 "$work/logs/engine.log"; return 1
    fi
  done
  say "bench $name: engine ready in $(( $(date +%s) - t )) s"
  python3 "$HERE/load.py" --url "http://127.0.0.1:$port" --model "$model" --concurrency 324 \
    --prompts "${BENCH_PROMPTS:-2000}" --max-tokens "${BENCH_MAX_TOKENS:-128}" --json-out "$work/direct.json"
  # The same, streamed as genfleet's worker asks: what streaming costs the engine itself.
  python3 "$HERE/load.py" --url "http://127.0.0.1:$port" --model "$model" --concurrency 324 --stream \
    --prompts "${BENCH_PROMPTS:-2000}" --max-tokens "${BENCH_MAX_TOKENS:-128}" --json-out "$work/direct_stream.json"
  # genfleet: Redis, one worker on the same engine, enqueue the same prompts, time to done.
  local rport=6391
  redis-server --port $rport --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
    --dir "$work" --logfile "$work/logs/redis.txt"
  for _ in $(seq 50); do redis-cli -p $rport ping >/dev/null 2>&1 && break; sleep 0.1; done
  redis-cli -p $rport flushall >/dev/null
  export GENFLEET_REDIS_URL=redis://127.0.0.1:$rport/0 GENFLEET_STORE=file://$work/store
  export GENFLEET_LOG_DIR=$work/logs GENFLEET_MAX_TOKENS=${BENCH_MAX_TOKENS:-128} GENFLEET_BATCH_SIZE=200
  python3 - "$work/prompts.jsonl" "${BENCH_PROMPTS:-2000}" <<PY
import json, sys
sys.path.insert(0, "$HERE")
from load import prompt
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        f.write(json.dumps({"id": f"p{i}", "prompt": prompt(i)}) + "\n")
PY
  setsid python3 -m genfleet.workers worker --engine external --engine-url "http://127.0.0.1:$port" \
    --model "$model" --hostname "bench-$name@h200" >"$work/logs/worker.txt" 2>&1 &
  local wpg=$!; PGIDS+=("$wpg")
  setsid python3 -m genfleet.workers control --hostname "control-$name@h200" >"$work/logs/control.txt" 2>&1 &
  local cpg=$!; PGIDS+=("$cpg")
  for _ in $(seq 120); do grep -q "feeding http" "$work/logs/worker.txt" && break; sleep 0.5; done
  local t_enq; t_enq=$(python3 -c 'import time; print(time.time())')
  genfleet enqueue "$work/prompts.jsonl" --run "bench-$name" --model "$model" >/dev/null || return 1
  local state=""
  for _ in $(seq 600); do
    state=$(genfleet status "bench-$name" --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>/dev/null)
    [ "$state" = done ] && break
    sleep 0.5
  done
  local t_done; t_done=$(python3 -c 'import time; print(time.time())')
  genfleet status "bench-$name" --json >"$work/genfleet_status.json" 2>/dev/null
  genfleet export "bench-$name" --out "$work/outputs.jsonl" && wc -l "$work/outputs.jsonl"
  genfleet findings --json >"$work/findings.json" 2>/dev/null
  python3 - "$work" "$t_enq" "$t_done" "$state" <<'PY'
import json, sys
work, t_enq, t_done, state = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
direct = json.load(open(f"{work}/direct.json"))
streamed = json.load(open(f"{work}/direct_stream.json"))
status = json.load(open(f"{work}/genfleet_status.json"))
elapsed = t_done - t_enq
tokens = status.get("completion_tokens") or 0
g = {"state": state, "elapsed_s": round(elapsed, 2), "completion_tokens": tokens,
     "tokens_per_s": round(tokens / elapsed, 1), "prompts_done": status.get("prompts_done"),
     "errors": status.get("errors")}
def ratio(a, b):
    return round(a / b, 3) if b else None
vs = {"direct": direct, "direct_stream": streamed, "genfleet": g,
      "genfleet_vs_direct": ratio(g["tokens_per_s"], direct["tokens_per_s"]),
      "genfleet_vs_direct_stream": ratio(g["tokens_per_s"], streamed["tokens_per_s"]),
      "direct_stream_vs_direct": ratio(streamed["tokens_per_s"], direct["tokens_per_s"])}
json.dump(vs, open(f"{work}/vs.json", "w"), indent=1)
print("direct", direct, "\ndirect_stream", streamed, "\ngenfleet", g)
print({k: v for k, v in vs.items() if k.endswith(("_direct", "_stream"))})
PY
  kill -TERM -- "-$wpg" "-$cpg" 2>/dev/null; sleep 3; kill -KILL -- "-$wpg" "-$cpg" 2>/dev/null
  redis-cli -p $rport shutdown nosave >/dev/null 2>&1
  kill -TERM -- "-$pgid" 2>/dev/null
  for _ in $(seq 30); do kill -0 -- "-$pgid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$pgid" 2>/dev/null
  say "bench $name: done"
}

tune_model() {
  local name=$1 model=/tmp/m/$1 mtp=$2 work=/tmp/bench/$1
  local starts; starts=$(echo "$mtp" | tr ',' '\n' | wc -l)
  enough "tune $name" $(( 60 + starts * 110 )) || return 1
  say "tune $name: --mtp $mtp"
  mkdir -p "$work"
  [ -f "$work/prompts.jsonl" ] || python3 -c "
import json, sys; sys.path.insert(0, '$HERE'); from load import prompt
open('$work/prompts.jsonl', 'w').writelines(json.dumps({'id': f'p{i}', 'prompt': prompt(i)}) + '\n' for i in range(2000))"
  GENFLEET_LOG_DIR=$work/logs timeout $(( $(left) - 10 )) python3 -m genfleet.workers tune --engine sglang --model "$model" --gpus 0 \
    --attention-backend triton --mem-fraction-static 0.6 --engine-extra-args "$ENGINE_ARGS" \
    --max-tokens "${BENCH_MAX_TOKENS:-128}" --mtp "$mtp" --concurrency "${TUNE_CONCURRENCY:-16,64,256}" \
    --duration-s "${TUNE_DURATION_S:-10}" --warmup-s 3 --ramp-s 2 --drain-s 20 --dataset "$work/prompts.jsonl" \
    --settings-out "$work/tuned.env" --json-out "$work/tune.json"
}

step_bench() {
  for name in ${BENCH_MODELS:-q35 dense}; do bench_model "$name"; done
  [[ " ${TUNE_MODELS:-q35 dense} " == *" q35 "* ]] && tune_model q35 "${TUNE_MTP_Q35:-on,off}"
  [[ " ${TUNE_MODELS:-q35 dense} " == *" dense "* ]] && tune_model dense off
  tar -C /tmp -czf "$OUT/bench.tar.gz" --exclude='store' --exclude='*.jsonl' bench 2>/dev/null
  for f in /tmp/bench/*/vs.json /tmp/bench/*/tune.json; do [ -f "$f" ] && echo "$f" && cat "$f" | head -c 3000; echo; done
}

step_harvest() {
  tar -C ~ -cJf "$OUT/jitcache.tar.xz" .cache/tvm-ffi .triton/cache 2>/dev/null
  ls -la "$OUT/jitcache.tar.xz"
}

for step in "$@"; do
  "step_$step" || say "step $step FAILED"
done
