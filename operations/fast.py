"""What depends on the hardware: the device, the dtype, and the speedups measured to pay on some of
it (explicit attention on CPUs in bf16; the compiled or CUDA-graphed module of for_training).
Measurements: results/bench/README.md (CPU) and results/gpu/README.md (GPU).

Run: python bench.py next:cifar-tiny --compile off,model,blocks --dtype bfloat16   (for_training)
"""
import os
import platform

import torch
import torch.nn as nn

from bamboo import Block

EXPLICIT_ATTENTION_MAX_TOKENS = 256  # beyond, the (T, T) matrices cost more memory than they save
PEAK_BF16_TFLOPS = {"A100": 312, "H100": 989, "H200": 989}  # dense, per GPU

DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPILE_MODES = ("auto", "off", "model", "blocks", "graphs")
ATTENTION_CHOICES = ("auto", "sdpa", "explicit")
# --compile auto on a CPU, per dtype and objective: what paid most, and from how many steps its
# saving wins back the first step's compilation (results/bench/README.md, on a CPU); else eager
CPU_COMPILE = {torch.bfloat16: {"cls": ("blocks", 400), "next": ("model", 200)},
               torch.float32: {"cls": ("blocks", 400)}}


def pick_device(name, local_rank=0):
    """auto: cuda (this rank's GPU), then mps, then cpu; or the device named, if it is here."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("mps") if torch.backends.mps.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; use auto, cpu, cuda, cuda:N or "
                         "mps") from None
    count = {"cpu": 1, "cuda": torch.cuda.device_count(),
             "mps": int(torch.backends.mps.is_available())}.get(device.type, 0)
    if device.type != "cpu" and (device.index or 0) >= count:
        raise ValueError(f"--device {name}: {count or 'no'} {device.type} device(s) here; use cpu")
    return device


def cpus():
    """The CPUs this process may run on (its affinity, where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_info():
    """Linux's /proc/cpuinfo, or '' elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_model():
    """The CPU's model name as Linux reports it, or the platform's processor string."""
    names = [line.split(":", 1)[1].strip() for line in cpu_info().splitlines()
             if line.startswith("model name")]
    return names[0] if names else platform.processor() or None


def pick_dtype(name, device):
    """auto: bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), where it is faster than
    fp32 at the same loss (results/bench/README.md); fp32 elsewhere, where bf16 is emulated."""
    if name == "auto":
        bf16 = (torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu"
                and bool({"avx512_bf16", "amx_bf16"} & set(cpu_info().split())))
        name = "bfloat16" if bf16 else "float32"
    return getattr(torch, name)


def peak_tflops(device, dtype):
    """Dense peak TFLOP/s of a CUDA GPU in the table, in dtype (float32: as TF32, half the bf16
    peak, where TF32 is on); None elsewhere."""
    if device.type != "cuda" or (dtype == torch.float32
                                 and not torch.backends.cuda.matmul.allow_tf32):
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    return peak / 2 if peak and dtype == torch.float32 else peak


def use_explicit_attention(asked, device, dtype, config):
    """Whether to build the model with explicit matmul-softmax-matmul attention: `asked` is
    bench.py's --attention (train.py asks auto); under auto, on CPU in bf16/fp16 for short
    sequences only, where it was measured to beat the fused kernel."""
    if asked != "auto":
        return asked == "explicit"
    tokens = config.num_patches() if config.is_image else config.seq_len
    short = tokens <= EXPLICIT_ATTENTION_MAX_TOKENS
    return device.type == "cpu" and dtype != torch.float32 and short


def for_training(model, device, dtype, compile="off", ddp=False, steps=0):
    """(module to train, compile mode, note): what train.py calls as module(x, y), and a line that
    says which compilation was chosen and why. Every choice runs the model's own forward and loss
    (the compile tests of test_all.py check loss and gradients against the plain model):

      off (auto on a CPU where         model itself: every loss eager, as bamboo.py reads
        compiling does not pay)
      model (auto on a CPU for the     torch.compile(model): the same forward and loss, compiled
        objectives CPU_COMPILE names)
      blocks (auto under DDP on        model with its Blocks compiled in place (compile_blocks);
        CUDA, and as CPU_COMPILE says) next: CompiledNextToken(model), model.next_token_loss
                                       (ChunkedCrossEntropy) compiled as one more region
      graphs (auto on one GPU)         CUDAGraphed(the module of blocks): its forward and backward
                                       captured as CUDA graphs and replayed (the optimizer apart)

    Under graphs, run the module under autocast with cache_enabled=False (the autocast cache would
    hold tensors from outside the graph) and feed it batches of one shape."""
    module = model
    mode, why = compile_plan(compile, device, model.config, ddp, steps, dtype)
    if mode == "model":
        module = torch.compile(module)
    elif mode in ("blocks", "graphs"):
        compile_blocks(model)
        if model.config.objective == "next":
            module = CompiledNextToken(model)
    if mode == "graphs":
        module = CUDAGraphed(module)
    if compile == "auto" and device.type == "cpu" and mode != "off":
        module = EagerIfCompilingFails(module, model)
    return module, mode, f"compile: {mode}{f' ({why})' if why else ''}"


def compile_plan(asked, device, config, ddp, steps=0, dtype=torch.bfloat16):
    """(mode, reason): the compilation to use for --compile `asked` in a run of `steps` steps, and
    why where it differs."""
    if asked == "auto" and device.type == "cpu":
        mode, least = CPU_COMPILE.get(dtype, {}).get(config.objective, ("off", 0))
        says = f"auto: compiling {config.objective} on a CPU"
        if mode != "off" and steps >= least and not ddp:
            return mode, f"{says} pays from {least} steps"
        why = f"pays from {least} steps, without DDP" if least else "is not known to pay"
        return "off", f"{says} {why}; --compile {mode if least else 'model'} forces it"
    if asked == "auto":
        if device.type != "cuda":
            return "off", f"auto compiles on CUDA and CPUs only; on {device.type} pass --compile"
        asked = "graphs"
    if asked != "graphs":
        return asked, ""
    if device.type != "cuda":
        unsafe = "CUDA graphs need a CUDA device"
    elif ddp:
        unsafe = "CUDA graphs are not measured under DDP here"
    elif config.checkpointing:
        unsafe = "activation checkpointing re-runs blocks in backward"
    else:
        return "graphs", ""
    return "blocks", unsafe + "; compiling blocks without CUDA graphs"


def compile_blocks(model, **compile_kwargs):
    """Regional compilation: compile each Block in place (nn.Module.compile). Identical Blocks share
    one compiled graph (their parameters are graph inputs), so compile time stays that of one block
    at any depth."""
    for module in model.modules():
        if isinstance(module, Block):
            module.compile(**compile_kwargs)


class EagerIfCompilingFails(nn.Module):
    """module, until a call whose compilation fails (no C++ compiler, an op the compiler cannot
    take): from then on the model runs eagerly, said in one line. What auto chooses on a CPU."""

    def __init__(self, module, model):
        super().__init__()
        self.module, self.model, self.config = module, model, model.config

    def forward(self, *args):
        try:  # the backward is compiled with the forward, so that its failure is met here too
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                return self.module(*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            print(f"note: compilation failed ({str(e).splitlines()[0][:120]}); the run goes on "
                  "uncompiled, as --compile off", flush=True)
            torch.compiler.set_stance("force_eager")  # compiled blocks now run as written
            self.module = self.model
            return self.model(*args)


class CompiledNextToken(nn.Module):
    """model's next-token forward with model.next_token_loss compiled as one region, which fuses
    each chunk's log-softmax and gradient into a few kernels: forward(tokens, y=None) -> (the last
    position's logits, loss), as the model's."""

    def __init__(self, model, **compile_kwargs):
        super().__init__()
        self.model, self.config = model, model.config
        self.loss = torch.compile(model.next_token_loss, **compile_kwargs)

    def forward(self, tokens, y=None):
        h, targets = self.model.next_token_features(tokens, y)
        return self.model.token_logits(h[:, -1:]), self.loss(h, targets)


class CUDAGraphed(nn.Module):
    """module's forward and backward captured as CUDA graphs on the first call, then replayed, each
    replay launching a whole step's kernels at once; random draws advance with every replay. Calls
    keep the first call's shapes; the optimizer and clipping stay outside (LossOnly: the loss)."""

    def __init__(self, module):
        super().__init__()
        self.module, self.config, self.graphed, self.shapes = module, module.config, None, None

    def forward(self, *args):
        inputs = tuple(a for a in args if a is not None)
        shapes = [tuple(a.shape) for a in inputs]
        if self.graphed is None:
            rng = torch.cuda.get_rng_state(inputs[0].device)  # warm-up draws must not shift masks
            self.loss_only = LossOnly(self.module, args)
            self.graphed = torch.cuda.make_graphed_callables(self.loss_only, inputs,
                                                             allow_unused_input=True)
            torch.cuda.set_rng_state(rng, inputs[0].device)  # replays read the state as it is now
            self.shapes = shapes
        if shapes != self.shapes:
            raise ValueError(f"a CUDA graph replays the shapes it captured {self.shapes}, got "
                             f"{shapes}; keep the batch size fixed or pass --compile blocks")
        loss = self.graphed(*inputs)
        return self.loss_only.out, loss  # out: the captured run's tensor, refilled by every replay


class LossOnly(nn.Module):
    """module called with the non-None arguments of a template call (make_graphed_callables takes
    tensors only), returning only the loss (a graphed output with grad would get zeros in every
    backward); out is kept, detached, in self.out, which a replay overwrites."""

    def __init__(self, module, template):
        super().__init__()
        self.module, self.present, self.out = module, [a is not None for a in template], None

    def forward(self, *tensors):
        it = iter(tensors)
        out, loss = self.module(*(next(it) if present else None for present in self.present))
        self.out = out.detach()
        return loss
