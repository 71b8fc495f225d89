#!/usr/bin/env bash
# Experiment 4 (Bamboo Table 1 / Fig. 3 at CPU scale): depth against width at (about) constant compute,
# cls from scratch against MAE pre-training then fine-tuning, at equal total steps (cls 1500; MAE 1000
# then fine-tuning 500), 3 seeds, the same initial weights for both arms of a seed. Three trunks of about
# equal FLOPs per token (depth x width^2 = 98k, 102k, 98k): 6x128, 12x92 and 24x64, on the setting of
# experiment 1 (16x16 CIFAR-10 images, 16 patch tokens, a fixed 5,000-image training subset).
#   bash results/e4.sh [DATA]     DATA defaults to ../shared/data; then python results/e4_analyze.py
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
COMMON="--preset cifar-deep --image_size 16 --patch_size 4 --dataset folder --data_dir $DATA/cifar10-jpeg
        --train_samples 5000 --batch_size 128 --eval_interval 500 --eval_samples 0 --log_interval 50 --lr 2e-3"
mkdir -p results/e4/logs
for seed in 0 1 2; do
  for shape in 6x128x2 12x92x2 24x64x1; do
    IFS=x read -r depth width heads <<< "$shape"
    out=out/e4/s$seed/${depth}x$width
    trunk="--depth $depth --width $width --heads $heads --seed $seed"
    $PY train.py $COMMON $trunk --objective cls --max_iters 1500 --warmup 100 --out_dir $out/cls --overwrite
    $PY train.py $COMMON $trunk --objective mae --max_iters 1000 --warmup 100 --out_dir $out/mae --overwrite
    $PY train.py $COMMON $trunk --objective cls --init_from $out/mae/ckpt.pt --max_iters 500 --warmup 50 \
      --layer_decay 0.75 --out_dir $out/ft --overwrite
    for arm in cls mae ft; do cp $out/$arm/log.jsonl results/e4/logs/s$seed-${depth}x$width-$arm.jsonl; done
  done
done
