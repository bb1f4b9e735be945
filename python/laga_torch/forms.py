"""The forms' attention on P ranks: the functional layer, and the forms'
registry (FORMS).

Each function reads as its block in docs/forms.md, which describes the same
data flow for the C++ forms (src/mla/form_NAME.cpp, one file a form:
explicit, absorbed, laga, laga_fused (here: fused.py), laga2d, allgather_kv,
ring_kv, ring_latent, a2a_p2p); the labels are the C++ ledger's.
Inputs are this rank's seq shard after the local projections (the
pith-train shape): q (B, L, H, dqk) = [q_nope | q_pe] with q_pe rotated (or
with q_latent the normalised query latent qn (B, L, rq) and wq_b), c_kv =
kv_norm(c) (B, L, C), k_pe rotated (B, L, dr), and wkv_b (H (dn+dv), C).
The output is o_loc (B, L, H dv), ready for wo. Parameter gradients,
wkv_b's included, come through autograd, each rank's partial (sum them over
the group, as `sync_gradients` does).
"""

import enum
import functools

import torch

from . import fused
from .attention import KeyRanges, attention
from .checks import functional_checked
from .comm import Placement, Plan, redistribute, start_redistribute
from .layout import HeadContextGrid
from .ring import KvBlocks, LatentBlocks, RingAttention, RingSp


class Attends(enum.Enum):
    """Where each rank's attention runs (the C++ FormSpec::attention)."""
    heads = "every token, the rank's heads (after the seq->head all-to-all)"
    grid = "the grid's query chunks x its head group's heads (laga2d, a2a_p2p)"
    own = "the rank's own tokens with all heads (no query or output exchange)"


class Keys(enum.Enum):
    """How the keys reach the rank's attention (the labels its ledger files)."""
    heads = "per-head K and V all-to-all seq->head (k_a2a, v_a2a)"
    latent = "the latent [c_hat | k_pe] all-gathered (latent_ag)"
    gather = "per-head K and V all-gathered (k_ag, v_ag)"
    ring = "blocks round the ring (ring.py; the codec's labels)"


class FormSpec:
    """One form's row, as the C++ registry row (src/mla/form_spec.hpp,
    FormTraits and FormSpec::attention): what it admits and how its data
    moves. Everything that is not the form reads it here.

    query_latent, overlap, head_groups: the variants it admits (q_latent,
    overlap, laga2d's head_groups). attends (Attends): where each rank's
    attention runs. keys (Keys): how the keys reach it. codec (Keys.ring):
    the block the ring passes, ring.KvBlocks (the per-head [K | V],
    kv_ring/dkv_ring) or ring.LatentBlocks (the latent,
    latent_ring/dlatent_ring), as the C++ ring forms' codecs. grid_order
    (Attends.grid): "head_major" (laga2d) or "context_major" (a2a_p2p, whose
    ring runs across the context groups of the rank's head group).

    reference, exact_at_one_rank: the C++ FormTraits of the same names (the
    one form the others are held to; a form that runs the reference's
    arithmetic at P 1). fused (Keys.latent): the up-projection made inside
    the flash attention call and K/V never kept (laga_fused, fused.py).
    invariant: the form offers MLA(..., invariant=True), out, dx and every
    gradient bitwise the same at every P (invariant.py; the forms without
    it say why in INVARIANT_REFUSAL).

    tests/tools/test_forms_registry.py holds these rows equal to the C++
    registry's (`laga forms --json`): the names in order and every trait."""

    def __init__(self, name, attends, keys, codec=None, query_latent=False, overlap=False,
                 head_groups=False, grid_order="head_major", reference=False,
                 exact_at_one_rank=False, fused=False, invariant=False):
        self.name, self.attends, self.keys, self.codec = name, attends, keys, codec
        self.query_latent, self.overlap, self.head_groups = query_latent, overlap, head_groups
        self.grid_order, self.fused, self.invariant = grid_order, fused, invariant
        self.reference, self.exact_at_one_rank = reference, exact_at_one_rank

    def default_head_groups(self, heads, ranks):
        """Ph when head_groups is 0: laga2d's gcd(H, P); a2a_p2p's leaves a ring."""
        if self.grid_order == "context_major":
            return HeadContextGrid.ring_default_head_groups(heads, ranks)
        return HeadContextGrid.default_head_groups(heads, ranks)

    @property
    def ring(self):
        return self.keys is Keys.ring


