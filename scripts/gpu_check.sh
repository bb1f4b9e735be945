#!/usr/bin/env bash
# What laga checks on a lent GPU, in one call (nothing here runs in CI, which
# has no GPU; docs/pytorch.md "On a GPU" and docs/planning.md "Timing a
# plan's shapes on a GPU" say what each part showed and when).
#
#   bash scripts/gpu_check.sh BUNDLE SHAPES OUTDIR
#
# BUNDLE: a .tar.xz of laga built elsewhere (laga and lib/ with the shared
# libraries it needs that the GPU machine lacks), so the C++ references run
# there; SHAPES: `laga plan --list-shapes` output to time. Writes into OUTDIR:
#   gpu.txt                 the device, driver, torch and CUDA versions
#   torch_package_cuda.log  tests/tools/test_torch_package.py on cuda:0 with
#                           NCCL at P 1 (every form and case, float64, float32,
#                           bf16, eager, flash and SDPA, against laga forward)
#   example_*.json          python/examples/train_mla.py on cuda:0, 20 AdamW
#                           steps at P 1 in float64, float32 and bfloat16
#   h200_measured.json      --base profiles/h200.json with the shapes' bf16
#                           times (scripts/time_shapes_torch.py) and its report
set -uo pipefail
bundle=$1 shapes=$2 out=$3
mkdir -p "$out" /tmp/laga-bundle
tar xJf "$bundle" -C /tmp/laga-bundle || exit 1
export LD_LIBRARY_PATH=/tmp/laga-bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1
laga=/tmp/laga-bundle/laga
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"
  lscpu | grep 'Model name'
  "$laga" --version 2>&1 | head -1
} 2>&1 | tee "$out/gpu.txt"

echo "== test_torch_package.py on cuda:0, NCCL, P 1"
time timeout 200 python3 tests/tools/test_torch_package.py "$laga" /tmp/tp-cuda \
  --device cuda --backend nccl --sp 1 >"$out/torch_package_cuda.log" 2>&1
echo "rc $?" >>"$out/torch_package_cuda.log"
tail -8 "$out/torch_package_cuda.log"

echo "== train_mla.py on cuda:0, P 1"
for dt in float64 float32 bfloat16; do
  RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
    timeout 60 python3 python/examples/train_mla.py --device cuda --backend nccl \
    --dtype $dt --steps 20 --json "$out/example_$dt.json" 2>&1 | tail -2
done

echo "== the shapes, bf16"
time timeout 330 python3 scripts/time_shapes_torch.py "$shapes" --base profiles/h200.json \
  --out "$out/h200_measured.json" --report "$out/h200_measured_report.json" --min-ms 10 \
  >"$out/time_shapes.log" 2>&1
echo "rc $?" >>"$out/time_shapes.log"
tail -3 "$out/time_shapes.log"
