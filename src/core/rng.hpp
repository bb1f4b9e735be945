// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11).
//
// A value depends only on (seed, stream, index), never on call order or on
// which thread or rank makes it, so rank r can fill its shard of a global
// tensor with exactly the numbers a single rank would have put there: element
// i of the global tensor is philox(seed, stream, i).
#pragma once

#include <array>
#include <cstdint>

namespace laga {

std::array<std::uint32_t, 4> philox4x32(std::array<std::uint32_t, 4> counter,
                                        std::array<std::uint32_t, 2> key);

// Uniform in (0, 1): never exactly 0 or 1, so log() in Box-Muller is finite.
double rng_uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t index);
// Standard normal by Box-Muller on the first two Philox words.
double rng_normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t index);

// out[i] = stddev * normal(seed, stream, first + i), i in [0, n).
template <class T>
void fill_normal(T* out, std::int64_t n, std::uint64_t seed, std::uint64_t stream,
                 std::uint64_t first, double stddev);
// out[i] = lo + (hi - lo) * uniform(seed, stream, first + i).
template <class T>
void fill_uniform(T* out, std::int64_t n, std::uint64_t seed, std::uint64_t stream,
                  std::uint64_t first, double lo, double hi);

}  // namespace laga
