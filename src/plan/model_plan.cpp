#include "plan/model_plan.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.hpp"
#include "mla/form_registry.hpp"
#include "plan/node_routing.hpp"

namespace laga {

namespace {

// Forward elementwise elements per token of layer l beyond the attention
// block (whose own are in its plan): two RMSNorms (read D, write D each),
// two residual adds (read 2 D, write D each), the SwiGLU activations (read
// 2 w, write w), and per routed copy its gather and its weighted combine
// (read D, write D each). Backward is taken as 2x forward.
double layer_elementwise_elements(const LmConfig& cfg, std::int64_t l) {
  const double D = double(cfg.dim());
  double n = 4 * D + 6 * D;
  if (cfg.is_moe_layer(l)) {
    const MoeConfig& m = *cfg.moe;
    const double k = double(m.num_experts_per_tok);
    n += k * 3 * double(m.moe_intermediate_size) + 3 * double(m.shared_intermediate_size()) +
         k * 4 * D;
  } else {
    n += 3 * double(cfg.hidden());
  }
  return n;
}

// Exponentials per token of layer l beyond the attention block, in one
// forward (`forward`) and one backward: each SwiGLU's silu (swiglu_forward
// and swiglu_backward each evaluate it) over its width, for the dense FFN,
// the shared expert and the routed rows the device runs (per token: the
// busiest owner's, as model_gemm_calls counts them), and the MoE gate's
// sigmoid over the E experts (forward only: route_backward reads the saved
// scores).
struct Exponentials {
  double forward = 0, backward = 0;
};
Exponentials layer_exponentials(const LmConfig& cfg, std::int64_t l, int ep) {
  if (!cfg.is_moe_layer(l)) return {double(cfg.hidden()), double(cfg.hidden())};
  const MoeConfig& m = *cfg.moe;
  const double E = double(m.n_routed_experts);
  const double routed_rows = double(m.num_experts_per_tok) * double(ep) *
                             double(most_experts_per_device(m.n_routed_experts, ep)) / E;
  const double silu =
      routed_rows * double(m.moe_intermediate_size) + double(m.shared_intermediate_size());
  return {silu + E, silu};
}

// The gradient sync of n elements per device over a group of G, on
// `fabric`: one all-reduce, or with ZeRO-1 a reduce-scatter of the
// gradients and an all-gather of the updated parameters (together the
// all-reduce's bytes, when the two are of one size). The ledger's rules
// (comm/communicator.hpp) give the bytes, in fp32 elements scaled to the
// gradients' element (grad_bytes) and the parameters' (param_bytes).
double sync_seconds(std::int64_t n, int G, bool zero1, std::int64_t grad_bytes,
                    std::int64_t param_bytes, const Fabric& fabric) {
  if (G <= 1 || n == 0) return 0;
  const auto scaled = [](WireBytes w, std::int64_t e) {
    return WireBytes{w.sent / 4 * e, w.received / 4 * e};
  };
  if (!zero1)
    return collective_seconds(CollectiveKind::all_reduce, G,
                              scaled(all_reduce_wire_bytes(n, G, 0, DType::f32), grad_bytes),
                              fabric);
  std::vector<std::int64_t> counts(static_cast<size_t>(G));
  for (int j = 0; j < G; ++j) counts[size_t(j)] = all_reduce_chunk(n, G, j);
  return collective_seconds(
             CollectiveKind::reduce_scatter, G,
             scaled(reduce_scatter_wire_bytes(counts.data(), G, 0, DType::f32), grad_bytes),
             fabric) +
         collective_seconds(
             CollectiveKind::all_gather, G,
             scaled(all_gather_wire_bytes(counts[0], counts.data(), G, 0, DType::f32), param_bytes),
             fabric);
}

// The EP all-to-alls of one MoE layer, per micro-batch on the busiest
// rank: seconds forward and backward, bytes sent and of them across nodes.
struct MoeExchange {
  double forward_s = 0, backward_s = 0, bytes = 0, inter_bytes = 0;
};
MoeExchange moe_exchange(const ModelPlanRequest& q, const LmConfig& cfg, std::int64_t N, int ep,
                         const Fabric& ep_fabric) {
  MoeExchange x;
  if (!cfg.moe) return x;
  const MoeConfig& m = *cfg.moe;
  const std::int64_t e = element_bytes(q.block.dtype);
  // FP8 rows carry a 4-byte scale per 128 elements (1x128 tiles).
  const double dispatch_elem = q.fp8 ? 1.0 + 4.0 / 128.0 : double(e);
  const int g = std::min(ep_fabric.ranks_per_node, ep);
  // Each forward's moe_counts first (the owners' row counts).
  const double counts_bytes = moe_counts_bytes(m.n_routed_experts, ep);
  const std::int64_t counts_whole = std::int64_t(counts_bytes);
  const double counts_s =
      collective_seconds(CollectiveKind::all_to_all, ep, {counts_whole, counts_whole}, ep_fabric);
  // One exchange of rows of `elem` bytes each: its seconds, bytes, inter-node bytes.
  const auto one = [&](double elem) -> std::array<double, 3> {
    if (q.node_limit > 0) {
      // The routed count (plan/node_routing.hpp): laga's router on
      // random logits, its rows as a count-only run's ledger has them.
      const NodeExchangeBytes c =
          node_limited_exchange_bytes(m, {ep, g, q.node_limit}, N, double(cfg.dim()) * elem);
      const double inter = c.inter, intra = c.intra;
      // The two links run at once (the report's IB-then-NVLink forwarding,
      // pipelined); each pays a message latency per peer.
      const double s = std::max(
          double(g - 1) * ep_fabric.intra.latency_s + intra / ep_fabric.intra.bytes_per_s,
          double(ep / g - 1) * ep_fabric.inter.latency_s + inter / ep_fabric.inter.bytes_per_s);
      return {s, inter + intra, inter};
    }
    const double b =
        expected_moe_a2a_bytes(N, m.num_experts_per_tok, cfg.dim(), 1, m.n_routed_experts, ep) *
        elem;
    const std::int64_t w = std::int64_t(std::llround(b));
    return {collective_seconds(CollectiveKind::all_to_all, ep, {w, w}, ep_fabric), b,
            b * node_crossing_share(CollectiveKind::all_to_all, ep, g)};
  };
  const auto dispatch = one(dispatch_elem), combine = one(double(e));
  // Forward: counts, dispatch, combine; backward: dmoe_combine (the
  // dispatch's size and element), dmoe_dispatch; recompute repeats the forward.
  const double forward = counts_s + dispatch[0] + combine[0];
  x.forward_s = forward;
  x.backward_s = dispatch[0] + combine[0] + (q.recompute ? forward : 0.0);
  const double passes = q.recompute ? 3.0 : 2.0;
  x.bytes = passes * (dispatch[1] + combine[1]) + (q.recompute ? 2 : 1) * counts_bytes;
  x.inter_bytes = passes * (dispatch[2] + combine[2]);
  return x;
}

// FP8 quantization elements per token of layer l's forward: the input of
// every FP8 GEMM (report section 3.3.2: activations in 1x128 tiles): the
// attention's x (for wq_a and wkv_a, or wq), its q latent, kv latent and the
// heads' output (wo's input); the FFN's x (the MoE's once per token, before
// its dispatch, report section 3.3.4) and each SwiGLU's h (w2's input).
double fp8_quantized_elements(const LmConfig& cfg, std::int64_t l) {
  const MlaConfig& a = cfg.mla;
  double n = double(a.dim + a.q_lora_rank + a.kv_lora_rank + a.n_heads * a.v_head_dim);
  n += double(cfg.dim());
  if (!cfg.is_moe_layer(l)) return n + double(cfg.hidden());
  const MoeConfig& m = *cfg.moe;
  return n + double(m.num_experts_per_tok * m.moe_intermediate_size) +
         double(m.shared_intermediate_size());
}

// One device's plan of the stage `span` (the whole model: one span of
// every layer with the embedding and head) at (S, P, dp, ep), its times for
// every micro-batch of the step and, in `pass`, per micro-batch by pass.
ModelPlan plan_one(const ModelPlanRequest& q, const StageSpan& span, const PlanCase& block,
                   const FormPlan& f, double reference_flops, int dp, int ep,
                   const Fabric& ep_fabric, const Fabric& world_fabric, PassTimes* pass) {
  const LmConfig cfg = stage_config(q.model, span);
  const int P = block.sp;
  const std::int64_t e = element_bytes(q.block.dtype);
  const SpLayout layout =
      SpLayout::even(q.block.batch, block.seq, cfg.mla.n_heads, P, q.block.seq_layout);
  const std::int64_t N = layout.largest_shard_tokens();
  const DeviceProfile& d = q.block.profile.device;
  const double peak = q.block.profile.peak_flops(q.block.dtype);
  // FP8 GEMMs run at the FP8 peak: their bf16 times scaled by the ratio.
  const double fp8_scale = q.fp8 ? peak / q.block.profile.peak_flops_fp8() : 1.0;
  const int head_passes = span.head ? 1 + span.mtp_modules : 0;

  ModelPlan m;
  m.form = f.form;
  m.dp = dp;
  m.ep = ep;
  const int world = P * dp;
  m.block = f;
  // The block's forward + backward: its step less its own gradient
  // all-reduce (the last phase, blocking), which the model's sync replaces.
  // FP8: its projections' GEMMs at the FP8 peak.
  const PhaseTime& sync = f.phases[2];
  const double gemm_saved_f = f.phases[0].compute.gemm_s * (1 - fp8_scale),
               gemm_saved_b = f.phases[1].compute.gemm_s * (1 - fp8_scale);
  double block_s = f.step_s - (sync.compute_s() + sync.comm_s) - gemm_saved_f - gemm_saved_b;
  double block_forward_s = f.phases[0].compute_s() + f.phases[0].comm_s - gemm_saved_f;
  double block_forward_compute = f.phases[0].compute_s() - gemm_saved_f;
  double block_backward_compute = f.phases[1].compute_s() - gemm_saved_b;
  // Replicas that are threads of one host (a profile with shared_cores)
  // share its cores with the SP group: the block plan shared them among its
  // P ranks only (group_step_time, its core_share_s), while all P * dp
  // compute at once, each at cores / (P * dp) of a core. Its compute is
  // stretched to that, less the share it already holds (issue 57; checked
  // against laga train --dp in docs/planning.md, "EP over the data-parallel
  // replicas against a measured step").
  if (const int cores = q.block.profile.shared_cores; cores > 0 && dp > 1 && P * dp > cores) {
    const double compute = block_forward_compute + block_backward_compute;
    const double extra =
        std::max(0.0, compute * (double(P * dp) / double(cores) - 1.0) - f.core_share_s);
    const double extra_forward = compute > 0 ? extra * block_forward_compute / compute : 0.0;
    block_s += extra;
    block_forward_s += extra_forward;
    block_forward_compute += extra_forward;
    block_backward_compute += extra - extra_forward;
  }
  const double passes = q.recompute ? 4.0 : 3.0;  // forward, backward 2x, forward again
  const MoeExchange a2a = moe_exchange(q, cfg, N, ep, ep_fabric);
  double ffn_flops = 0, elementwise_elements = 0, exponentials = 0, quantized = 0;
  double moe_forward_s = 0, moe_backward_s = 0;
  for (std::int64_t l = 0; l < cfg.layers; ++l) {
    m.time.attention += block_s + (q.recompute ? block_forward_s : 0.0);
    ffn_flops += ffn_flops_forward(cfg, l);
    elementwise_elements += layer_elementwise_elements(cfg, l) * passes;  // forward 1x, backward 2x
    const Exponentials x = layer_exponentials(cfg, l, ep);
    exponentials += x.forward * (q.recompute ? 2.0 : 1.0) + x.backward;
    if (q.fp8) quantized += fp8_quantized_elements(cfg, l) * (passes + 1.0);  // fwd 1x, bwd 3x
    if (cfg.is_moe_layer(l)) {
      moe_forward_s += a2a.forward_s, moe_backward_s += a2a.backward_s;
      m.moe_a2a_bytes_per_rank += a2a.bytes;
      m.moe_a2a_inter_node_bytes_per_rank += a2a.inter_bytes;
    }
  }
  m.time.moe_a2a = moe_forward_s + moe_backward_s;
  const ModelGemmCalls gemms =
      model_gemm_calls(cfg, N, ep, q.recompute, head_passes, span.head ? span.mtp_modules : 0);
  m.time.ffn = compute_time(gemms.ffn, q.block.profile, q.block.dtype).gemm_s * fp8_scale;
  m.time.head = compute_time(gemms.head, q.block.profile, q.block.dtype).gemm_s;
  // The embedding's gather and its gradient's scatter (D each), the final
  // norm (4 D forward, 2x backward) and the cross-entropy: read the logits
  // for the loss, read them and write their gradient (3 V), per head.
  const double D = double(cfg.dim()), V = double(cfg.vocab);
  if (span.embedding) elementwise_elements += 2 * D;
  elementwise_elements += double(head_passes) * (12 * D + 3 * V);
  exponentials += double(head_passes) * 2 * V;  // the cross-entropy's softmax, fwd and bwd
  m.time.elementwise = double(N) *
                       (elementwise_elements * double(e) + quantized * (3 + 4.0 / 128)) /
                       d.elementwise_bytes_per_s;
  // Loops that call exp per element run at the profile's exp rate, where it
  // has one (a CPU's: ~5 ns an element, against ~0.6 for their bytes); the
  // bytes above are priced too, though the measured rate includes a loop's
  // own loads and stores (a tenth of its time, counted twice).
  if (d.exp_per_s > 0) m.time.elementwise += double(N) * exponentials / d.exp_per_s;

  // Gradients: the replicated parameters' over every device holding them
  // (P * dp), the routed experts' over the world / ep devices owning the same ones.
  const ModelParamCounts params = stage_param_counts(q.model, span);
  // The owners of one expert are every ep-th device: as many per node as
  // the node holds EP groups.
  Fabric owners = world_fabric;
  owners.ranks_per_node = std::max(1, world_fabric.ranks_per_node / ep);
  const std::int64_t g = gradient_bytes(q.block.dtype, q.block.grad_reduce);
  m.time.grad_sync =
      sync_seconds(params.replicated(), world, q.zero1, g, e, world_fabric) +
      sync_seconds(params.routed_experts_on_device(ep), world / ep, q.zero1, g, e, owners);
  // AdamW, per parameter it updates: read the gradient (g bytes) and
  // master, m, v (12), write master, m, v (12) and, bf16, the bf16 copy (2):
  // 28 (fp32, and bf16 reducing in bf16) or 30 (bf16 with fp32 gradients).
  const double updated = q.zero1
                             ? double(params.total()) / double(world)
                             : double(params.replicated() + params.routed_experts_on_device(ep));
  const double adamw_bytes = double(g) + 24.0 + (q.block.dtype == PlanDType::bf16 ? 2.0 : 0.0);
  m.time.optimizer = updated * adamw_bytes / d.elementwise_bytes_per_s;

  // Ranks that are threads of one host (a profile with shared_cores, as
  // `laga plan --measure` writes) run the layers' balanced work beyond
  // attention all at once: each at cores / ranks of a core when there are
  // more of them (the attention's block plan shares the cores itself,
  // plan/time_model.hpp, group_step_time).
  if (const int cores = q.block.profile.shared_cores; cores > 0 && world > cores)
    for (double* t : {&m.time.ffn, &m.time.head, &m.time.elementwise, &m.time.optimizer})
      *t *= double(world) / double(cores);
  // Per micro-batch by pass: the forward is 1 of `passes` GEMM and
  // elementwise units (recompute's second forward is in the backward), the
  // weight gradients 1 of them (dW: as large as dx); the block's phases.
  if (pass) {
    const double layers = double(cfg.layers);
    const double ffn_unit = m.time.ffn / passes, head_unit = m.time.head / 3.0;
    const double block_forward_comm = block_forward_s - block_forward_compute;
    pass->forward =
        layers * block_forward_compute + ffn_unit + head_unit + m.time.elementwise / passes;
    pass->forward_comm = layers * block_forward_comm + moe_forward_s;
    pass->backward_comm =
        layers * (std::max(0.0, block_s - block_forward_s - block_backward_compute) +
                  (q.recompute ? block_forward_comm : 0.0)) +
        moe_backward_s;
    const double all =
        m.time.attention + m.time.ffn + m.time.head + m.time.elementwise + m.time.moe_a2a;
    pass->backward = all - pass->forward - pass->forward_comm - pass->backward_comm;
    pass->weight_grad = layers * f.phases[1].compute.gemm_s * fp8_scale / 2 + ffn_unit + head_unit;
  }
  // Every micro-batch runs the layers and the head; the sync and AdamW once.
  const double M = double(q.micro_batches);
  for (double* t :
       {&m.time.attention, &m.time.ffn, &m.time.moe_a2a, &m.time.head, &m.time.elementwise})
    *t *= M;
  m.moe_a2a_bytes_per_rank *= M;
  m.moe_a2a_inter_node_bytes_per_rank *= M;
  m.step_s = m.time.total();
  m.tokens_per_s_per_device = M * double(q.block.batch * block.seq) / m.step_s / double(P);
  m.model_flops = M * double(dp) *
                  (double(cfg.layers) * reference_flops +
                   double(q.block.batch * block.seq) *
                       (ffn_flops + double(head_passes) * head_flops_forward(cfg)) * 3.0);
  m.mfu = m.model_flops / (double(P * dp) * peak * m.step_s);
  m.attention_share = m.time.attention / m.step_s;
  m.state = state_bytes(params, q.block.dtype, q.block.grad_reduce, ep, world, q.zero1);
  m.activations = activation_bytes(cfg, N, e, double(f.after_forward_bytes),
                                   double(f.peak_activation_bytes), q.recompute, ep, span.head);
  m.fits = m.memory_bytes() <= d.memory_bytes;
  return m;
}

// The plan of P * dp * pp devices: each stage's devices plan their span
// (plan_one), each pipeline device runs its stage (DualPipe: its own and the
// mirror stage, half the micro-batches each), and the step is the slowest
// device's schedule (plan/pipeline.hpp) plus its gradient sync and AdamW.
ModelPlan plan_pipeline(const ModelPlanRequest& q, int pp, const PlanCase& b, const FormPlan& f,
                        double reference_flops, int dp, int ep, const Fabric& ep_fabric,
                        const Fabric& world_fabric) {
  PipelineChoice choice = q.pipeline;
  choice.stages = pp;
  const std::vector<StageSpan> spans = pipeline_stages(q.model, choice);
  const PipeSchedule sched = choice.schedule;
  const bool dual = sched == PipeSchedule::dualpipe && pp > 1;
  LAGA_CHECK(!dual || pp % 2 == 0, "--schedule dualpipe needs an even --pp (its micro-batches ",
             "enter from both ends); got --pp ", pp);
  const int world = b.sp * dp;
  // A stage's devices are a block of P * dp; its activations go to the
  // device P * dp on, across nodes once a stage fills a node.
  const LinkModel& link = q.block.profile.shared_cores > 0 || world < world_fabric.ranks_per_node
                              ? world_fabric.intra
                              : world_fabric.inter;
  const std::int64_t N =
      SpLayout::even(q.block.batch, b.seq, q.model.mla.n_heads, b.sp, q.block.seq_layout)
          .largest_shard_tokens();
  const double act_bytes = double(N * q.model.dim() * element_bytes(q.block.dtype));
  const double hop_s = pp > 1 ? link.latency_s + act_bytes / link.bytes_per_s : 0.0;
  std::vector<ModelPlan> pieces;
  std::vector<PassTimes> passes;
  for (size_t s = 0; s < spans.size(); ++s) {
    PassTimes t;
    pieces.push_back(
        plan_one(q, spans[s], b, f, reference_flops, dp, ep, ep_fabric, world_fabric, &t));
    if (s + 1 < spans.size()) t.forward_comm += hop_s;  // the activation on
    if (s > 0) t.backward_comm += hop_s;                // its gradient back
    passes.push_back(t);
  }
  ModelPlan m = pieces[0];
  m.pp = pp;
  m.time = {};
  m.moe_a2a_bytes_per_rank = m.moe_a2a_inter_node_bytes_per_rank = 0;
  m.model_flops = 0;
  for (const ModelPlan& p : pieces) m.model_flops += p.model_flops;
  const double M = double(q.micro_batches), peak = q.block.profile.peak_flops(q.block.dtype);
  // laga train's lockstep 1F1B: one step for every device, from every
  // stage's times; a device's bubble is that step less its own passes.
  const bool lockstep = sched == PipeSchedule::one_f_one_b_lockstep && pp > 1;
  const double lockstep_s =
      lockstep ? lockstep_step_s(passes, q.micro_batches, q.block.profile.shared_cores) : 0.0;
  double worst_memory = -1;
  bool all_fit = true;
  for (int dev = 0; dev < pp; ++dev) {
    StagePlan st;
    std::vector<int> own{dev};
    if (dual) own.push_back(pp - 1 - dev);
    const double share = 1.0 / double(own.size());  // of the micro-batches through each stage
    ModelStepTime t;
    double a2a_bytes = 0, a2a_inter = 0, p2p_bytes = 0;
    ActivationBytes per_batch;
    for (int s : own) {
      const ModelPlan& p = pieces[size_t(s)];
      const PassTimes& x = passes[size_t(s)];
      st.spans.push_back(spans[size_t(s)]);
      for (auto [to, from] : {std::pair{&st.pass.forward, x.forward},
                              {&st.pass.backward, x.backward},
                              {&st.pass.weight_grad, x.weight_grad},
                              {&st.pass.forward_comm, x.forward_comm},
                              {&st.pass.backward_comm, x.backward_comm}})
        *to += share * from;
      t.attention += share * p.time.attention, t.ffn += share * p.time.ffn;
      t.moe_a2a += share * p.time.moe_a2a, t.head += share * p.time.head;
      t.elementwise += share * p.time.elementwise;
      t.grad_sync += p.time.grad_sync, t.optimizer += p.time.optimizer;  // both stages' state
      t.p2p += share * M * hop_s * double((s + 1 < pp) + (s > 0));
      p2p_bytes += share * M * act_bytes * double((s + 1 < pp) + (s > 0));
      a2a_bytes += share * p.moe_a2a_bytes_per_rank,
          a2a_inter += share * p.moe_a2a_inter_node_bytes_per_rank;
      // DualPipe's two stages are each held by 2 world devices: ZeRO-1
      // shards their optimizer state over both.
      const StateBytes sb =
          state_bytes(stage_param_counts(q.model, spans[size_t(s)]), q.block.dtype,
                      q.block.grad_reduce, ep, world * int(own.size()), q.zero1);
      st.state.parameters += sb.parameters, st.state.gradients += sb.gradients;
      st.state.optimizer += sb.optimizer;
      per_batch.layers = std::max(per_batch.layers, p.activations.layers);
      per_batch.head = std::max(per_batch.head, p.activations.head);
      per_batch.transient = std::max(per_batch.transient, p.activations.transient);
    }
    if (dual) st.pass.comm_unit_share = choice.comm_unit_share;
    st.in_flight = in_flight_micro_batches(sched, pp, choice.chunks, dev, q.micro_batches);
    st.activations = per_batch;
    st.activations.layers *= st.in_flight;
    t.bubble = lockstep ? std::max(0.0, lockstep_s - M * (st.pass.f() + st.pass.b()))
                        : pipeline_bubble_s(sched, pp, choice.chunks, st.pass);
    if (dual) {
      const PassTimes& x = st.pass;
      t.comm_units = M * (x.forward + x.backward) * x.comm_unit_share / (1 - x.comm_unit_share);
      t.hidden = M * (x.f() + x.b() - x.f_and_b()) + t.comm_units;
    }
    const double step = t.total();
    all_fit = all_fit && st.memory_bytes() <= q.block.profile.device.memory_bytes;
    if (st.memory_bytes() > worst_memory) {
      worst_memory = st.memory_bytes();
      m.state = st.state, m.activations = st.activations;
    }
    if (step > m.step_s) {
      m.step_s = step, m.time = t, m.slowest_stage = dev;
      m.moe_a2a_bytes_per_rank = a2a_bytes, m.moe_a2a_inter_node_bytes_per_rank = a2a_inter;
      m.p2p_bytes_per_rank = p2p_bytes;
    }
    m.stages.push_back(std::move(st));
  }
  m.fits = all_fit;
  m.tokens_per_s_per_device =
      M * double(q.block.batch * b.seq) / m.step_s / double(b.sp) / double(pp);
  m.mfu = m.model_flops / (double(world * pp) * peak * m.step_s);
  m.attention_share = m.time.attention / m.step_s;
  return m;
}

}  // namespace

int expert_parallel_degree(const EpChoice& ep, int sp, int dp, std::int64_t experts) {
  switch (ep.rule) {
    case EpRule::sp:
      return sp;
    case EpRule::max:
      return int(std::gcd(std::int64_t(sp) * dp, experts));
    case EpRule::fixed:
      return ep.degree;
  }
  return sp;
}

ops::OpCounts model_plan_calls(const ModelPlanRequest& q) {
  PlanRequest block = q.block;
  block.cfg = q.model.mla;
  ops::OpCounts all = plan_calls(block);
  for (std::int64_t S : q.block.seqs)
    for (int P : q.block.sps)
      for (int dp : q.dps) {
        const SpLayout layout =
            SpLayout::even(q.block.batch, S, q.model.mla.n_heads, P, q.block.seq_layout);
        const std::int64_t N = layout.largest_shard_tokens();
        const int ep =
            q.model.moe ? expert_parallel_degree(q.ep, P, dp, q.model.moe->n_routed_experts) : 1;
        const ModelGemmCalls m = model_gemm_calls(q.model, N, ep, q.recompute);
        all.add(m.ffn);
        all.add(m.head);
      }
  return all;
}

MinDevices fewest_devices(const std::vector<ModelPlanCase>& cases, std::int64_t S) {
  MinDevices m;
  m.seq = S;
  double best_rate = 0;
  for (const ModelPlanCase& c : cases) {
    if (c.seq != S || c.winner < 0) continue;
    const int devices = c.devices();
    const int best = m.sp * m.dp * m.pp;
    const double rate = c.forms[size_t(c.winner)].tokens_per_s_per_device;
    if (!m.found || devices < best || (devices == best && rate > best_rate)) {
      m.found = true, m.sp = c.sp, m.dp = c.dp, m.pp = c.pp;
      m.form = c.forms[size_t(c.winner)].form;
      best_rate = rate;
    }
  }
  return m;
}

ModelPlanResult make_model_plans(const ModelPlanRequest& q) {
  LAGA_CHECK(!q.dps.empty(), "plan: need at least one --dp");
  LAGA_CHECK(q.micro_batches >= 1, "--micro-batches ", q.micro_batches,
             ": need at least 1 forward + backward per step");
  for (int dp : q.dps) LAGA_CHECK(dp >= 1, "--dp ", dp, ": need at least 1 replica");
  LAGA_CHECK(q.global_batch_tokens >= 0, "--global-batch ", q.global_batch_tokens,
             ": need 0 (none) or a number of tokens");
  LAGA_CHECK(!q.pps.empty(), "plan: need at least one --pp");
  for (int pp : q.pps) LAGA_CHECK(pp >= 1, "--pp ", pp, ": need at least 1 pipeline stage");
  LAGA_CHECK(q.pipeline.stage_layers.empty() || q.pps.size() == 1,
             "--stage-layers gives one pipeline's stages; give one --pp with it");
  q.model.validate();
  if (q.model.moe)
    for (int P : q.block.sps)
      for (int dp : q.dps) {
        const std::int64_t E = q.model.moe->n_routed_experts;
        const int ep = expert_parallel_degree(q.ep, P, dp, E);
        switch (q.ep.rule) {
          case EpRule::sp:
            break;  // P ranks, E / P experts each, the first E % P one more (as laga train)
          case EpRule::max:
            break;  // gcd(P * dp, E) divides both
          case EpRule::fixed:
            LAGA_CHECK((P * dp) % ep == 0, "--ep ", ep, " must divide the ", P * dp,
                       " devices of --sp ", P, " x --dp ", dp,
                       " (each EP group is EP consecutive devices); give --ep a divisor of ",
                       P * dp);
            break;
        }
      }
  // MFU counts the reference form's attention FLOPs: plan it too when it
  // was not asked for (and leave it out of the model plans).
  PlanRequest block = q.block;
  block.cfg = q.model.mla;
  const FormVariant reference = reference_form();
  const bool reference_asked =
      std::find(block.forms.begin(), block.forms.end(), reference) != block.forms.end();
  if (!reference_asked) block.forms.push_back(reference);
  ModelPlanResult r;
  r.blocks = make_plans(block);
  for (const PlanCase& b : r.blocks) {
    double reference_flops = 0;
    for (const FormPlan& f : b.forms)
      if (f.form == reference) reference_flops = f.flops_all_ranks;
    for (int dp : q.dps)
      for (int pp : q.pps) {
        ModelPlanCase c;
        c.seq = b.seq, c.sp = b.sp, c.dp = dp, c.pp = pp;
        // A fixed global batch: this dp's micro-batches (a copy of the
        // request carries them to the plans).
        ModelPlanRequest qd_storage;
        const ModelPlanRequest* qd = &q;
        if (q.global_batch_tokens > 0) {
          const std::int64_t per_step = b.seq * q.block.batch * dp;
          if (q.global_batch_tokens % per_step != 0) continue;
          qd_storage = q;
          qd_storage.micro_batches = q.global_batch_tokens / per_step;
          qd = &qd_storage;
        }
        c.micro_batches = qd->micro_batches;
        const PlanLinks world =
            plan_links(q.block.profile, b.sp * dp, q.block.nodes > 0 ? q.block.nodes * dp : 0,
                       q.block.link_bytes_per_s, q.block.link_latency_s);
        c.nodes = world.nodes * pp;
        const int ep =
            q.model.moe ? expert_parallel_degree(q.ep, b.sp, dp, q.model.moe->n_routed_experts) : 1;
        const Fabric ep_fabric = ep == b.sp
                                     ? b.links.fabric
                                     : plan_links(q.block.profile, ep, 0, q.block.link_bytes_per_s,
                                                  q.block.link_latency_s)
                                           .fabric;
        for (size_t i = 0; i < b.forms.size(); ++i) {
          if (!reference_asked && b.forms[i].form == reference) continue;
          const bool whole = pp == 1 && !q.pipeline.mtp;
          c.forms.push_back(whole ? plan_one(*qd, StageSpan{0, q.model.layers, true, true, 0}, b,
                                             b.forms[i], reference_flops, dp, ep, ep_fabric,
                                             world.fabric, nullptr)
                                  : plan_pipeline(*qd, pp, b, b.forms[i], reference_flops, dp, ep,
                                                  ep_fabric, world.fabric));
        }
        for (size_t i = 0; i < c.forms.size(); ++i)
          if (c.forms[i].fits &&
              (c.winner < 0 || c.forms[i].step_s < c.forms[size_t(c.winner)].step_s))
            c.winner = int(i);
        r.cases.push_back(std::move(c));
      }
  }
  for (std::int64_t S : q.block.seqs) {
    LAGA_CHECK(std::any_of(r.cases.begin(), r.cases.end(),
                           [&](const ModelPlanCase& c) { return c.seq == S; }),
               "--global-batch ", q.global_batch_tokens, " tokens is no whole number of ",
               "micro-batches of S ", S, " x batch ", q.block.batch,
               " tokens at any --dp; give a batch that is a multiple of S x batch x DP");
    r.min_devices.push_back(fewest_devices(r.cases, S));
  }
  return r;
}

}  // namespace laga
