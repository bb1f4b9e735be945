#include "mla/work_model.hpp"

#include <algorithm>
#include <limits>

#include "core/error.hpp"

namespace laga {

namespace {

// Keys seen by the queries [a, e) of a document starting at d0 (a >= d0):
// sum over t of t - d0 + 1.
double pairs_in(std::int64_t a, std::int64_t e, std::int64_t d0) {
  const double n = double(e - a);
  return n * double(a - d0 + 1) + n * (n - 1) / 2;
}

// The (query, key) pairs of the queries `ranges` of every row, per head.
double range_pairs(const SpLayout& lay, const std::vector<TokenRange>& ranges,
                   const Documents* docs) {
  double pairs = 0;
  for (std::int64_t b = 0; b < lay.batch; ++b) {
    const std::vector<std::int64_t> whole{0, lay.seq};
    const std::vector<std::int64_t>& cu = docs ? docs->cu_seqlens(b) : whole;
    for (const TokenRange& q : ranges)
      for (std::size_t k = 0; k + 1 < cu.size(); ++k) {
        const std::int64_t a = std::max(q.begin, cu[k]), e = std::min(q.end, cu[k + 1]);
        if (a < e) pairs += pairs_in(a, e, cu[k]);
      }
  }
  return pairs;
}

}  // namespace

AttentionWork attention_work(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                             int rank, const Documents* docs) {
  LAGA_CHECK(rank >= 0 && rank < layout.ranks, "attention_work: rank ", rank, " of ", layout.ranks);
  const double S = double(layout.seq);
  AttentionWork w;
  double heads = double(layout.head_count[std::size_t(rank)]);
  if (variant.form == Form::laga2d) {
    const HeadContextGrid g = laga2d_grid(layout, variant);
    w.pairs = range_pairs(layout, g.queries[std::size_t(rank)], docs);
    heads = double(g.head_count[std::size_t(rank)]);
  } else {
    w.pairs = docs ? docs->causal_pairs() : double(layout.batch) * S * (S + 1) / 2;
  }
  const double dqk = double(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim);
  double dims = 0;
  switch (variant.form) {
    case Form::explicit_form:
    case Form::laga:
    case Form::laga2d:
      dims = dqk + double(cfg.v_head_dim);
      break;
    case Form::absorbed:
      dims = double(cfg.kv_lora_rank + cfg.qk_rope_head_dim) + double(cfg.kv_lora_rank);
      break;
  }
  LAGA_CHECK(dims > 0, "attention_work: no work model for form ", static_cast<int>(variant.form));
  w.flops = 2 * w.pairs * heads * dims;
  return w;
}

double attention_balance(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                         const Documents* docs) {
  double lo = std::numeric_limits<double>::infinity(), hi = 0;
  for (int r = 0; r < layout.ranks; ++r) {
    const double f = attention_work(cfg, layout, variant, r, docs).flops;
    lo = std::min(lo, f), hi = std::max(hi, f);
  }
  if (hi == 0) return 1;
  return lo == 0 ? std::numeric_limits<double>::infinity() : hi / lo;
}

}  // namespace laga
