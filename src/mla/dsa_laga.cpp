// LAGA's head-sharded DSA forms (mla/dsa_laga.hpp; docs/forms.md, "DeepSeek
// Sparse Attention (DSA)").
#include "mla/dsa_laga.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
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

// The top-k of every rank's rows, (B, L_j, K) int32 each, all-gathered into
// (B, S, K) ("topk_ag"). The indices move as 4-byte words under DType::f32:
// a gather copies, never adds, so every bit arrives as it left.
static_assert(sizeof(std::int32_t) == sizeof(float));
std::vector<std::int32_t> gather_indices(Communicator& comm, const SpLayout& lay,
                                         const std::vector<std::int32_t>& own, std::int64_t K) {
  const std::int64_t B = lay.batch, S = lay.seq;
  std::vector<std::int64_t> counts, displs;
  std::int64_t off = 0;
  for (int j = 0; j < lay.ranks; ++j) {
    counts.push_back(B * lay.seq_count[std::size_t(j)] * K);
    displs.push_back(off);
    off += counts.back();
  }
  std::vector<std::int32_t> rank_major(static_cast<std::size_t>(off)), all(std::size_t(B * S * K));
  comm.all_gather_v(own.data(), std::int64_t(own.size()), rank_major.data(), counts.data(),
                    displs.data(), DType::f32, "topk_ag");
  for (int j = 0; j < lay.ranks; ++j) {
    const std::int64_t s0 = lay.shard_begin(j), L = lay.seq_count[std::size_t(j)];
    for (std::int64_t b = 0; b < B; ++b)
      std::copy_n(rank_major.data() + displs[std::size_t(j)] + b * L * K, L * K,
                  all.data() + (b * S + s0) * K);
  }
  return all;
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
  // The MLA's RoPE of the rank's rows (own: at s0 + l) or of every row.
  auto rope_mla = [&](T* p, bool own, std::int64_t nh, std::int64_t ld_token, std::int64_t ld_head,
                      bool inverse) {
    const std::int64_t rows = own ? L : S;
    if (doc_start)
      ops::rope_rows_at(p, B, rows, nh, ld_token, ld_head, own ? pos.data() : posS.data(), table,
                        inverse);
    else
      ops::rope_rows(p, B, rows, nh, ld_token, ld_head, own ? s0 : 0, table, inverse);
  };
  // The indexer's (rope_halves), of the rank's rows or every row.
  auto rope_index = [&](T* p, bool own, std::int64_t nh, std::int64_t ld_token, bool inverse) {
    const std::int64_t rows = own ? L : S;
    for (std::int64_t b = 0; b < B; ++b)
      ops::rope_halves(p + b * rows * ld_token, rows, nh, ld_token, dI, own ? s0 : 0,
                       doc_start ? (own ? pos.data() : posS.data()) + b * rows : nullptr, table,
                       inverse);
  };

  DsaBlockResult<T> res;
  comm.set_phase(Phase::forward);
  // ---- the rank's own rows: the MLA's projections and the indexer's
  std::vector<T> qa = buffer<T>(N * rq), qr = buffer<T>(N * rq), rstd_q = buffer<T>(N);
  ops::linear_rows(qa.data(), x, w.wq_a.data(), N, D, rq);
  ops::rmsnorm_rows(qr.data(), rstd_q.data(), qa.data(), rq, w.q_norm.data(), N, rq, cfg.norm_eps);
  std::vector<T> kv = buffer<T>(N * W), c = buffer<T>(N * C), rstd_kv = buffer<T>(N);
  ops::linear_rows(kv.data(), x, w.wkv_a.data(), N, D, W);
  ops::rmsnorm_rows(c.data(), rstd_kv.data(), kv.data(), W, w.kv_norm.data(), N, C, cfg.norm_eps);
  std::vector<T> lat_own = buffer<T>(N * W);  // [c | rope(k_pe)]
  for (std::int64_t t = 0; t < N; ++t) {
    std::copy_n(c.data() + t * C, C, lat_own.data() + t * W);
    std::copy_n(kv.data() + t * W + C, dr, lat_own.data() + t * W + C);
  }
  rope_mla(lat_own.data() + C, true, 1, W, dr, false);
  DsaIndexerProjections<T> ip = dsa_indexer_project(cfg, iw, x, qr.data(), N);
  rope_index(ip.q.data(), true, HI, HI * dI, false);
  rope_index(ip.k.data(), true, 1, dI, false);

  // ---- the queries to their heads' owners: q_h (B, S, H_r, dqk)
  std::vector<T> qh = buffer<T>(NS * Hr * dqk), qrS;
  if (indices) {
    std::vector<T> q = buffer<T>(N * H * dqk);
    ops::linear_rows(q.data(), qr.data(), w.wq_b.data(), N, rq, H * dqk);
    rope_mla(q.data() + dn, true, H, H * dqk, dqk, false);
    seq_to_head(comm, lay, q.data(), qh.data(), dqk, "q_a2a");
  } else {
    qrS = buffer<T>(NS * rq);
    gather_seq(comm, lay, qr.data(), qrS.data(), rq, "q_latent_ag");
    if (Hr > 0) {
      ops::linear_rows(qh.data(), qrS.data(), wq_b_mine, NS, rq, Hr * dqk);
      rope_mla(qh.data() + dn, false, Hr, Hr * dqk, dqk, false);
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
  is_own.validate();
  IndexerShape is_all = is_own;
  is_all.attn.Sq = S, is_all.attn.Sk = S, is_all.attn.doc_start = doc_start;
  std::vector<std::int32_t> idxS;  // every row's selection (sparse stage)
  if (indices || !sparse) {
    res.idx.assign(static_cast<std::size_t>(N * K), -1);
    ops::index_topk(is_own, res.idx.data(), ip.q.data(), kIk.data(), ip.w.data());
    if (sparse) idxS = gather_indices(comm, lay, res.idx, K);
  } else {
    // Every rank runs the indexer for every row from qr, k_I and w
    // gathered. (The rank's own rows' q_I, which the KL reads, were
    // projected by dsa_indexer_project too: L / S of this projection
    // again, which dsa_work counts.)
    std::vector<T> wS = buffer<T>(NS * HI), qIS = buffer<T>(NS * HI * dI);
    gather_seq(comm, lay, ip.w.data(), wS.data(), HI, "index_w_ag");
    ops::linear_rows(qIS.data(), qrS.data(), iw.wq_b.data(), NS, rq, HI * dI);
    rope_index(qIS.data(), false, HI, HI * dI, false);
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
    ops::head_summed_probs(ss, pS.data(), qh.data(), kh.data(), lseh.data(), att_idx);
    for (T& e : pS) e = T(double(e) * double(Hr) / double(H));
  }
  std::vector<T> o = buffer<T>(N * H * dv);
  head_to_seq(comm, lay, oh.data(), o.data(), dv, "out_a2a");
  res.out = buffer<T>(N * D);
  ops::linear_rows(res.out.data(), o.data(), w.wo.data(), N, H * dv, D);

  // ---- the indexer's KL over the rank's rows, its target summed here
  std::vector<T> p = buffer<T>(N * KA);
  reduce_scatter_seq(comm, lay, pS.data(), p.data(), KA, "index_target_rs");
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
  std::vector<T> dkIS = buffer<T>(NS * dI), dkI = buffer<T>(N * dI);
  for (std::int64_t b = 0; b < B; ++b)
    std::copy_n(dkIk.data() + b * Sk * dI, Sk * dI, dkIS.data() + b * S * dI);
  reduce_scatter_seq(comm, lay, dkIS.data(), dkI.data(), dI, "index_k_ag");
  rope_index(dqI.data(), true, HI, HI * dI, true);
  rope_index(dkI.data(), true, 1, dI, true);
  res.indexer_grads = dsa_indexer_project_backward(
      cfg, iw, x, qr.data(), ip.w_scale, ip.k_pre.data(), ip.k_mean.data(), ip.k_rstd.data(), dwI,
      dqI.data(), dkI.data(), N);

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
  std::vector<T> dkv = buffer<T>(N * W), dq = buffer<T>(N * H * dqk), dqr = buffer<T>(N * rq);
  reduce_scatter_seq(comm, lay, dlatS.data(), dkv.data(), W, "latent_ag");
  if (indices) {
    head_to_seq(comm, lay, dqh.data(), dq.data(), dqk, "q_a2a");
    rope_mla(dq.data() + dn, true, H, H * dqk, dqk, true);
    ops::linear_rows_backward<T>(dqr.data(), false, res.grads.wq_b.data(), dq.data(), qr.data(),
                                 w.wq_b.data(), N, rq, H * dqk);
  } else {
    std::vector<T> dqrS = buffer<T>(NS * rq);
    if (Hr > 0) {
      rope_mla(dqh.data() + dn, false, Hr, Hr * dqk, dqk, true);
      ops::linear_rows_backward<T>(dqrS.data(), false, res.grads.wq_b.data() + h0 * dqk * rq,
                                   dqh.data(), qrS.data(), wq_b_mine, NS, rq, Hr * dqk);
    }
    reduce_scatter_seq(comm, lay, dqrS.data(), dqr.data(), rq, "q_latent_ag");
  }
  // ---- the rank's own rows: the kv and q paths to x (dsa_block's)
  std::vector<T> dc = buffer<T>(N * C);
  for (std::int64_t t = 0; t < N; ++t) std::copy_n(dkv.data() + t * W, C, dc.data() + t * C);
  rope_mla(dkv.data() + C, true, 1, W, dr, true);
  ops::rmsnorm_rows_backward(dkv.data(), W, res.grads.kv_norm.data(), dc.data(), C, kv.data(), W,
                             w.kv_norm.data(), rstd_kv.data(), N, C);
  ops::linear_rows_backward<T>(res.dx.data(), false, res.grads.wkv_a.data(), dkv.data(), x,
                               w.wkv_a.data(), N, D, W);
  std::vector<T> dqa = buffer<T>(N * rq);
  ops::rmsnorm_rows_backward(dqa.data(), rq, res.grads.q_norm.data(), dqr.data(), rq, qa.data(), rq,
                             w.q_norm.data(), rstd_q.data(), N, rq);
  ops::linear_rows_backward<T>(res.dx.data(), true, res.grads.wq_a.data(), dqa.data(), x,
                               w.wq_a.data(), N, D, rq);
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
