"""Causal (in-document) attention of query rows over keys [0, Sk).

q (B, Sq, H, dqk), k (B, Sk, Hk, dqk), v (B, Sk, Hk, dv) with Hk = H, or
Hk = 1 (absorbed's one latent head shared by every query head). `mask`
(B, 1, Sq, Sk) bool, True where query i may see key j: j <= i and j in i's
document. dv may differ from dqk: V is never padded.

Two paths: torch's scaled_dot_product_attention where torch has it (on GPU
torch picks flash / cuDNN / memory-efficient kernels), and a math path as an
autograd.Function that saves what laga's eager kernel saves (q, k, v and the
probabilities; docs/forms.md "What each form saves") for torch without SDPA
or when asked for (`kind="math"`).
"""

import torch
import torch.nn.functional as F


def math_forward(q, k, v, mask, scale):
    """o (B, Sq, H, dv) and the probabilities (B, H, Sq, Sk) eager saves."""
    H = q.shape[2]
    # scores (B, H, Sq, Sk); k's head axis broadcasts when Hk = 1.
    s = torch.einsum("bihd,bjhd->bhij", q, k.expand(-1, -1, H, -1)) * scale
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", p, v.expand(-1, -1, H, -1)), p


def math_backward(q, k, v, p, do, scale):
    H = q.shape[2]
    ke, ve = k.expand(-1, -1, H, -1), v.expand(-1, -1, H, -1)
    dv = torch.einsum("bhij,bihd->bjhd", p, do)
    dp = torch.einsum("bihd,bjhd->bhij", do, ve)
    # softmax backward: dS = P (dP - rowsum(dP * P))
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
    dq = torch.einsum("bhij,bjhd->bihd", ds, ke)
    dk = torch.einsum("bhij,bihd->bjhd", ds, q)
    if k.shape[2] == 1 and H != 1:  # the shared head's gradient is every head's sum
        dk, dv = dk.sum(2, keepdim=True), dv.sum(2, keepdim=True)
    return dq, dk, dv


class _MathAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        o, p = math_forward(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        return math_backward(*ctx.saved_tensors, do, ctx.scale) + (None, None)


def no_attention(q, k, v):
    """The empty output of a rank that attends nothing, still joined to q, k
    and v in the graph: its backward must reach the collectives that made
    them, which every rank has to enter."""
    return q.new_zeros(q.shape[:3] + (v.shape[3],)) + 0 * (q.sum() + k.sum() + v.sum())


def has_sdpa():
    return hasattr(F, "scaled_dot_product_attention")


def attention(q, k, v, mask, scale, kind="auto"):
    """Returns o (B, Sq, H, dv). kind: "auto" (SDPA where torch has it, else
    math), "sdpa" or "math"."""
    if q.shape[2] == 0 or q.shape[1] == 0:  # a rank without heads or query rows
        return no_attention(q, k, v)
    if kind == "auto":
        kind = "sdpa" if has_sdpa() else "math"
    if kind == "math":
        return _MathAttention.apply(q, k, v, mask, scale)
    if kind != "sdpa":
        raise ValueError(f"attention kind '{kind}': expected auto, sdpa or math")
    if not has_sdpa():
        raise ValueError("attention kind 'sdpa': this torch has no "
                         "scaled_dot_product_attention; use 'math' or 'auto'")
    H = q.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = k.expand(-1, -1, H, -1).transpose(1, 2), v.expand(-1, -1, H, -1).transpose(1, 2)
    try:  # torch >= 2.1 takes the scale
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    except TypeError:  # torch 2.0: fold the scale into q (SDPA divides by sqrt(dqk))
        o = F.scaled_dot_product_attention(qt * (scale * q.shape[3] ** 0.5), kt, vt,
                                           attn_mask=mask)
    return o.transpose(1, 2)
