// Packed documents as cuDNN's ragged batch (cuda/sdpa_ragged.hpp): the
// lengths and offsets of every document of every row, against documents
// written out by hand, and the refusals of what is not a document
// structure. Host only.
#include <gtest/gtest.h>

#include <vector>

#include "common/error_of.hpp"
#include "cuda/sdpa_ragged.hpp"

namespace laga::cuda {
namespace {

// doc_start of rows packed with these document lengths (each row's sum S).
std::vector<std::int64_t> starts_of(const std::vector<std::vector<std::int64_t>>& rows) {
  std::vector<std::int64_t> d;
  for (const auto& lens : rows) {
    std::int64_t t = 0;
    for (std::int64_t n : lens) {
      for (std::int64_t i = 0; i < n; ++i) d.push_back(t);
      t += n;
    }
  }
  return d;
}

TEST(SdpaRagged, EveryDocumentOfEveryRowIsOneBatchEntry) {
  // B 2, S 13: "3,1,6,3" then one whole row; H 4, dqk 24, dv 16.
  const auto d = starts_of({{3, 1, 6, 3}, {13}});
  const RaggedDocuments r = ragged_documents(d.data(), 2, 13, 4, 24, 16);
  EXPECT_EQ(r.docs, 5);
  EXPECT_EQ(r.max_len, 13);
  EXPECT_EQ(r.seq_len, (std::vector<std::int32_t>{3, 1, 6, 3, 13}));
  // First tokens 0, 3, 4, 10, 13 (row 1 starts at packed token 13), end 26.
  const std::vector<std::int64_t> first{0, 3, 4, 10, 13, 26};
  ASSERT_EQ(r.qk_offset.size(), first.size());
  for (std::size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(r.qk_offset[i], first[i] * 4 * 24) << i;
    EXPECT_EQ(r.vo_offset[i], first[i] * 4 * 16) << i;
  }
}

TEST(SdpaRagged, TheGraphsOffsetsAreTheFirstTokensScaled) {
  // The B 2, S 13 rows above: first packed tokens 0, 3, 4, 10, 13, end 26.
  const auto d = starts_of({{3, 1, 6, 3}, {13}});
  const RaggedDocuments r = ragged_documents(d.data(), 2, 13, 4, 24, 16);
  EXPECT_EQ(ragged_offsets(r, 4 * 24, "Q"),
            (std::vector<std::int32_t>{0, 3 * 96, 4 * 96, 10 * 96, 13 * 96, 26 * 96}));
  // The stats in laga's (B, Hq, S) layout, Hq 4: row 0's documents at their
  // first token; row 1's at 1 * 4 * 13 + 0; the end at 2 * 4 * 13.
  EXPECT_EQ(ragged_stats_offsets(r, 4), (std::vector<std::int32_t>{0, 3, 4, 10, 52, 104}));
  // An offset past int32 is refused, naming the tensor.
  EXPECT_NE(test::error_of([&] {
              ragged_offsets(r, std::int64_t(1) << 28, "dO");
            }).find("dO's ragged offset"),
            std::string::npos);
}

TEST(SdpaRagged, OneDocumentPerRowIsTheDenseBatch) {
  const auto d = starts_of({{7}, {7}, {7}});
  const RaggedDocuments r = ragged_documents(d.data(), 3, 7, 2, 8, 8);
  EXPECT_EQ(r.docs, 3);
  EXPECT_EQ(r.max_len, 7);
  EXPECT_EQ(r.qk_offset, (std::vector<std::int64_t>{0, 7 * 16, 14 * 16, 21 * 16}));
}

TEST(SdpaRagged, WhatIsNotADocumentStructureIsRefused) {
  auto d = starts_of({{3, 4}});
  d[5] = 1;  // token 5 "starts" at 1: neither itself nor its predecessor's start
  EXPECT_NE(test::error_of([&] {
              ragged_documents(d.data(), 1, 7, 1, 8, 8);
            }).find("batch row 0 token 5 starts its document at 1"),
            std::string::npos);
  auto e = starts_of({{4}, {4}});
  e[4] = 2;  // row 1's token 0
  EXPECT_NE(test::error_of([&] {
              ragged_documents(e.data(), 2, 4, 1, 8, 8);
            }).find("every row's token 0 starts a document"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { ragged_documents(nullptr, 1, 4, 1, 8, 8); }).find("doc_start"),
            std::string::npos);
}

}  // namespace
}  // namespace laga::cuda
