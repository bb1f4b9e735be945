// The invariant GEMM (gemm_invariant.hpp; docs/invariance.md). Compiled with
// -ffp-contract=off (kernels/CMakeLists.txt): a product and the add after it
// are two roundings everywhere, never one fused multiply-add in one copy of
// the loop and not in another.
#include "kernels/gemm_invariant.hpp"

#include <algorithm>
#include <bit>
#include <type_traits>

#include "core/error.hpp"

namespace laga {

namespace {

constexpr std::int64_t kLeafBlock = 8;  // the tree's bottom three levels, unrolled
constexpr std::int64_t kTileCols = 64;  // columns per tile (vectorised)
constexpr std::int64_t kTileRows = 4;   // rows per tile (share one packed block of B)
constexpr int kMaxLevels = 64;          // levels above the leaf blocks: K < 2^67

// One tile: rows [i0, i0 + mr), columns [j0, j0 + nb) of S, into C.
template <class T>
inline __attribute__((always_inline)) void tile_body(bool ta, bool tb, std::int64_t K, T alpha,
                                                     const T* A, std::int64_t lda, const T* B,
                                                     std::int64_t ldb, T beta, T* C,
                                                     std::int64_t ldc, std::int64_t i0,
                                                     std::int64_t mr, std::int64_t j0,
                                                     std::int64_t nb) {
  T b[kLeafBlock][kTileCols];                 // op(B)'s block rows, packed
  T v[kTileRows][kLeafBlock][kTileCols];      // each row's products, then its block's tree
  T stack[kTileRows][kMaxLevels][kTileCols];  // the binary counter's left siblings
  const std::int64_t blocks = (K + kLeafBlock - 1) / kLeafBlock;
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    const std::int64_t k0 = blk * kLeafBlock, n = std::min(kLeafBlock, K - k0);
    for (std::int64_t q = 0; q < n; ++q)
      for (std::int64_t j = 0; j < nb; ++j)
        b[q][j] = tb ? B[(j0 + j) * ldb + k0 + q] : B[(k0 + q) * ldb + j0 + j];
    // The rows' A values; rows past mr compute zeros that are never stored.
    T a[kTileRows][kLeafBlock] = {};
    for (std::int64_t r = 0; r < mr; ++r)
      for (std::int64_t q = 0; q < n; ++q)
        a[r][q] = ta ? A[(k0 + q) * lda + i0 + r] : A[(i0 + r) * lda + k0 + q];
    if (n == kLeafBlock) {
      // Four rows share each loaded element of B.
#pragma omp simd
      for (std::int64_t j = 0; j < nb; ++j) {
        const T b0 = b[0][j], b1 = b[1][j], b2 = b[2][j], b3 = b[3][j];
        const T b4 = b[4][j], b5 = b[5][j], b6 = b[6][j], b7 = b[7][j];
        for (int r = 0; r < int(kTileRows); ++r) {
          const T* ar = a[r];
          v[r][0][j] = ((ar[0] * b0 + ar[1] * b1) + (ar[2] * b2 + ar[3] * b3)) +
                       ((ar[4] * b4 + ar[5] * b5) + (ar[6] * b6 + ar[7] * b7));
        }
      }
    } else {  // the last block, n < 8 leaves: the padded tree
      for (std::int64_t r = 0; r < mr; ++r) {
        for (std::int64_t q = 0; q < n; ++q)
#pragma omp simd
          for (std::int64_t j = 0; j < nb; ++j) v[r][q][j] = a[r][q] * b[q][j];
        for (std::int64_t cnt = n; cnt > 1; cnt = (cnt + 1) / 2) {
          for (std::int64_t q = 0; q < cnt / 2; ++q)
#pragma omp simd
            for (std::int64_t j = 0; j < nb; ++j) v[r][q][j] = v[r][2 * q][j] + v[r][2 * q + 1][j];
          if (cnt % 2)
            for (std::int64_t j = 0; j < nb; ++j) v[r][cnt / 2][j] = v[r][cnt - 1][j];
        }
      }
    }
    // The binary counter: block blk's value meets its left siblings.
    for (std::int64_t r = 0; r < mr; ++r) {
      T* out = v[r][0];
      int l = 0;
      for (; (blk >> l) & 1; ++l) {
#pragma omp simd
        for (std::int64_t j = 0; j < nb; ++j) out[j] = stack[r][l][j] + out[j];
      }
      std::copy(out, out + nb, stack[r][l]);
    }
  }
  // What the counter holds: the complete subtrees of the bits of `blocks`,
  // joined right to left (the padded tree's right spine).
  for (std::int64_t r = 0; r < mr; ++r) {
    T acc[kTileCols];
    bool have = false;
    for (int l = 0; l < kMaxLevels && (blocks >> l) != 0; ++l) {
      if (!((blocks >> l) & 1)) continue;
      if (have) {
#pragma omp simd
        for (std::int64_t j = 0; j < nb; ++j) acc[j] = stack[r][l][j] + acc[j];
      } else {
        std::copy(stack[r][l], stack[r][l] + nb, acc);
      }
      have = true;
    }
    T* c = C + (i0 + r) * ldc + j0;
    if (beta == T(0)) {
      for (std::int64_t j = 0; j < nb; ++j) c[j] = alpha * acc[j];
    } else {
      for (std::int64_t j = 0; j < nb; ++j) c[j] = alpha * acc[j] + beta * c[j];
    }
  }
}

// One copy per ISA level: every copy rounds the same operations the same
// way (no contraction), so which one the CPU picks changes no bit.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void tile_f(
    bool ta, bool tb, std::int64_t K, float alpha, const float* A, std::int64_t lda, const float* B,
    std::int64_t ldb, float beta, float* C, std::int64_t ldc, std::int64_t i0, std::int64_t mr,
    std::int64_t j0, std::int64_t nb) {
  tile_body<float>(ta, tb, K, alpha, A, lda, B, ldb, beta, C, ldc, i0, mr, j0, nb);
}
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void tile_d(
    bool ta, bool tb, std::int64_t K, double alpha, const double* A, std::int64_t lda,
    const double* B, std::int64_t ldb, double beta, double* C, std::int64_t ldc, std::int64_t i0,
    std::int64_t mr, std::int64_t j0, std::int64_t nb) {
  tile_body<double>(ta, tb, K, alpha, A, lda, B, ldb, beta, C, ldc, i0, mr, j0, nb);
}

