#!/usr/bin/env bash
# The torch 2 test environment: a virtual environment with PyPI's torch 2,
# triton and numpy (python/requirements-torch2.txt) under the build directory,
# for the package suite's second run (the tests named *_torch2; CMake's
# LAGA_TORCH2_PYTHON, tests/tools/CMakeLists.txt laga_add_torch_test) and the
# Triton kernel's tests under TRITON_INTERPRET=1 (docs/pytorch_triton.md "The torch 2
# suite"). Debian's torch 1.13 suite (/usr/bin/python3) is untouched.
#
#   scripts/setup_torch2.sh [BUILD_DIR]        (default: build)
#
# The wheels are downloaded once into BUILD_DIR/torch2-wheels (multi-GB: torch
# from PyPI is its CUDA build) and installed from there with --no-index, so a
# second run, or a rebuilt venv, downloads nothing. A venv whose stamp holds
# the hash of the requirements file's requirement lines is reused as it is:
# no pip runs at all.
# LAGA_TORCH2=off skips this (the *_torch2 tests are then not registered, and
# this says so). LAGA_TORCH2_WHEELS=drop removes the wheelhouse once the venv
# is made (scripts/test.sh sets it under CI=true: a clean clone never reuses
# it, and its 3.0 GB beside the 5.9 GB venv, the ASan build and the main one
# ran a CI disk out of space); the ready venv is still reused by its stamp,
# and only a changed requirements file then downloads again.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
req=python/requirements-torch2.txt
venv=$build/torch2-venv
wheels=$build/torch2-wheels
if [ "${LAGA_TORCH2:-on}" = off ]; then
  echo "setup_torch2: LAGA_TORCH2=off: no torch 2 venv; the *_torch2 tests are not registered"
  exit 0
fi
# The stamp: the requirement lines alone (a comment edit rebuilds nothing).
hash=$(grep -v '^[[:space:]]*\(#\|$\)' "$req" | sha256sum | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.laga-stamp" 2>/dev/null)" = "$hash" ]; then
  echo "setup_torch2: $venv is ready ($req unchanged); nothing downloaded"
  exit 0
fi
start=$(date +%s)
mkdir -p "$build"
# Download unless the wheelhouse already holds this requirements file's wheels
# (its own stamp, written only after a complete download).
if [ "$(cat "$wheels/.laga-stamp" 2>/dev/null)" != "$hash" ]; then
  rm -rf "$wheels.partial"
  echo "setup_torch2: downloading $req's wheels into $wheels (once; multi-GB)"
  /usr/bin/python3 -m venv "$build/torch2-pip" >/dev/null
  "$build/torch2-pip/bin/python" -m pip download --quiet --no-cache-dir -r "$req" \
    -d "$wheels.partial"
  rm -rf "$wheels" "$build/torch2-pip"
  mv "$wheels.partial" "$wheels"
  echo "$hash" >"$wheels/.laga-stamp"
fi
rm -rf "$venv"
/usr/bin/python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheels" --no-cache-dir -r "$req"
"$venv/bin/python" -c "import torch, triton, numpy; \
print('setup_torch2: torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
echo "$hash" >"$venv/.laga-stamp"
if [ "${LAGA_TORCH2_WHEELS:-keep}" = drop ]; then
  rm -rf "$wheels"
  echo "setup_torch2: LAGA_TORCH2_WHEELS=drop: $wheels removed (a changed $req downloads again)"
fi
echo "setup_torch2: $venv made in $(( $(date +%s) - start )) s"
