"""The model's settings: a validated Config dataclass, Bamboo's named configurations, and their compute.

Bamboo (Xue et al., ICML 2023) Table 1 sweeps depth x width at (roughly) constant FLOPs and
Table 2 pairs each original configuration with its deep-and-narrow Bamboo counterpart; both
are PRESETS here, beside laptop sizes for CIFAR-10 and WikiText. training_flops counts the
matmul FLOPs of one training sample, for Table 1's "comparable compute" and for MFU.

Run: python -c "from config import *; c = Config.from_preset('bamboo-b'); print(c, training_flops(c) / 1e9)"
"""
from dataclasses import asdict, dataclass, fields

OBJECTIVES = ("mae", "cls", "mlm", "next")
VO_PARAMS = ("free", "smooth", "sharpen")
IMAGE_OBJECTIVES = ("mae", "cls")


@dataclass
class Config:
    objective: str = "cls"       # training objective: mae | cls | mlm | next
    depth: int = 6               # number of transformer blocks in the trunk
    width: int = 192             # hidden size of every token
    heads: int = 0               # attention heads; 0 means width // 64 (head dim 64), at least 1
    mlp_ratio: float = 4.0       # MLP hidden size = mlp_ratio * width
    dropout: float = 0.0         # dropout on embeddings, attention probabilities and residual branches
    drop_path: float = 0.0       # stochastic depth rate of the last block (linear from 0 at the first)
    image_size: int = 32         # images are image_size x image_size (mae, cls)
    patch_size: int = 4          # square patches; (image_size / patch_size)^2 tokens
    channels: int = 3            # image channels
    num_classes: int = 10        # classes of the cls head
    pool: str = "mean"           # cls pooling: mean of patch tokens, or a learned CLS token
    vocab_size: int = 50257      # text vocabulary (GPT-2 BPE); [MASK] gets id vocab_size
    seq_len: int = 256           # longest text window (learned positions)
    mask_ratio: float = 0.75     # MAE: fraction of patches hidden from the encoder
    decoder_depth: int = 4       # MAE decoder blocks
    decoder_width: int = 192     # MAE decoder hidden size
    decoder_heads: int = 3       # MAE decoder heads
    norm_pix_loss: bool = False  # MAE: regress per-patch normalised pixels
    mlm_prob: float = 0.15       # MLM: fraction of positions chosen for the loss (exactly, per window, as BERT)
    neutreno: float = 0.0        # NeuTRENO lambda; 0 is plain attention (papers: 0.6 vision, 0.4 language)
    vo_param: str = "free"       # per-head W_V W_O: free, or smooth / sharpen by construction (Dovonon et al.)
    checkpointing: bool = False  # recompute each block's activations in backward: less memory, more time

    def __post_init__(self):
        if self.heads == 0:
            self.heads = max(1, self.width // 64)
        checks = [
            ("objective", self.objective in OBJECTIVES, f"must be one of {', '.join(OBJECTIVES)}"),
            ("depth", self.depth >= 1, "must be at least 1"),
            ("width", self.width >= 1, "must be at least 1"),
            ("heads", self.heads >= 1 and self.width % self.heads == 0,
             f"must divide width={self.width}; pick heads so that width // heads is the head dim"),
            ("mlp_ratio", self.mlp_ratio > 0, "must be positive"),
            ("dropout", 0 <= self.dropout < 1, "must be in [0, 1)"),
            ("drop_path", 0 <= self.drop_path < 1, "must be in [0, 1)"),
            ("patch_size", self.patch_size >= 1 and self.image_size % self.patch_size == 0,
             f"must divide image_size={self.image_size}"),
            ("image_size", self.image_size >= 1, "must be at least 1"),
            ("channels", self.channels >= 1, "must be at least 1"),
            ("num_classes", self.num_classes >= (2 if self.objective == "cls" else 1),
             "must be at least 2 for cls (an image folder holds one sub-folder per class)"),
            ("pool", self.pool in ("mean", "cls"), "must be mean or cls"),
            ("vocab_size", self.vocab_size >= 2, "must be at least 2"),
            ("seq_len", self.seq_len >= 2, "must be at least 2"),
            ("mask_ratio", 0 < self.mask_ratio < 1, "must be in (0, 1)"),
            ("mask_ratio", self.num_visible() >= 1, "leaves no visible patch; lower it"),
            ("decoder_depth", self.decoder_depth >= 1, "must be at least 1"),
            ("decoder_heads", self.decoder_heads >= 1 and self.decoder_width % self.decoder_heads == 0,
             f"must divide decoder_width={self.decoder_width}"),
            ("decoder_width", self.decoder_width % 4 == 0, "must be a multiple of 4 (2-D sin-cos positions)"),
            ("mlm_prob", 0 < self.mlm_prob < 1, "must be in (0, 1)"),
            ("neutreno", self.neutreno >= 0, "must be >= 0 (0 turns NeuTRENO off)"),
            ("vo_param", self.vo_param in VO_PARAMS, f"must be one of {', '.join(VO_PARAMS)}"),
        ]
        if self.objective in IMAGE_OBJECTIVES:
            checks.append(("width", self.width % 4 == 0, "must be a multiple of 4 for 2-D sin-cos positions"))
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"Config.{name}={getattr(self, name)!r} {why}")

    def num_patches(self):
        return (self.image_size // self.patch_size) ** 2

    def num_visible(self):
        return round(self.num_patches() * (1 - self.mask_ratio))

    def num_chosen(self, length):
        """MLM: how many of a window's `length` tokens are chosen for the loss (BERT: at least one)."""
        return max(1, round(length * self.mlm_prob))

    @property
    def is_image(self):
        return self.objective in IMAGE_OBJECTIVES

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        """Rebuild from a checkpoint's plain dict, refusing keys this version does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config fields {unknown}; the checkpoint comes from another version")
        return cls(**d)

    @classmethod
    def from_preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    @classmethod
    def from_spec(cls, spec, **defaults):
        """'PRESET[,key=value,...]', e.g. 'bamboo-b,neutreno=0.6,objective=mae', for command lines."""
        name, *pairs = spec.split(",")
        types = {f.name: f.type for f in fields(cls)}
        settings = dict(defaults)
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in types or not value:
                raise ValueError(f"bad setting {pair!r} in {spec!r}; write key=value with a Config field as key")
            try:
                settings[key] = parse_bool(value) if types[key] is bool else types[key](value)
            except ValueError:
                kind = {int: "an integer", float: "a number", bool: "true or false", str: "text"}[types[key]]
                raise ValueError(f"bad value in {pair!r}: {key} takes {kind}") from None
        return cls.from_preset(name, **settings)


def parse_bool(text):
    """true/false, yes/no, 1/0 (any case); anything else is an error, never a silent False."""
    words = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
    if text.lower() not in words:
        raise ValueError(f"{text!r} is not true or false")
    return words[text.lower()]


def _trunk(depth, width, heads=0):
    return dict(depth=depth, width=width, heads=heads)


# Head dim 64 unless stated. Table 1: depth sweeps at (roughly) constant compute.
# Table 2: each original configuration beside its Bamboo counterpart.
PRESETS = {
    "base-12x768": _trunk(12, 768),    # ViT-B / BERT-B / MAE-B: Table 1 and 2 "original Base"
    "base-24x512": _trunk(24, 512),
    "base-48x384": _trunk(48, 384),
    "base-96x256": _trunk(96, 256),
    "large-24x1024": _trunk(24, 1024),  # "original Large"
    "large-48x768": _trunk(48, 768),
    "large-60x640": _trunk(60, 640),
    "large-96x512": _trunk(96, 512),
    "huge-32x1280": _trunk(32, 1280, 16),  # "original Huge": head dim 80, as in ViT-H
    "bamboo-b": _trunk(48, 384),          # Table 2 Bamboo-B = base-48x384
    "bamboo-l": _trunk(48, 768),          # Table 2 Bamboo-L = large-48x768
    "bamboo-h": _trunk(64, 896),          # Table 2 Bamboo-H: 14 heads of 64
    # Laptop sizes (not from the paper). CIFAR: 32x32 images, patch 4 -> 64 tokens.
    "cifar-tiny": dict(depth=4, width=64, heads=2, decoder_depth=1, decoder_width=64, decoder_heads=2),
    "cifar-small": dict(depth=6, width=128, heads=2, decoder_depth=2, decoder_width=128, decoder_heads=2),
    "cifar-deep": dict(depth=24, width=64, heads=1, decoder_depth=2, decoder_width=128, decoder_heads=2),
    # WikiText with the GPT-2 tokenizer, 128-token windows.
    "wikitext-small": dict(depth=6, width=256, heads=4, seq_len=128),
    "wikitext-deep": dict(depth=24, width=128, heads=2, seq_len=128),
}


def training_flops(c):
    """Training FLOPs (forward + backward = 3x forward) for one sample, matmuls only.

    A block costs 2 * (4 D^2 + 2 D D_mlp) per token for its weights plus 4 T D per token
    for Q K^T and A V (PaLM appendix B; the causal half is not discounted).
    """
    def blocks(n, tokens, width, mlp):
        return n * tokens * (2 * (4 * width ** 2 + 2 * width * mlp) + 4 * tokens * width)

    mlp = int(c.mlp_ratio * c.width)
    prefix = 1 if c.is_image and c.pool == "cls" else 0
    if c.objective == "cls":
        T = c.num_patches() + prefix
        fwd = c.num_patches() * 2 * c.patch_size ** 2 * c.channels * c.width + blocks(c.depth, T, c.width, mlp)
        fwd += 2 * c.width * c.num_classes
    elif c.objective == "mae":
        L, dw = c.num_patches(), c.decoder_width
        fwd = c.num_visible() * 2 * c.patch_size ** 2 * c.channels * c.width
        fwd += blocks(c.depth, c.num_visible() + prefix, c.width, mlp) + 2 * (c.num_visible() + prefix) * c.width * dw
        fwd += blocks(c.decoder_depth, L + prefix, dw, int(c.mlp_ratio * dw))
        fwd += 2 * L * dw * c.patch_size ** 2 * c.channels  # the pixel prediction
    elif c.objective == "mlm":  # the head (transform + vocabulary) runs only at the chosen positions
        T = c.seq_len
        fwd = blocks(c.depth, T, c.width, mlp) + c.num_chosen(T) * (2 * c.width ** 2 + 2 * c.width * c.vocab_size)
    else:
        T = c.seq_len
        fwd = blocks(c.depth, T, c.width, mlp) + 2 * T * c.width * c.vocab_size
    return 3 * fwd
