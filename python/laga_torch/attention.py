"""Causal (in-document) attention of query rows over keys [0, Sk).

q (B, Sq, H, dqk), k (B, Sk, Hk, dqk), v (B, Sk, Hk, dv) with Hk = H, or
Hk = 1 (absorbed's one latent head shared by every query head). `mask`
(B, 1, Sq, Sk) bool, True where query i may see key j: j <= i and j in i's
document. dv may differ from dqk: V is never padded.

Three paths: torch's scaled_dot_product_attention where torch has it (on GPU
torch picks flash / cuDNN / memory-efficient kernels); a math path as an
autograd.Function that saves what laga's eager kernel saves (q, k, v and the
probabilities; docs/forms.md "What each form saves") for torch without SDPA
or when asked for (`kind="math"`, or "eager"); and flash (`kind="flash"`,
below): the C++ --attention flash in torch ops, an online softmax over key
blocks saving q, k, v, o and the log-sum-exp per row, backward recomputing
each tile's probabilities from it.
"""

import torch
import torch.nn.functional as F


def _selected_einsum(eq, x, y, see):
    """einsum(eq, x, y) of a (B, H, Sq, Sk) pair operand x against a row or
    key operand y, each output summed over the pairs `see` (B, 1, Sq, Sk)
    selects only: x is selected to 0 at the other pairs, and a non-finite
    entry of y reaches only the outputs whose seen pairs meet it (NaN there),
    never another document's through 0 * NaN (docs/reliability.md,
    "Non-finite values": selected, not multiplied by 0)."""
    x = torch.where(see, x, x.new_zeros(()))
    bad = ~torch.isfinite(y)
    out = torch.einsum(eq, x, y.masked_fill(bad, 0))
    hit = torch.einsum(eq, see.expand_as(x).to(x.dtype), bad.to(x.dtype)) > 0
    return out.masked_fill(hit, float("nan"))


def _einsum_seen(eq, x, y, see):
    """einsum(eq, x, y) over the seen pairs: dense where see is None (every
    operand finite, x exactly 0 at unseen pairs: the same sum)."""
    return torch.einsum(eq, x, y) if see is None else _selected_einsum(eq, x, y, see)


def math_forward(q, k, v, mask, scale):
    """o (B, Sq, H, dv) and the probabilities (B, H, Sq, Sk) eager saves.
    Masked pairs are selected out of every sum: with a non-finite q, k or v
    the probabilities are selected to 0 off the mask and P V sums over the
    seen keys only, so a NaN stays in its document and its causal future."""
    H = q.shape[2]
    # scores (B, H, Sq, Sk); k's head axis broadcasts when Hk = 1.
    s = torch.einsum("bihd,bjhd->bhij", q, k.expand(-1, -1, H, -1)) * scale
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    ve = v.expand(-1, -1, H, -1)
    see = None if _finite(q, k, v) else mask
    if see is not None:
        p = torch.where(mask, p, p.new_zeros(()))
    return _einsum_seen("bhij,bjhd->bihd", p, ve, see), p


def math_backward(q, k, v, p, do, scale, delta=None, see=None):
    """dq, dk, dv from the probabilities p. delta (B, H, Sq): the rows'
    D = do . o when p covers only part of each row's keys (a ring step's
    block, its p rescaled to the whole row's normalisation); None: the
    rowsum of dP * P over the keys given, which is D when they are all.
    see: the (B, 1, Sq, Sk) mask p was taken under (or a callable giving
    it), read only when an operand is non-finite: then every sum runs over
    the seen pairs only (None: the pairs where p != 0)."""
    H = q.shape[2]
    ke, ve = k.expand(-1, -1, H, -1), v.expand(-1, -1, H, -1)
    if _finite(q, k, v, do, p) and (delta is None or _finite(delta)):
        see = None
    else:
        see = see() if callable(see) else see
        see = (p != 0).any(1, keepdim=True) if see is None else see
    dv = _einsum_seen("bhij,bihd->bjhd", p, do, see)
    dp = torch.einsum("bihd,bjhd->bhij", do, ve)
    if see is not None:
        dp = torch.where(see, dp, dp.new_zeros(()))
        p = torch.where(see, p, p.new_zeros(()))
    # softmax backward: dS = P (dP - rowsum(dP * P))
    D = (dp * p).sum(-1, keepdim=True) if delta is None else delta[..., None]
    ds = p * (dp - D) * scale
    if see is not None:
        ds = torch.where(see, ds, ds.new_zeros(()))
    dq = _einsum_seen("bhij,bjhd->bihd", ds, ke, see)
    dk = _einsum_seen("bhij,bihd->bjhd", ds, q, see)
    if k.shape[2] == 1 and H != 1:  # the shared head's gradient is every head's sum
        dk, dv = dk.sum(2, keepdim=True), dv.sum(2, keepdim=True)
    return dq, dk, dv


