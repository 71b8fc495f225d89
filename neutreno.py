"""Self-attention with the NeuTRENO fidelity term as a toggle.

NeuTRENO (Nguyen, Nguyen & Baraniuk, NeurIPS 2023, "Mitigating Over-smoothing in
Transformers via Regularized Nonlocal Functionals") reads softmax attention as one
gradient step on a nonlocal smoothness functional and adds a fidelity term that pulls
every layer back towards the first layer's values. For layer l >= 1 and head h:

    O_h = softmax(Q_h K_h^T / sqrt(d_h)) V_h + lam * (V0_h - V_h)

exactly as the authors' code does it (see SPEC section 3):
  * the term is added per head, before the heads are merged and before W_O;
  * V0 is layer 0's value tensor (its qkv projection, bias included, applied to layer 0's
    normalised input) and it is NOT detached: every later layer sends gradient into it;
  * layer 0 itself is plain attention; it only hands its V on;
  * lam is one fixed float for every layer and head: 0.6 for vision, 0.4 for language
    modelling (the papers' values); lam = 0 is plain softmax attention, bit for bit;
  * the term is position-wise (token i's own values), so under a causal mask it leaks
    nothing from the future, and attention dropout does not touch it.

Run: python -c "import neutreno, torch; print(neutreno.Attention(64, 1, neutreno=0.6))"
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VISION_LAMBDA = 0.6    # DeiT / ADE20K in the NeuTRENO paper
LANGUAGE_LAMBDA = 0.4  # WikiText-103 language modelling in the NeuTRENO paper


def explicit_attention(q, k, v, causal=False, dropout_p=0.0):
    """softmax(q k^T / sqrt(d)) v with the probabilities returned, for the probe.

    Mathematically the same as F.scaled_dot_product_attention (a test checks allclose);
    slower, because it materialises the (B, nh, T, T) matrix.
    """
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, nh, T, T)
    if causal:
        T = q.size(-2)
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1)
    return F.dropout(probs, dropout_p) @ v, probs


class Attention(nn.Module):
    """Multi-head self-attention; NeuTRENO when `neutreno` > 0 and `v0` is given.

    forward(x, v0=None, need_weights=False) -> (y, v, probs)
      y:     (B, T, C) the block's attention output, after W_O
      v:     (B, nh, T, hs) this layer's values; layer 0's become V0 for the rest
      probs: (B, nh, T, T) attention probabilities if need_weights, else None
    """

    def __init__(self, width, heads, causal=False, neutreno=0.0, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.neutreno = neutreno
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)  # W_Q, W_K, W_V in one matmul
        self.proj = nn.Linear(width, width)     # W_O
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x, v0=None, need_weights=False):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            y, probs = explicit_attention(q, k, v, self.causal, dropout_p)
        else:
            y, probs = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=self.causal), None
        if v0 is not None and self.neutreno:
            y = y + self.neutreno * (v0 - v)  # the fidelity term, per head, before W_O
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads merged
        return self.proj_drop(self.proj(y)), v, probs
