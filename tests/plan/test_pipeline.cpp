// Pipeline stages, schedules, node-limited routing and FP8 in the model plan
// (plan/pipeline.hpp, plan/model_plan.hpp) against hand counts: the stage
// split of DeepSeek-V3, the bubbles and in-flight micro-batches of each
// schedule as their papers give them, the node-limited copies against a
// simulation of the routing they describe, the stages' parameters summing
// to the model's, and a pipelined plan composed of its stages' plans.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "common/error_of.hpp"
#include "model/moe_routing.hpp"
#include "plan/model_plan.hpp"
#include "plan/pipeline.hpp"

namespace laga {
namespace {

LmConfig moe_tiny() {  // docs/assets/moe_tiny.json: 3 layers, the first dense
  const char* src = std::getenv("LAGA_SOURCE_DIR");
  return LmConfig::from_json_file(std::string(src ? src : ".") + "/docs/assets/moe_tiny.json");
}

// DeepSeek-V3 at PP 16 with its MTP module: 62 units, 14 stages of 4 and 2
// of 3; stage 0 is three dense layers and one MoE layer; the last holds
// layers 59-60, the MTP module and the head.
TEST(Pipeline, DeepSeekV3StagesAtPp16) {
  const LmConfig v3 = LmConfig::preset("deepseek-v3");
  PipelineChoice pp;
  pp.stages = 16;
  pp.mtp = true;
  const std::vector<StageSpan> s = pipeline_stages(v3, pp);
  ASSERT_EQ(s.size(), 16u);
  std::int64_t layers = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_EQ(s[i].first_layer, layers);
    EXPECT_EQ(s[i].layers + s[i].mtp_modules, i < 14 ? 4 : 3) << "stage " << i;
    EXPECT_EQ(s[i].embedding, i == 0);
    EXPECT_EQ(s[i].head, i == 15);
    layers += s[i].layers;
  }
  EXPECT_EQ(layers, 61);
  EXPECT_EQ(s.back().first_layer, 59);
  EXPECT_EQ(s.back().mtp_modules, 1);
  const LmConfig first = stage_config(v3, s[0]);
  EXPECT_EQ(first.layers, 4);
  for (int l = 0; l < 3; ++l) EXPECT_FALSE(first.is_moe_layer(l));
  EXPECT_TRUE(first.is_moe_layer(3));
  const LmConfig last = stage_config(v3, s.back());
  EXPECT_EQ(last.layers, 3);  // two layers and the MTP module's
  for (int l = 0; l < 3; ++l) EXPECT_TRUE(last.is_moe_layer(l));

