// laga train --invariant (docs/invariance.md, "In training"; issue 56): a
// 20-step run's losses, gradient norms and final checkpoint (weights, AdamW
// moments, expert biases) are the same bytes at --sp 1, 2 and 4, dense
// (uneven shards, two rows; and with q_lora_rank) and MoE with expert
// parallelism, explicit and laga, fp32 and bf16. A reduction whose order
// follows the ranks is caught, and what the mode does not cover is refused
// by name. Under the sanitizers (common/sanitized.hpp) the runs are 4 steps
// (every case still run: the same step's code paths); the main pass keeps 20.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/error_of.hpp"
#include "common/sanitized.hpp"
#include "common/scratch.hpp"
#include "core/memory_pool.hpp"
#include "mla/canonical_sum.hpp"
#include "model/train.hpp"

namespace laga {
namespace {

namespace fs = std::filesystem;
using test::error_of;

constexpr std::int64_t kSteps = test::kSanitized ? 4 : 20;

// A tiny model: two layers, D 32, 4 heads, V 64.
TrainOptions dense(Form form, int sp) {
  TrainOptions o;
  o.model = LmConfig::derive(32, 4, 2, 64, 30);
  o.variant.form = form;
  o.attention = AttentionKind::flash;
  o.invariant = true;
  o.sp = sp;
  o.batch = 2;
  o.seq = 30;  // uneven at P 4 (8, 8, 7, 7)
  o.steps = kSteps;
  o.seed = 5;
  o.adam.lr = 3e-3;
  o.clip = 1.0;  // the clip's global norm is summed too
  return o;
}

// The query's low-rank path (wq_a, q_norm, wq_b: the block's canonical
// q_norm and wq_b gradients).
TrainOptions dense_q_lora(Form form, int sp) {
  TrainOptions o = dense(form, sp);
  o.model.mla.q_lora_rank = 16;
  return o;
}

// Layer 0 dense, layer 1 MoE: 8 experts in 2 groups, 2 a token, one shared
// expert, the bias balancing on; experts folded over every rank. Two rows:
// an owner receives each rank's rows b-major, which the mode sorts into
// global token order (moe.cpp, global_token_order).
TrainOptions moe(Form form, int sp) {
  TrainOptions o = dense(form, sp);
  MoeConfig m;
  m.n_routed_experts = 8, m.num_experts_per_tok = 2, m.moe_intermediate_size = 16;
  m.n_shared_experts = 1, m.n_group = 2, m.topk_group = 1, m.routed_scaling_factor = 1.5;
  m.norm_topk_prob = true, m.first_k_dense_replace = 1;
  o.model.moe = m;
  o.model.bias_update_speed = 1e-3;
  o.experts = ExpertPlacement::folded;
  o.batch = 2;
  o.seq = 31;  // uneven at P 2 (16, 15) and 4 (8, 8, 8, 7)
  return o;
}
// One row of tokens: an owner's rows arrive in global token order already.
TrainOptions moe_one_row(Form form, int sp) {
  TrainOptions o = moe(form, sp);
  o.batch = 1;
  o.seq = 62;
  return o;
}

struct Outcome {
  std::vector<double> loss, grad_norm;
  std::vector<std::vector<std::int64_t>> load;
  std::string checkpoint;  // the last step's safetensors, every byte
};

Outcome run(TrainOptions o, const std::string& name) {
  const fs::path dir = test::scratch_dir("model_train_invariant_", name);
  o.checkpoint_dir = dir.string();
  Outcome out;
  for (const StepRecord& s : train_local(o)) {
    out.loss.push_back(s.loss);
    out.grad_norm.push_back(s.grad_norm);
    out.load.push_back(s.expert_load);
  }
  std::ostringstream last;  // the last step's checkpoint: step-00000020.safetensors
  last << "step-" << std::setw(8) << std::setfill('0') << kSteps << ".safetensors";
  std::ifstream in(dir / last.str(), std::ios::binary);
  EXPECT_TRUE(in.good()) << name << ": no final checkpoint";
  out.checkpoint.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return out;
}

// Every P's run against P 1's, bit for bit (EXPECT_EQ on doubles: ==).
void expect_same_at_every_p(TrainOptions (*make)(Form, int), Form form, Precision precision,
                            const std::string& what) {
  TrainOptions o1 = make(form, 1);
  o1.precision = precision;
  const Outcome one = run(o1, what + "1");
  ASSERT_EQ(one.loss.size(), std::size_t(kSteps));
  ASSERT_FALSE(one.checkpoint.empty());
  for (int P : {2, 4}) {
    TrainOptions o = make(form, P);
    o.precision = precision;
    const Outcome got = run(o, what + std::to_string(P));
    EXPECT_EQ(got.loss, one.loss) << what << ": the losses at --sp " << P;
    EXPECT_EQ(got.grad_norm, one.grad_norm) << what << ": the gradient norms at --sp " << P;
    EXPECT_EQ(got.load, one.load) << what << ": the expert loads at --sp " << P;
    EXPECT_TRUE(got.checkpoint == one.checkpoint)
        << what << ": the final checkpoint's bytes at --sp " << P << " differ from --sp 1's";
  }
}

TEST(TrainInvariant, DenseSameBitsAtP124) {
  expect_same_at_every_p(&dense, Form::explicit_form, Precision::fp32, "dense_explicit_fp32_");
  expect_same_at_every_p(&dense, Form::laga, Precision::fp32, "dense_laga_fp32_");
  expect_same_at_every_p(&dense, Form::laga, Precision::bf16, "dense_laga_bf16_");
  expect_same_at_every_p(&dense_q_lora, Form::explicit_form, Precision::fp32, "q_lora_fp32_");
}

TEST(TrainInvariant, MoeWithExpertParallelismSameBitsAtP124) {
  expect_same_at_every_p(&moe, Form::explicit_form, Precision::fp32, "moe_explicit_fp32_");
  expect_same_at_every_p(&moe, Form::laga, Precision::bf16, "moe_laga_bf16_");
  expect_same_at_every_p(&moe_one_row, Form::laga, Precision::fp32, "moe_one_row_laga_fp32_");
}

// The mutation (docs/invariance.md, "The mutation"): every canonical sum
// combined in rank order, the grouping an all-reduce of partial sums has.
// The same runs then differ between P 1 and P 2: the test above catches a
// reduction order that follows the ranks. (And without the mode they differ
// too: the test compares what P changes.)
TEST(TrainInvariant, ARankOrderedReductionIsCaught) {
  struct Restore {
    ~Restore() { ops::canonical_sum_rank_order = false; }
  } restore;
  ops::canonical_sum_rank_order = true;
  const Outcome one = run(dense(Form::laga, 1), "mutation1");
  const Outcome two = run(dense(Form::laga, 2), "mutation2");
  EXPECT_NE(two.loss, one.loss);
  EXPECT_FALSE(two.checkpoint == one.checkpoint);
  ops::canonical_sum_rank_order = false;
  TrainOptions off1 = dense(Form::laga, 1), off2 = dense(Form::laga, 2);
  off1.invariant = off2.invariant = false;
  EXPECT_NE(run(off2, "off2").loss, run(off1, "off1").loss);
}

// laga train's memory check in the mode: the count-only step (the canonical
// sums' pieces and one-hot included) allocates what the real step does, its
// peak the measured one exactly, fp32 and bf16 (dense: under expert
// parallelism the count-only run sizes the experts' rows by the uniform
// expectation, not the routing, ModelMoe's tests).
TEST(TrainInvariant, TheMemoryPredictionIsTheMeasuredPeak) {
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(to_string(precision));
    TrainOptions o = dense(Form::laga, 2);
    o.precision = precision;
    o.steps = 1;
    std::vector<MemoryPool> pools(2);
    LocalRunOptions local;
    local.pools = &pools;
    run_local_ranks(
        2, [&](Communicator& comm) { train_rank(comm, o, nullptr); }, local);
    const std::vector<TrainMemory> predicted = predict_train_memory(o, StagingRule::in_process);
    for (std::size_t r = 0; r < pools.size(); ++r)
      EXPECT_EQ(predicted[r].step_peak, pools[r].peak_total()) << "rank " << r;
  }
}

// What the mode does not cover, each refused by name before a rank starts.
TEST(TrainInvariant, WhatTheModeDoesNotCoverIsRefusedByName) {
  const auto refusal = [](TrainOptions o) { return error_of([&] { validate_train_options(o); }); };
  TrainOptions o = dense(Form::ring_kv, 2);
  EXPECT_NE(refusal(o).find("--invariant: form ring_kv does not offer the invariant mode"),
            std::string::npos)
      << refusal(o);
  EXPECT_NE(refusal(o).find("explicit"), std::string::npos) << refusal(o);
  o = dense(Form::laga, 2);
  o.attention = AttentionKind::eager;
  EXPECT_NE(refusal(o).find("--invariant needs --attention flash"), std::string::npos);
  o = dense(Form::laga, 2);
  o.variant.queries = QueryExchange::latent;
  o.model.mla.q_lora_rank = 16;
  EXPECT_NE(refusal(o).find("--q-latent"), std::string::npos) << refusal(o);
  o = dense(Form::laga, 2);
  o.variant.overlap = Overlap::on;
  EXPECT_NE(refusal(o).find("--overlap on"), std::string::npos) << refusal(o);
  o = dense(Form::laga, 2);
  o.precision = Precision::bf16, o.grad_reduce = GradReduce::bf16;
  EXPECT_NE(refusal(o).find("drop --grad-reduce bf16"), std::string::npos) << refusal(o);
  o = dense(Form::laga, 2);
  o.seq_layout = SeqLayout::zigzag;
  EXPECT_NE(refusal(o).find("drop --seq-layout zigzag"), std::string::npos) << refusal(o);
  o = dense(Form::laga, 1);
  o.pp = 2;
  EXPECT_NE(refusal(o).find("--invariant: --pp 2"), std::string::npos) << refusal(o);
  o = dense(Form::laga, 1);
  o.dp = 2;
  EXPECT_NE(refusal(o).find("--invariant: --dp 2"), std::string::npos) << refusal(o);
  o = moe(Form::laga, 2);
  o.experts = ExpertPlacement::every_rank;
  EXPECT_NE(refusal(o).find("needs --expert-parallel over every rank"), std::string::npos)
      << refusal(o);
  o = moe(Form::laga, 4);
  o.expert_degree = 2;
  EXPECT_NE(refusal(o).find("needs --expert-parallel over every rank"), std::string::npos)
      << refusal(o);
  // And what it covers passes.
  EXPECT_EQ(refusal(dense(Form::explicit_form, 4)), "");
  EXPECT_EQ(refusal(moe(Form::laga, 4)), "");
}

}  // namespace
}  // namespace laga
