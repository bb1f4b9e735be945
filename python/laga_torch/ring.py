"""The ring engine of ring_kv and ring_latent: a port of src/mla/ring.hpp
(docs/forms.md, "ring_kv", "ring_latent"), shared by laga's tape
(tape.Block) and autograd's (RingAttention below).

Each rank attends its own query tokens [s0, s1), with all heads, against
the block of every rank that passes round the ring (rank r -> r + 1, P - 1
shifts), merging the steps' partial outputs by their log-sum-exp:

  step i = 0 .. P-1 holds rank j = r - i's block, tokens [k0, k0 + L_j):
    send it on and receive rank j - 1's (not after the last step): started
    before the step's attention and waited after it with overlap, else
    waited at once (the same bytes and values);
    j == r: causal attention of q over the block (the diagonal);
    j <  r: every key precedes every query: no causal mask;
    j >  r: keys after every query: no work (the block still passes on);
    o = e^(lse - lse') o + e^(lse_j - lse') o_j,  lse' = log(e^lse + e^lse_j)

Packed documents: row t sees the block's keys [max(start(t), k0), t] (the
C++ ring_calls' cases as key ranges: the diagonal under the documents'
mask, a past block seen from its document's start by the rows of the
document that runs into the shard, and by no other row). A row that sees
no key of a block takes lse_j = -inf there, so the merge leaves it as it
was; step 0 is the diagonal, where every row sees itself.

Backward recomputes as flash does: the blocks pass round again, each step's
attention backward reads the merged o and lse (eager: its probabilities,
rescaled in forward by e^(lse_j - lse') to the row's whole normalisation,
and D = do . o of the whole row), and the block's gradient accumulator
travels with it: the rank adds its part to the accumulator of the block it
holds and passes it on; after the last step one more shift brings every
block's gradient home (P shifts), summed over the ranks that attended it in
ring order.

A block is one flat tensor, in two parts, as the C++ codecs lay it out:
KvBlocks [K (B, L_j, H, dqk) | V (B, L_j, H, dv)] (ring_kv), LatentBlocks
[c_hat (B, L_j, C) | k_pe (B, L_j, dr)] (ring_latent, up-projected with the
full wkv_b at every step, wkv_b's gradient accumulated on the rank).
"""

import torch

from .attention import KeyRanges, _acc_dtype, flash_backward, flash_forward, math_backward
from .comm import start_ring_shift


class KvBlocks:
    """ring_kv's block: the per-head [K | V] itself (form_ring_kv.cpp)."""
    pass_label, grad_label = "kv_ring", "dkv_ring"
    keeps_c_hat = True  # wkv_b's gradient is taken at home, from the local c_hat

    def __init__(self, cfg, batch, wkv_b):
        self.B, self.H, self.dqk, self.dv = batch, cfg.n_heads, cfg.qk_head_dim, cfg.v_head_dim
        self.dn, self.wkv_b = cfg.qk_nope_head_dim, wkv_b
        self.d_wkv = None  # no parameter in the ring

    def own_block(self, c_hat, k_pe):
        """kv (B, L, H, dn+dv) = c_hat wkv_b^T of the local tokens for all heads,
        k_pe expanded over heads (explicit's), as the flat [K | V]."""
        B, L, H, dn = self.B, c_hat.shape[1], self.H, self.dn
        kv = (c_hat @ self.wkv_b.t()).view(B, L, H, dn + self.dv)
        k = torch.cat([kv[..., :dn], k_pe[:, :, None, :].expand(B, L, H, self.dqk - dn)], -1)
        return torch.cat([k.reshape(-1), kv[..., dn:].reshape(-1)])

    def latent_grad(self, acc, L, c_hat):
        """The own block's [dK | dV], home: explicit's merge into (d c_hat,
        d k_pe = the sum over heads of dk's rope part, d wkv_b)."""
        dk, dv = self.kv(acc, L)
        dkv = torch.cat([dk[..., :self.dn], dv], -1).reshape(self.B * L, -1)
        return (dkv @ self.wkv_b).view(self.B, L, -1), dk[..., self.dn:].sum(2), \
            dkv.t() @ c_hat.reshape(self.B * L, -1)

    def width(self):
        return self.H * (self.dqk + self.dv)

    def kv(self, block, Lj):
        n = self.B * Lj * self.H * self.dqk
        return (block[:n].view(self.B, Lj, self.H, self.dqk),
                block[n:].view(self.B, Lj, self.H, self.dv))

    def add_grad(self, block, Lj, dk, dv, acc):
        n = self.B * Lj * self.H * self.dqk
        acc[:n] += dk.reshape(-1)
        acc[n:] += dv.reshape(-1)


