// What the DSA forms' tests share (test_dsa_cp.cpp, test_dsa_laga.cpp, test_dsa_explicit.cpp,
// test_dsa_bf16.cpp, test_dsa_counts.cpp, test_dsa_memory.cpp, test_dsa_fp8_deepseek.cpp): the
// small DSA config, its token shares and near-equal heads, the indexer's random weights, one run's
// inputs over a layout, the packed batch's documents and its reference (dsa_block on each document
// alone), rows of a (B, S, w) tensor, a form's run on in-process ranks, the sum of the ranks'
// partial gradients and its comparison with the reference, a rank's ledger against its closed form,
// and the whole check of a form against the single-rank block (dsa_check_form).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "comm/communicator.hpp"
#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "mla/comm_model.hpp"
#include "mla/dsa_block.hpp"
#include "mla/dsa_model.hpp"
#include "mla/layout.hpp"
#include "mla/params.hpp"

namespace laga::test {

// The DSA forms' small config: C 10 > dn 4, dqk 8 != dv 5, 3 index heads of
// width 8 choosing 4 keys; `heads` 5 splits unevenly at every P > 1.
inline MlaConfig dsa_small_config(std::int64_t heads) {
  MlaConfig c;
  c.dim = 24, c.n_heads = heads, c.q_lora_rank = 12, c.kv_lora_rank = 10, c.qk_nope_head_dim = 4;
  c.qk_rope_head_dim = 4, c.v_head_dim = 5;
  c.original_seq_len = 4096, c.max_seq_len = 4096;
  c.index_n_heads = 3, c.index_head_dim = 8, c.index_topk = 4;
  c.validate();
  return c;
}

// S 11 split over P 1..4 ranks, unevenly: the forms' tests' token shares.
inline const std::vector<std::vector<std::int64_t>> kDsaTokenShards = {
    {11}, {6, 5}, {5, 2, 4}, {3, 3, 1, 4}};

// H heads over P ranks, near-equally: the first H % P ranks hold one more.
inline std::vector<std::int64_t> dsa_heads_of(std::int64_t H, int P) {
  std::vector<std::int64_t> h(std::size_t(P), H / P);
  for (std::int64_t j = 0; j < H % P; ++j) ++h[std::size_t(j)];
  return h;
}

// Uniform weights scaled by sqrt(3 / fan_in); the LayerNorm's weight about 1.
template <class T>
DsaIndexerParams<T> dsa_indexer_weights(const MlaConfig& c, std::uint64_t seed) {
  DsaIndexerParams<T> p = DsaIndexerParams<T>::zeros(c);
  std::uint64_t s = seed;
  for (auto& [name, t] : p.named()) {
    const double fan_in = name == "indexer.wq_b.weight" ? double(c.q_lora_rank) : double(c.dim);
    const bool norm = name.find("k_norm") != std::string::npos;
    fill_random(t->data(), std::int64_t(t->size()), ++s, norm ? -0.2 : -1.0, norm ? 0.2 : 1.0);
    if (!norm)
      for (T& e : *t) e = T(double(e) * std::sqrt(3.0 / fan_in));
    if (name == "indexer.k_norm.weight")
      for (T& e : *t) e += T(1);
  }
  return p;
}

// One run's inputs over B rows split as `tokens` (S their sum) with `heads`
// per rank: the layout, the MLA's weights (init_params seed 5, jitter 0.1),
// the indexer's (seed 40), x and dout (B, S, dim) (seeds 7 and 8).
template <class T>
struct DsaFormInputs {
  std::int64_t S = 0;
  SpLayout lay;
  MlaParams<T> w;
  DsaIndexerParams<T> iw;
  std::vector<T> x, dout;
};
template <class T>
DsaFormInputs<T> dsa_form_inputs(const MlaConfig& cfg, std::int64_t B,
                                 const std::vector<std::int64_t>& tokens,
                                 const std::vector<std::int64_t>& heads) {
  DsaFormInputs<T> in;
  for (std::int64_t n : tokens) in.S += n;
  in.lay = SpLayout::custom(B, tokens, heads);
  in.w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
  init_params(in.w, 5, 0.1);
  in.iw = dsa_indexer_weights<T>(cfg, 40);
  in.x = random_vector<T>(B * in.S * cfg.dim, 7);
  in.dout = random_vector<T>(B * in.S * cfg.dim, 8);
  return in;
}

// Rows [s0, s0 + L) of every batch row of a (B, S, w) tensor.
template <class T>
std::vector<T> dsa_rows(const std::vector<T>& a, std::int64_t B, std::int64_t S, std::int64_t w,
                        std::int64_t s0, std::int64_t L) {
  std::vector<T> out;
  for (std::int64_t b = 0; b < B; ++b)
    out.insert(out.end(), a.begin() + (b * S + s0) * w, a.begin() + (b * S + s0 + L) * w);
  return out;
}

// Runs rank(comm, xr, dr) on lay.ranks in-process ranks, rank r's thread
// under pools[r] (sized here: the ranks' gradients are pool tensors, so the
// caller's pools outlive the threads and the results), xr and dr the rank's
// rows of x and dout (B, S, D) (dr null when dout is empty). Returns the
// communicators: their ledgers hold what each rank moved.
template <class T, class Rank>
std::vector<std::unique_ptr<Communicator>> dsa_run_ranks(const SpLayout& lay,
                                                         const std::vector<T>& x,
                                                         const std::vector<T>& dout,
                                                         std::vector<MemoryPool>& pools,
                                                         Rank&& rank) {
  const std::int64_t B = lay.batch, S = lay.seq, D = std::int64_t(x.size()) / (B * S);
  pools = std::vector<MemoryPool>(static_cast<std::size_t>(lay.ranks));
  LocalRunOptions options;
  options.pools = &pools;
  std::vector<std::unique_ptr<Communicator>> comms = make_local_communicators(lay.ranks);
  run_local_ranks(
      comms,
      [&](Communicator& comm) {
        const int r = comm.rank();
        const std::int64_t s0 = lay.shard_begin(r), L = lay.seq_count[std::size_t(r)];
        const std::vector<T> xr = dsa_rows(x, B, S, D, s0, L);
        const std::vector<T> dr = dout.empty() ? std::vector<T>() : dsa_rows(dout, B, S, D, s0, L);
        rank(comm, xr.data(), dout.empty() ? nullptr : dr.data());
      },
      options);
  return comms;
}

// sum += part, gradient by gradient (the MLA's and the indexer's), and the KL.
template <class T>
void dsa_add_grads(DsaBlockResult<T>& sum, const DsaBlockResult<T>& part) {
  sum.kl_loss += part.kl_loss;
  sum.grads.for_each([&](const std::string& name, Tensor<T>& t) {
    part.grads.for_each([&](const std::string& n2, const Tensor<T>& g) {
      if (n2 != name) return;
      for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] += g.data()[i];
    });
  });
  DsaIndexerParams<T> theirs_p = part.indexer_grads;
  auto mine = sum.indexer_grads.named();
  auto theirs = theirs_p.named();
  for (std::size_t k = 0; k < mine.size(); ++k)
    for (std::size_t i = 0; i < mine[k].second->size(); ++i)
      (*mine[k].second)[i] += (*theirs[k].second)[i];
}

