"""--device cpu|emulated|cuda on laga forward, verify and compare
(tools/device_option.hpp).

--device cuda is refused with one sentence naming what is missing: the backend
(a build without CUDA) or the device (a build with it, on a machine without a
usable GPU: CI's; tools_cuda_backend_module holds the module's other errors,
and what runs where there is a GPU). An unknown device is refused naming the value;
--device cpu runs as before. --device emulated runs the device code path on
the CPU: verify passes every form on it against the CPU reference, and
forward's output and gradients are the CPU's byte for byte. compare's device
peak (mla/device_peak_prediction.hpp) is the pool's working peak plus what the
backend keeps per rank thread (none on emulated; the cuBLASLt workspace on
cuda, mla_test_device_emulated's DevicePeak test), count-only equal to the
model's, in its JSON and its table.

usage: test_device_option.py LAGA CUDA_BUILT(ON|OFF)
"""
import os
import subprocess
import sys
import tempfile

laga, cuda_built = sys.argv[1], sys.argv[2].upper() in ("ON", "1", "TRUE")
failures = []


def run(*args):
    return subprocess.run([laga, *args], capture_output=True, text=True, timeout=120)


for command in ("forward", "verify", "compare"):
    r = run(command, "--device", "cuda", "--preset", "tiny")
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    if r.returncode != 2 or len(lines) != 1:
        failures.append(f"{command} --device cuda: rc {r.returncode}, stderr {r.stderr!r}")
        continue
    msg = lines[0]
    want_start = f"laga: error: laga {command} --device cuda: "
    if not msg.startswith(want_start):
        failures.append(f"{command}: message does not name the command and option: {msg!r}")
    if cuda_built:
        known = ("no usable CUDA device", "no CUDA device", "compute capability")
    else:
        known = ("built without the CUDA backend",)
    if not any(k in msg for k in known):
        failures.append(f"{command}: the refusal names none of {known}: {msg!r}")
    if "does not load the CUDA backend" in msg:
        failures.append(f"{command}: the old refusal of a tool without the backend: {msg!r}")
    if "--device cpu" not in msg:
        failures.append(f"{command}: the refusal does not say what to do (--device cpu): {msg!r}")

r = run("forward", "--device", "gpu")
if r.returncode == 0 or "'gpu' is not one of cpu, emulated, cuda" not in r.stderr:
    failures.append(f"--device gpu: rc {r.returncode}, stderr {r.stderr!r}")

a = run("forward", "--device", "cpu", "--preset", "tiny", "--seq", "8")
b = run("forward", "--preset", "tiny", "--seq", "8")
if a.returncode != 0 or b.returncode != 0:
    failures.append(f"--device cpu: rc {a.returncode} / {b.returncode}: {a.stderr!r}")

v = run("verify", "--device", "emulated", "--preset", "tiny", "--seq", "13", "--sp", "1,3")
if v.returncode != 0 or "FAIL" in v.stdout:
    failures.append(f"verify --device emulated: rc {v.returncode}: {v.stdout[-2000:]!r} {v.stderr!r}")

with tempfile.TemporaryDirectory() as tmp:
    outs = {}
    for device in ("cpu", "emulated"):
        path = os.path.join(tmp, device + ".safetensors")
        r = run("forward", "--device", device, "--preset", "tiny", "--seq", "13", "--sp", "3",
                "--backward", "--output", path)
        if r.returncode != 0:
            failures.append(f"forward --device {device}: rc {r.returncode}: {r.stderr!r}")
            continue
        with open(path, "rb") as f:
            outs[device] = f.read()
    if len(outs) == 2 and outs["cpu"] != outs["emulated"]:
        failures.append("forward --device emulated: its output file differs from --device cpu's")

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "c.json")
    r = run("compare", "--device", "emulated", "--count-only", "--preset", "tiny", "--seq", "13",
            "--sp", "3", "--forms", "explicit,laga", "--json", path, "--quiet")
    if r.returncode != 0:
        failures.append(f"compare --device emulated --count-only: rc {r.returncode}: {r.stderr!r}")
    else:
        import json
        with open(path) as f:
            doc = json.load(f)
        forms = doc.get("forms") or []
        if not forms:
            failures.append(f"compare --json: no per-form list in {sorted(doc)}")
        for g in forms:
            want = max(g["peak_activation_bytes"], g["peak_grad_sync_bytes"])
            got = (g.get("device_peak_bytes"), g.get("predicted_device_peak_bytes"),
                   g.get("device_kept_predicted_bytes"))
            if got != (want, want, 0) or want <= 0:
                failures.append(f"compare --device emulated --count-only {g.get('form')}: device "
                                f"peak, model, kept {got}, want ({want}, {want}, 0)")
        if "device peak per rank on emulated" not in r.stdout:
            failures.append(f"compare --device emulated: no device peak line in {r.stdout[-1500:]!r}")

for f in failures:
    print("FAIL:", f)
print("ok" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
