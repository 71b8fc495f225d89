"""Speedups that pay only on some hardware, kept apart from the tutorial path.

bamboo.py, neutreno.py and train.py read as plain PyTorch: scaled_dot_product_attention,
F.cross_entropy, AdamW. What was measured to pay on particular hardware lives here, and
train.py and bench.py apply it with one call, for_training(model, device, dtype). It never
changes the model's API: out, loss = model(x, y) still returns logits for every objective
(under --compile blocks or graphs without gradient where noted: the loss carries it).

  explicit attention       CPU, bf16/fp16, short sequences: matmul-softmax-matmul beats the
                           fused CPU kernel there (bench.py --attention compares the two anywhere)
  chunked next-token loss  CPU: the loss and its gradient a few rows at a time, never all
                           (B*T, vocab) logits: faster and smaller there. On CUDA the plain loss
                           under torch.compile is the fast one, so it stays off.
  compilation              --compile model: torch.compile of the whole training module;
                           blocks: each transformer Block compiled once and reused by every
                           identical Block (regional compilation), so compile time does not grow
                           with depth (and next-token's logits and loss, one more region);
                           graphs: blocks compiled, then the whole forward and backward captured
                           as one CUDA graph and replayed every step (CUDAGraphed), for deep-and-
                           narrow models whose steps are bound by kernel launches.
                           auto: graphs on CUDA where they are safe, else blocks; off on CPU.
  aligned next-token       blocks and graphs, next-token: logits whose rows are padded to a
  logits                   multiple of 64 columns (aligned_token_logits), for tensor-core GEMMs
  the loss alone is        next-token's logits under blocks, every out under graphs come back
  differentiated           without gradient, so that no backward takes a zero gradient for them
                           (loss_carries_the_gradient, LossOnly). This entry and the one above
                           are not yet measured on a GPU.

The measurements, their machine and their commands are in results/bench/README.md (CPU) and
results/gpu/README.md (GPU).

Run: python -c "import fast, torch, bamboo; print(fast.for_training(bamboo.Bamboo(bamboo.Config(objective='next')),
     torch.device('cpu'), torch.bfloat16))"
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from bamboo import Block
from neutreno import Attention

EXPLICIT_ATTENTION_MAX_TOKENS = 256  # beyond this the (T, T) matrices cost more memory than the kernel saves
LOGITS_ROW_MULTIPLE = 64  # columns: a row of bf16 logits then starts on a 128-byte boundary (nanoGPT pads so)


COMPILE_MODES = ("auto", "off", "model", "blocks", "graphs")
ATTENTION_CHOICES = ("auto", "sdpa", "explicit")


def for_training(model, device, dtype, compile="off", ddp=False, attention="auto"):
    """(module to train, compile mode, note): model itself, or model inside the speedups that pay
    on this device. The note says which compilation was chosen and why, for train.py to print.
    Under mode "graphs" run the module under autocast with cache_enabled=False (the autocast
    cache would hold tensors from outside the graph) and feed it batches of one shape.
    attention: auto (explicit where measured to pay), or sdpa or explicit everywhere, for bench.py."""
    c = model.config
    explicit = explicit_attention_plan(attention, device, dtype, c.num_patches() if c.is_image else c.seq_len)
    for module in model.modules():
        if isinstance(module, Attention):
            module.explicit = explicit
    module = ChunkedNextToken(model) if device.type == "cpu" and c.objective == "next" else model
    mode, why = compile_plan(compile, device, c, ddp)
    if mode == "model":
        module = torch.compile(module)
    elif mode in ("blocks", "graphs"):
        compile_blocks(model)
    if mode == "graphs":
        module = CUDAGraphed(module)
    return module, mode, f"compile: {mode}{f' ({why})' if why else ''}"


def explicit_attention_plan(asked, device, dtype, tokens):
    """Whether attention runs as explicit matmul-softmax-matmul for --attention `asked`: under auto, on
    CPU in bf16/fp16 for short sequences only, where it was measured to beat the fused kernel."""
    if asked not in ATTENTION_CHOICES:
        raise ValueError(f"--attention {asked!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
    if asked != "auto":
        return asked == "explicit"
    return device.type == "cpu" and dtype != torch.float32 and tokens <= EXPLICIT_ATTENTION_MAX_TOKENS


def compile_plan(asked, device, config, ddp):
    """(mode, reason): the compilation to use for --compile `asked`, and why where it differs."""
    if asked not in COMPILE_MODES:
        raise ValueError(f"--compile {asked!r}: choose one of {', '.join(COMPILE_MODES)}")
    if asked == "auto":
        if device.type != "cuda":
            return "off", f"auto compiles on CUDA only; on {device.type} pass --compile blocks or model to compile"
        asked = "graphs"
    if asked != "graphs":
        return asked, ""
    unsafe = graphs_unsafe(device, config, ddp)
    return ("blocks", unsafe + "; compiling blocks without CUDA graphs") if unsafe else ("graphs", "")


def graphs_unsafe(device, config, ddp):
    """Why CUDA graphs cannot be used for this run, or '' when they can."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if ddp:
        return "CUDA graphs are not measured under DDP here"
    if config.checkpointing:
        return "activation checkpointing re-runs blocks in backward"
    return ""


