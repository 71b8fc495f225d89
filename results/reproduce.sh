#!/usr/bin/env bash
# Re-create every CPU experiment of results/README.md from scratch: the training runs of experiments 1 to 5, 7 to 10
# (3 seeds per arm, the same initial weights for the arms of a seed), their analyses (numbers, JSON, figures),
# and the probes of fresh models. Run time on the 2-core development CPU: see "One command" in results/README.md.
#   bash results/reproduce.sh [DATA]    DATA defaults to ../shared/data (CIFAR-10 JPEGs, WikiText-2, GPT-2 BPE)
# The order matters: experiment 2's vision arm reuses experiment 1's cls runs, experiment 3 reuses experiment 2's
# next-token runs. Each experiment's own script says what it runs; its analysis prints what results/README.md cites.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
five_seeds() {  # five_seeds EXPERIMENT NAME TITLE: EXPERIMENT's analysis of out/NAME, seeds 0 to 4, into five-seeds/
  mkdir -p "results/$2/five-seeds"
  $PY "results/${1}_analyze.py" "$DATA" --runs "out/$2" --out "results/$2/five-seeds" --seeds 0 1 2 3 4 --title "$3" \
    | tee "results/$2/five-seeds/five-seeds.txt"
}
for experiment in e1 e2 e3 e4 e5; do
  bash "results/$experiment.sh" "$DATA"
  $PY "results/${experiment}_analyze.py" "$DATA" | tee "results/$experiment/$experiment.txt"
done
for experiment in e7 e8 e9 e10; do  # from their logs; each writes its own eN.txt
  bash "results/$experiment.sh" "$DATA"
  $PY "results/${experiment}_analyze.py"
done
# Experiment 1 again with the fine-tuning that experiment 4 found better: as many steps as cls trains, no layer decay.
FT_STEPS=2000 LAYER_DECAY=1 bash results/e1.sh "$DATA"
$PY results/e1_analyze.py "$DATA" --runs out/e1-ft2000-ld1 --out results/e1-ft2000-ld1 --title "Experiment 1, MAE \
fine-tuned for 2,000 steps without layer decay: cls from scratch against MAE, 24x64, 16x16 CIFAR-10, mean ± std" \
  | tee results/e1-ft2000-ld1/e1-ft2000-ld1.txt
