// Documents: the cut points of packed rows, their parsing and validation, and
// the per-token arrays the kernels read (document starts, in-document
// positions).
#include <gtest/gtest.h>

#include "common/error_of.hpp"
#include "core/error.hpp"
#include "mla/documents.hpp"

namespace laga {
namespace {

using test::error_of;

TEST(Documents, LengthsSharedOrPerRow) {
  const Documents shared = Documents::parse_lengths("2,3", 2, 5);
  EXPECT_EQ(shared.cu_seqlens(0), (std::vector<std::int64_t>{0, 2, 5}));
  EXPECT_EQ(shared.cu_seqlens(1), (std::vector<std::int64_t>{0, 2, 5}));
  EXPECT_EQ(shared.describe(), "2,3");
  const Documents rows = Documents::parse_lengths("1,4/5", 2, 5);
  EXPECT_EQ(rows.cu_seqlens(0), (std::vector<std::int64_t>{0, 1, 5}));
  EXPECT_EQ(rows.cu_seqlens(1), (std::vector<std::int64_t>{0, 5}));
  EXPECT_EQ(rows.count(0), 2);
  EXPECT_EQ(rows.describe(), "1,4/5");
}

TEST(Documents, StartsPositionsAndPairs) {
  const Documents d = Documents::parse_lengths("1,4/2,2,1", 2, 5);
  EXPECT_EQ(d.doc_starts(), (std::vector<std::int64_t>{0, 1, 1, 1, 1, 0, 0, 2, 2, 4}));
  // Tokens [2, 5) of each row: row 0 at 1, 2, 3 of its second document; row 1
  // at 0, 1 of its second and 0 of its third.
  EXPECT_EQ(d.positions({{2, 5}}), (std::vector<std::int64_t>{1, 2, 3, 0, 1, 0}));
  EXPECT_EQ(d.positions({}), (std::vector<std::int64_t>{}));
  // A zigzag shard's two ranges, [0, 1) and [4, 5), one after the other in
  // each row: row 0 at 0 (first document) and 3; row 1 at 0 and 0.
  EXPECT_EQ(d.positions({{0, 1}, {4, 5}}), (std::vector<std::int64_t>{0, 3, 0, 0}));
  // 1 + 10 for row 0, 3 + 3 + 1 for row 1.
  EXPECT_EQ(d.causal_pairs(), 18.0);
}

TEST(Documents, BadListsNameTheProblem) {
  const auto bad_lengths = [](const char* text, std::int64_t B, std::int64_t S) {
    return error_of([&] { Documents::parse_lengths(text, B, S); });
  };
  EXPECT_NE(bad_lengths("2,2", 1, 5).find("add up to 4, not --seq 5"), std::string::npos);
  EXPECT_NE(bad_lengths("4,4", 1, 5).find("more than --seq 5"), std::string::npos);
  EXPECT_NE(bad_lengths("0,5", 1, 5).find("a document of length 0"), std::string::npos);
  EXPECT_NE(bad_lengths("-1,6", 1, 5).find("a document of length -1"), std::string::npos);
  EXPECT_NE(bad_lengths("2,,3", 1, 5).find("'' is not a whole number"), std::string::npos);
  EXPECT_NE(bad_lengths("2,,3", 1, 5).find("in '2,,3'"), std::string::npos);
  // The one rule for whole numbers (core/whole_number.hpp): 010 was read as 10.
  EXPECT_NE(bad_lengths("010", 1, 10).find("'010' is not a whole number"), std::string::npos);
  EXPECT_NE(bad_lengths("2.5,2.5", 1, 5).find("is not a whole number"), std::string::npos);
  // A length past int64 is refused by its range, not as "not a whole
  // number" (issue 54, T).
  const std::string huge = bad_lengths("99999999999999999999", 1, 10);
  EXPECT_NE(huge.find("'99999999999999999999' is not a whole number >= 1 and <= 10"),
            std::string::npos)
      << huge;
  EXPECT_EQ(huge.find("decimal digits only"), std::string::npos) << huge;
  EXPECT_NE(bad_lengths("5/5/5", 2, 5).find("3 rows of documents for a batch of 2"),
            std::string::npos);

  const auto bad_cuts = [](std::vector<std::int64_t> cu, std::int64_t S) {
    return error_of([&] { Documents::from_cu_seqlens("cu_seqlens in in.st", 1, S, {cu}); });
  };
  EXPECT_NE(bad_cuts({1, 5}, 5).find("cu_seqlens in in.st: cu_seqlens starts at 1"),
            std::string::npos);
  EXPECT_NE(bad_cuts({0, 3, 3, 5}, 5).find("document 1 has length 0"), std::string::npos);
  EXPECT_NE(bad_cuts({0, 4, 2, 5}, 5).find("strictly increasing"), std::string::npos);
  EXPECT_NE(bad_cuts({0, 4}, 5).find("cover 4 tokens but the sequence has 5"), std::string::npos);
  EXPECT_NE(bad_cuts({0}, 5).find("at least one document"), std::string::npos);
  EXPECT_NE(bad_cuts({0, 1, 2, 3}, 2).find("3 documents in a sequence of 2 tokens"),
            std::string::npos);
  EXPECT_EQ(bad_cuts({0, 5}, 5), "");
}

}  // namespace
}  // namespace laga
