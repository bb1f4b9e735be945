// Finite-difference checks, in double, of the whole MLA block's backward with
// respect to the input and every parameter: rq = 0 and rq > 0, YaRN on and
// off, each form with eager and flash attention on one rank, and each form
// and attention kind at P = 2 and 3 (ranks as threads, uneven shards, a rank
// with no head): there the analytic gradient is the all-reduced one of the
// whole sequence-parallel step and the loss is the group's assembled output.
// laga and laga2d with the query-latent exchange (rq > 0) under all of these
// too. Under the sanitizers (common/sanitized.hpp) each tensor is sampled at
// a few elements, first and last included: every case's forward and backward
// still run there; the main pass checks every element (rank 1) and 24 a
// tensor (P 2 and 3).
#include <gtest/gtest.h>

#include <memory>
#include <numeric>

#include "comm/communicator.hpp"
#include "common/check.hpp"
#include "common/sanitized.hpp"
#include "mla/block.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

// Elements checked a tensor under the sanitizers: first, middle, last.
constexpr std::int64_t kSanitizedElements = 3;

struct GradCase {
  const char* name;
  std::int64_t rq;
  bool yarn;
  Form form;
  AttentionKind attention;
  QueryExchange queries = QueryExchange::heads;
};

// "laga", "laga_qlatent": a test name's spelling of the variant.
std::string name_of(Form f, QueryExchange q) {
  return std::string(to_string(f)) + (q == QueryExchange::latent ? "_qlatent" : "");
}

MlaConfig tiny_config(std::int64_t rq, bool yarn) {
  MlaConfig c;
  c.dim = 10, c.n_heads = 3, c.q_lora_rank = rq, c.kv_lora_rank = 6, c.qk_nope_head_dim = 4,
  c.qk_rope_head_dim = 4, c.v_head_dim = 3;
  if (yarn) {
    // A small original context so the 4 rope dims straddle YaRN's ramp.
    c.rope_theta = 500, c.original_seq_len = 64, c.max_seq_len = 256, c.rope_factor = 8;
    c.mscale = 0.7;
  } else {
    c.original_seq_len = c.max_seq_len = 4096;
  }
  c.validate();
  return c;
}

class BlockGrad : public ::testing::TestWithParam<GradCase> {};

TEST_P(BlockGrad, MatchesFiniteDifferences) {
  const GradCase& gc = GetParam();
  const MlaConfig cfg = tiny_config(gc.rq, gc.yarn);
  const std::int64_t B = 2, S = 5;
  const SpLayout lay = SpLayout::even(B, S, cfg.n_heads, 1);
  const RopeTable rope(cfg.rope(), S);
  auto comm = make_self_communicator();
  const BlockContext ctx{cfg, lay, *comm, rope, {gc.form, gc.queries}, gc.attention, nullptr};

  auto w = MlaParams<double>::zeros(cfg, MemCategory::parameters);
  init_params(w, 7, 0.1);
  TensorD x({B, S, cfg.dim}), g({B, S, cfg.dim});
  test::fill_random(x.data(), x.numel(), 11);
  test::fill_random(g.data(), g.numel(), 12);

  // L = <G, out(x, W)>; its gradient is backward with dout = G.
  auto loss = [&] {
    TensorD out;
    MlaSaved<double> saved;
    mla_forward(ctx, w, x, out, saved);
    return test::dot(out.data(), g.data(), out.numel());
  };
  TensorD out, dx;
  MlaSaved<double> saved;
  auto grads = MlaParams<double>::zeros(cfg, MemCategory::gradients);
  mla_forward(ctx, w, x, out, saved);
  mla_backward(ctx, w, x, g, saved, dx, grads);

  test::GradientCheck check;
  check.add("x", x.data(), dx.data(), x.shape());
  std::vector<std::pair<std::string, TensorD*>> wp, gp;
  w.for_each([&](const std::string& name, TensorD& t) { wp.push_back({name, &t}); });
  grads.for_each([&](const std::string& name, TensorD& t) { gp.push_back({name, &t}); });
  ASSERT_EQ(wp.size(), gp.size());
  for (std::size_t i = 0; i < wp.size(); ++i) {
    ASSERT_EQ(wp[i].first, gp[i].first);
    check.add(wp[i].first, wp[i].second->data(), gp[i].second->data(), wp[i].second->shape());
  }
  test::GradCheckOptions opt;
  opt.tol = 1e-6;
  opt.floor_per_tensor = true;
  opt.max_elements = test::kSanitized ? kSanitizedElements : 0;  // 0: every element
  EXPECT_TRUE(check.run(loss, opt));
}

