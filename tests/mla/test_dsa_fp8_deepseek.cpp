// laga's fp8 indexer (index_fp8; kernels/dsa_indexer_fp8.hpp) against
// DeepSeek's fp8 path (python/dsa_deepseek_fp8.py: DeepSeek-V3.2-Exp's
// Indexer.forward with rotate_activation, act_quant ue8m0 and fp8_index, the
// e4m3 cast by torch.float8_e4m3fn or a numpy emulation): each query's
// selected keys equal DeepSeek's torch.topk set exactly, and the block's
// output its MLA.forward prefill (kv-cache fp8 simulation off) within
// block_tolerance, single-rank (dsa_block, per head and latent, double and
// float; with kv_fp8_round_trip, DeepSeek's fp8 kv-cache simulation, on and
// off) and every DSA form at P 2-4 with uneven shards (the forms take both
// options through the config).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "common/error_of.hpp"
#include "dsa_form_cases.hpp"
#include "io/safetensors.hpp"
#include "mla/dsa_block.hpp"
#include "mla/dsa_cp.hpp"
#include "mla/dsa_explicit.hpp"
#include "mla/dsa_laga.hpp"
#include "mla/dsa_model.hpp"

namespace laga {
namespace {

// The case file: LAGA_DSA_FP8_CASE (ctest sets it, one per torch), else
// LAGA_TEST_TMP/dsa_fp8/dsa_fp8.safetensors.
std::string path() {
  if (const char* p = std::getenv("LAGA_DSA_FP8_CASE")) return p;
  const char* tmp = std::getenv("LAGA_TEST_TMP");
  return std::string(tmp ? tmp : ".") + "/dsa_fp8/dsa_fp8.safetensors";
}

std::vector<double> values(const SafetensorsFile& f, const std::string& name) {
  const Tensor<double> t = f.read<double>(name, MemCategory::activations);
  return {t.data(), t.data() + t.numel()};
}

template <class T>
struct Fp8Case {
  MlaConfig cfg;
  std::int64_t B = 0, S = 0;
  MlaParams<T> w;
  DsaIndexerParams<T> iw;
  std::vector<T> x;
  std::vector<std::int64_t> topk;        // DeepSeek's (B, S, min(K, S))
  std::vector<double> out;               // DeepSeek's (B, S, D), the whole fp8 path
  std::vector<double> out_indexer_only;  // its kv-cache simulation off
};

template <class T>
Fp8Case<T> load() {
  Fp8Case<T> c;
  const SafetensorsFile f = SafetensorsFile::open(path());
  const nlohmann::json meta = nlohmann::json::parse(f.metadata().at("config"));
  c.cfg = MlaConfig::from_json(meta, path());
  c.B = meta.at("batch"), c.S = meta.at("seq");
  c.w = MlaParams<T>::zeros(c.cfg, MemCategory::parameters);
  c.w.for_each([&](const std::string& n, Tensor<T>& t) { f.read_into(n, t); });
  c.iw = DsaIndexerParams<T>::zeros(c.cfg);
  for (auto& [n, t] : c.iw.named()) {
    const std::vector<double> v = values(f, n);
    t->assign(v.begin(), v.end());
  }
  const std::vector<double> x = values(f, "x");
  c.x.assign(x.begin(), x.end());
  c.topk = f.read_indices("deepseek_topk");
  c.out = values(f, "deepseek_out");
  c.out_indexer_only = values(f, "deepseek_out_indexer_only");
  return c;
}

// Rows [s0, s0 + L) of each batch row: the selection equals DeepSeek's
// topk set within the causal mask (its topk keeps masked keys in rows
// with fewer than K causal ones), row for row.
template <class T>
void expect_selection(const std::string& tag, const Fp8Case<T>& c,
                      const std::vector<std::int32_t>& idx, std::int64_t s0, std::int64_t L) {
  const std::int64_t K = c.cfg.index_topk, KD = std::min(K, c.S);
  ASSERT_EQ(std::int64_t(idx.size()), c.B * L * K) << tag;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t l = 0; l < L; ++l) {
      const std::int64_t s = s0 + l;
      std::set<std::int64_t> theirs, ours;
      for (std::int64_t slot = 0; slot < KD; ++slot)
        if (const std::int64_t j = c.topk[std::size_t((b * c.S + s) * KD + slot)]; j <= s)
          theirs.insert(j);
      for (std::int64_t slot = 0; slot < K; ++slot)
        if (const std::int32_t j = idx[std::size_t((b * L + l) * K + slot)]; j >= 0) ours.insert(j);
      EXPECT_EQ(ours, theirs) << tag << ": batch " << b << " query " << s;
    }
}

template <class T>
void single_rank() {
  ASSERT_TRUE(std::filesystem::exists(path()))
      << path() << " is missing: ctest runs mla_dsa_deepseek_fp8_data first";
  const Fp8Case<T> c = load<T>();
  ASSERT_TRUE(c.cfg.index_fp8 && c.cfg.kv_fp8_round_trip)
      << "the case's config must turn index_fp8 and kv_fp8_round_trip on";
  MlaConfig indexer_only = c.cfg;
  indexer_only.kv_fp8_round_trip = false;
  const test::Tolerance tol = test::block_tolerance<T>();
  const T* const no_dout = nullptr;  // forward only: DeepSeek's code has no backward
  for (DsaAttend attend : {DsaAttend::per_head, DsaAttend::latent}) {
    const std::string tag =
        std::string(sizeof(T) == 8 ? "fp64 " : "fp32 ") + to_string(attend) + " fp8";
    const DsaBlockResult<T> r =
        dsa_block(c.cfg, c.w, c.iw, c.x.data(), no_dout, c.B, c.S, DsaStage::sparse, attend);
    expect_selection(tag, c, r.idx, 0, c.S);
    EXPECT_TRUE(test::all_close(tag + " out vs DeepSeek", r.out, c.out, tol.atol, tol.rtol));
    const DsaBlockResult<T> i =
        dsa_block(indexer_only, c.w, c.iw, c.x.data(), no_dout, c.B, c.S, DsaStage::sparse, attend);
    expect_selection(tag + " indexer only", c, i.idx, 0, c.S);
    EXPECT_TRUE(test::all_close(tag + " indexer only: out vs DeepSeek", i.out, c.out_indexer_only,
                                tol.atol, tol.rtol));
  }
  // The kv round trip is forward only: a backward is refused, naming it.
  const std::vector<T> dout(c.x.size(), T(1));
  EXPECT_NE(test::error_of([&] {
              dsa_block(c.cfg, c.w, c.iw, c.x.data(), dout.data(), c.B, c.S, DsaStage::sparse,
                        DsaAttend::per_head);
            }).find("kv_fp8_round_trip simulates DeepSeek's fp8 kv cache at inference"),
            std::string::npos);
  // The option is what makes the match: scored in the run's dtype, the
  // same weights select other keys for some query (the harness prints how
  // many rows differ).
  MlaConfig plain = c.cfg;
  plain.index_fp8 = false;
  const DsaBlockResult<T> p = dsa_block(plain, c.w, c.iw, c.x.data(), no_dout, c.B, c.S,
                                        DsaStage::sparse, DsaAttend::per_head);
  const DsaBlockResult<T> q = dsa_block(c.cfg, c.w, c.iw, c.x.data(), no_dout, c.B, c.S,
                                        DsaStage::sparse, DsaAttend::per_head);
  EXPECT_NE(p.idx, q.idx) << "index_fp8 changed no selection: the case does not test it";
}

TEST(DsaFp8Deepseek, SingleRankEqualsDeepSeeksFp8Path) {
  single_rank<double>();
  single_rank<float>();
}

// Training with index_fp8 (docs/forms.md, "The fp8 indexer"): the fp8
// scores pick the keys, the KL and its gradient read the run-dtype scores.
// In the dense warm-up every causal key is attended and is the KL's key set,
// so the option changes nothing there but the (unused) selection: the
// output, dx, every LM gradient, the KL loss and the indexer's gradients
// equal the run-dtype run's exactly. (Were the KL read from the fp8 scores,
// they would not.)
TEST(DsaFp8Deepseek, TheKlAndEveryGradientReadTheRunDtypeScores) {
  ASSERT_TRUE(std::filesystem::exists(path())) << path() << " is missing";
  Fp8Case<double> c = load<double>();
  c.cfg.kv_fp8_round_trip = false;  // forward only; this test trains
  MlaConfig plain = c.cfg;
  plain.index_fp8 = false;
  const std::vector<double> dout = test::random_vector<double>(c.B * c.S * c.cfg.dim, 17);
  const DsaBlockResult<double> a = dsa_block(c.cfg, c.w, c.iw, c.x.data(), dout.data(), c.B, c.S,
                                             DsaStage::dense_warmup, DsaAttend::per_head);
  const DsaBlockResult<double> b = dsa_block(plain, c.w, c.iw, c.x.data(), dout.data(), c.B, c.S,
                                             DsaStage::dense_warmup, DsaAttend::per_head);
  EXPECT_NE(a.idx, b.idx) << "the fp8 selection equals the run-dtype one: the case tests nothing";
  EXPECT_GT(a.kl_loss, 0);
  EXPECT_EQ(a.kl_loss, b.kl_loss);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.dx, b.dx);
  a.grads.for_each([&](const std::string& n, const Tensor<double>& g) {
    b.grads.for_each([&](const std::string& n2, const Tensor<double>& h) {
      if (n2 != n) return;
      EXPECT_TRUE(std::equal(g.data(), g.data() + g.numel(), h.data())) << n;
    });
  });
  DsaIndexerParams<double> ga = a.indexer_grads, gb = b.indexer_grads;
  auto na = ga.named(), nb = gb.named();
  for (std::size_t k = 0; k < na.size(); ++k)
    EXPECT_EQ(*na[k].second, *nb[k].second) << na[k].first;
  // The sparse stage trains with the option on (its KL over the fp8
  // selection): finite, and the LM gradient reaches x.
  const DsaBlockResult<double> s = dsa_block(c.cfg, c.w, c.iw, c.x.data(), dout.data(), c.B, c.S,
                                             DsaStage::sparse, DsaAttend::per_head);
  EXPECT_TRUE(std::isfinite(s.kl_loss));
  EXPECT_EQ(s.idx, a.idx);
}

