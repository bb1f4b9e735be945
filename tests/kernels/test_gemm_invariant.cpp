// gemm_invariant (kernels/gemm_invariant.hpp, docs/invariance.md): bit for
// bit its tree's definition (gemm_invariant_reference) in every transpose,
// stride and tail; close to the double product; and the two properties the
// invariant mode rests on -- a row's bits do not depend on how many rows are
// computed with it nor on the thread count, and the sum over an aligned
// range joins the sums of its halves exactly (what mla/canonical_sum.hpp
// cuts the global sequence by).
#include "kernels/gemm_invariant.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "common/threads.hpp"
#include "core/error.hpp"
#include "kernels/gemm.hpp"

namespace laga {
namespace {

using test::random_vector;

template <class T>
::testing::AssertionResult same_bits(const std::string& what, const T* a, const T* b,
                                     std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i)
    if (std::memcmp(a + i, b + i, sizeof(T)) != 0)
      return ::testing::AssertionFailure()
             << what << ": element " << i << " of " << n << " differs: " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

template <class T>
class GemmInvariantTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GemmInvariantTest, Types);

// Operands stored as op() asks, with a row stride 3 wider than the row.
template <class T>
struct Operands {
  std::int64_t M, N, K;
  bool ta, tb;
  std::int64_t lda, ldb, ldc;
  std::vector<T> A, B, C;
  Operands(std::int64_t m, std::int64_t n, std::int64_t k, bool ta_, bool tb_, std::uint64_t seed)
      : M(m),
        N(n),
        K(k),
        ta(ta_),
        tb(tb_),
        lda((ta ? M : K) + 3),
        ldb((tb ? K : N) + 3),
        ldc(N + 2) {
    A = random_vector<T>((ta ? K : M) * lda, seed);
    B = random_vector<T>((tb ? N : K) * ldb, seed + 1);
    C = random_vector<T>(M * ldc, seed + 2);
  }
};

TYPED_TEST(GemmInvariantTest, EqualsTheTreesDefinitionBitForBit) {
  using T = TypeParam;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (std::int64_t K : {1, 2, 3, 7, 8, 9, 13, 64, 65, 100, 257})
        for (T beta : {T(0), T(1), T(0.5)}) {
          SCOPED_TRACE("ta " + std::to_string(ta) + " tb " + std::to_string(tb) + " K " +
                       std::to_string(K) + " beta " + std::to_string(double(beta)));
          Operands<T> o(7, 70, K, ta, tb, 11 + std::uint64_t(K));
          std::vector<T> got = o.C, want = o.C;
          gemm_invariant<T>(ta, tb, o.M, o.N, K, T(0.75), o.A.data(), o.lda, o.B.data(), o.ldb,
                            beta, got.data(), o.ldc);
          gemm_invariant_reference<T>(ta, tb, o.M, o.N, K, T(0.75), o.A.data(), o.lda, o.B.data(),
                                      o.ldb, beta, want.data(), o.ldc);
          ASSERT_TRUE(same_bits("C", got.data(), want.data(), std::int64_t(got.size())));
          // And it is the product: against the double-accumulated one.
          std::vector<T> dbl = o.C;
          gemm_reference<T>(ta, tb, o.M, o.N, K, T(0.75), o.A.data(), o.lda, o.B.data(), o.ldb,
                            beta, dbl.data(), o.ldc);
          const double tol = std::is_same_v<T, float> ? 2e-5 * double(K) : 1e-13 * double(K);
          ASSERT_TRUE(test::all_close("C", got, dbl, tol, tol));
        }
}

// A row's bits whatever M and the thread count: the rows [5, 6) of an M-row
// product equal the 1-row product of that row alone, at 1 and 2 threads.
TYPED_TEST(GemmInvariantTest, ARowsBitsDoNotDependOnTheRowCountOrThreads) {
  using T = TypeParam;
  const std::int64_t N = 130, K = 300;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      Operands<T> o(201, N, K, ta, tb, 5);
      std::vector<T> all(std::size_t(o.M * o.ldc));
      {
        const test::ScopedOmpThreads two(2);
        gemm_invariant<T>(ta, tb, o.M, N, K, T(1), o.A.data(), o.lda, o.B.data(), o.ldb, T(0),
                          all.data(), o.ldc);
      }
      for (std::int64_t m : {1, 3, 64}) {
        // Rows [5, 5 + m) alone: A's rows (or, transposed, columns) from row 5.
        const T* a = ta ? o.A.data() + 5 : o.A.data() + 5 * o.lda;
        std::vector<T> part(std::size_t(m * o.ldc));
        const test::ScopedOmpThreads one(1);
        gemm_invariant<T>(ta, tb, m, N, K, T(1), a, o.lda, o.B.data(), o.ldb, T(0), part.data(),
                          o.ldc);
        ASSERT_TRUE(same_bits("rows 5.. of " + std::to_string(m), part.data(),
                              all.data() + 5 * o.ldc, m * o.ldc - (o.ldc - N)));
      }
    }
}

// The sum over [0, K) is the sum over [0, 2^l) plus the sum over [2^l, K)
// where 2^l is the largest power of two below K: the tree's root is the
// one add of its two subtrees. So an aligned range can be summed by
// whichever rank holds it and joined later with the same bits.
TYPED_TEST(GemmInvariantTest, AnAlignedRangeJoinsItsHalvesExactly) {
  using T = TypeParam;
  for (std::int64_t K : {2, 9, 64, 100, 128, 300}) {
    std::int64_t half = 1;
    while (half * 2 < K) half *= 2;
    Operands<T> o(6, 40, K, true, false, 9);  // dW = dy^T x: a sum over tokens k
    std::vector<T> whole(std::size_t(o.M * o.ldc)), left = whole, right = whole;
    gemm_invariant<T>(true, false, o.M, o.N, K, T(1), o.A.data(), o.lda, o.B.data(), o.ldb, T(0),
                      whole.data(), o.ldc);
    gemm_invariant<T>(true, false, o.M, o.N, half, T(1), o.A.data(), o.lda, o.B.data(), o.ldb, T(0),
                      left.data(), o.ldc);
    gemm_invariant<T>(true, false, o.M, o.N, K - half, T(1), o.A.data() + half * o.lda, o.lda,
                      o.B.data() + half * o.ldb, o.ldb, T(0), right.data(), o.ldc);
    for (std::size_t i = 0; i < left.size(); ++i) left[i] = left[i] + right[i];
    for (std::int64_t i = 0; i < o.M; ++i)
      ASSERT_TRUE(same_bits("K " + std::to_string(K) + " row " + std::to_string(i),
                            left.data() + i * o.ldc, whole.data() + i * o.ldc, o.N));
  }
}

TEST(GemmInvariant, RefusesAShortStride) {
  std::vector<float> a(16), b(16), c(16);
  EXPECT_THROW(gemm_invariant<float>(false, false, 2, 2, 4, 1.0f, a.data(), 3, b.data(), 2, 0.0f,
                                     c.data(), 2),
               Error);
}

}  // namespace
}  // namespace laga
