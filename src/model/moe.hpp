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
// Expert parallelism folded onto the sequence-parallel ranks (docs/moe.md,
// "Expert parallelism"; Megatron-Core's MoE parallel folding): rank j of the
// group owns experts [first[j], first[j+1]) and runs them on every rank's
// copies routed to them. Between the gate and the experts the copies go to
// their owners (all_to_all_v "moe_dispatch", after "moe_counts" tells each
// owner how many rows of each expert to expect), and back after them
// ("moe_combine"); backward sends dy the dispatch's way ("dmoe_combine", the
// adjoint of the combine) and dx home ("dmoe_dispatch"). The gate, the shared
// expert, the combine and the un-permute stay token-local.
//
// Names follow DeepSeek-V3's inference checkpoint, under the layer's prefix
// (layers.N.ffn.): gate.weight (E, D), gate.bias (E), experts.e.w1.weight
// (I, D), experts.e.w2.weight (D, I), experts.e.w3.weight (I, D),
// shared_experts.w1.weight (Ns I, D), .w2 (D, Ns I), .w3 (Ns I, D).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
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

// Where the routed experts run (`laga train --expert-parallel`): every rank
// runs every expert on its own tokens' copies (each holds all experts), or
// the experts are folded onto the sequence-parallel ranks (below).
enum class ExpertPlacement { every_rank, folded };
const char* to_string(ExpertPlacement p);  // "every-rank", "folded"

// Which rank runs which experts (above). The P ranks form P / G groups of G
// consecutive ranks (G = the EP degree, P by default); every group holds
// all E experts, G slots of them: slot s owns first[s+1] - first[s], E / G
// each with the first E % G slots one more (the sequence split's rule), and
// rank j is slot j % G of group j / G. A rank sends its copies to its own
// group's owners only; with G < P each expert has P / G owners, whose
// gradients the gradient all-reduce sums. A slot may own none when G > E.
struct ExpertParallel {
  Communicator* comm = nullptr;
  int group = 1;                     // G: ranks per EP group, the EP degree
  std::vector<std::int64_t> first;   // (G + 1) the first expert of each slot; first[G] = E
  std::vector<std::int64_t> tokens;  // (P) each rank's N: the sizes no routing changes

  // degree 0: G = P, the experts over every rank of comm; else G = degree,
  // which must divide P.
  static ExpertParallel folded(Communicator& comm, std::int64_t experts,
                               std::vector<std::int64_t> tokens_per_rank, int degree = 0);
  int ranks() const { return int(tokens.size()); }
  std::int64_t experts() const { return first.back(); }
  int slot(int j) const { return j % group; }
  bool same_group(int i, int j) const { return i / group == j / group; }
  std::int64_t first_expert(int j) const { return first[size_t(slot(j))]; }
  std::int64_t owned(int j) const { return first[size_t(slot(j) + 1)] - first[size_t(slot(j))]; }
  // The rows rank `owner` receives in a count-only run, where no routing
  // exists: the uniform-routing expectation round(sum_i N_i k owned / E)
  // over the ranks i of its group. A real run receives what the routing
  // sends (docs/moe.md).
  std::int64_t expected_rows(int owner, std::int64_t top_k) const;
  // The tokens of rank j's group: the most rows any expert it owns can take
  // (a token picks an expert once).
  std::int64_t group_tokens(int j) const;
};

// The bytes rank r's expert-parallel MoE layer sends under each label, given
// every rank's Dispatch::count (P x E, row i rank i's): what the ledger
// records, in closed form (docs/accounting.md, "Expert parallelism"); j and
// i run over r's group only.
//   moe_dispatch  sum_{j != r} sum_{e owned by j} count[r][e] D elem
//   moe_combine   sum_{i != r} sum_{e owned by r} count[i][e] D elem
//   moe_counts    sum_{j != r} owned(j) * 8            (the counts, as f64)
// Backward: dmoe_combine sends what moe_dispatch does, dmoe_dispatch what
// moe_combine does.
struct MoeEpBytes {
  std::int64_t dispatch = 0, combine = 0, counts = 0;
};
MoeEpBytes moe_ep_bytes(const ExpertParallel& ep,
                        const std::vector<std::vector<std::int64_t>>& counts, int r, std::int64_t D,
                        std::int64_t elem);