template <class T>
void forms() {
  ASSERT_TRUE(std::filesystem::exists(path())) << path() << " is missing";
  const Fp8Case<T> c = load<T>();
  const std::int64_t D = c.cfg.dim, S = c.S, B = c.B;
  const test::Tolerance tol = test::block_tolerance<T>();
  const T* const no_dout = nullptr;  // forward only: DeepSeek's code has no backward
  const std::vector<std::vector<std::int64_t>> shards = {{12, 8}, {7, 5, 8}, {3, 6, 6, 5}};
  for (const std::vector<std::int64_t>& counts : shards) {
    const int P = int(counts.size());
    const SpLayout lay = SpLayout::custom(B, counts, test::dsa_heads_of(c.cfg.n_heads, P));
    for (DsaForm form : {DsaForm::latent_gather, DsaForm::laga_indices, DsaForm::laga_recompute,
                         DsaForm::explicit_form}) {
      std::vector<MemoryPool> pools;
      std::vector<DsaBlockResult<T>> got(static_cast<std::size_t>(P));
      test::dsa_run_ranks(
          lay, c.x, std::vector<T>(), pools, [&](Communicator& comm, const T* xr, const T*) {
            DsaBlockResult<T>& g = got[std::size_t(comm.rank())];
            if (form == DsaForm::latent_gather)
              g = dsa_latent_gather(c.cfg, c.w, c.iw, xr, no_dout, lay, DsaStage::sparse, comm);
            else if (form == DsaForm::explicit_form)
              g = dsa_explicit(c.cfg, c.w, c.iw, xr, no_dout, lay, DsaStage::sparse, comm);
            else
              g = dsa_laga(c.cfg, c.w, c.iw, xr, no_dout, lay, DsaStage::sparse, form, comm);
          });
      for (int r = 0; r < P; ++r) {
        const std::int64_t s0 = lay.shard_begin(r), L = lay.seq_count[std::size_t(r)];
        const std::string tag = std::string(to_string(form)) + " P " + std::to_string(P) +
                                " rank " + std::to_string(r) + (sizeof(T) == 8 ? " fp64" : " fp32");
        expect_selection(tag, c, got[std::size_t(r)].idx, s0, L);
        EXPECT_TRUE(test::all_close(tag + " out vs DeepSeek", got[std::size_t(r)].out,
                                    test::dsa_rows(c.out, B, S, D, s0, L), tol.atol, tol.rtol));
      }
    }
  }
}

TEST(DsaFp8Deepseek, EveryFormAtP2To4EqualsDeepSeeksFp8Path) {
  forms<double>();
  forms<float>();
}

}  // namespace
}  // namespace laga
