// The op layer's sparse attention (mla/ops.hpp's contract: counting, the
// count-only decision and the kernel the kernel table's, mla/op_table.hpp):
// DeepSeek Sparse Attention's main attention over each query's selected keys
// (kernels/attention_sparse.hpp; docs/forms.md, "DeepSeek Sparse Attention
// (DSA)"), per-head (Hk = Hq) or in latent space (Hk = 1: keys [c | k_pe],
// values c).
//
// Counting: a call counts as the dense, non-causal attention of its Sq
// queries over K keys (AttentionCall with Sk = K, causal false): the FLOPs of
// every slot as if full, which the planner can time by its shape (an early
// row's empty slots are not subtracted).
//
// bf16 mixed precision (a UsePrecision(bf16) scope, T = float;
// docs/performance.md, "bf16 mixed precision"): q, k, v (and dout) are
// rounded to bf16 into one pool tensor per call (made before the count-only
// decision, so that a count-only run registers it too: docs/accounting.md,
// "bf16 operand copies and attention scratch") and the kernel table's bf16
// row runs kernels/attention_sparse.hpp's bf16 kernel on them; o, lse and
// the gradients come back as its fp32 outputs, as the dense bf16 flash
// kernel's do. The head-summed target is taken over the same rounded q, k
// (so each head's row sums to 1 against the bf16 forward's lse).
#pragma once

#include <cstdint>

#include "kernels/attention_sparse.hpp"
#include "mla/ops_attention.hpp"

namespace laga::ops {

// o (B, Sq, Hq, dv), lse (B, Hq, Sq) written; idx (B, Sq, K) is checked
// (sparse_attention_check_indices) before the kernel runs.
template <class T>
void sparse_attention_forward(const SparseAttnShape& s, T* o, T* lse, Src<T> q, Src<T> k, Src<T> v,
                              const std::int32_t* idx);
// dq, dk, dv overwritten.
template <class T>
void sparse_attention_backward(const SparseAttnShape& s, T* dq, T* dk, T* dv, Src<T> dout, Src<T> q,
                               Src<T> k, Src<T> v, Src<T> o, Src<T> lse, const std::int32_t* idx);

// The main attention's head-summed distribution (the indexer's KL target,
// kernels/attention_sparse.hpp), over the operands the forward that made
// lse read: under bf16, q and k rounded as there. Not a kernel-table op:
// it runs the kernel directly (it reads what forward's row read).
template <class T>
void sparse_attention_head_summed_probs(const SparseAttnShape& s, T* p, Src<T> q, Src<T> k,
                                        Src<T> lse, const std::int32_t* idx);

}  // namespace laga::ops
