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
  V begins;
  for (int r = 0; r < l.ranks; ++r) begins.push_back(l.shard_begin(r));
  EXPECT_EQ(begins, seq_offset);
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

// The zigzag layout by hand: 13 tokens over 3 ranks, 6 chunks 3+2+2+2+2+2:
// [0,3) [3,5) [5,7) [7,9) [9,11) [11,13). Rank r holds chunks r and 5-r;
// rank 2's, [5,7) and [7,9), are adjacent: one range.
TEST(SpLayout, ZigzagByHand) {
  using R = std::vector<TokenRange>;
  const SpLayout l = SpLayout::even(2, 13, 5, 3, SeqLayout::zigzag);
  EXPECT_EQ(l.seq_layout, SeqLayout::zigzag);
  EXPECT_EQ(l.seq_ranges[0], R({{0, 3}, {11, 13}}));
  EXPECT_EQ(l.seq_ranges[1], R({{3, 5}, {9, 11}}));
  EXPECT_EQ(l.seq_ranges[2], R({{5, 9}}));
  EXPECT_EQ(l.seq_count, V({5, 4, 4}));
  EXPECT_EQ(l.head_count, V({2, 2, 1}));  // heads as the contiguous layout's
  EXPECT_EQ(l.positions(0), V({0, 1, 2, 11, 12}));
  EXPECT_EQ(l.describe(), "seq 5+4+4 zigzag, heads 2+2+1");
  EXPECT_FALSE(l.rank_major_is_sequence());
  EXPECT_EQ(l.largest_shard_tokens(), 10);
  // S < 2P: the last chunks are empty, and every rank still holds a token.
  const SpLayout short_seq = SpLayout::even(1, 5, 2, 4, SeqLayout::zigzag);
  EXPECT_EQ(short_seq.seq_ranges[0], R({{0, 1}}));
  EXPECT_EQ(short_seq.seq_ranges[3], R({{3, 5}}));  // chunks 3 and 4, adjacent
  EXPECT_EQ(short_seq.seq_count, V({1, 1, 1, 2}));
  // At P 1 zigzag is the whole sequence, one range.
  EXPECT_EQ(SpLayout::even(1, 9, 3, 1, SeqLayout::zigzag).seq_ranges[0], R({{0, 9}}));
  // shard_begin is for contiguous layouts only.
  EXPECT_NE(test::error_of([&] { (void)l.shard_begin(0); }).find("read its seq_ranges"),
            std::string::npos);
  EXPECT_EQ(parse_seq_layout("zigzag"), SeqLayout::zigzag);
  EXPECT_NE(test::error_of([] { parse_seq_layout("mirror"); }).find("use contiguous or zigzag"),
            std::string::npos);
}

