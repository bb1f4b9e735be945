"""The varlen kernels of the attention dispatch (dispatch.py; docs/pytorch.md,
"The attention dispatch"): FlashAttention-4 (flash_attn.cute), FlashAttention-3
(flash_attn_interface), cuDNN SDPA and the memory-efficient SDPA kernel
through torch.ops.aten's varlen entry points. None of them has run for real:
this machine has no GPU; the adapters are tested against stand-ins with the
kernels' signatures and lse layouts (tests/tools/test_torch_dispatch_varlen.py).

The adapter turns the package's call (q (B, Sq, H, dqk), k (B, Sk, Hk, dqk),
v (B, Sk, Hk, dv), key ranges: row i sees keys [lo, hi)) into packed
documents: the rows split into runs, each a rectangle of queries over one key
range, either "full" (every row sees the same keys: a ring's earlier shard)
or "causal" (row j of the run sees one key more than row j-1, the diagonal
aligned bottom-right as FlashAttention aligns Sq != Sk). Runs become the
varlen call's sequences (cu_seqlens_q/k: queries and keys gathered in run
order, [T, H, D]); one call per mask kind present (at most two); rows that
see no key get o = 0, lse = 0 without a kernel. Never a dense mask, never V
padded to dqk. The kernel's lse comes back to (B, H, Sq) in the accumulation
type (the layout the ring forms merge with).
"""

import enum
import importlib
import inspect

import torch


class Mask(enum.Enum):
    full = 0
    causal = 1


class Runs:
    """The call's rows as varlen sequences: for each mask kind, the runs
    (b, q0, q1, k0, k1) in order; built from the key ranges' host copies."""

    def __init__(self, kr):
        lo, hi = kr.lo_h.tolist(), kr.hi_h.tolist()
        self.by_mask = {Mask.full: [], Mask.causal: []}
        loose = []  # one-row runs: either kind
        for b, (los, his) in enumerate(zip(lo, hi)):
            i, n = 0, len(los)
            while i < n:
                if los[i] >= his[i]:
                    i += 1
                    continue
                j, step = i + 1, None
                while j < n and los[j] == los[i] and los[j] < his[j]:
                    d = his[j] - his[j - 1]
                    if d not in (0, 1) or (step is not None and d != step):
                        break
                    step = d
                    j += 1
                run = (b, i, j, los[i], his[j - 1])
                if step is None:
                    loose.append(run)
                else:
                    self.by_mask[Mask.causal if step else Mask.full].append(run)
                i = j
        # One-row runs join a kind present (one call where possible).
        home = Mask.causal if self.by_mask[Mask.causal] or not self.by_mask[Mask.full] \
            else Mask.full
        self.by_mask[home] = sorted(self.by_mask[home] + loose)

    def calls(self):
        return [(m, r) for m, r in self.by_mask.items() if r]


def _pack(q, k, v, runs):
    """Packed [T, H, D] operands, cu_seqlens (int32), max lengths, and the
    (b, row) index of each packed query row."""
    dev = q.device
    qb = torch.tensor([b for b, q0, q1, _, _ in runs for _ in range(q1 - q0)], device=dev)
    qi = torch.tensor([i for _, q0, q1, _, _ in runs for i in range(q0, q1)], device=dev)
    kb = torch.tensor([b for b, _, _, k0, k1 in runs for _ in range(k1 - k0)], device=dev)
    ki = torch.tensor([i for _, _, _, k0, k1 in runs for i in range(k0, k1)], device=dev)
    lq = [q1 - q0 for _, q0, q1, _, _ in runs]
    lk = [k1 - k0 for _, _, _, k0, k1 in runs]
    cu_q = torch.tensor([0] + lq, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lk, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return (q[qb, qi], k[kb, ki], v[kb, ki], cu_q, cu_k, max(lq), max(lk), (qb, qi), (kb, ki))


def _lse_ht(lse, H, T):
    """The kernel's lse as (H, T): FlashAttention-3/4 and cuDNN's varlen
    calls return (H, T); a release returning (T, H) is turned."""
    if tuple(lse.shape) == (H, T):
        return lse
    if tuple(lse.shape) == (T, H):
        return lse.t()
    raise ValueError(f"varlen kernel returned lse of shape {tuple(lse.shape)}: expected "
                     f"({H}, {T}) or ({T}, {H}); this adapter does not know that release")


# --------------------------------------------------------------------------
# The kernels' calls: packed q (T, H, dqk), k (Tk, Hk, dqk), v (Tk, Hk, dv)
# -> out (T, H, dv), lse (H, T); each differentiable where backward is asked.
# --------------------------------------------------------------------------

def fa3_module():
    try:
        return importlib.import_module("flash_attn_interface")
    except ImportError:
        return None


def fa4_module():
    try:
        return importlib.import_module("flash_attn.cute")
    except ImportError:
        return None


def _fa3(q, k, v, cu_q, cu_k, mq, mk, causal, scale):
    fn = fa3_module().flash_attn_varlen_func
    kw = {}
    if "return_attn_probs" in inspect.signature(fn).parameters:
        kw["return_attn_probs"] = True  # newer releases return (out, lse) only then
    res = fn(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=scale, causal=causal, **kw)
    return res[0], _lse_ht(res[1], q.shape[1], q.shape[0])


def _fa4(q, k, v, cu_q, cu_k, mq, mk, causal, scale):
    out, lse = fa4_module().flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk,
        softmax_scale=scale, causal=causal, return_lse=True)
    return out, _lse_ht(lse, q.shape[1], q.shape[0])


