#!/usr/bin/env bash
# Experiment 6 (results/e6/PLAN.md): does depth pay under MAE at equal FLOPs? One depth's arms for every
# seed on one GPU: per seed cls (from scratch), mae (pre-training), ft (fine-tuning the mae, layer decay
# 0.65) and ft-dm (the depth-matched decay 0.65^(12/depth), secondary). Every command of it stops inside
# BUDGET seconds with checkpoints (--time_limit) and the next one continues them (--resume), so a machine
# that allows 10-minute commands loses no work: run it again until it says that every arm is done.
#   DATA=DIR bash results/e6.sh bamboo-b        DIR holds cifar10-jpeg/; runs go to RUNS (/tmp/e6)
#   DATA=DIR bash results/e6.sh base-12x768
#   DEVICE=cpu SAMPLES=32 BATCH=16 ... bash results/e6.sh cifar-tiny    a dry run at tiny scale (the suite's)
# RESULTS (results/e6) takes the outputs elsewhere; ARM_TIME_LIMIT caps each command's --time_limit (tests).
# Settings (PLAN.md): SEEDS ("0 1 2 3"), CLS_EPOCHS (15), MAE_EPOCHS (20), FT_EPOCHS (8), SAMPLES (50000
# training images), BATCH (256), BUDGET (540 s a command), DEVICE (cuda), PROBE_SAMPLES (256).
# Outputs, small enough to come back from a GPU machine: results/e6/PRESET/ with each arm's log.jsonl, its
# printed output, eval_correct.npy (per test image), the probe JSON of each finished model, planned.json
# (each arm's planned steps), status.txt and gpu.txt; ARCHIVE=FILE packs that folder.
set -euo pipefail
cd "$(dirname "$0")/.."
source results/checks.sh
PY=${PYTHON:-python}
PRESET=${1:-}
if [ -z "$PRESET" ]; then echo "usage: bash results/e6.sh PRESET (bamboo-b or base-12x768)" >&2; exit 2; fi
DATA=${DATA:-../shared/data} RUNS=${RUNS:-/tmp/e6} DEVICE=${DEVICE:-cuda} SEEDS=${SEEDS:-0 1 2 3}
CLS_EPOCHS=${CLS_EPOCHS:-15} MAE_EPOCHS=${MAE_EPOCHS:-20} FT_EPOCHS=${FT_EPOCHS:-8}
SAMPLES=${SAMPLES:-50000} BATCH=${BATCH:-256} BUDGET=${BUDGET:-540} PROBE_SAMPLES=${PROBE_SAMPLES:-256}
seed_list SEEDS
for v in CLS_EPOCHS MAE_EPOCHS FT_EPOCHS SAMPLES BATCH BUDGET PROBE_SAMPLES; do positive_whole $v ""; done
if [ "$DEVICE" = cuda ] && ! $PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "no CUDA device here: experiment 6 runs on a GPU (DEVICE=cpu runs it at tiny scale)"; exit 1
fi
OUT=${RESULTS:-results/e6}/$PRESET
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ]; then
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/gpu.txt"
fi
steps() { echo $(( ($1 * SAMPLES + BATCH - 1) / BATCH )); }  # epochs -> optimizer steps
DEPTH=$($PY -c "import sys; from bamboo import PRESETS; print(PRESETS[sys.argv[1]]['depth'])" "$PRESET")
MATCHED=$($PY -c "import sys; print(round(0.65 ** (12 / int(sys.argv[1])), 4))" "$DEPTH")
echo "{\"cls\": $(steps "$CLS_EPOCHS"), \"mae\": $(steps "$MAE_EPOCHS"), \"ft\": $(steps "$FT_EPOCHS")," \
  "\"ft-dm\": $(steps "$FT_EPOCHS"), \"depth_matched_decay\": $MATCHED}" > "$OUT/planned.json"
