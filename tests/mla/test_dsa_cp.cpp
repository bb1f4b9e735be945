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

#include <string>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "common/error_of.hpp"
#include "dsa_form_cases.hpp"
#include "mla/dsa_model.hpp"

namespace laga {
namespace {

MlaConfig cp_config() {
  return test::dsa_small_config(4);
}

// The form on one rank, for test::dsa_check_form.
const auto latent_gather = [](auto&&... a) { return dsa_latent_gather(a...); };

// Packed: test::kDsaPackedDocs, the reference each document alone
// (test::dsa_per_document).
template <class T>
void check_form(DsaStage stage, const std::vector<std::int64_t>& counts, bool packed = false) {
  test::dsa_check_form<T>(DsaForm::latent_gather, latent_gather, cp_config(), stage, counts,
                          test::dsa_heads_of(4, int(counts.size())), packed);
}

TEST(DsaLatentGather, SparseEqualsSingleRankExplicitDouble) {
  for (const auto& c : test::kDsaTokenShards) check_form<double>(DsaStage::sparse, c);
}
TEST(DsaLatentGather, DenseWarmupEqualsSingleRankExplicitDouble) {
  for (const auto& c : test::kDsaTokenShards) check_form<double>(DsaStage::dense_warmup, c);
}
TEST(DsaLatentGather, SparseEqualsSingleRankExplicitFloat) {
  for (const auto& c : test::kDsaTokenShards) check_form<float>(DsaStage::sparse, c);
}
TEST(DsaLatentGather, DenseWarmupEqualsSingleRankExplicitFloat) {
  for (const auto& c : test::kDsaTokenShards) check_form<float>(DsaStage::dense_warmup, c);
}

TEST(DsaLatentGather, PackedDocumentsEqualEachDocumentAloneDouble) {
  for (const auto& c : test::kDsaTokenShards) {
    check_form<double>(DsaStage::sparse, c, true);
    check_form<double>(DsaStage::dense_warmup, c, true);
  }
}
TEST(DsaLatentGather, PackedDocumentsEqualEachDocumentAloneFloat) {
  for (const auto& c : test::kDsaTokenShards) {
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
