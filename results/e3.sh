#!/usr/bin/env bash
# Experiment 3 (Bamboo section 2.4, token-level objectives on text), 3 seeds: masked-token prediction against
# next-token prediction from the same initial weights. The next arm is experiment 2's softmax text run
# (out/e2/s<seed>/next-0, 400 steps at lr 2e-3; run results/e2.sh first). MLM gets a loss on 15% of the tokens
# only, so it trains 3x the steps (1,200). At next-token's rate MLM learns nothing beyond frequent tokens, at 24
# blocks or at 6 (the control mlm-d6), so both MLM runs are made again at a 4x lower rate, 5e-4 (mlm-lr5e-4,
# mlm-d6-lr5e-4). e3_analyze.py checks what each model predicts beyond frequent tokens. Since the 6-block run at
# 5e-4 still predicts none, it is made once more at 3x the steps (mlm-d6-lr5e-4-long, 3,600): does MLM learn rarer
# tokens with more passes over this text, or does the held-out loss stop falling first?
#   bash results/e3.sh [DATA]     then python results/e3_analyze.py
#   (SEEDS="0 1" RUNS="mlm mlm-d6" bash results/e3.sh runs a part, to share the runs among cores)
set -euo pipefail
cd "$(dirname "$0")/.."
source results/checks.sh
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
SEEDS=${SEEDS:-0 1 2}
seed_list SEEDS
export TIKTOKEN_CACHE_DIR=$DATA/tiktoken
TEXT="--preset wikitext-deep --dataset text --data_dir $DATA/wikitext-2 --train_file valid.txt --val_file test.txt
      --tokenizer r50k_base --batch_size 16 --max_iters 1200 --warmup 40 --eval_samples 256 --log_interval 50
      --objective mlm"
mkdir -p results/e3/logs
run() {  # run SEED NAME FLAGS...: one MLM run, its log kept
  local seed=$1 name=$2; shift 2
  $PY train.py $TEXT --seed "$seed" --out_dir "out/e3/s$seed/$name" --overwrite "$@"
  cp "out/e3/s$seed/$name/log.jsonl" "results/e3/logs/s$seed-$name.jsonl"
}
for seed in $SEEDS; do
  for name in ${RUNS:-mlm mlm-d6 mlm-lr5e-4 mlm-d6-lr5e-4 mlm-d6-lr5e-4-long}; do
    case $name in
      mlm) run "$seed" $name --depth 24 --lr 2e-3 --eval_interval 400 ;;
      mlm-d6) run "$seed" $name --depth 6 --lr 2e-3 --eval_interval 400 ;;
      mlm-lr5e-4) run "$seed" $name --depth 24 --lr 5e-4 --eval_interval 400 ;;
      mlm-d6-lr5e-4) run "$seed" $name --depth 6 --lr 5e-4 --eval_interval 200 ;;
      mlm-d6-lr5e-4-long) run "$seed" $name --depth 6 --lr 5e-4 --eval_interval 400 --max_iters 3600 ;;
      *) echo "unknown run $name: choose among mlm mlm-d6 mlm-lr5e-4 mlm-d6-lr5e-4 mlm-d6-lr5e-4-long" >&2
         exit 2 ;;
    esac
  done
done
