// The team grid (plan/plan_search.hpp, `laga plan --search`): DeepSeek-V3 at
// S 4K on H100s finds a pipelined plan with the experts over the replicas,
// at a per-device load and MFU a reader would believe, where the old default
// (EP = P, no stages) found 512 devices at 0.7% MFU or nothing.
#include <gtest/gtest.h>

#include <cstdio>

#include "model/model.hpp"
#include "plan/hardware_profile.hpp"
#include "plan/plan_search.hpp"

namespace laga {
namespace {

ModelPlanRequest v3_at_4k() {
  ModelPlanRequest q;
  q.model = LmConfig::preset("deepseek-v3");
  q.block.cfg = q.model.mla;
  q.block.seqs = {4096};
  q.block.forms = {Form::explicit_form, Form::laga_fused};
  q.block.attention = AttentionKind::flash;
  q.block.dtype = PlanDType::bf16;
  q.block.profile = load_profile("h100");
  return with_team_grid(q);
}

const ModelPlan& chosen(const ModelPlanResult& r, const MinDevices& d) {
  for (const ModelPlanCase& c : r.cases)
    if (c.seq == d.seq && c.sp == d.sp && c.dp == d.dp && c.pp == d.pp)
      for (const ModelPlan& f : c.forms)
        if (f.form == d.form && f.fits) return f;
  throw Error("the chosen plan is not among the cases");
}

TEST(PlanSearch, DeepSeekV3At4KOnH100IsPipelinedWithExpertsOverReplicas) {
  const ModelPlanRequest q = v3_at_4k();
  const ModelPlanResult r = make_model_plans(q);
  ASSERT_EQ(r.min_devices.size(), 1u);
  const MinDevices& d = r.min_devices[0];
  ASSERT_TRUE(d.found);
  const ModelPlan& p = chosen(r, d);
  const double tokens_per_device = 4096.0 / d.sp;  // per micro-batch
  std::printf(
      "fewest: %d devices = P %d x DP %d x PP %d, EP %d, %s, %.0f tokens a device a "
      "micro-batch, %.0f tokens/s/device, MFU %.1f%%, %.1f GB\n",
      d.sp * d.dp * d.pp, d.sp, d.dp, d.pp, p.ep, to_string(d.form).c_str(), tokens_per_device,
      p.tokens_per_s_per_device, 100 * p.mfu, p.memory_bytes() / 1e9);
  EXPECT_GT(d.pp, 1);
  EXPECT_GT(d.dp, 1);
  EXPECT_GT(p.ep, d.sp);  // the experts over the replicas too
  // The global batch: 15360 sequences over the replicas, one a micro-batch.
  for (const ModelPlanCase& c : r.cases) {
    if (c.dp != d.dp) continue;
    EXPECT_EQ(c.micro_batches, 15360 / d.dp);
  }
  // Sane: a device holds at least 256 tokens a micro-batch (not the old
  // default's 16) and the plan runs at 15-60% MFU (not 0.7%).
  EXPECT_GE(tokens_per_device, 256);
  EXPECT_GE(p.mfu, 0.15);
  EXPECT_LE(p.mfu, 0.60);
  EXPECT_LE(p.memory_bytes(), q.block.profile.device.memory_bytes);
  // The MFU agrees with 6 x the activated parameters a token (the FFN's k of
  // E routed experts, no embedding) at the plan's tokens/s: attention adds
  // the rest, at 4K a few tenths at most.
  const ModelParamCounts n = model_param_counts(q.model);
  const double k = double(q.model.moe->num_experts_per_tok),
               E = double(q.model.moe->n_routed_experts);
  const double active =
      double(n.total() - n.embedding - n.mtp_projection) - double(n.routed_experts) * (1 - k / E);
  const double mfu_6n =
      p.tokens_per_s_per_device * 6 * active / q.block.profile.peak_flops(PlanDType::bf16);
  std::printf("6N MFU %.1f%% (N %.3gB activated)\n", 100 * mfu_6n, active / 1e9);
  EXPECT_GT(mfu_6n, 0.6 * p.mfu);
  EXPECT_LT(mfu_6n, p.mfu);
}

// At equal devices the pick is the most tokens a second a device, not the
// shortest step (which favoured fewer replicas: a step of fewer tokens).
TEST(PlanSearch, FewestDevicesBreaksTiesByThroughput) {
  ModelPlanCase a, b;
  a.seq = b.seq = 4096;
  a.sp = 2, a.dp = 1, a.pp = 2;
  b.sp = 1, b.dp = 2, b.pp = 2;
  ModelPlan fa, fb;
  fa.fits = fb.fits = true;
  fa.step_s = 1.0, fa.tokens_per_s_per_device = 100;
  fb.step_s = 1.5, fb.tokens_per_s_per_device = 130;
  a.forms = {fa}, b.forms = {fb};
  a.winner = b.winner = 0;
  const MinDevices m = fewest_devices({a, b}, 4096);
  ASSERT_TRUE(m.found);
  EXPECT_EQ(m.dp, 2);
  EXPECT_EQ(fewest_devices({b, a}, 4096).dp, 2);
}

}  // namespace
}  // namespace laga
