#!/usr/bin/env python3
"""Attention forward+backward at DeepSeek-V3's head dims on one GPU (issue 53
item 5; scripts/gpu_check_torch.sh runs it; docs/pytorch_triton.md "On a
GPU (not run)").

  bench_torch_gpu.py --out DIR [--seqs 4096,8192,16384,32768] [--heads 16]
                     [--batch 1] [--dry]

Two tables, each row timed as forward + backward (one loss.backward of a
fixed random dO), median of --reps after --warmup, the kernels alternating
within each repetition so that clocks and thermals hit them alike:
  1. attention kernels on the per-head forms' call: q (B, S, H, 192), k (B, S,
     H, 192), v (B, S, H, 128), causal, bf16: torch SDPA under each
     torch.nn.attention.sdpa_kernel backend alone (FLASH_ATTENTION needs equal
     head dims: its refusal is recorded, not hidden), FlexAttention (compiled,
     a causal block mask), and the package's laga_torch.attention.attention
     for each kind in --package-kinds (default sdpa; the hook for issue 53
     item 1's dispatch: a new kind, e.g. auto, is timed by naming it). TFLOP/s
     counts causal work: forward S^2/2 H (2 dqk + 2 dv) B, backward S^2/2 H (6
     dqk + 4 dv) B (the recomputed scores, dP, dV, dQ, dK) -- the convention
     of FlashAttention's benchmarks.
  2. laga_fused's Triton kernel (laga_torch.fused_triton) against unfused
     laga (K, V up-projected from the latent by torch, then the best SDPA
     backend of table 1, autograd through both) and explicit (K, V given, as
     a rank that received them holds them; SDPA): time and peak memory
     (torch.cuda.max_memory_allocated over the call, less what was allocated
     before it) at C 512, the same heads and S.
Writes DIR/bench_torch_gpu.json (every row, the device, driver, torch,
triton, CUDA, the command) and DIR/bench_torch_gpu.md (the tables for
docs/performance.md). A kernel that fails (unsupported shape, out of memory)
is a row with its error, never a missing row.

--dry: on the CPU, tiny shapes (S 32, 64; H 2; 8+4/8 over C 16; fp32), the
Triton kernel under TRITON_INTERPRET=1: checks that the script runs end to
end; its times mean nothing.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

if "--dry" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit decorates: before the import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def flops(B, S, H, dqk, dv):
    """Causal forward + backward FLOPs (the docstring's convention)."""
    half = B * H * S * S / 2
    return half * (2 * dqk + 2 * dv) + half * (6 * dqk + 4 * dv)


def timed(fns, dev, warmup, reps):
    """{name: (median s, error)} of each fn(), alternating within each rep."""
    errors, times = {}, {n: [] for n in fns}
    for i in range(warmup + reps):
        for n, fn in fns.items():
            if n in errors:
                continue
            try:
                sync(dev)
                t = time.perf_counter()
                fn()
                sync(dev)
                if i >= warmup:
                    times[n].append(time.perf_counter() - t)
            except Exception as e:  # a kernel that cannot run this shape: its row says why
                errors[n] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return {n: (statistics.median(times[n]) if n not in errors else None, errors.get(n))
            for n in fns}


def peak(fn, dev):
    """Peak bytes allocated over fn() beyond what was allocated before it."""
    if dev.type != "cuda":
        fn()
        return None
    sync(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    sync(dev)
    return torch.cuda.max_memory_allocated(dev) - base


def sdpa_backends():
    from torch.nn.attention import SDPBackend
    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
    return {n: getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)}


def attention_kernels(B, S, H, dqk, dv, dtype, dev, package_kinds):
    """{name: fn} each running forward + backward of causal attention."""
    from torch.nn.attention import sdpa_kernel
    g = torch.Generator(device=dev).manual_seed(5)
    q = torch.randn(B, H, S, dqk, device=dev, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(B, H, S, dqk, device=dev, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(B, H, S, dv, device=dev, dtype=dtype, generator=g).requires_grad_()
    do = torch.randn(B, H, S, dv, device=dev, dtype=dtype, generator=g)
    scale = dqk ** -0.5
    fns = {}

    def clear():
        q.grad = k.grad = v.grad = None

    for name, backend in sdpa_backends().items():
        if name == "MATH" and S > 8192:
            continue  # S x S scores in memory: not a training kernel at these S
        def run(backend=backend):
            clear()
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            o.backward(do)
        fns[f"sdpa {name.lower()}"] = run
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, S, S,
                                 device=str(dev))

        def run_flex():
            clear()
            flex(q, k, v, block_mask=mask, scale=scale).backward(do)
        fns["flex_attention"] = run_flex
    except Exception as e:
        err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        fns["flex_attention"] = lambda err=err: (_ for _ in ()).throw(RuntimeError(err))
    # The package's own entry point, per kind (issue 53 item 1's dispatch
    # hook: name its kind in --package-kinds). It takes (B, S, H, d) and a
    # mask callable: "mask" a (B, 1, S, S) bool, "ranges" KeyRanges.
    from laga_torch.attention import KeyRanges, attention
    qp, kp, vp = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    dop = do.transpose(1, 2)
    rows = torch.arange(S, device=dev)
    lo = torch.zeros(B, S, dtype=torch.long, device=dev)
    hi = (rows + 1)[None].expand(B, -1).contiguous()

    def mask(what):
        if what == "ranges":
            return KeyRanges(lo, hi)
        return (rows[None, :] <= rows[:, None])[None, None].expand(B, 1, S, S)

    for kind in package_kinds:
        def run_pkg(kind=kind):
            qp.grad = kp.grad = vp.grad = None
            attention(qp, kp, vp, mask, scale, kind).backward(dop)
        fns[f"laga_torch attention kind={kind}"] = run_pkg
    return fns


def fused_rows(B, S, H, dn, dr, dv, C, dtype, dev, best_backend):
    """{name: fn} for laga_fused's Triton kernel, unfused laga and explicit."""
    from types import SimpleNamespace
    from laga_torch import fused, fused_triton
    from laga_torch.attention import KeyRanges
    from torch.nn.attention import sdpa_kernel
    cfg = SimpleNamespace(kv_lora_rank=C, qk_nope_head_dim=dn, qk_rope_head_dim=dr,
                          v_head_dim=dv)
    g = torch.Generator(device=dev).manual_seed(6)
    q = torch.randn(B, S, H, dn + dr, device=dev, dtype=dtype, generator=g).requires_grad_()
    lat = torch.randn(B, S, C + dr, device=dev, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(H * (dn + dv), C, device=dev, dtype=dtype, generator=g) / C ** 0.5)
    w.requires_grad_()
    do = torch.randn(B, S, H, dv, device=dev, dtype=dtype, generator=g)
    rows = torch.arange(S, device=dev)
    kr = KeyRanges(torch.zeros(B, S, dtype=torch.long, device=dev),
                   (rows + 1)[None].expand(B, -1).contiguous())
    scale = (dn + dr) ** -0.5
    with torch.no_grad():  # explicit's K, V: made once, held as a rank that received them
        k_e, v_e = fused.up_project(lat, w, cfg)
        k_e, v_e = k_e.to(dtype).transpose(1, 2).contiguous(), v_e.to(dtype).transpose(1, 2)
        v_e = v_e.contiguous()
    k_e.requires_grad_()
    v_e.requires_grad_()
    backends = [best_backend] if best_backend is not None else list(sdpa_backends().values())

    def clear():
        q.grad = lat.grad = w.grad = k_e.grad = v_e.grad = None

    def triton():
        clear()
        o, lse = fused_triton.forward(q.detach(), lat.detach(), w.detach(), kr, scale, cfg)
        fused_triton.backward(q.detach(), lat.detach(), w.detach(), o, lse, do, kr, scale, cfg)

    def laga():
        clear()
        k, v = fused.up_project(lat, w, cfg)
        with sdpa_kernel(backends):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.to(dtype).transpose(1, 2),
                                               v.to(dtype).transpose(1, 2), is_causal=True,
                                               scale=scale)
        o.transpose(1, 2).backward(do)

    def explicit():
        clear()
        with sdpa_kernel(backends):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k_e, v_e, is_causal=True,
                                               scale=scale)
        o.transpose(1, 2).backward(do)

    return {"laga_fused triton": triton, "laga (up-projection + sdpa)": laga,
            "explicit (sdpa on held K, V)": explicit}


