// Kimi K3's gated NoPE MLA (docs/mla-math.md, "Gated NoPE MLA"; config keys
// mla_use_nope and mla_use_output_gate) under every form:
//  - the naive double reference (tests/common/naive_mla.hpp) with the gate
//    and without rotation, against central finite differences;
//  - every form and variant in double against that reference (P 1 and 3);
//  - every form and variant in fp32 at P 1..8, even and uneven, ranks without
//    heads, eager and flash, against single-rank explicit (out, dx and every
//    gradient, wg's included), and its ledger against the closed form;
//  - packed documents: every form equals each document run alone;
//  - the latent forms (absorbed, laga_fused, ring_latent) equal explicit in
//    double within 1e-12 of the largest value: with nothing rotated the
//    absorption W_UK^T q is exact algebra;
//  - the gate and NoPE each change the output (so neither can be dropped
//    silently and still pass), and qk_rope_head_dim 0 runs everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/block_inputs.hpp"
#include "common/check.hpp"
#include "common/naive_mla.hpp"
#include "common/variants.hpp"
#include "core/precision.hpp"
#include "core/rng.hpp"
#include "mla/comm_model.hpp"
#include "mla/ops_bf16.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

// Kimi K3-shaped in miniature: H 5 (no P > 1 here divides it), C > dn, dqk
// != dv. dr 4 unrotated (Kimi's mla_use_nope) or dr 0 (no rope part at all).
MlaConfig gated_nope(std::int64_t rq, std::int64_t dr, std::int64_t heads = 5) {
  MlaConfig c;
  c.dim = 32, c.n_heads = heads, c.q_lora_rank = rq, c.kv_lora_rank = 16, c.qk_nope_head_dim = 8,
  c.qk_rope_head_dim = dr, c.v_head_dim = 6;
  // The lengths would turn YaRN on were anything rotated: NoPE must ignore them.
  c.rope_theta = 500, c.original_seq_len = 8, c.max_seq_len = 64, c.rope_factor = 4;
  c.mla_use_nope = true, c.mla_use_output_gate = true;
  c.validate();
  return c;
}

std::string name_of(const MlaConfig& c) {
  return "rq" + std::to_string(c.q_lora_rank) + " dr" + std::to_string(c.qk_rope_head_dim) +
         (c.mla_use_nope ? " nope" : "") + (c.mla_use_output_gate ? " gated" : "");
}

// max |a - b| <= rel * max |b| over the tensor.
template <class T>
void expect_close(const std::string& what, const Tensor<T>& a, const Tensor<T>& b, double rel) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  double ref_max = 0, diff = 0;
  for (std::int64_t i = 0; i < b.numel(); ++i) {
    ref_max = std::max(ref_max, std::abs(double(b[i])));
    const double d = std::abs(double(a[i]) - double(b[i]));
    diff = std::isfinite(d) ? std::max(diff, d) : INFINITY;
  }
  EXPECT_LE(diff, rel * ref_max) << what << ": max |diff| " << diff << ", max |ref| " << ref_max;
}

template <class T>
void expect_run_matches(const BlockRun<T>& run, const BlockRun<T>& ref, double rel,
                        const std::string& tag) {
  expect_close(tag + " out", run.out, ref.out, rel);
  expect_close(tag + " dx", run.dx, ref.dx, rel);
  std::vector<std::pair<std::string, const Tensor<T>*>> a, b;
  run.grads.for_each([&](const std::string& n, const Tensor<T>& t) { a.push_back({n, &t}); });
  ref.grads.for_each([&](const std::string& n, const Tensor<T>& t) { b.push_back({n, &t}); });
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].first, b[i].first);
    expect_close(tag + " grad." + a[i].first, *a[i].second, *b[i].second, rel);
  }
}

