#!/usr/bin/env bash
# The performance measurements of README.md, each ratio from a single bench.py run.
#   bash results/bench.sh              writes results/bench/*.txt
#   BENCHLIB=/path bash results/bench.sh   also compares against timm / transformers / vit-pytorch
#                                      installed (not as bamboo dependencies) under /path
#   DATA=/path                         CIFAR-10 JPEGs for the bf16 accuracy check (default ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DATA=${DATA:-../shared/data}
mkdir -p results/bench
run() {  # run NAME ARGS...: one bench.py table, with the wall time of the whole run at its end
  local name=$1 start=$SECONDS; shift
  echo "== $name: python bench.py $*"
  { $PY bench.py "$@"; echo "(bench.py ran $((SECONDS - start)) s)"; } | tee "results/bench/$name.txt"
}

# Bamboo Table 1 at CIFAR size (64 tokens): throughput of the constant-FLOPs depth sweep, at batch 16 and at batch 8,
# where the deep models' 4x more operators weigh most.
run table1 cls:base-12x768 cls:base-24x512 cls:bamboo-b cls:base-96x256 --batch_size 16 --rounds 5
run table1-b8 cls:base-12x768 cls:base-24x512 cls:bamboo-b cls:base-96x256 --batch_size 8 --rounds 7
# ... at batch 32, where it weighs least ...
run table1-b32 cls:base-12x768 cls:bamboo-b --batch_size 32 --rounds 4
# ... at batch 1, where only the fixed per-operator cost is left ...
run table1-b1 cls:base-12x768 cls:bamboo-b --batch_size 1 --rounds 5
# ... the GEMMs of one training step (forward, dX, dW) of the two, timed alone: equal FLOPs, equal time?
$PY - <<'EOF' | tee results/bench/gemms.txt
import torch

import bench


def gemm_ms(m, k, n):
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    a @ b  # warm-up
    return bench.fastest_ms({"gemm": lambda: a @ b}, rounds=7, reps=10)["gemm"]


rows = 8 * 64  # batch 8 x 64 tokens
for depth, width in ((12, 768), (48, 384)):
    shapes = [(rows, width, 3 * width), (rows, width, width), (rows, width, 4 * width), (rows, 4 * width, width)]
    per_block = sum(gemm_ms(m, k, n) + gemm_ms(m, n, k) + gemm_ms(k, m, n) for m, k, n in shapes)
    print(f"{depth}x{width}, batch 8: the GEMMs of one bf16 training step take {depth * per_block:.0f} ms")
EOF
# ... and compiled, which fuses the deep model's twice larger elementwise work (cold inductor cache).
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) run table1-compile cls:base-12x768 cls:bamboo-b --batch_size 16 --rounds 4 \
  --compile off,model
# NeuTRENO's cost, and MAE (75% masked) against cls, on the same trunk.
run neutreno-mae cls:bamboo-b cls:bamboo-b,neutreno=0.6 mae:bamboo-b cls:cifar-small cls:cifar-small,neutreno=0.6 \
  mae:cifar-small --batch_size 16 --rounds 9
# bf16 autocast and torch.compile on this CPU; an empty inductor cache, so "1st s" holds a cold compile.
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) run dtype-compile cls:cifar-small --dtype float32,bfloat16 --compile off,model --batch_size 64
# ... and bf16's accuracy: held-out loss after 200 real CIFAR-10 steps, fp32 against bf16, same seed.
for dtype in float32 bfloat16; do
  $PY train.py --objective cls --preset cifar-small --dataset folder --data_dir "$DATA/cifar10-jpeg" --batch_size 64 \
    --max_iters 200 --warmup 20 --eval_interval 200 --dtype $dtype --out_dir "out/bench-$dtype" 2>&1 | tr '\r' '\n' \
    | grep --line-buffered -v "it/s\|s/it"
