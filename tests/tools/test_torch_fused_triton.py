#!/usr/bin/env python3
"""laga_fused's Triton kernel (python/laga_torch/fused_triton.py) under
Triton's CPU interpreter (TRITON_INTERPRET=1; torch 2 and triton from
build/torch2-venv: scripts/setup_torch2.sh, registered TORCH2_ONLY).

Usage: test_torch_fused_triton.py LAGA WORKDIR [--sp 1,2,3,4] [--device cpu|cuda]
       [--backend gloo|nccl] [--kernels-only | --module-only]

1. The kernel alone (fused_triton.forward / backward) on packed documents,
   a later shard's query rows (Sq < Sk, uneven), a row that sees no key,
   head dims 8+4/6 over a latent of 10 (not powers of two: padded tiles,
   masked), and DeepSeek-V3's 128+64/128 (the 192 split, not padded to
   256), tiles of 16 so that each shape spans several, against
     * autograd through an eager composition in float64 (up-projection, the
       masked S x S softmax, P V): o, lse, dq, d lat, d w within 1e-12
       relative in float64 (this holds the backward: an independent
       derivation, not fused.py's hand-written one); and fp32 within
       FP32_BOUND of it;
     * fused.py's torch code (the reference and fallback) in float64, 1e-12.
   And kernel_for's choice: Triton here for float32 and float64, torch for
   a non-finite operand and for LAGA_FUSED_KERNEL=torch, an unknown
   LAGA_FUSED_KERNEL refused naming it.
2. MLA(form="laga_fused", attention="flash") with the Triton kernel at P
   1-4 (gloo ranks as processes; S 13 uneven over P, H 5 and 3 uneven, a
   rank without heads, packed documents, the zigzag layout, q_latent with
   overlap, and 192/128 head dims; float32 and autograd's tape for the
   cases F32_CASES and AUTOGRAD_CASES name), on laga's tape and autograd's: out, dx
   and every gradient within 1e-12 relative of `laga forward --form
   laga_fused --attention flash --backward --dtype float64` in float64,
   within FP32_BOUND in float32, and within 1e-12 of the package's own laga
   (torch, float64) at the same P. Each run counts the Triton kernel's
   forward and backward calls: a run that fell back to torch fails.
A finite-difference check is not meaningful in fp32; the float64 runs are
the backward's check (the C++ float64 backward has its own finite-difference
tests, tests/mla/test_grad_check.cpp).

fp32 bound: FP32_BOUND = 1e-5 relative per tensor (|diff| / max |ref|), the
package's float32 bound against the C++ (test_torch_package.py TOLS): the
kernel's fp32 dots are full precision ("ieee"), so its error is fp32's
rounding over sums of at most C or S terms (measured: printed).
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.path.join(HERE, "..", "..", "python")
sys.path.insert(0, PY)
sys.path.insert(0, HERE)

if "--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] == "cpu":
    # Read by triton.jit when laga_torch.fused_triton is imported: before any import.
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import safetensors_io  # noqa: E402
import torch_package_common as tp  # noqa: E402  (tools_torch_package's cases, layout, assembly)
from torch_ranks import end_ranks, free_port  # noqa: E402

F64_BOUND, FP32_BOUND = 1e-12, 1e-5
# 192/128: DeepSeek-V3's head dims over a small latent and model.
WIDE = {"dim": 32, "n_heads": 3, "kv_lora_rank": 24, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "q_lora_rank": 0, "max_seq_len": 32}
CONFIGS = dict(tp.CONFIGS, wide=WIDE)


def cases():
    out = [c for c in tp.cases() if c["form"] == "laga_fused"]
    out.append({"id": "wide-laga_fused", "cfg": "wide", "form": "laga_fused", "opts": {},
                "docs": None})
    return out


def rel(a, ref):
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return float("inf")
    s = float(ref.abs().max()) if ref.numel() else 0.0
    d = float((a - ref).abs().max()) if a.numel() else 0.0
    return d / s if s > 0 else d


# --------------------------------------------------------------------------
# 1. The kernel alone
# --------------------------------------------------------------------------

def eager_reference(q, lat, w, lo, hi, scale, cfg):
    """o, lse and autograd's dq, d lat, d w of an eager composition in
    float64: K, V up-projected for every key, the masked S x S softmax."""
    from laga_torch.fused import up_project
    q, lat, w = (t.detach().double().requires_grad_() for t in (q, lat, w))
    k, v = up_project(lat, w, cfg)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    j = torch.arange(lat.shape[1])
    see = ((j >= lo[:, :, None]) & (j < hi[:, :, None]))[:, None]  # (B, 1, Sq, Sk)
    s = s.masked_fill(~see, float("-inf"))
    sees = see.any(-1, keepdim=True)
    lse = torch.where(sees[..., 0], torch.logsumexp(s, -1), torch.zeros(()).double())
    p = torch.where(sees, torch.softmax(torch.where(sees, s, torch.zeros(()).double()), -1)
                    * see, torch.zeros(()).double())
    o = torch.einsum("bhij,bjhd->bihd", p, v)
    return o, lse, (q, lat, w)


def kernels():
    import laga_torch.fused as fused
    from laga_torch import fused_triton
    from laga_torch.attention import KeyRanges
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(53)
    worst = {"float64": 0.0, "float32": 0.0, "torch": 0.0}
    shapes = [  # (what, B, Sq, Sk, nh, C, dn, dr, dv, docs, no_key_row)
        ("packed, 8+4/6 over C 10", 2, 40, 40, 3, 10, 8, 4, 6, [[0, 13, 29], [0, 7]], False),
        ("a later shard's rows (Sq 17 of Sk 40), packed", 2, 17, 40, 2, 10, 8, 4, 6,
         [[0, 5, 30], [0, 26]], False),
        ("a row that sees no key", 1, 20, 20, 2, 16, 8, 4, 8, [[0]], True),
        ("192/128 (128+64 / 128) over C 24", 1, 33, 33, 2, 24, 128, 64, 128, [[0, 20]],
         False)]
    for what, B, Sq, Sk, nh, C, dn, dr, dv, docs, no_key in shapes:
        cfg = SimpleNamespace(kv_lora_rank=C, qk_nope_head_dim=dn, qk_rope_head_dim=dr,
                              v_head_dim=dv)
        q = torch.randn(B, Sq, nh, dn + dr, generator=g, dtype=torch.float64)
        lat = torch.randn(B, Sk, C + dr, generator=g, dtype=torch.float64)
        w = torch.randn(nh * (dn + dv), C, generator=g, dtype=torch.float64) / C ** 0.5
        do = torch.randn(B, Sq, nh, dv, generator=g, dtype=torch.float64)
        rows = torch.arange(Sk - Sq, Sk)
        start = torch.zeros(B, Sk, dtype=torch.long)
        for b, d in enumerate(docs):
            for s0 in d:
                start[b, s0:] = s0
        lo, hi = start[:, rows].contiguous(), (rows + 1)[None].expand(B, -1).contiguous()
        if no_key:
            hi = hi.clone()
            hi[:, 0] = lo[:, 0]  # row 0 sees [0, 0): nothing
        kr = KeyRanges(lo, hi)
        scale = (dn + dr) ** -0.5
        o_ref, lse_ref, leaves = eager_reference(q, lat, w, lo, hi, scale, cfg)
        ref = [o_ref.detach(), lse_ref.detach()] + list(
            torch.autograd.grad(o_ref, leaves, do))
        names = ["o", "lse", "dq", "d lat", "d w"]
        for dt in (torch.float64, torch.float32):
            args = [t.to(dt) for t in (q, lat, w)]
            if fused.kernel_for(*args) is not fused.FusedKernel.triton:
                sys.exit(f"FAIL: kernel_for chose {fused.kernel_for(*args)} for {dt} under "
                         "TRITON_INTERPRET=1, not triton")
            o, lse = fused_triton.forward(*args, kr, scale, cfg)
            got = [o, lse] + list(fused_triton.backward(*args, o, lse, do.to(dt), kr, scale, cfg))
            bound = F64_BOUND if dt == torch.float64 else FP32_BOUND
            for n, a, r in zip(names, got, ref):
                if a.dtype != dt:  # lse too: fp32 for float32, float64 for float64
                    sys.exit(f"FAIL: kernel {what}: {n} is {a.dtype} for {dt} operands")
                e = rel(a, r)
                worst[str(dt)[6:]] = max(worst[str(dt)[6:]], e)
                if not e <= bound:
                    sys.exit(f"FAIL: kernel {what} {dt}: {n} differs from autograd through "
                             f"the eager float64 composition by {e:.3e} relative (> {bound})")
            if no_key and not (torch.all(o[:, 0] == 0) and torch.all(lse[:, :, 0] == 0)):
                sys.exit(f"FAIL: kernel {what}: the row that sees no key has o or lse != 0")
            if dt == torch.float64:  # fused.py's torch code: the reference and fallback
                os.environ["LAGA_FUSED_KERNEL"] = "torch"
                o_t, lse_t = fused.forward(*args, kr, scale, 16, cfg)
                mine = [o_t, lse_t] + list(fused.backward(*args, o_t, lse_t, do, kr, scale, 16,
                                                          cfg))
                del os.environ["LAGA_FUSED_KERNEL"]
                for n, a, r in zip(names, got, mine):
                    e = rel(a, r)
                    worst["torch"] = max(worst["torch"], e)
                    if not e <= F64_BOUND:
                        sys.exit(f"FAIL: kernel {what}: {n} differs from fused.py's torch code "
                                 f"by {e:.3e} relative (> {F64_BOUND})")
    # The choice.
    x = torch.ones(1, 2, 1, 3)
    y = x.clone()
    y[0, 1, 0, 2] = float("nan")
    if fused.kernel_for(y) is not fused.FusedKernel.torch:
        sys.exit("FAIL: kernel_for: a NaN operand did not go to the torch code")
    os.environ["LAGA_FUSED_KERNEL"] = "torch"
    if fused.kernel_for(x) is not fused.FusedKernel.torch:
        sys.exit("FAIL: kernel_for: LAGA_FUSED_KERNEL=torch did not choose torch")
    os.environ["LAGA_FUSED_KERNEL"] = "cuda-please"
    try:
        fused.kernel_for(x)
        sys.exit("FAIL: kernel_for: LAGA_FUSED_KERNEL=cuda-please was accepted")
    except ValueError as e:
        if "LAGA_FUSED_KERNEL='cuda-please'" not in str(e) or "triton" not in str(e):
            sys.exit(f"FAIL: kernel_for: the refusal does not name the variable and values: {e}")
    del os.environ["LAGA_FUSED_KERNEL"]
    print(f"fused_triton kernels ({len(shapes)} shapes): float64 within {worst['float64']:.2e} "
          f"of autograd (bound {F64_BOUND}), float32 within {worst['float32']:.2e} (bound "
          f"{FP32_BOUND}), float64 within {worst['torch']:.2e} of fused.py's torch code")


# --------------------------------------------------------------------------
# 2. The module at P 1-4 against the C++ form
# --------------------------------------------------------------------------

RUNS = [("f64", torch.float64, "laga"), ("f32", torch.float32, "laga"),
        ("f64-autograd", torch.float64, "autograd")]
# The interpreter is slow (about 0.1-1 s a kernel call here): float64 on
# laga's tape for every case, float32 and autograd's tape for a few.
F32_CASES = {"rq7-laga_fused", "wide-laga_fused", "rq7-laga_fused-packed"}
AUTOGRAD_CASES = {"rq7-laga_fused-packed", "rq7-laga_fused-q-latent-overlap"}


def runs(case):
    return [r for r in RUNS if r[0] == "f64" or (r[0] == "f32" and case["id"] in F32_CASES) or
            (r[0] == "f64-autograd" and case["id"] in AUTOGRAD_CASES)]


def worker(args):
    import torch.distributed as dist
    import laga_torch as lt
    from laga_torch import fused_triton
    torch.set_num_threads(1)
    calls = {"forward": 0, "backward": 0}
    for name in calls:  # count the Triton kernel's calls (fused.py and tape.py call these)
        def counted(*a, _f=getattr(fused_triton, name), _n=name, **k):
            calls[_n] += 1
            return _f(*a, **k)
        setattr(fused_triton, name, counted)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.world)
    dev = torch.device(args.device if args.device == "cpu" else f"cuda:{args.rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NCCL: one device per rank
    P, r = args.world, args.rank
    inp, _ = safetensors_io.load_file(os.path.join(args.dir, "input.safetensors"))
    for case in cases():
        own = tp.shard(lt, P, r, tp.seq_layout(case))
        w, _ = safetensors_io.load_file(
            os.path.join(args.dir, f"weights-{case['cfg']}.safetensors"))
        for tag, dtype, tape in runs(case) + [("f64-laga", torch.float64, "laga")]:
            form = "laga" if tag == "f64-laga" else "laga_fused"
            m = lt.MLA(lt.MLAConfig.from_json(CONFIGS[case["cfg"]]), form=form,
                       attention="flash", tape=tape, dtype=dtype, device=dev,
                       flash_block=tp.FLASH_BLOCK, **case["opts"])
            m.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
            x = torch.from_numpy(inp["x-" + case["cfg"]]).to(dev, dtype)[:, own].clone()
            x.requires_grad_()
            dout = torch.from_numpy(inp["dout-" + case["cfg"]]).to(dev, dtype)[:, own]
            before = dict(calls)
            out = m(x, cu_seqlens=case["docs"], seq_len=tp.S)
            out.backward(dout)
            heads = lt.SpLayout.even(tp.S, CONFIGS[case["cfg"]]["n_heads"], P,
                                     tp.seq_layout(case)).head_count[r]
            ran = {n: calls[n] - before[n] for n in calls}
            # On CUDA float64 takes fused.py's torch code (kernel_for): no Triton call expected.
            triton = dev.type == "cpu" or dtype != torch.float64
            if form == "laga_fused" and heads and triton and (ran["forward"] < 1 or
                                                              ran["backward"] < 1):
                sys.exit(f"FAIL: {case['id']} P {P} {tag}: rank {r} ran the Triton kernel "
                         f"{ran} times (forward, backward): laga_fused fell back to torch")
            res = {"out": out.detach(), "dx": x.grad}
            for n, p in m.named_parameters():
                res["grad." + n] = p.grad
            safetensors_io.save_file({k: v.cpu().numpy() for k, v in res.items()}, os.path.join(
                args.dir, f"torch-{tag}-{case['id']}-P{P}-r{r}.safetensors"))
    with open(os.path.join(args.dir, f"calls-P{P}-r{r}.json"), "w") as f:
        json.dump(calls, f)
    end_ranks()


def module(args, sps):
    import laga_torch as lt
    g = torch.Generator().manual_seed(24)
    inp = {}
    for name, cfg in CONFIGS.items():
        with open(os.path.join(args.dir, f"{name}.json"), "w") as f:
            json.dump(cfg, f)
        m = lt.MLA(lt.MLAConfig.from_json(cfg), dtype=torch.float64)
        w = {}
        for n, p in m.named_parameters():
            t = torch.randn(p.shape, generator=g, dtype=torch.float64)
            w[n] = (1 + 0.1 * t if "norm" in n else t / p.shape[-1] ** 0.5).numpy()
        safetensors_io.save_file(w, os.path.join(args.dir, f"weights-{name}.safetensors"))
        for k in ("x", "dout"):
            inp[f"{k}-{name}"] = torch.randn(tp.B, tp.S, cfg["dim"], generator=g,
                                             dtype=torch.float64).numpy()
        safetensors_io.save_file({k[:-len(name) - 1]: v for k, v in inp.items()
                                  if k.endswith("-" + name)},
                                 os.path.join(args.dir, f"input-{name}.safetensors"))
    safetensors_io.save_file(inp, os.path.join(args.dir, "input.safetensors"))
    for P in sps:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, args.laga, args.dir, "--worker",
                                   "--rank", str(rk), "--world", str(P), "--port", str(port),
                                   "--device", args.device, "--backend", args.backend],
                                  env=dict(os.environ, OMP_NUM_THREADS="1")) for rk in range(P)]
        try:
            t_start = time.time()
            for p in procs:
                p.wait(timeout=max(1, 240 - (time.time() - t_start)))
        except subprocess.TimeoutExpired:
            sys.exit(f"FAIL: torch ranks at P {P} ran past 240 s")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(p.returncode for p in procs):
            sys.exit(f"FAIL: torch ranks at P {P} exited {[p.returncode for p in procs]}")
    worst = {"f64": 0.0, "f32": 0.0, "f64-autograd": 0.0, "laga": 0.0}
    for P in sps:
        for case in cases():
            ref_path = os.path.join(args.dir, f"cxx-{case['id']}-P{P}.safetensors")
            cmd = [args.laga, "forward", "--config", os.path.join(args.dir, case["cfg"] + ".json"),
                   "--weights", os.path.join(args.dir, f"weights-{case['cfg']}.safetensors"),
                   "--input", os.path.join(args.dir, f"input-{case['cfg']}.safetensors"),
                   "--backward", "--dtype", "float64", "--sp", str(P), "--attention", "flash",
                   "--output", ref_path] + tp.cxx_flags(case)
            if case["docs"]:
                cmd += ["--doc-lens", "/".join(",".join(str(e - s) for s, e in zip(d, d[1:]))
                                               for d in case["docs"])]
            tp.run(cmd)
            ref, _ = safetensors_io.load_file(ref_path)
            laga = tp.assemble(lt, args.dir, "f64-laga", case, P)
            for tag, _, _ in runs(case):
                mine = tp.assemble(lt, args.dir, tag, case, P)
                if set(mine) != set(ref):
                    sys.exit(f"FAIL: {case['id']} P {P} {tag}: torch gives {sorted(mine)}, C++ "
                             f"{sorted(ref)}")
                bound = FP32_BOUND if tag == "f32" else F64_BOUND
                for k in ref:
                    for what, other, key in (("the C++ form", ref, tag),
                                             ("the package's laga", laga, "laga")):
                        if key == "laga" and tag == "f32":
                            continue
                        e = tp.rel(mine[k].astype(np.float64), other[k].astype(np.float64))
                        worst[key] = max(worst[key], e)
                        if not e <= bound:
                            sys.exit(f"FAIL: {case['id']} P {P} {tag}: {k} differs from {what} "
                                     f"by {e:.3e} relative (> {bound})")
    calls = [json.load(open(os.path.join(args.dir, f"calls-P{P}-r{r}.json")))
             for P in sps for r in range(P)]
    print(f"MLA(form='laga_fused') on the Triton kernel, {len(cases())} cases at P {sps}, "
          f"{sum(c['forward'] for c in calls)} kernel forwards and "
          f"{sum(c['backward'] for c in calls)} backwards: against laga forward --dtype float64 "
          f"float64 within {worst['f64']:.2e} (laga's tape), {worst['f64-autograd']:.2e} "
          f"(autograd's), float32 within {worst['f32']:.2e}; float64 within "
          f"{worst['laga']:.2e} of the package's laga")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("laga", nargs="?")
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--sp", default="1,2,3,4")
    ap.add_argument("--kernels-only", action="store_true")
    ap.add_argument("--module-only", action="store_true")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    from laga_torch import fused_triton
    if not fused_triton.importable():
        sys.exit(f"FAIL: triton is not importable under {sys.executable} (torch "
                 f"{torch.__version__}): run scripts/setup_torch2.sh and use build/torch2-venv")
    if args.worker:
        return worker(args)
    t0 = time.time()
    if args.device == "cpu" and not args.module_only:
        kernels()
    t1 = time.time()
    if not args.kernels_only:
        os.makedirs(args.dir, exist_ok=True)
        module(args, [int(p) for p in args.sp.split(",")])
    print(f"test_torch_fused_triton: kernels {t1 - t0:.1f} s, module {time.time() - t1:.1f} s "
          f"(torch {torch.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})")


if __name__ == "__main__":
    main()
