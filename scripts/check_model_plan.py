#!/usr/bin/env python3
"""Checks `laga plan --model`'s step time against `laga train` of the same
model on this machine (issue 28; docs/planning.md, "The model-level plan
against a measured step"): a small MoE model (docs/assets/moe_tiny.json by
default) at each P, experts folded onto the ranks (EP = P, `laga train
--expert-parallel`), ranks as threads sharing the cores.

  python3 scripts/check_model_plan.py [--laga build/laga] [--model FILE] [--seq 2048]
                                      [--sp 2,3,4] [--form laga] [--steps 12] [--rounds 3]

Each round measures the profile (`laga plan --measure --model`, every GEMM
and attention shape of the plans at every P timed, the layers' FFN and head
too), plans each P with it (`--dtype fp32`, the runs' precision), then
trains each P: a train run's step is its B S / tokens_per_s, the median over
its steps after the first --skip (JIT, first touches). A round's error is
its prediction against its own measurement, minutes apart at most, and the
reported error per P is the median round's, with the rounds' spread: a
virtual machine's host can slow every core by a fifth or more for seconds
to minutes without the guest seeing it, so a profile timed in one spell and
steps in another would measure the host, not the model.
"""
import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from machine_load import Others, cpu_model, uptime

HERE = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--laga", default="build/laga")
ap.add_argument("--model", default=os.path.join(HERE, "..", "docs", "assets", "moe_tiny.json"))
ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--sp", default="2,3,4")
ap.add_argument("--form", default="laga")
ap.add_argument("--steps", type=int, default=12, help="optimizer steps per train run")
ap.add_argument("--skip", type=int, default=2, help="first steps of a run left out of its median")
ap.add_argument("--rounds", type=int, default=3, help="train runs per P, alternating over the P")
args = ap.parse_args()
if args.steps <= args.skip:
    sys.exit(f"--steps {args.steps} leaves no step after --skip {args.skip}")
if args.rounds < 1:
    sys.exit(f"--rounds {args.rounds}: need at least 1")
sps = [int(p) for p in args.sp.split(",")]
tmp = tempfile.mkdtemp(prefix="laga_check_model_plan_")
atexit.register(shutil.rmtree, tmp, ignore_errors=True)


def laga(cmd):
    full = [args.laga] + cmd
    r = subprocess.run(full, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"{' '.join(full)} exited {r.returncode}: {r.stderr}")
    return r.stdout


print("before:", uptime())
others = Others()
profile = os.path.join(tmp, "this.json")
rounds = []  # per round {P: (predicted s, EP, measured s)}
for _ in range(args.rounds):
    laga(["plan", "--quiet", "--measure", profile, "--model", args.model, "--seq",
          str(args.seq), "--sp", args.sp, "--forms", args.form])
    this = {}
    for P in sps:
        out = os.path.join(tmp, f"plan-{P}.json")
        laga(["plan", "--quiet", "--profile", profile, "--dtype", "fp32", "--model", args.model,
              "--seq", str(args.seq), "--sp", str(P), "--forms", args.form, "--json", out])
        with open(out) as f:
            q = json.load(f)["plans"][0]
        log = os.path.join(tmp, f"train-{P}.jsonl")
        laga(["train", "--config", args.model, "--seq", str(args.seq), "--batch", "1", "--sp",
              str(P), "--steps", str(args.steps), "--form", args.form, "--attention", "flash",
              "--expert-parallel", "--log", log])
        with open(log) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        this[P] = (q["predicted_step_s"], q["ep"],
                   statistics.median([args.seq / r["tokens_per_s"] for r in lines[args.skip:]]))
    rounds.append(this)

cpu = cpu_model()
print(f"CPU: {cpu}; model {os.path.basename(args.model)}, S {args.seq}, form {args.form}, EP = P; "
      f"{args.steps} steps a run (median of steps {args.skip + 1}-{args.steps}), "
      f"{args.rounds} round(s)")
print(f"{'P':>3} {'EP':>3} {'predicted s':>12} {'measured s':>11} {'error':>8} "
      f"{'rounds: error min-max':>22}")
worst = 0.0
for P in sps:
    errs = sorted((100 * (r[P][0] - r[P][2]) / r[P][2], r[P]) for r in rounds)
    e, (p, ep, m) = errs[(len(errs) - 1) // 2]  # the median round (an even count: the lower)
    worst = max(worst, abs(e))
    print(f"{P:3d} {ep:3d} {p:12.4f} {m:11.4f} {e:+7.1f}% "
          f"{errs[0][0]:+10.1f}% to {errs[-1][0]:+.1f}%")
print(f"largest |error|: {worst:.1f}%")
print("after:", uptime())
print(others.report())
