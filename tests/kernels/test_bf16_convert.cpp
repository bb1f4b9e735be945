// fp32 -> bf16 rounding (core/bf16.hpp's to_bf16 and both paths of
// kernels/bf16_convert.hpp) against a naive reference that shares no code
// with them: it finds the two bf16 neighbours of x in double and picks the
// nearer, the even one on a tie, instead of adding a rounding bias to the
// bits. NaN, inf, ties both ways, overflow to inf, fp32 denormals (flushed to
// signed zero by design, core/bf16.hpp says why), then random bit patterns
// of every kind. Tensor<bf16>'s bytes as the pool counts them.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "core/bf16.hpp"
#include "core/memory_pool.hpp"
#include "core/tensor.hpp"
#include "kernels/bf16_convert.hpp"

namespace laga {
namespace {

float from_bits(std::uint32_t u) {
  return std::bit_cast<float>(u);
}
std::uint32_t bits_of(float x) {
  return std::bit_cast<std::uint32_t>(x);
}

// The reference: what bf16 value x should become, by the definition.
bf16 naive_to_bf16(float x) {
  const std::uint32_t u = bits_of(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 31) << 15);
  if (std::isnan(x)) {
    // Sign and the top 7 fraction bits kept, quiet bit set.
    return {static_cast<std::uint16_t>(sign | 0x7FC0u | ((u >> 16) & 0x007Fu))};
  }
  if (std::isinf(x)) return {static_cast<std::uint16_t>(sign | 0x7F80u)};
  if (std::fpclassify(x) == FP_SUBNORMAL || x == 0.0f) return {sign};
  // |x| lies in [lo, hi], the bf16 magnitudes on either side (hi may be inf,
  // which is what IEEE rounding gives past the largest finite bf16 when x is
  // at or beyond the midpoint to 2^128).
  const double ax = std::abs(static_cast<double>(x));
  const std::uint16_t lo_bits = static_cast<std::uint16_t>((u >> 16) & 0x7FFFu);
  const std::uint16_t hi_bits = static_cast<std::uint16_t>(lo_bits + 1);
  const double lo = std::abs(static_cast<double>(to_float(bf16{lo_bits})));
  // hi as 2^128 when it is bf16's inf: the distance that decides a tie.
  const double hi =
      hi_bits == 0x7F80u ? std::ldexp(1.0, 128) : static_cast<double>(to_float(bf16{hi_bits}));
  std::uint16_t pick;
  if (ax - lo < hi - ax)
    pick = lo_bits;
  else if (ax - lo > hi - ax)
    pick = hi_bits;
  else
    pick = (lo_bits & 1u) ? hi_bits : lo_bits;  // a tie: the even one
  return {static_cast<std::uint16_t>(sign | pick)};
}

// The inputs every path is held to: hand-picked edge cases first, then
// random bit patterns (every exponent, both signs, NaN payloads included).
std::vector<float> edge_and_random_inputs() {
  const std::vector<std::uint32_t> edges = {
      0x00000000, 0x80000000,  // +-0
      0x7F800000, 0xFF800000,  // +-inf
      0x7FC00000, 0xFFC00000,  // quiet NaN, both signs
      0x7F800001,              // signalling NaN, payload only in dropped bits: must stay NaN
      0x7FA00000, 0xFF812345,  // signalling NaNs with kept payload
      0x00000001, 0x80000001,  // smallest denormals
      0x007FFFFF, 0x807FFFFF,  // largest denormals (would round up to the smallest normal)
      0x00400000,              // a mid denormal
      0x00800000, 0x80800000,  // smallest normals
      0x7F7FFFFF, 0xFF7FFFFF,  // largest finite fp32: past bf16's largest, rounds to inf
      0x7F7F7FFF,              // just below the midpoint to inf: stays finite
      0x7F7F8000,              // exactly the midpoint, odd kept bit: to inf
      0x7F7E8000,              // a midpoint, even kept bit: down
      0x3F800000,              // 1
      0x3F808000,              // 1 + 2^-8: a tie, kept bit even -> down to 1
      0x3F818000,              // a tie, kept bit odd -> up
      0x3F808001, 0x3F807FFF,  // just above / below a tie
      0xBF818000,              // a negative tie
      0x3F80FFFF,              // rounds up across a fraction carry
      0x3FFFFFFF,              // rounds up across an exponent carry (to 2)
      0x00FF8000,              // a tie in the lowest binade
  };
  std::vector<float> x;
  for (std::uint32_t u : edges) x.push_back(from_bits(u));
  test::TestRng rng(27);
  for (int i = 0; i < 200000; ++i)
    x.push_back(from_bits(static_cast<std::uint32_t>(rng.next_u64())));
  // Every tie and near-tie pattern of the low half under random upper halves.
  for (int i = 0; i < 20000; ++i) {
    const std::uint32_t hi = static_cast<std::uint32_t>(rng.next_u64()) & 0xFFFF0000u;
    for (std::uint32_t lo : {0x8000u, 0x7FFFu, 0x8001u, 0xFFFFu, 0x0001u})
      x.push_back(from_bits(hi | lo));
  }
  return x;
}

std::string hex(std::uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08X", u);
  return buf;
}

TEST(Bf16, ScalarRoundingMatchesNaiveReference) {
  for (float x : edge_and_random_inputs()) {
    const bf16 got = to_bf16(x), want = naive_to_bf16(x);
    ASSERT_EQ(got.bits, want.bits) << "fp32 " << hex(bits_of(x)) << " (" << x << ")";
  }
}

// The rules spelled out on a few values, so the reference itself is checked.
TEST(Bf16, ReferenceFollowsTheRules) {
  EXPECT_EQ(naive_to_bf16(1.0f).bits, 0x3F80u);
  EXPECT_EQ(naive_to_bf16(from_bits(0x3F808000)).bits, 0x3F80u);              // tie to even: down
  EXPECT_EQ(naive_to_bf16(from_bits(0x3F818000)).bits, 0x3F82u);              // tie to even: up
  EXPECT_EQ(naive_to_bf16(from_bits(0x3F808001)).bits, 0x3F81u);              // above the tie: up
  EXPECT_EQ(naive_to_bf16(std::numeric_limits<float>::max()).bits, 0x7F80u);  // to inf
  EXPECT_EQ(naive_to_bf16(-std::numeric_limits<float>::infinity()).bits, 0xFF80u);
  EXPECT_EQ(naive_to_bf16(from_bits(0x7F800001)).bits, 0x7FC0u);  // sNaN stays NaN, quiet
  EXPECT_EQ(naive_to_bf16(from_bits(0x807FFFFF)).bits, 0x8000u);  // denormal: -0
  EXPECT_TRUE(std::isnan(to_float(naive_to_bf16(std::nanf("")))));
}

TEST(Bf16, WideningIsExactAndRoundTrips) {
  // Every bf16 bit pattern widens to the fp32 with those top bits, and
  // rounds back to itself (NaNs to a quiet NaN of the same sign and payload,
  // denormals to zero: the two documented exceptions).
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const bf16 x{static_cast<std::uint16_t>(b)};
    const float f = to_float(x);
    ASSERT_EQ(bits_of(f), b << 16);
    const bool nan = std::isnan(f), denormal = std::fpclassify(f) == FP_SUBNORMAL;
    const std::uint16_t want = nan        ? static_cast<std::uint16_t>(b | 0x0040u)
                               : denormal ? static_cast<std::uint16_t>(b & 0x8000u)
                                          : static_cast<std::uint16_t>(b);
    ASSERT_EQ(to_bf16(f).bits, want) << "bf16 " << hex(b);
  }
  std::vector<bf16> in(1000);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = to_bf16(0.37f * float(i) - 100.0f);
  std::vector<float> out(in.size());
  convert_to_float(in.data(), out.data(), std::int64_t(in.size()));
  for (std::size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], to_float(in[i]));
}

