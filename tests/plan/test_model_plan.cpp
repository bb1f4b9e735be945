// The whole-model plan's closed forms (plan/model_plan.hpp) against what
// they describe: the parameter count against the model's own tensors
// (LmParams, the ground truth, at the tiny MoE config and at DeepSeek-V3's
// full size under a count-only pool), laga train's state against the state
// formula, FLOPs, EP bytes and activations against hand counts, and the
// depth-1 plan against the block plan it is scaled from.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "comm/dry_run_comm.hpp"
#include "comm/local_comm.hpp"
#include "common/error_of.hpp"
#include "core/memory_pool.hpp"
#include "model/train.hpp"
#include "plan/model_plan.hpp"

namespace laga {
namespace {

LmConfig moe_tiny() {  // docs/assets/moe_tiny.json: 3 layers, the first dense
  const char* src = std::getenv("LAGA_SOURCE_DIR");
  return LmConfig::from_json_file(std::string(src ? src : ".") + "/docs/assets/moe_tiny.json");
}

std::int64_t model_numel(const LmConfig& cfg, const std::string& containing = "") {
  MemoryPool pool;
  pool.set_count_only(true);  // shapes only: DeepSeek-V3's 671B elements allocate nothing
  PoolScope scope(pool);
  const LmParams<float> p = LmParams<float>::zeros(cfg, MemCategory::parameters);
  std::int64_t n = 0;
  p.for_each([&](const std::string& name, const Tensor<float>& t) {
    if (name.find(containing) != std::string::npos) n += t.numel();
  });
  return n;
}

// The count is the model's: every tensor LmParams holds, the routed experts
// apart (the only tensors EP shards; forgetting the shared expert, the gate's
// bias or a norm breaks the total).
TEST(ModelPlan, ParameterCountIsTheModels) {
  for (const LmConfig& cfg : {moe_tiny(), LmConfig::preset("deepseek-v3")}) {
    const ModelParamCounts n = model_param_counts(cfg);
    EXPECT_EQ(n.total(), model_numel(cfg)) << cfg.summary();
    EXPECT_EQ(n.routed_experts, model_numel(cfg, ".ffn.experts.")) << cfg.summary();
    EXPECT_EQ(n.shared_experts, model_numel(cfg, ".ffn.shared_experts.")) << cfg.summary();
    EXPECT_EQ(n.attention, model_numel(cfg, ".attn.")) << cfg.summary();
  }
  // DeepSeek-V3's published size: 671B parameters, 37B activated per token
  // (the report's Table 1, the MTP module not counted).
  const ModelParamCounts v3 = model_param_counts(LmConfig::preset("deepseek-v3"));
  EXPECT_NEAR(double(v3.total()) / 1e9, 671.0, 0.5);
  const LmConfig c = LmConfig::preset("deepseek-v3");
  const double per_expert = 3.0 * 7168 * 2048;
  const double activated = double(v3.total()) - 58 * (256 - 8) * per_expert;
  EXPECT_NEAR(activated / 1e9, 37.5, 0.5);
  EXPECT_EQ(c.layers, 61);
  EXPECT_EQ(c.moe->first_k_dense_replace, 3);
}

// FLOPs per token at the tiny dims, by hand: D 64, F 192, E 8, k 2, I 32, Ns 1, V 256.
TEST(ModelPlan, FfnAndHeadFlopsByHand) {
  const LmConfig cfg = moe_tiny();
  EXPECT_EQ(ffn_flops_forward(cfg, 0), 2.0 * 3 * 64 * 192);  // dense: 73728
  // gate 2 D E = 1024; two routed copies 2 * 12288; the shared expert 12288.
  EXPECT_EQ(ffn_flops_forward(cfg, 1), 1024.0 + 2 * 12288 + 12288);
  EXPECT_EQ(ffn_flops_forward(cfg, 2), 37888.0);
  EXPECT_EQ(head_flops_forward(cfg), 2.0 * 64 * 256);
}

// The EP all-to-all's bytes against a count of copies: token copy c of
// every rank routed to expert c mod E (exactly uniform), the experts placed
// as laga train places them (ExpertParallel::folded: E / EP each, the first
// E % EP one more); each rank sends its copies to another rank's experts
// and receives the others' copies to its own. The busiest rank's larger
// direction is the plan's, at EP dividing E and not (3, 5, 6, 12 > E).
TEST(ModelPlan, MoeAllToAllBytesAreTheCopiesThatLeave) {
  const std::int64_t E = 8, k = 2, D = 64, tokens = 12;  // 24 copies: 3 per expert
  for (int ep : {1, 2, 3, 4, 5, 6, 8, 12}) {
    DryRunCommunicator group(0, ep);  // only its size: the placement's ranks
    const ExpertParallel owners =
        ExpertParallel::folded(group, E, std::vector<std::int64_t>(size_t(ep), tokens));
    std::int64_t busiest = 0;
    for (int r = 0; r < ep; ++r) {
      std::int64_t sent = 0, received = 0;
      for (int i = 0; i < ep; ++i)
        for (std::int64_t c = 0; c < tokens * k; ++c) {
          const std::int64_t e = c % E;
          const bool to_r = owners.first[size_t(r)] <= e && e < owners.first[size_t(r + 1)];
          if (i == r && !to_r) ++sent;
          if (i != r && to_r) ++received;
        }
      busiest = std::max({busiest, sent, received});
    }
    for (std::int64_t elem : {2, 4})
      EXPECT_EQ(expected_moe_a2a_bytes(tokens, k, D, elem, E, ep), double(busiest * D * elem))
          << "EP " << ep;
  }
  EXPECT_EQ(expected_moe_a2a_bytes(10, 2, 64, 2, 8, 4), 1920.0);  // 10 * 2 * 64 * 2 * 3/4
  EXPECT_NE(test::error_of([] { expected_moe_a2a_bytes(10, 2, 64, 2, 8, 0); }), "");
}

// moe_counts: 8 bytes per expert another rank owns, the most on the rank
// owning the fewest (EP 3 over 8: 2 of them); every expert elsewhere on a
// rank owning none (EP 12 > E 8).
TEST(ModelPlan, MoeCountsBytesAtAnyEp) {
  EXPECT_EQ(moe_counts_bytes(8, 1), 0.0);
  EXPECT_EQ(moe_counts_bytes(8, 2), 32.0);
  EXPECT_EQ(moe_counts_bytes(8, 3), 48.0);
  EXPECT_EQ(moe_counts_bytes(8, 12), 64.0);
  EXPECT_EQ(most_experts_per_device(8, 3), 3);
  EXPECT_EQ(most_experts_per_device(8, 12), 1);
}

// laga train's own state (fp32 parameters, gradients, m, v: the count-only
// run of its code) is the fp32 formula at one rank without ZeRO.
TEST(ModelPlan, Fp32StateIsLagaTrainsState) {
  TrainOptions o;
  o.model = moe_tiny();
  o.sp = 1, o.seq = 16, o.batch = 1;
  const std::vector<TrainMemory> m = predict_train_memory(o, StagingRule::in_process);
  const StateBytes s =
      state_bytes(model_param_counts(o.model), PlanDType::fp32, GradReduce::fp32, 1, 1, false);
  EXPECT_EQ(s.total(), double(m[0].state));
}

// bf16 reducing in bf16: 2 + 2 bytes of parameters and gradients and 12 of
// AdamW per parameter; EP divides the routed experts only, ZeRO-1 the
// optimizer only, the replicated part over EP x DP and the experts over DP.
TEST(ModelPlan, StateShardsWhatItShould) {
  ModelParamCounts n;
  n.attention = 1000, n.embedding = 200, n.routed_experts = 8000;  // replicated 1200
  n.routed_expert_count = 8;                                       // of 1000 elements each
  const auto state_bytes = [&n](PlanDType t, int ep, int world, bool zero1) {
    return laga::state_bytes(n, t, t == PlanDType::bf16 ? GradReduce::bf16 : GradReduce::fp32, ep,
                             world, zero1);
  };
  const StateBytes whole = state_bytes(PlanDType::bf16, 1, 1, false);
  EXPECT_EQ(whole.parameters, 2.0 * 9200);
  EXPECT_EQ(whole.gradients, 2.0 * 9200);
  EXPECT_EQ(whole.optimizer, 12.0 * 9200);
  const StateBytes ep4 = state_bytes(PlanDType::bf16, 4, 8, false);
  EXPECT_EQ(ep4.parameters, 2.0 * (1200 + 2000));
  EXPECT_EQ(ep4.optimizer, 12.0 * (1200 + 2000));  // no ZeRO: DP changes nothing
  const StateBytes z = state_bytes(PlanDType::bf16, 4, 8, true);
  EXPECT_EQ(z.parameters, ep4.parameters);
  EXPECT_EQ(z.gradients, ep4.gradients);
  EXPECT_EQ(z.optimizer, 12.0 * (1200.0 / 8 + 2000.0 / 2));
  EXPECT_EQ(state_bytes(PlanDType::fp32, 4, 8, true).optimizer, 8.0 * (1200.0 / 8 + 1000));
  // EP over every device: each expert has one owner, ZeRO has nothing to shard of it.
  const StateBytes world = state_bytes(PlanDType::bf16, 8, 8, true);
  EXPECT_EQ(world.parameters, 2.0 * (1200 + 1000));
  EXPECT_EQ(world.optimizer, 12.0 * (1200.0 / 8 + 1000));
  EXPECT_EQ(expert_parallel_degree({EpRule::sp, 0}, 4, 2, 256), 4);
  EXPECT_EQ(expert_parallel_degree({EpRule::max, 0}, 4, 2, 256), 8);
  EXPECT_EQ(expert_parallel_degree({EpRule::max, 0}, 256, 4, 256), 256);
  EXPECT_EQ(expert_parallel_degree({EpRule::max, 0}, 2, 3, 8), 2);
  EXPECT_EQ(expert_parallel_degree({EpRule::fixed, 2}, 4, 2, 256), 2);
}

// The saved tensors and the peak by hand at the tiny dims, N 16 tokens, 4
// bytes: the layers' own and the block's (its after_forward less its
// output); the peak at the last (MoE) layer's backward; with recompute each
// layer's input, the peak at the last layer re-run.
TEST(ModelPlan, ActivationsByHand) {
  const LmConfig cfg = moe_tiny();
  const std::int64_t N = 16, e = 4;
  const double dense = (4 * 16 * 64 + 2 * 16 + 3 * 16 * 192) * 4.0;                    // 53376
  const double moe = (4 * 16 * 64 + 2 * 16 + 32 * (3 * 32 + 64) + 3 * 16 * 32) * 4.0;  // 43136
  EXPECT_EQ(layer_saved_bytes(cfg, 0, N, e), dense);
  EXPECT_EQ(layer_saved_bytes(cfg, 1, N, e), moe);
  EXPECT_EQ(layer_saved_bytes(cfg, 1, N, e, 2), moe + 32 * 64 * 4.0);  // EP: the owner's xe
  EXPECT_EQ(layer_saved_bytes(cfg, 0, N, e, 2), dense);
  EXPECT_EQ(ffn_backward_working_bytes(cfg, 0, N, e), 3 * 16 * 192 * 4.0);
  EXPECT_EQ(ffn_backward_working_bytes(cfg, 1, N, e), (16 * 64 + 32 * (3 * 64 + 3 * 32)) * 4.0);
  const double out = 16 * 64 * 4.0, attn_saved = 1000;
  const double after = attn_saved + out, peak = after + 500;
  const ActivationBytes all = activation_bytes(cfg, N, e, after, peak, false);
  EXPECT_EQ(all.layers, 3 * attn_saved + dense + 2 * moe);                    // 142648
  EXPECT_EQ(all.head, (2 * 16 * 64 + 16) * 4.0 + 16 * 256 * 4.0 + 16 * 8.0);  // 24768
  // Layer 2's backward: layers 0, 1 and 2 saved, the head less its logits,
  // dn dx tmp, the MoE backward's 40960.
  EXPECT_EQ(all.total(), 142648 + 24768 - 16384 + 3 * 4096 + 40960.0);
  const ActivationBytes re = activation_bytes(cfg, N, e, after, peak, true);
  EXPECT_EQ(re.layers, 3 * out);
  EXPECT_EQ(re.total(), 2 * out + attn_saved + moe + 24768 - 16384 + 3 * 4096 + 40960.0);
}

// The activation peak is laga train's: its count-only run of one step
// (predict_train_memory: the pool's step peak less the state) at P 1 and 2
// (rank 0; at P 2 the large vocabulary left out, below), fp32,
// for the tiny MoE model, its dense twin and a large vocabulary (where the
// head's backward is the peak), explicit and laga.
TEST(ModelPlan, ActivationPeakIsLagaTrainsPeak) {
  LmConfig dense = moe_tiny(), wide = moe_tiny();
  dense.moe.reset();
  dense.bias_update_speed = 0;
  wide.vocab = 4096;
  for (const LmConfig& cfg : {moe_tiny(), dense, wide})
    for (Form form : {Form::explicit_form, Form::laga})
      for (int P : {1, 2}) {
        // At P 2 the large vocabulary's flattened gradient all-reduce buffer
        // (laga train's comm_buffers copy of every gradient, which a trainer
        // reducing in its gradient buffer does not hold) sets laga train's peak.
        if (P == 2 && cfg.vocab > 256) continue;
        TrainOptions o;
        o.model = cfg;
        o.sp = P, o.seq = 256, o.batch = 1;
        o.variant = form;
        o.attention = AttentionKind::flash;
        const TrainMemory m = predict_train_memory(o, StagingRule::in_process)[0];
        ModelPlanRequest q;
        q.model = cfg;
        q.block.cfg = cfg.mla;
        q.block.seqs = {256};
        q.block.sps = {P};
        q.ep = {EpRule::fixed, 1};  // laga train's experts run where their tokens are
        q.block.forms = {form};
        q.block.attention = AttentionKind::flash;
        q.block.dtype = PlanDType::fp32;
        q.block.profile = load_profile("h100");
        const ModelPlan p = make_model_plans(q).cases[0].forms[0];
        EXPECT_EQ(p.activations.total(), double(m.step_peak - m.state))
            << cfg.summary() << " " << to_string(FormVariant(form)) << " P " << P;
        // Every rank of laga train holds every expert: the plan's state at EP 1.
        EXPECT_EQ(p.state.total(), double(m.state)) << cfg.summary() << " P " << P;
      }
}

// At EP > 1 too (issue 54: the test above runs laga train at EP 1 only, so
// a plan that took EP 1 inside -- 15.33 GB for 18.74 GB at DeepSeek-V3 S
// 4096 P 8, and another "fits" -- passed): a real laga train run of the
// tiny MoE model at P 2 with its 8 experts folded over both ranks (EP 2:
// each owner also keeps the rows both ranks routed to its experts, and
// their outputs, beside its own copies), its pools' measured peak less the
// state, against the plan at EP 2. The real rows follow the routing, which
// the plan takes at its uniform expectation: they agree within 2% of the
// peak at S 1024 (0.8% here), where the plan at EP 1 is 4.4% below it.
TEST(ModelPlan, ActivationPeakAtEpTwoIsAMeasuredLagaTrainPeak) {
  const std::int64_t SEQ = 1024;
  const LmConfig cfg = moe_tiny();
  for (Form form : {Form::explicit_form, Form::laga}) {
    TrainOptions o;
    o.model = cfg;
    o.sp = 2, o.seq = SEQ, o.batch = 1, o.steps = 1, o.seed = 3;
    o.variant = form;
    o.attention = AttentionKind::flash;
    o.experts = ExpertPlacement::folded;
    o.expert_degree = 2;
    std::vector<MemoryPool> pools(2);
    LocalRunOptions run;
    run.pools = &pools;
    run_local_ranks(
        2, [&](Communicator& comm) { train_rank(comm, o, nullptr); }, run);
    double measured = 0;
    for (const MemoryPool& pool : pools) {
      const std::int64_t state = pool.peak(MemCategory::parameters) +
                                 pool.peak(MemCategory::optimizer) +
                                 pool.peak(MemCategory::gradients);
      measured = std::max(measured, double(pool.peak_total() - state));
    }
    ModelPlanRequest q;
    q.model = cfg;
    q.block.cfg = cfg.mla;
    q.block.seqs = {SEQ};
    q.block.sps = {2};
    q.ep = {EpRule::fixed, 2};
    q.block.forms = {form};
    q.block.attention = AttentionKind::flash;
    q.block.dtype = PlanDType::fp32;
    q.block.profile = load_profile("h100");
    const ModelPlan p = make_model_plans(q).cases[0].forms[0];
    ASSERT_EQ(p.ep, 2);
    const double planned = p.activations.total();
    EXPECT_NEAR(planned, measured, 0.02 * measured)
        << to_string(FormVariant(form)) << ": planned " << planned << ", measured " << measured;
    // What the test tells apart: the plan at EP 1 (the owner's rows left
    // out) lies outside the tolerance (4.4% below at this size).
    q.ep = {EpRule::fixed, 1};
    const double at_ep1 = make_model_plans(q).cases[0].forms[0].activations.total();
    EXPECT_GT(std::abs(at_ep1 - measured), 0.02 * measured)
        << to_string(FormVariant(form)) << ": EP 1 " << at_ep1 << ", measured " << measured;
  }
}

ModelPlanRequest request(const LmConfig& cfg, std::vector<int> sps) {
  ModelPlanRequest q;
  q.model = cfg;
  q.block.cfg = cfg.mla;
  q.block.seqs = {64};
  q.block.sps = std::move(sps);
  q.block.forms = {Form::explicit_form, Form::laga};
  q.block.attention = AttentionKind::flash;
  q.block.dtype = PlanDType::bf16;
  q.block.profile = load_profile("h100");
  return q;
}

// Depth 1, dense: the attention is the block plan's forward + backward (its
// own gradient all-reduce left out), exactly; depth 3 is three of them; the
// MoE layers' all-to-alls are four per layer at the link model's cost of the
// expected bytes, and none at P 1.
TEST(ModelPlan, AttentionIsTheBlockPlanScaledByDepth) {
  LmConfig dense = moe_tiny();
  dense.moe.reset();
  dense.bias_update_speed = 0;
  dense.layers = 1;
  const ModelPlanResult one = make_model_plans(request(dense, {2}));
  const std::vector<PlanCase> blocks = make_plans(request(dense, {2}).block);
  ASSERT_EQ(one.cases.size(), 1u);
  ASSERT_EQ(one.cases[0].forms.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const FormPlan& b = blocks[0].forms[i];
    const ModelPlan& m = one.cases[0].forms[i];
    EXPECT_EQ(m.form, b.form);
    EXPECT_EQ(m.block.bytes_sent_per_rank, b.bytes_sent_per_rank);
    EXPECT_GT(b.phases[2].comm_s, 0);  // P 2: the block's own all-reduce is there to leave out
    EXPECT_DOUBLE_EQ(m.time.attention, b.step_s - b.phases[2].compute_s() - b.phases[2].comm_s);
    EXPECT_EQ(m.time.moe_a2a, 0);
  }
  LmConfig deep = moe_tiny();  // 1 dense + 2 MoE layers
  const ModelPlanResult three = make_model_plans(request(deep, {2}));
  const ModelPlan& m = three.cases[0].forms[1];
  EXPECT_DOUBLE_EQ(m.time.attention, 3 * one.cases[0].forms[1].time.attention);
  const double bytes = expected_moe_a2a_bytes(32, 2, 64, 2, 8, 2);  // N_r 32 of S 64 at P 2
  const std::int64_t b = std::int64_t(bytes);
  // And each forward's moe_counts: 8 bytes for each of the other rank's 4 experts.
  EXPECT_EQ(moe_counts_bytes(8, 2), 32.0);
  const Fabric& f2 = three.blocks[0].links.fabric;
  const double counts_s = collective_seconds(CollectiveKind::all_to_all, 2, {32, 32}, f2);
  EXPECT_EQ(m.moe_a2a_bytes_per_rank, 2 * (4 * bytes + 32));
  EXPECT_DOUBLE_EQ(
      m.time.moe_a2a,
      2 * (4 * collective_seconds(CollectiveKind::all_to_all, 2, {b, b}, f2) + counts_s));
  const ModelPlanResult p1 = make_model_plans(request(deep, {1}));
  EXPECT_EQ(p1.cases[0].forms[0].time.moe_a2a, 0);
  EXPECT_EQ(p1.cases[0].forms[0].time.grad_sync, 0);
  // Recompute re-runs each block's forward and the MoE's forward all-to-alls.
  ModelPlanRequest rq = request(deep, {2});
  rq.recompute = true;
  const ModelPlan& r = make_model_plans(rq).cases[0].forms[1];
  const FormPlan& blk = m.block;
  EXPECT_DOUBLE_EQ(r.time.attention,
                   m.time.attention + 3 * (blk.phases[0].compute_s() + blk.phases[0].comm_s));
  // Recompute: the forward's three all-to-alls again (counts, dispatch, combine).
  EXPECT_DOUBLE_EQ(
      r.time.moe_a2a,
      m.time.moe_a2a +
          2 * (2 * collective_seconds(CollectiveKind::all_to_all, 2, {b, b}, f2) + counts_s));
  EXPECT_LT(r.activations.total(), m.activations.total());
  // Gradient accumulation: M forward + backward passes, one sync and AdamW;
  // the memory is one micro-batch's.
  ModelPlanRequest mq = request(deep, {2});
  mq.dps = {2};
  const ModelPlan one_mb = make_model_plans(mq).cases[0].forms[1];
  mq.micro_batches = 5;
  const ModelPlan five = make_model_plans(mq).cases[0].forms[1];
  EXPECT_GT(one_mb.time.grad_sync, 0);
  EXPECT_EQ(five.time.grad_sync, one_mb.time.grad_sync);
  EXPECT_EQ(five.time.optimizer, one_mb.time.optimizer);
  EXPECT_DOUBLE_EQ(five.time.attention, 5 * one_mb.time.attention);
  EXPECT_DOUBLE_EQ(five.time.ffn, 5 * one_mb.time.ffn);
  EXPECT_DOUBLE_EQ(five.time.moe_a2a, 5 * one_mb.time.moe_a2a);
  EXPECT_DOUBLE_EQ(five.model_flops, 5 * one_mb.model_flops);
  EXPECT_EQ(five.memory_bytes(), one_mb.memory_bytes());
}

// A bf16 plan holds and all-reduces fp32 gradients unless told bf16 (as a
// bf16 trainer does by default): the gradients' state is 4 bytes a
// parameter, the sync moves 4-byte elements, AdamW reads 30 bytes a
// parameter; with GradReduce::bf16, 2, 2 and 28. The parameters, the
// optimizer state and everything else are the same; an fp32 plan cannot
// reduce in bf16.
TEST(ModelPlan, Bf16PlansKeepFp32GradientsUnlessToldBf16) {
  LmConfig dense = moe_tiny();  // one group of owners: every gradient over all P x DP devices
  dense.moe.reset();
  dense.bias_update_speed = 0;
  ModelPlanRequest q = request(dense, {2});
  q.dps = {2};
  const ModelPlan fp32_grads = make_model_plans(q).cases[0].forms[1];
  q.block.grad_reduce = GradReduce::bf16;
  const ModelPlan bf16_grads = make_model_plans(q).cases[0].forms[1];
  const double n = double(model_param_counts(dense).replicated());
  EXPECT_EQ(fp32_grads.state.gradients, 4 * n);
  EXPECT_EQ(bf16_grads.state.gradients, 2 * n);
  EXPECT_EQ(fp32_grads.state.parameters, 2 * n);
  EXPECT_EQ(fp32_grads.state.parameters, bf16_grads.state.parameters);
  EXPECT_EQ(fp32_grads.state.optimizer, bf16_grads.state.optimizer);
  EXPECT_DOUBLE_EQ(fp32_grads.time.optimizer * 28, bf16_grads.time.optimizer * 30);
  // The gradients over the P x DP = 4 devices: one all-reduce of 4- or
  // 2-byte elements.
  const Fabric f = plan_links(q.block.profile, 4, 0, std::nullopt, std::nullopt).fabric;
  const auto sync = [&](std::int64_t e) {
    const WireBytes w =
        all_reduce_wire_bytes(model_param_counts(dense).replicated(), 4, 0, DType::f32);
    return collective_seconds(CollectiveKind::all_reduce, 4, {w.sent / 4 * e, w.received / 4 * e},
                              f);
  };
  EXPECT_DOUBLE_EQ(fp32_grads.time.grad_sync, sync(4));
  EXPECT_DOUBLE_EQ(bf16_grads.time.grad_sync, sync(2));
  EXPECT_EQ(fp32_grads.time.attention, bf16_grads.time.attention);
  EXPECT_EQ(fp32_grads.activations.total(), bf16_grads.activations.total());
  // The block plan's own gradient all-reduce moves 4- or 2-byte elements too.
  const FormPlan &b32 = fp32_grads.block, &b16 = bf16_grads.block;
  EXPECT_GT(b32.bytes_sent_per_rank, b16.bytes_sent_per_rank);
  EXPECT_EQ(b32.bytes_sent_forward, b16.bytes_sent_forward);
  EXPECT_EQ(b32.resident_bytes, b16.resident_bytes * 6 / 4);  // 2 + 4 against 2 + 2 a parameter
  q.block.dtype = PlanDType::fp32;
  EXPECT_NE(
      test::error_of([&] { make_model_plans(q); }).find("--grad-reduce bf16 needs --dtype bf16"),
      std::string::npos);
}

// The reference form does no redundant work, so its FLOPs over every rank
// do not depend on P: a check of the sum over rank classes MFU reads.
TEST(ModelPlan, ReferenceFlopsOverAllRanksDoNotDependOnP) {
  LmConfig cfg = moe_tiny();
  const ModelPlanResult r = make_model_plans(request(cfg, {1, 2, 4}));
  std::vector<double> flops;
  for (const PlanCase& c : r.blocks) flops.push_back(c.forms[0].flops_all_ranks);
  ASSERT_EQ(flops.size(), 3u);
  EXPECT_GT(flops[0], 0);
  EXPECT_DOUBLE_EQ(flops[1], flops[0]);
  EXPECT_DOUBLE_EQ(flops[2], flops[0]);
  // MFU's FLOPs: three layers of it, and the FFN and head closed forms fwd + 2x bwd.
  const ModelPlan& m = r.cases[1].forms[0];
  const double ffn = ffn_flops_forward(cfg, 0) + 2 * ffn_flops_forward(cfg, 1);
  EXPECT_DOUBLE_EQ(m.model_flops, 3 * flops[0] + 64 * (ffn + head_flops_forward(cfg)) * 3);
}

// --ep max: the experts over all P x DP = 8 devices (gcd(8, E 8)), the all-to-all over all of
// them (the expected bytes at that EP, on its links), fewer experts each.
TEST(ModelPlan, ExpertParallelOverEveryDevice) {
  ModelPlanRequest q = request(moe_tiny(), {2});
  q.dps = {4};
  const ModelPlan folded = make_model_plans(q).cases[0].forms[1];
  q.ep = {EpRule::max, 0};
  const ModelPlan world = make_model_plans(q).cases[0].forms[1];
  EXPECT_EQ(folded.ep, 2);
  EXPECT_EQ(world.ep, 8);
  const double bytes = expected_moe_a2a_bytes(32, 2, 64, 2, 8, 8);
  const std::int64_t b = std::int64_t(bytes);
  const double counts = moe_counts_bytes(8, 8);  // 8 bytes for each of the 7 others' experts
  EXPECT_EQ(counts, 56.0);
  EXPECT_EQ(world.moe_a2a_bytes_per_rank, 2 * (4 * bytes + counts));
  const Fabric eight = plan_links(q.block.profile, 8, 0, {}, {}).fabric;
  EXPECT_DOUBLE_EQ(world.time.moe_a2a,
                   2 * (4 * collective_seconds(CollectiveKind::all_to_all, 8, {b, b}, eight) +
                        collective_seconds(CollectiveKind::all_to_all, 8, {56, 56}, eight)));
  const ModelParamCounts n = model_param_counts(q.model);
  EXPECT_DOUBLE_EQ(folded.state.parameters - world.state.parameters,
                   2.0 * (double(n.routed_experts) / 2 - double(n.routed_experts) / 8));
  EXPECT_EQ(world.time.attention, folded.time.attention);  // the SP group's, unchanged
}

// P 3 over 8 experts: EP = 3, folded as laga train folds them (3 + 3 + 2);
// the busiest device holds 3 experts' state and keeps its 3 experts'
// expected rows (3 x 22 x 2 x 3 / 8 = 49.5: the largest shard 22 of S 64).
TEST(ModelPlan, FoldedExpertsWherePDoesNotDivideE) {
  ModelPlanRequest q = request(moe_tiny(), {3});
  const ModelPlan p = make_model_plans(q).cases[0].forms[1];
  EXPECT_EQ(p.ep, 3);
  const ModelParamCounts n = model_param_counts(q.model);
  EXPECT_EQ(p.state.parameters, 2.0 * double(n.replicated() + n.routed_experts / 8 * 3));
  const LmConfig& cfg = q.model;
  const double D = double(cfg.dim()), I = double(cfg.moe->moe_intermediate_size);
  const double copies = 22 * 2, rows = 49.5;
  EXPECT_EQ(layer_saved_bytes(cfg, 1, 22, 2, 3),
            2 * (4 * 22 * D + 2 * 22 + copies * D + rows * 3 * I + rows * D +
                 3 * 22 * double(cfg.moe->shared_intermediate_size())));
  EXPECT_EQ(p.moe_a2a_bytes_per_rank,
            2 * (4 * expected_moe_a2a_bytes(22, 2, 64, 2, 8, 3) + moe_counts_bytes(8, 3)));
}

TEST(ModelPlan, Refusals) {
  LmConfig cfg = moe_tiny();  // 8 experts
  ModelPlanRequest q = request(cfg, {2});
  q.dps = {0};
  EXPECT_NE(test::error_of([&] { make_model_plans(q); }).find("--dp 0"), std::string::npos);
  q.dps = {2};
  q.ep = {EpRule::fixed, 3};
  EXPECT_NE(test::error_of([&] {
              make_model_plans(q);
            }).find("--ep 3 must divide the 4 devices of --sp 2 x --dp 2"),
            std::string::npos);
  EXPECT_NE(test::error_of([] {
              LmConfig::preset("deepseek-v4");
            }).find("unknown model preset 'deepseek-v4'; choose one of: deepseek-v3"),
            std::string::npos);
}

}  // namespace
// Ranks that share a host's cores (shared_cores): the layers' work beyond
// attention, which every rank does at once, takes world / cores as long
// when there are more ranks than cores, and no longer when there are not.
TEST(ModelPlan, RanksSharingCoresShareTheLayersWork) {
  ModelPlanRequest q = request(moe_tiny(), {4});
  q.block.dtype = PlanDType::fp32;
  const ModelPlan own = make_model_plans(q).cases[0].forms[1];
  q.block.profile.shared_cores = 2;
  q.block.profile.devices_per_node = 2;
  const ModelPlan shared = make_model_plans(q).cases[0].forms[1];
  EXPECT_DOUBLE_EQ(shared.time.ffn, 2 * own.time.ffn);
  EXPECT_DOUBLE_EQ(shared.time.head, 2 * own.time.head);
  EXPECT_DOUBLE_EQ(shared.time.elementwise, 2 * own.time.elementwise);
  EXPECT_DOUBLE_EQ(shared.time.optimizer, 2 * own.time.optimizer);
  EXPECT_GT(shared.time.attention, own.time.attention);  // the block plan shares them too
  q.block.profile.shared_cores = 4;
  EXPECT_DOUBLE_EQ(make_model_plans(q).cases[0].forms[1].time.ffn, own.time.ffn);
}

// Data-parallel replicas that are threads of one host share its cores with
// the SP group (issue 57, `laga train --dp`): at P 1 the block plan gives
// each rank a core of its own, so the attention of P dp ranks on c < P dp
// cores is its compute stretched by P dp / c (the forward and backward
// compute; at P 1 the block has no collectives); at dp c or fewer, or on
// a profile of devices, it is the block's own. Seen to fail with the
// attention left at the block plan's (the replicas' sharing ignored).
TEST(ModelPlan, ReplicasSharingCoresShareTheAttention) {
  ModelPlanRequest q = request(moe_tiny(), {1});
  q.block.dtype = PlanDType::fp32;
  q.block.profile.shared_cores = 2;
  q.block.profile.devices_per_node = 2;
  q.dps = {1, 2, 3, 4};
  const ModelPlanResult r = make_model_plans(q);
  ASSERT_EQ(r.cases.size(), 4u);
  const FormPlan& block = r.cases[0].forms[1].block;
  const double compute = block.phases[0].compute_s() + block.phases[1].compute_s();
  const double layers = double(q.model.layers);
  for (const ModelPlanCase& c : r.cases) {
    const double stretch = std::max(1.0, double(c.dp) / 2.0);
    EXPECT_NEAR(c.forms[1].time.attention, layers * compute * stretch,
                1e-12 * layers * compute * stretch)
        << "dp " << c.dp;
  }
  q.block.profile.shared_cores = 0;  // a device per rank: no sharing
  q.dps = {4};
  EXPECT_NEAR(make_model_plans(q).cases[0].forms[1].time.attention, layers * compute,
              1e-12 * layers * compute);
}

// A profile with an exp rate prices the layers' exponentials at it, on top
// of their bytes: per token, the dense SwiGLU's F forward and F backward,
// each MoE layer's silu over the routed rows the device runs (the busiest
// owner's: k ep ceil(E / ep) / E per token) and the shared expert's, forward
// and backward, and the gate's E sigmoids forward; the cross-entropy's V
// forward and V backward. Recompute runs the forwards again. Counted by hand
// for moe_tiny (F 192, E 8, k 2, I 32, one shared expert of 32, V 256).
TEST(ModelPlan, ExponentialsAtTheProfilesRateByHand) {
  const double rate = 2.5e8;
  for (int P : {2, 3, 4})
    for (bool recompute : {false, true}) {
      ModelPlanRequest q = request(moe_tiny(), {P});
      q.recompute = recompute;
      const ModelPlan without = make_model_plans(q).cases[0].forms[1];
      q.block.profile.device.exp_per_s = rate;
      const ModelPlan with = make_model_plans(q).cases[0].forms[1];
      const double most = double((8 + P - 1) / P), rows = 2.0 * P * most / 8;  // per token
      const double dense = 192, moe_fwd = rows * 32 + 32 + 8, moe_bwd = rows * 32 + 32;
      const double forward = dense + 2 * moe_fwd, backward = dense + 2 * moe_bwd;
      const double per_token = forward * (recompute ? 2 : 1) + backward + 2 * 256;
      const double N =
          double(SpLayout::even(1, 64, 4, P, SeqLayout::contiguous).largest_shard_tokens());
      EXPECT_DOUBLE_EQ(with.time.elementwise - without.time.elementwise, N * per_token / rate)
          << "P " << P << (recompute ? " recompute" : "");
      EXPECT_DOUBLE_EQ(with.step_s - without.step_s, N * per_token / rate);
      EXPECT_EQ(with.time.ffn, without.time.ffn);
    }
}

// The layers' GEMM calls add up to the closed form's FLOPs (N k ep / E a
// whole number of rows here), forward once and backward twice, with the
// forward again under recompute; a measured shape replaces its calls'
// FLOPs / efficiency in the model's FFN time.
TEST(ModelPlan, GemmCallsAreTheClosedFormsFlops) {
  const LmConfig cfg = moe_tiny();  // E 8, k 2
  for (int ep : {1, 2, 4})
    for (bool recompute : {false, true}) {
      const std::int64_t N = 64;
      const ModelGemmCalls c = model_gemm_calls(cfg, N, ep, recompute);
      double want = 0;
      for (std::int64_t l = 0; l < cfg.layers; ++l) want += ffn_flops_forward(cfg, l);
      want *= double(N) * (recompute ? 4.0 : 3.0);
      EXPECT_DOUBLE_EQ(c.ffn.gemm_flops, want) << "ep " << ep;
      EXPECT_DOUBLE_EQ(c.head.gemm_flops, 3.0 * double(N) * head_flops_forward(cfg));
      double listed = 0;
      for (const auto& [call, t] : c.ffn.gemm_calls) listed += t.flops;
      EXPECT_DOUBLE_EQ(listed, want);
    }
  // EP 3 over E 8: the busiest device runs 3 experts, each on the 3
  // devices' expected 64 * 2 * 3 / 8 = 48 rows: 9/8 of its own 128 copies.
  {
    const std::int64_t N = 64, D = cfg.dim(), I = cfg.moe->moe_intermediate_size;
    const ModelGemmCalls c = model_gemm_calls(cfg, N, 3, false);
    double want = 0;
    for (std::int64_t l = 0; l < cfg.layers; ++l) {
      want += 3.0 * double(N) * ffn_flops_forward(cfg, l);
      if (cfg.is_moe_layer(l))
        want += 3.0 * (3 * 48 - N * cfg.moe->num_experts_per_tok) * 2.0 * 3 * double(D * I);
    }
    EXPECT_DOUBLE_EQ(c.ffn.gemm_flops, want);
  }
  ModelPlanRequest q = request(moe_tiny(), {2});
  q.block.dtype = PlanDType::fp32;
  const ModelPlan plain = make_model_plans(q).cases[0].forms[1];
  const ModelGemmCalls c = model_gemm_calls(q.model, 32, 2, false);  // S 64 over P 2, EP 2
  const auto& [call, tally] = *c.ffn.gemm_calls.begin();
  const double at_rate = tally.flops / (*q.block.profile.device.peak_flops_fp32 *
                                        q.block.profile.device.gemm_efficiency);
  q.block.profile.measured_shapes.gemm[call] = 1.0;  // one second a call
  const ModelPlan measured = make_model_plans(q).cases[0].forms[1];
  EXPECT_NEAR(measured.time.ffn, plain.time.ffn - at_rate + double(tally.calls),
              1e-9 * measured.time.ffn);
}

}  // namespace laga
