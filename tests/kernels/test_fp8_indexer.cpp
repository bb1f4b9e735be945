// DeepSeek's fp8 indexer path on the CPU (kernels/fp8_e4m3.hpp,
// kernels/hadamard.hpp, kernels/dsa_indexer_fp8.hpp) against naive
// references: the e4m3 cast against the nearest of the 256 codes (ties to
// the even code, saturation at 448, NaN), the block scale (fp32 and ue8m0)
// against log2/ceil in double, act_quant's bound and refusals, the Hadamard
// rotation against the dense Sylvester matrix, the fp8 scores against their
// composition from those pieces, and the KL's choice (the run-dtype scores
// whatever the scoring, docs/forms.md "The fp8 indexer").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/check.hpp"
#include "common/naive_dsa.hpp"
#include "core/error.hpp"
#include "kernels/dsa_indexer.hpp"
#include "kernels/dsa_indexer_fp8.hpp"
#include "kernels/fp8_e4m3.hpp"
#include "kernels/hadamard.hpp"

namespace laga {
namespace {

using test::random_vector;

// The finite e4m3 values with their codes, from the format's definition
// (not from fp8_e4m3_decode): sign, 4-bit exponent with bias 7, 3-bit
// mantissa, exponent 0 subnormal, S.1111.111 NaN.
struct Code {
  double value;
  int code;
};
std::vector<Code> finite_codes() {
  std::vector<Code> c;
  for (int code = 0; code < 256; ++code) {
    const int e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) continue;
    const double mag = e == 0 ? m * std::pow(2.0, -9) : (1 + m / 8.0) * std::pow(2.0, e - 7);
    c.push_back({(code & 128) ? -mag : mag, code});
  }
  return c;
}

// The nearest code to v; of two equally near, the one with an even
// mantissa (code bit 0 clear); beyond +-448, +-448 (saturation).
double naive_round(double v, const std::vector<Code>& codes) {
  if (v >= 448) return 448;
  if (v <= -448) return -448;
  const Code* best = nullptr;
  for (const Code& c : codes) {
    if (!best) {
      best = &c;
      continue;
    }
    const double d = std::fabs(v - c.value), db = std::fabs(v - best->value);
    if (d < db || (d == db && (c.code & 1) == 0 && (best->code & 1) == 1)) best = &c;
  }
  return best->value == 0 ? std::copysign(0.0, v) : best->value;
}

TEST(Fp8E4m3, DecodeIsTheFormatsDefinition) {
  for (const Code& c : finite_codes())
    EXPECT_EQ(double(fp8_e4m3_decode(std::uint8_t(c.code))), c.value) << "code " << c.code;
  EXPECT_TRUE(std::isnan(fp8_e4m3_decode(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_decode(0xff)));
  EXPECT_EQ(fp8_e4m3_decode(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_decode(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8E4m3, RoundsToNearestTiesToEvenAndSaturates) {
  const std::vector<Code> codes = finite_codes();
  std::vector<float> vs;
  std::vector<double> sorted;
  for (const Code& c : codes) sorted.push_back(c.value);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  for (std::size_t n = 0; n + 1 < sorted.size(); ++n) {
    const float mid = float((sorted[n] + sorted[n + 1]) / 2);  // exact: a tie
    vs.insert(vs.end(),
              {float(sorted[n]), mid, std::nextafter(mid, 1e9f), std::nextafter(mid, -1e9f)});
  }
  for (float v : random_vector<float>(20000, 3, -500, 500)) vs.push_back(v);
  for (float v : random_vector<float>(20000, 4, -0.05, 0.05)) vs.push_back(v);
  vs.insert(vs.end(), {448.0f, 464.0f, 470.0f, 1e30f, -1e30f, std::numeric_limits<float>::max(),
                       std::numeric_limits<float>::infinity(), 0.0f, -0.0f, 1e-30f});
  for (float v : vs) {
    const double want = naive_round(double(v), codes);
    const float got = fp8_e4m3_round(v);
    ASSERT_EQ(double(got), want) << "v " << v;
    ASSERT_EQ(double(fp8_e4m3_decode(fp8_e4m3_encode(v))), want) << "v " << v;
  }
  // Ties explicitly: 1.0625 lies between 1 (mantissa 0) and 1.125 (odd):
  // to 1; 1.1875 between 1.125 (odd) and 1.25 (even): to 1.25; the
  // subnormal tie 2^-10 between 0 and 2^-9: to 0.
  EXPECT_EQ(fp8_e4m3_round(1.0625f), 1.0f);
  EXPECT_EQ(fp8_e4m3_round(1.1875f), 1.25f);
  EXPECT_EQ(fp8_e4m3_round(std::ldexp(1.0f, -10)), 0.0f);
  EXPECT_EQ(fp8_e4m3_round(-464.0f), -448.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_round(std::nanf(""))));
}

TEST(Fp8BlockScale, Fp32AndUe8m0AsDeepSeeksKernel) {
  for (float amax : random_vector<float>(5000, 9, 1e-4, 1e4)) {
    const float s = amax * (1.0f / 448.0f);
    EXPECT_EQ(fp8_block_scale(amax, Fp8ScaleFmt::fp32), s);
    EXPECT_EQ(fp8_block_scale(amax, Fp8ScaleFmt::ue8m0),
              float(std::pow(2.0, std::ceil(std::log2(double(s))))))
        << amax;
  }
  EXPECT_EQ(fp8_block_scale(448.0f, Fp8ScaleFmt::ue8m0), 1.0f);  // exact power: kept
  EXPECT_EQ(fp8_block_scale(449.0f, Fp8ScaleFmt::ue8m0), 2.0f);
}

TEST(ActQuant, BlocksRoundTripWithinHalfASpacingAndRefuseWhatTheyCannotTake) {
  const std::int64_t rows = 5, n = 256, block = 128;
  std::vector<float> x = random_vector<float>(rows * n, 21, -3, 3);
  x[7] = 200.0f;                                                // an outlier in block 0 of row 0
  std::fill(x.begin() + 2 * n + 128, x.begin() + 3 * n, 0.0f);  // an all-zero block
  for (Fp8ScaleFmt fmt : {Fp8ScaleFmt::fp32, Fp8ScaleFmt::ue8m0}) {
    std::vector<float> y(x.size()), s(std::size_t(rows * n / block));
    act_quant(x.data(), rows, n, block, fmt, y.data(), s.data());
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t b = 0; b < n / block; ++b) {
        float amax = 0;
        for (std::int64_t e = 0; e < block; ++e)
          amax = std::max(amax, std::fabs(x[std::size_t(r * n + b * block + e)]));
        const float sc = s[std::size_t(r * (n / block) + b)];
        EXPECT_EQ(sc, fp8_block_scale(std::max(amax, 1e-4f), fmt));
        for (std::int64_t e = 0; e < block; ++e) {
          const std::size_t at = std::size_t(r * n + b * block + e);
          EXPECT_EQ(fp8_e4m3_round(y[at]), y[at]) << "not an e4m3 value";
          EXPECT_EQ(y[at], fp8_e4m3_round(std::clamp(x[at] / sc, -448.0f, 448.0f)));
          // |y - x / s| <= half the e4m3 spacing at y (an eighth of its binade, at least 2^-9)
          const double ay = std::fabs(double(y[at]));
          const double spacing =
              ay == 0 ? std::ldexp(1.0, -9)
                      : std::max(std::ldexp(1.0, -9), std::ldexp(1.0, std::ilogb(ay) - 3));
          EXPECT_LE(std::fabs(double(y[at]) - double(x[at]) / double(sc)),
                    spacing / 2 * (1 + 1e-5));
        }
      }
  }
  std::vector<float> y(x.size()), s(x.size());
  EXPECT_THROW(act_quant(x.data(), rows, 100, block, Fp8ScaleFmt::ue8m0, y.data(), s.data()),
               Error);
  x[300] = std::nanf("");
  try {
    act_quant(x.data(), rows, n, block, Fp8ScaleFmt::ue8m0, y.data(), s.data());
    ADD_FAILURE() << "a NaN was quantized";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("row 1, column 44"), std::string::npos) << e.what();
  }
  x[300] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(act_quant(x.data(), rows, n, block, Fp8ScaleFmt::ue8m0, y.data(), s.data()), Error);
}

TEST(Fp8RoundTrip, IsActQuantTimesItsScalesAndRefusesABadWidth) {
  const std::int64_t rows = 3, n = 256;
  const std::vector<double> x = random_vector<double>(rows * n, 61, -4, 4);
  std::vector<double> rt = x;
  fp8_round_trip(rt.data(), rows, n, 128, Fp8ScaleFmt::ue8m0);
  const std::vector<float> x32(x.begin(), x.end());
  std::vector<float> y(x32.size()), s(static_cast<std::size_t>(rows * 2));
  act_quant(x32.data(), rows, n, 128, Fp8ScaleFmt::ue8m0, y.data(), s.data());
  for (std::int64_t e = 0; e < rows * n; ++e)
    ASSERT_EQ(rt[std::size_t(e)], double(y[std::size_t(e)] * s[std::size_t(e / 128)])) << e;
  EXPECT_NE(rt, x);
  std::vector<float> z(200);
  EXPECT_THROW(fp8_round_trip(z.data(), 1, 200, 128, Fp8ScaleFmt::ue8m0), Error);
}

// H_d by its definition, scaled by d^-1/2: entry (i, j) = (-1)^popcount(i & j).
std::vector<double> dense_hadamard(std::int64_t d) {
  std::vector<double> m(static_cast<std::size_t>(d * d));
  for (std::int64_t i = 0; i < d; ++i)
    for (std::int64_t j = 0; j < d; ++j)
      m[std::size_t(i * d + j)] =
          (__builtin_popcountll(std::uint64_t(i & j)) % 2 ? -1.0 : 1.0) / std::sqrt(double(d));
  return m;
}

TEST(Hadamard, EqualsTheDenseSylvesterMatrixAndIsItsOwnInverse) {
  for (std::int64_t d : {1, 2, 4, 8, 32, 128}) {
    const std::int64_t rows = 3;
    const std::vector<double> x = random_vector<double>(rows * d, 31 + d);
    std::vector<double> y = x;
    hadamard_rotate(y.data(), rows, d);
    const std::vector<double> h = dense_hadamard(d);
    std::vector<double> want(x.size(), 0.0);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t i = 0; i < d; ++i)
        for (std::int64_t j = 0; j < d; ++j)
          want[std::size_t(r * d + i)] += h[std::size_t(i * d + j)] * x[std::size_t(r * d + j)];
    EXPECT_TRUE(test::all_close("hadamard d " + std::to_string(d), y, want, 1e-14, 1e-13));
    hadamard_rotate(y.data(), rows, d);
    EXPECT_TRUE(test::all_close("twice d " + std::to_string(d), y, x, 1e-14, 1e-13));
  }
  std::vector<float> z(12);
  EXPECT_THROW(hadamard_rotate(z.data(), 1, 12), Error);
}

struct Fp8Case {
  IndexerShape s;
  std::vector<double> q, k, w;
  Fp8Case(std::int64_t B, std::int64_t Sq, std::int64_t Sk, std::int64_t HI, std::int64_t topk,
          std::uint64_t seed) {
    s.attn.B = B, s.attn.Sq = Sq, s.attn.Sk = Sk, s.attn.Hq = HI, s.attn.Hk = 1, s.attn.dqk = 128;
    s.attn.dv = 1, s.attn.causal = true, s.topk = topk, s.scores = IndexScores::fp8;
    q = random_vector<double>(B * Sq * HI * 128, seed);
    k = random_vector<double>(B * Sk * 128, seed + 1);
    w = random_vector<double>(B * Sq * HI, seed + 2);
  }
};

// The fp8 scores composed from the pieces: dense rotation, act_quant per
// row (ue8m0), exact dots, head sum in double, one fp32 rounding.
std::vector<double> naive_fp8_scores(const Fp8Case& c) {
  const AttnShape& a = c.s.attn;
  const std::int64_t d = 128;
  const std::vector<double> h = dense_hadamard(d);
  auto quant = [&](const double* x, std::vector<float>& y, float& s) {
    std::vector<float> r(static_cast<std::size_t>(d));
    for (std::int64_t i = 0; i < d; ++i) {
      double acc = 0;
      for (std::int64_t j = 0; j < d; ++j) acc += h[std::size_t(i * d + j)] * x[j];
      r[std::size_t(i)] = float(acc);
    }
    float amax = 1e-4f;
    for (float v : r) amax = std::max(amax, std::fabs(v));
    s = fp8_block_scale(amax, Fp8ScaleFmt::ue8m0);
    y.resize(std::size_t(d));
    for (std::int64_t i = 0; i < d; ++i)
      y[std::size_t(i)] = fp8_e4m3_round(std::clamp(r[std::size_t(i)] / s, -448.0f, 448.0f));
  };
  std::vector<double> out(std::size_t(a.B * a.Sq * a.Sk), -std::numeric_limits<double>::infinity());
  for (std::int64_t b = 0; b < a.B; ++b)
    for (std::int64_t i = 0; i < a.Sq; ++i)
      for (std::int64_t j = 0; j <= i + a.Sk - a.Sq; ++j) {
        std::vector<float> kq;
        float ks = 0;
        quant(c.k.data() + (b * a.Sk + j) * d, kq, ks);
        double sum = 0;
        for (std::int64_t hh = 0; hh < a.Hq; ++hh) {
          std::vector<float> qq;
          float qs = 0;
          const std::int64_t row = (b * a.Sq + i) * a.Hq + hh;
          quant(c.q.data() + row * d, qq, qs);
          double dot = 0;
          for (std::int64_t e = 0; e < d; ++e)
            dot += double(qq[std::size_t(e)]) * kq[std::size_t(e)];
          if (dot > 0) sum += double(float(dot)) * double(float(c.w[std::size_t(row)]) * qs);
        }
        out[std::size_t((b * a.Sq + i) * a.Sk + j)] = double(float(sum * ks));
      }
  return out;
}

TEST(IndexerFp8, ScoresAreTheCompositionAndTheTopkSortsThem) {
  for (auto [Sq, Sk] : {std::pair{10, 10}, std::pair{4, 11}}) {
    Fp8Case c(2, Sq, Sk, 3, 4, 41);
    const std::int64_t n = 2 * Sq * Sk;
    std::vector<double> sc(static_cast<std::size_t>(n));
    dsa_index_scores(c.s, sc.data(), c.q.data(), c.k.data(), c.w.data());
    const std::vector<double> want = naive_fp8_scores(c);
    for (std::int64_t p = 0; p < n; ++p) ASSERT_EQ(sc[std::size_t(p)], want[std::size_t(p)]) << p;
    std::vector<std::int32_t> idx(static_cast<std::size_t>(2 * Sq * c.s.topk));
    dsa_index_topk(c.s, idx.data(), c.q.data(), c.k.data(), c.w.data());
    EXPECT_EQ(idx, test::naive_topk(2 * Sq, Sk, c.s.topk, want));
    // The run-dtype scores differ (quantization), within e4m3's bound: each
    // rotated element carries a relative error <= 2^-4 (half a spacing; the
    // subnormals' absolute 2^-10 s is far below), so a product <= 0.13, and
    // by Cauchy-Schwarz (the rotation keeps norms) |dI_ij| <= sum_h |w_h|
    // 0.13 |q_h| |k_j| (ReLU is 1-Lipschitz), fp32 rounding aside.
    IndexerShape plain = c.s;
    plain.scores = IndexScores::run_dtype;
    std::vector<double> ref(static_cast<std::size_t>(n));
    dsa_index_scores(plain, ref.data(), c.q.data(), c.k.data(), c.w.data());
    auto norm = [](const double* v) {
      double t = 0;
      for (int e = 0; e < 128; ++e) t += v[e] * v[e];
      return std::sqrt(t);
    };
    double gap = 0;
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t i = 0; i < Sq; ++i)
        for (std::int64_t j = 0; j <= i + Sk - Sq; ++j) {
          const std::size_t at = std::size_t((b * Sq + i) * Sk + j);
          double bound = 0;
          for (std::int64_t h = 0; h < 3; ++h) {
            const std::int64_t row = (b * Sq + i) * 3 + h;
            bound += std::fabs(c.w[std::size_t(row)]) * 0.13 * norm(c.q.data() + row * 128) *
                     norm(c.k.data() + (b * Sk + j) * 128);
          }
          EXPECT_LE(std::fabs(ref[at] - sc[at]), bound * (1 + 1e-5) + 1e-6) << "pair " << at;
          gap = std::max(gap, std::fabs(ref[at] - sc[at]));
        }
    EXPECT_GT(gap, 0) << "fp8 scores equal the unquantized ones: no quantization happened";
  }
  // float inputs score exactly as the same values in double (the fp8 path
  // rotates in double and rounds each score to fp32 either way).
  Fp8Case c(1, 6, 6, 2, 3, 43);
  for (auto* v : {&c.q, &c.k, &c.w})
    for (double& x : *v) x = double(float(x));
  const std::vector<float> qf(c.q.begin(), c.q.end()), kf(c.k.begin(), c.k.end()),
      wf(c.w.begin(), c.w.end());
  std::vector<float> sf(36);
  std::vector<double> sd(36);
  dsa_index_scores(c.s, sf.data(), qf.data(), kf.data(), wf.data());
  dsa_index_scores(c.s, sd.data(), c.q.data(), c.k.data(), c.w.data());
  for (std::size_t n = 0; n < 36; ++n) EXPECT_EQ(double(sf[n]), sd[n]) << n;
}

