"""laga's forms behind torchtitan's context-parallel inner-attention
interface (docs/pytorch.md, "torchtitan"): torchtitan's CPInnerAttention
shape (torchtitan/models/common/attention_cp.py, read 2026-12):

  * packed THD tensors: this rank's T tokens of the (one, packed) sequence,
    [T, H, K] queries and keys, [T, H, V] values, [T, H, V] out;
  * prepare_cp_metadata(attention_metadata, *, permutation), a static
    method turning the global sequence's metadata into this rank's: here
    a SequenceMetadata (the global cu_seqlens, or seq_len, and the group);
    permutation None is contiguous sharding, the head-tail permutation
    (rank r holding chunks r and 2P-1-r of 2P, torchtitan's and
    TransformerEngine's load balancer) is laga's zigzag layout, anything
    else is refused naming what it is;
  * reduce_dtype: the dtype the backward's reductions sum in.

LatentCPAttention (laga, laga_fused, absorbed, laga2d, ring_latent: the
forms that move the latent) takes MLA's natural inputs, as torchtitan's
MLA context-parallel class takes (q_THK, kv_THP, k_shared_TR): the queries
(q_pe rotated), the normalised latent c_kv [T, C], k_pe [T, R] (rotated),
and wkv_b; HeadCPAttention (explicit as Ulysses, allgather_kv, ring_kv)
takes per-head (q, k, v). Both run the package's forms (forms.py; the
attention through dispatch.py) and return [T, H, V].
"""

import dataclasses
from typing import Optional, Sequence

import torch

from . import dispatch
from .config import MLAConfig
from .forms import FORMS, Attends, Keys, Sp, check_variant, mla_attention
from .layout import SpLayout
from .module import doc_starts, rope_tables
from .ring import KvBlocks, RingAttention


@dataclasses.dataclass
class SequenceMetadata:
    """The global sequence: its documents (global offsets 0 .. S) or its
    length, and the context-parallel group (None: the world)."""
    seq_len: Optional[int] = None
    cu_seqlens: Optional[Sequence[int]] = None
    group: Optional[object] = None


@dataclasses.dataclass
class LocalMetadata:
    """prepare_cp_metadata's result: what this rank's forward needs."""
    seq_len: int
    cu_seqlens: Optional[Sequence[int]]
    group: Optional[object]
    seq_layout: str
    rank: int
    ranks: int


def _head_tail(seq_len, ranks):
    """The head-tail permutation as torchtitan applies it: rank 0's tokens,
    then rank 1's, ... (rank r: chunks r and 2P-1-r of 2P)."""
    lay = SpLayout.even(seq_len, 1, ranks, "zigzag")
    return [t for r in range(ranks) for t in lay.positions(r)]


