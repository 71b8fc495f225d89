#!/usr/bin/env bash
# Re-create every experiment of results/README.md from scratch, on CPU: the training runs of experiments 1 to 5
# (3 seeds per arm, the same initial weights for the arms of a seed), their analyses (numbers, JSON, figures),
# and the probes of fresh models. Run time on the 2-core development CPU: see "One command" in results/README.md.
#   bash results/reproduce.sh [DATA]    DATA defaults to ../shared/data (CIFAR-10 JPEGs, WikiText-2, GPT-2 BPE)
# The order matters: experiment 2's vision arm reuses experiment 1's cls runs, experiment 3 reuses experiment 2's
# next-token runs. Each experiment's own script says what it runs; its analysis prints what results/README.md cites.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
for experiment in e1 e2 e3 e4 e5; do
  bash "results/$experiment.sh" "$DATA"
  $PY "results/${experiment}_analyze.py" "$DATA" | tee "results/$experiment/$experiment.txt"
done
# Experiment 4 again at 3x the steps of every arm, on all three trunks: does MAE's deficit come
# from the budget? Then the deepest trunk on 20,000 training images instead of 5,000: does it come from the data?
BUDGET=3 bash results/e4.sh "$DATA"
$PY results/e4_analyze.py "$DATA" --runs out/e4-x3 --out results/e4-x3 --trunks 6x128 12x92 24x64 --title "Experiment 4 \
at 3x the steps: cls from scratch against MAE + fine-tuning, mean ± std over 3 seeds" | tee results/e4-x3/e4-x3.txt
SAMPLES=20000 TRUNKS=24x64 bash results/e4.sh "$DATA"
$PY results/e4_analyze.py "$DATA" --runs out/e4-n20000 --out results/e4-n20000 --trunks 24x64 --train_samples 20000 \
  --title "Experiment 4 on 20,000 training images, 24x64: cls from scratch against MAE + fine-tuning, mean ± std \
over 3 seeds" | tee results/e4-n20000/e4-n20000.txt
BUDGET=3 SAMPLES=20000 TRUNKS=24x64 bash results/e4.sh "$DATA"
$PY results/e4_analyze.py "$DATA" --runs out/e4-x3-n20000 --out results/e4-x3-n20000 --trunks 24x64 \
  --train_samples 20000 --title "Experiment 4 at 3x the steps on 20,000 images: 24x64, cls from scratch against \
MAE + fine-tuning, mean ± std over 3 seeds" | tee results/e4-x3-n20000/e4-x3-n20000.txt
IMAGE_SIZE=32 TRUNKS=24x64 bash results/e4.sh "$DATA"
$PY results/e4_analyze.py "$DATA" --runs out/e4-i32 --out results/e4-i32 --trunks 24x64 --image_size 32 \
  --title "Experiment 4 on 32x32 images (64 tokens): 24x64, cls from scratch against MAE + fine-tuning, mean ± std \
over 3 seeds" | tee results/e4-i32/e4-i32.txt

# Probes of fresh models: 256 fixed CIFAR-10 test images (64 for bamboo-b); one JSON, table and figure each.
CIFAR="--dataset folder --data_dir $DATA/cifar10-jpeg"
probe() { local name=$1; shift; $PY probe.py "$@" --json "results/$name.json" --plot "results/$name.png" > "results/$name.txt"; }
probe e2-neutreno-init init:cifar-deep init:cifar-deep,neutreno=0.6 --labels "softmax (init)","neutreno 0.6 (init)" \
  $CIFAR --samples 256
probe e5-vo-param-init init:cifar-deep,vo_param=smooth init:cifar-deep,vo_param=sharpen init:cifar-deep \
  --labels smooth,sharpen,free $CIFAR --samples 256
probe probe-init-bamboo-b init:bamboo-b init:bamboo-b,neutreno=0.6 $CIFAR --samples 64
