#!/usr/bin/env python3
"""python/plot_plan.py end to end: both modes write a PNG, the bandwidth mode
reports the crossover `laga plan` computes, and bad sweeps are refused.

    test_plot_plan.py LAGA_BINARY SCRATCH_DIR
"""
import json
import os
import subprocess
import sys

laga, scratch = sys.argv[1], sys.argv[2]
os.makedirs(scratch, exist_ok=True)
here = os.path.dirname(os.path.abspath(__file__))
script = os.path.join(here, "..", "..", "python", "plot_plan.py")
failures = []


def run(args, expect_rc=0):
    p = subprocess.run(["/usr/bin/python3", script, laga] + args, capture_output=True, text=True,
                       timeout=300)
    if p.returncode != expect_rc:
        failures.append(f"{args}: exit {p.returncode}, wanted {expect_rc}\n{p.stderr[-800:]}")
    return p


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


grid_png = os.path.join(scratch, "grid.png")
run(["--out", grid_png, "grid", "--preset", "small", "--seq", "1024,4096", "--sp", "2,8",
     "--profile", "a100"])
if not (os.path.exists(grid_png) and is_png(grid_png)):
    failures.append("grid: no PNG written")

bw_png = os.path.join(scratch, "bw.png")
p = run(["--out", bw_png, "--gbps", "0.01,100", "--points", "3", "bandwidth", "--preset",
         "small", "--seq", "4096", "--sp", "8", "--profile", "a100", "--forms", "explicit,laga"])
if not (os.path.exists(bw_png) and is_png(bw_png)):
    failures.append("bandwidth: no PNG written")
# The crossover it reports is the planner's own sentence.
plan_json = os.path.join(scratch, "plan.json")
subprocess.run([laga, "plan", "--quiet", "--preset", "small", "--seq", "4096", "--sp", "8",
                "--profile", "a100", "--forms", "explicit,laga", "--link", "0.01",
                "--json", plan_json], check=True, capture_output=True)
with open(plan_json) as f:
    crossover = json.load(f)["cases"][0]["crossover"]
if crossover not in p.stdout:
    failures.append(f"bandwidth: expected the planner's '{crossover}' in: {p.stdout}")

for args, needle in [
    (["--out", bw_png, "bandwidth", "--preset", "small", "--seq", "1024,2048", "--sp", "8"],
     "give one --seq and one --sp"),
    (["--out", bw_png, "--gbps", "5,1", "bandwidth", "--preset", "small", "--seq", "1024"],
     "0 < LO < HI"),
    (["--out", bw_png, "bandwidth", "--preset", "small", "--link", "1"], "drop it"),
    (["--out", scratch, "grid", "--preset", "small", "--seq", "1024", "--sp", "2"],
     "not a regular file"),
]:
    r = run(args, expect_rc=1)
    if needle not in r.stderr:
        failures.append(f"{args}: error should say '{needle}', got: {r.stderr}")

if failures:
    sys.exit(f"{len(failures)} failed:\n" + "\n".join(failures))
print("all ok")
