#!/usr/bin/env bash
# Prepared for a session lent a GPU: train a larger block-diffusion target on the built-in recipe (autoregressive
# pretraining, then block-diffusion fine-tune with block lengths 4/8/16/32), bf16 autocast, and bring its
# checkpoint back in pieces small enough for the device tool (16 MiB per file, 8 files).
#
# Here, once (the device machine has no reasoning-gym and no network; the corpus travels gzipped, about 12 MB):
#   spot-dlm prepare-data --out data_cache/corpus
#   echo /.gpu_data/ >> .git/info/exclude && mkdir -p .gpu_data
#   gzip -c data_cache/corpus/train_tokens.npy > .gpu_data/train_tokens.npy.gz
#   cp data_cache/corpus/{heldout_tokens.npy,tokenizer.json,corpus.json} .gpu_data/
# On the device (carry .gpu_data):
#   OUT=$OUT AR_MINUTES=2 BD_MINUTES=4 bash scripts/gpu_train_target.sh
# Back here: cat <files_at>/model.part.* > runs/gpu_target/model.safetensors; copy config.json, tokenizer.json,
# training_state.json and train_log.jsonl beside it; then here `spot-dlm evaluate-target --model runs/gpu_target`
# (it needs reasoning-gym, which the device machine lacks).
set -u
OUT=${OUT:-gpu_out}
DEVICE=${DEVICE:-cuda}
AR_MINUTES=${AR_MINUTES:-2}
BD_MINUTES=${BD_MINUTES:-4}
D_MODEL=${D_MODEL:-384}
N_LAYERS=${N_LAYERS:-8}
N_HEADS=${N_HEADS:-6}
BATCH=${BATCH:-64}
BF16=${BF16:---bf16}
DATA=${DATA:-.gpu_data}
RUN=${RUN:-runs/gpu_target}
mkdir -p "$OUT" data_cache/corpus "$RUN"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
LOG="$OUT/train_log.txt"
gunzip -c "$DATA/train_tokens.npy.gz" >data_cache/corpus/train_tokens.npy || exit 1
cp "$DATA/heldout_tokens.npy" "$DATA/tokenizer.json" "$DATA/corpus.json" data_cache/corpus/ || exit 1
{ date; nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; } >>"$LOG"
TRAIN=(python3 -m spot_dlm train-target --out "$RUN" --corpus data_cache/corpus --device "$DEVICE" $BF16
       --batch-size "$BATCH" --d-model "$D_MODEL" --n-layers "$N_LAYERS" --n-heads "$N_HEADS" --snapshot-minutes 1)
"${TRAIN[@]}" --phase ar --minutes "$AR_MINUTES" --lr 2e-3 >>"$LOG" 2>&1
echo "ar rc=$?" | tee -a "$LOG"
"${TRAIN[@]}" --phase bd --minutes "$BD_MINUTES" --lr 1e-3 >>"$LOG" 2>&1
echo "bd rc=$?" | tee -a "$LOG"
split -b 15m "$RUN/model.safetensors" "$OUT/model.part."
cp "$RUN/config.json" "$RUN/training_state.json" "$OUT/"
tail -n 5 "$RUN/train_log.jsonl" >"$OUT/train_log.jsonl"
ls -la "$OUT"
