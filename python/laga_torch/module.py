"""MLA(nn.Module): DeepSeek-V3's attention block as laga computes it
(docs/mla-math.md), on this rank's sequence shard, with the form chosen at
construction. Parameters under DeepSeek names; load_state_dict also takes
Hugging Face names (src/mla/params.cpp, hf_param_name)."""

import json
import logging
import math
import os
import shutil
import subprocess
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from .attention import KINDS
from .config import MLAConfig
from .forms import FORMS, Attends, Keys, Sp, check_variant, mla_attention, rope
from .layout import HeadContextGrid, SpLayout, check_seq_layout
from .names import HF_NAMES, resolve
from .norm import rms_norm
from .tape import Block

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        """x rstd w over the whole finite range (norm.py: rows divided by their
        largest |x| before squaring, never x.pow(2) as it stands)."""
        return rms_norm(x, self.weight, self.eps)


def rope_tables(cfg, positions, dtype, device):
    """cos, sin (positions, dr/2): angles in float64 (src/kernels/rope.cpp,
    rope_frequencies), then cast."""
    d = cfg.qk_rope_head_dim
    i = torch.arange(d // 2, dtype=torch.float64)
    f = 1.0 / cfg.rope_theta ** (2 * i / d)
    if cfg.yarn:
        def corr(rot):
            return d * math.log(cfg.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        low = max(math.floor(corr(cfg.beta_fast)), 0.0)
        high = min(math.ceil(corr(cfg.beta_slow)), float(d - 1))
        if low == high:
            high += 0.001
        smooth = 1 - ((i - low) / (high - low)).clamp(0, 1)
        f = f / cfg.rope_factor * (1 - smooth) + f * smooth
    a = torch.arange(positions, dtype=torch.float64)[:, None] * f[None, :]
    return a.cos().to(dtype=dtype, device=device), a.sin().to(dtype=dtype, device=device)


def doc_starts(cu_seqlens, batch, seq, device):
    """(B, S) first token of each token's document, from cu_seqlens: one
    list [0, e_1, ..., S] shared by every row, or one per row; GLOBAL
    offsets (ring-flash-attn's convention), strictly increasing."""
    if cu_seqlens is None:
        return torch.zeros(batch, seq, dtype=torch.long, device=device)
    rows = cu_seqlens
    if isinstance(rows, torch.Tensor):
        if rows.is_floating_point():
            raise ValueError(f"cu_seqlens has dtype {rows.dtype}; it holds token offsets (int)")
        rows = rows.tolist()
    if rows and not isinstance(rows[0], (list, tuple)):
        rows = [rows] * batch
    if len(rows) != batch:
        raise ValueError(f"cu_seqlens gives {len(rows)} rows for a batch of {batch}")
    out = torch.empty(batch, seq, dtype=torch.long)
    for b, cu in enumerate(rows):
        cu = [int(v) for v in cu]
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq:
            raise ValueError(f"cu_seqlens row {b} = {cu}: must run from 0 to the sequence length "
                             f"{seq}")
        if any(e <= s for s, e in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens row {b} = {cu}: must be strictly increasing (every "
                             "document at least one token)")
        for s, e in zip(cu, cu[1:]):
            out[b, s:e] = s
    return out.to(device)


log = logging.getLogger("laga_torch")


def plan_form(cfg, seq, ranks, batch, profile, laga=None, seq_layout="contiguous"):
    """The form `laga plan --json` picks for (cfg, S, P, B) on a hardware
    profile (a built-in name or a JSON file; docs/planning.md): (form,
    q_latent, overlap) of its winner among the forms this package implements
    (FORMS, the C++ build's seven). The binary: `laga`,
    else LAGA_BIN, else PATH."""
    laga = laga or os.environ.get("LAGA_BIN") or shutil.which("laga")
    if not laga:
        raise ValueError("form 'auto' asks `laga plan`, but no laga binary was found: set "
                         "LAGA_BIN or put laga on PATH, or choose a form")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg.to_json(), f)
    try:
        cmd = [laga, "plan", "--config", f.name, "--seq", str(seq), "--sp", str(ranks),
               "--batch", str(batch), "--profile", profile, "--json", "-", "--quiet",
               "--forms", ",".join(FORMS), "--seq-layout", seq_layout]
        if cfg.q_lora_rank:
            cmd.append("--q-latent")
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        os.unlink(f.name)
    if p.returncode:
        raise ValueError(f"form 'auto': {' '.join(cmd)} failed: {p.stderr.strip()}")
    winner = json.loads(p.stdout)["cases"][0]["winner"]
    parts = winner.split("+")
    return parts[0], "q-latent" in parts, "overlap" in parts


class MLA(nn.Module):
    """forward(x_local (B, S_r, D), group=None, cu_seqlens=None, seq_len=None)
    -> (B, S_r, D) for this rank's shard of SpLayout.even(S, H, P,
    seq_layout): the tokens SpLayout.positions(rank) of every row, in that
    order. seq_layout "contiguous" (rank r one range, in rank order) or
    "zigzag" (2P chunks, rank r holding chunks r and 2P-1-r: the
    load-balanced layout of TransformerEngine's context parallelism, which
    evens the causal work of allgather_kv and the rings; docs/forms.md, "The
    zigzag layout"). cu_seqlens stays in global offsets either way.

    form: a name in FORMS (explicit | absorbed | laga | laga2d |
    allgather_kv | ring_kv | ring_latent; each row says what it admits):
    head_groups: the grid forms' Ph (laga2d: 0 = gcd(H, P); a2a_p2p: 0 = the
    largest divisor of P below P that divides H); q_latent: laga/laga2d with
    q_lora_rank > 0 move the query latent; overlap: laga/laga2d start the
    latent gather before the queries move, the ring forms start each ring
    shift before the step's attention; "auto" with profile: laga plan's
    winner. tape "laga" (default):
    tape.Block, keeping what the C++ tape keeps; "autograd": the functional
    layer (forms.mla_attention) under autograd. attention: "eager" (or
    "math"; "auto" on laga's tape) keeps the probabilities, "flash" o and
    the log-sum-exp per row, in tiles of flash_block rows x keys, as the
    C++ tool's --attention; on tape "autograd" "auto" is SDPA where torch has
    it (the ring forms: eager, as a ring needs each block's log-sum-exp). Collectives are recorded in self.ledger (a Ledger) when set."""

    def __init__(self, cfg, form="laga", q_latent=False, overlap=False, head_groups=0,
                 attention="auto", tape="laga", profile=None, dtype=None, device=None,
                 flash_block=64, seq_layout="contiguous"):
        super().__init__()
        self.seq_layout = check_seq_layout(seq_layout)
        if isinstance(cfg, dict):
            cfg = MLAConfig.from_json(cfg)
        if form == "auto":
            if not profile:
                raise ValueError("form 'auto' needs a hardware profile for `laga plan` (profile="
                                 "'h100', a built-in name, or a profile JSON file)")
            if q_latent or overlap or head_groups:
                raise ValueError("form 'auto' takes q_latent and overlap from laga plan's winner "
                                 "(and laga2d's default head groups); give them with a form")
        elif form not in FORMS:
            raise ValueError(f"form '{form}': expected one of {', '.join(FORMS)} or auto")
        else:
            check_variant(form, cfg, q_latent, overlap, head_groups)
        self.cfg, self.form, self.q_latent, self.overlap = cfg, form, q_latent, overlap
        if tape not in ("laga", "autograd"):
            raise ValueError(f"tape '{tape}': expected laga (one autograd.Function keeping what "
                             "the C++ tape keeps) or autograd (the functional layer composed)")
        if attention not in KINDS:
            raise ValueError(f"attention '{attention}': expected eager or flash (the C++ tool's "
                             "--attention), auto, math (= eager) or sdpa (tape autograd)")
        if tape == "laga" and attention == "sdpa":
            raise ValueError("attention 'sdpa' with tape 'laga': laga's tape computes attention "
                             "itself, eager or flash; sdpa is tape 'autograd''s")
        if attention == "sdpa" and form in FORMS and FORMS[form].ring:
            raise ValueError(f"attention 'sdpa' with form '{form}': a ring merges each block's "
                             "log-sum-exp, which scaled_dot_product_attention does not return; "
                             "use eager or flash")
        if int(flash_block) != flash_block or flash_block < 1:
            raise ValueError(f"flash_block {flash_block}: expected a positive whole number of "
                             "rows and keys per tile")
        self.head_groups, self.attention, self.tape = head_groups, attention, tape
        self.flash_block = int(flash_block)
        self.profile, self.plans = profile, {}  # form 'auto': (S, P, B) -> laga plan's winner
        self.ledger = None
        kw = {"dtype": dtype, "device": device}
        D, H, dqk = cfg.dim, cfg.n_heads, cfg.qk_head_dim
        if cfg.q_lora_rank == 0:
            self.wq = nn.Linear(D, H * dqk, bias=False, **kw)
        else:
            self.wq_a = nn.Linear(D, cfg.q_lora_rank, bias=False, **kw)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps).to(**kw)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * dqk, bias=False, **kw)
        self.wkv_a = nn.Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False, **kw)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps).to(**kw)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                               bias=False, **kw)
        self.wo = nn.Linear(H * cfg.v_head_dim, D, bias=False, **kw)

    def load_state_dict(self, state_dict, strict=True, layer=None, **kwargs):
        """DeepSeek names, or Hugging Face's, bare or under
        `model.layers.<i>.self_attn.` (names.py, the C++ reader's rule): a
        parameter given under two names is refused, and so are several
        layers' attention weights unless `layer` picks one (a whole HF
        checkpoint's other tensors are left out)."""
        mapped = resolve(state_dict, layer)
        unused = [k for k in HF_NAMES if k in mapped and not hasattr(
            getattr(self, k.split(".")[0], None), "weight")]
        if strict and unused:  # (the C++ reader's verdict: another model's weights)
            raise ValueError(f"the state dict holds {', '.join(map(repr, unused))}, which this "
                             f"config has no place for (q_lora_rank {self.cfg.q_lora_rank}): the "
                             "weights are another model's; check the config")
        return super().load_state_dict(mapped, strict=strict, **kwargs)

    def forward(self, x, group=None, cu_seqlens=None, seq_len=None):
        cfg = self.cfg
        if x.dim() != 3 or x.shape[2] != cfg.dim:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected (B, S_r, {cfg.dim})")
        for name, p in self.named_parameters():
            if p.dtype != x.dtype or p.device != x.device:
                raise ValueError(f"x is {x.dtype} on {x.device} but parameter '{name}' is "
                                 f"{p.dtype} on {p.device}; move the module or the input")
        if not dist.is_initialized():
            raise ValueError("MLA.forward needs torch.distributed initialised (a group of one "
                             "rank is fine)")
        P, r = dist.get_world_size(group), dist.get_rank(group)
        B, L = x.shape[:2]
        if seq_len is None:
            if cu_seqlens is None:
                raise ValueError("give seq_len (the whole sequence's length S) or cu_seqlens "
                                 "(its documents; their last offset is S)")
            last = cu_seqlens[-1]
            last = last[-1] if isinstance(last, (list, tuple)) or (
                isinstance(last, torch.Tensor) and last.dim()) else last
            seq_len = int(last)
        lay = SpLayout.even(seq_len, cfg.n_heads, P, self.seq_layout)
        if L != lay.seq_count[r]:
            ranges = ", ".join(f"[{b}, {e})" for b, e in lay.seq_ranges[r])
            raise ValueError(f"x holds {L} tokens but rank {r} of {P} holds "
                             f"{lay.seq_count[r]} of S = {seq_len}, tokens {ranges} "
                             f"({lay.describe()})")
        form, q_latent, overlap = self.form, self.q_latent, self.overlap
        if form == "auto":
            key = (seq_len, P, B)
            if key not in self.plans:
                self.plans[key] = plan_form(cfg, seq_len, P, B, self.profile,
                                           seq_layout=self.seq_layout)
                log.info("laga plan (profile %s) picks %s for S %d, P %d, B %d", self.profile,
                         self.plans[key], seq_len, P, B)
            form, q_latent, overlap = self.plans[key]
        spec = FORMS[form]
        if spec.head_groups:  # the grid's check, on every rank before any collective
            HeadContextGrid(lay, self.head_groups or spec.default_head_groups(cfg.n_heads, P),
                            spec.grid_order)
        cos, sin = rope_tables(cfg, seq_len, x.dtype, x.device)
        sp = Sp(lay, r, group, self.ledger, B, doc_starts(cu_seqlens, B, seq_len, x.device),
                cos, sin, self.head_groups, self.attention, self.flash_block, form)
        if self.tape == "laga":
            return Block.apply(x, _Run(cfg, sp, form, q_latent, overlap, B,
                                       self.attention == "flash", self.flash_block),
                               *[dict(self.named_parameters())[n] for n in param_order(cfg)])
        pos = sp.pos[:, sp.own]
        H, dqk, dn = cfg.n_heads, cfg.qk_head_dim, cfg.qk_nope_head_dim
        q = query_latent = None
        if cfg.q_lora_rank == 0:
            q = self.wq(x)
        else:
            qn = self.q_norm(self.wq_a(x))
            if q_latent:
                query_latent = (qn, self.wq_b.weight)
            else:
                q = self.wq_b(qn)
        if q is not None:
            q = q.view(B, L, H, dqk)
            q = torch.cat([q[..., :dn], rope(q[..., dn:], sp, pos)], -1)
        kv = self.wkv_a(x)
        c_kv = self.kv_norm(kv[..., :cfg.kv_lora_rank])
        k_pe = rope(kv[..., cfg.kv_lora_rank:].unsqueeze(2), sp, pos).squeeze(2)
        o = mla_attention(form, q, c_kv, k_pe, self.wkv_b.weight, sp, cfg,
                          q_latent=query_latent, overlap=overlap)
        return self.wo(o)


