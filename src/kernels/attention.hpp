// Scaled-dot-product attention over (B, S, H, d) tensors, eager and reference.
//
// Layout (all contiguous, row-major):
//   q (B, Sq, Hq, dqk)   k (B, Sk, Hk, dqk)   v (B, Sk, Hk, dv)   o (B, Sq, Hq, dv)
// Query head h reads key/value head h / (Hq / Hk): Hk = Hq is multi-head
// attention (the explicit and laga forms), Hk = 1 is one key/value set shared
// by every head (the absorbed form's latent attention: keys [c | k_pe] of
// width C + dr, values c of width C).
//
// Query row i of batch row b is token t = i + Sk - Sq of the keys' sequence
// (the mask is aligned at the bottom right, as FlashAttention 2 does, so
// Sq == Sk is the usual lower triangle). It sees the keys
//   [key_begin(b, i), key_end(i)),  key_end(i) = t + 1 (clamped to [0, Sk]),
//   key_begin(b, i) = doc_start[b * Sk + t], or 0 without documents,
// or every key [0, Sk) when not causal:
//   s_ij = scale * q_i . k_j,  masked to -inf outside the row's key range
//   p_ij = softmax_j(s_ij),    o_i = sum_j p_ij v_j
//   lse_i = log(sum_j exp(s_ij))  (natural log, of the SCALED scores)
// Documents (packed sequences): several documents share one row of the batch;
// doc_start gives each token the first token of its document, so a token
// attends causally within its document and to nothing across documents. With
// doc_start null, key_begin is 0: one document per row, today's causal mask.
// A row with every key masked (possible only when Sq > Sk: t < 0) has o_i = 0,
// lse_i = 0 by convention, and passes no gradient: no NaN and no Inf ever leave
// these kernels. With Sq == Sk no row is empty (a token always sees itself).
//
// Backward, with dp_ij = do_i . v_j and D_i = sum_j p_ij dp_ij (= do_i . o_i):
//   ds_ij = p_ij (dp_ij - D_i)
//   dq_i = scale * sum_j ds_ij k_j,  dk_j = scale * sum_i ds_ij q_i,  dv_j = sum_i p_ij do_i
// dk and dv of a shared key/value head sum over the Hq / Hk query heads that
// read it. Every sum (o_i, D_i, dq_i, dk_j, dv_j) runs over the unmasked pairs
// only: a masked pair is left out (selected away), not multiplied by p_ij = 0,
// because 0 * NaN is NaN. So a NaN or inf in the q, k or v row of one token
// reaches exactly the rows that see that token (its document's causal future;
// in backward, through their dq and D, the keys those rows see), in every
// kernel alike, and never another document or an earlier position.
#pragma once

#include <cstdint>

namespace laga {

struct AttnShape {
  std::int64_t B = 1, Sq = 1, Sk = 1, Hq = 1, Hk = 1, dqk = 1, dv = 1;
  double scale = 1.0;
  bool causal = true;
  // (B, Sk) or null: doc_start[b * Sk + t] is the first token of token t's
  // document in batch row b, so doc_start[b * Sk + t] <= t, non-decreasing in
  // t, and == t exactly where a document starts (doc_start[b * Sk] == 0).
  // Needs causal. Not owned; read by every call that takes this shape.
  const std::int64_t* doc_start = nullptr;
  // The invariant mode (docs/invariance.md): the flash kernels' backward sums
  // every dK_j, dV_j over the query blocks as one ascending sum whatever the
  // head count (else, below 8 heads, as two row sets added), so that a head's
  // gradients do not depend on how many heads share its call.
  bool one_row_set = false;

  // Query row i sees keys [key_begin(b, i), key_end(i)) (empty when end is 0).
  std::int64_t key_end(std::int64_t i) const {
    if (!causal) return Sk;
    const std::int64_t e = i + Sk - Sq + 1;
    return e < 0 ? 0 : (e > Sk ? Sk : e);
  }
  std::int64_t key_begin(std::int64_t b, std::int64_t i) const {
    const std::int64_t t = i + Sk - Sq;  // the row's token; < 0: it sees no key
    return doc_start == nullptr || t < 0 ? 0 : doc_start[b * Sk + t];
  }
  // Multiply-adds of q.k and p.v over the unmasked (b, i, j) pairs, times Hq
  // and 2 for FLOPs: what a kernel that skips masked blocks has to do at least.
  double useful_flops_forward() const;
  // Throws laga::Error naming the bad extent, or a doc_start without the
  // causal mask or not of the form above (naming the row and token).
  void validate() const;
};

// Eager: the (B, Hq, Sq, Sk) probability matrix is materialised and saved for
// backward. probs (B, Hq, Sq, Sk) is written by forward and read by backward.
// lse (B, Hq, Sq), when not null, gets each row's log-sum-exp as the flash
// kernel writes it (a ring form merges its steps' partial outputs by it).
template <class T>
void attention_eager_forward(const AttnShape& s, T* o, T* probs, const T* q, const T* k, const T* v,
                             T* lse = nullptr);
// dq (B, Sq, Hq, dqk), dk (B, Sk, Hk, dqk), dv (B, Sk, Hk, dv): overwritten.
// dp_scratch: Sq * Sk elements of scratch for one head's dp at a time.
// delta (B, Hq, Sq), when not null, is D_i given: a call that holds only
// some of a row's keys (one step of a ring form) has probs normalised over
// ALL the row's keys (rescaled by exp(lse_step - lse_row)) and needs D_i =
// do_i . o_i of the row's whole output, which its own keys cannot sum to.
// Null: D_i = sum_j p_ij dp_ij over this call's keys, as above.
template <class T>
void attention_eager_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q,
                              const T* k, const T* v, const T* probs, T* dp_scratch,
                              const T* delta = nullptr);

// Naive loops with double accumulators; lse (B, Hq, Sq) may be null.
template <class T>
void attention_reference_forward(const AttnShape& s, T* o, T* lse, const T* q, const T* k,
                                 const T* v);
template <class T>
void attention_reference_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout,
                                  const T* q, const T* k, const T* v);

}  // namespace laga
