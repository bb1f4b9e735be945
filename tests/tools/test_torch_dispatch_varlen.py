#!/usr/bin/python3
"""The attention dispatch's varlen kernels (python/laga_torch/dispatch_varlen.py;
issue 53 item 1; docs/pytorch.md, "The attention dispatch").

Usage: test_torch_dispatch_varlen.py LAGA WORKDIR

FlashAttention-3/4 are not installable here and cuDNN / the memory-efficient
SDPA kernel run only on CUDA, so the adapters are exercised against
stand-ins with the REAL signatures and return layouts, computing naive
attention on the packed tensors in float64:
  * flash_attn_interface.flash_attn_varlen_func (FA3: positional cu_seqlens,
    max_seqlen, softmax_scale, causal aligned bottom-right, (out, lse (H, T))
    with return_attn_probs; an older release without that argument that
    always returns the pair), flash_attn.cute.flash_attn_varlen_func (FA4:
    keyword cu_seqlens, return_lse), torch.ops.aten._cudnn_attention_forward
    / _backward (causal aligned top-left on packed sequences, lse (H, T)) and
    _efficient_attention_forward / _backward (batch 1, custom_mask_type 2,
    lse (sequences, H, max_q rounded up to 32) with the padding poisoned);
  * each adapter, through dispatch.forward / backward with the kernel asked
    for, against the package's tiles on the calls the forms make (packed
    documents, a mid-sequence query range, a ring's rectangle, rows that see
    no key, a call mixing full and causal runs; per-head 192/128 and equal
    dims, a shared key head): o, lse, dq, dk, dv within 1e-12 in float64;
    the ledger counts the kernel;
  * supports() naming the value it refuses (head dims, heads, dtype, device,
    cuDNN's top-left causal), and, without the stand-ins, the kernels
    reported absent and "auto" taking the next one, the log line naming each
    passed over and why;
  * ranks (P 2, gloo): every form on both tapes, packed, float64, "auto"
    with FA3's stand-in, then the efficient kernel's, against the tiles:
    out, dx, every gradient within 1e-12, the bytes kept equal, the ledger
    naming the kernel (a ring step's backward starts from the merged o and
    lse: merged_backward for FA3, the given o and lse for the SDPA ops).
The stand-ins run on the CPU in float64 only because the test widens the
kernels' NEEDS (dtype, device) for them; nothing of these kernels has run
for real.
"""

import io
import json
import logging
import math
import os
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import laga_torch as lt  # noqa: E402
from laga_torch import dispatch, dispatch_varlen  # noqa: E402
from laga_torch.attention import KeyRanges, flash_backward, flash_forward  # noqa: E402
from laga_torch.comm import Ledger  # noqa: E402
from test_torch_dispatch import B, CFG, DOCS, S, calls, rel, saved_bytes  # noqa: E402
from torch_ranks import end_ranks, parse_rank_args, run_ranks  # noqa: E402

K = dispatch.Kernel


def fail(msg):
    sys.exit("FAIL: " + msg)


# --------------------------------------------------------------------------
# The stand-ins: naive attention per packed sequence, differentiable
# --------------------------------------------------------------------------

