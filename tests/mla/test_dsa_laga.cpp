// DSA's head-sharded LAGA forms (mla/dsa_laga.hpp), laga_indices and
// laga_recompute, at P = 1..4 in-process ranks with uneven shards and
// uneven heads (H 5; one case with a rank that holds no head): every rank's
// output, dx and selection, the weight gradients (the MLA's and the
// indexer's) and the indexer's KL loss summed over the ranks, equal
// single-rank explicit DSA (dsa_block, per-head attention) in double and
// float within block_tolerance, in the sparse stage (top-k < S, so the
// selection matters) and the dense warm-up, unpacked and packed; each
// rank's ledger equals dsa_predict_comm's closed form for the form and
// stage, label for label; and the ledgers say which of the two moves fewer
// bytes.
#include "mla/dsa_laga.hpp"

#include <gtest/gtest.h>

#include <iostream>
#include <string>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "common/error_of.hpp"
#include "dsa_form_cases.hpp"

namespace laga {
namespace {

// H 5 so that the heads split unevenly at every P > 1.
MlaConfig laga_config() {
  return test::dsa_small_config(5);
}

struct Shards {
  std::vector<std::int64_t> tokens, heads;
};
// S 11 = 6+5 = 5+2+4 = 3+3+1+4; H 5 = 3+2 = 2+2+1 = 2+1+1+1, and a rank
// with no head (2+2+1+0: it attends nothing, yet owns queries and keys).
const std::vector<Shards> kShards = {{{11}, {5}},
                                     {{6, 5}, {3, 2}},
                                     {{5, 2, 4}, {2, 2, 1}},
                                     {{3, 3, 1, 4}, {2, 1, 1, 1}},
                                     {{2, 4, 4, 1}, {2, 2, 1, 0}}};

// Every rank's ledger after one forward + backward: bytes sent over every
// label and phase, summed over the ranks.
struct StepBytes {
  std::int64_t sent = 0;
};

// Packed: test::kDsaPackedDocs, the reference each document alone
// (test::dsa_per_document).
template <class T>
StepBytes check_form(DsaForm form, DsaStage stage, const Shards& sh, bool packed = false) {
  const auto laga = [form](const MlaConfig& cfg, const MlaParams<T>& w,
                           const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                           const SpLayout& lay, DsaStage st, Communicator& comm,
                           const std::int64_t* doc_start) {
    return dsa_laga(cfg, w, iw, x, dout, lay, st, form, comm, doc_start);
  };
  return {test::dsa_check_form<T>(form, laga, laga_config(), stage, sh.tokens, sh.heads, packed)};
}

template <class T>
void check_all(DsaForm form, DsaStage stage) {
  for (const Shards& s : kShards) check_form<T>(form, stage, s);
}

TEST(DsaLagaIndices, SparseEqualsSingleRankExplicitDouble) {
  check_all<double>(DsaForm::laga_indices, DsaStage::sparse);
}
TEST(DsaLagaIndices, DenseWarmupEqualsSingleRankExplicitDouble) {
  check_all<double>(DsaForm::laga_indices, DsaStage::dense_warmup);
}
TEST(DsaLagaIndices, SparseAndWarmupEqualSingleRankExplicitFloat) {
  check_all<float>(DsaForm::laga_indices, DsaStage::sparse);
  check_all<float>(DsaForm::laga_indices, DsaStage::dense_warmup);
}
TEST(DsaLagaRecompute, SparseEqualsSingleRankExplicitDouble) {
  check_all<double>(DsaForm::laga_recompute, DsaStage::sparse);
}
TEST(DsaLagaRecompute, DenseWarmupEqualsSingleRankExplicitDouble) {
  check_all<double>(DsaForm::laga_recompute, DsaStage::dense_warmup);
}
TEST(DsaLagaRecompute, SparseAndWarmupEqualSingleRankExplicitFloat) {
  check_all<float>(DsaForm::laga_recompute, DsaStage::sparse);
  check_all<float>(DsaForm::laga_recompute, DsaStage::dense_warmup);
}

TEST(DsaLaga, PackedDocumentsEqualEachDocumentAlone) {
  for (DsaForm f : {DsaForm::laga_indices, DsaForm::laga_recompute})
    for (DsaStage st : {DsaStage::sparse, DsaStage::dense_warmup})
      for (const Shards& s : kShards) {
        check_form<double>(f, st, s, true);
        check_form<float>(f, st, s, true);
      }
}

// "Implement both and let the ledger say which wins": the bytes every rank
// sent in one training step (sparse stage), summed over the ranks, as the
// ledgers measured them. Summed over the ranks, an exchange and its adjoint
// move the same, so per token of rank r the two forms differ only in the
// queries' way and the indexer's: laga_indices sends 2 (H - H_r) dqk e
// (q_a2a, both ways) + (P-1) K 4 (topk_ag), laga_recompute 2 (P-1) rq e
// (q_latent_ag, both ways) + (P-1) Hi e (index_w_ag); the rest (latent_ag,
// index_k_ag, index_target_rs, out_a2a) is the same in both and cancels.
// The query latent's gather grows with P - 1 where the heads' all-to-all
// stays below H dqk, so the winner turns with P: here (H 5, dqk 8, rq 12,
// Hi 3, K 4, e 8, B 2, S 11) laga_recompute sends less at P 2 and 3
// (17,520 and 32,320 bytes against 20,032 and 32,992), laga_indices at P 4
// (43,456 against 46,160). At DeepSeek-V3.2's dims the indices (K 4 = 8,192
// bytes a query) decide it for laga_recompute (docs/planning.md, "DSA").
TEST(DsaLaga, TheLedgerSaysWhichMovesFewerBytes) {
  for (std::size_t i = 1; i < 4; ++i) {
    const Shards& s = kShards[i];
    const std::int64_t P = std::int64_t(s.tokens.size());
    const StepBytes ind = check_form<double>(DsaForm::laga_indices, DsaStage::sparse, s);
    const StepBytes rec = check_form<double>(DsaForm::laga_recompute, DsaStage::sparse, s);
    const MlaConfig c = laga_config();
    const std::int64_t e = 8, B = 2, dqk = c.qk_head_dim();
    std::int64_t want_ind = 0, want_rec = 0;  // the two counts above, written out per rank
    for (std::size_t r = 0; r < s.tokens.size(); ++r) {
      const std::int64_t L = s.tokens[r];
      want_ind += B * L * (2 * (c.n_heads - s.heads[r]) * dqk * e + (P - 1) * c.index_topk * 4);
      want_rec += B * L * (P - 1) * (2 * c.q_lora_rank + c.index_n_heads) * e;
    }
    EXPECT_EQ(ind.sent - rec.sent, want_ind - want_rec) << "P " << P;
    if (P < 4)
      EXPECT_LT(rec.sent, ind.sent) << "P " << P << ": laga_recompute should move fewer bytes";
    else
      EXPECT_LT(ind.sent, rec.sent) << "P " << P << ": laga_indices should move fewer bytes";
    std::cout << "P " << P << ": one step's bytes over the ranks, laga_indices " << ind.sent
              << ", laga_recompute " << rec.sent << "\n";
  }
}

// Bad input: one error naming what is wrong, the same on every rank.
TEST(DsaLaga, RefusesAnotherFormZigzagAndABadDocStart) {
  const MlaConfig cfg = laga_config();
  MlaParams<double> w = MlaParams<double>::zeros(cfg, MemCategory::parameters);
  const DsaIndexerParams<double> iw = DsaIndexerParams<double>::zeros(cfg);
  const std::vector<double> x(std::size_t(8 * cfg.dim), 0.0);
  auto run = [&](const SpLayout& lay, DsaForm form, const std::int64_t* docs) {
    return test::error_of([&] {
      run_local_ranks(lay.ranks, [&](Communicator& comm) {
        dsa_laga<double>(cfg, w, iw, x.data(), nullptr, lay, DsaStage::sparse, form, comm, docs);
      });
    });
  };
  const SpLayout even = SpLayout::custom(1, {8, 8}, {3, 2});
  const std::string other = run(even, DsaForm::latent_gather, nullptr);
  EXPECT_NE(other.find("DSA form 'latent_gather' is not one of LAGA's head-sharded forms"),
            std::string::npos)
      << other;
  SpLayout zig = SpLayout::even(1, 16, 4, 2, SeqLayout::zigzag);
  zig.head_count = {3, 2};
  const std::string z = run(zig, DsaForm::laga_indices, nullptr);
  EXPECT_NE(z.find("the zigzag layout is not implemented"), std::string::npos) << z;
  const std::string heads = run(SpLayout::even(1, 16, 4, 2), DsaForm::laga_recompute, nullptr);
  EXPECT_NE(heads.find("the layout's ranks hold 4 heads, the config has n_heads 5"),
            std::string::npos)
      << heads;
  // token 3 claims a document starting at 2, but token 2's starts at 0
  const std::vector<std::int64_t> bad = {0, 0, 0, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0};
  const std::string doc = run(even, DsaForm::laga_indices, bad.data());
  EXPECT_NE(doc.find("doc_start[0, 3] = 2 is not the first token of a document"), std::string::npos)
      << doc;
}

}  // namespace
}  // namespace laga
