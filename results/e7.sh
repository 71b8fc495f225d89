#!/usr/bin/env bash
# Experiment 7 (NeuTRENO across depth; results/e7/PLAN.md): cls from scratch, softmax against NeuTRENO from
# the same initial weights per seed, on experiment 4's three trunks of equal FLOPs (6x128, 12x92, 24x64) and
# recipe (16x16 CIFAR-10, 5,000-image subset, 1,500 steps of 128, lr 2e-3, warmup 100), lambda 0.6; then
# lambda 0.2, 0.4 and 0.8 at 24x64. 3 seeds, 27 runs.
#   bash results/e7.sh [DATA]     then python results/e7_analyze.py
#   (SEEDS="0" PART=depth|lambda bash results/e7.sh runs a part)
set -euo pipefail
cd "$(dirname "$0")/.."
source results/checks.sh
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
SEEDS=${SEEDS:-0 1 2}
seed_list SEEDS
PART=${PART:-all}
case $PART in all|depth|lambda) ;; *) echo "PART must be all, depth or lambda, got '$PART'" >&2; exit 2 ;; esac
COMMON="--preset cifar-deep --image_size 16 --patch_size 4 --dataset folder --data_dir $DATA/cifar10-jpeg
        --train_samples 5000 --batch_size 128 --eval_interval 500 --eval_samples 0 --log_interval 50 --lr 2e-3
        --objective cls --max_iters 1500 --warmup 100"
heads_of() { case $1 in 6x128|12x92) echo 2 ;; 24x64) echo 1 ;; esac; }
run() {  # run SEED TRUNK LAMBDA: one arm (lambda 0 is softmax), its log and per-image correctness kept
  local seed=$1 trunk=$2 lam=$3 arm=softmax out
  if [ "$3" != 0 ]; then arm=neutreno-$3; fi
  out=out/e7/s$seed/$trunk/$arm
  if [ -f "results/e7/logs/s$seed-$trunk-$arm.npy" ]; then return; fi  # kept already
  $PY train.py $COMMON --depth "${trunk%x*}" --width "${trunk#*x}" --heads "$(heads_of "$trunk")" --seed "$seed" \
    --neutreno "$lam" --out_dir "$out" --overwrite
  cp "$out/log.jsonl" "results/e7/logs/s$seed-$trunk-$arm.jsonl"
  cp "$out/eval_correct.npy" "results/e7/logs/s$seed-$trunk-$arm.npy"
}
mkdir -p results/e7/logs
for seed in $SEEDS; do
  if [ "$PART" != lambda ]; then
    for trunk in 6x128 12x92 24x64; do run "$seed" $trunk 0; run "$seed" $trunk 0.6; done
  fi
  if [ "$PART" != depth ]; then
    for lam in 0.2 0.4 0.8; do run "$seed" 24x64 $lam; done
  fi
done
