#!/usr/bin/env python3
"""`laga train --dp D` (issue 57: EP over DP against a measured run needs a
data-parallel run to measure) against the one-rank run of the same global
batch.

    test_train_dp.py LAGA SCRATCH [MPIEXEC]

D replicas each take B / D rows of every batch; the loss is the mean over
every replica's targets and the gradients are summed over every rank, so the
run is the one-rank run's math summed in another order. Held here, each
against `--sp 1` without --dp at the same --batch, over 3 steps:

  - a dense model at D 2 and 3, and the small MoE model (its expert bias
    balancing on) at D 2 and 3 with every expert on every rank, with
    --expert-parallel (EP over all the replicas) and at D 4 with --ep 2 (two
    EP groups of two replicas each): every step's loss within 1e-5 relative,
    its gradient norm within 1e-4, and every tensor of the final checkpoint
    (parameters, AdamW m and v) within 1e-4 of its largest element;
  - a checkpoint written at D 2 (step 2 of 4) resumed at D 2: steps 3 and 4
    bit for bit those of the uninterrupted run; resumed at D 1: within the
    tolerances above (dp is free to change);
  - under MPIEXEC (2 processes, --comm mpi) the D 2 MoE run with
    --expert-parallel bit for bit the 2 threads';
  - the refusals: a --batch D does not divide, --dp with --sp 2, --pp 2,
    --pack-eos, and an --ep that does not divide the ranks, each naming the
    option;
  - a token file with --val-data at D 2: every validation loss within 1e-6
    of one rank's.

Reading the same rows on every replica (a broken split) moves the losses by
about 1e-2 and fails the first check.
"""
import json
import math
import os
import shutil
import struct
import subprocess
import sys

laga, scratch = sys.argv[1], sys.argv[2]
mpiexec = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
here = os.path.dirname(os.path.abspath(__file__))
moe = os.path.join(here, "..", "..", "docs", "assets", "moe_tiny.json")
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
failures = []

DENSE = ["--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "256"]
MOE = ["--config", moe]
COMMON = ["--seq", "32", "--lr", "0.5", "--eps", "1", "--quiet", "--form", "explicit"]


def run(args, launcher=None, expect_ok=True):
    cmd = (launcher or []) + [laga, "train"] + args
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    if expect_ok and r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr}")
    return r


def train(name, model, extra, batch, steps=3, launcher=None, resume=None):
    """Runs it; returns (log lines, checkpoint directory)."""
    log = os.path.join(scratch, name + ".jsonl")
    ckpt = os.path.join(scratch, name + ".ckpt")
    args = model + COMMON + ["--batch", str(batch), "--steps", str(steps), "--log", log,
                             "--checkpoint", resume or ckpt] + extra
    if resume:
        args += ["--resume", resume]
    else:
        shutil.rmtree(ckpt, ignore_errors=True)
    run(args, launcher)
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()], resume or ckpt


def tensors(ckpt):
    """Every tensor of the checkpoint's latest safetensors file, as floats."""
    with open(os.path.join(ckpt, "latest.json")) as f:
        manifest = json.load(f)
    path = os.path.join(ckpt, manifest["file"])
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        assert v["dtype"] == "F32", (k, v["dtype"])
        a, b = v["data_offsets"]
        out[k] = struct.unpack(f"<{(b - a) // 4}f", data[8 + n + a:8 + n + b])
    return out


def close(what, ref, got, loss_rel=1e-6, norm_rel=1e-5, weight_rel=2e-5):
    (ref_log, ref_ckpt), (got_log, got_ckpt) = ref, got
    if [r["step"] for r in ref_log] != [r["step"] for r in got_log]:
        failures.append(f"{what}: steps {[r['step'] for r in got_log]}, want "
                        f"{[r['step'] for r in ref_log]}")
        return
    for a, b in zip(ref_log, got_log):
        if abs(a["loss"] - b["loss"]) > loss_rel * abs(a["loss"]):
            failures.append(f"{what}: step {a['step']} loss {b['loss']!r}, one rank "
                            f"{a['loss']!r}")
        if abs(a["grad_norm"] - b["grad_norm"]) > norm_rel * abs(a["grad_norm"]):
            failures.append(f"{what}: step {a['step']} grad_norm {b['grad_norm']!r}, one rank "
                            f"{a['grad_norm']!r}")
        if a["targets"] != b["targets"]:
            failures.append(f"{what}: step {a['step']} targets {b['targets']}, want "
                            f"{a['targets']}")
    ta, tb = tensors(ref_ckpt), tensors(got_ckpt)
    if sorted(ta) != sorted(tb):
        failures.append(f"{what}: the checkpoints hold different tensors")
        return
    worst = (0.0, "")
    for k in ta:
        scale = max(max(abs(x) for x in ta[k]), 1e-30)
        d = max(abs(x - y) for x, y in zip(ta[k], tb[k])) / scale
        if not math.isfinite(d) or d > worst[0]:
            worst = (d, k)
    if not worst[0] <= weight_rel:
        failures.append(f"{what}: final tensor {worst[1]} differs by {worst[0]:.3g} of its "
                        f"largest element (limit {weight_rel})")
    return worst


# Against one rank at the same global batch.
cases = [
    ("dense", DENSE, [], [2, 3], 6),
    ("moe", MOE, [], [2], 6),
    ("moe_ep", MOE, ["--expert-parallel"], [2, 3], 6),
    ("moe_ep2", MOE, ["--expert-parallel", "--ep", "2"], [4], 4),
]
refs = {}
for name, model, extra, dps, batch in cases:
    key = (tuple(model), batch)
    if key not in refs:
        refs[key] = train(f"ref_{len(refs)}", model, [], batch)
    for dp in dps:
        got = train(f"{name}_dp{dp}", model, ["--dp", str(dp)] + extra, batch)
        worst = close(f"{name} --dp {dp}", refs[key], got)
        if worst:
            print(f"{name} --dp {dp} {' '.join(extra)}: losses "
                  f"{[r['loss'] for r in got[0]]}; final tensors within "
                  f"{worst[0]:.2g} of their largest element ({worst[1]})")

