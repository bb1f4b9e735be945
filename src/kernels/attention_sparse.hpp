// Attention restricted to a per-query set of selected keys: DeepSeek Sparse
// Attention's main attention (docs/forms.md, "DeepSeek Sparse Attention
// (DSA)"). The kernel gathers the selected key and value rows of each query
// and never forms an Sq x Sk mask: a query row costs O(K) whatever Sk is (at
// S 32k a row has 2048 of 32k keys).
//
// Layout (row-major, as kernels/attention.hpp):
//   q (B, Sq, Hq, dqk)  k (B, Sk, Hk, dqk)  v (B, Sk, Hk, dv)  o (B, Sq, Hq, dv)
//   idx (B, Sq, K) int32: the key positions query row i attends, each in
//   [0, Sk), or -1 for an empty slot (a row of an early token has fewer than
//   K keys to choose from). Slots may come in any order; a key listed twice
//   would count twice, so the selection never lists one twice (checked by
//   sparse_attention_check_indices).
//   lse (B, Hq, Sq): natural log of the row's sum of exp of its scaled scores.
// Query head h reads key/value head h / (Hq / Hk): Hk = Hq is per-head
// attention (DeepSeek's prefill: K = [k_nope | k_pe] per head), Hk = 1 the
// latent (absorbed) form: keys [c | k_pe] of width C + dr, values c, one
// head shared by every query head -- what a rank attends after all-gathering
// the latent (the field's context-parallel choice for DSA).
//
//   s_ir = scale q_i . k_{idx[i, r]},  p_ir = softmax_r(s_ir),  o_i = sum_r p_ir v_{idx[i, r]}
// over the row's non-empty slots r. A row with no slot has o = 0, lse = 0 and
// passes no gradient (kernels/attention.hpp's convention).
// Backward, D_i = do_i . o_i, dp_ir = do_i . v_{idx[i, r]}:
//   ds_ir = p_ir (dp_ir - D_i), dq_i = scale sum_r ds_ir k_{idx[i, r]},
//   dk_j = scale sum_{(i, r): idx[i, r] = j} ds_ir q_i,  dv_j = sum_{(i, r): idx = j} p_ir do_i
// (the heads that share a key/value head summed).
//
// Sums: every dot product, the softmax's max, sum and lse, o's and dq's
// accumulators and D_i run in double; dk and dv, scattered into by every
// query that selected the key, accumulate in T (the output's type).
//
// bf16 mixed precision (the _bf16 entry points; docs/performance.md, "bf16
// mixed precision"): q, k, v and dO are read as bf16 storage, as the dense
// bf16 flash kernel reads them (kernels/attention_flash_bf16.hpp), and
// everything else is fp32 as there: o and lse are fp32 outputs (backward's
// D_i = dO_i . o_i is taken from the unrounded o), and dq, dk, dv are the
// fp32 sums themselves (fp32 master weights; rounding them would be a
// rounding the caller cannot undo). Each bf16 value is widened exactly and
// goes through the float kernel's arithmetic above -- P and dS are not
// rounded to bf16 (as on the dense kernel's widened path, flash_bf16_isa
// fp32): a gather kernel has no tile product for VDPBF16PS to run, and
// rounding them would only add error. So a bf16 call equals the float call
// on the widened operands bit for bit (tests/kernels/
// test_attention_sparse.cpp holds that), and its error against exact
// attention on the unrounded operands is the bf16 rounding of q, k, v, dO
// alone (unit roundoff 2^-8 per operand) plus the float kernel's.
#pragma once

#include <cstdint>

#include "core/bf16.hpp"
#include "kernels/attention.hpp"

namespace laga {

struct SparseAttnShape {
  // attn.B, Sq, Sk, Hq, Hk, dqk, dv and scale; attn.causal and doc_start are
  // not read (the selection is the mask).
  AttnShape attn{};
  std::int64_t K = 1;  // slots per query row
  // Throws laga::Error naming the bad extent.
  void validate() const;
};

// Throws laga::Error naming the first slot outside [0, Sk) and not -1, or the
// first key a row lists twice (batch row, query row, slot, value).
void sparse_attention_check_indices(const SparseAttnShape& s, const std::int32_t* idx);

// o (B, Sq, Hq, dv), lse (B, Hq, Sq) written.
template <class T>
void sparse_attention_forward(const SparseAttnShape& s, T* o, T* lse, const T* q, const T* k,
                              const T* v, const std::int32_t* idx);
// dq (B, Sq, Hq, dqk), dk (B, Sk, Hk, dqk), dv (B, Sk, Hk, dv) overwritten.
template <class T>
void sparse_attention_backward(const SparseAttnShape& s, T* dq, T* dk, T* dv, const T* dout,
                               const T* q, const T* k, const T* v, const T* o, const T* lse,
                               const std::int32_t* idx);

// The main attention's distribution over each row's slots, summed over the
// query heads and L1-normalised (the lightning indexer's KL target, DeepSeek
// V3.2's report §2.1): p (B, Sq, K), p_ir = (1/Hq) sum_h exp(s^h_ir - lse^h_i)
// for a non-empty slot, 0 for an empty one. lse is the attention's over the
// same slots (each head's row then sums to 1, so p's row sums to 1).
template <class T>
void sparse_attention_head_summed_probs(const SparseAttnShape& s, T* p, const T* q, const T* k,
                                        const T* lse, const std::int32_t* idx);

// bf16 mixed precision (top comment): bf16 q, k, v (and dout), fp32 o, lse
// and gradients, the float kernel's arithmetic on the widened values.
void sparse_attention_forward_bf16(const SparseAttnShape& s, float* o, float* lse, const bf16* q,
                                   const bf16* k, const bf16* v, const std::int32_t* idx);
void sparse_attention_backward_bf16(const SparseAttnShape& s, float* dq, float* dk, float* dv,
                                    const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                                    const float* o, const float* lse, const std::int32_t* idx);
// The head-summed target over the same bf16 q, k as the forward that made
// lse (so each head's row sums to 1 as in fp32).
void sparse_attention_head_summed_probs_bf16(const SparseAttnShape& s, float* p, const bf16* q,
                                             const bf16* k, const float* lse,
                                             const std::int32_t* idx);

}  // namespace laga
