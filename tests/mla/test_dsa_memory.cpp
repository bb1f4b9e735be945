// DSA's activation memory (mla/dsa_model.hpp, dsa_memory) against the
// pool: for latent_gather (mla/dsa_cp.hpp), explicit (mla/dsa_explicit.hpp)
// and the LAGA forms (mla/dsa_laga.hpp; the head-sharded ones also at P 6
// with a rank of no heads), at P 1..4 with
// uneven shards and heads, both stages, fp32, fp64 and bf16, with and
// without dout, on every rank, a real run's pool peak
// (MemCategory::activations) equals a count-only run's
// (MemoryPool::set_count_only, the rank alone on a DryRunCommunicator) and
// dsa_memory's peak (forward_peak without dout), in bytes; and at
// DeepSeek-V3.2's dims (S 32768 and 131072, P 8 and 64; latent_gather on
// ranks 0 and P-1, the head-sharded forms on P-1, each in bf16 at S 131072
// P 8 too) the
// count-only run equals dsa_memory, without the memory (a few seconds,
// most of it each run's RoPE table). The single-rank block
// (mla/dsa_block.hpp, not a form: no dsa_memory) has a count-only run too,
// its peak a real run's.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/dry_run_comm.hpp"
#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "dsa_form_cases.hpp"
#include "mla/dsa_cp.hpp"
#include "mla/dsa_explicit.hpp"
#include "mla/dsa_laga.hpp"
#include "mla/dsa_model.hpp"
#include "mla/ops.hpp"

