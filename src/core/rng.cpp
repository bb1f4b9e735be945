#include "core/rng.hpp"

#include <cmath>
#include <numbers>

namespace laga {

std::array<std::uint32_t, 4> philox4x32(std::array<std::uint32_t, 4> c,
                                        std::array<std::uint32_t, 2> k) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = static_cast<std::uint64_t>(kMul0) * c[0];
    const std::uint64_t p1 = static_cast<std::uint64_t>(kMul1) * c[2];
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32),
                        lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32),
                        lo1 = static_cast<std::uint32_t>(p1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += kWeyl0;
    k[1] += kWeyl1;
  }
  return c;
}

namespace {
std::array<std::uint32_t, 4> draw(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return philox4x32({static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32),
                     static_cast<std::uint32_t>(stream), static_cast<std::uint32_t>(stream >> 32)},
                    {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)});
}
// (u + 0.5) / 2^32 lies in (0, 1).
double to_unit(std::uint32_t u) {
  return (static_cast<double>(u) + 0.5) * 0x1.0p-32;
}
}  // namespace

double rng_uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return to_unit(draw(seed, stream, index)[0]);
}

double rng_normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const auto w = draw(seed, stream, index);
  const double u1 = to_unit(w[0]), u2 = to_unit(w[1]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

template <class T>
void fill_normal(T* out, std::int64_t n, std::uint64_t seed, std::uint64_t stream,
                 std::uint64_t first, double stddev) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (std::int64_t i = 0; i < n; ++i)
    out[i] =
        static_cast<T>(stddev * rng_normal(seed, stream, first + static_cast<std::uint64_t>(i)));
}

template <class T>
void fill_uniform(T* out, std::int64_t n, std::uint64_t seed, std::uint64_t stream,
                  std::uint64_t first, double lo, double hi) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (std::int64_t i = 0; i < n; ++i)
    out[i] = static_cast<T>(
        lo + (hi - lo) * rng_uniform(seed, stream, first + static_cast<std::uint64_t>(i)));
}

template void fill_normal<float>(float*, std::int64_t, std::uint64_t, std::uint64_t, std::uint64_t,
                                 double);
template void fill_normal<double>(double*, std::int64_t, std::uint64_t, std::uint64_t,
                                  std::uint64_t, double);
template void fill_uniform<float>(float*, std::int64_t, std::uint64_t, std::uint64_t, std::uint64_t,
                                  double, double);
template void fill_uniform<double>(double*, std::int64_t, std::uint64_t, std::uint64_t,
                                   std::uint64_t, double, double);

}  // namespace laga
