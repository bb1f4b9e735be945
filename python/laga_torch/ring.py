"""The ring engine of ring_kv and ring_latent: a port of src/mla/ring.hpp
(docs/forms.md, "ring_kv", "ring_latent"), shared by laga's tape
(tape.Block) and autograd's (RingAttention below).

Each rank attends its own query tokens (its seq shard: one range, or the
zigzag layout's two), with all heads, against the block of every rank that
passes round the ring (rank r -> r + 1, P - 1 shifts), merging the steps'
partial outputs by their log-sum-exp:

  step i = 0 .. P-1 holds rank j = r - i's block, its L_j tokens:
    send it on and receive rank j - 1's (not after the last step): started
    before the step's attention and waited after it with overlap, else
    waited at once (the same bytes and values);
    j == r: causal attention of q over the block (the diagonal);
    j != r: the rectangle of the rank's query rows that follow the block's
    key rows (RingRect: contiguous shards, every row x every key when
    j < r, nothing when j > r, the block still passing on; zigzag shards,
    rank j < r's first chunk against both of r's, rank j > r's two chunks
    against r's second), unmasked but for packed documents;
    o = e^(lse - lse') o + e^(lse_j - lse') o_j,  lse' = log(e^lse + e^lse_j)
    over the rectangle's rows.

Packed documents: row t sees the block's keys at positions [start(t), t]
(the C++ ring_calls' cases as key ranges: the diagonal under the documents'
mask, a past block seen from its document's start by the rows of the
document that runs into it, and by no other row). A row that sees no key
of a block takes lse_j = -inf there, so the merge leaves it as it was;
step 0 is the diagonal, where every row sees itself.

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

from .attention import KeyRanges, _acc_dtype, _einsum_seen, _finite, first_order_only, \
    math_backward
from . import dispatch
from .dispatch import backward as flash_backward, forward as flash_forward
from .comm import start_ring_shift


class KvBlocks:
    """ring_kv's block: the per-head [K | V] itself (form_ring_kv.cpp)."""
    pass_label, grad_label = "kv_ring", "dkv_ring"
    keeps_c_hat = True  # wkv_b's gradient is taken at home, from the local c_hat

    def __init__(self, cfg, batch, wkv_b, heads=None):
        # heads: a2a_p2p's block holds its head group's H_g heads (default all H)
        self.B, self.H = batch, heads or cfg.n_heads
        self.dqk, self.dv = cfg.qk_head_dim, cfg.v_head_dim
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

    def add_grad(self, block, Lj, k_row, dk, dv, acc):
        """dk (B, keys, H, dqk), dv of the block's rows [k_row, k_row + keys)."""
        k, v = self.kv(acc, Lj)
        k[:, k_row:k_row + dk.shape[1]] += dk
        v[:, k_row:k_row + dv.shape[1]] += dv


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

    def add_grad(self, block, Lj, k_row, dk, dv, acc):
        """The step's dK/dV (B, keys, H, .) of the block's rows [k_row, k_row +
        keys) through the up-projection: d k_pe += sum over heads of dk's rope
        part, dc += dkv wkv_b into the accumulator; wkv_b's gradient += dkv^T c
        (stays on the rank)."""
        B, H, dn, C, n = self.B, self.H, self.dn, self.C, dk.shape[1]
        c, _ = self._parts(block, Lj)
        c = c[:, k_row:k_row + n]
        dkv = torch.cat([dk[..., :dn], dv], -1).reshape(B * n, H * (dn + self.dv))
        a_c, a_pe = self._parts(acc, Lj)
        a_c[:, k_row:k_row + n] += (dkv @ self.wkv_b).view(B, n, C)
        a_pe[:, k_row:k_row + n] += dk[..., dn:].sum(2)
        self.d_wkv += dkv.t() @ c.reshape(B * n, C)


class _Members:
    """A ring's members as ring_forward reads a layout: each member's rows
    (ascending ranges), their count and positions; a member may hold none
    (a2a_p2p's chunks when S < 2 Pc)."""

    def __init__(self, seq_ranges):
        self.seq_ranges = [list(r) for r in seq_ranges]
        self.seq_count = [sum(e - b for b, e in r) for r in self.seq_ranges]
        self.ranks = len(self.seq_ranges)

    def positions(self, r):
        return [t for b, e in self.seq_ranges[r] for t in range(b, e)]


