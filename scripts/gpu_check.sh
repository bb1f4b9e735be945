#!/usr/bin/env bash
# What laga checks on a lent GPU, in one call (nothing here runs in CI, which
# has no GPU; docs/pytorch.md "On a GPU", docs/planning.md "Timing a plan's
# shapes on a GPU" and docs/performance.md "The CUDA backend" say what each
# part showed and when). Three modes:
#
#   bash scripts/gpu_check.sh BUNDLE SHAPES OUTDIR         the PyTorch package (below)
#   bash scripts/gpu_check.sh cuda-bundle BUILD_DIR OUT.tar.xz
#                                                          here: pack laga_cuda_check, laga
#   bash scripts/gpu_check.sh cuda OUT.tar.xz OUTDIR [--dry-run]
#                                                          there: run it
#
# cuda-bundle (on the build machine, a LAGA_CUDA=ON build): laga_cuda_check,
# laga_cuda_forms, laga and its CUDA backend module liblaga_cuda_backend.so
# (sm_90, built with this machine's nvcc; laga finds the module beside it)
# and the shared libraries they need
# that the GPU image lacks (oneDNN, OpenBLAS and their runtimes), into one
# .tar.xz to carry. The CUDA libraries (cuBLASLt, cuDNN, NVRTC, NCCL) are not
# packed (over 800 MB): the GPU image's PyPI nvidia-* wheels provide them.
# Why not build there: the image has nvcc, CMake and ninja but not the Debian
# packages laga's CMake requires (oneDNN, OpenBLAS, MPI, CLI11, GTest).
#
# cuda (on the GPU machine): unpacks the bundle, puts its lib/ and the
# wheels' nvidia/*/lib directories on LD_LIBRARY_PATH, records the device,
# and runs laga_cuda_check (every op against the CPU's float64 reference,
# then cuDNN's and laga's attention TFLOP/s at 192/128, H 128, S
# 4096..32768, within a time budget), then laga_cuda_forms (every form on
# CUDA at P 1 and P 2-4 sharing the GPU against the CPU float64 reference,
# the ledger, the device peak against the model, bf16 against CUDA explicit,
# step times per form at DeepSeek-V3 block dims, S 4096..32768, with the
# fused kernel's peak and time beside unfused laga and explicit), then `laga
# compare --device cuda` (the tool's own path: the module loaded, every form
# at P 1 and at P 2, 3, 4 as ranks sharing the GPU, its tables), writing
# into OUTDIR:
#   cuda_gpu.txt      nvidia-smi's device, driver and clocks
#   cuda_check.json   every op check (error, tolerance, pass) and timing
#   cuda_check.md     the same as tables, for docs/performance.md
#   cuda_check.log    its output
#   cuda_forms.json   every form check and step time
#   cuda_forms.md     the same as tables
#   cuda_forms.log    its output
#   plan_vs_gpu.json / .md / .log   scripts/plan_vs_gpu.py: each timed row
#                     beside `laga plan`'s prediction on the profile of this
#                     device (nvidia-smi's name; none: no prediction, said why)
#   laga_compare_cuda_pP.md / .json / .log   laga compare --device cuda at P
#                     1..4: the table it prints, its JSON, its output
#   laga_compare_cuda_count_only.md / .json / .log   the same at P 4,
#                     --count-only: the device peak it predicts per form
#                     (device_peak_bytes: the pool's + the cuBLASLt workspace)
#   summary.txt       every step's exit status; the last line names the
#                     failed steps (none: "all steps passed")
# Budget (timeouts): 180 + 180 + 20 + 10 + 4 x 20 + 15 = 485 s, about eight
# minutes, inside the lease's ten-minute command; the checks take seconds,
# the timings stop at their --budget-s.
# --dry-run: no device needed (CI's host test, tools_gpu_check_cuda_dry):
# the bundle is unpacked and its binaries run with its libraries, listing
# what they would check; laga loads the module and lists its kernel rows
# (laga_kernels_cuda.json); plan_vs_gpu.py joins the (empty) timings with
# `laga plan` (plan_vs_gpu.json: no rows, and no profile without a device).
#
# The PyTorch mode:
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

if [ "${1:-}" = "cuda-bundle" ]; then
  build=${2:?"usage: gpu_check.sh cuda-bundle BUILD_DIR OUT.tar.xz"}
  tarball=${3:?"usage: gpu_check.sh cuda-bundle BUILD_DIR OUT.tar.xz"}
  stage=$(mktemp -d)
  mkdir -p "$stage/lib"
  for t in laga_cuda_check laga_cuda_forms laga liblaga_cuda_backend.so; do
    [ -e "$build/$t" ] || { echo "gpu_check: $build/$t is missing: build it (LAGA_CUDA=ON; the module: target laga_cuda_backend)"; exit 2; }
    cp "$build/$t" "$stage/"
  done
  # Every library they load but CUDA's own (the GPU image has those) and libc's.
  ldd "$build/laga_cuda_check" "$build/laga_cuda_forms" "$build/laga" \
    "$build/liblaga_cuda_backend.so" | awk '$3 ~ /^\// {print $3}' | sort -u |
    while read -r lib; do
    case "$(basename "$lib")" in
      libcuda*|libcublas*|libcudnn*|libnvrtc*|libnccl*|libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*) ;;
      *) cp -L "$lib" "$stage/lib/" ;;
    esac
  done
  XZ_OPT=${XZ_OPT:--3 -T2} tar -cJf "$tarball" -C "$stage" .
  rm -rf "$stage"
  echo "gpu_check: $tarball ($(du -h "$tarball" | cut -f1))"
  exit 0
