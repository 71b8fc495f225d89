#!/usr/bin/env bash
# Experiment 3 (Bamboo section 2.4, token-level objectives on text), 3 seeds: masked-token prediction against
# next-token prediction from the same initial weights. The next arm is experiment 2's softmax text run
# (out/e2/s<seed>/next-0, 400 steps; run results/e2.sh first). MLM gets a loss on 15% of the tokens only, so
# it trains 3x the steps (1,200). A control asks whether this text can teach MLM at all: the same MLM run
# with 6 blocks instead of 24 (mlm-d6). e3_analyze.py checks what each model predicts beyond frequent tokens.
#   bash results/e3.sh [DATA]     then python results/e3_analyze.py
#   (SEEDS="0 1" DEPTHS=24 bash results/e3.sh runs a part, to share the runs among cores)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
export TIKTOKEN_CACHE_DIR=$DATA/tiktoken
TEXT="--preset wikitext-deep --dataset text --data_dir $DATA/wikitext-2 --train_file valid.txt --val_file test.txt
      --tokenizer r50k_base --batch_size 16 --max_iters 1200 --warmup 40 --lr 2e-3 --eval_interval 400
      --eval_samples 256 --log_interval 50 --objective mlm"
mkdir -p results/e3/logs
for seed in ${SEEDS:-0 1 2}; do
  for depth in ${DEPTHS:-24 6}; do
    name=mlm; [ "$depth" = 24 ] || name=mlm-d$depth
    $PY train.py $TEXT --depth "$depth" --seed "$seed" --out_dir "out/e3/s$seed/$name" --overwrite
    cp "out/e3/s$seed/$name/log.jsonl" "results/e3/logs/s$seed-$name.jsonl"
  done
done