TEST(IndexerFp8, RefusesAnIndexHeadDimOtherThan128AndNonFiniteValues) {
  Fp8Case c(1, 4, 4, 2, 2, 47);
  c.s.attn.dqk = 64;
  std::vector<std::int32_t> idx(8);
  try {
    dsa_index_topk(c.s, idx.data(), c.q.data(), c.k.data(), c.w.data());
    ADD_FAILURE() << "d_I 64 was scored in fp8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("index_head_dim 128"), std::string::npos) << e.what();
  }
  c.s.attn.dqk = 128;
  c.k[5] = std::numeric_limits<double>::infinity();
  EXPECT_THROW(dsa_index_topk(c.s, idx.data(), c.q.data(), c.k.data(), c.w.data()), Error);
}

TEST(IndexerFp8, KlReadsTheRunDtypeScoresWhateverTheScoring) {
  // The documented choice (kernels/dsa_indexer.hpp): the fp8 path picks the
  // keys; the KL and its gradient are the unquantized scores' over them.
  Fp8Case c(1, 7, 7, 3, 3, 53);
  const std::int64_t rows = 7, K = 3;
  std::vector<std::int32_t> idx(static_cast<std::size_t>(rows * K));
  dsa_index_topk(c.s, idx.data(), c.q.data(), c.k.data(), c.w.data());
  const std::vector<double> p = random_vector<double>(rows * K, 59, 0.1, 1.0);
  IndexerShape plain = c.s;
  plain.scores = IndexScores::run_dtype;
  std::vector<double> l8(rows), l(rows), dq8(c.q.size()), dq(c.q.size()), dk8(c.k.size()),
      dk(c.k.size()), dw8(c.w.size()), dw(c.w.size());
  dsa_indexer_kl(c.s, K, idx.data(), p.data(), c.q.data(), c.k.data(), c.w.data(), l8.data(),
                 dq8.data(), dk8.data(), dw8.data());
  dsa_indexer_kl(plain, K, idx.data(), p.data(), c.q.data(), c.k.data(), c.w.data(), l.data(),
                 dq.data(), dk.data(), dw.data());
  EXPECT_EQ(l8, l);
  EXPECT_EQ(dq8, dq);
  EXPECT_EQ(dk8, dk);
  EXPECT_EQ(dw8, dw);
  // and that loss is the naive KL of the run-dtype scores over the fp8 selection
  const std::vector<double> plain_scores = test::naive_index_scores(1, 7, 7, 3, 128, c.q, c.k, c.w);
  double total = 0;
  for (double v : l) total += v;
  EXPECT_NEAR(total, test::naive_indexer_kl(rows, 7, K, idx, p, plain_scores), 1e-12);
}

}  // namespace
}  // namespace laga