def registry(rows):
    """The rows as the registry {name: row}, refused (ValueError) unless the
    names are distinct and exactly one row is the reference: the C++
    registry's own check (check_form_rows, src/mla/form.cpp)."""
    names = [f.name for f in rows]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"laga_torch's form registry names {', '.join(twice)} more than once")
    refs = [f.name for f in rows if f.reference]
    if len(refs) != 1:
        raise ValueError("laga_torch's form registry must have exactly one reference form (the "
                         "one every other form is held to); it has "
                         f"{len(refs)}{': ' + ', '.join(refs) if refs else ''}")
    return {f.name: f for f in rows}


# The registry, in the C++ order (src/mla/forms.def; `laga forms`).
FORMS = registry((
    FormSpec("explicit", Attends.heads, Keys.heads, reference=True, invariant=True),
    FormSpec("absorbed", Attends.heads, Keys.latent, invariant=True),
    FormSpec("laga", Attends.heads, Keys.latent, query_latent=True, overlap=True,
             exact_at_one_rank=True, invariant=True),
    FormSpec("laga_fused", Attends.heads, Keys.latent, query_latent=True, overlap=True,
             fused=True, invariant=True),
    FormSpec("laga2d", Attends.grid, Keys.latent, query_latent=True, overlap=True,
             head_groups=True, exact_at_one_rank=True),
    FormSpec("allgather_kv", Attends.own, Keys.gather, exact_at_one_rank=True, invariant=True),
    FormSpec("ring_kv", Attends.own, Keys.ring, codec=KvBlocks, overlap=True,
             exact_at_one_rank=True),
    FormSpec("ring_latent", Attends.own, Keys.ring, codec=LatentBlocks, overlap=True,
             exact_at_one_rank=True),
    FormSpec("a2a_p2p", Attends.grid, Keys.ring, codec=KvBlocks, overlap=True, head_groups=True,
             grid_order="context_major", exact_at_one_rank=True)))


# Why a form does not offer the invariant mode, and what to use (the refusal's words).
_RING_MERGE = ("its output merges the ring's P blocks by log-sum-exp, as many and in an order "
               "that P sets")
INVARIANT_REFUSAL = {
    "laga2d": "its attention is cut into query chunks that P sets, and its keys' gradients are "
              "summed over a head group's ranks in rank order",
    "ring_kv": _RING_MERGE,
    "ring_latent": _RING_MERGE,
    "a2a_p2p": _RING_MERGE,
}

if set(INVARIANT_REFUSAL) != {n for n, f in FORMS.items() if not f.invariant}:
    raise ValueError("laga_torch's form registry: every form without the invariant mode needs "
                     "its reason in INVARIANT_REFUSAL, and only those")


def check_invariant(form):
    """The invariant mode's form check: a ValueError naming the form, why it
    cannot, and the forms that can."""
    if not FORMS[form].invariant:
        raise ValueError(f"invariant=True with form '{form}': {INVARIANT_REFUSAL[form]}, so its "
                         f"results change with P; use {names_with('invariant', 'or')} (the "
                         "forms that offer the invariant mode: docs/pytorch_invariant.md)")


def reference_form():
    """The name of the one reference row (every reader of "the reference
    form" asks here, as the C++ readers ask reference_form())."""
    return next(f.name for f in FORMS.values() if f.reference)


def form_spec(form):
    """The row of a form name; an unknown name is a ValueError listing them."""
    if form not in FORMS:
        raise ValueError(f"form '{form}': expected one of {', '.join(FORMS)}")
    return FORMS[form]


def names_with(trait, conj="and"):
    """The forms with a trait in words, for the messages that refuse a
    variant: "laga and laga2d", "laga, laga2d, ring_kv and ring_latent"."""
    n = [f.name for f in FORMS.values() if getattr(f, trait)]
    return n[0] if len(n) == 1 else ", ".join(n[:-1]) + f" {conj} " + n[-1]


