// The model's sums over tokens as ops that decide for themselves how to sum
// (docs/invariance.md, "In training"): a weight's gradient dW = sum_t dy_t^T
// x_t, an RMSNorm weight's, the embedding's scatter-add, the loss's sum.
// With the invariant mode off (ops::op_invariant) each is this rank's
// partial, as the model always summed it, and the gradient all-reduce (the
// loss's all-reduce) sums the ranks. In the mode each is the canonical sum
// over the global sequence (canonical_sum.hpp: fixed aligned nodes of one
// tree over the global token index, the same bits at every P), added on rank
// 0 only, so that the all-reduce then adds the other ranks' zeros, exactly.
//
// Where the tokens lie is the thread's SumOverTokens scope (set by the
// model's entry points, model/model.cpp, from the run's SpLayout): the
// communicator and every rank's shard of the sequence. The mode without a
// scope is an internal error, named.
#pragma once

#include <cstdint>

#include "comm/communicator.hpp"
#include "mla/canonical_sum.hpp"
#include "mla/layout.hpp"
#include "mla/ops.hpp"

namespace laga::ops {

// The scope's tokens: the sequence's shards (canonical_sum.hpp's
// sequence_shards; contiguous layouts only, which the mode requires).
struct TokenSumContext {
  Communicator* comm = nullptr;
  TokenShards shards;
};
inline thread_local const TokenSumContext* op_token_sums = nullptr;

// While it lives, this thread's model ops sum over the tokens of `layout`
// on `comm` (read only in the invariant mode).
class SumOverTokens {
 public:
  SumOverTokens(Communicator& comm, const SpLayout& layout);
  ~SumOverTokens() { op_token_sums = previous_; }
  SumOverTokens(const SumOverTokens&) = delete;
  SumOverTokens& operator=(const SumOverTokens&) = delete;

 private:
  TokenSumContext context_;
  const TokenSumContext* previous_;
};

// This rank's local token row b L_r + i as its global index g = b S +
// begin_r + i, under the thread's SumOverTokens scope (the mode's order of
// an MoE expert's rows, model/moe.cpp). `what` names the caller if the
// scope is missing.
std::int64_t global_token_index(std::int64_t local_row, const char* what);

// dx (N, in) = dy w (added when accumulate; none when dx is null), and w's
// gradient dw (out, in) += dy^T x over the tokens: this rank's N rows
// (ops::linear_backward), or in the mode the canonical sum over every
// rank's, under `label` (the ledger's, for the pieces' all-gather).
template <class T>
void linear_backward_over_tokens(Mat<T>* dx, bool accumulate, Tensor<T>& dw, In<T> dy, In<T> x,
                                 const Tensor<T>& w, const char* label);
// As above, x a whole tensor which a bf16 run may hold narrowed
// (keep_narrowed): read in place with the mode off, as ops::linear_backward
// reads it; widened first in the mode (the canonical sum reads a matrix).
template <class T>
void linear_backward_over_tokens(Mat<T>* dx, bool accumulate, Tensor<T>& dw, In<T> dy, Tensor<T>& x,
                                 const Tensor<T>& w, const char* label);

// RMSNorm's backward: dx overwritten, the weight's gradient dw (C) += its
// sum over the tokens (this rank's, or in the mode canonical, in fp32 as the
// kernel's own; canonical_rmsnorm_weight_grad).
template <class T>
void rmsnorm_backward_over_tokens(Mat<T> dx, Tensor<T>& dw, In<T> dy, In<T> x, const Tensor<T>& w,
                                  const Tensor<T>& rstd, const char* label);

// The embedding's gradient: dtable (V, D) += dout (N, D) scattered to rows
// ids (N). In the mode every rank's rows and ids are gathered (under
// `label`) and rank 0 adds them in the global token order g = b S + s: each
// table row's sum over the tokens holding its id in one order at every P (a
// scatter-add, like the kernel's, of B S D gathered elements; under the
// test-only canonical_sum_rank_order rank after rank instead).
template <class T>
void embedding_backward_over_tokens(Tensor<T>& dtable, In<T> dout, const std::int32_t* ids,
                                    const char* label);

// The loss's sum over the tokens: loss (N) this rank's per-token losses,
// `local` their sum in row order (ops::cross_entropy's). Mode off: `local`,
// for the caller's all-reduce. In the mode: every rank's losses gathered
// (under `label`) and summed in double in the global token order g = b S +
// s, returned on rank 0, 0 on the others (the caller's all-reduce adds
// them: exact). Under the test-only canonical_sum_rank_order the order is
// rank after rank instead (the mode off's grouping), which a test catches.
template <class T>
double loss_sum_over_tokens(const Tensor<T>& loss, double local, const char* label);

}  // namespace laga::ops
