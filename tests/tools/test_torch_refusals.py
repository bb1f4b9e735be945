#!/usr/bin/python3
"""laga_torch's refusals across ranks (docs/pytorch.md, "Refusals").

Usage: test_torch_refusals.py LAGA WORKDIR CASE [--only NAME]

CASE ranks: ranks (processes on gloo, a free port) that disagree — on
  cu_seqlens, seq_len, batch, config, form, variant, attention, layout,
  dtype, module size, a change at the second forward, one rank in another
  call — and ranks of which one refuses its own arguments (seq_len a float
  tensor, 12.7, a string; a shard of the wrong length; cu_seqlens with 4.7).
  Every rank must raise the same error (type and message, naming what
  differs and which ranks) within SCENARIO_S seconds; a gloo abort or a hang
  fails. Arguments every rank gives alike: seq_len and cu_seqlens as ints,
  numpy arrays, tuples and tensors accepted and equal to the list's output;
  non-integers, unsorted, wrong ends, bad shapes, a group without this rank,
  a group of the wrong type, bad module arguments refused naming the
  argument. At P 2 and 3.
CASE sync: sync_gradients before backward (on one rank or all) is the same
  clear error on every rank; a module of another size on one rank too; and
  the gradients it writes back equal, within 1e-12, the gradients of the
  whole sequence on one rank (rq7, laga and ring_kv, P 2 and 3).
CASE auto: form "auto" plans once and every rank runs that plan: a rank
  without the binary (either rank) is fine, no rank with it is one error on
  every rank, and a bad LAGA_BIN (missing, a directory, not executable, not
  an executable format, exits 3, prints nothing, prints other JSON, names a
  form the package lacks) is one clear ValueError on every rank.
The group timeout is TIMEOUT_S and the driver kills the ranks after
WALL_S: a hang fails fast, naming the case.
"""

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

TIMEOUT_S = 15  # the gloo group's: a collective that waits longer raises
SCENARIO_S = 8  # what a refusal may take on every rank (it takes milliseconds)
WALL_S = 150  # the whole launch
S, B = 13, 2
RQ7 = {"dim": 24, "n_heads": 5, "kv_lora_rank": 10, "qk_nope_head_dim": 8,
       "qk_rope_head_dim": 4, "v_head_dim": 6, "original_seq_len": 8, "max_seq_len": 32,
       "rope_factor": 4.0, "mscale": 0.7, "beta_fast": 4.0, "beta_slow": 1.0, "q_lora_rank": 7}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# The ranks
# --------------------------------------------------------------------------

class Ctx:
    def __init__(self, lt, P, r, laga, workdir):
        self.lt, self.P, self.r, self.laga, self.dir = lt, P, r, laga, workdir

    def module(self, cfg=None, **kw):
        torch.manual_seed(0)  # the same weights on every rank
        kw.setdefault("dtype", torch.float64)
        return self.lt.MLA(self.lt.MLAConfig.from_json(cfg or RQ7), **kw)

    def x(self, seq=S, batch=B, layout="contiguous", dtype=torch.float64, P=None, r=None):
        torch.manual_seed(1)
        x = torch.randn(batch, seq, RQ7["dim"], dtype=torch.float64)
        lay = self.lt.SpLayout.even(seq, RQ7["n_heads"], P or self.P, layout)
        return x[:, lay.positions(self.r if r is None else r)].to(dtype)


def mine(r, a, b):
    """a on rank 0, b elsewhere."""
    return a if r == 0 else b


