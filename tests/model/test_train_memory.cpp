// `laga train`'s memory prediction (predict_train_memory): the count-only run
// of a training rank against the MemoryPool of a real one. The pool's part of
// the prediction must equal the measured peak exactly: it is the same code
// run without storage, so any difference is a bug, not a tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/scratch.hpp"
#include "common/variants.hpp"
#include "core/error.hpp"
#include "model/train.hpp"
#include "plan/pipeline.hpp"

namespace laga {
namespace {

struct Case {
  FormVariant form;
  AttentionKind attention;
  int sp;
  std::int64_t seq, batch;
  Precision precision = Precision::fp32;
  GradReduce grad_reduce = GradReduce::fp32;
};

TrainOptions options_of(const Case& c) {
  TrainOptions o;
  o.model = LmConfig::derive(32, 4, 2, 64, c.seq);
  o.model.mla.q_lora_rank = 12;  // so the query-latent variants run too
  o.variant = c.form;
  o.attention = c.attention;
  o.sp = c.sp;
  o.batch = c.batch;
  o.seq = c.seq;
  o.steps = 2;
  o.seed = 5;
  o.adam.lr = 3e-3;
  o.precision = c.precision;
  o.grad_reduce = c.grad_reduce;
  return o;
}

// Every rank's pool after a real run of o (its peak over the whole run).
std::vector<MemoryPool> measured_pools(const TrainOptions& o) {
  std::vector<MemoryPool> pools(static_cast<size_t>(o.sp));
  LocalRunOptions run;
  run.pools = &pools;
  run_local_ranks(
      o.sp, [&](Communicator& comm) { train_rank(comm, o, nullptr); }, run);
  return pools;
}

// Every variant in the registry (test::form_variants: each form, the query
// latent, overlap), each on two layouts of uneven shards (seq 33 over 2
// ranks: 17 + 16; seq 20 over 3 ranks, 4 heads: 2 + 1 + 1), both attention
// kernels, batch 1 and 2; and in bf16 (flash) at 3 ranks, its activation
// collectives and (--grad-reduce bf16) its gradient all-reduce on the wire
// as bf16 (mla/wire.hpp), which the prediction must run at the same
// precision to see.
TEST(TrainMemory, PoolPredictionEqualsTheMeasuredPeakOfRealSteps) {
  std::vector<Case> cases;
  for (FormVariant v : test::form_variants(options_of({}).model.mla, test::WithOverlap::yes)) {
    cases.push_back({v, AttentionKind::flash, 2, 33, 2});
    cases.push_back({v, AttentionKind::eager, 3, 20, 1});
    cases.push_back({v, AttentionKind::flash, 3, 20, 2, Precision::bf16});
    cases.push_back({v, AttentionKind::flash, 3, 20, 1, Precision::bf16, GradReduce::bf16});
  }
  for (const Case& c : cases) {
    const TrainOptions o = options_of(c);
    SCOPED_TRACE(cat(to_string(c.form), " ", to_string(c.attention), " P=", c.sp, " S=", c.seq,
                     " B=", c.batch, " ", to_string(c.precision), " grad-reduce ",
                     to_string(c.grad_reduce)));
    const std::vector<TrainMemory> predicted = predict_train_memory(o, StagingRule::in_process);
    const std::vector<MemoryPool> pools = measured_pools(o);
    ASSERT_EQ(predicted.size(), pools.size());
    for (size_t r = 0; r < pools.size(); ++r) {
      const MemoryPool& pool = pools[r];
      EXPECT_EQ(predicted[r].step_peak, pool.peak_total()) << "rank " << r;
      EXPECT_EQ(predicted[r].state, pool.peak(MemCategory::parameters) +
                                        pool.peak(MemCategory::optimizer) +
                                        pool.peak(MemCategory::gradients))
          << "rank " << r;
      // The state is held throughout, so the step's own part is what lies above it.
      EXPECT_GT(predicted[r].step_peak, predicted[r].state);
      // What the pool held, its block cache's kept blocks and page rounding
      // included, stays within the prediction's bound.
      EXPECT_LE(pool.peak_held(), predicted[r].step_peak + predicted[r].cache) << "rank " << r;
      EXPECT_EQ(pool.current_total(), 0) << "rank " << r << ": a tensor outlived the run";
    }
  }
}

// A DSA model (model/dsa_layer.hpp: the block at --sp 1, the query-local
// latent gather at --sp > 1): the prediction runs one step of each stage the
// run has (dense warm-up, sparse), so its pool part equals the real run's
// peak over both, with the warm-up covering none, one or every step; uneven
// shards (33 over 2, 20 over 3), fp32 and bf16.
TEST(TrainMemory, DsaPoolPredictionEqualsTheMeasuredPeak) {
  struct DsaCase {
    int sp;
    std::int64_t seq, warmup;
    Precision precision;
  };
  const std::vector<DsaCase> cases = {{1, 32, 0, Precision::fp32}, {1, 32, 1, Precision::fp32},
                                      {2, 33, 1, Precision::fp32}, {3, 20, 2, Precision::fp32},
                                      {2, 33, 0, Precision::bf16}, {3, 20, 1, Precision::bf16}};
  for (const DsaCase& c : cases) {
    TrainOptions o;
    o.model = LmConfig::derive(32, 4, 2, 64, c.seq);
    o.model.mla.q_lora_rank = 16;
    o.model.mla.index_n_heads = 2;
    o.model.mla.index_head_dim = 8;
    o.model.mla.index_topk = 8;
    o.index_warmup = c.warmup;
    o.sp = c.sp;
    o.batch = 2;
    o.seq = c.seq;
    o.steps = 2;
    o.seed = 3;
    o.adam.lr = 3e-3;
    o.precision = c.precision;
    SCOPED_TRACE(cat("DSA P=", c.sp, " S=", c.seq, " warm-up ", c.warmup, " of 2 steps ",
                     to_string(c.precision)));
    const std::vector<TrainMemory> predicted = predict_train_memory(o, StagingRule::in_process);
    const std::vector<MemoryPool> pools = measured_pools(o);
    ASSERT_EQ(predicted.size(), pools.size());
    for (size_t r = 0; r < pools.size(); ++r) {
      EXPECT_EQ(predicted[r].step_peak, pools[r].peak_total()) << "rank " << r;
      EXPECT_GT(predicted[r].step_peak, predicted[r].state) << "rank " << r;
      EXPECT_EQ(pools[r].current_total(), 0) << "rank " << r << ": a tensor outlived the run";
    }
  }
}

// Under --pp the prediction runs the pipelined step on a dry-run
// communicator of PP ranks (the activations each stage receives, the
// micro-batches it holds in flight): each stage's peak equals its real
// pool's, at PP 2 and 3 with 1 and 2 micro-batches, the MoE model with its
// bias balancing.
TEST(TrainMemory, PipelineStagesPredictionEqualsTheirMeasuredPeaks) {
  const char* src = std::getenv("LAGA_SOURCE_DIR");
  LmConfig moe =
      LmConfig::from_json_file(std::string(src ? src : ".") + "/docs/assets/moe_tiny.json");
  for (const auto& [pp, micro] : {std::pair{2, 2}, {3, 1}, {3, 2}}) {
    TrainOptions o = options_of({Form::laga, AttentionKind::flash, 1, 24, 2});
    o.model = moe;
    o.pp = pp;
    o.micro_batches = micro;
    PipelineChoice choice;
    choice.stages = pp;
    o.stages = lm_stages(pipeline_stages(moe, choice));
    SCOPED_TRACE(cat("PP ", pp, " M ", micro));
    const std::vector<TrainMemory> predicted = predict_train_memory(o, StagingRule::in_process);
    std::vector<MemoryPool> pools(static_cast<size_t>(pp));
    LocalRunOptions run;
    run.pools = &pools;
    run_local_ranks(
        pp, [&](Communicator& comm) { train_rank(comm, o, nullptr); }, run);
    ASSERT_EQ(predicted.size(), pools.size());
    for (size_t r = 0; r < pools.size(); ++r) {
      EXPECT_EQ(predicted[r].step_peak, pools[r].peak_total()) << "stage " << r;
      EXPECT_GT(predicted[r].step_peak, predicted[r].state) << "stage " << r;
      EXPECT_EQ(pools[r].current_total(), 0) << "stage " << r;
    }
  }
}

// A resumed run with checkpoints allocates the same in the pool (the
// checkpoint's tensors are read into the state; the writer's copies are not
// the pool's), and the closed-form terms follow the options.
TEST(TrainMemory, ResumeAndCheckpointsAndTheTermsOutsideThePool) {
  const auto dir = test::scratch_dir("model_train_memory_", "resume");
  TrainOptions o = options_of({FormVariant(Form::laga), AttentionKind::flash, 2, 24, 1});
  o.checkpoint_dir = dir.string();
  o.save_every = 1;
  const std::vector<TrainMemory> fresh = predict_train_memory(o, StagingRule::in_process);
  const std::vector<MemoryPool> first = measured_pools(o);
  o.resume = dir.string();
  o.steps = 4;
  const std::vector<MemoryPool> resumed = measured_pools(o);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(fresh[r].step_peak, first[r].peak_total()) << "rank " << r;
    EXPECT_EQ(fresh[r].step_peak, resumed[r].peak_total()) << "rank " << r;
    EXPECT_LE(resumed[r].peak_held(), fresh[r].step_peak + fresh[r].cache) << "rank " << r;
  }
  // Parameters, m and v: three equal parts of the state besides the gradients.
  const std::int64_t params = 4 * [&] {
    LmParams<float> p = LmParams<float>::zeros(o.model, MemCategory::parameters);
    return p.numel();
  }();
  EXPECT_EQ(fresh[0].state, 4 * params);
  EXPECT_EQ(fresh[0].checkpoint, 3 * params);  // rank 0 writes the checkpoints
  EXPECT_EQ(fresh[1].checkpoint, 0);
  // RoPE: cos and sin of seq x dr/2 doubles; batch buffers: the window
  // (B, S+1) and the rank's tokens and targets (B, L_r), int32.
  const std::int64_t dr = o.model.mla.qk_rope_head_dim;
  EXPECT_EQ(fresh[0].rope, 2 * 24 * (dr / 2) * 8);
  EXPECT_EQ(fresh[0].batch_ids, 4 * (25 + 2 * 12));
  EXPECT_EQ(fresh[0].token_ids, 0);  // random data holds no ids
  for (const TrainMemory& m : fresh) {
    EXPECT_EQ(m.packing, 0);
    EXPECT_EQ(m.peak,
              m.rope + m.batch_ids + std::max(m.step_peak + m.cache, m.state + m.checkpoint));
  }
  // --pack-eos: the pool is the same (the documents' arrays are not pool
  // tensors); outside it, the packed targets (B, S) int32, up to S + 1 cut
  // points and, per layer, doc_start (B, S) and positions (B, L_r) int64.
  o.pack_eos = 0;
  const std::vector<TrainMemory> packed = predict_train_memory(o, StagingRule::in_process);
  EXPECT_EQ(packed[0].step_peak, fresh[0].step_peak);
  EXPECT_EQ(packed[0].packing, 4 * 24 + 8 * 25 + o.model.layers * 8 * (24 + 12));
  EXPECT_EQ(packed[0].peak, fresh[0].peak + packed[0].packing);
}

}  // namespace
}  // namespace laga
