// gemm (float: oneDNN, double: OpenBLAS) against gemm_reference and
// hand-computed products; the linear layers against plain loops and finite
// differences. CTest runs this binary again with ONEDNN_MAX_CPU_ISA=AVX2, so
// the AVX2 kernels are checked on an AVX-512 CPU too.
#include "kernels/gemm.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common/check.hpp"
#include "common/error_of.hpp"
#include "common/threads.hpp"

namespace laga {
namespace {

using test::all_close;
using test::random_vector;

template <class T>
class GemmTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GemmTest, Types);

// A = [[1 2 3] [4 5 6]] (2x3), B = [[7 8] [9 10] [11 12]] (3x2), AB = [[58 64] [139 154]].
// Each operand is stored either as itself or as its transpose, so every
// transpose flag is checked against numbers worked out by hand.
TYPED_TEST(GemmTest, HandComputedProductInAllFourTransposes) {
  using T = TypeParam;
  const std::vector<T> A{1, 2, 3, 4, 5, 6}, At{1, 4, 2, 5, 3, 6};
  const std::vector<T> B{7, 8, 9, 10, 11, 12}, Bt{7, 9, 11, 8, 10, 12};
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(std::string("trans_a=") + (ta ? "1" : "0") + " trans_b=" + (tb ? "1" : "0"));
      const T* a = ta ? At.data() : A.data();
      const T* b = tb ? Bt.data() : B.data();
      const std::int64_t lda = ta ? 2 : 3, ldb = tb ? 3 : 2;
      // C = 2 AB - C0 with C0 = 1: exact in any precision.
      std::vector<T> c(4, T(1)), cr(4, T(1));
      gemm<T>(ta, tb, 2, 2, 3, T(2), a, lda, b, ldb, T(-1), c.data(), 2);
      gemm_reference<T>(ta, tb, 2, 2, 3, T(2), a, lda, b, ldb, T(-1), cr.data(), 2);
      const std::vector<T> expect{115, 127, 277, 307};
      EXPECT_EQ(c, expect);
      EXPECT_EQ(cr, expect);
    }
}

// Strided operands with padding, odd sizes, alpha/beta. The error bound is
// the standard one for a dot product of length K (Higham, Accuracy and
// Stability, 3.5): |fl(C) - C| <= (K + 2) eps (|alpha| |A||B| + |beta| |C0|)
// elementwise, plus eps |C| for rounding the double reference to T.
TYPED_TEST(GemmTest, MatchesReferenceStridedAllTransposes) {
  using T = TypeParam;
  const double eps = std::numeric_limits<T>::epsilon();
  struct Size {
    std::int64_t M, N, K;
  };
  // The last two are large enough for the libraries' blocked, packed,
  // multi-threaded kernels, with ragged edges in every dimension.
  const Size sizes[] = {{1, 1, 1},    {7, 5, 3},  {13, 17, 11},   {33, 31, 29},
                        {64, 3, 101}, {2, 70, 9}, {131, 97, 259}, {257, 129, 67}};
  std::uint64_t seed = 1;
  for (const Size& sz : sizes)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const auto [M, N, K] = sz;
        SCOPED_TRACE(testing::Message() << "M=" << M << " N=" << N << " K=" << K
                                        << " trans_a=" << ta << " trans_b=" << tb);
        // Stored shapes: A is (M, K) or (K, M); B is (K, N) or (N, K); each
        // row padded so the leading dimension exceeds the row width.
        const std::int64_t a_rows = ta ? K : M, a_cols = ta ? M : K;
        const std::int64_t b_rows = tb ? N : K, b_cols = tb ? K : N;
        const std::int64_t lda = a_cols + 3, ldb = b_cols + 2, ldc = N + 5;
        const auto A = random_vector<T>(a_rows * lda, seed++);
        const auto B = random_vector<T>(b_rows * ldb, seed++);
        const auto C0 = random_vector<T>(M * ldc, seed++);
        const T alpha = T(0.75), beta = T(-1.5);
        std::vector<T> C = C0, R = C0;
        gemm<T>(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
        gemm_reference<T>(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, R.data(),
                          ldc);
        for (std::int64_t i = 0; i < M; ++i)
          for (std::int64_t j = 0; j < ldc; ++j) {
            const std::int64_t at = i * ldc + j;
            if (j >= N) {  // padding of C is never written
              ASSERT_EQ(C[at], C0[at]) << "gemm wrote C padding at (" << i << ", " << j << ")";
              ASSERT_EQ(R[at], C0[at]) << "gemm_reference wrote C padding";
              continue;
            }
            double mag = 0;
            for (std::int64_t k = 0; k < K; ++k) {
              const double a = ta ? A[k * lda + i] : A[i * lda + k];
              const double b = tb ? B[j * ldb + k] : B[k * ldb + j];
              mag += std::abs(a * b);
            }
            const double bound = double(K + 2) * eps *
                                     (std::abs(double(alpha)) * mag +
                                      std::abs(double(beta)) * std::abs(double(C0[at]))) +
                                 eps * std::abs(double(R[at]));
            ASSERT_LE(std::abs(double(C[at]) - double(R[at])), bound)
                << "C(" << i << ", " << j << "): gemm " << C[at] << " reference " << R[at];
          }
      }
}

