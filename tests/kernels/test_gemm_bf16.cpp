// gemm_bf16 (oneDNN's bf16 matmul, fp32 accumulation) and the bf16 linear
// layers against a naive double reference on the same bf16 inputs. CTest runs
// this binary on each path (LAGA_GEMM_BF16=onednn_bf16 and widened_fp32, and
// auto, whichever this CPU takes), and again with ONEDNN_MAX_CPU_ISA=
// AVX512_CORE (oneDNN's bf16 emulation, no AVX512_BF16) and =AVX2 (no bf16
// matmul: widened), so every path is checked on an AVX512_BF16 CPU.
//
// The bound. bf16 inputs are exact in fp32 and each product of two is exact
// in fp32 (8 + 8 significand bits), so the only errors are the fp32 sums of
// K products, in whatever order and blocking the kernel adds them, each
// addition off by at most u = 2^-24 relative (round to nearest; Higham,
// Accuracy and Stability, 3.1): |sum - exact| <= gamma_K sum |a_k b_k| with
// gamma_K ~ K u. alpha's scale and beta's sum add two more roundings, so
//   |C - ref| <= (K + 2) 2^-24 (|alpha| sum_k |a_ik b_kj| + |beta| |C0_ij|)
// for an fp32 C, plus, for a bf16 C, one rounding of the result to bf16:
//   + 2^-8 |ref| (RNE to 8 significand bits: half an ulp, 2^-8 relative).
#include "kernels/gemm_bf16.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/check.hpp"
#include "common/error_of.hpp"
#include "common/threads.hpp"
#include "core/bf16.hpp"

namespace laga {
namespace {

constexpr double kU = 0x1.0p-24;     // fp32 unit roundoff
constexpr double kUBf16 = 0x1.0p-8;  // bf16 unit roundoff

std::vector<bf16> random_bf16(std::int64_t n, std::uint64_t seed) {
  const std::vector<float> f = test::random_vector<float>(n, seed);
  std::vector<bf16> b(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) b[i] = to_bf16(f[i]);
  return b;
}

double widen(float x) {
  return x;
}
double widen(bf16 x) {
  return to_float(x);
}

template <class TC>
TC from_float(float x) {
  if constexpr (std::is_same_v<TC, bf16>)
    return to_bf16(x);
  else
    return x;
}

template <class TC>
const char* name_of() {
  return std::is_same_v<TC, bf16> ? "bf16" : "fp32";
}

// Checks C against the double reference of alpha op(A) op(B) + beta C0 with
// the bound above, and that C's padding (columns N..ldc) kept C0.
template <class TC>
void expect_within_bound(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K,
                         float alpha, const std::vector<bf16>& A, std::int64_t lda,
                         const std::vector<bf16>& B, std::int64_t ldb, float beta,
                         const std::vector<TC>& C0, const std::vector<TC>& C, std::int64_t ldc) {
  const double out_rounding = std::is_same_v<TC, bf16> ? kUBf16 : 0.0;
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < ldc; ++j) {
      const std::int64_t at = i * ldc + j;
      if (j >= N) {
        ASSERT_EQ(std::memcmp(&C[std::size_t(at)], &C0[std::size_t(at)], sizeof(TC)), 0)
            << "gemm_bf16 wrote C's padding at (" << i << ", " << j << ")";
        continue;
      }
      double acc = 0, mag = 0;
      for (std::int64_t k = 0; k < K; ++k) {
        const double a = widen(ta ? A[std::size_t(k * lda + i)] : A[std::size_t(i * lda + k)]);
        const double b = widen(tb ? B[std::size_t(j * ldb + k)] : B[std::size_t(k * ldb + j)]);
        acc += a * b;
        mag += std::abs(a * b);
      }
      const double c0 = beta == 0.0f ? 0.0 : widen(C0[std::size_t(at)]);  // beta 0: C0 unread
      const double ref = double(alpha) * acc + double(beta) * c0;
      const double bound =
          double(K + 2) * kU * (std::abs(double(alpha)) * mag + std::abs(double(beta) * c0)) +
          out_rounding * std::abs(ref);
      const double got = widen(C[std::size_t(at)]);
      ASSERT_LE(std::abs(got - ref), bound)
          << name_of<TC>() << " C(" << i << ", " << j << "): gemm_bf16 " << got << " reference "
          << ref << " (M " << M << " N " << N << " K " << K << " trans_a " << ta << " trans_b "
          << tb << " lda " << lda << " ldb " << ldb << " ldc " << ldc << " alpha " << alpha
          << " beta " << beta << ")";
    }
}

// A = [[1 2 3] [4 5 6]] (2x3), B = [[7 8] [9 10] [11 12]] (3x2): 2 AB - 1 =
// [[115 127] [277 307]], exact in fp32; a bf16 C rounds the last two.
template <class TC>
void hand_computed_all_transposes() {
  const std::vector<float> a{1, 2, 3, 4, 5, 6}, at{1, 4, 2, 5, 3, 6};
  const std::vector<float> b{7, 8, 9, 10, 11, 12}, bt{7, 9, 11, 8, 10, 12};
  auto to_b = [](const std::vector<float>& v) {
    std::vector<bf16> out;
    for (float x : v) out.push_back(to_bf16(x));
    return out;
  };
  const std::vector<bf16> A = to_b(a), At = to_b(at), B = to_b(b), Bt = to_b(bt);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(testing::Message() << name_of<TC>() << " trans_a " << ta << " trans_b " << tb);
      std::vector<TC> c(4, from_float<TC>(1.0f));
      gemm_bf16<TC>(ta, tb, 2, 2, 3, 2.0f, (ta ? At : A).data(), ta ? 2 : 3, (tb ? Bt : B).data(),
                    tb ? 3 : 2, -1.0f, c.data(), 2);
      // fp32 holds them exactly; bf16 (8 bits) rounds 115 -> 115, 127 -> 127,
      // 277 -> 276 (ties to even between 276 and 278), 307 -> 308.
      const std::vector<float> expect = std::is_same_v<TC, bf16>
                                            ? std::vector<float>{115, 127, 276, 308}
                                            : std::vector<float>{115, 127, 277, 307};
      for (int i = 0; i < 4; ++i) EXPECT_EQ(widen(c[std::size_t(i)]), expect[std::size_t(i)]);
    }
}

