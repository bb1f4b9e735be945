#!/usr/bin/env python3
"""Checks `laga plan --model`'s step time against `laga train` of the same
model on this machine (issue 28; docs/planning.md, "The model-level plan
against a measured step"): a small MoE model (docs/assets/moe_tiny.json by
default) at each P, experts folded onto the ranks (EP = P, `laga train
--expert-parallel`), ranks as threads sharing the cores.

  python3 scripts/check_model_plan.py [--laga build/laga] [--model FILE] [--seq 2048]
                                      [--sp 2,3,4] [--form laga] [--steps 12] [--rounds 3]
                                      [--dp 2,3,4 [--ep all|N]] [--mpi] [--cores N]
                                      [--markdown] [--max-error E]

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

--dp D,... checks EP over the data-parallel replicas instead (issue 57;
docs/planning.md, "EP over the data-parallel replicas against a measured
step"): each case is --sp 1 --dp D, one sequence a replica (`laga plan
--batch 1 --dp D --ep N` against `laga train --batch D --dp D
--expert-parallel --ep N`), the experts spread over EP = N consecutive
replicas: --ep all (the default) N = D, every replica; --ep N a fixed N
dividing every D. --mpi runs the ranks as MPI processes (mpiexec, --bind-to
none) rather than threads; --cores N pins this script and every run to the
last N cores of its affinity (as scripts/check_pipeline_plan.py does).
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
ap.add_argument("--dp", default="", help="data-parallel replicas to check at --sp 1 (EP over DP)")
ap.add_argument("--ep", default="all", help="with --dp: all (EP = D) or a fixed EP degree N")
ap.add_argument("--form", default="laga")
ap.add_argument("--steps", type=int, default=12, help="optimizer steps per train run")
ap.add_argument("--skip", type=int, default=2, help="first steps of a run left out of its median")
ap.add_argument("--rounds", type=int, default=3, help="train runs per P, alternating over the P")
ap.add_argument("--mpi", action="store_true", help="the ranks as MPI processes (mpiexec)")
ap.add_argument("--mpiexec", default="mpiexec")
ap.add_argument("--cores", type=int, default=0,
                help="run on the last N cores of this process's affinity (0: all of them)")
ap.add_argument("--markdown", action="store_true", help="the table as docs/planning.md has it")
ap.add_argument("--max-error", type=float, default=0.0,
                help="exit 1 if some case's median-round |error| is above this percent (0: report)")
args = ap.parse_args()
if args.steps <= args.skip:
    sys.exit(f"--steps {args.steps} leaves no step after --skip {args.skip}")
if args.rounds < 1:
    sys.exit(f"--rounds {args.rounds}: need at least 1")
if args.cores:
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= args.cores <= len(allowed):
        sys.exit(f"--cores {args.cores}: this process may run on {len(allowed)} core(s)")
    os.sched_setaffinity(0, allowed[-args.cores:])
# The cases: (P, D, EP); EP 0 is the plan's default (EP = P) and train's.
if args.dp:
    dps = [int(d) for d in args.dp.split(",")]
    if args.ep != "all" and any(d % int(args.ep) for d in dps):
        sys.exit(f"--ep {args.ep} must divide every --dp {args.dp}")
    cases = [(1, d, d if args.ep == "all" else int(args.ep)) for d in dps]
else:
    cases = [(int(p), 1, 0) for p in args.sp.split(",")]
tmp = tempfile.mkdtemp(prefix="laga_check_model_plan_")
atexit.register(shutil.rmtree, tmp, ignore_errors=True)


def laga(cmd, launcher=None):
    full = (launcher or []) + [args.laga] + cmd
    r = subprocess.run(full, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"{' '.join(full)} exited {r.returncode}: {r.stderr}")
    return r.stdout


def parallel(P, D, ep):
    """The options a case gives both laga plan and laga train."""
    out = ["--sp", str(P)]
    if D > 1:
        out += ["--dp", str(D)]
    if ep:
        out += ["--ep", str(ep)]
    return out


print("before:", uptime())
others = Others()
profile = os.path.join(tmp, "this.json")
rounds = []  # per round {case: (plan, measured s)}
for _ in range(args.rounds):
    # Every case's shapes (the EP degree sets the experts' GEMMs).
    for P, D, ep in cases:
        laga(["plan", "--quiet", "--measure", profile + f".{P}-{D}", "--model", args.model,
              "--seq", str(args.seq), "--forms", args.form] + parallel(P, D, ep))
    this = {}
    for case in cases:
        P, D, ep = case
        out = os.path.join(tmp, f"plan-{P}-{D}.json")
        laga(["plan", "--quiet", "--profile", profile + f".{P}-{D}", "--dtype", "fp32",
              "--model", args.model, "--seq", str(args.seq), "--batch", "1", "--forms",
              args.form, "--json", out] + parallel(P, D, ep))
        with open(out) as f:
            q = json.load(f)["plans"][0]
        log = os.path.join(tmp, f"train-{P}-{D}.jsonl")
        if os.path.exists(log):
            os.remove(log)
        launcher = None
        cmd = ["train", "--config", args.model, "--seq", str(args.seq), "--batch", str(D),
               "--steps", str(args.steps), "--form", args.form, "--attention", "flash",
               "--expert-parallel", "--quiet", "--log", log] + parallel(P, D, ep)
        if args.mpi:
            # --bind-to none: Open MPI binds 2 processes to a core each by
            # default, which would undo --cores.
            launcher = [args.mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to",
                        "none", "-np", str(P * D)]
            cmd += ["--comm", "mpi"]
        laga(cmd, launcher)
        with open(log) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        this[case] = (q, statistics.median([D * args.seq / r["tokens_per_s"]
                                            for r in lines[args.skip:]]))
    rounds.append(this)

ranks = "MPI processes" if args.mpi else "threads"
ranks += f" on core(s) {sorted(os.sched_getaffinity(0))}"
what = (f"EP over DP ({'EP = D' if args.ep == 'all' else 'EP ' + args.ep}), one sequence a "
        f"replica" if args.dp else "EP = P")
print(f"CPU: {cpu_model()}; model {os.path.basename(args.model)}, S {args.seq}, form {args.form}, "
      f"{what}, ranks as {ranks}; {args.steps} steps a run (median of steps {args.skip + 1}-"
      f"{args.steps}), {args.rounds} round(s)")
rows = []
worst = 0.0
for case in cases:
    errs = sorted((100 * (r[case][0]["predicted_step_s"] - r[case][1]) / r[case][1], r[case])
                  for r in rounds)
    e, (q, m) = errs[(len(errs) - 1) // 2]  # the median round (an even count: the lower)
    worst = max(worst, abs(e))
    rows.append((case, q, m, e, errs[0][0], errs[-1][0]))
if args.markdown:
    print("| P | DP | EP | predicted s | of it attention, FFN, MoE all-to-all, gradient sync s "
          "| measured s | error | rounds: error min-max |")
    print("|---|---|---|---|---|---|---|---|")
    for (P, D, _), q, m, e, lo, hi in rows:
        s = q["seconds"]
        print(f"| {P} | {D} | {q['ep']} | {q['predicted_step_s']:.4f} | {s['attention']:.4f}, "
              f"{s['ffn']:.4f}, {s['moe_a2a']:.4f}, {s['grad_sync']:.4f} | {m:.4f} | {e:+.1f}% "
              f"| {lo:+.1f}% to {hi:+.1f}% |")
else:
    print(f"{'P':>3} {'DP':>3} {'EP':>3} {'predicted s':>12} {'measured s':>11} {'error':>8} "
          f"{'rounds: error min-max':>22}")
    for (P, D, _), q, m, e, lo, hi in rows:
        print(f"{P:3d} {D:3d} {q['ep']:3d} {q['predicted_step_s']:12.4f} {m:11.4f} {e:+7.1f}% "
              f"{lo:+10.1f}% to {hi:+.1f}%")
print(f"largest |error|: {worst:.1f}%")
print("after:", uptime())
print(others.report())
if args.max_error > 0 and worst > args.max_error:
    sys.exit(f"the plan is off by {worst:.1f}% in some case, above --max-error {args.max_error}")
