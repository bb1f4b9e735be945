#!/usr/bin/python3
"""laga_torch.torchtitan: torchtitan's context-parallel inner-attention shape
(packed [T, H, D] tensors, prepare_cp_metadata(md, *, permutation),
reduce_dtype) over laga's forms (issue 53 item 3; docs/pytorch.md,
"torchtitan").

Usage: test_torch_torchtitan.py LAGA WORKDIR

At P 2 and 3 (gloo, free ports), packed documents [0, 4, 9, 13] and
one sequence, contiguous (permutation None) and head-tail (the zigzag
permutation) shards: LatentCPAttention for laga, laga_fused, absorbed,
laga2d and ring_latent on (q, c_kv, k_pe, wkv_b), and HeadCPAttention for
explicit, allgather_kv and ring_kv on (q, k, v), each rank's out and the
gradients of its q, latent (or k, v) and of wkv_b (summed over ranks)
within 1e-12 (float64) of a naive causal in-document softmax attention
written here on the whole sequence; the same for Kimi K3's NoPE configs
(KIMI: mla_use_nope with dr 4 unrotated, and qk_rope_head_dim 0) on packed
documents, both layouts; reduce_dtype float32 under bf16 inputs
within the bf16 bound of float64 (24 u). Refused, naming the value: a
permutation that is neither contiguous nor head-tail, a latent form given
to HeadCPAttention and the reverse, a shard of the wrong length.
python/examples/train_mla_torchtitan.py (a two-layer MLA model through
LatentCPAttention): 6 AdamW steps at P 2, head-tail laga and contiguous
ring_latent, equal to P 1 within 1e-10 per step's loss, falling. Where
torchtitan imports: its DeepSeek-V3 Attention with laga's InnerAttention
swapped in equals its own SDPA (torchtitan_swap).
"""

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import laga_torch as lt  # noqa: E402
from laga_torch import torchtitan as tt  # noqa: E402
from torch_ranks import end_ranks, free_port, parse_rank_args, run_ranks  # noqa: E402

CFG = {"dim": 24, "n_heads": 5, "kv_lora_rank": 10, "qk_nope_head_dim": 8,
       "qk_rope_head_dim": 4, "v_head_dim": 6, "q_lora_rank": 7, "original_seq_len": 8,
       "max_seq_len": 32, "rope_factor": 4.0, "mscale": 0.7, "beta_fast": 4.0, "beta_slow": 1.0}
# Kimi K3's NoPE MLA from its config.json keys (docs/mla-math.md, "Gated NoPE
# MLA"): the adapter rotates nothing itself, so the same inner attention with
# dr 4 kept unrotated and scale (dn + dr)^-1/2 (no YaRN mscale); and dr 0
# (empty k_pe). The gate is the model's, outside the inner attention.
KIMI = [dict(CFG, mla_use_nope=True, mla_use_output_gate=True),
        dict(CFG, qk_rope_head_dim=0, q_lora_rank=0)]
S = 13
LATENT = ["laga", "laga_fused", "absorbed", "laga2d", "ring_latent"]
HEADS = ["explicit", "allgather_kv", "ring_kv"]
U_BF16 = 2.0 ** -8


def fail(msg):
    sys.exit("FAIL: " + msg)


def rel(a, ref):
    if ref.numel() == 0:  # dr 0's k_pe: nothing to differ, but the shape
        return 0.0 if a.shape == ref.shape else float("inf")
    d = (a.double() - ref.double()).abs().max().item()
    s = ref.double().abs().max().item()
    return d / s if s > 0 else d


def naive(q, k, v, cu, scale):
    """Causal in-document softmax attention on the whole sequence:
    q (S, H, dqk), k (S, H, dqk), v (S, H, dv)."""
    start = torch.zeros(S, dtype=torch.long)
    for b, e in zip(cu, cu[1:]):
        start[b:e] = b
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    see = (j <= i) & (j >= start[:, None])
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    p = s.masked_fill(~see, float("-inf")).softmax(-1)
    return torch.einsum("hij,jhd->ihd", p, v)


