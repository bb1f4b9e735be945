#include "mla/dsa_cp.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "mla/dsa_rows.hpp"
#include "mla/ops_dsa.hpp"

namespace laga {

namespace {

template <class T>
std::vector<T> buffer(std::int64_t n) {
  return std::vector<T>(static_cast<std::size_t>(n), T(0));
}

// Rank-major shards (rank j: B x L_j rows of width W, as all_gather_v lands
// them) and the (B, Sk, W) prefix of the sequence they make: the keys a
// rank whose shard ends at Sk reads.
struct Shards {
  const SpLayout& lay;
  std::int64_t W;
  std::vector<std::int64_t> counts, displs;
  Shards(const SpLayout& l, std::int64_t w) : lay(l), W(w) {
    std::int64_t off = 0;
    for (int j = 0; j < l.ranks; ++j) {
      counts.push_back(l.batch * l.seq_count[std::size_t(j)] * W);
      displs.push_back(off);
      off += counts.back();
    }
  }
  std::int64_t total() const { return displs.back() + counts.back(); }
  // dir true: rank-major -> (B, Sk, W); false: (B, Sk, W) -> rank-major
  // (rows at or past Sk left as they are: zero in a fresh buffer).
  template <class T>
  void copy(T* rank_major, T* seq, std::int64_t Sk, bool to_seq) const {
    for (int j = 0; j < lay.ranks; ++j) {
      const std::int64_t s0 = lay.shard_begin(j), L = lay.seq_count[std::size_t(j)];
      const std::int64_t n = std::max<std::int64_t>(0, std::min(L, Sk - s0));
      for (std::int64_t b = 0; b < lay.batch; ++b)
        for (std::int64_t l = 0; l < n; ++l) {
          T* rm = rank_major + displs[std::size_t(j)] + (b * L + l) * W;
          T* sq = seq + (b * Sk + s0 + l) * W;
          if (to_seq)
            std::copy_n(rm, W, sq);
          else
            std::copy_n(sq, W, rm);
        }
    }
  }
};

}  // namespace

template <class T>
DsaBlockResult<T> dsa_latent_gather(const MlaConfig& cfg, const MlaParams<T>& w,
                                    const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                                    const SpLayout& lay, DsaStage stage, Communicator& comm,
                                    const std::int64_t* doc_start) {
  cfg.validate();
  lay.validate();
  LAGA_CHECK(cfg.dsa(),
             "dsa_latent_gather: the config has no DeepSeek Sparse Attention keys (index_n_heads, "
             "index_head_dim, index_topk)");
  LAGA_CHECK(lay.seq_layout == SeqLayout::contiguous,
             "dsa_latent_gather: the zigzag layout is not implemented; use --seq-layout "
             "contiguous");
  LAGA_CHECK(lay.ranks == comm.size(), "dsa_latent_gather: the layout has ", lay.ranks,
             " ranks, the communicator ", comm.size());
  const int r = comm.rank();
  const std::int64_t B = lay.batch, S = lay.seq, s0 = lay.shard_begin(r);
  const std::int64_t L = lay.seq_count[std::size_t(r)], Sk = s0 + L, N = B * L, NK = B * Sk;
  const std::int64_t D = cfg.dim, H = cfg.n_heads, C = cfg.kv_lora_rank;
  const std::int64_t dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim;
  const std::int64_t dqk = dn + dr, HI = cfg.index_n_heads, dI = cfg.index_head_dim;
  const std::int64_t K = cfg.index_topk, W = C + dr;
  const RopeTable table(cfg.rope(), S);
  const Shards lat_sh(lay, W), key_sh(lay, dI);

  // Packed documents: each token's first token of its document over the
  // keys this rank reads (B, Sk), and its RoPE position within its
  // document for the rank's rows (B, L) (docs/forms.md, "Packed sequences").
  std::vector<std::int64_t> docs_k, pos;
  if (doc_start) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < Sk; ++t) {
        const std::int64_t d = doc_start[b * S + t];
        LAGA_CHECK(d >= 0 && d <= t && (t == 0 ? d == 0 : d == t || d == doc_start[b * S + t - 1]),
                   "dsa_latent_gather: doc_start[", b, ", ", t, "] = ", d,
                   " is not the first token of a document holding token ", t);
        docs_k.push_back(d);
        if (t >= s0) pos.push_back(t - d);
      }
  }
  const std::int64_t* docs = doc_start ? docs_k.data() : nullptr;
  // The rank's rows: at s0 + l, or at their positions in their documents.
  const DsaRowPositions at{B, L, s0, doc_start ? pos.data() : nullptr};
  DsaBlockResult<T> res;
  comm.set_phase(Phase::forward);
  // ---- the rank's own rows: the MLA's projections (dsa_block's, at s0)
  const DsaOwnRows<T> own = dsa_own_rows(cfg, w, x, at, table, true, dout != nullptr);
  const std::vector<T>&qr = own.qr, &q = own.q;
  std::vector<T> lat_own = buffer<T>(N * W);  // [c | rope(k_pe)]
  for (std::int64_t t = 0; t < N; ++t) {
    std::copy_n(own.c.data() + t * C, C, lat_own.data() + t * W);
    std::copy_n(own.k_pe.data() + t * dr, dr, lat_own.data() + t * W + C);
  }
  // ... and the indexer's
  DsaIndexerProjections<T> ip = dsa_indexer_project(cfg, iw, x, qr.data(), N);
  std::vector<T>& qI = ip.q;  // the names the rest of this function reads
  std::vector<T>& kpre = ip.k_pre;
  std::vector<T>& kI = ip.k;
  std::vector<T>& k_mean = ip.k_mean;
  std::vector<T>& k_rstd = ip.k_rstd;
  std::vector<T>& wI = ip.w;
  const double w_scale = ip.w_scale;
  dsa_rope_index_rows(qI.data(), at, HI, HI * dI, dI, table, false);
  dsa_rope_index_rows(kI.data(), at, 1, dI, dI, table, false);
  dsa_index_values_as_stored(cfg, N, qI.data(), kI.data(), wI.data());

  // ---- the gathers: every rank's latent and index keys, kept up to Sk
  std::vector<T> lat_rm = buffer<T>(lat_sh.total()), key_rm = buffer<T>(key_sh.total());
  dsa_all_gather_v(comm, lat_own.data(), N * W, lat_rm.data(), lat_sh.counts.data(),
                   lat_sh.displs.data(), "latent_ag");
  dsa_all_gather_v(comm, kI.data(), N * dI, key_rm.data(), key_sh.counts.data(),
                   key_sh.displs.data(), "index_k_ag");
  std::vector<T> lat = buffer<T>(NK * W), kIS = buffer<T>(NK * dI), cS = buffer<T>(NK * C);
  lat_sh.copy(lat_rm.data(), lat.data(), Sk, true);
  key_sh.copy(key_rm.data(), kIS.data(), Sk, true);
  for (std::int64_t t = 0; t < NK; ++t) std::copy_n(lat.data() + t * W, C, cS.data() + t * C);

  // ---- the indexer and top-k of the rank's rows (row i is token s0 + i)
  IndexerShape is;
  is.attn = AttnShape{B, L, Sk, HI, 1, dI, 1, 1.0, true};
  is.attn.doc_start = docs;
  is.topk = K;
  is.scores = index_scores_of(cfg);
  is.validate();
  res.idx.assign(static_cast<std::size_t>(N * K), -1);
  ops::index_topk(is, res.idx.data(), qI.data(), kIS.data(), wI.data());
  std::vector<std::int32_t> all;
  const std::int32_t* att_idx = res.idx.data();
  std::int64_t KA = K;
  if (stage == DsaStage::dense_warmup) {
    all.assign(static_cast<std::size_t>(N * Sk), -1);
    ops::index_all_causal(is, all.data());
    att_idx = all.data(), KA = Sk;
  }

  // ---- the attention in latent space
  SparseAttnShape ss;
  ss.attn = AttnShape{B, L, Sk, H, 1, W, C, cfg.softmax_scale(), true};
  ss.attn.doc_start = docs;
  ss.K = KA;
  std::vector<T> qa_abs = buffer<T>(N * H * W), o_lat = buffer<T>(N * H * C);
  std::vector<T> o = buffer<T>(N * H * dv), lse = buffer<T>(B * H * L);
  for (std::int64_t h = 0; h < H; ++h)  // q_nope W_UK[h] into qa_abs[:, h, :C]
    ops::gemm_strided<T>(false, false, N, C, dn, T(1), q.data() + h * dqk, H * dqk,
                         w.wkv_b.data() + h * (dn + dv) * C, C, T(0), qa_abs.data() + h * W, H * W);
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      std::copy_n(q.data() + (t * H + h) * dqk + dn, dr, qa_abs.data() + (t * H + h) * W + C);
  ops::sparse_attention_forward<T>(ss, o_lat.data(), lse.data(), qa_abs.data(), lat.data(),
                                   cS.data(), att_idx);
  for (std::int64_t h = 0; h < H; ++h)  // o_lat W_UV[h]^T
    ops::gemm_strided<T>(false, true, N, dv, C, T(1), o_lat.data() + h * C, H * C,
                         w.wkv_b.data() + (h * (dn + dv) + dn) * C, C, T(0), o.data() + h * dv,
                         H * dv);
  res.out = buffer<T>(N * D);
  ops::linear_rows(res.out.data(), o.data(), w.wo.data(), N, H * dv, D);

  // ---- the indexer's KL over the rank's rows
  std::vector<T> p = buffer<T>(N * KA);
  ops::sparse_attention_head_summed_probs<T>(ss, p.data(), qa_abs.data(), lat.data(), lse.data(),
                                             att_idx);
  std::vector<double> loss(static_cast<std::size_t>(N));
  std::vector<T> dqI = buffer<T>(N * HI * dI), dkIS = buffer<T>(NK * dI), dwI = buffer<T>(N * HI);
  ops::indexer_kl(is, KA, att_idx, p.data(), qI.data(), kIS.data(), wI.data(), loss.data(),
                  dqI.data(), dkIS.data(), dwI.data());
  for (double l : loss) res.kl_loss += l;
  if (!dout) return res;

  comm.set_phase(Phase::backward);
  // ---- the indexer's weights: k_I's gradient to the keys' owners first
  std::vector<T> dk_rm = buffer<T>(key_sh.total()), dkI = buffer<T>(N * dI);
  key_sh.copy(dk_rm.data(), dkIS.data(), Sk, false);
  dsa_reduce_scatter_v(comm, dk_rm.data(), key_sh.counts.data(), key_sh.displs.data(), dkI.data(),
                       "index_k_ag");
  dsa_rope_index_rows(dqI.data(), at, HI, HI * dI, dI, table, true);
  dsa_rope_index_rows(dkI.data(), at, 1, dI, dI, table, true);
  res.indexer_grads =
      dsa_indexer_project_backward(cfg, iw, x, qr.data(), w_scale, kpre.data(), k_mean.data(),
                                   k_rstd.data(), dwI, dqI.data(), dkI.data(), N);

  // ---- the LM backward: the rank's rows, the latent's gradient to its owners
  res.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  res.dx = buffer<T>(N * D);
  std::vector<T> dO = buffer<T>(N * H * dv);
  ops::linear_rows_backward<T>(dO.data(), false, res.grads.wo.data(), dout, o.data(), w.wo.data(),
                               N, H * dv, D);
  std::vector<T> do_lat = buffer<T>(N * H * C), dq_abs = buffer<T>(N * H * W);
  std::vector<T> dlatS = buffer<T>(NK * W), dvalS = buffer<T>(NK * C);
  for (std::int64_t h = 0; h < H; ++h) {
    ops::gemm_strided<T>(false, false, N, C, dv, T(1), dO.data() + h * dv, H * dv,
                         w.wkv_b.data() + (h * (dn + dv) + dn) * C, C, T(0), do_lat.data() + h * C,
                         H * C);
    ops::gemm_strided<T>(true, false, dv, C, N, T(1), dO.data() + h * dv, H * dv,
                         o_lat.data() + h * C, H * C, T(1),
                         res.grads.wkv_b.data() + (h * (dn + dv) + dn) * C, C);
  }
  ops::sparse_attention_backward<T>(ss, dq_abs.data(), dlatS.data(), dvalS.data(), do_lat.data(),
                                    qa_abs.data(), lat.data(), cS.data(), o_lat.data(), lse.data(),
                                    att_idx);
  for (std::int64_t t = 0; t < NK; ++t)  // c is the keys' latent and the values
    for (std::int64_t e = 0; e < C; ++e)
      dlatS[std::size_t(t * W + e)] += dvalS[std::size_t(t * C + e)];
  std::vector<T> dlat_rm = buffer<T>(lat_sh.total()), dkv = buffer<T>(N * W);
  lat_sh.copy(dlat_rm.data(), dlatS.data(), Sk, false);
  dsa_reduce_scatter_v(comm, dlat_rm.data(), lat_sh.counts.data(), lat_sh.displs.data(), dkv.data(),
                       "latent_ag");
  std::vector<T> dq = buffer<T>(N * H * dqk), dc = buffer<T>(N * C);
  for (std::int64_t h = 0; h < H; ++h) {
    ops::gemm_strided<T>(false, true, N, dn, C, T(1), dq_abs.data() + h * W, H * W,
                         w.wkv_b.data() + h * (dn + dv) * C, C, T(0), dq.data() + h * dqk, H * dqk);
    ops::gemm_strided<T>(true, false, dn, C, N, T(1), q.data() + h * dqk, H * dqk,
                         dq_abs.data() + h * W, H * W, T(1),
                         res.grads.wkv_b.data() + h * (dn + dv) * C, C);
  }
  for (std::int64_t t = 0; t < N; ++t) {
    for (std::int64_t h = 0; h < H; ++h)
      std::copy_n(dq_abs.data() + (t * H + h) * W + C, dr, dq.data() + (t * H + h) * dqk + dn);
    std::copy_n(dkv.data() + t * W, C, dc.data() + t * C);
  }
  std::vector<T> dqr;
  dsa_own_rows_backward(cfg, w, x, own, at, table, dkv.data(), dc.data(), dq.data(), dqr, res.grads,
                        res.dx.data());
  return res;
}

#define LAGA_INSTANTIATE(T)                                                                  \
  template DsaBlockResult<T> dsa_latent_gather<T>(                                           \
      const MlaConfig&, const MlaParams<T>&, const DsaIndexerParams<T>&, const T*, const T*, \
      const SpLayout&, DsaStage, Communicator&, const std::int64_t*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
