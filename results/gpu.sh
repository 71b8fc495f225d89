#!/usr/bin/env bash
# The GPU path, checked on any CUDA machine with one command; every output goes to results/gpu/.
#   bash results/gpu.sh            the GPU issue's targets: the CUDA tests (test_all.py's CUDA section), the bench tables of the
#                                  targets, a short CIFAR-10 run and a probe of it; then results/gpu_targets.py
#                                  fills the targets table from the steps that passed (results/gpu/targets.md)
#   bash results/gpu.sh verify     the flagship path as a user runs it, in about 5 minutes: the CUDA tests,
#                                  train.py --objective mae --depth 48 --width 384 for 300 steps, a resume to
#                                  400 under CUDA graphs, look.py and probe.py on its checkpoint (results/gpu/verify/)
#   bash results/gpu.sh loader     whether the streaming loader keeps a bamboo-b MAE step at 224 fed: the same
#                                  steps fed from memory, then streamed by 4, 8 and 15 workers (results/gpu/loader/)
#   bash results/gpu.sh explore    not targets, candidates for them, in results/gpu/explore/: attention kernels
#                                  for short sequences, inductor's GEMM autotuning, and a kernel profile
#   DATA=DIR      an ImageFolder tree of CIFAR-10 (train/ and test/) for the short real run and the probe;
#                 without it, those two steps are skipped with a note (no download: GPU machines may be offline)
#   BENCHLIB=DIR  where timm, transformers and vit-pytorch are installed, if they are not importable already;
#                 without them, the --against tables are skipped with a note
#   ARCHIVE=FILE  also pack results/gpu/ (checkpoints left out) into this .tgz at the end: one file for a remote
#                 runner that returns only a few files
# Each step has its own time limit, cut to what is left of 580 s, so that each part ends within 10 minutes; a step
# that fails, times out or finds no time left is recorded in the part's status.txt and the script goes on.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
PART=${1:-targets}
case $PART in
  targets) OUT=results/gpu ;;
  explore) OUT=results/gpu/explore ;;
  verify) OUT=results/gpu/verify ;;
  loader) OUT=results/gpu/loader ;;
  *) echo "unknown part '$PART': bash results/gpu.sh [targets|verify|loader|explore]" >&2; exit 2 ;;
esac
if ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "no CUDA device: nothing to check (the recorded outputs in $OUT are left as they are)"
  exit 1
fi
mkdir -p "$OUT"
: > "$OUT/status.txt"
if [ -n "${BENCHLIB:-}" ]; then export PYTHONPATH=$BENCHLIB; fi

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, output to $OUT/NAME.txt, status recorded
  local name=$1 limit=$2 start=$SECONDS; shift 2
  if [ $((580 - SECONDS)) -lt "$limit" ]; then limit=$((580 - SECONDS)); fi
  if [ "$limit" -le 0 ]; then echo "$name skipped: no time left" | tee -a "$OUT/status.txt"; return; fi
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/status.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

targets() {
  step tests 120 $PY -m pytest -q test_all.py -k cuda
  # MAE 48x384, batch 256: eager against CUDA graphs over regionally compiled blocks (target: at most 20 ms).
  step mae-bamboo-b 60 $PY bench.py mae:bamboo-b --batch_size 256 --compile off,graphs --rounds 3 --steps 5 \
    --json "$OUT/mae-bamboo-b.json"
  # Bamboo Table 1 at batch 256, both under the default compilation (target: bamboo-b at least 0.7x of 12x768,
  # and 12x768 at least 45% MFU).
  step table1 60 $PY bench.py cls:base-12x768 cls:bamboo-b --batch_size 256 --compile auto --rounds 3 --steps 5 \
    --json "$OUT/table1.json"
  if [ -n "${DATA:-}" ] && [ -d "$DATA/train" ]; then
    # A short real run (target: a cifar-small step of 128 images in at most 4 ms), then its probe.
    step train-cifar-small 90 $PY train.py --preset cifar-small --dataset folder --data_dir "$DATA" \
      --train_samples 10000 --batch_size 128 --max_iters 600 --eval_interval 300 --out_dir "$OUT/cifar-small" \
      --overwrite
    step probe 40 $PY probe.py "$OUT/cifar-small/ckpt.pt" --device cuda --samples 256 --json "$OUT/probe.json" \
      --plot "$OUT/probe.png"
  else
    echo "real run skipped: set DATA to a CIFAR-10 ImageFolder tree (train/ and test/)" | tee -a "$OUT/status.txt"
  fi
  # Cold compile of the deepest models: one Block compiled and reused at every depth (target: at most 30 s).
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) step compile-cold 60 $PY bench.py cls:bamboo-b cls:base-96x256 \
    --batch_size 64 --compile blocks --rounds 1 --steps 1 --warmup 1 --json "$OUT/compile-cold.json"
  if $PY -c "import timm, transformers, vit_pytorch" 2> /dev/null; then
    # Against what users would pick, both compiled (targets: cls 1.4x timm, next 1.2x and mlm 1.2x Hugging Face).
    step against-cls 160 $PY bench.py cls:bamboo-b --against --batch_size 256 --compile graphs --rounds 3 \
      --steps 5 --json "$OUT/against-cls.json"
    step against-text 120 $PY bench.py next:wikitext-small mlm:wikitext-small --against \
      --batch_size 64 --compile auto --rounds 3 --steps 5 --json "$OUT/against-text.json"
  else
    echo "against skipped: timm, transformers or vit-pytorch is not importable (set BENCHLIB)" |
      tee -a "$OUT/status.txt"
  fi
}

