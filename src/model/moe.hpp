// DeepSeek-V3's MoE FFN (inference/model.py `MoE`, HF `DeepseekV3MoE`) on one
// rank, forward and backward, for N tokens of width D (docs/moe.md):
//
//   z   = x W_g^T                                   (N, E) gate logits
//   K, w = route(z, bias)                           (N, k) ids, weights (moe_routing.hpp)
//   out = sum_j w_j Expert_Kj(x) + Shared(x)        (N, D)
//   Expert_e(x) = w2_e (silu(w1_e x) * w3_e x)      w1, w3 (I, D), w2 (D, I)
//   Shared(x)   = the same with width Ns I          (none when Ns = 0)
//
// The routed copies run grouped by expert (the Dispatch permutation): expert
// e's rows of the permuted order are one GEMM per projection, the layout an
// expert-parallel all_to_all_v will deliver them in. The combine adds each
// token's k copies in slot order, so the result does not depend on threads.
//
// Backward is forward reversed: the shared expert as a dense SwiGLU; the
// combine gives dw_j = <dout, y_Kj> and dy_Kj = w_j dout; each expert's
// SwiGLU backward on its rows; the permutation reversed adds each token's
// copies back into dx; dw goes through route_backward to dz and the gate's
// linear. The bias gets no gradient (update_expert_bias steers it).
//
// Names follow DeepSeek-V3's inference checkpoint, under the layer's prefix
// (layers.N.ffn.): gate.weight (E, D), gate.bias (E), experts.e.w1.weight
// (I, D), experts.e.w2.weight (D, I), experts.e.w3.weight (I, D),
// shared_experts.w1.weight (Ns I, D), .w2 (D, Ns I), .w3 (Ns I, D).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "model/moe_config.hpp"
#include "model/moe_routing.hpp"

namespace laga {

// One SwiGLU: w1, w3 (F, D), w2 (D, F).
template <class T>
struct ExpertParams {
  Tensor<T> w1, w2, w3;
};

template <class T>
struct MoeParams {
  Tensor<T> gate;       // (E, D)
  Tensor<T> gate_bias;  // (E) e_score_correction_bias: selects, never weights; no gradient
  std::vector<ExpertParams<T>> experts;  // E of width I
  ExpertParams<T> shared;                // width Ns I; undefined tensors when Ns = 0

  static MoeParams zeros(const MoeConfig& cfg, std::int64_t dim, MemCategory cat);
  // Every tensor with its name (above), in a fixed order: gate.weight,
  // gate.bias, experts in order, shared_experts. with_bias false skips
  // gate.bias, which no optimiser step may touch (its gradient slot is 0).
  void for_each(const std::function<void(const std::string&, Tensor<T>&)>& fn,
                bool with_bias = true);
};

// What backward needs: the routing, the permutation, and each SwiGLU's
// pre-activations and outputs (x itself is backward's argument).
template <class T>
struct MoeSaved {
  Routing<T> routing;
  Dispatch dispatch;
  Tensor<T> a, b, h;     // (N k, I) w1 x, w3 x, silu(a) b of each copy, in permuted order
  Tensor<T> y;           // (N k, D) each copy's expert output, unweighted (dw needs it)
  Tensor<T> sa, sb, sh;  // (N, Ns I) the shared expert's
};

template <class T>
struct MoeForward {
  Tensor<T> out;  // (N, D)
  MoeSaved<T> saved;
};

// x (N, D). Throws laga::Error when the parameters' shapes do not match cfg
// and D, or the gate's logits are not finite.
template <class T>
MoeForward<T> moe_forward(const MoeConfig& cfg, const MoeParams<T>& w, const T* x, std::int64_t N,
                          std::int64_t D);

// Returns dx (N, D) from dout (N, D). Every weight's gradient is ADDED to
// grads (a weight used by several calls sums its gradients); grads.gate_bias
// is left as it is.
template <class T>
Tensor<T> moe_backward(const MoeConfig& cfg, const MoeParams<T>& w, const T* x,
                       const MoeSaved<T>& s, const T* dout, MoeParams<T>& grads);

}  // namespace laga
