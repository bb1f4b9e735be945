// The model's sums over tokens (ops_token_sums.hpp; docs/invariance.md, "In
// training").
#include "mla/ops_token_sums.hpp"

#include <utility>
#include <vector>

#include "core/error.hpp"
#include "mla/ops_model.hpp"

namespace laga::ops {

TokenShards sequence_shards(const SpLayout& layout) {
  LAGA_CHECK(layout.rank_major_is_sequence(),
             "internal: the canonical sums over tokens need contiguous sequence shards");
  TokenShards t;
  t.B = layout.batch, t.S = layout.seq;
  for (int r = 0; r < layout.ranks; ++r) {
    t.begin.push_back(layout.shard_begin(r));
    t.end.push_back(layout.shard_begin(r) + layout.seq_count[std::size_t(r)]);
  }
  return t;
}

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

template <class T>
void embedding_backward_over_tokens(Tensor<T>& dtable, In<T> dout, const std::int32_t* ids,
                                    const char* label) {
  if (!op_invariant) return embedding_backward(dtable, dout, ids);
  const TokenSumContext& c = token_sums(label);
  const std::int64_t N = dout.rows, V = dtable.dim(0);
  Tensor<T> onehot = Tensor<T>::zeros({N, V}, "embedding one-hot");
  count_elementwise<T>(N, 1);
  if (runs(N * V, {onehot.data(), ids}))
    for (std::int64_t t = 0; t < N; ++t) {
      LAGA_CHECK(ids[t] >= 0 && ids[t] < V, "internal: token id ", ids[t], " outside [0, ", V, ")");
      onehot.data()[t * V + ids[t]] = T(1);
    }
  // fp32 under bf16 as well: the scatter-add adds fp32 rows, unrounded.
  const UsePrecision fp32(Precision::fp32, op_grad_reduce);
  canonical_token_sum<T>(*c.comm, mat(dtable), mat(std::as_const(onehot)), dout, c.shards, label,
                         adds_here(c));
}

template <class T>
double loss_sum_over_tokens(const Tensor<T>& loss, double local, const char* label) {
  if (!op_invariant) return local;
  const TokenSumContext& c = token_sums(label);
  const TokenShards& sh = c.shards;
  const int P = c.comm->size(), r = c.comm->rank();
  std::vector<std::int64_t> counts(std::size_t(P), 0), displs(std::size_t(P), 0);
  std::int64_t total = 0;
  for (int q = 0; q < P; ++q) {
    counts[std::size_t(q)] = sh.local_rows(q), displs[std::size_t(q)] = total;
    total += counts[std::size_t(q)];
  }
  LAGA_CHECK(loss.numel() == counts[std::size_t(r)], "internal: ", loss.numel(),
             " token losses on a rank of ", counts[std::size_t(r)], " tokens");
  Tensor<T> all({total}, "every token's loss", MemCategory::comm_buffers);
  c.comm->all_gather_v(loss.data(), counts[std::size_t(r)], all.data(), counts.data(),
                       displs.data(), label);
  count_elementwise<T>(total, 1);
  if (r != 0 || !runs(total, {all.data()})) return 0.0;
  double sum = 0.0;
  if (canonical_sum_rank_order) {  // the test-only mutation: rank after rank, each in row order
    for (std::int64_t i = 0; i < total; ++i) sum += double(all.data()[i]);
    return sum;
  }
  for (std::int64_t b = 0; b < sh.B; ++b)  // the global order: row b's tokens, rank after rank
    for (int q = 0; q < P; ++q) {
      const std::int64_t L = sh.end[std::size_t(q)] - sh.begin[std::size_t(q)];
      const T* row = all.data() + displs[std::size_t(q)] + b * L;
      for (std::int64_t i = 0; i < L; ++i) sum += double(row[i]);
    }
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
