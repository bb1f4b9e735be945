#include "plan/measure.hpp"

#include <immintrin.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
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
#include "kernels/swiglu.hpp"
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
  // What the time model counts for flash (mla/ops_attention.cpp): forward, and backward
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

// How many copies of a call's operands (`bytes` each) a timing cycles
// through: enough that together they are four times this core's L2, so
// each timed call reads its operands from L3 or memory, as a call inside a
// block step does (between two uses of a tensor a step touches megabytes of
// others). An LRU cache cycled over more than its size keeps none of it;
// four times, not just over one, because L2 is neither strictly LRU nor
// alone (the prefetchers). On this machine the sum of a step's GEMMs timed
// this way came 4-16% under the same calls timed inside `laga compare`
// steps, against 10-30% under when timed warm on one set of operands
// (docs/planning.md, "Where the error went").
int operand_sets(double bytes) {
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  const double footprint = 4.0 * double(l2 > 0 ? l2 : 1 << 20);
  return static_cast<int>(std::clamp(std::ceil(footprint / std::max(bytes, 1.0)), 1.0, 64.0));
}

// The median of 9 samples of one call in this thread's CPU time, each
// sample enough back-to-back calls to last about 2 ms (one call of a small
// GEMM takes microseconds, below what one clock reading resolves well).
// call(i) runs the kernel on operand set i % sets.
template <class Call>
double seconds_per_call(int sets, Call&& call) {
  for (int i = 0; i < sets; ++i) call(i);  // the first calls pay for JIT code and page faults
  const double t0 = thread_seconds();
  call(0);
  const double first = thread_seconds() - t0;
  const int calls = static_cast<int>(std::clamp(2e-3 / std::max(first, 1e-9), 1.0, 1e4));
  std::vector<double> sample;
  int next = 1;
  constexpr int samples = 9;  // the median shrugs off a few disturbed by the rest of the machine
  for (int i = 0; i < samples; ++i) {
    const double s0 = thread_seconds();
    for (int c = 0; c < calls; ++c) call(next++ % sets);
    sample.push_back((thread_seconds() - s0) / calls);
  }
  std::nth_element(sample.begin(), sample.begin() + samples / 2, sample.end());
  return sample[samples / 2];
}

// Exponentials a second in the elementwise kernels that call one per
// element: swiglu_forward (h = a sigmoid(a) b, a double exp and a division
// per element) on one thread, 16K elements a call (192 KiB of operands: a
// layer's shard-sized loop, from L2).
double exp_rate() {
  const std::int64_t n = 16 << 10;
  const std::vector<float> a = random_floats(n, 21), b = random_floats(n, 22);
  std::vector<float> h(static_cast<size_t>(n));
  return double(n) /
         seconds_per_call(1, [&](int) { swiglu_forward(h.data(), a.data(), b.data(), n); });
}

// Elements of a row-major (rows, cols) operand with row stride ld.
std::int64_t strided(std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  return rows == 0 ? 0 : (rows - 1) * ld + cols;
}

// A, B and C of one GEMM call, in elements.
std::array<std::int64_t, 3> gemm_operands(const ops::GemmCall& g) {
  return {strided(g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda),
          strided(g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb), strided(g.m, g.n, g.ldc)};
}

double time_gemm(const ops::GemmCall& g) {
  const auto [na, nb, nc] = gemm_operands(g);
  struct Operands {
    std::vector<float> a, b, c;
  };
  std::vector<Operands> set(size_t(operand_sets(4.0 * double(na + nb + nc))));
  for (Operands& x : set) x = {random_floats(na, 11), random_floats(nb, 12), random_floats(nc, 13)};
  return seconds_per_call(int(set.size()), [&](int i) {
    Operands& x = set[size_t(i)];
    gemm<float>(g.trans_a, g.trans_b, g.m, g.n, g.k, 1.f, x.a.data(), g.lda, x.b.data(), g.ldb,
                g.accumulate ? 1.f : 0.f, x.c.data(), g.ldc);
  });
}

// Elements of one attention call's operands: q, k, v, o, dout, dq, dk, dv,
// and eager's probabilities (B, Hq, Sq, Sk) or flash's lse (B, Hq, Sq).
double attention_elements(const ops::AttentionCall& a) {
  const double B = double(a.B);
  return B * (2.0 * a.Sq * a.Hq * (a.dqk + a.dv) + 2.0 * a.Sk * a.Hk * (a.dqk + a.dv) +
              double(a.Hq) * a.Sq * (a.kernel == AttentionKind::eager ? double(a.Sk) : 1.0));
}

