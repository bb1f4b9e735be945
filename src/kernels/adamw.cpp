#include "kernels/adamw.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace laga {

template <class T>
void adamw_step(T* p, T* m, T* v, const T* g, std::int64_t n, std::int64_t step,
                const AdamWHyper& h) {
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  const T b1 = static_cast<T>(h.beta1), b2 = static_cast<T>(h.beta2);
  const T a1 = static_cast<T>(1.0 - h.beta1), a2 = static_cast<T>(1.0 - h.beta2);
  const T step_size = static_cast<T>(h.lr / bc1);
  const T inv_sqrt_bc2 = static_cast<T>(1.0 / std::sqrt(bc2));
  const T eps = static_cast<T>(h.eps), decay = static_cast<T>(h.lr * h.weight_decay);
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const T gi = g[i];
    const T mi = b1 * m[i] + a1 * gi;
    const T vi = b2 * v[i] + a2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] - decay * p[i] - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
  }
}

template <class T>
void adamw_step_reference(T* p, T* m, T* v, const T* g, std::int64_t n, std::int64_t step,
                          const AdamWHyper& h) {
  for (std::int64_t i = 0; i < n; ++i) {
    const double mi = h.beta1 * m[i] + (1 - h.beta1) * g[i];
    const double vi = h.beta2 * v[i] + (1 - h.beta2) * double(g[i]) * g[i];
    const double mhat = mi / (1 - std::pow(h.beta1, double(step)));
    const double vhat = vi / (1 - std::pow(h.beta2, double(step)));
    m[i] = static_cast<T>(mi);
    v[i] = static_cast<T>(vi);
    p[i] = static_cast<T>(p[i] - h.lr * (mhat / (std::sqrt(vhat) + h.eps) + h.weight_decay * p[i]));
  }
}

template <class T>
double sum_squares(const T* g, std::int64_t n) {
  double s = 0.0;
  for (std::int64_t i = 0; i < n; ++i) s += static_cast<double>(g[i]) * static_cast<double>(g[i]);
  return s;
}

double clip_factor(double norm, double max_norm) {
  if (max_norm <= 0.0 || !(norm > max_norm)) return 1.0;
  return max_norm / (norm + 1e-6);
}

double LrSchedule::at(std::int64_t step) const {
  if (warmup > 0 && step <= warmup)
    return lr * static_cast<double>(step) / static_cast<double>(warmup);
  if (!cosine) return lr;
  const double span = static_cast<double>(std::max<std::int64_t>(1, total - warmup));
  const double t = std::clamp(static_cast<double>(step - warmup) / span, 0.0, 1.0);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(std::numbers::pi * t));
}

#define LAGA_INSTANTIATE(T)                                                               \
  template void adamw_step<T>(T*, T*, T*, const T*, std::int64_t, std::int64_t,           \
                              const AdamWHyper&);                                         \
  template void adamw_step_reference<T>(T*, T*, T*, const T*, std::int64_t, std::int64_t, \
                                        const AdamWHyper&);                               \
  template double sum_squares<T>(const T*, std::int64_t);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