class _CPBase:
    reduce_dtype: torch.dtype

    def __init__(self, cfg, form, reduce_dtype=torch.float32, attention="flash",
                 attention_kernel="auto", flash_block=64):
        if isinstance(cfg, dict):
            cfg = MLAConfig.from_json(cfg)
        if reduce_dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"reduce_dtype {reduce_dtype}: expected torch.float32 or "
                             "torch.bfloat16 (torchtitan's choices) or torch.float64")
        if attention_kernel not in dispatch.REQUESTS:
            raise ValueError(f"attention_kernel '{attention_kernel}': expected "
                             f"{', '.join(dispatch.REQUESTS)}")
        self.cfg, self.form, self.reduce_dtype = cfg, form, reduce_dtype
        self.attention, self.attention_kernel, self.flash_block = attention, attention_kernel, \
            flash_block

    @staticmethod
    def prepare_cp_metadata(attention_metadata, *, permutation):
        """This rank's metadata from the global sequence's: the layout the
        permutation means (None: contiguous; head-tail: zigzag)."""
        import torch.distributed as dist
        md = attention_metadata
        if not isinstance(md, SequenceMetadata):
            raise TypeError(f"attention_metadata must be a laga_torch.torchtitan."
                            f"SequenceMetadata, got {type(md).__name__}")
        S = md.seq_len if md.cu_seqlens is None else int(list(md.cu_seqlens)[-1])
        if S is None:
            raise ValueError("attention_metadata gives neither seq_len nor cu_seqlens")
        P, r = dist.get_world_size(md.group), dist.get_rank(md.group)
        layout = "contiguous"
        if permutation is not None:
            perm = torch.as_tensor(permutation)
            if perm.dim() != 2 or perm.shape[1] != S:
                raise ValueError(f"permutation must have shape [1, seq_len] or [batch, seq_len] "
                                 f"with seq_len {S}, got {tuple(perm.shape)}")
            rows = {tuple(int(v) for v in row) for row in perm}
            if rows == {tuple(range(S))}:
                layout = "contiguous"
            elif rows == {tuple(_head_tail(S, P))}:
                layout = "zigzag"
            else:
                raise ValueError(f"permutation {perm[0, :8].tolist()}...: laga's forms run "
                                 "contiguous shards (None or the identity) or the head-tail "
                                 f"permutation (rank r holding chunks r and 2P-1-r of 2P; at "
                                 f"S {S}, P {P} it begins {_head_tail(S, P)[:8]})")
        return LocalMetadata(S, None if md.cu_seqlens is None else list(md.cu_seqlens),
                             md.group, layout, r, P)

    def _sp(self, md, T, dtype, device):
        lay = SpLayout.even(md.seq_len, self.cfg.n_heads, md.ranks, md.seq_layout)
        if T != lay.seq_count[md.rank]:
            ranges = ", ".join(f"[{b}, {e})" for b, e in lay.seq_ranges[md.rank])
            raise ValueError(f"this rank's tensors hold {T} tokens; rank {md.rank} of "
                             f"{md.ranks} holds {lay.seq_count[md.rank]}: {ranges}")
        cos, sin = rope_tables(self.cfg, md.seq_len, dtype, device)
        rows = None if md.cu_seqlens is None else [md.cu_seqlens]
        return Sp(lay, md.rank, md.group, None, 1, doc_starts(rows, 1, md.seq_len, device), cos,
                  sin, 0, self.attention, self.flash_block, self.form)

    def _compute_dtype(self, dtype):
        """reduce_dtype float32 under bf16 inputs: the form runs in fp32, so
        its gathers' reduce-scatters (and the rings' accumulators) sum in
        fp32; torchtitan keeps its forward in bf16 (docs/pytorch.md)."""
        def size(t):
            return torch.empty((), dtype=t).element_size()  # (torch 1.13 has no dtype.itemsize)
        return self.reduce_dtype if size(self.reduce_dtype) > size(dtype) else dtype


class LatentCPAttention(_CPBase):
    """forward(q_THK, kv_THP, k_shared_TR, wkv_b, *, attention_metadata)
    -> out_THV: q_THK [T, H, dn+dr] (q_pe rotated at its global positions),
    kv_THP the normalised latent c_kv [T, C] (or [T, 1, C]), k_shared_TR
    k_pe [T, dr] (or [T, 1, dr], rotated), wkv_b [H (dn+dv), C]; a form
    that moves the latent (laga, laga_fused, absorbed, laga2d,
    ring_latent)."""

    def __init__(self, cfg, form="laga", **kw):
        super().__init__(cfg, form, **kw)
        spec = check_variant(form, self.cfg)
        if spec.keys is Keys.heads or spec.keys is Keys.gather or \
                (spec.ring and spec.codec is KvBlocks):
            raise ValueError(f"LatentCPAttention form '{form}' moves per-head K and V; use "
                             "HeadCPAttention for it, or a latent form (laga, laga_fused, "
                             "absorbed, laga2d, ring_latent)")

    def forward(self, q_THK, kv_THP, k_shared_TR, wkv_b, *, attention_metadata):
        md = attention_metadata
        dtype = q_THK.dtype
        ct = self._compute_dtype(dtype)
        c = kv_THP.reshape(kv_THP.shape[0], -1)
        k_pe = k_shared_TR.reshape(k_shared_TR.shape[0], -1)
        sp = self._sp(md, q_THK.shape[0], ct, q_THK.device)
        with dispatch.context(None, self.attention_kernel):
            o = mla_attention(self.form, q_THK[None].to(ct), c[None].to(ct), k_pe[None].to(ct),
                              wkv_b.to(ct), sp, self.cfg)
        return o[0].view(q_THK.shape[0], self.cfg.n_heads, self.cfg.v_head_dim).to(dtype)

    __call__ = forward