// Reference semantics checked with plain loops on one case, so gemm is not
// only compared with something that could share its mistakes.
TYPED_TEST(GemmTest, ReferenceIsTheDefinition) {
  using T = TypeParam;
  const std::int64_t M = 4, N = 3, K = 5, lda = 7, ldb = 6, ldc = 6;
  const auto A = random_vector<T>(K * lda, 11);  // op(A) = A^T: stored (K, M)
  const auto B = random_vector<T>(N * ldb, 12);  // op(B) = B^T: stored (N, K)
  std::vector<T> C(M * ldc, T(0.5));
  gemm_reference<T>(true, true, M, N, K, T(2), A.data(), lda, B.data(), ldb, T(3), C.data(), ldc);
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (std::int64_t k = 0; k < K; ++k) s += double(A[k * lda + i]) * double(B[j * ldb + k]);
      // One rounding of a value below 2 * 5 + 1.5 to T.
      EXPECT_NEAR(C[i * ldc + j], 2 * s + 1.5, 12 * std::numeric_limits<T>::epsilon());
    }
}

TYPED_TEST(GemmTest, BetaZeroIgnoresNaNInC) {
  using T = TypeParam;
  const std::int64_t M = 9, N = 7, K = 5;
  const auto A = random_vector<T>(M * K, 21), B = random_vector<T>(K * N, 22);
  for (bool tb : {false, true}) {
    std::vector<T> C(M * N, std::numeric_limits<T>::quiet_NaN()), R = C;
    gemm<T>(false, tb, M, N, K, T(1.25), A.data(), K, B.data(), tb ? K : N, T(0), C.data(), N);
    gemm_reference<T>(false, tb, M, N, K, T(1.25), A.data(), K, B.data(), tb ? K : N, T(0),
                      R.data(), N);
    EXPECT_TRUE(test::all_finite("gemm C", C.data(), M * N));
    EXPECT_TRUE(test::all_finite("gemm_reference C", R.data(), M * N));
    // 20 eps: K = 5 products (see the bound above) with |a|, |b| <= 1.
    EXPECT_TRUE(all_close("C", C, R, 20 * std::numeric_limits<T>::epsilon(), 0.0));
  }
}

