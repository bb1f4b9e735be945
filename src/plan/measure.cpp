#include "plan/measure.hpp"

#include <immintrin.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "comm/local_comm.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/threads.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash.hpp"
#include "kernels/gemm.hpp"
#include "mla/block.hpp"

namespace laga {

namespace {

using Clock = std::chrono::steady_clock;

// The best of `reps` timings of fn, in seconds: the machine is shared, and
// the fastest run is the one least disturbed.
template <class Fn>
double best_seconds(int reps, Fn&& fn) {
  double best = 1e300;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

double fma_peak() {
  // 8 independent chains hide the FMA latency (4 cycles, 2 ports).
  constexpr int chains = 8;
  constexpr std::int64_t iters = 20'000'000;
  float sink = 0;
  const double s = best_seconds(3, [&] {
    __m256 acc[chains];
    for (int c = 0; c < chains; ++c) acc[c] = _mm256_set1_ps(float(c));
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (std::int64_t i = 0; i < iters; ++i)
      for (int c = 0; c < chains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    __m256 t = acc[0];
    for (int c = 1; c < chains; ++c) t = _mm256_add_ps(t, acc[c]);
    float out[8];
    _mm256_storeu_ps(out, t);
    sink += out[0];
  });
  volatile float keep = sink;  // the chains must not be optimised away
  (void)keep;
  return double(iters) * chains * 8 * 2 / s;
}

std::vector<float> random_floats(std::int64_t n, int stream) {
  std::vector<float> v(static_cast<size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    v[size_t(i)] = float(rng_normal(7, std::uint64_t(stream), std::uint64_t(i)));
  return v;
}

double gemm_rate() {
  const std::int64_t M = 512, N = 512, K = 256;
  const std::vector<float> a = random_floats(M * K, 1), b = random_floats(N * K, 2);
  std::vector<float> c(static_cast<size_t>(M * N));
  const double s = best_seconds(10, [&] {
    gemm<float>(false, true, M, N, K, 1.f, a.data(), K, b.data(), K, 0.f, c.data(), N);
  });
  return 2.0 * M * N * K / s;
}

double flash_rate() {
  AttnShape sh;
  sh.B = 1, sh.Sq = sh.Sk = 1024, sh.Hq = sh.Hk = 4, sh.dqk = 48, sh.dv = 32;
  sh.scale = 1.0 / std::sqrt(48.0);
  const std::int64_t nq = sh.Sq * sh.Hq * sh.dqk, nv = sh.Sq * sh.Hq * sh.dv;
  const std::vector<float> q = random_floats(nq, 3), k = random_floats(nq, 4),
                           v = random_floats(nv, 5), dout = random_floats(nv, 6);
  std::vector<float> o(static_cast<size_t>(nv)), dv(static_cast<size_t>(nv));
  std::vector<float> lse(static_cast<size_t>(sh.Sq * sh.Hq));
  std::vector<float> dq(static_cast<size_t>(nq)), dk(static_cast<size_t>(nq));
  const double s = best_seconds(5, [&] {
    attention_flash_forward(sh, o.data(), lse.data(), q.data(), k.data(), v.data());
    attention_flash_backward(sh, dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                             v.data(), o.data(), lse.data());
  });
  // What the time model counts for flash (block.cpp): forward, and backward
  // at (3 dqk + 2 dv) / (dqk + dv) times forward.
  const double fwd = sh.useful_flops_forward();
  return fwd * (1.0 + (3.0 * sh.dqk + 2.0 * sh.dv) / double(sh.dqk + sh.dv)) / s;
}

double copy_rate() {
  const std::int64_t n = std::int64_t(64) << 20;
  std::vector<char> a(static_cast<size_t>(n), 1), b(static_cast<size_t>(n), 2);
  const double s = best_seconds(5, [&] { std::memcpy(b.data(), a.data(), size_t(n)); });
  return 2.0 * double(n) / s;
}

// 2 in-process ranks, one core each: a 4-byte all-to-all round for the
// latency, 8 MiB ones for the bandwidth.
LinkModel local_link() {
  LinkModel link;
  run_local_ranks(2, [&](Communicator& comm) {
    auto round = [&](std::int64_t n, int reps) {
      std::vector<float> send(static_cast<size_t>(2 * n), 1.f), recv(static_cast<size_t>(2 * n));
      const std::int64_t counts[2] = {n, n}, displs[2] = {0, n};
      return best_seconds(reps, [&] {
        comm.all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs, "measure");
      });
    };
    round(1, 100);  // warm up
    const double small = round(1, 2000);
    const std::int64_t n = std::int64_t(2) << 20;  // 8 MiB of floats to the peer
    const double big = round(n, 10);
    if (comm.rank() == 0) {
      link.latency_s = small;
      link.bytes_per_s = double(n) * 4 / std::max(big - small, 1e-9);
    }
  });
  return link;
}

// CPU seconds of this thread: what a kernel costs on the core it runs on,
// without the time it waited while other processes of a shared machine had
// the core (a rank of a timed run has its own core).
double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// The median of 5 samples of one call of fn in this thread's CPU time, each
// sample enough back-to-back calls to last about 2 ms (one call of a small
// GEMM takes microseconds, below what one clock reading resolves well).
template <class Fn>
double seconds_per_call(Fn&& fn) {
  const double t0 = thread_seconds();
  fn();  // warm-up: the kernel's first call pays for JIT code and page faults
  const double first = thread_seconds() - t0;
  const int calls = static_cast<int>(std::clamp(2e-3 / std::max(first, 1e-9), 1.0, 1e4));
  std::vector<double> sample;
  for (int i = 0; i < 5; ++i) {
    const double s0 = thread_seconds();
    for (int c = 0; c < calls; ++c) fn();
    sample.push_back((thread_seconds() - s0) / calls);
  }
  std::nth_element(sample.begin(), sample.begin() + 2, sample.end());
  return sample[2];
}

// Elements of a row-major (rows, cols) operand with row stride ld.
std::int64_t strided(std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  return rows == 0 ? 0 : (rows - 1) * ld + cols;
}

double time_gemm(const ops::GemmCall& g) {
  const std::int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const std::int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  const std::vector<float> a = random_floats(strided(a_rows, a_cols, g.lda), 11),
                           b = random_floats(strided(b_rows, b_cols, g.ldb), 12);
  std::vector<float> c = random_floats(strided(g.m, g.n, g.ldc), 13);
  return seconds_per_call([&] {
    gemm<float>(g.trans_a, g.trans_b, g.m, g.n, g.k, 1.f, a.data(), g.lda, b.data(), g.ldb,
                g.accumulate ? 1.f : 0.f, c.data(), g.ldc);
  });
}

double time_attention(const ops::AttentionCall& a) {
  AttnShape sh;
  sh.B = a.B, sh.Sq = a.Sq, sh.Sk = a.Sk, sh.Hq = a.Hq, sh.Hk = a.Hk, sh.dqk = a.dqk, sh.dv = a.dv;
  sh.causal = a.causal;
  sh.scale = 1.0 / std::sqrt(double(a.dqk));
  const bool eager = a.kernel == AttentionKind::eager;
  // q (B, Sq, Hq, dqk), k (B, Sk, Hk, dqk), v (B, Sk, Hk, dv), o and dout (B, Sq, Hq, dv).
  const std::vector<float> q = random_floats(a.B * a.Sq * a.Hq * a.dqk, 21),
                           k = random_floats(a.B * a.Sk * a.Hk * a.dqk, 22),
                           v = random_floats(a.B * a.Sk * a.Hk * a.dv, 23),
                           dout = random_floats(a.B * a.Sq * a.Hq * a.dv, 24);
  std::vector<float> o(q.size() / size_t(a.dqk) * size_t(a.dv)), dq(q.size()), dk(k.size()),
      dv(v.size());
  // Eager's probabilities (B, Hq, Sq, Sk) and one head's dp (Sq, Sk); flash's lse (B, Hq, Sq).
  std::vector<float> stats(size_t(a.B * a.Hq * a.Sq * (eager ? a.Sk : 1)));
  std::vector<float> dp(eager ? size_t(a.Sq * a.Sk) : 0);
  auto forward = [&] {
    if (eager)
      attention_eager_forward(sh, o.data(), stats.data(), q.data(), k.data(), v.data());
    else
      attention_flash_forward(sh, o.data(), stats.data(), q.data(), k.data(), v.data());
  };
  if (a.pass == ops::AttentionPass::forward) return seconds_per_call(forward);
  forward();  // backward reads forward's outputs
  return seconds_per_call([&] {
    if (eager)
      attention_eager_backward(sh, dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                               v.data(), stats.data(), dp.data());
    else
      attention_flash_backward(sh, dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                               v.data(), o.data(), stats.data());
  });
}

// A shape is timed when one call is small enough to repeat: at most
// kMaxCallFlops (about 0.1-1 s on one core) and kMaxCallBytes of operands.
constexpr double kMaxCallFlops = 2e10;
constexpr double kMaxCallBytes = double(std::int64_t(1) << 30);

}  // namespace

bool shape_timeable(const ops::GemmCall& g, const ops::CallTally& t) {
  const double bytes = 4.0 * double(strided(g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda) +
                                    strided(g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb) +
                                    strided(g.m, g.n, g.ldc));
  return t.flops / double(t.calls) <= kMaxCallFlops && bytes <= kMaxCallBytes;
}

bool shape_timeable(const ops::AttentionCall& a, const ops::CallTally& t) {
  const double elements =
      double(a.B) * (2.0 * a.Sq * a.Hq * (a.dqk + a.dv) + 2.0 * a.Sk * a.Hk * (a.dqk + a.dv) +
                     (a.kernel == AttentionKind::eager ? double(a.Hq) * a.Sq * a.Sk : 0.0));
  return !a.documents && t.flops / double(t.calls) <= kMaxCallFlops &&
         4.0 * elements <= kMaxCallBytes;
}

int measure_shapes(const ops::OpCounts& calls, ShapeTimes& times,
                   const std::function<void(const std::string&)>& progress) {
  set_rank_threads(1);
  int timed = 0;
  const auto say = [&](const std::string& what) {
    if (progress && timed % 20 == 0) progress(cat("timing ", what, " (", timed, " shapes so far)"));
  };
  for (const auto& [g, tally] : calls.gemm_calls)
    if (!times.gemm.count(g) && shape_timeable(g, tally)) {
      say("GEMM shapes");
      times.gemm[g] = time_gemm(g);
      ++timed;
    }
  for (const auto& [a, tally] : calls.attention_calls)
    if (!times.attention.count(a) && shape_timeable(a, tally)) {
      say("attention shapes");
      times.attention[a] = time_attention(a);
      ++timed;
    }
  return timed;
}

HardwareProfile measure_this_machine(const std::function<void(const std::string&)>& progress) {
  auto say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  set_rank_threads(1);
  HardwareProfile p;
  p.name = "this";
  p.source = "measured";
  const int cores = hardware_cores();
  say("FMA peak of one core");
  const double fma = fma_peak();
  say("GEMM and flash attention on one core");
  const double gemm = gemm_rate(), flash = flash_rate();
  // OpenBLAS may use wider vectors (AVX-512) than laga's -mavx2 build, so its
  // GEMM can beat the AVX2 FMA loop: the peak is the larger of the two.
  const double peak = std::max(fma, gemm);
  say("memory bandwidth of one core");
  const double copy = copy_rate();
  say("the in-process communicator, 2 ranks");
  const LinkModel link = local_link();
  const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  p.description = cat("this machine, measured by laga plan --measure: one device = one core of ",
                      cores, "; GEMM ", gemm / 1e9, " GFLOP/s, flash ", flash / 1e9,
                      " GFLOP/s, AVX2 FMA loop ", fma / 1e9, " GFLOP/s (fp32)");
  p.device.peak_flops_fp32 = peak;
  p.device.gemm_efficiency = std::min(1.0, gemm / peak);
  p.device.attention_efficiency = std::min(1.0, flash / peak);
  p.device.elementwise_bytes_per_s = copy;
  p.device.memory_bytes_per_s = copy;
  p.device.memory_bytes = ram / cores;
  p.devices_per_node = cores;
  p.intra_node = p.inter_node = link;
  return p;
}

}  // namespace laga