void expect_ledger_matches_model(const MlaConfig& cfg, const SpLayout& lay, FormVariant variant,
                                 const BlockRun<float>& run) {
  for (const RankReport& rep : run.ranks) {
    const CommPrediction pred = predict_comm(cfg, lay, variant, rep.rank, 4, true, true);
    std::size_t seen = 0;
    for (const auto& [key, entry] : rep.ledger.entries()) {
      const std::string where = to_string(variant) + " rank " + std::to_string(rep.rank) + " " +
                                to_string(key.first) + "/" + key.second;
      auto it = pred.find(key);
      ASSERT_NE(it, pred.end()) << where << " is in the ledger but not in the model";
      EXPECT_EQ(entry.bytes_sent, it->second.sent) << where;
      EXPECT_EQ(entry.bytes_received, it->second.received) << where;
      EXPECT_EQ(entry.calls, it->second.calls) << where;
      ++seen;
    }
    EXPECT_EQ(seen, pred.size()) << "the model predicts labels the ledger never saw";
  }
}

RunSpec spec_of(FormVariant v, AttentionKind a) {
  RunSpec spec;
  spec.variant = v;
  spec.attention = a;
  spec.deferred_delivery_for_testing = true;
  return spec;
}

test::NaiveTensors naive_weights(const MlaParams<double>& w) {
  test::NaiveTensors nw;
  w.for_each([&](const std::string& n, const TensorD& t) {
    nw[n].assign(t.data(), t.data() + t.numel());
  });
  return nw;
}

// The reference itself, by central differences in double: every element of
// x and of every parameter, wg's included, rq 0 and 5, dr 0 and 4 unrotated.
TEST(GatedNope, NaiveBackwardMatchesFiniteDifferences) {
  for (std::int64_t rq : {0, 5})
    for (std::int64_t dr : {0, 4}) {
      MlaConfig c = gated_nope(rq, dr, 3);
      c.dim = 10, c.kv_lora_rank = 6, c.qk_nope_head_dim = 4, c.v_head_dim = 3;
      c.validate();
      const std::int64_t B = 2, S = 5;
      test::NaiveTensors w;
      std::uint64_t seed = 300;
      for (const auto& [name, shape] : mla_param_shapes(c)) {
        std::int64_t n = 1;
        for (auto e : shape) n *= e;
        w[name] = test::random_vector<double>(n, seed++, -0.5, 0.5);
        if (shape.size() == 1)
          for (double& v : w[name]) v += 1.0;
      }
      ASSERT_EQ(w.count("wg.weight"), 1u);
      std::vector<double> x = test::random_vector<double>(B * S * c.dim, 1);
      const std::vector<double> g = test::random_vector<double>(B * S * c.dim, 2);
      const test::NaiveMlaResult r = test::naive_mla(c, w, x, g, B, S);
      test::GradientCheck check;
      check.add("x", x.data(), r.dx.data(), B * S * c.dim);
      for (auto& [name, v] : w)
        check.add(name, v.data(), r.grads.at(name).data(), std::int64_t(v.size()));
      test::GradCheckOptions opt;
      opt.floor_per_tensor = true;
      EXPECT_TRUE(check.run(
          [&] {
            const test::NaiveMlaResult f = test::naive_mla(c, w, x, g, B, S);
            return test::dot(f.out.data(), g.data(), std::int64_t(g.size()));
          },
          opt))
          << name_of(c);
    }
}

