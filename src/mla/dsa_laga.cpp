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

template <class T>
std::vector<T> buffer(std::int64_t n) {
  return std::vector<T>(static_cast<std::size_t>(n), T(0));
}

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
  cfg.validate();
  lay.validate();
  LAGA_CHECK(cfg.dsa(),
             "dsa_laga: the config has no DeepSeek Sparse Attention keys (index_n_heads, "
             "index_head_dim, index_topk)");
  LAGA_CHECK(form == DsaForm::laga_indices || form == DsaForm::laga_recompute,
             "dsa_laga: DSA form '", to_string(form),
             "' is not one of LAGA's head-sharded forms; use laga_indices or laga_recompute "
             "(latent_gather runs in dsa_latent_gather, mla/dsa_cp.hpp)");
  LAGA_CHECK(lay.seq_layout == SeqLayout::contiguous,
             "dsa_laga: the zigzag layout is not implemented; use --seq-layout contiguous");
  LAGA_CHECK(lay.ranks == comm.size(), "dsa_laga: the layout has ", lay.ranks,
             " ranks, the communicator ", comm.size());
  std::int64_t heads = 0;
  for (std::int64_t h : lay.head_count) heads += h;
  LAGA_CHECK(heads == cfg.n_heads, "dsa_laga: the layout's ranks hold ", heads,
             " heads, the config has n_heads ", cfg.n_heads);
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
  const T* wq_b_mine = w.wq_b.data() + h0 * dqk * rq;
  const T* wkv_b_mine = w.wkv_b.data() + h0 * (dn + dv) * C;

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
  DsaBlockResult<T> res;
  comm.set_phase(Phase::forward);
  // ---- the rank's own rows: the MLA's projections and the indexer's
  const DsaRowPositions at{B, L, s0, doc_start ? pos.data() : nullptr};
  const DsaOwnRows<T> own = dsa_own_rows(cfg, w, x, at, table, indices, dout != nullptr);
  const Tensor<T>& qr = own.qr;
  std::vector<T> lat_own = buffer<T>(N * W);  // [c | rope(k_pe)]
  for (std::int64_t t = 0; t < N; ++t) {
    std::copy_n(own.c.data() + t * C, C, lat_own.data() + t * W);
    std::copy_n(own.k_pe.data() + t * dr, dr, lat_own.data() + t * W + C);
  }
  DsaIndexerProjections<T> ip = dsa_indexer_project(cfg, iw, x, qr.data(), N);
  dsa_rope_index_rows(ip.q.data(), at, HI, HI * dI, dI, table, false);
  dsa_rope_index_rows(ip.k.data(), at, 1, dI, dI, table, false);
  dsa_index_values_as_stored(cfg, N, ip.q.data(), ip.k.data(), ip.w.data());

  // ---- the queries to their heads' owners: q_h (B, S, H_r, dqk)
  std::vector<T> qh = buffer<T>(NS * Hr * dqk), qrS;
  if (indices) {
    seq_to_head(comm, lay, own.q.data(), qh.data(), dqk, "q_a2a");
  } else {
    qrS = buffer<T>(NS * rq);
    gather_seq(comm, lay, qr.data(), qrS.data(), rq, "q_latent_ag");
    if (Hr > 0) {
      ops::linear_rows(qh.data(), qrS.data(), wq_b_mine, NS, rq, Hr * dqk);
      dsa_rope_rows(qh.data() + dn, all_rows, Hr, Hr * dqk, dqk, table, false);
    }
  }
  // ---- the latent and the index keys of every token
  std::vector<T> latS = buffer<T>(NS * W), kIS = buffer<T>(NS * dI), cS = buffer<T>(NS * C);
  gather_seq(comm, lay, lat_own.data(), latS.data(), W, "latent_ag");
  gather_seq(comm, lay, ip.k.data(), kIS.data(), dI, "index_k_ag");
  for (std::int64_t t = 0; t < NS; ++t) std::copy_n(latS.data() + t * W, C, cS.data() + t * C);
  const std::vector<T> kIk = rows_of(kIS, B, S, dI, 0, Sk);  // the keys of the rank's rows

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
  std::vector<std::int32_t> idxS;  // every row's selection (sparse stage)
  if (indices || !sparse) {
    res.idx.assign(static_cast<std::size_t>(N * K), -1);
    ops::index_topk(is_own, res.idx.data(), ip.q.data(), kIk.data(), ip.w.data());
    if (sparse) idxS = dsa_gather_indices(comm, lay, res.idx, K);
  } else {
    // Every rank runs the indexer for every row from qr, k_I and w
    // gathered. (The rank's own rows' q_I, which the KL reads, were
    // projected by dsa_indexer_project too: L / S of this projection
    // again, which dsa_work counts.)
    std::vector<T> wS = buffer<T>(NS * HI), qIS = buffer<T>(NS * HI * dI);
    gather_seq(comm, lay, ip.w.data(), wS.data(), HI, "index_w_ag");
    ops::linear_rows(qIS.data(), qrS.data(), iw.wq_b.data(), NS, rq, HI * dI);
    dsa_rope_index_rows(qIS.data(), all_rows, HI, HI * dI, dI, table, false);
    dsa_index_values_as_stored<T>(cfg, NS, qIS.data(), nullptr, nullptr);
    idxS.assign(static_cast<std::size_t>(NS * K), -1);
    ops::index_topk(is_all, idxS.data(), qIS.data(), kIS.data(), wS.data());
    res.idx = rows_of(idxS, B, S, K, s0, L);
  }
  // The main attention's key set of every row: the selection, or every
  // causal key in the warm-up (S slots a row).
  std::vector<std::int32_t> all;
  if (!sparse) {
    all.assign(static_cast<std::size_t>(NS * S), -1);
    ops::index_all_causal(is_all, all.data());
  }
  const std::int32_t* att_idx = sparse ? idxS.data() : all.data();
  const std::int64_t KA = sparse ? K : S;

  // ---- the rank's heads, every query: K/V up-projected, attention per head
  std::vector<T> kh = buffer<T>(NS * Hr * dqk), vh = buffer<T>(NS * Hr * dv);
  std::vector<T> oh = buffer<T>(NS * Hr * dv), lseh = buffer<T>(B * Hr * S);
  std::vector<T> pS = buffer<T>(NS * KA);  // the rank's heads' share of the KL target
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
    std::vector<T> kvb = buffer<T>(NS * Hr * (dn + dv));
    ops::linear_rows(kvb.data(), cS.data(), wkv_b_mine, NS, C, Hr * (dn + dv));
    for (std::int64_t t = 0; t < NS; ++t)
      for (std::int64_t h = 0; h < Hr; ++h) {
        const T* src = kvb.data() + (t * Hr + h) * (dn + dv);
        std::copy_n(src, dn, kh.data() + (t * Hr + h) * dqk);
        std::copy_n(latS.data() + t * W + C, dr, kh.data() + (t * Hr + h) * dqk + dn);
        std::copy_n(src + dn, dv, vh.data() + (t * Hr + h) * dv);
      }
    ops::sparse_attention_forward<T>(ss, oh.data(), lseh.data(), qh.data(), kh.data(), vh.data(),
                                     att_idx);
    // (1/H_r) sum over the rank's heads, weighted H_r / H: summed over the
    // ranks, (1/H) sum over every head, dsa_block's target.
    ops::sparse_attention_head_summed_probs<T>(ss, pS.data(), qh.data(), kh.data(), lseh.data(),
                                               att_idx);
    for (T& e : pS) e = T(double(e) * double(Hr) / double(H));
  }
  std::vector<T> o = buffer<T>(N * H * dv);
  head_to_seq(comm, lay, oh.data(), o.data(), dv, "out_a2a");
  res.out = buffer<T>(N * D);
  ops::linear_rows(res.out.data(), o.data(), w.wo.data(), N, H * dv, D);

  // ---- the indexer's KL over the rank's rows, its target summed here
  std::vector<T> p = buffer<T>(N * KA);
  dsa_reduce_scatter_seq_fp32(comm, lay, pS.data(), p.data(), KA, "index_target_rs");
  const std::vector<std::int32_t> own_slots =
      sparse ? res.idx : rows_of(all, B, S, S, s0, L);  // (B, L, KA)
  std::vector<double> loss(static_cast<std::size_t>(N));
  std::vector<T> dqI = buffer<T>(N * HI * dI), dkIk = buffer<T>(B * Sk * dI),
                 dwI = buffer<T>(N * HI);
  ops::indexer_kl(is_own, KA, own_slots.data(), p.data(), ip.q.data(), kIk.data(), ip.w.data(),
                  loss.data(), dqI.data(), dkIk.data(), dwI.data());
  for (double l : loss) res.kl_loss += l;
  if (!dout) return res;

  comm.set_phase(Phase::backward);
  // ---- the indexer's weights: k_I's gradient to the keys' owners first
  Tensor<T> dkI = dsa_index_key_grads_home(comm, lay, dkIk.data(), Sk, dI);
  dsa_rope_index_rows(dqI.data(), at, HI, HI * dI, dI, table, true);
  dsa_rope_index_rows(dkI.data(), at, 1, dI, dI, table, true);
  res.indexer_grads = dsa_indexer_project_backward(
      cfg, iw, x, qr.data(), ip.w_scale, ip.k_pre.data(), ip.k_mean.data(), ip.k_rstd.data(),
      dwI.data(), dqI.data(), dkI.data(), N);

  // ---- the LM backward: the heads' gradients from every query
  res.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  res.dx = buffer<T>(N * D);
  std::vector<T> dO = buffer<T>(N * H * dv), dOh = buffer<T>(NS * Hr * dv);
  ops::linear_rows_backward<T>(dO.data(), false, res.grads.wo.data(), dout, o.data(), w.wo.data(),
                               N, H * dv, D);
  seq_to_head(comm, lay, dO.data(), dOh.data(), dv, "out_a2a");
  std::vector<T> dqh = buffer<T>(NS * Hr * dqk), dlatS = buffer<T>(NS * W);
  if (Hr > 0) {
    std::vector<T> dkh = buffer<T>(NS * Hr * dqk), dvh = buffer<T>(NS * Hr * dv);
    ops::sparse_attention_backward<T>(ss, dqh.data(), dkh.data(), dvh.data(), dOh.data(), qh.data(),
                                      kh.data(), vh.data(), oh.data(), lseh.data(), att_idx);
    std::vector<T> dkvb = buffer<T>(NS * Hr * (dn + dv)), dcS = buffer<T>(NS * C);
    for (std::int64_t t = 0; t < NS; ++t)
      for (std::int64_t h = 0; h < Hr; ++h) {
        T* dst = dkvb.data() + (t * Hr + h) * (dn + dv);
        std::copy_n(dkh.data() + (t * Hr + h) * dqk, dn, dst);
        std::copy_n(dvh.data() + (t * Hr + h) * dv, dv, dst + dn);
        for (std::int64_t e = 0; e < dr; ++e)  // k_pe is every head's: its gradient sums them
          dlatS[std::size_t(t * W + C + e)] += dkh[std::size_t((t * Hr + h) * dqk + dn + e)];
      }
    ops::linear_rows_backward<T>(dcS.data(), false, res.grads.wkv_b.data() + h0 * (dn + dv) * C,
                                 dkvb.data(), cS.data(), wkv_b_mine, NS, C, Hr * (dn + dv));
    for (std::int64_t t = 0; t < NS; ++t) std::copy_n(dcS.data() + t * C, C, dlatS.data() + t * W);
  }
  // ... the latent's gradient to its owners, the queries' to theirs
  std::vector<T> dkv = buffer<T>(N * W), dq;
  Tensor<T> dqr;
  reduce_scatter_seq(comm, lay, dlatS.data(), dkv.data(), W, "latent_ag");
  if (indices) {
    dq = buffer<T>(N * H * dqk);
    head_to_seq(comm, lay, dqh.data(), dq.data(), dqk, "q_a2a");
  } else {
    dqr = Tensor<T>::zeros({N * rq}, "dsa dqr");
    std::vector<T> dqrS = buffer<T>(NS * rq);
    if (Hr > 0) {
      dsa_rope_rows(dqh.data() + dn, all_rows, Hr, Hr * dqk, dqk, table, true);
      ops::linear_rows_backward<T>(dqrS.data(), false, res.grads.wq_b.data() + h0 * dqk * rq,
                                   dqh.data(), qrS.data(), wq_b_mine, NS, rq, Hr * dqk);
    }
    reduce_scatter_seq(comm, lay, dqrS.data(), dqr.data(), rq, "q_latent_ag");
  }
  // ---- the rank's own rows: the kv and q paths to x (dsa_block's)
  std::vector<T> dc = buffer<T>(N * C);
  for (std::int64_t t = 0; t < N; ++t) std::copy_n(dkv.data() + t * W, C, dc.data() + t * C);
  dsa_own_rows_backward(cfg, w, x, own, at, table, dkv.data(), dc.data(),
                        indices ? dq.data() : nullptr, dqr, res.grads, res.dx.data());
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
