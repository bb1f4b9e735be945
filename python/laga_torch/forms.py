"""The four forms' attention on P ranks: the functional layer.

Each function reads as its block in docs/forms.md, which describes the same
data flow for the C++ forms (src/mla/form_explicit.cpp, form_laga.cpp,
form_laga2d.cpp, form_absorbed.cpp); the labels are the C++ ledger's.
Inputs are this rank's seq shard after the local projections (the
pith-train shape): q (B, L, H, dqk) = [q_nope | q_pe] with q_pe rotated (or
with q_latent the normalised query latent qn (B, L, rq) and wq_b), c_kv =
kv_norm(c) (B, L, C), k_pe rotated (B, L, dr), and wkv_b (H (dn+dv), C).
The output is o_loc (B, L, H dv), ready for wo. Parameter gradients,
wkv_b's included, come through autograd, each rank's partial (sum them over
the group, as `sync_gradients` does).
"""

import functools

import torch

from .attention import KeyRanges, attention
from .comm import Placement, Plan, redistribute, start_redistribute
from .layout import HeadContextGrid

FORMS = ("explicit", "absorbed", "laga", "laga2d")


@functools.lru_cache(maxsize=256)
def _plan(kind, seq_counts, head_counts, head_groups, rank, batch, width, label):
    """The placements of each movement (docs/forms.md, "The four data
    movements"; redistribute in src/mla/exchange.hpp)."""
    from .layout import SpLayout
    lay = SpLayout(list(seq_counts), list(head_counts))
    P, S, H = lay.ranks, lay.seq, lay.heads
    shard = [Placement([(lay.seq_offset[i], lay.seq_offset[i] + lay.seq_count[i])], 0, H)
             for i in range(P)]
    row = [Placement(p.ranges, 0, 1) for p in shard]  # a (B, L, 1, W) row per token
    if kind in ("seq_to_head", "head_to_seq"):
        heads = [Placement([(0, S)], lay.head_offset[j], lay.head_count[j]) for j in range(P)]
        src, dst = (shard, heads) if kind == "seq_to_head" else (heads, shard)
    elif kind == "gather_seq":  # all-gather; its adjoint the reduce-scatter
        src, dst = row, [Placement([(0, S)], 0, 1)] * P
    else:  # laga2d: tokens <-> each rank's query chunks x its group's heads
        g = HeadContextGrid(lay, head_groups)
        grid = [Placement(g.queries[j], g.head_offset[j], g.head_count[j]) for j in range(P)]
        if kind == "to_queries":
            src, dst = shard, grid
        elif kind == "from_queries":
            src, dst = grid, shard
        else:  # "latent_to_queries": qn to every rank attending its tokens (copies)
            src, dst = row, [Placement(g.queries[j], 0, 1) for j in range(P)]
    return Plan(src, dst, rank, batch, width, label)


class Sp:
    """This rank's part in one forward: the layout, its group and ledger, the
    documents' starts (B, S) and in-document positions (B, S), the RoPE table."""

    def __init__(self, layout, rank, group, ledger, batch, doc_start, cos, sin, head_groups=0,
                 attention_kind="auto", flash_block=64):
        self.layout, self.rank, self.group, self.ledger = layout, rank, group, ledger
        self.batch, self.doc_start, self.cos, self.sin = batch, doc_start, cos, sin
        self.attention_kind, self.flash_block = attention_kind, flash_block
        self.head_groups = head_groups or HeadContextGrid.default_head_groups(layout.heads,
                                                                              layout.ranks)
        S = layout.seq
        self.pos = torch.arange(S, device=doc_start.device)[None, :] - doc_start

    def plan(self, kind, width, label):
        lay = self.layout
        return _plan(kind, tuple(lay.seq_count), tuple(lay.head_count), self.head_groups,
                     self.rank, self.batch, width, label)

    def move(self, x, kind, label):
        return redistribute(x, self.plan(kind, x.shape[-1], label), self.group, self.ledger)

    def grid(self):
        return HeadContextGrid(self.layout, self.head_groups)

    def shard(self):
        s0 = self.layout.seq_offset[self.rank]
        return s0, s0 + self.layout.seq_count[self.rank]

    def mask(self, rows, keys):
        """(B, 1, Sq, Sk): query token rows[i] sees key j when start(i) <= j <= i."""
        j = torch.arange(keys, device=rows.device)
        see = (j[None, None, :] <= rows[None, :, None]) & \
              (j[None, None, :] >= self.doc_start[:, rows][:, :, None])
        return see[:, None]

    def key_ranges(self, rows, keys):
        """The same mask as flash's KeyRanges: row i sees [start(i), min(i + 1, keys))."""
        hi = (rows + 1).clamp(max=keys)[None].expand(self.batch, -1).contiguous()
        return KeyRanges(self.doc_start[:, rows].contiguous(), hi)

    def attend(self, q, k, v, rows, keys, scale):
        """attention() of query rows `rows` over keys [0, keys), the mask as
        the kind needs it (flash: ranges, never the (Sq, Sk) mask)."""
        def mask(what):
            return self.key_ranges(rows, keys) if what == "ranges" else self.mask(rows, keys)
        return attention(q, k, v, mask, scale, self.attention_kind, self.flash_block)


def rope(x, sp, pos):
    """Interleaved-pair rotation of x (B, T, heads, dr) at positions (B, T)."""
    c, s = sp.cos[pos][:, :, None, :], sp.sin[pos][:, :, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)


