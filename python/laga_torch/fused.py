"""laga_fused in torch: laga's data flow with the up-projection made inside
the flash attention call, the C++ src/mla/form_laga_fused.cpp (docs/forms.md,
"laga_fused").

What it keeps between forward and backward is the C++ form's: the rank's
queries q_h, the gathered latent lat (B, S, C+dr), flash's output o_h and
log-sum-exp lse, and never the per-head K and V of the whole sequence; its
backward makes K and V again from the latent (the up-projection twice, the
form's price). What it computes is laga's (the same products, so float64
agrees with `laga forward --form laga_fused` to rounding).

This is plain torch, not a fused kernel: K and V of the rank's heads exist
for the whole sequence while the flash call runs (forward, and again in
backward), where the C++ kernel makes them a key chunk at a time. So the
bytes kept for backward are the form's; the transient peak inside the call
is laga's.

Under bf16 the C++ form runs its fp32 kernel on the bf16 operands: K and V
are made in fp32 from the bf16 latent and wkv_b rows and never rounded to
bf16 (mla/ops_attention.cpp, fused_latent_attention_forward); so are they
here (the flash call's accumulation type).

With attention other than flash the C++ form runs laga's unfused path
(its note says so), and so does the package: only flash is fused.

The fused kernel itself is fused_triton.py (Triton, forward and backward:
K and V a key tile at a time on chip); forward() and backward() here run it
when kernel_for chooses it, and this file's torch code otherwise: it stays
the reference the Triton kernel is tested against and the fallback
wherever Triton cannot run.
"""

import enum
import logging
import os

import torch

from . import dispatch, fused_triton
from .attention import _acc_dtype, _finite, first_order_only
from .dispatch import backward as flash_backward, forward as flash_forward

_log = logging.getLogger("laga_torch")


class FusedKernel(enum.Enum):
    """Which code runs laga_fused's flash attention (kernel_for)."""
    triton = "triton"  # fused_triton.py: the up-projection inside the kernel
    torch = "torch"    # this file: K and V made for the call, then flash_forward


def _requested():
    """LAGA_FUSED_KERNEL: auto (unset or empty), triton or torch; anything
    else refused naming the variable and the values."""
    v = os.environ.get("LAGA_FUSED_KERNEL", "") or "auto"
    if v == "auto":
        return None
    try:
        return FusedKernel(v)
    except ValueError:
        raise ValueError(f"LAGA_FUSED_KERNEL={v!r}: expected auto, triton or torch") from None


def kernel_for(*tensors):
    """The kernel for a laga_fused flash call on these operands (q, lat,
    w_rows and, in backward, dO). auto: Triton where it is importable and
    runs: on a CUDA device in float32, bf16 or fp16, or under
    TRITON_INTERPRET=1 on the CPU in float32 or float64 (the interpreter's
    bf16 tl.dot is wrong, triton #11584); torch otherwise. LAGA_FUSED_KERNEL
    =triton asks for Triton and is refused, naming what is missing, where
    it cannot run. Non-finite operands always take the torch code, which
    keeps a NaN in its document (fused_triton's docstring says why)."""
    want = _requested()
    if want is FusedKernel.torch:
        return FusedKernel.torch
    q = tensors[0]
    if not fused_triton.importable():
        why = "triton is not importable (torch 1.13 from Debian has none: pip install triton)"
    elif q.device.type == "cuda":
        ok = q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        why = None if ok else f"dtype {q.dtype} on CUDA (float32, bfloat16 or float16)"
    elif q.device.type == "cpu" and fused_triton.interpreted():
        ok = q.dtype in (torch.float32, torch.float64)
        why = None if ok else (f"dtype {q.dtype} under TRITON_INTERPRET=1 (float32 or float64: "
                               "the interpreter's bf16 tl.dot is wrong, triton #11584)")
    else:
        why = (f"device {q.device.type} (CUDA, or the CPU with TRITON_INTERPRET=1 set before "
               "importing laga_torch)")
    if why is not None:
        if want is FusedKernel.triton:
            raise ValueError(f"LAGA_FUSED_KERNEL=triton: laga_fused's Triton kernel cannot run "
                             f"here: {why}; unset it (auto) or set it to torch")
        return FusedKernel.torch
    if not _finite(*tensors):
        return FusedKernel.torch
    return FusedKernel.triton