TEST(GemmBf16, HandComputedProductInAllFourTransposesFp32Out) {
  hand_computed_all_transposes<float>();
}
TEST(GemmBf16, HandComputedProductInAllFourTransposesBf16Out) {
  hand_computed_all_transposes<bf16>();
}

struct Size {
  std::int64_t M, N, K;
};
// Odd extents (1, 7, 129) in every position, and two large enough for
// oneDNN's blocked, threaded kernels with ragged edges in every dimension.
const Size kSizes[] = {{1, 1, 1},     {7, 1, 129},   {1, 129, 7},   {129, 7, 1},
                       {7, 129, 129}, {129, 129, 7}, {129, 1, 129}, {200, 257, 515}};

// Every transpose, both output types, beta 0 (C full of NaN: must not be
// read), beta 1 (accumulate, as a weight gradient does) and a general beta,
// dense and with every leading dimension padded.
template <class TC>
void matches_reference(bool padded) {
  std::uint64_t seed = padded ? 1000 : 1;
  for (const Size& sz : kSizes)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f, -1.5f}) {
          const auto [M, N, K] = sz;
          // Stored shapes: A (M, K) or (K, M), B (K, N) or (N, K).
          const std::int64_t a_rows = ta ? K : M, a_cols = ta ? M : K;
          const std::int64_t b_rows = tb ? N : K, b_cols = tb ? K : N;
          const std::int64_t lda = a_cols + (padded ? 3 : 0), ldb = b_cols + (padded ? 2 : 0);
          const std::int64_t ldc = N + (padded ? 5 : 0);
          const auto A = random_bf16(a_rows * lda, seed++), B = random_bf16(b_rows * ldb, seed++);
          std::vector<TC> C0(std::size_t(M * ldc));
          const std::vector<float> c0 = test::random_vector<float>(M * ldc, seed++);
          for (std::size_t i = 0; i < C0.size(); ++i)
            C0[i] = from_float<TC>(beta == 0.0f && std::int64_t(i) % ldc < N
                                       ? std::numeric_limits<float>::quiet_NaN()
                                       : c0[i]);
          std::vector<TC> C = C0;
          const float alpha = 0.75f;
          gemm_bf16<TC>(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
          expect_within_bound<TC>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C0, C, ldc);
          if (testing::Test::HasFatalFailure()) return;
        }
}