def ranks_scenarios(c):
    """(name, fn, expect): fn(c) runs on every rank; expect is ("ok",) or
    (exception name, [words every rank's message holds])."""
    lt, r, P = c.lt, c.r, c.P
    x = c.x()
    docs_a, docs_b = [0, 5, S], [0, 6, S]
    out = [
        ("cu_seqlens differ", lambda c: c.module()(x, cu_seqlens=mine(r, docs_a, docs_b)),
         ("ValueError", ["disagree", "cu_seqlens", "rank 0", "[[0, 5, 13], [0, 5, 13]]",
                         "[[0, 6, 13], [0, 6, 13]]"])),
        ("one row of cu_seqlens differs",
         lambda c: c.module()(x, cu_seqlens=[docs_a, mine(r, docs_a, docs_b)]),
         ("ValueError", ["cu_seqlens", "rank 0"])),
        ("config differs (rope_theta)",
         lambda c: c.module(dict(RQ7, rope_theta=mine(r, 10000.0, 500000.0)))(x, seq_len=S),
         ("ValueError", ["config", "rope_theta", "500000"])),
        ("module size differs (q_lora_rank)",
         lambda c: c.module(dict(RQ7, q_lora_rank=mine(r, 7, 6)))(x, seq_len=S),
         ("ValueError", ["config", "module", "wq_a.weight"])),
        ("weights differ", lambda c: other_weights(c)(x, seq_len=S),
         ("ValueError", ["weights", "sampled hash", "broadcast"])),
        ("form differs", lambda c: c.module(form=mine(r, "laga", "explicit"))(x, seq_len=S),
         ("ValueError", ["form", "laga q_latent", "explicit q_latent"])),
        ("a2a form differs from a ring",
         lambda c: c.module(form=mine(r, "ring_kv", "allgather_kv"))(x, seq_len=S),
         ("ValueError", ["form", "ring_kv", "allgather_kv"])),
        ("overlap differs", lambda c: c.module(overlap=mine(r, True, False))(x, seq_len=S),
         ("ValueError", ["form", "overlap=True", "overlap=False"])),
        ("attention differs", lambda c: c.module(attention=mine(r, "eager", "flash"))(
            x, seq_len=S), ("ValueError", ["attention", "eager", "flash"])),
        ("tape differs", lambda c: c.module(tape=mine(r, "laga", "autograd"))(x, seq_len=S),
         ("ValueError", ["attention", "tape=laga", "tape=autograd"])),
        # S 13 at P 2: 7 + 6 tokens on either layout, so the shard lengths pass
        ("seq_layout differs", lambda c: c.module(
            seq_layout=mine(r, "contiguous", "zigzag"))(
                c.x(layout=mine(r, "contiguous", "zigzag")), seq_len=S),
         ("ValueError", ["seq_layout", "contiguous", "zigzag"])),
        ("dtype differs", lambda c: c.module(dtype=mine(r, torch.float64, torch.float32))(
            c.x(dtype=mine(r, torch.float64, torch.float32)), seq_len=S),
         ("ValueError", ["dtype", "torch.float64", "torch.float32"])),
        ("batch differs", lambda c: c.module()(c.x(batch=mine(r, 2, 1)), seq_len=S),
         ("ValueError", ["batch", "rank 0 2", "1"])),
        ("grad mode differs", lambda c: no_grad_on(r, 1, lambda: c.module()(x, seq_len=S)),
         ("ValueError", ["grad", "True", "False"])),
        ("changed at the second forward", second_forward,
         ("ValueError", ["cu_seqlens", "[[0, 5, 13], [0, 5, 13]]"])),
        ("one rank in sync_gradients", other_call,
         ("ValueError", ["different calls", "MLA.forward", "sync_gradients"])),
        # seq_len differs with each shard right for its own S: 7 + 6 of 13, 7 + 7 of 14
        ("seq_len differs (S 13 against 14)",
         lambda c: c.module()(c.x(seq=mine(r, S, S + 1)), seq_len=mine(r, S, S + 1)),
         ("ValueError", ["seq_len", "13", "14"])),
        # One rank refuses its own arguments: every rank raises it.
        ("seq_len a float tensor on one rank",
         lambda c: c.module()(x, seq_len=mine(r, torch.tensor(13.0), S)),
         ("ArgumentTypeError", ["seq_len", "rank 0", "torch.float32", "every rank raises this"])),
        ("seq_len 12.7 on one rank", lambda c: c.module()(x, seq_len=mine(r, S, 12.7)),
         ("ArgumentTypeError", ["seq_len", "12.7", "every rank raises this"])),
        ("seq_len a string on one rank", lambda c: c.module()(x, seq_len=mine(r, "13", S)),
         ("ArgumentTypeError", ["seq_len", "'13'"])),
        ("a shard of the wrong length on one rank",
         lambda c: c.module()(mine(r, x, x[:, :-1]), seq_len=S),
         ("ValueError", ["holds", "rank 1"])),
        ("cu_seqlens 4.7 on one rank",
         lambda c: c.module()(x, cu_seqlens=mine(r, [0, 4.7, S], [0, 4, S])),
         ("ArgumentTypeError", ["cu_seqlens[1]", "4.7"])),
        ("x not a tensor on one rank", lambda c: c.module()(mine(r, x.tolist(), x), seq_len=S),
         ("ArgumentTypeError", ["x must be a tensor", "list"])),
        # Every rank alike: refused naming the argument.
        ("seq_len 12.7", lambda c: c.module()(x, seq_len=12.7),
         ("ArgumentTypeError", ["seq_len", "12.7"])),
        ("seq_len 13.0", lambda c: c.module()(x, seq_len=13.0), ("ArgumentTypeError", ["seq_len"])),
        ("seq_len True", lambda c: c.module()(x, seq_len=True),
         ("ArgumentTypeError", ["seq_len", "bool"])),
        ("seq_len 0", lambda c: c.module()(x, seq_len=0), ("ValueError", ["seq_len 0"])),
        ("seq_len -13", lambda c: c.module()(x, seq_len=-S), ("ValueError", ["seq_len -13"])),
        ("seq_len a float tensor", lambda c: c.module()(x, seq_len=torch.tensor(13.0)),
         ("ArgumentTypeError", ["seq_len", "float"])),
        ("seq_len a 2-element tensor", lambda c: c.module()(x, seq_len=torch.tensor([S, S])),
         ("ArgumentTypeError", ["seq_len", "shape"])),
        ("seq_len None and no cu_seqlens", lambda c: c.module()(x),
         ("ValueError", ["seq_len", "cu_seqlens"])),
        ("cu_seqlens [0, 4.7, 13]", lambda c: c.module()(x, cu_seqlens=[0, 4.7, S]),
         ("ArgumentTypeError", ["cu_seqlens[1]", "4.7"])),
        ("cu_seqlens [0, 4.0, 13]", lambda c: c.module()(x, cu_seqlens=[0, 4.0, S]),
         ("ArgumentTypeError", ["cu_seqlens[1]", "4.0"])),
        ("cu_seqlens numpy float", lambda c: c.module()(
            x, cu_seqlens=np.array([0, 4.7, S])), ("ArgumentTypeError", ["cu_seqlens", "float64"])),
        ("cu_seqlens unsorted", lambda c: c.module()(x, cu_seqlens=[0, 9, 4, S]),
         ("ValueError", ["cu_seqlens", "increasing"])),
        ("cu_seqlens numpy unsorted", lambda c: c.module()(x, cu_seqlens=np.array([0, 9, 4, S])),
         ("ValueError", ["cu_seqlens", "increasing"])),
        ("cu_seqlens not from 0", lambda c: c.module()(x, cu_seqlens=[1, 5, S]),
         ("ValueError", ["cu_seqlens", "from 0"])),
        ("cu_seqlens past S", lambda c: c.module()(x, cu_seqlens=[0, 5, S + 1], seq_len=S),
         ("ValueError", ["cu_seqlens", "from 0"])),
        ("cu_seqlens empty", lambda c: c.module()(x, cu_seqlens=[]),
         ("ValueError", ["cu_seqlens"])),
        ("cu_seqlens a string", lambda c: c.module()(x, cu_seqlens="0,5,13"),
         ("ArgumentTypeError", ["cu_seqlens", "str"])),
        ("cu_seqlens a bool", lambda c: c.module()(x, cu_seqlens=[0, True, S]),
         ("ArgumentTypeError", ["cu_seqlens[1]", "bool"])),
        ("cu_seqlens 3-D", lambda c: c.module()(x, cu_seqlens=np.zeros((2, 2, 3), np.int64)),
         ("ValueError", ["cu_seqlens", "shape"])),
        ("cu_seqlens rows != batch", lambda c: c.module()(
            x, cu_seqlens=np.array([[0, S]] * 3)), ("ValueError", ["3 rows", "batch of 2"])),
        ("group a list", lambda c: c.module()(x, seq_len=S, group=[0, 1]),
         ("ArgumentTypeError", ["group", "list"])),
        ("q_latent a string", lambda c: c.module(form="laga", q_latent="yes"),
         ("ArgumentTypeError", ["q_latent", "'yes'"])),
        ("overlap 1", lambda c: c.module(overlap=1), ("ArgumentTypeError", ["overlap"])),
        ("head_groups 1.5", lambda c: c.module(form="laga2d", head_groups=1.5),
         ("ArgumentTypeError", ["head_groups", "1.5"])),
        ("head_groups -1", lambda c: c.module(form="laga2d", head_groups=-1),
         ("ValueError", ["head_groups -1"])),
        ("flash_block '8'", lambda c: c.module(flash_block="8"),
         ("ArgumentTypeError", ["flash_block", "'8'"])),
        ("form None", lambda c: c.module(form=None), ("ArgumentTypeError", ["form", "NoneType"])),
        ("cfg a path", lambda c: lt.MLA("config.json"), ("ArgumentTypeError", ["cfg", "str"])),
        ("dtype int64", lambda c: c.module(dtype=torch.int64), ("ArgumentTypeError", ["dtype"])),
        ("ledger a dict", lambda c: with_ledger(c.module(), {})(x, seq_len=S),
         ("ArgumentTypeError", ["ledger", "dict"])),
        ("functional: q of the wrong shape", lambda c: functional(c, q_shape=(B, 1, 5, 12)),
         ("ValueError", ["q has shape", "(2, 1, 5, 12)"])),
        ("functional: sp not an Sp", lambda c: functional(c, sp="sp"),
         ("ArgumentTypeError", ["sp must be", "str"])),
        ("functional: overlap 'on'", lambda c: functional(c, overlap="on"),
         ("ArgumentTypeError", ["overlap", "'on'"])),
        ("functional: q_latent a tensor", lambda c: functional(c, q_latent=torch.zeros(1)),
         ("ArgumentTypeError", ["q_latent", "Tensor"])),
        ("functional: as the module", lambda c: functional(c), ("ok",)),
        ("SpLayout.even(12.7, ...)", lambda c: lt.SpLayout.even(12.7, 5, c.P),
         ("ArgumentTypeError", ["seq", "12.7"])),
        ("config mutated after building", mutated_config,
         ("ValueError", ["rope_theta must be > 1"])),
    ]
    # Accepted alike: every spelling of the same documents and S gives the list's output.
    spellings = [("numpy", np.array(docs_a)), ("numpy int32", np.array(docs_a, np.int32)),
                 ("tuple", tuple(docs_a)), ("tensor", torch.tensor(docs_a)),
                 ("int32 tensor", torch.tensor(docs_a, dtype=torch.int32)),
                 ("numpy rows", np.array([docs_a, docs_a])),
                 ("list of numpy rows", [np.array(docs_a), np.array(docs_a)]),
                 ("list of tensor rows", [torch.tensor(docs_a), torch.tensor(docs_a)]),
                 ("numpy scalars", [np.int64(v) for v in docs_a])]
    for name, cu in spellings:
        out.append((f"cu_seqlens as {name}", lambda c, cu=cu: same_output(
            c, lambda m: m(x, cu_seqlens=cu), lambda m: m(x, cu_seqlens=docs_a)), ("ok",)))
    for name, s in (("tensor", torch.tensor(S)), ("numpy", np.int64(S)),
                    ("1-element tensor", torch.tensor([S]))):
        out.append((f"seq_len as {name}", lambda c, s=s: same_output(
            c, lambda m: m(x, seq_len=s), lambda m: m(x, seq_len=S)), ("ok",)))
    if P == 3:  # a group without rank 2: rank 2 is refused, ranks 0 and 1 run
        out.append(("a group without this rank", group_without_me,
                    ("per-rank", {0: "ok", 1: "ok", 2: ("ValueError", ["not a member"])})))
    return out