class _Run:
    """What tape.Block needs beyond tensors: the config, this rank's Sp, the
    form's plans (labels as the C++ ledger's), query rows, heads and calls."""

    def __init__(self, cfg, sp, form, q_latent, overlap, batch, flash=False, block=64):
        from .forms import _head_range, _query_rows
        self.cfg, self.sp, self.form, self.q_latent, self.overlap = cfg, sp, form, q_latent, overlap
        self.flash, self.block = flash, block  # attention: flash (o, lse saved) or eager
        self.names = param_order(cfg)
        self.spec = spec = FORMS[form]
        self.rows = _query_rows(sp, form)
        self.heads = _head_range(sp, form)
        self.key_end = int(self.rows[-1]) + 1 if len(self.rows) else 0
        dqk, dv, H = cfg.qk_head_dim, cfg.v_head_dim, cfg.n_heads
        # One attention call per query range (rows a, b of q_h; keys [0, e)):
        # laga2d's query chunks, the own seq ranges (allgather_kv: two on
        # zigzag shards, as the C++ form calls), or every token.
        ranges = {Attends.grid: lambda: sp.grid().queries[sp.rank],
                  Attends.own: lambda: sp.layout.seq_ranges[sp.rank],
                  Attends.heads: lambda: [(0, sp.layout.seq)]}[spec.attends]()
        self.calls, a = [], 0
        for lo, hi in ranges:
            self.calls.append((a, a + hi - lo, hi))
            a += hi - lo
        # The movements, labels as the C++ ledger's (docs/forms.md, "Collectives per step").
        self.plans = {}
        grid = spec.attends is Attends.grid
        if spec.attends is not Attends.own:  # the queries to the heads' owners and the output back
            if q_latent:
                kind = "latent_to_queries" if grid and sp.grid().context_groups > 1 else \
                    "gather_seq"
                label = "q_latent_a2a" if kind == "latent_to_queries" else "q_latent_ag"
                self.plans["q"] = sp.plan(kind, cfg.q_lora_rank, label)
            else:
                self.plans["q"] = sp.plan("to_queries" if grid else "seq_to_head", dqk, "q_a2a")
            self.plans["out"] = sp.plan("from_queries" if grid else "head_to_seq", dv, "out_a2a")
        if spec.keys is Keys.heads or (spec.ring and grid):  # explicit's K and V (a2a_p2p: to the grid)
            kind = "to_queries" if grid else "seq_to_head"
            self.plans.update(k=sp.plan(kind, dqk, "k_a2a"), v=sp.plan(kind, dv, "v_a2a"))
        elif spec.keys is Keys.latent:
            self.plans["lat"] = sp.plan("gather_seq", cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                        "latent_ag")
        elif spec.keys is Keys.gather:  # every token's per-head K and V, as (B, L, 1, H d) rows
            self.plans.update(k=sp.plan("gather_seq", H * dqk, "k_ag"),
                              v=sp.plan("gather_seq", H * dv, "v_ag"))
        # the ring forms' rings: ring.py's shifts, no plan


