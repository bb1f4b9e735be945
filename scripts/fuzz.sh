#!/usr/bin/env bash
# Coverage-guided fuzzing of laga's readers with libFuzzer (clang, with
# AddressSanitizer and UndefinedBehaviorSanitizer): builds one binary per
# target into build-fuzz/ and runs each for SECONDS on its committed seed
# corpus (tests/fuzz/corpus/<target>/, read only) plus a working corpus
# (build-fuzz/corpus/<target>/, kept between runs). docs/reliability.md
# ("Fuzzing") has the targets, the figures and how a crash becomes a test.
#
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]      # default 20 s, all targets
#   FUZZ_RUNS=1000000 bash scripts/fuzz.sh 900      # stop at 10^6 executions
#
# Targets: safetensors, config_modelargs, config_hf (one binary, two seed
# corpora), tokens, manifest. Exit status 1 if any target crashed; the input
# that did is in build-fuzz/artifacts/<target>/ and the log in
# build-fuzz/<target>.log. Needs clang (scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors config_modelargs config_hf tokens manifest)

CXX=${CXX_FUZZ:-clang++}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found; apt-get install clang" >&2; exit 2; }
out=build-fuzz
mkdir -p "$out"
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -mavx2 -mfma
       -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -Isrc -Itests/fuzz)

# The library sources each reader needs (compiled into the target, so that
# they are instrumented for coverage and the sanitizers).
core=(src/core/tensor.cpp src/core/memory_pool.cpp src/core/rng.cpp)
declare -A sources=(
  [safetensors]="tests/fuzz/fuzz_safetensors.cpp src/io/safetensors.cpp src/io/atomic_file.cpp ${core[*]}"
  [config]="tests/fuzz/fuzz_config.cpp src/mla/config.cpp ${core[*]}"
  [tokens]="tests/fuzz/fuzz_tokens.cpp src/model/data.cpp src/mla/documents.cpp src/mla/params.cpp src/mla/config.cpp ${core[*]}"
  [manifest]="tests/fuzz/fuzz_manifest.cpp src/model/checkpoint_manifest.cpp"
)
binary_of() { case $1 in config_*) echo config ;; *) echo "$1" ;; esac; }

built=()
for t in "${targets[@]}"; do
  b=$(binary_of "$t")
  [ -n "${sources[$b]:-}" ] || { echo "fuzz.sh: unknown target '$t'" >&2; exit 2; }
  case " ${built[*]} " in *" $b "*) continue ;; esac
  echo "fuzz.sh: building fuzz_$b"
  # shellcheck disable=SC2086
  "$CXX" "${flags[@]}" ${sources[$b]} -o "$out/fuzz_$b"
  built+=("$b")
done

status=0
for t in "${targets[@]}"; do
  b=$(binary_of "$t")
  mkdir -p "$out/corpus/$t" "$out/artifacts/$t"
  echo "fuzz.sh: running $t for $seconds s"
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     "$out/fuzz_$b" -max_total_time="$seconds" -runs="${FUZZ_RUNS:--1}" -print_final_stats=1 -rss_limit_mb=2048 \
       -max_len=65536 -timeout=10 -artifact_prefix="$out/artifacts/$t/" \
       "$out/corpus/$t" "tests/fuzz/corpus/$t" >"$out/$t.log" 2>&1; then
    result=ok
  else
    result=CRASH
    status=1
  fi
  # The last status line (#N ... cov: C ft: F corp: ...) and the totals.
  line=$(grep -E '^#[0-9]+' "$out/$t.log" | tail -1 || true)
  execs=$(grep -E 'stat::number_of_executed_units' "$out/$t.log" | awk '{print $2}' || true)
  echo "fuzz.sh: $t: $result; executions ${execs:-?}; last: ${line:-none}"
  [ $result = ok ] || tail -40 "$out/$t.log"
done
exit $status