fi

if [ "${1:-}" = "cuda" ]; then
  tarball=${2:?"usage: gpu_check.sh cuda OUT.tar.xz OUTDIR [--dry-run]"}
  out=${3:?"usage: gpu_check.sh cuda OUT.tar.xz OUTDIR [--dry-run]"}
  dry=${4:-}
  mkdir -p "$out"
  dir=$(mktemp -d)
  tar xJf "$tarball" -C "$dir" || exit 2
  libs="$dir/lib"
  # The PyPI nvidia-* wheels' libraries (cuBLASLt, cuDNN, NVRTC, NCCL, cudart).
  site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
  if [ -n "$site" ] && [ -d "$site/nvidia" ]; then
    for d in $(find "$site/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u); do
      libs="$libs:$d"
    done
  fi
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  here=$(cd "$(dirname "$0")" && pwd)
  # The device as nvidia-smi names it: plan_vs_gpu.py picks its profile.
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
  if [ "$dry" = "--dry-run" ]; then
    "$dir/laga_cuda_check" --dry-run --json "$out/cuda_check.json" 2>&1 | tee "$out/cuda_check.log"
    rc=${PIPESTATUS[0]}
    "$dir/laga_cuda_forms" --dry-run --json "$out/cuda_forms.json" 2>&1 | tee "$out/cuda_forms.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    "$dir/laga" kernels --device cuda --json "$out/laga_kernels_cuda.json" 2>&1 |
      tee "$out/laga_kernels_cuda.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    # The join with `laga plan` on what the dry run wrote (no timings; the
    # device's name where nvidia-smi finds one, else the refusal).
    python3 "$here/plan_vs_gpu.py" --forms "$out/cuda_forms.json" --gpu-name "$gpu_name" \
      --laga "$dir/laga" --json "$out/plan_vs_gpu.json" --table "$out/plan_vs_gpu.md" || rc=1
    exit "$rc"
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
    2>&1 | tee "$out/cuda_gpu.txt"
  rc=0
  failed=""
  # One step's exit status into summary.txt; a failed step is named at the end.
  step() {
    echo "$1: rc $2" >>"$out/summary.txt"
    if [ "$2" != 0 ]; then
      failed="$failed $1"
      rc=1
      echo "FAILED: $1 (rc $2; rc 124 is its timeout)" >&2
    fi
  }
  : >"$out/summary.txt"
  echo "== laga_cuda_check"
  time timeout 180 "$dir/laga_cuda_check" --json "$out/cuda_check.json" \
    --table "$out/cuda_check.md" --budget-s 120 >"$out/cuda_check.log" 2>&1
  r=$?
  echo "rc $r" >>"$out/cuda_check.log"
  tail -40 "$out/cuda_check.log"
  step laga_cuda_check "$r"
  echo "== laga_cuda_forms"
  time timeout 180 "$dir/laga_cuda_forms" --json "$out/cuda_forms.json" \
    --table "$out/cuda_forms.md" --budget-s 100 >"$out/cuda_forms.log" 2>&1
  r=$?
  echo "rc $r" >>"$out/cuda_forms.log"
  tail -60 "$out/cuda_forms.log"
  step laga_cuda_forms "$r"
  echo "== laga plan beside the step times ($gpu_name)"
  timeout 20 python3 "$here/plan_vs_gpu.py" --forms "$out/cuda_forms.json" \
    --gpu-name "$gpu_name" --laga "$dir/laga" --json "$out/plan_vs_gpu.json" \
    --table "$out/plan_vs_gpu.md" >"$out/plan_vs_gpu.log" 2>&1
  r=$?
  tail -40 "$out/plan_vs_gpu.log"
  step plan_vs_gpu "$r"
  # laga itself on the GPU: the module loaded (beside laga), every form,
  # ranks as threads sharing the GPU; its table and JSON as on the CPU.
  # (The shape: compare's default model and S, two measured steps after one
  # warm-up; LAGA_COMPARE_SHAPE replaces it.)
  timeout 10 "$dir/laga" kernels --device cuda --json "$out/laga_kernels_cuda.json" \
    >"$out/laga_kernels_cuda.log" 2>&1
  step laga_kernels_cuda "$?"
  shape=${LAGA_COMPARE_SHAPE:---preset small --seq 1024 --steps 2 --warmup 1}
  for P in 1 2 3 4; do
    echo "== laga compare --device cuda --sp $P"
    f="$out/laga_compare_cuda_p$P"
    timeout 20 "$dir/laga" compare --device cuda --forms all --sp "$P" \
      $shape --json "$f.json" >"$f.md" 2>"$f.log"
    r=$?
    echo "rc $r" >>"$f.log"
    tail -30 "$f.md"
    tail -3 "$f.log"
    step "laga_compare_cuda_p$P" "$r"
  done
  # The device peak count-only predicts (mla/device_peak_prediction.hpp),
  # beside the P 4 run's measured pool above.
  echo "== laga compare --device cuda --sp 4 --count-only"
  f="$out/laga_compare_cuda_count_only"
  timeout 15 "$dir/laga" compare --device cuda --forms all --sp 4 --count-only \
    $shape --json "$f.json" >"$f.md" 2>"$f.log"
  r=$?
  echo "rc $r" >>"$f.log"
  grep -A12 "device peak per rank" "$f.md"
  tail -3 "$f.log"
  step laga_compare_cuda_count_only "$r"
  if [ -n "$failed" ]; then
    echo "failed:$failed" | tee -a "$out/summary.txt" >&2
  else
    echo "all steps passed" | tee -a "$out/summary.txt"
  fi
  exit $rc
fi

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
