#!/usr/bin/env bash
# Experiment 10 (does a classifier's over-smoothing pass with training?; results/e10/PLAN.md): experiment 7's
# 24x64 classifier and recipe for 4,000 steps, an evaluation with the per-layer probe every 250, softmax
# against NeuTRENO 0.6 from the same initial weights per seed. Two runs at a time, one thread each; a run whose
# log is kept in results/e10/logs is skipped.
#   bash results/e10.sh [DATA]     then python results/e10_analyze.py
#   SEEDS ("0 1 2"), JOBS (2)
set -euo pipefail
cd "$(dirname "$0")/.."
source results/checks.sh
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
SEEDS=${SEEDS:-0 1 2}
seed_list SEEDS
JOBS=${JOBS:-2}
positive_whole JOBS "of runs at a time"
cifar_folder "$DATA"
COMMON="--preset cifar-deep --image_size 16 --patch_size 4 --dataset folder --data_dir $DATA/cifar10-jpeg
        --train_samples 5000 --batch_size 128 --eval_interval 250 --eval_samples 0 --log_interval 50
        --probe_samples 64 --objective cls --max_iters 4000 --lr 2e-3 --warmup 100 --depth 24 --width 64
        --heads 1"
run() {  # run SEED ARM: one arm, its log and per-image correctness kept
  local seed=$1 arm=$2 out=out/e10/s$1/$2 kept=results/e10/logs/s$1-$2 lam=0
  if [ -f "$kept.npy" ]; then return; fi
  if [ "$arm" = neutreno-0.6 ]; then lam=0.6; fi
  mkdir -p "out/e10/s$seed"
  OMP_NUM_THREADS=1 $PY train.py $COMMON --neutreno "$lam" --seed "$seed" --out_dir "$out" --overwrite \
    > "$out.txt" 2>&1 || { echo "$out failed: see $out.txt" >&2; return 1; }
  cp "$out/log.jsonl" "$kept.jsonl"
  cp "$out/eval_correct.npy" "$kept.npy"
}
mkdir -p results/e10/logs
export -f run
export PY COMMON
for seed in $SEEDS; do printf '%s softmax\n%s neutreno-0.6\n' "$seed" "$seed"; done \
  | xargs -P "$JOBS" -L 1 bash -c 'run "$0" "$1"'
echo "every run kept in results/e10/logs; then: python results/e10_analyze.py"
