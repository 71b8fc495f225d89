#!/usr/bin/env bash
# Experiment 1 (Bamboo Fig. 1 and 2), sized so over-smoothing has a chance to appear on a 2-core CPU:
# cls from scratch against MAE pre-training then fine-tuning, the same 24x64 trunk and the same initial
# weights per seed, 3 seeds, 16x16 CIFAR-10 images (16 patch tokens) so a step is cheap, and a fixed
# 5,000-image training subset so that 2,000 steps of 128 are 51 epochs (the cls arm reaches its late phase).
# The fine-tuning runs 1,000 steps with layer decay 0.75; FT_STEPS and LAYER_DECAY (1 turns it off) change it,
# into out/e1-ft<N>-ld<X> and results/e1-ft<N>-ld<X> (experiment 4 found the decay holds a deep MAE back).
#   bash results/e1.sh [DATA]     DATA defaults to ../shared/data; then python results/e1_analyze.py
#   (FT_STEPS=2000 LAYER_DECAY=1 SEEDS=0 bash results/e1.sh runs a part, to share the seeds among cores; then
#   python results/e1_analyze.py --runs out/e1-ft2000-ld1 --out results/e1-ft2000-ld1 --title "...")
set -euo pipefail
cd "$(dirname "$0")/.."
source results/checks.sh
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
FT_STEPS=${FT_STEPS:-1000}
LAYER_DECAY=${LAYER_DECAY:-0.75}
positive_whole FT_STEPS "of fine-tuning steps"
layer_decay_in_range
NAME=e1; if [ "$FT_STEPS" != 1000 ]; then NAME=$NAME-ft$FT_STEPS; fi
if [ "$LAYER_DECAY" != 0.75 ]; then NAME=$NAME-ld$LAYER_DECAY; fi
COMMON="--preset cifar-deep --image_size 16 --patch_size 4 --dataset folder --data_dir $DATA/cifar10-jpeg
        --train_samples 5000 --batch_size 128 --eval_interval 500 --eval_samples 0 --log_interval 50"
mkdir -p results/$NAME/logs
for seed in ${SEEDS:-0 1 2}; do
  out=out/$NAME/s$seed
  $PY train.py $COMMON --seed $seed --objective cls --max_iters 2000 --warmup 100 --lr 2e-3 --out_dir $out/cls --overwrite
  $PY train.py $COMMON --seed $seed --objective mae --max_iters 2000 --warmup 100 --lr 2e-3 --out_dir $out/mae --overwrite
  $PY train.py $COMMON --seed $seed --objective cls --init_from $out/mae/ckpt.pt --max_iters $FT_STEPS --warmup 50 \
    --lr 2e-3 --layer_decay $LAYER_DECAY --out_dir $out/ft --overwrite
  for arm in cls mae ft; do cp $out/$arm/log.jsonl results/$NAME/logs/s$seed-$arm.jsonl; done
done
