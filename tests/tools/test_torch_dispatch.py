#!/usr/bin/python3
"""laga_torch's attention dispatch (python/laga_torch/dispatch.py; issue 53
item 1; docs/pytorch.md, "The attention dispatch").

Usage: test_torch_dispatch.py LAGA WORKDIR

One process:
  * the kernels against each other on the calls the forms make: key ranges
    of packed documents (a row's document start to itself), a query range
    that starts mid-sequence (laga2d's chunks, allgather_kv's zigzag
    ranges), a ring's unmasked rectangle, rows that see no key, a shared
    key head (absorbed), dv != dqk: flex's o and lse (and the tiles'
    backward from them) within 1e-12 of the tiles' in float64 and 1e-5 in
    float32 (both round each product once in fp32 for float32: the bound
    is fp32's accumulation over S keys, measured below it by 100x);
  * the choice: on the CPU "auto" is the tiles (flex's CPU path is
    unfused), logged once per kind of call on logger laga_torch; a NaN
    operand runs on the tiles whatever was asked; flex asked for on a torch
    without it is refused naming the torch and what is missing.
Ranks (P 2, gloo): every form of FORMS on both tapes, packed documents,
float64, MLA(attention="flash", attention_kernel="flex") against the same
module on the tiles: out, dx and every gradient within 1e-12 (measured
~1e-16), the bytes kept for backward equal (o and lse, never
probabilities), and the ledger's kernel counts say flex ran forward (and,
on the CPU, the tiles backward). On torch 1.13 (no flex) the ranks' part
is not run and the test says so.
"""

import io
import json
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import laga_torch as lt  # noqa: E402
from laga_torch import dispatch  # noqa: E402
from laga_torch.attention import KeyRanges  # noqa: E402
from torch_ranks import end_ranks, parse_rank_args, run_ranks  # noqa: E402

CFG = {"dim": 24, "n_heads": 5, "kv_lora_rank": 10, "qk_nope_head_dim": 8,
       "qk_rope_head_dim": 4, "v_head_dim": 6, "q_lora_rank": 7, "original_seq_len": 8,
       "max_seq_len": 32, "rope_factor": 4.0, "mscale": 0.7, "beta_fast": 4.0, "beta_slow": 1.0}
B, S = 2, 13
DOCS = [[0, 3, 9, 10, 13], [0, 6, 13]]


def fail(msg):
    sys.exit("FAIL: " + msg)


def rel(a, ref):
    d = (a.double() - ref.double()).abs().max().item()
    s = ref.double().abs().max().item()
    return d / s if s > 0 else d


def calls():
    """(name, lo, hi, Sk) of the key ranges the forms' calls make."""
    start = torch.zeros(B, S, dtype=torch.long)
    for b, cu in enumerate(DOCS):
        for s, e in zip(cu, cu[1:]):
            start[b, s:e] = s
    rows = torch.arange(S)
    out = [("packed, every row", start.clone(), (rows + 1)[None].expand(B, S).clone(), S)]
    r = torch.arange(5, 11)  # a query range mid-sequence over keys [0, 11)
    out.append(("rows 5..10 over keys [0, 11)", start[:, r].clone(),
                (r + 1)[None].expand(B, -1).clone(), 11))
    lo = torch.zeros(B, 4, dtype=torch.long)
    out.append(("a ring's rectangle", lo, torch.full((B, 4), 7, dtype=torch.long), 7))
    lo = torch.tensor([[0, 3, 3, 5], [2, 2, 9, 9]])  # rows that see none: lo == hi
    hi = torch.tensor([[0, 4, 5, 5], [3, 4, 9, 11]])
    out.append(("rows that see no key", lo, hi, 11))
    return out


def kernels_agree():
    """flex against the tiles on every call kind, float64 and float32."""
    if dispatch.supports(dispatch.Kernel.flex, torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1),
                         torch.zeros(1, 1, 1, 1), True) is not None:
        return None
    g = torch.Generator().manual_seed(41)
    worst = {torch.float64: 0.0, torch.float32: 0.0}
    n = 0
    for name, lo, hi, Sk in calls():
        Sq = lo.shape[1]
        for H, Hk, dqk, dv in ((5, 5, 12, 6), (5, 1, 14, 10)):  # per-head; absorbed's shared head
            for dt in (torch.float64, torch.float32):
                q = torch.randn(B, Sq, H, dqk, generator=g, dtype=torch.float64).to(dt)
                k = torch.randn(B, Sk, Hk, dqk, generator=g, dtype=torch.float64).to(dt)
                v = torch.randn(B, Sk, Hk, dv, generator=g, dtype=torch.float64).to(dt)
                do = torch.randn(B, Sq, H, dv, generator=g, dtype=torch.float64).to(dt)
                kr = KeyRanges(lo, hi)
                res = {}
                for kern in ("tiles", "flex"):
                    with dispatch.context(None, kern):
                        o, lse = dispatch.forward(q, k, v, kr, 0.3, 4)
                        res[kern] = (o, lse) + tuple(dispatch.backward(q, k, v, o, lse, do, kr,
                                                                       0.3, 4))
                bound = 1e-12 if dt == torch.float64 else 1e-5
                for i, what in enumerate(("o", "lse", "dq", "dk", "dv")):
                    e = rel(res["flex"][i], res["tiles"][i])
                    worst[dt] = max(worst[dt], e)
                    if e > bound:
                        fail(f"flex against the tiles ({name}, H {H} over {Hk} key heads, "
                             f"{dt}): {what} off by {e:.3g} > {bound}")
                n += 1
    return n, worst


