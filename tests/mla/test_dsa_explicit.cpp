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
#include "mla/dsa_model.hpp"

namespace laga {
namespace {

using test::all_close;

MlaConfig cp_config() {
  MlaConfig c;
  c.dim = 24, c.n_heads = 5, c.q_lora_rank = 12, c.kv_lora_rank = 10, c.qk_nope_head_dim = 4;
  c.qk_rope_head_dim = 4, c.v_head_dim = 5;
  c.original_seq_len = 4096, c.max_seq_len = 4096;
  c.index_n_heads = 3, c.index_head_dim = 8, c.index_topk = 4;
  c.validate();
  return c;
}

template <class T>
DsaIndexerParams<T> indexer_weights(const MlaConfig& c, std::uint64_t seed) {
  DsaIndexerParams<T> p = DsaIndexerParams<T>::zeros(c);
  std::uint64_t s = seed;
  for (auto& [name, t] : p.named()) {
    const double fan_in = name == "indexer.wq_b.weight" ? double(c.q_lora_rank) : double(c.dim);
    const bool norm = name.find("k_norm") != std::string::npos;
    test::fill_random(t->data(), std::int64_t(t->size()), ++s, norm ? -0.2 : -1.0,
                      norm ? 0.2 : 1.0);
    if (!norm)
      for (T& e : *t) e = T(double(e) * std::sqrt(3.0 / fan_in));
    if (name == "indexer.k_norm.weight")
      for (T& e : *t) e += T(1);
  }
  return p;
}

std::vector<std::int64_t> heads_of(int P) {
  std::vector<std::int64_t> h(std::size_t(P), 5 / P);  // uneven at every P > 1
  for (int j = 0; j < 5 % P; ++j) ++h[std::size_t(j)];
  return h;
}

// Rows [s0, s0 + L) of every batch row of a (B, S, w) tensor.
template <class T>
std::vector<T> rows_of(const std::vector<T>& a, std::int64_t B, std::int64_t S, std::int64_t w,
                       std::int64_t s0, std::int64_t L) {
  std::vector<T> out;
  for (std::int64_t b = 0; b < B; ++b)
    out.insert(out.end(), a.begin() + (b * S + s0) * w, a.begin() + (b * S + s0 + L) * w);
  return out;
}

// Packed: row 0 holds documents of 4 and 7 tokens, row 1 of 2, 5 and 4
// (S 11). The reference is dsa_block on each document alone (B 1, its
// positions from 0), the selection moved to the row's positions and the
// gradients and KL summed over the documents.
const std::vector<std::vector<std::int64_t>> kDocs = {{4, 7}, {2, 5, 4}};

template <class T>
DsaBlockResult<T> per_document(const MlaConfig& cfg, const MlaParams<T>& w,
                               const DsaIndexerParams<T>& iw, const std::vector<T>& x,
                               const std::vector<T>& dout, std::int64_t S, DsaStage stage,
                               std::vector<std::int64_t>& doc_start) {
  const std::int64_t D = cfg.dim, K = cfg.index_topk;
  DsaBlockResult<T> all;
  all.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  all.indexer_grads = DsaIndexerParams<T>::zeros(cfg);
  for (std::size_t b = 0; b < kDocs.size(); ++b) {
    std::int64_t a = 0;
    for (std::int64_t len : kDocs[b]) {
      const std::int64_t off = std::int64_t(b) * S + a;
      for (std::int64_t t = 0; t < len; ++t) doc_start.push_back(a);
      const std::vector<T> xd(x.begin() + off * D, x.begin() + (off + len) * D);
      const std::vector<T> dd(dout.begin() + off * D, dout.begin() + (off + len) * D);
      const DsaBlockResult<T> r =
          dsa_block(cfg, w, iw, xd.data(), dd.data(), 1, len, stage, DsaAttend::per_head);
      all.out.insert(all.out.end(), r.out.begin(), r.out.end());
      all.dx.insert(all.dx.end(), r.dx.begin(), r.dx.end());
      for (std::int64_t i = 0; i < len * K; ++i) {
        const std::int32_t j = r.idx[std::size_t(i)];
        all.idx.push_back(j < 0 ? j : std::int32_t(j + a));
      }
      all.kl_loss += r.kl_loss;
      all.grads.for_each([&](const std::string& name, Tensor<T>& t) {
        r.grads.for_each([&](const std::string& n2, const Tensor<T>& g) {
          if (n2 != name) return;
          for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] += g.data()[i];
        });
      });
      DsaIndexerParams<T> ri = r.indexer_grads;
      auto mine = all.indexer_grads.named();
      auto theirs = ri.named();
      for (std::size_t k = 0; k < mine.size(); ++k)
        for (std::size_t i = 0; i < mine[k].second->size(); ++i)
          (*mine[k].second)[i] += (*theirs[k].second)[i];
      a += len;
    }
  }
  return all;
}

template <class T>
void check_form(DsaStage stage, const std::vector<std::int64_t>& counts, bool packed = false,
                std::vector<std::int64_t> heads = {}) {
  const MlaConfig cfg = cp_config();
  const int P = int(counts.size());
  const std::int64_t B = 2, D = cfg.dim, K = cfg.index_topk;
  std::int64_t S = 0;
  for (std::int64_t n : counts) S += n;
  const SpLayout lay = SpLayout::custom(B, counts, heads.empty() ? heads_of(P) : heads);
  MlaParams<T> w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
  init_params(w, 5, 0.1);
  const DsaIndexerParams<T> iw = indexer_weights<T>(cfg, 40);
  const std::vector<T> x = test::random_vector<T>(B * S * D, 7);
  const std::vector<T> dout = test::random_vector<T>(B * S * D, 8);
  std::vector<std::int64_t> doc_start;
  const DsaBlockResult<T> want =
      packed ? per_document(cfg, w, iw, x, dout, S, stage, doc_start)
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
        const std::vector<T> xr = rows_of(x, B, S, D, s0, L), dr = rows_of(dout, B, S, D, s0, L);
        got[std::size_t(r)] = dsa_explicit(cfg, w, iw, xr.data(), dr.data(), lay, stage, comm,
                                           packed ? doc_start.data() : nullptr);
      },
      options);

  const std::string what = std::string(to_string(stage)) + (packed ? " packed" : "") + " P " +
                           std::to_string(P) + " " + lay.describe() +
                           (sizeof(T) == 8 ? " double" : " float");
  const test::Tolerance tol = test::block_tolerance<T>();
  double kl = 0;
  MlaParams<T> grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  DsaIndexerParams<T> igrads = DsaIndexerParams<T>::zeros(cfg);
  for (int r = 0; r < P; ++r) {
    const DsaBlockResult<T>& g = got[std::size_t(r)];
    const std::int64_t s0 = lay.shard_begin(r), L = lay.seq_count[std::size_t(r)];
    const std::string wr = what + " rank " + std::to_string(r);
    EXPECT_TRUE(
        all_close(wr + " out", g.out, rows_of(want.out, B, S, D, s0, L), tol.atol, tol.rtol));
    EXPECT_TRUE(all_close(wr + " dx", g.dx, rows_of(want.dx, B, S, D, s0, L), tol.atol, tol.rtol));
    EXPECT_EQ(g.idx, rows_of(want.idx, B, S, K, s0, L)) << wr << " selection";
    kl += g.kl_loss;
    grads.for_each([&](const std::string& name, Tensor<T>& t) {
      g.grads.for_each([&](const std::string& n2, const Tensor<T>& s) {
        if (n2 != name) return;
        for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] += s.data()[i];
      });
    });
    DsaIndexerParams<T> gi = g.indexer_grads;
    auto mine = igrads.named();
    auto theirs = gi.named();
    for (std::size_t k = 0; k < mine.size(); ++k)
      for (std::size_t i = 0; i < mine[k].second->size(); ++i)
        (*mine[k].second)[i] += (*theirs[k].second)[i];

    // The ledger: the closed form, label for label, both directions.
    const CommPrediction p =
        dsa_predict_comm(cfg, *DsaConfig::of(cfg), lay, DsaForm::explicit_form, r,
                         {std::int64_t(sizeof(T)), std::int64_t(sizeof(T))}, true, false, stage);
    const auto& entries = comms[std::size_t(r)]->ledger().entries();
    EXPECT_EQ(entries.size(), p.size()) << wr << " ledger labels";
    for (const auto& [key, pred] : p) {
      const auto it = entries.find(key);
      ASSERT_NE(it, entries.end()) << wr << " no ledger entry " << key.second;
      EXPECT_EQ(it->second.bytes_sent, pred.sent) << wr << " " << key.second;
      EXPECT_EQ(it->second.bytes_received, pred.received) << wr << " " << key.second;
      EXPECT_EQ(it->second.calls, pred.calls) << wr << " " << key.second;
    }
  }
  EXPECT_NEAR(kl, want.kl_loss, tol.atol + tol.rtol * std::abs(want.kl_loss)) << what << " KL";
  grads.for_each([&](const std::string& name, const Tensor<T>& t) {
    want.grads.for_each([&](const std::string& n2, const Tensor<T>& ref) {
      if (n2 != name) return;
      EXPECT_TRUE(
          all_close(what + " d" + name, t.data(), ref.data(), t.numel(), tol.atol, tol.rtol));
    });
  });
  DsaIndexerParams<T> wi = want.indexer_grads;
  auto mine = igrads.named();
  auto ref = wi.named();
  for (std::size_t k = 0; k < mine.size(); ++k)
    EXPECT_TRUE(all_close(what + " d" + mine[k].first, *mine[k].second, *ref[k].second, tol.atol,
                          tol.rtol));
}