// The packed batch the forms' tests run (S 11): row 0 holds documents of 4
// and 7 tokens, row 1 of 2, 5 and 4.
inline const std::vector<std::vector<std::int64_t>> kDsaPackedDocs = {{4, 7}, {2, 5, 4}};

// A packed batch: docs[b] the document lengths of batch row b (each row's
// sum is S). The reference is dsa_block on each document alone (B 1, its
// positions from 0), the selection moved to the row's positions, the
// gradients and KL summed over the documents; doc_start (B, S) is filled.
template <class T>
DsaBlockResult<T> dsa_per_document(const MlaConfig& cfg, const MlaParams<T>& w,
                                   const DsaIndexerParams<T>& iw, const std::vector<T>& x,
                                   const std::vector<T>& dout, std::int64_t S, DsaStage stage,
                                   const std::vector<std::vector<std::int64_t>>& docs,
                                   std::vector<std::int64_t>& doc_start) {
  const std::int64_t D = cfg.dim, K = cfg.index_topk;
  DsaBlockResult<T> all;
  all.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  all.indexer_grads = DsaIndexerParams<T>::zeros(cfg);
  for (std::size_t b = 0; b < docs.size(); ++b) {
    std::int64_t a = 0;
    for (std::int64_t len : docs[b]) {
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
      dsa_add_grads(all, r);
      a += len;
    }
  }
  return all;
}

// The ranks' summed KL and gradients (dsa_add_grads) against the reference.
template <class T>
void dsa_expect_sum_equals(const std::string& what, DsaBlockResult<T>& sum,
                           const DsaBlockResult<T>& want, const Tolerance& tol) {
  EXPECT_NEAR(sum.kl_loss, want.kl_loss, tol.atol + tol.rtol * std::abs(want.kl_loss))
      << what << " KL";
  sum.grads.for_each([&](const std::string& name, const Tensor<T>& t) {
    want.grads.for_each([&](const std::string& n2, const Tensor<T>& ref) {
      if (n2 != name) return;
      EXPECT_TRUE(
          all_close(what + " d" + name, t.data(), ref.data(), t.numel(), tol.atol, tol.rtol));
    });
  });
  DsaIndexerParams<T> wi = want.indexer_grads;
  auto mine = sum.indexer_grads.named();
  auto ref = wi.named();
  for (std::size_t k = 0; k < mine.size(); ++k)
    EXPECT_TRUE(all_close(what + " d" + mine[k].first, *mine[k].second, *ref[k].second, tol.atol,
                          tol.rtol));
}

