#!/usr/bin/env python3
"""Smoke test of laga_bench: the harness, every benchmark at --quick shapes,
and the PyTorch peers of `block --torch` and `block_bf16 --torch` (bf16
autocast).

Checks what a run prints, not how fast it is: every table row has a #wrong
of 0 (a kernel that regresses shows up here as well as in its unit test),
the laga/PyTorch table lists the three block forms with a finite speedup,
and a PyTorch peer that cannot start ends the run with an error naming it.
usage: test_bench.py LAGA_BENCH PYTHON_WITH_TORCH
"""
import re
import subprocess
import sys

def run(args, expect_ok=True):
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if expect_ok and p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(args)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def check_no_wrong(out, what):
    """The rows of the main tables (those with a %peak): op -> #wrong, all 0."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("  ") and "%" in line:
            fields = line.split()
            rows[fields[0]] = fields[-1]
            # gemm_bf16's layout conversions (reorder_w*, cvt_w) compute no
            # product and its accumulating rows (bf16_acc) hold n products at
            # the end: the bench marks them n/a; every other row is checked.
            unchecked = any(t in fields[0] for t in ("/reorder_w", "/cvt_w", "/bf16_acc"))
            if fields[-1] != "0" and not (unchecked and fields[-1] == "n/a"):
                sys.exit(f"FAIL: {what}: #wrong is {fields[-1]}, not 0, in\n{line}")
    if not rows:
        sys.exit(f"FAIL: {what}: no table rows in\n{out}")
    return rows


def main():
    bench, python = sys.argv[1], sys.argv[2]
    # Every benchmark at --quick shapes; the GEMM ones on one case (wkv_b's
    # product): each of their cases runs the same code on another shape, and
    # all of them took 43 of the run's 57 s here. block and block_bf16 run
    # once each, with their PyTorch peers, below (they ran here as well until
    # 2026-12-07: the same rows twice).
    out = run([bench, "attention", "packed", "flash_bf16", "--quick", "--repeats", "1",
               "--warmup", "0"]).stdout
    out += run([bench, "gemm", "gemm_bf16", "--quick", "--case", "wkv_b", "--repeats", "1",
                "--warmup", "0"]).stdout
    ops = set(check_no_wrong(out, "laga_bench --quick"))

    block_out = run([bench, "block", "--quick", "--torch", "--python", python, "--repeats", "2",
                     "--warmup", "0"]).stdout
    ops |= set(check_no_wrong(block_out, "laga_bench block --quick --torch"))
    for want in ("attn_flash_fwd+bwd", "attn_eager_bwd", "attn_flash_fwd+bwd/bf16",
                 "fwd_nt/onednn", "dx_nn/openblas",
                 "dw_tn/laga", "block_explicit",
                 "block_absorbed", "block_laga"):
        if want not in ops:
            sys.exit(f"FAIL: laga_bench --quick printed no {want} row:\n{out}{block_out}")
    out = block_out
    # "block" is a whole benchmark's name: it selects that one, not block_bf16 too.
    if "# ---- block: " not in out or "# ---- block_bf16" in out:
        sys.exit(f"FAIL: laga_bench block ran other benchmarks than block:\n{out}")
    speedups = re.findall(r"^  (block_\w+)\s.*\s([0-9.]+)x$", out, re.M)
    if sorted(op for op, _ in speedups) != ["block_absorbed", "block_explicit", "block_laga"]:
        sys.exit(f"FAIL: block --torch: expected one speedup per form, got {speedups}\n{out}")
    if not all(float(x) > 0 for _, x in speedups):
        sys.exit(f"FAIL: block --torch: non-positive speedup in {speedups}")
    if out.count("speedup per adjacent pair: median") != 3:
        sys.exit(f"FAIL: block --torch: no per-pair speedup line per form\n{out}")

    # block_bf16 --torch: the PyTorch peer under CPU bf16 autocast, one ratio
    # line per form against laga's bf16 step.
    out = run([bench, "block_bf16", "--quick", "--torch", "--python", python, "--repeats", "2",
               "--warmup", "0"]).stdout
    check_no_wrong(out, "laga_bench block_bf16 --quick --torch")
    if "torch.autocast" not in out or out.count("laga bf16 over it per round: median") != 3:
        sys.exit(f"FAIL: block_bf16 --torch: no autocast peer line per form\n{out}")

    p = run([bench, "block", "--quick", "--torch", "--python", "/nonexistent/python3",
             "--repeats", "1", "--warmup", "0"], expect_ok=False)
    if p.returncode == 0 or "/nonexistent/python3" not in p.stderr + p.stdout:
        sys.exit(f"FAIL: a PyTorch peer that cannot start must fail the run naming it; "
                 f"exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    print("laga_bench smoke test passed")


if __name__ == "__main__":
    main()
