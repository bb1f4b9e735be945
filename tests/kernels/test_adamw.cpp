// AdamW against the formula in double, its defining properties (first step
// moves every weight by ~lr, decay is decoupled from the gradient), gradient
// clipping and the learning-rate schedule.
#include "kernels/adamw.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/check.hpp"

namespace laga {
namespace {

TEST(AdamW, MatchesReferenceOverSteps) {
  const std::int64_t n = 257;
  AdamWHyper h{3e-3, 0.9, 0.95, 1e-8, 0.1};
  auto p = test::random_vector<float>(n, 1), pr = p;
  std::vector<float> m(n, 0), v(n, 0), mr(n, 0), vr(n, 0);
  for (int step = 1; step <= 5; ++step) {
    auto g = test::random_vector<float>(n, 10 + step);
    adamw_step(p.data(), m.data(), v.data(), g.data(), n, step, h);
    adamw_step_reference(pr.data(), mr.data(), vr.data(), g.data(), n, step, h);
  }
  EXPECT_TRUE(test::all_close("p", p, pr, 1e-6, 1e-5));
  EXPECT_TRUE(test::all_close("m", m, mr, 1e-7, 1e-5));
  EXPECT_TRUE(test::all_close("v", v, vr, 1e-9, 1e-5));
}

TEST(AdamW, FirstStepMovesByLrAndDecayIsDecoupled) {
  // Step 1: mhat = g, vhat = g^2, so the update is lr * sign(g) (eps aside)
  // whatever the gradient's scale.
  std::vector<double> p{1.0, -2.0, 3.0}, g{1e-3, -50.0, 7.0}, m(3, 0), v(3, 0);
  AdamWHyper h{0.01, 0.9, 0.999, 1e-12, 0.0};
  adamw_step(p.data(), m.data(), v.data(), g.data(), 3, 1, h);
  EXPECT_NEAR(p[0], 1.0 - 0.01, 1e-9);
  EXPECT_NEAR(p[1], -2.0 + 0.01, 1e-9);
  EXPECT_NEAR(p[2], 3.0 - 0.01, 1e-9);
  // Zero gradient: only the decay acts, p *= 1 - lr wd (not routed through v).
  std::vector<double> q{2.0}, z{0.0}, mq{0.0}, vq{0.0};
  adamw_step(q.data(), mq.data(), vq.data(), z.data(), 1, 1,
             AdamWHyper{0.1, 0.9, 0.999, 1e-8, 0.5});
  EXPECT_DOUBLE_EQ(q[0], 2.0 * (1 - 0.1 * 0.5));
}

TEST(AdamW, ClipFactorAndNorm) {
  std::vector<float> g{3, 4};
  EXPECT_DOUBLE_EQ(std::sqrt(sum_squares(g.data(), 2)), 5.0);
  EXPECT_DOUBLE_EQ(clip_factor(5.0, 0.0), 1.0);   // off
  EXPECT_DOUBLE_EQ(clip_factor(5.0, 10.0), 1.0);  // below the bound
  EXPECT_NEAR(clip_factor(5.0, 1.0), 1.0 / 5.0, 1e-6);
}

TEST(AdamW, Schedule) {
  LrSchedule s{1.0, 4, 14, true, 0.1};
  EXPECT_DOUBLE_EQ(s.at(1), 0.25);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_NEAR(s.at(9), 0.55, 1e-12);  // half-way through the cosine
  EXPECT_NEAR(s.at(14), 0.1, 1e-12);
  LrSchedule c{2e-3, 0, 60, false, 0.0};
  EXPECT_DOUBLE_EQ(c.at(1), 2e-3);
  EXPECT_DOUBLE_EQ(c.at(60), 2e-3);
}

}  // namespace
}  // namespace laga
