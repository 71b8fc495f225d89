#!/usr/bin/env bash
# Experiment 8 (depth against width on text; results/e8/PLAN.md): next-token prediction on WikiText-2 with
# two trunks of equal FLOPs per token, 6x256 (wikitext-small) and 24x128 (wikitext-deep), experiment 2's
# recipe (train valid.txt, test test.txt, GPT-2 BPE, 400 steps of 16 windows of 128 tokens, lr 2e-3,
# warmup 40), 3 seeds, 6 runs.
#   bash results/e8.sh [DATA]     then python results/e8_analyze.py
set -euo pipefail
cd "$(dirname "$0")/.."
source results/checks.sh
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
SEEDS=${SEEDS:-0 1 2}
seed_list SEEDS
export TIKTOKEN_CACHE_DIR=$DATA/tiktoken  # GPT-2's BPE ranks (r50k_base) without network
TEXT="--dataset text --data_dir $DATA/wikitext-2 --train_file valid.txt --val_file test.txt --tokenizer r50k_base
      --batch_size 16 --max_iters 400 --warmup 40 --lr 2e-3 --eval_interval 400 --eval_samples 1024
      --log_interval 50 --objective next"
mkdir -p results/e8/logs
for seed in $SEEDS; do
  for trunk in 6x256 24x128; do
    preset=wikitext-small; if [ $trunk = 24x128 ]; then preset=wikitext-deep; fi
    out=out/e8/s$seed/$trunk
    if [ -f "results/e8/logs/s$seed-$trunk.jsonl" ]; then continue; fi  # kept already
    $PY train.py --preset $preset $TEXT --seed "$seed" --out_dir "$out" --overwrite
    cp "$out/log.jsonl" "results/e8/logs/s$seed-$trunk.jsonl"
  done
done
