#!/usr/bin/env python3
"""Times the GEMM and attention call shapes of a plan on a GPU with torch, and
writes a hardware profile whose measured_shapes cost `laga plan` call by call.

    laga plan --preset deepseek-v3 --seq 32768 --sp 8 --list-shapes shapes.json
    python3 scripts/time_shapes_torch.py shapes.json --base profiles/h200.json \\
        --out h200_measured.json [--dtype bf16] [--report report.json]
    laga plan --profile h200_measured.json --preset deepseek-v3 --seq 32768 --sp 8

`laga plan --list-shapes` lists every GEMM and attention call the plan's
forms issue, in the op counters' fields (docs/planning.md, "Timing a plan's
shapes on a GPU"). Each is timed here as one call on one device in `--dtype`
(bf16 by default, the precision the GPU profiles plan in; fp32 accumulation
as cuBLAS and torch's attention kernels do):

  GEMM       C (m x n, row stride ldc) = op(A) op(B) [+ C when accumulate],
             row-major as laga::gemm; A and B are strided views with the
             call's lda and ldb, so a call on a column block of a wider
             matrix reads the same rows it reads in laga; torch.mm (a fresh
             C, from the caching allocator) or C.addmm_ (accumulate).
  attention  torch's scaled_dot_product_attention on q (B, Hq, Sq, dqk),
             k (B, Hk, Sk, dqk), v (B, Hk, Sk, dv); causal as laga's kernels
             define it (row i of Sq sees keys [0, i + Sk - Sq], the mask's
             lower-right alignment); each backend torch has (cuDNN, flash,
             memory-efficient) is tried and the fastest that accepts the
             shape is kept, the math backend only where none does.
             forward: one call. backward: (forward + backward) - forward, the
             backward being autograd.grad of q, k, v given dO.

Timing: CUDA events around a loop of back-to-back calls lasting at least
--min-ms (after --warmup calls), the median of --repeats such loops, operands
rotated over enough copies to exceed twice the L2 cache (so each call reads
them from HBM, as a step does). Random normal operands (never zeros: they run
faster). The output profile is --base's with the description saying what was
timed and measured_shapes {"dtype", "gemm", "attention"} holding the seconds;
--report also writes, per shape, the backend and the FLOP/s the plan's own
count of the call's FLOPs gives at the measured time.
Needs a CUDA device (--device cpu checks the script on the CPU: the suite's
tools_plan_measure runs it so on Debian's torch 1.13, where attention has no
SDPA and only the GEMMs are timed).
"""

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

L2_BYTES = 64 << 20
DEVICE = "cuda"  # --device


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", help="`laga plan --list-shapes` output")
    ap.add_argument("--base", required=True, help="the profile whose device and links to keep")
    ap.add_argument("--out", required=True, help="the profile to write (refused if it exists)")
    ap.add_argument("--report", help="per-shape backend and FLOP/s, JSON (refused if it exists)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a check of this script on a machine without a GPU (host clock)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-ms", type=float, default=20.0)
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="stop timing after this many seconds; the shapes left are left out of "
                         "the profile (the plan costs them at the efficiency) and named in the "
                         "report")
    return ap.parse_args()


def copies_for(nbytes):
    """Operand sets to rotate over so that together they exceed twice L2."""
    return max(1, min(16, math.ceil(2 * L2_BYTES / max(nbytes, 1))))


class Clock:
    """CUDA events on a GPU (device work is asynchronous); the host clock on
    the CPU."""

    def __init__(self, device):
        self.cuda = device == "cuda"

    def ms(self, fn):
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)


def time_loop(call, n_sets, a):
    """Median seconds per call of call(i) (i: the operand set)."""
    clock = Clock(a.device)
    clock.ms(lambda: [call(i % n_sets) for i in range(a.warmup)])
    one_ms = max(clock.ms(lambda: call(0)), 1e-3)
    reps = max(1, min(10000, math.ceil(a.min_ms / one_ms)))
    samples = [clock.ms(lambda: [call(i % n_sets) for i in range(reps)]) / 1e3 / reps
               for _ in range(a.repeats)]
    return statistics.median(samples)