// What backward needs: the routing, the permutation, and each SwiGLU's
// pre-activations and outputs (x itself is backward's argument).
// Without expert parallelism the experts' rows are the rank's own N k copies
// in permuted order (R = N k). With it they are the M rows the rank's own
// experts received from every rank, expert-major (each owned expert's rows,
// by source rank, each source's in its permuted order), and the owner keeps
// those rows' inputs (xe), since x is on the rank they came from.
template <class T>
struct MoeSaved {
  Routing<T> routing;
  Dispatch dispatch;
  Tensor<T> a, b, h;     // (R or M, I) w1 x, w3 x, silu(a) b of each row the rank's experts ran
  Tensor<T> y;           // (N k, D) each own copy's expert output, unweighted (dw needs it)
  Tensor<T> sa, sb, sh;  // (N, Ns I) the shared expert's
  // Expert parallel only:
  std::vector<std::int64_t> recv;  // (P x owned) rows of owned expert e from rank i, [i][e]
  Tensor<T> xe;                    // (M, D) the rows the owned experts ran, expert-major
  // The invariant mode's order of those rows (docs/invariance.md, "In
  // training"): within each owned expert by global token index, row k the
  // expert-major row order[k]; empty outside the mode.
  std::vector<std::int32_t> order;
  // A count-only run's M, the stand-in for the rows no routing sent
  // (ExpertParallel::expected_rows); -1 in a real run, whose M is recv's
  // sum, and without expert parallelism.
  std::int64_t count_only_rows = -1;
};

// bf16 runs hold a layer's expert activations at 2 bytes from forward to
// backward (mla/ops.hpp, keep_narrowed), which changes no bit: a, b, sa, sb
// are GEMMs' fresh outputs and y, xe what bf16 exchanges delivered (bf16
// values already), and backward reads h and sh only as w2's GEMM operand,
// rounded there. widen_kept gives them back in fp32 before moe_backward.
template <class T>
void keep_narrowed(MoeSaved<T>& s);
template <class T>
void widen_kept(MoeSaved<T>& s);

// Under --dtype bf16 a routed expert's GEMMs copy their operands a slice of
// at most this many rows at a time, into one scratch per layer pass sized
// for the slice (mla/ops_bf16.hpp, RowSlicedLinears): its size cannot follow
// the routing, which the count-only memory prediction does not know. 512 rows
// keep the GEMMs at full speed (their K and N are the model's D and the
// expert's I); tests lower it to make the slices run.
inline std::atomic<std::int64_t> moe_bf16_row_slice{512};

template <class T>
struct MoeForward {
  Tensor<T> out;  // (N, D)
  MoeSaved<T> saved;
};

// x (N, D). Throws laga::Error when the parameters' shapes do not match cfg
// and D, or the gate's logits are not finite. ep: the experts spread over
// ep->comm's ranks (every rank of the group calls with the same ep), or null:
// every expert on this rank.
template <class T>
MoeForward<T> moe_forward(const MoeConfig& cfg, const MoeParams<T>& w, const T* x, std::int64_t N,
                          std::int64_t D, const ExpertParallel* ep = nullptr);

// Returns dx (N, D) from dout (N, D). Every weight's gradient is ADDED to
// grads (a weight used by several calls sums its gradients); grads.gate_bias
// is left as it is. Under expert parallelism (the forward's ep) each rank
// adds the gradients of the experts it owns only, from every rank's copies;
// the others' stay as they are, so the sum over ranks of every gradient is
// the single-rank one, as without it.
template <class T>
Tensor<T> moe_backward(const MoeConfig& cfg, const MoeParams<T>& w, const T* x,
                       const MoeSaved<T>& s, const T* dout, MoeParams<T>& grads,
                       const ExpertParallel* ep = nullptr);

}  // namespace laga
