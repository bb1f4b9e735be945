#include "kernels/gemm.hpp"

#include <cblas.h>

#include "core/error.hpp"

namespace laga {

namespace {
CBLAS_TRANSPOSE tr(bool t) {
  return t ? CblasTrans : CblasNoTrans;
}
}  // namespace

template <>
void gemm<float>(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                 const float* A, std::int64_t lda, const float* B, std::int64_t ldb, float beta,
                 float* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, tr(ta), tr(tb), static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B,
              static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

template <>
void gemm<double>(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, double alpha,
                  const double* A, std::int64_t lda, const double* B, std::int64_t ldb, double beta,
                  double* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_dgemm(CblasRowMajor, tr(ta), tr(tb), static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B,
              static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
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
