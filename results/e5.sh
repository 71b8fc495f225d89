#!/usr/bin/env bash
# Experiment 5 (Dovonon et al.): the same cls run with W_V W_O free, built to smooth, or built to sharpen,
# 3 seeds each, at experiment 1's scale (24x64, 16x16 CIFAR-10, the fixed 5,000-image subset), 1,000 steps.
#   bash results/e5.sh [DATA]     DATA defaults to ../shared/data; then python results/e5_analyze.py
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
COMMON="--preset cifar-deep --image_size 16 --patch_size 4 --dataset folder --data_dir $DATA/cifar10-jpeg
        --train_samples 5000 --batch_size 128 --eval_interval 500 --eval_samples 0 --log_interval 50
        --objective cls --max_iters 1000 --warmup 100 --lr 2e-3"
mkdir -p results/e5/logs
for seed in 0 1 2; do
  for mode in free smooth sharpen; do
    $PY train.py $COMMON --seed $seed --vo_param $mode --out_dir out/e5/s$seed/$mode --overwrite
    cp out/e5/s$seed/$mode/log.jsonl results/e5/logs/s$seed-$mode.jsonl
  done
done
