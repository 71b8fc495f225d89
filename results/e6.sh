#!/usr/bin/env bash
# Experiments 6 and 11 (results/e6/PLAN.md, results/e11/PLAN.md): does depth pay under MAE at equal FLOPs?
# One command per stretch of GPU time. Experiment 6 fixes its design once (results/e6_design.py's rule from
# bench.py's steps on this GPU), then runs whole seeds: per seed, the shallow then the deep trunk, each MAE then
# fine-tuning from it, each run's final evaluation logging the per-layer probe. Experiment 11's design is
# committed (results/e11/design.json) and its unit is one arm: one trunk's MAE and fine-tuning. A unit starts
# only if the longest such unit measured so far (the design's prediction before the first) fits what is left of
# BUDGET. A finished unit lands in RESULTS/sN/ and is skipped by every later command, on this machine or a
# fresh one; one that did not finish leaves nothing kept there (on this machine, the next command resumes it).
#   DATA=DIR bash results/e6.sh             DIR holds cifar10-jpeg/; checkpoints and decoded images go to RUNS
#   bash results/e11.sh                     the same with RESULTS=results/e11
#   ARCHIVE=FILE                            also pack RESULTS into FILE (a runner that returns few files)
# SEEDS ("0 1 2 3 4 5"), BUDGET (570 s), DEVICE (cuda), PROBE_SAMPLES (256), RESULTS (results/e6),
# RUNS (/tmp/ and RESULTS' last name). The suite's dry runs put a tiny design.json in RESULTS, DEVICE=cpu.
set -euo pipefail
if [ $# -gt 0 ]; then
  echo "results/e6.sh takes no arguments (got '$*'): its settings are environment variables (see its head)" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
source results/checks.sh
PY=${PYTHON:-python}
OUT=${RESULTS:-results/e6} DATA=${DATA:-../shared/data} DEVICE=${DEVICE:-cuda} SEEDS=${SEEDS:-0 1 2 3 4 5}
RUNS=${RUNS:-/tmp/$(basename "$OUT")} BUDGET=${BUDGET:-570} PROBE_SAMPLES=${PROBE_SAMPLES:-256}
seed_list SEEDS
for v in BUDGET PROBE_SAMPLES; do positive_whole $v ""; done
if [ "$PROBE_SAMPLES" -lt 2 ]; then echo "PROBE_SAMPLES must be at least 2, got $PROBE_SAMPLES" >&2; exit 2; fi
case $DEVICE in cuda|cpu) ;; *) echo "DEVICE must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac
if [ -n "${ARCHIVE:-}" ] && [ ! -d "$(dirname "$ARCHIVE")" ]; then
  echo "ARCHIVE's folder $(dirname "$ARCHIVE") does not exist; make it or point ARCHIVE elsewhere" >&2; exit 2
fi
if [ "$DEVICE" = cpu ] && [ ! -f "$OUT/design.json" ]; then
  echo "DEVICE=cpu needs a design.json in $OUT (the rule would benchmark GPU-size trunks on the CPU)" >&2
  exit 2
fi
if [ "$DEVICE" = cuda ] && ! $PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "no CUDA device here: this experiment runs on a GPU (the suite's dry run uses DEVICE=cpu)"; exit 1
fi
cifar_folder "$DATA"
start=$SECONDS
export TORCH_LOGS=${TORCH_LOGS-recompiles}  # each arm's output says what compiled twice, and why
mkdir -p "$OUT" "$RUNS"
if [ "$DEVICE" = cuda ]; then
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/gpu.txt"
fi

if [ ! -f "$OUT/design.json" ]; then  # the rule, once: P1, and P2 only if no length fits P1
  for pair in P1 P2; do
    last=""; if [ $pair = P2 ]; then last=--last; fi
    { read -r mae_specs; read -r ft_specs; } < <($PY results/e6_design.py specs $pair)
    $PY bench.py $mae_specs --batch_size 1024 --compile auto --rounds 3 --steps 5 \
      --json "$OUT/bench-$pair-mae.json" > "$OUT/bench-$pair-mae.txt" 2>&1
    $PY bench.py $ft_specs --batch_size 512 --compile auto --rounds 3 --steps 5 \
      --json "$OUT/bench-$pair-ft.json" > "$OUT/bench-$pair-ft.txt" 2>&1
    rc=0
    $PY results/e6_design.py choose $pair "$OUT/bench-$pair-mae.json" "$OUT/bench-$pair-ft.json" \
      "$OUT/design.json" $last || rc=$?
    if [ $rc = 0 ]; then break; elif [ $rc != 3 ]; then exit $rc; fi
  done
  echo "design fixed in $((SECONDS - start)) s"
fi
declare -A PREDICTED  # seconds by unit, before one is measured
eval "$($PY results/e6_design.py shell "$OUT/design.json")"

COMMON="--dataset folder --data_dir $DATA/cifar10-jpeg --train_samples $SAMPLES --eval_samples 0
        --device $DEVICE --log_interval 50 --probe_samples $PROBE_SAMPLES --cache_dir $RUNS/cache"
MAE="--objective mae --batch_size $MAE_BATCH --base_lr 1.5e-4 --norm_pix_loss --warmup $MAE_WARMUP"
FT="--objective cls --batch_size $FT_BATCH --base_lr 5e-4 --drop_path 0.1 --label_smoothing 0.1
    --warmup $FT_WARMUP"

finished() {  # finished RUN PLANNED: the run's log holds an evaluation at its planned step
  [ -f "$1/log.jsonl" ] && grep -q "\"eval\": true, \"step\": $2," "$1/log.jsonl"
}

