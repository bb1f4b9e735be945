#include "kernels/output_gate.hpp"

#include <cmath>

namespace laga {

namespace {
// In double: 1 / (1 + e^-g) is then exact to double's rounding for every
// float g, and e^-g's overflow (g < -709) still gives the limit 0.
inline double sigmoid(double g) {
  return 1.0 / (1.0 + std::exp(-g));
}
}  // namespace

template <class T>
void output_gate_forward(T* y, const T* o, const T* g, std::int64_t n) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i)
    y[i] = static_cast<T>(static_cast<double>(o[i]) * sigmoid(static_cast<double>(g[i])));
}

template <class T>
void output_gate_backward(T* d_o, T* dg, const T* dy, const T* o, const T* g, std::int64_t n) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const double s = sigmoid(static_cast<double>(g[i])), d = dy[i];
    d_o[i] = static_cast<T>(d * s);
    dg[i] = static_cast<T>(d * static_cast<double>(o[i]) * s * (1.0 - s));
  }
}

template <class T>
void output_gate_forward_reference(T* y, const T* o, const T* g, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const double e = std::exp(static_cast<double>(g[i]));  // sigmoid(g) = e / (1 + e)
    y[i] = static_cast<T>(std::isinf(e) ? double(o[i]) : double(o[i]) * e / (1.0 + e));
  }
}

template <class T>
void output_gate_backward_reference(T* d_o, T* dg, const T* dy, const T* o, const T* g,
                                    std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    // sigmoid'(g) = e^-g / (1 + e^-g)^2, written out rather than s (1 - s)
    // so a shared typo cannot pass.
    const double e = std::exp(-static_cast<double>(g[i]));
    const double s = 1.0 / (1.0 + e);
    const double ds = std::isinf(e) ? 0.0 : e / ((1.0 + e) * (1.0 + e));
    d_o[i] = static_cast<T>(dy[i] * s);
    dg[i] = static_cast<T>(dy[i] * o[i] * ds);
  }
}

#define LAGA_INSTANTIATE(T)                                                                  \
  template void output_gate_forward<T>(T*, const T*, const T*, std::int64_t);                \
  template void output_gate_backward<T>(T*, T*, const T*, const T*, const T*, std::int64_t); \
  template void output_gate_forward_reference<T>(T*, const T*, const T*, std::int64_t);      \
  template void output_gate_backward_reference<T>(T*, T*, const T*, const T*, const T*,      \
                                                  std::int64_t);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