def check_variant(form, cfg, q_latent=False, overlap=False, head_groups=0):
    """The one variant check (the C++ check_variant): a ValueError naming the
    option and the form when the form's row does not admit it."""
    spec = form_spec(form)
    if q_latent and cfg.q_lora_rank == 0:
        raise ValueError("q_latent needs q_lora_rank > 0 (there is no query latent to move); "
                         "this config has q_lora_rank 0")
    if q_latent and not spec.query_latent:
        raise ValueError(f"q_latent with form '{form}': only {names_with('query_latent')} move "
                         "the query latent")
    if overlap and not spec.overlap:
        raise ValueError(f"overlap with form '{form}': only {names_with('overlap')} have an "
                         "overlapped path")
    if head_groups and not spec.head_groups:
        raise ValueError(f"head_groups {head_groups} with form '{form}': only "
                         f"{names_with('head_groups')} has head groups")
    return spec


@functools.lru_cache(maxsize=256)
def _plan(kind, seq_ranges, head_counts, head_groups, rank, batch, width, label,
          order="head_major"):
    """The placements of each movement (docs/forms.md, "The four data
    movements"; redistribute in src/mla/exchange.hpp). seq_ranges: each
    rank's token ranges (the layout's, contiguous or zigzag)."""
    from .layout import SpLayout
    lay = SpLayout([sum(e - b for b, e in rr) for rr in seq_ranges], list(head_counts),
                   seq_ranges)
    P, S, H = lay.ranks, lay.seq, lay.heads
    shard = [Placement(lay.seq_ranges[i], 0, H) for i in range(P)]
    row = [Placement(p.ranges, 0, 1) for p in shard]  # a (B, L, 1, W) row per token
    if kind in ("seq_to_head", "head_to_seq"):
        heads = [Placement([(0, S)], lay.head_offset[j], lay.head_count[j]) for j in range(P)]
        src, dst = (shard, heads) if kind == "seq_to_head" else (heads, shard)
    elif kind == "gather_seq":  # all-gather; its adjoint the reduce-scatter
        src, dst = row, [Placement([(0, S)], 0, 1)] * P
    else:  # laga2d: tokens <-> each rank's query chunks x its group's heads
        g = HeadContextGrid(lay, head_groups, order)
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

    ring = None  # as ring.RingSp's: the ring forms run one ring of every rank

    def __init__(self, layout, rank, group, ledger, batch, doc_start, cos, sin, head_groups=0,
                 attention_kind="auto", flash_block=64, form=None):
        self.layout, self.rank, self.group, self.ledger = layout, rank, group, ledger
        self.batch, self.doc_start, self.cos, self.sin = batch, doc_start, cos, sin
        self.attention_kind, self.flash_block = attention_kind, flash_block
        # The grid of the form run (laga2d's, or a2a_p2p's context-major one).
        spec = FORMS.get(form) if form else None
        self.grid_order = spec.grid_order if spec else "head_major"
        self.head_groups = head_groups or (
            spec.default_head_groups(layout.heads, layout.ranks) if spec else
            HeadContextGrid.default_head_groups(layout.heads, layout.ranks))
        S = layout.seq
        self.pos = torch.arange(S, device=doc_start.device)[None, :] - doc_start
        # The own tokens' global indices (L,), in the shard's row order:
        # one range, or the zigzag layout's two.
        self.own = torch.tensor(layout.positions(rank), dtype=torch.long, device=doc_start.device)

    def plan(self, kind, width, label):
        lay = self.layout
        return _plan(kind, tuple(tuple(r) for r in lay.seq_ranges), tuple(lay.head_count),
                     self.head_groups, self.rank, self.batch, width, label, self.grid_order)

    def move(self, x, kind, label):
        return redistribute(x, self.plan(kind, x.shape[-1], label), self.group, self.ledger)

    def grid(self):
        return HeadContextGrid(self.layout, self.head_groups, self.grid_order)

    def head_group_ring(self):
        """a2a_p2p's ring (ring.RingSp): the Pc ranks of this rank's head
        group, each with its context group's query rows, Ph apart."""
        return RingSp.of_grid(self, self.grid())

    def own_key_end(self):
        """One past the own tokens' last: the keys they can see are [0, this)."""
        return int(self.layout.seq_ranges[self.rank][-1][1])

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
    """Interleaved-pair rotation of x (B, T, heads, dr) at positions (B, T);
    x itself when nothing rotates (NoPE: sp.cos None, module.rope_tables)."""
    if sp.cos is None:
        return x
    c, s = sp.cos[pos][:, :, None, :], sp.sin[pos][:, :, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)