def no_grad_on(r, which, fn):
    if r == which:
        with torch.no_grad():
            return fn()
    return fn()


def other_weights(c):
    """Rank 1's wkv_b one ulp off in one element (rank 0's as loaded)."""
    m = c.module()
    if c.r == 1:
        with torch.no_grad():
            w = m.wkv_b.weight.view(-1)
            w[0] = torch.nextafter(w[0], torch.tensor(1e9, dtype=w.dtype))
    return m


def with_ledger(m, ledger):
    m.ledger = ledger
    return m


def functional(c, q_shape=None, sp=None, overlap=False, q_latent=None):
    """lt.mla_attention on this rank's shard: right, or with one argument wrong."""
    from laga_torch.forms import Sp
    from laga_torch.module import rope_tables
    lt, cfg = c.lt, c.lt.MLAConfig.from_json(RQ7)
    lay = lt.SpLayout.even(S, cfg.n_heads, c.P)
    L = lay.seq_count[c.r]
    cos, sin = rope_tables(cfg, S, torch.float64, "cpu")
    sp = sp or Sp(lay, c.r, None, None, B, torch.zeros(B, S, dtype=torch.long), cos, sin,
                  form="laga")
    torch.manual_seed(3)
    q = torch.randn(q_shape or (B, L, cfg.n_heads, cfg.qk_head_dim), dtype=torch.float64)
    c_kv = torch.randn(B, L, cfg.kv_lora_rank, dtype=torch.float64)
    k_pe = torch.randn(B, L, cfg.qk_rope_head_dim, dtype=torch.float64)
    wkv_b = torch.randn(cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank,
                        dtype=torch.float64)
    return lt.mla_attention("laga", q, c_kv, k_pe, wkv_b, sp, cfg, q_latent=q_latent,
                            overlap=overlap)


