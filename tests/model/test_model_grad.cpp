// The whole model's backward in double: finite differences at P = 1 for every
// form and attention kind, and the sequence-parallel gradients of every form at
// P = 2 and 3 against P = 1.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "model/model.hpp"

namespace laga {
namespace {

LmConfig tiny() {
  LmConfig c = LmConfig::derive(24, 3, 2, 13, 64);  // dn = dv = 8, dr = 4, C = 32
  c.ffn_hidden = 20;
  return c;
}

struct Batch {
  std::int64_t B = 2, S = 7;
  std::vector<std::int32_t> tok, tgt;  // (B, S)
};
Batch batch(const LmConfig& c) {
  Batch b;
  test::TestRng rng(11);
  for (std::int64_t i = 0; i < b.B * b.S; ++i) {
    b.tok.push_back(std::int32_t(rng.next_u64() % std::uint64_t(c.vocab)));
    b.tgt.push_back(std::int32_t(rng.next_u64() % std::uint64_t(c.vocab)));
  }
  return b;
}

// Rows [off, off + L) of every sequence.
std::vector<std::int32_t> shard(const std::vector<std::int32_t>& v, std::int64_t B, std::int64_t S,
                                std::int64_t off, std::int64_t L) {
  std::vector<std::int32_t> out;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < L; ++i) out.push_back(v[size_t(b * S + off + i)]);
  return out;
}

// Seeded parameters with the norm gains moved away from 1, so that a gain
// the backward ignores shows up.
LmParams<double> test_params(const LmConfig& cfg) {
  LmParams<double> w = LmParams<double>::zeros(cfg, MemCategory::parameters);
  init_lm_params(w, 5);
  w.for_each([](const std::string&, Tensor<double>& t) {
    if (t.rank() == 1)
      for (std::int64_t i = 0; i < t.numel(); ++i) t[i] += 0.1 * std::sin(double(i));
  });
  return w;
}

// (loss, every gradient by name) of one forward+backward on P local ranks.
std::pair<double, std::map<std::string, std::vector<double>>> run(const LmConfig& cfg, Form form,
                                                                  int P, const Batch& bt) {
  double loss = 0;
  std::map<std::string, std::vector<double>> grads;
  run_local_ranks(P, [&](Communicator& comm) {
    const SpLayout layout = SpLayout::even(bt.B, bt.S, cfg.mla.n_heads, P);
    const RopeTable rope(cfg.mla.rope(), bt.S);
    const LmContext ctx{cfg, layout, comm, rope, form, AttentionKind::eager};
    const LmParams<double> w = test_params(cfg);
    LmParams<double> g = LmParams<double>::zeros(cfg, MemCategory::gradients);
    const int r = comm.rank();
    const auto off = layout.seq_offset[size_t(r)], L = layout.seq_count[size_t(r)];
    auto tok = shard(bt.tok, bt.B, bt.S, off, L), tgt = shard(bt.tgt, bt.B, bt.S, off, L);
    const double l = lm_forward_backward(ctx, w, tok.data(), tgt.data(), g);
    if (r != 0) return;
    loss = l;
    g.for_each([&](const std::string& n, const Tensor<double>& t) {
      grads[n].assign(t.data(), t.data() + t.numel());
    });
  });
  return {loss, grads};
}

struct ModelCase {
  Form form;
  AttentionKind attention;
};
class ModelGradFd : public ::testing::TestWithParam<ModelCase> {};

// Every form and attention kind on one rank, every tensor sampled, each
// relative to its own largest gradient (a per-tensor floor).
TEST_P(ModelGradFd, FiniteDifferencesWholeModelDouble) {
  const LmConfig cfg = tiny();
  const Batch bt = batch(cfg);
  auto comm = make_self_communicator();
  const SpLayout layout = SpLayout::even(bt.B, bt.S, cfg.mla.n_heads, 1);
  const RopeTable rope(cfg.mla.rope(), bt.S);
  const LmContext ctx{cfg, layout, *comm, rope, GetParam().form, GetParam().attention};
  LmParams<double> w = test_params(cfg);
  LmParams<double> g = LmParams<double>::zeros(cfg, MemCategory::gradients);
  lm_forward_backward(ctx, w, bt.tok.data(), bt.tgt.data(), g);
  test::GradientCheck gc;
  std::vector<Tensor<double>*> gs;
  g.for_each([&](const std::string&, Tensor<double>& t) { gs.push_back(&t); });
  size_t k = 0;
  w.for_each([&](const std::string& n, Tensor<double>& t) {
    gc.add(n, t.data(), gs[k++]->data(), t.shape());
  });
  test::GradCheckOptions opt;
  opt.max_elements = 12;
  opt.tol = 1e-5;
  opt.floor_per_tensor = true;
  EXPECT_TRUE(gc.run([&] { return lm_loss(ctx, w, bt.tok.data(), bt.tgt.data()); }, opt));
  EXPECT_GT(gc.last_checked(), 200);
}

INSTANTIATE_TEST_SUITE_P(AllForms, ModelGradFd,
                         ::testing::Values(ModelCase{Form::explicit_form, AttentionKind::eager},
                                           ModelCase{Form::absorbed, AttentionKind::eager},
                                           ModelCase{Form::laga, AttentionKind::eager},
                                           ModelCase{Form::explicit_form, AttentionKind::flash},
                                           ModelCase{Form::absorbed, AttentionKind::flash},
                                           ModelCase{Form::laga, AttentionKind::flash}),
                         [](const ::testing::TestParamInfo<ModelCase>& p) {
                           return std::string(to_string(p.param.form)) + "_" +
                                  to_string(p.param.attention);
                         });

TEST(ModelGrad, EveryFormAtP2AndP3MatchesP1) {
  const LmConfig cfg = tiny();
  const Batch bt = batch(cfg);
  const auto ref = run(cfg, Form::explicit_form, 1, bt);
  for (Form f : all_forms())
    for (int P : {2, 3}) {
      SCOPED_TRACE(std::string(to_string(f)) + " P=" + std::to_string(P));
      const auto got = run(cfg, f, P, bt);
      EXPECT_NEAR(got.first, ref.first, 1e-13);
      for (const auto& [name, v] : ref.second)
        EXPECT_TRUE(test::all_close(name, got.second.at(name), v, 1e-12, 1e-9));
    }
}

TEST(ModelGrad, LagaEqualsExplicitBitForBitAtP1) {
  const LmConfig cfg = tiny();
  const Batch bt = batch(cfg);
  const auto a = run(cfg, Form::explicit_form, 1, bt), b = run(cfg, Form::laga, 1, bt);
  EXPECT_EQ(a.first, b.first);
  for (const auto& [name, v] : a.second)
    EXPECT_TRUE(test::all_equal(name, b.second.at(name).data(), v.data(), std::int64_t(v.size())));
}

}  // namespace
}  // namespace laga
