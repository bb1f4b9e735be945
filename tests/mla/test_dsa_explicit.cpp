// DSA's explicit form (mla/dsa_explicit.hpp: head-sharded per-head Q, K, V,
// the indexer's keys and the selection all-gathered, the KL target
// reduce-scattered to the rows' owners) at P = 1..4 in-process ranks,
// uneven shards and uneven heads (H 5): every rank's outputs, dx and
// selection, the weight gradients and the indexer's KL loss and its
// gradients summed over the ranks, equal single-rank explicit DSA
// (dsa_block, per-head attention) in double (block_tolerance<double>) and
// float (block_tolerance<float>), in the sparse stage (top-k < S, so the
// selection matters) and the dense warm-up, one document a row and packed;
// and each rank's ledger equals dsa_predict_comm's closed form for
// DsaForm::explicit_form in the same stage (mla/dsa_model.hpp), label for
// label.
#include "mla/dsa_explicit.hpp"

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
  return test::dsa_small_config(5);
}

// The form on one rank, for test::dsa_check_form.
const auto explicit_form = [](auto&&... a) { return dsa_explicit(a...); };

// Packed: test::kDsaPackedDocs, the reference each document alone
// (test::dsa_per_document). `heads` empty: H 5
// near-equally (test::dsa_heads_of), uneven at every P > 1.
template <class T>
void check_form(DsaStage stage, const std::vector<std::int64_t>& counts, bool packed = false,
                std::vector<std::int64_t> heads = {}) {
  test::dsa_check_form<T>(DsaForm::explicit_form, explicit_form, cp_config(), stage, counts,
                          heads.empty() ? test::dsa_heads_of(5, int(counts.size())) : heads,
                          packed);
}

TEST(DsaExplicit, SparseEqualsSingleRankExplicitDouble) {
  for (const auto& c : test::kDsaTokenShards) check_form<double>(DsaStage::sparse, c);
}
TEST(DsaExplicit, DenseWarmupEqualsSingleRankExplicitDouble) {
  for (const auto& c : test::kDsaTokenShards) check_form<double>(DsaStage::dense_warmup, c);
}
TEST(DsaExplicit, SparseEqualsSingleRankExplicitFloat) {
  for (const auto& c : test::kDsaTokenShards) check_form<float>(DsaStage::sparse, c);
}
TEST(DsaExplicit, DenseWarmupEqualsSingleRankExplicitFloat) {
  for (const auto& c : test::kDsaTokenShards) check_form<float>(DsaStage::dense_warmup, c);
}

TEST(DsaExplicit, PackedDocumentsEqualEachDocumentAloneDouble) {
  for (const auto& c : test::kDsaTokenShards) {
    check_form<double>(DsaStage::sparse, c, true);
    check_form<double>(DsaStage::dense_warmup, c, true);
  }
}
TEST(DsaExplicit, PackedDocumentsEqualEachDocumentAloneFloat) {
  for (const auto& c : test::kDsaTokenShards) {
    check_form<float>(DsaStage::sparse, c, true);
    check_form<float>(DsaStage::dense_warmup, c, true);
  }
}

// A rank without heads (P 6 > H 5, and one at P 3) attends nothing, sends
// its rows' Q, K, V to the others and still gets its rows' KL target.
TEST(DsaExplicit, RanksWithoutHeads) {
  for (DsaStage stage : {DsaStage::sparse, DsaStage::dense_warmup}) {
    check_form<double>(stage, {2, 2, 2, 2, 2, 1}, false, {1, 1, 1, 1, 1, 0});
    check_form<double>(stage, {5, 2, 4}, true, {0, 3, 2});
  }
}

