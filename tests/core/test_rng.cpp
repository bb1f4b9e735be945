// Philox4x32-10 and the counter-based fills built on it.
#include "core/rng.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

namespace laga {
namespace {

using Words = std::array<std::uint32_t, 4>;

// Known-answer vectors of Random123 (kat_vectors, "philox4x32 10"): counter,
// key, expected output.
TEST(Philox4x32, Random123KnownAnswers) {
  EXPECT_EQ(philox4x32({0, 0, 0, 0}, {0, 0}),
            (Words{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(
      philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}),
      (Words{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  // Digits of pi: exercises every word of counter and key with distinct values.
  EXPECT_EQ(
      philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
      (Words{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Rng, SameArgumentsSameValue) {
  for (std::uint64_t i : {0ull, 1ull, 12345ull, (1ull << 40) + 7}) {
    EXPECT_EQ(rng_uniform(42, 3, i), rng_uniform(42, 3, i));
    EXPECT_EQ(rng_normal(42, 3, i), rng_normal(42, 3, i));
  }
  // Call order does not matter: values drawn backwards equal values drawn forwards.
  std::vector<double> fwd, bwd(100);
  for (std::uint64_t i = 0; i < 100; ++i) fwd.push_back(rng_normal(7, 1, i));
  for (std::uint64_t i = 100; i-- > 0;) bwd[i] = rng_normal(7, 1, i);
  EXPECT_EQ(fwd, bwd);
}

TEST(Rng, EveryBitOfSeedStreamAndIndexMatters) {
  const double base = rng_uniform(1, 1, 1);
  // Low and high 32-bit halves of each 64-bit argument go to different
  // Philox words; flipping any of them must change the value.
  EXPECT_NE(rng_uniform(2, 1, 1), base);
  EXPECT_NE(rng_uniform(1 + (1ull << 32), 1, 1), base);
  EXPECT_NE(rng_uniform(1, 2, 1), base);
  EXPECT_NE(rng_uniform(1, 1 + (1ull << 32), 1), base);
  EXPECT_NE(rng_uniform(1, 1, 2), base);
  EXPECT_NE(rng_uniform(1, 1, 1 + (1ull << 32)), base);
}

TEST(Rng, UniformIsPhiloxWordZeroMappedIntoOpenInterval) {
  // index -> counter {lo, hi, stream lo, stream hi}, seed -> key {lo, hi}.
  const std::uint64_t seed = 0x0123456789abcdefull, stream = 0xfedcba9876543210ull,
                      index = 0x1122334455667788ull;
  const Words w =
      philox4x32({0x55667788u, 0x11223344u, 0x76543210u, 0xfedcba98u}, {0x89abcdefu, 0x01234567u});
  EXPECT_EQ(rng_uniform(seed, stream, index), (static_cast<double>(w[0]) + 0.5) * 0x1.0p-32);
}

TEST(Rng, NormalIsBoxMullerOnWordsZeroAndOne) {
  // z = sqrt(-2 ln u1) cos(2 pi u2), u_k = (word_k + 0.5) / 2^32 of
  // philox(counter {index lo, index hi, stream lo, stream hi}, key {seed lo, seed hi}).
  for (std::uint64_t i : {0ull, 5ull, 123456789ull}) {
    const Words w = philox4x32({static_cast<std::uint32_t>(i), 0u, 9u, 0u}, {31u, 0u});
    const double u1 = (w[0] + 0.5) * 0x1.0p-32, u2 = (w[1] + 0.5) * 0x1.0p-32;
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    EXPECT_NEAR(rng_normal(31, 9, i), z, 1e-15 * (1 + std::abs(z))) << "index " << i;
  }
}

template <class T>
class FillTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(FillTest, Types);

TYPED_TEST(FillTest, OffsetFillEqualsSliceOfFullFill) {
  // n > 65536 so the full fill runs the OpenMP path; the shards run serially:
  // the numbers must not depend on the thread that makes them.
  constexpr std::int64_t n = 70001;
  std::vector<TypeParam> full(n), part(n);
  fill_normal(full.data(), n, 1234, 5, 0, 0.02);
  const std::int64_t cuts[] = {0, 1, 17, 40000, 69999, n};
  for (int c = 0; c + 1 < 6; ++c)
    fill_normal(part.data() + cuts[c], cuts[c + 1] - cuts[c], 1234, 5,
                static_cast<std::uint64_t>(cuts[c]), 0.02);
  EXPECT_EQ(full, part);
  // And each element is stddev * rng_normal(seed, stream, i), rounded to T.
  for (std::int64_t i : {std::int64_t{0}, std::int64_t{12345}, n - 1})
    EXPECT_EQ(full[i], static_cast<TypeParam>(0.02 * rng_normal(1234, 5, i)));

  std::vector<TypeParam> ufull(n), upart(n);
  fill_uniform(ufull.data(), n, 99, 0, 0, -2.0, 3.0);
  fill_uniform(upart.data(), 30000, 99, 0, 0, -2.0, 3.0);
  fill_uniform(upart.data() + 30000, n - 30000, 99, 0, 30000, -2.0, 3.0);
  EXPECT_EQ(ufull, upart);
}

TYPED_TEST(FillTest, StreamsAreDifferent) {
  std::vector<TypeParam> a(64), b(64);
  fill_normal(a.data(), 64, 1, 0, 0, 1.0);
  fill_normal(b.data(), 64, 1, 1, 0, 1.0);
  int equal = 0;
  for (int i = 0; i < 64; ++i) equal += a[i] == b[i];
  EXPECT_EQ(equal, 0);
}

// Moments of 1e5 samples. The standard error of a mean of n unit-variance
// samples is 1/sqrt(n) = 3.2e-3, of the variance sqrt(2/n) = 4.5e-3 (normal)
// and of a uniform's mean sqrt(1/12/n) = 9.1e-4: the bounds below are ~5
// standard errors, so a correct generator fails with probability < 1e-6 and a
// biased one (e.g. a wrong Box-Muller constant) fails for sure.
TEST(Rng, NormalMoments) {
  constexpr std::int64_t n = 100000;
  std::vector<double> x(n);
  fill_normal(x.data(), n, 2024, 0, 0, 1.0);
  double mean = 0, m2 = 0, m4 = 0, mx = 0;
  for (double v : x) mean += v;
  mean /= n;
  for (double v : x) {
    m2 += (v - mean) * (v - mean);
    m4 += std::pow(v - mean, 4);
    mx = std::max(mx, std::abs(v));
  }
  m2 /= n;
  m4 /= n;
  EXPECT_NEAR(mean, 0.0, 0.016);
  EXPECT_NEAR(m2, 1.0, 0.023);
  EXPECT_NEAR(m4 / (m2 * m2), 3.0, 0.1);  // kurtosis; SE sqrt(24/n) = 0.015
  EXPECT_LT(mx, 6.5);                     // P(|z| > 6.5) ~ 8e-11 per sample
  EXPECT_GT(mx, 3.5);                     // 1e5 samples reach 3.5 (P(miss) ~ e^-46)

  std::vector<double> y(n);
  fill_normal(y.data(), n, 2024, 0, 0, 0.5);  // stddev scales
  for (int i = 0; i < 100; ++i) EXPECT_DOUBLE_EQ(y[i], 0.5 * x[i]);
}

TEST(Rng, UniformMomentsAndRange) {
  constexpr std::int64_t n = 100000;
  std::vector<double> u(n);
  for (std::int64_t i = 0; i < n; ++i) u[i] = rng_uniform(77, 3, static_cast<std::uint64_t>(i));
  double mean = 0, var = 0;
  for (double v : u) {
    ASSERT_GT(v, 0.0);
    ASSERT_LT(v, 1.0);
    mean += v;
  }
  mean /= n;
  for (double v : u) var += (v - mean) * (v - mean);
  var /= n;
  EXPECT_NEAR(mean, 0.5, 0.0046);
  EXPECT_NEAR(var, 1.0 / 12.0, 0.0013);  // SE of the variance: sqrt(1/180/n) = 2.4e-4
  // Ten equal bins each hold 1e4 +- 100 (binomial SE 95): 5 SE.
  std::vector<int> bins(10, 0);
  for (double v : u) ++bins[static_cast<int>(v * 10)];
  for (int b = 0; b < 10; ++b) EXPECT_NEAR(bins[b], 10000, 500) << "bin " << b;

  std::vector<float> f(1000);
  fill_uniform(f.data(), 1000, 5, 0, 0, -3.0, -1.0);
  for (float v : f) {
    ASSERT_GE(v, -3.0f);
    ASSERT_LE(v, -1.0f);
  }
}

}  // namespace
}  // namespace laga
