#!/usr/bin/env python3
"""The memory prediction's MPI staging rule against the pools of a real
mpirun run (issue 16 item 7): `laga compare --comm mpi` on 3 processes
measures every rank's pool and sets the prediction (the count-only run on a
dry-run communicator staging as MPI does) beside it; both must agree byte for
byte for every form, and the MPI staging must be what the in-process backend
does not do (else the check would not exercise the MPI rule). Then the same
in bf16 with the gradient all-reduce bf16 too (--dtype bf16 --grad-reduce
bf16, flash): the MPI stagings in bf16 (mla/wire.hpp), predicted exactly.

  compare_mpi_memory.py LAGA MPIEXEC TMPDIR
"""
import json
import os
import subprocess
import sys

laga, mpiexec, tmp = sys.argv[1:4]
os.makedirs(tmp, exist_ok=True)
common = ["compare", "--preset", "tiny", "--seq", "31", "--batch", "2", "--sp", "3",
          "--steps", "1", "--warmup", "0", "--quiet", "--attention", "eager"]


def run(cmd, out):
    r = subprocess.run(cmd + ["--json", out], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    with open(out) as f:
        return {f["form"]: f for f in json.load(f)["forms"]}


mpi = run(["timeout", "100", mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", "3", laga]
          + common + ["--comm", "mpi"], os.path.join(tmp, "mpi.json"))
local = run([laga] + common, os.path.join(tmp, "local.json"))
bf16 = common[:-1] + ["flash", "--dtype", "bf16", "--grad-reduce", "bf16"]
mpi_bf16 = run(["timeout", "100", mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", "3",
                laga] + bf16 + ["--comm", "mpi"], os.path.join(tmp, "mpi-bf16.json"))
failures = []
for form, f in list(mpi.items()) + [(k + " bf16", v) for k, v in mpi_bf16.items()]:
    for measured, predicted in [("peak_activation_bytes", "predicted_peak_activation_bytes"),
                                ("peak_comm_buffer_bytes", "predicted_peak_comm_buffer_bytes"),
                                ("peak_grad_sync_bytes", "predicted_peak_grad_sync_bytes")]:
        if f[measured] != f[predicted]:
            failures.append(f"{form} under MPI: {measured} {f[measured]} != {predicted} "
                            f"{f[predicted]}")
    if not f["memory_match"] or not f["bytes_match"]:
        failures.append(f"{form} under MPI: memory_match {f['memory_match']}, "
                        f"bytes_match {f['bytes_match']}")
# MPI stages the peers' blocks of the gradient all-reduce ((P-1) x its chunk;
# in-process only its own chunk): the grad-sync peaks must differ.
if all(mpi[k]["peak_grad_sync_bytes"] == local[k]["peak_grad_sync_bytes"] for k in mpi):
    failures.append("MPI and in-process grad-sync peaks are equal: the MPI staging rule is "
                    "not exercised")
# In bf16 the all-reduce's MPI staging holds bf16: the grad-sync peak falls.
# And a bf16 attention call's scratch (its operands' copies and the bf16
# flash workspace: mla/block.cpp) is a pool tensor, counted and predicted
# (the checks above); at these sizes it is what explicit's peak is made at.
for k in mpi:
    if k == "explicit" and not any(t["name"].startswith("bf16 attention scratch")
                                   for t in mpi_bf16[k]["predicted_live_at_peak"]):
        failures.append(f"{k} bf16 under MPI: no bf16 attention scratch live at the peak "
                        f"({mpi_bf16[k]['predicted_peak_at']})")
    if not mpi_bf16[k]["peak_grad_sync_bytes"] < mpi[k]["peak_grad_sync_bytes"]:
        failures.append(f"{k}: --grad-reduce bf16's grad-sync peak "
                        f"{mpi_bf16[k]['peak_grad_sync_bytes']} is not below fp32's "
                        f"{mpi[k]['peak_grad_sync_bytes']}")
for m in failures:
    print("FAILED:", m)
print("compare_mpi_memory:", "FAILED" if failures else "ok", f"({len(mpi)} forms)")
sys.exit(1 if failures else 0)
