#!/usr/bin/env python3
"""scripts/check_model_plan.py --dp end to end, cheaply (issue 57): the plan
of `laga plan --model --sp 1 --dp D --ep 2` and `laga train --dp D
--expert-parallel --ep 2` of the small MoE model, at D 2 and 4, one round of
a short sequence.

  test_check_model_plan_dp.py LAGA

What it holds is the plumbing, not the timing: the script runs both tools
per D, reads their outputs and reports a row per D with its EP, a positive
prediction and measurement, and the error between them. Whether the plan is
within 15% of the run is the script's own run (docs/planning.md, "EP over
the data-parallel replicas against a measured step"): steps of milliseconds
on a shared 2-core box move by more than that with the others' load.
"""
import os
import re
import subprocess
import sys

laga = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
script = os.path.join(here, "..", "..", "scripts", "check_model_plan.py")
r = subprocess.run([sys.executable, script, "--laga", laga, "--seq", "64", "--dp", "2,4",
                    "--ep", "2", "--steps", "3", "--skip", "1", "--rounds", "1", "--form",
                    "explicit", "--markdown"], capture_output=True, text=True, timeout=240)
if r.returncode != 0:
    sys.exit(f"check_model_plan.py exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
rows = {}
for line in r.stdout.splitlines():
    m = re.match(r"\| 1 \| (\d) \| (\d) \| ([\d.]+) \| [\d., ]+ \| ([\d.]+) \| ([-+\d.]+)% \|", line)
    if m:
        rows[int(m.group(1))] = (int(m.group(2)), float(m.group(3)), float(m.group(4)),
                                 float(m.group(5)))
failures = []
if sorted(rows) != [2, 4]:
    failures.append(f"rows for DP {sorted(rows)}, want 2 and 4:\n{r.stdout}")
for dp, (ep, pred, measured, err) in rows.items():
    if ep != 2:
        failures.append(f"DP {dp}: EP {ep} in the plan, want the 2 asked for")
    if not (pred > 0 and measured > 0):
        failures.append(f"DP {dp}: a zero in predicted {pred}, measured {measured}")
        continue
    # The table's seconds are rounded to 5e-5 and its percentages to 0.05.
    slack = 100 * 5e-5 * (1 / measured + pred / measured ** 2) + 0.05
    if abs(100 * (pred - measured) / measured - err) > slack:
        failures.append(f"DP {dp}: error {err}% is not (predicted - measured) / measured")
if "largest |error|" not in r.stdout or "CPU:" not in r.stdout or "EP over DP" not in r.stdout:
    failures.append(f"no machine or summary line:\n{r.stdout}")
if failures:
    sys.exit("\n".join(failures))
print(r.stdout)