const std::vector<std::vector<std::int64_t>> kShards = {{11}, {6, 5}, {5, 2, 4}, {3, 3, 1, 4}};

TEST(DsaExplicit, SparseEqualsSingleRankExplicitDouble) {
  for (const auto& c : kShards) check_form<double>(DsaStage::sparse, c);
}
TEST(DsaExplicit, DenseWarmupEqualsSingleRankExplicitDouble) {
  for (const auto& c : kShards) check_form<double>(DsaStage::dense_warmup, c);
}
TEST(DsaExplicit, SparseEqualsSingleRankExplicitFloat) {
  for (const auto& c : kShards) check_form<float>(DsaStage::sparse, c);
}
TEST(DsaExplicit, DenseWarmupEqualsSingleRankExplicitFloat) {
  for (const auto& c : kShards) check_form<float>(DsaStage::dense_warmup, c);
}

TEST(DsaExplicit, PackedDocumentsEqualEachDocumentAloneDouble) {
  for (const auto& c : kShards) {
    check_form<double>(DsaStage::sparse, c, true);
    check_form<double>(DsaStage::dense_warmup, c, true);
  }
}
TEST(DsaExplicit, PackedDocumentsEqualEachDocumentAloneFloat) {
  for (const auto& c : kShards) {
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
  const SpLayout lay = SpLayout::custom(B, {5, 2, 4}, heads_of(3));
  MlaParams<double> w = MlaParams<double>::zeros(cfg, MemCategory::parameters);
  init_params(w, 5, 0.1);
  const DsaIndexerParams<double> iw = indexer_weights<double>(cfg, 40);
  const std::vector<double> x = test::random_vector<double>(B * S * D, 7);
  for (DsaStage stage : {DsaStage::sparse, DsaStage::dense_warmup}) {
    const DsaBlockResult<double> want =
        dsa_block<double>(cfg, w, iw, x.data(), nullptr, B, S, stage, DsaAttend::per_head);
    std::vector<DsaBlockResult<double>> got(3);
    std::vector<std::unique_ptr<Communicator>> comms = make_local_communicators(3);
    run_local_ranks(comms, [&](Communicator& comm) {
      const int r = comm.rank();
      const std::vector<double> xr =
          rows_of(x, B, S, D, lay.shard_begin(r), lay.seq_count[std::size_t(r)]);
      got[std::size_t(r)] = dsa_explicit<double>(cfg, w, iw, xr.data(), nullptr, lay, stage, comm);
    });
    const test::Tolerance tol = test::block_tolerance<double>();
    double kl = 0;
    for (int r = 0; r < 3; ++r) {
      const DsaBlockResult<double>& g = got[std::size_t(r)];
      const std::int64_t s0 = lay.shard_begin(r), L = lay.seq_count[std::size_t(r)];
      const std::string wr = std::string(to_string(stage)) + " rank " + std::to_string(r);
      EXPECT_TRUE(
          all_close(wr + " out", g.out, rows_of(want.out, B, S, D, s0, L), tol.atol, tol.rtol));
      EXPECT_EQ(g.idx, rows_of(want.idx, B, S, K, s0, L)) << wr;
      EXPECT_TRUE(g.dx.empty()) << wr;
      kl += g.kl_loss;
      const CommPrediction p = dsa_predict_comm(
          cfg, *DsaConfig::of(cfg), lay, DsaForm::explicit_form, r, {8, 8}, false, false, stage);
      const auto& entries = comms[std::size_t(r)]->ledger().entries();
      EXPECT_EQ(entries.size(), p.size()) << wr;
      for (const auto& [key, pred] : p) {
        const auto it = entries.find(key);
        ASSERT_NE(it, entries.end()) << wr << " no ledger entry " << key.second;
        EXPECT_EQ(it->second.bytes_sent, pred.sent) << wr << " " << key.second;
        EXPECT_EQ(it->second.calls, pred.calls) << wr << " " << key.second;
      }
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
  EXPECT_NE(heads.find("the layout splits 4 heads, the config has n_heads 5"), std::string::npos)
      << heads;
  const std::string doc = run(SpLayout::even(1, 16, 5, 2), bad.data());
  EXPECT_NE(doc.find("doc_start[0, 3] = 2 is not the first token of a document"), std::string::npos)
      << doc;
}

}  // namespace
}  // namespace laga