done | tee results/bench/dtype-loss.txt
# Regional compilation: the cold compile (first step, empty inductor cache, one process per mode) of the whole
# model against each Block compiled once and reused, for the two deepest Table 1 presets.
compile_time() {
  for mode in model blocks; do
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) run "compile-$mode" cls:bamboo-b cls:base-96x256 --batch_size 8 \
      --warmup 1 --rounds 2 --steps 1 --compile $mode
  done
}
compile_time
# --compile auto on a CPU (fast.CPU_COMPILE): each quick recipe's model at its batch, bf16, compiled
# blocks and the whole model against eager, each mode in its own process with an empty inductor cache (cold
# first step), then the blocks again on the cache it left (warm first step). Evaluation runs eagerly.
cpu_compile() {
  for spec in "cls:cifar-small 128" "mae:cifar-deep 128" "next:wikitext-small 16"; do
    set -- $spec
    local name=${1%%:*} cache
    for mode in model blocks; do
      cache=$(mktemp -d)
      TORCHINDUCTOR_CACHE_DIR=$cache run "cpu-compile-$name-$mode" "$1" --batch_size "$2" --compile off,$mode \
        --rounds 3 --steps 2 --warmup 1
    done
    TORCHINDUCTOR_CACHE_DIR=$cache run "cpu-compile-$name-blocks-warm" "$1" --batch_size "$2" --compile off,blocks \
      --rounds 3 --steps 2 --warmup 1
  done
}
cpu_compile
# ... and in float32 (CPUs without native bf16): the three modes in one process, an empty inductor cache.
for spec in "cls:cifar-small 128" "mae:cifar-deep 128" "next:wikitext-small 16"; do
  set -- $spec
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) run "cpu-compile-fp32-${1%%:*}" "$1" --batch_size "$2" --dtype float32 \
    --compile off,model,blocks --rounds 3 --steps 2 --warmup 1
done
# Each at its fastest on a CPU: ours eager, compiled whole and in blocks; each library eager and compiled whole
# (--compile auto times both). timm and transformers are requirements; vit-pytorch's MAE is not (below).
run against-best cls:cifar-small next:wikitext-small mlm:wikitext-small --against --compile auto,model,blocks \
  --batch_size 16 --rounds 5
# Activation checkpointing: memory saved and time paid on a deep model.
run checkpointing cls:base-96x256 cls:base-96x256,checkpointing=true --batch_size 32
# The allocator: glibc's defaults against glibc told by environment to keep freed memory (no code needed).
# A process-wide setting, so the two arms are separate processes, alternated twice.
malloc() {
  for i in 1 2; do
    run "malloc-glibc-$i" next:wikitext-small cls:bamboo-b cls:cifar-small --batch_size 16 --rounds 3
    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483647 \
      run "malloc-env-$i" next:wikitext-small cls:bamboo-b cls:cifar-small --batch_size 16 --rounds 3
  done
}
malloc
# Where the time goes: the profiler on one step.
run profile next:wikitext-small cls:cifar-small --batch_size 32 --rounds 1 --steps 1 --profile 8
# What each CPU optimization bought against the code path it replaced, and what NeuTRENO costs: A/B in one process.
changes() {
$PY - <<'EOF' | tee results/bench/changes.txt
import torch
import torch.nn.functional as F

import bench
import neutreno
from bamboo import Bamboo, Config
from operations.fast import ChunkedCrossEntropy


def fastest(calls, rounds=7, reps=3):
    """bench.py's round-robin timer, after one warm-up call each."""
    for call in calls.values():
        call()
    return bench.fastest_ms(calls, rounds, reps)


def report(title, best):
    (a, ta), (b, tb) = best.items()
    print(f"{title}: {a} {ta:.1f} ms, {b} {tb:.1f} ms, {ta / tb:.2f}x")


# 1. Attention: PyTorch's fused SDPA kernel against explicit matmul-softmax-matmul, the same model and batch.
args = bench.build_parser().parse_args(["cls:cifar-small", "--batch_size", "16"])
runner = bench.Runner(bench.parse_spec("cls:cifar-small"), args, torch.device("cpu"), torch.bfloat16, "off")


def step_with(explicit):
    def step():
        for module in runner.model.modules():
            if isinstance(module, neutreno.Attention):
                module.explicit = explicit
        runner.step()
    return step


report("cls:cifar-small bf16 training step, batch 16",
       fastest({"fused SDPA": step_with(False), "explicit attention (fast.py)": step_with(True)}))

# 2. AdamW on bamboo-b's 85M parameters: the for-loop implementation against the fused kernel.
model = Bamboo(Config.from_preset("bamboo-b", objective="cls"))
for p in model.parameters():
    p.grad = torch.randn_like(p)
optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4, **kw)
              for name, kw in (("for-loop AdamW", {"foreach": False}), ("fused AdamW", {"fused": True}))}
report("AdamW step, bamboo-b", fastest({name: opt.step for name, opt in optimizers.items()}, rounds=5, reps=1))

# 3. Next-token loss, GPT-2 vocabulary, 16 x 128 tokens of width 256: full logits against ChunkedCrossEntropy.
h = torch.randn(16 * 128, 256, requires_grad=True)
weight = (torch.randn(50257, 256) * 0.02).requires_grad_()
targets = torch.randint(0, 50257, (16 * 128,))


def full_logits():
    with torch.autocast("cpu", torch.bfloat16):
        F.cross_entropy(h @ weight.T, targets).backward()


def chunked():
    ChunkedCrossEntropy.apply(h.to(torch.bfloat16), weight.to(torch.bfloat16), targets).backward()