  pp.stage_layers = std::vector<int>(16, 4);
  EXPECT_NE(test::error_of([&] { pipeline_stages(v3, pp); }).find("sums to 64 layers"),
            std::string::npos);
  pp.stage_layers.resize(3);
  EXPECT_NE(test::error_of([&] { pipeline_stages(v3, pp); }).find("one count per stage"),
            std::string::npos);
  pp.stage_layers = {3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2};
  EXPECT_EQ(pipeline_stages(v3, pp)[0].layers, 3);
  EXPECT_EQ(pipeline_stages(v3, pp)[15].first_layer, 59);
}

// The stages' parameters are the model's, every tensor once: the MTP
// module adds one MoE layer, its enorm, hnorm and head norm, and eh_proj (D, 2 D).
TEST(Pipeline, StageParametersSumToTheModels) {
  for (const LmConfig& cfg : {moe_tiny(), LmConfig::preset("deepseek-v3")})
    for (int stages : {1, 2, 3}) {
      for (bool mtp : {false, true}) {
        PipelineChoice pp;
        pp.stages = stages, pp.mtp = mtp;
        std::int64_t sum = 0;
        for (const StageSpan& s : pipeline_stages(cfg, pp))
          sum += stage_param_counts(cfg, s).total();
        const ModelParamCounts whole = model_param_counts(cfg);
        LmConfig one_more = cfg;
        one_more.layers = 1 + cfg.layers;
        const std::int64_t mtp_layer =
            model_param_counts(one_more).total() - whole.total();  // one MoE layer, its norms
        const std::int64_t D = cfg.dim();
        EXPECT_EQ(sum, whole.total() + (mtp ? mtp_layer + 2 * D * D + 3 * D : 0))
            << cfg.summary() << " PP " << stages << " mtp " << mtp;
      }
    }
}

// Bubbles as the papers give them, for F 1, B 2, W 0.5 (forward comm 0.25,
// backward 0.5): 1F1B (PP - 1)(F + B); interleaved / v; DualPipe
// (PP/2 - 1)(F&B + B - 3W) with F&B the larger of the computes and comms.
TEST(Pipeline, BubblesByHand) {
  PassTimes t;
  t.forward = 1, t.backward = 2, t.weight_grad = 0.5, t.forward_comm = 0.25, t.backward_comm = 0.5;
  EXPECT_DOUBLE_EQ(pipeline_bubble_s(PipeSchedule::one_f_one_b, 8, 1, t), 7 * 3.75);
  EXPECT_DOUBLE_EQ(pipeline_bubble_s(PipeSchedule::interleaved, 8, 2, t), 7 * 3.75 / 2);
  EXPECT_DOUBLE_EQ(t.f_and_b(), 3.0);
  EXPECT_DOUBLE_EQ(pipeline_bubble_s(PipeSchedule::dualpipe, 8, 1, t), 3 * (3.0 + 2.5 - 1.5));
  EXPECT_DOUBLE_EQ(pipeline_bubble_s(PipeSchedule::one_f_one_b, 1, 1, t), 0.0);
  // 12 micro-batches: DualPipe's steady state is one F&B a micro-batch.
  EXPECT_DOUBLE_EQ(pipeline_step_s(PipeSchedule::dualpipe, 8, 1, 12, t), 12 * 3.0 + 12.0);
  EXPECT_DOUBLE_EQ(pipeline_step_s(PipeSchedule::one_f_one_b, 8, 1, 12, t), 12 * 3.75 + 26.25);
  // The communication's share of the SMs slows the pair's compute.
  t.comm_unit_share = 0.25;
  EXPECT_DOUBLE_EQ(t.f_and_b(), 4.0);
  // Communication longer than compute is the pair's time.
  t.comm_unit_share = 0, t.forward_comm = 3, t.backward_comm = 2;
  EXPECT_DOUBLE_EQ(t.f_and_b(), 5.0);
  EXPECT_NE(
      test::error_of([&] { pipeline_bubble_s(PipeSchedule::dualpipe, 5, 1, t); }).find("even --pp"),
      std::string::npos);
}

// laga train's lockstep 1F1B, F 1 and B 2 on every stage, by hand from the
// tick table (model/pipeline.hpp; F a forward, B a backward, . idle):
//   PP 2, M 4:  F. FF .B BF FB BF FB BF .B B.   ticks of 1 1 2 2 2 2 2 2 2 2 = 18
// against 1F1B's (M + PP - 1)(F + B) = 15: each steady tick holds a B. On 2
// shared cores, PP 4, M 4: F... FF.. FFF. FFFF ...B ..BF .BFB BFBF .BFB B.BF
// .B.B B.B. .B.. B... take 1 1 1.5 2 2 2 2.5 3 2.5 2.5 2 2 2 2 = 28 (FFF: 3
// on 2 cores, 1.5; BFB: the three at 2/3 until F ends at 1.5, then the Bs'
// last half at 1: 2.5). The exchanges: each tick's longest forward comm plus
// its longest backward comm.
TEST(Pipeline, LockstepOneFOneBByHand) {
  PassTimes t;
  t.forward = 1, t.backward = 2;
  EXPECT_DOUBLE_EQ(lockstep_step_s({t, t}, 4, 0), 18);
  EXPECT_DOUBLE_EQ(pipeline_step_s(PipeSchedule::one_f_one_b_lockstep, 2, 1, 4, t), 18);
  EXPECT_DOUBLE_EQ(pipeline_step_s(PipeSchedule::one_f_one_b, 2, 1, 4, t), 15);
  EXPECT_DOUBLE_EQ(lockstep_step_s({t, t, t, t}, 4, 2), 28);
  EXPECT_DOUBLE_EQ(shared_makespan({1, 1, 4}, 2), 4.5);
  EXPECT_DOUBLE_EQ(shared_makespan({1, 3}, 2), 3);
  EXPECT_DOUBLE_EQ(shared_makespan({1, 3}, 0), 3);
  // One stage: its passes one after another.
  EXPECT_DOUBLE_EQ(lockstep_step_s({t}, 3, 2), 9);
  // Stage 0 sends activations (0.25), stage 1 gradients (0.5): the 4 ticks
  // with a forward on stage 0 pay 0.25, the 4 with a backward on stage 1 0.5.
  PassTimes first = t, last = t;
  first.forward_comm = 0.25, last.backward_comm = 0.5;
  EXPECT_DOUBLE_EQ(lockstep_step_s({first, last}, 4, 0), 18 + 4 * 0.25 + 4 * 0.5);
  EXPECT_NE(test::error_of([&] {
              pipeline_bubble_s(PipeSchedule::one_f_one_b_lockstep, 2, 1, t);
            }).find("every stage's times"),
            std::string::npos);
  EXPECT_EQ(parse_pipe_schedule("1f1b-lockstep"), PipeSchedule::one_f_one_b_lockstep);
}

// In-flight micro-batches: 1F1B PP - stage; interleaved (Megatron's warm-up
// of 2 (PP - stage - 1) + (v - 1) PP chunk forwards, plus one, in stages of
// 1/v) PP + (PP - 1)/v on the first stage; DualPipe PP + 1; never more than M.
TEST(Pipeline, InFlightMicroBatches) {
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(PipeSchedule::one_f_one_b, 8, 1, 0, 64), 8);
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(PipeSchedule::one_f_one_b, 8, 1, 7, 64), 1);
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(PipeSchedule::interleaved, 8, 4, 0, 64), 8 + 7.0 / 4);
  // One chunk is not 1F1B: Megatron's interleaved warm-up is twice as deep.
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(PipeSchedule::interleaved, 8, 1, 3, 64), 9);
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(PipeSchedule::dualpipe, 16, 1, 5, 120), 17);
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(PipeSchedule::one_f_one_b, 8, 1, 0, 3), 3);
}

