#include "kernels/rmsnorm.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace laga {

// RMSNorm is scale-invariant but its sum of squares is not: a row whose
// sum of x^2 passes the type's range (float: |x| ~ 1e19 over 512 columns)
// made it inf, 1/sqrt(inf) = 0, and the row exactly 0 with nothing
// non-finite to notice (issue 26). So each row is summed as (x / m)^2, m its
// largest |x|, and
//   rstd = 1 / sqrt(sum x^2 / C + eps) = (1/m) / sqrt(sum (x/m)^2 / C + eps / m^2),
// which neither overflows nor, for rows of ordinary size, rounds differently
// by more than an ulp or two. rstd itself stays representable: it is about
// 1 / m.
template <class T>
void rmsnorm_forward(T* y, T* rstd, const T* x, std::int64_t ldx, const T* w, std::int64_t N,
                     std::int64_t C, double eps) {
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * ldx;
    T m = 0;
#pragma omp simd reduction(max : m)
    for (std::int64_t c = 0; c < C; ++c) m = std::max(m, std::abs(xr[c]));
    T r = T(1) / std::sqrt(static_cast<T>(eps));  // an all-zero row
    if (m > 0 && std::isfinite(m)) {
      const T s = T(1) / m;
      T ss = 0;
#pragma omp simd reduction(+ : ss)
      for (std::int64_t c = 0; c < C; ++c) ss += (xr[c] * s) * (xr[c] * s);
      r = s / std::sqrt(ss / static_cast<T>(C) + static_cast<T>(eps) * s * s);
    } else if (!(m == 0)) {
      r = std::numeric_limits<T>::quiet_NaN();  // a non-finite input stays visible
    }
    rstd[n] = r;
    T* yr = y + n * C;
#pragma omp simd
    for (std::int64_t c = 0; c < C; ++c) yr[c] = xr[c] * r * w[c];
  }
}

// With xhat = x rstd (of order 1 whatever the row's scale),
//   dx = rstd (w dy - xhat (sum_c w dy xhat) / C),  dw += dy xhat:
// the same gradient as rstd w dy - x rstd^3 (sum w dy x) / C, without the
// rstd^3 that underflows (and x sum(x) that overflows) for large rows.
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
      T g = 0;
#pragma omp simd reduction(+ : g)
      for (std::int64_t c = 0; c < C; ++c) g += w[c] * dyr[c] * (xr[c] * r);
      const T k = g / static_cast<T>(C);
      T* dxr = dx + n * lddx;
#pragma omp simd
      for (std::int64_t c = 0; c < C; ++c) {
        const T xhat = xr[c] * r;
        dxr[c] = r * (w[c] * dyr[c] - xhat * k);
        dw_local[c] += dyr[c] * xhat;
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
    // In long double (x86's 80-bit: a double row's squares cannot overflow
    // it), the definition as written.
    long double ss = 0;
    for (std::int64_t c = 0; c < C; ++c) {
      const long double v = x[n * ldx + c];
      ss += v * v;
    }
    const double r = static_cast<double>(1.0L / std::sqrt(ss / C + static_cast<long double>(eps)));
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
    double g = 0;  // sum_c w dy xhat, xhat = x rstd
    for (std::int64_t c = 0; c < C; ++c)
      g += double(w[c]) * dy[n * lddy + c] * (double(x[n * ldx + c]) * r);
    for (std::int64_t c = 0; c < C; ++c) {
      const double xhat = double(x[n * ldx + c]) * r;
      dx[n * lddx + c] = static_cast<T>(r * (w[c] * dy[n * lddy + c] - xhat * g / double(C)));
      dw[c] = static_cast<T>(dw[c] + double(dy[n * lddy + c]) * xhat);
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