def _query_rows(sp, form):
    """The attention's query rows (global token indices) on this rank: every
    token (Attends.heads), laga2d's query chunks (grid), or its own tokens
    (own)."""
    where = FORMS[form].attends
    dev = sp.doc_start.device
    if where is Attends.heads:
        return torch.arange(sp.layout.seq, device=dev)
    if where is Attends.own:
        return sp.own
    ranges = sp.grid().queries[sp.rank]
    return torch.tensor([t for b, e in ranges for t in range(b, e)], dtype=torch.long, device=dev)


def _head_range(sp, form):
    """(h0, nh): the heads this rank attends."""
    where = FORMS[form].attends
    if where is Attends.grid:
        g = sp.grid()
        return g.head_offset[sp.rank], g.head_count[sp.rank]
    if where is Attends.own:
        return 0, sp.layout.heads
    return sp.layout.head_offset[sp.rank], sp.layout.head_count[sp.rank]


def _heads_queries(sp, cfg, form, q, q_latent, rows):
    """q_h (B, Sq, H_r, dqk) for the rank's heads and query rows: per-head
    queries all-to-all (q_a2a), or the query latent moved and wq_b applied
    for the own heads locally (q_latent_ag / laga2d's q_latent_a2a)."""
    grid = FORMS[form].attends is Attends.grid
    if q_latent is None:
        return sp.move(q, "to_queries" if grid else "seq_to_head", "q_a2a")
    qn, wq_b = q_latent
    qn = qn.unsqueeze(2)
    if grid and sp.grid().context_groups > 1:
        qn_q = sp.move(qn, "latent_to_queries", "q_latent_a2a")
    else:
        qn_q = sp.move(qn, "gather_seq", "q_latent_ag")
    h0, nh = _head_range(sp, form)
    dqk, dn = cfg.qk_head_dim, cfg.qk_nope_head_dim
    q_h = (qn_q.squeeze(2) @ wq_b[h0 * dqk:(h0 + nh) * dqk].t()).view(
        qn_q.shape[0], qn_q.shape[1], nh, dqk)
    # q_pe rotated at each query row's (in-document) position.
    return torch.cat([q_h[..., :dn], rope(q_h[..., dn:], sp, sp.pos[:, rows])], -1)


def _own_tokens(form, q, c_kv, k_pe, wkv_b, sp, cfg, overlap):
    """allgather_kv and the ring forms: the rank's own tokens with all
    heads, so no query or output exchange (q is already (B, L, H, dqk))."""
    B, L = c_kv.shape[:2]
    H, dn, dr, dv = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    dqk, spec = dn + dr, FORMS[form]
    if spec.ring:  # the own block (made under autograd), round the ring
        own = spec.codec(cfg, B, wkv_b).own_block(c_kv, k_pe)
        o = RingAttention.apply(q, own, wkv_b, sp, cfg, spec.codec, overlap)
        return o.reshape(B, L, H * dv)
    # K and V of the local tokens for all heads, k_pe expanded (explicit's).
    kv = (c_kv @ wkv_b.t()).view(B, L, H, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe[:, :, None, :].expand(B, L, H, dr)], -1)
    v = kv[..., dn:]
    # allgather_kv: K and V of every token (one (B, L, 1, H d) row per token
    # gathered, in sequence order), attended by the own queries over the keys
    # [0, e) they see, e one past the last own token.
    S, e = sp.layout.seq, sp.own_key_end()
    k_ag = sp.move(k.reshape(B, L, 1, H * dqk), "gather_seq", "k_ag").view(B, S, H, dqk)
    v_ag = sp.move(v.reshape(B, L, 1, H * dv), "gather_seq", "v_ag").view(B, S, H, dv)
    o = sp.attend(q, k_ag[:, :e], v_ag[:, :e], sp.own, e, cfg.softmax_scale())
    return o.reshape(B, L, H * dv)