def inputs(cfg):
    g = torch.Generator().manual_seed(31)
    H, C, dn, dr, dv = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, \
        cfg.qk_rope_head_dim, cfg.v_head_dim
    f = (lambda *s: torch.randn(*s, generator=g, dtype=torch.float64))
    return {"q": f(S, H, dn + dr), "c": f(S, C), "k_pe": f(S, dr),
            "wkv_b": f(H * (dn + dv), C) / C ** 0.5, "k": f(S, H, dn + dr), "v": f(S, H, dv),
            "do": f(S, H, dv)}


def reference(cfg, x, cu, latent):
    """out and gradients of the whole sequence, the naive attention."""
    H, dn, dv = cfg.n_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    leaves = {n: x[n].clone().requires_grad_(True) for n in
              (("q", "c", "k_pe", "wkv_b") if latent else ("q", "k", "v"))}
    if latent:
        kv = (leaves["c"] @ leaves["wkv_b"].t()).view(S, H, dn + dv)
        k = torch.cat([kv[..., :dn], leaves["k_pe"][:, None].expand(S, H, -1)], -1)
        v = kv[..., dn:]
    else:
        k, v = leaves["k"], leaves["v"]
    o = naive(leaves["q"], k, v, cu, cfg.softmax_scale())
    o.backward(x["do"])
    return o.detach(), {n: t.grad for n, t in leaves.items()}


def worker(args):
    r, P = args.rank, args.world
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=r,
                            world_size=P)
    worst, worst_bf16, cases = 0.0, 0.0, 0
    runs = [(CFG, cu, layout) for cu in ([0, 4, 9, 13], [0, 13])
            for layout in ("contiguous", "zigzag")]
    runs += [(k, [0, 4, 9, 13], layout) for k in KIMI for layout in ("contiguous", "zigzag")]
    for cfg_json, cu, layout in runs:
        cfg = lt.MLAConfig.from_json(cfg_json)
        x = inputs(cfg)
        if not cfg.rotates and cfg.softmax_scale() != cfg.qk_head_dim ** -0.5:
            fail(f"{cfg_json}: NoPE's softmax scale {cfg.softmax_scale()} is not (dn + dr)^-1/2")
        perm = None if layout == "contiguous" else torch.tensor([tt._head_tail(S, P)])
        md = tt.LatentCPAttention.prepare_cp_metadata(
            tt.SequenceMetadata(cu_seqlens=cu), permutation=perm)
        if md.seq_layout != (layout if P > 1 else "contiguous"):  # (P 1: the identity)
            fail(f"permutation {perm}: read as {md.seq_layout}, expected {layout}")
        own = torch.tensor(lt.SpLayout.even(S, cfg.n_heads, P, layout).positions(r))
        for latent, forms in ((True, LATENT), (False, HEADS)):
            ref_o, ref_g = reference(cfg, x, cu, latent)
            for form in forms:
                cls = tt.LatentCPAttention if latent else tt.HeadCPAttention
                att = cls(cfg, form, reduce_dtype=torch.float64)
                names = ("q", "c", "k_pe", "wkv_b") if latent else ("q", "k", "v")
                loc = {n: (x[n] if n == "wkv_b" else x[n][own]).clone().requires_grad_(True)
                       for n in names}
                args_ = [loc[n] for n in names]
                o = att(*args_, attention_metadata=md)
                o.backward(x["do"][own])
                errs = [rel(o, ref_o[own])]
                for n in names:
                    gr = loc[n].grad.clone()
                    if n == "wkv_b":
                        dist.all_reduce(gr)
                        errs.append(rel(gr, ref_g[n]))
                    else:
                        errs.append(rel(gr, ref_g[n][own]))
                if max(errs) > 1e-12:
                    fail(f"P {P} {form} {layout} cu {cu}: off by {max(errs):.3g} from the "
                         "naive attention (out, then each input's gradient: "
                         f"{['%.2g' % e for e in errs]})")
                worst, cases = max(worst, max(errs)), cases + 1
                if form in ("laga", "ring_kv") and cu[1] == 4 and cfg_json is CFG:  # reduce_dtype fp32 under bf16
                    att = cls(cfg, form, reduce_dtype=torch.float32)
                    b = [t.detach().to(torch.bfloat16).requires_grad_(True) for t in args_]
                    ob = att(*b, attention_metadata=md)
                    if ob.dtype != torch.bfloat16:
                        fail(f"{form}: bf16 inputs gave a {ob.dtype} output")
                    e = rel(ob, ref_o[own]) / (24 * U_BF16)
                    worst_bf16 = max(worst_bf16, e)
                    if e > 1:
                        fail(f"P {P} {form} bf16 with reduce_dtype float32: out off by "
                             f"{e:.2f} of the bf16 bound 24 u")
    cfg = lt.MLAConfig.from_json(CFG)
    x = inputs(cfg)
    # refusals, each naming the value
    md_try = tt.SequenceMetadata(seq_len=S)
    refusals = 0
    for what, fn, needle in [
            ("a permutation neither contiguous nor head-tail",
             lambda: tt.LatentCPAttention.prepare_cp_metadata(
                 md_try, permutation=torch.tensor([list(reversed(range(S)))])), "head-tail"),
            ("a permutation of the wrong length",
             lambda: tt.LatentCPAttention.prepare_cp_metadata(
                 md_try, permutation=torch.tensor([list(range(S - 1))])), "seq_len 13"),
            ("a per-head form as latent", lambda: tt.LatentCPAttention(cfg, "ring_kv"),
             "HeadCPAttention"),
            ("a latent form as per-head", lambda: tt.HeadCPAttention(cfg, "laga"),
             "LatentCPAttention"),
            ("a shard of the wrong length",
             lambda: tt.HeadCPAttention(cfg, "ring_kv")(
                 x["q"][:2], x["k"][:2], x["v"][:2],
                 attention_metadata=tt.LatentCPAttention.prepare_cp_metadata(
                     md_try, permutation=None)), "hold 2 tokens")]:
        try:
            fn()
        except (ValueError, TypeError) as e:
            if needle not in str(e):
                fail(f"{what}: the refusal does not say '{needle}': {e}")
            refusals += 1
            continue
        fail(f"{what} was accepted")
    with open(os.path.join(args.dir, f"tt-P{P}-r{r}.json"), "w") as f:
        json.dump({"worst": worst, "worst_bf16": worst_bf16, "cases": cases,
                   "refusals": refusals}, f)
    end_ranks()