def strided(rows, cols, ld, dtype):
    """A (rows x cols) row-major view with row stride ld, over random storage."""
    base = torch.randn(rows * ld, device=DEVICE, dtype=torch.float32).to(dtype)
    return base.as_strided((rows, cols), (ld, 1))


def time_gemm(g, dtype, a):
    m, n, k = g["m"], g["n"], g["k"]
    a_rows, a_cols = (k, m) if g["trans_a"] else (m, k)
    b_rows, b_cols = (n, k) if g["trans_b"] else (k, n)
    nbytes = (a_rows * g["lda"] + b_rows * g["ldb"] + m * g["ldc"]) * torch.finfo(dtype).bits // 8
    sets = []
    for _ in range(copies_for(nbytes)):
        A, B = strided(a_rows, a_cols, g["lda"], dtype), strided(b_rows, b_cols, g["ldb"], dtype)
        C = strided(m, n, g["ldc"], dtype)
        sets.append((A.t() if g["trans_a"] else A, B.t() if g["trans_b"] else B, C))
    if g["accumulate"]:
        def call(i):
            A, B, C = sets[i]
            C.addmm_(A, B)
    else:
        def call(i):
            A, B, _ = sets[i]
            torch.mm(A, B)
    return time_loop(call, len(sets), a), "cublas"


BACKENDS = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"]


def causal_mask(Sq, Sk):
    """laga's causal rule: row i sees keys [0, i + Sk - Sq] (lower right)."""
    if Sq == Sk:
        return None, True
    try:
        from torch.nn.attention.bias import causal_lower_right
        return causal_lower_right(Sq, Sk), False
    except ImportError:
        i = torch.arange(Sq, device=DEVICE)[:, None]
        j = torch.arange(Sk, device=DEVICE)[None, :]
        return j <= i + (Sk - Sq), False


def time_attention(c, dtype, a):
    try:  # torch >= 2.3 chooses SDPA's backend this way
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None, f"torch {torch.__version__} has no torch.nn.attention (SDPA backends)"
    B, Sq, Sk, Hq, Hk, dqk, dv = (c[x] for x in ("B", "Sq", "Sk", "Hq", "Hk", "dqk", "dv"))
    backward = c["pass"] == "backward"
    mask, is_causal = causal_mask(Sq, Sk) if c["causal"] else (None, False)
    nbytes = (B * Sq * Hq * (dqk + dv) * 2 + B * Sk * Hk * (dqk + dv) * 2) * torch.finfo(dtype).bits // 8
    sets = []
    for _ in range(copies_for(nbytes)):
        q = torch.randn(B, Hq, Sq, dqk, device=DEVICE, dtype=dtype, requires_grad=backward)
        k = torch.randn(B, Hk, Sk, dqk, device=DEVICE, dtype=dtype, requires_grad=backward)
        v = torch.randn(B, Hk, Sk, dv, device=DEVICE, dtype=dtype, requires_grad=backward)
        do = torch.randn(B, Hq, Sq, dv, device=DEVICE, dtype=dtype)
        sets.append((q, k, v, do))
    gqa = {"enable_gqa": True} if Hk != Hq else {}

    def fwd(i):
        q, k, v, _ = sets[i]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=1.0 / math.sqrt(dqk), **gqa)

    def fwd_bwd(i):
        o = fwd(i)
        torch.autograd.grad(o, sets[i][:3], sets[i][3])

    # Each backend that takes the shape, timed on one call; then the fastest,
    # timed in full. The math backend (which holds the scores) only where no
    # other takes the shape and the scores fit in 8 GB.
    one = fwd_bwd if backward else fwd
    clock = Clock(a.device)
    names = BACKENDS + (["MATH"] if 4 * B * Hq * Sq * Sk <= 8 << 30 else [])
    probe = {}
    for name in names:
        if name == "MATH" and probe:
            break
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                one(0)
                probe[name] = clock.ms(lambda: one(1 % len(sets)))
        except (RuntimeError, TypeError):  # not this shape, or out of memory
            continue
    if not probe:
        return None, "no backend takes it"
    name = min(probe, key=probe.get)
    with sdpa_kernel([getattr(SDPBackend, name)]):
        tf = time_loop(fwd, len(sets), a)
        s = time_loop(fwd_bwd, len(sets), a) - tf if backward else tf
    return s, name


