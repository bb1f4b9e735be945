// Dense matrix products, row-major, and the linear layers built on them.
// Weights are stored [out, in] and applied as y = x W^T, as in PyTorch and
// DeepSeek's checkpoints.
//
// float runs on oneDNN's dnnl_sgemm: its JIT kernels target the widest ISA the
// CPU has (AVX-512 where there is one, capped by ONEDNN_MAX_CPU_ISA), on any
// vendor's CPU, and its OpenMP threads follow this thread's omp_set_num_threads
// (core/threads.hpp: each in-process rank its share of the cores). It was
// chosen by measurement over OpenBLAS and BLIS (laga_bench gemm,
// docs/performance.md). double (tests, finite differences) runs on OpenBLAS'
// cblas_dgemm: oneDNN has no dgemm.
#pragma once

#include <cstdint>
#include <string>

namespace laga {

// C (M, N) = alpha * op(A) op(B) + beta * C, op(A) (M, K), op(B) (K, N).
// lda/ldb/ldc are row strides in elements, so A may be a column slice of a
// wider matrix (one head of a (S, H, d) tensor: lda = H * d). beta 0 ignores
// C's old contents (NaN included). A stride shorter than its row throws
// laga::Error.
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

// What float GEMMs run here, for reports: "oneDNN 2.6.3, avx512_core_vnni".
std::string gemm_kernels();
// Whether those kernels are AVX-512 ones (a report's %peak is against that
// ISA's FMA peak; anything narrower is measured against AVX2's).
bool gemm_uses_avx512();

}  // namespace laga
