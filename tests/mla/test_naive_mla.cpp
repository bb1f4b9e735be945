// The naive double MLA block (tests/common/naive_mla.hpp), which the bench's
// block rows count #wrong against, checked on its own: against PyTorch
// autograd (python/torch_reference.py's float64 results) for out, dx and every
// gradient, and its backward against central finite differences. Then every
// form in double (and laga with the query-latent exchange where rq > 0),
// eager and flash, at P = 1 and 3, against it: with no fp32
// rounding in the way, a slightly wrong constant (a softmax scale off by
// 1e-4, a 10x RMSNorm epsilon, a RoPE frequency) is far outside the bound.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>

#include "common/check.hpp"
#include "common/naive_mla.hpp"
#include "io/safetensors.hpp"
#include "mla/params.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

std::vector<double> as_double(const TensorF& t) {
  return {t.data(), t.data() + t.numel()};
}

class NaiveVsTorch : public ::testing::TestWithParam<std::string> {};

// The reference results are float64 rounded once to fp32 (torch_reference.py
// writes them so), so the naive double block must land within that rounding:
// rtol 1e-7 > 2^-24, atol 1e-12 for double rounding of O(1) sums.
TEST_P(NaiveVsTorch, MatchesAutograd) {
  const char* tmp = std::getenv("LAGA_TEST_TMP");
  const std::string path =
      std::string(tmp ? tmp : ".") + "/torch_ref/case_" + GetParam() + ".safetensors";
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing: ctest runs mla_torch_reference_data first";
  const SafetensorsFile f = SafetensorsFile::open(path);
  const nlohmann::json meta = nlohmann::json::parse(f.metadata().at("config"));
  const MlaConfig cfg = MlaConfig::from_json(meta, path);
  const std::int64_t B = meta.at("batch"), S = meta.at("seq");
  test::NaiveTensors w;
  for (const auto& [name, shape] : mla_param_shapes(cfg))
    w[name] = as_double(f.read<float>(name, shape, MemCategory::parameters));
  const Shape act{B, S, cfg.dim};
  const test::NaiveMlaResult r =
      test::naive_mla(cfg, w, as_double(f.read<float>("x", act, MemCategory::activations)),
                      as_double(f.read<float>("dout", act, MemCategory::activations)), B, S);
  const double atol = 1e-12, rtol = 1e-7;
  EXPECT_TRUE(test::all_close("out", r.out, as_double(f.read<float>("out", act)), atol, rtol));
  EXPECT_TRUE(test::all_close("dx", r.dx, as_double(f.read<float>("dx", act)), atol, rtol));
  ASSERT_EQ(r.grads.size(), w.size());
  for (const auto& [name, shape] : mla_param_shapes(cfg))
    EXPECT_TRUE(test::all_close("grad." + name, r.grads.at(name),
                                as_double(f.read<float>("grad." + name, shape)), atol, rtol));
}

INSTANTIATE_TEST_SUITE_P(Cases, NaiveVsTorch, ::testing::Values("a", "b", "c", "d"));

// Central differences of L = <G, out> in double, every element of x and of
// every parameter, with YaRN's ramp inside the rope pairs and rq > 0 (and 0).
TEST(NaiveMla, BackwardMatchesFiniteDifferences) {
  for (std::int64_t rq : {0, 5}) {
    MlaConfig c;
    c.dim = 10, c.n_heads = 3, c.q_lora_rank = rq, c.kv_lora_rank = 6, c.qk_nope_head_dim = 4,
    c.qk_rope_head_dim = 4, c.v_head_dim = 3;
    c.rope_theta = 500, c.original_seq_len = 64, c.max_seq_len = 256, c.rope_factor = 8;
    c.mscale = 0.7;
    c.validate();
    const std::int64_t B = 2, S = 5;
    test::NaiveTensors w;
    std::uint64_t seed = 100;
    for (const auto& [name, shape] : mla_param_shapes(c)) {
      std::int64_t n = 1;
      for (auto e : shape) n *= e;
      w[name] = test::random_vector<double>(n, seed++, -0.5, 0.5);
      if (shape.size() == 1)
        for (double& v : w[name]) v += 1.0;  // norm gains near 1
    }
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
        << "rq " << rq;
  }
}

struct FormCase {
  Form form;
  AttentionKind attention;
  QueryExchange queries = QueryExchange::heads;
};
class FormsVsNaive : public ::testing::TestWithParam<FormCase> {};

TEST_P(FormsVsNaive, DoubleMatchesEveryElement) {
  for (std::int64_t rq : {0, 7}) {
    if (rq == 0 && GetParam().queries == QueryExchange::latent) continue;  // no query latent
    MlaConfig c;
    c.dim = 24, c.n_heads = 5, c.q_lora_rank = rq, c.kv_lora_rank = 12, c.qk_nope_head_dim = 6,
    c.qk_rope_head_dim = 8, c.v_head_dim = 4;
    // YaRN with its ramp inside the 4 rope pairs.
    c.rope_theta = 500, c.original_seq_len = 64, c.max_seq_len = 256, c.rope_factor = 8;
    c.mscale = 0.7;
    c.validate();
    const std::int64_t B = 2, S = 11;
    auto w = MlaParams<double>::zeros(c, MemCategory::parameters);
    init_params(w, 21, 0.1);
    TensorD x({B, S, c.dim}), g({B, S, c.dim});
    test::fill_random(x.data(), x.numel(), 31);
    test::fill_random(g.data(), g.numel(), 32);
    test::NaiveTensors nw;
    w.for_each([&](const std::string& n, const TensorD& t) {
      nw[n].assign(t.data(), t.data() + t.numel());
    });
    const test::NaiveMlaResult ref = test::naive_mla(c, nw, {x.data(), x.data() + x.numel()},
                                                     {g.data(), g.data() + g.numel()}, B, S);
    for (int P : {1, 3}) {
      RunSpec spec;
      spec.variant.form = GetParam().form;
      spec.attention = GetParam().attention;
      spec.variant.queries = GetParam().queries;
      const BlockRun<double> run = run_local(c, SpLayout::even(B, S, c.n_heads, P), w, x, g, spec);
      const std::string tag = "rq " + std::to_string(rq) + " P " + std::to_string(P) + " ";
      const test::Tolerance tol = test::block_tolerance<double>();
      EXPECT_TRUE(
          test::all_close(tag + "out", run.out.data(), ref.out.data(), run.out.numel(), tol));
      EXPECT_TRUE(test::all_close(tag + "dx", run.dx.data(), ref.dx.data(), run.dx.numel(), tol));
      run.grads.for_each([&](const std::string& n, const TensorD& t) {
        EXPECT_TRUE(
            test::all_close(tag + "grad." + n, t.data(), ref.grads.at(n).data(), t.numel(), tol));
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllForms, FormsVsNaive,
    ::testing::Values(FormCase{Form::explicit_form, AttentionKind::eager},
                      FormCase{Form::absorbed, AttentionKind::eager},
                      FormCase{Form::laga, AttentionKind::eager},
                      FormCase{Form::explicit_form, AttentionKind::flash},
                      FormCase{Form::absorbed, AttentionKind::flash},
                      FormCase{Form::laga, AttentionKind::flash},
                      FormCase{Form::laga, AttentionKind::eager, QueryExchange::latent},
                      FormCase{Form::laga, AttentionKind::flash, QueryExchange::latent}),
    [](const ::testing::TestParamInfo<FormCase>& p) {
      return std::string(to_string(p.param.form)) +
             (p.param.queries == QueryExchange::latent ? "_qlatent_" : "_") +
             to_string(p.param.attention);
    });

}  // namespace
}  // namespace laga
