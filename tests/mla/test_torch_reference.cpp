// The whole block against an independent PyTorch autograd implementation
// (python/torch_reference.py, float64, written without reading this code):
// output, dx and every parameter gradient, fp32 here, for rq = 0 and rq > 0,
// YaRN on and off, odd head counts, B > 1; every form (and with rq > 0 laga
// with the query-latent exchange), at P = 1 and P = 3.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>

#include "common/check.hpp"
#include "io/safetensors.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

std::string case_path(const std::string& name) {
  const char* tmp = std::getenv("LAGA_TEST_TMP");
  return std::string(tmp ? tmp : ".") + "/torch_ref/case_" + name + ".safetensors";
}

// Every element within test::block_tolerance<float>() of the float64
// reference rounded to fp32: |a - b| <= atol + rtol |b|, so small elements
// are bounded relative to their own size, not only to the tensor's largest.
void expect_matches(const std::string& what, const TensorF& a, const TensorF& ref) {
  ASSERT_EQ(a.shape(), ref.shape()) << what;
  double ref_max = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i)
    ref_max = std::max(ref_max, std::abs(double(ref[i])));
  EXPECT_GT(ref_max, 0.0) << what << ": reference is all zeros; the case cannot catch anything";
  EXPECT_TRUE(
      test::all_close(what, a.data(), ref.data(), a.numel(), test::block_tolerance<float>()));
}

class TorchReference : public ::testing::TestWithParam<std::string> {};

TEST_P(TorchReference, BlockMatchesAutograd) {
  const std::string path = case_path(GetParam());
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing: ctest runs mla_torch_reference_data first (needs /usr/bin/python3 "
      << "with torch: scripts/setup.sh installs python3-torch)";
  const SafetensorsFile f = SafetensorsFile::open(path);
  const nlohmann::json meta = nlohmann::json::parse(f.metadata().at("config"));
  const MlaConfig cfg = MlaConfig::from_json(meta, path);
  const std::int64_t B = meta.at("batch"), S = meta.at("seq");
  auto w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
  w.for_each([&](const std::string& name, TensorF& t) { f.read_into(name, t); });
  const TensorF x = f.read<float>("x", {B, S, cfg.dim}, MemCategory::activations);
  const TensorF dout = f.read<float>("dout", {B, S, cfg.dim}, MemCategory::activations);
  const TensorF out = f.read<float>("out", {B, S, cfg.dim}, MemCategory::activations);
  const TensorF dx = f.read<float>("dx", {B, S, cfg.dim}, MemCategory::activations);

  // Every form; with rq > 0 laga with the query-latent exchange too.
  std::vector<FormVariant> variants;
  for (Form one : all_forms()) variants.push_back(one);
  if (cfg.q_lora_rank > 0) variants.push_back({Form::laga, QueryExchange::latent});
  for (int P : {1, 3})
    for (FormVariant form : variants)
      for (AttentionKind att : {AttentionKind::eager, AttentionKind::flash}) {
        RunSpec spec;
        spec.variant.form = form.form;
        spec.variant.queries = form.queries;
        spec.attention = att;
        const BlockRun<float> run =
            run_local(cfg, SpLayout::even(B, S, cfg.n_heads, P), w, x, dout, spec);
        const std::string tag =
            GetParam() + " " + to_string(form) + " P=" + std::to_string(P) + " " + to_string(att);
        expect_matches(tag + " out", run.out, out);
        expect_matches(tag + " dx", run.dx, dx);
        run.grads.for_each([&](const std::string& name, const TensorF& g) {
          expect_matches(tag + " grad." + name, g,
                         f.read<float>("grad." + name, g.shape(), MemCategory::activations));
        });
      }
}

INSTANTIATE_TEST_SUITE_P(Cases, TorchReference, ::testing::Values("a", "b", "c", "d"));

}  // namespace
}  // namespace laga
