// The benchmark harness behind `laga_bench`: one small set of tools, one thin
// file per benchmark (bench_*.cpp), in the spirit of nccl-tests.
//
// A benchmark is a function registered under a name with LAGA_BENCH. It builds
// its inputs, computes a reference once, and for every kernel and shape calls
// Context::run(), which warms up, times the median of --repeats runs, counts
// wrong elements against the reference, and prints one table row with the
// GFLOP/s and its share of the FMA peak of the instruction set the row's
// kernels ran, measured on the same threads right before and right after the
// row (the higher of the two). Adding a benchmark
// (e.g. a whole MLA block per form) is one more bench_<name>.cpp with a
// LAGA_BENCH(...) in it; CMake globs them.
//
// FLOP convention: a row's GFLOP is the useful work of the operation as the
// benchmark defines it (for attention: only the unmasked half of a causal
// product, see bench_attention.cpp), not what a given kernel happens to
// execute, so rows of different kernels for one operation are comparable.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace laga::bench {

struct Options {
  int threads = 2;
  int repeats = 5;  // timed runs; the median is reported
  int warmup = 1;
  bool torch = false;  // also run python/bench_torch.py on the same shapes
  bool quick = false;  // smaller shapes (a smoke test of the harness itself)
  std::string python = "/usr/bin/python3";
  std::vector<std::string> filters;  // run benchmarks whose name contains one of these
  std::vector<std::string> cases;    // ... and of their cases those that contain one of these
  std::vector<std::string> ops;      // ... and of their rows those whose op contains one of these
};

// GFLOP/s of a register-resident FMA loop (no loads) run on `threads` threads
// at once, per instruction set: the ceiling no kernel of that ISA can pass.
// The peak of one ISA ("avx2" or "avx512": fp32 FMA; "bf16": AVX512_BF16's
// VDPBF16PS, two bf16 products summed into each fp32 lane; "amx": AMX's
// TDPBF16PS, a 16 x 32 by 32 x 16 bf16 tile product a call) now, best of
// `repeats` rounds; throws for an ISA this CPU lacks.
double measure_isa_peak(const std::string& isa, int threads, int repeats);
// Both, for the header of a run; avx512 is 0 on a CPU without AVX-512F.
struct Peak {
  double avx2 = 0, avx512 = 0;
};
Peak measure_fma_peak(int threads, int repeats);
// Whether this CPU (and its OS) runs AVX512_BF16, the "bf16" peak's loop.
bool cpu_has_avx512_bf16();
// Whether this CPU has AMX's bf16 tiles and the OS grants their state: the
// "amx" peak's loop (TDPBF16PS), where oneDNN's AMX bf16 kernels run.
bool cpu_has_amx_bf16();

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  std::vector<double> samples_ms;  // the timed calls in the order they ran
  // Process CPU time over (wall time x threads) of the timed runs: 100% when
  // the kernel's threads had their cores to themselves the whole time (or
  // spun), less when other processes took turns on them. A row with a low
  // busy% says more about the machine than about the kernel.
  double busy = 0;
};
// Runs fn `warmup` times, then `repeats` times timed; median, min, max.
// `between`, when given, runs before each timed call, outside the timing (a
// PyTorch peer's step, so that the two alternate: bench/torch_peer.hpp).
Timing time_it(const std::function<void()>& fn, int warmup, int repeats, int threads,
               const std::function<void()>& between = {});
// The same for several functions at once, alternating: every warm-up round
// and every timed round calls each of fns in turn, so that a drift of the
// machine's speed falls on all of them alike (libraries compared side by
// side). One Timing per function, in order.
std::vector<Timing> time_alternating(const std::vector<std::function<void()>>& fns, int warmup,
                                     int repeats, int threads,
                                     const std::function<void()>& between = {});

// Median of a non-empty sample (mean of the middle two for an even count).
double median(std::vector<double> v);

