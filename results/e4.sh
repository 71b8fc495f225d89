#!/usr/bin/env bash
# Experiment 4 (Bamboo Table 1 / Fig. 3 at CPU scale): depth against width at (about) constant compute,
# cls from scratch against MAE pre-training then fine-tuning, at equal total steps (cls 1500; MAE 1000
# then fine-tuning 500), 3 seeds, the same initial weights for both arms of a seed. Three trunks of about
# equal FLOPs per token (depth x width^2 = 98k, 102k, 98k): 6x128, 12x92 and 24x64, on the setting of
# experiment 1 (16x16 CIFAR-10 images, 16 patch tokens, a fixed 5,000-image training subset).
# BUDGET=3 runs every arm for 3x the steps (cls 4500; MAE 3000 then 1500), warmups unchanged, into out/e4-x3 and
# results/e4-x3: does MAE's deficit, or the loss with depth, come from the short budget? SAMPLES=20000 trains on a
# fixed subset of 20,000 images instead of 5,000, into out/e4-n20000 (with BUDGET=3: e4-x3-n20000): from the data?
# IMAGE_SIZE=32 trains on 32x32 images (64 patch tokens, 16 visible to MAE's encoder, instead of 16 and 4), into
# out/e4-i32: from the token count? WIDEN=2 doubles every trunk's width and heads (head dims unchanged, 4x the FLOPs;
# 24x64 becomes 24x128, in folders named by the widened trunk) into out/e4-w2: from the width? FT_STEPS=1500 fine-tunes
# for as many steps as cls trains (into out/e4-ft1500): is MAE's encoder a better start than random weights at equal
# supervised steps? LAYER_DECAY=1 fine-tunes without layer decay (into ...-ld1; 0.75^24 leaves block 1 of 24x64 a
# thousandth of the rate): does the decay hold the deep trunks back? REUSE=out/e4-ft1500 takes the cls and mae arms
# of that earlier run (same seeds and trunks) instead of training them again, so fine-tuning variants share them.
# CLS_STEPS=N trains cls for N steps instead of 1500 x BUDGET (into ...-clsN), for a cls arm of the MAE arm's compute
# (the paper's recipe: MAE 1,000 + fine-tuning 500 cost what 1,080 cls steps cost); with REUSE only MAE is taken,
# and with REUSE_FT=1 its fine-tuning too (made with this FT_STEPS and LAYER_DECAY), so that only cls trains.
#   bash results/e4.sh [DATA]     DATA defaults to ../shared/data; then python results/e4_analyze.py
#   (SEEDS="0 1" TRUNKS="24x64" BUDGET=3 bash results/e4.sh runs a part, to share the runs among cores; then
#   python results/e4_analyze.py --runs out/e4-x3 --out results/e4-x3 --trunks 24x64, plus --train_samples N
#   after SAMPLES=N, so that evaluation normalises with the training subset's statistics, and the widened trunks
#   after WIDEN)
set -euo pipefail
cd "$(dirname "$0")/.."
source results/checks.sh
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
BUDGET=${BUDGET:-1}
SAMPLES=${SAMPLES:-5000}
IMAGE_SIZE=${IMAGE_SIZE:-16}
WIDEN=${WIDEN:-1}
LAYER_DECAY=${LAYER_DECAY:-0.75}
PATCH=4
positive_whole BUDGET "(the steps' multiplier)"
positive_whole SAMPLES "of training images"
positive_whole IMAGE_SIZE "of pixels"
positive_whole WIDEN "(the widths' multiplier)"
FT_STEPS=${FT_STEPS:-$((500 * BUDGET))}
positive_whole FT_STEPS "of fine-tuning steps"
CLS_STEPS=${CLS_STEPS:-$((1500 * BUDGET))}
positive_whole CLS_STEPS "of cls steps"
layer_decay_in_range
if [ $((IMAGE_SIZE % PATCH)) != 0 ]; then
  echo "IMAGE_SIZE must be a multiple of the patch size $PATCH, got $IMAGE_SIZE" >&2; exit 2