// Every form and variant in double against the naive reference, element by
// element at the block tolerance, P 1 and 3 (uneven: H 5, S 11).
TEST(GatedNope, EveryFormInDoubleMatchesTheNaiveReference) {
  for (std::int64_t rq : {0, 7})
    for (std::int64_t dr : {0, 4}) {
      const MlaConfig c = gated_nope(rq, dr);
      const std::int64_t B = 2, S = 11;
      auto w = MlaParams<double>::zeros(c, MemCategory::parameters);
      init_params(w, 21, 0.1);
      TensorD x({B, S, c.dim}), g({B, S, c.dim});
      test::fill_random(x.data(), x.numel(), 31);
      test::fill_random(g.data(), g.numel(), 32);
      const test::NaiveMlaResult ref =
          test::naive_mla(c, naive_weights(w), {x.data(), x.data() + x.numel()},
                          {g.data(), g.data() + g.numel()}, B, S);
      for (FormVariant v : test::form_variants(c, test::WithOverlap::no))
        for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
          for (int P : {1, 3}) {
            const BlockRun<double> run =
                run_local(c, SpLayout::even(B, S, c.n_heads, P), w, x, g, spec_of(v, a));
            const std::string tag = name_of(c) + " " + to_string(v) + " " + to_string(a) + " P" +
                                    std::to_string(P) + " ";
            const test::Tolerance tol = test::block_tolerance<double>();
            EXPECT_TRUE(
                test::all_close(tag + "out", run.out.data(), ref.out.data(), run.out.numel(), tol));
            EXPECT_TRUE(
                test::all_close(tag + "dx", run.dx.data(), ref.dx.data(), run.dx.numel(), tol));
            run.grads.for_each([&](const std::string& n, const TensorD& t) {
              EXPECT_TRUE(test::all_close(tag + "grad." + n, t.data(), ref.grads.at(n).data(),
                                          t.numel(), tol));
            });
          }
    }
}

struct Layout {
  std::vector<std::int64_t> seq, heads;
};

// fp32, every form and variant (overlapped included) on even and uneven
// shards, P 1 to 8 (ranks with one token, ranks without heads), eager and
// flash, against single-rank explicit at the forms' usual bound; the ledger
// against the closed form (the gate sends nothing: the ledger is NoPE's).
TEST(GatedNope, EveryFormAgreesWithSingleRankExplicit) {
  const std::vector<Layout> layouts = {{{13}, {5}},
                                       {{7, 6}, {3, 2}},
                                       {{5, 4, 4}, {2, 2, 1}},
                                       {{1, 8, 4}, {0, 3, 2}},
                                       {{2, 2, 2, 2, 2, 1, 1, 1}, {1, 1, 1, 1, 1, 0, 0, 0}}};
  for (std::int64_t rq : {0, 7})
    for (std::int64_t dr : {0, 4}) {
      const MlaConfig cfg = gated_nope(rq, dr);
      const Layout& first = layouts.front();
      const test::BlockInputs<float> in = test::make_inputs(cfg, 2, first.seq.front());
      RunSpec spec;
      spec.variant.form = Form::explicit_form;
      const BlockRun<float> ref =
          run_local(cfg, SpLayout::even(2, 13, cfg.n_heads, 1), in.w, in.x, in.dout, spec);
      for (const Layout& l : layouts) {
        const SpLayout lay = SpLayout::custom(2, l.seq, l.heads);
        for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
          for (FormVariant v : test::form_variants(cfg, test::WithOverlap::yes)) {
            const BlockRun<float> run = run_local(cfg, lay, in.w, in.x, in.dout, spec_of(v, a));
            expect_run_matches(
                run, ref, 1e-5,
                name_of(cfg) + " " + to_string(v) + " " + to_string(a) + " " + lay.describe());
            expect_ledger_matches_model(cfg, lay, v, run);
          }
      }
    }
}

// Packed documents (uneven, documents across ranks): every form equals each
// document run alone through single-rank explicit.
TEST(GatedNope, PackedEveryFormEqualsEachDocumentAlone) {
  const std::int64_t B = 2, S = 13;
  const Documents docs = Documents::from_cu_seqlens("test", B, S, {{0, 4, 5, 13}, {0, 7, 13}});
  for (std::int64_t rq : {0, 7})
    for (std::int64_t dr : {0, 4}) {
      const MlaConfig cfg = gated_nope(rq, dr);
      const test::BlockInputs<float> in = test::make_inputs(cfg, B, S);
      RunSpec spec;
      spec.variant.form = Form::explicit_form;
      const BlockRun<float> ref = run_documents_alone(cfg, in.w, in.x, in.dout, docs, spec);
      for (const SpLayout& lay :
           {SpLayout::custom(B, {5, 4, 4}, {2, 2, 1}), SpLayout::custom(B, {1, 8, 4}, {0, 3, 2}),
            SpLayout::even(B, S, 5, 3, SeqLayout::zigzag)})
        for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
          for (FormVariant v : test::form_variants(cfg, test::WithOverlap::yes)) {
            RunSpec packed = spec_of(v, a);
            packed.documents = &docs;
            const BlockRun<float> run = run_local(cfg, lay, in.w, in.x, in.dout, packed);
            expect_run_matches(run, ref, 1e-5,
                               name_of(cfg) + " " + to_string(v) + " " + to_string(a) + " " +
                                   lay.describe() + " docs " + docs.describe());
            expect_ledger_matches_model(cfg, lay, v, run);
          }
    }
}

