// count_nonfinite and describe_nonfinite: the one count and sentence every
// refusal of NaN/inf uses (forward's inputs, checkpoints, gradients).
#include "core/nonfinite.hpp"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

namespace laga {
namespace {

template <class T>
class NonFiniteCount : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(NonFiniteCount, Types);

TYPED_TEST(NonFiniteCount, CountsNanAndBothInfinitiesFromTheFirst) {
  using T = TypeParam;
  const T nan = std::numeric_limits<T>::quiet_NaN(), inf = std::numeric_limits<T>::infinity();
  std::vector<T> x(10, T(1));
  x[9] = std::numeric_limits<T>::max();  // finite, however large
  x[8] = std::numeric_limits<T>::denorm_min();
  NonFinite nf = count_nonfinite(x.data(), std::int64_t(x.size()));
  EXPECT_EQ(nf.count, 0);
  EXPECT_EQ(nf.first, -1);
  x[3] = -inf;
  x[5] = nan;
  x[7] = inf;
  nf = count_nonfinite(x.data(), std::int64_t(x.size()));
  EXPECT_EQ(nf.count, 3);
  EXPECT_EQ(nf.first, 3);
}

TEST(NonFinite, DescribesCountFirstIndexAndSize) {
  EXPECT_EQ(describe_nonfinite("tensor 'w'", NonFinite{1, 5}, 2304),
            "tensor 'w' holds 1 non-finite value (NaN or inf; the first at flat index 5 of 2304)");
  EXPECT_EQ(describe_nonfinite("x", NonFinite{3, 0}, 9),
            "x holds 3 non-finite values (NaN or inf; the first at flat index 0 of 9)");
}

}  // namespace
}  // namespace laga
