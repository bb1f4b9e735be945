#include "harness.hpp"

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <memory>

#include "core/error.hpp"
#include "kernels/gemm.hpp"

#if defined(__AVX2__) && defined(__FMA__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace laga::bench {

namespace {

// FMA throughput, not latency: 12 independent accumulator chains cover a
// 4-cycle FMA latency on two FMA ports with room to spare, and nothing is
// loaded or stored inside the loop. Returns FLOPs done by this thread.
#if defined(__AVX2__) && defined(__FMA__)
#define LAGA_R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
double fma_loop_avx2(std::int64_t iters, float* sink) {
#define LAGA_DECL(i) __m256 a##i = _mm256_set1_ps(1.0f + 1e-3f * i);
#define LAGA_FMA(i) a##i = _mm256_fmadd_ps(a##i, x, y);
#define LAGA_SUM(i) s = _mm256_add_ps(s, a##i);
  LAGA_R12(LAGA_DECL)
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (std::int64_t it = 0; it < iters; ++it) {
    LAGA_R12(LAGA_FMA)
  }
  __m256 s = _mm256_setzero_ps();
  LAGA_R12(LAGA_SUM)
  *sink += _mm_cvtss_f32(_mm256_castps256_ps128(s));
#undef LAGA_DECL
#undef LAGA_FMA
#undef LAGA_SUM
  return 12.0 * 8 * 2 * static_cast<double>(iters);
}

// AVX-512 for this function only, whatever the build's flags (docs/build.md:
// not for the whole build); measure_fma_peak calls it only on CPUs with it.
__attribute__((target("avx512f"))) double fma_loop_avx512(std::int64_t iters, float* sink) {
#define LAGA_DECL(i) __m512 a##i = _mm512_set1_ps(1.0f + 1e-3f * i);
#define LAGA_FMA(i) a##i = _mm512_fmadd_ps(a##i, x, y);
#define LAGA_SUM(i) s = _mm512_add_ps(s, a##i);
  LAGA_R12(LAGA_DECL)
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  for (std::int64_t it = 0; it < iters; ++it) {
    LAGA_R12(LAGA_FMA)
  }
  __m512 s = _mm512_setzero_ps();
  LAGA_R12(LAGA_SUM)
  *sink += _mm512_reduce_add_ps(s);
#undef LAGA_DECL
#undef LAGA_FMA
#undef LAGA_SUM
  return 12.0 * 16 * 2 * static_cast<double>(iters);
}

// The bf16 dot-product peak: VDPBF16PS adds two bf16 products into each of
// 16 fp32 lanes (64 FLOP an instruction), what oneDNN's bf16 brgemm kernels
// run on. The same 12 independent chains, no loads; the bf16 operands are
// made once, outside the loop. Run only on CPUs with AVX512_BF16.
__attribute__((target("avx512f,avx512bf16"))) double dpbf16_loop(std::int64_t iters, float* sink) {
#define LAGA_DECL(i) __m512 a##i = _mm512_set1_ps(1.0f + 1e-3f * i);
#define LAGA_DP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
#define LAGA_SUM(i) s = _mm512_add_ps(s, a##i);
  LAGA_R12(LAGA_DECL)
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.999f), _mm512_set1_ps(0.999f));
  const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-7f), _mm512_set1_ps(1e-7f));
  for (std::int64_t it = 0; it < iters; ++it) {
    LAGA_R12(LAGA_DP)
  }
  __m512 s = _mm512_setzero_ps();
  LAGA_R12(LAGA_SUM)
  *sink += _mm512_reduce_add_ps(s);
#undef LAGA_DECL
#undef LAGA_DP
#undef LAGA_SUM
  return 12.0 * 16 * 2 * 2 * static_cast<double>(iters);
}

// The AMX bf16 peak: TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16
// one (stored as 16 rows of 16 bf16 pairs) into a 16 x 16 fp32 tile, 16,384
// FLOP an instruction; what oneDNN's brg:avx512_core_amx_bf16 kernels run
// on. Four independent accumulator tiles over two A and two B tiles loaded
// once, outside the loop: no loads inside it, as the FMA loops. Run only
// where cpu_has_amx_bf16() (the OS has granted the tile data state).
struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
__attribute__((target("amx-tile,amx-bf16"))) double amx_bf16_loop(std::int64_t iters, float* sink) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  alignas(64) std::uint16_t ones[16 * 32];
  for (std::uint16_t& v : ones) v = 0x3f80;  // bf16 1.0
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  for (std::int64_t it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  *sink += out[0];
  return 4.0 * 16 * 16 * 32 * 2 * static_cast<double>(iters);
}
#endif

