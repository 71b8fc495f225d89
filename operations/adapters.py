"""timm and Hugging Face models as probe.py sees a Bamboo: a config, each block's per-head W_Q,
W_K, W_V, W_O read from the library's own weight layout, hidden states from hooks on the block list,
and attention probabilities recomputed from each block's input (fused kernels return none).

Run: python probe.py timm:vit_base_patch16_224,pretrained=0 --dataset folder --data_dir DIR
"""
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from neutreno import Attention, attention_probabilities

FAMILIES = ("vit (timm)", "gpt2", "bert", "opt", "vit and vit_mae (Hugging Face)")


def is_image(config):
    return config is None or hasattr(config, "image_size")


def linear(module):
    """(W (out, in), b (out,)) of an nn.Linear, or of a GPT-2 Conv1D (which stores W transposed)."""
    weight = module.weight if isinstance(module, torch.nn.Linear) else module.weight.T
    bias = module.bias if module.bias is not None else weight.new_zeros(weight.shape[0])
    return weight, bias


def block_layout(model, block):
    """What the probe needs of one block: q, k, v, o as (W, b) in nn.Linear's convention, the norm
    before attention (None where the block is post-norm) and the output's per-channel scale."""
    kind = type(block).__name__
    if hasattr(block, "attn") and hasattr(block.attn, "qkv"):  # timm's ViT (and bamboo's Block)
        from timm.models.vision_transformer import Attention as TimmAttention  # in every timm

        if not isinstance(block.attn, (TimmAttention, Attention)):  # biases of its own, relative
            raise ValueError(f"{kind}'s attention ({type(block.attn).__module__}) is more than "
                             "softmax(q k^T) (relative positions, rotary embeddings, biases of "
                             "its own), which the probe recomputes; probe a model with timm's "
                             "plain Attention, such as vit_base_patch16_224 or deit_*")
        normed = [n for n in ("q_norm", "k_norm", "norm") if not isinstance(
            getattr(block.attn, n, None), (type(None), nn.Identity))]
        if normed:  # the maps would be plain softmax(q k^T); W_O would follow a norm
            raise ValueError(f"{kind} normalises inside attention ({', '.join(normed)}), which "
                             "the probe's attention maps (q_norm, k_norm) and W_V W_O (norm) do "
                             "not; probe a model without qk_norm or scale_norm")
        w, b = linear(block.attn.qkv)  # rows: W_Q, W_K, W_V, each head's rows together
        q, k, v = zip(w.chunk(3), b.chunk(3))
        scale = getattr(getattr(block, "ls1", None), "gamma", None)  # LayerScale, if there is one
        norm = getattr(block, "norm1", None) or block.ln1
        return dict(q=q, k=k, v=v, o=linear(block.attn.proj), norm=norm, out_scale=scale)
    if kind == "GPT2Block":
        c = model.config
        if c.scale_attn_by_inverse_layer_idx or not c.scale_attn_weights:
            raise ValueError("this GPT-2 scales its attention otherwise than by 1/sqrt(head size) "
                             "(scale_attn_by_inverse_layer_idx, scale_attn_weights), which the "
                             "probe's attention maps do not; probe a GPT-2 with the defaults")
        w, b = linear(block.attn.c_attn)
        q, k, v = zip(w.chunk(3), b.chunk(3))
        return dict(q=q, k=k, v=v, o=linear(block.attn.c_proj), norm=block.ln_1, out_scale=None)
    if kind == "BertLayer":
        s = block.attention.self
        return dict(q=linear(s.query), k=linear(s.key), v=linear(s.value),
                    o=linear(block.attention.output.dense), norm=None, out_scale=None)
    if kind == "OPTDecoderLayer":
        s = block.self_attn
        norm = block.self_attn_layer_norm if model.config.do_layer_norm_before else None
        return dict(q=linear(s.q_proj), k=linear(s.k_proj), v=linear(s.v_proj),
                    o=linear(s.out_proj), norm=norm, out_scale=None)
    if kind in ("ViTLayer", "ViTMAELayer"):  # pre-norm; projections named q_proj or query
        a = block.attention
        if hasattr(a, "q_proj"):  # transformers 5
            q, k, v, o = a.q_proj, a.k_proj, a.v_proj, a.o_proj
        else:
            q, k, v, o = a.attention.query, a.attention.key, a.attention.value, a.output.dense
        return dict(q=linear(q), k=linear(k), v=linear(v), o=linear(o),
                    norm=block.layernorm_before, out_scale=None)
    raise ValueError(f"no adapter for blocks of type {kind}; the probe knows {', '.join(FAMILIES)}")


def block_list(model):
    """The model's list of transformer blocks, wherever the library keeps it."""
    paths = ("blocks", "transformer.h", "h", "layers", "encoder.layer", "decoder.layers",
             "model.decoder.layers")
    for path in paths:
        holder = model
        for part in path.split("."):
            holder = getattr(holder, part, None)
        if isinstance(holder, (torch.nn.ModuleList, torch.nn.Sequential)) and len(holder):
            return holder
    raise ValueError(f"{type(model).__name__} has no block list the probe can find")


