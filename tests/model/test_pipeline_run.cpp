// laga's pipeline execution (model/pipeline.hpp) against the unpipelined
// step: PP 2-4 stages as threads, 1, 2 and 4 micro-batches, the tiny MoE
// model and a dense one, in double. One micro-batch runs the same ops in the
// same order as lm_forward_backward: loss and every gradient bitwise equal
// (against the step run at a pipeline rank's thread count: reference()).
// More micro-batches split the batch's rows, so each weight gradient is a
// sum of M GEMMs' sums instead of one: equal within 1e-12 of each tensor's
// largest element (double rounding of the reordered sums, ~1e-16 a term).
// The ledger holds each boundary's activations and gradients exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "comm/local_comm.hpp"
#include "model/pipeline.hpp"
#include "plan/pipeline.hpp"

namespace laga {
namespace {

LmConfig moe_tiny() {  // docs/assets/moe_tiny.json: 3 layers, the first dense
  const char* src = std::getenv("LAGA_SOURCE_DIR");
  return LmConfig::from_json_file(std::string(src ? src : ".") + "/docs/assets/moe_tiny.json");
}

LmConfig dense4() {
  LmConfig c = moe_tiny();
  c.moe.reset();
  c.layers = 4;
  return c;
}

LmParams<double> params(const LmConfig& cfg) {
  LmParams<double> w = LmParams<double>::zeros(cfg, MemCategory::parameters);
  init_lm_params(w, 5);
  return w;
}

using Grads = std::map<std::string, std::vector<double>>;

// Whether parameter `name` belongs to `stage` (its layers, embed, norm and head).
bool of_stage(const std::string& name, const LmStage& s) {
  if (name == "embed.weight" || name.rfind("embed", 0) == 0) return s.embedding;
  if (name.rfind("layers.", 0) == 0) {
    const std::int64_t l = std::stoll(name.substr(7));
    return l >= s.first && l < s.last;
  }
  return s.head;  // norm, head
}

struct Step {
  double loss = 0;
  Grads grads;
  std::vector<std::map<std::string, std::int64_t>> sent;  // per rank, per label
};

// The unpipelined step on one rank whose thread count is a pipeline rank's
// (rank 0 of PP in-process ranks; the others idle): the OpenMP reductions
// of a kernel split their rows by thread, so another count sums in another
// order.
Step reference(const LmConfig& cfg, int PP, const std::vector<std::int32_t>& tok,
               const std::vector<std::int32_t>& tgt, std::int64_t B, std::int64_t S) {
  Step out;
  run_local_ranks(PP, [&](Communicator& comm) {
    if (comm.rank() != 0) return;
    const std::unique_ptr<Communicator> self = make_self_communicator();
    const SpLayout layout = SpLayout::even(B, S, cfg.mla.n_heads, 1);
    const RopeTable rope(cfg.mla.rope(), S);
    const LmContext ctx{cfg, layout, *self, rope, Form::explicit_form, AttentionKind::eager};
    const LmParams<double> w = params(cfg);
    LmParams<double> g = LmParams<double>::zeros(cfg, MemCategory::gradients);
    out.loss = lm_forward_backward(ctx, w, tok.data(), tgt.data(), g);
    g.for_each([&](const std::string& n, const Tensor<double>& t) {
      out.grads[n].assign(t.data(), t.data() + t.numel());
    });
  });
  return out;
}

Step pipelined(const LmConfig& cfg, int PP, int M, const std::vector<std::int32_t>& tok,
               const std::vector<std::int32_t>& tgt, std::int64_t B, std::int64_t S) {
  Step out;
  out.sent.resize(size_t(PP));
  PipelineChoice choice;
  choice.stages = PP;
  const std::vector<LmStage> stages = lm_stages(pipeline_stages(cfg, choice));
  std::vector<double> losses(static_cast<size_t>(PP));
  std::vector<Grads> per_rank(static_cast<size_t>(PP));
  run_local_ranks(PP, [&](Communicator& comm) {
    const int r = comm.rank();
    const LmParams<double> w = params(cfg);
    LmParams<double> g = LmParams<double>::zeros(cfg, MemCategory::gradients);
    losses[size_t(r)] = pipeline_forward_backward(comm, cfg, stages, w, tok.data(), tgt.data(), B,
                                                  S, M, AttentionKind::eager, g);
    g.for_each([&](const std::string& n, const Tensor<double>& t) {
      if (of_stage(n, stages[size_t(r)]))
        per_rank[size_t(r)][n].assign(t.data(), t.data() + t.numel());
    });
    for (const auto& [key, e] : comm.ledger().entries())
      out.sent[size_t(r)][key.second] += e.bytes_sent;
  });
  for (int r = 0; r < PP; ++r) {
    EXPECT_EQ(losses[size_t(r)], losses[0]) << "rank " << r;
    for (auto& [n, v] : per_rank[size_t(r)]) out.grads[n] = std::move(v);
  }
  out.loss = losses[0];
  return out;
}

TEST(PipelineRun, OneFOneBOrderAndTicks) {
  // Stage 0 of 4 with 6 micro-batches: 3 warm-up forwards, then F/B, then 3 backwards.
  const std::vector<PipelinePass> o = one_f_one_b_order(4, 0, 6);
  ASSERT_EQ(o.size(), 12u);
  EXPECT_EQ(o[0], (PipelinePass{true, 0}));
  EXPECT_EQ(o[3], (PipelinePass{true, 3}));
  EXPECT_EQ(o[4], (PipelinePass{false, 0}));
  EXPECT_EQ(o.back(), (PipelinePass{false, 5}));
  // Every pass runs once, after what it needs.
  const auto ticks = pipeline_ticks(4, 6);
  std::map<std::tuple<int, bool, int>, int> at;
  for (size_t t = 0; t < ticks.size(); ++t)
    for (int s = 0; s < 4; ++s)
      if (ticks[t][size_t(s)]) {
        const PipelinePass p = *ticks[t][size_t(s)];
        ASSERT_TRUE(at.emplace(std::tuple{s, p.forward, p.micro_batch}, int(t)).second);
        if (p.forward && s > 0) {
          EXPECT_LT(at.at({s - 1, true, p.micro_batch}), int(t));
        }
        if (!p.forward && s < 3) {
          EXPECT_LT(at.at({s + 1, false, p.micro_batch}), int(t));
        }
      }
  EXPECT_EQ(at.size(), 4u * 6 * 2);
}

TEST(PipelineRun, EqualsTheUnpipelinedStep) {
  const std::int64_t B = 4, S = 16;
  for (const LmConfig& cfg : {moe_tiny(), dense4()}) {
    std::mt19937 rng(3);
    std::vector<std::int32_t> tok(size_t(B * S)), tgt(size_t(B * S));
    for (auto& t : tok) t = std::int32_t(rng() % std::uint32_t(cfg.vocab));
    for (auto& t : tgt) t = std::int32_t(rng() % std::uint32_t(cfg.vocab));
    for (int PP : {2, 3}) {
      const Step ref = reference(cfg, PP, tok, tgt, B, S);
      for (int M : {1, 2, 4}) {
        Step p = pipelined(cfg, PP, M, tok, tgt, B, S);
        SCOPED_TRACE(cfg.summary() + " PP " + std::to_string(PP) + " M " + std::to_string(M));
        ASSERT_EQ(p.grads.size(), ref.grads.size());
        if (M == 1) {
          EXPECT_EQ(p.loss, ref.loss);
        } else {
          EXPECT_NEAR(p.loss, ref.loss, 1e-12 * std::abs(ref.loss));
        }
        for (const auto& [n, want] : ref.grads) {
          const std::vector<double>& got = p.grads.at(n);
          double big = 0;
          for (double v : want) big = std::max(big, std::abs(v));
          for (size_t i = 0; i < want.size(); ++i) {
            if (M == 1)
              ASSERT_EQ(got[i], want[i]) << n << "[" << i << "] " << (got[i] - want[i]) / big;
            else
              ASSERT_NEAR(got[i], want[i], 1e-12 * big) << n << "[" << i << "]";
          }
        }
        // Each boundary: M micro-batches of (B/M S, D) doubles each way.
        const std::int64_t boundary = B * S * cfg.dim() * 8;
        for (int r = 0; r < PP; ++r) {
          EXPECT_EQ(p.sent[size_t(r)]["pp_activation"], r < PP - 1 ? boundary : 0) << r;
          EXPECT_EQ(p.sent[size_t(r)]["pp_gradient"], r > 0 ? boundary : 0) << r;
        }
      }
    }
  }
}

TEST(PipelineRun, FourStagesOfTheDenseModel) {
  const LmConfig cfg = dense4();
  const std::int64_t B = 4, S = 8;
  std::vector<std::int32_t> tok(size_t(B * S)), tgt(size_t(B * S));
  for (size_t i = 0; i < tok.size(); ++i)
    tok[i] = std::int32_t(i * 7 % 97), tgt[i] = std::int32_t(i * 5 % 89);
  const Step ref = reference(cfg, 4, tok, tgt, B, S);
  const Step p = pipelined(cfg, 4, 1, tok, tgt, B, S);
  EXPECT_EQ(p.loss, ref.loss);
  for (const auto& [n, want] : ref.grads) EXPECT_EQ(p.grads.at(n), want) << n;
}

}  // namespace
}  // namespace laga