fi
NAME=e4; if [ "$BUDGET" != 1 ]; then NAME=$NAME-x$BUDGET; fi; if [ "$SAMPLES" != 5000 ]; then NAME=$NAME-n$SAMPLES; fi
if [ "$IMAGE_SIZE" != 16 ]; then NAME=$NAME-i$IMAGE_SIZE; fi; if [ "$WIDEN" != 1 ]; then NAME=$NAME-w$WIDEN; fi
if [ "$FT_STEPS" != $((500 * BUDGET)) ]; then NAME=$NAME-ft$FT_STEPS; fi
if [ "$LAYER_DECAY" != 0.75 ]; then NAME=$NAME-ld$LAYER_DECAY; fi
REUSED="cls mae"; if [ "$CLS_STEPS" != $((1500 * BUDGET)) ]; then NAME=$NAME-cls$CLS_STEPS; REUSED=mae; fi
if [ -n "${REUSE_FT:-}" ]; then
  if [ "$REUSE_FT" != 1 ] || [ "$REUSED" != mae ] || [ -z "${REUSE:-}" ]; then
    echo "REUSE_FT=1 takes the fine-tuning of REUSE beside a cls arm of its own: set REUSE and CLS_STEPS" >&2; exit 2
  fi
  REUSED="mae ft"
fi
reused() {  # reused ARM: whether ARM is taken from REUSE rather than trained here
  [ -n "${REUSE:-}" ] && case " $REUSED " in *" $1 "*) true ;; *) false ;; esac
}
COMMON="--preset cifar-deep --image_size $IMAGE_SIZE --patch_size $PATCH --dataset folder --data_dir $DATA/cifar10-jpeg
        --train_samples $SAMPLES --batch_size 128 --eval_interval 500 --eval_samples 0 --log_interval 50 --lr 2e-3"
TRUNKS=${TRUNKS:-6x128 12x92 24x64}
heads_of() {  # the sweep's trunks and their heads (head dims 64, 46 and 64)
  case $1 in 6x128|12x92) echo 2 ;; 24x64) echo 1 ;; *) return 1 ;; esac
}
for trunk in $TRUNKS; do
  heads_of "$trunk" > /dev/null || { echo "unknown trunk $trunk: choose among 6x128 12x92 24x64" >&2; exit 2; }
done
shape_of() { echo "${1%x*}x$((${1#*x} * WIDEN))"; }  # the trunk as run: depth x widened width
SEEDS=${SEEDS:-0 1 2}
seed_list SEEDS
for seed in $SEEDS; do  # a reused arm must be there, and must not replace a run, before anything is written
  for trunk in ${REUSE:+$TRUNKS}; do
    for arm in $REUSED; do
      reusable "$REUSE/s$seed/$(shape_of "$trunk")/$arm" "out/$NAME/s$seed/$(shape_of "$trunk")/$arm"
    done
  done
done
mkdir -p results/$NAME/logs
for seed in $SEEDS; do
  for trunk in $TRUNKS; do
    depth=${trunk%x*} width=$((${trunk#*x} * WIDEN))
    shape=$(shape_of "$trunk"); out=out/$NAME/s$seed/$shape
    flags="--depth $depth --width $width --heads $(($(heads_of "$trunk") * WIDEN)) --seed $seed"
    for arm in cls mae ft; do if reused $arm; then reuse_arm "$REUSE/s$seed/$shape/$arm" $out/$arm; fi; done
    reused cls || $PY train.py $COMMON $flags --objective cls --max_iters $CLS_STEPS --warmup 100 --out_dir $out/cls \
      --overwrite
    reused mae || $PY train.py $COMMON $flags --objective mae --max_iters $((1000 * BUDGET)) --warmup 100 \
      --out_dir $out/mae --overwrite
    reused ft || $PY train.py $COMMON $flags --objective cls --init_from $out/mae/ckpt.pt --max_iters $FT_STEPS \
      --warmup 50 --layer_decay $LAYER_DECAY --out_dir $out/ft --overwrite
    for arm in cls mae ft; do  # the log, and a classifier's per-image correctness for paired tests
      cp $out/$arm/log.jsonl results/$NAME/logs/s$seed-$shape-$arm.jsonl
      if [ -f $out/$arm/eval_correct.npy ]; then cp $out/$arm/eval_correct.npy results/$NAME/logs/s$seed-$shape-$arm.npy; fi
    done
  done
done
