#!/usr/bin/env python3
"""Mutation check of the test suite (not CI: it rebuilds once per mutation).

    python3 scripts/mutate.py [--build-dir DIR] [--jobs N] [--only NAME,...]

Copies the working tree (tracked and untracked files, not build outputs) to
DIR/src, builds the test binaries listed in TESTS there once, then for each
mutation in MUTATIONS, one at a time: applies it to the copy (the text must
occur exactly once, so a mutation that no longer applies is an error, not a
silent pass), rebuilds, runs TESTS with ctest, records which fail, and
reverts. A mutation whose tree does not build is reported as not applied
(nothing ran), never as caught. Prints a Markdown table (mutation, tests that failed) and exits 1
if any mutation was caught by no test, or could not be applied.

The working tree itself is never modified. ccache (CMAKE_*_COMPILER_LAUNCHER)
makes the rebuilds cheap; run it under `nice` on a shared machine.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests every mutation is run against (ctest names; binaries of the same
# name are the build targets, the Python fixture needs none).
TESTS = [
    "kernels_test_rmsnorm", "kernels_test_rope", "kernels_test_attention_packed",
    "core_test_memory_pool", "test_comm_local", "mla_test_config", "mla_test_comm_model",
    "mla_test_block_grad", "mla_test_forms", "mla_test_naive_mla", "mla_test_work_model",
    "mla_test_torch_reference", "plan_test_time_model", "tools_test_memory_check_figure",
    "io_safetensors_set",
]

# (name, what it breaks, file, original text, mutated text)
MUTATIONS = [
    ("rmsnorm_eps_x10", "the RMSNorm epsilon, 10x (forward kernel)", "src/kernels/rmsnorm.cpp",
     "ss / static_cast<T>(C) + static_cast<T>(eps) * s * s);",
     "ss / static_cast<T>(C) + static_cast<T>(10 * eps) * s * s);"),
    ("softmax_scale_1e-4", "the softmax scale, relative +1e-4", "src/mla/config.cpp",
     "    s *= m * m;\n  }\n  return s;", "    s *= m * m;\n  }\n  return s * (1 + 1e-4);"),
    ("rope_freq_1", "RoPE pair 1's frequency, relative +1e-3", "src/kernels/rope.cpp",
     "  if (!p.yarn) return freqs;",
     "  freqs[1] *= 1.001;\n  if (!p.yarn) return freqs;"),
    ("yarn_ramp", "YaRN's ramp one pair wider", "src/kernels/rope.cpp",
     "(static_cast<double>(i) - low) / (high - low)",
     "(static_cast<double>(i) - low) / (high - low + 1)"),
    ("all_gather_bytes", "the all-gather byte rule: P copies sent instead of P - 1",
     "src/comm/ledger.cpp",
     # No rank is r - P, so each_peer counts a copy for the own rank too (r stays in use).
     "  return each_peer(P, r, dtype, [&](int j) { return std::pair{send_count, recv_counts[j]}; });",
     "  return each_peer(P, r - P, dtype, [&](int j) { return std::pair{send_count, "
     "recv_counts[j]}; });"),
    ("rmsnorm_grad_term", "RMSNorm backward without its mean term", "src/kernels/rmsnorm.cpp",
     "dxr[c] = r * (w[c] * dyr[c] - xhat * k);", "dxr[c] = r * (w[c] * dyr[c] + 0 * k);"),
    # Issue 29: one for each part added since the list above was written.
    ("plan_classes_by_shard", "the planner's rank classes keyed on the shards alone (the "
     "shipped bug: laga2d's ranks of equal shards send different bytes)",
     "src/plan/time_model.cpp", "const Key key{layout.seq_count[u], own,",
     "const Key key{layout.seq_count[u], 0,"),
    ("cache_bound_x2", "the block cache's share of the held bound (and so of the memory "
     "check's allowance) doubled", "src/core/memory_pool.cpp",
     "std::ceil(factor * double(cache_.stats().live_peak))",
     "std::ceil(2 * factor * double(cache_.stats().live_peak))"),
    ("memory_check_one_rank", "the memory check counts one rank of a local run, not all P",
     "src/tools/memory_check.cpp", "(all_here ? sum : worst) + held_shared",
     "worst + held_shared"),
    ("packed_mask_leak", "the packed mask lets a row see the previous document's last key",
     "src/kernels/attention.hpp", "return doc_start == nullptr || t < 0 ? 0 : doc_start[b * Sk + t];",
     "return doc_start == nullptr || t < 0 ? 0\n"
     "         : (doc_start[b * Sk + t] > 0 ? doc_start[b * Sk + t] - 1 : 0);"),
    ("laga2d_chunks_unmirrored", "laga2d's context group c takes chunks c and Pc + c, not its "
     "mirror 2Pc - 1 - c (still a tiling: only the balance shows it)", "src/mla/layout.cpp",
     "for (const int k : {r % Pc, 2 * Pc - 1 - r % Pc}) {",
     "for (const int k : {r % Pc, Pc + r % Pc}) {"),
    ("overlap_read_before_wait", "--overlap on up-projects the gathered latent before its "
     "all-gather's wait", "src/mla/laga_inputs.cpp",
     "    r.q_h = latent ? exchange_query_latent(st, w) : P::queries_to_heads(st, w, in);\n"
     "    lat_ag.wait(st.ctx.comm);\n",
     "    r.q_h = latent ? exchange_query_latent(st, w) : P::queries_to_heads(st, w, in);\n"
     "    P::up_project_kv(st, w, lat, st.Sk, r.k_h, r.v_h);\n"
     "    lat_ag.wait(st.ctx.comm);\n    return r;\n"),
    ("overlap_backward_before_wait", "--overlap on runs the latent norm's backward before the "
     "reduce-scatter's wait", "src/mla/pieces.cpp",
     "    dlat_pending->wait(st.ctx.comm);\n"
     "    latent_norm_backward(st, w, dlat_loc, in, dproj, grads);\n",
     "    latent_norm_backward(st, w, dlat_loc, in, dproj, grads);\n"
     "    dlat_pending->wait(st.ctx.comm);\n"),
    ("overlap_send_released", "a started latent all-gather's send buffer freed at start, not at "
     "its wait (a use-after-free on an asynchronous transport)", "src/mla/exchange.cpp",
     "                                    label);\n  return s;\n}\n\ntemplate <class T>\n"
     "StartedSeq<T> start_reduce_scatter_seq",
     "                                    label);\n  s.send_.reset();\n  return s;\n}\n\n"
     "template <class T>\nStartedSeq<T> start_reduce_scatter_seq"),
    # Issue 26: real checkpoints (fp8 block scales, sharded indexes).
    ("fp8_scale_column_127", "the fp8 block scale's column taken as j / 127, not j / 128",
     "src/io/safetensors_set.cpp", "s_row[j / kFp8BlockSize]", "s_row[j / (kFp8BlockSize - 1)]"),
    ("fp8_scale_grid_floor", "the scale grid rounded down (the ragged last block row dropped)",
     "src/io/safetensors_set.cpp",
     "const std::int64_t R = (M + kFp8BlockSize - 1) / kFp8BlockSize;",
     "const std::int64_t R = M / kFp8BlockSize + (M < kFp8BlockSize);"),
    ("fp8_subnormal_2^-10", "F8_E4M3 subnormals as m * 2^-10, not m * 2^-9",
     "src/io/safetensors.cpp", "* 0x1p-9f;", "* 0x1p-10f;"),
    ("index_listed_twice", "a key repeated in the index accepted (for a tensor: the last shard "
     "wins)", "src/io/safetensors_set.cpp", "duplicate = key, duplicate_is_tensor = in_map;",
     "duplicate_is_tensor = false;"),
    ("index_two_shards", "a tensor held by two opened shards accepted",
     "src/io/safetensors_set.cpp", "placed == weight_map_.end() || placed->second == shard,",
     "true,"),
    ("index_dotdot", "a shard path climbing out with '..' accepted",
     "src/io/safetensors_set.cpp", "climbs = climbs || part == \"..\";",
     "climbs = climbs || part == \"...\";"),
    ("scale_without_weight", "a _scale_inv without its weight accepted",
     "src/io/safetensors_set.cpp", "LAGA_CHECK(contains(weight),", "LAGA_CHECK(true,"),
    ("shards_opened_eagerly", "every shard of the index opened at open, not when read",
     "src/io/safetensors_set.cpp", "  set.check_scales_have_weights();\n",
     "  set.check_scales_have_weights();\n"
     "  for (const auto& entry : set.weight_map_) (void)set.file_of(entry.first);\n"),
    ("ring_merge_unscaled", "a ring step's merge keeps the running output unscaled (drops "
     "e^(lse - lse'))", "src/kernels/lse_merge.cpp",
     "const T a = std::exp(l - merged), w = std::exp(lp - merged);",
     "const T a = 1, w = std::exp(lp - merged);"),
    ("ring_grad_not_home", "the ring's gradient accumulators miss their last shift home",
     "src/mla/ring.hpp", "      if (ranks > 1) {\n        Tensor<T> arriving",
     "      if (ranks > 1 && i + 1 < ranks) {\n        Tensor<T> arriving"),
    ("ring_eager_probs_unrescaled", "eager's per-step probabilities left normalised over their "
     "own block", "src/mla/ops_attention.hpp",
     "++p) *p *= f;", "++p) *p *= T(1) + T(0) * f;"),
    ("ring_packed_whole_block", "a past block's keys seen from the block's start, across the "
     "document boundary", "src/mla/ring.hpp",
     "const std::int64_t lo = std::max(k0, start) - k0;",
     "const std::int64_t lo = 0 * (std::max(k0, start) - k0);"),
]


def sh(cmd, cwd, log):
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode


def copy_tree(dst):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, rel))


def failed_tests(build, log, jobs):
    out = os.path.join(build, "mutate_ctest.log")
    sh(["ctest", "--test-dir", build, "-j", str(jobs), "--no-tests=error", "--output-log", out,
        "-R", "^(" + "|".join(TESTS + ["mla_torch_reference_data"]) + ")$"], ROOT, log)
    with open(out) as f:
        text = f.read()
    # ctest's summary: "The following tests FAILED:" then "  12 - name (Failed)".
    tail = text.split("The following tests FAILED:")[-1] if "tests FAILED" in text else ""
    return sorted(set(re.findall(r"^\s*\d+ - (\S+) \(", tail, re.M)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-mutate"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated mutation names")
    a = ap.parse_args()
    work = os.path.abspath(a.build_dir)
    src, build, log = os.path.join(work, "src"), os.path.join(work, "build"), \
        os.path.join(work, "mutate.log")
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    copy_tree(src)
    launcher = ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DCMAKE_C_COMPILER_LAUNCHER=ccache"] \
        if shutil.which("ccache") else []
    if sh(["cmake", "-S", src, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
           "-DLAGA_WERROR=ON"] + launcher, ROOT, log) != 0:
        sys.exit(f"mutate: configuring failed, see {log}")
    build_cmd = ["cmake", "--build", build, "-j", str(a.jobs), "--target"] + TESTS
    if sh(build_cmd, ROOT, log) != 0:
        sys.exit(f"mutate: the unmutated build failed, see {log}")
    clean = failed_tests(build, log, a.jobs)
    if clean:
        sys.exit(f"mutate: the unmutated tree already fails {clean}; fix that first")

    only = set(filter(None, a.only.split(",")))
    rows, bad = [], []
    for name, what, rel, old, new in MUTATIONS:
        if only and name not in only:
            continue
        path = os.path.join(src, rel)
        with open(path) as f:
            text = f.read()
        if text.count(old) != 1:
            rows.append((name, what, rel, f"NOT APPLIED: the text occurs {text.count(old)} times"))
            bad.append(name)
            continue
        try:
            with open(path, "w") as f:
                f.write(text.replace(old, new))
            # A mutation that does not build was never run: not applied, not
            # caught (a test cannot see what does not exist).
            built = sh(build_cmd, ROOT, log) == 0
            caught = failed_tests(build, log, a.jobs) if built else []
        finally:
            with open(path, "w") as f:
                f.write(text)
        if not built:
            print(f"mutate: {name}: NOT APPLIED (the mutated tree does not build)", flush=True)
            rows.append((name, what, rel, "**not applied: does not build**"))
            bad.append(name)
            continue
        print(f"mutate: {name}: {', '.join(caught) or 'NOT CAUGHT'}", flush=True)
        rows.append((name, what, rel, ", ".join(f"`{t}`" for t in caught) or "**not caught**"))
        if not caught:
            bad.append(name)
    sh(build_cmd, ROOT, log)  # leave the copy built unmutated

    print("\n| mutation | what it breaks | file | tests that fail |")
    print("|---|---|---|---|")
    for name, what, rel, caught in rows:
        print(f"| `{name}` | {what} | `{rel}` | {caught} |")
    if bad:
        print(f"\nmutate: not caught or not applied: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
