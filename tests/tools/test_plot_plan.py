#!/usr/bin/env python3
"""python/plot_plan.py end to end: both modes write a PNG, the bandwidth mode
reports the crossover `laga plan` computes, and bad sweeps are refused; and
python/plot_model_plan.py writes its PNG and table (laga plan --model).

    test_plot_plan.py LAGA_BINARY SCRATCH_DIR
"""
import json
import os
import struct
import subprocess
import sys
import time

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


def png_size(path):
    """(width, height) from a PNG's IHDR chunk, or None when it is not a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", head[16:24])


def check_written(path, what, since):
    """The image at path was written by this run: a PNG of plot size, newer
    than the run's start (a reused build tree may hold an earlier run's)."""
    if not os.path.exists(path):
        failures.append(f"{what}: no PNG written")
        return
    size, st = png_size(path), os.stat(path)
    if size is None or st.st_size < 10_000 or size[0] < 400 or size[1] < 300:
        failures.append(f"{what}: {path} is not a plot ({st.st_size} bytes, size {size})")
    if st.st_mtime < since:
        failures.append(f"{what}: {path} is older than this run")


grid_png = os.path.join(scratch, "grid.png")
bw_png = os.path.join(scratch, "bw.png")
for old in (grid_png, bw_png):  # an earlier run's images must not pass for this one's
    if os.path.exists(old):
        os.remove(old)
start = time.time() - 1  # mtime granularity
run(["--out", grid_png, "grid", "--preset", "small", "--seq", "1024,4096", "--sp", "2,8",
     "--profile", "a100"])
check_written(grid_png, "grid", start)

p = run(["--out", bw_png, "--gbps", "0.01,100", "--points", "3", "bandwidth", "--preset",
         "small", "--seq", "4096", "--sp", "8", "--profile", "a100", "--forms", "explicit,laga"])
check_written(bw_png, "bandwidth", start)
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

# python/plot_model_plan.py: the PNG and the table of the fewest devices per
# S, read from laga plan --model's JSON (moe_tiny fits on one device).
model_png = os.path.join(scratch, "model.png")
model_md = os.path.join(scratch, "model.md")
moe_tiny = os.path.join(here, "..", "..", "docs", "assets", "moe_tiny.json")
since = time.time()
p = subprocess.run(["/usr/bin/python3", os.path.join(here, "..", "..", "python",
                                                     "plot_model_plan.py"), laga,
                    "--out", model_png, "--table", model_md, "--profiles", "h100",
                    "--model", moe_tiny, "--seq", "64,128", "--sp", "1,2", "--dp", "1,2",
                    "--forms", "explicit,laga"], capture_output=True, text=True, timeout=300)
if p.returncode != 0:
    failures.append(f"plot_model_plan.py: exit {p.returncode}\n{p.stderr[-800:]}")
else:
    check_written(model_png, "plot_model_plan.py", since)
    with open(model_md) as f:
        rows = [l for l in f.read().splitlines() if l.startswith("| h100 |")]
    if len(rows) != 2 or any("| 1 (1 x 1) |" not in r for r in rows):
        failures.append(f"plot_model_plan.py table rows: {rows}")

if failures:
    sys.exit(f"{len(failures)} failed:\n" + "\n".join(failures))
print("all ok")
