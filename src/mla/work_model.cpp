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
  // Rows alike (no documents, or one list shared by every row): one row's
  // pairs times the batch, so that the cost does not grow with --batch.
  const bool alike = !docs || docs->shared();
  const std::vector<std::int64_t> whole{0, lay.seq};
  for (std::int64_t b = 0; b < (alike ? 1 : lay.batch); ++b) {
    const std::vector<std::int64_t>& cu = docs ? docs->cu_seqlens(b) : whole;
    for (const TokenRange& q : ranges)
      for (std::size_t k = 0; k + 1 < cu.size(); ++k) {
        const std::int64_t a = std::max(q.begin, cu[k]), e = std::min(q.end, cu[k + 1]);
        if (a < e) pairs += pairs_in(a, e, cu[k]);
      }
  }
  return alike ? pairs * double(lay.batch) : pairs;
}

}  // namespace

AttentionWork attention_work(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                             int rank, const Documents* docs) {
  LAGA_CHECK(rank >= 0 && rank < layout.ranks, "attention_work: rank ", rank, " of ", layout.ranks);
  AttentionWork w;
  // Where the form attends: its query ranges, over the keys up to each,
  // for its heads (FormSpec::attention).
  const Placement at = attention_placement(layout, variant);
  w.pairs = range_pairs(layout, at.tokens[std::size_t(rank)], docs);
  const double heads = double(at.head_count[std::size_t(rank)]);
  w.flops = 2 * w.pairs * heads * double(form_spec(variant.form).pair_width(cfg));
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
