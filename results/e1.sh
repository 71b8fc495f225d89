#!/usr/bin/env bash
# Experiment 1 (Bamboo Fig. 1 and 2), sized so over-smoothing has a chance to appear on a 2-core CPU:
# cls from scratch against MAE pre-training then fine-tuning, the same 24x64 trunk and the same initial
# weights per seed, 3 seeds, 16x16 CIFAR-10 images (16 patch tokens) so a step is cheap, and a fixed
# 5,000-image training subset so that 2,000 steps of 128 are 51 epochs (the cls arm reaches its late phase).
#   bash results/e1.sh [DATA]     DATA defaults to ../shared/data; then python results/e1_analyze.py
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
COMMON="--preset cifar-deep --image_size 16 --patch_size 4 --dataset folder --data_dir $DATA/cifar10-jpeg
        --train_samples 5000 --batch_size 128 --eval_interval 500 --eval_samples 0 --log_interval 50"
mkdir -p results/e1/logs
for seed in 0 1 2; do
  out=out/e1/s$seed
  $PY train.py $COMMON --seed $seed --objective cls --max_iters 2000 --warmup 100 --lr 2e-3 --out_dir $out/cls --overwrite
  $PY train.py $COMMON --seed $seed --objective mae --max_iters 2000 --warmup 100 --lr 2e-3 --out_dir $out/mae --overwrite
  $PY train.py $COMMON --seed $seed --objective cls --init_from $out/mae/ckpt.pt --max_iters 1000 --warmup 50 \
    --lr 2e-3 --layer_decay 0.75 --out_dir $out/ft --overwrite
  for arm in cls mae ft; do cp $out/$arm/log.jsonl results/e1/logs/s$seed-$arm.jsonl; done
done