// Both array paths, at lengths that leave every tail size of the 32-wide
// vector loop, at an unaligned start: bit for bit the scalar rounding.
void expect_path_matches_scalar(Bf16ConvertIsa isa) {
  const std::vector<float> x = edge_and_random_inputs();
  for (std::int64_t n : {0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000}) {
    for (std::int64_t offset : {0, 1}) {
      std::vector<bf16> y(std::size_t(n) + 2, bf16{0xABCD});
      convert_to_bf16(x.data() + offset, y.data() + 1, n, isa);
      ASSERT_EQ(y[0].bits, 0xABCDu) << "wrote before the output";
      ASSERT_EQ(y[std::size_t(n) + 1].bits, 0xABCDu) << "wrote past the output, n " << n;
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_EQ(y[std::size_t(i) + 1].bits, to_bf16(x[std::size_t(offset + i)]).bits)
            << to_string(isa) << " n " << n << " i " << i << " fp32 "
            << hex(bits_of(x[std::size_t(offset + i)]));
    }
  }
  std::vector<bf16> all(x.size()), want(x.size());
  convert_to_bf16(x.data(), all.data(), std::int64_t(x.size()), isa);
  for (std::size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(all[i].bits, naive_to_bf16(x[i]).bits)
        << to_string(isa) << " element " << i << " fp32 " << hex(bits_of(x[i]));
}

TEST(Bf16Convert, PortablePathMatchesReference) {
  expect_path_matches_scalar(Bf16ConvertIsa::portable);
}

TEST(Bf16Convert, Avx512Bf16PathMatchesReference) {
  if (!bf16_convert_isa_available(Bf16ConvertIsa::avx512_bf16))
    GTEST_SKIP() << "this CPU (or build) has no AVX512_BF16";
  expect_path_matches_scalar(Bf16ConvertIsa::avx512_bf16);
}

TEST(Bf16Convert, ChoosesAvx512Bf16WhereTheCpuHasIt) {
  __builtin_cpu_init();
  const bool cpu_has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  // The build's compiler takes the target attribute (GCC 12): a CPU that has
  // the instructions must get them.
  EXPECT_EQ(bf16_convert_isa() == Bf16ConvertIsa::avx512_bf16, cpu_has)
      << "chose " << to_string(bf16_convert_isa());
}

TEST(Bf16Tensor, AccountsTwoBytesAnElementAndConverts) {
  MemoryPool pool;
  PoolScope scope(pool);
  Tensor<float> x({3, 5}, MemCategory::parameters);
  for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = 0.1f * float(i) - 0.7f;
  const std::int64_t before = pool.current(MemCategory::activations);
  {
    const Tensor<bf16> y = to_bf16(x, MemCategory::activations);
    EXPECT_EQ(y.shape(), x.shape());
    EXPECT_EQ(y.bytes(), 2 * 15);
    EXPECT_EQ(pool.current(MemCategory::activations) - before, 2 * 15);
    for (std::int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(y[i].bits, to_bf16(x[i]).bits);
    const Tensor<float> back = to_float(y, MemCategory::activations);
    for (std::int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(back[i], to_float(y[i]));
    const Tensor<bf16> z = Tensor<bf16>::zeros({4});
    for (std::int64_t i = 0; i < 4; ++i) EXPECT_EQ(to_float(z[i]), 0.0f);
  }
  EXPECT_EQ(pool.current(MemCategory::activations), before);
}

TEST(Bf16Tensor, CountOnlyIsUnbacked) {
  MemoryPool pool;
  pool.set_count_only(true);
  PoolScope scope(pool);
  Tensor<float> x({1024, 64}, MemCategory::parameters);
  const Tensor<bf16> y = to_bf16(x, MemCategory::activations);
  EXPECT_EQ(y.data(), nullptr);
  EXPECT_EQ(pool.current(MemCategory::activations), 1024 * 64 * 2);
}

}  // namespace
}  // namespace laga
