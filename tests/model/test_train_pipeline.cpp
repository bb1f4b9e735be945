// `laga train --pp`: the training loop with its ranks as pipeline stages
// (model/pipeline.hpp, the plan's placement of the layers) against the same
// run unpipelined, in fp32. The losses, gradient norms and expert loads of
// every step, and the parameters and AdamW moments a checkpoint holds after
// the last (gathered from each stage's owner), agree within fp32 rounding of
// reordered sums: a stage's kernels run on another OpenMP thread count than
// the unpipelined rank's and micro-batches split the weight gradients' row
// sums, so no step is bitwise. Measured after 4 steps (the norm of each
// tensor's difference over the norm of its update): weights within 1.8e-4 at
// PP 4, M 4 and 3e-6 at PP 3, M 1; the moments within 2.3e-5. The bound is
// 1e-3; a tensor left stale would score 1. The double-precision step itself
// is equal to 1e-12 in model_test_pipeline_run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "common/error_of.hpp"
#include "common/scratch.hpp"
#include "model/checkpoint.hpp"
#include "model/train.hpp"
#include "plan/pipeline.hpp"

namespace laga {
namespace {

namespace fs = std::filesystem;

LmConfig moe_tiny(std::int64_t layers) {  // docs/assets/moe_tiny.json, the first layer dense
  const char* src = std::getenv("LAGA_SOURCE_DIR");
  LmConfig c =
      LmConfig::from_json_file(std::string(src ? src : ".") + "/docs/assets/moe_tiny.json");
  c.layers = layers;
  return c;
}

TrainOptions options(const LmConfig& cfg, int pp, std::int64_t micro_batches,
                     const std::string& dir) {
  TrainOptions o;
  o.model = cfg;
  o.variant.form = Form::laga;  // train's default form, on each stage's one rank
  o.attention = AttentionKind::flash;
  o.batch = 4;
  o.seq = 32;
  o.steps = 4;
  o.seed = 11;
  o.adam.lr = 3e-3;
  o.clip = 1.0;
  o.pp = pp;
  o.micro_batches = micro_batches;
  if (pp > 1) {
    PipelineChoice choice;
    choice.stages = pp;
    o.stages = lm_stages(pipeline_stages(cfg, choice));
  }
  o.checkpoint_dir = dir;
  return o;
}

TrainState<float> saved(const LmConfig& cfg, const std::string& dir) {
  TrainState<float> st;
  st.params = LmParams<float>::zeros(cfg, MemCategory::parameters);
  st.m = LmParams<float>::zeros(cfg, MemCategory::optimizer);
  st.v = LmParams<float>::zeros(cfg, MemCategory::optimizer);
  load_checkpoint(dir, cfg, st);
  return st;
}

std::map<std::string, std::vector<float>> tensors(LmParams<float>& p) {
  std::map<std::string, std::vector<float>> out;
  p.for_each([&](const std::string& n, Tensor<float>& t) {
    out[n].assign(t.data(), t.data() + t.numel());
  });
  return out;
}

// The largest over tensors of ||got - want|| / ||want - from||: each
// tensor's difference between the runs against how far the unpipelined run
// moved it from `from` (the initial weights, or zero moments). A tensor a
// stage's owner did not send to rank 0 (stale: still `from`) scores 1.
// Rounding alone scores far less: an AdamW update is about lr a step
// whatever the gradient's scale, so an element whose gradient is a sum that
// cancels to ~0 may move by another sign in the two runs, but few do.
double worst_relative(LmParams<float>& want_p, LmParams<float>& got_p, LmParams<float>& from_p,
                      std::string* where) {
  auto want = tensors(want_p), got = tensors(got_p), from = tensors(from_p);
  double worst = 0;
  for (const auto& [n, w] : want) {
    const std::vector<float>&g = got.at(n), &f = from.at(n);
    double moved = 0, diff = 0;
    for (size_t i = 0; i < w.size(); ++i)
      moved += double(w[i] - f[i]) * double(w[i] - f[i]),
          diff += double(w[i] - g[i]) * double(w[i] - g[i]);
    if (moved == 0) continue;  // never updated (the experts' biases without load, norms at 0 lr)
    if (std::sqrt(diff / moved) > worst) worst = std::sqrt(diff / moved), *where = n;
  }
  return worst;
}

TEST(TrainPipeline, StagesTrainAsTheUnpipelinedRun) {
  struct Case {
    std::int64_t layers;
    int pp;
    std::int64_t micro_batches;
  };
  for (const Case k : {Case{3, 2, 2}, Case{3, 3, 1}, Case{4, 4, 4}}) {
    const LmConfig cfg = moe_tiny(k.layers);
    SCOPED_TRACE("layers " + std::to_string(k.layers) + " PP " + std::to_string(k.pp) + " M " +
                 std::to_string(k.micro_batches));
    const fs::path dir = test::scratch_dir("model_train_pipeline_", std::to_string(k.pp));
    const auto ref = train_local(options(cfg, 1, 1, (dir / "ref").string()));
    const auto got = train_local(options(cfg, k.pp, k.micro_batches, (dir / "pp").string()));
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_NEAR(got[i].loss, ref[i].loss, 1e-5 * ref[i].loss) << "step " << i + 1;
      EXPECT_NEAR(got[i].grad_norm, ref[i].grad_norm, 1e-4 * ref[i].grad_norm) << "step " << i + 1;
    }
    // The bias balancing's load, summed over the stages: the same routing.
    EXPECT_EQ(got[0].expert_load, ref[0].expert_load);
    EXPECT_FALSE(ref[0].expert_load.empty());
    TrainState<float> a = saved(cfg, (dir / "ref").string()), b = saved(cfg, (dir / "pp").string());
    // Every stage's tensors reached rank 0's checkpoint: a stale one (the
    // initial weights, zero moments) would differ by its whole update.
    LmParams<float> init = LmParams<float>::zeros(cfg, MemCategory::parameters),
                    zero = LmParams<float>::zeros(cfg, MemCategory::optimizer);
    init_lm_params(init, 11);
    std::string where;
    const double w = worst_relative(a.params, b.params, init, &where);
    EXPECT_LT(w, 1e-3) << where;
    const double m = worst_relative(a.m, b.m, zero, &where);
    EXPECT_LT(m, 1e-3) << where;
    const double v = worst_relative(a.v, b.v, zero, &where);
    EXPECT_LT(v, 1e-3) << where;
    std::printf("PP %d M %lld: weights' updates within %.2e, m %.2e, v %.2e\n", k.pp,
                (long long)k.micro_batches, w, m, v);
  }
}

// A non-finite gradient on one stage stops the step on every stage before
// its update (the norm's square is all-reduced), and every rank's message
// names that stage from the all-reduced flags (only the stage's own rank
// sees its tensors), so the words are the same on each.
TEST(TrainPipeline, NonFiniteGradientNamesItsStage) {
  const LmConfig cfg = moe_tiny(3);
  TrainOptions o = options(cfg, 3, 1, "");
  o.after_backward = [&](std::int64_t step, const LmParams<float>&, LmParams<float>& grads) {
    // Stage 1 holds layer 1; the others' copies of it stay 0.
    if (step == 2 && grads.layers[1].ffn_norm[0] != 0.0f)
      grads.layers[1].ffn_norm[0] = std::numeric_limits<float>::quiet_NaN();
  };
  const std::string e = test::error_of([&] { train_local(o); });
  EXPECT_NE(e.find("the gradient at step 2 is not finite"), std::string::npos) << e;
  EXPECT_NE(e.find("on pipeline stage 1 (layers [1, 2))"), std::string::npos) << e;
}

TEST(TrainPipeline, RefusalsNameTheOptionAndTheFix) {
  const LmConfig cfg = moe_tiny(3);
  TrainOptions o = options(cfg, 2, 3, "");
  EXPECT_NE(test::error_of([&] {
              validate_train_options(o);
            }).find("--micro-batches 3 must divide --batch 4"),
            std::string::npos);
  o = options(cfg, 2, 2, "");
  o.sp = 2;
  EXPECT_NE(test::error_of([&] { validate_train_options(o); })
                .find("--pp 2 runs one rank a stage; --sp 2 (sequence parallelism) within a stage "
                      "is not supported yet"),
            std::string::npos);
  o = options(cfg, 1, 2, "");
  EXPECT_NE(test::error_of([&] { validate_train_options(o); }).find("add --pp N"),
            std::string::npos);
  o = options(cfg, 2, 1, "");
  o.stages.pop_back();
  EXPECT_NE(test::error_of([&] { validate_train_options(o); }).find("1 pipeline stages for --pp 2"),
            std::string::npos);
}

}  // namespace
}  // namespace laga
