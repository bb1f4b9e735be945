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
import inspect
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .attention import KINDS
from .config import MLAConfig
from .forms import (FORMS, Attends, Keys, Sp, check_invariant, check_variant, mla_attention,
                    names_with, rope)
from .invariant import TokenTree
from .layout import SEQ_LAYOUTS, HeadContextGrid, SpLayout, check_seq_layout
from . import checks
from .checks import check_documents, cu_seqlens_rows
from .names import HF_NAMES, resolve
from .norm import rms_norm
from .tape import Block
from . import dispatch, trainer

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
    rope_frequencies), then cast. (None, None) when nothing rotates (NoPE:
    mla_use_nope or qk_rope_head_dim 0, the C++ MlaConfig::rope's dim 0):
    every rotation (forms.rope, tape._rot) then returns its input as it is."""
    if not cfg.rotates:
        return None, None
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
    offsets (ring-flash-attn's convention), strictly increasing. Lists,
    tuples, numpy arrays and tensors of whole numbers (checks.cu_seqlens_rows)."""
    if cu_seqlens is None:
        return torch.zeros(batch, seq, dtype=torch.long, device=device)
    rows = cu_seqlens_rows(cu_seqlens, batch)
    check_documents(rows, seq)
    out = torch.empty(batch, seq, dtype=torch.long)
    for b, cu in enumerate(rows):
        for s, e in zip(cu, cu[1:]):
            out[b, s:e] = s
    return out.to(device)


log = logging.getLogger("laga_torch")


PLAN_TIMEOUT_S = 120


def laga_binary(laga=None):
    """(path, None) of the laga binary form 'auto' asks (the argument, else
    LAGA_BIN, else PATH), or (None, why not) where there is none usable."""
    if laga:
        where = "the laga binary given"
    elif os.environ.get("LAGA_BIN"):
        laga, where = os.environ["LAGA_BIN"], "LAGA_BIN"
    else:
        laga, where = shutil.which("laga"), "PATH"
        if not laga:
            return None, "no laga binary: LAGA_BIN is not set and there is no laga on PATH"
    if not os.path.exists(laga):
        return None, f"{where} = {laga}: no such file"
    if os.path.isdir(laga):
        return None, f"{where} = {laga} is a directory; give the laga executable (build/laga)"
    if not os.access(laga, os.X_OK):
        return None, f"{where} = {laga} is not executable"
    return laga, None


def plan_form(cfg, seq, ranks, batch, profile, laga=None, seq_layout="contiguous"):
    """The form `laga plan --json` picks for (cfg, S, P, B) on a hardware
    profile (a built-in name or a JSON file; docs/planning.md): (form,
    q_latent, overlap) of its winner among the forms this package implements
    (FORMS, the C++ build's: tools_forms_registry). The binary: `laga`,
    else LAGA_BIN, else PATH. Every failure is a ValueError saying what to
    do."""
    laga, why = laga_binary(laga)
    if not laga:
        raise ValueError(f"form 'auto' asks `laga plan`, but {why}: set LAGA_BIN to the laga "
                         "executable or put laga on PATH, or choose a form")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg.to_json(), f)
    cmd = [laga, "plan", "--config", f.name, "--seq", str(seq), "--sp", str(ranks),
           "--batch", str(batch), "--profile", str(profile), "--json", "-", "--quiet",
           "--forms", ",".join(FORMS), "--seq-layout", seq_layout]
    if cfg.q_lora_rank:
        cmd.append("--q-latent")
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=PLAN_TIMEOUT_S, errors="replace")
    except subprocess.TimeoutExpired:
        raise ValueError(f"form 'auto': {laga} plan did not finish in {PLAN_TIMEOUT_S} s; check "
                         "that LAGA_BIN is the laga tool, or choose a form") from None
    except OSError as e:
        raise ValueError(f"form 'auto': cannot run {laga} ({e.strerror}); LAGA_BIN must be the "
                         "laga executable built for this machine, or choose a form") from None
    finally:
        os.unlink(f.name)
    if p.returncode:
        err = p.stderr.strip()[-2000:] or "(nothing on stderr)"
        raise ValueError(f"form 'auto': {' '.join(cmd)} exited {p.returncode}: {err}")
    try:
        winner = json.loads(p.stdout)["cases"][0]["winner"]
        parts = winner.split("+")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        out = repr(p.stdout.strip()[:200]) if p.stdout.strip() else "nothing"
        raise ValueError(f"form 'auto': {laga} plan printed {out}, not laga plan's JSON (a "
                         "'cases' list with a 'winner'); is LAGA_BIN the laga tool?") from None
    if parts[0] not in FORMS or not set(parts[1:]) <= {"q-latent", "overlap"}:
        raise ValueError(f"form 'auto': laga plan's winner '{winner}' is not a form of this "
                         f"package ({', '.join(FORMS)}); is LAGA_BIN another laga version?")
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
                 flash_block=64, seq_layout="contiguous", attention_kernel="auto",
                 invariant=False):
        super().__init__()
        # Every argument's type first (a TypeError naming it), then its value.
        self.seq_layout = check_seq_layout(checks.name_arg(seq_layout, "seq_layout", SEQ_LAYOUTS))
        if isinstance(cfg, dict):
            cfg = MLAConfig.from_json(cfg)
        elif not isinstance(cfg, MLAConfig):
            raise checks.ArgumentTypeError(f"cfg must be an MLAConfig or a config dict, got "
                                           f"{type(cfg).__name__}")
        cfg.validate()  # a config changed after it was built is checked again
        checks.name_arg(form, "form", list(FORMS) + ["auto"])
        q_latent, overlap = checks.flag(q_latent, "q_latent"), checks.flag(overlap, "overlap")
        invariant = checks.flag(invariant, "invariant")
        head_groups = checks.whole(head_groups, "head_groups")
        if head_groups < 0:
            raise ValueError(f"head_groups {head_groups}: expected 0 (the form's default) or a "
                             "positive number of head groups")
        checks.name_arg(attention, "attention", KINDS)
        checks.name_arg(tape, "tape", ("laga", "autograd"))
        checks.name_arg(attention_kernel, "attention_kernel", dispatch.REQUESTS)
        flash_block = checks.whole(flash_block, "flash_block")
        if profile is not None and not isinstance(profile, (str, os.PathLike)):
            raise checks.ArgumentTypeError(f"profile must be a built-in profile name or a "
                                           f"profile JSON file's path, got "
                                           f"{type(profile).__name__}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or
                                  not dtype.is_floating_point):
            raise checks.ArgumentTypeError(f"dtype must be a floating torch.dtype (torch.float32, "
                                           f"torch.float64, torch.bfloat16) or None, got {dtype!r}")
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
        if invariant:  # docs/pytorch_invariant.md
            if form == "auto":
                raise ValueError("invariant=True with form 'auto': the planner's winner may be a "
                                 "form without the invariant mode; choose one of the forms that "
                                 f"offer it ({names_with('invariant', 'or')})")
            check_invariant(form)
            if tape != "laga":
                raise ValueError(f"invariant=True with tape '{tape}': the invariant mode is laga's "
                                 "tape's (its backward sums each weight's gradient in the token "
                                 "tree); use tape='laga'")
            if attention_kernel not in ("auto", "tiles"):
                raise ValueError(f"invariant=True with attention_kernel '{attention_kernel}': "
                                 "only the package's tiles are aligned to the global sequence "
                                 "and held bitwise across P; use 'tiles' or 'auto'")
        self.invariant = invariant
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
        if flash_block < 1:
            raise ValueError(f"flash_block {flash_block}: expected a positive whole number of "
                             "rows and keys per tile")
        self.head_groups, self.attention, self.tape = head_groups, attention, tape
        self.flash_block = flash_block
        if attention_kernel not in dispatch.REQUESTS:
            raise ValueError(f"attention_kernel '{attention_kernel}': expected "
                             f"{', '.join(dispatch.REQUESTS)} (dispatch.py)")
        self.attention_kernel = attention_kernel
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
        if cfg.mla_use_output_gate:  # Kimi K3's g_proj (docs/mla-math.md, "Gated NoPE MLA")
            self.wg = nn.Linear(D, H * cfg.v_head_dim, bias=False, **kw)
        self._register_load_state_dict_pre_hook(MLA._hf_names_pre_hook)
        trainer.register(self)  # the opaque op's handle under torch.compile (trainer.py)

    def load_state_dict(self, state_dict, strict=True, assign=False, layer=None):
        """DeepSeek names, or Hugging Face's, bare or under
        `model.layers.<i>.self_attn.` (names.py, the C++ reader's rule): a
        parameter given under two names is refused, and so are several
        layers' attention weights unless `layer` picks one (a whole HF
        checkpoint's other tensors are left out). `assign` is torch's (2.1+:
        the module takes the state dict's tensors, as after building it on
        the meta device); torch's own order, (state_dict, strict, assign).
        As a submodule of a model, HF names under the module's prefix load
        through _hf_names_pre_hook."""
        mapped = resolve(state_dict, layer)
        unused = [k for k in HF_NAMES if k in mapped and not hasattr(
            getattr(self, k.split(".")[0], None), "weight")]
        if strict and unused:  # (the C++ reader's verdict: another model's weights)
            why = ("mla_use_output_gate is false: the weights have Kimi K3's output gate; set "
                   "it true in the config") if unused == ["wg.weight"] else \
                f"q_lora_rank {self.cfg.q_lora_rank}"
            raise ValueError(f"the state dict holds {', '.join(map(repr, unused))}, which this "
                             f"config has no place for ({why}): the weights are another "
                             "model's; check the config")
        if strict and self.cfg.mla_use_output_gate and "wg.weight" not in mapped:
            # (the C++ reader's verdict, block_job.cpp: the config needs it)
            raise ValueError("the state dict has no 'wg.weight' (DeepSeek-style name) or "
                             "'g_proj.weight' (Kimi K3's name): the config's "
                             "mla_use_output_gate needs the output gate's weight; check the "
                             "config and the layer")
        if not assign:
            return super().load_state_dict(mapped, strict=strict)
        if "assign" not in inspect.signature(nn.Module.load_state_dict).parameters:
            raise ValueError(f"load_state_dict(assign=True) needs torch 2.1 or later (this is "
                             f"torch {torch.__version__}); load without assign")
        return super().load_state_dict(mapped, strict=strict, assign=True)

    @staticmethod
    def _hf_names_pre_hook(state_dict, prefix, *args):
        """A load_state_dict pre-hook: under this module's prefix (as a
        submodule, `model.layers.3.self_attn.`), Hugging Face's names
        (`kv_b_proj.weight`) are renamed to the DeepSeek ones it holds; one
        parameter under both names is refused naming both, as names.resolve
        refuses it at the top."""
        for ds, hf in HF_NAMES.items():
            if prefix + hf not in state_dict:
                continue
            if prefix + ds in state_dict:
                raise ValueError(f"parameter '{prefix}{ds}' is in the state dict under 2 names, "
                                 f"'{prefix}{ds}' and '{prefix}{hf}'; give each parameter once "
                                 "(two copies may be two models): remove one")
            state_dict[prefix + ds] = state_dict.pop(prefix + hf)

    def forward(self, x, group=None, cu_seqlens=None, seq_len=None):
        # Under torch.autocast the block runs in autocast's dtype, input and
        # weights cast once here (differentiable: the weights' gradients come
        # back in their own dtype), with autocast off inside, so forward and
        # the tape's backward see one dtype (docs/pytorch.md, "Trainers").
        amp = trainer.autocast_dtype(x)
        if trainer.compiling():  # one opaque op for torch.compile: no graph break
            return trainer.opaque_forward(self, x, group, cu_seqlens, seq_len, amp)
        if amp is None:
            return self.run_block(x, group, cu_seqlens, seq_len)
        with torch.autocast(x.device.type, enabled=False):
            return self.run_block(x.to(amp), group, cu_seqlens, seq_len,
                                  {n: p.to(amp) for n, p in self.named_parameters()})

    def run_block(self, x, group=None, cu_seqlens=None, seq_len=None, weights=None):
        """forward without autocast's casts, on `weights` ({name: tensor},
        default the parameters): the block as the tapes compute it."""
        cfg = self.cfg
        W = dict(self.named_parameters()) if weights is None else weights
        P, r = checks.group_arg(group)  # without a group there is no one to tell
        # This rank's arguments, checked before any collective; a refusal
        # is carried into the agreement check, so every rank raises it.
        local, error = None, None
        try:
            local = self._check_local(x, P, r, cu_seqlens, seq_len, W)
        except (ValueError, TypeError) as e:
            error = e
        flags = 0
        if self.form == "auto":
            if laga_binary()[0]:
                flags |= checks.FLAG_CAN_PLAN
            if local and (local[0], P, local[1]) not in self.plans:
                flags |= checks.FLAG_NEEDS_PLAN
        flags = checks.agree(group, "MLA.forward", self._fields(x, local), error, flags)
        seq_len, B, rows, lay = local
        L = x.shape[1]
        form, q_latent, overlap = self.form, self.q_latent, self.overlap
        if form == "auto":
            key = (seq_len, P, B)
            if any(f & checks.FLAG_NEEDS_PLAN for f in flags):
                self.plans[key] = self._plan_once(group, P, r, seq_len, B, flags)
                log.info("laga plan (profile %s) picks %s for S %d, P %d, B %d", self.profile,
                         self.plans[key], seq_len, P, B)
            form, q_latent, overlap = self.plans[key]
            spec = FORMS[form]
            if spec.head_groups:  # the same grid on every rank: S, P agreed
                HeadContextGrid(lay, spec.default_head_groups(cfg.n_heads, P), spec.grid_order)
        cos, sin = rope_tables(cfg, seq_len, x.dtype, x.device)
        sp = Sp(lay, r, group, self.ledger, B, doc_starts(rows, B, seq_len, x.device), cos, sin,
                self.head_groups, self.attention, self.flash_block, form)
        # every flash call inside picks its kernel (dispatch.py), counted in the ledger
        with dispatch.context(self.ledger, self.attention_kernel):
            if self.tape == "laga":
                return Block.apply(x, _Run(cfg, sp, form, q_latent, overlap, B,
                                           self.attention == "flash", self.flash_block,
                                           self.attention_kernel, self.invariant),
                                   *[W[n] for n in param_order(cfg)])
            pos = sp.pos[:, sp.own]
            H, dqk, dn = cfg.n_heads, cfg.qk_head_dim, cfg.qk_nope_head_dim
            q = query_latent = None
            if cfg.q_lora_rank == 0:
                q = F.linear(x, W["wq.weight"])
            else:
                qn = rms_norm(F.linear(x, W["wq_a.weight"]), W["q_norm.weight"], cfg.norm_eps)
                if q_latent:
                    query_latent = (qn, W["wq_b.weight"])
                else:
                    q = F.linear(qn, W["wq_b.weight"])
            if q is not None:
                q = q.view(B, L, H, dqk)
                q = torch.cat([q[..., :dn], rope(q[..., dn:], sp, pos)], -1)
            kv = F.linear(x, W["wkv_a.weight"])
            c_kv = rms_norm(kv[..., :cfg.kv_lora_rank], W["kv_norm.weight"], cfg.norm_eps)
            k_pe = rope(kv[..., cfg.kv_lora_rank:].unsqueeze(2), sp, pos).squeeze(2)
            o = mla_attention(form, q, c_kv, k_pe, W["wkv_b.weight"], sp, cfg,
                              q_latent=query_latent, overlap=overlap, check_ranks=False)
            if cfg.mla_use_output_gate:  # o * sigmoid(x wg^T) before wo
                o = o * torch.sigmoid(F.linear(x, W["wg.weight"]))
            return F.linear(o, W["wo.weight"])


    def _check_local(self, x, P, r, cu_seqlens, seq_len, W):
        """(S, B, cu_seqlens rows or None, layout) of this forward, or the
        ValueError / TypeError naming what is wrong with this rank's
        arguments."""
        cfg = self.cfg
        if not isinstance(x, torch.Tensor):
            raise checks.ArgumentTypeError(f"x must be a tensor (B, S_r, {cfg.dim}), got "
                                           f"{type(x).__name__}")
        if x.dim() != 3 or x.shape[2] != cfg.dim:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected (B, S_r, {cfg.dim})")
        for name, p in W.items():
            if p.dtype != x.dtype or p.device != x.device:
                raise ValueError(f"x is {x.dtype} on {x.device} but parameter '{name}' is "
                                 f"{p.dtype} on {p.device}; move the module or the input")
        if self.invariant and (x.dtype not in (torch.float32, torch.float64) or
                               x.device.type != "cpu"):
            raise ValueError(f"invariant=True with {x.dtype} on {x.device.type}: the invariant "
                             "mode is built and tested for float32 and float64 on the CPU only "
                             "(docs/pytorch_invariant.md)")
        if self.ledger is not None and not callable(getattr(self.ledger, "add", None)):
            raise checks.ArgumentTypeError(f"ledger must be a laga_torch.Ledger or None, got "
                                           f"{type(self.ledger).__name__}")
        B, L = x.shape[:2]
        if B < 1:
            raise ValueError(f"x has shape {tuple(x.shape)}: a batch of {B} rows; expected at "
                             "least one")
        seq_len = checks.seq_len_arg(seq_len)
        rows = cu_seqlens_rows(cu_seqlens, B)
        if seq_len is None:
            if rows is None:
                raise ValueError("give seq_len (the whole sequence's length S) or cu_seqlens "
                                 "(its documents; their last offset is S)")
            if not rows[0]:
                raise ValueError("cu_seqlens is empty; it runs from 0 to S")
            seq_len = checks.seq_len_arg(rows[0][-1])
        if rows is not None:
            check_documents(rows, seq_len)
        lay = SpLayout.even(seq_len, cfg.n_heads, P, self.seq_layout)
        if L != lay.seq_count[r]:
            ranges = ", ".join(f"[{b}, {e})" for b, e in lay.seq_ranges[r])
            raise ValueError(f"x holds {L} tokens but rank {r} of {P} holds "
                             f"{lay.seq_count[r]} of S = {seq_len}, tokens {ranges} "
                             f"({lay.describe()})")
        if self.form != "auto" and FORMS[self.form].head_groups:  # the grid's check
            spec = FORMS[self.form]
            HeadContextGrid(lay, self.head_groups or spec.default_head_groups(cfg.n_heads, P),
                            spec.grid_order)
        return seq_len, B, rows, lay

    def _fields(self, x, local):
        """What every rank must agree on, as text (checks.agree)."""
        d = checks.describe
        f = {"form": d(f"{self.form} q_latent={self.q_latent} overlap={self.overlap} "
                       f"head_groups={self.head_groups} profile={self.profile} "
                       f"invariant={self.invariant}"),
             "attention": d(f"{self.attention} tape={self.tape} flash_block={self.flash_block} "
                            f"kernel={self.attention_kernel}"),
             "config": d(self.cfg.to_json(), 4000),
             "module": d([[n, list(p.shape), str(p.dtype)] for n, p in self.named_parameters()],
                         4000),
             "seq_layout": self.seq_layout}
        if isinstance(x, torch.Tensor):
            f["dtype"] = f"{x.dtype} on {x.device.type}"
            f["grad"] = str(torch.is_grad_enabled() and (
                x.requires_grad or any(p.requires_grad for p in self.parameters())))
        f["weights"] = self._weights_sample()
        if local:
            f["seq_len"], f["batch"] = str(local[0]), str(local[1])
            f["cu_seqlens"] = d(local[2])
        return f

    def _weights_sample(self):
        """A hash of 64 evenly spaced elements of each parameter, bit for
        bit: ranks that loaded or initialised different weights (a seed per
        rank, a broadcast forgotten) differ here. Sampled, not summed, so
        that no summation order can make equal weights differ; one small
        device-to-host copy."""
        try:
            parts = []
            for _, p in sorted(self.named_parameters()):
                flat = p.detach().reshape(-1)
                n = flat.numel()
                idx = torch.linspace(0, max(n - 1, 0), min(n, 64), device=p.device).long()
                parts.append(flat[idx].contiguous().view(torch.uint8))
            data = torch.cat(parts).cpu().numpy().tobytes() if parts else b""
            return f"sampled hash {checks._hash(data.hex()) & 0xFFFFFFFFFFFF:012x}"
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            return "?"  # a meta module: refused by the dtype/device check anyway

    def _plan_once(self, group, P, r, seq_len, B, flags):
        """form 'auto': `laga plan` run once, on the first rank that has the
        binary, and its choice (or its failure) read by every rank."""
        def plan():
            return plan_form(self.cfg, seq_len, P, B, self.profile, seq_layout=self.seq_layout)
        if P == 1:
            return plan()
        device = checks._device(group)
        planners = [i for i, f in enumerate(flags) if f & checks.FLAG_CAN_PLAN]
        if not planners:
            why = checks.gather_texts(group, checks.TEXT_CAP, laga_binary()[1] or "?", device)
            said = "; ".join(f"{checks._ranks(rs)}: {w}" for w, rs in checks._grouped(why).items())
            raise ValueError(f"form 'auto' asks `laga plan`, but no rank of the group can run it "
                             f"({said}): set LAGA_BIN to the laga executable or put laga on PATH "
                             "on at least one rank, or choose a form")
        text = ""
        if r == planners[0]:
            try:
                text = json.dumps({"plan": list(plan())})
            except Exception as e:  # every rank must hear of it
                text = json.dumps({"error": str(e) or type(e).__name__})
        said = json.loads(checks.gather_texts(group, checks.TEXT_CAP, text, device)[planners[0]])
        if "error" in said:
            raise ValueError(f"{said['error']} (laga plan ran on rank {planners[0]} for every "
                             "rank)")
        return tuple(said["plan"])