arm() {  # arm SEED RUN PLANNED FLAGS...: train or continue one run inside what is left of BUDGET
  local seed=$1 run=$2 planned=$3; shift 3
  local left=$((BUDGET - (SECONDS - start) - 15))
  if finished "$run" "$planned" || [ "$left" -lt 10 ]; then return; fi
  local began=$SECONDS
  if [ -f "$run/ckpt.pt" ]; then
    $PY train.py --resume --out_dir "$run" --time_limit "$left" --device "$DEVICE"
  else
    $PY train.py $COMMON --seed "$seed" --max_iters "$planned" --eval_interval "$planned" --overwrite \
      --out_dir "$run" --time_limit "$left" "$@"
  fi >> "$run.txt" 2>&1 || { echo "$run failed: see $run.txt" >&2; failed=1; }
  echo "e6.sh: this process took $((SECONDS - began)) s" >> "$run.txt"
}

trunk() {  # trunk SEED NAME FLAGS DECAY: MAE, then fine-tuning from it
  local runs=$RUNS/s$1
  arm "$1" "$runs/$2-mae" "$MAE_STEPS" $MAE $3
  if finished "$runs/$2-mae" "$MAE_STEPS"; then
    arm "$1" "$runs/$2-ft" "$FT_STEPS" $FT --layer_decay "$4" --init_from "$runs/$2-mae/ckpt.pt"
  fi
}

unit_done() {  # unit_done SEED TRUNKS...: every run of the trunks at its planned step
  local runs=$RUNS/s$1 name; shift
  for name in "$@"; do
    finished "$runs/$name-mae" "$MAE_STEPS" && finished "$runs/$name-ft" "$FT_STEPS" || return 1
  done
}

keep() {  # keep SEED TAG SECONDS TRUNKS...: copy a finished unit's small outputs into OUT/sN, its seconds last
  local runs=$RUNS/s$1 to=$OUT/s$1 tag=$2 seconds=$3 name run; shift 3
  mkdir -p "$to"
  for name in "$@"; do
    for run in "$name-mae" "$name-ft"; do
      cp "$runs/$run/log.jsonl" "$to/$run.jsonl"
      cp "$runs/$run.txt" "$to/"
      if [ -f "$runs/$run/eval_correct.npy" ]; then cp "$runs/$run/eval_correct.npy" "$to/$run.npy"; fi
    done
  done
  echo "$REVISION" > "$to/revision.txt"
  if [ -f "$OUT/gpu.txt" ]; then cp "$OUT/gpu.txt" "$to/${tag}gpu.txt"; fi  # the GPU this unit ran on
  echo "$seconds" > "$to/${tag}seconds.txt"  # written last: a unit is kept when its seconds are
}

longest() {  # longest TAG UNIT: the longest such unit of this revision kept in OUT, or its prediction
  local file measured=0
  for file in "$OUT"/s*/"$1"seconds.txt; do
    if [ -f "$file" ] && [ "$(cat "$(dirname "$file")/revision.txt" 2> /dev/null)" = "$REVISION" ]; then
      measured=$(( $(cat "$file") > measured ? $(cat "$file") : measured ))
    fi
  done
  if [ "$measured" -gt 0 ]; then echo "$measured"; else echo "${PREDICTED[$2]}"; fi
}

if [ "$UNIT" = arm ]; then UNITS="shallow deep"; else UNITS="shallow+deep"; fi
left_over=0 failed=0
for seed in $SEEDS; do
  for unit in $UNITS; do
    trunks=${unit/+/ } tag="" name="seed $seed"
    if [ "$UNIT" = arm ]; then tag="$unit-" name="seed $seed, $unit arm"; fi
    if [ -f "$OUT/s$seed/${tag}seconds.txt" ]; then continue; fi
    need=$(longest "$tag" "$unit")
    spent=$(cat "$RUNS/s$seed/${tag}seconds" 2> /dev/null || echo 0)  # a unit begun on this machine goes on
    if [ "$spent" -gt 0 ]; then need=$(( need - spent > 60 ? need - spent : 60 )); fi
    if [ $((BUDGET - (SECONDS - start))) -lt "$need" ]; then
      echo "$name: not started, $((BUDGET - (SECONDS - start))) s left, it needs about $need s"
      left_over=1; break 2
    fi
    unit_start=$SECONDS
    echo "$name: $trunks ($PAIR, MAE $MAE_STEPS steps, fine-tuning $FT_STEPS)"
    mkdir -p "$RUNS/s$seed"
    for trunk_name in $trunks; do
      flags=${trunk_name^^}_FLAGS decay=${trunk_name^^}_DECAY
      trunk "$seed" "$trunk_name" "${!flags}" "${!decay}"
    done
    spent=$(( spent + SECONDS - unit_start ))
    echo "$spent" > "$RUNS/s$seed/${tag}seconds"  # a unit continued on this machine adds its commands' times
    if unit_done "$seed" $trunks; then
      keep "$seed" "$tag" "$spent" $trunks
      echo "$name: done in $spent s, kept in $OUT/s$seed"
    else
      echo "$name: not finished in this command; run it again to continue (on this machine it resumes)"
      left_over=1; break 2
    fi
  done
done
if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE" "$OUT"; fi
if [ "$failed" = 1 ]; then echo "a run failed (above); its output says why" >&2; exit 1; fi
if [ "$left_over" = 1 ]; then echo "run the same command again for the units left ($((SECONDS - start)) s used)"
else echo "every seed is done; then: python results/e6_analyze.py --root $OUT"; fi
