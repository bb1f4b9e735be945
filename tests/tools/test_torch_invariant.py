#!/usr/bin/python3
"""laga_torch's invariant mode (MLA(..., invariant=True);
docs/pytorch_invariant.md; python/laga_torch/invariant.py).

Usage: test_torch_invariant.py LAGA WORKDIR [--ps 1,2,3,4]

(--ps: the rank counts, P 1 first; the torch 2 twin runs 1,2, its torch 1.13
run all four.)

One launch of 4 ranks (gloo, a free port, one thread each), the groups of
its first 1, 2, 3 and 4 ranks in turn: at P 1, 2, 3, 4, S 200 (four
chunks of the token tree, the last short; shards 100+100, 67+67+66,
50+50+50+50 cut chunks), H 5 (uneven heads, P 4 has a rank with one):
  * every form that offers the mode (explicit, absorbed, laga, laga_fused,
    allgather_kv), eager and flash, float32 and float64, one sequence and
    packed documents (different per row), q_lora_rank 7 and 0, contiguous
    and zigzag, q_latent and overlap, each at P 1 within 1e-12 (float64) / 1e-5 (float32) of the
    mode off (the right numbers, not only the same ones): out
    and dx (each rank's rows put back in sequence order) and every
    parameter's gradient on every rank bitwise equal (the bits, so -0 and
    +0 differ) to P 1's;
  * a training run: two residual MLA layers (laga, float64 and float32),
    AdamW, 4 steps, the loss summed in the token tree: every step's loss
    and the final weights bitwise equal at P 1, 2, 3, 4;
  * the mutation: with invariant.RANK_ORDER_MUTATION (each rank's chunks
    summed, then the ranks' partials in rank order: an all-reduce's order)
    the gradients at some P > 1 differ from P 1's, so the comparison above
    can fail; and with the mode off some P > 1 differs from P 1 (what the
    mode is for);
  * refusals, on every rank, naming the form and what to use: each form
    without the mode (laga2d, the rings), tape autograd, form auto, bf16.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import laga_torch as lt  # noqa: E402
from laga_torch import invariant  # noqa: E402
from torch_ranks import end_ranks, parse_rank_args, run_ranks  # noqa: E402

CFG = {"dim": 24, "n_heads": 5, "kv_lora_rank": 10, "qk_nope_head_dim": 8,
       "qk_rope_head_dim": 4, "v_head_dim": 6, "q_lora_rank": 7, "rope_theta": 10000.0}
S, B = 200, 2
DOCS = [[0, 30, 31, 120, 200], [0, 64, 65, 199, 200]]
DTYPES = {"float64": torch.float64, "float32": torch.float32}
PS = (1, 2, 3, 4)
# The cases run with the mutation and with the mode off (each must differ
# from P 1 somewhere): laga (the weights' and the heads' trees) and
# allgather_kv (the keys' gradients' tree as well).
PROBES = [dict(form=f, attention="eager", dtype="float64", docs=DOCS, rq=7, layout="contiguous")
          for f in ("laga", "allgather_kv")]
TOL = {"float64": 1e-12, "float32": 1e-5}


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def cases():
    out = []
    for form in ("explicit", "absorbed", "laga", "laga_fused", "allgather_kv"):
        for att in ("eager", "flash"):
            for dt in DTYPES:
                for docs in (None, DOCS):
                    out.append(dict(form=form, attention=att, dtype=dt, docs=docs, rq=7,
                                    layout="contiguous"))
    out.append(dict(form="laga", attention="flash", dtype="float64", docs=DOCS, rq=0,
                    layout="contiguous"))
    out.append(dict(form="explicit", attention="eager", dtype="float32", docs=None, rq=0,
                    layout="contiguous"))
    for form in ("laga", "absorbed", "allgather_kv"):
        out.append(dict(form=form, attention="flash", dtype="float32", docs=DOCS, rq=7,
                        layout="zigzag"))
    for form, att, dt, ql, ov in [("laga", "flash", "float64", True, False),
                                  ("laga", "eager", "float32", True, True),
                                  ("laga_fused", "flash", "float32", True, True),
                                  ("laga", "flash", "float64", False, True)]:
        out.append(dict(form=form, attention=att, dtype=dt, docs=DOCS, rq=7,
                        layout="contiguous", q_latent=ql, overlap=ov))
    return out


def name(c):
    return (f"{c['form']}-{c['attention']}-{c['dtype']}-{'packed' if c['docs'] else 'one'}-"
            f"rq{c['rq']}-{c['layout']}" + "-q_latent" * c.get("q_latent", False) +
            "-overlap" * c.get("overlap", False))


def module(c, dt, invariant_mode=True):
    cfg = lt.MLAConfig.from_json(dict(CFG, q_lora_rank=c["rq"]))
    torch.manual_seed(1)
    m = lt.MLA(cfg, form=c["form"], attention=c["attention"], dtype=dt,
               seq_layout=c["layout"], invariant=invariant_mode,
               q_latent=c.get("q_latent", False), overlap=c.get("overlap", False))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) * 0.3 + (1 if p.dim() == 1 else 0))
    return m


def run_case(c, P, r, group, invariant_mode=True):
    dt = DTYPES[c["dtype"]]
    m = module(c, dt, invariant_mode)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, CFG["dim"], generator=g, dtype=torch.float64).to(dt)
    dout = torch.randn(B, S, CFG["dim"], generator=g, dtype=torch.float64).to(dt)
    pos = lt.SpLayout.even(S, CFG["n_heads"], P, c["layout"]).positions(r)
    xl = x[:, pos].clone().requires_grad_(True)
    out = m(xl, group, seq_len=S, cu_seqlens=c["docs"])
    out.backward(dout[:, pos])
    lt.sync_gradients(m, group)
    return {"pos": torch.tensor(pos), "out": out.detach(), "dx": xl.grad,
            **{n: p.grad for n, p in m.named_parameters()}}


def train(dtype, P, r, group):
    """Two residual laga layers, AdamW, 4 steps; the loss (the squared
    error to a target, per token) summed in the token tree."""
    dt = DTYPES[dtype]
    c = dict(form="laga", attention="flash", layout="contiguous", rq=7)
    layers = [module(c, dt) for _ in range(2)]
    with torch.no_grad():  # two different layers
        for p in layers[1].parameters():
            p.mul_(0.9)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, S, CFG["dim"], generator=g, dtype=torch.float64).to(dt)
    target = torch.randn(B, S, CFG["dim"], generator=g, dtype=torch.float64).to(dt)
    lay = lt.SpLayout.even(S, CFG["n_heads"], P)
    pos = lay.positions(r)
    tree = invariant.TokenTree(lay, r, group, None, B)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        h = x[:, pos]
        for m in layers:
            h = h + m(h, group, seq_len=S, cu_seqlens=DOCS)
        per_token = ((h - target[:, pos]) ** 2).sum(-1)  # (B, L): row sums
        per_token.sum().backward()  # each token's gradient is its own term's
        for m in layers:
            lt.sync_gradients(m, group)
        losses.append(tree.column_sum(per_token.detach().unsqueeze(-1)))
        opt.step()
    return {"losses": torch.cat(losses), **{f"w{i}": p.detach() for i, p in enumerate(params)}}


def refusals(P, r, group):
    """Each refusal raised by this rank (the constructor is every rank's;
    bf16 is the forward's, through the agreement check)."""
    cfg = lt.MLAConfig.from_json(CFG)
    said = []

    def refused(want, **kw):
        try:
            lt.MLA(cfg, invariant=True, **kw)
        except ValueError as e:
            for w in want:
                if w not in str(e):
                    fail(f"rank {r}: the refusal of {kw} does not say '{w}': {e}")
            said.append(str(e))
            return
        fail(f"rank {r}: MLA(invariant=True, {kw}) was accepted")
    for form in ("laga2d", "ring_kv", "ring_latent", "a2a_p2p"):
        refused([f"form '{form}'", "use explicit, absorbed, laga, laga_fused or allgather_kv"],
                form=form)
    refused(["tape 'autograd'", "tape='laga'"], form="laga", tape="autograd")
    refused(["form 'auto'"], form="auto", profile="h100")
    m = lt.MLA(cfg, form="laga", invariant=True, dtype=torch.bfloat16)
    pos = lt.SpLayout.even(S, CFG["n_heads"], P).positions(r)
    try:
        m(torch.zeros(1, len(pos), CFG["dim"], dtype=torch.bfloat16), group, seq_len=S)
        fail(f"rank {r}: a bf16 input was accepted by the invariant mode")
    except ValueError as e:
        if "float32 and float64" not in str(e):
            fail(f"rank {r}: the bf16 refusal does not name the dtypes: {e}")
        said.append(str(e))
    return said


def worker(args):
    r = args.rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=r,
                            world_size=args.world)
    for P in args.ps or PS:
        group = dist.new_group(list(range(P)))  # every rank makes every group
        if r >= P:
            continue
        res = {}
        for c in cases():
            res[name(c)] = run_case(c, P, r, group)
            if P == 1:  # the mode off, which tools_torch_package holds to laga forward
                res["ref:" + name(c)] = run_case(c, P, r, group, invariant_mode=False)
        for c in PROBES:
            res["off:" + name(c)] = run_case(c, P, r, group, invariant_mode=False)
            invariant.RANK_ORDER_MUTATION = True
            res["mutated:" + name(c)] = run_case(c, P, r, group)
            invariant.RANK_ORDER_MUTATION = False
        for dt in DTYPES:
            res[f"train-{dt}"] = train(dt, P, r, group)
        res["refusals"] = refusals(P, r, group)
        torch.save(res, os.path.join(args.dir, f"inv_P{P}_r{r}.pt"))
    end_ranks()


