// RoPE: frequencies (plain and YaRN, against an independent reimplementation
// of DeepSeek-V3's precompute_freqs_cis and against PyTorch-made constants),
// the table, and rope_apply (complex multiplication, inverse, transpose as
// backward, strided heads, global positions), and rope_apply_at (positions
// per token: the same rotation as rope_apply, restarting per document).
#include "kernels/rope.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <limits>
#include <numbers>
#include <string>
#include <type_traits>
#include <vector>

#include "common/check.hpp"
#include "common/threads.hpp"
#include "core/error.hpp"

namespace laga {
namespace {

using test::all_close;
using test::random_vector;

TEST(RopeFrequencies, PlainIsBasePowerMinus2iOverD) {
  for (std::int64_t d : {2, 16, 64}) {
    for (double theta : {1e4, 5e5}) {
      RopeParams p;
      p.dim = d;
      p.theta = theta;
      p.yarn = false;
      const auto f = rope_frequencies(p);
      ASSERT_EQ(f.size(), static_cast<std::size_t>(d / 2));
      for (std::int64_t i = 0; i < d / 2; ++i) {
        const double expect = std::pow(theta, -2.0 * double(i) / double(d));
        EXPECT_NEAR(f[i], expect, 4e-16 * expect) << "d=" << d << " theta=" << theta << " i=" << i;
      }
      EXPECT_EQ(f[0], 1.0);
    }
  }
}

// DeepSeek-V3 inference/model.py, transcribed independently of src/:
//   find_correction_dim(r) = dim * log(orig / (r * 2 pi)) / (2 log(base))
//   low  = max(floor(find_correction_dim(beta_fast)), 0)
//   high = min(ceil(find_correction_dim(beta_slow)), dim - 1)
//   linear_ramp_factor(low, high, dim // 2): if low == high: high += 0.001;
//       clamp((arange(dim // 2) - low) / (high - low), 0, 1)
//   smooth = 1 - ramp;  freqs = freqs / factor * (1 - smooth) + freqs * smooth
std::vector<double> deepseek_yarn_freqs(int dim, double base, double factor, double orig,
                                        double beta_fast, double beta_slow) {
  const double pi = std::numbers::pi;
  auto corr = [&](double rot) {
    return dim * std::log(orig / (rot * 2 * pi)) / (2 * std::log(base));
  };
  double low = std::floor(corr(beta_fast));
  double high = std::ceil(corr(beta_slow));
  low = low < 0 ? 0 : low;
  high = high > dim - 1 ? dim - 1 : high;
  if (low == high) high += 0.001;
  std::vector<double> f(dim / 2);
  for (int i = 0; i < dim / 2; ++i) {
    const double base_f = 1.0 / std::pow(base, double(2 * i) / dim);
    double ramp = (i - low) / (high - low);
    ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
    const double smooth = 1 - ramp;
    f[i] = base_f / factor * (1 - smooth) + base_f * smooth;
  }
  return f;
}

RopeParams v3_params() {
  RopeParams p;  // DeepSeek-V3: qk_rope_head_dim 64, rope_theta 1e4, YaRN factor 40,
  p.dim = 64;    // original_seq_len 4096, beta_fast 32, beta_slow 1.
  p.theta = 1e4;
  p.yarn = true;
  p.factor = 40;
  p.original_seq_len = 4096;
  p.beta_fast = 32;
  p.beta_slow = 1;
  return p;
}

TEST(RopeFrequencies, YarnMatchesDeepSeekFormula) {
  const auto f = rope_frequencies(v3_params());
  const auto e = deepseek_yarn_freqs(64, 1e4, 40, 4096, 32, 1);
  ASSERT_EQ(f.size(), 32u);
  EXPECT_TRUE(all_close("freqs", f, e, 0.0, 1e-15));
  // The correction range for V3 is [10, 23]: below it unchanged, above it
  // divided by the factor, in between interpolated.
  for (int i = 0; i <= 10; ++i) EXPECT_NEAR(f[i], std::pow(1e4, -i / 32.0), 1e-15) << i;
  for (int i = 23; i < 32; ++i) EXPECT_NEAR(f[i], std::pow(1e4, -i / 32.0) / 40, 1e-18) << i;
  EXPECT_LT(f[16], std::pow(1e4, -0.5));
  EXPECT_GT(f[16], std::pow(1e4, -0.5) / 40);

  // Other parameters, including one whose correction range is clamped at 0.
  struct P {
    int dim;
    double base, factor, orig, bf, bs;
  };
  for (const P& q :
       {P{32, 5e5, 8, 2048, 16, 2}, P{16, 1e4, 4, 64, 32, 1}, P{128, 1e6, 16, 8192, 32, 1}}) {
    RopeParams p;
    p.dim = q.dim;
    p.theta = q.base;
    p.yarn = true;
    p.factor = q.factor;
    p.original_seq_len = static_cast<std::int64_t>(q.orig);
    p.beta_fast = q.bf;
    p.beta_slow = q.bs;
    EXPECT_TRUE(all_close("freqs", rope_frequencies(p),
                          deepseek_yarn_freqs(q.dim, q.base, q.factor, q.orig, q.bf, q.bs), 0.0,
                          1e-15))
        << "dim " << q.dim << " base " << q.base;
  }
}

// Made with PyTorch 1.13 (/usr/bin/python3), DeepSeek-V3's precompute_freqs_cis
// code in float64:
//   def find_correction_dim(num_rotations, dim, base, max_seq_len):
//       return dim * math.log(max_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))
//   def find_correction_range(low_rot, high_rot, dim, base, max_seq_len):
//       low = math.floor(find_correction_dim(low_rot, dim, base, max_seq_len))
//       high = math.ceil(find_correction_dim(high_rot, dim, base, max_seq_len))
//       return max(low, 0), min(high, dim-1)
//   def linear_ramp_factor(min, max, dim):
//       if min == max: max += 0.001
//       return torch.clamp((torch.arange(dim, dtype=torch.float64) - min) / (max - min), 0, 1)
//   dim, base, factor = 64, 10000.0, 40
//   freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
//   low, high = find_correction_range(32, 1, dim, base, 4096)      # (10, 23)
//   smooth = 1 - linear_ramp_factor(low, high, dim // 2)
//   freqs = freqs / factor * (1 - smooth) + freqs * smooth
//   print(",\n".join("%.17g" % f for f in freqs.tolist()))
// (DeepSeek runs this in float32; those values agree with these to 2e-7
// relative, fp32 rounding.)
constexpr double kV3YarnFreqs[32] = {
    1,
    0.74989420933245587,
    0.56234132519034907,
    0.42169650342858228,
    0.31622776601683794,
    0.23713737056616555,
    0.17782794100389226,
    0.1333521432163324,
    0.10000000000000001,
    0.074989420933245579,
    0.056234132519034905,
    0.039006926567143857,
    0.026879360111431223,
    0.018378146218877827,
    0.01244795587027246,
    0.0083345089510207769,
    0.0054999999999999997,
    0.0035619974943291656,
    0.002249365300761396,
    0.0013705136361428923,
    0.00079056941504209452,
    0.00041499039849078964,
    0.00017782794100389219,
    3.3338035804083099e-05,
    2.5000000000000001e-05,
    1.8747355233311393e-05,
    1.4058533129758727e-05,
    1.0542412585714557e-05,
    7.9056941504209488e-06,
    5.9284342641541385e-06,
    4.4456985250973064e-06,
    3.3338035804083097e-06,
};

TEST(RopeFrequencies, YarnMatchesPyTorchConstants) {
  const auto f = rope_frequencies(v3_params());
  // 1e-14: pow in libm vs PyTorch may differ in the last ulp or two.
  EXPECT_TRUE(all_close("freqs", f.data(), kV3YarnFreqs, 32, 0.0, 1e-14));
}

TEST(RopeFrequencies, YarnOffIgnoresTheYarnFields) {
  RopeParams p = v3_params();
  p.yarn = false;
  const auto f = rope_frequencies(p);
  for (int i = 0; i < 32; ++i) EXPECT_NEAR(f[i], std::pow(1e4, -i / 32.0), 4e-16) << i;
}

TEST(RopeTable, HoldsCosSinOfPositionTimesFrequency) {
  const RopeParams p = v3_params();
  const auto f = rope_frequencies(p);
  const RopeTable t(p, 300);
  EXPECT_EQ(t.dim(), 64);
  EXPECT_EQ(t.positions(), 300);
  for (std::int64_t pos : {0, 1, 17, 299})
    for (std::int64_t i : {0, 5, 31}) {
      EXPECT_NEAR(t.cos(pos, i), std::cos(double(pos) * f[i]), 1e-15);
      EXPECT_NEAR(t.sin(pos, i), std::sin(double(pos) * f[i]), 1e-15);
    }
  RopeParams odd;
  odd.dim = 7;
  EXPECT_THROW(RopeTable(odd, 4), Error);
  odd.dim = -2;
  EXPECT_THROW(RopeTable(odd, 4), Error);
  // dim 0 is NoPE: an empty table, and the op layer rotates nothing
  // (ops::rope returns before asking for a kernel).
  RopeParams none;
  none.dim = 0;
  const RopeTable empty(none, 4);
  EXPECT_EQ(empty.dim(), 0);
  EXPECT_TRUE(empty.backed());
}

template <class T>
class RopeApplyTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(RopeApplyTest, Types);

// One rotation of values |x| <= 1: a few roundings of T, plus cos/sin rounded
// to T (the kernel casts the double table to T before multiplying).
template <class T>
double rot_tol() {
  return 8 * std::numeric_limits<T>::epsilon();
}

// Layout of q: (B, L, H, dn + dr), the rope part the last dr of each head.
struct Layout {
  std::int64_t B, L, H, dn, dr;
  std::int64_t head() const { return dn + dr; }
  std::int64_t token() const { return H * head(); }
  std::int64_t size() const { return B * L * token(); }
};

TYPED_TEST(RopeApplyTest, MatchesComplexMultiplicationAndLeavesNopeAlone) {
  using T = TypeParam;
  RopeParams p = v3_params();
  p.dim = 8;
  p.original_seq_len = 16;  // a correction range inside the 4 frequencies
  const auto f = rope_frequencies(p);
  const RopeTable table(p, 64);
  for (const Layout lay : {Layout{2, 5, 3, 0, 8}, Layout{3, 4, 2, 5, 8}}) {
    SCOPED_TRACE(testing::Message() << "dn=" << lay.dn);
    const std::int64_t pos0 = 9;
    const auto x0 = random_vector<T>(lay.size(), 7);
    std::vector<T> x = x0;
    rope_apply<T>(x.data() + lay.dn, lay.B, lay.L, lay.H, lay.token(), lay.head(), pos0, table,
                  false);
    std::vector<double> expect(x0.begin(), x0.end());
    for (std::int64_t b = 0; b < lay.B; ++b)
      for (std::int64_t l = 0; l < lay.L; ++l)
        for (std::int64_t h = 0; h < lay.H; ++h)
          for (std::int64_t i = 0; i < lay.dr / 2; ++i) {
            const std::int64_t at = (b * lay.L + l) * lay.token() + h * lay.head() + lay.dn + 2 * i;
            const std::complex<double> z(x0[at], x0[at + 1]);
            const std::complex<double> r = z * std::polar(1.0, double(pos0 + l) * f[i]);
            expect[at] = r.real();
            expect[at + 1] = r.imag();
          }
    // The nope part (every element not rewritten above) is bit-identical.
    EXPECT_TRUE(all_close("q", x, expect, rot_tol<T>(), 0.0));
    for (std::int64_t t = 0; t < lay.B * lay.L * lay.H; ++t)
      for (std::int64_t c = 0; c < lay.dn; ++c)
        ASSERT_EQ(x[t * lay.head() + c], x0[t * lay.head() + c]) << "nope element touched";
  }
}

TYPED_TEST(RopeApplyTest, InverseUndoesForwardAndPreservesNorms) {
  using T = TypeParam;
  const RopeParams p = v3_params();
  const RopeTable table(p, 40);
  const Layout lay{2, 7, 3, 0, 64};
  const auto x0 = random_vector<T>(lay.size(), 8);
  std::vector<T> x = x0;
  rope_apply<T>(x.data(), lay.B, lay.L, lay.H, lay.token(), lay.head(), 33, table, false);
  // A rotation: each pair keeps its length.
  for (std::int64_t k = 0; k < lay.size(); k += 2) {
    const double n0 = std::hypot(double(x0[k]), double(x0[k + 1]));
    const double n1 = std::hypot(double(x[k]), double(x[k + 1]));
    ASSERT_NEAR(n1, n0, rot_tol<T>()) << "pair " << k / 2;
  }
  EXPECT_FALSE(all_close("rotated", x, x0, 1e-3, 0.0));  // it did rotate
  rope_apply<T>(x.data(), lay.B, lay.L, lay.H, lay.token(), lay.head(), 33, table, true);
  EXPECT_TRUE(all_close("x", x, x0, 2 * rot_tol<T>(), 0.0));
}

// Rank r holding tokens [s0, s0 + L) rotates them at global positions
// s0.. : sharding the sequence and rotating each shard gives, bit for bit,
// the rotation of the whole sequence.
TYPED_TEST(RopeApplyTest, ShardsAtGlobalPositionsEqualTheWhole) {
  using T = TypeParam;
  const RopeTable table(v3_params(), 20);
  const Layout lay{2, 13, 2, 3, 64};
  const auto x0 = random_vector<T>(lay.size(), 9);
  std::vector<T> whole = x0;
  rope_apply<T>(whole.data() + lay.dn, lay.B, lay.L, lay.H, lay.token(), lay.head(), 0, table,
                false);
  const std::int64_t cuts[] = {0, 5, 6, 13};
  for (int c = 0; c < 3; ++c) {
    const std::int64_t s0 = cuts[c], L = cuts[c + 1] - cuts[c];
    std::vector<T> shard(lay.B * L * lay.token());
    for (std::int64_t b = 0; b < lay.B; ++b)
      std::copy_n(x0.begin() + (b * lay.L + s0) * lay.token(), L * lay.token(),
                  shard.begin() + b * L * lay.token());
    rope_apply<T>(shard.data() + lay.dn, lay.B, L, lay.H, lay.token(), lay.head(), s0, table,
                  false);
    for (std::int64_t b = 0; b < lay.B; ++b)
      ASSERT_TRUE(test::all_equal("shard", shard.data() + b * L * lay.token(),
                                  whole.data() + (b * lay.L + s0) * lay.token(), L * lay.token()))
          << "shard " << c << " batch " << b;
  }
}

TYPED_TEST(RopeApplyTest, RejectsPositionsOutsideTheTable) {
  using T = TypeParam;
  const RopeTable table(v3_params(), 10);
  std::vector<T> x(4 * 64, T(1));
  EXPECT_NO_THROW(rope_apply<T>(x.data(), 1, 4, 1, 64, 64, 6, table, false));
  EXPECT_THROW(rope_apply<T>(x.data(), 1, 4, 1, 64, 64, 7, table, false), Error);
  EXPECT_THROW(rope_apply<T>(x.data(), 1, 4, 1, 64, 64, -1, table, false), Error);
}

// Positions pos0 .. pos0 + L - 1 given per token are rope_apply, bit for bit.
TYPED_TEST(RopeApplyTest, AtConsecutivePositionsIsRopeApply) {
  using T = TypeParam;
  const RopeTable table(v3_params(), 40);
  const Layout lay{2, 13, 3, 5, 64};
  const auto x0 = random_vector<T>(lay.size(), 12);
  for (bool inverse : {false, true}) {
    std::vector<T> want = x0, got = x0;
    rope_apply<T>(want.data() + lay.dn, lay.B, lay.L, lay.H, lay.token(), lay.head(), 17, table,
                  inverse);
    std::vector<std::int64_t> positions;
    for (std::int64_t b = 0; b < lay.B; ++b)
      for (std::int64_t l = 0; l < lay.L; ++l) positions.push_back(17 + l);
    rope_apply_at<T>(got.data() + lay.dn, lay.B, lay.L, lay.H, lay.token(), lay.head(),
                     positions.data(), table, inverse);
    EXPECT_TRUE(test::all_equal("x", got.data(), want.data(), lay.size())) << "inverse " << inverse;
  }
}

// Packed documents: positions restart at 0 at every document's start, a
// different split in each batch row; against the complex multiplication at
// each token's position within its document. Then the inverse undoes it.
TYPED_TEST(RopeApplyTest, AtRestartsPerDocumentAndInverseUndoesIt) {
  using T = TypeParam;
  RopeParams p = v3_params();
  p.dim = 8;
  p.original_seq_len = 16;
  const auto f = rope_frequencies(p);
  const RopeTable table(p, 9);  // the longest document: 9 tokens
  const Layout lay{2, 12, 2, 3, 8};
  const std::vector<std::vector<std::int64_t>> docs = {{1, 9, 2}, {4, 4, 1, 3}};
  std::vector<std::int64_t> positions;
  for (const auto& row : docs)
    for (std::int64_t len : row)
      for (std::int64_t pos = 0; pos < len; ++pos) positions.push_back(pos);
  ASSERT_EQ(positions.size(), static_cast<size_t>(lay.B * lay.L));
  const auto x0 = random_vector<T>(lay.size(), 13);
  std::vector<T> x = x0;
  rope_apply_at<T>(x.data() + lay.dn, lay.B, lay.L, lay.H, lay.token(), lay.head(),
                   positions.data(), table, false);
  std::vector<double> expect(x0.begin(), x0.end());
  for (std::int64_t b = 0; b < lay.B; ++b)
    for (std::int64_t l = 0; l < lay.L; ++l)
      for (std::int64_t h = 0; h < lay.H; ++h)
        for (std::int64_t i = 0; i < lay.dr / 2; ++i) {
          const std::int64_t at = (b * lay.L + l) * lay.token() + h * lay.head() + lay.dn + 2 * i;
          const double angle = double(positions[b * lay.L + l]) * f[i];
          const std::complex<double> r =
              std::complex<double>(x0[at], x0[at + 1]) * std::polar(1.0, angle);
          expect[at] = r.real();
          expect[at + 1] = r.imag();
        }
  EXPECT_TRUE(all_close("q", x, expect, rot_tol<T>(), 0.0));
  rope_apply_at<T>(x.data() + lay.dn, lay.B, lay.L, lay.H, lay.token(), lay.head(),
                   positions.data(), table, true);
  EXPECT_TRUE(all_close("x", x, x0, 2 * rot_tol<T>(), 0.0));
}

// A position outside [0, table.positions()) is refused, naming it, before
// any element is rotated.
TYPED_TEST(RopeApplyTest, AtRejectsPositionsOutsideTheTable) {
  using T = TypeParam;
  const RopeTable table(v3_params(), 10);
  const std::vector<T> x0(2 * 4 * 64, T(1));
  for (std::int64_t bad : {10, -1}) {
    std::vector<T> x = x0;
    const std::vector<std::int64_t> positions = {0, 1, 2, 3, 9, 0, bad, 1};
    try {
      rope_apply_at<T>(x.data(), 2, 4, 1, 64, 64, positions.data(), table, false);
      ADD_FAILURE() << "position " << bad << " accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("position " + std::to_string(bad) + " of token 2 of batch row 1"),
                std::string::npos)
          << what;
    }
    EXPECT_EQ(x, x0) << "nothing may be rotated before the error";
  }
}

// rope_apply(x) is linear, y = R x, so for L = <G, R x> the gradient is R^T G,
// which the backward computes as rope_apply(G, inverse = true). Finite
// differences in double; L is linear so the central difference is exact up to
// rounding (~1e-11 relative): tol 1e-6.
TEST(RopeApply, InverseIsTheBackwardByFiniteDifferences) {
  const test::ScopedOmpThreads one_thread(1);  // see common/threads.hpp
  RopeParams p = v3_params();
  p.dim = 16;
  p.original_seq_len = 64;
  const RopeTable table(p, 30);
  const Layout lay{2, 3, 2, 3, 16};
  auto x = random_vector<double>(lay.size(), 10);
  const auto G = random_vector<double>(lay.size(), 11);
  std::vector<double> y;
  auto loss = [&] {
    y = x;
    rope_apply<double>(y.data() + lay.dn, lay.B, lay.L, lay.H, lay.token(), lay.head(), 20, table,
                       false);
    return test::dot(G.data(), y.data(), lay.size());
  };
  std::vector<double> dx = G;  // nope part: identity, gradient G
  rope_apply<double>(dx.data() + lay.dn, lay.B, lay.L, lay.H, lay.token(), lay.head(), 20, table,
                     true);
  test::GradientCheck gc;
  gc.add("x", x.data(), dx.data(), {lay.B, lay.L, lay.H, lay.head()});
  EXPECT_TRUE(gc.run(loss));
  // And the forward rotation is not its own transpose (a check that can fail).
  std::vector<double> wrong = G;
  rope_apply<double>(wrong.data() + lay.dn, lay.B, lay.L, lay.H, lay.token(), lay.head(), 20, table,
                     false);
  test::GradientCheck bad;
  bad.add("x", x.data(), wrong.data(), lay.size());
  EXPECT_FALSE(bad.run(loss));
}

}  // namespace
}  // namespace laga