def made_with_torchtitan():
    """Whether this Python is the torch 2 venv scripts/setup_torch2.sh made
    (its stamp) from python/requirements-torch2.txt pinning torchtitan: there
    the swap must run, not be reported as not run."""
    req = os.path.join(HERE, "..", "..", "python", "requirements-torch2.txt")
    if not os.path.exists(os.path.join(sys.prefix, ".laga-stamp")) or not os.path.exists(req):
        return False
    return any(ln.strip().startswith("torchtitan==") for ln in open(req))


def torchtitan_swap():
    """torchtitan's DeepSeek-V3 Attention (its debug model's, float64) with
    its SDPA inner attention, then with laga's InnerAttention swapped in
    (explicit, allgather_kv, ring_kv at P 1): out and every parameter's
    gradient within 1e-12. Runs where torchtitan imports (PyPI's torchtitan
    needs its own dependencies: spmd_types, tyro, einops)."""
    import dataclasses
    try:
        from torchtitan.models.deepseek_v3 import model_registry
        from torchtitan.models.common.attention import ScaledDotProductAttention
    except Exception as e:  # not installed, or its dependencies missing
        if made_with_torchtitan():
            fail(f"torchtitan does not import in {sys.prefix}, a venv setup_torch2.sh made from "
                 f"a requirements file that pins it ({type(e).__name__}: {e}): rerun "
                 "scripts/setup_torch2.sh")
        return f"torchtitan swap: not run: torchtitan does not import here ({type(e).__name__}: {e})"
    ac = model_registry("debugmodel").model.layers[0].attention
    ac = dataclasses.replace(ac, inner_attention=ScaledDotProductAttention.Config())
    torch.manual_seed(5)
    attn = ac.build().double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    rope = ac.rope
    cfg = lt.MLAConfig(dim=ac.dim, n_heads=ac.n_heads, kv_lora_rank=ac.kv_lora_rank,
                       qk_nope_head_dim=ac.qk_nope_head_dim, qk_rope_head_dim=ac.qk_rope_head_dim,
                       v_head_dim=ac.v_head_dim, q_lora_rank=ac.q_lora_rank,
                       rope_factor=rope.rope_factor, mscale=ac.mscale,
                       original_seq_len=rope.original_seq_len, max_seq_len=rope.max_seq_len)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 24, ac.dim, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 24, ac.dim, generator=g, dtype=torch.float64)

    def run():
        attn.zero_grad()
        y = attn(x, None)
        y.backward(dout)
        return [y.detach()] + [p.grad.clone() for p in attn.parameters()]
    ref = run()
    worst = 0.0
    for form in HEADS:
        attn.inner_attention = tt.InnerAttention(cfg, form, reduce_dtype=torch.float64)
        got = run()
        e = max(rel(a, b) for a, b in zip(got, ref))
        if e > 1e-12:
            fail(f"torchtitan's DeepSeek-V3 Attention with laga's {form} inside: off by {e:.3g} "
                 "from its SDPA")
        worst = max(worst, e)
    return (f"torchtitan swap: torchtitan's DeepSeek-V3 Attention (debug model, H "
            f"{ac.n_heads}, 192/128, float64) with laga's {', '.join(HEADS)} inside within "
            f"{worst:.2g} of its own SDPA (out and every gradient)")