TYPED_TEST(GemmTest, AlphaZeroScalesCAndEmptyIsANoOp) {
  using T = TypeParam;
  const auto A = random_vector<T>(12, 31), B = random_vector<T>(12, 32);
  std::vector<T> C{1, -2, 3, -4, 5, -6, 7, -8, 9};
  gemm<T>(false, false, 3, 3, 4, T(0), A.data(), 4, B.data(), 3, T(2), C.data(), 3);
  EXPECT_EQ(C, (std::vector<T>{2, -4, 6, -8, 10, -12, 14, -16, 18}));
  const std::vector<T> before = C;
  gemm<T>(false, false, 0, 3, 4, T(1), A.data(), 4, B.data(), 3, T(0), C.data(), 3);
  gemm<T>(false, false, 3, 0, 4, T(1), A.data(), 4, B.data(), 1, T(0), C.data(), 1);
  EXPECT_EQ(C, before);
}

// K = 0 is an empty sum: C = beta C, and beta 0 clears C whatever it held.
TYPED_TEST(GemmTest, EmptyInnerDimensionScalesC) {
  using T = TypeParam;
  std::vector<T> C{1, -2, 3, -4, 5, -6};
  gemm<T>(false, false, 2, 3, 0, T(1), nullptr, 0, nullptr, 3, T(-0.5), C.data(), 3);
  EXPECT_EQ(C, (std::vector<T>{-0.5, 1, -1.5, 2, -2.5, 3}));
  std::vector<T> nan(6, std::numeric_limits<T>::quiet_NaN());
  gemm<T>(true, true, 2, 3, 0, T(1), nullptr, 2, nullptr, 0, T(0), nan.data(), 3);
  EXPECT_EQ(nan, std::vector<T>(6, T(0)));
}

TYPED_TEST(GemmTest, StrideShorterThanItsRowThrows) {
  using T = TypeParam;
  const std::vector<T> A(12, T(1)), B(12, T(1));
  std::vector<T> C(12, T(0));
  // A (3, 4) with lda 3; B^T stored (3, 4) with ldb 3; C (3, 3) with ldc 2.
  const std::string bad_a = test::error_of(
      [&] { gemm<T>(false, false, 3, 3, 4, T(1), A.data(), 3, B.data(), 3, T(0), C.data(), 3); });
  EXPECT_NE(bad_a.find("row stride is shorter than its row"), std::string::npos) << bad_a;
  EXPECT_NE(bad_a.find("lda 3"), std::string::npos) << bad_a;
  const std::string bad_b = test::error_of(
      [&] { gemm<T>(false, true, 3, 3, 4, T(1), A.data(), 4, B.data(), 3, T(0), C.data(), 3); });
  EXPECT_NE(bad_b.find("ldb 3"), std::string::npos) << bad_b;
  const std::string bad_c = test::error_of(
      [&] { gemm<T>(false, false, 3, 3, 4, T(1), A.data(), 4, B.data(), 3, T(0), C.data(), 2); });
  EXPECT_NE(bad_c.find("ldc 2"), std::string::npos) << bad_c;
}

// ---------------------------------------------------------------- linear

// y (N, out) = x (N, in) W^T by loops in double.
template <class T>
std::vector<double> linear_loops(const std::vector<T>& x, const std::vector<T>& w, std::int64_t N,
                                 std::int64_t in, std::int64_t out) {
  std::vector<double> y(N * out, 0.0);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t i = 0; i < in; ++i) y[n * out + o] += double(x[n * in + i]) * w[o * in + i];
  return y;
}

// |x|, |w|, |dy| <= 1 and sums of at most 65 products: errors <= 67 eps * 65
// (the bound above with |A||B| <= K). For float that is 5.2e-4 worst case;
// typical errors are ~sqrt(K) eps |.|, so 1e-4 absolute is both safe and tight
// enough to catch a wrong or missing term (each term is ~0.25 on average).
template <class T>
double lin_tol() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-12;
}

