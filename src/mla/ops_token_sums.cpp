// The model's sums over tokens (ops_token_sums.hpp; docs/invariance.md, "In
// training").
#include "mla/ops_token_sums.hpp"

#include <utility>
#include <vector>

#include "core/error.hpp"
#include "mla/ops_model.hpp"

namespace laga::ops {

SumOverTokens::SumOverTokens(Communicator& comm, const SpLayout& layout)
    : previous_(op_token_sums) {
  context_.comm = &comm;
  // A layout the mode cannot sum over (zigzag) leaves the shards empty: only
  // the mode reads them, and it refuses such a layout before a rank starts.
  if (layout.rank_major_is_sequence()) context_.shards = sequence_shards(layout);
  op_token_sums = &context_;
}

namespace {
// The scope the mode's sums read, named when missing.
const TokenSumContext& token_sums(const char* label) {
  LAGA_CHECK(op_token_sums && op_token_sums->comm && op_token_sums->shards.ranks() > 0,
             "internal: the invariant mode's sum '", label,
             "' over tokens without a SumOverTokens scope on this thread");
  return *op_token_sums;
}
bool adds_here(const TokenSumContext& c) {
  return c.comm->rank() == 0;
}
}  // namespace

std::int64_t global_token_index(std::int64_t local_row, const char* what) {
  const TokenSumContext& c = token_sums(what);
  const int r = c.comm->rank();
  const std::int64_t L = c.shards.end[std::size_t(r)] - c.shards.begin[std::size_t(r)];
  LAGA_CHECK(L > 0 && local_row >= 0 && local_row < c.shards.local_rows(r), "internal: local row ",
             local_row, " of a rank of ", c.shards.local_rows(r), " tokens");
  return (local_row / L) * c.shards.S + c.shards.begin[std::size_t(r)] + local_row % L;
}

template <class T>
void linear_backward_over_tokens(Mat<T>* dx, bool accumulate, Tensor<T>& dw, In<T> dy, In<T> x,
                                 const Tensor<T>& w, const char* label) {
  if (!op_invariant) return linear_backward(dx, accumulate, dw, dy, x, w);
  const TokenSumContext& c = token_sums(label);
  if (dx) gemm(*dx, accumulate ? T(1) : T(0), dy, false, mat(w), false);
  canonical_token_sum(*c.comm, mat(dw), dy, x, c.shards, label, adds_here(c));
}

template <class T>
void linear_backward_over_tokens(Mat<T>* dx, bool accumulate, Tensor<T>& dw, In<T> dy, Tensor<T>& x,
                                 const Tensor<T>& w, const char* label) {
  if (!op_invariant) return linear_backward(dx, accumulate, dw, dy, std::as_const(x), w);
  widen_kept(x);
  linear_backward_over_tokens(dx, accumulate, dw, dy, mat(std::as_const(x)), w, label);
}

template <class T>
void rmsnorm_backward_over_tokens(Mat<T> dx, Tensor<T>& dw, In<T> dy, In<T> x, const Tensor<T>& w,
                                  const Tensor<T>& rstd, const char* label) {
  if (!op_invariant) return rmsnorm_backward(dx, dw, dy, x, w, rstd);
  const TokenSumContext& c = token_sums(label);
  // The kernel's dx; its own (rank-partial) dw goes to a scratch.
  Tensor<T> dw_local = Tensor<T>::zeros(w.shape(), "rmsnorm local grad (unused)");
  rmsnorm_backward(dx, dw_local, dy, x, w, rstd);
  canonical_rmsnorm_weight_grad(*c.comm, dw, dy, x, rstd, c.shards, label, adds_here(c));
}

namespace {
// Every rank's rows gathered: counts and displacements of each rank's
// local rows (times `width` elements a row).
struct Gathered {
  std::vector<std::int64_t> counts, displs;
  std::int64_t total = 0;  // rows
  Gathered(const TokenShards& sh, std::int64_t width) {
    for (int q = 0; q < sh.ranks(); ++q) {
      counts.push_back(sh.local_rows(q) * width), displs.push_back(total * width);
      total += sh.local_rows(q);
    }
  }
};
// f(row in the gathered rows) for every token, in the global order g = b S
// + s (row b's tokens, rank after rank), or under the test-only mutation
// rank after rank, each rank's rows in its order (the mode off's grouping).
template <class F>
void in_global_order(const TokenShards& sh, const Gathered& g, F&& f) {
  if (canonical_sum_rank_order) {
    for (std::int64_t t = 0; t < g.total; ++t) f(t);
    return;
  }
  std::vector<std::int64_t> first(std::size_t(sh.ranks()), 0);  // each rank's first row
  for (int q = 1; q < sh.ranks(); ++q)
    first[std::size_t(q)] = first[std::size_t(q - 1)] + sh.local_rows(q - 1);
  for (std::int64_t b = 0; b < sh.B; ++b)
    for (int q = 0; q < sh.ranks(); ++q) {
      const std::int64_t L = sh.end[std::size_t(q)] - sh.begin[std::size_t(q)];
      for (std::int64_t i = 0; i < L; ++i) f(first[std::size_t(q)] + b * L + i);
    }
}
}  // namespace

template <class T>
void embedding_backward_over_tokens(Tensor<T>& dtable, In<T> dout, const std::int32_t* ids,
                                    const char* label) {
  if (!op_invariant) return embedding_backward(dtable, dout, ids);
  const TokenSumContext& c = token_sums(label);
  const TokenShards& sh = c.shards;
  const int r = c.comm->rank();
  const std::int64_t D = dout.cols, V = dtable.dim(0), n = dout.rows;
  LAGA_CHECK(dout.ld == D && n == sh.local_rows(r) && dtable.dim(1) == D,
             "internal: embedding_backward_over_tokens of (", n, ", ", D, ") rows into ",
             to_string(dtable.shape()), " on a rank of ", sh.local_rows(r), " tokens");
  const Gathered rows(sh, D), tokens(sh, 1);
  Tensor<T> all({rows.total, D}, "every token's embedding gradient", MemCategory::comm_buffers);
  // The ids as doubles (exact for every int32), the collectives' element.
  Tensor<double> mine({n}, "this rank's token ids", MemCategory::comm_buffers);
  Tensor<double> who({tokens.total}, "every token's id", MemCategory::comm_buffers);
  if (runs(n, {mine.data(), ids}))
    for (std::int64_t t = 0; t < n; ++t) mine.data()[t] = double(ids[t]);
  c.comm->all_gather_v(dout.p, n * D, all.data(), rows.counts.data(), rows.displs.data(), label);
  c.comm->all_gather_v(mine.data(), n, who.data(), tokens.counts.data(), tokens.displs.data(),
                       label);
  count_elementwise<T>(rows.total * D, 3);
  if (r != 0 || !runs(rows.total * D, {dtable.data(), all.data(), who.data()})) return;
  in_global_order(sh, tokens, [&](std::int64_t t) {
    const std::int64_t id = std::int64_t(who.data()[t]);
    LAGA_CHECK(id >= 0 && id < V, "internal: token id ", id, " outside [0, ", V, ")");
    T* dst = dtable.data() + id * D;
    const T* src = all.data() + t * D;
    for (std::int64_t j = 0; j < D; ++j) dst[j] = dst[j] + src[j];
  });
}

template <class T>
double loss_sum_over_tokens(const Tensor<T>& loss, double local, const char* label) {
  if (!op_invariant) return local;
  const TokenSumContext& c = token_sums(label);
  const TokenShards& sh = c.shards;
  const int r = c.comm->rank();
  const Gathered tokens(sh, 1);
  LAGA_CHECK(loss.numel() == sh.local_rows(r), "internal: ", loss.numel(),
             " token losses on a rank of ", sh.local_rows(r), " tokens");
  Tensor<T> all({tokens.total}, "every token's loss", MemCategory::comm_buffers);
  c.comm->all_gather_v(loss.data(), loss.numel(), all.data(), tokens.counts.data(),
                       tokens.displs.data(), label);
  count_elementwise<T>(tokens.total, 1);
  if (r != 0 || !runs(tokens.total, {all.data()})) return 0.0;
  double sum = 0.0;
  in_global_order(sh, tokens, [&](std::int64_t t) { sum += double(all.data()[t]); });
  return sum;
}

#define LAGA_INSTANTIATE(T)                                                                       \
  template void linear_backward_over_tokens<T>(Mat<T>*, bool, Tensor<T>&, In<T>, In<T>,           \
                                               const Tensor<T>&, const char*);                    \
  template void linear_backward_over_tokens<T>(Mat<T>*, bool, Tensor<T>&, In<T>, Tensor<T>&,      \
                                               const Tensor<T>&, const char*);                    \
  template void rmsnorm_backward_over_tokens<T>(Mat<T>, Tensor<T>&, In<T>, In<T>,                 \
                                                const Tensor<T>&, const Tensor<T>&, const char*); \
  template void embedding_backward_over_tokens<T>(Tensor<T>&, In<T>, const std::int32_t*,         \
                                                  const char*);                                   \
  template double loss_sum_over_tokens<T>(const Tensor<T>&, double, const char*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::ops
