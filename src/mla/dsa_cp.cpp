#include "mla/dsa_cp.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "mla/dsa_rows.hpp"
#include "mla/ops_dsa.hpp"

namespace laga {

namespace {

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
  // (rows at or past Sk left as they are: zero in a fresh buffer). Block
  // by block through the op layer (ops::copy), which moves nothing
  // count-only.
  template <class T>
  void copy(Tensor<T>& rank_major, Tensor<T>& seq, std::int64_t Sk, bool to_seq) const {
    for (int j = 0; j < lay.ranks; ++j) {
      const std::int64_t s0 = lay.shard_begin(j), L = lay.seq_count[std::size_t(j)];
      const std::int64_t n = std::max<std::int64_t>(0, std::min(L, Sk - s0));
      if (n == 0) continue;  // the shard starts at or past Sk
      const std::int64_t rm0 = displs[std::size_t(j)] / W;
      for (std::int64_t b = 0; b < lay.batch; ++b) {
        const ops::Mat<T> rm =
            ops::mat(rank_major, rank_major.numel() / W, W).block(rm0 + b * L, n, 0, W);
        const ops::Mat<T> sq = ops::mat(seq, lay.batch * Sk, W).block(b * Sk + s0, n, 0, W);
        if (to_seq)
          ops::copy(sq, rm);
        else
          ops::copy(rm, sq);
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
  check_dsa_form_inputs("dsa_latent_gather", cfg, lay, comm, false);
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
  // Every buffer is a pool tensor, freed (reset) where nothing reads it
  // again: dsa_memory (mla/dsa_model.cpp) writes the same sequence out, and
  // tests/mla/test_dsa_memory.cpp holds the pool's peak to it.
  auto zeros = [](std::int64_t n, const char* name) { return Tensor<T>::zeros({n}, name); };
  auto m = [](Tensor<T>& t, std::int64_t rows, std::int64_t cols) {
    return ops::mat(t, rows, cols);
  };
  DsaBlockResult<T> res;
  comm.set_phase(Phase::forward);
  // ---- the rank's own rows: the MLA's projections (dsa_block's, at s0)
  DsaOwnRows<T> own = dsa_own_rows(cfg, w, x, at, table, true, dout != nullptr);
  Tensor<T>&qr = own.qr, &q = own.q;
  Tensor<T> lat_own = zeros(N * W, "dsa latent own");  // [c | rope(k_pe)]
  ops::copy(m(lat_own, N, W).col_range(0, C), m(own.c, N, C));
  ops::copy(m(lat_own, N, W).col_range(C, dr), m(own.k_pe, N, dr));
  own.c.reset(), own.k_pe.reset();
  // ... and the indexer's
  DsaIndexerProjections<T> ip = dsa_indexer_rows(cfg, iw, x, qr.data(), at, table, N);
  Tensor<T>& qI = ip.q;  // the names the rest of this function reads
  Tensor<T>& kI = ip.k;
  Tensor<T>& wI = ip.w;

  // ---- the gathers: every rank's latent and index keys, kept up to Sk
  Tensor<T> lat_rm = zeros(lat_sh.total(), "dsa latent gathered");
  Tensor<T> key_rm = zeros(key_sh.total(), "dsa index keys gathered");
  dsa_all_gather_v(comm, lat_own.data(), N * W, lat_rm.data(), lat_sh.counts.data(),
                   lat_sh.displs.data(), "latent_ag");
  dsa_all_gather_v(comm, kI.data(), N * dI, key_rm.data(), key_sh.counts.data(),
                   key_sh.displs.data(), "index_k_ag");
  lat_own.reset(), kI.reset();
  Tensor<T> lat = zeros(NK * W, "dsa latent (B, Sk)"),
            kIS = zeros(NK * dI, "dsa index keys (B, Sk)");
  lat_sh.copy(lat_rm, lat, Sk, true);
  key_sh.copy(key_rm, kIS, Sk, true);
  lat_rm.reset(), key_rm.reset();
  Tensor<T> cS = zeros(NK * C, "dsa values (B, Sk)");
  ops::copy(m(cS, NK, C), m(lat, NK, W).col_range(0, C));

  // ---- the indexer and top-k of the rank's rows (row i is token s0 + i)
  IndexerShape is;
  is.attn = AttnShape{B, L, Sk, HI, 1, dI, 1, 1.0, true};
  is.attn.doc_start = docs;
  is.topk = K;
  is.scores = index_scores_of(cfg);
  is.validate();
  TensorI32 idx({N * K}, "dsa top-k indices");
  idx.fill(-1);
  ops::index_topk(is, idx.data(), qI.data(), kIS.data(), wI.data());
  TensorI32 all;
  const std::int32_t* att_idx = idx.data();
  std::int64_t KA = K;
  if (stage == DsaStage::dense_warmup) {
    all = TensorI32({N * Sk}, "dsa every causal key");
    all.fill(-1);
    ops::index_all_causal(is, all.data());
    att_idx = all.data(), KA = Sk;
  }

  // ---- the attention in latent space
  SparseAttnShape ss;
  ss.attn = AttnShape{B, L, Sk, H, 1, W, C, cfg.softmax_scale(), true};
  ss.attn.doc_start = docs;
  ss.K = KA;
  Tensor<T> qa_abs = zeros(N * H * W, "dsa absorbed q"), o_lat = zeros(N * H * C, "dsa o_lat");
  Tensor<T> o = zeros(N * H * dv, "dsa o"), lse = zeros(B * H * L, "dsa lse");
  dsa_absorb_q(cfg, w, q, qa_abs, N);
  ops::sparse_attention_forward<T>(ss, o_lat.data(), lse.data(), qa_abs.data(), lat.data(),
                                   cS.data(), att_idx);
  dsa_latent_out(cfg, w, o_lat, o, N);
  Tensor<T> out = zeros(N * D, "dsa output");
  ops::linear_rows(out.data(), o.data(), w.wo.data(), N, H * dv, D);

  // ---- the indexer's KL over the rank's rows
  Tensor<T> p = zeros(N * KA, "dsa KL target");
  ops::sparse_attention_head_summed_probs<T>(ss, p.data(), qa_abs.data(), lat.data(), lse.data(),
                                             att_idx);
  std::vector<double> loss(static_cast<std::size_t>(N));
  Tensor<T> dqI = zeros(N * HI * dI, "dsa index dq"), dkIS = zeros(NK * dI, "dsa index dk (B, Sk)");
  Tensor<T> dwI = zeros(N * HI, "dsa index dw");
  ops::indexer_kl(is, KA, att_idx, p.data(), qI.data(), kIS.data(), wI.data(), loss.data(),
                  dqI.data(), dkIS.data(), dwI.data());
  for (double l : loss) res.kl_loss += l;
  p.reset(), qI.reset(), wI.reset(), kIS.reset();
  res.out = ops::to_vector(out);
  res.idx = ops::to_vector(idx);
  if (!dout) return res;

  comm.set_phase(Phase::backward);
  // ---- the indexer's weights: k_I's gradient to the keys' owners first
  Tensor<T> dk_rm = zeros(key_sh.total(), "dsa index dk gathered");
  key_sh.copy(dk_rm, dkIS, Sk, false);
  dkIS.reset();
  Tensor<T> dkI = zeros(N * dI, "dsa index dk");
  dsa_reduce_scatter_v(comm, dk_rm.data(), key_sh.counts.data(), key_sh.displs.data(), dkI.data(),
                       "index_k_ag");
  dk_rm.reset();
  res.indexer_grads =
      dsa_indexer_rows_backward(cfg, iw, x, qr.data(), ip, at, table, dqI, dkI, dwI, N);

  // ---- the LM backward: the rank's rows, the latent's gradient to its owners
  res.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  Tensor<T> dx = zeros(N * D, "dsa dx");
  Tensor<T> dO = zeros(N * H * dv, "dsa dO");
  ops::linear_rows_backward<T>(dO.data(), false, res.grads.wo.data(), dout, o.data(), w.wo.data(),
                               N, H * dv, D);
  o.reset();
  Tensor<T> do_lat = zeros(N * H * C, "dsa do_lat");
  dsa_latent_out_backward(cfg, w, dO, o_lat, do_lat, res.grads, N);
  dO.reset();
  Tensor<T> dq_abs = zeros(N * H * W, "dsa absorbed dq");
  Tensor<T> dlatS = zeros(NK * W, "dsa d latent (B, Sk)"), dvalS = zeros(NK * C, "dsa d values");
  ops::sparse_attention_backward<T>(ss, dq_abs.data(), dlatS.data(), dvalS.data(), do_lat.data(),
                                    qa_abs.data(), lat.data(), cS.data(), o_lat.data(), lse.data(),
                                    att_idx);
  do_lat.reset(), qa_abs.reset(), lat.reset(), cS.reset(), o_lat.reset(), lse.reset();
  idx.reset(), all.reset();
  // c is the keys' latent and the values
  ops::add(m(dlatS, NK, W).col_range(0, C), m(dvalS, NK, C));
  dvalS.reset();
  Tensor<T> dlat_rm = zeros(lat_sh.total(), "dsa d latent gathered");
  lat_sh.copy(dlat_rm, dlatS, Sk, false);
  dlatS.reset();
  Tensor<T> dkv = zeros(N * W, "dsa dkv");
  dsa_reduce_scatter_v(comm, dlat_rm.data(), lat_sh.counts.data(), lat_sh.displs.data(), dkv.data(),
                       "latent_ag");
  dlat_rm.reset();
  Tensor<T> dq = zeros(N * H * dqk, "dsa dq"), dc = zeros(N * C, "dsa dc");
  dsa_absorb_q_backward(cfg, w, q, dq_abs, dq, res.grads, N);
  ops::copy(m(dc, N, C), m(dkv, N, W).col_range(0, C));
  dq_abs.reset(), q.reset();
  Tensor<T> dqr;
  dsa_own_rows_backward(cfg, w, x, own, at, table, dkv.data(), dc.data(), dq.data(), dqr, res.grads,
                        dx.data());
  res.dx = ops::to_vector(dx);
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