def compile_blocks(model, **compile_kwargs):
    """Regional compilation: compile each Block in place. Identical Blocks share one compiled graph
    (their parameters are graph inputs), so compile time stays that of one block at any depth.
    Next-token's logits and loss are one more region: compiled, the (B, T, vocab) log-softmax is
    fused into one pass instead of fp32 copies of the largest tensors of the step; its logits
    come from aligned_token_logits and without gradient (loss_carries_the_gradient)."""
    for module in model.modules():
        if isinstance(module, Block):
            module.compile(**compile_kwargs)
    if model.config.objective == "next":
        model.token_logits = functools.partial(aligned_token_logits, model)
        model.next_token_loss = torch.compile(functools.partial(loss_carries_the_gradient, model.next_token_loss),
                                              **compile_kwargs)


def loss_carries_the_gradient(loss_fn, *args):
    """(out, loss) of loss_fn with out detached. A compiled region's backward takes a gradient for every output
    that requires grad, zeros when unused: for next-token's logits, (B, T, vocab) zeros made and added every step."""
    out, loss = loss_fn(*args)
    return out.detach(), loss


def aligned_token_logits(model, h):
    """model.token_logits(h) (B, T, vocab) as a view of logits padded to a multiple of 64 columns.

    With GPT-2's 50,257 ids every row of the logits starts off the 16-byte alignment that tensor-core
    GEMMs load and store fastest, and the step's three largest GEMMs (the logits, dL/dh, dL/dW) all
    use them. torch.compile keeps the strides of a tensor it returns, so it does not pad these
    itself. Zero rows appended to the output embedding make the padded columns; the view leaves them
    out, so the logits, the loss and the gradients are the model's own.
    """
    weight = model.output_embedding()  # (vocab, D)
    vocab = weight.shape[0]
    padded = F.pad(weight, (0, 0, 0, -vocab % LOGITS_ROW_MULTIPLE))  # (vocab rounded up, D)
    return (h @ padded.T)[..., :vocab]  # (B, T, vocab), row stride a multiple of 64


class CUDAGraphed(nn.Module):
    """module's forward and backward captured as CUDA graphs on the first call, then replayed.

    One replay launches the whole step's kernels at once: deep-and-narrow models spend most of
    an eager step launching small kernels. torch.cuda.make_graphed_callables warms up on a side
    stream (compiling the blocks there), captures, and returns a callable that autograd
    differentiates with the captured backward. Random draws (MAE masks, dropout) come from the
    CUDA generator, whose offset advances at every replay: new masks every step. The optimizer,
    gradient clipping and the data pipeline stay outside the graph. A replay reuses the captured
    shapes, so every call must have the first call's shapes; a replay overwrites the previous
    outputs, so consume them (the loss) before the next call. Only the loss is differentiated:
    out comes back without gradient, because a graphed output that requires grad gets a gradient at
    every step, zeros when unused, and for next-token's logits that is (B, T, vocab) zeros made,
    copied and added in every backward.
    """

    def __init__(self, module):
        super().__init__()
        self.module, self.config, self.graphed, self.shapes = module, module.config, None, None

    def forward(self, *args):
        inputs = tuple(a for a in args if a is not None)
        shapes = [tuple(a.shape) for a in inputs]
        if self.graphed is None:
            rng = torch.cuda.get_rng_state(inputs[0].device)  # warm-up draws must not shift a resumed run's masks
            self.loss_only = LossOnly(self.module, args)
            self.graphed = torch.cuda.make_graphed_callables(self.loss_only, inputs, allow_unused_input=True)
            torch.cuda.set_rng_state(rng, inputs[0].device)  # replays read the generator's state as it is now
            self.shapes = shapes
        if shapes != self.shapes:
            raise ValueError(f"a CUDA graph replays the shapes it captured {self.shapes}, got {shapes}; "
                             "keep the batch size fixed or pass --compile blocks")
        loss = self.graphed(*inputs)
        return self.loss_only.out, loss  # out: the captured run's tensor, which every replay refills


