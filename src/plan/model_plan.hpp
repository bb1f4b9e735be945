// `laga plan --model`: one training step of a whole N-layer model
// (DeepSeek-V3: MLA in every layer, a dense SwiGLU FFN in the first
// first_k_dense_replace layers and the MoE in the rest, embedding, final
// norm, LM head, cross-entropy), planned on a hardware profile from the
// per-block plan the planner already makes (docs/planning.md, "A whole
// DeepSeek-V3 step"). Nothing of the attention is derived here: its time,
// bytes and memory are the block plan's (FormPlan, planner.hpp), scaled by
// depth. What is new is in closed form, each in one function below:
//
//   parameters      model_param_counts: every tensor of LmParams by kind
//   FFN FLOPs       ffn_flops_forward: 2 * 3 * D * width per token per
//                   SwiGLU (w1, w3: D -> width, w2: width -> D), an MoE
//                   layer's gate 2 * D * E and its k routed copies plus the
//                   shared expert; the head 2 * D * V; backward 2x forward
//   EP traffic      expected_moe_a2a_bytes (below)
//   state memory    state_bytes: parameters, gradients, AdamW's fp32
//                   master (bf16 only) + m + v, ZeRO-1 sharded or not
//   activations     activation_bytes: what each layer keeps for backward
//                   (the block's after_forward, the model's norms and
//                   residuals, the FFN's saved tensors), with or without
//                   per-layer recompute
//
// Parallelism: the SP group of P ranks runs every layer's attention in the
// chosen form; expert parallelism is folded onto the same ranks (Megatron's
// MoE parallel folding): by default EP = P and each rank owns E / P experts
// of every MoE layer, the first E % P one more, as laga train places them
// (EpChoice below: EP over every device, or a fixed degree). dp
// data-parallel replicas of that group make P * dp devices. Pipeline
// stages (ModelPlanRequest::pps, plan/pipeline.hpp) put P * dp devices on
// each stage's layers, P * dp * pp in all; without them every device holds
// every layer. No tensor parallelism is modelled.
//
// Time, per device, nothing overlapped (the paper's "temporally separated"
// attention and MoE collectives, modelled so: each term waits for the one
// before): per layer the attention block's predicted forward + backward (its
// own gradient all-reduce left out: the model's gradient sync below
// replaces it), the FFN's GEMM calls (model_gemm_calls: measured shapes
// where the profile has them, else FLOPs at peak x gemm efficiency), the MoE's
// all-to-alls (moe_counts, then the four row exchanges) on the EP group's
// links (collective_seconds, the link model of every other plan), the layer's elementwise bytes at
// the elementwise bandwidth and its exponentials (SwiGLU's silu, the gate's sigmoid) at the
// profile's exp_per_s where it has one (a CPU's; plan/hardware_profile.hpp); the head's FLOPs and
// the cross-entropy's bytes and exponentials; the gradient sync; AdamW's bytes. Every figure but
// the parameter, FLOP and byte counts is a prediction.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "model/model.hpp"
#include "plan/pipeline.hpp"
#include "plan/planner.hpp"

