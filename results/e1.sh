#!/usr/bin/env bash
# Experiment 1 (Bamboo Fig. 1 and 2), sized so over-smoothing has a chance to appear on a 2-core CPU:
# cls from scratch against MAE pre-training then fine-tuning, the same 24x64 trunk and the same initial
# weights per seed, 3 seeds, 16x16 CIFAR-10 images (16 patch tokens) so a step is cheap, and a fixed
# 5,000-image training subset so that 2,000 steps of 128 are 51 epochs (the cls arm reaches its late phase).
# The fine-tuning runs 1,000 steps with layer decay 0.75; FT_STEPS and LAYER_DECAY (1 turns it off) change it,
# into out/e1-ft<N>-ld<X> and results/e1-ft<N>-ld<X> (experiment 4 found the decay holds a deep MAE back).
# CLS_STEPS trains cls for that many steps instead of 2,000 (into e1-cls<N>...): with REUSE=1 it takes the mae
# and ft arms of the run with the same fine-tuning instead of training them again, so that cls can be set
# against MAE at equal total steps (CLS_STEPS=4000 FT_STEPS=2000 LAYER_DECAY=1 REUSE=1, after that run).
#   bash results/e1.sh [DATA]     DATA defaults to ../shared/data; then python results/e1_analyze.py
#   (FT_STEPS=2000 LAYER_DECAY=1 SEEDS=0 bash results/e1.sh runs a part, to share the seeds among cores; then
#   python results/e1_analyze.py --runs out/e1-ft2000-ld1 --out results/e1-ft2000-ld1 --title "...")
set -euo pipefail
cd "$(dirname "$0")/.."
source results/checks.sh
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
CLS_STEPS=${CLS_STEPS:-2000}
FT_STEPS=${FT_STEPS:-1000}
LAYER_DECAY=${LAYER_DECAY:-0.75}
positive_whole CLS_STEPS "of cls steps"
positive_whole FT_STEPS "of fine-tuning steps"
layer_decay_in_range
FINE_TUNING=; if [ "$FT_STEPS" != 1000 ]; then FINE_TUNING=-ft$FT_STEPS; fi
if [ "$LAYER_DECAY" != 0.75 ]; then FINE_TUNING=$FINE_TUNING-ld$LAYER_DECAY; fi
NAME=e1$FINE_TUNING; if [ "$CLS_STEPS" != 2000 ]; then NAME=e1-cls$CLS_STEPS$FINE_TUNING; fi
REUSE=${REUSE:-}
case $REUSE in
  '') ;;
  1) if [ "$NAME" = "e1$FINE_TUNING" ]; then
       echo "REUSE=1 takes the mae and ft arms of out/e1$FINE_TUNING for a cls arm of other length; set CLS_STEPS" >&2
       exit 2
     fi ;;
  *) echo "REUSE must be 1 (take the mae and ft arms of out/e1$FINE_TUNING) or unset, got '$REUSE'" >&2; exit 2 ;;
esac
SEEDS=${SEEDS:-0 1 2}
seed_list SEEDS
for seed in $SEEDS; do  # a reused arm must be there, and must not replace a run, before anything is written
  for arm in ${REUSE:+mae ft}; do reusable "out/e1$FINE_TUNING/s$seed/$arm" "out/$NAME/s$seed/$arm"; done
done
COMMON="--preset cifar-deep --image_size 16 --patch_size 4 --dataset folder --data_dir $DATA/cifar10-jpeg
        --train_samples 5000 --batch_size 128 --eval_interval 500 --eval_samples 0 --log_interval 50"
mkdir -p results/$NAME/logs
for seed in $SEEDS; do
  out=out/$NAME/s$seed
  $PY train.py $COMMON --seed $seed --objective cls --max_iters $CLS_STEPS --warmup 100 --lr 2e-3 --out_dir $out/cls \
    --overwrite
  if [ -n "$REUSE" ]; then
    for arm in mae ft; do reuse_arm "out/e1$FINE_TUNING/s$seed/$arm" $out/$arm; done
  else
    $PY train.py $COMMON --seed $seed --objective mae --max_iters 2000 --warmup 100 --lr 2e-3 --out_dir $out/mae \
      --overwrite
    $PY train.py $COMMON --seed $seed --objective cls --init_from $out/mae/ckpt.pt --max_iters $FT_STEPS --warmup 50 \
      --lr 2e-3 --layer_decay $LAYER_DECAY --out_dir $out/ft --overwrite
  fi
  for arm in cls mae ft; do cp $out/$arm/log.jsonl results/$NAME/logs/s$seed-$arm.jsonl; done
done
