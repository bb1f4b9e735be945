// Node-limited routing's bytes (plan/node_routing.hpp): the hops counted by
// hand on a tiny placement, and `laga plan --node-limit`'s bytes equal to
// the count-only run's ledger of laga's router, link by link.
#include <gtest/gtest.h>

#include <cstdio>

#include "model/model.hpp"
#include "plan/hardware_profile.hpp"
#include "plan/model_plan.hpp"
#include "plan/node_routing.hpp"
#include "plan/pipeline.hpp"

namespace laga {
namespace {

std::int64_t sent(const Ledger& l, const std::string& label) {
  const auto it = l.entries().find({Phase::forward, label});
  return it == l.entries().end() ? 0 : it->second.bytes_sent;
}

// EP 4 over 2 nodes of 2 devices, 8 experts (2 a device), k 2. Rank 0 is
// node 0's index 0; rank 3 node 1's index 1.
TEST(NodeRouting, HopsCountedByHand) {
  const NodeTopology t{4, 2, 2};
  // Rank r's one token: its two experts (devices e / 2).
  //   rank 0: 2, 6  devices 1, 3: node 0 from 0 to 1 (intra); node 1 lands
  //                 on 2 (inter 0->2), forwarded to 3 (intra 2->3)
  //   rank 1: 4, 5  device 2 twice: one row, landing on 3 (inter 1->3),
  //                 forwarded to 2 (intra 3->2)
  //   rank 2: 4, 0  device 2 (its own: nothing), device 0: lands on 0 (inter 2->0)
  //   rank 3: 7, 6  device 3, its own: nothing sent
  const std::vector<std::int32_t> expert{2, 6, 4, 5, 4, 0, 7, 6};
  const NodeDispatchRows r = node_dispatch_rows(expert, 2, 8, 1, t);
  const auto at = [](const std::vector<std::int64_t>& m, int i, int j) {
    return m[size_t(i * 4 + j)];
  };
  EXPECT_EQ(at(r.inter, 0, 2), 1);
  EXPECT_EQ(at(r.inter, 1, 3), 1);
  EXPECT_EQ(at(r.inter, 2, 0), 1);
  EXPECT_EQ(r.inter_total(), 3);
  EXPECT_EQ(at(r.intra, 0, 1), 1);
  EXPECT_EQ(at(r.intra, 2, 3), 1);
  EXPECT_EQ(at(r.intra, 3, 2), 1);
  EXPECT_EQ(r.intra_total(), 3);
  EXPECT_EQ(r.most_nodes, 2);
  // The ledgers: D 16 bf16 rows; the combine sends the dispatch's rows back.
  const std::vector<Ledger> l = node_dispatch_ledgers(r, 16);
  ASSERT_EQ(l.size(), 4u);
  EXPECT_EQ(sent(l[0], "moe_dispatch_inter"), 32);
  EXPECT_EQ(sent(l[0], "moe_dispatch_intra"), 32);
  EXPECT_EQ(sent(l[2], "moe_dispatch_intra"), 32);
  EXPECT_EQ(sent(l[3], "moe_dispatch_inter"), 0);
  EXPECT_EQ(sent(l[2], "moe_combine_inter"), 32);  // back to rank 0
  EXPECT_EQ(sent(l[0], "moe_combine_inter"), 32);  // back to rank 2
  EXPECT_EQ(sent(l[1], "moe_combine_intra"), 32);  // back to rank 0
  EXPECT_EQ(sent(l[3], "moe_combine_intra"), 32);  // back to rank 2
}

// DeepSeek-V3 (EP 64 over 8 nodes, 4 a token): the planner's bytes of one
// exchange are the count-only run's ledger, mean over the ranks, exactly;
// the router keeps the limit; and the uniform closed form
// (node_limited_copies) under-counts the inter-node rows, as docs say.
TEST(NodeRouting, PlannerChargesTheCountOnlyLedger) {
  const LmConfig v3 = LmConfig::preset("deepseek-v3");
  const MoeConfig& m = *v3.moe;
  const NodeTopology t{64, 8, 4};
  const std::int64_t N = 64, D = v3.dim();
  const NodeDispatchRows rows = routed_node_dispatch_rows(m, t, N);
  EXPECT_LE(rows.most_nodes, 4);
  EXPECT_EQ(rows.most_nodes, 4);
  const std::vector<Ledger> ledgers = node_dispatch_ledgers(rows, D);
  std::int64_t di = 0, dn = 0, ci = 0, cn = 0;
  for (const Ledger& l : ledgers) {
    di += sent(l, "moe_dispatch_inter"), dn += sent(l, "moe_dispatch_intra");
    ci += sent(l, "moe_combine_inter"), cn += sent(l, "moe_combine_intra");
  }
  EXPECT_EQ(di, ci);
  EXPECT_EQ(dn, cn);
  const NodeExchangeBytes plan = node_limited_exchange_bytes(m, t, N, double(D) * 2);
  EXPECT_EQ(plan.inter, double(di) / 64);
  EXPECT_EQ(plan.intra, double(dn) / 64);
  const LinkCopies uniform = node_limited_copies(256, 8, 64, 8, 4);
  const double routed_inter = double(rows.inter_total()) / double(64 * N);
  const double routed_intra = double(rows.intra_total()) / double(64 * N);
  std::printf("rows a token: routed inter %.4f intra %.4f; uniform closed form %.4f %.4f\n",
              routed_inter, routed_intra, uniform.inter, uniform.intra);
  EXPECT_GT(routed_inter, uniform.inter * 1.03);
}

// The same equality through a whole plan: `--node-limit 4` at EP 64 (DP 64
// replicas of P 1, --ep max), S 64 (N 64 a rank): every MoE layer's four
// exchanges (dispatch, combine forward; dmoe_combine, dmoe_dispatch) of
// every micro-batch, across nodes, are the ledger's.
TEST(NodeRouting, ModelPlanInterNodeBytesAreTheLedgers) {
  ModelPlanRequest q;
  q.model = LmConfig::preset("deepseek-v3");
  q.model.layers = 5;  // 3 dense, 2 MoE: the bytes per MoE layer are what is checked
  q.block.cfg = q.model.mla;
  q.block.seqs = {64};
  q.block.sps = {1};
  q.block.forms = {Form::explicit_form};
  q.block.attention = AttentionKind::flash;
  q.block.dtype = PlanDType::bf16;
  q.block.profile = load_profile("h800");
  q.dps = {64};
  q.ep = {EpRule::max, 0};
  q.node_limit = 4;
  q.micro_batches = 3;
  const ModelPlanResult r = make_model_plans(q);
  ASSERT_EQ(r.cases.size(), 1u);
  const ModelPlan& p = r.cases[0].forms[0];
  ASSERT_EQ(p.ep, 64);
  const NodeDispatchRows rows = routed_node_dispatch_rows(*q.model.moe, {64, 8, 4}, 64);
  std::int64_t inter = 0, all = 0;
  for (const Ledger& l : node_dispatch_ledgers(rows, q.model.dim())) {
    inter += sent(l, "moe_dispatch_inter") + sent(l, "moe_combine_inter");
    all += l.bytes_sent();
  }
  // Forward and backward (2 passes), 2 MoE layers, 3 micro-batches.
  EXPECT_DOUBLE_EQ(p.moe_a2a_inter_node_bytes_per_rank, 3.0 * 2 * 2 * double(inter) / 64);
  const double counts = moe_counts_bytes(256, 64);
  EXPECT_DOUBLE_EQ(p.moe_a2a_bytes_per_rank, 3.0 * 2 * (2 * double(all) / 64 + counts));
}

TEST(NodeRouting, RefusesWhatDoesNotFit) {
  const MoeConfig m = *LmConfig::preset("deepseek-v3").moe;
  EXPECT_THROW(node_limited_gate(m, {64, 8, 9}), Error);   // 9 of 8 nodes
  EXPECT_THROW(node_limited_gate(m, {60, 8, 4}), Error);   // not whole nodes
  EXPECT_THROW(node_limited_gate(m, {64, 8, 0}), Error);   // no node
  EXPECT_EQ(node_limited_gate(m, {64, 8, 4}).n_group, 8);  // V3's own groups
}

}  // namespace
}  // namespace laga