// Node-limited copies against the routing they describe, simulated: a
// token's node_limit nodes uniform among the EP group's, its k experts
// uniform among theirs; it crosses to each remote target node holding one
// once, and on every target node reaches the devices holding one but the
// one it lands on (its own on the home node). 50000 tokens: the counts'
// standard errors are at most ~0.006; the bound 0.03 is five of them.
TEST(Pipeline, NodeLimitedCopiesAreTheRoutingsMean) {
  struct Case {
    std::int64_t E, k;
    int ep, g, limit;
  };
  for (const Case c : {Case{256, 8, 64, 8, 4}, Case{64, 6, 16, 4, 2}, Case{256, 8, 64, 8, 8}}) {
    const LinkCopies f = node_limited_copies(c.E, c.k, c.ep, c.g, c.limit);
    const int nodes = c.ep / c.g;
    const std::int64_t per_node = c.E / nodes, per_device = c.E / c.ep;
    std::mt19937_64 rng(57);
    double inter = 0, intra = 0;
    const int T = 50000;
    for (int t = 0; t < T; ++t) {
      const int home = int(rng() % std::uint64_t(nodes)), lane = int(rng() % std::uint64_t(c.g));
      std::vector<int> all(static_cast<size_t>(nodes));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<std::int64_t> pool;
      for (int n = 0; n < c.limit; ++n)
        for (std::int64_t e = 0; e < per_node; ++e) pool.push_back(all[size_t(n)] * per_node + e);
      std::shuffle(pool.begin(), pool.end(), rng);
      std::set<int> hit_nodes, hit_devices;
      for (std::int64_t j = 0; j < c.k; ++j) {
        hit_nodes.insert(int(pool[size_t(j)] / per_node));
        hit_devices.insert(int(pool[size_t(j)] / per_device));
      }
      for (int n : hit_nodes) inter += n != home;
      for (int d : hit_devices) intra += d % c.g != lane;  // not the device it lands on
    }
    EXPECT_NEAR(inter / T, f.inter, 0.03) << c.E << " " << c.ep << " " << c.limit;
    EXPECT_NEAR(intra / T, f.intra, 0.03) << c.E << " " << c.ep << " " << c.limit;
  }
  // DeepSeek-V3's: 3.5 remote nodes a token, each hit but with probability
  // C(96, 8) / C(128, 8); against laga's per-copy 8 (1 - 8/64) = 7 copies.
  const LinkCopies v3 = node_limited_copies(256, 8, 64, 8, 4);
  double none = 1;
  for (int i = 0; i < 8; ++i) none *= (96.0 - i) / (128.0 - i);
  EXPECT_DOUBLE_EQ(v3.inter, 3.5 * (1 - none));
  const LinkCopies per_copy = node_limited_copies(256, 8, 64, 8, 0);
  EXPECT_DOUBLE_EQ(per_copy.inter, 7.0);
  EXPECT_DOUBLE_EQ(per_copy.intra, 8.0 * 7 / 64);
  EXPECT_NE(test::error_of([] { node_limited_copies(256, 8, 64, 8, 9); }).find("exceeds"),
            std::string::npos);
}