class RingSp:
    """The ring a rank's ring attention runs round, with what ring_forward
    reads of an Sp (the C++ RingView, src/mla/ring.hpp): its members'
    rows (`layout`), this rank's place (`rank`) and rows' global positions
    (`own`), and the ring its shifts pass round (`ring`: (size, stride), or
    None for one ring of every rank). ring_kv and ring_latent pass the Sp
    itself; a2a_p2p this, of_grid."""

    def __init__(self, layout, rank, sp, own, ring):
        self.layout, self.rank, self.own, self.ring = layout, rank, own, ring
        self.group, self.ledger, self.batch, self.doc_start = sp.group, sp.ledger, sp.batch, \
            sp.doc_start
        self.attention_kind, self.flash_block = sp.attention_kind, sp.flash_block

    @classmethod
    def of_grid(cls, sp, g):
        """The Pc ranks of sp's head group on the context-major grid g, in
        context-group order (Ph apart), each with its context group's query
        rows."""
        hg, Pc = g.head_group(sp.rank), g.context_groups
        lay = _Members([g.queries[g.rank_at(hg, c)] for c in range(Pc)])
        place = g.context_group(sp.rank)
        own = torch.tensor(lay.positions(place), dtype=torch.long, device=sp.doc_start.device)
        return cls(lay, place, sp, own, (Pc, g.head_groups))


def _block_elems(sp, codec, j):
    return sp.batch * sp.layout.seq_count[j] * codec.width()


class RingRect:
    """The (query row, key row) rectangle a ring step attends: the rank's
    local rows [q_row, q_row + rows) against the block's rows [k_row, k_row +
    keys) (the C++ ring_rect, src/mla/ring.hpp). The own block's is every row
    against every row under the causal mask (the local tokens are ascending,
    so the mask of the rows as they lie is the sequence's). Another block's
    keys either all precede a query range or all follow it (whole chunks of
    one tiling), and on contiguous and zigzag shards those that precede form
    one rectangle, unmasked: rows 0 when no key precedes."""

    def __init__(self, lay, r, owner):
        mine, theirs = lay.seq_ranges[r], lay.seq_ranges[owner]
        self.diagonal = owner == r
        self.q_row = self.rows = self.k_row = self.keys = 0
        if self.diagonal:
            self.rows = self.keys = lay.seq_count[r]
            return
        pairs = [(a, b) for a in range(len(mine)) for b in range(len(theirs))
                 if theirs[b][1] <= mine[a][0]]  # every key of range b precedes range a
        if not pairs:
            return
        qs, ks = sorted({a for a, _ in pairs}), sorted({b for _, b in pairs})
        if len(pairs) != len(qs) * len(ks) or qs[-1] - qs[0] + 1 != len(qs) or \
                ks[-1] - ks[0] + 1 != len(ks):
            raise ValueError(f"ring: rank {r}'s seq ranges against rank {owner}'s are no one "
                             "rectangle; the ring forms run contiguous or zigzag shards")

        def rows_before(v, n):
            return sum(e - b for b, e in v[:n])
        self.q_row, self.k_row = rows_before(mine, qs[0]), rows_before(theirs, ks[0])
        self.rows = rows_before(mine, qs[-1] + 1) - self.q_row
        self.keys = rows_before(theirs, ks[-1] + 1) - self.k_row

    def q(self, x):
        """The rectangle's rows of a (B, L, ...) tensor."""
        return x[:, self.q_row:self.q_row + self.rows]

    def k(self, x):
        """The rectangle's keys of a (B, L_j, ...) block tensor."""
        return x[:, self.k_row:self.k_row + self.keys]


def key_ranges(sp, owner):
    """(rect, lo, hi) of the block of rank `owner`: row q_row + i of the
    shard sees the rectangle's keys [lo[b, i], hi[b, i]), (B, rows) local to
    it (those at positions [start(t), t] of its token t: the positions are
    ascending, so a range); None when no key of the block precedes a row
    (skipped, still passed on)."""
    lay = sp.layout
    rect = RingRect(lay, sp.rank, owner)
    if rect.rows == 0:
        return None
    dev = sp.doc_start.device
    kpos = torch.tensor(lay.positions(owner)[rect.k_row:rect.k_row + rect.keys], dtype=torch.long,
                        device=dev)
    t = sp.own[rect.q_row:rect.q_row + rect.rows]
    lo = torch.searchsorted(kpos, sp.doc_start[:, t].contiguous())
    hi = torch.searchsorted(kpos, t, right=True)[None].expand_as(lo)
    return rect, lo.contiguous(), hi.contiguous()