// The latent forms carry gated NoPE training exactly: in double they equal
// explicit within 1e-12 of the largest value, outputs and every gradient,
// at several P, uneven and zigzag.
TEST(GatedNope, LatentFormsEqualExplicitInDoubleWithin1e12) {
  for (std::int64_t rq : {0, 7})
    for (std::int64_t dr : {0, 4}) {
      const MlaConfig c = gated_nope(rq, dr);
      const std::int64_t B = 2, S = 13;
      auto w = MlaParams<double>::zeros(c, MemCategory::parameters);
      init_params(w, 41, 0.1);
      TensorD x({B, S, c.dim}), g({B, S, c.dim});
      test::fill_random(x.data(), x.numel(), 43);
      test::fill_random(g.data(), g.numel(), 44);
      RunSpec spec;
      spec.variant.form = Form::explicit_form;
      const BlockRun<double> ref = run_local(c, SpLayout::even(B, S, c.n_heads, 1), w, x, g, spec);
      for (Form f : {Form::absorbed, Form::laga_fused, Form::ring_latent})
        for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
          for (const SpLayout& lay :
               {SpLayout::even(B, S, c.n_heads, 1), SpLayout::custom(B, {5, 4, 4}, {2, 2, 1}),
                SpLayout::custom(B, {2, 2, 2, 2, 2, 1, 1, 1}, {1, 1, 1, 1, 1, 0, 0, 0}),
                SpLayout::even(B, S, c.n_heads, 3, SeqLayout::zigzag)}) {
            const BlockRun<double> run = run_local(c, lay, w, x, g, spec_of(f, a));
            expect_run_matches(
                run, ref, 1e-12,
                name_of(c) + " " + to_string(f) + " " + to_string(a) + " " + lay.describe());
          }
    }
}

// Neither switch is dead: with the gate off, or RoPE on, the same weights
// give another output (by far more than any bound above), so a form that
// dropped the gate or rotated anyway could not pass the checks above.
TEST(GatedNope, TheGateAndNopeEachChangeTheOutput) {
  const MlaConfig on = gated_nope(7, 4);
  MlaConfig no_gate = on, roped = on;
  no_gate.mla_use_output_gate = false;
  roped.mla_use_nope = false;
  const test::BlockInputs<float> in = test::make_inputs(on, 2, 13);
  RunSpec spec;
  spec.variant.form = Form::laga;
  const SpLayout lay = SpLayout::even(2, 13, 5, 2);
  const BlockRun<float> a = run_local(on, lay, in.w, in.x, in.dout, spec);
  MlaParams<float> w_no_gate = MlaParams<float>::zeros(no_gate, MemCategory::parameters);
  in.w.for_each([&](const std::string& n, const TensorF& t) {
    w_no_gate.for_each([&](const std::string& m, TensorF& u) {
      if (m == n) std::copy(t.data(), t.data() + t.numel(), u.data());
    });
  });
  const BlockRun<float> b = run_local(no_gate, lay, w_no_gate, in.x, in.dout, spec);
  const BlockRun<float> r = run_local(roped, lay, in.w, in.x, in.dout, spec);
  auto max_diff = [](const TensorF& p, const TensorF& q) {
    double m = 0;
    for (std::int64_t i = 0; i < p.numel(); ++i) m = std::max(m, std::abs(double(p[i] - q[i])));
    return m;
  };
  EXPECT_GT(max_diff(a.out, b.out), 1e-2);
  EXPECT_GT(max_diff(a.out, r.out), 1e-3);
  EXPECT_EQ(on.softmax_scale(), 1.0 / std::sqrt(12.0)) << "NoPE: (dn + dr)^-1/2, no YaRN mscale";
  EXPECT_FALSE(on.yarn());
  EXPECT_TRUE(roped.yarn());
}