def _query_rows(sp, form):
    """The attention's query rows (global token indices) on this rank: every
    token but in laga2d, where they are its query chunks."""
    if form != "laga2d":
        return torch.arange(sp.layout.seq, device=sp.doc_start.device)
    ranges = sp.grid().queries[sp.rank]
    return torch.tensor([t for b, e in ranges for t in range(b, e)], dtype=torch.long,
                        device=sp.doc_start.device)


def _head_range(sp, form):
    if form == "laga2d":
        g = sp.grid()
        return g.head_offset[sp.rank], g.head_count[sp.rank]
    return sp.layout.head_offset[sp.rank], sp.layout.head_count[sp.rank]


def _heads_queries(sp, cfg, form, q, q_latent, rows):
    """q_h (B, Sq, H_r, dqk) for the rank's heads and query rows: per-head
    queries all-to-all (q_a2a), or the query latent moved and wq_b applied
    for the own heads locally (q_latent_ag / laga2d's q_latent_a2a)."""
    if q_latent is None:
        return sp.move(q, "to_queries" if form == "laga2d" else "seq_to_head", "q_a2a")
    qn, wq_b = q_latent
    qn = qn.unsqueeze(2)
    if form == "laga2d" and sp.grid().context_groups > 1:
        qn_q = sp.move(qn, "latent_to_queries", "q_latent_a2a")
    else:
        qn_q = sp.move(qn, "gather_seq", "q_latent_ag")
    h0, nh = _head_range(sp, form)
    dqk, dn = cfg.qk_head_dim, cfg.qk_nope_head_dim
    q_h = (qn_q.squeeze(2) @ wq_b[h0 * dqk:(h0 + nh) * dqk].t()).view(
        qn_q.shape[0], qn_q.shape[1], nh, dqk)
    # q_pe rotated at each query row's (in-document) position.
    return torch.cat([q_h[..., :dn], rope(q_h[..., dn:], sp, sp.pos[:, rows])], -1)


def mla_attention(form, q, c_kv, k_pe, wkv_b, sp, cfg, q_latent=None, overlap=False):
    """o_loc (B, L, H dv) of this rank's seq shard; see the module docstring."""
    if form not in FORMS:
        raise ValueError(f"form '{form}': expected one of {', '.join(FORMS)}")
    if overlap and form not in ("laga", "laga2d"):
        raise ValueError(f"overlap with form '{form}': only laga and laga2d have an overlapped "
                         "path (their latent collectives do not depend on the query path)")
    B, L = c_kv.shape[:2]
    H, C, dn, dr, dv = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, \
        cfg.qk_rope_head_dim, cfg.v_head_dim
    rows = _query_rows(sp, form)
    h0, nh = _head_range(sp, form)
    scale = cfg.softmax_scale()
    wkv = wkv_b.view(H, dn + dv, C)

    if form == "explicit":
        # kv of the local tokens for ALL heads, k_pe expanded over heads
        # (Megatron-Core's way), then three seq->head all-to-alls.
        kv = (c_kv @ wkv_b.t()).view(B, L, H, dn + dv)
        k = torch.cat([kv[..., :dn], k_pe[:, :, None, :].expand(B, L, H, dr)], -1)
        q_h = _heads_queries(sp, cfg, form, q, q_latent, rows)
        k_h = sp.move(k, "seq_to_head", "k_a2a")
        v_h = sp.move(kv[..., dn:].contiguous(), "seq_to_head", "v_a2a")
        o_h = sp.attend(q_h, k_h, v_h, rows, sp.layout.seq, scale)
        return sp.move(o_h, "head_to_seq", "out_a2a").reshape(B, L, H * dv)

    # laga, laga2d, absorbed: the latent [c_kv | k_pe] of every token, gathered.
    lat_loc = torch.cat([c_kv, k_pe], -1).unsqueeze(2)
    plan = sp.plan("gather_seq", C + dr, "latent_ag")
    if overlap:  # on the wire while the queries move
        wait = start_redistribute(lat_loc, plan, sp.group, sp.ledger)
        q_h = _heads_queries(sp, cfg, form, q, q_latent, rows)
        lat = wait().squeeze(2)
    else:
        q_h = _heads_queries(sp, cfg, form, q, q_latent, rows)
        lat = redistribute(lat_loc, plan, sp.group, sp.ledger).squeeze(2)
    back = "from_queries" if form == "laga2d" else "head_to_seq"

    if form == "absorbed":
        # W_UK into the queries and W_UV after attention, per head: attention
        # runs in the latent space over one key head shared by all.
        w_uk, w_uv = wkv[h0:h0 + nh, :dn], wkv[h0:h0 + nh, dn:]
        q_abs = torch.cat([torch.einsum("bshn,hnc->bshc", q_h[..., :dn], w_uk), q_h[..., dn:]], -1)
        lat_k = lat.unsqueeze(2)
        o_lat = sp.attend(q_abs, lat_k, lat_k[..., :C], rows, sp.layout.seq, scale)
        o_h = torch.einsum("bshc,hvc->bshv", o_lat, w_uv)
        return sp.move(o_h, back, "out_a2a").reshape(B, L, H * dv)

    # laga / laga2d: up-project the OWN heads over the keys attention needs.
    Sk = int(rows[-1]) + 1 if len(rows) else 0
    kv_h = (lat[:, :Sk, :C] @ wkv[h0:h0 + nh].reshape(nh * (dn + dv), C).t()).view(
        B, Sk, nh, dn + dv)
    k_h = torch.cat([kv_h[..., :dn], lat[:, :Sk, None, C:].expand(B, Sk, nh, dr)], -1)
    o_h = sp.attend(q_h, k_h, kv_h[..., dn:], rows, Sk, scale)
    return sp.move(o_h, back, "out_a2a").reshape(B, L, H * dv)