report("next-token loss forward + backward, bf16", fastest({"full logits": full_logits, "chunked": chunked},
                                                           rounds=5, reps=1))

# ... and a whole next:wikitext-small training step: the model's plain logits loss against fast.ChunkedNextToken.
args = bench.build_parser().parse_args(["next:wikitext-small", "--batch_size", "16"])
chunked_step = bench.Runner(bench.parse_spec("next:wikitext-small"), args, torch.device("cpu"), torch.bfloat16, "off")
plain_step = bench.Runner(bench.parse_spec("next:wikitext-small"), args, torch.device("cpu"), torch.bfloat16, "off")
plain_step.forward = plain_step.model  # what train.py would run without fast.py
report("next:wikitext-small bf16 training step, batch 16",
       fastest({"plain logits": plain_step.step, "chunked (fast.py)": chunked_step.step}, rounds=5, reps=1))

# 4. NeuTRENO's cost: one bamboo-b model and batch, its lambda switched between 0 and 0.6 step by step.
args = bench.build_parser().parse_args(["cls:bamboo-b,neutreno=0.6", "--batch_size", "16"])
runner = bench.Runner(bench.parse_spec("cls:bamboo-b,neutreno=0.6"), args, torch.device("cpu"), torch.bfloat16, "off")


def step_with_lambda(lam):
    def step():
        for block in runner.model.blocks:
            block.attn.neutreno = lam
        runner.step()
    return step


best = fastest({"lambda 0": step_with_lambda(0.0), "lambda 0.6": step_with_lambda(0.6)}, rounds=9, reps=1)
print(f"cls:bamboo-b bf16 training step, batch 16: lambda 0 {best['lambda 0']:.1f} ms, lambda 0.6 "
      f"{best['lambda 0.6']:.1f} ms, NeuTRENO costs {best['lambda 0.6'] / best['lambda 0']:.3f}x")
EOF
}
changes
# A compiled region's backward takes a gradient for every output that requires grad, zeros when one is unused:
# what returning such an output detached (fast.loss_carries_the_gradient) saves, fp32, warm inductor cache.
unused_outputs() {
$PY - <<'EOF' | tee results/bench/unused-outputs.txt
import functools

import torch

import bench
from operations import fast
from bamboo import Bamboo, Config


def fastest(calls, rounds=7, reps=3):
    for call in calls.values():  # compiles
        call()
    return bench.fastest_ms(calls, rounds, reps)


def backward_of(region, *inputs):
    return lambda: region(*inputs)[1].backward()


def report(title, best):
    (a, ta), (b, tb) = best.items()
    print(f"{title}: {a} {ta:.1f} ms, {b} {tb:.1f} ms, {ta / tb:.2f}x")


# 1. The mechanism alone: y = 2x (4096 x 8192, 128 MB) returned beside a loss that uses it.
def doubled(x):
    y = x * 2
    return y, (y * y).mean()


x = torch.randn(4096, 8192, requires_grad=True)
regions = {"y with gradient": torch.compile(doubled),
           "y detached": torch.compile(functools.partial(fast.loss_carries_the_gradient, doubled))}
report("compiled y = 2x and loss, forward + backward", fastest({k: backward_of(r, x) for k, r in regions.items()}))

# 2. next-token's logits-and-loss region, GPT-2's vocabulary, 4 x 127 positions of width 256 (fp32 logits 102 MB).
model = Bamboo(Config.from_preset("wikitext-small", objective="next"))
h = torch.randn(4, 127, model.config.width, requires_grad=True)
targets = torch.randint(0, model.config.vocab_size, (4, 127))
regions = {"logits with gradient": torch.compile(model.next_token_loss),
           "logits detached": torch.compile(functools.partial(fast.loss_carries_the_gradient, model.next_token_loss))}
report("compiled next-token logits and loss, forward + backward",
       fastest({k: backward_of(r, h, targets) for k, r in regions.items()}, rounds=7, reps=1))
EOF
}
unused_outputs
# Against the implementations users would otherwise pick, same depth/width/heads/patch/sequence (6x256, 4 heads).
if [ -n "${BENCHLIB:-}" ]; then
  export PYTHONPATH=$BENCHLIB
  run against cls:cifar-small,width=256,heads=4 mae:cifar-small,width=256,heads=4 \
    next:wikitext-small mlm:wikitext-small --against --batch_size 16 --rounds 7
  # ... and in fp32, the default on CPUs without native bf16 (most laptops).
  run against-fp32 cls:cifar-small,width=256,heads=4 mae:cifar-small,width=256,heads=4 \
    next:wikitext-small mlm:wikitext-small --against --batch_size 16 --rounds 5 --dtype float32
fi