def second_forward(c):
    m = c.module()
    x = c.x()
    m(x, cu_seqlens=[0, 5, S])
    return m(x, cu_seqlens=mine(c.r, [0, 5, S], [0, 7, S]))


def other_call(c):
    m = c.module()
    if c.r == 0:
        return m(c.x(), seq_len=S)
    return c.lt.sync_gradients(m)


def mutated_config(c):
    cfg = c.lt.MLAConfig.from_json(RQ7)
    cfg.rope_theta = -1.0
    return c.lt.MLA(cfg)


def same_output(c, fn, ref):
    m = c.module()
    a, b = fn(m), ref(m)
    if not torch.equal(a, b):
        raise AssertionError("the output differs from the list's")


def group_without_me(c):
    import torch.distributed as dist
    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))
    x = c.x(P=2, r=min(c.r, 1))
    return c.module()(x, seq_len=S, group=g)


def sync_scenarios(c):
    lt, r = c.lt, c.r
    return [
        ("sync_gradients before backward", lambda c: lt.sync_gradients(c.module()),
         ("ValueError", ["no gradient", "after backward"])),
        ("sync_gradients after zero_grad(set_to_none)", lambda c: sync_after(c, False),
         ("ValueError", ["no gradient", "after backward"])),
        ("sync_gradients before backward on one rank", lambda c: sync_after(c, c.r != 0),
         ("ValueError", ["no gradient", "rank 0", "every rank raises this"])),
        ("sync_gradients with grad_reduce fp16 on one rank",
         lambda c: sync_after(c, True, mine(r, "fp16", "fp32")),
         ("ValueError", ["grad_reduce", "fp16"])),
        ("sync_gradients of another module on one rank", other_module,
         ("ValueError", ["grads", "wq_a.weight"])),
        ("sync_gradients of a non-module", lambda c: lt.sync_gradients(torch.nn.Linear(2, 2)),
         ("ArgumentTypeError", ["MLA", "Linear"])),
        ("sync_gradients writes back the sums (laga)", lambda c: synced_equals_one_rank(
            c, "laga"), ("ok",)),
        ("sync_gradients writes back the sums (ring_kv, packed)",
         lambda c: synced_equals_one_rank(c, "ring_kv", [0, 3, 9, S]), ("ok",)),
    ]


