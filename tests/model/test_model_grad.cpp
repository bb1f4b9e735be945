// The whole model's backward in double: finite differences at P = 1 for every
// form and attention kind, the sequence-parallel gradients of every form at
// P = 2 and 3 against P = 1, and packed rows (laga train --pack-eos) against
// each document run alone.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "common/lm_batch.hpp"
#include "kernels/cross_entropy.hpp"
#include "model/model.hpp"

namespace laga {
namespace {

using test::Batch;
using test::batch;
using test::shard;

LmConfig tiny() {
  LmConfig c = LmConfig::derive(24, 3, 2, 13, 64);  // dn = dv = 8, dr = 4, C = 32
  c.ffn_hidden = 20;
  return c;
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

// (loss, every gradient by name) of one forward+backward on P local ranks;
// packed rows when `docs` is given, the mean over `counted` targets.
test::LossAndGrads run(const LmConfig& cfg, Form form, int P, const Batch& bt,
                       AttentionKind attention = AttentionKind::eager,
                       const Documents* docs = nullptr, std::int64_t counted = 0) {
  return test::loss_and_grads(cfg, form, attention, P, bt, test_params, [&](LmContext& ctx) {
    ctx.documents = docs;
    ctx.counted_targets = counted;
  });
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

// Packed rows are their documents run alone: every op but attention is
// token-local, attention stays inside a document and positions restart at
// each, so each document's tokens see exactly what they would see alone.
// With sum_k the loss SUM over document k's counted targets,
//   packed loss = (sum over k of sum_k) / counted,
// and likewise every gradient. Documents of 1 and S-1 tokens, and documents
// crossing the rank boundaries at P = 2, 3, in every form, eager and flash;
// the target after each document's last token is ignored (as --pack-eos
// does), and a document whose every target is ignored adds nothing.
TEST(ModelGrad, PackedRowsEqualEachDocumentAlone) {
  const LmConfig cfg = tiny();
  Batch bt;
  bt.S = 11;
  test::TestRng rng(23);
  for (std::int64_t i = 0; i < bt.B * bt.S; ++i) {
    bt.tok.push_back(std::int32_t(rng.next_u64() % std::uint64_t(cfg.vocab)));
    bt.tgt.push_back(std::int32_t(rng.next_u64() % std::uint64_t(cfg.vocab)));
  }
  const std::vector<std::vector<std::int64_t>> cu{{0, 4, 5, 11}, {0, 10, 11}};
  const Documents docs = Documents::from_cu_seqlens("test", bt.B, bt.S, cu);
  std::int64_t counted = 0;
  for (std::int64_t b = 0; b < bt.B; ++b)
    for (size_t k = 1; k < cu[size_t(b)].size(); ++k) {
      bt.tgt[size_t(b * bt.S + cu[size_t(b)][k] - 1)] = kIgnoreTarget;
    }
  for (std::int32_t t : bt.tgt) counted += t != kIgnoreTarget;

  double ref_sum = 0;
  std::map<std::string, std::vector<double>> ref_grads;
  for (std::int64_t b = 0; b < bt.B; ++b)
    for (size_t k = 0; k + 1 < cu[size_t(b)].size(); ++k) {
      const std::int64_t s0 = cu[size_t(b)][k], len = cu[size_t(b)][k + 1] - s0;
      Batch one;
      one.B = 1;
      one.S = len;
      one.tok.assign(bt.tok.begin() + b * bt.S + s0, bt.tok.begin() + b * bt.S + s0 + len);
      one.tgt.assign(bt.tgt.begin() + b * bt.S + s0, bt.tgt.begin() + b * bt.S + s0 + len);
      std::int64_t n = 0;
      for (std::int32_t t : one.tgt) n += t != kIgnoreTarget;
      if (n == 0) continue;  // nothing to learn from: loss and gradients 0
      const auto [loss, grads] =
          run(cfg, Form::explicit_form, 1, one, AttentionKind::eager, nullptr, n);
      ref_sum += loss * double(n);
      for (const auto& [name, v] : grads) {
        std::vector<double>& acc = ref_grads[name];
        acc.resize(v.size(), 0.0);
        for (size_t i = 0; i < v.size(); ++i) acc[i] += v[i] * double(n);
      }
    }
  for (auto& [name, v] : ref_grads)
    for (double& x : v) x /= double(counted);

  for (Form f : all_forms())
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
      for (int P : {1, 2, 3}) {
        SCOPED_TRACE(std::string(to_string(f)) + " " + to_string(a) + " P=" + std::to_string(P));
        const auto got = run(cfg, f, P, bt, a, &docs, counted);
        EXPECT_NEAR(got.first, ref_sum / double(counted), 1e-12);
        for (const auto& [name, v] : ref_grads)
          EXPECT_TRUE(test::all_close(name, got.second.at(name), v, 1e-12, 1e-9));
      }
  // Unpacked, the same batch differs: the test sees the masks.
  const auto unpacked = run(cfg, Form::laga, 1, bt, AttentionKind::eager, nullptr, counted);
  EXPECT_GT(std::abs(unpacked.first - ref_sum / double(counted)), 1e-6);
}

}  // namespace
}  // namespace laga