# The paper's fine-tuning recipe (Table 5, Base) where it applies, for cls and ft alike; MAE's pre-training
# rate and normalised pixels. AdamW (0.9, 0.95), weight decay 0.05, warmup then cosine: train.py's defaults.
COMMON="--preset $PRESET --dataset folder --data_dir $DATA/cifar10-jpeg --train_samples 0 --eval_samples 0
        --batch_size $BATCH --device $DEVICE --log_interval 50"
SUPERVISED="--objective cls --base_lr 5e-4 --drop_path 0.1 --label_smoothing 0.1"
start=$SECONDS

finished() {  # finished RUN PLANNED: the run's log holds an evaluation at its planned step
  [ -f "$1/log.jsonl" ] && grep -q "\"eval\": true, \"step\": $2," "$1/log.jsonl"
}

arm() {  # arm SEED NAME PLANNED FLAGS...: train or continue one arm inside what is left of BUDGET
  local seed=$1 name=$2 planned=$3 run=$RUNS/$PRESET/s$1/$2; shift 3
  local left=$((BUDGET - (SECONDS - start) - 60))  # a minute for start-up, the last evaluation and saving
  if finished "$run" "$planned" || [ "$left" -lt 30 ]; then return 0; fi
  local limit=${ARM_TIME_LIMIT:-$left}
  if [ -f "$run/ckpt.pt" ]; then
    $PY train.py --resume --out_dir "$run" --time_limit "$limit" --device "$DEVICE"
  else
    $PY train.py $COMMON --seed "$seed" --max_iters "$planned" --eval_interval "$planned" --overwrite \
      --out_dir "$run" --time_limit "$limit" "$@"
  fi >> "$OUT/s$seed-$name.txt" 2>&1 || echo "seed $seed $name failed: see $OUT/s$seed-$name.txt" >&2
  for file in log.jsonl eval_correct.npy; do
    if [ -f "$run/$file" ]; then cp "$run/$file" "$OUT/s$seed-$name.${file#*.}"; fi
  done
  if finished "$run" "$planned" && [ ! -f "$OUT/s$seed-$name.probe.json" ]; then
    $PY probe.py "$run/ckpt.pt" --dataset folder --data_dir "$DATA/cifar10-jpeg" --device "$DEVICE" \
      --samples "$PROBE_SAMPLES" --json "$OUT/s$seed-$name.probe.json" > /dev/null
  fi
}

for seed in $SEEDS; do
  arm "$seed" cls "$(steps "$CLS_EPOCHS")" $SUPERVISED
  arm "$seed" mae "$(steps "$MAE_EPOCHS")" --objective mae --base_lr 1.5e-4 --norm_pix_loss
  if finished "$RUNS/$PRESET/s$seed/mae" "$(steps "$MAE_EPOCHS")"; then
    arm "$seed" ft "$(steps "$FT_EPOCHS")" $SUPERVISED --layer_decay 0.65 \
      --init_from "$RUNS/$PRESET/s$seed/mae/ckpt.pt"
    arm "$seed" ft-dm "$(steps "$FT_EPOCHS")" $SUPERVISED --layer_decay "$MATCHED" \
      --init_from "$RUNS/$PRESET/s$seed/mae/ckpt.pt"
  fi
done

left=0
: > "$OUT/status.txt"
for seed in $SEEDS; do
  for name in cls mae ft ft-dm; do
    case $name in cls) planned=$(steps "$CLS_EPOCHS") ;; mae) planned=$(steps "$MAE_EPOCHS") ;;
                  *) planned=$(steps "$FT_EPOCHS") ;; esac
    if finished "$RUNS/$PRESET/s$seed/$name" "$planned"; then state="done"; else state="not done"; left=1; fi
    echo "seed $seed $name: $state (planned $planned steps)" >> "$OUT/status.txt"
  done
done
cat "$OUT/status.txt"
if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE" "$OUT"; fi
if [ "$left" = 1 ]; then echo "run bash results/e6.sh $PRESET again to continue ($((SECONDS - start)) s used)"; else
  echo "every arm of $PRESET is done; then: python results/e6_analyze.py"; fi
