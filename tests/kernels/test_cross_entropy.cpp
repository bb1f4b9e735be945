// Fused cross-entropy against the textbook reference, with huge logits (the
// max subtraction), out-of-range targets, and finite differences in double.
#include "kernels/cross_entropy.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/check.hpp"
#include "core/error.hpp"

namespace laga {
namespace {

using test::all_close;
using test::random_vector;

TEST(CrossEntropy, MatchesReferenceFloatAndDouble) {
  const std::int64_t N = 7, V = 301;
  std::vector<std::int32_t> t(N);
  for (std::int64_t i = 0; i < N; ++i) t[i] = std::int32_t((i * 97 + 5) % V);
  auto xd = random_vector<double>(N * V, 1, -4, 4);
  auto xf = test::convert<float>(xd);
  std::vector<double> ld(N), lse(N), lr(N), gd(N * V), gr(N * V);
  cross_entropy_forward(ld.data(), lse.data(), xd.data(), t.data(), N, V);
  cross_entropy_forward_reference(lr.data(), xd.data(), t.data(), N, V);
  EXPECT_TRUE(all_close("loss", ld, lr, 1e-13, 1e-13));
  cross_entropy_backward(gd.data(), xd.data(), lse.data(), t.data(), 0.5, N, V);
  cross_entropy_backward_reference(gr.data(), xd.data(), t.data(), 0.5, N, V);
  EXPECT_TRUE(all_close("dlogits", gd, gr, 1e-15, 1e-12));
  // float: the sums run in double, so only the inputs' and outputs' rounding remains.
  std::vector<float> lf(N), gf(N * V);
  std::vector<double> lsef(N);
  cross_entropy_forward(lf.data(), lsef.data(), xf.data(), t.data(), N, V);
  EXPECT_TRUE(all_close("loss f32", lf, lr, 1e-5, 1e-6));
  // In place (dlogits aliases logits), as the model uses it.
  cross_entropy_backward(xf.data(), xf.data(), lsef.data(), t.data(), 0.5, N, V);
  EXPECT_TRUE(all_close("dlogits f32 in place", xf, gr, 1e-7, 1e-5));
}

TEST(CrossEntropy, IgnoredTargetsCountNothing) {
  // Rows 1 and 3 are ignored: zero loss, zero gradient; the other rows are
  // exactly those of a run without the ignored rows.
  const std::int64_t N = 5, V = 17;
  const std::vector<std::int32_t> t{3, kIgnoreTarget, 16, kIgnoreTarget, 0};
  const auto x = random_vector<double>(N * V, 4, -3, 3);
  std::vector<double> loss(N), lse(N), g(N * V, 9.0), lr(N), gr(N * V, 9.0);
  cross_entropy_forward(loss.data(), lse.data(), x.data(), t.data(), N, V);
  cross_entropy_forward_reference(lr.data(), x.data(), t.data(), N, V);
  cross_entropy_backward(g.data(), x.data(), lse.data(), t.data(), 0.25, N, V);
  cross_entropy_backward_reference(gr.data(), x.data(), t.data(), 0.25, N, V);
  for (std::int64_t i : {1, 3}) {
    EXPECT_EQ(loss[i], 0.0);
    EXPECT_EQ(lr[i], 0.0);
    for (std::int64_t v = 0; v < V; ++v) {
      EXPECT_EQ(g[i * V + v], 0.0) << "row " << i;
      EXPECT_EQ(gr[i * V + v], 0.0) << "row " << i;
    }
  }
  for (std::int64_t i : {0, 2, 4}) {
    double one_loss, one_lse;
    std::vector<double> one_g(V);
    cross_entropy_forward(&one_loss, &one_lse, x.data() + i * V, &t[i], 1, V);
    cross_entropy_backward(one_g.data(), x.data() + i * V, &one_lse, &t[i], 0.25, 1, V);
    EXPECT_EQ(loss[i], one_loss) << "row " << i;
    for (std::int64_t v = 0; v < V; ++v) EXPECT_EQ(g[i * V + v], one_g[v]) << "row " << i;
  }
  EXPECT_TRUE(all_close("loss vs reference", loss, lr, 1e-13, 1e-13));
  EXPECT_TRUE(all_close("dlogits vs reference", g, gr, 1e-15, 1e-12));
  // Only -1 means "ignore": -2 is still an id out of range.
  const std::vector<std::int32_t> bad{-2};
  EXPECT_THROW(cross_entropy_forward(loss.data(), lse.data(), x.data(), bad.data(), 1, V), Error);
}

TEST(CrossEntropy, StableForHugeLogits) {
  // exp(1e4) overflows any float type; the max subtraction makes it harmless.
  std::vector<float> x{1e4f, 1e4f - 1.0f, -1e4f, 1e4f};
  std::vector<std::int32_t> t{1};
  float loss;
  double lse;
  cross_entropy_forward(&loss, &lse, x.data(), t.data(), 1, 4);
  // logits relative to the max: 0, -1, -2e4, 0 -> loss = log(2 + e^-1) + 1
  EXPECT_NEAR(loss, std::log(2.0 + std::exp(-1.0)) + 1.0, 1e-5);
  std::vector<float> g(4);
  cross_entropy_backward(g.data(), x.data(), &lse, t.data(), 1.0, 1, 4);
  EXPECT_TRUE(test::all_finite("dlogits", g.data(), 4));
  EXPECT_NEAR(g[0] + g[1] + g[2] + g[3], 0.0, 1e-6);  // softmax sums to 1, onehot too
}

TEST(CrossEntropy, TargetOutOfRangeNamesIt) {
  std::vector<double> x(6, 0.0), loss(2), lse(2);
  std::vector<std::int32_t> t{1, 3};
  try {
    cross_entropy_forward(loss.data(), lse.data(), x.data(), t.data(), 2, 3);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("target id 3 of row 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--vocab"), std::string::npos) << e.what();
  }
}

TEST(CrossEntropy, FiniteDifferencesDouble) {
  const std::int64_t N = 3, V = 11;
  std::vector<std::int32_t> t{0, 10, 4};
  auto x = random_vector<double>(N * V, 3, -3, 3);
  const double scale = 1.0 / N;  // d(mean loss)
  std::vector<double> lse(N), g(N * V), loss(N);
  cross_entropy_forward(loss.data(), lse.data(), x.data(), t.data(), N, V);
  cross_entropy_backward(g.data(), x.data(), lse.data(), t.data(), scale, N, V);
  EXPECT_TRUE(test::check_gradient(
      "logits",
      [&](const std::vector<double>& xs) {
        std::vector<double> l(N), s(N);
        cross_entropy_forward(l.data(), s.data(), xs.data(), t.data(), N, V);
        return (l[0] + l[1] + l[2]) * scale;
      },
      x, g));
}

}  // namespace
}  // namespace laga
