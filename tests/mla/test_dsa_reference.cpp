// The single-rank DSA block (mla/dsa_block.hpp) against
//  - PyTorch autograd (python/dsa_reference.py, float64, dense index mask):
//    the selection exactly, out, dx, every LM gradient, the KL loss and the
//    indexer's KL gradients, in fp64 and fp32, sparse stage (YaRN off and on)
//    and dense warm-up, attending per head and in latent space;
//  - DeepSeek's own prefill math (python/dsa_deepseek_harness.py, a
//    transcription of DeepSeek-V3.2-Exp inference/model.py after 8631a81
//    "fix indexer rope", fp8 and the Hadamard rotation removed): each query's
//    selected keys equal its torch.topk set (within the causal mask, where
//    DeepSeek's index_mask keeps them) and the block's output equals its
//    MLA.forward prefill.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "io/safetensors.hpp"
#include "mla/dsa_block.hpp"

namespace laga {
namespace {

std::string dir() {
  const char* tmp = std::getenv("LAGA_TEST_TMP");
  return std::string(tmp ? tmp : ".") + "/dsa_ref/";
}

std::vector<double> values(const SafetensorsFile& f, const std::string& name) {
  const Tensor<double> t = f.read<double>(name, MemCategory::activations);
  return {t.data(), t.data() + t.numel()};
}

template <class T>
test::Tolerance tolerance() {
  return test::block_tolerance<T>();
}

template <class T>
void check_case(const std::string& name, DsaStage stage, DsaAttend attend) {
  const std::string path = dir() + "dsa_" + name + ".safetensors";
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing: ctest runs mla_dsa_reference_data first (/usr/bin/python3 with "
      << "torch)";
  const SafetensorsFile f = SafetensorsFile::open(path);
  const nlohmann::json meta = nlohmann::json::parse(f.metadata().at("config"));
  const MlaConfig cfg = MlaConfig::from_json(meta, path);
  const std::int64_t B = meta.at("batch"), S = meta.at("seq"), K = cfg.index_topk;
  ASSERT_EQ(meta.at("stage").get<std::string>(), to_string(stage));
  MlaParams<T> w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
  w.for_each([&](const std::string& n, Tensor<T>& t) { f.read_into(n, t); });
  DsaIndexerParams<T> iw = DsaIndexerParams<T>::zeros(cfg);
  for (auto& [n, t] : iw.named()) {
    const std::vector<double> v = values(f, n);
    ASSERT_EQ(v.size(), t->size()) << n;
    t->assign(v.begin(), v.end());
  }
  const std::vector<double> x64 = values(f, "x"), dout64 = values(f, "dout");
  const std::vector<T> x(x64.begin(), x64.end()), dout(dout64.begin(), dout64.end());
  const DsaBlockResult<T> r = dsa_block(cfg, w, iw, x.data(), dout.data(), B, S, stage, attend);
  const std::string tag =
      name + (std::is_same_v<T, double> ? " fp64 " : " fp32 ") + to_string(attend);
  const test::Tolerance tol = tolerance<T>();

  const std::vector<std::int64_t> idx_ref = f.read_indices("idx");
  ASSERT_EQ(idx_ref.size(), r.idx.size());
  for (std::size_t n = 0; n < idx_ref.size(); ++n)
    ASSERT_EQ(r.idx[n], idx_ref[n]) << tag << ": selection slot " << n;
  EXPECT_TRUE(test::all_close(tag + " out", r.out, values(f, "out"), tol.atol, tol.rtol));
  EXPECT_TRUE(test::all_close(tag + " dx", r.dx, values(f, "dx"), tol.atol, tol.rtol));
  r.grads.for_each([&](const std::string& n, const Tensor<T>& g) {
    const std::vector<double> ref = values(f, "grad." + n);
    EXPECT_TRUE(test::all_close(tag + " grad " + n, g.data(), ref.data(), g.numel(), tol));
  });
  DsaIndexerParams<T> ig = r.indexer_grads;
  for (auto& [n, g] : ig.named())
    EXPECT_TRUE(
        test::all_close(tag + " grad " + n, *g, values(f, "grad." + n), tol.atol, tol.rtol));
  const double kl_ref = values(f, "kl_loss").at(0);
  EXPECT_NEAR(r.kl_loss, kl_ref, (std::is_same_v<T, double> ? 1e-12 : 1e-5) * kl_ref) << tag;

  if (stage != DsaStage::sparse) return;
  // DeepSeek's code: its topk set within the causal mask, and its output.
  const std::string ds_path = dir() + "dsa_" + name + "_deepseek.safetensors";
  ASSERT_TRUE(std::filesystem::exists(ds_path))
      << ds_path << " is missing: ctest runs mla_dsa_deepseek_harness first";
  const SafetensorsFile ds = SafetensorsFile::open(ds_path);
  const std::vector<std::int64_t> topk = ds.read_indices("deepseek_topk");
  const std::int64_t KD = std::min(K, S);
  ASSERT_EQ(std::int64_t(topk.size()), B * S * KD);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s) {
      std::set<std::int64_t> theirs, ours;
      for (std::int64_t slot = 0; slot < KD; ++slot)
        if (const std::int64_t j = topk[std::size_t((b * S + s) * KD + slot)]; j <= s)
          theirs.insert(j);
      for (std::int64_t slot = 0; slot < K; ++slot)
        if (const std::int32_t j = r.idx[std::size_t((b * S + s) * K + slot)]; j >= 0)
          ours.insert(j);
      EXPECT_EQ(ours, theirs) << tag << ": batch " << b << " query " << s;
    }
  EXPECT_TRUE(test::all_close(tag + " out vs DeepSeek", r.out, values(ds, "deepseek_out"), tol.atol,
                              tol.rtol));
}

TEST(DsaReference, SparseStage) {
  for (DsaAttend a : {DsaAttend::per_head, DsaAttend::latent})
    check_case<double>("sparse", DsaStage::sparse, a);
  for (DsaAttend a : {DsaAttend::per_head, DsaAttend::latent})
    check_case<float>("sparse", DsaStage::sparse, a);
}
TEST(DsaReference, SparseStageWithYarn) {
  for (DsaAttend a : {DsaAttend::per_head, DsaAttend::latent})
    check_case<double>("sparse_yarn", DsaStage::sparse, a);
  for (DsaAttend a : {DsaAttend::per_head, DsaAttend::latent})
    check_case<float>("sparse_yarn", DsaStage::sparse, a);
}
TEST(DsaReference, DenseWarmup) {
  for (DsaAttend a : {DsaAttend::per_head, DsaAttend::latent})
    check_case<double>("dense_warmup", DsaStage::dense_warmup, a);
  for (DsaAttend a : {DsaAttend::per_head, DsaAttend::latent})
    check_case<float>("dense_warmup", DsaStage::dense_warmup, a);
}

}  // namespace
}  // namespace laga
