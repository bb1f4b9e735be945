// DeepSeek's gates (inference/model.py `Gate`; HF `MoEGate`: V3's noaux_tc,
// V2's greedy and group_limited_greedy; MoeConfig names the three) on N
// tokens' logits z = x W_g^T (N, E), and the permutation that groups the
// routed token copies by expert (the order an expert-parallel all_to_all_v
// will send them in).
//
//   s     = sigmoid(z), or softmax(z) over the E experts  (N, E) scores
//   b     = s + bias (noaux_tc), s (V2's gates)           biased: selection only
//   g_q   = sum of the 2 largest b in group q (noaux_tc)  (N, G) groups: E/G experts each
//           the largest b in group q (group_limited_greedy); greedy: no groups
//   keep the topk_group groups of largest g; the other groups' experts are
//   excluded (DeepSeek's -inf fill; see docs/moe.md for HF's 0.0 fill)
//   K     = the k kept experts of largest b               (N, k) expert ids
//   w_j   = c * s_Kj / sum_i s_Ki    (norm_topk_prob)     (N, k) weights from
//   w_j   = c * s_Kj                 (otherwise)          the UNBIASED scores
//
// Tie-break, everywhere (groups and experts): of two equal scores the lower
// index ranks first. K lists each token's experts best first by that order.
//
// Backward: the selection K is piecewise constant in z (its derivative is 0
// almost everywhere), so dz is the derivative of the weights with K held
// fixed; the bias gets none (it is steered by update_expert_bias instead):
//   ds_i = c (dw_i - sum_j dw_j s_Kj / S) / S,  S = sum_j s_Kj   (norm)
//   ds_i = c dw_i                                               (otherwise)
//   dz_i = ds_i s_i (1 - s_i)      for i in K, 0 for every other expert (sigmoid)
//   dz_i = s_i (ds_i - sum_j ds_Kj s_Kj)  for every i, ds_i = 0 off K  (softmax)
#pragma once

#include <cstdint>
#include <vector>

#include "model/moe_config.hpp"

namespace laga {

template <class T>
struct Routing {
  std::int64_t tokens = 0, top_k = 0, experts = 0;
  std::vector<std::int32_t> expert;  // (N, k) selected ids, best biased score first
  std::vector<T> weight;             // (N, k) w
  std::vector<double> score;         // (N, k) s of the selected experts (backward's S and s(1-s))
  std::vector<double> prob;          // (N, E) every s under softmax (its dz is dense), else empty
};

// logits (N, E), bias (E) or null (all zero). Throws laga::Error on a
// non-finite logit or bias (naming the token and expert), and on a non-zero
// bias for a gate that has none (greedy, group_limited_greedy).
template <class T>
Routing<T> route(const MoeConfig& cfg, const T* logits, const T* bias, std::int64_t N);

// dlogits (N, E) from dweight (N, k): zero outside each token's selection.
template <class T>
std::vector<T> route_backward(const MoeConfig& cfg, const Routing<T>& r, const T* dweight);

// The routed copies (token t, slot j) regrouped by expert: expert e's rows
// are [offset[e], offset[e] + count[e]) of the permuted order, its tokens in
// ascending order (a counting sort: stable, deterministic). count is what
// each expert receives, the counts an all_to_all_v sends.
struct Dispatch {
  std::int64_t tokens = 0, top_k = 0, experts = 0;
  std::vector<std::int64_t> count;   // (E)
  std::vector<std::int64_t> offset;  // (E + 1) exclusive prefix sum of count; offset[E] = N k
  std::vector<std::int32_t> token;   // (N k) permuted row -> its token
  std::vector<std::int64_t> row;     // (N k) copy t k + j -> its permuted row (the inverse)

  std::int64_t rows() const { return tokens * top_k; }
};

template <class T>
Dispatch make_dispatch(const Routing<T>& r);

// DeepSeek-V3's auxiliary-loss-free balancing (the paper's §2.1.2): after a
// step, each expert's bias moves by gamma towards balance,
//   bias_e - gamma if expert e got more than the mean load (N k / E),
//   bias_e + gamma if fewer, unchanged if exactly the mean.
// Returns the new bias (E). tokens_per_expert is Dispatch::count summed over
// whatever the step routed (every rank's, under expert parallelism).
// Throws laga::Error when the sizes differ or gamma is negative or not finite.
template <class T>
std::vector<T> update_expert_bias(const std::vector<T>& bias,
                                  const std::vector<std::int64_t>& tokens_per_expert, double gamma);

}  // namespace laga
