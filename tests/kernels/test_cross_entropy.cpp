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