# and cls trained 4,000 steps against that run's MAE and fine-tuning (2,000 + 2,000 steps): equal total steps.
CLS_STEPS=4000 FT_STEPS=2000 LAYER_DECAY=1 REUSE=1 bash results/e1.sh "$DATA"
$PY results/e1_analyze.py "$DATA" --runs out/e1-cls4000-ft2000-ld1 --out results/e1-cls4000-ft2000-ld1 --title \
"Experiment 1 at equal total steps: cls from scratch 4,000 steps against MAE 2,000 + fine-tuning 2,000 without layer \
decay, 24x64, 16x16 CIFAR-10, mean ± std" | tee results/e1-cls4000-ft2000-ld1/e1-cls4000-ft2000-ld1.txt
# Both designs with two more seeds (every arm trained), analysed over five.
FT_STEPS=2000 LAYER_DECAY=1 SEEDS="3 4" bash results/e1.sh "$DATA"
CLS_STEPS=4000 FT_STEPS=2000 LAYER_DECAY=1 REUSE=1 SEEDS="3 4" bash results/e1.sh "$DATA"
for name in e1-ft2000-ld1 e1-cls4000-ft2000-ld1; do
  five_seeds e1 $name "Experiment 1 ($name): cls from scratch against MAE, 24x64, 16x16 CIFAR-10, mean ± std over \
5 seeds"
done
# Experiment 4 again, one suspect at a time for MAE's deficit: 3x the steps of every arm on all three trunks (the
# budget), the deepest trunk on 20,000 training images (the data), both at once, on 32x32 images (the tokens) and at
# twice the width (the model's size); then the fine-tuning on 24x64 (as many steps as cls trains, without layer
# decay, both), and the recipe without decay on all three trunks, at equal supervised and at equal total steps.
e4_variant() {  # e4_variant NAME TITLE [TRUNKS]: e4.sh with the caller's BUDGET, SAMPLES, IMAGE_SIZE, WIDEN, FT_STEPS,
  # LAYER_DECAY, REUSE and TRUNKS
  # (it names its folders NAME), then its analysis given the same subset, image size and trunks (the third argument
  # names the trunks as run, when WIDEN changed them)
  bash results/e4.sh "$DATA"
  local trunks=${3:-${TRUNKS:-}}
  # shellcheck disable=SC2086  # trunks is a list of words
  $PY results/e4_analyze.py "$DATA" --runs "out/$1" --out "results/$1" ${trunks:+--trunks $trunks} \
    ${SAMPLES:+--train_samples "$SAMPLES"} ${IMAGE_SIZE:+--image_size "$IMAGE_SIZE"} --title "$2" \
    | tee "results/$1/$1.txt"
}
BUDGET=3 e4_variant e4-x3 "Experiment 4 at 3x the steps: cls from scratch against MAE + fine-tuning, mean ± std over \
3 seeds"
SAMPLES=20000 TRUNKS=24x64 e4_variant e4-n20000 "Experiment 4 on 20,000 training images, 24x64: cls from scratch \
against MAE + fine-tuning, mean ± std over 3 seeds"
BUDGET=3 SAMPLES=20000 TRUNKS=24x64 e4_variant e4-x3-n20000 "Experiment 4 at 3x the steps on 20,000 images: 24x64, \
cls from scratch against MAE + fine-tuning, mean ± std over 3 seeds"
IMAGE_SIZE=32 TRUNKS=24x64 e4_variant e4-i32 "Experiment 4 on 32x32 images (64 tokens): 24x64, cls from scratch \
against MAE + fine-tuning, mean ± std over 3 seeds"
WIDEN=2 TRUNKS=24x64 e4_variant e4-w2 "Experiment 4 at twice the width, 24x128: cls from scratch against MAE + \
fine-tuning, mean ± std over 3 seeds" 24x128
FT_STEPS=1500 TRUNKS=24x64 e4_variant e4-ft1500 "Experiment 4, 24x64, MAE fine-tuned for 1,500 steps (as many as cls \
trains): cls from scratch against MAE + fine-tuning, mean ± std over 3 seeds"
FT_STEPS=1500 LAYER_DECAY=1 e4_variant e4-ft1500-ld1 "Experiment 4, MAE fine-tuned for 1,500 steps without layer \
decay: cls from scratch against MAE + fine-tuning, mean ± std over 3 seeds" "6x128 12x92 24x64"
REUSE=out/e4-ft1500-ld1 CLS_STEPS=1080 e4_variant e4-cls1080 "Experiment 4 at matched compute: cls from scratch for \
1,080 steps against MAE 1,000 + fine-tuning 500, mean ± std over 3 seeds" "6x128 12x92 24x64"
REUSE=out/e4-ft1500-ld1 REUSE_FT=1 CLS_STEPS=2080 FT_STEPS=1500 LAYER_DECAY=1 e4_variant e4-ft1500-ld1-cls2080 \
"Experiment 4 at matched compute: cls from scratch for 2,080 steps against MAE 1,000 + fine-tuning 1,500 without layer \
decay, mean ± std over 3 seeds" "6x128 12x92 24x64"
REUSE=out/e4-ft1500-ld1 LAYER_DECAY=1 TRUNKS="6x128 12x92" bash results/e4.sh "$DATA"  # equal total steps, no decay
REUSE=out/e4-ft1500 LAYER_DECAY=1 TRUNKS=24x64 e4_variant e4-ld1 "Experiment 4, MAE fine-tuned for 500 steps without \
layer decay (equal total steps): cls from scratch against MAE + fine-tuning, mean ± std over 3 seeds" "6x128 12x92 24x64"
LAYER_DECAY=1 SEEDS="3 4" bash results/e4.sh "$DATA"  # two more seeds of that, every arm
five_seeds e4 e4-ld1 "Experiment 4, MAE fine-tuned for 500 steps without layer decay (equal total steps): cls from \
scratch against MAE + fine-tuning, mean ± std over 5 seeds"

# Probes of fresh models: 256 fixed CIFAR-10 test images (64 for bamboo-b); one JSON, table and figure each.
CIFAR="--dataset folder --data_dir $DATA/cifar10-jpeg"
probe() { local name=$1; shift; $PY probe.py "$@" --json "results/probes/$name.json" --plot "results/probes/$name.png" > "results/probes/$name.txt"; }
probe e2-neutreno-init init:cifar-deep init:cifar-deep,neutreno=0.6 --labels "softmax (init)","neutreno 0.6 (init)" \
  $CIFAR --samples 256
probe e5-vo-param-init init:cifar-deep,vo_param=smooth init:cifar-deep,vo_param=sharpen init:cifar-deep \
  --labels smooth,sharpen,free $CIFAR --samples 256
probe probe-init-bamboo-b init:bamboo-b init:bamboo-b,neutreno=0.6 $CIFAR --samples 64
$PY results/verdicts.py --write  # the record's verdict tables, from the logs above