class _Run:
    """What tape.Block needs beyond tensors: the config, this rank's Sp, the
    form's plans (labels as the C++ ledger's), query rows, heads and calls."""

    def __init__(self, cfg, sp, form, q_latent, overlap, batch, flash=False, block=64,
                 kernel="auto", invariant=False):
        from .forms import _head_range, _query_rows
        self.cfg, self.sp, self.form, self.q_latent, self.overlap = cfg, sp, form, q_latent, overlap
        self.flash, self.block = flash, block  # attention: flash (o, lse saved) or eager
        self.kernel = kernel  # flash's kernel request (dispatch.py)
        # the invariant mode's token tree (invariant.py); None: the rank-order paths
        self.tree = TokenTree(sp.layout, sp.rank, sp.group, sp.ledger, batch) if invariant \
            else None
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
    gate = ["wg.weight"] if cfg.mla_use_output_gate else []
    return q + ["wkv_a.weight", "kv_norm.weight", "wkv_b.weight", "wo.weight"] + gate


def sync_gradients(module, group=None, ledger=None, grad_reduce="fp32"):
    """Sums every parameter's gradient over the group in one all-reduce of a
    flat buffer (mla_sync_gradients: label grad_allreduce, phase grad_sync,
    bytes by the ring rule of src/comm/communicator.hpp).

    grad_reduce, for bf16 gradients (the C++ --grad-reduce): "fp32", the
    default, reduces them widened to fp32 (4 bytes an element on the wire,
    as mixed-precision trainers keep it) and rounds each sum to bf16 once;
    "bf16" reduces the bf16 buffer itself (half the bytes; it needs a
    backend that sums bf16: NCCL, not torch 1.13's gloo). fp32 and fp64
    gradients are reduced as they are either way.

    A module with invariant=True needs no sum: its backward left the whole
    sequence's gradients, summed in the token tree, on every rank
    (invariant.py); sync_gradients checks the ranks agree and returns."""
    P, _ = checks.group_arg(group)
    error, names, params = None, [], {}
    try:  # this rank's refusal is every rank's (checks.agree), never an all-reduce of another size
        if not isinstance(module, MLA):
            raise checks.ArgumentTypeError(f"sync_gradients takes an MLA module, got "
                                           f"{type(module).__name__}")
        if ledger is not None and not callable(getattr(ledger, "add", None)):
            raise checks.ArgumentTypeError(f"ledger must be a laga_torch.Ledger or None, got "
                                           f"{type(ledger).__name__}")
        if not isinstance(grad_reduce, str) or grad_reduce not in ("fp32", "bf16"):
            raise ValueError(f"grad_reduce={grad_reduce!r}: use 'fp32' or 'bf16'")
        params = dict(module.named_parameters())
        names = param_order(module.cfg)
        missing = [n for n in names if params[n].grad is None]
        if missing:
            raise ValueError(f"sync_gradients: parameter{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing)} ha{'ve' if len(missing) > 1 else 's'} no "
                             "gradient: call it after backward (out.backward(...)), on every "
                             "rank, with the gradients not set to None")
        dts = {params[n].grad.dtype for n in names}
        if len(dts) > 1:
            raise ValueError(f"sync_gradients: the gradients have dtypes "
                             f"{sorted(map(str, dts))}; one all-reduce needs one dtype")
    except (ValueError, TypeError) as e:
        error = e
    fields = {"grad_reduce": str(grad_reduce), "invariant": str(getattr(module, "invariant", None)),
              "grads": checks.describe([[n, list(params[n].shape),
                                         str(getattr(params[n].grad, "dtype", None))]
                                        for n in names if n in params], 4000)}
    checks.agree(group, "sync_gradients", fields, error)
    if P == 1 or module.invariant:  # invariant: backward made the whole sequence's on every rank
        return
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