def naive_varlen(q, k, v, cu_q, cu_k, scale, causal, top_left=False):
    """out (T, H, dv), lse (H, T) of packed sequences; causal aligned
    bottom-right (FlashAttention) or top-left (cuDNN on packed sequences)."""
    H, Hk = q.shape[1], k.shape[1]
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        qs = q[int(cu_q[s]):int(cu_q[s + 1])]
        ks = k[int(cu_k[s]):int(cu_k[s + 1])].repeat_interleave(H // Hk, 1)
        vs = v[int(cu_k[s]):int(cu_k[s + 1])].repeat_interleave(H // Hk, 1)
        n, m = qs.shape[0], ks.shape[0]
        sc = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if causal:
            i = torch.arange(n)[:, None]
            j = torch.arange(m)[None]
            sc = sc.masked_fill(j > (i if top_left else m - n + i), float("-inf"))
        lse = torch.logsumexp(sc, -1)
        outs.append(torch.einsum("hij,jhd->ihd", torch.exp(sc - lse[..., None]), vs))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def naive_varlen_backward(q, k, v, out, lse, do, cu_q, cu_k, scale, causal, top_left=False):
    """dq, dk, dv from the GIVEN out and lse (H, T), as the SDPA kernels'
    backward ops use theirs: P = exp(s - lse), dS = P (dO V^T - dO . out)."""
    H, Hk = q.shape[1], k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s in range(len(cu_q) - 1):
        a, e, ka, ke = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        qs, ks, vs = q[a:e], k[ka:ke].repeat_interleave(H // Hk, 1), \
            v[ka:ke].repeat_interleave(H // Hk, 1)
        n, m = qs.shape[0], ks.shape[0]
        sc = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if causal:
            i = torch.arange(n)[:, None]
            j = torch.arange(m)[None]
            sc = sc.masked_fill(j > (i if top_left else m - n + i), float("-inf"))
        p = torch.exp(sc - lse[:, a:e, None])
        dos = do[a:e]
        dp = torch.einsum("ihd,jhd->hij", dos, vs)
        ds = p * (dp - (dos * out[a:e]).sum(-1).t()[..., None])
        dq[a:e] = torch.einsum("hij,jhd->ihd", ds, ks) * scale
        dks = torch.einsum("hij,ihd->jhd", ds, qs) * scale
        dvs = torch.einsum("hij,ihd->jhd", p, dos)
        dk[ka:ke] = dks.reshape(m, Hk, H // Hk, -1).sum(2)
        dv[ka:ke] = dvs.reshape(m, Hk, H // Hk, -1).sum(2)
    return dq, dk, dv


def fa3_module(old=False):
    mod = types.ModuleType("flash_attn_interface")
    if old:
        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, softmax_scale=None, causal=False,
                                   window_size=(-1, -1), deterministic=False):
            return naive_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    else:
        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, seqused_q=None, seqused_k=None,
                                   softmax_scale=None, causal=False, qv=None, q_descale=None,
                                   k_descale=None, v_descale=None, window_size=(-1, -1),
                                   attention_chunk=0, softcap=0.0, num_splits=1,
                                   pack_gqa=None, deterministic=False, sm_margin=0,
                                   return_attn_probs=False):
            out, lse = naive_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                    causal)
            return (out, lse) if return_attn_probs else out
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return {"flash_attn_interface": mod}


def fa4_module():
    pkg, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None,
                               max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                               seqused_k=None, page_table=None, softmax_scale=None,
                               causal=False, window_size=(None, None), learnable_sink=None,
                               softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
                               score_mod=None, aux_tensors=None, return_lse=False):
        out, lse = naive_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return out, (lse if return_lse else None)
    cute.flash_attn_varlen_func = flash_attn_varlen_func
    pkg.cute = cute
    return {"flash_attn": pkg, "flash_attn.cute": cute}


def cudnn_ops():
    def fwd(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
            compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
            scale=None, seqused_k=None, block_table=None):
        out, lse = naive_varlen(query, key, value, cum_seq_q, cum_seq_k, scale, is_causal,
                                top_left=True)
        z = torch.zeros(())
        return out, lse, cum_seq_q, cum_seq_k, max_q, max_k, z, z, z

    def bwd(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
            attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
            scale=None):
        return naive_varlen_backward(query, key, value, out, logsumexp, grad_out, cum_seq_q,
                                     cum_seq_k, scale, is_causal, top_left=True)
    return {"cudnn": lambda: fwd, "cudnn_backward": lambda: bwd}


def efficient_ops():
    def mask_args(custom_mask_type):
        if custom_mask_type not in (0, 1, 2):
            fail(f"custom_mask_type {custom_mask_type}")
        return custom_mask_type != 0, custom_mask_type == 1

    def fwd(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            dropout_p, custom_mask_type, compute_log_sumexp=False, *, scale=None,
            seqlen_k=None, window_size=None):
        causal, top_left = mask_args(custom_mask_type)
        out, lse = naive_varlen(query[0], key[0], value[0], cu_seqlens_q, cu_seqlens_k, scale,
                                causal, top_left)
        n = len(cu_seqlens_q) - 1
        padded = torch.full((n, query.shape[2], math.ceil(max_seqlen_q / 32) * 32),
                            float("nan"), dtype=lse.dtype)  # the padding: never read
        for s in range(n):
            a, e = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
            padded[s, :, :e - a] = lse[:, a:e]
        z = torch.zeros(())
        return out[None], padded, z, z, max_seqlen_q, max_seqlen_k

    def bwd(grad_out_, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type,
            bias_requires_grad, *, scale=None, num_splits_key=None, window_size=None,
            shared_storage_dqdkdv=False):
        causal, top_left = mask_args(custom_mask_type)
        n = len(cu_seqlens_q) - 1
        lse = torch.cat([logsumexp[s, :, :int(cu_seqlens_q[s + 1] - cu_seqlens_q[s])]
                         for s in range(n)], 1)  # the per-sequence rows, padding left
        dq, dk, dv = naive_varlen_backward(query[0], key[0], value[0], out[0], lse,
                                           grad_out_[0], cu_seqlens_q, cu_seqlens_k, scale,
                                           causal, top_left)
        return dq[None], dk[None], dv[None], None
    return {"efficient": lambda: fwd, "efficient_backward": lambda: bwd}


class StandIns:
    """Installs stand-in modules / aten entry points and widens the kernels'
    NEEDS to the CPU and float64 (restored on exit)."""

    def __init__(self, modules=None, aten=None, widen=tuple(dispatch.NEEDS), any_dims=False):
        self.modules, self.aten, self.widen = modules or {}, aten or {}, widen
        self.any_dims = any_dims  # the model's small head dims (a stand-in has no limit)

    def __enter__(self):
        self.old_mods = {n: sys.modules.get(n) for n in self.modules}
        sys.modules.update(self.modules)
        self.old_aten = dict(dispatch_varlen.ATEN)
        dispatch_varlen.ATEN.update(self.aten)
        self.old_needs = {k: (n.dtypes, n.devices, n.present, n.dims)
                          for k, n in dispatch.NEEDS.items()}
        for kern in self.widen:
            n = dispatch.NEEDS[kern]
            n.dtypes, n.devices = n.dtypes + (torch.float64,), n.devices + ("cpu",)
            if self.any_dims:
                n.dims = lambda dqk, dv: None
        for kern, ops in ((K.cudnn, "cudnn"), (K.efficient, "efficient")):
            if ops in self.aten:
                dispatch.NEEDS[kern].present = lambda: None
        self.old_pref = dispatch.PREFERENCE.get("cpu")
        dispatch.PREFERENCE["cpu"] = dispatch.PREFERENCE["cuda"]
        return self

    def __exit__(self, *exc):
        for n, m in self.old_mods.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
        dispatch_varlen.ATEN.clear()
        dispatch_varlen.ATEN.update(self.old_aten)
        for k, (d, dev, p, dims) in self.old_needs.items():
            n = dispatch.NEEDS[k]
            n.dtypes, n.devices, n.present, n.dims = d, dev, p, dims
        if self.old_pref is None:
            dispatch.PREFERENCE.pop("cpu", None)
        else:
            dispatch.PREFERENCE["cpu"] = self.old_pref


# --------------------------------------------------------------------------
# The adapters against the tiles
# --------------------------------------------------------------------------

def all_calls():
    out = calls()
    # One call with full and causal runs: rows 0-1 see keys [0, 3) (a ring's
    # earlier shard), rows 2-4 their document [4, 5..7), row 5 none.
    lo = torch.tensor([[0, 0, 4, 4, 4, 7]] * B)
    hi = torch.tensor([[3, 3, 5, 6, 7, 7]] * B)
    out.append(("full and causal runs in one call", lo, hi, 8))
    return out


SHAPES = ((3, 3, 192, 128), (3, 1, 192, 128), (2, 2, 16, 16))  # H, Hk, dqk, dv


def adapters_agree():
    g = torch.Generator().manual_seed(53)
    rows, worst, refused = 0, 0.0, {}
    setups = {
        "fa3": (K.fa3, StandIns(modules=fa3_module())),
        "fa3 (a release without return_attn_probs)": (K.fa3, StandIns(
            modules=fa3_module(old=True))),
        "fa4": (K.fa4, StandIns(modules=fa4_module())),
        "cudnn": (K.cudnn, StandIns(aten=cudnn_ops())),
        "efficient": (K.efficient, StandIns(aten=efficient_ops())),
    }
    for label, (kern, standins) in setups.items():
        with standins:
            for name, lo, hi, Sk in all_calls():
                Sq = lo.shape[1]
                kr = KeyRanges(lo, hi)
                for H, Hk, dqk, dv in SHAPES:
                    q = torch.randn(B, Sq, H, dqk, generator=g, dtype=torch.float64)
                    k = torch.randn(B, Sk, Hk, dqk, generator=g, dtype=torch.float64)
                    v = torch.randn(B, Sk, Hk, dv, generator=g, dtype=torch.float64)
                    do = torch.randn(B, Sq, H, dv, generator=g, dtype=torch.float64)
                    why = dispatch.supports(kern, q, k, v, True, kr=kr)
                    if why is not None:
                        refused.setdefault(kern.name, set()).add(why)
                        continue
                    ledger = Ledger()
                    with dispatch.context(ledger, kern.name):
                        o, lse = dispatch.forward(q, k, v, kr, 0.3, 4)
                        grads = dispatch.backward(q, k, v, o, lse, do, kr, 0.3, 4)
                    if ledger.kernels != {("forward", kern.name): 1, ("backward", kern.name): 1}:
                        fail(f"{label}: the ledger counted {ledger.kernels}")
                    ro, rl = flash_forward(q, k, v, kr, 0.3, 4)
                    ref = (ro, rl) + tuple(flash_backward(q, k, v, ro, rl, do, kr, 0.3, 4))
                    for i, what in enumerate(("o", "lse", "dq", "dk", "dv")):
                        got = (o, lse) + tuple(grads)
                        if got[i].shape != ref[i].shape or got[i].dtype != ref[i].dtype:
                            fail(f"{label} ({name}): {what} {tuple(got[i].shape)} "
                                 f"{got[i].dtype}, the tiles' {tuple(ref[i].shape)} "
                                 f"{ref[i].dtype}")
                        e = rel(got[i], ref[i])
                        worst = max(worst, e)
                        if not e <= 1e-12:
                            fail(f"{label} against the tiles ({name}, H {H} over {Hk}, "
                                 f"{dqk}/{dv}): {what} off by {e:.3g} > 1e-12")
                    rows += 1
    # The refusals these shapes must meet, each naming its value.
    if not any("3 query heads over 1 key heads" in w for w in refused.get("cudnn", ())):
        fail(f"cudnn did not refuse the shared key head naming it: {refused.get('cudnn')}")
    if not any("causal run of 4 query rows over 6 keys" in w for w in refused.get("cudnn", ())):
        fail(f"cudnn did not refuse a bottom-right causal run naming it: {refused.get('cudnn')}")
    if "fa3" in refused or "fa4" in refused:
        fail(f"FlashAttention refused a call it takes: {refused}")
    return rows, worst, refused


def refusals():
    """supports() naming the value, with the stand-ins present."""
    out = []
    q = torch.zeros(1, 4, 4, 16, dtype=torch.bfloat16)
    k = torch.zeros(1, 4, 4, 16, dtype=torch.bfloat16)
    v = torch.zeros(1, 4, 4, 8, dtype=torch.bfloat16)
    with StandIns(modules={**fa3_module(), **fa4_module()}, widen=()):
        for kern, text in ((K.fa3, "head dims 16/8"), (K.fa4, "head dims 16/8")):
            why = dispatch.supports(kern, q, k, v, True)
            if why is None or text not in why:
                fail(f"{kern.name} on 16/8: expected a refusal naming '{text}', got {why!r}")
            out.append(f"{kern.name}: {why}")
        v = torch.zeros(1, 4, 4, 16, dtype=torch.bfloat16)
        why = dispatch.supports(K.fa3, q, k, v, True)
        if why is None or "device cpu" not in why:
            fail(f"fa3 on a CPU tensor: expected a refusal naming device cpu, got {why!r}")
        out.append(f"fa3: {why}")
        why = dispatch.supports(K.fa3, q.double(), k.double(), v.double(), True)
        if why is None or "dtype torch.float64" not in why:
            fail(f"fa3 in float64: expected a refusal naming the dtype, got {why!r}")
        out.append(f"fa3: {why}")
        why = dispatch.supports(K.fa4, q[:, :, :3], k[:, :, :2], v[:, :, :2], True)
        if why is None or "3 query heads over 2 key heads" not in why:
            fail(f"fa4 on 3 over 2 heads: expected a refusal naming them, got {why!r}")
        out.append(f"fa4: {why}")
    return out


def absent_then_next():
    """Without the stand-ins the varlen kernels are reported absent and auto
    takes the next; with FA3's stand-in it is chosen, without it FA4's."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("laga_torch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = []
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 5, 2, 16, generator=g, dtype=torch.float64)
    k, v = torch.randn(1, 5, 2, 16, generator=g, dtype=torch.float64), \
        torch.randn(1, 5, 2, 16, generator=g, dtype=torch.float64)
    kr = KeyRanges(torch.zeros(1, 5, dtype=torch.long), torch.arange(1, 6)[None])
    for mod in ("flash_attn_interface", "flash_attn.cute"):
        if mod in sys.modules or dispatch_varlen.fa3_module() is not None:
            out.append(f"{mod} is importable here: its absence is not checked")
    with StandIns(widen=(K.fa3, K.fa4)):  # tables widened, no module: absent
        for kern, text in ((K.fa3, "flash_attn_interface"), (K.fa4, "flash_attn.cute")):
            why = dispatch.supports(kern, q, k, v, True)
            if why is None or text not in why or "not importable" not in why:
                fail(f"{kern.name} without its module: expected '{text} ... not importable', "
                     f"got {why!r}")
        kern, _ = dispatch.choose(q, k, v, kr=kr)
        if kern in (K.fa3, K.fa4):
            fail(f"auto chose {kern.name} with its module absent")
        out.append(f"absent: auto took {kern.name}")
    for mods, expect in ((fa3_module(), K.fa3), (fa4_module(), K.fa4)):
        with StandIns(modules=mods, widen=(K.fa3, K.fa4)):
            ledger = Ledger()
            with dispatch.context(ledger):
                dispatch.forward(q, k, v, kr, 0.25, 4)
            if ledger.kernels != {("forward", expect.name): 1}:
                fail(f"auto with {sorted(mods)} present: the ledger says {ledger.kernels}, "
                     f"expected {expect.name}")
            out.append(f"{'+'.join(sorted(mods))} present: auto took {expect.name}")
    logger.removeHandler(handler)
    lines = [ln for ln in buf.getvalue().splitlines() if "attention forward" in ln]
    if not any("not fa3: flash_attn_interface" in ln and "not fa4: flash_attn.cute" in ln
               for ln in lines):
        fail(f"no log line names FA3 and FA4 absent: {lines}")
    if not any(ln.split(": ", 1)[1].startswith("fa4") and "not fa3: flash_attn_interface" in ln
               for ln in lines):
        fail(f"no log line says fa4 was chosen with fa3 absent: {lines}")
    out += lines
    return out


# --------------------------------------------------------------------------
# Ranks: every form, both tapes, through FA3's and the efficient kernel's
# stand-ins against the tiles
# --------------------------------------------------------------------------

RANK_KERNELS = {"fa3": lambda: StandIns(modules=fa3_module(), widen=(K.fa3,), any_dims=True),
                "efficient": lambda: StandIns(aten=efficient_ops(), widen=(K.efficient,),
                                              any_dims=True)}


def worker(args):
    import torch.distributed as dist
    r, P = args.rank, args.world
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=r,
                            world_size=P)
    cfg = lt.MLAConfig.from_json(CFG)
    own = lt.SpLayout.even(S, cfg.n_heads, P).positions(r)
    g = torch.Generator().manual_seed(43)
    x = torch.randn(B, S, cfg.dim, generator=g, dtype=torch.float64)[:, own]
    dout = torch.randn(B, S, cfg.dim, generator=g, dtype=torch.float64)[:, own]
    worst, cases, kernels = 0.0, 0, {}
    for form in lt.FORMS:
        for tape in ("laga", "autograd"):
            for name, standins in RANK_KERNELS.items():
                # absorbed's one shared key head: the efficient kernel (and cuDNN)
                # needs equal heads, so its calls are refused; FA3 takes them.
                res, kept = {}, {}
                with standins():
                    for kern in ("tiles", name):
                        torch.manual_seed(44)
                        m = lt.MLA(cfg, form=form, tape=tape, attention="flash", flash_block=4,
                                   dtype=torch.float64,
                                   attention_kernel=kern if kern == "tiles" else "auto")
                        m.ledger = lt.Ledger()
                        xi = x.clone().requires_grad_(True)
                        y, kept[kern] = saved_bytes(lambda: m(xi, cu_seqlens=DOCS))
                        y.backward(dout)
                        res[kern] = [y, xi.grad] + [p.grad for p in m.parameters()]
                        ks = {f"{a} {b}": c for (a, b), c in m.ledger.kernels.items()}
                e = max(rel(a, b) for a, b in zip(res[name], res["tiles"]))
                if not e <= 1e-12:
                    fail(f"P {P} rank {r} {form} tape {tape}: {name} off by {e:.3g} from the "
                         "tiles")
                if kept[name] != kept["tiles"]:
                    fail(f"P {P} rank {r} {form} tape {tape}: {name} keeps {kept[name]} bytes "
                         f"for backward, the tiles {kept['tiles']}")
                ran = {k.split()[1] for k in ks}
                if form != "absorbed" or name == "fa3":
                    if ran != {name}:
                        fail(f"{form} tape {tape}: auto with {name}'s stand-in ran {ks}")
                kernels[f"{form} {tape} {name}"] = ks
                worst, cases = max(worst, e), cases + 1
    with open(os.path.join(args.dir, f"disp-P{P}-r{r}.json"), "w") as f:
        json.dump({"worst": worst, "cases": cases, "kernels": kernels}, f)
    end_ranks()


def main():
    args = parse_rank_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.dir, exist_ok=True)
    torch.set_num_threads(2)
    t0 = time.time()
    rows, worst, refused = adapters_agree()
    print(f"adapters against the tiles: {rows} calls (5 kernels x calls x shapes), "
          f"o/lse/dq/dk/dv worst {worst:.3g} (<= 1e-12, float64)")
    for kern, whys in sorted(refused.items()):
        for w in sorted(whys):
            print(f"  refused by {kern}: {w}")
    for line in refusals() + absent_then_next():
        print(line)
    t1 = time.time()
    run_ranks(__file__, [args.laga, args.dir, "--worker"], 2, 200, fail)
    res = [json.load(open(os.path.join(args.dir, f"disp-P2-r{r}.json"))) for r in range(2)]
    w = max(x["worst"] for x in res)
    print(f"every form on both tapes at P 2 (packed, float64), auto with FA3's and the "
          f"efficient kernel's stand-ins: {sum(x['cases'] for x in res)} rank-cases within "
          f"{w:.2g} of the tiles, the bytes kept equal ({time.time() - t1:.1f} s); ledger "
          f"(rank 0): laga {res[0]['kernels']['laga laga fa3']}, absorbed with efficient "
          f"{res[0]['kernels']['absorbed laga efficient']}")
    print(f"PASS ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
