#!/usr/bin/env python3
"""Checks `laga plan`'s time model against measurement on this machine
(issue 13): `laga compare --link` at P 2 by default (--sp; ranks as threads sharing the cores)
at bandwidths spanning the laga/explicit crossover, beside `laga plan
--profile this --link` for the same, with the % error per form, where
that error lies (the time in collectives and the rest), and the crossover
bandwidth predicted and measured (docs/planning.md, "Checking the model").

  python3 scripts/check_plan.py [--laga build/laga] [--seq 1024] [--latency-us 1000] [--rounds N]
                                [--bandwidths GBPS,...] [--config FILE] [--overlap both]

Without --config it writes a model whose latent is wide against its heads
(C = 256, 4 heads of dqk 32, dv 16), so laga sends more bytes than explicit
but issues fewer collectives: explicit wins on slow links, laga on fast
ones, and the crossover lies where the link model can be timed. Without
--bandwidths it takes 4 around the predicted crossover (1/6, 1/2.5, 2.5x and
6x). With --overlap both (the default) laga+overlap runs and is planned
beside laga: the plan replays each rank's collectives and waits as a
timeline, so what overlap hides is predicted too. The profile of this machine is measured once (laga plan --measure, with
the same model, S, P and forms, so every GEMM and attention shape the plans
cost is timed). The load average (`uptime`) is printed before and after: on
a shared machine, measured times mean little when it is above the 2 ranks'.
With --rounds N the whole check runs N times: each round measures the
profile afresh, plans and runs `laga compare` at every bandwidth, and its
error is its prediction against its own measurement; each row is the round
with the median error, beside the rounds' spread of errors. A virtual
machine's host can slow its cores' memory and caches by a fifth or more for
seconds to minutes without the guest seeing another process: a profile
timed in one spell and steps in another would measure the host, and one
such spell is one round of N, not the figure.
"""
import argparse
import atexit
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

from machine_load import Others, cpu_model, uptime

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--laga", default="build/laga")
ap.add_argument("--seq", type=int, default=1024)
ap.add_argument("--latency-us", type=float, default=1000)
ap.add_argument("--bandwidths", default="")
ap.add_argument("--config", default="")
ap.add_argument("--forms", default="explicit,laga,absorbed")
ap.add_argument("--sp", type=int, default=2, help="ranks (as threads, the cores shared among them)")
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--rounds", type=int, default=1,
                help="whole checks (profile, plans, compares), each its own error; the round "
                     "with the median error per row is reported")
ap.add_argument("--seq-layout", default="contiguous", choices=["contiguous", "zigzag"],
                help="the shards of every run (laga --seq-layout)")
ap.add_argument("--overlap", default="both", choices=["off", "on", "both"],
                help="laga's overlapped variant beside it (both), instead (on) or not (off)")
args = ap.parse_args()
if args.rounds < 1:
    sys.exit(f"--rounds {args.rounds}: need at least 1")
tmp = tempfile.mkdtemp(prefix="laga_check_plan_")
atexit.register(shutil.rmtree, tmp, ignore_errors=True)


def laga(cmd, json_out=None):
    full = [args.laga] + cmd + (["--json", json_out] if json_out else [])
    r = subprocess.run(full, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"{' '.join(full)} exited {r.returncode}: {r.stderr}")
    if json_out:
        with open(json_out) as f:
            return json.load(f)
    return r.stdout


config = args.config
if not config:
    config = os.path.join(tmp, "wide_latent.json")
    with open(config, "w") as f:
        json.dump({"dim": 256, "n_heads": 4, "kv_lora_rank": 256, "qk_nope_head_dim": 16,
                   "qk_rope_head_dim": 16, "v_head_dim": 16}, f)
print("before:", uptime())
others = Others()
model = ["--config", config]
profile = os.path.join(tmp, "this.json")
common = model + ["--seq", str(args.seq), "--sp", str(args.sp), "--forms", args.forms,
                  "--overlap", args.overlap, "--seq-layout", args.seq_layout]
laga(["plan", "--quiet", "--measure", profile, "--dtype", "fp32"] + common)
lat = args.latency_us


def exposed_comm_s(q):
    """A plan's communication that is not hidden under compute: its phases'
    collective time less what overlap hides, plus its waits for peers to
    issue a collective (the step's part that `laga compare` measures as time
    in collectives)."""
    return (sum(ph["comm_s"] for ph in q["phases"].values()) - q["hidden_comm_s"] +
            q["peer_wait_s"])


