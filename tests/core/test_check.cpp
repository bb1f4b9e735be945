// Self-test of tests/common/check.hpp: the helpers every other test relies on
// must pass what is right and, above all, fail what is wrong.
#include "common/check.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace laga::test {
namespace {

bool contains(const ::testing::AssertionResult& r, const std::string& s) {
  return std::string(r.message()).find(s) != std::string::npos;
}

TEST(Check, TestRngIsDeterministicAndInRange) {
  EXPECT_EQ(random_vector<double>(10, 5), random_vector<double>(10, 5));
  EXPECT_NE(random_vector<double>(10, 5), random_vector<double>(10, 6));
  for (double v : random_vector<double>(1000, 1, 2.0, 3.0)) {
    ASSERT_GE(v, 2.0);
    ASSERT_LT(v, 3.0);
  }
  // SplitMix64 reference value for seed 0 (first output of the published
  // generator: 0xe220a8397b1dcdaf).
  TestRng r(0);
  EXPECT_EQ(r.next_u64(), 0xe220a8397b1dcdafull);
}

TEST(Check, DiffHelpers) {
  const std::vector<double> a{1.0, 2.0, 3.0}, b{1.0, 2.5, 2.0};
  EXPECT_DOUBLE_EQ(max_abs_diff(a.data(), b.data(), 3), 1.0);
  EXPECT_DOUBLE_EQ(max_rel_error(a.data(), b.data(), 3), 1.0 / 3.0);
  const DiffStats d = diff_stats(a.data(), b.data(), 3);
  EXPECT_EQ(d.abs_index, 2);
  EXPECT_EQ(d.rel_index, 2);
  const std::vector<float> n{1.0f, std::numeric_limits<float>::quiet_NaN(), 3.0f};
  EXPECT_TRUE(std::isinf(max_abs_diff(n.data(), a.data(), 3)));
  EXPECT_DOUBLE_EQ(dot(a.data(), b.data(), 3), 1.0 + 5.0 + 6.0);
}

TEST(Check, AllCloseNamesTheWorstElementAndRejectsNaN) {
  const std::vector<double> e{1.0, 2.0, 3.0, 4.0};
  std::vector<double> a = e;
  EXPECT_TRUE(all_close("a", a, e, 0.0, 0.0));
  a[1] += 1e-7;
  a[3] += 1e-3;
  EXPECT_TRUE(all_close("a", a, e, 1e-3, 1e-4));  // 1e-3 <= 1e-3 + 4e-4
  const auto r = all_close("buf", a, e, 1e-6, 0.0);
  EXPECT_FALSE(r);
  EXPECT_TRUE(contains(r, "buf[3]")) << r.message();
  EXPECT_TRUE(contains(r, "1 of 4")) << r.message();
  a[0] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_FALSE(all_close("a", a, a, 1e9, 1e9));  // NaN is never close, even to itself
  EXPECT_FALSE(all_close("a", std::vector<double>{1.0}, e, 1.0, 1.0));  // size mismatch
}

TEST(Check, AllEqualAndAllFinite) {
  const std::vector<float> x{0.0f, 1.0f, -2.0f};
  std::vector<float> y{-0.0f, 1.0f, -2.0f};
  EXPECT_TRUE(all_equal("x", x.data(), y.data(), 3));
  y[2] = std::nextafter(-2.0f, 0.0f);
  const auto r = all_equal("x", x.data(), y.data(), 3);
  EXPECT_FALSE(r);
  EXPECT_TRUE(contains(r, "x[2]")) << r.message();
  EXPECT_TRUE(all_finite("x", x.data(), 3));
  y[1] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(all_finite("y", y.data(), 3));
}

// L(x) = sum_i sin(x_i) x_{i+1}^2 + exp(x_0 / 4): a gradient with every kind
// of term (coupled, nonlinear, one element near zero).
double loss(const std::vector<double>& x) {
  double s = std::exp(x[0] / 4);
  for (std::size_t i = 0; i + 1 < x.size(); ++i) s += std::sin(x[i]) * x[i + 1] * x[i + 1];
  return s;
}
std::vector<double> grad(const std::vector<double>& x) {
  std::vector<double> g(x.size(), 0.0);
  g[0] = std::exp(x[0] / 4) / 4;
  for (std::size_t i = 0; i + 1 < x.size(); ++i) {
    g[i] += std::cos(x[i]) * x[i + 1] * x[i + 1];
    g[i + 1] += 2 * std::sin(x[i]) * x[i + 1];
  }
  return g;
}

TEST(Check, GradientCheckPassesTheRightGradient) {
  const auto x = random_vector<double>(12, 3, -2.0, 2.0);
  const auto r = check_gradient("x", loss, x, grad(x));
  EXPECT_TRUE(r) << r.message();
}

TEST(Check, GradientCheckFailsAWrongElementAndNamesIt) {
  auto x = random_vector<double>(12, 3, -2.0, 2.0);
  auto g = grad(x);
  g[7] *= 1.00001;  // a relative error of 1e-5 > tol 1e-6
  const auto r = check_gradient("theta", loss, x, g);
  EXPECT_FALSE(r);
  EXPECT_TRUE(contains(r, "theta[7]")) << r.message();
  EXPECT_TRUE(contains(r, "1 of 12")) << r.message();
}

TEST(Check, GradientCheckOverSeveralTensorsWithShapesAndSampling) {
  std::vector<double> a = random_vector<double>(6, 1), b = random_vector<double>(20, 2);
  // L = sum_ij a_i^2 b_j^3: da_i = 2 a_i sum b^3, db_j = 3 b_j^2 sum a^2.
  auto L = [&] {
    double sa = 0, sb = 0;
    for (double v : a) sa += v * v;
    for (double v : b) sb += v * v * v;
    return sa * sb;
  };
  double sa = 0, sb = 0;
  for (double v : a) sa += v * v;
  for (double v : b) sb += v * v * v;
  std::vector<double> ga(6), gb(20);
  for (int i = 0; i < 6; ++i) ga[i] = 2 * a[i] * sb;
  for (int j = 0; j < 20; ++j) gb[j] = 3 * b[j] * b[j] * sa;
  const std::vector<double> a0 = a, b0 = b;

  GradientCheck gc;
  gc.add("a", a.data(), ga.data(), 6).add("b", b.data(), gb.data(), {4, 5});
  GradCheckOptions opt;
  opt.max_elements = 5;
  EXPECT_TRUE(gc.run(L, opt));
  EXPECT_EQ(gc.last_checked(), 10);  // 5 of a, 5 of b
  EXPECT_LT(gc.last_max_rel_error(), 1e-8);
  EXPECT_EQ(a, a0);  // restored bit for bit
  EXPECT_EQ(b, b0);

  gb[19] = -gb[19];  // the last element is always among the sampled ones
  const auto r = gc.run(L, opt);
  EXPECT_FALSE(r);
  EXPECT_TRUE(contains(r, "b[19] = b(3, 4)")) << r.message();
}

// L = 1000 <c, big> + 1e-7 <small, small>, with |L| ~ 1 so finite
// differences resolve both: small's gradients (~2e-7) are ~1e-10 of big's
// (~1000). Doubling small's analytic gradient hides under the whole check's
// floor (1e-3 of big's largest gradient) but not under a per-tensor floor.
TEST(Check, PerTensorFloorSeesAWrongSmallTensor) {
  std::vector<double> big = random_vector<double>(4, 3, -1e-3, 1e-3),
                      small = random_vector<double>(4, 4, 0.5, 1.0);
  auto L = [&] {
    double s = 0;
    for (int i = 0; i < 4; ++i) s += 1000.0 * (i + 1) * big[i] + 1e-7 * small[i] * small[i];
    return s;
  };
  std::vector<double> gbig(4), gsmall(4);
  for (int i = 0; i < 4; ++i) gbig[i] = 1000.0 * (i + 1), gsmall[i] = 2 * 2e-7 * small[i];  // 2x
  GradientCheck gc;
  gc.add("big", big.data(), gbig.data(), 4).add("small", small.data(), gsmall.data(), 4);
  GradCheckOptions opt;
  opt.tol = 1e-3;
  EXPECT_TRUE(gc.run(L, opt)) << "the global floor hides small's error, as documented";
  opt.floor_per_tensor = true;
  const auto r = gc.run(L, opt);
  EXPECT_FALSE(r);
  EXPECT_TRUE(contains(r, "4 of 8")) << r.message();
  EXPECT_TRUE(contains(r, "d loss / d small[0]")) << r.message();
  for (double& g : gsmall) g /= 2;  // the right gradient passes per tensor too
  EXPECT_TRUE(gc.run(L, opt));
}

}  // namespace
}  // namespace laga::test
