"""Self-attention with the NeuTRENO fidelity term as a toggle.

NeuTRENO (Nguyen, Nguyen & Baraniuk, NeurIPS 2023, "Mitigating Over-smoothing in
Transformers via Regularized Nonlocal Functionals") reads softmax attention as one
gradient step on a nonlocal smoothness functional and adds a fidelity term that pulls
every layer back towards the first layer's values. For layer l >= 1 and head h:

    O_h = softmax(Q_h K_h^T / sqrt(d_h)) V_h + lam * (V0_h - V_h)

exactly as the authors' code does it (NeuTRENO section 3):
  * the term is added per head, before the heads are merged and before W_O;
  * V0 is layer 0's value tensor (its qkv projection, bias included, applied to layer 0's
    normalised input) and it is not detached: every later layer sends gradient into it
    (Config.neutreno_detach cuts that path, for an ablation; the forward stays the same);
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

def attention_probabilities(q, k, causal=False):
    """softmax(q k^T / sqrt(d)) (B, nh, T, T) of q and k (B, nh, T, hs), causal if asked."""
    scores = (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)  # (B, nh, T, T); scaling q: cheaper
    if causal:
        future = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1)


def explicit_attention(q, k, v, causal=False, dropout_p=0.0):
    """softmax(q k^T / sqrt(d)) v and the (B, nh, T, T) probabilities: the math of
    F.scaled_dot_product_attention, materialised (the probe needs it; short sequences gain)."""
    probs = attention_probabilities(q, k, causal)
    return F.dropout(probs, dropout_p) @ v, probs


class EigenValueOutput(nn.Module):
    """W_V W_O of every head from its eigendecomposition (Dovonon, Bronstein & Kusner, TMLR 2025).

    Per head h, H_h = W_V,h W_O,h = Q_h diag(l_h) Q_h^T with Q_h (D, hs) orthonormal, so
    l_h are exactly H_h's non-zero eigenvalues:
      smooth:  l = psi^2                        every eigenvalue > 0: the layer smooths
      sharpen: l = -clip(psi^2, 1e-4, 1)        every eigenvalue in [-1, 0): the layer sharpens
    Choices where the paper leaves details open:
      * the split: W_V,h = Q_h (orthonormal, values keep their norm) and W_O,h = diag(l_h) Q_h^T,
        so the eigenvalues sit in the output projection, next to where NeuTRENO adds its term;
      * the clip: a gain beyond 1 per layer would blow the residual stream up (psi's gradient is
        zero once clipped); Block drops the LayerNorm gain, whose sign could flip l.
    """

    def __init__(self, width, heads, mode):
        super().__init__()
        self.mode = mode
        self.basis = nn.Parameter(torch.randn(heads, width, width // heads))  # fed to the QR
        self.psi = nn.Parameter(torch.empty(heads, width // heads).uniform_(0.3, 0.7))  # |l| < 0.5
        self.bias = nn.Parameter(torch.zeros(width))

    def eigenvalues(self):
        square = self.psi ** 2  # (nh, hs)
        return square if self.mode == "smooth" else -square.clamp(1e-4, 1.0)


class Attention(nn.Module):
    """Multi-head self-attention; NeuTRENO when `neutreno` > 0 and `v0` is given.

    W_Q, W_K, W_V are one Linear (qkv), W_O another (proj); EigenAttention builds W_V and W_O from
    eigenvalues instead, both reaching forward() through projections(). explicit: attention as
    matmul-softmax-matmul even without need_weights (operations/fast.py picks it where it pays).

    forward(x, v0=None, need_weights=False) -> (y, v, probs)
      y:     (B, T, C) the block's attention output, after W_O
      v:     (B, nh, T, hs) this layer's values if it is layer 0 (v0 None) of a NeuTRENO model:
             they become V0 for the rest; else None, as nothing reads them
      probs: (B, nh, T, T) attention probabilities if need_weights, else None"""

    def __init__(self, width, heads, causal=False, neutreno=0.0, dropout=0.0, explicit=False):
        super().__init__()
        self.heads, self.causal, self.neutreno, self.dropout = heads, causal, neutreno, dropout
        self.explicit = explicit
        self.build_projections(width, heads)
        self.proj_drop = nn.Dropout(dropout)

    def build_projections(self, width, heads):
        self.qkv = nn.Linear(width, 3 * width)  # W_Q, W_K, W_V in one matmul
        self.proj = nn.Linear(width, width)  # W_O

    def projections(self):
        """(W_qkv (3C, C), b_qkv (3C,), W_O (C, C), b_O (C,)), as F.linear takes them."""
        return self.qkv.weight, self.qkv.bias, self.proj.weight, self.proj.bias

    def forward(self, x, v0=None, need_weights=False):
        B, T, C = x.shape
        w_qkv, b_qkv, w_o, b_o = self.projections()
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
                   for t in F.linear(x, w_qkv, b_qkv).split(C, dim=2))
        dropout_p = self.dropout if self.training else 0.0
        if need_weights or self.explicit:
            y, probs = explicit_attention(q, k, v, self.causal, dropout_p)
            probs = probs if need_weights else None
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=self.causal)
            probs = None
        if v0 is not None and self.neutreno:
            y = y + self.neutreno * (v0 - v)  # the fidelity term, per head, before W_O
        out = F.linear(y.transpose(1, 2).reshape(B, T, C), w_o, b_o)  # heads merged, then W_O
        # v only where NeuTRENO reads it: compiled, an unread output would take a zero gradient
        return self.proj_drop(out), v if v0 is None and self.neutreno else None, probs

    def weights(self):
        """W_Q, W_K (D, D) and per head W_V (nh, D, hs), W_O (nh, hs, D), all acting as x @ W."""
        w_qkv, _, w_o, _ = (t.detach() for t in self.projections())
        D, nh = w_o.shape[0], self.heads
        w_q, w_k, w_v = w_qkv.chunk(3)  # (D_out, D_in) each
        return {"q": w_q.T, "k": w_k.T, "v": w_v.T.reshape(D, nh, D // nh).transpose(0, 1),
                "o": w_o.T.reshape(nh, D // nh, D)}


class EigenAttention(Attention):
    """Attention whose per-head W_V W_O smooths or sharpens by construction: EigenValueOutput's Q_h
    and diag(l_h) Q_h^T laid out as the W_qkv and W_O that Attention.forward applies."""

    def __init__(self, width, heads, mode, **kwargs):
        self.mode = mode  # read by build_projections, which Attention.__init__ calls
        super().__init__(width, heads, **kwargs)

    def build_projections(self, width, heads):
        self.qk = nn.Linear(width, 2 * width)  # W_Q, W_K
        self.vo = EigenValueOutput(width, heads, self.mode)

    def projections(self):
        basis = torch.linalg.qr(self.vo.basis.float()).Q  # (nh, D, hs): Q_h, orthonormal columns
        nh, D, hs = basis.shape
        w_v = basis.transpose(1, 2).reshape(nh * hs, D)  # head h's rows: Q_h^T, so x @ Q_h
        w_qkv = torch.cat([self.qk.weight, w_v.to(self.qk.weight.dtype)])
        b_qkv = torch.cat([self.qk.bias, self.qk.bias.new_zeros(D)])
        scaled = basis * self.vo.eigenvalues()[:, None, :]  # (nh, D, hs): Q_h diag(l_h)
        w_o = scaled.permute(1, 0, 2).reshape(D, nh * hs)  # sum over heads of diag(l_h) Q_h^T
        return w_qkv, b_qkv, w_o.to(self.vo.bias.dtype), self.vo.bias