def _chosen(kernel, what):
    _log.debug("laga_fused %s: %s kernel", what, kernel.value)
    return kernel


def up_project(lat, w_rows, cfg):
    """k (B, Sk, nh, dqk) and v (B, Sk, nh, dv) of the rank's nh heads from
    the gathered latent lat (B, Sk, C+dr) and their rows of wkv_b
    (nh (dn+dv), C), in the flash call's accumulation type (bf16: fp32)."""
    C, dn, dr = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    acc = _acc_dtype(lat.dtype)
    lat, w_rows = lat.to(acc), w_rows.to(acc)
    B, Sk = lat.shape[:2]
    nh = w_rows.shape[0] // (dn + cfg.v_head_dim)
    kv = (lat[..., :C] @ w_rows.t()).view(B, Sk, nh, dn + cfg.v_head_dim)
    k = torch.cat([kv[..., :dn], lat[:, :, None, C:].expand(B, Sk, nh, dr)], -1)
    return k, kv[..., dn:].contiguous()


def up_project_backward(dk, dv, lat, w_rows, cfg):
    """The up-projection's adjoint: (d lat (B, Sk, C+dr) in lat's type, d
    w_rows (nh (dn+dv), C) in w_rows' type) from dk, dv of up_project's k, v;
    d k_pe is the sum over heads (k_pe is every head's)."""
    C, dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    acc = _acc_dtype(lat.dtype)
    B, Sk = lat.shape[:2]
    dkv = torch.cat([dk[..., :dn].to(acc), dv.to(acc)], -1).reshape(B, Sk, -1)
    d_lat = torch.cat([dkv @ w_rows.to(acc), dk[..., dn:].to(acc).sum(2)], -1)
    d_w = dkv.flatten(0, 1).t() @ lat[..., :C].to(acc).flatten(0, 1)
    return d_lat.to(lat.dtype), d_w.to(w_rows.dtype)


def forward(q, lat, w_rows, ranges, scale, block, cfg):
    """o (B, Sq, nh, dv) and lse of flash attention over keys made from lat
    (block: the torch code's tile; the Triton kernel has its own)."""
    if _chosen(kernel_for(q, lat, w_rows), "forward") is FusedKernel.triton:
        return fused_triton.forward(q, lat, w_rows, ranges, scale, cfg)
    k, v = up_project(lat, w_rows, cfg)
    return flash_forward(q, k, v, ranges, scale, block)


def backward(q, lat, w_rows, o, lse, do, ranges, scale, block, cfg):
    """(dq, d lat, d w_rows) from what forward kept: K and V made again."""
    if _chosen(kernel_for(q, lat, w_rows, do), "backward") is FusedKernel.triton:
        return fused_triton.backward(q, lat, w_rows, o, lse, do, ranges, scale, cfg)
    k, v = up_project(lat, w_rows, cfg)
    dq, dk, dv = flash_backward(q, k, v, o, lse, do, ranges, scale, block)
    del k, v
    d_lat, d_w = up_project_backward(dk, dv, lat, w_rows, cfg)
    return dq, d_lat, d_w


class LatentFlash(torch.autograd.Function):
    """The functional layer's (tape "autograd") laga_fused attention: saves
    q, lat, w_rows, o and lse, no K or V. First derivatives only: a second
    backward (create_graph=True through it) raises an error naming this
    kernel and what to use instead (first_order_only), never a wrong
    number."""

    @staticmethod
    def forward(ctx, q, lat, w_rows, ranges, scale, block, cfg):
        o, lse = forward(q, lat, w_rows, ranges, scale, block, cfg)
        ctx.save_for_backward(q, lat, w_rows, o, lse)
        ctx.ranges, ctx.scale, ctx.block, ctx.cfg = ranges, scale, block, cfg
        ctx.dispatch = dispatch.current()
        return o

    @staticmethod
    @first_order_only("laga_fused's flash kernel (MLA(form='laga_fused') with flash attention)",
                      "form='laga' (the same numbers, K and V kept) or eager attention on "
                      "tape='autograd'")
    def backward(ctx, do):
        q, lat, w_rows, o, lse = ctx.saved_tensors
        with dispatch.context(*ctx.dispatch):
            dq, d_lat, d_w = backward(q, lat, w_rows, o, lse, do, ctx.ranges, ctx.scale,
                                      ctx.block, ctx.cfg)
        return dq, d_lat, d_w, None, None, None, None
