#!/usr/bin/env python3
"""scripts/check_pipeline_plan.py end to end, cheaply (issue 57): the plan of
`laga plan --model --pp --schedule 1f1b-lockstep` and `laga train --pp` of the
same small MoE model, at PP 2 and 4, one round of a short sequence.

  test_check_pipeline_plan.py LAGA

What it holds is the plumbing, not the timing: the script runs both tools at
each PP, reads their outputs and reports a row per PP with a positive
prediction, bubble and measurement. Whether the prediction is within 15% of
the measurement is the script's own run on a quiet machine
(docs/planning.md, "The pipelined plan against a measured step"): on a
shared 2-core box the steps of a few milliseconds measured here move by more
than that with the other processes' load, so a bound on them would test the
load.
"""
import os
import re
import subprocess
import sys

laga = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
script = os.path.join(here, "..", "..", "scripts", "check_pipeline_plan.py")
r = subprocess.run([sys.executable, script, "--laga", laga, "--seq", "64", "--pp", "2,4",
                    "--micro-batches", "2", "--steps", "3", "--skip", "1", "--rounds", "1",
                    "--markdown"], capture_output=True, text=True, timeout=240)
if r.returncode != 0:
    sys.exit(f"check_pipeline_plan.py exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
rows = {}
for line in r.stdout.splitlines():
    m = re.match(r"\| (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \(([-+\d.]+)%\) \| ([\d.]+) \| "
                 r"([-+\d.]+)% \|", line)
    if m:
        rows[int(m.group(1))] = [float(x) for x in m.groups()[1:]]
failures = []
if sorted(rows) != [2, 4]:
    failures.append(f"rows for PP {sorted(rows)}, want 2 and 4:\n{r.stdout}")
for pp, (pred, bubble, formula, _, measured, err) in rows.items():
    if not (pred > 0 and bubble > 0 and formula > 0 and measured > 0):
        failures.append(f"PP {pp}: a zero in predicted {pred}, bubble {bubble}, "
                        f"1F1B {formula}, measured {measured}")
    # The table's seconds are rounded to 5e-5 and its percentages to 0.05.
    slack = 100 * 5e-5 * (1 / measured + pred / measured ** 2) + 0.05
    if abs(100 * (pred - measured) / measured - err) > slack:
        failures.append(f"PP {pp}: error {err}% is not (predicted - measured) / measured")
if "largest |error|" not in r.stdout or "CPU:" not in r.stdout:
    failures.append(f"no machine or summary line:\n{r.stdout}")
if failures:
    sys.exit("\n".join(failures))
print(r.stdout)