def param_order(cfg):
    """The C++ MlaParams::for_each order (the gradient all-reduce's flat buffer)."""
    q = ["wq.weight"] if cfg.q_lora_rank == 0 else ["wq_a.weight", "q_norm.weight", "wq_b.weight"]
    return q + ["wkv_a.weight", "kv_norm.weight", "wkv_b.weight", "wo.weight"]


def sync_gradients(module, group=None, ledger=None, grad_reduce="fp32"):
    """Sums every parameter's gradient over the group in one all-reduce of a
    flat buffer (mla_sync_gradients: label grad_allreduce, phase grad_sync,
    bytes by the ring rule of src/comm/communicator.hpp).

    grad_reduce, for bf16 gradients (the C++ --grad-reduce): "fp32", the
    default, reduces them widened to fp32 (4 bytes an element on the wire,
    as mixed-precision trainers keep it) and rounds each sum to bf16 once;
    "bf16" reduces the bf16 buffer itself (half the bytes; it needs a
    backend that sums bf16: NCCL, not torch 1.13's gloo). fp32 and fp64
    gradients are reduced as they are either way."""
    if grad_reduce not in ("fp32", "bf16"):
        raise ValueError(f"grad_reduce={grad_reduce!r}: use 'fp32' or 'bf16'")
    P = dist.get_world_size(group)
    if P == 1:
        return
    params = dict(module.named_parameters())
    names = param_order(module.cfg)
    flat = torch.cat([params[n].grad.reshape(-1) for n in names])
    if flat.dtype in (torch.bfloat16, torch.float16) and grad_reduce == "fp32":
        flat = flat.float()
    dist.all_reduce(flat, group=group)
    if ledger is not None:
        n, r = flat.numel(), dist.get_rank(group)
        own = n // P + (1 if r < n % P else 0)
        b = ((n - own) + (P - 1) * own) * flat.element_size()
        ledger.add("grad_sync", "grad_allreduce", b, b)
    i = 0
    for name in names:
        g = params[name].grad
        g.copy_(flat[i:i + g.numel()].view_as(g))
        i += g.numel()