TEST(GemmBf16, MatchesReferenceAllTransposesFp32Out) {
  matches_reference<float>(false);
}
TEST(GemmBf16, MatchesReferenceAllTransposesBf16Out) {
  matches_reference<bf16>(false);
}
TEST(GemmBf16, MatchesReferenceStridedFp32Out) {
  matches_reference<float>(true);
}
TEST(GemmBf16, MatchesReferenceStridedBf16Out) {
  matches_reference<bf16>(true);
}

// The bound is tight enough to matter: products rounded to bf16 before the
// sum (an fp32 -> bf16 -> fp32 accumulator, what "bf16 accumulation" would
// do) break it on this case, so a kernel that summed in bf16 would fail.
TEST(GemmBf16, BoundRejectsBf16Accumulation) {
  const std::int64_t K = 512;
  const auto A = random_bf16(K, 77), B = random_bf16(K, 78);
  double exact = 0, mag = 0;
  float acc_bf16 = 0;
  for (std::int64_t k = 0; k < K; ++k) {
    const double p = double(to_float(A[std::size_t(k)])) * double(to_float(B[std::size_t(k)]));
    exact += p;
    mag += std::abs(p);
    acc_bf16 = to_float(to_bf16(acc_bf16 + float(p)));
  }
  EXPECT_GT(std::abs(double(acc_bf16) - exact), double(K + 2) * kU * mag);
}

// linear_forward_bf16 / linear_backward_bf16: y = x W^T, dx = dy W (set or
// accumulated), dW += dy^T x into an fp32 gradient that already holds one.
template <class TA>
void linear_layers() {
  const std::int64_t N = 33, in = 70, out = 129;
  const auto x = random_bf16(N * in, 5), w = random_bf16(out * in, 6), dy = random_bf16(N * out, 7);
  // y: gemm(x, W^T).
  std::vector<TA> y(std::size_t(N * out)), y0 = y;
  linear_forward_bf16<TA>(y.data(), x.data(), w.data(), N, in, out);
  expect_within_bound<TA>(false, true, N, out, in, 1.0f, x, in, w, in, 0.0f, y0, y, out);
  for (bool accumulate : {false, true}) {
    SCOPED_TRACE(testing::Message() << name_of<TA>() << " accumulate_dx " << accumulate);
    std::vector<TA> dx0(std::size_t(N * in));
    const std::vector<float> d = test::random_vector<float>(N * in, 8);
    for (std::size_t i = 0; i < dx0.size(); ++i) dx0[i] = from_float<TA>(d[i]);
    const std::vector<float> dw0 = test::random_vector<float>(out * in, 9);
    std::vector<TA> dx = dx0;
    std::vector<float> dw = dw0;
    linear_backward_bf16<TA>(dx.data(), accumulate, dw.data(), dy.data(), x.data(), w.data(), N, in,
                             out);
    expect_within_bound<TA>(false, false, N, in, out, 1.0f, dy, out, w, in,
                            accumulate ? 1.0f : 0.0f, dx0, dx, in);
    expect_within_bound<float>(true, false, out, in, N, 1.0f, dy, out, x, in, 1.0f, dw0, dw, in);
    // dx null: only dW; dW null: only dx.
    std::vector<float> dw_only = dw0;
    linear_backward_bf16<TA>(nullptr, false, dw_only.data(), dy.data(), x.data(), w.data(), N, in,
                             out);
    EXPECT_EQ(dw_only, dw);
  }
}

TEST(GemmBf16, LinearLayersFp32Activations) {
  linear_layers<float>();
}
TEST(GemmBf16, LinearLayersBf16Activations) {
  linear_layers<bf16>();
}

// K = 0 is an empty sum: C = beta C, and beta 0 clears C whatever it held.
TEST(GemmBf16, EmptyInnerDimensionScalesCAndEmptyOutputIsANoOp) {
  std::vector<float> C{1, -2, 3, -4, 5, -6};
  gemm_bf16<float>(false, false, 2, 3, 0, 1.0f, nullptr, 1, nullptr, 3, -0.5f, C.data(), 3);
  EXPECT_EQ(C, (std::vector<float>{-0.5, 1, -1.5, 2, -2.5, 3}));
  std::vector<bf16> nan(6, to_bf16(std::numeric_limits<float>::quiet_NaN()));
  gemm_bf16<bf16>(true, true, 2, 3, 0, 1.0f, nullptr, 2, nullptr, 1, 0.0f, nan.data(), 3);
  for (bf16 v : nan) EXPECT_EQ(v.bits, 0u);
  const std::vector<float> before = C;
  gemm_bf16<float>(false, false, 0, 3, 4, 1.0f, nullptr, 4, nullptr, 3, 0.0f, C.data(), 3);
  EXPECT_EQ(C, before);
}

