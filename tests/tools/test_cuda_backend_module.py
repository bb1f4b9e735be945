"""The CUDA backend as a module (mla/cuda_backend.hpp; docs/build.md, "The CUDA
backend"): laga loads liblaga_cuda_backend.so only for --device cuda.

- `laga kernels --device cuda` loads it (dlopen with RTLD_NOW: every library
  and every laga symbol it needs is found), its ABI version is the one in
  src/mla/cuda_backend_abi.hpp, and the ops its rows name are the CPU table's
  less the ops not on the device yet (named below: a new CUDA row, or a new
  CPU op without one, fails here until this list says so).
- Without a usable device (CI's machines), `laga forward|compare|verify
  --device cuda` fails with one line: the command, the option and the module's
  own device reason (not the old "this tool does not load the backend"
  refusal). With one, forward --device cuda runs the block.
- A module path that does not exist, a file that is not a module, and a
  library without laga's entry point each give their own error naming the path.
- --comm nccl is refused where it cannot run (verify; without --device cuda),
  and --device cuda with --comm mpi; with --device cuda and no GPU, the device,
  the same line from each of 2 MPI ranks (with MPIEXEC).

usage: test_cuda_backend_module.py LAGA ABI_HEADER [MPIEXEC]
"""
import json
import os
import re
import subprocess
import sys
import tempfile

laga, abi_header = sys.argv[1], sys.argv[2]
mpiexec = sys.argv[3] if len(sys.argv) > 3 else None
failures = []

# Ops the CPU table has and the CUDA backend does not yet (docs/build.md, "The
# CUDA backend": the model's kernels on the device are a later step; so are
# DSA's lightning indexer's, mla/ops_dsa.hpp).
NOT_ON_CUDA_YET = {
    "embedding_forward", "embedding_backward", "swiglu_forward", "swiglu_backward",
    "output_gate_forward", "output_gate_backward", "cross_entropy",
    "cross_entropy_backward", "adamw",
    "layernorm_forward", "layernorm_backward", "rope_halves_forward", "rope_halves_backward",
    "index_topk", "index_all_causal", "indexer_kl", "kv_fp8_round_trip",
}


def run(*args, env=None):
    e = dict(os.environ)
    e.pop("LAGA_CUDA_BACKEND", None)
    e.update(env or {})
    return subprocess.run([laga, *args], capture_output=True, text=True, timeout=120, env=e)


def kernels(device):
    r = run("kernels", "--device", device, "--json", "-")
    if r.returncode != 0:
        failures.append(f"kernels --device {device}: rc {r.returncode}: {r.stderr!r}")
        return None
    return json.loads(r.stdout)


cpu, cuda = kernels("cpu"), kernels("cuda")
abi = int(re.search(r"kCudaBackendAbi = (\d+);", open(abi_header).read()).group(1))
device_missing = None
if cpu and cuda:
    if cuda.get("abi_version") != abi:
        failures.append(f"module ABI {cuda.get('abi_version')} != the header's {abi}")
    if os.path.basename(cuda.get("module", "")) != "liblaga_cuda_backend.so":
        failures.append(f"module path {cuda.get('module')!r}: not liblaga_cuda_backend.so")
    if not os.path.samefile(os.path.dirname(cuda["module"]), os.path.dirname(os.path.realpath(laga))):
        failures.append(f"module {cuda['module']!r} not found beside laga ({laga})")
    cpu_ops = {k["op"] for k in cpu["kernels"]}
    cuda_ops = {k["op"] for k in cuda["kernels"]}
    if not NOT_ON_CUDA_YET <= cpu_ops:
        failures.append(f"ops listed as not on CUDA yet that the CPU lacks: {NOT_ON_CUDA_YET - cpu_ops}")
    if cuda_ops != cpu_ops - NOT_ON_CUDA_YET:
        failures.append(f"CUDA ops differ from the CPU's less the listed ones: missing "
                        f"{sorted(cpu_ops - NOT_ON_CUDA_YET - cuda_ops)}, extra "
                        f"{sorted(cuda_ops - (cpu_ops - NOT_ON_CUDA_YET))}")
    if any(k["kernel"] in ("", None) for k in cuda["kernels"]):
        failures.append("a CUDA row without a kernel name")
    device_missing = cuda.get("device_missing")