def sync_after(c, keep, grad_reduce="fp32"):
    """Forward and backward on every rank; where not keep, the gradients
    then set to None (zero_grad(set_to_none=True), as before a backward)."""
    m = c.module()
    m(c.x(), seq_len=S).sum().backward()
    if not keep:
        m.zero_grad(set_to_none=True)
    return c.lt.sync_gradients(m, grad_reduce=grad_reduce)


def other_module(c):
    import torch.distributed as dist
    alone = [dist.new_group([i]) for i in range(c.P)]  # every rank makes every group
    m = c.module(dict(RQ7, q_lora_rank=mine(c.r, 7, 6)))
    m(c.x(P=1, r=0), seq_len=S, group=alone[c.r]).sum().backward()
    return c.lt.sync_gradients(m)


def synced_equals_one_rank(c, form, docs=None):
    """Each rank's gradients after sync_gradients equal those of the whole
    sequence on one rank (a group of one), within 1e-12 relative."""
    import torch.distributed as dist
    alone = [dist.new_group([i]) for i in range(c.P)]
    torch.manual_seed(2)
    dout = torch.randn(B, S, RQ7["dim"], dtype=torch.float64)
    lay = c.lt.SpLayout.even(S, RQ7["n_heads"], c.P)
    m = c.module(form=form)
    m(c.x(), seq_len=S, cu_seqlens=docs).backward(dout[:, lay.positions(c.r)])
    c.lt.sync_gradients(m)
    ref = c.module(form="explicit")
    ref(c.x(P=1, r=0), seq_len=S, cu_seqlens=docs, group=alone[c.r]).backward(dout)
    want = dict(ref.named_parameters())
    for n, p in m.named_parameters():
        w = want[n].grad
        e = float((p.grad - w).abs().max() / w.abs().max())
        if not e <= 1e-12:
            raise AssertionError(f"{n}'s gradient after sync_gradients is off by {e:.3e} "
                                 "relative from the whole sequence's on one rank")


