#include "plan/measure.hpp"

#include <immintrin.h>
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

}  // namespace

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
