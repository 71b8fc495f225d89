#!/usr/bin/env bash
# Experiment 2 (NeuTRENO, Nguyen et al. NeurIPS 2023), 3 seeds, each arm from the same initial weights:
#  vision: the 24x64 classifier of experiment 1 with lambda 0.6 (its softmax arm is experiment 1's cls run
#          out/e1/s<seed>/cls, so run results/e1.sh first); 16x16 CIFAR-10, 5,000-image subset, 2,000 steps;
#  text:   next-token models on WikiText-2 (train valid.txt, test test.txt, GPT-2 BPE), the 24x128
#          wikitext-deep trunk, softmax against lambda 0.4, 400 steps of 16 windows of 128 tokens.
#   bash results/e2.sh [DATA] [vision|text|all]   then python results/e2_analyze.py
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
PART=${2:-all}
PY=${PYTHON:-python}
export TIKTOKEN_CACHE_DIR=$DATA/tiktoken  # GPT-2's BPE ranks (r50k_base) without network
VISION="--preset cifar-deep --image_size 16 --patch_size 4 --dataset folder --data_dir $DATA/cifar10-jpeg
        --train_samples 5000 --batch_size 128 --eval_interval 500 --eval_samples 0 --log_interval 50
        --objective cls --max_iters 2000 --warmup 100 --lr 2e-3"
TEXT="--preset wikitext-deep --dataset text --data_dir $DATA/wikitext-2 --train_file valid.txt --val_file test.txt
      --tokenizer r50k_base --batch_size 16 --max_iters 400 --warmup 40 --lr 2e-3 --eval_interval 200
      --eval_samples 256 --log_interval 50 --objective next"
mkdir -p results/e2/logs
for seed in 0 1 2; do
  if [ "$PART" != text ]; then
    $PY train.py $VISION --seed $seed --neutreno 0.6 --out_dir out/e2/s$seed/vision-neutreno --overwrite
    cp out/e2/s$seed/vision-neutreno/log.jsonl results/e2/logs/s$seed-vision-neutreno.jsonl
  fi
  if [ "$PART" != vision ]; then
    for lam in 0 0.4; do
      $PY train.py $TEXT --seed $seed --neutreno $lam --out_dir out/e2/s$seed/next-$lam --overwrite
      cp out/e2/s$seed/next-$lam/log.jsonl results/e2/logs/s$seed-next-$lam.jsonl
    done
  fi
done