TEST(GemmBf16, StrideShorterThanItsRowThrows) {
  const std::vector<bf16> A(12, to_bf16(1.0f)), B(12, to_bf16(1.0f));
  std::vector<float> C(12, 0.0f);
  const std::string bad_a = test::error_of([&] {
    gemm_bf16<float>(false, false, 3, 3, 4, 1.0f, A.data(), 3, B.data(), 3, 0.0f, C.data(), 3);
  });
  EXPECT_NE(bad_a.find("row stride is shorter than its row"), std::string::npos) << bad_a;
  EXPECT_NE(bad_a.find("lda 3"), std::string::npos) << bad_a;
  const std::string bad_b = test::error_of([&] {
    gemm_bf16<float>(false, true, 3, 3, 4, 1.0f, A.data(), 4, B.data(), 3, 0.0f, C.data(), 3);
  });
  EXPECT_NE(bad_b.find("ldb 3"), std::string::npos) << bad_b;
  const std::string bad_c = test::error_of([&] {
    gemm_bf16<float>(false, false, 3, 3, 4, 1.0f, A.data(), 4, B.data(), 3, 0.0f, C.data(), 2);
  });
  EXPECT_NE(bad_c.find("ldc 2"), std::string::npos) << bad_c;
}

// One primitive per distinct call: repeating a call reuses it; another
// stride, transpose, output type, beta or thread count is another one, and
// each gives its own correct result (a key that left one out would hand a
// call a primitive made for another shape of memory).
TEST(GemmBf16, CachesOnePrimitivePerDistinctCall) {
  const std::int64_t M = 19, N = 23, K = 31, ld = 40;
  const auto A = random_bf16(ld * ld, 41), B = random_bf16(ld * ld, 42);
  std::vector<float> C0(std::size_t(M * ld), 0.25f);
  auto run = [&](bool tb, std::int64_t lda, std::int64_t ldc, float beta) {
    std::vector<float> C = C0;
    const std::int64_t ldb = tb ? K : N;
    gemm_bf16<float>(false, tb, M, N, K, 1.0f, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
    expect_within_bound<float>(false, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C0, C, ldc);
  };
  run(false, K, N, 0.0f);
  const std::int64_t base = gemm_bf16_cached_primitives();
  run(false, K, N, 0.0f);
  EXPECT_EQ(gemm_bf16_cached_primitives(), base) << "the same call made a second primitive";
  run(true, K, N, 0.0f);
  run(false, K + 3, N, 0.0f);
  run(false, K, N + 2, 0.0f);
  run(false, K, N, 1.0f);
  std::vector<bf16> Cb(std::size_t(M * N));
  gemm_bf16<bf16>(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, Cb.data(), N);
  {
    test::ScopedOmpThreads one(omp_get_max_threads() == 1 ? 2 : 1);
    run(false, K, N, 0.0f);
  }
  // Where oneDNN has no bf16 matmul (ONEDNN_MAX_CPU_ISA=AVX2) nothing is cached.
  const bool onednn =
      gemm_bf16_implementation(false, false, M, N, K, K, N, N, false).find("widened") ==
      std::string::npos;
  EXPECT_EQ(gemm_bf16_cached_primitives(), base + (onednn ? 6 : 0));
}

// Ranks are threads of one process: several call one cached primitive at
// once, each with its own OpenMP team (core/threads.hpp) and its own
// operands, and each gets its single-threaded answer. Distinct operands
// matter: oneDNN packs B into the scratchpad, and threads that shared one
// would overwrite each other's packed B (identical B's would hide that).
TEST(GemmBf16, ThreadsShareTheCacheSafely) {
  const std::int64_t M = 96, N = 160, K = 257;
  constexpr int kThreads = 4;
  std::vector<std::vector<bf16>> A, B;
  std::vector<std::vector<float>> want(kThreads, std::vector<float>(std::size_t(M * N)));
  for (int t = 0; t < kThreads; ++t) {
    A.push_back(random_bf16(M * K, 51 + 2 * std::uint64_t(t)));
    B.push_back(random_bf16(N * K, 52 + 2 * std::uint64_t(t)));
    test::ScopedOmpThreads one(1);
    gemm_bf16<float>(false, true, M, N, K, 1.0f, A.back().data(), K, B.back().data(), K, 0.0f,
                     want[std::size_t(t)].data(), N);
  }
  std::vector<std::vector<float>> got(kThreads, std::vector<float>(std::size_t(M * N)));
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      omp_set_num_threads(1);
      const std::size_t i = std::size_t(t);
      for (int rep = 0; rep < 50; ++rep) {
        gemm_bf16<float>(false, true, M, N, K, 1.0f, A[i].data(), K, B[i].data(), K, 0.0f,
                         got[i].data(), N);
        if (got[i] != want[i]) ++mismatches[i];
      }
    });
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(mismatches[std::size_t(t)], 0) << "thread " << t << " got a wrong product";
}

