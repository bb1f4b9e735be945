// Timing the plan's own shapes (plan/measure.hpp): every listed GEMM and
// attention shape gets a positive time, a shape already timed is not timed
// again, and what cannot be timed faithfully (document starts, calls too big
// to repeat) is left to the efficiency figures.
#include <gtest/gtest.h>

#include "mla/block.hpp"
#include "plan/measure.hpp"

namespace laga {
namespace {

ops::AttentionCall attention(ops::AttentionPass pass, AttentionKind kernel) {
  ops::AttentionCall a;
  a.B = 1, a.Sq = a.Sk = 64, a.Hq = 2, a.Hk = 1, a.dqk = 24, a.dv = 16;
  a.kernel = kernel, a.pass = pass;
  return a;
}

TEST(MeasureShapes, TimesEveryListedShapeOnce) {
  ops::OpCounts calls;
  const ops::GemmCall g{false, true, 48, 40, 32, 96, 32, 40, true};
  calls.gemm_calls[g] = {3, 3 * 2.0 * 48 * 40 * 32};
  for (AttentionKind k : {AttentionKind::flash, AttentionKind::eager})
    for (ops::AttentionPass p : {ops::AttentionPass::forward, ops::AttentionPass::backward})
      calls.attention_calls[attention(p, k)] = {1, 1e5};
  ShapeTimes times;
  EXPECT_EQ(measure_shapes(calls, times, {}), 5);
  ASSERT_EQ(times.gemm.size(), 1u);
  EXPECT_GT(times.gemm.at(g), 0);
  ASSERT_EQ(times.attention.size(), 4u);
  for (const auto& [a, s] : times.attention) EXPECT_GT(s, 0);
  const ShapeTimes before = times;
  EXPECT_EQ(measure_shapes(calls, times, {}), 0);  // memoised: nothing new
  EXPECT_EQ(times.gemm, before.gemm);
}

TEST(MeasureShapes, LeavesOutWhatItCannotTimeFaithfully) {
  ops::AttentionCall docs = attention(ops::AttentionPass::forward, AttentionKind::flash);
  docs.documents = true;
  EXPECT_FALSE(shape_timeable(docs, {1, 1e5}));
  EXPECT_TRUE(
      shape_timeable(attention(ops::AttentionPass::forward, AttentionKind::flash), {1, 1e5}));
  // 10^12 FLOPs in one call: seconds to minutes on a core, not repeated.
  const ops::GemmCall big{false, false, 10000, 10000, 5000, 5000, 10000, 10000, false};
  EXPECT_FALSE(shape_timeable(big, {1, 1e12}));
  // A call of few FLOPs over 1 GiB of strided operands.
  const ops::GemmCall wide{false, false, 1 << 16, 1, 1, 1 << 14, 1, 1, false};
  EXPECT_FALSE(shape_timeable(wide, {1, 2.0 * (1 << 16)}));
  ops::OpCounts calls;
  calls.attention_calls[docs] = {1, 1e5};
  calls.gemm_calls[big] = {1, 1e12};
  ShapeTimes times;
  EXPECT_EQ(measure_shapes(calls, times, {}), 0);
  EXPECT_TRUE(times.attention.empty());
  EXPECT_TRUE(times.gemm.empty());
}

}  // namespace
}  // namespace laga