def auto_scenarios(c):
    d = c.dir
    bad = {"missing": os.path.join(d, "no-such-laga"), "directory": d,
           "not executable": os.path.join(d, "plain.txt"),
           "not an executable format": os.path.join(d, "garbage.bin"),
           "exits 3": os.path.join(d, "exit3.sh"), "prints nothing": "/bin/true",
           "prints other JSON": os.path.join(d, "other_json.sh"),
           "names a form the package lacks": os.path.join(d, "bogus_form.sh")}
    words = {"missing": ["LAGA_BIN", "no such file"], "directory": ["LAGA_BIN", "directory"],
             "not executable": ["LAGA_BIN", "not executable"],
             "not an executable format": ["cannot run", "LAGA_BIN"],
             "exits 3": ["exited 3", "broken on purpose"],
             "prints nothing": ["not laga plan's JSON"],
             "prints other JSON": ["not laga plan's JSON", "cases"],
             "names a form the package lacks": ["warp_drive", "not a form"]}
    out = [("auto: rank 1 without the binary", lambda c: auto_runs(c, {1: bad["missing"]}),
            ("ok",)),
           ("auto: rank 0 without the binary", lambda c: auto_runs(c, {0: bad["missing"]}),
            ("ok",)),
           ("auto: no rank with the binary",
            lambda c: auto_runs(c, {i: bad["missing"] for i in range(c.P)}),
            ("ValueError", ["no rank of the group", "LAGA_BIN", "no such file"]))]
    for name, path in bad.items():
        out.append((f"auto: LAGA_BIN {name}", lambda c, path=path: auto_runs(
            c, {i: path for i in range(c.P)}), ("ValueError", words[name])))
    return out


def auto_runs(c, bin_of):
    """form auto with LAGA_BIN per rank (c.laga where not given) and no laga
    on PATH: the output equals the plan's form chosen by hand on every rank."""
    os.environ["LAGA_BIN"] = bin_of.get(c.r, c.laga)
    m = c.module(form="auto", profile="h100")
    out = m(c.x(), seq_len=S)
    (key, picked), = m.plans.items()
    ref = c.module(form=picked[0], q_latent=picked[1], overlap=picked[2])(c.x(), seq_len=S)
    if not torch.equal(out, ref):
        raise AssertionError(f"form auto ({picked}) differs from that form by hand")
    return picked


def worker(args):
    import torch.distributed as dist
    import laga_torch as lt
    torch.set_num_threads(1)
    os.environ["PATH"] = "/usr/bin:/bin"  # no laga there: LAGA_BIN decides
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    c = Ctx(lt, args.world, args.rank, args.laga, args.dir)
    scen = {"ranks": ranks_scenarios, "sync": sync_scenarios, "auto": auto_scenarios}[args.case](c)
    results = []
    for name, fn, _ in scen:
        if args.only and args.only not in name:
            continue
        t = time.time()
        try:
            fn(c)
            got = {"kind": "ok", "msg": ""}
        except (ValueError, TypeError) as e:
            got = {"kind": type(e).__name__, "msg": str(e)}
        except Exception as e:  # noqa: BLE001: recorded, the driver fails it
            got = {"kind": type(e).__name__, "msg": f"{e}\n{traceback.format_exc()}"}
        got.update(name=name, s=time.time() - t)
        results.append(got)
        with open(os.path.join(args.dir, f"{args.case}-P{args.world}-r{args.rank}.json"),
                  "w") as f:
            json.dump(results, f)  # after each: a rank that hangs later leaves what it did
    dist.destroy_process_group()


# --------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------

def fake_binaries(d):
    """The bad LAGA_BINs of the auto case."""
    def script(name, body, mode=0o755):
        p = os.path.join(d, name)
        with open(p, "w") as f:
            f.write(body)
        os.chmod(p, mode)
    script("plain.txt", "not a program\n", 0o644)
    script("exit3.sh", "#!/bin/sh\necho 'laga: error: broken on purpose' >&2\nexit 3\n")
    script("other_json.sh", "#!/bin/sh\necho '{\"plans\": []}'\n")
    script("bogus_form.sh", "#!/bin/sh\necho '{\"cases\": [{\"winner\": \"warp_drive\"}]}'\n")
    with open(os.path.join(d, "garbage.bin"), "wb") as f:
        f.write(b"\x7fELF\x01\x00garbage")
    os.chmod(os.path.join(d, "garbage.bin"), 0o755)