if device_missing:  # no usable GPU here: the module's own reason, one line
    for command in ("forward", "compare", "verify"):
        r = run(command, "--device", "cuda", "--preset", "tiny", "--seq", "8")
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        want = f"laga: error: laga {command} --device cuda: {device_missing}"
        if r.returncode != 2 or lines != [want]:
            failures.append(f"{command} --device cuda: rc {r.returncode}, stderr {r.stderr!r}; "
                            f"want {want!r}")
elif device_missing is not None:  # a GPU: the block runs on it
    r = run("forward", "--device", "cuda", "--preset", "tiny", "--seq", "13", "--sp", "3",
            "--backward")
    if r.returncode != 0:
        failures.append(f"forward --device cuda on this GPU: rc {r.returncode}: {r.stderr!r}")

# --comm nccl: compare and forward only, with --device cuda only; --device
# cuda takes local or nccl, not mpi. Each refused in one line naming both.
nccl_cases = [
    (["verify", "--comm", "nccl"], "--comm nccl: this command does not take NCCL"),
    (["forward", "--comm", "nccl"],
     "laga forward --device cpu: --comm nccl moves GPU buffers; add --device cuda"),
    (["compare", "--device", "emulated", "--comm", "nccl"],
     "laga compare --device emulated: --comm nccl moves GPU buffers; add --device cuda"),
    (["forward", "--device", "cuda", "--comm", "mpi"],
     "laga forward --device cuda: --comm mpi moves host buffers"),
]
if device_missing:  # nccl with cuda: the device's absence first
    nccl_cases.append((["forward", "--device", "cuda", "--comm", "nccl"],
                       f"laga forward --device cuda: {device_missing}"))
for args, words in nccl_cases:
    r = run(*args, "--preset", "tiny", "--seq", "8")
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    if r.returncode != 2 or len(lines) != 1 or words not in lines[0]:
        failures.append(f"{' '.join(args)}: rc {r.returncode}, stderr {r.stderr!r}; want {words!r}")

# Under mpirun, every rank of --comm nccl without a device stops with the
# same one line (tools/cli_common.cpp, agree_on_failure), none waits.
if device_missing and mpiexec:
    want = f"laga: error: laga forward --device cuda: {device_missing}"
    cmd = [mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", "2", laga, "forward",
           "--device", "cuda", "--comm", "nccl", "--preset", "tiny", "--seq", "8", "--sp", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode == 0 or (r.stdout + r.stderr).splitlines().count(want) != 2:
        failures.append(f"mpirun -np 2 forward --comm nccl: rc {r.returncode}, output "
                        f"{(r.stdout + r.stderr)[-1500:]!r}; want {want!r} from each rank")

with tempfile.TemporaryDirectory() as tmp:
    missing = os.path.join(tmp, "no_such_module.so")
    not_elf = os.path.join(tmp, "not_a_module.so")
    with open(not_elf, "w") as f:
        f.write("not a shared object\n")
    libc = next(l.split()[-1] for l in open("/proc/self/maps") if "/libc.so" in l or "/libc-" in l)
    cases = [
        (missing, ["does not exist", "named by LAGA_CUDA_BACKEND", missing]),
        (not_elf, ["cannot load the CUDA backend module " + not_elf + ": ", "LD_LIBRARY_PATH"]),
        (libc, ["has no entry point laga_cuda_backend_api", libc]),
    ]
    for path, words in cases:
        for args in (["forward", "--device", "cuda", "--preset", "tiny"],
                     ["kernels", "--device", "cuda"]):
            r = run(*args, env={"LAGA_CUDA_BACKEND": path})
            lines = [l for l in r.stderr.splitlines() if l.strip()]
            ok = (r.returncode == 2 and len(lines) == 1 and
                  lines[0].startswith(f"laga: error: laga {args[0]} --device cuda: ") and
                  all(w in lines[0] for w in words))
            if not ok:
                failures.append(f"LAGA_CUDA_BACKEND={path} {args[0]}: rc {r.returncode}, "
                                f"stderr {r.stderr!r}; want {words}")
    # A CPU run never loads the module, whatever LAGA_CUDA_BACKEND says.
    r = run("forward", "--preset", "tiny", "--seq", "8", env={"LAGA_CUDA_BACKEND": missing})
    if r.returncode != 0:
        failures.append(f"forward --device cpu with a bad LAGA_CUDA_BACKEND: rc {r.returncode}: "
                        f"{r.stderr!r}")

for f in failures:
    print("FAIL:", f)
print("ok" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
