// The time model's inputs: op counts from the count-only run equal those of
// a run with storage (so the planner reads what really runs), a linear's
// count is its GEMM's 2 M N K, ranks fall into the right classes, and a
// rank's communication time is the link model's, collective by collective.
#include <gtest/gtest.h>

#include "comm/dry_run_comm.hpp"
#include "common/error_of.hpp"
#include "mla/memory_model.hpp"
#include "mla/runner.hpp"
#include "plan/time_model.hpp"

namespace laga {
namespace {

MlaConfig tiny() {
  MlaConfig c = MlaConfig::preset("tiny");
  c.q_lora_rank = 16;  // the query latent's ops too
  return c;
}

TEST(OpCounts, ALinearCountsItsGemm) {
  MemoryPool pool;
  pool.set_count_only(true);
  PoolScope scope(pool);
  TensorF x({5, 7}), y({5, 3}), w({3, 7});
  ops::OpCounts c;
  {
    const ops::CountOps counting(c);
    ops::linear(ops::mat(y), ops::mat(x), w);
  }
  EXPECT_EQ(c.gemm_flops, 2.0 * 5 * 7 * 3);
  ops::linear(ops::mat(y), ops::mat(x), w);  // no counter: nothing added
  EXPECT_EQ(c.gemm_flops, 2.0 * 5 * 7 * 3);
}

// The count-only run counts exactly what a run with storage does, for every
// form and attention kernel, on uneven shards.
TEST(OpCounts, CountOnlyEqualsARealRun) {
  const MlaConfig cfg = tiny();
  const SpLayout lay = SpLayout::even(2, 11, cfg.n_heads, 3);
  const RopeTable rope(cfg.rope(), lay.seq);
  for (FormVariant f : {FormVariant(Form::explicit_form), FormVariant(Form::absorbed),
                        FormVariant(Form::laga), FormVariant(Form::laga, QueryExchange::latent)})
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
      for (int r = 0; r < lay.ranks; ++r) {
        ops::OpCounts counted, real;
        MemoryModelOptions o;
        o.op_counts = &counted;
        predict_memory(cfg, lay, f, a, r, 4, o);
        {
          MemoryPool pool;
          PoolScope scope(pool);
          const MlaParams<float> w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
          const TensorF x({lay.batch, lay.seq, cfg.dim}), dout({lay.batch, lay.seq, cfg.dim});
          DryRunCommunicator comm(r, lay.ranks);
          RunSpec spec;
          spec.form = f.form;
          spec.queries = f.queries;
          spec.attention = a;
          const ops::CountOps counting(real);
          run_rank(comm, cfg, lay, rope, w, x, dout, spec);
        }
        const std::string where = to_string(f) + " rank " + std::to_string(r);
        EXPECT_GT(counted.gemm_flops, 0) << where;
        EXPECT_GT(counted.attention_flops, 0) << where;
        EXPECT_EQ(counted.gemm_flops, real.gemm_flops) << where;
        EXPECT_EQ(counted.attention_flops, real.attention_flops) << where;
        EXPECT_EQ(counted.elementwise_bytes, real.elementwise_bytes) << where;
      }
}

TEST(TimeModel, RankClassesGroupRanksWithTheSameWork) {
  const MlaConfig cfg = tiny();  // 4 heads
  // S 10 over 4 ranks: tokens 3+3+2+2, heads 1 each.
  const RankClasses c = rank_classes(cfg, SpLayout::even(1, 10, cfg.n_heads, 4));
  ASSERT_EQ(c.class_of.size(), 4u);
  EXPECT_EQ(c.class_of[0], c.class_of[1]);
  EXPECT_EQ(c.class_of[2], c.class_of[3]);
  EXPECT_NE(c.class_of[0], c.class_of[2]);
  EXPECT_EQ(c.representatives, (std::vector<int>{0, 2}));
}

TEST(TimeModel, CommunicationIsTheLinkModelPerCollective) {
  const MlaConfig cfg = tiny();
  const SpLayout lay = SpLayout::even(1, 64, cfg.n_heads, 2);
  const HardwareProfile prof = load_profile("h100");
  for (FormVariant f : {FormVariant(Form::explicit_form), FormVariant(Form::laga)}) {
    const RankWork w = rank_work(cfg, lay, f, AttentionKind::flash, 0, PlanDType::fp32);
    const Fabric fabric = single_level({10e9, 20e-6, Topology::switched});
    const auto t = rank_time(w, 2, prof, PlanDType::fp32, fabric);
    std::array<double, 3> want{};
    for (const auto& [key, b] : w.comm)
      want[size_t(key.first)] += collective_seconds(b.kind, 2, {b.sent, b.received}, fabric);
    for (size_t ph = 0; ph < 3; ++ph) EXPECT_DOUBLE_EQ(t[ph].comm_s, want[ph]) << ph;
    // bf16 counts the same FLOPs and half the bytes.
    const RankWork h = rank_work(cfg, lay, f, AttentionKind::flash, 0, PlanDType::bf16);
    for (size_t ph = 0; ph < 3; ++ph) {
      EXPECT_EQ(h.ops[ph].gemm_flops, w.ops[ph].gemm_flops);
      EXPECT_EQ(2 * h.ops[ph].elementwise_bytes, w.ops[ph].elementwise_bytes);
    }
  }
}

TEST(TimeModel, NodesMustHoldTheRanks) {
  const HardwareProfile prof = load_profile("h100");  // 8 per node
  EXPECT_EQ(plan_links(prof, 8, 0, {}, {}).nodes, 1);
  EXPECT_EQ(plan_links(prof, 64, 0, {}, {}).nodes, 8);
  EXPECT_EQ(plan_links(prof, 64, 0, {}, {}).fabric.ranks_per_node, 8);
  EXPECT_EQ(plan_links(prof, 16, 4, {}, {}).fabric.ranks_per_node, 4);
  const PlanLinks over = plan_links(prof, 16, 0, 1e9, 2e-6);
  EXPECT_EQ(over.fabric.intra.bytes_per_s, 1e9);
  EXPECT_EQ(over.fabric.inter.latency_s, 2e-6);
  EXPECT_NE(test::error_of([&] {
              plan_links(prof, 16, 1, {}, {});
            }).find("puts 16 ranks on a node, but profile h100 has 8 devices per node"),
            std::string::npos);
}

}  // namespace
}  // namespace laga