# A token file and validation: each replica validates its own rows too.
tok = os.path.join(scratch, "tokens.u16")
with open(tok, "wb") as f:
    f.write(struct.pack("<4096H", *[(i * 7) % 200 for i in range(4096)]))
DATA = ["--data", tok, "--val-data", tok, "--val-every", "1"]
val_ref, _ = train("val_ref", MOE, DATA, 4, steps=2)
val_dp, _ = train("val_dp2", MOE, DATA + ["--dp", "2", "--expert-parallel"], 4, steps=2)
for a, b in zip(val_ref, val_dp):
    if abs(a["val_loss"] - b["val_loss"]) > 1e-6 * abs(a["val_loss"]):
        failures.append(f"--val-data at --dp 2: step {a['step']} val_loss {b['val_loss']!r}, "
                        f"one rank {a['val_loss']!r}")

# A checkpoint written at D 2, resumed at D 2 (bit for bit) and at D 1.
whole, _ = train("resume_whole", MOE, ["--dp", "2", "--expert-parallel"], 6, steps=4)
half, ckpt = train("resume_half", MOE, ["--dp", "2", "--expert-parallel", "--save-every", "2"],
                   6, steps=2)
keep = os.path.join(scratch, "resume_copy.ckpt")
shutil.copytree(ckpt, keep)
resumed, _ = train("resume_half", MOE, ["--dp", "2", "--expert-parallel"], 6, steps=4,
                   resume=ckpt)
if [(r["step"], r["loss"], r["grad_norm"]) for r in resumed] != \
        [(r["step"], r["loss"], r["grad_norm"]) for r in whole]:
    failures.append(f"resumed at --dp 2: {[(r['step'], r['loss']) for r in resumed]}, "
                    f"uninterrupted {[(r['step'], r['loss']) for r in whole]}")
log1 = os.path.join(scratch, "resume_dp1.jsonl")
shutil.copy(os.path.join(scratch, "resume_half.jsonl"), log1)
r = run(MOE + COMMON + ["--batch", "6", "--steps", "4", "--log", log1, "--checkpoint", keep,
                        "--resume", keep, "--expert-parallel"])
with open(log1) as f:
    at1 = [json.loads(line) for line in f if line.strip()]
if "dp: 2 -> (not used)" not in r.stderr and "dp: 2 -> 1" not in r.stderr:
    failures.append(f"resumed at --dp 1: no note that dp changed:\n{r.stderr}")
for a, b in zip(whole[2:], at1[2:]):
    if a["step"] != b["step"] or abs(a["loss"] - b["loss"]) > 1e-5 * abs(a["loss"]):
        failures.append(f"resumed at --dp 1: step {b['step']} loss {b['loss']!r}, at --dp 2 "
                        f"{a['loss']!r}")
if len(at1) != 4:
    failures.append(f"resumed at --dp 1: {len(at1)} log lines, want 4")

# MPI processes: bit for bit the threads.
if mpiexec:
    threads, _ = train("mpi_threads", MOE, ["--dp", "2", "--expert-parallel"], 6)
    procs, _ = train("mpi_procs", MOE, ["--dp", "2", "--expert-parallel", "--comm", "mpi"], 6,
                     launcher=[mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", "2"])
    if [(r["loss"], r["grad_norm"]) for r in threads] != \
            [(r["loss"], r["grad_norm"]) for r in procs]:
        failures.append(f"--dp 2 under MPI: {[r['loss'] for r in procs]}, as threads "
                        f"{[r['loss'] for r in threads]}")
    # Processes that are not --sp x --dp: refused, naming both.
    r = run(MOE + ["--seq", "32", "--steps", "1", "--quiet", "--batch", "2", "--dp", "2",
                   "--comm", "mpi"],
            launcher=[mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", "3"],
            expect_ok=False)
    if r.returncode == 0 or "3 MPI processes" not in r.stderr or "--dp" not in r.stderr:
        failures.append(f"--dp 2 under 3 MPI processes: exit {r.returncode}, want a refusal "
                        f"naming the 3 processes and --dp:\n{r.stderr}")

# The refusals, each naming what to change.
refusals = [
    (["--batch", "5", "--dp", "2"], "--batch 5 does not split over --dp 2"),
    (["--batch", "2", "--dp", "2", "--sp", "2"], "--dp with --sp > 1 is not built yet"),
    (["--batch", "2", "--dp", "2", "--pp", "2"], "--dp with --pp is not built yet"),
    (["--batch", "2", "--dp", "2", "--pack-eos", "0"], "--dp with --pack-eos is not built yet"),
    (["--batch", "2", "--dp", "2", "--expert-parallel", "--ep", "3"],
     "--ep 3 must divide the 2 ranks"),
]
for extra, want in refusals:
    r = run(MOE + ["--seq", "32", "--steps", "1", "--quiet"] + extra, expect_ok=False)
    if r.returncode == 0 or want not in r.stderr or "Traceback" in r.stderr:
        failures.append(f"{' '.join(extra)}: exit {r.returncode}, want a refusal saying "
                        f"'{want}':\n{r.stderr}")

if failures:
    sys.exit("FAILED:\n" + "\n".join(failures))
print("laga train --dp: ok" + (" (MPI at 2 processes too)" if mpiexec else ""))