double time_attention(const ops::AttentionCall& a) {
  AttnShape sh;
  sh.B = a.B, sh.Sq = a.Sq, sh.Sk = a.Sk, sh.Hq = a.Hq, sh.Hk = a.Hk, sh.dqk = a.dqk, sh.dv = a.dv;
  sh.causal = a.causal;
  sh.scale = 1.0 / std::sqrt(double(a.dqk));
  const bool eager = a.kernel == AttentionKind::eager;
  // q (B, Sq, Hq, dqk), k (B, Sk, Hk, dqk), v (B, Sk, Hk, dv), o and dout (B, Sq, Hq, dv);
  // stats: eager's probabilities (B, Hq, Sq, Sk), flash's lse (B, Hq, Sq); dp: eager's one
  // head's (Sq, Sk).
  struct Operands {
    std::vector<float> q, k, v, dout, o, stats, dq, dk, dv, dp;
  };
  const std::int64_t nq = a.B * a.Sq * a.Hq * a.dqk, nk = a.B * a.Sk * a.Hk * a.dqk,
                     nv = a.B * a.Sk * a.Hk * a.dv, no = a.B * a.Sq * a.Hq * a.dv;
  std::vector<Operands> set(size_t(operand_sets(4.0 * attention_elements(a))));
  for (Operands& x : set) {
    x.q = random_floats(nq, 21), x.k = random_floats(nk, 22), x.v = random_floats(nv, 23);
    x.dout = random_floats(no, 24);
    x.o.resize(size_t(no)), x.dq.resize(size_t(nq)), x.dk.resize(size_t(nk));
    x.dv.resize(size_t(nv));
    x.stats.resize(size_t(a.B * a.Hq * a.Sq * (eager ? a.Sk : 1)));
    x.dp.resize(eager ? size_t(a.Sq * a.Sk) : 0);
  }
  auto forward = [&](int i) {
    Operands& x = set[size_t(i)];
    if (eager)
      attention_eager_forward(sh, x.o.data(), x.stats.data(), x.q.data(), x.k.data(), x.v.data());
    else
      attention_flash_forward(sh, x.o.data(), x.stats.data(), x.q.data(), x.k.data(), x.v.data());
  };
  if (a.pass == ops::AttentionPass::forward) return seconds_per_call(int(set.size()), forward);
  for (int i = 0; i < int(set.size()); ++i) forward(i);  // backward reads forward's outputs
  return seconds_per_call(int(set.size()), [&](int i) {
    Operands& x = set[size_t(i)];
    if (eager)
      attention_eager_backward(sh, x.dq.data(), x.dk.data(), x.dv.data(), x.dout.data(), x.q.data(),
                               x.k.data(), x.v.data(), x.stats.data(), x.dp.data());
    else
      attention_flash_backward(sh, x.dq.data(), x.dk.data(), x.dv.data(), x.dout.data(), x.q.data(),
                               x.k.data(), x.v.data(), x.o.data(), x.stats.data());
  });
}

// A shape is timed when one call is small enough to repeat: at most
// kMaxCallFlops (about 0.1-1 s on one core) and kMaxCallBytes of operands.
constexpr double kMaxCallFlops = 2e10;
constexpr double kMaxCallBytes = double(std::int64_t(1) << 30);

}  // namespace

bool shape_timeable(const ops::GemmCall& g, const ops::CallTally& t) {
  const auto [na, nb, nc] = gemm_operands(g);
  return t.flops / double(t.calls) <= kMaxCallFlops && 4.0 * double(na + nb + nc) <= kMaxCallBytes;
}

bool shape_timeable(const ops::AttentionCall& a, const ops::CallTally& t) {
  return a.costed_by_extents() && t.flops / double(t.calls) <= kMaxCallFlops &&
         4.0 * attention_elements(a) <= kMaxCallBytes;
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
  say("the elementwise kernels' exponentials on one core");
  const double exps = exp_rate();
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
  p.device.exp_per_s = exps;
  p.device.memory_bytes = ram / cores;
  p.devices_per_node = cores;
  p.shared_cores = cores;  // laga's ranks here are threads sharing these cores
  p.intra_node = p.inter_node = link;
  return p;
}

}  // namespace laga