def first_order_only(what, instead):
    """backward's decorator for a Function whose backward is hand-written
    and not itself differentiable: with create_graph=True the gradients come
    back, but differentiating them again raises an error naming `what` and
    what to use `instead` (torch's once_differentiable, with a message that
    says what to do), never a second derivative that is None or wrong."""
    from torch._C import _functions

    def wrap(fn):
        def backward(ctx, *grads):
            with torch.no_grad():
                out = fn(ctx, *grads)
            if not torch.is_grad_enabled():
                return out
            tup = out if isinstance(out, tuple) else (out,)
            if not any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads) and \
                    not any(isinstance(t, torch.Tensor) and t.requires_grad
                            for t in ctx.saved_tensors):
                return out
            err = _functions.DelayedError(
                f"laga_torch: {what} has no second derivative (its backward is hand-written); "
                f"double backward (create_graph=True, then a gradient of the gradient) needs "
                f"{instead}".encode(), len(tup))

            def leaf(t):
                if t is None:
                    return t
                t = t.detach()
                t.requires_grad = True
                return t
            res = err(*[leaf(t) for t in tup])
            res = res if isinstance(res, tuple) else (res,)
            return res if isinstance(out, tuple) else res[0]
        return backward
    return wrap


def _recompute_backward(q, k, v, see, do, scale):
    """dq, dk, dv as differentiable functions of q, k, v and do (the math
    path recomputed under autograd): the double backward of both attention
    Functions, whose first backward reads what forward saved."""
    _, p = math_forward(q, k, v, see, scale)
    return math_backward(q, k, v, p, do, scale, see=see)


class _MathAttention(torch.autograd.Function):
    """The math path: saves q, k, v and the probabilities (what laga's eager
    kernel saves); the mask is recomputed when backward needs it (a
    non-finite operand, or double backward, which recomputes the
    probabilities under autograd: gradgradcheck holds it)."""

    @staticmethod
    def forward(ctx, q, k, v, mask_fn, scale):
        o, p = math_forward(q, k, v, mask_fn("mask"), scale)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale, ctx.mask_fn = scale, mask_fn
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, p = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the gradient itself differentiable
            return _recompute_backward(q, k, v, ctx.mask_fn("mask"), do, ctx.scale) + \
                (None, None)
        return math_backward(q, k, v, p, do, ctx.scale,
                             see=lambda: ctx.mask_fn("mask")) + (None, None)


def no_attention(q, k, v):
    """The empty output of a rank that attends nothing, still joined to q, k
    and v in the graph: its backward must reach the collectives that made
    them, which every rank has to enter."""
    return q.new_zeros(q.shape[:3] + (v.shape[3],)) + 0 * (q.sum() + k.sum() + v.sum())


def has_sdpa():
    return hasattr(F, "scaled_dot_product_attention")


KINDS = ("auto", "eager", "math", "flash", "sdpa")


class _FlashAttention(torch.autograd.Function):
    """flash attention under autograd (dispatch.forward / backward: the kernel
    chosen per call): saves q, k, v, o, lse."""

    @staticmethod
    def forward(ctx, q, k, v, ranges, scale, block):
        from . import dispatch  # (dispatch imports this module's tiles)
        o, lse = dispatch.forward(q, k, v, ranges, scale, block)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ranges, ctx.scale, ctx.block = ranges, scale, block
        ctx.dispatch = dispatch.current()
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the math path under autograd (dense mask)
            Sq, Sk = q.shape[1], k.shape[1]
            see = ctx.ranges.see(0, Sq, 0, Sk)
            return _recompute_backward(q, k, v, see, do, ctx.scale) + (None, None, None)
        from . import dispatch
        with dispatch.context(*ctx.dispatch):
            return dispatch.backward(q, k, v, o, lse, do, ctx.ranges, ctx.scale, ctx.block) + \
                (None, None, None)


