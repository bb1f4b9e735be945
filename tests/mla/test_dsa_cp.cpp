// DSA's query-local latent gather (mla/dsa_cp.hpp) at P = 1..4 in-process
// ranks, uneven shards: every rank's outputs, dx and selection, the weight
// gradients and the indexer's KL loss and its gradients summed over the
// ranks, equal single-rank explicit DSA (dsa_block, per-head attention) in
// double (block_tolerance<double>) and float (block_tolerance<float>), in
// the sparse stage (top-k < S, so the selection matters) and the dense
// warm-up; and each rank's ledger equals dsa_predict_comm's closed form for
// DsaForm::latent_gather (mla/dsa_model.hpp), label for label.
#include "mla/dsa_cp.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "common/error_of.hpp"
#include "dsa_form_cases.hpp"
#include "mla/dsa_model.hpp"

namespace laga {
namespace {

using test::all_close;

MlaConfig cp_config() {
  return test::dsa_small_config(4);
}

std::vector<std::int64_t> heads_of(int P) {
  std::vector<std::int64_t> h(std::size_t(P), 4 / P);
  for (int j = 0; j < 4 % P; ++j) ++h[std::size_t(j)];
  return h;
}

// Packed: row 0 holds documents of 4 and 7 tokens, row 1 of 2, 5 and 4
// (S 11). The reference is dsa_block on each document alone
// (test::dsa_per_document).
const std::vector<std::vector<std::int64_t>> kDocs = {{4, 7}, {2, 5, 4}};

template <class T>
void check_form(DsaStage stage, const std::vector<std::int64_t>& counts, bool packed = false) {
  const MlaConfig cfg = cp_config();
  const int P = int(counts.size());
  const std::int64_t B = 2, D = cfg.dim, K = cfg.index_topk;
  const auto [S, lay, w, iw, x, dout] = test::dsa_form_inputs<T>(cfg, B, counts, heads_of(P));
  std::vector<std::int64_t> doc_start;
  const DsaBlockResult<T> want =
      packed ? test::dsa_per_document(cfg, w, iw, x, dout, S, stage, kDocs, doc_start)
             : dsa_block(cfg, w, iw, x.data(), dout.data(), B, S, stage, DsaAttend::per_head);

  // The ranks' gradients are pool tensors: the pools outlive the threads.
  std::vector<MemoryPool> pools(static_cast<std::size_t>(P));
  LocalRunOptions options;
  options.pools = &pools;
  std::vector<DsaBlockResult<T>> got(static_cast<std::size_t>(P));
  std::vector<std::unique_ptr<Communicator>> comms = make_local_communicators(P);
  run_local_ranks(
      comms,
      [&](Communicator& comm) {
        const int r = comm.rank();
        const std::int64_t s0 = lay.shard_begin(r), L = lay.seq_count[std::size_t(r)];
        const std::vector<T> xr = test::dsa_rows(x, B, S, D, s0, L),
                             dr = test::dsa_rows(dout, B, S, D, s0, L);
        got[std::size_t(r)] = dsa_latent_gather(cfg, w, iw, xr.data(), dr.data(), lay, stage, comm,
                                                packed ? doc_start.data() : nullptr);
      },
      options);

  const std::string what = std::string(to_string(stage)) + (packed ? " packed" : "") + " P " +
                           std::to_string(P) + " " + lay.describe() +
                           (sizeof(T) == 8 ? " double" : " float");
  const test::Tolerance tol = test::block_tolerance<T>();
  DsaBlockResult<T> sum;
  sum.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  sum.indexer_grads = DsaIndexerParams<T>::zeros(cfg);
  for (int r = 0; r < P; ++r) {
    const DsaBlockResult<T>& g = got[std::size_t(r)];
    const std::int64_t s0 = lay.shard_begin(r), L = lay.seq_count[std::size_t(r)];
    const std::string wr = what + " rank " + std::to_string(r);
    EXPECT_TRUE(all_close(wr + " out", g.out, test::dsa_rows(want.out, B, S, D, s0, L), tol.atol,
                          tol.rtol));
    EXPECT_TRUE(
        all_close(wr + " dx", g.dx, test::dsa_rows(want.dx, B, S, D, s0, L), tol.atol, tol.rtol));
    EXPECT_EQ(g.idx, test::dsa_rows(want.idx, B, S, K, s0, L)) << wr << " selection";
    test::dsa_add_grads(sum, g);

    // The ledger: the closed form, label for label, both directions.
    const CommPrediction p =
        dsa_predict_comm(cfg, *DsaConfig::of(cfg), lay, DsaForm::latent_gather, r,
                         {std::int64_t(sizeof(T)), std::int64_t(sizeof(T))}, true, false);
    test::dsa_expect_ledger(wr, comms[std::size_t(r)]->ledger(), p);
  }
  test::dsa_expect_sum_equals(what, sum, want, tol);
}

const std::vector<std::vector<std::int64_t>> kShards = {{11}, {6, 5}, {5, 2, 4}, {3, 3, 1, 4}};

TEST(DsaLatentGather, SparseEqualsSingleRankExplicitDouble) {
  for (const auto& c : kShards) check_form<double>(DsaStage::sparse, c);
}
TEST(DsaLatentGather, DenseWarmupEqualsSingleRankExplicitDouble) {
  for (const auto& c : kShards) check_form<double>(DsaStage::dense_warmup, c);
}
TEST(DsaLatentGather, SparseEqualsSingleRankExplicitFloat) {
  for (const auto& c : kShards) check_form<float>(DsaStage::sparse, c);
}
TEST(DsaLatentGather, DenseWarmupEqualsSingleRankExplicitFloat) {
  for (const auto& c : kShards) check_form<float>(DsaStage::dense_warmup, c);
}

TEST(DsaLatentGather, PackedDocumentsEqualEachDocumentAloneDouble) {
  for (const auto& c : kShards) {
    check_form<double>(DsaStage::sparse, c, true);
    check_form<double>(DsaStage::dense_warmup, c, true);
  }
}
TEST(DsaLatentGather, PackedDocumentsEqualEachDocumentAloneFloat) {
  for (const auto& c : kShards) {
    check_form<float>(DsaStage::sparse, c, true);
    check_form<float>(DsaStage::dense_warmup, c, true);
  }
}

// Bad input: one error naming what is wrong, the same on every rank.
TEST(DsaLatentGather, RefusesZigzagAndABadDocStart) {
  const MlaConfig cfg = cp_config();
  MlaParams<double> w = MlaParams<double>::zeros(cfg, MemCategory::parameters);
  const DsaIndexerParams<double> iw = DsaIndexerParams<double>::zeros(cfg);
  const std::vector<double> x(std::size_t(8 * cfg.dim), 0.0);
  auto run = [&](const SpLayout& lay, const std::int64_t* docs) {
    return test::error_of([&] {
      run_local_ranks(lay.ranks, [&](Communicator& comm) {
        dsa_latent_gather<double>(cfg, w, iw, x.data(), nullptr, lay, DsaStage::sparse, comm, docs);
      });
    });
  };
  const std::string zig = run(SpLayout::even(1, 16, 4, 2, SeqLayout::zigzag), nullptr);
  EXPECT_NE(zig.find("the zigzag layout is not implemented"), std::string::npos) << zig;
  // token 3 claims a document starting at 2, but token 2's starts at 0
  const std::vector<std::int64_t> bad = {0, 0, 0, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0};
  const std::string doc = run(SpLayout::even(1, 16, 4, 2), bad.data());
  EXPECT_NE(doc.find("doc_start[0, 3] = 2 is not the first token of a document"), std::string::npos)
      << doc;
}

}  // namespace
}  // namespace laga
