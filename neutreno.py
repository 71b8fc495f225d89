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

import torch
import torch.nn as nn
import torch.nn.functional as F

VISION_LAMBDA = 0.6    # DeiT / ADE20K in the NeuTRENO paper
LANGUAGE_LAMBDA = 0.4  # WikiText-103 language modelling in the NeuTRENO paper


def explicit_attention(q, k, v, causal=False, dropout_p=0.0):
    """softmax(q k^T / sqrt(d)) v with the probabilities returned, for the probe.

    Mathematically the same as F.scaled_dot_product_attention; it materialises the
    (B, nh, T, T) matrix, which the probe needs and which pays off only for short sequences.
    """
    scores = (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)  # (B, nh, T, T); scaling q is T/hs times cheaper
    if causal:
        T = q.size(-2)
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1)
    return F.dropout(probs, dropout_p) @ v, probs


class EigenValueOutput(nn.Module):
    """W_V W_O of every head built from its eigendecomposition (Dovonon, Bronstein & Kusner, TMLR 2025).

    Per head h, H_h = W_V,h W_O,h = Q_h diag(l_h) Q_h^T with Q_h (D, hs) orthonormal, so
    l_h are exactly H_h's non-zero eigenvalues:
      smooth:  l = psi^2                        every eigenvalue > 0: the layer smooths
      sharpen: l = -clip(psi^2, 1e-4, 1)        every eigenvalue in [-1, 0): the layer sharpens
    Choices where the paper leaves details open:
      * the split: W_V,h = Q_h (orthonormal, values keep their norm) and W_O,h = diag(l_h) Q_h^T,
        so the eigenvalues sit in the output projection, next to where NeuTRENO adds its term;
      * Q_h is the Q of a QR decomposition of a learned (D, hs) matrix, as in the paper;
      * LayerNorm's gain multiplies H from the left, and a negative gain can flip an eigenvalue's
        sign; the attention LayerNorm of these blocks therefore has no learned gain (Block does that);
      * clipping psi^2 into [1e-4, 1] keeps the sharpening eigenvalues in [-1, 0) (a gain beyond
        1 per layer would blow the residual stream up); the gradient of psi is zero once clipped.
    """

    def __init__(self, width, heads, mode):
        super().__init__()
        self.mode = mode
        self.basis = nn.Parameter(torch.randn(heads, width, width // heads))  # fed to the QR
        self.psi = nn.Parameter(torch.empty(heads, width // heads).uniform_(0.3, 0.7))  # |l| in 0.09..0.49
        self.bias = nn.Parameter(torch.zeros(width))

    def eigenvalues(self):
        square = self.psi ** 2  # (nh, hs)
        return square if self.mode == "smooth" else -square.clamp(1e-4, 1.0)

    def orthonormal(self):
        return torch.linalg.qr(self.basis.float()).Q  # (nh, D, hs), columns orthonormal


class Attention(nn.Module):
    """Multi-head self-attention; NeuTRENO when `neutreno` > 0 and `v0` is given.

    vo_param = free uses learned W_V and W_O (plain attention); smooth or sharpen builds
    them per head from EigenValueOutput above.

    forward(x, v0=None, need_weights=False) -> (y, v, probs)
      y:     (B, T, C) the block's attention output, after W_O
      v:     (B, nh, T, hs) this layer's values if it is layer 0 (v0 None) of a NeuTRENO model:
             they become V0 for the rest; else None, as nothing reads them (returned, a compiled
             block would take a zero gradient for them in every backward)
      probs: (B, nh, T, T) attention probabilities if need_weights, else None
    """

    def __init__(self, width, heads, causal=False, neutreno=0.0, dropout=0.0, vo_param="free"):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.neutreno = neutreno
        self.dropout = dropout
        self.explicit = False  # True: softmax attention as plain ops even without need_weights (fast.py sets it)
        if vo_param == "free":
            self.qkv = nn.Linear(width, 3 * width)  # W_Q, W_K, W_V in one matmul
            self.proj = nn.Linear(width, width)     # W_O
        else:
            self.qk = nn.Linear(width, 2 * width)   # W_Q, W_K
            self.vo = EigenValueOutput(width, heads, vo_param)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x, v0=None, need_weights=False):
        B, T, C = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(C, dim=2)
            v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        else:
            q, k = self.qk(x).split(C, dim=2)
            basis = self.vo.orthonormal().to(x.dtype)
            v = torch.einsum("btd,hdk->bhtk", x, basis)  # (B, nh, T, hs): x @ Q_h per head
        q, k = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k))  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        if need_weights or self.explicit:
            y, probs = explicit_attention(q, k, v, self.causal, dropout_p)
            probs = probs if need_weights else None
        else:
            y, probs = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=self.causal), None
        if v0 is not None and self.neutreno:
            y = y + self.neutreno * (v0 - v)  # the fidelity term, per head, before W_O
        if hasattr(self, "qkv"):
            out = self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C): heads merged, then W_O
        else:  # W_O,h = diag(l_h) Q_h^T, summed over heads
            scaled = y * self.vo.eigenvalues().to(y.dtype)[None, :, None, :]
            out = torch.einsum("bhtk,hdk->btd", scaled, basis) + self.vo.bias
        return self.proj_drop(out), v if v0 is None and self.neutreno else None, probs

    def weights(self):
        """W_Q, W_K (D, D) and per head W_V (nh, D, hs), W_O (nh, hs, D), all acting as x @ W."""
        nh = self.heads
        if hasattr(self, "qkv"):
            w_q, w_k, w_v = self.qkv.weight.detach().chunk(3)  # (D_out, D_in) each
            D = w_q.shape[1]
            return {"q": w_q.T, "k": w_k.T, "v": w_v.T.reshape(D, nh, D // nh).transpose(0, 1),
                    "o": self.proj.weight.detach().T.reshape(nh, D // nh, D)}
        w_q, w_k = self.qk.weight.detach().chunk(2)
        basis = self.vo.orthonormal().detach()
        return {"q": w_q.T, "k": w_k.T, "v": basis,
                "o": self.vo.eigenvalues().detach()[..., None] * basis.transpose(1, 2)}