// All threads run the loop at once (what a kernel on `threads` threads
// competes for: shared cores, turbo limits); the best of `repeats` rounds.
double peak_of(double (*loop)(std::int64_t, float*), int threads, int repeats,
               std::int64_t iters = 20'000'000) {
  double best = 0;
  for (int r = 0; r <= repeats; ++r) {  // round 0 warms up (clocks, pages)
    double flops = 0;
    float sink = 0;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : flops, sink)
    flops += loop(iters, &sink);
    const double dt = omp_get_wtime() - t0;
    if (sink == 42.0f) std::printf(" ");  // keeps the loop observable
    if (r > 0) best = std::max(best, flops / dt * 1e-9);
  }
  return best;
}

double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

bool cpu_has_amx_bf16() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
  // Linux hands out the tile data state only on request (once per process;
  // oneDNN makes the same request): ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA.
  constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return granted;
}

double measure_isa_peak(const std::string& isa, int threads, int repeats) {
  LAGA_CHECK(isa == "avx2" || isa == "avx512" || isa == "bf16" || isa == "amx",
             "laga_bench: no FMA peak loop for ISA '", isa, "'");
  LAGA_CHECK(isa != "amx" || cpu_has_amx_bf16(),
             "laga_bench: a row ran AMX bf16 kernels on a CPU (or OS) without amx-bf16");
  __builtin_cpu_init();
  LAGA_CHECK(isa == "avx2" || isa == "amx" || __builtin_cpu_supports("avx512f"),
             "laga_bench: a row ran ", isa, " kernels on a CPU without avx512f");
  LAGA_CHECK(isa != "bf16" || cpu_has_avx512_bf16(),
             "laga_bench: a row ran bf16 dot-product "
             "kernels on a CPU without avx512bf16");
#if defined(__AVX2__) && defined(__FMA__)
  if (isa == "bf16") return peak_of(&dpbf16_loop, threads, repeats);
  // One TDPBF16PS takes 16 cycles: 2M iterations run as long as the FMA loops' 20M.
  if (isa == "amx") return peak_of(&amx_bf16_loop, threads, repeats, 2'000'000);
  return peak_of(isa == "avx512" ? &fma_loop_avx512 : &fma_loop_avx2, threads, repeats);
#else
  fail("laga_bench: no FMA peak loop for this target; build with AVX2+FMA");
#endif
}

Peak measure_fma_peak(int threads, int repeats) {
  Peak p;
  p.avx2 = measure_isa_peak("avx2", threads, repeats);
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) p.avx512 = measure_isa_peak("avx512", threads, repeats);
  return p;
}

