// The single-rank DSA block (mla/dsa_block.hpp): the dense warm-up and a
// top-k no smaller than S equal the naive dense MLA block (common/naive_mla.hpp)
// in double, outputs and every LM gradient; the sparse stage's LM gradient
// and the indexer's KL gradient against finite differences in double; the
// indexer's input detached (its KL moves no MLA weight and no dx).
// The comparisons with PyTorch autograd and DeepSeek's own code are in
// test_dsa_reference.cpp.
#include "mla/dsa_block.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/check.hpp"
#include "common/naive_mla.hpp"
#include "core/error.hpp"

namespace laga {
namespace {

using test::all_close;

MlaConfig dsa_config(std::int64_t topk) {
  MlaConfig c;
  c.dim = 24, c.n_heads = 3, c.q_lora_rank = 12, c.kv_lora_rank = 10, c.qk_nope_head_dim = 4;
  c.qk_rope_head_dim = 4, c.v_head_dim = 5;
  c.original_seq_len = 4096, c.max_seq_len = 4096;
  c.index_n_heads = 3, c.index_head_dim = 8, c.index_topk = topk;
  c.validate();
  return c;
}

template <class T>
DsaIndexerParams<T> indexer_weights(const MlaConfig& c, std::uint64_t seed) {
  DsaIndexerParams<T> p = DsaIndexerParams<T>::zeros(c);
  std::uint64_t s = seed;
  for (auto& [name, t] : p.named()) {
    const double fan_in = name == "indexer.wq_b.weight" ? double(c.q_lora_rank) : double(c.dim);
    const bool norm = name.find("k_norm") != std::string::npos;
    test::fill_random(t->data(), std::int64_t(t->size()), ++s, norm ? -0.2 : -1.0,
                      norm ? 0.2 : 1.0);
    if (!norm)
      for (T& e : *t) e = T(double(e) * std::sqrt(3.0 / fan_in));
    if (name == "indexer.k_norm.weight")
      for (T& e : *t) e += T(1);
  }
  return p;
}

struct Case {
  MlaConfig cfg;
  std::int64_t B = 2, S = 9;
  MlaParams<double> w;
  DsaIndexerParams<double> iw;
  std::vector<double> x, dout;
  explicit Case(std::int64_t topk)
      : cfg(dsa_config(topk)), w(MlaParams<double>::zeros(cfg, MemCategory::parameters)) {
    init_params(w, 5, 0.1);
    iw = indexer_weights<double>(cfg, 40);
    x = test::random_vector<double>(B * S * cfg.dim, 7);
    dout = test::random_vector<double>(B * S * cfg.dim, 8);
  }
  test::NaiveTensors naive_weights() const {
    test::NaiveTensors t;
    w.for_each([&](const std::string& name, const Tensor<double>& p) {
      t[name] = std::vector<double>(p.data(), p.data() + p.numel());
    });
    return t;
  }
};

void expect_equals_dense(const Case& c, const DsaBlockResult<double>& r, const std::string& what) {
  const test::NaiveMlaResult want =
      test::naive_mla(c.cfg, c.naive_weights(), c.x, c.dout, c.B, c.S);
  const test::Tolerance tol = test::block_tolerance<double>();
  EXPECT_TRUE(all_close(what + " out", r.out, want.out, tol.atol, tol.rtol));
  EXPECT_TRUE(all_close(what + " dx", r.dx, want.dx, tol.atol, tol.rtol));
  r.grads.for_each([&](const std::string& name, const Tensor<double>& g) {
    const std::vector<double>& ref = want.grads.at(name);
    EXPECT_TRUE(all_close(what + " grad " + name, g.data(), ref.data(), g.numel(),
                          test::block_tolerance<double>()));
  });
}

TEST(DsaBlock, DenseWarmupIsTheDenseBlock) {
  Case c(3);
  const auto r =
      dsa_block(c.cfg, c.w, c.iw, c.x.data(), c.dout.data(), c.B, c.S, DsaStage::dense_warmup);
  expect_equals_dense(c, r, "dense warm-up");
  EXPECT_GT(r.kl_loss, 0.0);
}

TEST(DsaBlock, TopkOfAtLeastSIsTheDenseBlock) {
  Case c(9);
  const auto r = dsa_block(c.cfg, c.w, c.iw, c.x.data(), c.dout.data(), c.B, c.S, DsaStage::sparse);
  expect_equals_dense(c, r, "topk = S");
}

TEST(DsaBlock, SparseStageDiffersFromDenseAndSelectsTopk) {
  Case c(3);
  const auto r = dsa_block(c.cfg, c.w, c.iw, c.x.data(), c.dout.data(), c.B, c.S, DsaStage::sparse);
  const test::NaiveMlaResult dense =
      test::naive_mla(c.cfg, c.naive_weights(), c.x, c.dout, c.B, c.S);
  EXPECT_FALSE(all_close("sparse vs dense", r.out, dense.out, 1e-6, 0));
  for (std::int64_t row = 0; row < c.B * c.S; ++row) {
    const std::int64_t s = row % c.S;
    for (std::int64_t slot = 0; slot < 3; ++slot)
      EXPECT_EQ(r.idx[std::size_t(row * 3 + slot)] >= 0, slot <= s) << "row " << row;
  }
}

// The LM gradient of <out, G> through the selected keys, and the KL's
// gradient of the indexer's weights, by central differences in double.
TEST(DsaBlock, GradientsMatchFiniteDifferences) {
  for (DsaStage stage : {DsaStage::sparse, DsaStage::dense_warmup}) {
    Case c(3);
    const auto r = dsa_block(c.cfg, c.w, c.iw, c.x.data(), c.dout.data(), c.B, c.S, stage);
    auto lm_loss = [&] {
      const auto f = dsa_block<double>(c.cfg, c.w, c.iw, c.x.data(), nullptr, c.B, c.S, stage);
      return test::dot(f.out.data(), c.dout.data(), std::int64_t(f.out.size()));
    };
    test::GradCheckOptions opt;
    opt.max_elements = 24;
    opt.floor_per_tensor = true;
    test::GradientCheck lm;
    lm.add("x", c.x.data(), r.dx.data(), std::int64_t(c.x.size()));
    MlaParams<double>& g = const_cast<MlaParams<double>&>(r.grads);
    c.w.for_each([&](const std::string& name, Tensor<double>& p) {
      Tensor<double>* gp = nullptr;
      g.for_each([&](const std::string& gn, Tensor<double>& t) {
        if (gn == name) gp = &t;
      });
      lm.add(name, p.data(), gp->data(), p.numel());
    });
    EXPECT_TRUE(lm.run(lm_loss, opt)) << to_string(stage);
    auto kl = [&] {
      return dsa_block<double>(c.cfg, c.w, c.iw, c.x.data(), nullptr, c.B, c.S, stage).kl_loss;
    };
    test::GradientCheck ik;
    DsaIndexerParams<double> ig = r.indexer_grads;
    auto params = c.iw.named();
    auto grads = ig.named();
    for (std::size_t n = 0; n < params.size(); ++n)
      ik.add(params[n].first, params[n].second->data(), grads[n].second->data(),
             std::int64_t(params[n].second->size()));
    EXPECT_TRUE(ik.run(kl, opt)) << to_string(stage);
  }
}

// The indexer's input is detached: its KL changes with the MLA weights (the
// target) but passes them no gradient, and the indexer's weights get none
// from the LM loss: dx and the MLA gradients do not depend on them.
TEST(DsaBlock, IndexerInputIsDetached) {
  Case c(20);  // every key selected: the selection cannot move
  const auto a = dsa_block(c.cfg, c.w, c.iw, c.x.data(), c.dout.data(), c.B, c.S, DsaStage::sparse);
  DsaIndexerParams<double> other = indexer_weights<double>(c.cfg, 99);
  const auto b =
      dsa_block(c.cfg, c.w, other, c.x.data(), c.dout.data(), c.B, c.S, DsaStage::sparse);
  EXPECT_TRUE(test::all_equal("dx", a.dx.data(), b.dx.data(), std::int64_t(a.dx.size())));
  EXPECT_NE(a.kl_loss, b.kl_loss);
}

// The latent (absorbed) attention is the per-head one: outputs, the
// selection, every gradient and the KL, in double, both stages.
TEST(DsaBlock, LatentAttentionEqualsPerHead) {
  for (DsaStage stage : {DsaStage::sparse, DsaStage::dense_warmup}) {
    Case c(4);
    const auto a = dsa_block(c.cfg, c.w, c.iw, c.x.data(), c.dout.data(), c.B, c.S, stage,
                             DsaAttend::per_head);
    const auto l =
        dsa_block(c.cfg, c.w, c.iw, c.x.data(), c.dout.data(), c.B, c.S, stage, DsaAttend::latent);
    const test::Tolerance tol = test::block_tolerance<double>();
    const std::string tag = to_string(stage);
    EXPECT_EQ(a.idx, l.idx) << tag;
    EXPECT_TRUE(all_close(tag + " out", l.out, a.out, tol.atol, tol.rtol));
    EXPECT_TRUE(all_close(tag + " dx", l.dx, a.dx, tol.atol, tol.rtol));
    std::vector<std::vector<double>> ga;
    a.grads.for_each([&](const std::string&, const Tensor<double>& g) {
      ga.emplace_back(g.data(), g.data() + g.numel());
    });
    std::size_t n = 0;
    l.grads.for_each([&](const std::string& name, const Tensor<double>& g) {
      EXPECT_TRUE(all_close(tag + " grad " + name, g.data(), ga[n++].data(), g.numel(), tol));
    });
    DsaIndexerParams<double> ia = a.indexer_grads, il = l.indexer_grads;
    for (std::size_t i = 0; i < ia.named().size(); ++i)
      EXPECT_TRUE(all_close(tag + " " + ia.named()[i].first, *il.named()[i].second,
                            *ia.named()[i].second, tol.atol, tol.rtol));
    EXPECT_NEAR(l.kl_loss, a.kl_loss, 1e-12 * a.kl_loss) << tag;
  }
}

TEST(DsaBlock, RefusesADenseConfig) {
  Case c(3);
  MlaConfig dense = c.cfg;
  dense.index_n_heads = dense.index_head_dim = dense.index_topk = 0;
  EXPECT_THROW(dsa_block(dense, c.w, c.iw, c.x.data(), c.dout.data(), c.B, c.S, DsaStage::sparse),
               Error);
}

}  // namespace
}  // namespace laga
