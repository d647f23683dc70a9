#!/usr/bin/env bash
# Real DLM families on a GPU, at a real size: builds random-weight stand-ins of SDAR and LLaDA (about 1.4B
# parameters, bf16, saved and loaded back like real checkpoints) and runs `spot-dlm check-model` on each: SPOT vs
# the family's standard loop (exact match), the flip rate of packed/batched passes vs one-state passes, passes and
# tokens/s. Runs from the repository root with the machine's own python3 (torch with CUDA). transformers and its
# dependencies come from wheels carried in $WHEELS (prepare them with scripts/fetch_gpu_wheels.sh) unless python3
# already imports it. Results land in $OUT (default gpu_out/): log.txt, check_<family>.json.
#   bash scripts/gpu_check_families.sh
#   DEVICE=cpu DTYPE=float32 HIDDEN=64 LAYERS=2 HEADS=4 GEN=16 bash scripts/gpu_check_families.sh   # dry run
set -u
OUT=${OUT:-gpu_out}
WHEELS=${WHEELS:-.gpu_wheels}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
HIDDEN=${HIDDEN:-2048}
LAYERS=${LAYERS:-16}
HEADS=${HEADS:-16}
GEN=${GEN:-128}
FAMILIES=${FAMILIES:-sdar llada}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
LOG="$OUT/log.txt"
START=$(date +%s)
elapsed() { echo $(($(date +%s) - START)); }

if ! "$PYTHON" -c "import transformers" 2>/dev/null; then
    echo "== installing transformers from $WHEELS" | tee -a "$LOG"
    "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" --target "$OUT/site" transformers >>"$LOG" 2>&1
    export PYTHONPATH="$PYTHONPATH:$PWD/$OUT/site"
fi
"$PYTHON" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__,
torch.cuda.is_available())" 2>&1 | tee -a "$LOG"

for family in $FAMILIES; do
    folder="$OUT/standin_$family"
    echo "== $family: build at $(elapsed)s" | tee -a "$LOG"
    "$PYTHON" -c "
import torch
from spot_dlm.standins import build_standin
build_standin('$family', '$folder', dtype=torch.$DTYPE, hidden_size=$HIDDEN, num_layers=$LAYERS, num_heads=$HEADS,
              num_kv_heads=max(1, $HEADS // 4), weight_scale=0.08)
" >>"$LOG" 2>&1 || { echo "== $family: build failed" | tee -a "$LOG"; continue; }
    echo "== $family: check-model at $(elapsed)s" | tee -a "$LOG"
    timeout 240 "$PYTHON" -m spot_dlm check-model "$folder" --trust-remote-code --device "$DEVICE" --dtype "$DTYPE" \
        --n-prompts 3 --gen-length "$GEN" --budget 8 --json "$OUT/check_$family.json" 2>&1 | tee -a "$LOG"
    rm -rf "$folder"  # gigabytes of random weights: not brought back
done
echo "== done at $(elapsed)s" | tee -a "$LOG"