def env_info(dev):
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(dev),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs", default="4096,8192,16384,32768")
    ap.add_argument("--heads", type=int, default=16, help="16: DeepSeek-V3's 128 at P 8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--package-kinds", default="sdpa")
    ap.add_argument("--dry", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.dry:
        dev, dtype = torch.device("cpu"), torch.float32
        seqs, H, (dn, dr, dv, C) = [32, 64], 2, (8, 4, 8, 16)
        a.warmup, a.reps = 1, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_torch_gpu.py: no CUDA device (use --dry for the CPU check)")
        dev, dtype = torch.device("cuda:0"), torch.bfloat16
        seqs, H, (dn, dr, dv, C) = [int(s) for s in a.seqs.split(",")], a.heads, (128, 64, 128,
                                                                                    512)
    dqk, B = dn + dr, a.batch
    kinds = [k for k in a.package_kinds.split(",") if k]
    rows = []
    for S in seqs:
        fns = attention_kernels(B, S, H, dqk, dv, dtype, dev, kinds)
        res = timed(fns, dev, a.warmup, a.reps)
        fl = flops(B, S, H, dqk, dv)
        best, best_t = None, None
        for name, (t, err) in res.items():
            rows.append({"table": "kernels", "S": S, "H": H, "B": B, "dqk": dqk, "dv": dv,
                         "dtype": str(dtype)[6:], "kernel": name, "ms": t and t * 1e3,
                         "tflops": t and fl / t / 1e12, "error": err})
            if t and name.startswith("sdpa ") and (best_t is None or t < best_t):
                best, best_t = name[5:].upper(), t
            print(f"S {S} {name}: " + (f"{t * 1e3:.2f} ms, {fl / t / 1e12:.1f} TFLOP/s"
                                       if t else err), flush=True)
        del fns
        backend = sdpa_backends().get(best) if best else None
        fused = fused_rows(B, S, H, dn, dr, dv, C, dtype, dev, backend)
        res = timed(fused, dev, a.warmup, a.reps)
        for name, fn in fused.items():
            t, err = res[name]
            p = None
            if err is None:
                try:
                    p = peak(fn, dev)
                except Exception as e:
                    err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append({"table": "fused", "S": S, "H": H, "B": B, "C": C, "dqk": dqk, "dv": dv,
                         "dtype": str(dtype)[6:], "kernel": name, "sdpa_backend": best,
                         "ms": t and t * 1e3, "tflops": t and fl / t / 1e12,
                         "peak_bytes": p, "error": err})
            print(f"S {S} {name}: " + (f"{t * 1e3:.2f} ms, peak {p}" if t else err), flush=True)
        del fused
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        write(a.out, dev, a.dry, rows)  # after each S: a run cut short keeps what it measured


def write(out, dev, dry, rows):
    info = env_info(dev)
    info["dry"] = dry
    with open(os.path.join(out, "bench_torch_gpu.json"), "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "bench_torch_gpu.md"), "w") as f:
        f.write(f"{info}\n\n| table | S | kernel | ms | TFLOP/s | peak MiB | note |\n"
                "|---|---|---|---|---|---|---|\n")
        for r in rows:
            ms, tf, pk = r["ms"], r["tflops"], r.get("peak_bytes")
            f.write(f"| {r['table']} | {r['S']} | {r['kernel']} | "
                    f"{'' if ms is None else f'{ms:.2f}'} | {'' if tf is None else f'{tf:.1f}'} | "
                    f"{'' if pk is None else f'{pk / 2**20:.0f}'} | {r['error'] or ''} |\n")
    print(f"bench_torch_gpu.py: {len(rows)} rows, {sum(r['error'] is not None for r in rows)} "
          f"with errors; wrote {out}/bench_torch_gpu.json and .md")


if __name__ == "__main__":
    main()