def _see(lo, hi, Lk):
    """(B, 1, L, Lk) bool: row i sees key j of the block."""
    j = torch.arange(Lk, device=lo.device)
    return ((j >= lo[..., None]) & (j < hi[..., None]))[:, None]


def _eager_step(q, k, v, see, scale):
    """Of a step's rectangle, q (B, rows, H, dqk) against k, v (B, keys, H, .):
    o_j (B, rows, H, dv), lse_j (B, H, rows) and the probabilities (B, H,
    rows, keys) normalised over these keys; a row that sees none: o_j 0,
    lse_j -inf, p 0."""
    acc = _acc_dtype(q.dtype)  # bf16: scores, lse and P V in fp32, as flash's tiles
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    s = s.masked_fill(~see, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(see, torch.exp(s - lse[..., None]), s.new_zeros(()))
    # P V over the seen keys only when an operand is non-finite (a NaN key
    # another document holds never reaches a row through 0 * NaN).
    exact = None if _finite(q, k, v) else see
    return _einsum_seen("bhij,bjhd->bihd", p, v, exact), lse, p


class _Shifts:
    """The ring shifts one pass (forward or backward) has started and not
    yet waited, by label: at most one each (the block's, and in backward the
    accumulator's). Starting a second while the first is open, or ending
    the pass with one open, is a missing wait: its receive buffer would be
    read, or overwritten, before the transfer lands, and the ranks' P2P
    calls fall out of step (a hang, in gloo). Both raise at once, naming the
    shift, after the open transfer has been waited (so no rank is left
    inside it)."""

    def __init__(self, phase):
        self.phase, self.open = phase, {}

    def start(self, sp, x, numel, label, step, overlap):
        """The ring shift; without overlap waited here (returns the block),
        with overlap started (returns its wait)."""
        if label in self.open:
            self._missing(label, "before the next one started at step " + str(step))
        _, wait = start_ring_shift(x, numel, sp.group, sp.ledger, self.phase, label, sp.ring)
        if not overlap:
            return wait()
        self.open[label] = (step, wait)

        def waited():
            self.open.pop(label, None)
            return wait()
        return waited

    def close(self):
        for label in list(self.open):
            self._missing(label, "by the end of the pass")

    def _missing(self, label, when):
        step, wait = self.open.pop(label)
        wait()
        raise RuntimeError(f"ring {self.phase}: the '{label}' shift started at step {step} was "
                           f"never waited {when}: a missing wait in the ring's overlap (each "
                           "started shift must be waited before its buffer is read and before "
                           "the next shift of its kind starts)")


def ring_forward(sp, codec, q, own, flash, block, overlap, scale):
    """q (B, L, H, dqk) of the own tokens, own (the flat own block):
    (o (B, L, H, dv), stats): flash's merged lse (B, H, L), or eager's
    {step: rescaled probabilities (B, H, rows, keys)} of every step's
    non-empty rectangle (RingRect; what the C++ RingAttention keeps)."""
    P, r, lay = sp.layout.ranks, sp.rank, sp.layout
    B, L, H, _ = q.shape
    acc = _acc_dtype(q.dtype)
    o = lse = None
    probs, step_lse = {}, {}
    cur = own
    shifts = _Shifts("forward")
    for i in range(P):
        owner = (r - i) % P
        nxt = None
        if i + 1 < P:
            nxt = shifts.start(sp, cur, _block_elems(sp, codec, (owner - 1) % P),
                               codec.pass_label, i, overlap)
        rng = key_ranges(sp, owner)
        if rng is not None:
            rect, lo, hi = rng
            k, v = codec.kv(cur, lay.seq_count[owner])
            q_r, k_r, v_r = rect.q(q), rect.k(k), rect.k(v)
            if flash:
                o_j, lse_j = flash_forward(q_r, k_r, v_r, KeyRanges(lo, hi), scale, block)
                lse_j = torch.where((lo < hi)[:, None], lse_j, lse_j.new_tensor(float("-inf")))
            else:  # (bf16: the step's lse stays fp32 to the merge; its p is kept in bf16)
                o_j, lse_j, probs[i] = _eager_step(q_r, k_r, v_r, _see(lo, hi, rect.keys), scale)
                step_lse[i] = (rect, lse_j)
            o_j, lse_j = o_j.to(acc), lse_j.to(acc)
            if o is None:  # step 0, the diagonal: every row sees itself
                o, lse = o_j, lse_j.clone()  # (merged in place; eager keeps the step's lse_j)
            else:  # the rectangle's rows, in place
                a0, a1 = rect.q_row, rect.q_row + rect.rows
                lse_r = lse[:, :, a0:a1]
                m = torch.maximum(lse_r, lse_j)
                merged = m + torch.log(torch.exp(lse_r - m) + torch.exp(lse_j - m))
                a, w = torch.exp(lse_r - merged), torch.exp(lse_j - merged)
                o[:, a0:a1] = a.transpose(1, 2)[..., None] * o[:, a0:a1] + \
                    w.transpose(1, 2)[..., None] * o_j
                lse[:, :, a0:a1] = merged
        if nxt is not None:
            cur = nxt() if overlap else nxt
    shifts.close()
    if flash:
        return o.to(q.dtype), lse
    # Eager: each step's probabilities to the row's whole normalisation.
    for i, p in probs.items():
        rect, lse_i = step_lse[i]
        scale_i = torch.exp(lse_i - lse[:, :, rect.q_row:rect.q_row + rect.rows])
        probs[i] = (p.to(acc) * scale_i[..., None]).to(q.dtype)
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
    shifts = _Shifts("backward")
    for i in range(P):
        owner = (r - i) % P
        nxt = None
        if i + 1 < P:
            nxt = shifts.start(sp, cur, _block_elems(sp, codec, (owner - 1) % P),
                               codec.pass_label, i, overlap)
        rng = key_ranges(sp, owner)
        grads = None
        if rng is not None:
            rect, lo, hi = rng
            Lk = lay.seq_count[owner]
            k, v = codec.kv(cur, Lk)
            q_r, k_r, v_r, do_r = rect.q(q), rect.k(k), rect.k(v), rect.q(do)
            if flash:
                lse_r = stats[:, :, rect.q_row:rect.q_row + rect.rows]
                dq_, dk, dv = flash_backward(q_r, k_r, v_r, rect.q(o), lse_r, do_r,
                                             KeyRanges(lo, hi), scale, block)
            else:
                delta_r = delta[:, :, rect.q_row:rect.q_row + rect.rows]
                dq_, dk, dv = math_backward(q_r, k_r, v_r, stats[i], do_r, scale, delta=delta_r,
                                            see=lambda: _see(lo, hi, rect.keys))
            dq[:, rect.q_row:rect.q_row + rect.rows] += dq_
            grads = (Lk, rect.k_row, dk, dv)
        if acc_wait is not None:
            acc = acc_wait()
            acc_wait = None
        if grads is not None:
            codec.add_grad(cur, *grads, acc)
        if nxt is not None and overlap:
            nxt = nxt()
        if P > 1:  # the accumulator goes on with its block; after the last step, home
            arriving = shifts.start(sp, acc, _block_elems(sp, codec, (owner - 1) % P),
                                    codec.grad_label, i, overlap)
            if overlap:
                acc_wait = arriving
            else:
                acc = arriving
        if nxt is not None:
            cur = nxt
    if acc_wait is not None:
        acc = acc_wait()
    shifts.close()
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
        ctx.dispatch = dispatch.current()
        return o

    @staticmethod
    @first_order_only("the ring forms' RingAttention (ring_kv, ring_latent, a2a_p2p)",
                      "a form without a ring (explicit, absorbed, laga, laga2d or allgather_kv) "
                      "on tape='autograd'")
    def backward(ctx, do):
        saved = ctx.saved_tensors
        q, own, o, wkv_b = saved[:4]
        stats = saved[4] if ctx.flash else dict(zip(ctx.steps, saved[4:]))
        sp = ctx.sp
        codec = ctx.codec_type(ctx.cfg, sp.batch, wkv_b)
        with dispatch.context(*ctx.dispatch):
            dq, d_own = ring_backward(sp, codec, q, own, o, stats, do.contiguous(), ctx.flash,
                                      sp.flash_block, ctx.overlap, ctx.cfg.softmax_scale())
        return dq, d_own, codec.d_wkv, None, None, None, None
