#include "kernels/swiglu.hpp"

#include <cmath>

namespace laga {

namespace {
// 1 / (1 + e^-a) overflows e^-a to inf for a < -88 in float, which still
// gives the right limit 0; computing in double avoids even that.
inline double sigmoid(double a) {
  return 1.0 / (1.0 + std::exp(-a));
}
}  // namespace

template <class T>
void swiglu_forward(T* h, const T* a, const T* b, std::int64_t n) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = a[i];
    h[i] = static_cast<T>(x * sigmoid(x) * static_cast<double>(b[i]));
  }
}

template <class T>
void swiglu_backward(T* da, T* db, const T* dh, const T* a, const T* b, std::int64_t n) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = a[i], s = sigmoid(x), g = dh[i];
    da[i] = static_cast<T>(g * static_cast<double>(b[i]) * s * (1.0 + x * (1.0 - s)));
    db[i] = static_cast<T>(g * x * s);
  }
}

template <class T>
void swiglu_forward_reference(T* h, const T* a, const T* b, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = a[i];
    h[i] = static_cast<T>(x / (1.0 + std::exp(-x)) * b[i]);
  }
}

template <class T>
void swiglu_backward_reference(T* da, T* db, const T* dh, const T* a, const T* b, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    // d/da [a sigma(a)] = sigma(a) + a sigma(a) (1 - sigma(a)), written out
    // differently from the kernel so a shared typo cannot pass.
    const double x = a[i], e = std::exp(-x), s = 1.0 / (1.0 + e);
    const double dsilu = s + x * e / ((1.0 + e) * (1.0 + e));
    da[i] = static_cast<T>(dh[i] * b[i] * dsilu);
    db[i] = static_cast<T>(dh[i] * x * s);
  }
}

#define LAGA_INSTANTIATE(T)                                                             \
  template void swiglu_forward<T>(T*, const T*, const T*, std::int64_t);                \
  template void swiglu_backward<T>(T*, T*, const T*, const T*, const T*, std::int64_t); \
  template void swiglu_forward_reference<T>(T*, const T*, const T*, std::int64_t);      \
  template void swiglu_backward_reference<T>(T*, T*, const T*, const T*, const T*, std::int64_t);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
