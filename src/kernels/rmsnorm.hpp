// RMSNorm, weight only, no centering (DeepSeek-V3 `RMSNorm`):
//   y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps), per row of C.
// Backward, with g = w * dy and C the row width:
//   dx = rstd * g - x * rstd^3 * sum(g * x) / C
//   dw += sum over rows of dy * x * rstd
#pragma once

#include <cstdint>

namespace laga {

// y (N, C) contiguous; x (N, C) with row stride ldx (x may be the first C
// columns of a wider row, as the latent is of wkv_a's output); rstd (N) saved.
template <class T>
void rmsnorm_forward(T* y, T* rstd, const T* x, std::int64_t ldx, const T* w, std::int64_t N,
                     std::int64_t C, double eps);

// dx (N, C) with row stride lddx, overwritten; dy and x (N, C) with row
// strides lddy and ldx; dw (C) accumulated. Each has its own stride because
// each may be the first C columns of a different wider row (the block's
// d[q | kv_a], d[c_hat | k_pe] and saved kv_a).
template <class T>
void rmsnorm_backward(T* dx, std::int64_t lddx, T* dw, const T* dy, std::int64_t lddy, const T* x,
                      std::int64_t ldx, const T* w, const T* rstd, std::int64_t N, std::int64_t C);

// Naive versions in double, for tests.
template <class T>
void rmsnorm_forward_reference(T* y, T* rstd, const T* x, std::int64_t ldx, const T* w,
                               std::int64_t N, std::int64_t C, double eps);
template <class T>
void rmsnorm_backward_reference(T* dx, std::int64_t lddx, T* dw, const T* dy, std::int64_t lddy,
                                const T* x, std::int64_t ldx, const T* w, const T* rstd,
                                std::int64_t N, std::int64_t C);

}  // namespace laga