// Forward only (dout null): the rows' outputs, selections and KL as with a
// backward, and a ledger of the forward's labels alone (backward false).
TEST(DsaExplicit, ForwardOnlyMovesTheForwardAlone) {
  const MlaConfig cfg = cp_config();
  const std::int64_t B = 2, S = 11, D = cfg.dim, K = cfg.index_topk;
  const SpLayout lay = SpLayout::custom(B, {5, 2, 4}, test::dsa_heads_of(5, 3));
  MlaParams<double> w = MlaParams<double>::zeros(cfg, MemCategory::parameters);
  init_params(w, 5, 0.1);
  const DsaIndexerParams<double> iw = test::dsa_indexer_weights<double>(cfg, 40);
  const std::vector<double> x = test::random_vector<double>(B * S * D, 7);
  for (DsaStage stage : {DsaStage::sparse, DsaStage::dense_warmup}) {
    const DsaBlockResult<double> want =
        dsa_block<double>(cfg, w, iw, x.data(), nullptr, B, S, stage, DsaAttend::per_head);
    std::vector<DsaBlockResult<double>> got(3);
    std::vector<std::unique_ptr<Communicator>> comms = make_local_communicators(3);
    run_local_ranks(comms, [&](Communicator& comm) {
      const int r = comm.rank();
      const std::vector<double> xr =
          test::dsa_rows(x, B, S, D, lay.shard_begin(r), lay.seq_count[std::size_t(r)]);
      got[std::size_t(r)] = dsa_explicit<double>(cfg, w, iw, xr.data(), nullptr, lay, stage, comm);
    });
    const test::Tolerance tol = test::block_tolerance<double>();
    double kl = 0;
    for (int r = 0; r < 3; ++r) {
      const DsaBlockResult<double>& g = got[std::size_t(r)];
      const std::int64_t s0 = lay.shard_begin(r), L = lay.seq_count[std::size_t(r)];
      const std::string wr = std::string(to_string(stage)) + " rank " + std::to_string(r);
      EXPECT_TRUE(all_close(wr + " out", g.out, test::dsa_rows(want.out, B, S, D, s0, L), tol.atol,
                            tol.rtol));
      EXPECT_EQ(g.idx, test::dsa_rows(want.idx, B, S, K, s0, L)) << wr;
      EXPECT_TRUE(g.dx.empty()) << wr;
      kl += g.kl_loss;
      test::dsa_expect_ledger(
          wr, comms[std::size_t(r)]->ledger(),
          dsa_predict_comm(cfg, *DsaConfig::of(cfg), lay, DsaForm::explicit_form, r, {8, 8}, false,
                           false, stage));
    }
    EXPECT_NEAR(kl, want.kl_loss, tol.atol + tol.rtol * std::abs(want.kl_loss));
  }
}

// Bad input: one error naming what is wrong, the same on every rank.
TEST(DsaExplicit, RefusesZigzagOtherHeadsAndABadDocStart) {
  const MlaConfig cfg = cp_config();
  MlaParams<double> w = MlaParams<double>::zeros(cfg, MemCategory::parameters);
  const DsaIndexerParams<double> iw = DsaIndexerParams<double>::zeros(cfg);
  const std::vector<double> x(std::size_t(8 * cfg.dim), 0.0);
  auto run = [&](const SpLayout& lay, const std::int64_t* docs) {
    return test::error_of([&] {
      run_local_ranks(lay.ranks, [&](Communicator& comm) {
        dsa_explicit<double>(cfg, w, iw, x.data(), nullptr, lay, DsaStage::sparse, comm, docs);
      });
    });
  };
  const std::string zig = run(SpLayout::even(1, 16, 5, 2, SeqLayout::zigzag), nullptr);
  EXPECT_NE(zig.find("the zigzag layout is not implemented"), std::string::npos) << zig;
  // token 3 claims a document starting at 2, but token 2's starts at 0
  const std::vector<std::int64_t> bad = {0, 0, 0, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0};
  const std::string heads = run(SpLayout::even(1, 16, 4, 2), nullptr);
  EXPECT_NE(heads.find("the layout's ranks hold 4 heads, the config has n_heads 5"),
            std::string::npos)
      << heads;
  const std::string doc = run(SpLayout::even(1, 16, 5, 2), bad.data());
  EXPECT_NE(doc.find("doc_start[0, 3] = 2 is not the first token of a document"), std::string::npos)
      << doc;
}

}  // namespace
}  // namespace laga