class HeadCPAttention(_CPBase):
    """forward(q_THK, k_THK, v_THV, *, attention_metadata) -> out_THV for
    the forms that move per-head K and V: explicit (Ulysses: all-to-all to
    the heads' ranks), allgather_kv, ring_kv. cfg gives H, the head dims and
    the softmax scale."""

    def __init__(self, cfg, form="ring_kv", **kw):
        super().__init__(cfg, form, **kw)
        spec = check_variant(form, self.cfg)
        if not (spec.keys is Keys.heads or spec.keys is Keys.gather or
                (spec.ring and spec.codec is KvBlocks and spec.attends is Attends.own)):
            raise ValueError(f"HeadCPAttention form '{form}': expected explicit, allgather_kv "
                             "or ring_kv (the forms that move per-head K and V); the latent "
                             "forms take MLA's latent: LatentCPAttention")

    def forward(self, q_THK, k_THK, v_THV, *, attention_metadata, scale=None):
        md = attention_metadata
        dtype = q_THK.dtype
        ct = self._compute_dtype(dtype)
        T, H = q_THK.shape[:2]
        dqk, dv = k_THK.shape[2], v_THV.shape[2]
        sp = self._sp(md, T, ct, q_THK.device)
        q, k, v = (t[None].to(ct) for t in (q_THK, k_THK, v_THV))
        spec = FORMS[self.form]
        scale = self.cfg.softmax_scale() if scale is None else scale
        with dispatch.context(None, self.attention_kernel):
            if spec.ring:  # ring_kv: the flat [K | V] of the own tokens round the ring
                own = torch.cat([k.reshape(-1), v.reshape(-1)])
                o = RingAttention.apply(q, own, q.new_empty(0), sp, self.cfg, KvBlocks, False)
            elif spec.keys is Keys.gather:  # allgather_kv
                S, e = sp.layout.seq, sp.own_key_end()
                k_ag = sp.move(k.reshape(1, T, 1, H * dqk), "gather_seq", "k_ag").view(
                    1, S, H, dqk)
                v_ag = sp.move(v.reshape(1, T, 1, H * dv), "gather_seq", "v_ag").view(
                    1, S, H, dv)
                o = sp.attend(q, k_ag[:, :e], v_ag[:, :e], sp.own, e, scale)
            else:  # explicit: Ulysses, every token for the rank's heads
                rows = torch.arange(sp.layout.seq, device=q.device)
                q_h, k_h, v_h = (sp.move(t.contiguous(), "seq_to_head", lab)
                                 for t, lab in ((q, "q_a2a"), (k, "k_a2a"), (v, "v_a2a")))
                o = sp.move(sp.attend(q_h, k_h, v_h, rows, sp.layout.seq, scale), "head_to_seq",
                            "out_a2a")
        return o[0].reshape(T, H, dv).to(dtype)

    __call__ = forward


class InnerAttention(torch.nn.Module):
    """torchtitan's inner-attention call as its DeepSeek-V3 Attention makes
    it (torchtitan 0.3: inner_attention(q, k, v, attention_masks=...,
    scale=...) on [B, S, H, D] tensors): HeadCPAttention on each batch row,
    over `group` (None: the world), contiguous shards. attention_masks None
    is causal attention over a group of one; a SequenceMetadata gives the
    sequence's length or documents (needed over more ranks). Tested at P 1
    inside torchtitan's DeepSeek-V3 Attention (tools_torch_torchtitan);
    HeadCPAttention itself at P 2 and 3."""

    def __init__(self, cfg, form="explicit", group=None, **kw):
        super().__init__()
        self.head = HeadCPAttention(cfg, form, **kw)
        self.group = group

    def forward(self, q, k, v, attention_masks=None, scale=None, **kwargs):
        if attention_masks is None:
            md = SequenceMetadata(seq_len=None, group=self.group)
        elif isinstance(attention_masks, SequenceMetadata):
            md = attention_masks
        else:
            raise TypeError(f"attention_masks {type(attention_masks).__name__}: laga's inner "
                            "attention takes None (causal) or a laga_torch.torchtitan."
                            "SequenceMetadata (packed documents)")
        import torch.distributed as dist
        P = dist.get_world_size(md.group)
        if md.seq_len is None and md.cu_seqlens is None:
            if P > 1:  # (uneven shards: the length is not q's times P)
                raise ValueError(f"InnerAttention over a group of {P} ranks needs the whole "
                                 "sequence's length: attention_masks=SequenceMetadata(seq_len=S, "
                                 "group=...)")
            md = dataclasses.replace(md, seq_len=q.shape[1])
        local = HeadCPAttention.prepare_cp_metadata(md, permutation=None)
        return torch.stack([self.head(q[b], k[b], v[b], attention_metadata=local, scale=scale)
                            for b in range(q.shape[0])])