class LatentBlocks:
    """ring_latent's block: the latent [c_hat | k_pe], every head's K and V
    up-projected from it at every step (form_ring_latent.cpp)."""
    pass_label, grad_label = "latent_ring", "dlatent_ring"
    keeps_c_hat = False  # c_hat is in the block

    def __init__(self, cfg, batch, wkv_b):
        self.B, self.H, self.C = batch, cfg.n_heads, cfg.kv_lora_rank
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.wkv_b = wkv_b  # (H (dn + dv), C)
        self.d_wkv = torch.zeros_like(wkv_b)

    def width(self):
        return self.C + self.dr

    def _parts(self, block, Lj):
        n = self.B * Lj * self.C
        return block[:n].view(self.B, Lj, self.C), block[n:].view(self.B, Lj, self.dr)

    def own_block(self, c_hat, k_pe):
        return torch.cat([c_hat.reshape(-1), k_pe.reshape(-1)])

    def latent_grad(self, acc, L, c_hat=None):
        """The accumulator is d[c_hat | k_pe] already; wkv_b's gradient was
        taken on the ring."""
        d_c, d_pe = self._parts(acc, L)
        return d_c, d_pe, self.d_wkv

    def kv(self, block, Lj):
        """k (B, L_j, H, dqk) = [c wkv_b^T's nope part | k_pe for every head], v."""
        B, H, dn, dr = self.B, self.H, self.dn, self.dr
        c, pe = self._parts(block, Lj)
        kv = (c @ self.wkv_b.t()).view(B, Lj, H, dn + self.dv)
        k = torch.cat([kv[..., :dn], pe[:, :, None, :].expand(B, Lj, H, dr)], -1)
        return k, kv[..., dn:]

    def add_grad(self, block, Lj, dk, dv, acc):
        """The step's dK/dV through the up-projection: d k_pe += sum over heads
        of dk's rope part, dc += dkv wkv_b into the accumulator; wkv_b's
        gradient += dkv^T c (stays on the rank)."""
        B, H, dn, C = self.B, self.H, self.dn, self.C
        c, _ = self._parts(block, Lj)
        dkv = torch.cat([dk[..., :dn], dv], -1).reshape(B * Lj, H * (dn + self.dv))
        a_c, a_pe = self._parts(acc, Lj)
        a_c += (dkv @ self.wkv_b).view(B, Lj, C)
        a_pe += dk[..., dn:].sum(2)
        self.d_wkv += dkv.t() @ c.reshape(B * Lj, C)


def _block_elems(sp, codec, j):
    return sp.batch * sp.layout.seq_count[j] * codec.width()


def key_ranges(sp, owner):
    """(lo, hi) (B, L) of the block of rank `owner`, local to it: row t of
    the shard sees keys [lo, hi) of the block; None when the block follows
    every query (skipped, still passed on)."""
    lay = sp.layout
    s0, s1 = sp.shard()
    k0, Lk = lay.seq_offset[owner], lay.seq_count[owner]
    if k0 > s0:
        return None
    t = torch.arange(s0, s1, device=sp.doc_start.device)
    lo = (sp.doc_start[:, s0:s1] - k0).clamp(0, Lk)
    hi = (t + 1 - k0).clamp(0, Lk)[None].expand_as(lo)
    return lo.contiguous(), hi.contiguous()


def _see(lo, hi, Lk):
    """(B, 1, L, Lk) bool: row i sees key j of the block."""
    j = torch.arange(Lk, device=lo.device)
    return ((j >= lo[..., None]) & (j < hi[..., None]))[:, None]