double median(std::vector<double> v) {
  LAGA_CHECK(!v.empty(), "laga_bench: median of an empty sample");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string gemm_isa() {
  return gemm_uses_avx512() ? "avx512" : "avx2";
}

std::string wider_isa(const std::string& a, const std::string& b) {
  return a == "avx512" || b == "avx512" ? "avx512" : "avx2";
}

std::vector<Timing> time_alternating(const std::vector<std::function<void()>>& fns, int warmup,
                                     int repeats, int threads,
                                     const std::function<void()>& between) {
  for (int i = 0; i < warmup; ++i)
    for (const auto& fn : fns) fn();
  std::vector<std::vector<double>> ms(fns.size());
  std::vector<double> wall(fns.size(), 0.0), cpu(fns.size(), 0.0);  // of the timed calls only
  for (int i = 0; i < std::max(1, repeats); ++i) {
    for (size_t f = 0; f < fns.size(); ++f) {
      if (between) between();
      const double cpu0 = cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      fns[f]();
      const auto t1 = std::chrono::steady_clock::now();
      cpu[f] += cpu_seconds() - cpu0;
      ms[f].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      wall[f] += ms[f].back() * 1e-3;
    }
  }
  std::vector<Timing> out(fns.size());
  for (size_t f = 0; f < fns.size(); ++f) {
    Timing& t = out[f];
    t.busy = wall[f] > 0 ? cpu[f] / (wall[f] * std::max(1, threads)) : 0;
    t.median_ms = median(ms[f]);
    const auto [lo, hi] = std::minmax_element(ms[f].begin(), ms[f].end());
    t.min_ms = *lo;
    t.max_ms = *hi;
    t.samples_ms = std::move(ms[f]);
  }
  return out;
}

Timing time_it(const std::function<void()>& fn, int warmup, int repeats, int threads,
               const std::function<void()>& between) {
  return time_alternating({fn}, warmup, repeats, threads, between).front();
}

void Context::header() const {
  std::printf("#\n# %-22s %-36s %9s %10s %9s %-6s %7s %6s %7s\n", "op", "shape", "GFLOP", "ms(med)",
              "GFLOP/s", "isa", "%peak", "busy%", "#wrong");
  std::fflush(stdout);
}

void Context::note(const std::string& text) const {
  std::printf("# %s\n", text.c_str());
  std::fflush(stdout);
}

bool Context::selected(const std::string& op) const {
  if (opt_.ops.empty()) return true;
  for (const std::string& o : opt_.ops)
    if (op.find(o) != std::string::npos) return true;
  return false;
}

Row& Context::run(const std::string& op, const std::string& shape, double gflop,
                  const std::string& isa, const std::function<void()>& fn,
                  const std::function<std::int64_t()>& check,
                  const std::function<void()>& between) {
  static Row skipped;
  if (!selected(op)) return skipped = Row{};
  return *run_alternating({{op, shape, gflop, isa, fn, check}}, between).front();
}

std::vector<Row*> Context::run_alternating(const std::vector<Candidate>& candidates,
                                           const std::function<void()>& between) {
  std::vector<const Candidate*> chosen;
  for (const Candidate& c : candidates)
    if (selected(c.op)) chosen.push_back(&c);
  if (chosen.empty()) return {};
  // The machine's speed drifts over minutes (a shared VM), so the start-up
  // peak can be far from the one the rows ran under: each row is measured
  // against the higher of two peaks of its ISA taken just before and just
  // after the rows, which never flatters it when the drift goes one way. The
  // first also fails early for an ISA this CPU lacks.
  std::vector<std::string> isas;
  for (const Candidate* c : chosen)
    if (std::find(isas.begin(), isas.end(), c->isa) == isas.end()) isas.push_back(c->isa);
  std::vector<double> peak;
  for (const std::string& isa : isas) peak.push_back(measure_isa_peak(isa, opt_.threads, 2));
  std::vector<std::function<void()>> fns;
  for (const Candidate* c : chosen) fns.push_back(c->fn);
  std::vector<Timing> timings =
      time_alternating(fns, opt_.warmup, opt_.repeats, opt_.threads, between);
  for (size_t i = 0; i < isas.size(); ++i)
    peak[i] = std::max(peak[i], measure_isa_peak(isas[i], opt_.threads, 2));

  const size_t first = rows_.size();
  for (size_t k = 0; k < chosen.size(); ++k) {
    const Candidate& c = *chosen[k];
    Row row;
    row.op = c.op;
    row.shape = c.shape;
    row.gflop = c.gflop;
    row.isa = c.isa;
    row.t = std::move(timings[k]);
    row.wrong = c.check ? c.check() : -1;
    const double isa_peak = peak[size_t(std::find(isas.begin(), isas.end(), c.isa) - isas.begin())];
    const double rate = c.gflop / (row.t.median_ms * 1e-3);
    std::printf("  %-22s %-36s %9.2f %10.2f %9.1f %-6s %6.1f%% %5.0f%% %7s\n", c.op.c_str(),
                c.shape.c_str(), c.gflop, row.t.median_ms, rate, c.isa.c_str(),
                100.0 * rate / isa_peak, 100.0 * row.t.busy,
                row.wrong < 0 ? "n/a" : std::to_string(row.wrong).c_str());
    std::fflush(stdout);
    rows_.push_back(std::move(row));
  }
  std::vector<Row*> out;
  for (size_t i = first; i < rows_.size(); ++i) out.push_back(&rows_[i]);
  return out;
}

void Context::print_torch_comparison() const {
  bool any = false;
  for (const Row& r : rows_) any = any || !std::isnan(r.torch_ms);
  if (!any) return;
  std::printf(
      "#\n# laga vs PyTorch eager (python/bench_torch*.py: same shapes, same threads via "
      "torch.set_num_threads, same run); speedup = torch ms / laga ms\n");
  std::printf("# %-22s %-36s %10s %10s %9s\n", "op", "shape", "laga ms", "torch ms", "speedup");
  for (const Row& r : rows_) {
    if (std::isnan(r.torch_ms)) continue;
    std::printf("  %-22s %-36s %10.2f %10.2f %8.2fx\n", r.op.c_str(), r.shape.c_str(),
                r.t.median_ms, r.torch_ms, r.torch_ms / r.t.median_ms);
  }
  std::fflush(stdout);
}

std::string Context::capture(const std::string& command) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), &pclose);
  LAGA_CHECK(pipe, "laga_bench: could not start '", command, "'");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe.get())) > 0) out.append(buf, n);
  const int status = pclose(pipe.release());
  LAGA_CHECK(status == 0, "laga_bench: '", command, "' failed (status ", status,
             "); run it by hand to see its error");
  return out;
}

std::vector<Benchmark>& registry() {
  static std::vector<Benchmark> r;
  return r;
}

bool case_selected(const Options& opt, const std::string& name) {
  if (opt.cases.empty()) return true;
  for (const std::string& c : opt.cases)
    if (name.find(c) != std::string::npos) return true;
  return false;
}

std::string source_dir() {
  return LAGA_SOURCE_DIR;
}

}  // namespace laga::bench
