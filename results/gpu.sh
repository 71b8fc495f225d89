#!/usr/bin/env bash
# The GPU path, checked on any CUDA machine with one command; every output goes to results/gpu/.
#   bash results/gpu.sh
#   DATA=DIR      an ImageFolder tree of CIFAR-10 (train/ and test/) for the short real run and the probe;
#                 without it, those two steps are skipped with a note (no download: GPU machines may be offline)
#   BENCHLIB=DIR  where timm, transformers and vit-pytorch are installed, if they are not importable already;
#                 without them, the --against tables are skipped with a note
#   ARCHIVE=FILE  also pack results/gpu/ (checkpoints left out) into this .tgz at the end: one file for a remote
#                 runner that returns only a few files
# It runs the CUDA tests (tests/gpu), the bench tables of the GPU issue's targets, a short CIFAR-10 run and
# a probe of it, and, not targets, attention kernels compared for short sequences. Each step has its own time limit, cut to what is left of 580 s, so the whole ends within 10 minutes;
# a step that fails, times out or finds no time left is recorded in results/gpu/status.txt and the script goes on.
# Last, results/gpu_targets.py fills the targets table from the steps that passed: results/gpu/targets.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=results/gpu
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

step tests 120 $PY -m pytest -q tests/gpu
# MAE 48x384, batch 256: eager against CUDA graphs over regionally compiled blocks (target: at most 20 ms).
step mae-bamboo-b 60 $PY bench.py mae:bamboo-b --batch_size 256 --compile off,graphs --rounds 3 --steps 5 \
  --json "$OUT/mae-bamboo-b.json"
# Bamboo Table 1 at batch 256, both under the default compilation (target: bamboo-b at least 0.7x of 12x768,
# and 12x768 at least 45% MFU).
step table1 60 $PY bench.py cls:base-12x768 cls:bamboo-b --batch_size 256 --compile auto --rounds 3 --steps 5 \
  --json "$OUT/table1.json"
HAVE_DATA=false; if [ -n "${DATA:-}" ] && [ -d "$DATA/train" ]; then HAVE_DATA=true; fi
if $HAVE_DATA; then
  # A short real run (target: a cifar-small step of 128 images in at most 4 ms), then its probe.
  step train-cifar-small 90 $PY train.py --preset cifar-small --dataset folder --data_dir "$DATA" \
    --train_samples 10000 --batch_size 128 --max_iters 600 --eval_interval 300 --out_dir "$OUT/cifar-small" --overwrite
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
  step against-cls 160 $PY bench.py cls:bamboo-b --against --batch_size 256 --compile graphs --rounds 3 --steps 5 \
    --json "$OUT/against-cls.json"
  step against-text 120 $PY bench.py next:wikitext-small mlm:wikitext-small --against \
    --batch_size 64 --compile auto --rounds 3 --steps 5 --json "$OUT/against-text.json"
else
  echo "against skipped: timm, transformers or vit-pytorch is not importable (set BENCHLIB)" | tee -a "$OUT/status.txt"
fi
# Not targets: which attention kernel is fastest for short sequences (cls: 64 tokens; MAE's encoder: 16 visible).
# PyTorch's pick among the fused SDPA kernels against explicit matmul-softmax-matmul, then the fused pick with
# cuDNN's kernel turned off (FlashAttention or memory-efficient). Last, so that they take only the time left.
step attention 90 $PY bench.py cls:bamboo-b mae:bamboo-b --attention sdpa,explicit --batch_size 256 \
  --compile graphs --rounds 3 --steps 5 --json "$OUT/attention.json"
step attention-no-cudnn 40 $PY -c "import sys, torch, bench; torch.backends.cuda.enable_cudnn_sdp(False); \
sys.exit(bench.main(sys.argv[1:]))" cls:bamboo-b --attention sdpa --batch_size 256 --compile graphs --rounds 3 --steps 5 \
  --json "$OUT/attention-no-cudnn.json"
$PY results/gpu_targets.py "$OUT" > "$OUT/targets.md" && cat "$OUT/targets.md"
if [ -n "${ARCHIVE:-}" ]; then
  tar czf "$ARCHIVE" --exclude='*.pt' "$OUT" && echo "archived $OUT/ in $ARCHIVE"
fi
echo "outputs in $OUT/"
