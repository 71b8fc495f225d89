#!/usr/bin/env bash
# The performance measurements of README.md, each ratio from a single bench.py run.
#   bash results/bench.sh              writes results/bench/*.txt
#   BENCHLIB=/path bash results/bench.sh   also compares against timm / transformers / vit-pytorch
#                                      installed (not as bamboo dependencies) under /path
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
mkdir -p results/bench
run() { local name=$1; shift; echo "== $name: python bench.py $*"; $PY bench.py "$@" | tee "results/bench/$name.txt"; }

# Bamboo Table 1 at CIFAR size (64 tokens): throughput of the constant-FLOPs depth sweep.
run table1 cls:base-12x768 cls:base-24x512 cls:bamboo-b cls:base-96x256 --batch_size 8
# NeuTRENO's cost, and MAE (75% masked) against cls, on the same trunk.
run neutreno-mae cls:bamboo-b cls:bamboo-b,neutreno=0.6 mae:bamboo-b cls:cifar-small cls:cifar-small,neutreno=0.6 \
  mae:cifar-small --batch_size 16 --no-memory
# bf16 autocast and torch.compile on this CPU.
run dtype-compile cls:cifar-small --dtype float32,bfloat16 --compile off,on --batch_size 64 --no-memory
# Activation checkpointing: memory saved and time paid on a deep model.
run checkpointing cls:base-96x256 cls:base-96x256,checkpointing=true --batch_size 32
# Where the time goes: the profiler on one step.
run profile next:wikitext-small cls:cifar-small --batch_size 32 --rounds 1 --steps 1 --no-memory --profile 8
# Against the implementations users would otherwise pick, same depth/width/heads/patch/sequence (6x256, 4 heads).
if [ -n "${BENCHLIB:-}" ]; then
  export PYTHONPATH=$BENCHLIB
  run against cls:cifar-small,width=256,heads=4 mae:cifar-small,width=256,heads=4 \
    next:wikitext-small mlm:wikitext-small --against --batch_size 16 --no-memory
fi
