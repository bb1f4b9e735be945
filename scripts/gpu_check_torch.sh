#!/usr/bin/env bash
# laga_torch on a lent GPU with torch 2 and Triton, in one call (issue 53
# item 5; nothing here runs in CI, which has no GPU; docs/pytorch_triton.md
# "On a GPU (not run)" says what has run). Beside scripts/gpu_check.sh (torch 1.x package
# checks and the plan's shapes).
#
#   bash scripts/gpu_check_torch.sh OUTDIR [LAGA]      (PYTHON: default python3)
#   bash scripts/gpu_check_torch.sh --dry OUTDIR [LAGA] (the CPU: tiny shapes)
#
# PYTHON needs torch 2 and triton (python/requirements-torch2.txt); LAGA is
# the C++ tool the package tests compare with (default build/laga; a bundle
# as gpu_check.sh's works: put its lib/ on LD_LIBRARY_PATH). Writes OUTDIR:
#   gpu_torch.txt                device, driver, torch, triton, CUDA
#   torch_package_cuda.log       test_torch_package.py on cuda:0, NCCL, P 1
#   fused_triton_cuda.log        test_torch_fused_triton.py on cuda:0, P 1:
#                                MLA(form="laga_fused") on the compiled Triton
#                                kernel (float32; float64 takes the torch code
#                                on CUDA) against laga forward --dtype float64
#   bench_torch_gpu.{json,md}    scripts/bench_torch_gpu.py: SDPA backends,
#                                FlexAttention and laga_torch.attention kinds
#                                at 192/128, S 4096-32768, bf16, fwd+bwd
#                                TFLOP/s; laga_fused's Triton kernel against
#                                unfused laga and explicit (time, peak memory)
# Budget: about 6 minutes (timeouts 150 + 150 + 330 s). To time issue 53
# item 1's dispatch, add its kind: BENCH_ARGS="--package-kinds sdpa,auto".
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = --dry ]; then dry=1; shift; fi
out=$1 laga=${2:-build/laga}
PY=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  if [ $dry = 0 ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  fi
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  lscpu | grep 'Model name'
  "$laga" --version 2>&1 | head -1
} 2>&1 | tee "$out/gpu_torch.txt"

if [ $dry = 1 ]; then
  dev=(--device cpu --backend gloo) sp=1 bench=(--dry)
else
  dev=(--device cuda --backend nccl) sp=1 bench=()
fi
echo "== test_torch_package.py, ${dev[*]}, P $sp"
time timeout 150 "$PY" tests/tools/test_torch_package.py "$laga" /tmp/tp-torch2 "${dev[@]}" \
  --sp $sp >"$out/torch_package_cuda.log" 2>&1
echo "rc $?" >>"$out/torch_package_cuda.log"
tail -4 "$out/torch_package_cuda.log"

echo "== test_torch_fused_triton.py, ${dev[*]}, P $sp"
time timeout 150 "$PY" tests/tools/test_torch_fused_triton.py "$laga" /tmp/ft-torch2 "${dev[@]}" \
  --sp $sp >"$out/fused_triton_cuda.log" 2>&1
echo "rc $?" >>"$out/fused_triton_cuda.log"
tail -4 "$out/fused_triton_cuda.log"

echo "== bench_torch_gpu.py"
# shellcheck disable=SC2086
time timeout 330 "$PY" scripts/bench_torch_gpu.py --out "$out" "${bench[@]}" ${BENCH_ARGS:-} \
  >"$out/bench.log" 2>&1
echo "rc $?" >>"$out/bench.log"
tail -3 "$out/bench.log"
cat "$out/bench_torch_gpu.md" 2>/dev/null
