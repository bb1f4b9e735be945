// The closed-form attention work of a rank equals what the attention kernels'
// own mask counts (AttnShape::useful_flops_forward over the document starts),
// for every form, packed or not, on every rank of an uneven layout.
#include <gtest/gtest.h>

#include "kernels/attention.hpp"
#include "mla/work_model.hpp"

namespace laga {
namespace {

TEST(AttentionWork, EqualsTheKernelsMaskCount) {
  MlaConfig cfg;
  cfg.dim = 32, cfg.n_heads = 5, cfg.kv_lora_rank = 16, cfg.qk_nope_head_dim = 8,
  cfg.qk_rope_head_dim = 4, cfg.v_head_dim = 6;
  cfg.validate();
  const SpLayout lay = SpLayout::custom(2, {9, 8, 8}, {3, 2, 0});
  const Documents docs = Documents::parse_lengths("1,7,17/25", 2, 25);
  for (const Documents* d : {static_cast<const Documents*>(nullptr), &docs}) {
    const std::vector<std::int64_t> starts = d ? d->doc_starts() : std::vector<std::int64_t>{};
    for (Form f : all_forms())
      for (int r = 0; r < lay.ranks; ++r) {
        const std::int64_t Hr = lay.head_count[std::size_t(r)], dr = cfg.qk_rope_head_dim;
        AttnShape s = f == Form::absorbed
                          ? AttnShape{2, 25, 25, Hr, 1, cfg.kv_lora_rank + dr, cfg.kv_lora_rank}
                          : AttnShape{2, 25, 25, Hr, Hr, cfg.qk_nope_head_dim + dr, cfg.v_head_dim};
        s.doc_start = d ? starts.data() : nullptr;
        const AttentionWork w = attention_work(cfg, lay, f, r, d);
        EXPECT_EQ(w.flops, s.useful_flops_forward()) << to_string(f) << " rank " << r;
      }
  }
  // Packed: 1 + 28 + 153 pairs in row 0, 325 in row 1.
  EXPECT_EQ(attention_work(cfg, lay, Form::laga, 0, &docs).pairs, 507);
  EXPECT_EQ(attention_work(cfg, lay, Form::laga, 0, nullptr).pairs, 650);
}

}  // namespace
}  // namespace laga
