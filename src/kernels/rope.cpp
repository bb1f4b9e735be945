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
  // dim 0: nothing rotates (NoPE); an empty table that no kernel reads.
  LAGA_CHECK(p.dim >= 0 && p.dim % 2 == 0, "rope: qk_rope_head_dim must be even and >= 0, got ",
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
  // dim 0: nothing rotates (NoPE); an empty table that no kernel reads.
  LAGA_CHECK(p.dim >= 0 && p.dim % 2 == 0, "rope: qk_rope_head_dim must be even and >= 0, got ",
             p.dim);
  return RopeTable(p.dim, positions);
}

namespace {

void require_backed(const RopeTable& table) {
  LAGA_CHECK(table.backed(),
             "rope: the table has no cos/sin (RopeTable::unbacked is for "
             "count-only runs, where no kernel runs)");
}

// The one rotation loop: token (b, l) at position position_of(b, l), already
// checked to lie in the table.
template <class T, class PositionOf>
void rotate(T* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
            std::int64_t ld_head, PositionOf position_of, const RopeTable& table, bool inverse) {
  const std::int64_t half = table.dim() / 2;
  const double sign = inverse ? -1.0 : 1.0;
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t l = 0; l < L; ++l) {
      const std::int64_t pos = position_of(b, l);
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

}  // namespace

template <class T>
void rope_apply(T* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                std::int64_t ld_head, std::int64_t pos0, const RopeTable& table, bool inverse) {
  LAGA_CHECK(pos0 >= 0 && pos0 + L <= table.positions(), "rope: positions [", pos0, ", ", pos0 + L,
             ") exceed the table's ", table.positions(),
             "; build the RopeTable for the full sequence");
  require_backed(table);
  rotate(
      x, B, L, H, ld_token, ld_head, [pos0](std::int64_t, std::int64_t l) { return pos0 + l; },
      table, inverse);
}

template <class T>
void rope_apply_at(T* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                   std::int64_t ld_head, const std::int64_t* positions, const RopeTable& table,
                   bool inverse) {
  for (std::int64_t t = 0; t < B * L; ++t)
    LAGA_CHECK(positions[t] >= 0 && positions[t] < table.positions(), "rope: position ",
               positions[t], " of token ", t % L, " of batch row ", t / L,
               " is outside the table's [0, ", table.positions(),
               "); build the RopeTable for the longest document (or sequence)");
  require_backed(table);
  rotate(
      x, B, L, H, ld_token, ld_head,
      [positions, L](std::int64_t b, std::int64_t l) { return positions[b * L + l]; }, table,
      inverse);
}

#define LAGA_INSTANTIATE(T)                                                                  \
  template void rope_apply<T>(T*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,    \
                              std::int64_t, std::int64_t, const RopeTable&, bool);           \
  template void rope_apply_at<T>(T*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, \
                                 std::int64_t, const std::int64_t*, const RopeTable&, bool);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