// validate() holds the ranges to a tiling of the sequence.
TEST(SpLayout, RangesThatDoNotTileAreRefused) {
  SpLayout l = SpLayout::even(1, 8, 2, 2, SeqLayout::zigzag);
  l.seq_ranges[1] = {{2, 4}, {4, 6}};  // [2, 6) in two pieces still tiles
  EXPECT_NO_THROW(l.validate());
  l.seq_ranges[1] = {{1, 3}, {4, 6}};
  EXPECT_NE(test::error_of([&] { l.validate(); }).find("token 1 is held twice"), std::string::npos);
  l.seq_ranges[1] = {{2, 4}, {4, 7}};
  EXPECT_NE(test::error_of([&] { l.validate(); }).find("seq ranges hold 5 tokens"),
            std::string::npos);
  l.seq_ranges[1] = {{3, 5}, {5, 7}};
  EXPECT_NE(test::error_of([&] { l.validate(); }).find("token 2 is held by no rank"),
            std::string::npos);
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

// laga2d's grid by hand: 13 tokens over 2 Pc chunks, context group c taking
// chunks c and 2Pc-1-c, heads split over the head groups.
TEST(HeadContextGrid, ChunksAndHeadGroupsByHand) {
  using R = std::vector<TokenRange>;
  // P 4 = 2 head groups x 2 context groups; 13 tokens in 4 chunks 4+3+3+3:
  // [0,4) [4,7) [7,10) [10,13). Group c = 0 takes chunks 0 and 3, c = 1
  // chunks 1 and 2, adjacent, so one range. 5 heads over 2 groups: 3+2.
  HeadContextGrid g = HeadContextGrid::make(SpLayout::even(1, 13, 5, 4), 2);
  EXPECT_EQ(g.head_groups, 2);
  EXPECT_EQ(g.context_groups, 2);
  EXPECT_EQ(g.head_count, V({3, 3, 2, 2}));
  EXPECT_EQ(g.head_offset, V({0, 0, 3, 3}));
  EXPECT_EQ(g.queries[0], R({{0, 4}, {10, 13}}));
  EXPECT_EQ(g.queries[1], R({{4, 10}}));
  EXPECT_EQ(g.queries[2], g.queries[0]);
  EXPECT_EQ(g.query_rows(0), 7);
  EXPECT_EQ(g.key_end(0), 13);
  EXPECT_EQ(g.key_end(1), 10);
  EXPECT_EQ(g.describe(), "2 head groups x 2 context groups (heads 3+2)");

  // Ph = P: one context group, the whole sequence, the layout's own head
  // shards (uneven, a rank without heads): laga's attention.
  g = HeadContextGrid::make(SpLayout::custom(2, {1, 8, 4}, {0, 3, 2}), 3);
  EXPECT_EQ(g.head_count, V({0, 3, 2}));
  EXPECT_EQ(g.head_offset, V({0, 0, 3}));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(g.queries[std::size_t(r)], R({{0, 13}}));

  // Ph = 1 at P 8 on 13 tokens: 16 chunks, the last three empty (13 = 16 * 0
  // + 13: chunks 0..12 hold one token). Group c takes chunk c and 15 - c.
  g = HeadContextGrid::make(SpLayout::even(1, 13, 3, 8), 1);
  EXPECT_EQ(g.head_count, V(8, 3));
  EXPECT_EQ(g.queries[0], R({{0, 1}}));  // chunk 15 is empty
  EXPECT_EQ(g.queries[3], R({{3, 4}, {12, 13}}));
  EXPECT_EQ(g.queries[7], R({{7, 9}}));  // chunks 7 and 8: adjacent
  EXPECT_EQ(g.key_end(0), 1);
}

TEST(HeadContextGrid, DefaultRuleIsTheGcd) {
  EXPECT_EQ(HeadContextGrid::default_head_groups(128, 512), 128);
  EXPECT_EQ(HeadContextGrid::default_head_groups(128, 8), 8);
  EXPECT_EQ(HeadContextGrid::default_head_groups(6, 8), 2);
  EXPECT_EQ(HeadContextGrid::default_head_groups(3, 8), 1);
  EXPECT_EQ(HeadContextGrid::default_head_groups(6, 4), 2);
  EXPECT_EQ(HeadContextGrid::resolve_head_groups(6, 8, 0), 2);
  EXPECT_EQ(HeadContextGrid::resolve_head_groups(6, 8, 4), 4);
}

TEST(HeadContextGrid, RefusalsNameTheFix) {
  const SpLayout lay = SpLayout::even(1, 16, 6, 8);
  std::string e = error_of([&] { HeadContextGrid::make(lay, 3); });
  EXPECT_NE(e.find("--head-groups 3 does not divide --sp 8"), std::string::npos) << e;
  EXPECT_NE(e.find("choose a divisor of 8"), std::string::npos) << e;
  e = error_of([&] { HeadContextGrid::make(lay, 16); });
  EXPECT_NE(e.find("must be between 1 and --sp 8"), std::string::npos) << e;
  e = error_of([&] { HeadContextGrid::make(lay, 0); });
  EXPECT_NE(e.find("must be between 1 and --sp 8"), std::string::npos) << e;
  e = error_of([&] { HeadContextGrid::resolve_head_groups(6, 8, -1); });
  EXPECT_NE(e.find("--head-groups must be >= 1"), std::string::npos) << e;
}

}  // namespace
}  // namespace laga
