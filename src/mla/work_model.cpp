#include "mla/work_model.hpp"

#include "core/error.hpp"

namespace laga {

AttentionWork attention_work(const MlaConfig& cfg, const SpLayout& layout, Form form, int rank,
                             const Documents* docs) {
  LAGA_CHECK(rank >= 0 && rank < layout.ranks, "attention_work: rank ", rank, " of ", layout.ranks);
  const double S = double(layout.seq);
  AttentionWork w;
  w.pairs = docs ? docs->causal_pairs() : double(layout.batch) * S * (S + 1) / 2;
  const double dqk = double(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim);
  double dims = 0;
  switch (form) {
    case Form::explicit_form:
    case Form::laga:
      dims = dqk + double(cfg.v_head_dim);
      break;
    case Form::absorbed:
      dims = double(cfg.kv_lora_rank + cfg.qk_rope_head_dim) + double(cfg.kv_lora_rank);
      break;
  }
  LAGA_CHECK(dims > 0, "attention_work: no work model for form ", static_cast<int>(form));
  w.flops = 2 * w.pairs * double(layout.head_count[std::size_t(rank)]) * dims;
  return w;
}

}  // namespace laga
