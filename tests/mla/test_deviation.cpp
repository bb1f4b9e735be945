// deviation(), the agreement measure every tool reports (laga compare's and
// verify's max |diff|): a NaN or Inf in the result or in the reference is
// disagreement, never dropped (issue 10 item 4: compare's own max once
// skipped NaN and reported agreement).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

TensorF tensor(std::initializer_list<float> v) {
  TensorF t({static_cast<std::int64_t>(v.size())});
  std::int64_t i = 0;
  for (float x : v) t[i++] = x;
  return t;
}

TEST(Deviation, MaxAbsAndScale) {
  const Deviation d = deviation(tensor({1, 2, 3}), tensor({1, 2.5f, -4}));
  EXPECT_DOUBLE_EQ(d.max_abs, 7.0);
  EXPECT_DOUBLE_EQ(d.ref_max, 4.0);
  EXPECT_DOUBLE_EQ(d.relative(), 7.0 / 4.0);
}

TEST(Deviation, NonFiniteIsDisagreementWhereverItIs) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // First, middle and last element, in the result and in the reference.
  for (int at = 0; at < 3; ++at)
    for (float bad : {nan, inf, -inf})
      for (bool in_ref : {false, true}) {
        TensorF a = tensor({1, 2, 3}), ref = tensor({1, 2, 3});
        (in_ref ? ref : a)[at] = bad;
        const Deviation d = deviation(a, ref);
        EXPECT_TRUE(std::isinf(d.max_abs) && d.max_abs > 0)
            << "non-finite at " << at << (in_ref ? " in the reference" : " in the result")
            << " gave max_abs " << d.max_abs;
      }
}

TEST(Deviation, ShapesMustMatch) {
  EXPECT_THROW(deviation(tensor({1, 2}), tensor({1, 2, 3})), Error);
}

}  // namespace
}  // namespace laga