verify() {  # the flagship command as the README gives it, on real data, then what a user does next
  step tests 150 $PY -m pytest -q test_all.py -k cuda
  if [ -z "${DATA:-}" ] || [ ! -d "$DATA/train" ]; then
    echo "flagship skipped: set DATA to a CIFAR-10 ImageFolder tree (train/ and test/)" | tee -a "$OUT/status.txt"
    return
  fi
  local run="$OUT/flagship" data="--dataset folder --data_dir $DATA"
  step flagship 150 $PY train.py --objective mae --depth 48 --width 384 $data --max_iters 300 \
    --eval_interval 300 --log_interval 50 --out_dir "$run" --overwrite
  step resume 90 $PY train.py --resume --out_dir "$run" --max_iters 400
  step reconstruct 40 $PY look.py reconstruct "$run/ckpt.pt" --out "$OUT/reconstruct.png"
  step attention 40 $PY look.py attention "$run/ckpt.pt" --layers 0,23,-1 --out "$OUT/attention.png"
  step curves 30 $PY look.py curves "$run" --out "$OUT/curves.png"
  step probe 60 $PY probe.py "$run/ckpt.pt" --device cuda --samples 256 --json "$OUT/probe.json" \
    --plot "$OUT/probe.png"
  cp "$run/log.jsonl" "$OUT/flagship-log.jsonl" 2> /dev/null || true
}

loader() {  # 3,600 ImageNet-sized JPEGs made from DATA; a step fed from memory is what streaming must keep up with
  if [ -z "${DATA:-}" ] || [ ! -d "$DATA/train" ]; then
    echo "loader skipped: set DATA to a CIFAR-10 ImageFolder tree (train/ and test/)" | tee -a "$OUT/status.txt"
    return
  fi
  local folder=/tmp/imagenet-like
  step make-folder 150 $PY results/loader/bench.py --make $folder --source "$DATA" --per_class 300
  local run="$PY train.py --objective mae --preset bamboo-b-224 --dataset folder --data_dir $folder --batch_size 256
    --max_iters 30 --eval_interval 30 --eval_samples 256 --probe_samples 0 --log_interval 10 --overwrite"
  step memory 120 $run --stream off --out_dir "$OUT/memory"
  for workers in 4 8 15; do
    step "stream-$workers" 90 $run --stream on --workers $workers --out_dir "$OUT/stream-$workers"
  done
}

explore() {  # the deep-narrow trunks at batch 256 under CUDA graphs, as in the targets
  local models="cls:bamboo-b mae:bamboo-b cls:base-12x768" common="--batch_size 256 --rounds 3 --steps 5"
  # Attention for 64 tokens (cls) and MAE's 16 visible ones: PyTorch's pick among its fused kernels against
  # explicit matmul-softmax-matmul, then the fused pick with cuDNN's kernel turned off (FlashAttention or
  # memory-efficient). In the H100 profile of cls:bamboo-b before the GPU issue, cuDNN's attention took 6.5 ms
  # of 41.7 ms of GPU time.
  step attention 150 $PY bench.py $models --attention sdpa,explicit --compile graphs $common \
    --json "$OUT/attention.json"
  step attention-no-cudnn 90 $PY -c "import sys, torch, bench; torch.backends.cuda.enable_cudnn_sdp(False); \
sys.exit(bench.main(sys.argv[1:]))" $models --attention sdpa --compile graphs $common \
    --json "$OUT/attention-no-cudnn.json"
  # Inductor's GEMM autotuning (Triton templates, fused epilogues) for the blocks' small GEMMs, compiled once:
  # Table 1's pair, then MAE, in two steps so that one that runs out of time leaves the other's rows.
  TORCHINDUCTOR_MAX_AUTOTUNE=1 step autotune 150 $PY bench.py cls:bamboo-b cls:base-12x768 --compile graphs \
    $common --json "$OUT/autotune.json"
  TORCHINDUCTOR_MAX_AUTOTUNE=1 step autotune-mae 90 $PY bench.py mae:bamboo-b --compile graphs $common \
    --json "$OUT/autotune-mae.json"
  # Where a step's GPU time goes now (blocks: the same kernels as under graphs, each one visible to the profiler),
  # for the cls targets and for next-token's.
  step profile 60 $PY bench.py cls:bamboo-b --compile blocks --batch_size 256 --rounds 1 --steps 2 --profile 40 \
    --json "$OUT/profile.json"
  step profile-next 30 $PY bench.py next:wikitext-small --compile blocks --batch_size 64 --rounds 1 --steps 2 \
    --profile 30 --json "$OUT/profile-next.json"
}

"$PART"
if [ "$PART" = targets ] || [ "$PART" = explore ]; then
  $PY results/gpu_targets.py results/gpu > results/gpu/targets.md && cat results/gpu/targets.md
fi
if [ -n "${ARCHIVE:-}" ]; then
  packed=results/gpu; if [ "$PART" = verify ] || [ "$PART" = loader ]; then packed=$OUT; fi
  tar czf "$ARCHIVE" --exclude='*.pt' "$packed" && echo "archived results/gpu/ in $ARCHIVE"
fi
echo "outputs in $OUT/"
