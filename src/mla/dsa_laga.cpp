// LAGA's head-sharded DSA forms (mla/dsa_laga.hpp; docs/forms.md, "DeepSeek
// Sparse Attention (DSA)").
#include "mla/dsa_laga.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "mla/dsa_rows.hpp"
#include "mla/exchange.hpp"
#include "mla/ops_dsa.hpp"

namespace laga {

namespace {

// Rows [t0, t0 + n) of every batch row of a (B, S, w) tensor, as (B, n, w).
template <class T>
std::vector<T> rows_of(const std::vector<T>& a, std::int64_t B, std::int64_t S, std::int64_t w,
                       std::int64_t t0, std::int64_t n) {
  std::vector<T> out(static_cast<std::size_t>(B * n * w));
  for (std::int64_t b = 0; b < B; ++b)
    std::copy_n(a.data() + (b * S + t0) * w, n * w, out.data() + b * n * w);
  return out;
}

}  // namespace

template <class T>
DsaBlockResult<T> dsa_laga(const MlaConfig& cfg, const MlaParams<T>& w,
                           const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                           const SpLayout& lay, DsaStage stage, DsaForm form, Communicator& comm,
                           const std::int64_t* doc_start) {
  LAGA_CHECK(form == DsaForm::laga_indices || form == DsaForm::laga_recompute,
             "dsa_laga: DSA form '", to_string(form),
             "' is not one of LAGA's head-sharded forms; use laga_indices or laga_recompute "
             "(latent_gather runs in dsa_latent_gather, mla/dsa_cp.hpp)");
  check_dsa_form_inputs("dsa_laga", cfg, lay, comm, true);
  const bool indices = form == DsaForm::laga_indices, sparse = stage == DsaStage::sparse;
  const int r = comm.rank();
  const std::int64_t B = lay.batch, S = lay.seq, s0 = lay.shard_begin(r);
  const std::int64_t L = lay.seq_count[std::size_t(r)], Sk = s0 + L, N = B * L, NS = B * S;
  const std::int64_t h0 = lay.head_offset[std::size_t(r)], Hr = lay.head_count[std::size_t(r)];
  const std::int64_t D = cfg.dim, H = cfg.n_heads, rq = cfg.q_lora_rank, C = cfg.kv_lora_rank;
  const std::int64_t dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim;
  const std::int64_t dqk = dn + dr, HI = cfg.index_n_heads, dI = cfg.index_head_dim;
  const std::int64_t K = cfg.index_topk, W = C + dr;
  const RopeTable table(cfg.rope(), S);
  // The rank's heads' rows of wq_b (H dqk, rq) and wkv_b (H (dn + dv), C).
  const T* wq_b_mine = ops::at(w.wq_b.data(), h0 * dqk * rq);
  const T* wkv_b_mine = ops::at(w.wkv_b.data(), h0 * (dn + dv) * C);

  // Packed documents: every token's document start (the head owners read
  // every row, so every rank checks all of it: a bad one is the same error
  // on every rank), its RoPE position within its document (B, S), and the
  // keys' document starts of the rank's own rows' indexer (B, Sk).
  std::vector<std::int64_t> docs_k, posS;
  if (doc_start) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < S; ++t) {
        const std::int64_t d = doc_start[b * S + t];
        LAGA_CHECK(d >= 0 && d <= t && (t == 0 ? d == 0 : d == t || d == doc_start[b * S + t - 1]),
                   "dsa_laga: doc_start[", b, ", ", t, "] = ", d,
                   " is not the first token of a document holding token ", t);
        posS.push_back(t - d);
        if (t < Sk) docs_k.push_back(d);
      }
  }
  const std::vector<std::int64_t> pos = doc_start ? rows_of(posS, B, S, 1, s0, L) : posS;
  // Every row of the sequence (the head-sharded attention's), at 0 .. S - 1
  // or at its position in its document.
  const DsaRowPositions all_rows{B, S, 0, doc_start ? posS.data() : nullptr};
  // Every buffer is a pool tensor, freed (reset) where nothing reads it
  // again: dsa_memory (mla/dsa_model.cpp, laga_memory) writes the same
  // sequence out.
  auto zeros = [](std::int64_t n, const char* name) { return Tensor<T>::zeros({n}, name); };
  auto m = [](auto& t, std::int64_t rows, std::int64_t cols) { return ops::mat(t, rows, cols); };
  DsaBlockResult<T> res;
  comm.set_phase(Phase::forward);
  // ---- the rank's own rows: the MLA's projections and the indexer's
  const DsaRowPositions at{B, L, s0, doc_start ? pos.data() : nullptr};
  DsaOwnRows<T> own = dsa_own_rows(cfg, w, x, at, table, indices, dout != nullptr);
  Tensor<T>& qr = own.qr;
  Tensor<T> lat_own = zeros(N * W, "dsa latent own [c | rope(k_pe)]");
  ops::copy(m(lat_own, N, W).col_range(0, C), m(own.c, N, C));
  ops::copy(m(lat_own, N, W).col_range(C, dr), m(own.k_pe, N, dr));
  own.c.reset(), own.k_pe.reset();
  DsaIndexerProjections<T> ip = dsa_indexer_rows(cfg, iw, x, qr.data(), at, table, N);

  // ---- the queries to their heads' owners: q_h (B, S, H_r, dqk)
  Tensor<T> qh = zeros(NS * Hr * dqk, "dsa q_h"), qrS;
  if (indices) {
    seq_to_head(comm, lay, own.q.data(), qh.data(), dqk, "q_a2a");
    own.q.reset();
  } else {
    qrS = zeros(NS * rq, "dsa query latent gathered");
    gather_seq(comm, lay, qr.data(), qrS.data(), rq, "q_latent_ag");
    if (Hr > 0) {
      ops::linear_rows(qh.data(), qrS.data(), wq_b_mine, NS, rq, Hr * dqk);
      dsa_rope_rows(ops::at(qh.data(), dn), all_rows, Hr, Hr * dqk, dqk, table, false);
    }
  }
  // ---- the latent and the index keys of every token
  Tensor<T> latS = zeros(NS * W, "dsa latent gathered"),
            kIS = zeros(NS * dI, "dsa index keys gathered");
  gather_seq(comm, lay, lat_own.data(), latS.data(), W, "latent_ag");
  lat_own.reset();
  gather_seq(comm, lay, ip.k.data(), kIS.data(), dI, "index_k_ag");
  ip.k.reset();
  Tensor<T> cS = zeros(NS * C, "dsa latent c gathered");
  ops::copy(m(cS, NS, C), m(latS, NS, W).col_range(0, C));
  Tensor<T> kIk = zeros(B * Sk * dI, "dsa index keys (B, Sk)");  // the keys of the rank's rows
  for (std::int64_t b = 0; b < B; ++b)
    ops::copy(m(kIk, B * Sk, dI).row_range(b * Sk, Sk), m(kIS, NS, dI).row_range(b * S, Sk));

  // ---- the selection. The rank's rows (row i is token s0 + i) against the
  // keys before s0 + L; every row (B, S, K) where the attention needs it.
  IndexerShape is_own;
  is_own.attn = AttnShape{B, L, Sk, HI, 1, dI, 1, 1.0, true};
  is_own.attn.doc_start = doc_start ? docs_k.data() : nullptr;
  is_own.topk = K;
  is_own.scores = index_scores_of(cfg);
  is_own.validate();
  IndexerShape is_all = is_own;
  is_all.attn.Sq = S, is_all.attn.Sk = S, is_all.attn.doc_start = doc_start;
  // (int32 rows move by ops::cast: ops::copy's kernel moves float types)
  TensorI32 idx({N * K}, "dsa top-k indices"), idxS;  // the rank's rows', every row's (sparse)
  if (indices || !sparse) {
    idx.fill(-1);
    ops::index_topk(is_own, idx.data(), ip.q.data(), kIk.data(), ip.w.data());
    kIS.reset();
    if (sparse) idxS = dsa_gather_indices(comm, lay, idx, K);
  } else {
    // Every rank runs the indexer for every row from qr, k_I and w
    // gathered. (The rank's own rows' q_I, which the KL reads, were
    // projected by dsa_indexer_project too: L / S of this projection
    // again, which dsa_work counts.)
    Tensor<T> wS = zeros(NS * HI, "dsa index weights gathered");
    Tensor<T> qIS = zeros(NS * HI * dI, "dsa index queries of every row");
    gather_seq(comm, lay, ip.w.data(), wS.data(), HI, "index_w_ag");
    ops::linear_rows(qIS.data(), qrS.data(), iw.wq_b.data(), NS, rq, HI * dI);
    dsa_rope_index_rows(qIS.data(), all_rows, HI, HI * dI, dI, table, false);
    dsa_index_values_as_stored<T>(cfg, NS, qIS.data(), nullptr, nullptr);
    idxS = TensorI32({NS * K}, "dsa every row's selection");
    idxS.fill(-1);
    ops::index_topk(is_all, idxS.data(), qIS.data(), kIS.data(), wS.data());
    wS.reset(), qIS.reset(), kIS.reset();
    for (std::int64_t b = 0; b < B; ++b)
      ops::cast(ops::at(idx.data(), b * L * K), ops::at(idxS.data(), (b * S + s0) * K), L * K);
  }
  // The main attention's key set of every row: the selection, or every
  // causal key in the warm-up (S slots a row).
  TensorI32 all;
  if (!sparse) {
    all = TensorI32({NS * S}, "dsa every causal key");
    all.fill(-1);
    ops::index_all_causal(is_all, all.data());
  }
  const TensorI32& att = sparse ? idxS : all;
  const std::int64_t KA = sparse ? K : S;

  // ---- the rank's heads, every query: K/V up-projected, attention per head
  Tensor<T> kh = zeros(NS * Hr * dqk, "dsa k_h"), vh = zeros(NS * Hr * dv, "dsa v_h");
  Tensor<T> oh = zeros(NS * Hr * dv, "dsa o_h"), lseh = zeros(B * Hr * S, "dsa lse");
  // the rank's heads' share of the KL target
  Tensor<T> pS = zeros(NS * KA, "dsa KL target part");
  SparseAttnShape ss;
  ss.attn = AttnShape{B,
                      S,
                      S,
                      std::max<std::int64_t>(Hr, 1),
                      std::max<std::int64_t>(Hr, 1),
                      dqk,
                      dv,
                      cfg.softmax_scale(),
                      true};
  ss.K = KA;
  if (Hr > 0) {
    Tensor<T> kvb = zeros(NS * Hr * (dn + dv), "dsa kv_b");
    ops::linear_rows(kvb.data(), cS.data(), wkv_b_mine, NS, C, Hr * (dn + dv));
    for (std::int64_t h = 0; h < Hr; ++h) {
      const auto src = m(kvb, NS, Hr * (dn + dv));
      ops::copy(m(kh, NS, Hr * dqk).col_range(h * dqk, dn), src.col_range(h * (dn + dv), dn));
      ops::copy(m(kh, NS, Hr * dqk).col_range(h * dqk + dn, dr), m(latS, NS, W).col_range(C, dr));
      ops::copy(m(vh, NS, Hr * dv).col_range(h * dv, dv), src.col_range(h * (dn + dv) + dn, dv));
    }
    kvb.reset();
    ops::sparse_attention_forward<T>(ss, oh.data(), lseh.data(), qh.data(), kh.data(), vh.data(),
                                     att.data());
    // (1/H_r) sum over the rank's heads, weighted H_r / H: summed over the
    // ranks, (1/H) sum over every head, dsa_block's target.
    ops::sparse_attention_head_summed_probs<T>(ss, pS.data(), qh.data(), kh.data(), lseh.data(),
                                               att.data());
    ops::scale_ratio(m(pS, NS, KA), double(Hr), double(H));
  }
  latS.reset();
  Tensor<T> o = zeros(N * H * dv, "dsa o");
  head_to_seq(comm, lay, oh.data(), o.data(), dv, "out_a2a");
  Tensor<T> out = zeros(N * D, "dsa output");
  ops::linear_rows(out.data(), o.data(), w.wo.data(), N, H * dv, D);

  // ---- the indexer's KL over the rank's rows, its target summed here
  Tensor<T> p = zeros(N * KA, "dsa KL target");
  dsa_reduce_scatter_seq_fp32(comm, lay, pS.data(), p.data(), KA, "index_target_rs");
  pS.reset();
  TensorI32 own_all;  // the warm-up's key set of the rank's rows, (B, L, S)
  if (!sparse) {
    own_all = TensorI32({N * S}, "dsa own rows' causal keys");
    for (std::int64_t b = 0; b < B; ++b)
      ops::cast(ops::at(own_all.data(), b * L * S), ops::at(all.data(), (b * S + s0) * S), L * S);
  }
  const TensorI32& own_slots = sparse ? idx : own_all;  // (B, L, KA)
  std::vector<double> loss(static_cast<std::size_t>(N));
  Tensor<T> dqI = zeros(N * HI * dI, "dsa index dq"),
            dkIk = zeros(B * Sk * dI, "dsa index dk (B, Sk)");
  Tensor<T> dwI = zeros(N * HI, "dsa index dw");
  ops::indexer_kl(is_own, KA, own_slots.data(), p.data(), ip.q.data(), kIk.data(), ip.w.data(),
                  loss.data(), dqI.data(), dkIk.data(), dwI.data());
  for (double l : loss) res.kl_loss += l;
  // the KL's gradients are taken: backward reads them
  kIk.reset(), p.reset(), own_all.reset(), ip.q.reset(), ip.w.reset();
  res.out = ops::to_vector(out);
  res.idx = ops::to_vector(idx);
  out.reset(), idx.reset();
  if (!dout) return res;

  comm.set_phase(Phase::backward);
  // ---- the indexer's weights: k_I's gradient to the keys' owners first
  Tensor<T> dkI = dsa_index_key_grads_home(comm, lay, dkIk.data(), Sk, dI);
  dkIk.reset();
  res.indexer_grads =
      dsa_indexer_rows_backward(cfg, iw, x, qr.data(), ip, at, table, dqI, dkI, dwI, N);

  // ---- the LM backward: the heads' gradients from every query
  res.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  Tensor<T> dx = zeros(N * D, "dsa dx");
  Tensor<T> dO = zeros(N * H * dv, "dsa dO"), dOh = zeros(NS * Hr * dv, "dsa dO_h");
  ops::linear_rows_backward<T>(dO.data(), false, res.grads.wo.data(), dout, o.data(), w.wo.data(),
                               N, H * dv, D);
  seq_to_head(comm, lay, dO.data(), dOh.data(), dv, "out_a2a");
  o.reset(), dO.reset();
  Tensor<T> dqh = zeros(NS * Hr * dqk, "dsa dq_h"), dlatS = zeros(NS * W, "dsa d latent gathered");
  if (Hr > 0) {
    Tensor<T> dkh = zeros(NS * Hr * dqk, "dsa dk_h"), dvh = zeros(NS * Hr * dv, "dsa dv_h");
    ops::sparse_attention_backward<T>(ss, dqh.data(), dkh.data(), dvh.data(), dOh.data(), qh.data(),
                                      kh.data(), vh.data(), oh.data(), lseh.data(), att.data());
    dOh.reset(), qh.reset(), kh.reset(), vh.reset(), oh.reset(), lseh.reset();
    idxS.reset(), all.reset();
    Tensor<T> dkvb = zeros(NS * Hr * (dn + dv), "dsa dkv_b"),
              dcS = zeros(NS * C, "dsa dc gathered");
    for (std::int64_t h = 0; h < Hr; ++h) {
      const auto dst = m(dkvb, NS, Hr * (dn + dv));
      ops::copy(dst.col_range(h * (dn + dv), dn), m(dkh, NS, Hr * dqk).col_range(h * dqk, dn));
      ops::copy(dst.col_range(h * (dn + dv) + dn, dv), m(dvh, NS, Hr * dv).col_range(h * dv, dv));
      // k_pe is every head's: its gradient sums them
      ops::add(m(dlatS, NS, W).col_range(C, dr), m(dkh, NS, Hr * dqk).col_range(h * dqk + dn, dr));
    }
    dkh.reset(), dvh.reset();
    ops::linear_rows_backward<T>(dcS.data(), false,
                                 ops::at(res.grads.wkv_b.data(), h0 * (dn + dv) * C), dkvb.data(),
                                 cS.data(), wkv_b_mine, NS, C, Hr * (dn + dv));
    dkvb.reset();
    ops::copy(m(dlatS, NS, W).col_range(0, C), m(dcS, NS, C));
  }
  dOh.reset(), qh.reset(), kh.reset(), vh.reset(), oh.reset(), lseh.reset();
  idxS.reset(), all.reset(), cS.reset();
  // ... the latent's gradient to its owners, the queries' to theirs
  Tensor<T> dkv = zeros(N * W, "dsa dkv"), dq;
  Tensor<T> dqr;
  reduce_scatter_seq(comm, lay, dlatS.data(), dkv.data(), W, "latent_ag");
  dlatS.reset();
  if (indices) {
    dq = zeros(N * H * dqk, "dsa dq");
    head_to_seq(comm, lay, dqh.data(), dq.data(), dqk, "q_a2a");
    dqh.reset();
  } else {
    dqr = Tensor<T>::zeros({N * rq}, "dsa dqr");
    Tensor<T> dqrS = zeros(NS * rq, "dsa dqr gathered");
    if (Hr > 0) {
      dsa_rope_rows(ops::at(dqh.data(), dn), all_rows, Hr, Hr * dqk, dqk, table, true);
      ops::linear_rows_backward<T>(dqrS.data(), false,
                                   ops::at(res.grads.wq_b.data(), h0 * dqk * rq), dqh.data(),
                                   qrS.data(), wq_b_mine, NS, rq, Hr * dqk);
    }
    dqh.reset(), qrS.reset();
    reduce_scatter_seq(comm, lay, dqrS.data(), dqr.data(), rq, "q_latent_ag");
  }
  // ---- the rank's own rows: the kv and q paths to x (dsa_block's)
  Tensor<T> dc = zeros(N * C, "dsa dc");
  ops::copy(m(dc, N, C), m(dkv, N, W).col_range(0, C));
  dsa_own_rows_backward(cfg, w, x, own, at, table, dkv.data(), dc.data(),
                        indices ? dq.data() : nullptr, dqr, res.grads, dx.data());
  res.dx = ops::to_vector(dx);
  return res;
}

#define LAGA_INSTANTIATE(T)                                                                  \
  template DsaBlockResult<T> dsa_laga<T>(                                                    \
      const MlaConfig&, const MlaParams<T>&, const DsaIndexerParams<T>&, const T*, const T*, \
      const SpLayout&, DsaStage, DsaForm, Communicator&, const std::int64_t*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
