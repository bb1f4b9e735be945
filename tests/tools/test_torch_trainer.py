#!/usr/bin/python3
"""What a PyTorch trainer does with laga_torch.MLA (issue 53 item 6;
docs/pytorch.md, "Trainers"), on the torch that runs it.

Usage: test_torch_trainer.py LAGA WORKDIR

One process (a gloo group of one):
  * autocast (cpu, bf16): an fp32 module's forward and backward under
    torch.autocast equal the same weights' bf16 module bit for bit (out;
    every gradient, which comes back fp32, equal to the bf16 module's
    widened), both tapes, eager and flash, several forms. Before: laga's
    tape's backward raised "expected m1 and m2 to have the same dtype".
  * load_state_dict(sd, assign=True) (torch 2.1+): a module built on the
    meta device takes the tensors themselves (same storage) and computes
    the module's output bit for bit; on a torch without assign, a
    ValueError naming the version.
  * Hugging Face names with MLA a submodule of a model
    (model.layers.3.self_attn): loaded bit for bit equal to DeepSeek names;
    a parameter under both names refused naming both.
  * torch.compile (torch 2.4+): torch._dynamo.explain finds 0 graph breaks
    (12 before) in the module, each tape, several forms; a two-layer model
    compiled with fullgraph=True (backend aot_eager: AOTAutograd's
    forward and backward graphs, no code generation) gives the eager
    model's loss bit for bit and every gradient within 1e-12 (float64; the
    embedding's backward sums in AOTAutograd's order), packed documents
    too, and under autocast (bit for bit); the graphs the op keeps for
    backward are freed by it, or with the output when none runs.
  * activation checkpointing (torch.utils.checkpoint, use_reentrant=False):
    every gradient equal to the run without it.
Ranks (gloo, free ports):
  * P 4, two sequence groups of 2 ranks (different data), the model under
    DistributedDataParallel over all 4: DDP's own averaging gives half
    the right gradient (shown), sum_over_sequence_ranks(dp_replicas=2) gives
    the mean over the two sequences of each one's whole-sequence gradient
    (computed on a one-rank group) within 1e-12; checkpointing at P 2
    within 1e-12 of the one-rank gradient.
  * the same 4 ranks under FSDP2 (torch.distributed.fsdp.fully_shard, torch
    2): with every FSDP module's gradient divide factor 2 (the replicas),
    the same mean within 1e-12; FSDP2's default (divide by 4) gives half.
Each part says what it ran or which torch feature it lacks.
"""

import inspect
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import laga_torch as lt  # noqa: E402
from torch_ranks import end_ranks, free_port, parse_rank_args, run_ranks  # noqa: E402

CFG = {"dim": 24, "n_heads": 5, "kv_lora_rank": 10, "qk_nope_head_dim": 8,
       "qk_rope_head_dim": 4, "v_head_dim": 6, "q_lora_rank": 7, "original_seq_len": 8,
       "max_seq_len": 32, "rope_factor": 4.0, "mscale": 0.7, "beta_fast": 4.0, "beta_slow": 1.0}
B, S, VOCAB = 2, 13, 32
HF = {"wq_a.weight": "q_a_proj.weight", "q_norm.weight": "q_a_layernorm.weight",
      "wq_b.weight": "q_b_proj.weight", "wkv_a.weight": "kv_a_proj_with_mqa.weight",
      "kv_norm.weight": "kv_a_layernorm.weight", "wkv_b.weight": "kv_b_proj.weight",
      "wo.weight": "o_proj.weight"}  # transformers' DeepseekV3Attention, written out here


def fail(msg):
    sys.exit("FAIL: " + msg)


def rel(a, ref):
    d = (a.double() - ref.double()).abs().max().item()
    s = ref.double().abs().max().item()
    return d / s if s > 0 else d


def cfg():
    return lt.MLAConfig.from_json(CFG)


class TinyLM(nn.Module):
    """Embedding, two MLA blocks with residuals, a head (the example's model)."""

    def __init__(self, layers=2, **mla):
        super().__init__()
        c = cfg()
        self.embed = nn.Embedding(VOCAB, c.dim)
        self.blocks = nn.ModuleList(lt.MLA(c, **mla) for _ in range(layers))
        self.head = nn.Linear(c.dim, VOCAB, bias=False)

    def forward(self, tokens, group=None, seq_len=S, cu_seqlens=None):
        h = self.embed(tokens)
        for blk in self.blocks:
            h = h + blk(h, group=group, seq_len=seq_len, cu_seqlens=cu_seqlens)
        return self.head(h)


