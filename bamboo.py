"""One transformer trunk, four training objectives, and the Bamboo configurations.

Bamboo (Xue et al., ICML 2023, "A Study on Transformer Configuration and Training
Objective") argues that token-level objectives (MAE, BERT-style MLM, next-token) resist
over-smoothing, so models trained with them should be deeper and narrower at equal
FLOPs: Bamboo-B is 48x384 instead of 12x768. This file holds, in data-flow order:

  Config   a validated dataclass, with named PRESETS (Bamboo Tables 1 and 2) and
           training_flops, the matmul FLOPs of one training sample (Table 1's "comparable compute")
  MLP, Block, DropPath   the pre-norm transformer block (attention lives in neutreno.py)
  Bamboo   the model: image or text stem -> Blocks -> one of four heads: mae (He et al. 2021's
           masked autoencoder), cls (ViT), mlm (BERT, 80/10/10 corruption inside the model) and
           next (GPT, causal, tied embeddings); and configure_optimizer, AdamW with layer decay

Each objective owns its corruption, so data.py hands over clean images and clean token
windows and any batch can be run (or probed) under any objective.

Run: python -c "from bamboo import *; print(Bamboo(Config.from_preset('bamboo-b')).num_params())"
"""
import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from neutreno import Attention, EigenAttention

OBJECTIVES = ("mae", "cls", "mlm", "next")
VO_PARAMS = ("free", "smooth", "sharpen")
IMAGE_OBJECTIVES = ("mae", "cls")
LOGITS_PER_CHUNK = 2 ** 23  # next-token loss: 32 MB of fp32 logits at a time (166 rows of GPT-2's)