class LossOnly(nn.Module):
    """module called with the non-None arguments of a template call (make_graphed_callables takes tensors only),
    returning the loss; out is kept, detached, in self.out."""

    def __init__(self, module, template):
        super().__init__()
        self.module, self.present, self.out = module, [a is not None for a in template], None

    def forward(self, *tensors):
        it = iter(tensors)
        out, loss = self.module(*(next(it) if present else None for present in self.present))
        self.out = out.detach()
        return loss


class ChunkedNextToken(nn.Module):
    """model's next-token loss computed by ChunkedCrossEntropy: forward(tokens, y=None) -> (None, loss).

    The features and targets are the model's own (Bamboo.next_token_features), so the loss is
    the same as model(tokens, y)[1] to rounding; only the logits are never all materialised.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, tokens, y=None):
        h, targets = self.model.next_token_features(tokens, y)
        weight = self.model.output_embedding()
        if torch.is_autocast_enabled(h.device.type):  # autocast does not reach into an autograd Function
            dtype = torch.get_autocast_dtype(h.device.type)
            h, weight = h.to(dtype), weight.to(dtype)
        return None, ChunkedCrossEntropy.apply(h.flatten(0, 1), weight, targets.flatten())


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of the logits h @ W^T, a few rows at a time, gradients included.

    The next-token loss over GPT-2's 50257 ids makes (B*T, 50257) logits: at batch 32 x 128
    tokens, 0.8 GB in fp32, plus as much again for log-softmax and for each gradient. Here
    each chunk of rows makes its logits, its loss and straight away its gradient
    (softmax - one-hot); only dL/dh and dL/dW are kept for backward. Same loss and gradients
    to rounding.
    """

    ELEMENTS_PER_CHUNK = 2 ** 23  # 32 MB of fp32 logits at a time; 166 rows for GPT-2's vocabulary

    @staticmethod
    def forward(ctx, h, weight, targets):
        # h (N, D), weight (V, D), targets (N,) with -100 = ignored
        valid = targets != -100
        safe = targets.clamp(min=0)[:, None]  # (N, 1); ignored rows are zeroed through h_valid
        h_valid = h * valid[:, None].to(h.dtype)  # cheaper than masking each (rows, V) gradient
        rows = max(1, ChunkedCrossEntropy.ELEMENTS_PER_CHUNK // weight.shape[0])
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for i in range(0, h.shape[0], rows):
            chunk = slice(i, i + rows)
            log_probs = torch.log_softmax(h[chunk] @ weight.T, dim=-1, dtype=torch.float32)  # (rows, V)
            total -= (log_probs.gather(1, safe[chunk]).squeeze(1) * valid[chunk]).sum()
            grad = log_probs.exp_()  # softmax, in place
            grad.scatter_add_(1, safe[chunk], torch.full_like(grad[:, :1], -1.0))  # minus the one-hot
            grad = grad.to(h.dtype)
            grad_h[chunk] = (grad @ weight) * valid[chunk, None]
            grad_w += grad.T @ h_valid[chunk]
        count = valid.sum().clamp(min=1)  # no NaN when a batch has no targets
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_loss / count
        return grad_h * scale.to(grad_h.dtype), (grad_w * scale).to(ctx.weight_dtype), None
