#!/usr/bin/env bash
# Experiment 9 (why NeuTRENO helps the deep trunk; results/e9/PLAN.md). Part A: at 24x64 with experiment 7's
# recipe, per seed, softmax, NeuTRENO 0.6, NeuTRENO 0.6 with V0 detached, and softmax with lr 1e-3 and warmup
# 300, from the same initial weights. Part B: seeds 3-5 of experiment 7's 6x128 and 24x64 pairs. Two runs at a
# time, one thread each; a run whose log is kept in results/e9/logs is skipped.
#   bash results/e9.sh [DATA]     then python results/e9_analyze.py
#   PART=A|B (A), SEEDS (part A: "0 1 2"; part B: "3 4 5"), JOBS (2)
set -euo pipefail
cd "$(dirname "$0")/.."
source results/checks.sh
DATA=${1:-../shared/data}
PY=${PYTHON:-python}
PART=${PART:-A}
case $PART in A) SEEDS=${SEEDS:-0 1 2} ;; B) SEEDS=${SEEDS:-3 4 5} ;;
  *) echo "PART must be A or B, got '$PART'" >&2; exit 2 ;; esac
seed_list SEEDS
JOBS=${JOBS:-2}
positive_whole JOBS "of runs at a time"
cifar_folder "$DATA"
COMMON="--preset cifar-deep --image_size 16 --patch_size 4 --dataset folder --data_dir $DATA/cifar10-jpeg
        --train_samples 5000 --batch_size 128 --eval_interval 500 --eval_samples 0 --log_interval 50
        --objective cls --max_iters 1500"
heads_of() { case $1 in 6x128) echo 2 ;; 24x64) echo 1 ;; esac; }
arm_flags() {  # the flags of an arm
  case $1 in
    softmax) echo "--lr 2e-3 --warmup 100" ;;
    neutreno-0.6) echo "--lr 2e-3 --warmup 100 --neutreno 0.6" ;;
    neutreno-0.6-detached) echo "--lr 2e-3 --warmup 100 --neutreno 0.6 --neutreno_detach" ;;
    softmax-gentle) echo "--lr 1e-3 --warmup 300" ;;
  esac
}
run() {  # run SEED TRUNK ARM: one arm, its log and per-image correctness kept
  local seed=$1 trunk=$2 arm=$3 out=out/e9/s$1/$2/$3 kept=results/e9/logs/s$1-$2-$3
  if [ -f "$kept.npy" ]; then return; fi
  OMP_NUM_THREADS=1 $PY train.py $COMMON $(arm_flags "$arm") --depth "${trunk%x*}" --width "${trunk#*x}" \
    --heads "$(heads_of "$trunk")" --seed "$seed" --out_dir "$out" --overwrite > "$out.txt" 2>&1 \
    || { echo "$out failed: see $out.txt" >&2; return 1; }
  cp "$out/log.jsonl" "$kept.jsonl"
  cp "$out/eval_correct.npy" "$kept.npy"
}
mkdir -p results/e9/logs
jobs_list=()
for seed in $SEEDS; do
  if [ "$PART" = A ]; then
    for arm in softmax neutreno-0.6 neutreno-0.6-detached softmax-gentle; do jobs_list+=("$seed 24x64 $arm"); done
  else
    for trunk in 6x128 24x64; do for arm in softmax neutreno-0.6; do jobs_list+=("$seed $trunk $arm"); done; done
  fi
done
for job in "${jobs_list[@]}"; do mkdir -p "out/e9/s${job%% *}/$(echo "$job" | cut -d' ' -f2)"; done
export -f run arm_flags heads_of
export PY COMMON
printf '%s\n' "${jobs_list[@]}" | xargs -P "$JOBS" -L 1 bash -c 'run "$0" "$1" "$2"'
echo "part $PART: every run kept in results/e9/logs; then: python results/e9_analyze.py"
