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
type (the layout the ring forms merge with). Backward starts from the o and
lse the forward kept, a ring step's merged row's (merged_backward).
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


def _cudnn(q, k, v, cu_q, cu_k, mq, mk, causal, scale):
    res = ATEN["cudnn"]()(q, k, v, None, cu_q, cu_k, mq, mk, True, 0.0, causal, False,
                          scale=scale)
    return res[0], _lse_ht(res[1], q.shape[1], q.shape[0])


def _rows_in_sequences(cu_q, T):
    """(sequence, row within it) of each packed row."""
    t = torch.arange(T, device=cu_q.device)
    seq = torch.searchsorted(cu_q[1:].long(), t, right=True)
    return seq, t - cu_q.long()[seq]


def _efficient(q, k, v, cu_q, cu_k, mq, mk, causal, scale):
    mask = _EFF_MASK[Mask.causal if causal else Mask.full]
    res = ATEN["efficient"]()(q[None], k[None], v[None], None, cu_q, cu_k, mq, mk, 0.0, mask,
                              True, scale=scale)
    # out (1, T, H, dv); lse (sequences, H, max_q rounded up to 32): lse[s, h, j]
    # is row j of sequence s, gathered per packed row.
    seq, pos = _rows_in_sequences(cu_q, q.shape[0])
    return res[0][0], res[1][seq, :, pos].t()


CALLS = {"fa3": _fa3, "fa4": _fa4, "cudnn": _cudnn, "efficient": _efficient}


def _run(name, q, k, v, kr, scale, acc):
    """o (B, Sq, H, dv) in q's dtype and lse (B, H, Sq) in acc (o
    differentiable in q, k, v where the kernel's function is: FlashAttention's)."""
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


def merged_backward(call, q, k, v, o, lse, do, sees, scale, acc):
    """dq, dk, dv of one call whose rows may be part of a larger softmax (a
    ring's step: o and lse are the merged row's, as ring_backward passes
    them), through a kernel that can only recompute its own o_l, lse_l under
    autograd (FlashAttention's public functions, flex): lse's gradient is
    not propagated by them, and its backward forms D = dO . o_l, not the
    merged row's D = dO . o.

    With w = exp(lse_l - lse) (the row's share of the merged softmax:
    P = w P_l) and c = dO . (o_l - o), the gradient is that of o_l with
    upstream w dO, plus dS_ij = P_ij c_i more: dq_i += scale c_i w_i (P_l K)_i,
    dk_j += scale sum_i P_l,ij (w_i c_i q_i), i.e. a second call with K as
    the values (its output, and its value gradient for upstream w c q).
    For a call that is its own row (w = 1, c = 0 up to rounding) this is the
    plain backward. sees: (B, Sq) rows that see a key."""
    sees3 = sees[:, None, :]  # (B, 1, Sq) against lse's (B, H, Sq)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        o_l, lse_l = call(*leaves)
        w = torch.where(sees3, torch.exp(lse_l.detach().to(acc) - lse.to(acc)),
                        lse.new_zeros((), dtype=acc))
        w = w.transpose(1, 2)[..., None]  # (B, Sq, H, 1)
        grads = torch.autograd.grad(o_l, leaves, (w * do.to(acc)).to(o_l.dtype),
                                    allow_unused=True)
        dq, dk, dv = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
        c = (do.to(acc) * (o_l.detach().to(acc) - o.to(acc))).sum(-1, keepdim=True)
        c = torch.where(sees[:, :, None, None], c, c.new_zeros(()))
        kv = k.detach().requires_grad_(True)
        o2, _ = call(q.detach(), k.detach(), kv)
        (dk2,) = torch.autograd.grad(o2, [kv], (w * c * q.to(acc)).to(o2.dtype),
                                     allow_unused=True)
    dq = dq + (scale * w * c * o2.detach().to(acc)).to(dq.dtype)
    if dk2 is not None:
        dk = dk + scale * dk2
    return dq, dk, dv


def _given_rows(o, lse, qb, qi, acc):
    """The forward's (merged) o and lse at the packed rows: (T, H, dv), (H, T)."""
    return o[qb, qi], lse.transpose(1, 2)[qb, qi].t().to(acc)


def _sdpa_backward(name, q, k, v, o, lse, do, kr, scale, acc):
    """cuDNN / the memory-efficient kernel: their backward ops take o and lse,
    so they get the forward's (a ring's merged row's) as they are, in their
    layout; the forward runs once more for the philox state they also take
    (dropout 0: unused by the math)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for mask, runs in Runs(kr).calls():
        qp, kp, vp, cu_q, cu_k, mq, mk, (qb, qi), (kb, ki) = _pack(q, k, v, runs)
        op, lp = _given_rows(o, lse, qb, qi, acc)
        dop = do[qb, qi].contiguous()
        causal = mask is Mask.causal
        if name == "cudnn":
            res = ATEN["cudnn"]()(qp, kp, vp, None, cu_q, cu_k, mq, mk, True, 0.0, causal,
                                  False, scale=scale)
            lse_k = lp if tuple(res[1].shape) == tuple(lp.shape) else lp.t()
            g = ATEN["cudnn_backward"]()(dop, qp, kp, vp, op.contiguous(), lse_k.contiguous(),
                                         res[6], res[7], torch.empty(0, device=q.device),
                                         cu_q, cu_k, mq, mk, 0.0, causal, scale=scale)
        else:
            em = _EFF_MASK[mask]
            res = ATEN["efficient"]()(qp[None], kp[None], vp[None], None, cu_q, cu_k, mq, mk,
                                      0.0, em, True, scale=scale)
            lse_k = torch.zeros_like(res[1])  # (sequences, H, max_q rounded up to 32)
            seq, pos = _rows_in_sequences(cu_q, qp.shape[0])
            lse_k[seq, :, pos] = lp.t().to(lse_k.dtype)
            g = ATEN["efficient_backward"]()(
                dop[None], qp[None], kp[None], vp[None], None, op[None].contiguous(), cu_q,
                cu_k, mq, mk, lse_k, 0.0, res[2], res[3], em, False, scale=scale)
            g = [t[0] for t in g[:3]]
        dq = dq.index_put((qb, qi), g[0].to(q.dtype), accumulate=True)
        dk = dk.index_put((kb, ki), g[1].to(k.dtype), accumulate=True)
        dv = dv.index_put((kb, ki), g[2].to(v.dtype), accumulate=True)
    return dq, dk, dv


def backward(name, q, k, v, o, lse, do, kr, scale, acc):
    """dq, dk, dv of the call, o and lse the forward's (a ring step's merged
    row's): cuDNN and the memory-efficient kernel take them in their backward;
    FlashAttention's public functions recompute (merged_backward)."""
    if name in ("cudnn", "efficient"):
        return _sdpa_backward(name, q, k, v, o, lse, do, kr, scale, acc)
    return merged_backward(lambda a, b, c: _run(name, a, b, c, kr, scale, acc), q, k, v, o, lse,
                           do, kr.lo < kr.hi, scale, acc)