def tokens(seed, n=S):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, n + 1), generator=g)


def loss_of(logits, targets, n_total):
    """The sequence's mean loss as this rank's part: a sum over its tokens
    divided by every token's count (the ranks' parts sum to the mean)."""
    return F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(),
                           reduction="sum") / n_total


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------
# One process
# --------------------------------------------------------------------------

def autocast_case(form, tape, attention, packed):
    """fp32 module under autocast(cpu, bf16) against the bf16 module."""
    torch.manual_seed(3)
    m32 = lt.MLA(cfg(), form=form, tape=tape, attention=attention)
    m16 = lt.MLA(cfg(), form=form, tape=tape, attention=attention, dtype=torch.bfloat16)
    m16.load_state_dict({n: p.detach().to(torch.bfloat16) for n, p in m32.state_dict().items()})
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, S, CFG["dim"], generator=g)
    dout = torch.randn(B, S, CFG["dim"], generator=g)
    kw = {"cu_seqlens": [0, 5, 13]} if packed else {"seq_len": S}
    x32 = x.clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16):
        y = m32(x32, **kw)
    if y.dtype != torch.bfloat16:
        fail(f"autocast {form} {tape}: out is {y.dtype}, expected autocast's bf16")
    y.backward(dout.to(torch.bfloat16))
    x16 = x.to(torch.bfloat16).requires_grad_(True)
    y16 = m16(x16, **kw)
    y16.backward(dout.to(torch.bfloat16))
    worst = 0.0
    pairs = [("out", y, y16), ("dx", x32.grad, x16.grad.float())]
    pairs += [(n, p.grad, q.grad.float()) for (n, p), q in zip(m32.named_parameters(),
                                                                m16.parameters())]
    for name, a, b in pairs:
        if a.dtype != b.dtype and name != "out":
            fail(f"autocast {form} {tape}: {name} gradient is {a.dtype}, expected {b.dtype}")
        if not torch.equal(a.float(), b.float()):
            fail(f"autocast {form} {tape} {attention}: {name} differs from the bf16 module's by "
                 f"{rel(a, b):.3g} (expected bit for bit: the same casts)")
        worst = max(worst, rel(a, b))
    return worst


def check_autocast():
    cases = [("laga", "laga", "eager", False), ("laga", "laga", "flash", True),
             ("explicit", "laga", "eager", True), ("ring_kv", "laga", "flash", False),
             ("laga_fused", "laga", "flash", False), ("absorbed", "autograd", "eager", False),
             ("laga", "autograd", "flash", True)]
    for c in cases:
        autocast_case(*c)
    return f"autocast(cpu, bf16): {len(cases)} cases bit for bit equal to the bf16 module"


def check_assign():
    c = cfg()
    torch.manual_seed(4)
    ref = lt.MLA(c, dtype=torch.float64)
    sd = {n: p.detach().clone() for n, p in ref.state_dict().items()}
    if "assign" not in inspect.signature(nn.Module.load_state_dict).parameters:
        try:
            lt.MLA(c).load_state_dict(sd, assign=True)
        except ValueError as e:
            if "torch 2.1" not in str(e) or torch.__version__ not in str(e):
                fail(f"assign=True on torch {torch.__version__}: the refusal names neither the "
                     f"torch it needs nor this one: {e}")
            return f"load_state_dict(assign=True): refused on torch {torch.__version__} ({e})"
        fail("assign=True on a torch without it was not refused")
    meta = lt.MLA(c, dtype=torch.float64, device="meta")
    meta.load_state_dict(sd, assign=True)
    for n, p in meta.named_parameters():
        if p.device.type != "cpu" or p.data_ptr() != sd[n].data_ptr():
            fail(f"assign=True: parameter {n} is not the state dict's tensor")
    x = torch.randn(B, S, c.dim, dtype=torch.float64)
    if not torch.equal(meta(x, seq_len=S), ref(x, seq_len=S)):
        fail("assign=True: the assigned module's output differs from the module's")
    # HF names with assign, as a loader from an HF checkpoint gives them
    meta = lt.MLA(c, dtype=torch.float64, device="meta")
    meta.load_state_dict({HF[n]: t for n, t in sd.items()}, assign=True)
    if not torch.equal(meta(x, seq_len=S), ref(x, seq_len=S)):
        fail("assign=True under HF names: output differs")
    return "load_state_dict(assign=True): the meta module takes the tensors, output bit for bit"


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = lt.MLA(cfg(), dtype=torch.float64)