def check(case, P, per_rank, scen_names, expects):
    fails = []
    for name in scen_names:
        got = [next((g for g in rr if g["name"] == name), None) for rr in per_rank]
        want = expects[name]
        if any(g is None for g in got):
            fails.append(f"{name} at P {P}: ranks {[r for r, g in enumerate(got) if g is None]} "
                         "never finished it (a hang or an abort)")
            continue
        slow = [round(g["s"], 1) for g in got if g["s"] > SCENARIO_S]
        if slow:
            fails.append(f"{name} at P {P}: took {slow} s on some rank (> {SCENARIO_S} s): the "
                         "ranks waited for each other")
        if want[0] == "per-rank":
            wants = [want[1][r] for r in range(P)]
        else:
            wants = [want] * P
        for r, (g, w) in enumerate(zip(got, wants)):
            w = ("ok",) if w == "ok" else w
            if w[0] == "ok":
                if g["kind"] != "ok":
                    fails.append(f"{name} at P {P}, rank {r}: {g['kind']}: {g['msg']}")
                continue
            if g["kind"] != w[0]:
                fails.append(f"{name} at P {P}, rank {r}: expected {w[0]}, got {g['kind']}: "
                             f"{g['msg']}")
                continue
            miss = [word for word in w[1] if word not in g["msg"]]
            if miss:
                fails.append(f"{name} at P {P}, rank {r}: the {w[0]} does not name {miss}: "
                             f"{g['msg']}")
        if want[0] not in ("ok", "per-rank") and len({(g["kind"], g["msg"]) for g in got}) > 1:
            fails.append(f"{name} at P {P}: the ranks raised different errors: "
                         + " | ".join(f"rank {r}: {g['kind']}: {g['msg']}"
                                      for r, g in enumerate(got)))
    return fails


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("laga")
    ap.add_argument("dir")
    ap.add_argument("case", choices=("ranks", "sync", "auto"))
    ap.add_argument("--only", default="")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    args.laga = os.path.abspath(args.laga)
    if args.worker:
        return worker(args)
    t0 = time.time()
    args.dir = os.path.abspath(os.path.join(args.dir, args.case))
    os.makedirs(args.dir, exist_ok=True)
    fake_binaries(args.dir)
    import laga_torch as lt
    fails, ran = [], 0
    for P in {"ranks": (2, 3), "sync": (2, 3), "auto": (2,)}[args.case]:
        for f in os.listdir(args.dir):
            if f.startswith(f"{args.case}-P{P}-"):
                os.unlink(os.path.join(args.dir, f))
        c = Ctx(lt, P, 0, args.laga, args.dir)
        scen = {"ranks": ranks_scenarios, "sync": sync_scenarios,
                "auto": auto_scenarios}[args.case](c)
        names = [n for n, _, _ in scen if not args.only or args.only in n]
        expects = {n: e for n, _, e in scen}
        port = free_port()
        cmd = [sys.executable, __file__, args.laga, args.dir, args.case, "--worker",
               "--world", str(P), "--port", str(port), "--only", args.only]
        procs = [subprocess.Popen(cmd + ["--rank", str(r)],
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
                 for r in range(P)]
        deadline = time.time() + WALL_S
        try:
            for p in procs:
                p.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            fails.append(f"P {P}: the ranks were still running after {WALL_S} s (a hang)")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        if any(codes):
            fails.append(f"P {P}: ranks exited {codes} (an abort, a crash or a hang)")
        per_rank = []
        for r in range(P):
            path = os.path.join(args.dir, f"{args.case}-P{P}-r{r}.json")
            per_rank.append(json.load(open(path)) if os.path.exists(path) else [])
        fails += check(args.case, P, per_rank, names, expects)
        ran += len(names)
    for f in fails:
        print("FAIL:", f)
    if fails:
        sys.exit(f"FAIL: {len(fails)} of the checks ({ran} scenarios)")
    print(f"ok: {ran} scenarios of case {args.case}, every rank the same verdict "
          f"({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