// The node limit the plan assumes is what laga's router does when the
// expert groups are the nodes (DeepSeek-V3: 8 groups of 32 = EP 64 over 8
// nodes, 4 groups a token): every token's 8 experts lie in at most 4 nodes.
// The router picks the groups by their two best scores, not uniformly, so
// on random logits its mean remote nodes a token is between the uniform
// model's (node_limited_copies, which lets a picked node get no expert) and
// 3.5 (every picked node hit); docs/planning.md quotes both.
TEST(Pipeline, DeepSeekRouterKeepsTheNodeLimit) {
  MoeConfig m;
  m.n_routed_experts = 256, m.num_experts_per_tok = 8, m.n_group = 8, m.topk_group = 4;
  const std::int64_t N = 4096, E = 256;
  std::mt19937_64 rng(57);
  std::normal_distribution<double> z;
  std::vector<double> logits(size_t(N * E));
  for (double& v : logits) v = z(rng);
  const Routing<double> r = route<double>(m, logits.data(), nullptr, N);
  double remote = 0;
  for (std::int64_t t = 0; t < N; ++t) {
    std::set<std::int64_t> nodes;
    for (std::int64_t j = 0; j < 8; ++j) nodes.insert(r.expert[size_t(t * 8 + j)] / 32);
    ASSERT_LE(nodes.size(), 4u) << "token " << t;
    remote += double(nodes.size()) - double(nodes.count(t % 8));  // home node t % 8
  }
  remote /= double(N);
  const LinkCopies uniform = node_limited_copies(256, 8, 64, 8, 4);
  EXPECT_GT(remote, uniform.inter);
  EXPECT_LE(remote, 3.5 + 0.05);  // 4 nodes, the home one among them half the time
  std::printf("remote nodes a token: router %.3f, uniform model %.3f\n", remote, uniform.inter);
}

ModelPlanRequest request(const LmConfig& cfg) {
  ModelPlanRequest q;
  q.model = cfg;
  q.block.cfg = cfg.mla;
  q.block.seqs = {64};
  q.block.sps = {2};
  q.block.forms = {Form::laga};
  q.block.attention = AttentionKind::flash;
  q.block.dtype = PlanDType::bf16;
  q.block.profile = load_profile("h100");
  q.micro_batches = 6;
  return q;
}

