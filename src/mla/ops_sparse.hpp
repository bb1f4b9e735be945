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
// row's empty slots are not subtracted). bf16 runs are refused by the rows
// (the kernel has no bf16 path yet).
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

}  // namespace laga::ops