namespace laga {
namespace {

// The pool's activation peak of one call of f, above what was live before.
template <class F>
std::int64_t activation_peak(F&& f) {
  MemoryPool& pool = current_pool();
  const std::int64_t base = pool.current(MemCategory::activations);
  pool.reset_peaks();
  f();
  EXPECT_EQ(pool.current(MemCategory::activations), base) << "a DSA tensor outlived its run";
  return pool.peak(MemCategory::activations) - base;
}

// The forms the engine runs (dsa_form_runs), each on pool tensors, by DsaForm.
template <class T>
DsaBlockResult<T> run_form(DsaForm form, const MlaConfig& cfg, const MlaParams<T>& w,
                           const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                           const SpLayout& lay, DsaStage stage, Communicator& comm) {
  if (form == DsaForm::explicit_form) return dsa_explicit(cfg, w, iw, x, dout, lay, stage, comm);
  if (form == DsaForm::laga_indices || form == DsaForm::laga_recompute)
    return dsa_laga(cfg, w, iw, x, dout, lay, stage, form, comm);
  return dsa_latent_gather(cfg, w, iw, x, dout, lay, stage, comm);
}

// One rank alone under a count-only pool: x is never read (pass null), dout
// only says whether backward runs.
template <class T>
std::int64_t count_only_peak(DsaForm form, const MlaConfig& cfg, const SpLayout& lay, int r,
                             DsaStage stage, bool backward, bool bf16) {
  MemoryPool pool;
  pool.set_count_only(true);
  const PoolScope scope(pool);
  const UsePrecision precision(bf16 ? Precision::bf16 : Precision::fp32);
  const MlaParams<T> w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
  const DsaIndexerParams<T> iw = DsaIndexerParams<T>::zeros(cfg);
  DryRunCommunicator comm(r, lay.ranks);
  const T unread{};
  return activation_peak([&] {
    const DsaBlockResult<T> res =
        run_form<T>(form, cfg, w, iw, nullptr, backward ? &unread : nullptr, lay, stage, comm);
    EXPECT_TRUE(res.out.empty() && res.dx.empty() && res.idx.empty()) << "count-only results";
  });
}

RunDtype dtype_of(bool is_double, bool bf16) {
  return is_double ? RunDtype::fp64 : bf16 ? RunDtype::bf16 : RunDtype::fp32;
}

template <class T>
void check_small(DsaForm form, const std::vector<std::int64_t>& counts,
                 const std::vector<std::int64_t>& heads, DsaStage stage, bool backward, bool bf16) {
  const MlaConfig cfg = test::dsa_small_config(5);
  const int P = int(counts.size());
  const std::int64_t B = 2, D = cfg.dim;
  const auto [S, lay, w, iw, x, dout] = test::dsa_form_inputs<T>(cfg, B, counts, heads);
  std::vector<MemoryPool> pools;
  std::vector<std::int64_t> real(static_cast<std::size_t>(P));
  test::dsa_run_ranks(lay, x, dout, pools, [&](Communicator& comm, const T* xr, const T* dr) {
    const UsePrecision precision(bf16 ? Precision::bf16 : Precision::fp32);
    const int r = comm.rank();
    const std::int64_t L = lay.seq_count[std::size_t(r)];
    real[std::size_t(r)] = activation_peak([&] {
      const DsaBlockResult<T> res =
          run_form<T>(form, cfg, w, iw, xr, backward ? dr : nullptr, lay, stage, comm);
      EXPECT_EQ(res.out.size(), std::size_t(B * L * D));
    });
  });
  const RunDtype dt = dtype_of(sizeof(T) == 8, bf16);
  for (int r = 0; r < P; ++r) {
    const std::string what = std::string(to_string(form)) + " " + to_string(dt) + " " +
                             to_string(stage) + (backward ? "" : " forward only") + " " +
                             lay.describe() + " rank " + std::to_string(r);
    const DsaMemory m = dsa_memory(cfg, *DsaConfig::of(cfg), lay, form, r, dt, stage);
    const std::int64_t want = backward ? m.peak : m.forward_peak;
    EXPECT_EQ(real[std::size_t(r)], want) << what << "; model peak at '" << m.peak_where << "'";
    EXPECT_EQ(count_only_peak<T>(form, cfg, lay, r, stage, backward, bf16), want)
        << what << " count-only";
  }
}

// S 11 in uneven shards, H 5 near-equally over their ranks.
void check_small_all(DsaForm form) {
  for (const std::vector<std::int64_t>& counts : test::kDsaTokenShards) {
    const std::vector<std::int64_t> heads = test::dsa_heads_of(5, int(counts.size()));
    for (DsaStage stage : {DsaStage::sparse, DsaStage::dense_warmup})
      for (bool backward : {true, false}) {
        check_small<double>(form, counts, heads, stage, backward, false);
        check_small<float>(form, counts, heads, stage, backward, false);
        check_small<float>(form, counts, heads, stage, backward, true);
      }
  }
}

TEST(DsaMemory, LatentGatherPeakIsThePoolsOnEveryRank) {
  check_small_all(DsaForm::latent_gather);
}

// Uneven heads, and at P 6 (S 11, H 5) a rank with none.
TEST(DsaMemory, ExplicitPeakIsThePoolsOnEveryRank) {
  check_small_all(DsaForm::explicit_form);
  for (bool bf16 : {false, true})
    check_small<float>(DsaForm::explicit_form, {2, 2, 2, 2, 2, 1}, {1, 1, 1, 1, 1, 0},
                       DsaStage::sparse, true, bf16);
}

// The LAGA forms: uneven heads, and at P 6 (S 11, H 5) a rank with none.
TEST(DsaMemory, LagaFormsPeakIsThePoolsOnEveryRank) {
  for (DsaForm form : {DsaForm::laga_indices, DsaForm::laga_recompute}) {
    check_small_all(form);
    for (DsaStage stage : {DsaStage::sparse, DsaStage::dense_warmup})
      for (bool bf16 : {false, true})
        check_small<float>(form, {2, 2, 2, 2, 2, 1}, {1, 1, 1, 1, 1, 0}, stage, true, bf16);
  }
}

TEST(DsaMemory, CountOnlyAtDeepSeekV32Dims) {
  const DsaConfig dsa = *DsaConfig::preset("deepseek-v3.2");
  const MlaConfig cfg = dsa.with(MlaConfig::preset("deepseek-v3.2"));
  struct Case {
    DsaForm form;
    std::int64_t S;
    int P, rank;
    bool bf16;
  };
  std::vector<Case> cases;
  for (std::int64_t S : {32768, 131072})
    for (int P : {8, 64}) {
      for (int r : {0, P - 1}) cases.push_back({DsaForm::latent_gather, S, P, r, false});
      // the head-sharded forms' largest rank
      for (DsaForm form : {DsaForm::explicit_form, DsaForm::laga_indices, DsaForm::laga_recompute})
        cases.push_back({form, S, P, P - 1, false});
    }
  for (DsaForm form : {DsaForm::latent_gather, DsaForm::explicit_form, DsaForm::laga_indices,
                       DsaForm::laga_recompute})
    cases.push_back({form, 131072, 8, 7, true});
  for (const Case& c : cases) {
    const SpLayout lay = SpLayout::even(1, c.S, cfg.n_heads, c.P);
    const RunDtype dt = c.bf16 ? RunDtype::bf16 : RunDtype::fp32;
    const DsaMemory m = dsa_memory(cfg, dsa, lay, c.form, c.rank, dt);
    EXPECT_EQ(count_only_peak<float>(c.form, cfg, lay, c.rank, DsaStage::sparse, true, c.bf16),
              m.peak)
        << to_string(c.form) << " deepseek-v3.2 S " << c.S << " P " << c.P << " rank " << c.rank
        << " " << to_string(dt) << "; model peak at '" << m.peak_where << "'";
  }
}

// The single-rank block: a count-only run's activation peak is a real run's,
// per attend, stage, dtype, with and without dout.
template <class T>
void check_block(DsaAttend attend, DsaStage stage, bool backward, bool bf16) {
  const MlaConfig cfg = test::dsa_small_config(5);
  const std::int64_t B = 2, S = 11, D = cfg.dim;
  const UsePrecision precision(bf16 ? Precision::bf16 : Precision::fp32);
  std::int64_t real = 0, counted = 0;
  {
    MemoryPool pool;
    const PoolScope scope(pool);
    MlaParams<T> w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
    init_params(w, 5, 0.1);
    const DsaIndexerParams<T> iw = test::dsa_indexer_weights<T>(cfg, 40);
    const std::vector<T> x = test::random_vector<T>(B * S * D, 7);
    const std::vector<T> dout = test::random_vector<T>(B * S * D, 8);
    real = activation_peak([&] {
      const DsaBlockResult<T> r =
          dsa_block(cfg, w, iw, x.data(), backward ? dout.data() : nullptr, B, S, stage, attend);
      EXPECT_EQ(r.out.size(), std::size_t(B * S * D));
    });
  }
  {
    MemoryPool pool;
    pool.set_count_only(true);
    const PoolScope scope(pool);
    const MlaParams<T> w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
    const DsaIndexerParams<T> iw = DsaIndexerParams<T>::zeros(cfg);
    const T unread{};
    counted = activation_peak([&] {
      const DsaBlockResult<T> r =
          dsa_block<T>(cfg, w, iw, nullptr, backward ? &unread : nullptr, B, S, stage, attend);
      EXPECT_TRUE(r.out.empty() && r.dx.empty() && r.idx.empty()) << "count-only results";
    });
  }
  EXPECT_GT(real, 0);
  EXPECT_EQ(counted, real) << "dsa_block " << to_string(attend) << " " << to_string(stage)
                           << (sizeof(T) == 8 ? " fp64"
                               : bf16         ? " bf16"
                                              : " fp32")
                           << (backward ? "" : " forward only");
}

TEST(DsaMemory, BlockCountOnlyPeakIsARealRuns) {
  for (DsaAttend attend : {DsaAttend::per_head, DsaAttend::latent})
    for (DsaStage stage : {DsaStage::sparse, DsaStage::dense_warmup})
      for (bool backward : {true, false}) {
        check_block<double>(attend, stage, backward, false);
        check_block<float>(attend, stage, backward, false);
        check_block<float>(attend, stage, backward, true);
      }
}

}  // namespace
}  // namespace laga