// A rank's ledger against its closed form, label for label: bytes both
// ways and calls, and no label the closed form lacks.
inline void dsa_expect_ledger(const std::string& what, const Ledger& ledger,
                              const CommPrediction& p) {
  const auto& entries = ledger.entries();
  EXPECT_EQ(entries.size(), p.size()) << what << " ledger labels";
  for (const auto& [key, pred] : p) {
    const auto it = entries.find(key);
    if (it == entries.end()) {
      ADD_FAILURE() << what << " no ledger entry " << to_string(key.first) << " " << key.second;
      continue;
    }
    EXPECT_EQ(it->second.bytes_sent, pred.sent) << what << " " << key.second;
    EXPECT_EQ(it->second.bytes_received, pred.received) << what << " " << key.second;
    EXPECT_EQ(it->second.calls, pred.calls) << what << " " << key.second;
  }
}

// One DSA form on P = tokens.size() in-process ranks (B 2, the ranks'
// shares of S and of the heads `tokens` and `heads`, dsa_form_inputs)
// against the single-rank reference: dsa_block (per-head attention) or, when
// `packed`, each document of kDsaPackedDocs alone (dsa_per_document), its
// doc_start given to the ranks. Every rank's out and dx within
// block_tolerance<T> and its selection exactly are the reference's rows; its
// ledger is dsa_predict_comm's closed form for `form` at `stage`, label for
// label (dsa_expect_ledger); the KL and gradients summed over the ranks are
// the reference's (dsa_expect_sum_equals). run(cfg, w, iw, xr, dr, lay,
// stage, comm, doc_start) is the form on one rank. Returns the bytes the
// ranks' ledgers sent, summed over the ranks and their labels.
template <class T, class Run>
std::int64_t dsa_check_form(DsaForm form, Run&& run, const MlaConfig& cfg, DsaStage stage,
                            const std::vector<std::int64_t>& tokens,
                            const std::vector<std::int64_t>& heads, bool packed) {
  const std::int64_t B = 2, D = cfg.dim, K = cfg.index_topk;
  const auto [S, lay, w, iw, x, dout] = dsa_form_inputs<T>(cfg, B, tokens, heads);
  const int P = lay.ranks;
  std::vector<std::int64_t> doc_start;
  const DsaBlockResult<T> want =
      packed ? dsa_per_document(cfg, w, iw, x, dout, S, stage, kDsaPackedDocs, doc_start)
             : dsa_block(cfg, w, iw, x.data(), dout.data(), B, S, stage, DsaAttend::per_head);

  std::vector<MemoryPool> pools;
  std::vector<DsaBlockResult<T>> got(static_cast<std::size_t>(P));
  const std::vector<std::unique_ptr<Communicator>> comms =
      dsa_run_ranks(lay, x, dout, pools, [&](Communicator& comm, const T* xr, const T* dr) {
        got[std::size_t(comm.rank())] =
            run(cfg, w, iw, xr, dr, lay, stage, comm, packed ? doc_start.data() : nullptr);
      });

  const std::string what = std::string(to_string(form)) + " " + to_string(stage) +
                           (packed ? " packed" : "") + " P " + std::to_string(P) + " " +
                           lay.describe() + (sizeof(T) == 8 ? " double" : " float");
  const Tolerance tol = block_tolerance<T>();
  DsaBlockResult<T> sum;
  sum.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  sum.indexer_grads = DsaIndexerParams<T>::zeros(cfg);
  std::int64_t sent = 0;
  for (int r = 0; r < P; ++r) {
    const DsaBlockResult<T>& g = got[std::size_t(r)];
    const std::int64_t s0 = lay.shard_begin(r), L = lay.seq_count[std::size_t(r)];
    const std::string wr = what + " rank " + std::to_string(r);
    EXPECT_TRUE(
        all_close(wr + " out", g.out, dsa_rows(want.out, B, S, D, s0, L), tol.atol, tol.rtol));
    EXPECT_TRUE(all_close(wr + " dx", g.dx, dsa_rows(want.dx, B, S, D, s0, L), tol.atol, tol.rtol));
    EXPECT_EQ(g.idx, dsa_rows(want.idx, B, S, K, s0, L)) << wr << " selection";
    dsa_add_grads(sum, g);

    const Ledger& ledger = comms[std::size_t(r)]->ledger();
    dsa_expect_ledger(
        wr, ledger,
        dsa_predict_comm(cfg, *DsaConfig::of(cfg), lay, form, r,
                         {std::int64_t(sizeof(T)), std::int64_t(sizeof(T))}, true, false, stage));
    sent += ledger.bytes_sent();
  }
  dsa_expect_sum_equals(what, sum, want, tol);
  return sent;
}

}  // namespace laga::test
