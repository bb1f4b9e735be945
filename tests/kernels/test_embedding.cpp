// Embedding gather and scatter-add (repeated ids sum), bad ids, and FD.
#include "kernels/embedding.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "common/check.hpp"
#include "core/error.hpp"

namespace laga {
namespace {

TEST(Embedding, GatherAndScatterAdd) {
  const std::int64_t V = 5, D = 3, N = 4;
  std::vector<float> table(V * D);
  for (std::int64_t i = 0; i < V * D; ++i) table[i] = float(i);
  std::vector<std::int32_t> ids{4, 0, 4, 2};
  std::vector<float> out(N * D);
  embedding_forward(out.data(), ids.data(), table.data(), N, V, D);
  for (std::int64_t i = 0; i < N; ++i)
    for (std::int64_t d = 0; d < D; ++d) EXPECT_EQ(out[i * D + d], float(ids[i] * D + d));
  std::vector<float> dout(N * D), dt(V * D, 1.0f);
  for (std::int64_t i = 0; i < N * D; ++i) dout[i] = float(i + 1);
  embedding_backward(dt.data(), dout.data(), ids.data(), N, V, D);
  // row 4 gets rows 0 and 2 of dout (1+7, 2+8, 3+9) on top of the 1 already there.
  EXPECT_EQ(dt[4 * D + 0], 1 + 1 + 7.0f);
  EXPECT_EQ(dt[4 * D + 2], 1 + 3 + 9.0f);
  EXPECT_EQ(dt[0 * D + 1], 1 + 5.0f);
  EXPECT_EQ(dt[2 * D + 0], 1 + 10.0f);
  EXPECT_EQ(dt[1 * D + 0], 1.0f);  // unused row untouched
}

TEST(Embedding, BadIdNamesPositionAndVocab) {
  std::vector<double> table(6), out(4);
  std::vector<std::int32_t> ids{1, 3};
  try {
    embedding_forward(out.data(), ids.data(), table.data(), 2, 3, 2);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("token id 3 at position 1"), std::string::npos) << m;
    EXPECT_NE(m.find("[0, 3)"), std::string::npos) << m;
  }
}

TEST(Embedding, FiniteDifferencesDouble) {
  const std::int64_t V = 4, D = 3, N = 5;
  auto table = test::random_vector<double>(V * D, 1);
  auto G = test::random_vector<double>(N * D, 2);
  std::vector<std::int32_t> ids{1, 3, 1, 0, 1};
  std::vector<double> dt(V * D, 0.0);
  embedding_backward(dt.data(), G.data(), ids.data(), N, V, D);
  EXPECT_TRUE(test::check_gradient(
      "table",
      [&](const std::vector<double>& t) {
        std::vector<double> out(N * D);
        embedding_forward(out.data(), ids.data(), t.data(), N, V, D);
        return test::dot(out.data(), G.data(), N * D);
      },
      table, dt));
}

}  // namespace
}  // namespace laga