# torch.ops.aten's entry points, looked up per call (a test puts stand-ins
# with the same signatures here).
ATEN = {
    "cudnn": lambda: torch.ops.aten._cudnn_attention_forward,
    "cudnn_backward": lambda: torch.ops.aten._cudnn_attention_backward,
    "efficient": lambda: torch.ops.aten._efficient_attention_forward,
    "efficient_backward": lambda: torch.ops.aten._efficient_attention_backward,
}
# _efficient_attention_forward's custom_mask_type (xformers' convention):
# 0 none, 1 causal from the top left, 2 causal from the bottom right.
_EFF_MASK = {Mask.full: 0, Mask.causal: 2}


class _Cudnn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, mq, mk, causal, scale):
        res = ATEN["cudnn"]()(q, k, v, None, cu_q, cu_k, mq, mk, True, 0.0, causal, False,
                              scale=scale)
        out, lse = res[0], res[1]
        ctx.save_for_backward(q, k, v, out, lse, res[6], res[7], cu_q, cu_k)
        ctx.args = (mq, mk, causal, scale)
        return out, _lse_ht(lse, q.shape[1], q.shape[0])

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, out, lse, seed, offset, cu_q, cu_k = ctx.saved_tensors
        mq, mk, causal, scale = ctx.args
        dq, dk, dv = ATEN["cudnn_backward"]()(do.contiguous(), q, k, v, out, lse, seed, offset,
                                              torch.empty(0, device=q.device), cu_q, cu_k,
                                              mq, mk, 0.0, causal, scale=scale)
        return dq, dk, dv, None, None, None, None, None, None


def _cudnn(q, k, v, cu_q, cu_k, mq, mk, causal, scale):
    return _Cudnn.apply(q, k, v, cu_q, cu_k, mq, mk, causal, scale)


class _Efficient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, mq, mk, causal, scale):
        mask = _EFF_MASK[Mask.causal if causal else Mask.full]
        res = ATEN["efficient"]()(q[None], k[None], v[None], None, cu_q, cu_k, mq, mk, 0.0,
                                  mask, True, scale=scale)
        out, lse = res[0], res[1]  # (1, T, H, dv); (sequences, H, max_q rounded up to 32)
        ctx.save_for_backward(q, k, v, out, lse, res[2], res[3], cu_q, cu_k)
        ctx.args = (mq, mk, mask, scale)
        # lse[s, h, j] is row j of sequence s: gather each packed row's.
        T = q.shape[0]
        seq = torch.searchsorted(cu_q[1:].long(), torch.arange(T, device=q.device),
                                 right=True)
        pos = torch.arange(T, device=q.device) - cu_q.long()[seq]
        return out[0], lse[seq, :, pos].t()

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, out, lse, seed, offset, cu_q, cu_k = ctx.saved_tensors
        mq, mk, mask, scale = ctx.args
        dq, dk, dv, _ = ATEN["efficient_backward"]()(
            do[None].contiguous(), q[None], k[None], v[None], None, out, cu_q, cu_k, mq, mk,
            lse, 0.0, seed, offset, mask, False, scale=scale)
        return dq[0], dk[0], dv[0], None, None, None, None, None, None


def _efficient(q, k, v, cu_q, cu_k, mq, mk, causal, scale):
    return _Efficient.apply(q, k, v, cu_q, cu_k, mq, mk, causal, scale)


CALLS = {"fa3": _fa3, "fa4": _fa4, "cudnn": _cudnn, "efficient": _efficient}


def _run(name, q, k, v, kr, scale, acc):
    """o (B, Sq, H, dv) in q's dtype and lse (B, H, Sq) in acc, differentiable
    in q, k, v through the kernel's own backward."""
    B, Sq, H, _ = q.shape
    o = q.new_zeros(B, Sq, H, v.shape[3])
    lse = torch.zeros(B, H, Sq, dtype=acc, device=q.device)
    for mask, runs in Runs(kr).calls():
        qp, kp, vp, cu_q, cu_k, mq, mk, (qb, qi), _ = _pack(q, k, v, runs)
        out, l_ht = CALLS[name](qp, kp, vp, cu_q, cu_k, mq, mk, mask is Mask.causal, scale)
        o = o.index_put((qb, qi), out.to(q.dtype))
        lse = lse.transpose(1, 2).index_put((qb, qi), l_ht.t().to(acc)).transpose(1, 2)
    return o, lse


def forward(name, q, k, v, kr, scale, acc):
    with torch.no_grad():
        return _run(name, q.detach(), k.detach(), v.detach(), kr, scale, acc)


def backward(name, q, k, v, do, kr, scale, acc):
    """dq, dk, dv: the call recomputed through the kernel's autograd (its own
    backward), dO scattered to the packed rows (rows that see no key: none)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        o, _ = _run(name, *leaves, kr, scale, acc)
        grads = torch.autograd.grad(o, leaves, do.to(o.dtype), allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
