#include "kernels/rope.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.hpp"

namespace laga {

std::vector<double> rope_frequencies(const RopeParams& p) {
  const std::int64_t d = p.dim;
  std::vector<double> freqs(static_cast<size_t>(d / 2));
  for (std::int64_t i = 0; i < d / 2; ++i)
    freqs[static_cast<size_t>(i)] =
        1.0 / std::pow(p.theta, static_cast<double>(2 * i) / static_cast<double>(d));
  if (!p.yarn) return freqs;
  // The dimension at which a frequency completes `rotations` turns over the
  // original context.
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(d) *
           std::log(static_cast<double>(p.original_seq_len) /
                    (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(p.theta));
  };
  const double low = std::max(std::floor(correction_dim(p.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(p.beta_slow)), static_cast<double>(d - 1));
  if (low == high) high += 0.001;
  for (std::int64_t i = 0; i < d / 2; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double smooth = 1.0 - ramp;
    double& f = freqs[static_cast<size_t>(i)];
    f = f / p.factor * (1.0 - smooth) + f * smooth;
  }
  return freqs;
}

RopeTable::RopeTable(const RopeParams& p, std::int64_t positions)
    : dim_(p.dim), positions_(positions) {
  LAGA_CHECK(p.dim > 0 && p.dim % 2 == 0, "rope: qk_rope_head_dim must be even and positive, got ",
             p.dim);
  const auto freqs = rope_frequencies(p);
  const std::int64_t half = dim_ / 2;
  cos_.resize(static_cast<size_t>(positions * half));
  sin_.resize(static_cast<size_t>(positions * half));
  for (std::int64_t pos = 0; pos < positions; ++pos)
    for (std::int64_t i = 0; i < half; ++i) {
      const double a = static_cast<double>(pos) * freqs[static_cast<size_t>(i)];
      cos_[idx(pos, i)] = std::cos(a);
      sin_[idx(pos, i)] = std::sin(a);
    }
}

RopeTable RopeTable::unbacked(const RopeParams& p, std::int64_t positions) {
  LAGA_CHECK(p.dim > 0 && p.dim % 2 == 0, "rope: qk_rope_head_dim must be even and positive, got ",
             p.dim);
  return RopeTable(p.dim, positions);
}

template <class T>
void rope_apply(T* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                std::int64_t ld_head, std::int64_t pos0, const RopeTable& table, bool inverse) {
  LAGA_CHECK(pos0 >= 0 && pos0 + L <= table.positions(), "rope: positions [", pos0, ", ", pos0 + L,
             ") exceed the table's ", table.positions(),
             "; build the RopeTable for the full sequence");
  LAGA_CHECK(table.backed(),
             "rope: the table has no cos/sin (RopeTable::unbacked is for "
             "count-only runs, where no kernel runs)");
  const std::int64_t half = table.dim() / 2;
  const double sign = inverse ? -1.0 : 1.0;
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t l = 0; l < L; ++l) {
      const std::int64_t pos = pos0 + l;
      for (std::int64_t h = 0; h < H; ++h) {
        T* p = x + (b * L + l) * ld_token + h * ld_head;
        for (std::int64_t i = 0; i < half; ++i) {
          const T c = static_cast<T>(table.cos(pos, i));
          const T s = static_cast<T>(sign * table.sin(pos, i));
          const T re = p[2 * i], im = p[2 * i + 1];
          p[2 * i] = re * c - im * s;
          p[2 * i + 1] = re * s + im * c;
        }
      }
    }
}

template void rope_apply<float>(float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                                std::int64_t, std::int64_t, const RopeTable&, bool);
template void rope_apply<double>(double*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                                 std::int64_t, std::int64_t, const RopeTable&, bool);

}  // namespace laga
