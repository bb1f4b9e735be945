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
  const std::int64_t B = 2, D = cfg.dim;
  const auto [S, lay, w, iw, x, dout] = test::dsa_form_inputs<T>(cfg, B, sh.tokens, sh.heads);
  std::vector<MemoryPool> pools(static_cast<std::size_t>(P));
  LocalRunOptions options;
  options.pools = &pools;
  std::vector<ops::OpCounts> counts(static_cast<std::size_t>(P));
  std::vector<DsaBlockResult<T>> got(static_cast<std::size_t>(P));
  std::vector<std::unique_ptr<Communicator>> comms = make_local_communicators(P);
  run_local_ranks(
      comms,
      [&](Communicator& comm) {
        const int r = comm.rank();
        const std::int64_t s0 = lay.shard_begin(r), L = lay.seq_count[std::size_t(r)];
        const std::vector<T> xr = test::dsa_rows(x, B, S, D, s0, L);
        const std::vector<T> dr = test::dsa_rows(dout, B, S, D, s0, L);
        const ops::CountOps count(counts[std::size_t(r)]);
        const DsaStage st = DsaStage::sparse;
        if (form == DsaForm::latent_gather)
          got[std::size_t(r)] = dsa_latent_gather(cfg, w, iw, xr.data(), dr.data(), lay, st, comm);
        else if (form == DsaForm::explicit_form)
          got[std::size_t(r)] = dsa_explicit(cfg, w, iw, xr.data(), dr.data(), lay, st, comm);
        else
          got[std::size_t(r)] = dsa_laga(cfg, w, iw, xr.data(), dr.data(), lay, st, form, comm);
      },
      options);
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