template <class T>
T tree_sum(bool ta, bool tb, const T* A, std::int64_t lda, const T* B, std::int64_t ldb,
           std::int64_t i, std::int64_t j, std::int64_t lo, std::int64_t size, std::int64_t K) {
  if (size == 1) {
    const T a = ta ? A[lo * lda + i] : A[i * lda + lo];
    const T b = tb ? B[j * ldb + lo] : B[lo * ldb + j];
    return a * b;
  }
  const std::int64_t half = size / 2;
  const T left = tree_sum(ta, tb, A, lda, B, ldb, i, j, lo, half, K);
  if (lo + half >= K) return left;  // the right subtree has no leaf: absent
  return left + tree_sum(ta, tb, A, lda, B, ldb, i, j, lo + half, half, K);
}

template <class T>
void check_args(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, std::int64_t lda,
                std::int64_t ldb, std::int64_t ldc) {
  LAGA_CHECK(M >= 0 && N >= 0 && K >= 0 && lda >= (ta ? M : K) && ldb >= (tb ? K : N) && ldc >= N,
             "gemm_invariant: extents or strides out of range (M ", M, " N ", N, " K ", K,
             ", trans_a ", ta, " trans_b ", tb, ": lda ", lda, " ldb ", ldb, " ldc ", ldc,
             "); this is a bug in the caller");
}

}  // namespace

template <class T>
void gemm_invariant(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha,
                    const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C,
                    std::int64_t ldc) {
  check_args<T>(ta, tb, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j)
        C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  const std::int64_t row_tiles = (M + kTileRows - 1) / kTileRows;
  const std::int64_t col_tiles = (N + kTileCols - 1) / kTileCols;
  // Tiles split among threads; an element's sum is one tile's, whichever
  // thread runs it. Column tiles outer: a panel of B stays in cache.
#pragma omp parallel for collapse(2) schedule(static) if (M * N * K > (1 << 18))
  for (std::int64_t jt = 0; jt < col_tiles; ++jt)
    for (std::int64_t it = 0; it < row_tiles; ++it) {
      const std::int64_t i0 = it * kTileRows, j0 = jt * kTileCols;
      const std::int64_t mr = std::min(kTileRows, M - i0), nb = std::min(kTileCols, N - j0);
      if constexpr (std::is_same_v<T, float>)
        tile_f(ta, tb, K, alpha, A, lda, B, ldb, beta, C, ldc, i0, mr, j0, nb);
      else
        tile_d(ta, tb, K, alpha, A, lda, B, ldb, beta, C, ldc, i0, mr, j0, nb);
    }
}

template <class T>
void gemm_invariant_reference(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K,
                              T alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb,
                              T beta, T* C, std::int64_t ldc) {
  check_args<T>(ta, tb, M, N, K, lda, ldb, ldc);
  const std::int64_t size = K == 0 ? 0 : std::int64_t(std::bit_ceil(std::uint64_t(K)));
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) {
      const T s = K == 0 ? T(0) : tree_sum(ta, tb, A, lda, B, ldb, i, j, 0, size, K);
      T& c = C[i * ldc + j];
      c = K == 0 ? (beta == T(0) ? T(0) : beta * c)
                 : (beta == T(0) ? alpha * s : alpha * s + beta * c);
    }
}

template void gemm_invariant<float>(bool, bool, std::int64_t, std::int64_t, std::int64_t, float,
                                    const float*, std::int64_t, const float*, std::int64_t, float,
                                    float*, std::int64_t);
template void gemm_invariant<double>(bool, bool, std::int64_t, std::int64_t, std::int64_t, double,
                                     const double*, std::int64_t, const double*, std::int64_t,
                                     double, double*, std::int64_t);
template void gemm_invariant_reference<float>(bool, bool, std::int64_t, std::int64_t, std::int64_t,
                                              float, const float*, std::int64_t, const float*,
                                              std::int64_t, float, float*, std::int64_t);
template void gemm_invariant_reference<double>(bool, bool, std::int64_t, std::int64_t, std::int64_t,
                                               double, const double*, std::int64_t, const double*,
                                               std::int64_t, double, double*, std::int64_t);

}  // namespace laga