class Outer(nn.Module):
    """A model with MLA where HF's DeepseekV3 puts its attention."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Layer() for _ in range(4))


def check_nested_names():
    torch.manual_seed(6)
    src = Outer()
    hf = {}
    for k, t in src.state_dict().items():
        head, name = k.split(".self_attn.")
        hf[f"{head}.self_attn.{HF[name]}"] = t.clone()
    dst = Outer()
    dst.load_state_dict(hf)  # strict: every key placed, none left over
    x = torch.randn(B, S, CFG["dim"], dtype=torch.float64)
    for i in range(4):
        a, b = src.model.layers[i].self_attn, dst.model.layers[i].self_attn
        if not torch.equal(a(x, seq_len=S), b(x, seq_len=S)):
            fail(f"HF names under model.layers.{i}.self_attn.: output differs")
    both = dict(src.state_dict())
    both["model.layers.2.self_attn.kv_b_proj.weight"] = both[
        "model.layers.2.self_attn.wkv_b.weight"]
    try:
        Outer().load_state_dict(both)
        fail("a parameter under its DeepSeek and HF names (nested) was loaded")
    except ValueError as e:
        if "kv_b_proj" not in str(e) or "wkv_b" not in str(e):
            fail(f"the two names' refusal names them not both: {e}")
    return "HF names as a submodule (model.layers.<i>.self_attn.): 4 layers bit for bit"


def check_compile():
    if not (hasattr(torch, "compile") and hasattr(torch.library, "custom_op")):
        return (f"torch.compile: not run: torch {torch.__version__} lacks "
                f"{'torch.compile' if not hasattr(torch, 'compile') else 'torch.library.custom_op'}"
                " (the opaque op needs torch 2.4+)")
    import torch._dynamo as dynamo
    t0 = time.time()
    explained = 0
    for form, tape, attention in [("laga", "laga", "eager"), ("ring_kv", "laga", "flash"),
                                  ("laga2d", "autograd", "eager"), ("laga_fused", "laga", "flash"),
                                  ("explicit", "autograd", "auto")]:
        m = lt.MLA(cfg(), form=form, tape=tape, attention=attention, dtype=torch.float64)
        x = torch.randn(B, S, CFG["dim"], dtype=torch.float64, requires_grad=True)
        ex = dynamo.explain(m)(x, seq_len=S)
        if ex.graph_break_count:
            fail(f"torch.compile: {ex.graph_break_count} graph breaks in MLA(form={form}, "
                 f"tape={tape}): " + "; ".join(b.reason[:120] for b in ex.break_reasons))
        explained += 1
        dynamo.reset()
    worst_runs, worst = 0, 0.0
    for tape, cu, amp in [("laga", None, False), ("autograd", [0, 4, 13], False),
                          ("laga", [0, 7, 13], True)]:
        torch.manual_seed(7)
        model = TinyLM(tape=tape, attention="flash", dtype=torch.float64)
        model = model.to(torch.float32 if amp else torch.float64)
        seq = tokens(8)
        inp, tgt = seq[:, :-1], seq[:, 1:]

        def step(fn):
            model.zero_grad()
            with torch.autocast("cpu", torch.bfloat16, enabled=amp):
                logits = fn(inp, cu_seqlens=cu)
            loss = loss_of(logits, tgt, tgt.numel())
            loss.backward()
            return loss.detach(), grads(model)
        l0, g0 = step(model)
        dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for _ in range(2):  # the second call reuses the graph
            l1, g1 = step(compiled)
            if not torch.equal(l0, l1):
                fail(f"compiled model (tape {tape}, cu_seqlens {cu}, autocast {amp}): loss "
                     f"{l1.item()} against eager {l0.item()}")
            for n in g0:  # (AOTAutograd's embedding backward sums in its own order)
                worst = max(worst, rel(g1[n], g0[n]))
                if rel(g1[n], g0[n]) > (1e-12 if not amp else 0.0):
                    fail(f"compiled model (tape {tape}): gradient {n} off by {rel(g1[n], g0[n])}")
        worst_runs += 1
        # the eager graph the op keeps for backward: gone after it, and
        # with the output when no backward runs (trainer.py's finalizer)
        import gc
        from laga_torch import trainer
        if trainer._GRAPHS:
            fail(f"compiled model: {len(trainer._GRAPHS)} graphs kept after backward")
        logits = compiled(inp, cu_seqlens=cu)
        if len(trainer._GRAPHS) != 2:
            fail(f"compiled model: {len(trainer._GRAPHS)} graphs kept by a forward of 2 blocks")
        del logits
        gc.collect()
        if trainer._GRAPHS:
            fail(f"compiled model: {len(trainer._GRAPHS)} graphs kept after the output was dropped")
        dynamo.reset()
    return (f"torch.compile: 0 graph breaks in {explained} forms' modules; fullgraph compile "
            f"(aot_eager) of a 2-layer model: loss bit for bit, gradients within {worst:.2g} "
            f"of eager in {worst_runs} runs "
            f"({time.time() - t0:.1f} s)")


def checkpointed_grads(model, inp, tgt, group, seq_len, own, ckpt):
    """Gradients of this rank's loss part, with each block checkpointed."""
    from torch.utils.checkpoint import checkpoint
    model.zero_grad()
    h = model.embed(inp)
    for blk in model.blocks:
        if ckpt:
            h = h + checkpoint(blk, h, group, None, seq_len, use_reentrant=False)
        else:
            h = h + blk(h, group=group, seq_len=seq_len)
    loss_of(model.head(h), tgt, B * seq_len).backward()
    return grads(model)