def _eager_step(q, k, v, see, scale):
    """o_j (B, L, H, dv), lse_j (B, H, L) and the probabilities (B, H, L, L_j)
    normalised over this block's keys; a row that sees none: o_j 0, lse_j
    -inf, p 0."""
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    s = s.masked_fill(~see, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(see, torch.exp(s - lse[..., None]), s.new_zeros(()))
    return torch.einsum("bhij,bjhd->bihd", p, v), lse, p


def _shift(sp, x, numel, label, phase, overlap):
    """The ring shift; without overlap waited here (returns the block), with
    overlap started (returns its wait)."""
    _, wait = start_ring_shift(x, numel, sp.group, sp.ledger, phase, label)
    return wait if overlap else wait()


def ring_forward(sp, codec, q, own, flash, block, overlap, scale):
    """q (B, L, H, dqk) of the own tokens, own (the flat own block):
    (o (B, L, H, dv), stats): flash's merged lse (B, H, L), or eager's
    {step: rescaled probabilities (B, H, L, L_j)} for every block that does
    not follow the own tokens (what the C++ RingAttention keeps)."""
    P, r, lay = sp.layout.ranks, sp.rank, sp.layout
    B, L, H, _ = q.shape
    acc = _acc_dtype(q.dtype)
    o = lse = None
    probs, step_lse = {}, {}
    cur = own
    for i in range(P):
        owner = (r - i) % P
        nxt = None
        if i + 1 < P:
            nxt = _shift(sp, cur, _block_elems(sp, codec, (owner - 1) % P), codec.pass_label,
                         "forward", overlap)
        rng = key_ranges(sp, owner)
        if rng is not None:
            Lk = lay.seq_count[owner]
            k, v = codec.kv(cur, Lk)
            lo, hi = rng
            if flash:
                o_j, lse_j = flash_forward(q, k, v, KeyRanges(lo, hi), scale, block)
                lse_j = torch.where((lo < hi)[:, None], lse_j, lse_j.new_tensor(float("-inf")))
            else:
                o_j, lse_j, probs[i] = _eager_step(q, k, v, _see(lo, hi, Lk), scale)
                step_lse[i] = lse_j
            o_j, lse_j = o_j.to(acc), lse_j.to(acc)
            if o is None:  # step 0, the diagonal: every row sees itself
                o, lse = o_j, lse_j
            else:
                m = torch.maximum(lse, lse_j)
                merged = m + torch.log(torch.exp(lse - m) + torch.exp(lse_j - m))
                a, w = torch.exp(lse - merged), torch.exp(lse_j - merged)
                o = a.transpose(1, 2)[..., None] * o + w.transpose(1, 2)[..., None] * o_j
                lse = merged
        if nxt is not None:
            cur = nxt() if overlap else nxt
    if flash:
        return o.to(q.dtype), lse
    # Eager: each step's probabilities to the row's whole normalisation.
    for i, p in probs.items():
        probs[i] = (p.to(acc) * torch.exp(step_lse[i] - lse)[..., None]).to(p.dtype)
    return o.to(q.dtype), probs


def ring_backward(sp, codec, q, own, o, stats, do, flash, block, overlap, scale):
    """dq (B, L, H, dqk) and the own block's gradient (flat, home after the
    ring), codec.d_wkv added to (ring_latent); the blocks round again."""
    P, r, lay = sp.layout.ranks, sp.rank, sp.layout
    acc_t = _acc_dtype(q.dtype)
    delta = None
    if not flash:  # D = do . o of the whole row, (B, H, L)
        delta = (do.to(acc_t) * o.to(acc_t)).sum(-1).transpose(1, 2).to(q.dtype)
    dq = torch.zeros_like(q)
    cur, acc = own, torch.zeros_like(own)
    acc_wait = None  # the accumulator's shift, with overlap, until the next step waits
    for i in range(P):
        owner = (r - i) % P
        nxt = None
        if i + 1 < P:
            nxt = _shift(sp, cur, _block_elems(sp, codec, (owner - 1) % P), codec.pass_label,
                         "backward", overlap)
        rng = key_ranges(sp, owner)
        grads = None
        if rng is not None:
            Lk = lay.seq_count[owner]
            k, v = codec.kv(cur, Lk)
            lo, hi = rng
            if flash:
                dq_, dk, dv = flash_backward(q, k, v, o, stats, do, KeyRanges(lo, hi), scale,
                                             block)
            else:
                dq_, dk, dv = math_backward(q, k, v, stats[i], do, scale, delta=delta)
            dq += dq_
            grads = (Lk, dk, dv)
        if acc_wait is not None:
            acc = acc_wait()
            acc_wait = None
        if grads is not None:
            codec.add_grad(cur, grads[0], grads[1], grads[2], acc)
        if nxt is not None and overlap:
            nxt = nxt()
        if P > 1:  # the accumulator goes on with its block; after the last step, home
            arriving = _shift(sp, acc, _block_elems(sp, codec, (owner - 1) % P),
                              codec.grad_label, "backward", overlap)
            if overlap:
                acc_wait = arriving
            else:
                acc = arriving
        if nxt is not None:
            cur = nxt
    if acc_wait is not None:
        acc = acc_wait()
    return dq, acc


class RingAttention(torch.autograd.Function):
    """The ring's attention under autograd (tape "autograd"): forward and
    backward are ring_forward / ring_backward, saving q, the own block, o and
    the statistics (flash's lse, or eager's probabilities); wkv_b gets the
    gradient the ring takes (ring_latent's; ring_kv's own block, built by
    autograd from wkv_b, carries the rest). Attention "flash" is flash, any other
    kind eager (a ring merges each block's log-sum-exp, which SDPA does not
    give)."""

    @staticmethod
    def forward(ctx, q, own, wkv_b, sp, cfg, codec_type, overlap):
        codec = codec_type(cfg, sp.batch, wkv_b)
        flash = sp.attention_kind == "flash"
        scale = cfg.softmax_scale()
        o, stats = ring_forward(sp, codec, q, own, flash, sp.flash_block, overlap, scale)
        steps = [] if flash else sorted(stats)
        saved = [stats] if flash else [stats[i] for i in steps]
        ctx.sp, ctx.cfg, ctx.codec_type, ctx.overlap, ctx.flash, ctx.steps = \
            sp, cfg, codec_type, overlap, flash, steps
        ctx.save_for_backward(q, own, o, wkv_b, *saved)
        return o

    @staticmethod
    def backward(ctx, do):
        saved = ctx.saved_tensors
        q, own, o, wkv_b = saved[:4]
        stats = saved[4] if ctx.flash else dict(zip(ctx.steps, saved[4:]))
        sp = ctx.sp
        codec = ctx.codec_type(ctx.cfg, sp.batch, wkv_b)
        dq, d_own = ring_backward(sp, codec, q, own, o, stats, do.contiguous(), ctx.flash,
                                  sp.flash_block, ctx.overlap, ctx.cfg.softmax_scale())
        return dq, d_own, codec.d_wkv, None, None, None, None