def bits(t):
    """The tensor's bits (so -0 and +0, and NaN payloads, differ)."""
    t = t.contiguous()
    return t.view(torch.int64 if t.element_size() == 8 else torch.int32)


def whole(parts, key):
    """Rank shards' rows (dim 1) back in sequence order."""
    t = torch.cat([p[key] for p in parts], 1)
    order = torch.cat([p["pos"] for p in parts]).argsort()
    return t[:, order]


def differ(a, b):
    """Names of the tensors that differ bitwise between results a and b
    (lists of every rank's dicts)."""
    out = []
    for key in ("out", "dx"):
        if not torch.equal(bits(whole(a, key)), bits(whole(b, key))):
            out.append(key)
    for key in a[0]:
        if key in ("pos", "out", "dx"):
            continue
        for r, p in enumerate(b):
            if not torch.equal(bits(a[0][key]), bits(p[key])):
                out.append(f"{key} (rank {r})")
                break
    return out


def main():
    args = parse_rank_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.dir, exist_ok=True)
    for f in os.listdir(args.dir):  # no result of an earlier run is read
        if f.startswith("inv_P"):
            os.unlink(os.path.join(args.dir, f))
    Ps = args.ps or PS
    if Ps[0] != 1 or len(Ps) < 2:
        fail(f"--ps {','.join(map(str, Ps))}: P 1 (the reference) and at least one P > 1")
    run_ranks(__file__, [args.laga, args.dir, "--ps", ",".join(map(str, Ps)), "--worker"],
              max(Ps), 280, fail)
    res = {P: [torch.load(os.path.join(args.dir, f"inv_P{P}_r{r}.pt")) for r in range(P)]
           for P in Ps}
    names = [name(c) for c in cases()]
    checked = 0
    for n in names:
        for P in Ps[1:]:
            d = differ([res[1][0][n]], [x[n] for x in res[P]])
            if d:
                fail(f"{n}: at P {P} not bitwise P 1's: {', '.join(d)}")
            checked += 1
    worst = {}
    for c in cases():
        n = name(c)
        a, b = res[1][0][n], res[1][0]["ref:" + n]
        for key in a:
            if key == "pos":
                continue
            err = ((a[key] - b[key]).abs().max() / b[key].abs().max().clamp(min=1e-30)).item()
            worst[c["dtype"]] = max(worst.get(c["dtype"], 0.0), err)
            if not err <= TOL[c["dtype"]]:
                fail(f"{n}: {key} with the mode on is {err:.3g} from the mode off (relative to "
                     f"its largest), over {TOL[c['dtype']]}: the mode changed the values")
    print("the mode on against off at P 1, worst relative error: " +
          ", ".join(f"{k} {v:.2g}" for k, v in worst.items()))
    print(f"invariant: {len(names)} cases bitwise equal to P 1 at P "
          f"{', '.join(map(str, Ps[1:]))} ({checked} runs: out, dx, every gradient on every "
          "rank)")
    for dt in DTYPES:
        k = f"train-{dt}"
        for P in Ps[1:]:
            for key, t in res[1][0][k].items():
                for r in range(P):
                    if not torch.equal(bits(t), bits(res[P][r][k][key])):
                        fail(f"training {dt}: {key} at P {P} rank {r} not bitwise P 1's")
        print(f"training {dt}: losses {[f'{v:.6g}' for v in res[1][0][k]['losses'].tolist()]} "
              f"and final weights bitwise equal at P {', '.join(map(str, Ps))}")
    for what, c in [(w, c) for w in ("mutated", "off") for c in PROBES]:
        k = f"{what}:" + name(c)
        d = {P: differ([res[1][0][k]], [x[k] for x in res[P]]) for P in Ps[1:]}
        if not any(d.values()):
            fail(f"{k}: every P equals P 1 bitwise: the comparison cannot tell a rank-order "
                 "sum")
        print(f"{k}: differs from P 1 at " +
              "; ".join(f"P {P}: {len(v)} tensors ({', '.join(v[:3])}...)" for P, v in d.items()
                        if v))
    for P in Ps:
        said = [res[P][r]["refusals"] for r in range(P)]
        if any(s != said[0] for s in said):
            fail(f"the refusals differ between ranks at P {P}")
    print(f"refusals: {len(said[0])}, the same on every rank, e.g. {said[0][2]}")
    print("PASS")


if __name__ == "__main__":
    main()