def attention(q, k, v, mask, scale, kind="auto", block=64):
    """Returns o (B, Sq, H, dv). kind: "auto" (SDPA where torch has it, else
    math), "sdpa", "math" (= "eager") or "flash". `mask` is a callable giving
    the (B, 1, Sq, Sk) bool mask, or with flash the KeyRanges (flash never
    builds the mask); block: flash's tile size."""
    if q.shape[2] == 0 or q.shape[1] == 0:  # a rank without heads or query rows
        return no_attention(q, k, v)
    if kind == "auto":
        kind = "sdpa" if has_sdpa() else "math"
    if kind == "flash":
        return _FlashAttention.apply(q, k, v, mask("ranges"), scale, block)
    if kind not in ("math", "eager", "sdpa"):
        raise ValueError(f"attention kind '{kind}': expected auto, sdpa, math, eager or flash")
    if kind == "sdpa" and not has_sdpa():
        raise ValueError("attention kind 'sdpa': this torch has no "
                         "scaled_dot_product_attention; use 'math' or 'auto'")
    if kind in ("math", "eager") or not _finite(q, k, v):
        # (SDPA multiplies masked pairs by 0: with a non-finite operand the
        # math path, which selects them out, so a NaN stays in its document)
        return _MathAttention.apply(q, k, v, mask, scale)
    mask = mask("mask")
    H = q.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = k.expand(-1, -1, H, -1).transpose(1, 2), v.expand(-1, -1, H, -1).transpose(1, 2)
    try:  # torch >= 2.1 takes the scale
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    except TypeError:  # torch 2.0: fold the scale into q (SDPA divides by sqrt(dqk))
        o = F.scaled_dot_product_attention(qt * (scale * q.shape[3] ** 0.5), kt, vt,
                                           attn_mask=mask)
    return o.transpose(1, 2)


# --------------------------------------------------------------------------
# Flash-style attention (the C++ --attention flash: src/kernels/attention_flash*)
# --------------------------------------------------------------------------

class KeyRanges:
    """Row i of batch row b sees the keys [lo[b, i], hi[b, i]): its document's
    first token to itself (the causal, in-document mask of `mask` above, as
    ranges). lo and hi are (B, Sq) long tensors on the attention's device;
    their host copies give the tiles' bounds (one transfer per call). The
    rows of one call are one ascending token range, so both ends are
    non-decreasing in i, as the C++ kernels require of theirs."""

    def __init__(self, lo, hi):
        self.lo, self.hi = lo, hi
        self.lo_h, self.hi_h = lo.cpu(), hi.cpu()

    def tile(self, a0, a1, j0, j1):
        """(needed, masked) of rows [a0, a1) x keys [j0, j1): whether some row
        sees some key of it, and whether some row misses some key of it."""
        lo, hi = self.lo_h[:, a0:a1], self.hi_h[:, a0:a1]
        needed = bool(((lo < j1) & (hi > j0) & (lo < hi)).any())
        masked = bool(lo.max() > j0) or bool(hi.min() < j1)
        return needed, masked

    def see(self, a0, a1, j0, j1):
        """(B, 1, a1 - a0, j1 - j0) bool: row a0 + i sees key j0 + j."""
        j = torch.arange(j0, j1, device=self.lo.device)
        lo, hi = self.lo[:, a0:a1, None], self.hi[:, a0:a1, None]
        return ((j >= lo) & (j < hi))[:, None]