def mla_attention(form, q, c_kv, k_pe, wkv_b, sp, cfg, q_latent=None, overlap=False,
                  check_ranks=True):
    """o_loc (B, L, H dv) of this rank's seq shard; see the module docstring.
    Every argument is checked first and, with check_ranks (MLA.forward,
    which has checked, passes False), the ranks' agreement as MLA.forward's
    (checks.agree): a bad argument on one rank is the same error on all."""
    functional_checked(form, q, c_kv, k_pe, wkv_b, sp, cfg, q_latent, overlap, check_ranks)
    spec = check_variant(form, cfg, q_latent is not None, overlap)
    B, L = c_kv.shape[:2]
    H, C, dn, dr, dv = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, \
        cfg.qk_rope_head_dim, cfg.v_head_dim
    if spec.attends is Attends.own:
        return _own_tokens(form, q, c_kv, k_pe, wkv_b, sp, cfg, overlap)
    rows = _query_rows(sp, form)
    h0, nh = _head_range(sp, form)
    scale = cfg.softmax_scale()
    wkv = wkv_b.view(H, dn + dv, C)

    # To the heads' ranks and back: the whole sequence's, or the grid's chunks.
    to, back = ("to_queries", "from_queries") if spec.attends is Attends.grid else \
        ("seq_to_head", "head_to_seq")
    if spec.keys is Keys.heads or spec.ring:  # explicit; a2a_p2p on its grid
        # kv of the local tokens for ALL heads, k_pe expanded over heads
        # (Megatron-Core's way), then three all-to-alls to the heads' ranks.
        kv = (c_kv @ wkv_b.t()).view(B, L, H, dn + dv)
        k = torch.cat([kv[..., :dn], k_pe[:, :, None, :].expand(B, L, H, dr)], -1)
        q_h = _heads_queries(sp, cfg, form, q, q_latent, rows)
        k_h = sp.move(k, to, "k_a2a")
        v_h = sp.move(kv[..., dn:].contiguous(), to, "v_a2a")
        if spec.ring:  # a2a_p2p: the [K | V] of its rows round the head group's ring
            own = torch.cat([k_h.reshape(-1), v_h.reshape(-1)])
            codec = functools.partial(spec.codec, heads=nh)
            o_h = RingAttention.apply(q_h, own, wkv_b, sp.head_group_ring(), cfg, codec, overlap)
        else:
            o_h = sp.attend(q_h, k_h, v_h, rows, sp.layout.seq, scale)
        return sp.move(o_h, back, "out_a2a").reshape(B, L, H * dv)

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
    if spec.fused and sp.attention_kind == "flash" and nh and len(rows):
        # laga_fused: K/V made inside the attention call, never kept (fused.py).
        w_rows = wkv[h0:h0 + nh].reshape(nh * (dn + dv), C)
        o_h = fused.LatentFlash.apply(q_h, lat[:, :Sk], w_rows, sp.key_ranges(rows, Sk), scale,
                                      sp.flash_block, cfg)
        return sp.move(o_h, back, "out_a2a").reshape(B, L, H * dv)
    kv_h = (lat[:, :Sk, :C] @ wkv[h0:h0 + nh].reshape(nh * (dn + dv), C).t()).view(
        B, Sk, nh, dn + dv)
    k_h = torch.cat([kv_h[..., :dn], lat[:, :Sk, None, C:].expand(B, Sk, nh, dr)], -1)
    o_h = sp.attend(q_h, k_h, kv_h[..., dn:], rows, Sk, scale)
    return sp.move(o_h, back, "out_a2a").reshape(B, L, H * dv)