def choice_rules():
    """auto on the CPU, a NaN operand, flex on a torch without it; the log."""
    out = []
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("laga_torch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    q = torch.randn(1, 4, 2, 6, dtype=torch.float64)
    k, v = torch.randn(1, 4, 2, 6, dtype=torch.float64), torch.randn(1, 4, 2, 3,
                                                                     dtype=torch.float64)
    kern, _ = dispatch.choose(q, k, v)
    if kern is not dispatch.Kernel.tiles:
        fail(f"auto on the CPU chose {kern.name}; the tiles are the CPU's choice")
    dispatch.choose(q, k, v)
    lines = [ln for ln in buf.getvalue().splitlines() if "attention forward" in ln]
    if len(lines) != 1 or "tiles" not in lines[0] or "cpu float64" not in lines[0]:
        fail(f"the choice's log: expected one line naming tiles and cpu float64, got {lines}")
    out.append("auto on the CPU: tiles, logged once")
    bad = q.clone()
    bad[0, 1, 0, 0] = float("nan")
    why = dispatch.supports(dispatch.Kernel.flex, bad, k, v, False)
    if why is None or "NaN" not in why:
        fail(f"flex on a NaN operand: expected a refusal naming the NaN, got {why!r}")
    if dispatch.choose(bad, k, v, "flex")[0] is not dispatch.Kernel.tiles:
        fail("a NaN operand with flex asked for did not run on the tiles")
    out.append("a NaN operand runs on the tiles")
    if dispatch._flex_api() is None:
        try:
            dispatch.choose(q, k, v, "flex")
            fail("flex asked for on a torch without it was accepted")
        except ValueError as e:
            if torch.__version__ not in str(e) or "flex_attention" not in str(e):
                fail(f"the refusal of flex names neither the torch nor flex_attention: {e}")
            out.append(f"flex refused on torch {torch.__version__}: {e}")
    try:
        dispatch.choose(q, k, v, "flash3")
        fail("an unknown kernel was accepted")
    except ValueError as e:
        if "'flash3'" not in str(e) or "tiles" not in str(e):
            fail(f"an unknown kernel's refusal does not name it and the choices: {e}")
    logger.removeHandler(handler)
    return out


# --------------------------------------------------------------------------
# Ranks: every form, both tapes, through flex against the tiles
# --------------------------------------------------------------------------

def saved_bytes(fn):
    """Bytes autograd keeps for backward while fn runs (each storage once)."""
    seen = {}

    def pack(t):
        if isinstance(t, torch.nn.Parameter):
            return t
        try:
            key = t.untyped_storage().data_ptr()
            n = t.untyped_storage().nbytes()
        except AttributeError:
            key, n = t.storage().data_ptr(), t.storage().nbytes()
        seen[key] = n
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def worker(args):
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
            res, kept = {}, {}
            for kern in ("tiles", "flex"):
                torch.manual_seed(44)
                m = lt.MLA(cfg, form=form, tape=tape, attention="flash", flash_block=4,
                           dtype=torch.float64, attention_kernel=kern)
                m.ledger = lt.Ledger()
                xi = x.clone().requires_grad_(True)
                y, kept[kern] = saved_bytes(lambda: m(xi, cu_seqlens=DOCS))
                y.backward(dout)
                res[kern] = [y, xi.grad] + [p.grad for p in m.parameters()]
                if kern == "flex":
                    kernels[f"{form} {tape}"] = {f"{a} {b}": c for (a, b), c in
                                                 m.ledger.kernels.items()}
            e = max(rel(a, b) for a, b in zip(res["flex"], res["tiles"]))
            if e > 1e-12:
                fail(f"P {P} rank {r} {form} tape {tape}: flex off by {e:.3g} from the tiles")
            if kept["flex"] != kept["tiles"]:
                fail(f"P {P} rank {r} {form} tape {tape}: flex keeps {kept['flex']} bytes for "
                     f"backward, the tiles {kept['tiles']}")
            ks = kernels[f"{form} {tape}"]
            if ks.get("forward flex", 0) < 1 or any(k.startswith("forward") and "tiles" in k
                                                    for k in ks):
                fail(f"{form} tape {tape}: the ledger's kernels {ks} do not say flex ran "
                     "every forward call")
            worst, cases = max(worst, e), cases + 1
    with open(os.path.join(args.dir, f"disp-P{P}-r{r}.json"), "w") as f:
        json.dump({"worst": worst, "cases": cases, "kernels": kernels}, f)
    end_ranks()


def launch(args, P, timeout=200):
    run_ranks(__file__, [args.laga, args.dir, "--worker"], P, timeout, fail)
    return [json.load(open(os.path.join(args.dir, f"disp-P{P}-r{r}.json"))) for r in range(P)]


def main():
    args = parse_rank_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.dir, exist_ok=True)
    torch.set_num_threads(2)
    t0 = time.time()
    print(f"torch {torch.__version__}")
    for line in choice_rules():
        print(line)
    agree = kernels_agree()
    if agree is None:
        print(f"flex against the tiles: not run: torch {torch.__version__} has no "
              "torch.nn.attention.flex_attention with return_lse (torch 2.5+)")
        print(f"PASS ({time.time() - t0:.1f} s)")
        return
    n, worst = agree
    print(f"flex against the tiles: {n} calls (packed, mid-sequence rows, a ring's "
          f"rectangle, rows seeing no key; per-head and a shared key head) within "
          f"{worst[torch.float64]:.2g} in float64 and {worst[torch.float32]:.2g} in float32")
    res = launch(args, 2)
    w = max(x["worst"] for x in res)
    ks = res[0]["kernels"]["laga laga"]
    print(f"every form on both tapes at P 2 (packed, float64) through flex: "
          f"{sum(x['cases'] for x in res)} rank-cases within {w:.2g} of the tiles, the bytes "
          f"kept equal; ledger kernels (laga, rank 0): {ks}")
    print(f"PASS ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