def main():
    a = parse_args()
    for path in (a.out, a.report):
        if path and os.path.exists(path):
            sys.exit(f"time_shapes_torch.py: {path} exists; give a new file (nothing is overwritten)")
    global DEVICE
    DEVICE = a.device
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("time_shapes_torch.py: no CUDA device; this script times shapes on a GPU "
                 "(--device cpu checks it on this machine)")
    name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU (a check of the script)"
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    with open(a.shapes) as f:
        shapes = json.load(f)
    with open(a.base) as f:
        profile = json.load(f)
    measured = {"dtype": a.dtype, "gemm": [], "attention": []}
    report = {"device": name, "torch": torch.__version__,
              "cuda": torch.version.cuda, "dtype": a.dtype, "gemm": [], "attention": []}
    fields = {"gemm": ("trans_a", "trans_b", "m", "n", "k", "lda", "ldb", "ldc", "accumulate"),
              "attention": ("kernel", "pass", "B", "Sq", "Sk", "Hq", "Hk", "dqk", "dv", "causal")}
    timers = {"gemm": time_gemm, "attention": time_attention}
    record = record_into(measured, report)
    print(f"timing {len(shapes['gemm'])} GEMM and {len(shapes['attention'])} attention shapes in "
          f"{a.dtype} on {name}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    t0, failed = time.monotonic(), None
    for kind in ("gemm", "attention"):
        for n, c in enumerate(shapes[kind]):
            shape = {f: c[f] for f in fields[kind]}
            if failed:
                s, backend = None, failed
            elif time.monotonic() - t0 > a.budget_s:
                s, backend = None, "budget spent"
            else:
                try:
                    s, backend = timers[kind](c, dtype, a)
                except Exception as e:  # a CUDA error is sticky: time nothing more
                    why = str(e).splitlines()[0]
                    s, backend = None, f"failed: {why}"
                    failed = f"not timed after a failure at {kind} {n + 1}: {why}"
            record(kind, n, len(shapes[kind]), shape, c, s, backend)
            if a.device == "cuda" and not failed:
                torch.cuda.empty_cache()
    write(a, profile, measured, report, name)


def record_into(measured, report):
    """record(kind, n, total, shape, listed, seconds, backend): one shape's
    result into the profile's shapes, the report and the log."""
    def record(kind, n, total, shape, c, s, backend):
        if s is None:  # not timed: the plan costs it at the efficiency
            report[kind].append(dict(shape, calls=c["calls"], seconds=None, backend=backend))
            print(f"{kind} {n + 1}/{total}: {shape} not timed: {backend}", flush=True)
            return
        rate = c["flops"] / c["calls"] / s  # the FLOPs the plan counts for one call
        measured[kind].append(dict(shape, seconds=s))
        report[kind].append(dict(shape, calls=c["calls"], seconds=s, backend=backend,
                                 tflops=rate / 1e12))
        print(f"{kind} {n + 1}/{total}: {shape} {s * 1e6:.1f} us {rate / 1e12:.1f} TFLOP/s "
              f"{backend}", flush=True)
    return record


def write(a, profile, measured, report, name):
    profile["description"] += (
        f"; measured_shapes: {a.dtype} times of this plan's calls on one "
        f"{name} (torch {report['torch']}, CUDA {report['cuda']}, "
        f"cuBLAS GEMMs, SDPA attention), {datetime.date.today().isoformat()}, "
        "scripts/time_shapes_torch.py")
    profile["measured_shapes"] = measured
    with open(a.out, "x") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    if a.report:
        with open(a.report, "x") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
