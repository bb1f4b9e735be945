#!/usr/bin/env python3
"""Checks `laga plan --model --pp`'s step against `laga train --pp` of the same
model on this machine (issue 57; docs/planning.md, "The pipelined plan against
a measured step"): the small MoE model (docs/assets/moe_tiny.json with
--layers layers, 4 by default so that 4 stages hold a layer each), its stages
as the plan places them, ranks as threads (--comm local) or MPI processes
(--mpi), M micro-batches of one sequence each.

  python3 scripts/check_pipeline_plan.py [--laga build/laga] [--layers 4] [--seq 1024]
      [--pp 2,3,4] [--micro-batches 4] [--steps 6] [--skip 2] [--rounds 3] [--mpi]
      [--cores N] [--markdown]

Each round measures the profile (`laga plan --measure --model`, the layers'
shapes at P 1, one thread), plans each PP with it (`--dtype fp32 --sp 1
--batch 1 --micro-batches M --schedule 1f1b-lockstep`: laga train's own
schedule, and --schedule 1f1b for reference: the asynchronous 1F1B's
formula), then trains each PP (`--batch M --micro-batches M`): a run's step
is B S / tokens_per_s, the median over its steps after the first --skip. A
round's error is its prediction against its own measurement; the error per
PP is the median round's, with the rounds' spread (as check_model_plan.py
does, for the same reason: a shared host's speed drifts between spells).
--max-error E exits 1 when the median round's |error| at some PP is above E
percent (the default, 0, only reports).

Beside the step, the work: the plan's compute of every stage, M (F + B)
summed over the stages (its per-stage pass times), against the CPU seconds
the run's processes spent a step (getrusage of the children: a run of
--steps less a run of --skip steps, over their difference). A busy machine
stretches the step (the ranks wait for cores) but hardly the CPU time, so
where the step cannot be measured cleanly the work still can.

--cores N pins this script and every run it starts to the last N cores of
its CPU affinity (sched_setaffinity): laga then sees N cores (hardware_cores
reads the affinity), the profile says shared_cores N and the stages share
those. On a machine others are using, the scheduler moves their work to the
other cores, so the measured cores are quieter than the machine.
"""
import argparse
import atexit
import json
import os
import resource
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
ap.add_argument("--layers", type=int, default=4, help="the model's layers (num_hidden_layers)")
ap.add_argument("--seq", type=int, default=1024)
ap.add_argument("--pp", default="2,3,4")
ap.add_argument("--micro-batches", type=int, default=4)
ap.add_argument("--steps", type=int, default=6, help="optimizer steps per train run")
ap.add_argument("--skip", type=int, default=2, help="first steps of a run left out of its median")
ap.add_argument("--rounds", type=int, default=3, help="train runs per PP, alternating over the PP")
ap.add_argument("--mpi", action="store_true", help="the stages as MPI processes (mpiexec)")
ap.add_argument("--mpiexec", default="mpiexec")
ap.add_argument("--max-error", type=float, default=0.0,
                help="exit 1 if some PP's median-round |error| is above this percent (0: report)")
ap.add_argument("--cores", type=int, default=0,
                help="run on the last N cores of this process's affinity (0: all of them)")
ap.add_argument("--markdown", action="store_true", help="the table as docs/planning.md has it")
args = ap.parse_args()
if args.steps <= args.skip:
    sys.exit(f"--steps {args.steps} leaves no step after --skip {args.skip}")
if args.rounds < 1 or args.micro_batches < 1 or args.layers < 1:
    sys.exit("--rounds, --micro-batches and --layers must each be at least 1")
if args.cores:
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= args.cores <= len(allowed):
        sys.exit(f"--cores {args.cores}: this process may run on {len(allowed)} core(s)")
    os.sched_setaffinity(0, allowed[-args.cores:])
pps = [int(p) for p in args.pp.split(",")]
if any(p < 2 or p > args.layers for p in pps):
    sys.exit(f"--pp {args.pp}: each must be between 2 and --layers {args.layers}")
tmp = tempfile.mkdtemp(prefix="laga_check_pipeline_plan_")
atexit.register(shutil.rmtree, tmp, ignore_errors=True)
with open(args.model) as f:
    config = json.load(f)
config["num_hidden_layers"] = args.layers
model = os.path.join(tmp, "model.json")
with open(model, "w") as f:
    json.dump(config, f)
M = args.micro_batches


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr}")
    return r.stdout


def laga(cmd):
    return run([args.laga] + cmd)