def _acc_dtype(dtype):
    """What a flash tile computes in: float64 stays, float32 and narrower in
    float32 (bf16's scores, softmax statistics and sums in fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _eq(shared, a, b, out):
    """The einsum of two operands where the key side (k, v, dk, dv: the
    terms indexed by j first) is (B, T, d) when one key head is shared by
    every query head (absorbed)."""
    def f(t):
        return t.replace("h", "") if shared and t[1] == "j" else t
    return f"{f(a)},{f(b)}->{f(out)}"


def _scores(q, k, shared, scale):
    return torch.einsum(_eq(shared, "bihd", "bjhd", "bhij"), q, k) * scale


def _rows_times_keys(x, y, shared, kr, a0, j0, exact):
    """(B, nq, H, d) = X (B, H, nq, nk) times the key operand y (B, nk, [H,] d),
    each row summed over the keys it sees only: in `exact` mode a masked
    tile is split, per batch row, into runs of rows with the same key range,
    each contracted over that range alone (the C++ rows_times_keys), so that
    a non-finite key row no row of the run sees cannot reach it through
    0 * NaN; else one dense product (x is exactly 0 at masked pairs, so with
    finite y the two are the same sum)."""
    if not exact:
        return torch.einsum(_eq(shared, "bhij", "bjhd", "bihd"), x, y)
    B, H, nq, nk = x.shape
    out = x.new_zeros(B, nq, H, y.shape[-1])
    lo = (kr.lo_h[:, a0:a0 + nq] - j0).clamp(0, nk)
    hi = (kr.hi_h[:, a0:a0 + nq] - j0).clamp(0, nk)
    for b in range(B):
        r0 = 0
        while r0 < nq:
            r1 = r0 + 1
            while r1 < nq and lo[b, r1] == lo[b, r0] and hi[b, r1] == hi[b, r0]:
                r1 += 1
            l, h = int(lo[b, r0]), int(hi[b, r0])
            if h > l:
                yb = y[b, l:h]
                xb = x[b, :, r0:r1, l:h]
                out[b, r0:r1] = torch.einsum("hij,jd->ihd" if shared else "hij,jhd->ihd", xb, yb)
            r0 = r1
    return out


def _keys_times_rows(x, y, shared, kr, a0, j0, exact):
    """(B, nk, [H,] d) = X^T (X (B, H, nq, nk)) times the row operand y
    (B, nq, H, d), each key summed over the rows that see it only (exact:
    runs of keys seen by the same rows, each contracted over those rows
    alone, the C++ keys_times_rows; else dense, the same sum when y is
    finite). With a shared key head the heads sum too."""
    if not exact:
        return torch.einsum(_eq(shared, "bhij", "bihd", "bjhd"), x, y)
    B, H, nq, nk = x.shape
    out = x.new_zeros((B, nk, y.shape[-1]) if shared else (B, nk, H, y.shape[-1]))
    c = torch.arange(j0, j0 + nk)[:, None]
    eq = "hij,ihd->jd" if shared else "hij,ihd->jhd"
    for b in range(B):
        sees = (kr.lo_h[b, a0:a0 + nq][None] <= c) & (kr.hi_h[b, a0:a0 + nq][None] > c)  # (nk, nq)
        c0 = 0
        while c0 < nk:
            c1 = c0 + 1
            while c1 < nk and torch.equal(sees[c1], sees[c0]):
                c1 += 1
            idx = sees[c0].nonzero()[:, 0]
            if len(idx):
                idx = idx.to(x.device)
                out[b, c0:c1] = torch.einsum(eq, x[b, :, idx, c0:c1], y[b, idx])
            c0 = c1
    return out


def _finite(*ts):
    return bool(torch.stack([torch.isfinite(t).all() for t in ts]).all())


def flash_forward(q, k, v, kr, scale, block=64, exact=None):
    """o (B, Sq, H, dv) and lse (B, H, Sq) of causal in-document attention by
    an online softmax over key blocks, never the (Sq, Sk) matrix: query
    blocks of `block` rows, key blocks of `block` keys aligned at multiples
    of it (as the C++ kernels' 64 x 64 tiles); tiles no row sees are not
    computed. lse is the natural log-sum-exp of each row's scaled scores, 0
    for a row that sees no key (whose o is 0), as the C++ kernel's.
    Masked pairs: scores selected to -inf before the row maximum and p to 0
    after the exponential (a NaN from another document's key or query never
    enters a row's statistics), and the products summed over visible pairs
    only (see _rows_times_keys; `exact` None: exact runs exactly when v has
    a non-finite value, one check per call). bf16 computes in fp32; lse is
    kept in that type."""
    B, Sq, H, dqk = q.shape
    Sk, dv = k.shape[1], v.shape[3]
    shared = k.shape[2] == 1 and H != 1
    acc = _acc_dtype(q.dtype)
    o = q.new_zeros(B, Sq, H, dv)
    lse = torch.zeros(B, H, Sq, dtype=acc, device=q.device)
    if B == 0 or Sq == 0 or H == 0 or Sk == 0:
        return o, lse
    if exact is None:
        exact = not _finite(v)
    kk = k[:, :, 0] if shared else k
    vv = v[:, :, 0] if shared else v
    ninf = float("-inf")
    for a0 in range(0, Sq, block):
        a1 = min(a0 + block, Sq)
        qb = q[:, a0:a1].to(acc)
        m = torch.full((B, H, a1 - a0), ninf, dtype=acc, device=q.device)
        l = torch.zeros_like(m)
        acc_o = torch.zeros(B, a1 - a0, H, dv, dtype=acc, device=q.device)
        for j0 in range(0, Sk, block):
            j1 = min(j0 + block, Sk)
            needed, masked = kr.tile(a0, a1, j0, j1)
            if not needed:
                continue
            s = _scores(qb, kk[:, j0:j1].to(acc), shared, scale)
            see = kr.see(a0, a1, j0, j1) if masked else None
            if masked:
                s = torch.where(see, s, s.new_tensor(ninf))
            m_new = torch.maximum(m, s.amax(-1))
            # A row that has seen no key yet has max -inf: shift by 0 (p = 0, not NaN).
            m_use = torch.where(m_new == ninf, m_new.new_zeros(()), m_new)
            alpha = torch.exp(m - m_use)
            p = torch.exp(s - m_use[..., None])
            if masked:
                p = torch.where(see, p, p.new_zeros(()))
            l = l * alpha + p.sum(-1)
            acc_o = acc_o * alpha.transpose(1, 2)[..., None] + _rows_times_keys(
                p, vv[:, j0:j1].to(acc), shared, kr, a0, j0, exact and masked)
            m = m_new
        # A row that sees no key: o = 0, lse = 0; one that sees keys with every
        # score -inf (or a NaN): NaN, as the eager softmax (and the C++ kernel) gives.
        ok = l > 0
        l_safe = torch.where(ok, l, torch.ones_like(l))
        sees = (kr.lo[:, a0:a1] < kr.hi[:, a0:a1])[:, None]  # (B, 1, nq)
        fill = torch.where(sees, l.new_tensor(float("nan")), l.new_zeros(())).expand_as(l)
        lse[:, :, a0:a1] = torch.where(ok, m + torch.log(l_safe), fill)
        t = (lambda z: z.transpose(1, 2)[..., None])
        ob = torch.where(t(ok), acc_o / t(l_safe), t(fill))
        o[:, a0:a1] = ob.to(o.dtype)
    return o, lse


def flash_backward(q, k, v, o, lse, do, kr, scale, block=64, exact=None):
    """dq, dk, dv of flash_forward from what it saved (q, k, v, o, lse):
    each tile's P recomputed as exp(s - lse), D = rowsum(dO o), dS = P (dP -
    D) scale, masked pairs selected out of P and dS and the sums taken over
    visible pairs only (`exact` None: exact runs when q, k or dO has a
    non-finite value). dk, dv summed over query blocks, dq over key blocks,
    in fp32 for bf16."""
    B, Sq, H, dqk = q.shape
    Sk = k.shape[1]
    shared = k.shape[2] == 1 and H != 1
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    if not (B == 0 or Sq == 0 or H == 0 or Sk == 0):
        if exact is None:
            exact = not _finite(q, k, do)
        kk = k[:, :, 0] if shared else k
        vv = v[:, :, 0] if shared else v
        dkk = dk[:, :, 0] if shared else dk
        dvv = dv[:, :, 0] if shared else dv
        for a0 in range(0, Sq, block):
            a1 = min(a0 + block, Sq)
            qb, dob = q[:, a0:a1].to(acc), do[:, a0:a1].to(acc)
            D = (dob * o[:, a0:a1].to(acc)).sum(-1).transpose(1, 2)  # (B, H, nq)
            L = lse[:, :, a0:a1].to(acc)
            dqb = torch.zeros_like(qb)
            for j0 in range(0, Sk, block):
                j1 = min(j0 + block, Sk)
                needed, masked = kr.tile(a0, a1, j0, j1)
                if not needed:
                    continue
                kb, vb = kk[:, j0:j1].to(acc), vv[:, j0:j1].to(acc)
                s = _scores(qb, kb, shared, scale)
                see = kr.see(a0, a1, j0, j1) if masked else None
                if masked:
                    s = torch.where(see, s, s.new_tensor(float("-inf")))
                p = torch.exp(s - L[..., None])
                if masked:
                    p = torch.where(see, p, p.new_zeros(()))
                ex = exact and masked
                dvv[:, j0:j1] += _keys_times_rows(p, dob, shared, kr, a0, j0, ex)
                dp = torch.einsum(_eq(shared, "bihd", "bjhd", "bhij"), dob, vb)
                ds = p * (dp - D[..., None]) * scale
                if masked:
                    ds = torch.where(see, ds, ds.new_zeros(()))
                dqb += _rows_times_keys(ds, kb, shared, kr, a0, j0, ex)
                dkk[:, j0:j1] += _keys_times_rows(ds, qb, shared, kr, a0, j0, ex)
            dq[:, a0:a1] = dqb
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
