// Dense matrix products through CBLAS (OpenBLAS), row-major, and the linear
// layers built on them. Weights are stored [out, in] and applied as y = x W^T,
// as in PyTorch and DeepSeek's checkpoints.
#pragma once

#include <cstdint>

namespace laga {

// C (M, N) = alpha * op(A) op(B) + beta * C, op(A) (M, K), op(B) (K, N).
// lda/ldb/ldc are row strides in elements, so A may be a column slice of a
// wider matrix (one head of a (S, H, d) tensor: lda = H * d).
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha,
          const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C,
          std::int64_t ldc);

// The same product by three loops with a double accumulator: the reference
// gemm() is tested against.
template <class T>
void gemm_reference(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
                    T alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta,
                    T* C, std::int64_t ldc);

// y (N, out) = x (N, in) W^T, W (out, in).
template <class T>
void linear_forward(T* y, const T* x, const T* w, std::int64_t N, std::int64_t in,
                    std::int64_t out);

// dx (N, in) = dy W (overwritten, or added to when accumulate_dx; skipped when
// dx is null); dW (out, in) += dy^T x (always accumulated: a weight used by
// several calls sums its gradients).
template <class T>
void linear_backward(T* dx, bool accumulate_dx, T* dw, const T* dy, const T* x, const T* w,
                     std::int64_t N, std::int64_t in, std::int64_t out);

}  // namespace laga
