// The closed-form communication model's gradient all-reduce term, against
// parameter counts worked out by hand from DeepSeek-V3's published attention
// shapes (D 7168, H 128, q_lora_rank 1536, kv_lora_rank 512, dn 128, dr 64,
// dv 128), and against mla_param_shapes, which allocates the gradients: the
// model writes the count out on its own, so the two are a check on each other.
#include <gtest/gtest.h>

#include "mla/comm_model.hpp"
#include "mla/params.hpp"

namespace laga {
namespace {

std::int64_t count_of(const std::vector<std::pair<std::string, Shape>>& shapes) {
  std::int64_t n = 0;
  for (const auto& [name, shape] : shapes) {
    std::int64_t k = 1;
    for (auto e : shape) k *= e;
    n += k;
  }
  return n;
}

// P = 2: rank r sends every chunk but its own in the reduce-scatter and its
// own in the all-gather, so each rank sends (and receives) n elements.
std::int64_t grad_bytes_at_p2(const MlaConfig& cfg, int rank) {
  const SpLayout lay = SpLayout::even(1, 2, cfg.n_heads, 2);
  const CommPrediction p = predict_comm(cfg, lay, Form::laga, rank, 4, false, true);
  const auto it = p.find({Phase::grad_sync, "grad_allreduce"});
  EXPECT_NE(it, p.end());
  EXPECT_EQ(it->second.calls, 1);
  EXPECT_EQ(it->second.sent, it->second.received);
  return it->second.sent;
}

TEST(CommModel, GradSyncCountsDeepSeekV3Parameters) {
  // wq_a 1536x7168, q_norm 1536, wq_b (128*192)x1536, wkv_a 576x7168,
  // kv_norm 512, wkv_b (128*256)x512, wo 7168x(128*128): 187,107,328.
  const std::int64_t v3 =
      1536 * 7168 + 1536 + 128 * 192 * 1536 + 576 * 7168 + 512 + 128 * 256 * 512 + 7168 * 128 * 128;
  const MlaConfig cfg = MlaConfig::preset("deepseek-v3");
  EXPECT_EQ(count_of(mla_param_shapes(cfg)), v3);
  for (int r : {0, 1}) EXPECT_EQ(grad_bytes_at_p2(cfg, r), 4 * v3) << "rank " << r;

  // rq = 0 (the paper preset): one wq (128*192)x7168 instead of the bottleneck.
  const std::int64_t paper =
      128 * 192 * 7168 + 576 * 7168 + 512 + 128 * 256 * 512 + 7168 * 128 * 128;
  const MlaConfig p = MlaConfig::preset("paper");
  ASSERT_EQ(p.q_lora_rank, 0);
  EXPECT_EQ(count_of(mla_param_shapes(p)), paper);
  EXPECT_EQ(grad_bytes_at_p2(p, 0), 4 * paper);
}

TEST(CommModel, OneCallPerLabelAndPhase) {
  MlaConfig cfg;
  const SpLayout lay = SpLayout::even(2, 13, cfg.n_heads, 3);
  for (Form f : all_forms()) {
    const CommPrediction p = predict_comm(cfg, lay, f, 1, 4, true, true);
    // forward and backward: q, out and (explicit) k, v or (else) the latent;
    // plus the gradient all-reduce.
    EXPECT_EQ(p.size(), f == Form::explicit_form ? 9u : 7u) << to_string(f);
    for (const auto& [key, b] : p) EXPECT_EQ(b.calls, 1) << to_string(f) << " " << key.second;
  }
}

}  // namespace
}  // namespace laga
