#!/usr/bin/env bash
# One prepared GPU run (about 9 minutes): exactness on CUDA, the verification-cost curve of the built-in target
# and of larger random targets, then standard vs SPOT throughput on as many held-out GSM8K prompts as the time left
# allows. Runs from the repository root with the machine's own python3 (torch with CUDA); installs nothing.
# Results land in $OUT (default gpu_out/): log.txt, verify_cost_builtin.json, verify_cost_large.json, bench_gpu.json.
#   bash scripts/gpu_speed_check.sh            # TOTAL_SECONDS=540 by default
#   DEVICE=cpu LARGE_SHAPES=d64-l2-h4-v512 TOTAL_SECONDS=200 MAX_PROMPTS=3 bash scripts/gpu_speed_check.sh  # dry run
set -u
OUT=${OUT:-gpu_out}
TOTAL_SECONDS=${TOTAL_SECONDS:-540}
DEVICE=${DEVICE:-cuda}
LARGE_SHAPES=${LARGE_SHAPES:-d1024-l24-h16-v32768,d2048-l24-h16-v65536,d4096-l36-h32-v151936-m3}
MAX_PROMPTS=${MAX_PROMPTS:-50}
BUDGETS=${BUDGETS:-2,4,8,16,32}
VERIFY_COST=${VERIFY_COST:-1}  # 0 skips the verification-cost curves
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
START=$(date +%s)
LOG="$OUT/log.txt"

elapsed() { echo $(($(date +%s) - START)); }
stage() {  # stage NAME LIMIT_SECONDS COMMAND...: run with a time limit, keep its output in the log
    local name=$1 limit=$2
    shift 2
    echo "== $name: start at $(elapsed)s, limit ${limit}s" | tee -a "$LOG"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    echo "== $name: rc=$? at $(elapsed)s" | tee -a "$LOG"
}
echo "== start at $(elapsed)s" | tee -a "$LOG"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; python3 -c \
  "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available())"; } \
  >>"$LOG" 2>&1

stage pytest_gpu 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_devices.py tests/test_builtin_target.py

if [ "$VERIFY_COST" = 1 ]; then
    stage verify_cost_builtin 60 python3 -m spot_dlm verify-cost --device $DEVICE --shapes builtin \
        --nodes 1,2,4,8,16,32,64 --repeats 20 --json "$OUT/verify_cost_builtin.json"
    stage verify_cost_large 120 python3 -m spot_dlm verify-cost --device $DEVICE --dtype bfloat16 \
        --shapes "$LARGE_SHAPES" \
        --nodes 1,2,4,8,16,32,64 --repeats 10 --json "$OUT/verify_cost_large.json"
fi

# Calibrate: 2 prompts of the full grid, then as many prompts (<= 50) as fit in the time left.
# spot on a GPU is the paper-sized order model (auto); spot-small shows whether the CPU-sized one costs passes there
# and spot-nb0 what the neighbour-token code costs on the host.
METHODS=${METHODS:-standard,spot,spot-small,spot-nb0}
BENCH=(python3 -m spot_dlm bench --device $DEVICE --methods "$METHODS" --budgets "$BUDGETS" --temperatures 0,1
       --task gsm8k)
T0=$(date +%s)
stage bench_calibration 120 "${BENCH[@]}" --n-prompts 2
CAL=$(($(date +%s) - T0))
LEFT=$((TOTAL_SECONDS - $(elapsed) - 20))
N=$(python3 -c "print(max(0, min($MAX_PROMPTS, int(($LEFT - 20) / max($CAL / 2, 0.1) * 0.85))))")
echo "== calibration took ${CAL}s for 2 prompts; ${LEFT}s left -> $N prompts" | tee -a "$LOG"
if [ "$N" -ge 2 ]; then
    stage bench_gpu $((LEFT > 0 ? LEFT : 1)) "${BENCH[@]}" --n-prompts "$N" --json "$OUT/bench_gpu.json"
fi
echo "== done at $(elapsed)s" | tee -a "$LOG"