def check_checkpoint():
    torch.manual_seed(9)
    model = TinyLM().double()
    seq = tokens(10)
    a = checkpointed_grads(model, seq[:, :-1], seq[:, 1:], None, S, None, False)
    b = checkpointed_grads(model, seq[:, :-1], seq[:, 1:], None, S, None, True)
    for n in a:
        if not torch.equal(a[n], b[n]):
            fail(f"checkpointing: gradient {n} differs by {rel(b[n], a[n])}")
    return "activation checkpointing (P 1): every gradient bit for bit"


# --------------------------------------------------------------------------
# Ranks
# --------------------------------------------------------------------------

def one_rank_reference(model, seq, groups, r, dtype=torch.float64):
    """The whole sequence's gradients of the same model on a group of one."""
    model.zero_grad()
    logits = model(seq[:, :-1], group=groups[r], seq_len=S)
    loss_of(logits, seq[:, 1:], B * S).backward()
    return grads(model)


def worker_ranks(args):
    """P 4: sequence groups {0, 1} and {2, 3}; DDP, then FSDP2, over all 4."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    r, P = args.rank, args.world
    singles = [dist.new_group([i]) for i in range(P)]
    sp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    my_sp, sp_rank = sp[r // 2], r % 2
    own = lt.SpLayout.even(S, CFG["n_heads"], 2).positions(sp_rank)
    out = {}
    torch.manual_seed(11)
    model = TinyLM().double()
    seqs = [tokens(20), tokens(21)]  # one sequence per sequence group
    refs = [one_rank_reference(model, s, singles, r) for s in seqs]
    want = {n: (refs[0][n] + refs[1][n]) / 2 for n in refs[0]}  # data parallel: the mean
    seq = seqs[r // 2]
    inp, tgt = seq[:, :-1][:, own], seq[:, 1:][:, own]
    for hook in (None, lt.sum_over_sequence_ranks(dp_replicas=2)):
        ddp = DDP(model)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        model.zero_grad()
        loss_of(ddp(inp, group=my_sp, seq_len=S), tgt, B * S).backward()
        got = grads(model)
        key = "sum_hook" if hook else "ddp_default"
        out[key] = max(rel(got[n], want[n]) for n in want)
        out[key + "_half"] = max(rel(2 * got[n], want[n]) for n in want)
        del ddp
    # checkpointing at P 2, against the sequence's one-rank run
    g = checkpointed_grads(model, inp, tgt, my_sp, S, own, True)
    for n in g:
        dist.all_reduce(g[n], group=my_sp)
    out["checkpoint_p2"] = max(rel(g[n], refs[r // 2][n]) for n in g)
    out.update(fsdp(inp, tgt, my_sp, want))
    with open(os.path.join(args.dir, f"ranks-r{r}.json"), "w") as f:
        json.dump(out, f)


def fsdp(inp, tgt, my_sp, want):
    """FSDP2 (fully_shard) over all 4 ranks, the same composition as DDP's:
    sum over the sequence group, mean over the 2 replicas (divide factor 2,
    set on every FSDP module); its default divides by 4 (half the gradient)."""
    try:
        from torch.distributed.fsdp import fully_shard, FSDPModule
    except (ImportError, ValueError) as e:  # (1.13 under Python 3.11: a dataclass ValueError)
        return {"fsdp_missing": f"{type(e).__name__}: {e}"[:200]}
    out = {}
    for divide in (None, 2.0):
        torch.manual_seed(11)
        model = TinyLM().double()
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        if divide is not None:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(divide)
        loss_of(model(inp, group=my_sp, seq_len=S), tgt, B * S).backward()
        got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        key = "fsdp_sum" if divide else "fsdp_default"
        out[key] = max(rel(got[n], want[n]) for n in want)
        out[key + "_half"] = max(rel(2 * got[n], want[n]) for n in want)
    return out


def launch(args, what, P, timeout=150):
    run_ranks(__file__, [args.laga, args.dir, "--worker", what], P, timeout, fail,
              what=f"{what} ranks")
    return [json.load(open(os.path.join(args.dir, f"{what}-r{r}.json"))) for r in range(P)]


def main():
    args = parse_rank_args(worker_takes_value=True)
    if args.worker:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.rank, world_size=args.world)
        worker_ranks(args)
        end_ranks()
        return
    os.makedirs(args.dir, exist_ok=True)
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    for check in (check_autocast, check_assign, check_nested_names, check_checkpoint,
                  check_compile):
        t0 = time.time()
        print(f"{check()}  [{time.time() - t0:.1f} s]", flush=True)
    dist.destroy_process_group()

    t0 = time.time()
    res = launch(args, "ranks", 4)
    worst = max(x["sum_hook"] for x in res)
    if worst > 1e-12:
        fail(f"DDP with sum_over_sequence_ranks: gradients off by {worst:.3g} from the mean of the "
             "two sequences' whole-sequence gradients")
    if max(x["ddp_default_half"] for x in res) > 1e-12:
        fail("DDP's own averaging was expected to give half the gradient over a sequence group "
             "of 2; it gave something else (the docs' statement would be wrong)")
    ck = max(x["checkpoint_p2"] for x in res if "checkpoint_p2" in x)
    if ck > 1e-12:
        fail(f"checkpointing at P 2: gradients off by {ck:.3g} from the one-rank run")
    print(f"DDP (P 4: 2 sequence groups x 2 replicas): sum_over_sequence_ranks within {worst:.2g}; "
          f"DDP's default is half the gradient (2x within "
          f"{max(x['ddp_default_half'] for x in res):.2g}); checkpointing at P 2 within "
          f"{ck:.2g}  [{time.time() - t0:.1f} s]")

    if "fsdp_sum" not in res[0]:
        print(f"FSDP2: not run: torch {torch.__version__} has no "
              f"torch.distributed.fsdp.fully_shard ({res[0]['fsdp_missing']})")
    else:
        worst = max(x["fsdp_sum"] for x in res)
        if worst > 1e-12:
            fail(f"FSDP2 with gradient divide factor 2 (the replicas): gradients off by {worst:.3g}")
        if max(x["fsdp_default_half"] for x in res) > 1e-12:
            fail("FSDP2's default was expected to divide by all 4 ranks (half the gradient)")
        print(f"FSDP2 (P 4, gloo, set_gradient_divide_factor(2.0) on every FSDP module): within "
              f"{worst:.2g}; its default divides by 4 (half)")
    print("PASS")


if __name__ == "__main__":
    main()