def run_example(args, P, layout, form, steps=6, timeout=150):
    """python/examples/train_mla_torchtitan.py at P ranks: its losses."""
    ex = os.path.join(HERE, "..", "..", "python", "examples", "train_mla_torchtitan.py")
    out = os.path.join(args.dir, f"example-P{P}-{layout}-{form}.json")
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, ex, "--form", form, "--layout", layout, "--steps", str(steps),
         "--json", out], stdout=subprocess.DEVNULL,
        env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(P), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1")) for r in range(P)]
    t0 = time.time()
    try:
        for p in procs:
            p.wait(timeout=max(1, timeout - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        fail(f"the torchtitan-shaped example at P {P} ran past {timeout} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        fail(f"the torchtitan-shaped example at P {P} exited {[p.returncode for p in procs]}")
    return json.load(open(out))["losses"]


def launch(args, P, timeout=150):
    run_ranks(__file__, [args.laga, args.dir, "--worker"], P, timeout, fail)
    return [json.load(open(os.path.join(args.dir, f"tt-P{P}-r{r}.json"))) for r in range(P)]


def main():
    args = parse_rank_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.dir, exist_ok=True)
    t0 = time.time()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    print(torchtitan_swap())
    dist.destroy_process_group()
    worst, worst_bf16, cases = 0.0, 0.0, 0
    for P in (2, 3):  # (P 1: the example's baseline and the swap)
        for res in launch(args, P):
            worst, worst_bf16 = max(worst, res["worst"]), max(worst_bf16, res["worst_bf16"])
            cases += res["cases"]
            if res["refusals"] != 5:
                fail(f"P {P}: {res['refusals']} of 5 refusals")
    base = run_example(args, 1, "contiguous", "laga")
    for P, layout, form in ((2, "head-tail", "laga"), (2, "contiguous", "ring_latent")):
        got = run_example(args, P, layout, form)
        d = max(abs(a - b) / abs(b) for a, b in zip(got, base))
        if d > 1e-10 or not base[-1] < base[0]:
            fail(f"the torchtitan-shaped example at P {P} ({layout}, {form}): losses {got} "
                 f"against P 1's {base} (off by {d:.3g}; expected equal and falling)")
    print(f"the torchtitan-shaped example: 6 AdamW steps at P 2 (head-tail laga, contiguous "
          f"ring_latent) equal to P 1 within 1e-10, loss {base[0]:.3f} -> {base[-1]:.3f}")
    print(f"laga_torch.torchtitan (torch {torch.__version__}): {cases} rank-cases of 8 forms, "
          f"P 2 and 3, contiguous and head-tail, packed and not, within {worst:.2g} of the naive "
          f"attention (float64; bound 1e-12); bf16 with reduce_dtype float32 at {worst_bf16:.2f} "
          f"of its bound; 5 refusals naming the value ({time.time() - t0:.1f} s)")
    print("PASS")


if __name__ == "__main__":
    main()
