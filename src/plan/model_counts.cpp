// The closed forms of laga plan --model (model_plan.hpp): the EP
// all-to-alls' expected bytes, a model's and a stage's parameters, the FFN's
// and the head's FLOPs and GEMM calls, the optimizer state, and what each
// layer keeps for backward. model_plan.cpp composes them into a step.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/error.hpp"
#include "mla/params.hpp"
#include "plan/model_plan.hpp"

namespace laga {

std::int64_t most_experts_per_device(std::int64_t experts, int ep) {
  LAGA_CHECK(experts >= 1 && ep >= 1, "most_experts_per_device(E ", experts, ", EP ", ep,
             "): need E and EP >= 1");
  return (experts + ep - 1) / ep;
}

double expected_moe_a2a_bytes(std::int64_t tokens_per_rank, std::int64_t k, std::int64_t dim,
                              std::int64_t elem_bytes, std::int64_t experts, int ep) {
  LAGA_CHECK(
      tokens_per_rank >= 0 && k >= 0 && dim >= 0 && elem_bytes >= 1 && experts >= 1 && ep >= 1,
      "expected_moe_a2a_bytes(tokens ", tokens_per_rank, ", k ", k, ", D ", dim, ", elem ",
      elem_bytes, ", E ", experts, ", EP ", ep, "): every size must be >= 0, elem, E and EP >= 1");
  // A rank owning o of the E experts sends the copies not routed to its own
  // (probability 1 - o/E under uniform routing) and receives the other ep - 1
  // ranks' copies routed to its own (o/E of each rank's). The dispatch's
  // busiest rank is the one with the larger of those; the combine's is the
  // same rank, the directions swapped. o is E / ep or one more.
  const double copies = double(tokens_per_rank) * double(k), E = double(experts);
  const double fewest = double(experts / ep), most = double(most_experts_per_device(experts, ep));
  double busiest = 0;
  for (double o : {fewest, most})
    busiest = std::max({busiest, copies * (1.0 - o / E), double(ep - 1) * copies * o / E});
  return busiest * double(dim) * double(elem_bytes);
}

double moe_counts_bytes(std::int64_t experts, int ep) {
  LAGA_CHECK(experts >= 1 && ep >= 1, "moe_counts_bytes(E ", experts, ", EP ", ep,
             "): need E and EP >= 1");
  // Rank r sends 8 bytes per expert owned by another: E - owned(r), the most
  // on a rank owning the fewest.
  return 8.0 * double(experts - experts / ep);
}

ModelParamCounts model_param_counts(const LmConfig& cfg) {
  ModelParamCounts n;
  const std::int64_t D = cfg.dim(), F = cfg.hidden(), V = cfg.vocab;
  std::int64_t mla = 0;
  for (const auto& [name, shape] : mla_param_shapes(cfg.mla)) mla += numel(shape);
  for (std::int64_t l = 0; l < cfg.layers; ++l) {
    n.attention += mla;
    n.norms += 2 * D;  // attn_norm, ffn_norm
    if (cfg.is_moe_layer(l)) {
      const MoeConfig& m = *cfg.moe;
      n.gate += m.n_routed_experts * D + m.n_routed_experts;  // weight (E, D), bias (E)
      n.shared_experts += 3 * D * m.shared_intermediate_size();
      n.routed_experts += 3 * D * m.moe_intermediate_size * m.n_routed_experts;
    } else {
      n.dense_ffn += 3 * D * F;
    }
  }
  n.norms += D;  // the final norm
  if (cfg.moe) n.routed_expert_count = cfg.moe->n_routed_experts;
  n.embedding = V * D;
  n.head = V * D;
  return n;
}

LmConfig stage_config(const LmConfig& cfg, const StageSpan& span) {
  LAGA_CHECK(
      span.first_layer >= 0 && span.layers >= 0 && span.first_layer + span.layers <= cfg.layers,
      "stage_config: layers [", span.first_layer, ", ", span.first_layer + span.layers,
      ") are not of the model's ", cfg.layers);
  LmConfig s = cfg;
  s.layers = span.layers + span.mtp_modules;
  if (s.moe) {
    const std::int64_t dense =
        std::clamp<std::int64_t>(cfg.moe->first_k_dense_replace - span.first_layer, 0, span.layers);
    s.moe->first_k_dense_replace = dense;
  }
  return s;
}

ModelParamCounts stage_param_counts(const LmConfig& cfg, const StageSpan& span) {
  ModelParamCounts n = model_param_counts(stage_config(cfg, span));
  const std::int64_t D = cfg.dim();
  if (!span.embedding) n.embedding = 0;
  if (!span.head) n.head = 0, n.norms -= D;  // the final norm goes with the head
  n.norms += 3 * D * span.mtp_modules;       // each MTP module's enorm, hnorm and head norm
  n.mtp_projection = 2 * D * D * span.mtp_modules;
  return n;
}

double ffn_flops_forward(const LmConfig& cfg, std::int64_t layer) {
  const double D = double(cfg.dim());
  // One SwiGLU of width w on one token: w1, w3 (D -> w) and w2 (w -> D), 2 D w each.
  const auto swiglu = [D](double w) { return 2.0 * 3.0 * D * w; };
  if (!cfg.is_moe_layer(layer)) return swiglu(double(cfg.hidden()));
  const MoeConfig& m = *cfg.moe;
  return 2.0 * D * double(m.n_routed_experts) +  // the gate's logits
         double(m.num_experts_per_tok) * swiglu(double(m.moe_intermediate_size)) +
         swiglu(double(m.shared_intermediate_size()));
}

double head_flops_forward(const LmConfig& cfg) {
  return 2.0 * double(cfg.dim()) * double(cfg.vocab);
}

namespace {

// One linear layer's calls, y (rows, out) = x (rows, in) W^T: its forward
// (`forwards` times) and its backward, dx (accumulated or not) and dW.
void add_linear(ops::OpCounts& c, std::int64_t rows, std::int64_t in, std::int64_t out,
                double forwards, bool accumulate_dx, std::int64_t times = 1) {
  if (rows <= 0 || times <= 0) return;
  c.add_gemm({false, true, rows, out, in, in, in, out, false}, std::int64_t(forwards) * times);
  c.add_gemm({false, false, rows, in, out, out, in, in, accumulate_dx}, times);  // dx = dy W
  c.add_gemm({true, false, out, in, rows, out, in, in, true}, times);            // dW += dy^T x
}

// A SwiGLU of width w on `rows` tokens: w1 and w3 (D -> w; w3's dx adds to
// w1's), w2 (w -> D).
void add_swiglu(ops::OpCounts& c, std::int64_t rows, std::int64_t D, std::int64_t w,
                double forwards, bool accumulate_first_dx, std::int64_t times = 1) {
  add_linear(c, rows, D, w, forwards, accumulate_first_dx, times);
  add_linear(c, rows, D, w, forwards, true, times);
  add_linear(c, rows, w, D, forwards, false, times);
}

}  // namespace

ModelGemmCalls model_gemm_calls(const LmConfig& cfg, std::int64_t N, int ep, bool recompute,
                                int head_passes, int mtp_modules) {
  ModelGemmCalls calls;
  const std::int64_t D = cfg.dim();
  const double forwards = recompute ? 2.0 : 1.0;
  for (std::int64_t l = 0; l < cfg.layers; ++l) {
    if (!cfg.is_moe_layer(l)) {
      add_swiglu(calls.ffn, N, D, cfg.hidden(), forwards, false);
      continue;
    }
    const MoeConfig& m = *cfg.moe;
    const std::int64_t E = m.n_routed_experts;
    add_linear(calls.ffn, N, D, E, forwards, true);  // the gate; its dx adds to the experts'
    if (m.shared_intermediate_size() > 0)
      add_swiglu(calls.ffn, N, D, m.shared_intermediate_size(), forwards, true);
    const std::int64_t rows =
        std::llround(double(N) * double(m.num_experts_per_tok) * double(ep) / double(E));
    add_swiglu(calls.ffn, rows, D, m.moe_intermediate_size, forwards, false,
               most_experts_per_device(E, ep));
  }
  add_linear(calls.head, N, D, cfg.vocab, 1.0, false, head_passes);
  add_linear(calls.head, N, 2 * D, D, forwards, false, mtp_modules);  // MTP's eh_proj
  return calls;
}

StateBytes state_bytes(const ModelParamCounts& params, PlanDType dtype, GradReduce grad_reduce,
                       int ep, int world, bool zero1) {
  LAGA_CHECK(ep >= 1 && world >= ep && world % ep == 0, "state_bytes: EP ", ep, " must divide the ",
             world, " devices");
  const double e = double(element_bytes(dtype));
  // AdamW's own state per parameter: bf16 keeps an fp32 master besides m and
  // v; fp32 updates the parameters themselves.
  const double opt = dtype == PlanDType::bf16 ? 12.0 : 8.0;
  const double replicated = double(params.replicated());
  const double experts = double(params.routed_experts_on_device(ep));  // this device's share
  StateBytes s;
  s.parameters = (replicated + experts) * e;
  s.gradients = (replicated + experts) * double(gradient_bytes(dtype, grad_reduce));
  s.optimizer = zero1 ? opt * (replicated / double(world) + experts / double(world / ep))
                      : opt * (replicated + experts);
  return s;
}

double layer_saved_bytes(const LmConfig& cfg, std::int64_t layer, std::int64_t tokens,
                         std::int64_t elem_bytes, int ep) {
  const double N = double(tokens), D = double(cfg.dim()), e = double(elem_bytes);
  double elements = 4 * N * D + 2 * N;  // x, n1, h, n2; rstd1, rstd2
  if (cfg.is_moe_layer(layer)) {
    const MoeConfig& m = *cfg.moe;
    const double copies = N * double(m.num_experts_per_tok), I = double(m.moe_intermediate_size);
    // The rows the rank's experts ran: its own copies, or under EP the
    // busiest owner's expected rows from every rank, whose inputs (xe) it
    // keeps too (their x is on the rank they came from).
    const double rows = ep > 1 ? double(m.num_experts_per_tok) * N * double(ep) *
                                     double(most_experts_per_device(m.n_routed_experts, ep)) /
                                     double(m.n_routed_experts)
                               : copies;
    elements += copies * D + rows * 3 * I + 3 * N * double(m.shared_intermediate_size());
    if (ep > 1) elements += rows * D;
  } else {
    elements += 3 * N * double(cfg.hidden());  // a, b, g
  }
  return elements * e;
}

double ffn_backward_working_bytes(const LmConfig& cfg, std::int64_t layer, std::int64_t tokens,
                                  std::int64_t elem_bytes) {
  const double N = double(tokens), D = double(cfg.dim()), e = double(elem_bytes);
  if (!cfg.is_moe_layer(layer)) return 3 * N * double(cfg.hidden()) * e;  // dg, da, db (N, F)
  // moe_backward: dx (N, D), and per routed copy dy, its input xp and dxp
  // (D each) and dh, da, db (I each); the shared expert's (N, Ns I) are
  // freed before the routed ones are made.
  const MoeConfig& m = *cfg.moe;
  const double copies = N * double(m.num_experts_per_tok);
  return (N * D + copies * (3 * D + 3 * double(m.moe_intermediate_size))) * e;
}

ActivationBytes activation_bytes(const LmConfig& cfg, std::int64_t tokens, std::int64_t elem_bytes,
                                 double attn_after_forward, double attn_peak, bool recompute,
                                 int ep, bool head) {
  const double N = double(tokens), D = double(cfg.dim()), V = double(cfg.vocab),
               e = double(elem_bytes);
  // The block's output (N, D) is in after_forward but freed after the
  // residual add: the block keeps the rest.
  const double attn_saved = std::max(0.0, attn_after_forward - N * D * e);
  const double attn_extra = std::max(0.0, attn_peak - attn_after_forward);
  ActivationBytes a;
  // xf, nf, rstdf; logits; lse (double)
  const double logits = head ? N * V * e : 0.0;
  a.head = head ? (2 * N * D + N) * e + logits + N * 8.0 : 0.0;
  // The backward's peak is the largest of (model.cpp's backward):
  //   the head's: every layer's kept tensors, the head's, and dn (N, D);
  //     the logits' gradient overwrites the logits;
  //   layer l's: the kept tensors of layers < l, layer l's whole saved (with
  //     recompute: re-run), the head's less the logits (freed), dn, dx, tmp
  //     (N, D) each, and the larger of the block's backward working set and
  //     the FFN's.
  double kept_below = 0, peak = 0;
  for (std::int64_t l = 0; l < cfg.layers; ++l) {
    const double saved = attn_saved + layer_saved_bytes(cfg, l, tokens, elem_bytes, ep);
    const double work =
        std::max(attn_extra, ffn_backward_working_bytes(cfg, l, tokens, elem_bytes));
    peak = std::max(peak, kept_below + saved + a.head - logits + 3 * N * D * e + work);
    kept_below += recompute ? N * D * e : saved;  // recompute: the layer's input x only
  }
  a.layers = kept_below;
  peak = std::max(peak, a.layers + a.head + N * D * e);
  a.transient = peak - a.layers - a.head;
  return a;
}

}  // namespace laga