// A pipelined plan is its stages' plans composed: PP 3 on the 3-layer tiny
// MoE model, 1F1B, is M (F + B) + (PP - 1)(F + B) + sync + AdamW of its
// slowest device; its FLOPs are the unpipelined model's; the first stage
// holds the embedding and PP micro-batches, the last the head and one.
TEST(Pipeline, PipelinedPlanComposesItsStages) {
  ModelPlanRequest q = request(moe_tiny());
  const ModelPlan whole = make_model_plans(q).cases[0].forms[0];
  q.pps = {3};
  const ModelPlanResult r = make_model_plans(q);
  ASSERT_EQ(r.cases.size(), 1u);
  EXPECT_EQ(r.cases[0].devices(), 6);
  const ModelPlan& p = r.cases[0].forms[0];
  ASSERT_EQ(p.stages.size(), 3u);
  EXPECT_NEAR(p.model_flops, whole.model_flops, 1e-9 * whole.model_flops);
  const StagePlan& slow = p.stages[size_t(p.slowest_stage)];
  const double FB = slow.pass.f() + slow.pass.b();
  EXPECT_NEAR(p.time.bubble, 2 * FB, 1e-12);
  EXPECT_NEAR(p.step_s, 6 * FB + 2 * FB + p.time.grad_sync + p.time.optimizer, 1e-9 * p.step_s);
  EXPECT_DOUBLE_EQ(p.stages[0].in_flight, 3);
  EXPECT_DOUBLE_EQ(p.stages[2].in_flight, 1);
  EXPECT_LT(p.state.total(), whole.state.total());  // a third of the layers a device
  // The activation passed on and its gradient: (N, D) bf16 each way.
  const double act = 32.0 * double(q.model.dim()) * 2;  // S 64 over P 2
  EXPECT_DOUBLE_EQ(p.p2p_bytes_per_rank, 6 * act * (p.slowest_stage == 1 ? 2 : 1));
  // DualPipe needs an even PP.
  q.pipeline.schedule = PipeSchedule::dualpipe;
  EXPECT_NE(test::error_of([&] { make_model_plans(q); }).find("even --pp"), std::string::npos);
  q.pps = {2};
  const ModelPlan dual = make_model_plans(q).cases[0].forms[0];
  // Each device holds both stages: the same state, the mean of their work.
  EXPECT_DOUBLE_EQ(dual.stages[0].state.parameters, dual.stages[1].state.parameters);
  EXPECT_DOUBLE_EQ(dual.stages[0].pass.forward, dual.stages[1].pass.forward);
  EXPECT_DOUBLE_EQ(dual.stages[0].in_flight, 3);
}

// FP8: the layers' GEMMs at the FP8 peak (h100: twice bf16's), the head's
// not; a profile without an fp8 peak is refused naming it.
TEST(Pipeline, Fp8GemmsRunAtTheFp8Peak) {
  ModelPlanRequest q = request(moe_tiny());
  const ModelPlan bf16 = make_model_plans(q).cases[0].forms[0];
  q.fp8 = true;
  const ModelPlan fp8 = make_model_plans(q).cases[0].forms[0];
  const HardwareProfile h100 = load_profile("h100");
  const double ratio = h100.peak_flops(PlanDType::bf16) / h100.peak_flops_fp8();  // ~1/2
  EXPECT_NEAR(fp8.time.ffn, bf16.time.ffn * ratio, 1e-12 * bf16.time.ffn);
  EXPECT_DOUBLE_EQ(fp8.time.head, bf16.time.head);
  EXPECT_LT(fp8.time.attention, bf16.time.attention);      // its projections
  EXPECT_GT(fp8.time.elementwise, bf16.time.elementwise);  // the quantization passes
  q.block.profile = load_profile("a100");
  EXPECT_NE(test::error_of([&] { make_model_plans(q); }).find("peak_flops.fp8"), std::string::npos);
}

}  // namespace
}  // namespace laga