// Elements of `got` farther than rel * max|ref| from `ref`, NaN and Inf
// counted as wrong: the nccl-tests "#wrong" column.
template <class T, class R>
std::int64_t count_wrong(const T* got, const R* ref, std::int64_t n, double rel) {
  double mx = 0;
  for (std::int64_t i = 0; i < n; ++i) mx = std::max(mx, std::abs(static_cast<double>(ref[i])));
  const double tol = rel * mx;
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double d = std::abs(static_cast<double>(got[i]) - static_cast<double>(ref[i]));
    if (!(d <= tol)) ++wrong;  // NaN compares false
  }
  return wrong;
}

// The ISA of the kernels laga::gemm<float> runs (oneDNN's JIT): avx512, else
// avx2 (an older one's rows a %peak against AVX2 understates).
std::string gemm_isa();
// The wider of two ISA names, for a row whose kernels ran both.
std::string wider_isa(const std::string& a, const std::string& b);

struct Row {
  std::string op;     // "attn_flash_fwd", "sgemm", ...
  std::string shape;  // a compact description of the extents
  double gflop = 0;   // useful work, by the benchmark's stated convention
  std::string isa;    // of its kernels, the widest if several: %peak is against its peak
  Timing t;
  std::int64_t wrong = -1;                                     // -1: not checked
  double torch_ms = std::numeric_limits<double>::quiet_NaN();  // same op in PyTorch, if run
};

// One row of Context::run_alternating: what Context::run takes.
struct Candidate {
  std::string op, shape;
  double gflop = 0;
  std::string isa;
  std::function<void()> fn;
  std::function<std::int64_t()> check;
};

class Context {
 public:
  explicit Context(Options opt) : opt_(std::move(opt)) {}
  const Options& options() const { return opt_; }

  // Times `fn` (after warm-up), then calls `check` once on the last run's
  // outputs for the #wrong column, prints and records the row; `isa` is the
  // instruction set fn's kernels run (the widest, if several), whose peak the
  // row's %peak is against. A row that --op does not select is neither run nor
  // printed (the returned row is a scratch one). `between`: as in time_it.
  Row& run(const std::string& op, const std::string& shape, double gflop, const std::string& isa,
           const std::function<void()>& fn, const std::function<std::int64_t()>& check,
           const std::function<void()>& between = {});
  // Context::run for several rows timed alternately (time_alternating): the
  // rows --op selects, in order; pointers into rows() until the next run.
  std::vector<Row*> run_alternating(const std::vector<Candidate>& candidates,
                                    const std::function<void()>& between = {});
  // Whether --op selects rows named `op`.
  bool selected(const std::string& op) const;
  // Prints a line prefixed with '#', nccl-tests style, between table rows.
  void note(const std::string& text) const;
  // Prints the table header (once per benchmark; repeated headers are cheap).
  void header() const;
  std::vector<Row>& rows() { return rows_; }
  // Reprints the rows that have a PyTorch timing, with laga/PyTorch ratios.
  void print_torch_comparison() const;
  // Runs a command (e.g. python/bench_torch.py), returns its standard output;
  // throws laga::Error naming the command when it fails.
  static std::string capture(const std::string& command);

 private:
  Options opt_;
  std::vector<Row> rows_;
};

using BenchFn = void (*)(Context&);
struct Benchmark {
  std::string name, help;
  BenchFn fn;
};
std::vector<Benchmark>& registry();
struct Registrar {
  Registrar(const char* name, const char* help, BenchFn fn) {
    registry().push_back({name, help, fn});
  }
};

// Whether a benchmark's case named `name` is selected by --case.
bool case_selected(const Options& opt, const std::string& name);

// Source tree root, for scripts the harness calls (python/bench_torch.py).
std::string source_dir();

}  // namespace laga::bench

#define LAGA_BENCH_CAT2(a, b) a##b
#define LAGA_BENCH_CAT(a, b) LAGA_BENCH_CAT2(a, b)
// LAGA_BENCH(attention, "help") { ... ctx.run(...) ... }
#define LAGA_BENCH(name, help)                                                                     \
  static void laga_bench_##name(::laga::bench::Context& ctx);                                      \
  static const ::laga::bench::Registrar LAGA_BENCH_CAT(laga_bench_reg_, name)(#name, help,         \
                                                                              &laga_bench_##name); \
  static void laga_bench_##name(::laga::bench::Context& ctx)