namespace laga {

// The most routed experts one device of an EP group of ep owns: ceil(E / ep).
// laga train's split (ExpertParallel::folded, model/moe.hpp) gives E / ep
// each and the first E % ep devices one more, so ep need not divide E; a
// device owns none where ep > E.
std::int64_t most_experts_per_device(std::int64_t experts, int ep);

// The bytes the busiest rank moves in ONE expert-parallel all-to-all of
// routed token copies (moe_dispatch, moe_combine forward; dmoe_combine,
// dmoe_dispatch backward: each the same size), in expectation under UNIFORM
// routing, every rank holding N_r tokens. A rank owning o of the E experts
// sends its N_r k copies (D elements each) not routed to its own experts
// and receives the other EP - 1 ranks' copies routed to its own:
//
//   sent N_r k (1 - o/E),  received (EP - 1) N_r k o/E   (x D x elem_bytes)
//
// and the combine swaps the two. The result is the larger of them over
// o = floor(E/EP) and ceil(E/EP): at EP | E both are N_r k D elem (1 - 1/EP).
// Real routing is not uniform: a rank whose experts are popular receives
// more; this is the mean, not the max. The one closed form of these bytes:
// the model's EP collectives (same labels) are checked against it.
double expected_moe_a2a_bytes(std::int64_t tokens_per_rank, std::int64_t k, std::int64_t dim,
                              std::int64_t elem_bytes, std::int64_t experts, int ep);

// The most bytes one rank sends in the forward's moe_counts all-to-all,
// which tells each owner how many copies of each of its experts come
// (model/moe.hpp, moe_ep_bytes: 8 bytes, an f64, per expert owned by
// another rank): 8 (E - floor(E / EP)), on a rank owning the fewest. Not
// routing-dependent.
double moe_counts_bytes(std::int64_t experts, int ep);

// A model's parameters by kind, counted from LmConfig (the shapes of
// LmParams::zeros, model.cpp; tests/plan/test_model_plan.cpp checks the sum
// against LmParams::numel).
struct ModelParamCounts {
  std::int64_t attention = 0;       // every layer's MLA block (mla_param_shapes)
  std::int64_t norms = 0;           // attn_norm and ffn_norm of every layer, and the final norm
  std::int64_t dense_ffn = 0;       // w1, w2, w3 of the dense layers: 3 D F each
  std::int64_t gate = 0;            // the MoE layers' gate.weight (E, D) and gate.bias (E)
  std::int64_t shared_experts = 0;  // 3 D (Ns I) per MoE layer
  std::int64_t routed_experts = 0;  // 3 D I E per MoE layer: the only ones sharded (by EP)
  std::int64_t routed_expert_count = 0;  // E (experts, not elements); 0 without MoE
  std::int64_t embedding = 0, head = 0;  // V D each (not tied)
  std::int64_t mtp_projection = 0;       // an MTP module's eh_proj (D, 2 D); 0 without MTP
  // Held by every rank of the SP group (and every replica).
  std::int64_t replicated() const {
    return attention + norms + dense_ffn + gate + shared_experts + embedding + head +
           mtp_projection;
  }
  std::int64_t total() const { return replicated() + routed_experts; }
  // The routed experts' elements on the device owning the most of them at
  // EP ep (most_experts_per_device of every MoE layer's E).
  std::int64_t routed_experts_on_device(int ep) const {
    if (routed_expert_count == 0) return routed_experts;  // no MoE: none
    return routed_experts / routed_expert_count * most_experts_per_device(routed_expert_count, ep);
  }
};
ModelParamCounts model_param_counts(const LmConfig& cfg);
// A pipeline stage's: the layers of stage_config(cfg, span), the embedding,
// final norm and head where the span holds them, and each MTP module's
// layer (in the stage config), its three norms (enorm, hnorm, the shared
// head's) and its eh_proj (its embedding
// and head are the main model's, shared on the same device: the report's
// section 3.2.3).
ModelParamCounts stage_param_counts(const LmConfig& cfg, const StageSpan& span);
// The model a stage runs: cfg with the span's layers (its dense ones first,
// as the model's are) and each MTP module's transformer layer after them.
LmConfig stage_config(const LmConfig& cfg, const StageSpan& span);

// Forward FLOPs per token of layer l's FFN (2 M N K per GEMM): dense
// 2 * 3 * D * F; MoE 2 * D * E (gate) + (k + Ns) * 2 * 3 * D * I. Backward
// is 2x forward (the input and the weight gradient, each a GEMM as large).
double ffn_flops_forward(const LmConfig& cfg, std::int64_t layer);
// The LM head's forward FLOPs per token: 2 * D * V.
double head_flops_forward(const LmConfig& cfg);

// The GEMM calls, by shape, of one forward + backward (+ the forward again
// with recompute) of every layer's FFN and of the head on a device holding
// N tokens, as the model's kernels issue them (model/model.cpp and
// model/moe.cpp through kernels/gemm.hpp's linear_forward and
// linear_backward: y = x W^T; dx (+)= dy W; dW += dy^T x). A routed
// expert's rows are their expectation under uniform routing, N k ep / E
// rounded (each of the E / ep experts a device owns takes its share of
// the ep devices' tokens). Their FLOPs sum to ffn_flops_forward's and
// head_flops_forward's but for that rounding. The time model costs each
// call at its shape's measured time where the profile has it (`laga plan
// --measure --model`) and at peak x gemm efficiency where not.
struct ModelGemmCalls {
  ops::OpCounts ffn, head;
};
// head_passes: the LM head's forward + backward, once per head the device
// runs (0 on a stage without it, 2 with the MTP module's); each MTP module
// adds its eh_proj (N, 2 D) -> (N, D) to the head's calls.
ModelGemmCalls model_gemm_calls(const LmConfig& cfg, std::int64_t N, int ep, bool recompute,
                                int head_passes = 1, int mtp_modules = 0);

// Bytes per device of the training state. What is assumed:
//   bf16 plan: parameters and gradients bf16 (2 + 2 bytes), AdamW an fp32
//              master copy + m + v (12 bytes): 16 bytes per parameter;
//   fp32 plan: parameters and gradients fp32 (4 + 4), m + v (8): 16 bytes,
//              what laga train holds (no master: the parameters are fp32).
// A device holds the replicated parameters and its share of the routed
// experts: the busiest device's, ceil(E / ep) of every MoE layer's E.
// ZeRO-1 shards the optimizer part (master, m, v) over every device holding
// a replica of the parameter: the replicated ones over all `world` devices
// (the SP ranks hold replicas too, as Megatron's distributed optimizer
// shards over the data x context-parallel group), the routed experts over
// the world / ep devices that own the same experts. Parameters and gradients stay
// whole (ZeRO-2/3 would shard them).
struct StateBytes {
  double parameters = 0, gradients = 0, optimizer = 0;
  double total() const { return parameters + gradients + optimizer; }
};
// Parameters in the plan's element, gradients in gradient_bytes(dtype,
// grad_reduce) (fp32 unless a bf16 plan reduces in bf16).
StateBytes state_bytes(const ModelParamCounts& params, PlanDType dtype, GradReduce grad_reduce,
                       int ep, int world, bool zero1);

// What one layer keeps from forward to backward on a rank of N_r = tokens
// tokens, in bytes of elem_bytes (closed form, the tensors of model.cpp's
// LayerSaved): x, n1, h, n2 (N_r, D) and the two norms' rstd (N_r); dense:
// a, b, g (N_r, F); MoE: per routed copy (N_r k of them on the rank under
// uniform routing) the expert output y (D), and per row its experts ran a, b,
// h (I): its own N_r k copies, or with expert parallelism (ep > 1) the
// busiest owner's expected rows N_r k ep ceil(E/ep) / E, with each row's
// input xe (D), which the owner keeps (moe.hpp, MoeSaved::xe); the shared
// expert's a, b, h (N_r, Ns I).
// The attention block's saved tensors are not in it (the block plan has them).
double layer_saved_bytes(const LmConfig& cfg, std::int64_t layer, std::int64_t tokens,
                         std::int64_t elem_bytes, int ep = 1);

// The FFN backward's own working set on a rank (model.cpp, moe.cpp): dense
// dg, da, db (N_r, F); MoE dx (N_r, D) and per routed copy dy, xp, dxp (D)
// and dh, da, db (I).
double ffn_backward_working_bytes(const LmConfig& cfg, std::int64_t layer, std::int64_t tokens,
                                  std::int64_t elem_bytes);

struct ActivationBytes {
  double layers = 0;     // what every layer keeps from forward to backward
  double head = 0;       // final norm's xf, nf, rstd, the logits (N_r, V) and lse (doubles)
  double transient = 0;  // the backward's peak beyond those two (below)
  double total() const { return layers + head + transient; }
};
// The peak activation bytes of the model's forward + backward on a rank,
// as laga train's pool sees them (tests/plan/test_model_plan.cpp checks it
// against predict_train_memory). attn_after_forward: the block's
// after_forward (its saved tensors and its output (N_r, D), which the model
// frees after the residual add); attn_peak: its forward + backward peak.
// Without recompute every layer keeps its saved tensors; with recompute
// each keeps its input x (N_r, D) and the layer in backward is re-run and
// holds everything. The peak is the largest of the head's backward and each
// layer's (model_counts.cpp has the terms).
// The FFN backward's working set is the one without EP (ffn_backward_working_bytes):
// the EP backward's exchange buffers are not modelled.
// head false: a pipeline stage without the head (no logits, no final norm).
ActivationBytes activation_bytes(const LmConfig& cfg, std::int64_t tokens, std::int64_t elem_bytes,
                                 double attn_after_forward, double attn_peak, bool recompute,
                                 int ep = 1, bool head = true);

// The expert-parallel degree: folded onto the SP ranks (EP = P, the
// default); as many devices as share the E experts evenly, the experts
// spread over the data-parallel replicas too (EP = gcd(P * dp, E): every
// device at P * dp <= E for powers of two); or a fixed N dividing E and every
// P * dp (--ep sp|max|N). Each EP group is ep consecutive devices; E / ep
// experts per device.
enum class EpRule { sp, max, fixed };
struct EpChoice {
  EpRule rule = EpRule::sp;
  int degree = 0;  // EpRule::fixed
};
int expert_parallel_degree(const EpChoice& ep, int sp, int dp, std::int64_t experts);

struct ModelPlanRequest {
  PlanRequest block;  // block.cfg is model.mla; seqs, sps, forms, profile, ...
  LmConfig model;
  std::vector<int> dps{1};
  // Pipeline stages to plan, each a case beside the dps (pipeline.stages is
  // set from it per case).
  std::vector<int> pps{1};
  // Gradient accumulation: micro-batches of block.batch sequences per
  // optimizer step, each a forward + backward; the gradient sync and AdamW
  // run once per step. Memory is one micro-batch's.
  std::int64_t micro_batches = 1;
  // A fixed global batch of this many tokens a step over the replicas (the
  // team's batch, plan/plan_search.hpp): each (S, dp) case then runs
  // global_batch_tokens / (S x batch x dp) micro-batches (a dp that leaves
  // no whole number of them, or none, is not planned) in place of
  // micro_batches. 0: micro_batches for every case.
  std::int64_t global_batch_tokens = 0;
  EpChoice ep;
  bool zero1 = false;
  bool recompute = false;
  // Pipeline stages (plan/pipeline.hpp): every (P, dp) case is one stage's
  // devices, P * dp * pipeline.stages in all. stages 1 and no MTP: the
  // whole model on every device, as before.
  PipelineChoice pipeline;
  // FP8 GEMMs (DeepSeek-V3's recipe, report section 3.3): every linear of
  // the layers (the MLA projections and the FFNs) at the profile's FP8 peak x
  // its GEMM efficiency, the head, gate, norms and attention core kept in
  // bf16 as the report keeps them; each FP8 GEMM's inputs quantized per
  // 1x128 tile (activations) in a memory-bound pass, read 2 bytes and write
  // 1 + 4/128 (the scale) per element, forward and, 3x, backward (the
  // output gradient and the transposed copies the weight gradient reads);
  // the EP dispatch and its backward (dmoe_combine) move FP8 rows with their
  // scales, the combine and dmoe_dispatch bf16 (report section 3.3.4).
  bool fp8 = false;
  // DeepSeek-V3's node-limited routing (plan/pipeline.hpp,
  // node_limited_copies): each token's experts on at most node_limit of the
  // EP group's nodes and sent once per node over the inter-node link, then
  // forwarded within it; the inter- and intra-node shares at their own
  // links, concurrently. 0: laga's dispatch (every copy to its owner).
  int node_limit = 0;
};

// Every GEMM and attention call the model plans of `q` cost: the blocks'
// (plan_calls) and each (S, P, dp)'s model_gemm_calls, what `laga plan
// --measure --model` times.
ops::OpCounts model_plan_calls(const ModelPlanRequest& q);

// Seconds of one step (every micro-batch) of the slowest device, by what it does.
struct ModelStepTime {
  double attention = 0;    // the blocks' forward + backward (+ forward again with recompute)
  double ffn = 0;          // the FFN GEMMs: dense, gate, routed and shared experts
  double moe_a2a = 0;      // the EP all-to-alls
  double head = 0;         // the LM head's GEMMs
  double elementwise = 0;  // norms, residuals, SwiGLU, permutes, embedding, cross-entropy (+ exps)
  double grad_sync = 0;    // the gradients over the SP and DP ranks
  double optimizer = 0;    // AdamW's bytes
  double p2p = 0;          // activations and their gradients between pipeline stages
  double bubble = 0;       // the pipeline schedule's warm-up and drain (pipeline_bubble_s)
  double comm_units = 0;   // DualPipe: the compute slowed by the SMs its communication takes
  double hidden = 0;       // communication DualPipe hides under compute (subtracted)
  double total() const {
    return attention + ffn + moe_a2a + head + elementwise + grad_sync + optimizer + p2p + bubble +
           comm_units - hidden;
  }
};

// One pipeline device's share (a stage, or DualPipe's pair of stages).
struct StagePlan {
  std::vector<StageSpan> spans;  // one; DualPipe two (its own and the mirror stage)
  PassTimes pass;                // per micro-batch (DualPipe: the mean of its two stages')
  double in_flight = 0;          // micro-batches of activations held at the peak
  StateBytes state;
  ActivationBytes activations;  // of in_flight micro-batches
  double memory_bytes() const { return state.total() + activations.total(); }
};

struct ModelPlan {
  FormVariant form = Form::laga;
  int dp = 1, ep = 1;
  FormPlan block;  // the one-block plan this is scaled from
  ModelStepTime time;
  double step_s = 0;
  double tokens_per_s_per_device = 0;
  // FLOPs of the step over every device: each layer's attention as the
  // reference form's count-only run counts it (every rank summed: no form's
  // redundant work, flash's backward recompute of q k included), the FFN and
  // head in closed form; the embedding, norms and cross-entropy not counted.
  double model_flops = 0;
  double mfu = 0;                     // model_flops / (devices x peak x step_s)
  double attention_share = 0;         // time.attention / step_s
  double moe_a2a_bytes_per_rank = 0;  // per step, sent, the mean under uniform routing
  // Of those, the bytes over the inter-node link (the EP group's nodes; the
  // rest within a node).
  double moe_a2a_inter_node_bytes_per_rank = 0;
  double p2p_bytes_per_rank = 0;  // per step, sent to the next or previous stage
  int pp = 1;
  std::vector<StagePlan> stages;  // per pipeline device, with --pp or --mtp
  int slowest_stage = 0;          // the device whose step is the plan's
  StateBytes state;
  ActivationBytes activations;
  double memory_bytes() const { return state.total() + activations.total(); }
  bool fits = false;  // memory_bytes() <= the device's memory
};

struct ModelPlanCase {
  std::int64_t seq = 0;
  int sp = 1, dp = 1, pp = 1;
  std::int64_t micro_batches = 1;  // a step's, per replica
  int nodes = 1;                   // of the whole P * dp * pp devices
  int devices() const { return sp * dp * pp; }
  std::vector<ModelPlan> forms;
  int winner = -1;  // the fastest form that fits; -1: none
};

// Per sequence length: the fewest devices (P * dp * pp) among the planned
// grid at which some form fits, and of the fitting plans there the one of
// the most tokens a second a device (not the shortest step: at equal
// devices a case of more replicas steps more tokens).
struct MinDevices {
  std::int64_t seq = 0;
  bool found = false;
  int sp = 0, dp = 0, pp = 1;
  FormVariant form = Form::laga;
};

struct ModelPlanResult {
  std::vector<PlanCase> blocks;         // make_plans(block): one per (S, P)
  std::vector<ModelPlanCase> cases;     // one per (S, P, dp)
  std::vector<MinDevices> min_devices;  // one per S
};

// The fewest-devices pick (MinDevices above) over `cases` at S.
MinDevices fewest_devices(const std::vector<ModelPlanCase>& cases, std::int64_t S);

// Throws laga::Error when the EP degree of some (P, dp) does not divide the
// routed experts (or, fixed, the devices), or a dp is below 1.
ModelPlanResult make_model_plans(const ModelPlanRequest& request);

}  // namespace laga
