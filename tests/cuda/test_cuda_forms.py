"""laga_cuda_forms's host side (src/cuda/check_forms.cpp).

--dry-run lists what it would run and writes the JSON with "ran": false, with
no device. A real run on a machine without a usable GPU exits 2 with one line
naming what is missing (never a crash); on one with a GPU (not CI's) it runs
every form on CUDA against the CPU (small timing shapes here) and its JSON
says "ran": true with every check's result.

usage: test_cuda_forms.py LAGA_CUDA_FORMS TMPDIR
"""
import json
import os
import subprocess
import sys

tool, tmp = sys.argv[1], sys.argv[2]
os.makedirs(tmp, exist_ok=True)
failures = []

out = os.path.join(tmp, "dry.json")
r = subprocess.run([tool, "--dry-run", "--json", out, "--seqs", "4096,8192"],
                   capture_output=True, text=True, timeout=60)
if r.returncode != 0:
    failures.append(f"--dry-run: rc {r.returncode}: {r.stderr}")
else:
    j = json.load(open(out))
    if j.get("ran") is not False or j.get("seqs") != [4096, 8192] or len(j.get("checks", [])) != 3:
        failures.append(f"--dry-run JSON: {j}")

out = os.path.join(tmp, "real.json")
r = subprocess.run([tool, "--json", out, "--seqs", "256", "--budget-s", "20"],
                   capture_output=True, text=True, timeout=600)
if r.returncode == 2:
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    if len(lines) != 1 or not lines[0].startswith("laga_cuda_forms: ") \
            or "device" not in lines[0].lower():
        failures.append(f"no device: the refusal is not one line naming the device: {r.stderr!r}")
    else:
        print("no usable device here:", lines[0])
elif r.returncode in (0, 1):
    j = json.load(open(out))
    if j.get("ran") is not True or not j.get("forms"):
        failures.append(f"a device run wrote no results: {j}")
    bad = [x for x in j.get("forms", []) if not x["pass"]]
    if bad:
        failures.append(f"{len(bad)} check(s) failed: {bad[:3]}")
else:
    failures.append(f"rc {r.returncode}: {r.stderr}")

for f in failures:
    print("FAIL:", f)
print("ok" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