def plan(bw):
    p = laga(["plan", "--quiet", "--profile", profile, "--dtype", "fp32",
              "--link", f"{bw},{lat}"] + common, os.path.join(tmp, "plan.json"))
    return p, {q["form"]: (q["predicted_step_s"], exposed_comm_s(q)) for q in p["plans"]}


p0, _ = plan(1.0)
cross = p0["cases"][0].get("crossover_bytes_per_s")
print(f"predicted crossover at {lat:g} us: " +
      (f"{cross / 1e9:.4g} GB/s" if cross else p0["cases"][0].get("crossover", "none")))
if args.bandwidths:
    bws = [float(b) for b in args.bandwidths.split(",")]
else:
    if not cross:
        sys.exit("no predicted crossover for this config; give --bandwidths")
    bws = [cross / 1e9 * k for k in (1 / 6, 1 / 2.5, 2.5, 6)]

rows, measured_lead = [], []
rounds = []  # each round's {(bw, form): (pred step, pred comm, measured step, measured comm)}
for r in range(args.rounds):
    if r:  # round 0 plans with the profile the bandwidths were chosen by
        laga(["plan", "--quiet", "--measure", profile, "--dtype", "fp32"] + common)
    this = {}
    for bw in bws:
        _, pred = plan(bw)
        c = laga(["compare", "--quiet", "--steps", str(args.steps), "--warmup", "2",
                  "--link", f"{bw},{lat}"] + common, os.path.join(tmp, "compare.json"))
        for f in c["forms"]:
            this[(bw, f["form"])] = pred[f["form"]] + (f["step_ms"] / 1e3, f["comm_ms"] / 1e3)
    rounds.append(this)

spread = {}  # (bw, form) -> the rounds' smallest and largest error, %
for bw in bws:
    meas = {}
    for (b, form) in rounds[0]:
        if b != bw:
            continue
        errs = sorted((100 * (x[0] - x[2]) / x[2], x) for x in (r[(bw, form)] for r in rounds))
        _, (p, pc, m, mc) = errs[(len(errs) - 1) // 2]  # the median round (even: the lower)
        spread[(bw, form)] = (errs[0][0], errs[-1][0])
        rows.append((bw, form, p, m, pc, mc))
        meas[form] = (m, mc)
    # The crossover the plan names is the first laga variant's.
    first_laga = next((f for f in meas if f.startswith("laga")), None)
    if first_laga and "explicit" in meas:
        measured_lead.append((bw, meas[first_laga][0] - meas["explicit"][0]))

cpu = cpu_model()
print(f"CPU: {cpu}; P {args.sp} (ranks as threads sharing the cores); S {args.seq}; latency "
      f"{lat:g} us; {args.steps} steps a compare, {args.rounds} round(s)")
# Where the error is: the step split into its time in collectives (exposed:
# predicted by the link model, measured by `laga compare`'s comm_ms) and the
# rest (compute, in both), each predicted - measured in ms. The comm split is
# a consistency check, not a measurement of the link model: `compare --link`
# holds each collective for collective_seconds, the very function the plan
# costs it with, so the two agree by construction but for waits on the
# other rank. Measure the communication against real links:
# scripts/shaped_links.py (its 'comm' columns).
print(f"{'GB/s':>9} {'form':>14} {'predicted ms':>13} {'measured ms':>12} {'error':>8}"
      f" {'comm pred-meas':>15} {'rest pred-meas':>15}" +
      (f" {'rounds: error min-max':>22}" if args.rounds > 1 else ""))
worst = 0
for bw, form, p, m, pc, mc in rows:
    e = 100 * (p - m) / m
    worst = max(worst, abs(e))
    lo, hi = spread[(bw, form)]
    print(f"{bw:9.4g} {form:>14} {p * 1e3:13.3f} {m * 1e3:12.3f} {e:+7.1f}%"
          f" {(pc - mc) * 1e3:+15.2f} {((p - pc) - (m - mc)) * 1e3:+15.2f}" +
          (f" {lo:+10.1f}% to {hi:+.1f}%" if args.rounds > 1 else ""))
print(f"largest |error|: {worst:.1f}%")
# The measured crossover: where laga's lead over explicit changes sign,
# interpolated in log bandwidth.
found = None
for (b0, d0), (b1, d1) in zip(measured_lead, measured_lead[1:]):
    if (d0 < 0) != (d1 < 0):
        t = d0 / (d0 - d1)
        found = math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0)))
print("measured crossover: " + (f"{found:.4g} GB/s" if found else "none in the range measured") +
      (f"; predicted {cross / 1e9:.4g} GB/s" if cross else ""))
print("after:", uptime())
# What the rest of the machine ran meanwhile (a quiet check has it near 0).
print(others.report())