class ForeignBlock:
    """One block as probe.py reads it: attn.weights() and ln1.weight."""

    def __init__(self, layout, heads):
        self.layout, self.heads = layout, heads
        self.attn = SimpleNamespace(weights=self.weights)
        norm = layout["norm"]
        self.ln1 = SimpleNamespace(weight=None if norm is None else norm.weight)

    def weights(self):
        """W_Q, W_K (D, D) and per head W_V (nh, D, hs), W_O (nh, hs, D), all acting as x @ W."""
        (wq, _), (wk, _), (wv, _), (wo, _) = (self.layout[n] for n in "qkvo")
        wo = wo if self.layout["out_scale"] is None else self.layout["out_scale"][:, None] * wo
        D, nh = wo.shape[0], self.heads
        return {"q": wq.detach().T, "k": wk.detach().T,
                "v": wv.detach().T.reshape(D, nh, D // nh).transpose(0, 1),
                "o": wo.detach().T.reshape(nh, D // nh, D)}


class Foreign(nn.Module):
    """A timm or Hugging Face transformer with the interface probe.py reads of a Bamboo model."""

    def __init__(self, model, spec, statistics=None, tokenizer=None):
        """statistics: the (mean, std) an image model expects (default 0.5, 0.5); tokenizer: the
        --tokenizer a text model reads by default (None: the user must choose)."""
        super().__init__()
        self.model, self.spec, self.tokenizer = model, spec, tokenizer
        self.statistics = statistics or ((0.5,) * 3, (0.5,) * 3)
        config = getattr(model, "config", None)
        self.is_image = getattr(config, "is_image", is_image(config))
        self.is_mae = getattr(config, "model_type", "") == "vit_mae"  # masks unless told not to
        self.causal = (type(model).__name__.startswith(("GPT2", "OPT"))
                       or getattr(config, "objective", None) == "next")
        self.block_modules = blocks = list(block_list(model))  # the library's own, hooked
        keys = [k for k in ("num_attention_heads", "n_head", "heads") if hasattr(config, k)]
        self.heads = getattr(config, keys[0]) if keys else blocks[0].attn.num_heads
        self.blocks = [ForeignBlock(block_layout(model, b), self.heads) for b in blocks]
        timm_size = getattr(getattr(model, "patch_embed", None), "img_size", None)
        size = timm_size[0] if timm_size else getattr(config, "image_size", 224)
        seq_len = (getattr(config, "n_positions", None) or getattr(config, "seq_len", None)
                   or getattr(config, "max_position_embeddings", 512))
        patches = (size // getattr(config, "patch_size", 1)) ** 2
        self.config = SimpleNamespace(
            depth=len(blocks), is_image=self.is_image, objective="cls" if self.is_image else "next",
            image_size=size, seq_len=seq_len, vocab_size=getattr(config, "vocab_size", 0),
            mask_ratio=config.mask_ratio if self.is_mae else 0.0, num_patches=lambda: patches)
        post_norm = any(b["norm"] is None for b in (blk.layout for blk in self.blocks))
        why = ("post-norm blocks: the LayerNorm after the residual sum, not the eigenvalues of "
               "W_V W_O, decides the sign of the update")
        self.absent = {"vo_dominant": why, "vo_positive": why} if post_norm else {}
        self.train(model.training)  # as the library's model is

    def normalize(self, pixels):
        """Images in [0, 1] normalised by the model's own mean and std (timm's, the processor's)."""
        mean, std = (torch.tensor(s, dtype=torch.float32).view(1, -1, 1, 1)
                     for s in self.statistics)
        return (pixels - mean) / std

    @torch.no_grad()
    def hidden_states(self, x, need_weights=False, mask_ratio=0.0, noise=None):
        """The first block's input and every block's output, and each block's attention
        probabilities computed again from its input (need_weights)."""
        inputs, outputs = [], []

        def keep(module, args, out):  # returns None: the block's output goes on unchanged
            inputs.append(args[0])
            outputs.append(out[0] if isinstance(out, (tuple, list)) else out)

        hooks = [b.register_forward_hook(keep) for b in self.block_modules]  # the library's own
        try:
            if hasattr(self.model, "forward_features"):  # timm: the trunk without the head
                self.model.forward_features(x)
            elif hasattr(self.model.config, "objective"):  # bamboo's cls or next, from outside
                self.model(x, x if self.causal else None)  # (mae and mlm would mask or corrupt)
            elif self.is_mae:  # every patch in order unless masked (noise: which are kept)
                before, self.model.config.mask_ratio = self.model.config.mask_ratio, mask_ratio
                try:
                    self.model(pixel_values=x, noise=noise if mask_ratio else
                               torch.arange(self.config.num_patches(), device=x.device)
                               .float().expand(len(x), -1))
                finally:  # the model's own setting, as it was
                    self.model.config.mask_ratio = before
            else:
                self.model(**{"pixel_values" if self.is_image else "input_ids": x})
        finally:
            for hook in hooks:
                hook.remove()
        hiddens = [inputs[0]] + outputs
        if not need_weights:
            return hiddens
        return hiddens, [self.attention(block.layout, h) for block, h in zip(self.blocks, inputs)]

    def attention(self, layout, h):
        """softmax(q k^T / sqrt(hs)) of a block's input h (B, T, D); causal where the model is."""
        a = layout["norm"](h) if layout["norm"] is not None else h
        B, T, D = a.shape
        q, k = (F.linear(a, *layout[n]).view(B, T, self.heads, -1).transpose(1, 2) for n in "qk")
        return attention_probabilities(q, k, self.causal)