@dataclass
class Config:
    objective: str = "cls"       # training objective: mae | cls | mlm | next
    depth: int = 6               # number of transformer blocks in the trunk
    width: int = 192             # hidden size of every token
    heads: int = 0               # attention heads; 0 means width // 64 (head dim 64), at least 1
    mlp_ratio: float = 4.0       # MLP hidden size = mlp_ratio * width
    dropout: float = 0.0         # dropout on embeddings, attention probabilities, residual branches
    drop_path: float = 0.0       # stochastic depth of the last block (linear from 0 at the first)
    image_size: int = 32         # images are image_size x image_size (mae, cls)
    patch_size: int = 4          # square patches; (image_size / patch_size)^2 tokens
    channels: int = 3            # image channels
    num_classes: int = 10        # classes of the cls head
    pool: str = "mean"           # cls pooling: mean of patch tokens, or a learned CLS token
    label_smoothing: float = 0.0  # cls: targets (1 - e) one-hot + e / classes (MAE's is 0.1)
    vocab_size: int = 50257      # text vocabulary (GPT-2 BPE); [MASK] gets id vocab_size
    seq_len: int = 256           # longest text window (learned positions)
    mask_ratio: float = 0.75     # MAE: fraction of patches hidden from the encoder
    decoder_depth: int = 4       # MAE decoder blocks
    decoder_width: int = 192     # MAE decoder hidden size
    decoder_heads: int = 3       # MAE decoder heads
    norm_pix_loss: bool = False  # MAE: regress per-patch normalised pixels
    mlm_prob: float = 0.15       # MLM: share of positions in the loss (exact per window, as BERT)
    neutreno: float = 0.0        # NeuTRENO lambda, 0 = off (the papers: 0.6 images, 0.4 text)
    neutreno_detach: bool = False  # NeuTRENO's V0 without gradient: same forward, no path back
    vo_param: str = "free"       # per-head W_V W_O: free, or smooth / sharpen (Dovonon et al.)
    checkpointing: bool = False  # recompute each block in backward: less memory, more time

    def __post_init__(self):
        if self.heads == 0:
            self.heads = max(1, self.width // 64)
        at_least_1 = ("depth", "width", "image_size", "channels", "decoder_depth")
        checks = [
            ("objective", self.objective in OBJECTIVES, f"must be one of {', '.join(OBJECTIVES)}"),
            *((name, getattr(self, name) >= 1, "must be at least 1") for name in at_least_1),
            *((name, 0 <= getattr(self, name) < 1, "must be in [0, 1)")
              for name in ("dropout", "drop_path", "label_smoothing")),
            ("heads", self.heads >= 1 and self.width % self.heads == 0,
             f"must divide width={self.width}; pick heads so that width // heads is the head dim"),
            ("mlp_ratio", self.mlp_ratio > 0, "must be positive"),
            ("patch_size", self.patch_size >= 1 and self.image_size % self.patch_size == 0,
             f"must divide image_size={self.image_size}"),
            ("num_classes", self.num_classes >= (2 if self.objective == "cls" else 1),
             "must be at least 2 for cls (an image folder holds one sub-folder per class)"),
            ("pool", self.pool in ("mean", "cls"), "must be mean or cls"),
            ("vocab_size", self.vocab_size >= 2, "must be at least 2"),
            ("seq_len", self.seq_len >= 2, "must be at least 2"),
            ("mask_ratio", 0 < self.mask_ratio < 1, "must be in (0, 1)"),
            ("mask_ratio", self.patch_size < 1 or 0 < self.num_visible() < self.num_patches(),
             "must hide some patches and leave others visible"),
            ("decoder_heads",
             self.decoder_heads >= 1 and self.decoder_width % self.decoder_heads == 0,
             f"must divide decoder_width={self.decoder_width}"),
            ("mlm_prob", 0 < self.mlm_prob < 1, "must be in (0, 1)"),
            ("neutreno", self.neutreno >= 0, "must be >= 0 (0 turns NeuTRENO off)"),
            ("neutreno_detach", not self.neutreno_detach or self.neutreno > 0,
             "applies to NeuTRENO only; give --neutreno > 0 too"),
            ("vo_param", self.vo_param in VO_PARAMS, f"must be one of {', '.join(VO_PARAMS)}"),
            *((name, not self.is_image or getattr(self, name) % 4 == 0, "must be a multiple of 4 "
               "(2-D sin-cos positions)") for name in ("width", "decoder_width")),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"Config.{name}={getattr(self, name)!r} {why}")

    def num_patches(self):
        return (self.image_size // self.patch_size) ** 2

    def num_visible(self):
        return round(self.num_patches() * (1 - self.mask_ratio))

    def num_chosen(self, length):
        """MLM: how many of a window's `length` tokens are in the loss (BERT: at least one)."""
        return max(1, round(length * self.mlm_prob))

    @property
    def is_image(self):
        return self.objective in IMAGE_OBJECTIVES

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        """Rebuild from a checkpoint's plain dict, refusing keys this version does not know."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown config fields {unknown}: a checkpoint of another version")
        return cls(**d)

    @classmethod
    def from_preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


def _trunk(depth, width, heads=0):
    return dict(depth=depth, width=width, heads=heads)


# Head dim 64 unless stated. Table 1: depth sweeps at about constant compute; Table 2: Bamboo's.
PRESETS = {
    "base-12x768": _trunk(12, 768),    # ViT-B / BERT-B / MAE-B: Table 1 and 2 "original Base"
    "base-24x512": _trunk(24, 512), "base-48x384": _trunk(48, 384), "base-96x256": _trunk(96, 256),
    "large-24x1024": _trunk(24, 1024),  # "original Large"
    "large-48x768": _trunk(48, 768), "large-60x640": _trunk(60, 640),
    "large-96x512": _trunk(96, 512),
    "huge-32x1280": _trunk(32, 1280, 16),  # "original Huge": head dim 80, as in ViT-H
    "bamboo-b": _trunk(48, 384),          # Table 2 Bamboo-B = base-48x384
    "bamboo-l": _trunk(48, 768),          # Table 2 Bamboo-L = large-48x768
    "bamboo-h": _trunk(64, 896),          # Table 2 Bamboo-H: 14 heads of 64
    # The paper's ImageNet setting: 224 px in 16 px patches (196 tokens), MAE's decoder and loss.
    "bamboo-b-224": dict(depth=48, width=384, image_size=224, patch_size=16, decoder_depth=8,
                         decoder_width=512, decoder_heads=16, norm_pix_loss=True),
    # Laptop sizes (not from the paper). CIFAR: 32x32 images, patch 4 -> 64 tokens.
    "cifar-tiny": dict(depth=4, width=64, heads=2, decoder_depth=1, decoder_width=64,
                       decoder_heads=2),
    "cifar-small": dict(depth=6, width=128, heads=2, decoder_depth=2, decoder_width=128,
                        decoder_heads=2),
    "cifar-deep": dict(depth=24, width=64, heads=1, decoder_depth=2, decoder_width=128,
                       decoder_heads=2),
    # WikiText with the GPT-2 tokenizer, 128-token windows.
    "wikitext-small": dict(depth=6, width=256, heads=4, seq_len=128),
    "wikitext-deep": dict(depth=24, width=128, heads=2, seq_len=128),
}


def training_flops(c):
    """Training FLOPs (forward + backward = 3x forward) for one sample, matmuls only: a block costs
    2 * (4 D^2 + 2 D D_mlp) per token for its weights plus 4 T D per token for Q K^T and A V (PaLM
    appendix B; the causal half is not discounted)."""
    def blocks(n, tokens, width, mlp):
        return n * tokens * (2 * (4 * width ** 2 + 2 * width * mlp) + 4 * tokens * width)

    mlp, T = int(c.mlp_ratio * c.width), c.seq_len  # T: text windows
    prefix = 1 if c.is_image and c.pool == "cls" else 0
    if c.objective == "cls":
        fwd = c.num_patches() * 2 * c.patch_size ** 2 * c.channels * c.width  # the patch embedding
        fwd += blocks(c.depth, c.num_patches() + prefix, c.width, mlp)
        fwd += 2 * c.width * c.num_classes
    elif c.objective == "mae":
        L, dw = c.num_patches(), c.decoder_width
        fwd = c.num_visible() * 2 * c.patch_size ** 2 * c.channels * c.width
        fwd += blocks(c.depth, c.num_visible() + prefix, c.width, mlp)
        fwd += 2 * (c.num_visible() + prefix) * c.width * dw  # into the decoder's width
        fwd += blocks(c.decoder_depth, L + prefix, dw, int(c.mlp_ratio * dw))
        fwd += 2 * L * dw * c.patch_size ** 2 * c.channels  # the pixel prediction
    elif c.objective == "mlm":  # the head (transform + vocabulary) runs at the chosen positions
        fwd = blocks(c.depth, T, c.width, mlp)
        fwd += c.num_chosen(T) * (2 * c.width ** 2 + 2 * c.width * c.vocab_size)
    else:
        fwd = blocks(c.depth, T, c.width, mlp) + 2 * T * c.width * c.vocab_size
    return 3 * fwd


class MLP(nn.Module):
    def __init__(self, width, hidden, dropout):
        super().__init__()
        self.fc = nn.Linear(width, hidden)
        self.proj = nn.Linear(hidden, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class DropPath(nn.Module):
    """Stochastic depth: drop a sample's whole residual branch with probability p. p is a tensor:
    compiled, a float that differs per block would compile every block anew."""

    def __init__(self, p):
        super().__init__()
        self.active = p > 0
        self.register_buffer("p", torch.tensor(float(p)), persistent=False)

    def forward(self, x):
        if not self.training or not self.active:
            return x
        keep = torch.rand(x.shape[0], *([1] * (x.dim() - 1)), device=x.device) >= self.p
        return (x * (keep.float() / (1 - self.p))).to(x.dtype)  # the scale in fp32, never bf16


class Block(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x)). Returns (x, v, attention probs), v the
    values of a NeuTRENO model's layer 0 (called without v0), else None."""

    def __init__(self, width, heads, mlp_ratio=4.0, dropout=0.0, drop_path=0.0, causal=False,
                 neutreno=0.0, vo_param="free", explicit_attention=False):
        super().__init__()
        # smooth/sharpen: no learned gain (whose sign could flip W_V W_O's eigenvalues) or bias
        self.ln1 = nn.LayerNorm(width, elementwise_affine=vo_param == "free")
        options = dict(causal=causal, neutreno=neutreno, dropout=dropout,
                       explicit=explicit_attention)
        self.attn = (Attention(width, heads, **options) if vo_param == "free"
                     else EigenAttention(width, heads, vo_param, **options))
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width, int(mlp_ratio * width), dropout)
        self.drop_path = DropPath(drop_path)

    def forward(self, x, v0=None, need_weights=False):
        a, v, probs = self.attn(self.ln1(x), v0, need_weights)
        x = x + self.drop_path(a)
        x = x + self.drop_path(self.mlp(self.ln2(x)))
        return x, v, probs


def sincos_2d(width, grid):
    """Fixed 2-D sine-cosine positions (MAE): a quarter of the channels per sin/cos of x/y."""
    omega = 1.0 / 10000 ** (torch.arange(width // 4, dtype=torch.float64) / (width // 4))
    ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    x_angles = xs.flatten()[:, None] * omega[None]  # (grid*grid, width/4)
    y_angles = ys.flatten()[:, None] * omega[None]
    pos = torch.cat([x_angles.sin(), x_angles.cos(), y_angles.sin(), y_angles.cos()], dim=1)
    return pos.float().unsqueeze(0)  # (1, grid*grid, width)


def patchify(imgs, p):
    """(B, C, H, W) -> (B, L, p*p*C), patches in row-major order."""
    B, C, H, W = imgs.shape
    x = imgs.reshape(B, C, H // p, p, W // p, p)
    return torch.einsum("bchpwq->bhwpqc", x).reshape(B, (H // p) * (W // p), p * p * C)


def unpatchify(x, p, channels):
    """(B, L, p*p*C) -> (B, C, H, W), the inverse of patchify."""
    B, L, _ = x.shape
    g = int(math.isqrt(L))
    x = x.reshape(B, g, g, p, p, channels)
    return torch.einsum("bhwpqc->bchpwq", x).reshape(B, channels, g * p, g * p)


def random_masking(batch_size, length, mask_ratio, noise=None, device=None):
    """MAE's argsort-of-noise masking of `length` tokens per sample. Returns ids_keep (B, round(L
    * (1 - mask_ratio))), the visible tokens in shuffled order; the mask (B, L) with 1 = hidden, in
    the original order; and ids_restore (B, L), which undoes the shuffle. take_tokens(x, ids_keep)
    then gives the visible tokens of x (B, L, D)."""
    keep = round(length * (1 - mask_ratio))
    noise = torch.rand(batch_size, length, device=device) if noise is None else noise
    ids_shuffle = noise.argsort(dim=1)  # ascending: the smallest noise is kept
    ids_restore = ids_shuffle.argsort(dim=1)
    mask = torch.ones(batch_size, length, device=noise.device)
    mask[:, :keep] = 0
    return ids_shuffle[:, :keep], mask.gather(1, ids_restore), ids_restore


def take_tokens(x, ids):
    """The tokens of x (B, L, D) at the positions ids (B, K): (B, K, D)."""
    return x.gather(1, ids[..., None].expand(-1, -1, x.shape[-1]))


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of the logits h @ W^T, a chunk of rows at a time: GPT-2's 50,257-id
    logits are a step's largest tensors. Each chunk makes its logits, its loss and, training, at
    once its gradient (softmax minus one-hot), so only dL/dh and dL/dW outlive it.
    h (N, D), weight (V, D), targets (N,), -100 where ignored."""

    @staticmethod
    def forward(ctx, h, weight, targets):
        gradients = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        valid = targets != -100
        safe = targets.clamp(min=0)[:, None]  # (N, 1); ignored rows are zeroed through h_valid
        h_valid = h * valid[:, None].to(h.dtype)  # cheaper than masking each (rows, V) gradient
        rows = max(1, LOGITS_PER_CHUNK // weight.shape[0])
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if gradients else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for i in range(0, h.shape[0], rows):
            chunk = slice(i, i + rows)
            log_probs = torch.log_softmax(h[chunk] @ weight.T, -1, dtype=torch.float32)  # (rows, V)
            total -= (log_probs.gather(1, safe[chunk]).squeeze(1) * valid[chunk]).sum()
            if gradients:
                grad = log_probs.exp_()  # softmax, in place
                grad.scatter_add_(1, safe[chunk], torch.full_like(grad[:, :1], -1.0))  # - one-hot
                grad = grad.to(h.dtype)
                grad_h[chunk] = (grad @ weight) * valid[chunk, None]
                grad_w += grad.T @ h_valid[chunk]
        count = valid.sum().clamp(min=1)  # no NaN when a batch has no targets
        if gradients:
            ctx.save_for_backward(grad_h, grad_w, count)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_loss / count
        return grad_h * scale.to(grad_h.dtype), (grad_w * scale).to(grad_h.dtype), None


def init_stack(*modules, residual_depth=0):
    """GPT-2's init: every Linear and Embedding N(0, 0.02), biases 0; with residual_depth, then
    each residual projection N(0, 0.02 / sqrt(2 * depth)), as that many add up in the stream."""
    parts = [m for part in modules for m in part.modules()]
    for module in parts:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for block in (m for m in parts if residual_depth and isinstance(m, Block)):
        for proj in (getattr(block.attn, "proj", None), block.mlp.proj):  # vo_param: no W_O Linear
            if proj is not None:
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * residual_depth))


TRUNK = ("patch_embed.", "pos_embed", "tok_embed.", "blocks.")  # the stem and the blocks, by name


def layer_id(name, depth):
    """0 for the stem, i + 1 for block i, depth + 1 for the final norm and the heads."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    stem = ("patch_embed", "pos_embed", "cls_token", "tok_embed")
    return 0 if name.startswith(stem) else depth + 1


class Bamboo(nn.Module):
    """The trunk with the stem and head of `config.objective`.

    out, loss = model(x, y=None)
      mae:  x images (B, C, H, W) -> out = predicted patches (B, L, p*p*C); loss on masked patches
      cls:  x images, y labels (B,) -> out = logits (B, num_classes); loss if y is given
      mlm:  x tokens (B, T) -> out = logits (N, vocab) at the N chosen positions, in row-major
            order (targets[targets != -100] lines up with them); 80/10/10 masking done here;
            or pass corrupted x with y = targets (-100 where ignored), as mask_tokens makes them
      next: x tokens (B, T) -> out = the logits of what follows x (B, 1, vocab), as nanoGPT's,
            loss predicting x[:, 1:] (a window of seq_len + 1 ends in a target-only token) or
            y (B, T) if given; every position's logits: token_logits(h) of next_token_features
    """

    def __init__(self, config, explicit_attention=False):
        """explicit_attention: matmul-softmax-matmul, not the fused kernel (not in the config)."""
        super().__init__()
        self.config = c = config
        self.mask_id = c.vocab_size  # [MASK] sits just beyond the vocabulary
        # Each part is initialised as it is built, in data-flow order, so nothing built later
        # shifts its draws: with one seed the stem and blocks are bit-identical whatever the
        # objective, head or pooling, and compared arms (cls, mae) start from the same weights.
        if c.is_image:
            self.patch_embed = nn.Linear(c.patch_size ** 2 * c.channels, c.width)  # a stride-p conv
            self.register_buffer("pos_embed", sincos_2d(c.width, c.image_size // c.patch_size),
                                 persistent=False)
            init_stack(self.patch_embed)
        else:
            self.tok_embed = nn.Embedding(c.vocab_size + 1, c.width)  # +1 row for [MASK]
            self.pos_embed = nn.Parameter(torch.zeros(1, c.seq_len, c.width))
            init_stack(self.tok_embed)
            nn.init.normal_(self.pos_embed, std=0.02)
        self.embed_drop = nn.Dropout(c.dropout)
        rates = [c.drop_path * i / max(1, c.depth - 1) for i in range(c.depth)]  # grows linearly
        self.blocks = nn.ModuleList(Block(c.width, c.heads, c.mlp_ratio, c.dropout, rate,
                                          c.objective == "next", c.neutreno, c.vo_param,
                                          explicit_attention) for rate in rates)
        init_stack(self.blocks, residual_depth=c.depth)
        self.cls_token = (nn.Parameter(nn.init.normal_(torch.empty(1, 1, c.width), std=0.02))
                          if c.is_image and c.pool == "cls" else None)
        if c.objective == "cls":  # MAE's fine-tuning head: pool, a fresh LayerNorm, a classifier
            self.fc_norm = nn.LayerNorm(c.width)
            self.head = nn.Linear(c.width, c.num_classes)
            nn.init.normal_(self.head.weight, std=2e-5)  # MAE's init: near-zero logits at first
            nn.init.zeros_(self.head.bias)
            return
        self.ln_f = nn.LayerNorm(c.width)  # the encoder's final norm; fine-tuning drops it
        if c.objective == "mae":
            self.decoder_embed = nn.Linear(c.width, c.decoder_width)
            self.mask_token = nn.Parameter(torch.zeros(1, 1, c.decoder_width))
            grid = c.image_size // c.patch_size
            self.register_buffer("decoder_pos_embed", sincos_2d(c.decoder_width, grid),
                                 persistent=False)
            self.decoder_blocks = nn.ModuleList(
                Block(c.decoder_width, c.decoder_heads, c.mlp_ratio,
                      explicit_attention=explicit_attention) for _ in range(c.decoder_depth))
            self.decoder_norm = nn.LayerNorm(c.decoder_width)
            self.decoder_pred = nn.Linear(c.decoder_width, c.patch_size ** 2 * c.channels)
            nn.init.normal_(self.mask_token, std=0.02)
            init_stack(self.decoder_embed, self.decoder_pred)
            init_stack(self.decoder_blocks, residual_depth=c.decoder_depth)
        elif c.objective == "mlm":  # BERT's transform before the tied output embedding
            self.mlm_transform = nn.Sequential(nn.Linear(c.width, c.width), nn.GELU(),
                                               nn.LayerNorm(c.width))
            self.mlm_bias = nn.Parameter(torch.zeros(c.vocab_size))
            init_stack(self.mlm_transform)

    # ---- stem and trunk, shared by forward() and hidden_states() ----

    def embed(self, x, mask_ratio=0.0, noise=None):
        """Stem: images -> patch tokens + 2-D positions (+ CLS), tokens -> embeddings + positions.
        mask_ratio > 0 (images) MAE-masks the patches before they are embedded and CLS prepended.
        Returns (h, mask, ids_restore), mask and ids_restore None unmasked."""
        c = self.config
        if c.is_image:
            if x.dim() != 4 or x.shape[1:] != (c.channels, c.image_size, c.image_size):
                raise ValueError(f"expected images (B, {c.channels}, {c.image_size}, "
                                 f"{c.image_size}), got {tuple(x.shape)}")
            patches = patchify(x, c.patch_size)  # (B, L, p*p*C)
            pos = self.pos_embed.expand(x.shape[0], -1, -1)  # (B, L, D)
            mask = ids_restore = None
            if mask_ratio > 0:  # mask first: the stem, too, embeds only the visible patches
                ids_keep, mask, ids_restore = random_masking(x.shape[0], patches.shape[1],
                                                             mask_ratio, noise, x.device)
                patches, pos = take_tokens(patches, ids_keep), take_tokens(pos, ids_keep)
            h = self.patch_embed(patches) + pos  # (B, L or visible, D)
            if self.cls_token is not None:
                h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1)
        else:
            h, mask, ids_restore = self.tok_embed(x) + self.pos_embed[:, : x.shape[1]], None, None
        return self.embed_drop(h), mask, ids_restore

    def run_blocks(self, h, collect=False, need_weights=False):
        """The trunk, layer 0's values V0 for NeuTRENO in every later layer. Returns (h, hiddens,
        attns): hiddens holds the input and every block's output when collect=True, attns every
        layer's (B, nh, T, T) probabilities when need_weights."""
        hiddens, attns, v0 = [h] if collect else [], [], None
        recompute = self.config.checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:  # keep only each block's input; rerun the block (same RNG) in backward
                h, v, probs = checkpoint(block, h, v0, need_weights, use_reentrant=False)
            else:
                h, v, probs = block(h, v0, need_weights)
            if v0 is None and v is not None:  # layer 0's values, V0 for every later layer
                v0 = v.detach() if self.config.neutreno_detach else v
            if collect:
                hiddens.append(h)
            if need_weights:
                attns.append(probs)
        return h, hiddens, attns

    def hidden_states(self, x, need_weights=False, mask_ratio=0.0, noise=None):
        """depth+1 tensors (B, T, width): the stem's output, then every block's; all tokens, none
        corrupted, whatever the objective (mask_ratio > 0, images: MAE's visible patches only).
        need_weights=True: (hiddens, attns), attns depth tensors (B, nh, T, T)."""
        h, _, _ = self.embed(x, mask_ratio, noise)
        _, hiddens, attns = self.run_blocks(h, collect=True, need_weights=need_weights)
        return (hiddens, attns) if need_weights else hiddens

    # ---- the four objectives ----

    def forward(self, x, y=None):
        if self.config.objective == "mae":  # y, an image batch's labels, is not MAE's
            return self.forward_mae(x)
        if self.config.objective == "cls":
            return self.forward_cls(x, y)
        if self.config.objective == "mlm":
            return self.forward_mlm(x, y)
        return self.forward_next(x, y)

    def forward_cls(self, x, y=None):
        h, _, _ = self.run_blocks(self.embed(x)[0])
        pooled = h[:, 0] if self.cls_token is not None else h.mean(dim=1)  # (B, D)
        logits = self.head(self.fc_norm(pooled))
        if y is None:
            return logits, None
        return logits, F.cross_entropy(logits, y, label_smoothing=self.config.label_smoothing)

    def forward_encoder(self, imgs, mask_ratio, noise=None):
        h, mask, ids_restore = self.embed(imgs, mask_ratio, noise)
        h, _, _ = self.run_blocks(h)
        return self.ln_f(h), mask, ids_restore

    def forward_decoder(self, latent, ids_restore):
        h = self.decoder_embed(latent)
        prefix = 1 if self.cls_token is not None else 0
        B, L = ids_restore.shape
        masked = self.mask_token.expand(B, L + prefix - h.shape[1], -1)
        patches = take_tokens(torch.cat([h[:, prefix:], masked], dim=1), ids_restore)  # un-shuffle
        tokens = patches + self.decoder_pos_embed
        if prefix:  # without a CLS token there is nothing to prepend, and no copy to make
            tokens = torch.cat([h[:, :prefix], tokens], dim=1)
        for block in self.decoder_blocks:
            tokens, _, _ = block(tokens)
        return self.decoder_pred(self.decoder_norm(tokens))[:, prefix:]  # (B, L, p*p*C)

    def forward_loss(self, imgs, pred, mask):
        """Mean squared error over masked patches only."""
        target = patchify(imgs, self.config.patch_size)
        if self.config.norm_pix_loss:
            mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1e-6).sqrt()
        per_patch = ((pred - target) ** 2).mean(dim=-1)
        return (per_patch * mask).sum() / mask.sum()

    def forward_mae(self, imgs, noise=None):
        latent, mask, ids_restore = self.forward_encoder(imgs, self.config.mask_ratio, noise)
        pred = self.forward_decoder(latent, ids_restore)
        return pred, self.forward_loss(imgs, pred, mask)

    def choose_positions(self, tokens):
        """The positions (B, k) of tokens (B, T) that MLM predicts, ascending in each row: BERT's
        exact count k = round(mlm_prob * T) per window (at least 1), drawn by argsort of noise as
        MAE draws its masks; a fixed count keeps the step's shapes static (a CUDA graph's need)."""
        noise = torch.rand(tokens.shape, device=tokens.device)
        return noise.argsort(dim=1)[:, : self.config.num_chosen(tokens.shape[1])].sort(dim=1).values

    def mask_tokens(self, tokens, positions=None):
        """BERT corruption of the chosen positions: 80% -> [MASK], 10% a random token, 10% kept.
        Returns (inputs, targets) with targets = -100 (ignored) at the positions not chosen."""
        positions = self.choose_positions(tokens) if positions is None else positions
        chosen = torch.zeros_like(tokens, dtype=torch.bool).scatter_(1, positions, True)
        roll = torch.rand(tokens.shape, device=tokens.device)
        random_ids = torch.randint_like(tokens, self.config.vocab_size)
        inputs = torch.where(chosen & (roll < 0.8), self.mask_id, tokens)
        inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
        return inputs, tokens.masked_fill(~chosen, -100)

    def output_embedding(self):
        """The tied output weights (vocab, width), the real vocabulary only: [MASK] has no row."""
        return self.tok_embed.weight[: self.config.vocab_size]

    def token_logits(self, h):
        return h @ self.output_embedding().T

    def forward_mlm(self, tokens, y=None):
        if y is None:  # corrupt here; the chosen positions come in (B, k), static shapes
            positions = self.choose_positions(tokens)
            inputs, _ = self.mask_tokens(tokens, positions)
            h, _, _ = self.run_blocks(self.embed(inputs)[0])
            h = take_tokens(h, positions).flatten(0, 1)  # (N, D) at the chosen positions
            targets = tokens.gather(1, positions).flatten()
        else:  # corrupted tokens and their targets given (-100 where ignored)
            h, _, _ = self.run_blocks(self.embed(tokens)[0])
            chosen = y != -100
            h, targets = h[chosen], y[chosen]
        # Logits only where the loss looks (15% of the positions); sum / count: no NaN for none.
        logits = self.token_logits(self.mlm_transform(self.ln_f(h))) + self.mlm_bias  # (N, vocab)
        return logits, F.cross_entropy(logits, targets, reduction="sum") / max(1, len(targets))

    def next_token_features(self, tokens, y=None):
        """The final-norm features (B, T', D) of the tokens read, and their targets: y (nanoGPT's
        way), or x[:, 1:]; then x is read whole where it fits seq_len (T' = T: the last position has
        no target), else all but its last token (T' = T - 1)."""
        if y is None and (tokens.dim() != 2 or tokens.dtype != torch.long or
                          not 2 <= tokens.shape[1] <= self.config.seq_len + 1):
            raise ValueError(f"expected token windows (B, T) of dtype long with 2 <= T <= seq_len "
                             f"+ 1 = {self.config.seq_len + 1} (the last token is only a target, "
                             f"or pass targets y), got {tuple(tokens.shape)} {tokens.dtype}")
        inputs, targets = tokens, y
        if y is None:
            inputs, targets = tokens[:, :self.config.seq_len], tokens[:, 1:]
        h, _, _ = self.run_blocks(self.embed(inputs)[0])
        return self.ln_f(h), targets

    def forward_next(self, tokens, y=None):
        h, targets = self.next_token_features(tokens, y)
        return self.token_logits(h[:, -1:]), self.next_token_loss(h, targets)

    def next_token_loss(self, h, targets):
        """Mean cross-entropy of the logits of h (B, T' >= T, D) over targets (B, T), positions past
        them left out; no logits come back (ChunkedCrossEntropy never holds them all)."""
        h, weight = h[:, :targets.shape[1]], self.output_embedding()
        if not torch.is_grad_enabled():  # evaluation: the loss alone, no gradients made
            h, weight = h.detach(), weight.detach()
        if torch.is_autocast_enabled(h.device.type):  # autocast does not reach into a Function
            dtype = torch.get_autocast_dtype(h.device.type)
            h, weight = h.to(dtype), weight.to(dtype)
        return ChunkedCrossEntropy.apply(h.flatten(0, 1), weight, targets.flatten())

    @torch.no_grad()
    def generate(self, tokens, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Continue tokens (B, T) by max_new_tokens ids, as nanoGPT's generate: each sampled from
        softmax(logits / temperature), the top_k likeliest if given, of the last seq_len tokens."""
        if self.config.objective != "next":
            raise ValueError(f"generate needs a next-token model, not {self.config.objective}")
        for _ in range(max_new_tokens):
            h, _, _ = self.run_blocks(self.embed(tokens[:, -self.config.seq_len:])[0])
            logits = self.token_logits(self.ln_f(h[:, -1])).float() / temperature  # (B, vocab)
            if top_k is not None:
                kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            new = torch.multinomial(logits.softmax(-1), 1, generator=generator)  # (B, 1)
            tokens = torch.cat([tokens, new], dim=1)
        return tokens

    # ---- optimisation ----

    def configure_optimizer(self, lr, weight_decay, beta2, layer_decay=1.0):
        """AdamW (0.9, beta2), as nanoGPT and MAE: only matrices decay; each group's lr_scale is
        layer_decay^(depth + 1 - layer), MAE's and BEiT's layer-wise decay (train.py applies it)."""
        depth, groups = self.config.depth, {}
        no_decay = ("pos_embed", "cls_token", "mask_token", "vo.psi", "vo.basis")
        for name, p in self.named_parameters():
            # No decay on positions, special tokens, or eigenvalues (decay would pull l to 0).
            decay = p.dim() >= 2 and not name.endswith(no_decay)
            lr_scale = layer_decay ** (depth + 1 - layer_id(name, depth))
            # One group per setting: 2 without layer decay, so one fused kernel call each.
            group = groups.setdefault((decay, lr_scale), {
                "params": [], "lr_scale": lr_scale, "weight_decay": weight_decay if decay else 0.0})
            group["params"].append(p)
        fused = next(self.parameters()).device.type in ("cuda", "cpu")  # faster, where it exists
        return torch.optim.AdamW(list(groups.values()), lr=lr, betas=(0.9, beta2), fused=fused)

    # ---- bookkeeping ----

    def num_params(self, trunk_only=False):
        """All parameters, or only the Blocks' (the 'comparable compute' of Bamboo Table 1)."""
        return sum(p.numel() for p in (self.blocks if trunk_only else self).parameters())

    def load_encoder(self, state_dict):
        """Load a pretrained trunk (e.g. MAE) to fine-tune: each tensor whose name and shape match
        but the heads (decoder_*, mask_token, mlm_*, fc_norm, head) and ln_f, which a classifier
        lacks (MAE's fine-tuning drops it too). Returns (loaded names, skipped names)."""
        own = self.state_dict()
        heads = ("decoder_", "mask_token", "mlm_", "head.", "fc_norm.")
        loaded = [name for name, tensor in state_dict.items()
                  if name in own and own[name].shape == tensor.shape and not name.startswith(heads)]
        skipped = [name for name in state_dict if name not in loaded]
        self.load_state_dict({k: state_dict[k] for k in loaded}, strict=False)
        return loaded, skipped
