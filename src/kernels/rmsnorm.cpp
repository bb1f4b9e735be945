#include "kernels/rmsnorm.hpp"

#include <omp.h>

#include <cmath>
#include <vector>

namespace laga {

template <class T>
void rmsnorm_forward(T* y, T* rstd, const T* x, std::int64_t ldx, const T* w, std::int64_t N,
                     std::int64_t C, double eps) {
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * ldx;
    T ss = 0;
#pragma omp simd reduction(+ : ss)
    for (std::int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
    const T r = T(1) / std::sqrt(ss / static_cast<T>(C) + static_cast<T>(eps));
    rstd[n] = r;
    T* yr = y + n * C;
#pragma omp simd
    for (std::int64_t c = 0; c < C; ++c) yr[c] = xr[c] * r * w[c];
  }
}

template <class T>
void rmsnorm_backward(T* dx, std::int64_t lddx, T* dw, const T* dy, std::int64_t lddy, const T* x,
                      std::int64_t ldx, const T* w, const T* rstd, std::int64_t N, std::int64_t C) {
  // dx rows are independent; dw is a sum over rows, so each thread sums its
  // static block of rows apart and the partial sums are added in thread order
  // afterwards: deterministic for a fixed thread count.
  const int threads = omp_get_max_threads();
  std::vector<T> dw_part(static_cast<size_t>(threads) * static_cast<size_t>(C), T(0));
#pragma omp parallel num_threads(threads)
  {
    T* dw_local =
        dw_part.data() + static_cast<size_t>(omp_get_thread_num()) * static_cast<size_t>(C);
#pragma omp for schedule(static)
    for (std::int64_t n = 0; n < N; ++n) {
      const T* xr = x + n * ldx;
      const T* dyr = dy + n * lddy;
      const T r = rstd[n];
      T gx = 0;
#pragma omp simd reduction(+ : gx)
      for (std::int64_t c = 0; c < C; ++c) gx += w[c] * dyr[c] * xr[c];
      const T k = r * r * r * gx / static_cast<T>(C);
      T* dxr = dx + n * lddx;
#pragma omp simd
      for (std::int64_t c = 0; c < C; ++c) {
        dxr[c] = r * w[c] * dyr[c] - xr[c] * k;
        dw_local[c] += dyr[c] * xr[c] * r;
      }
    }
  }
  for (int t = 0; t < threads; ++t)
    for (std::int64_t c = 0; c < C; ++c)
      dw[c] += dw_part[static_cast<size_t>(t) * static_cast<size_t>(C) + static_cast<size_t>(c)];
}

template <class T>
void rmsnorm_forward_reference(T* y, T* rstd, const T* x, std::int64_t ldx, const T* w,
                               std::int64_t N, std::int64_t C, double eps) {
  for (std::int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (std::int64_t c = 0; c < C; ++c) ss += double(x[n * ldx + c]) * x[n * ldx + c];
    const double r = 1.0 / std::sqrt(ss / double(C) + eps);
    rstd[n] = static_cast<T>(r);
    for (std::int64_t c = 0; c < C; ++c) y[n * C + c] = static_cast<T>(x[n * ldx + c] * r * w[c]);
  }
}

template <class T>
void rmsnorm_backward_reference(T* dx, std::int64_t lddx, T* dw, const T* dy, std::int64_t lddy,
                                const T* x, std::int64_t ldx, const T* w, const T* rstd,
                                std::int64_t N, std::int64_t C) {
  for (std::int64_t n = 0; n < N; ++n) {
    const double r = rstd[n];
    double gx = 0;
    for (std::int64_t c = 0; c < C; ++c) gx += double(w[c]) * dy[n * lddy + c] * x[n * ldx + c];
    for (std::int64_t c = 0; c < C; ++c) {
      dx[n * lddx + c] =
          static_cast<T>(r * w[c] * dy[n * lddy + c] - x[n * ldx + c] * r * r * r * gx / double(C));
      dw[c] = static_cast<T>(dw[c] + double(dy[n * lddy + c]) * x[n * ldx + c] * r);
    }
  }
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template void rmsnorm_forward<T>(T*, T*, const T*, std::int64_t, const T*, std::int64_t,         \
                                   std::int64_t, double);                                          \
  template void rmsnorm_backward<T>(T*, std::int64_t, T*, const T*, std::int64_t, const T*,        \
                                    std::int64_t, const T*, const T*, std::int64_t, std::int64_t); \
  template void rmsnorm_forward_reference<T>(T*, T*, const T*, std::int64_t, const T*,             \
                                             std::int64_t, std::int64_t, double);                  \
  template void rmsnorm_backward_reference<T>(T*, std::int64_t, T*, const T*, std::int64_t,        \
                                              const T*, std::int64_t, const T*, const T*,          \
                                              std::int64_t, std::int64_t);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