def plan(profile, pp, schedule):
    out = os.path.join(tmp, f"plan-{pp}-{schedule}.json")
    laga(["plan", "--quiet", "--profile", profile, "--dtype", "fp32", "--model", model, "--seq",
          str(args.seq), "--sp", "1", "--pp", str(pp), "--micro-batches", str(M), "--schedule",
          schedule, "--forms", "explicit", "--json", out])
    with open(out) as f:
        return json.load(f)["plans"][0]


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def train(pp):
    """The median step of a run of --steps, and its CPU seconds a step."""
    log = os.path.join(tmp, f"train-{pp}.jsonl")
    cpu = []
    for steps in (args.steps, args.skip):
        if os.path.exists(log):
            os.remove(log)
        cmd = [args.laga, "train", "--config", model, "--seq", str(args.seq), "--batch", str(M),
               "--micro-batches", str(M), "--pp", str(pp), "--steps", str(steps), "--form",
               "explicit", "--attention", "flash", "--quiet", "--log", log]
        if args.mpi:
            # --bind-to none: Open MPI binds 2 processes to a core each by
            # default, which would undo --cores.
            cmd = [args.mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                   "-np", str(pp)] + cmd + ["--comm", "mpi"]
        c0 = children_cpu()
        run(cmd)
        cpu.append(children_cpu() - c0)
        if steps == args.steps:
            with open(log) as f:
                lines = [json.loads(line) for line in f if line.strip()]
            step = statistics.median([M * args.seq / r["tokens_per_s"]
                                      for r in lines[args.skip:]])
    return step, (cpu[0] - cpu[1]) / (args.steps - args.skip)


def work(plan):
    """The plan's compute a step over every stage: M (F + B) each."""
    return sum(M * (st["forward_s"] + st["backward_s"]) for st in plan["stages"])


print("before:", uptime())
others = Others()
profile = os.path.join(tmp, "this.json")
rounds = []  # per round {PP: (lockstep plan, 1f1b plan, measured s, CPU s a step)}
for _ in range(args.rounds):
    laga(["plan", "--quiet", "--measure", profile, "--model", model, "--seq", str(args.seq),
          "--sp", "1", "--forms", "explicit"])
    this = {}
    for pp in pps:
        lock, formula = plan(profile, pp, "1f1b-lockstep"), plan(profile, pp, "1f1b")
        this[pp] = (lock, formula) + train(pp)
    rounds.append(this)

ranks = "MPI processes" if args.mpi else "threads"
ranks += f" on core(s) {sorted(os.sched_getaffinity(0))}"
print(f"CPU: {cpu_model()}; {os.path.basename(args.model)} at {args.layers} layers, S {args.seq}, "
      f"M {M} micro-batches of 1 sequence, stages as {ranks}; {args.steps} steps a run (median "
      f"of steps {args.skip + 1}-{args.steps}), {args.rounds} round(s)")
rows = []
worst = 0.0
for pp in pps:
    errs = sorted((100 * (r[pp][0]["predicted_step_s"] - r[pp][2]) / r[pp][2], r[pp])
                  for r in rounds)
    e, (lock, formula, measured, cpu) = errs[(len(errs) - 1) // 2]  # the median round
    worst = max(worst, abs(e))
    f_err = 100 * (formula["predicted_step_s"] - measured) / measured
    w = work(lock)
    rows.append((pp, lock["predicted_step_s"], lock["seconds"]["bubble"],
                 formula["predicted_step_s"], f_err, measured, e, errs[0][0], errs[-1][0], w, cpu,
                 100 * (w - cpu) / cpu))
if args.markdown:
    print("| PP | predicted s (1f1b-lockstep) | of it bubble s | 1F1B formula s (error) "
          "| measured s | error | rounds: error min-max | plan's work s | run's CPU s | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pp, p, bub, f, fe, m, e, lo, hi, w, c, we in rows:
        print(f"| {pp} | {p:.4f} | {bub:.4f} | {f:.4f} ({fe:+.1f}%) | {m:.4f} | {e:+.1f}% "
              f"| {lo:+.1f}% to {hi:+.1f}% | {w:.4f} | {c:.4f} | {we:+.1f}% |")
else:
    print(f"{'PP':>3} {'predicted s':>12} {'bubble s':>9} {'1F1B formula s':>15} {'measured s':>11} "
          f"{'error':>8} {'rounds: error min-max':>22} {'work s':>8} {'CPU s':>8} {'error':>7}")
    for pp, p, bub, f, fe, m, e, lo, hi, w, c, we in rows:
        print(f"{pp:3d} {p:12.4f} {bub:9.4f} {f:8.4f} ({fe:+5.1f}%) {m:11.4f} {e:+7.1f}% "
              f"{lo:+10.1f}% to {hi:+.1f}% {w:8.4f} {c:8.4f} {we:+6.1f}%")
print(f"largest |error|: {worst:.1f}%")
print("after:", uptime())
print(others.report())
if args.max_error > 0 and worst > args.max_error:
    sys.exit(f"the plan is off by {worst:.1f}% at some PP, above --max-error {args.max_error}")