TEST(GemmBf16, PathResolvesFromTheEnvironmentValue) {
  using detail::resolve_gemm_bf16_path;
  // auto (unset, empty or "auto"): oneDNN's matmul only where it has one and it pays.
  for (const char* v : {static_cast<const char*>(nullptr), "", "auto"}) {
    EXPECT_EQ(resolve_gemm_bf16_path(v, true, true), GemmBf16Path::onednn_bf16);
    EXPECT_EQ(resolve_gemm_bf16_path(v, true, false), GemmBf16Path::widened_fp32);
    EXPECT_EQ(resolve_gemm_bf16_path(v, false, true), GemmBf16Path::widened_fp32);
  }
  EXPECT_EQ(resolve_gemm_bf16_path("widened_fp32", true, true), GemmBf16Path::widened_fp32);
  EXPECT_EQ(resolve_gemm_bf16_path("onednn_bf16", true, false), GemmBf16Path::onednn_bf16);
  const std::string none =
      test::error_of([] { resolve_gemm_bf16_path("onednn_bf16", false, true); });
  EXPECT_NE(none.find("oneDNN has no bf16 matmul on this CPU"), std::string::npos) << none;
  const std::string bad = test::error_of([] { resolve_gemm_bf16_path("bf16", true, true); });
  EXPECT_NE(bad.find("LAGA_GEMM_BF16='bf16' is not a bf16 GEMM path"), std::string::npos) << bad;
}

// The two paths are the same function within the bound (each is checked
// against the reference above on its own run); set_gemm_bf16_path switches
// between them and the implementation report names the one that ran.
TEST(GemmBf16, BothPathsMeetTheBoundAndReportThemselves) {
  const std::int64_t M = 65, N = 130, K = 259;
  const auto A = random_bf16(M * K, 91), B = random_bf16(N * K, 92);
  const std::vector<float> C0(std::size_t(M * N), 0.5f);
  const GemmBf16Path before = gemm_bf16_path();
  const bool has_onednn =
      test::error_of([] { (void)set_gemm_bf16_path(GemmBf16Path::onednn_bf16); }).empty();
  for (GemmBf16Path p : {GemmBf16Path::widened_fp32, GemmBf16Path::onednn_bf16}) {
    if (p == GemmBf16Path::onednn_bf16 && !has_onednn) continue;
    set_gemm_bf16_path(p);
    std::vector<float> C = C0;
    gemm_bf16<float>(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 1.0f, C.data(), N);
    expect_within_bound<float>(false, true, M, N, K, 1.0f, A, K, B, K, 1.0f, C0, C, N);
    const std::string impl = gemm_bf16_implementation(false, true, M, N, K, K, K, N, false);
    EXPECT_EQ(impl.find("widened") != std::string::npos, p == GemmBf16Path::widened_fp32) << impl;
  }
  set_gemm_bf16_path(before);
}

TEST(GemmBf16, ReportsTheImplementation) {
  const std::string impl = gemm_bf16_implementation(false, true, 64, 64, 64, 64, 64, 64, false);
  EXPECT_FALSE(impl.empty());
  const std::string bad =
      test::error_of([&] { gemm_bf16_implementation(false, true, 0, 64, 64, 64, 64, 64, false); });
  EXPECT_NE(bad.find("runs no oneDNN primitive"), std::string::npos) << bad;
}

}  // namespace
}  // namespace laga
