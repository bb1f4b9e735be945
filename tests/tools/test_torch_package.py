#!/usr/bin/python3
"""laga_torch (python/laga_torch) against the C++ forms.

Usage: test_torch_package.py LAGA WORKDIR [--device cpu|cuda] [--backend gloo|nccl]

For every form (the package's FORMS: explicit, absorbed, laga, laga_fused,
laga2d and the context-parallel allgather_kv, ring_kv, ring_latent, a2a_p2p;
tests/tools/test_forms_registry.py holds them equal to the C++ registry) and option (q_latent,
overlap, laga2d head groups, packed documents straddling shards, the zigzag
layout) at P 1, 2, 3, 4, with S % P != 0, S % 2P != 0 and H % P != 0:
  * out, dx and every parameter gradient (summed over ranks) of the torch
    module in float64, on laga's tape and on autograd's, equal
    `laga forward --backward --dtype float64` on the same safetensors within
    1e-12 relative per tensor (|diff| / max |ref|);
  * the same in float32 within 1e-5 of `laga forward` (float32);
  * the same float64 runs within 1e-12 of the package's own explicit at P 1
    (same config and documents), every tape and attention a case ran;
  * bf16 (the forms with q_lora_rank 7, unpacked) within a first-order bound
    from bf16's unit roundoff of float64, and at P 2-4 of bf16 explicit at
    P 1 (BF16_BOUND below says how it is derived);
  * the ledger of a float32 run (forward, backward, sync_gradients) equals
    `laga compare --count-only --json` per (phase, label): calls, bytes sent
    and received (compare reports the max over ranks; so does this);
  * the bytes autograd keeps for backward (saved_tensors_hooks, each storage
    once, parameters and input left out, and every tensor a custom Function
    keeps as a ctx attribute outside save_for_backward, found by walking the
    graph) plus the output equal the C++ closed form (compare's
    predicted_saved_after_forward_bytes, eager attention, the rank compare
    names) for every form and option; bf16 keeps bf16 (half the float32
    run's bytes; flash: but its fp32 lse);
  * with attention "flash" (the FLASH cases: every form, uneven S and H, a
    rank without heads, packed, q_latent, laga2d; tiles of FLASH_BLOCK rows
    and keys): out, dx and every gradient within 1e-12 of `laga forward
    --dtype float64 --attention flash` (float32 within 1e-5), bf16 within
    its bound of float64, the float32 bytes kept for backward equal to
    compare's flash closed form (o and lse, no probabilities), the ledger the
    eager run's; a NaN in one token reaches no other document's out or dx,
    and flash's exact (run by run) and dense products agree;
  * MLAConfig reads ModelArgs and HF config.json files as laga does, and
    HF parameter names (written out here from transformers'
    DeepseekV3Attention, not taken from the package's map) load to the
    same module;
  * form "auto" runs `laga plan --json`'s winner (h100 profile), bit for bit;
  * bad input gets a ValueError naming it.
Ranks run as processes (this file with --worker) on a free port found at
run time, one launch per P running every case, one thread each. The configs,
documents and cases (VARIANTS, PACKED, FLASH...) are torch_package_common.py's,
which test_torch_fused_triton.py runs too.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

# The configs, cases, shard layout, runner and comparison this test shares
# with the Triton one; importing it puts python/ (safetensors_io, laga_torch)
# on sys.path.
from torch_package_common import (
    B, BASE, CONFIG_FILES, CONFIGS, DOCS, FLASH, FLASH_AUTOGRAD, FLASH_BF16, FLASH_BLOCK, HF, PY, S,
    ZIGZAG, assemble, bf16_case, cases, compare_name, compare_rows, cxx_flags, max_over_ranks,
    rel, run, sdpa_case, seq_layout, shard)
import safetensors_io
from torch_ranks import end_ranks, free_port
from torch_saved import saved_by

TOLS = {"float64": 1e-12, "float32": 1e-5}
# bf16 (unit roundoff u = 2^-8; torch's CPU bf16 matmuls accumulate in fp32,
# so each dot product rounds once). Forward, x to out, rounds at about 12
# stages (proj, norm, rope, kv up-projection, scores, softmax, P V, q_abs or
# W_UV, wo, and the casts between); to first order each adds u relative to
# the largest value of what it produces, so out is within 12 u of float64
# relative to max |out|; backward runs the chain back, about twice the
# stages: dx and every gradient within 24 u. The bound ignores how the
# block's conditioning amplifies errors, so it is a first-order bound, not a
# proof; the measured figures are printed beside it. Each form at P 2-4
# against bf16 explicit at P 1 (the paper's comparison): both sides within
# their float64 bound, so within twice it.
U_BF16 = 2.0 ** -8
BF16_BOUND = {"out": 12 * U_BF16, "grad": 24 * U_BF16}



# --------------------------------------------------------------------------
# One rank: every case at this P
# --------------------------------------------------------------------------

def worker(args):
    import torch.distributed as dist
    import laga_torch as lt
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.world)
    dev = torch.device(args.device if args.device == "cpu" else f"cuda:{args.rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NCCL: one device per rank
    P, r = args.world, args.rank
    results = {}
    for case in cases():
        own = shard(lt, P, r, seq_layout(case))
        w, _ = safetensors_io.load_file(os.path.join(args.dir, f"weights-{case['cfg']}.safetensors"))
        inp, _ = safetensors_io.load_file(os.path.join(args.dir, "input.safetensors"))
        # float64 and float32 on laga's tape; float64 on autograd's (the functional
        # layer composed).
        f64_ledgers = {}
        runs = [(torch.float64, "laga", "math"), (torch.float32, "laga", "math"),
                (torch.float64, "autograd", "math")]
        if bf16_case(case):
            runs.append((torch.bfloat16, "laga", "math"))
        if case["id"] in FLASH:
            runs += [(torch.float64, "laga", "flash"), (torch.float32, "laga", "flash")]
        if case["id"] in FLASH_BF16:
            runs.append((torch.bfloat16, "laga", "flash"))
        if case["id"] in FLASH_AUTOGRAD:
            runs.append((torch.float64, "autograd", "flash"))
        if sdpa_case(lt, case):
            runs.append((torch.float64, "autograd", "sdpa"))
        for dtype, tape, attention in runs:
            m = lt.MLA(lt.MLAConfig.from_json(CONFIGS[case["cfg"]]), form=case["form"],
                       attention=attention, tape=tape, dtype=dtype, device=dev,
                       flash_block=FLASH_BLOCK, **case["opts"])
            m.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
            m.ledger = lt.Ledger()
            x = torch.from_numpy(inp["x"]).to(dev, dtype)[:, own].clone().requires_grad_()
            dout = torch.from_numpy(inp["dout"]).to(dev, dtype)[:, own]
            keep = saved_by(m, x)
            with torch.autograd.graph.saved_tensors_hooks(keep.add, lambda t: t):
                out = m(x, cu_seqlens=case["docs"], seq_len=S)
            keep.add_ctx(out)
            saved = sum(b for _, b in keep) + out.numel() * out.element_size()
            if dtype == torch.bfloat16:  # what bf16 keeps: bf16, but flash's lse (fp32)
                if not set(keep.fp32) <= ({"lse"} if attention == "flash" else set()):
                    sys.exit(f"FAIL: {case['id']} P {P} bf16 {attention}: keeps fp32 tensors "
                             f"{sorted(keep.fp32.items())} for backward (bf16 keeps bf16, but "
                             "flash's lse)")
            out.backward(dout)
            res = {"out": out.detach(), "dx": x.grad}
            for n, p in m.named_parameters():  # this rank's partial
                res["grad." + n] = p.grad
            res = {k: v.cpu().double().numpy() if dtype == torch.bfloat16 else v.cpu().numpy()
                   for k, v in res.items()}
            tag = {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16"}[dtype] + \
                ("-autograd" if tape == "autograd" else "") + \
                ("-flash" if attention == "flash" else "") + ("-sdpa" if attention == "sdpa" else "")
            safetensors_io.save_file(res, os.path.join(
                args.dir, f"torch-{tag}-{case['id']}-P{P}-r{r}.safetensors"))
            if dtype == torch.bfloat16 and tape == "laga" and attention == "flash":
                # Half the float32 flash run's bytes (which equal compare's
                # flash closed form, below), but lse, kept fp32: 2 bytes more
                # an element. (compare --dtype bf16 counts the C++ bf16 run's
                # own buffers, which keep more: not this package's figure.)
                want = results[case["id"]]["saved_flash"] // 2 + 2 * keep.fp32.get("lse", 0)
                if saved != want:
                    sys.exit(f"FAIL: {case['id']} P {P} bf16 flash: rank {r} keeps {saved} "
                             f"bytes for backward (with the output), not half the float32 "
                             f"flash run's {results[case['id']]['saved_flash']} + 2 bytes per "
                             f"fp32 lse element ({keep.fp32.get('lse', 0)}): {want}")
            if dtype == torch.bfloat16 and tape == "laga" and attention == "math":
                # bf16 tensors on the wire, the gradient sum in fp32 (the
                # default grad_reduce): laga compare --dtype bf16's ledger
                # (checked below). What it keeps: half the float32 run's.
                if saved * 2 != results[case["id"]]["saved"]:
                    sys.exit(f"FAIL: {case['id']} P {P} bf16: rank {r} keeps {saved} bytes for "
                             f"backward (with the output), not half the float32 run's "
                             f"{results[case['id']]['saved']}")
                lt.sync_gradients(m, ledger=m.ledger)
                results[case["id"]]["ledger_bf16"] = [
                    [ph, lb, v["calls"], v["sent"], v["received"]]
                    for (ph, lb), v in m.ledger.rows.items()]
                continue
            if attention == "flash":  # the same movements as eager's
                if dtype == torch.float32:
                    lt.sync_gradients(m, ledger=m.ledger)
                    eager = results[case["id"]]["ledger"]
                    mine = [[ph, lb, v["calls"], v["sent"], v["received"]]
                            for (ph, lb), v in m.ledger.rows.items()]
                    if mine != eager:
                        sys.exit(f"FAIL: {case['id']} P {P}: flash's ledger {mine} differs from "
                                 f"eager's {eager}")
                    results[case["id"]]["saved_flash"] = saved
                continue
            if dtype == torch.float64:  # both tapes hand torch.distributed the same bytes
                f64_ledgers[tape] = dict(m.ledger.rows)
                if tape == "autograd" and f64_ledgers["autograd"] != f64_ledgers["laga"]:
                    sys.exit(f"FAIL: {case['id']} P {P}: the autograd tape's ledger "
                             f"{f64_ledgers['autograd']} differs from laga's "
                             f"{f64_ledgers['laga']}")
            if dtype == torch.float32 and tape == "laga":
                lt.sync_gradients(m, ledger=m.ledger)
                results[case["id"]] = {"ledger": [[ph, lb, v["calls"], v["sent"], v["received"]]
                                                  for (ph, lb), v in m.ledger.rows.items()],
                                       "saved": saved}
    with open(os.path.join(args.dir, f"ledger-P{P}-r{r}.json"), "w") as f:
        json.dump(results, f)
    nan_isolated(lt, dev, P, r, args)
    hf_names(lt, dev, P, args)
    auto(lt, dev, P, args)
    errors(lt, dev, P, r)
    if P == 3:
        subgroup(lt, dev, r, args)
    end_ranks()


def nan_isolated(lt, dev, P, r, args):
    """Flash leaves masked pairs out of every sum by selection: a NaN in one
    token's input (row 0, token 4, document [3, 9)) reaches out and dx of
    that document's later tokens (and its keys' dx) and of nothing else, on
    every form, packed at P 1-4; elsewhere out and dx equal the clean run's
    (1e-12 relative; the NaN run takes flash's exact products, the clean one
    its dense ones). Eager, which multiplies masked pairs by p = 0, fails this."""
    w, _ = safetensors_io.load_file(os.path.join(args.dir, "weights-rq7.safetensors"))
    inp, _ = safetensors_io.load_file(os.path.join(args.dir, "input.safetensors"))
    for form, opts in (("explicit", {}), ("absorbed", {}), ("laga", {}), ("laga_fused", {}),
                       ("laga2d", {"head_groups": 1}), ("allgather_kv", {}),
                       ("ring_latent", {"overlap": True}),  # (the rings share one engine)
                       ("ring_kv", ZIGZAG)):
        own = shard(lt, P, r, opts.get("seq_layout", "contiguous"))
        hit = torch.zeros(B, S, dtype=torch.bool)
        hit[0, 3:9] = True  # the NaN's document
        hit = hit[:, own]
        got = []
        for poison in (False, True):
            m = lt.MLA(lt.MLAConfig.from_json(CONFIGS["rq7"]), form=form, attention="flash",
                       dtype=torch.float64, device=dev, flash_block=FLASH_BLOCK, **opts)
            m.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
            x = torch.from_numpy(inp["x"]).clone()
            if poison:
                x[0, 4, 5] = float("nan")
            x = x.to(dev)[:, own].clone().requires_grad_()
            out = m(x, cu_seqlens=DOCS, seq_len=S)
            out.backward(torch.from_numpy(inp["dout"]).to(dev)[:, own])
            got.append((out.detach().cpu(), x.grad.cpu()))
        for name, clean, bad in zip(("out", "dx"), *got):
            e = rel(bad[~hit].numpy(), clean[~hit].numpy())
            if not e <= 1e-12:
                sys.exit(f"FAIL: {form} flash at P {P}, rank {r}: a NaN in token 4 of row 0 "
                         f"reaches {name} outside its document ({e:.3e} relative)")
        at = (own == 4).nonzero()[:, 0]
        if len(at) and not torch.isnan(got[1][0][0, at[0]]).all():
            sys.exit(f"FAIL: {form} {opts} flash at P {P}: the NaN in token 4 did not reach its "
                     "own out")


def subgroup(lt, dev, r, args):
    """A ring over a group that is not the world: global ranks 1 and 2 of 3
    (group ranks 0 and 1, so P2POp's peers must be mapped to global ranks),
    ring_kv in float64; out, dx and every gradient summed over the group
    within 1e-12 of the package's explicit on the whole sequence in a group
    of one."""
    import torch.distributed as dist
    pair = dist.new_group([1, 2])
    alone = [dist.new_group([i]) for i in range(3)]  # every rank makes every group
    if r == 0:
        return
    w, _ = safetensors_io.load_file(os.path.join(args.dir, "weights-rq7.safetensors"))
    inp, _ = safetensors_io.load_file(os.path.join(args.dir, "input.safetensors"))
    lay = lt.SpLayout.even(S, BASE["n_heads"], 2)
    (s0, s1), = lay.seq_ranges[r - 1]
    got = {}
    for form, group, lo, hi in (("ring_kv", pair, s0, s1), ("explicit", alone[r], 0, S)):
        m = lt.MLA(lt.MLAConfig.from_json(CONFIGS["rq7"]), form=form, dtype=torch.float64,
                   device=dev)
        m.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
        x = torch.from_numpy(inp["x"]).to(dev)[:, lo:hi].clone().requires_grad_()
        out = m(x, seq_len=S, group=group)
        out.backward(torch.from_numpy(inp["dout"]).to(dev)[:, lo:hi])
        got[form] = {"out": out.detach()[:, s0 - lo:s1 - lo], "dx": x.grad[:, s0 - lo:s1 - lo]}
        for n, p in m.named_parameters():
            if form == "ring_kv":
                dist.all_reduce(p.grad, group=pair)
            got[form]["grad." + n] = p.grad
    for k, v in got["explicit"].items():
        e = rel(got["ring_kv"][k].cpu().numpy(), v.cpu().numpy())
        if not e <= TOLS["float64"]:
            sys.exit(f"FAIL: ring_kv on the group of global ranks 1, 2: {k} differs from explicit "
                     f"by {e:.3e} relative")


# Hugging Face's names of the attention's parameters, written out here from
# transformers' DeepseekV3Attention (modeling_deepseek_v3.py: q_a_proj,
# q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
# o_proj; q_proj without a query latent), not from the package's map, which
# the test would otherwise only reverse.
HF_ATTENTION = {"wq.weight": "q_proj.weight", "wq_a.weight": "q_a_proj.weight",
                "q_norm.weight": "q_a_layernorm.weight", "wq_b.weight": "q_b_proj.weight",
                "wkv_a.weight": "kv_a_proj_with_mqa.weight",
                "kv_norm.weight": "kv_a_layernorm.weight", "wkv_b.weight": "kv_b_proj.weight",
                "wo.weight": "o_proj.weight"}


def hf_names(lt, dev, P, args):
    """A module built from the HF config.json and loaded under HF names
    (model.layers.<i>.self_attn.q_a_proj.weight, ...) equals the DeepSeek-named
    one bit for bit."""
    w, _ = safetensors_io.load_file(os.path.join(args.dir, "weights-rq7.safetensors"))
    hf = {f"model.layers.3.self_attn.{HF_ATTENTION[k]}": torch.from_numpy(v)
          for k, v in w.items()}
    x = torch.from_numpy(safetensors_io.load_file(os.path.join(args.dir, "input.safetensors"))[0]
                         ["x"])[:, shard(lt, P, args.rank)].to(dev)
    outs = []
    for cfg, state in ((CONFIGS["rq7"], {k: torch.from_numpy(v) for k, v in w.items()}),
                       (HF, hf)):
        m = lt.MLA(lt.MLAConfig.from_json(cfg), form="laga", dtype=torch.float64, device=dev)
        m.load_state_dict(state)
        outs.append(m(x, seq_len=S))
    if not torch.equal(outs[0], outs[1]):
        sys.exit(f"FAIL: P {P}: the HF config and names give another output than DeepSeek's")


def auto(lt, dev, P, args):
    """form 'auto' runs the winner of `laga plan --json` among the package's
    forms (asked here too, on the h100 profile): the same output, bit for
    bit, as that form chosen by hand; every rank picks the same."""
    cfg = lt.MLAConfig.from_json(CONFIGS["rq7"])
    os.environ["LAGA_BIN"] = args.laga
    plan = json.loads(run([args.laga, "plan", "--config", os.path.join(args.dir, "rq7.json"),
                           "--seq", str(S), "--sp", str(P), "--batch", str(B), "--profile",
                           "h100", "--q-latent", "--json", "-", "--quiet",
                           "--forms", ",".join(lt.FORMS)]))
    w = plan["cases"][0]["winner"].split("+")
    picked = (w[0], "q-latent" in w, "overlap" in w)
    torch.manual_seed(5)
    x = torch.randn(B, S, BASE["dim"], dtype=torch.float64)[:, shard(lt, P, args.rank)].to(dev)
    outs, mods = [], []
    for kw in ({"form": "auto", "profile": "h100"},
               {"form": picked[0], "q_latent": picked[1], "overlap": picked[2]}):
        torch.manual_seed(6)
        mods.append(lt.MLA(cfg, dtype=torch.float64, device=dev, **kw))
        outs.append(mods[-1](x, seq_len=S))
    if mods[0].plans != {(S, P, B): picked}:
        sys.exit(f"FAIL: form auto at P {P} recorded {mods[0].plans}, laga plan picks {picked}")
    if not torch.equal(outs[0], outs[1]):
        sys.exit(f"FAIL: form auto at P {P} differs from {picked} chosen by hand")


def expect_error(what, words, fn):
    try:
        fn()
    except ValueError as e:
        for w in words:
            if w not in str(e):
                sys.exit(f"FAIL: {what}: the ValueError does not name '{w}': {e}")
        return
    sys.exit(f"FAIL: {what}: no ValueError")


def errors(lt, dev, P, r):
    cfg0, cfg7 = lt.MLAConfig.from_json(CONFIGS["rq0"]), lt.MLAConfig.from_json(CONFIGS["rq7"])
    lay = lt.SpLayout.even(S, BASE["n_heads"], P)
    m = lt.MLA(cfg7, form="laga", dtype=torch.float64, device=dev)
    x = torch.zeros(B, lay.seq_count[r], BASE["dim"], dtype=torch.float64, device=dev)
    expect_error("q_latent with q_lora_rank 0", ["q_latent", "q_lora_rank"],
                 lambda: lt.MLA(cfg0, form="laga", q_latent=True))
    expect_error("overlap with explicit", ["overlap", "explicit"],
                 lambda: lt.MLA(cfg7, form="explicit", overlap=True))
    expect_error("unknown form", ["form", "ring", "ring_latent"], lambda: lt.MLA(cfg7, form="ring"))
    expect_error("overlap with allgather_kv", ["overlap", "allgather_kv", "ring_kv"],
                 lambda: lt.MLA(cfg7, form="allgather_kv", overlap=True))
    expect_error("q_latent with ring_kv", ["q_latent", "ring_kv", "laga2d"],
                 lambda: lt.MLA(cfg7, form="ring_kv", q_latent=True))
    expect_error("head_groups with ring_latent", ["head_groups", "ring_latent"],
                 lambda: lt.MLA(cfg7, form="ring_latent", head_groups=1))
    expect_error("sdpa with a ring form", ["sdpa", "ring_latent", "log-sum-exp"],
                 lambda: lt.MLA(cfg7, form="ring_latent", tape="autograd", attention="sdpa"))
    expect_error("unknown attention", ["attention", "ring", "flash"],
                 lambda: lt.MLA(cfg7, attention="ring"))
    expect_error("sdpa on laga's tape", ["sdpa", "laga"], lambda: lt.MLA(cfg7, attention="sdpa"))
    expect_error("flash_block 0", ["flash_block"], lambda: lt.MLA(cfg7, flash_block=0))
    expect_error("unknown grad_reduce", ["grad_reduce", "fp16", "fp32", "bf16"],
                 lambda: lt.sync_gradients(m, grad_reduce="fp16"))
    expect_error("unknown seq_layout", ["seq_layout", "zigzg", "contiguous", "zigzag"],
                 lambda: lt.MLA(cfg7, seq_layout="zigzg"))
    zz = lt.SpLayout.even(S, BASE["n_heads"], P, "zigzag")
    want = ", ".join(f"[{b}, {e})" for b, e in zz.seq_ranges[r])
    expect_error("a zigzag shard of the wrong length", ["holds", f"rank {r}", want, "zigzag"],
                 lambda: lt.MLA(cfg7, form="ring_kv", dtype=torch.float64, device=dev,
                                seq_layout="zigzag")(
                     torch.zeros(B, zz.seq_count[r] + 1, BASE["dim"], dtype=torch.float64,
                                 device=dev), seq_len=S))
    expect_error("form auto without a profile", ["auto", "profile"],
                 lambda: lt.MLA(cfg7, form="auto"))
    expect_error("form auto with overlap", ["auto", "overlap", "plan"],
                 lambda: lt.MLA(cfg7, form="auto", profile="h100", overlap=True))
    if P > 1:
        expect_error("a group larger than the sequence", ["sequence length", str(P - 1)],
                     lambda: m(x[:, :1], seq_len=P - 1))
    expect_error("a shard of the wrong length", ["holds", f"rank {r}"],
                 lambda: m(torch.zeros(B, lay.seq_count[r] + 1, BASE["dim"], dtype=torch.float64,
                                       device=dev), seq_len=S))
    expect_error("cu_seqlens not summing to S", ["cu_seqlens", "from 0"],
                 lambda: m(x, cu_seqlens=[0, 5, S - 1], seq_len=S))
    expect_error("cu_seqlens not increasing", ["cu_seqlens", "increasing"],
                 lambda: m(x, cu_seqlens=[0, 5, 5, S], seq_len=S))
    expect_error("float cu_seqlens", ["cu_seqlens", "float64"],
                 lambda: m(x, cu_seqlens=torch.tensor([0.0, 5.0, S], dtype=torch.float64),
                           seq_len=S))
    expect_error("cu_seqlens rows != batch", ["cu_seqlens", "3 rows", f"batch of {B}"],
                 lambda: m(x, cu_seqlens=[[0, S]] * 3, seq_len=S))
    expect_error("mixed dtypes", ["float32", "wq_a.weight"], lambda: m(x.float(), seq_len=S))
    meta = lt.MLA(cfg7, form="laga", dtype=torch.float64, device="meta")
    expect_error("mixed devices", ["meta", "wq_a.weight"], lambda: meta(x, seq_len=S))
    if P in (3, 4):  # 2 does not divide 3; 3 does not divide 4
        hg = 2 if P == 3 else 3
        expect_error("head groups not dividing P", ["head_groups", "divide", str(P)],
                     lambda: lt.MLA(cfg7, form="laga2d", head_groups=hg,
                                    dtype=torch.float64, device=dev)(x, seq_len=S))


# --------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------

def flash_kernels(lt, dev):
    """laga_torch.attention's flash against its math path in float64 on the
    packed documents (one key head per query head, and one shared, as
    absorbed's), blocks 1, FLASH_BLOCK and 64: o, dq, dk, dv within 1e-13,
    with the dense and the exact (run by run) products alike; and a row that
    sees no key gets o = 0, lse = 0 and passes no gradient."""
    from laga_torch.attention import (KeyRanges, flash_backward, flash_forward, math_backward,
                                      math_forward)
    g = torch.Generator().manual_seed(7)
    starts = torch.tensor([[a for a, b in zip(d, d[1:]) for _ in range(b - a)] for d in DOCS],
                          device=dev)
    worst = 0.0

    def expect_math(got, want, what):
        # o, dq, dk, dv of flash against the math path, within 1e-13.
        nonlocal worst
        for name, x, y in zip(("o", "dq", "dk", "dv"), got, want):
            e = rel(x.cpu().numpy(), y.cpu().numpy())
            worst = max(worst, e)
            if not e <= 1e-13:
                sys.exit(f"FAIL: flash {what}: {name} differs from math by {e:.3e}")

    for Hk in (3, 1):
        for a, b in ((0, S), (4, 11)):  # every row; a range of rows over keys [0, b)
            rows = torch.arange(a, b, device=dev)
            q, k, v, do = (torch.randn(shape, generator=g, dtype=torch.float64).to(dev) for shape in
                           ((B, b - a, 3, 7), (B, b, Hk, 7), (B, b, Hk, 5), (B, b - a, 3, 5)))
            sp = lt.forms.Sp(lt.SpLayout.even(S, 3, 1), 0, None, None, B, starts,
                             None, None)
            o_ref, p = math_forward(q, k, v, sp.mask(rows, b), 0.3)
            want = (o_ref,) + math_backward(q, k, v, p, do, 0.3)
            for block in (1, FLASH_BLOCK, 64):
                for exact in (False, True):
                    kr = sp.key_ranges(rows, b)
                    o, lse = flash_forward(q, k, v, kr, 0.3, block, exact=exact)
                    got = (o,) + flash_backward(q, k, v, o, lse, do, kr, 0.3, block, exact=exact)
                    expect_math(got, want,
                                f"(Hk {Hk}, rows [{a}, {b}), block {block}, exact {exact})")
    # A row that sees no key (row 2's range emptied): o = 0, lse = 0, no gradient
    # from it, as the C++ kernel's convention; the math path with that row's
    # probabilities set to 0 is the reference.
    rows = torch.arange(S, device=dev)
    q, k, v, do = (torch.randn(shape, generator=g, dtype=torch.float64).to(dev) for shape in
                   ((B, S, 3, 7), (B, S, 3, 7), (B, S, 3, 5), (B, S, 3, 5)))
    kr = sp.key_ranges(rows, S)
    hi = kr.hi.clone()
    hi[:, 2] = kr.lo[:, 2]
    kr = KeyRanges(kr.lo, hi)
    mask = sp.mask(rows, S).clone()
    mask[:, :, 2] = False
    o_ref, p = math_forward(q, k, v, mask, 0.3)
    p = torch.nan_to_num(p, nan=0.0)
    want = (torch.nan_to_num(o_ref, nan=0.0),) + math_backward(q, k, v, p, do, 0.3)
    o, lse = flash_forward(q, k, v, kr, 0.3, FLASH_BLOCK)
    got = (o,) + flash_backward(q, k, v, o, lse, do, kr, 0.3, FLASH_BLOCK)
    if not (torch.all(o[:, 2] == 0) and torch.all(lse[:, :, 2] == 0)):
        sys.exit("FAIL: flash: a row that sees no key does not get o = 0 and lse = 0")
    expect_math(got, want, "with a row that sees no key")
    return worst


def example(args):
    """The example trainer's float64 steps (--example-steps, 20; the torch 2
    twin's fewer: docs/testing.md, "Suite time") at P 2 (laga, and ring_kv on
    the zigzag layout) equal P 1 within 1e-6 per step's loss. Ranks get
    torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from
    here: Debian's torchrun 1.13 fails under Python 3.11 before starting any
    worker (elastic's to_map)."""
    os.makedirs(args.dir, exist_ok=True)
    script = os.path.join(PY, "examples", "train_mla.py")
    losses, steps = {}, args.example_steps
    for name, P, extra in ((1, 1, []), (2, 2, []),
                           ("2 ring_kv zigzag", 2, ["--form", "ring_kv", "--seq-layout",
                                                    "zigzag"])):
        port, out = free_port(), os.path.join(args.dir, f"example-{name}.json".replace(" ", "-"))
        procs = [subprocess.Popen([sys.executable, script, "--steps", str(steps), "--dtype", "float64",
                                   "--backend", args.backend, "--device", args.device,
                                   "--json", out] + extra,
                                  stdout=subprocess.DEVNULL,
                                  env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r),
                                           WORLD_SIZE=str(P), MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
                 for r in range(P)]
        for p in procs:
            p.wait(timeout=200)
        if any(p.returncode for p in procs):
            sys.exit(f"FAIL: train_mla.py at P {name} exited {[p.returncode for p in procs]}")
        losses[name] = json.load(open(out))["losses"]
    worst = {}
    for name in (2, "2 ring_kv zigzag"):
        if len(losses[1]) != steps or len(losses[name]) != steps:
            sys.exit(f"FAIL: expected {steps} losses per run, got {len(losses[1])} and "
                     f"{len(losses[name])}")
        worst[name] = max(abs(a - b) for a, b in zip(losses[1], losses[name]))
        if not worst[name] <= 1e-6:
            sys.exit(f"FAIL: train_mla.py P {name} differs from P 1 by {worst[name]:.3e} in a "
                     "step's loss")
    print(f"train_mla.py: {steps} steps, P 2 within {worst[2]:.2e} of P 1 per step, P 2 ring_kv "
          f"zigzag within {worst['2 ring_kv zigzag']:.2e} (loss {losses[1][0]:.6f} -> "
          f"{losses[1][-1]:.6f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("laga", nargs="?")
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--sp", default="1,2,3,4")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--example", action="store_true",
                    help="instead: python/examples/train_mla.py at P 2 against P 1")
    ap.add_argument("--example-steps", type=int, default=20,
                    help="the example's steps a run (the torch 2 twin runs fewer)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.example:
        return example(args)
    t0 = time.time()
    os.makedirs(args.dir, exist_ok=True)
    g = torch.Generator().manual_seed(24)
    sys.path.insert(0, PY)
    import laga_torch as lt
    for name, cfg in CONFIGS.items():
        with open(os.path.join(args.dir, f"{name}.json"), "w") as f:
            json.dump(cfg, f)
        m = lt.MLA(lt.MLAConfig.from_json(cfg), dtype=torch.float64)
        w = {}
        for n, p in m.named_parameters():  # norms 1 + 0.1 N so that ignoring one fails
            t = torch.randn(p.shape, generator=g, dtype=torch.float64)
            w[n] = (1 + 0.1 * t if "norm" in n else t / p.shape[-1] ** 0.5).numpy()
        safetensors_io.save_file(w, os.path.join(args.dir, f"weights-{name}.safetensors"))
    inp = {"x": torch.randn(B, S, BASE["dim"], generator=g, dtype=torch.float64).numpy(),
           "dout": torch.randn(B, S, BASE["dim"], generator=g, dtype=torch.float64).numpy()}
    safetensors_io.save_file(inp, os.path.join(args.dir, "input.safetensors"))
    sps = [int(p) for p in args.sp.split(",")]

    # Configs: MLAConfig reads each file as laga does (laga forward's output
    # records the config it read).
    for name, j in dict(CONFIG_FILES, **CONFIGS).items():
        path = os.path.join(args.dir, f"config-{name}.json")
        json.dump(j, open(path, "w"))
        out = os.path.join(args.dir, f"config-{name}.safetensors")
        run([args.laga, "forward", "--config", path, "--seq", "4", "--output", out])
        theirs = json.loads(safetensors_io.load_file(out)[1]["config"])
        mine = lt.MLAConfig.from_json(j).to_json()
        bad = {k: (mine.get(k), v) for k, v in theirs.items() if mine.get(k) != v}
        if bad or mine["yarn_always"] != theirs.get("yarn_always", False):
            sys.exit(f"FAIL: config {name}: MLAConfig reads (ours, laga's) {bad}, yarn_always "
                     f"{mine['yarn_always']} vs {theirs.get('yarn_always', False)}")

    flash_worst = flash_kernels(lt, torch.device(args.device))

    # The torch ranks, one launch per P.
    for P in sps:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, args.laga, args.dir, "--worker",
                                   "--rank", str(r), "--world", str(P), "--port", str(port),
                                   "--device", args.device, "--backend", args.backend],
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
                 for r in range(P)]
        try:
            t_start = time.time()
            for p in procs:
                p.wait(timeout=max(1, 200 - (time.time() - t_start)))
        except subprocess.TimeoutExpired:
            sys.exit(f"FAIL: torch ranks at P {P} ran past 200 s: a rank waits in a collective "
                     "or ring shift the others never entered (or one never waited)")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(p.returncode for p in procs):
            sys.exit(f"FAIL: torch ranks at P {P} exited {[p.returncode for p in procs]}")
    t_torch = time.time() - t0

    def assembled(tag, case, P):
        return assemble(lt, args.dir, tag, case, P)

    # Values: the C++ forms against the torch module, per tensor: float64
    # within 1e-12, float32 within 1e-5 (the paper's fp32 check).
    worst, checked = {"float64": 0.0, "float32": 0.0}, 0
    worst_flash = {"float64": 0.0, "float32": 0.0}
    worst_sdpa, sdpa_checked = 0.0, 0
    for P, case, dt in [(P, c, dt) for P in sps for c in cases() for dt in TOLS]:
        tol, tag = TOLS[dt], "f64" if dt == "float64" else "f32"
        ref_path = os.path.join(args.dir, f"cxx-{tag}-{case['id']}-P{P}.safetensors")
        cmd = [args.laga, "forward", "--config", os.path.join(args.dir, case["cfg"] + ".json"),
               "--weights", os.path.join(args.dir, f"weights-{case['cfg']}.safetensors"),
               "--input", os.path.join(args.dir, "input.safetensors"), "--backward",
               "--dtype", dt, "--sp", str(P), "--attention", "flash",
               "--output", ref_path] + cxx_flags(case)
        if case["docs"]:
            cmd += ["--doc-lens", "/".join(",".join(str(e - s) for s, e in zip(d, d[1:]))
                                           for d in case["docs"])]
        run(cmd)
        ref, _ = safetensors_io.load_file(ref_path)
        tags = [tag] + ([tag + "-autograd"] if dt == "float64" else [])
        if case["id"] in FLASH:
            tags.append(tag + "-flash")
        if case["id"] in FLASH_AUTOGRAD and dt == "float64":
            tags.append(tag + "-autograd-flash")
        if sdpa_case(lt, case) and dt == "float64":
            tags.append(tag + "-autograd-sdpa")
        for tag in tags:
            mine = assembled(tag, case, P)
            if set(mine) != set(ref):
                sys.exit(f"FAIL: {case['id']} P {P} {tag}: torch gives {sorted(mine)}, C++ "
                         f"{sorted(ref)}")
            for k in ref:
                e = rel(mine[k].astype(np.float64), ref[k].astype(np.float64))
                (worst_flash if tag.endswith("-flash") else worst)[dt] = max(
                    (worst_flash if tag.endswith("-flash") else worst)[dt], e)
                if tag.endswith("-sdpa"):
                    worst_sdpa, sdpa_checked = max(worst_sdpa, e), sdpa_checked + 1
                checked += 1
                if not e <= tol:
                    sys.exit(f"FAIL: {case['id']} P {P} {tag}: {k} differs from the C++ form by "
                             f"{e:.3e} relative (> {tol})")

    # bf16: against float64 at the same P, and at P 2-4 against bf16 explicit at P 1.
    bf16_worst = {"f64": 0.0, "explicit P1": 0.0, "flash f64": 0.0}
    explicit_p1 = {c["cfg"]: c for c in cases() if bf16_case(c) and
                   c["form"] == lt.forms.reference_form()}
    for P in sps:
        for case in filter(bf16_case, cases()):
            mine = assembled("bf16", case, P)
            refs = [("f64", assembled("f64", case, P), 1)]
            if P > 1 and 1 in sps:
                refs.append(("explicit P1", assembled("bf16", explicit_p1[case["cfg"]], 1), 2))
            if case["id"] in FLASH_BF16:
                refs.append(("flash f64", refs[0][1], 1))
            for what, ref, factor in refs:
                got = assembled("bf16-flash", case, P) if what == "flash f64" else mine
                for k in ref:
                    bound = factor * BF16_BOUND["out" if k == "out" else "grad"]
                    e = rel(got[k], ref[k])
                    bf16_worst[what] = max(bf16_worst[what], e / bound)
                    if not e <= bound:
                        sys.exit(f"FAIL: {case['id']} P {P} bf16: {k} differs from {what} by "
                                 f"{e:.3e} relative (> {bound:.3e}, bf16's first-order bound)")

    # Every form at every P against the package's own single-rank explicit
    # (the same config and documents, float64, each tape and attention the
    # case ran): within 1e-12 relative per tensor.
    p1_worst, p1_checked = 0.0, 0
    if 1 in sps:
        for case in cases():
            ref_case = [c for c in cases() if c["cfg"] == case["cfg"] and c["docs"] == case["docs"]
                        and c["form"] == lt.forms.reference_form() and not c["opts"]]
            if not ref_case:
                continue
            ref = assembled("f64", ref_case[0], 1)
            tags = ["f64", "f64-autograd"] + (["f64-flash"] if case["id"] in FLASH else []) + \
                (["f64-autograd-flash"] if case["id"] in FLASH_AUTOGRAD else []) + \
                (["f64-autograd-sdpa"] if sdpa_case(lt, case) else [])
            for P, tag in [(P, t) for P in sps for t in tags]:
                got = assembled(tag, case, P)
                for k in ref:
                    e = rel(got[k], ref[k])
                    p1_worst, p1_checked = max(p1_worst, e), p1_checked + 1
                    if not e <= TOLS["float64"]:
                        sys.exit(f"FAIL: {case['id']} P {P} {tag}: {k} differs from the package's "
                                 f"explicit at P 1 by {e:.3e} relative (> {TOLS['float64']})")

    # The ledger: float32 runs against compare's count-only ledger (f32).
    ledgers, flash_saved, rank_ledgers, bf16_ledgers = 0, 0, 0, 0
    for P in sps:
        per_rank = [json.load(open(os.path.join(args.dir, f"ledger-P{P}-r{r}.json")))
                    for r in range(P)]
        for hg, cfg, layout in [(hg, cfg, lay) for hg in ("", "1") for cfg in CONFIGS
                                for lay in lt.layout.SEQ_LAYOUTS]:
            mine = [c for c in cases() if c["cfg"] == cfg and not c["docs"] and
                    str(c["opts"].get("head_groups", "")) == hg and seq_layout(c) == layout]
            if not mine:
                continue
            cmd = [args.laga, "compare", "--config", os.path.join(args.dir, cfg + ".json"),
                   "--batch", str(B), "--seq", str(S), "--sp", str(P), "--count-only",
                   "--forms", ",".join(lt.FORMS), "--overlap", "both",
                   "--attention", "eager", "--seq-layout", layout, "--json", "-"] + \
                  (["--q-latent"] if CONFIGS[cfg]["q_lora_rank"] else []) + \
                  (["--head-groups", hg] if hg else [])
            cmp_forms = {f["form"]: f for f in json.loads(run(cmd))["forms"]}
            flash = [c for c in mine if c["id"] in FLASH]
            if flash:  # flash's closed form: o and lse in place of the probabilities
                i = cmd.index("--attention")
                cmp_flash = {f["form"]: f for f in json.loads(run(
                    cmd[:i + 1] + ["flash"] + cmd[i + 2:]))["forms"]}
            for case in flash:
                f = cmp_flash[compare_name(case)]
                got = per_rank[f["peak_rank"]][case["id"]]["saved_flash"]
                if got != f["predicted_saved_after_forward_bytes"]:
                    sys.exit(f"FAIL: {case['id']} P {P} flash: rank {f['peak_rank']} keeps "
                             f"{got} bytes for backward (with the output), the C++ flash "
                             f"closed form {f['predicted_saved_after_forward_bytes']}")
                flash_saved += 1
            in_bf16 = [c for c in mine if bf16_case(c)]
            if in_bf16:  # bf16 on the wire, the gradients' sum fp32 (C++ bf16 runs
                # flash only: the movements are eager's)
                i = cmd.index("--attention")
                cmp_bf16 = {f["form"]: f for f in json.loads(run(
                    cmd[:i + 1] + ["flash", "--dtype", "bf16"] + cmd[i + 2:]))["forms"]}
            for case in in_bf16:
                want = compare_rows(cmp_bf16[compare_name(case)])
                got = max_over_ranks(per_rank, case["id"], "ledger_bf16")
                if got != want:
                    sys.exit(f"FAIL: {case['id']} P {P} bf16: ledger differs from laga compare "
                             f"--dtype bf16\n  torch:   {sorted(got.items())}"
                             f"\n  compare: {sorted(want.items())}")
                bf16_ledgers += 1
            for case in mine:
                want = compare_rows(cmp_forms[compare_name(case)])
                f = cmp_forms[compare_name(case)]
                kept = per_rank[f["peak_rank"]][case["id"]]["saved"]
                if kept != f["predicted_saved_after_forward_bytes"]:
                    sys.exit(f"FAIL: {case['id']} P {P}: rank {f['peak_rank']} keeps {kept} "
                             "bytes for backward (with the output), the C++ closed form "
                             f"{f['predicted_saved_after_forward_bytes']}")
                got = max_over_ranks(per_rank, case["id"], "ledger")
                if got != want:
                    sys.exit(f"FAIL: {case['id']} P {P}: ledger differs from laga compare\n"
                             f"  torch:   {sorted(got.items())}\n  compare: {sorted(want.items())}")
                ledgers += 1
            # The maximum over ranks hides a rank that files another's bytes
            # (a ring shift's received block counted as the one it sent has
            # the same maximum): for rq7, which holds every form, every rank
            # alone (compare --rank-only) against that rank's ledger and the
            # bytes it keeps, exactly.
            if cfg != "rq7" or hg or P == 1:
                continue
            for r in range(P):
                alone = {f["form"]: f for f in json.loads(run(
                    cmd + ["--rank-only", str(r)]))["forms"]}
                for case in mine:
                    f = alone[compare_name(case)]
                    want = [[l["phase"], l["label"], l["calls"], l["bytes_sent"],
                             l["bytes_received"]] for l in f["by_label"]]
                    got = per_rank[r][case["id"]]["ledger"]
                    if sorted(got) != sorted(want):
                        sys.exit(f"FAIL: {case['id']} P {P}: rank {r}'s ledger differs from "
                                 f"laga compare --rank-only {r}\n  torch:   {sorted(got)}\n"
                                 f"  compare: {sorted(want)}")
                    if per_rank[r][case["id"]]["saved"] != \
                            f["predicted_saved_after_forward_bytes"]:
                        sys.exit(f"FAIL: {case['id']} P {P}: rank {r} keeps "
                                 f"{per_rank[r][case['id']]['saved']} bytes for backward "
                                 "(with the output), the C++ closed form "
                                 f"{f['predicted_saved_after_forward_bytes']}")
                    rank_ledgers += 1
    print(f"laga_torch flash kernels: within {flash_worst:.1e} of the math path (dense and "
          "exact products, blocks 1, 4, 64; a row that sees no key)")
    print(f"laga_torch: {p1_checked} float64 tensors of every form at P {args.sp} within "
          f"{p1_worst:.2e} of the package's explicit at P 1")
    print(f"laga_torch bf16: worst error / bound against float64 {bf16_worst['f64']:.2f}, "
          f"against bf16 explicit at P 1 {bf16_worst['explicit P1']:.2f}")
    from laga_torch.attention import has_sdpa
    if has_sdpa() and not sdpa_checked:
        sys.exit("FAIL: this torch has scaled_dot_product_attention, but no sdpa run was checked")
    print("laga_torch sdpa (tape autograd, float64, every form but the rings): "
          + (f"{sdpa_checked} tensors within {worst_sdpa:.2e} of laga forward's"
             if has_sdpa() else
             f"not run: torch {torch.__version__} has no scaled_dot_product_attention"))
    print(f"laga_torch: {checked} tensors equal laga forward's (worst relative: float64 "
          f"{worst['float64']:.2e} <= {TOLS['float64']}, float32 {worst['float32']:.2e} <= "
          f"{TOLS['float32']}); {ledgers} ledgers and saved-for-backward byte counts equal "
          f"laga compare's (and {rank_ledgers} on each rank alone, and {bf16_ledgers} bf16 "
          f"ledgers laga compare --dtype bf16's); flash: worst relative "
          f"float64 {worst_flash['float64']:.2e}, float32 "
          f"{worst_flash['float32']:.2e}, bf16 error / bound {bf16_worst['flash f64']:.2f}, "
          f"{flash_saved} saved-for-backward byte counts equal compare's flash closed form; "
          f"torch ranks {t_torch:.1f} s, "
          f"total {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
