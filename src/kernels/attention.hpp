// Scaled-dot-product attention over (B, S, H, d) tensors, eager and reference.
//
// Layout (all contiguous, row-major):
//   q (B, Sq, Hq, dqk)   k (B, Sk, Hk, dqk)   v (B, Sk, Hk, dv)   o (B, Sq, Hq, dv)
// Query head h reads key/value head h / (Hq / Hk): Hk = Hq is multi-head
// attention (the explicit and laga forms), Hk = 1 is one key/value set shared
// by every head (the absorbed form's latent attention: keys [c | k_pe] of
// width C + dr, values c of width C).
//
//   s_ij = scale * q_i . k_j,  masked to -inf where causal and j > i + Sk - Sq
//   p_ij = softmax_j(s_ij),    o_i = sum_j p_ij v_j
//   lse_i = log(sum_j exp(s_ij))  (natural log, of the SCALED scores)
// The causal mask is aligned at the bottom right (as FlashAttention 2 does), so
// Sq == Sk is the usual lower triangle. A row with every key masked (possible
// only when Sq > Sk) has o_i = 0, lse_i = 0 by convention, and passes no
// gradient: no NaN and no Inf ever leave these kernels.
//
// Backward, with dp_ij = do_i . v_j and D_i = sum_j p_ij dp_ij (= do_i . o_i):
//   ds_ij = p_ij (dp_ij - D_i)
//   dq_i = scale * sum_j ds_ij k_j,  dk_j = scale * sum_i ds_ij q_i,  dv_j = sum_i p_ij do_i
// dk and dv of a shared key/value head sum over the Hq / Hk query heads that
// read it.
#pragma once

#include <cstdint>

namespace laga {

struct AttnShape {
  std::int64_t B = 1, Sq = 1, Sk = 1, Hq = 1, Hk = 1, dqk = 1, dv = 1;
  double scale = 1.0;
  bool causal = true;

  // The key range [0, end) visible to query row i (end may be 0).
  std::int64_t key_end(std::int64_t i) const {
    if (!causal) return Sk;
    const std::int64_t e = i + Sk - Sq + 1;
    return e < 0 ? 0 : (e > Sk ? Sk : e);
  }
  // Multiply-adds of q.k and p.v over the unmasked (i, j) pairs, times 2 for
  // FLOPs: what a kernel that skips masked blocks has to do at least.
  double useful_flops_forward() const;
  void validate() const;  // throws laga::Error naming the bad extent
};

// Eager: the (B, Hq, Sq, Sk) probability matrix is materialised and saved for
// backward. probs (B, Hq, Sq, Sk) is written by forward and read by backward.
template <class T>
void attention_eager_forward(const AttnShape& s, T* o, T* probs, const T* q, const T* k,
                             const T* v);
// dq (B, Sq, Hq, dqk), dk (B, Sk, Hk, dqk), dv (B, Sk, Hk, dv): overwritten.
// dp_scratch: Sq * Sk elements of scratch for one head's dp at a time.
template <class T>
void attention_eager_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q,
                              const T* k, const T* v, const T* probs, T* dp_scratch);

// Naive loops with double accumulators; lse (B, Hq, Sq) may be null.
template <class T>
void attention_reference_forward(const AttnShape& s, T* o, T* lse, const T* q, const T* k,
                                 const T* v);
template <class T>
void attention_reference_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout,
                                  const T* q, const T* k, const T* v);

}  // namespace laga