// bf16 mixed precision (--dtype bf16): every form with the gate and NoPE
// within the bounds ops_bf16.hpp derives for the block (the gate's branch,
// x wg^T and its sigmoid, runs beside the attention's path and rounds no
// more than it: o's rounding as wo's operand becomes y's), against float64
// explicit on the same values, P 1 to 8.
TEST(GatedNope, Bf16EveryFormWithinTheBlocksBounds) {
  const double out_bound = bf16_bound_vs_exact(BlockTensor::output),
               grad_bound = bf16_bound_vs_exact(BlockTensor::gradient);
  for (std::int64_t rq : {0, 7})
    for (std::int64_t dr : {0, 4}) {
      const MlaConfig cfg = gated_nope(rq, dr);
      const std::int64_t B = 2, S = 13;
      const test::BlockInputs<float> in = test::make_inputs(cfg, B, S);
      auto wd = MlaParams<double>::zeros(cfg, MemCategory::parameters);
      std::vector<const TensorF*> from;
      in.w.for_each([&](const std::string&, const TensorF& t) { from.push_back(&t); });
      std::size_t k = 0;
      wd.for_each([&](const std::string&, TensorD& t) {
        for (std::int64_t j = 0; j < t.numel(); ++j) t[j] = (*from[k])[j];
        ++k;
      });
      TensorD xd({B, S, cfg.dim}), gd({B, S, cfg.dim});
      for (std::int64_t j = 0; j < xd.numel(); ++j) xd[j] = in.x[j], gd[j] = in.dout[j];
      RunSpec spec;
      spec.variant.form = Form::explicit_form;
      const BlockRun<double> exact =
          run_local(cfg, SpLayout::even(B, S, cfg.n_heads, 1), wd, xd, gd, spec);
      for (const SpLayout& lay :
           {SpLayout::even(B, S, cfg.n_heads, 1), SpLayout::custom(B, {5, 4, 4}, {2, 2, 1}),
            SpLayout::custom(B, {2, 2, 2, 2, 2, 1, 1, 1}, {1, 1, 1, 1, 1, 0, 0, 0})})
        for (FormVariant v : test::form_variants(cfg, test::WithOverlap::no)) {
          const UsePrecision bf16(Precision::bf16);
          const BlockRun<float> run =
              run_local(cfg, lay, in.w, in.x, in.dout, spec_of(v, AttentionKind::flash));
          const std::string tag = name_of(cfg) + " bf16 " + to_string(v) + " " + lay.describe();
          auto rel = [](const auto& a, const TensorD& b) {
            double m = 0, r = 0;
            for (std::int64_t j = 0; j < b.numel(); ++j) {
              m = std::max(m, std::abs(double(a[j]) - b[j]));
              r = std::max(r, std::abs(b[j]));
            }
            return m / r;
          };
          EXPECT_LE(rel(run.out, exact.out), out_bound) << tag << " out";
          EXPECT_LE(rel(run.dx, exact.dx), grad_bound) << tag << " dx";
          std::vector<const TensorD*> refs;
          exact.grads.for_each([&](const std::string&, const TensorD& t) { refs.push_back(&t); });
          std::size_t i = 0;
          run.grads.for_each([&](const std::string& n, const TensorF& t) {
            EXPECT_LE(rel(t, *refs[i++]), grad_bound) << tag << " grad." << n;
          });
        }
    }
}

}  // namespace
}  // namespace laga
