#!/usr/bin/env python3
"""The upfront memory check (issue 10 item 5): a job that cannot fit in what
the process may use is refused within 2 seconds, naming the predicted and the
available bytes and the knobs that lower the peak; one that fits runs. For
`laga train` (the model, its AdamW state and gradients): refused within 1
second, before any allocation (with --no-memory-check the same job fails at
its first allocation instead, naming that tensor).

  test_memory_check.py LAGA
"""
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

laga = sys.argv[1]
tmp_dir = tempfile.mkdtemp(prefix="laga_memory_check_")
LIMIT = 3 * 1024**3  # RLIMIT_AS: one of the three limits laga reads


def limited():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def run(args):
    t0 = time.monotonic()
    r = subprocess.run([laga] + args, capture_output=True, text=True, timeout=120,
                       preexec_fn=limited)
    return r, time.monotonic() - t0


failures = []
too_big = [
    ["compare", "--preset", "paper", "--seq", "8192", "--sp", "2", "--forms", "laga", "--quiet"],
    ["forward", "--preset", "paper", "--seq", "8192", "--sp", "2", "--form", "laga"],
    ["verify", "--preset", "paper", "--seq", "8192", "--sp", "2", "--forms", "laga"],
]
for args in too_big:
    r, secs = run(args)
    words = ["would need", "available", "RLIMIT_AS", "--sp", "--seq", "--attention flash",
             "--count-only", "--no-memory-check"]
    missing = [w for w in words if w not in r.stderr]
    if r.returncode != 2 or missing or secs > 2.0:
        failures.append(f"{' '.join(args[:1])}: rc {r.returncode} after {secs:.2f} s, missing "
                        f"{missing} in: {r.stderr.strip()[:300]}")

# train: 8 layers of D = 4096 with a 32000 vocabulary need about 42 GB.
BIG_TRAIN = ["train", "--d-model", "4096", "--heads", "32", "--layers", "8", "--vocab", "32000",
             "--seq", "4096", "--steps", "1", "--quiet"]
r, secs = run(BIG_TRAIN)
words = ["laga train would need", "available", "RLIMIT_AS", "--batch", "--seq",
         "--attention flash", "--layers", "--d-model", "--vocab", "mpirun", "--no-memory-check"]
missing = [w for w in words if w not in r.stderr]
if r.returncode != 2 or missing or secs > 1.0:
    failures.append(f"train: rc {r.returncode} after {secs:.2f} s, missing {missing} in: "
                    f"{r.stderr.strip()[:400]}")
# Bypassed, the job goes on to allocate and fails there: the check is what
# refused it above, not an allocation.
r, _ = run(BIG_TRAIN + ["--no-memory-check"])
if r.returncode != 2 or "would need" in r.stderr or "out of memory" not in r.stderr:
    failures.append(f"train --no-memory-check: rc {r.returncode}, wanted the allocation's own "
                    f"error: {r.stderr.strip()[:300]}")
r, _ = run(["train", "--d-model", "32", "--heads", "4", "--layers", "1", "--vocab", "64",
            "--seq", "16", "--steps", "2", "--quiet"])
if r.returncode != 0:
    failures.append(f"a small train under the limit failed: {r.stderr.strip()[:300]}")

# Fits: a small job under the same limit runs.
r, _ = run(["compare", "--preset", "tiny", "--seq", "64", "--sp", "2", "--steps", "1",
            "--warmup", "0", "--quiet"])
if r.returncode != 0:
    failures.append(f"a small compare under the limit failed: {r.stderr.strip()[:300]}")
# Count-only allocates nothing and is never refused.
r, _ = run(["compare", "--preset", "paper", "--seq", "8192", "--sp", "2", "--count-only",
            "--quiet"])
if r.returncode != 0:
    failures.append(f"count-only under the limit failed: {r.stderr.strip()[:300]}")

# Issue 54 item O: an MoE model's size is its routed experts, and the check
# says so. 10^6 experts took the check 3.6 GB and 12 s and, under a limit,
# failed blaming --seq/--batch/--vocab: refused now at once (laga train
# takes at most 16384 per layer). 16000 of moe_tiny's over --sp 2 need more
# than the limit for their parameters and moments alone: refused by the
# closed-form floor before the count-only prediction, naming the experts.
MOE_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                        "assets", "moe_tiny.json")
with open(MOE_TINY) as f:
    moe = json.load(f)
for experts, sp, must_say in [(1_000_000, 1, ["1000000 routed experts", "n_routed_experts"]),
                              (16_000, 2, ["routed experts hold", "n_routed_experts",
                                           "--expert-parallel", "would need", "available"])]:
    moe["n_routed_experts"] = experts
    cfg = os.path.join(tmp_dir, f"moe_{experts}.json")
    with open(cfg, "w") as f:
        json.dump(moe, f)
    r, secs = run(["train", "--config", cfg, "--seq", "16", "--sp", str(sp), "--steps", "1",
                   "--quiet"])
    missing = [w for w in must_say if w not in r.stderr]
    if r.returncode != 2 or missing or "--seq, --batch or --vocab" in r.stderr or secs > 2.0:
        failures.append(f"train, {experts} experts: rc {r.returncode} after {secs:.2f} s, "
                        f"missing {missing} in: {r.stderr.strip()[:500]}")

# Issue 54 item W: under a small address space (ulimit -v 200000) OpenBLAS's
# server threads, started when the library loads, retried their 128 MB
# buffers without end: every command, `laga --version` included, spun at
# 100% CPU and never exited. laga now runs itself again with one OpenBLAS
# thread under any address-space limit and raises the count only where the
# buffers fit (core/threads.hpp): each finishes at once, and count-only and
# plan, which allocate nothing large, succeed. (A real job this close to the
# limit can still fail inside oneDNN's or libgomp's own start-up, at times
# with a crash: docs/reliability.md, "Allocation failures".)
def small_address_space(kib):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (kib * 1024, kib * 1024))
    return limit


for kib in (200_000, 170_000):
    for args in [
            ["--version"], ["forms"],
            ["compare", "--count-only", "--preset", "tiny", "--seq", "64", "--sp", "1", "--quiet"],
            ["compare", "--count-only", "--preset", "tiny", "--seq", "64", "--sp", "2", "--quiet"],
            ["compare", "--count-only", "--preset", "deepseek-v3", "--seq", "4096", "--sp", "8",
             "--quiet"],
            ["plan", "--preset", "tiny", "--seq", "64", "--sp", "2", "--profile", "h100",
             "--quiet"]]:
        t0 = time.monotonic()
        try:
            r = subprocess.run([laga] + args, capture_output=True, text=True, timeout=30,
                               preexec_fn=small_address_space(kib))
        except subprocess.TimeoutExpired:
            failures.append(f"ulimit -v {kib}: laga {' '.join(args)} still running after 30 s")
            continue
        secs = time.monotonic() - t0
        if r.returncode != 0 or secs > 10:
            failures.append(f"ulimit -v {kib}: laga {' '.join(args)}: rc {r.returncode} after "
                            f"{secs:.1f} s: {r.stderr.strip()[-300:]}")

for m in failures:
    print("FAILED:", m)
sys.exit(1 if failures else 0)