TYPED_TEST(GemmTest, LinearForwardAndBackwardMatchLoops) {
  using T = TypeParam;
  struct Size {
    std::int64_t N, in, out;
  };
  for (const Size& s : {Size{1, 1, 1}, Size{5, 7, 3}, Size{33, 65, 17}}) {
    const auto [N, in, out] = s;
    SCOPED_TRACE(testing::Message() << "N=" << N << " in=" << in << " out=" << out);
    const auto x = random_vector<T>(N * in, 41), w = random_vector<T>(out * in, 42);
    const auto dy = random_vector<T>(N * out, 43);
    std::vector<T> y(N * out, std::numeric_limits<T>::quiet_NaN());
    linear_forward<T>(y.data(), x.data(), w.data(), N, in, out);
    EXPECT_TRUE(all_close("y", y, linear_loops(x, w, N, in, out), lin_tol<T>(), 0.0));

    // dx = dy W, dW = dy^T x, by loops.
    std::vector<double> dx_ref(N * in, 0.0), dw_ref(out * in, 0.0);
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t o = 0; o < out; ++o)
        for (std::int64_t i = 0; i < in; ++i) {
          dx_ref[n * in + i] += double(dy[n * out + o]) * w[o * in + i];
          dw_ref[o * in + i] += double(dy[n * out + o]) * x[n * in + i];
        }
    // Overwrite: NaN garbage in dx must not leak through.
    std::vector<T> dx(N * in, std::numeric_limits<T>::quiet_NaN());
    const auto dw0 = random_vector<T>(out * in, 44);  // dW accumulates onto this
    std::vector<T> dw = dw0;
    linear_backward<T>(dx.data(), false, dw.data(), dy.data(), x.data(), w.data(), N, in, out);
    EXPECT_TRUE(all_close("dx", dx, dx_ref, lin_tol<T>(), 0.0));
    std::vector<double> dw_expect(out * in);
    for (std::int64_t i = 0; i < out * in; ++i) dw_expect[i] = dw_ref[i] + dw0[i];
    EXPECT_TRUE(all_close("dw (accumulated)", dw, dw_expect, lin_tol<T>(), 0.0));

    // accumulate_dx adds to what is there.
    const auto dx0 = random_vector<T>(N * in, 45);
    std::vector<T> dx_acc = dx0;
    linear_backward<T>(dx_acc.data(), true, nullptr, dy.data(), x.data(), w.data(), N, in, out);
    std::vector<double> dx_expect(N * in);
    for (std::int64_t i = 0; i < N * in; ++i) dx_expect[i] = dx_ref[i] + dx0[i];
    EXPECT_TRUE(all_close("dx (accumulated)", dx_acc, dx_expect, lin_tol<T>(), 0.0));

    // A null dx skips it; dW still accumulates (twice now).
    linear_backward<T>(nullptr, false, dw.data(), dy.data(), x.data(), w.data(), N, in, out);
    for (std::int64_t i = 0; i < out * in; ++i) dw_expect[i] += dw_ref[i];
    EXPECT_TRUE(all_close("dw (accumulated twice)", dw, dw_expect, 2 * lin_tol<T>(), 0.0));
  }
}

// Finite differences in double of L = <G, linear_forward(x, W)>. L is bilinear,
// so the central difference has no truncation error and the relative error is
// rounding only (~1e-10): tol 1e-6 leaves four orders of margin.
TEST(Linear, BackwardMatchesFiniteDifferences) {
  const test::ScopedOmpThreads one_thread(1);  // see common/threads.hpp
  const std::int64_t N = 4, in = 6, out = 5;
  auto x = random_vector<double>(N * in, 51), w = random_vector<double>(out * in, 52);
  const auto G = random_vector<double>(N * out, 53);
  std::vector<double> y(N * out);
  auto loss = [&] {
    linear_forward<double>(y.data(), x.data(), w.data(), N, in, out);
    return test::dot(G.data(), y.data(), N * out);
  };
  std::vector<double> dx(N * in), dw(out * in, 0.0);
  linear_backward<double>(dx.data(), false, dw.data(), G.data(), x.data(), w.data(), N, in, out);
  test::GradientCheck gc;
  gc.add("x", x.data(), dx.data(), {N, in}).add("w", w.data(), dw.data(), {out, in});
  EXPECT_TRUE(gc.run(loss));
}

}  // namespace
}  // namespace laga
