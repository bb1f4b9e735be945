// SpLayout against layouts worked out by hand: the near-equal split (the
// first S % P ranks one token more, likewise heads), offsets as running sums,
// ranks with no head, custom shards, and every refusal naming its fix.
#include "mla/layout.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "common/error_of.hpp"
#include "core/error.hpp"

namespace laga {
namespace {

using V = std::vector<std::int64_t>;

void expect_layout(const SpLayout& l, std::int64_t batch, V seq_count, V seq_offset, V head_count,
                   V head_offset) {
  EXPECT_EQ(l.batch, batch);
  EXPECT_EQ(l.ranks, static_cast<int>(seq_count.size()));
  EXPECT_EQ(l.seq_count, seq_count);
  EXPECT_EQ(l.seq_offset, seq_offset);
  EXPECT_EQ(l.head_count, head_count);
  EXPECT_EQ(l.head_offset, head_offset);
}

TEST(SpLayout, EvenSplitsByHand) {
  // 13 tokens over 3 ranks: 13 = 3 * 4 + 1, rank 0 takes the extra one.
  // 5 heads: 5 = 3 * 1 + 2, ranks 0 and 1 take one more.
  SpLayout l = SpLayout::even(2, 13, 5, 3);
  expect_layout(l, 2, {5, 4, 4}, {0, 5, 9}, {2, 2, 1}, {0, 2, 4});
  EXPECT_EQ(l.seq, 13);
  EXPECT_EQ(l.heads, 5);
  EXPECT_EQ(l.describe(), "seq 5+4+4, heads 2+2+1");

  // Fewer heads than ranks: the last ranks own none.
  l = SpLayout::even(1, 7, 2, 4);
  expect_layout(l, 1, {2, 2, 2, 1}, {0, 2, 4, 6}, {1, 1, 0, 0}, {0, 1, 2, 2});

  // Divisible: equal shards.
  l = SpLayout::even(3, 16, 8, 4);
  expect_layout(l, 3, {4, 4, 4, 4}, {0, 4, 8, 12}, {2, 2, 2, 2}, {0, 2, 4, 6});

  // One rank holds everything.
  l = SpLayout::even(1, 9, 3, 1);
  expect_layout(l, 1, {9}, {0}, {3}, {0});
  EXPECT_EQ(l.describe(), "seq 9, heads 3");
}

TEST(SpLayout, CustomShards) {
  const SpLayout l = SpLayout::custom(2, {1, 8, 4}, {0, 3, 2});
  expect_layout(l, 2, {1, 8, 4}, {0, 1, 9}, {0, 3, 2}, {0, 0, 3});
  EXPECT_EQ(l.seq, 13);
  EXPECT_EQ(l.heads, 5);
  EXPECT_EQ(l.describe(), "seq 1+8+4, heads 0+3+2");
}

using test::error_of;

TEST(SpLayout, RefusalsNameTheFix) {
  auto has = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  };
  std::string e = error_of([] { SpLayout::even(1, 3, 4, 4); });
  EXPECT_TRUE(has(e, "--seq 3 is shorter than --sp 4")) << e;
  EXPECT_TRUE(has(e, "fewer ranks")) << e;
  e = error_of([] { SpLayout::even(1, 3, 4, 0); });
  EXPECT_TRUE(has(e, "at least 1 rank")) << e;
  e = error_of([] { SpLayout::custom(1, {2, 0, 1}, {1, 1, 1}); });
  EXPECT_TRUE(has(e, "rank 1 holds no tokens")) << e;
  e = error_of([] { SpLayout::custom(1, {2, 1}, {1, -1}); });
  EXPECT_TRUE(has(e, "rank 1 has a negative head count")) << e;
  e = error_of([] { SpLayout::custom(1, {2, 1}, {1, 1, 1}); });
  EXPECT_TRUE(has(e, "one seq count and one head count per rank")) << e;
  e = error_of([] { SpLayout::custom(0, {2, 1}, {1, 1}); });
  EXPECT_TRUE(has(e, "batch must be >= 1")) << e;
}

}  // namespace
}  // namespace laga
