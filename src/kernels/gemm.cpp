#include "kernels/gemm.hpp"

#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl_debug.h>

#include "core/error.hpp"
#include "core/threads.hpp"

namespace laga {

namespace {

CBLAS_TRANSPOSE tr(bool t) {
  return t ? CblasTrans : CblasNoTrans;
}

// The library call for C = alpha op(A) op(B) + beta C with M, N, K > 0 and
// strides already checked.
void library_gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                  const float* A, std::int64_t lda, const float* B, std::int64_t ldb, float beta,
                  float* C, std::int64_t ldc) {
  const dnnl_status_t st =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  LAGA_CHECK(st == dnnl_success, "gemm: oneDNN's dnnl_sgemm failed (", dnnl_status2str(st),
             ") on M ", M, " N ", N, " K ", K, " lda ", lda, " ldb ", ldb, " ldc ", ldc,
             "; out of memory is the likely cause: use a shorter sequence or more ranks");
}

void library_gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, double alpha,
                  const double* A, std::int64_t lda, const double* B, std::int64_t ldb, double beta,
                  double* C, std::int64_t ldc) {
  check_openblas_buffer();  // else OpenBLAS retries a failed mapping without end
  cblas_dgemm(CblasRowMajor, tr(ta), tr(tb), static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B,
              static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

}  // namespace

template <class T>
void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
          std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  // Row-major: a stored row of op(A) is K wide, or M for A^T; likewise B.
  LAGA_CHECK(lda >= (ta ? M : K) && ldb >= (tb ? K : N) && ldc >= N,
             "gemm: a row stride is shorter than its row (M ", M, " N ", N, " K ", K, ", trans_a ",
             ta, " trans_b ", tb, ": lda ", lda, " ldb ", ldb, " ldc ", ldc,
             "); this is a bug in the caller");
  if (K == 0) {  // an empty sum: C = beta C, where beta 0 ignores C (NaN included)
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j)
        C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  library_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

std::string gemm_kernels() {
  const dnnl_version_t* v = dnnl_version();
  return cat("oneDNN ", v->major, ".", v->minor, ".", v->patch, ", ",
             dnnl_cpu_isa2str(dnnl_get_effective_cpu_isa()));
}

bool gemm_uses_avx512() {
  // Every AVX-512 ISA of oneDNN's (avx512_core and up) has avx512_core's bits.
  const int isa = dnnl_get_effective_cpu_isa();
  return (isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
}

template <class T>
void gemm_reference(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha,
                    const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C,
                    std::int64_t ldc) {
  for (std::int64_t i = 0; i < M; ++i) {
    for (std::int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (std::int64_t k = 0; k < K; ++k) {
        const double a = ta ? A[k * lda + i] : A[i * lda + k];
        const double b = tb ? B[j * ldb + k] : B[k * ldb + j];
        acc += a * b;
      }
      // beta == 0 must ignore C entirely: it may hold NaN garbage.
      const double c = beta == T(0) ? 0.0 : static_cast<double>(beta) * C[i * ldc + j];
      C[i * ldc + j] = static_cast<T>(static_cast<double>(alpha) * acc + c);
    }
  }
}

template <class T>
void linear_forward(T* y, const T* x, const T* w, std::int64_t N, std::int64_t in,
                    std::int64_t out) {
  gemm<T>(false, true, N, out, in, T(1), x, in, w, in, T(0), y, out);
}

template <class T>
void linear_backward(T* dx, bool accumulate_dx, T* dw, const T* dy, const T* x, const T* w,
                     std::int64_t N, std::int64_t in, std::int64_t out) {
  if (dx)
    gemm<T>(false, false, N, in, out, T(1), dy, out, w, in, accumulate_dx ? T(1) : T(0), dx, in);
  if (dw) gemm<T>(true, false, out, in, N, T(1), dy, out, x, in, T(1), dw, in);
}

template void gemm<float>(bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*,
                          std::int64_t, const float*, std::int64_t, float, float*, std::int64_t);
template void gemm<double>(bool, bool, std::int64_t, std::int64_t, std::int64_t, double,
                           const double*, std::int64_t, const double*, std::int64_t, double,
                           double*, std::int64_t);
template void gemm_reference<float>(bool, bool, std::int64_t, std::int64_t, std::int64_t, float,
                                    const float*, std::int64_t, const float*, std::int64_t, float,
                                    float*, std::int64_t);
template void gemm_reference<double>(bool, bool, std::int64_t, std::int64_t, std::int64_t, double,
                                     const double*, std::int64_t, const double*, std::int64_t,
                                     double, double*, std::int64_t);
template void linear_forward<float>(float*, const float*, const float*, std::int64_t, std::int64_t,
                                    std::int64_t);
template void linear_forward<double>(double*, const double*, const double*, std::int64_t,
                                     std::int64_t, std::int64_t);
template void linear_backward<float>(float*, bool, float*, const float*, const float*, const float*,
                                     std::int64_t, std::int64_t, std::int64_t);
template void linear_backward<double>(double*, bool, double*, const double*, const double*,
                                      const double*, std::int64_t, std::int64_t, std::int64_t);

}  // namespace laga
