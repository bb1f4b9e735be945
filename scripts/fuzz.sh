#!/usr/bin/env bash
# Coverage-guided fuzzing of laga's readers with libFuzzer (clang, with
# AddressSanitizer and UndefinedBehaviorSanitizer): builds one binary per
# target into build-fuzz/ and runs each for SECONDS (one per core at a time)
# on its committed seed
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
core=(src/core/tensor.cpp src/core/memory_pool.cpp src/core/block_cache.cpp src/core/rng.cpp)
declare -A sources=(
  [safetensors]="tests/fuzz/fuzz_safetensors.cpp src/io/safetensors.cpp src/io/safetensors_set.cpp src/io/atomic_file.cpp ${core[*]}"
  [config]="tests/fuzz/fuzz_config.cpp src/mla/config.cpp ${core[*]}"
  [tokens]="tests/fuzz/fuzz_tokens.cpp src/model/data.cpp src/mla/documents.cpp src/mla/params.cpp src/mla/config.cpp ${core[*]}"
  [manifest]="tests/fuzz/fuzz_manifest.cpp src/model/checkpoint_manifest.cpp"
)
binary_of() { case $1 in config_*) echo config ;; *) echo "$1" ;; esac; }

# Up to one build or run per core at once: each compiler invocation and each
# libFuzzer process is single-threaded.
jobs=$(nproc)
wait_for_slot() {
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
}

built=()
for t in "${targets[@]}"; do
  b=$(binary_of "$t")
  [ -n "${sources[$b]:-}" ] || { echo "fuzz.sh: unknown target '$t'" >&2; exit 2; }
  case " ${built[*]} " in *" $b "*) continue ;; esac
  built+=("$b")
done
for b in "${built[@]}"; do
  wait_for_slot
  echo "fuzz.sh: building fuzz_$b"
  # shellcheck disable=SC2086
  rm -f "$out/build_$b.ok"
  ( "$CXX" "${flags[@]}" ${sources[$b]} -o "$out/fuzz_$b" >"$out/build_$b.log" 2>&1 &&
      touch "$out/build_$b.ok" ) &
done
wait
for b in "${built[@]}"; do
  [ -f "$out/build_$b.ok" ] || {
    cat "$out/build_$b.log" >&2
    echo "fuzz.sh: building fuzz_$b failed (above)" >&2
    exit 2
  }
done

# run_target T: one target for $seconds s; its log in $out/T.log, its result
# in $out/T.result.
run_target() {
  local t=$1 b
  b=$(binary_of "$t")
  mkdir -p "$out/corpus/$t" "$out/artifacts/$t"
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     "$out/fuzz_$b" -max_total_time="$seconds" -runs="${FUZZ_RUNS:--1}" -print_final_stats=1 -rss_limit_mb=2048 \
       -max_len=65536 -timeout=10 -artifact_prefix="$out/artifacts/$t/" \
       "$out/corpus/$t" "tests/fuzz/corpus/$t" >"$out/$t.log" 2>&1; then
    echo ok >"$out/$t.result"
  else
    echo CRASH >"$out/$t.result"
  fi
}
for t in "${targets[@]}"; do
  wait_for_slot
  echo "fuzz.sh: running $t for $seconds s"
  rm -f "$out/$t.result"
  run_target "$t" &
done
wait

status=0
for t in "${targets[@]}"; do
  result=$(cat "$out/$t.result" 2>/dev/null || echo "no result")
  [ "$result" = ok ] || status=1
  # The last status line (#N ... cov: C ft: F corp: ...) and the totals.
  line=$(grep -E '^#[0-9]+' "$out/$t.log" | tail -1 || true)
  execs=$(grep -E 'stat::number_of_executed_units' "$out/$t.log" | awk '{print $2}' || true)
  echo "fuzz.sh: $t: $result; executions ${execs:-?}; last: ${line:-none}"
  [ "$result" = ok ] || tail -40 "$out/$t.log"
done
exit $status
