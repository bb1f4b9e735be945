#include "kernels/cross_entropy.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"

namespace laga {

namespace {
void check_target(std::int32_t t, std::int64_t i, std::int64_t V) {
  LAGA_CHECK(t == kIgnoreTarget || (t >= 0 && t < V), "cross_entropy: target id ", t, " of row ", i,
             " is outside the vocabulary [0, ", V, "); raise --vocab or fix the data");
}
}  // namespace

template <class T>
void cross_entropy_forward(T* loss, double* lse, const T* logits, const std::int32_t* targets,
                           std::int64_t N, std::int64_t V) {
  for (std::int64_t i = 0; i < N; ++i) check_target(targets[i], i, V);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < N; ++i) {
    if (targets[i] == kIgnoreTarget) {
      lse[i] = 0, loss[i] = T(0);
      continue;
    }
    const T* row = logits + i * V;
    double m = row[0];
    for (std::int64_t v = 1; v < V; ++v) m = std::max(m, static_cast<double>(row[v]));
    double s = 0.0;
    for (std::int64_t v = 0; v < V; ++v) s += std::exp(static_cast<double>(row[v]) - m);
    const double l = m + std::log(s);
    lse[i] = l;
    loss[i] = static_cast<T>(l - static_cast<double>(row[targets[i]]));
  }
}

template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const double* lse,
                            const std::int32_t* targets, double scale, std::int64_t N,
                            std::int64_t V) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < N; ++i) {
    const T* row = logits + i * V;
    T* d = dlogits + i * V;
    if (targets[i] == kIgnoreTarget) {
      std::fill_n(d, V, T(0));
      continue;
    }
    const double l = lse[i];
    for (std::int64_t v = 0; v < V; ++v)
      d[v] = static_cast<T>(scale * std::exp(static_cast<double>(row[v]) - l));
    d[targets[i]] = static_cast<T>(static_cast<double>(d[targets[i]]) - scale);
  }
}

template <class T>
void cross_entropy_forward_reference(T* loss, const T* logits, const std::int32_t* targets,
                                     std::int64_t N, std::int64_t V) {
  std::vector<double> p(static_cast<size_t>(V));
  for (std::int64_t i = 0; i < N; ++i) {
    check_target(targets[i], i, V);
    if (targets[i] == kIgnoreTarget) {
      loss[i] = T(0);
      continue;
    }
    double m = -INFINITY, s = 0.0;
    for (std::int64_t v = 0; v < V; ++v) m = std::max(m, static_cast<double>(logits[i * V + v]));
    for (std::int64_t v = 0; v < V; ++v) s += p[v] = std::exp(logits[i * V + v] - m);
    loss[i] = static_cast<T>(-std::log(p[targets[i]] / s));
  }
}

template <class T>
void cross_entropy_backward_reference(T* dlogits, const T* logits, const std::int32_t* targets,
                                      double scale, std::int64_t N, std::int64_t V) {
  std::vector<double> p(static_cast<size_t>(V));
  for (std::int64_t i = 0; i < N; ++i) {
    if (targets[i] == kIgnoreTarget) {
      std::fill_n(dlogits + i * V, V, T(0));
      continue;
    }
    double m = -INFINITY, s = 0.0;
    for (std::int64_t v = 0; v < V; ++v) m = std::max(m, static_cast<double>(logits[i * V + v]));
    for (std::int64_t v = 0; v < V; ++v) s += p[v] = std::exp(logits[i * V + v] - m);
    for (std::int64_t v = 0; v < V; ++v)
      dlogits[i * V + v] = static_cast<T>(scale * (p[v] / s - (v == targets[i] ? 1.0 : 0.0)));
  }
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template void cross_entropy_forward<T>(T*, double*, const T*, const std::int32_t*, std::int64_t, \
                                         std::int64_t);                                            \
  template void cross_entropy_backward<T>(T*, const T*, const double*, const std::int32_t*,        \
                                          double, std::int64_t, std::int64_t);                     \
  template void cross_entropy_forward_reference<T>(T*, const T*, const std::int32_t*,              \
                                                   std::int64_t, std::int64_t);                    \
  template void cross_entropy_backward_reference<T>(T*, const T*, const std::int32_t*, double,     \
                                                    std::int64_t, std::int64_t);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
