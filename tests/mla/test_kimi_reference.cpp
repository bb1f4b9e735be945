// Kimi K3's gated NoPE MLA against an independent PyTorch implementation of
// Kimi's own attention code (python/kimi_reference.py: Hugging Face /
// torchtitan math, weights under Kimi's names, the config under Kimi's
// config.json keys), in float64: every form and variant, at P 1, 3 and an
// uneven layout with a rank holding no head, out, dx and every gradient
// (g_proj's included) within the block's double tolerance. The config and
// the weights go through laga's readers (MlaConfig::from_json,
// hf_param_name), so Kimi's key and weight names are what is tested.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "common/check.hpp"
#include "io/safetensors.hpp"
#include "mla/params.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

std::string case_path(const std::string& name) {
  const char* tmp = std::getenv("LAGA_TEST_TMP");
  return std::string(tmp ? tmp : ".") + "/kimi_ref/case_" + name + ".safetensors";
}

class KimiReference : public ::testing::TestWithParam<std::string> {};

TEST_P(KimiReference, EveryFormMatchesKimisAttentionInDouble) {
  const std::string path = case_path(GetParam());
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing: ctest runs mla_kimi_reference_data first (needs /usr/bin/python3 "
      << "with torch)";
  const SafetensorsFile f = SafetensorsFile::open(path);
  const MlaConfig cfg =
      MlaConfig::from_json(nlohmann::json::parse(f.metadata().at("config")), path);
  ASSERT_TRUE(cfg.mla_use_nope);
  const std::int64_t B = std::stoll(f.metadata().at("batch")),
                     S = std::stoll(f.metadata().at("seq"));
  auto w = MlaParams<double>::zeros(cfg, MemCategory::parameters);
  w.for_each([&](const std::string& name, TensorD& t) { f.read_into(hf_param_name(name, 0), t); });
  auto act = [&](const char* name) {
    return f.read<double>(name, {B, S, cfg.dim}, MemCategory::activations);
  };
  const TensorD x = act("x"), dout = act("dout"), out = act("out"), dx = act("dx");
  const test::Tolerance tol = test::block_tolerance<double>();
  std::vector<FormVariant> variants;
  for (Form one : all_forms()) variants.push_back(one);
  if (cfg.q_lora_rank > 0) variants.push_back({Form::laga, QueryExchange::latent});
  std::vector<SpLayout> layouts = {SpLayout::even(B, S, cfg.n_heads, 1),
                                   SpLayout::even(B, S, cfg.n_heads, 3)};
  if (S >= 9)
    layouts.push_back(SpLayout::custom(
        B, {1, S - 5, 4},
        {0, cfg.n_heads - cfg.n_heads / 2, cfg.n_heads / 2}));  // a one-token rank, no head
  for (const SpLayout& lay : layouts)
    for (FormVariant v : variants)
      for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
        RunSpec spec;
        spec.variant = v, spec.attention = a;
        const BlockRun<double> run = run_local(cfg, lay, w, x, dout, spec);
        const std::string tag =
            GetParam() + " " + to_string(v) + " " + to_string(a) + " " + lay.describe() + " ";
        EXPECT_TRUE(test::all_close(tag + "out", run.out.data(), out.data(), out.numel(), tol));
        EXPECT_TRUE(test::all_close(tag + "dx", run.dx.data(), dx.data(), dx.numel(), tol));
        run.grads.for_each([&](const std::string& name, const TensorD& g) {
          const TensorD ref =
              f.read<double>("grad." + hf_param_name(name, 0), g.shape(), MemCategory::activations);
          EXPECT_TRUE(test::all_close(tag + "grad." + name, g.data(), ref.data(), g.numel(), tol));
        });
      }
}

INSTANTIATE_TEST_SUITE_P(Cases, KimiReference, ::testing::Values("k3_like", "rope0_rq0", "nogate"));

}  // namespace
}  // namespace laga
