#!/usr/bin/env bash
# Experiment 1 at the paper's depth, on one GPU (Bamboo Fig. 1 and 2): bamboo-b (48x384, 6 heads) on 32x32
# CIFAR-10 in 4x4 patches, cls from scratch against MAE pre-training (its default 4x192 decoder) then
# fine-tuning, the same initial weights per seed. Every arm trains 100 epochs of a fixed 4,000-image subset
# (1,563 steps of 256) at the default rate (3e-4) and WARMUP steps (480, train.py's default of 10 x depth; the
# earlier runs in results/superseded/e1-gpu-warmup240 used 240, with which seed 2's cls arm diverges); fine-tuning uses the paper's
# layer-wise lr decay of 0.65 (Table 5, Base), or LAYER_DECAY (1 turns it off: 0.65^48 leaves block 1 a billionth
# of the rate, and experiment 4 found the decay holds a deep MAE back; give such a run its own RESULTS folder).
# The seeds given run side by side on the one GPU; each is scored and probed there (results/e1_analyze.py) as
# soon as its runs end, then one summary covers every seed done so far.
#   DATA=DIR bash results/e1_gpu.sh 0 1        DIR holds cifar10-jpeg/; checkpoints go to RUNS (/tmp/e1g)
#   DATA=DIR ALL_SEEDS="0 1 2" bash results/e1_gpu.sh 2     train seed 2, summarise all three (0, 1 read back)
# Outputs: RESULTS (results/e1-gpu-w480/): logs, per-seed JSON, wall times, the GPU. PRESET, SAMPLES, STEPS, WARMUP
# override the scale (a CPU smoke test: PRESET=cifar-tiny SAMPLES=256 STEPS=4 DEVICE=cpu); the earlier runs:
# WARMUP=240 RESULTS=results/superseded/e1-gpu-warmup240.
# Experiment 4 on a GPU takes the same recipe to Bamboo's wide trunk of equal FLOPs per token (12 x 768^2 = 48 x 384^2):
#   PRESET=base-12x768 RUNS=/tmp/e4g RESULTS=results/e4-gpu-base-12x768 DATA=DIR bash results/e1_gpu.sh 0 1 2
set -euo pipefail
cd "$(dirname "$0")/.."
source results/checks.sh
PY=${PYTHON:-python}
DATA=${DATA:-../shared/data}
RUNS=${RUNS:-/tmp/e1g}
PRESET=${PRESET:-bamboo-b} SAMPLES=${SAMPLES:-4000} STEPS=${STEPS:-1563} DEVICE=${DEVICE:-cuda} WARMUP=${WARMUP:-480}
RESULTS=${RESULTS:-results/e1-gpu-w480} LAYER_DECAY=${LAYER_DECAY:-0.65}
layer_decay_in_range
SEEDS="$*" ALL_SEEDS=${ALL_SEEDS:-$*}
seed_list SEEDS
seed_list ALL_SEEDS
mkdir -p "$RESULTS/logs"
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RESULTS/gpu.txt"; fi
COMMON="--preset $PRESET --dataset folder --data_dir $DATA/cifar10-jpeg --train_samples $SAMPLES --batch_size 256
        --max_iters $STEPS --warmup $WARMUP --eval_interval $STEPS --eval_samples 0 --log_interval 50
        --device $DEVICE --overwrite"

arm() {  # arm SEED NAME FLAGS...: one training run, its log and wall time kept
  local seed=$1 name=$2 start=$SECONDS; shift 2
  $PY train.py $COMMON --seed "$seed" --out_dir "$RUNS/s$seed/$name" "$@" > "$RESULTS/logs/s$seed-$name.txt" 2>&1
  cp "$RUNS/s$seed/$name/log.jsonl" "$RESULTS/logs/s$seed-$name.jsonl"
  echo "seed $seed $name $((SECONDS - start)) s" >> "$RESULTS/time.txt"
}

analysis() {  # analysis FLAGS...: results/e1_analyze.py on this experiment's runs (FLAGS name the seeds)
  $PY results/e1_analyze.py "$DATA" --runs "$RUNS" --out "$RESULTS" --image_size 32 --train_samples "$SAMPLES" \
    --device "$DEVICE" "$@" \
    --title "Experiment 1 on a GPU: cls from scratch against MAE, $PRESET, 32x32 CIFAR-10, 100 epochs, warmup $WARMUP, mean ± std"
}

seed_runs() {  # one seed's three arms, then its analysis while the checkpoints are there (a GPU session may end)
  arm "$1" cls --objective cls
  arm "$1" mae --objective mae
  arm "$1" ft --objective cls --init_from "$RUNS/s$1/mae/ckpt.pt" --layer_decay "$LAYER_DECAY"
  local start=$SECONDS
  analysis --seeds "$1" > "$RESULTS/logs/s$1-analyze.txt" 2>&1
  echo "seed $1 analysis $((SECONDS - start)) s" >> "$RESULTS/time.txt"
}

start=$SECONDS
for seed in "$@"; do seed_runs "$seed" & done
failed=""
for seed in "$@"; do wait -n || failed="yes"; done
echo "seeds $* side by side: $((SECONDS - start)) s" >> "$RESULTS/time.txt"
if [ -n "$failed" ]; then echo "a seed failed: see $RESULTS/logs; the summary below leaves it out" >&2; fi
done_seeds=$(for seed in $ALL_SEEDS; do if [ -f "$RESULTS/seed$seed.json" ]; then echo "$seed"; fi; done)
# Each seed was measured above: the summary reads their numbers back instead of measuring them again.
if [ -n "$done_seeds" ]; then analysis --read_back --seeds $done_seeds > "$RESULTS/analyze.txt" 2>&1; fi
[ -z "$failed" ]