std::vector<GradCase> cases() {
  std::vector<GradCase> v;
  for (Form f : all_forms())
    for (std::int64_t rq : {0, 5})
      for (bool yarn : {false, true}) v.push_back({"", rq, yarn, f, AttentionKind::eager});
  for (Form f : all_forms()) v.push_back({"", 5, true, f, AttentionKind::flash});
  for (Form f : forms_with(&FormTraits::query_latent)) {
    for (bool yarn : {false, true})
      v.push_back({"", 5, yarn, f, AttentionKind::eager, QueryExchange::latent});
    v.push_back({"", 5, true, f, AttentionKind::flash, QueryExchange::latent});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllForms, BlockGrad, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<GradCase>& p) {
                           const GradCase& c = p.param;
                           return name_of(c.form, c.queries) + "_rq" + std::to_string(c.rq) +
                                  (c.yarn ? "_yarn" : "_rope") + "_" + to_string(c.attention);
                         });

struct SpCase {
  Form form;
  AttentionKind attention;
  std::vector<std::int64_t> seq, heads;  // per-rank shards; sizes give P
  QueryExchange queries = QueryExchange::heads;
  // zigzag: SpLayout::even's zigzag shards of sum(seq) tokens over seq.size()
  // ranks instead (heads split evenly).
  SeqLayout layout = SeqLayout::contiguous;
};

class BlockGradSp : public ::testing::TestWithParam<SpCase> {};

TEST_P(BlockGradSp, MatchesFiniteDifferences) {
  const SpCase& sc = GetParam();
  const MlaConfig cfg = tiny_config(5, true);
  const std::int64_t B = 2;
  const SpLayout lay = sc.layout == SeqLayout::zigzag
                           ? SpLayout::even(B, std::accumulate(sc.seq.begin(), sc.seq.end(), 0),
                                            cfg.n_heads, int(sc.seq.size()), sc.layout)
                           : SpLayout::custom(B, sc.seq, sc.heads);
  auto w = MlaParams<double>::zeros(cfg, MemCategory::parameters);
  init_params(w, 7, 0.1);
  TensorD x({B, lay.seq, cfg.dim}), g({B, lay.seq, cfg.dim});
  test::fill_random(x.data(), x.numel(), 11);
  test::fill_random(g.data(), g.numel(), 12);
  RunSpec spec;
  spec.variant.form = sc.form;
  spec.attention = sc.attention;
  spec.variant.queries = sc.queries;
  BlockRun<double> run = run_local(cfg, lay, w, x, g, spec);

  spec.backward = false;
  auto loss = [&] {
    const BlockRun<double> f = run_local(cfg, lay, w, x, g, spec);
    return test::dot(f.out.data(), g.data(), f.out.numel());
  };
  test::GradientCheck check;
  check.add("x", x.data(), run.dx.data(), x.shape());
  std::vector<std::pair<std::string, TensorD*>> wp, gp;
  w.for_each([&](const std::string& name, TensorD& t) { wp.push_back({name, &t}); });
  run.grads.for_each([&](const std::string& name, TensorD& t) { gp.push_back({name, &t}); });
  ASSERT_EQ(wp.size(), gp.size());
  for (std::size_t i = 0; i < wp.size(); ++i) {
    ASSERT_EQ(wp[i].first, gp[i].first);
    check.add(wp[i].first, wp[i].second->data(), gp[i].second->data(), wp[i].second->shape());
  }
  test::GradCheckOptions opt;
  opt.tol = 1e-6;
  opt.floor_per_tensor = true;
  // Every tensor, sampled: each loss is a P-rank run.
  opt.max_elements = test::kSanitized ? kSanitizedElements : 24;
  EXPECT_TRUE(check.run(loss, opt));
  EXPECT_GT(check.last_checked(), test::kSanitized ? 2 * std::int64_t(wp.size()) : 150);
}

std::vector<SpCase> sp_cases() {
  std::vector<SpCase> v;
  for (Form f : all_forms())
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
      v.push_back({f, a, {3, 2}, {2, 1}});
      v.push_back({f, a, {2, 2, 1}, {2, 0, 1}});  // rank 1 owns no head
      // Zigzag: 7 tokens in 4 chunks 2+2+2+1 over P 2, 8 in 6 (2+2+1+1+1+1) over P 3.
      v.push_back({f, a, {4, 3}, {}, QueryExchange::heads, SeqLayout::zigzag});
      v.push_back({f, a, {3, 3, 2}, {}, QueryExchange::heads, SeqLayout::zigzag});
    }
  // laga2d's default grid is Ph = gcd(3, P): at P 2 one head group of two
  // context groups (the query latent sent to each group's chunks), at P 3
  // laga's own (all-gathered).
  for (Form f : forms_with(&FormTraits::query_latent))
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
      v.push_back({f, a, {3, 2}, {2, 1}, QueryExchange::latent});
      v.push_back({f, a, {2, 2, 1}, {2, 0, 1}, QueryExchange::latent});
    }
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllForms, BlockGradSp, ::testing::ValuesIn(sp_cases()),
                         [](const ::testing::TestParamInfo<SpCase>& p) {
                           return name_of(p.param.form, p.param.queries) + "_P" +
                                  std::to_string(p.param.seq.size()) + "_" +
                                  to_string(p.param.attention) +
                                  (p.param.layout == SeqLayout::zigzag ? "_zigzag" : "");
                         });

}  // namespace
}  // namespace laga
