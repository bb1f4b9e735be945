// What the DSA forms ask the op layer for (mla/ops_dsa.hpp) counted as
// their ops run, against the closed form the planner prices them by
// (dsa_work, mla/dsa_model.hpp): every rank's GEMM FLOPs and the indexer's
// score FLOPs (its top-k over every causal pair, its KL over the selected
// slots), forward and backward summed, for the latent gather, laga_indices,
// laga_recompute and explicit at P 1..4 with uneven shards (and uneven
// heads for the head-sharded forms), sparse stage. Before the DSA code went
// through the op layer it counted nothing (its kernels were called
// directly), so each count was 0.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

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

MlaConfig counts_config() {
  return test::dsa_small_config(5);
}

struct Shards {
  std::vector<std::int64_t> tokens, heads;
};
// S 11, H 5: even and uneven token shards, uneven heads.
const std::vector<Shards> kShards = {
    {{11}, {5}}, {{6, 5}, {3, 2}}, {{5, 2, 4}, {2, 2, 1}}, {{3, 3, 1, 4}, {2, 1, 1, 1}}};

template <class T>
void check_counts(DsaForm form, const Shards& sh) {
  const MlaConfig cfg = counts_config();
  const int P = int(sh.tokens.size());
  const std::int64_t B = 2;
  const auto [S, lay, w, iw, x, dout] = test::dsa_form_inputs<T>(cfg, B, sh.tokens, sh.heads);
  std::vector<MemoryPool> pools;
  std::vector<ops::OpCounts> counts(static_cast<std::size_t>(P));
  std::vector<DsaBlockResult<T>> got(static_cast<std::size_t>(P));
  test::dsa_run_ranks(lay, x, dout, pools, [&](Communicator& comm, const T* xr, const T* dr) {
    const std::size_t r = std::size_t(comm.rank());
    const ops::CountOps count(counts[r]);
    const DsaStage st = DsaStage::sparse;
    if (form == DsaForm::latent_gather)
      got[r] = dsa_latent_gather(cfg, w, iw, xr, dr, lay, st, comm);
    else if (form == DsaForm::explicit_form)
      got[r] = dsa_explicit(cfg, w, iw, xr, dr, lay, st, comm);
    else
      got[r] = dsa_laga(cfg, w, iw, xr, dr, lay, st, form, comm);
  });
  for (int r = 0; r < P; ++r) {
    const DsaRankWork want = dsa_work(cfg, *DsaConfig::of(cfg), lay, form, r);
    const ops::OpCounts& c = counts[std::size_t(r)];
    const std::string what = std::string(to_string(form)) + " P " + std::to_string(P) + " " +
                             lay.describe() + " rank " + std::to_string(r);
    EXPECT_EQ(c.gemm_flops, want.forward.gemm_flops + want.backward.gemm_flops) << what;
    EXPECT_EQ(c.indexer_flops, want.forward.indexer_flops + want.backward.indexer_flops) << what;
  }
}

TEST(DsaCounts, LatentGatherCountsWhatDsaWorkPrices) {
  for (const Shards& s : kShards) check_counts<double>(DsaForm::latent_gather, s);
}
TEST(DsaCounts, LagaIndicesCountsWhatDsaWorkPrices) {
  for (const Shards& s : kShards) check_counts<double>(DsaForm::laga_indices, s);
}
TEST(DsaCounts, LagaRecomputeCountsWhatDsaWorkPrices) {
  for (const Shards& s : kShards) check_counts<double>(DsaForm::laga_recompute, s);
}
TEST(DsaCounts, ExplicitCountsWhatDsaWorkPrices) {
  for (const Shards& s : kShards) check_counts<float>(DsaForm::explicit_form, s);
}

}  // namespace
}  // namespace laga
