#include "kernels/rmsnorm.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace laga {

// RMSNorm is scale-invariant but its sum of squares is not, and every
// figure of the row must stay inside the type's range at both ends:
//  - summed as x^2, a float row of |x| ~ 1e19 over 512 columns summed to
//    inf and came out exactly 0 (issue 26);
//  - summed as (x/m)^2 with m the row's largest |x| and eps carried as
//    eps / m^2 (issue 26's fix), a float row with m below ~5e-23 made
//    eps / m^2 inf and came out exactly 0, and a subnormal m made 1/m inf
//    and the row NaN (issue 54, F).
// So the row's root mean square d = sqrt(mean x^2 + eps) is computed in
// double whatever T is, from m and the mean of (x/m)^2 (in [1/C, 1]):
//   d = m sqrt(mean (x/m)^2 + (eps/m)/m),
// and where (eps/m)/m passes double's range (eps exceeds m^2 by more than
// 1e308, so m^2 is far below eps's last bit) d = sqrt(eps). Neither
// overflows or underflows for any finite x of either type (a float's square
// is within double's range; a double's is scaled by m first). y = x w / d,
// rounded once to T; rstd = 1/d is saved for backward (for a float it stays
// representable: it lies in [1/m, 1/sqrt(eps)], and eps >= 1e-30 by the
// config's rule; eps = 0 with a zero row is 1/0, the caller's choice).
namespace {
template <class T>
double row_rms(const T* xr, std::int64_t C, double eps) {
  double m = 0;
#pragma omp simd reduction(max : m)
  for (std::int64_t c = 0; c < C; ++c) m = std::max(m, std::abs(static_cast<double>(xr[c])));
  if (m == 0) return std::sqrt(eps);                                       // an all-zero row
  if (!std::isfinite(m)) return std::numeric_limits<double>::quiet_NaN();  // stays visible
  const double s = 1.0 / m;  // inf only for a double m below 1/DBL_MAX: divide then
  double ss = 0;
  if (std::isfinite(s)) {
#pragma omp simd reduction(+ : ss)
    for (std::int64_t c = 0; c < C; ++c) {
      const double v = static_cast<double>(xr[c]) * s;
      ss += v * v;
    }
  } else {
    for (std::int64_t c = 0; c < C; ++c) {
      const double v = static_cast<double>(xr[c]) / m;
      ss += v * v;
    }
  }
  const double mean = ss / static_cast<double>(C);  // NaN when the row holds one
  const double q = eps / m / m;
  if (!std::isfinite(q)) return std::isnan(mean) ? mean : std::sqrt(eps);
  return m * std::sqrt(mean + q);
}
}  // namespace

template <class T>
void rmsnorm_forward(T* y, T* rstd, const T* x, std::int64_t ldx, const T* w, std::int64_t N,
                     std::int64_t C, double eps) {
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * ldx;
    const double d = row_rms(xr, C, eps), r = 1.0 / d;
    rstd[n] = static_cast<T>(r);
    T* yr = y + n * C;
    if (std::isnormal(r) || !std::isfinite(r)) {
#pragma omp simd
      for (std::int64_t c = 0; c < C; ++c)
        yr[c] = static_cast<T>(static_cast<double>(xr[c]) * r * static_cast<double>(w[c]));
    } else {  // a double row near DBL_MAX: 1/d is subnormal, divide instead
      for (std::int64_t c = 0; c < C; ++c)
        yr[c] = static_cast<T>(static_cast<double>(xr[c]) / d * static_cast<double>(w[c]));
    }
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
