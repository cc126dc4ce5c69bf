#!/usr/bin/env bash
# Issue 15's CUDA checks, one script for a lent GPU (run from the repository root):
#   1. the CUDA equality tests (ModelRunner on cuda, TP=1, greedy against transformers);
#   2. the device's copy bandwidth (the floor's denominator);
#   3. where a decode step's time goes, in process (step_profile, torch's profiler with CUDA activity);
#   4. `meshserve bench` against the served suite at concurrency 1 and 64;
# 3 and 4 on a random-weight model of Llama-3-8B's shape (--load-format dummy: no weights needed).
#
# Every phase runs under its own time limit and the next one runs whatever the last gave; all output goes to
# $OUT/checks.log, the bench records to $OUT/*.json. A dry run on the CPU:
#   DEVICE=cpu SHAPE=tiny WHEELS=0 PYTHON=.venv/bin/python scripts/cuda_checks.sh
set -u
OUT=${OUT:-/tmp/cuda-checks}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-llama-3-8b}
PY=${PYTHON:-python3}
# Phases to run (names below), all by default.
PHASES=${PHASES:-env tests bandwidth profile served}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/checks.log"
: >"$LOG"

# Packages the device's image lacks travel as wheels in .whl (see docs/benchmarks.md, "The CUDA path").
if [ "${WHEELS:-1}" = 1 ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || echo "wheel install failed" | tee -a "$LOG"
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi

phase() {
  # phase NAME SECONDS COMMAND...: run under a limit, log its output, report its status and time.
  local name=$1 limit=$2
  shift 2
  case " $PHASES " in *" $name "*) ;; *) return 0 ;; esac
  local start=$SECONDS
  echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
  # Through bash so that a phase may be one of the functions below (exported).
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >>"$LOG" 2>&1
  echo "=== $name rc=$? $((SECONDS - start))s" | tee -a "$LOG"
}

env_report() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
  "$PY" - <<'EOF'
import sys, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "SMs", p.multi_processor_count, "memory GiB", round(p.total_memory / 2**30, 1))
import services.worker.model_runner  # noqa: F401  (the worker's imports resolve here)
print("imports ok")
EOF
}

bandwidth() {
  "$PY" - "$DEVICE" <<'EOF'
import json, statistics, sys, time, torch
device = sys.argv[1]
n = (4 << 30) // 2 if device == "cuda" else (256 << 20) // 2
src = torch.randn(n, dtype=torch.bfloat16, device=device)
dst = torch.empty_like(src)
times = []
for i in range(13):
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    if i >= 3:
        times.append(time.perf_counter() - t)
median = statistics.median(times)
# Bytes read plus bytes written, as the floor counts a step's reads.
print(json.dumps({"copy_bytes": 2 * src.numel() * 2, "median_s": median, "GB_per_s": round(4 * n / median / 1e9, 1)}))
EOF
}

served() {
  local logs=/tmp/suite-logs
  rm -rf "$logs"
  "$PY" -m services.cli up "$MODEL_DIR" --device "$DEVICE" --dtype bfloat16 --load-format dummy --kv-store off \
    --max-model-len 2048 --log-dir "$logs" --startup-timeout 300 >"$logs.up" 2>&1 &
  local up=$!
  local waited=0
  until grep -q "meshserve: serving" "$logs.up" 2>/dev/null; do
    if ! kill -0 "$up" 2>/dev/null || [ $waited -ge 300 ]; then
      echo "suite did not start:"; cat "$logs.up"; tail -n 40 "$logs"/*.log 2>/dev/null
      kill "$up" 2>/dev/null
      return 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
  echo "suite serving after ${waited}s"
  grep -h '"kv_cache_sized"\|"model_loaded"' "$logs"/worker*.log | cut -c1-600
  local common=(--backend meshserve --model "$MODEL_DIR" --dataset random --random-input-len 512
    --random-output-len 128 --no-progress)
  "$PY" -m services.cli bench "${common[@]}" --num-prompts 8 --max-concurrency 1 --num-warmups 1 \
    --save-result "$OUT/served-c1.json"
  "$PY" -m services.cli bench "${common[@]}" --num-prompts 128 --max-concurrency 64 --num-warmups 2 --seed 1 \
    --save-result "$OUT/served-c64.json"
  kill -INT "$up"
  wait "$up"
  grep -h "error\|Traceback" "$logs"/*.log | head -20
}

MODEL_DIR=/tmp/shaped-$SHAPE
export PY DEVICE OUT MODEL_DIR
export -f env_report bandwidth served
"$PY" -m services.worker.benchmarks.shaped_model "$SHAPE" "$MODEL_DIR" >>"$LOG" 2>&1

phase env 60 env_report
phase tests 150 "$PY" -m pytest -q -rs -p no:cacheprovider -k "cuda" tests/unit/worker/test_model_runner.py
phase bandwidth 60 bandwidth
phase profile 150 "$PY" -m services.worker.benchmarks.step_profile --device "$DEVICE" --load-format dummy \
  --model "$MODEL_DIR" --batch 1 64 --steps 20
phase served 240 served
echo "=== summary"
grep -E "^=== .* rc=|passed|failed|skipped|GB_per_s|^\{\"batch|^device |^python |Output token throughput|Mean TTFT|Mean TPOT|Failed requests|Error|error:" "$LOG" | cut -c1-1500
