#include "mla/dsa_block.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "mla/dsa_rows.hpp"
#include "mla/ops_dsa.hpp"

namespace laga {

const char* to_string(DsaStage s) {
  return s == DsaStage::sparse ? "sparse" : "dense_warmup";
}
const char* to_string(DsaAttend a) {
  return a == DsaAttend::latent ? "latent" : "per_head";
}

template <class T>
DsaIndexerParams<T> DsaIndexerParams<T>::zeros(const MlaConfig& cfg) {
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  DsaIndexerParams p;
  p.wq_b.assign(n(cfg.index_n_heads * cfg.index_head_dim * cfg.q_lora_rank), T(0));
  p.wk.assign(n(cfg.index_head_dim * cfg.dim), T(0));
  p.k_norm_weight.assign(n(cfg.index_head_dim), T(0));
  p.k_norm_bias.assign(n(cfg.index_head_dim), T(0));
  p.weights_proj.assign(n(cfg.index_n_heads * cfg.dim), T(0));
  return p;
}

template <class T>
std::vector<std::pair<std::string, std::vector<T>*>> DsaIndexerParams<T>::named() {
  return {{"indexer.wq_b.weight", &wq_b},
          {"indexer.wk.weight", &wk},
          {"indexer.k_norm.weight", &k_norm_weight},
          {"indexer.k_norm.bias", &k_norm_bias},
          {"indexer.weights_proj.weight", &weights_proj}};
}

namespace {

// DeepSeek's LayerNorm (model.py): eps 1e-6.
constexpr double kIndexerNormEps = 1e-6;

template <class T>
std::vector<T> buffer(std::int64_t n) {
  return std::vector<T>(static_cast<std::size_t>(n), T(0));
}

}  // namespace

template <class T>
DsaIndexerProjections<T> dsa_indexer_project(const MlaConfig& cfg, const DsaIndexerParams<T>& iw,
                                             const T* x, const T* qr, std::int64_t N) {
  const std::int64_t D = cfg.dim, rq = cfg.q_lora_rank, HI = cfg.index_n_heads,
                     dI = cfg.index_head_dim;
  DsaIndexerProjections<T> p{
      Tensor<T>::zeros({N * HI * dI}, "dsa index q"), Tensor<T>::zeros({N * dI}, "dsa index k_pre"),
      Tensor<T>::zeros({N * dI}, "dsa index k"),      Tensor<T>::zeros({N}, "dsa index k_mean"),
      Tensor<T>::zeros({N}, "dsa index k_rstd"),      Tensor<T>::zeros({N * HI}, "dsa index w")};
  ops::linear_rows(p.q.data(), qr, iw.wq_b.data(), N, rq, HI * dI);
  ops::linear_rows(p.k_pre.data(), x, iw.wk.data(), N, D, dI);
  ops::layernorm(p.k.data(), p.k_mean.data(), p.k_rstd.data(), p.k_pre.data(),
                 iw.k_norm_weight.data(), iw.k_norm_bias.data(), N, dI, kIndexerNormEps);
  // weights_proj(x) * n_heads^-0.5, times softmax_scale = head_dim^-0.5.
  p.w_scale = 1.0 / std::sqrt(double(HI)) / std::sqrt(double(dI));
  ops::linear_rows(p.w.data(), x, iw.weights_proj.data(), N, D, HI);
  ops::scale(ops::mat(p.w, N, HI), p.w_scale);
  return p;
}

template <class T>
DsaIndexerParams<T> dsa_indexer_project_backward(const MlaConfig& cfg,
                                                 const DsaIndexerParams<T>& iw, const T* x,
                                                 const T* qr, double w_scale, const T* k_pre,
                                                 const T* k_mean, const T* k_rstd, T* dw,
                                                 const T* dq, const T* dk, std::int64_t N) {
  const std::int64_t D = cfg.dim, rq = cfg.q_lora_rank, HI = cfg.index_n_heads,
                     dI = cfg.index_head_dim;
  DsaIndexerParams<T> g = DsaIndexerParams<T>::zeros(cfg);
  ops::scale(ops::Mat<T>{dw, N, HI, HI}, w_scale);
  ops::linear_rows_backward<T>(nullptr, false, g.weights_proj.data(), dw, x, iw.weights_proj.data(),
                               N, D, HI);
  ops::linear_rows_backward<T>(nullptr, false, g.wq_b.data(), dq, qr, iw.wq_b.data(), N, rq,
                               HI * dI);
  Tensor<T> dkpre = Tensor<T>::zeros({N * dI}, "dsa index dk_pre");
  ops::layernorm_backward(dkpre.data(), g.k_norm_weight.data(), g.k_norm_bias.data(), dk, k_pre,
                          iw.k_norm_weight.data(), k_mean, k_rstd, N, dI);
  ops::linear_rows_backward<T>(nullptr, false, g.wk.data(), dkpre.data(), x, iw.wk.data(), N, D,
                               dI);
  return g;
}

template <class T>
DsaBlockResult<T> dsa_block(const MlaConfig& cfg, const MlaParams<T>& w,
                            const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                            std::int64_t B, std::int64_t S, DsaStage stage, DsaAttend attend) {
  cfg.validate();
  LAGA_CHECK(cfg.dsa(),
             "dsa_block: the config has no DeepSeek Sparse Attention keys (index_n_heads, "
             "index_head_dim, index_topk)");
  LAGA_CHECK(B > 0 && S > 0, "dsa_block: batch and sequence must be positive, got B=", B, " S=", S);
  const std::int64_t D = cfg.dim, H = cfg.n_heads, C = cfg.kv_lora_rank;
  const std::int64_t dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim;
  const std::int64_t dqk = dn + dr, HI = cfg.index_n_heads, dI = cfg.index_head_dim;
  const std::int64_t K = cfg.index_topk, N = B * S;
  const RopeTable table(cfg.rope(), S);

  DsaBlockResult<T> r;
  // ---- the MLA's projections (DeepSeek's MLA.forward)
  const DsaRowPositions at{B, S, 0, nullptr};
  const DsaOwnRows<T> own = dsa_own_rows(cfg, w, x, at, table, true, dout != nullptr);
  const Tensor<T>&qr = own.qr, &q = own.q, &c = own.c, &k_pe = own.k_pe;
  std::vector<T> kvb = buffer<T>(N * H * (dn + dv));
  ops::linear_rows(kvb.data(), c.data(), w.wkv_b.data(), N, C, H * (dn + dv));
  std::vector<T> k = buffer<T>(N * H * dqk), v = buffer<T>(N * H * dv);
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t h = 0; h < H; ++h) {
      const T* src = kvb.data() + (t * H + h) * (dn + dv);
      std::copy_n(src, dn, k.data() + (t * H + h) * dqk);
      std::copy_n(k_pe.data() + t * dr, dr, k.data() + (t * H + h) * dqk + dn);
      std::copy_n(src + dn, dv, v.data() + (t * H + h) * dv);
    }

  // ---- the lightning indexer (DeepSeek's Indexer.forward; fp8 scoring when cfg.index_fp8)
  DsaIndexerProjections<T> ip = dsa_indexer_project(cfg, iw, x, qr.data(), N);
  Tensor<T>& qI = ip.q;  // the names the rest of this function reads
  Tensor<T>& kpre = ip.k_pre;
  Tensor<T>& kI = ip.k;
  Tensor<T>& k_mean = ip.k_mean;
  Tensor<T>& k_rstd = ip.k_rstd;
  Tensor<T>& wI = ip.w;
  const double w_scale = ip.w_scale;
  dsa_rope_index_rows(qI.data(), at, HI, HI * dI, dI, table, false);
  dsa_rope_index_rows(kI.data(), at, 1, dI, dI, table, false);
  IndexerShape is;
  is.attn = AttnShape{B, S, S, HI, 1, dI, 1, 1.0, true};
  is.topk = K;
  is.scores = index_scores_of(cfg);
  is.validate();
  r.idx.assign(static_cast<std::size_t>(N * K), -1);
  ops::index_topk(is, r.idx.data(), qI.data(), kI.data(), wI.data());

  // ---- the main attention: the selected keys (sparse) or every causal key
  // (the dense warm-up), one gather kernel either way.
  std::vector<std::int32_t> all;
  const std::int32_t* att_idx = r.idx.data();
  std::int64_t KA = K;
  if (stage == DsaStage::dense_warmup) {
    all.assign(static_cast<std::size_t>(N * S), -1);
    ops::index_all_causal(is, all.data());
    att_idx = all.data(), KA = S;
  }
  // Per head (DeepSeek's prefill: K = [k_nope | k_pe], V per head) or in
  // latent space (absorbed: q_nope W_UK against [c | k_pe], values c, one
  // key/value head; o = o_lat W_UV^T): the same attention in exact
  // arithmetic.
  const bool latent = attend == DsaAttend::latent;
  const std::int64_t qw = latent ? C + dr : dqk, vw = latent ? C : dv, HK = latent ? 1 : H;
  SparseAttnShape ss;
  ss.attn = AttnShape{B, S, S, H, HK, qw, vw, cfg.softmax_scale(), true};
  ss.K = KA;
  std::vector<T> qa_abs, lat, o = buffer<T>(N * H * dv), lse = buffer<T>(B * H * S);
  std::vector<T> o_lat;
  const T *q_att = q.data(), *k_att = k.data(), *v_att = v.data();
  if (latent) {
    qa_abs = buffer<T>(N * H * (C + dr)), lat = buffer<T>(N * (C + dr)),
    o_lat = buffer<T>(N * H * C);
    for (std::int64_t h = 0; h < H; ++h)  // q_nope (N, dn) W_UK[h] (dn, C) into qa_abs[:, h, :C]
      ops::gemm_strided<T>(false, false, N, C, dn, T(1), q.data() + h * dqk, H * dqk,
                           w.wkv_b.data() + h * (dn + dv) * C, C, T(0),
                           qa_abs.data() + h * (C + dr), H * (C + dr));
    for (std::int64_t t = 0; t < N; ++t) {
      for (std::int64_t h = 0; h < H; ++h)
        std::copy_n(q.data() + (t * H + h) * dqk + dn, dr,
                    qa_abs.data() + (t * H + h) * (C + dr) + C);
      std::copy_n(c.data() + t * C, C, lat.data() + t * (C + dr));
      std::copy_n(k_pe.data() + t * dr, dr, lat.data() + t * (C + dr) + C);
    }
    q_att = qa_abs.data(), k_att = lat.data(), v_att = c.data();
  }
  ops::sparse_attention_forward<T>(ss, latent ? o_lat.data() : o.data(), lse.data(), q_att, k_att,
                                   v_att, att_idx);
  if (latent)
    for (std::int64_t h = 0; h < H; ++h)  // o_lat (N, C) W_UV[h]^T (C, dv)
      ops::gemm_strided<T>(false, true, N, dv, C, T(1), o_lat.data() + h * C, H * C,
                           w.wkv_b.data() + (h * (dn + dv) + dn) * C, C, T(0), o.data() + h * dv,
                           H * dv);
  r.out = buffer<T>(N * D);
  ops::linear_rows(r.out.data(), o.data(), w.wo.data(), N, H * dv, D);

  // ---- the indexer's KL against the main attention's head-summed distribution
  std::vector<T> p = buffer<T>(N * KA);
  ops::sparse_attention_head_summed_probs<T>(ss, p.data(), q_att, k_att, lse.data(), att_idx);
  std::vector<double> loss(static_cast<std::size_t>(N));
  std::vector<T> dqI = buffer<T>(N * HI * dI), dkI = buffer<T>(N * dI), dwI = buffer<T>(N * HI);
  ops::indexer_kl(is, KA, att_idx, p.data(), qI.data(), kI.data(), wI.data(), loss.data(),
                  dqI.data(), dkI.data(), dwI.data());
  for (double l : loss) r.kl_loss += l;
  if (!dout) return r;

  // ---- the indexer's weights from the KL (its input detached: no dx, no dqr)
  dsa_rope_index_rows(dqI.data(), at, HI, HI * dI, dI, table, true);
  dsa_rope_index_rows(dkI.data(), at, 1, dI, dI, table, true);
  r.indexer_grads =
      dsa_indexer_project_backward(cfg, iw, x, qr.data(), w_scale, kpre.data(), k_mean.data(),
                                   k_rstd.data(), dwI.data(), dqI.data(), dkI.data(), N);

  // ---- the LM backward through the attended keys
  r.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  r.dx = buffer<T>(N * D);
  std::vector<T> dO = buffer<T>(N * H * dv);
  ops::linear_rows_backward<T>(dO.data(), false, r.grads.wo.data(), dout, o.data(), w.wo.data(), N,
                               H * dv, D);
  std::vector<T> dq = buffer<T>(N * H * dqk), dkv = buffer<T>(N * (C + dr)), dc = buffer<T>(N * C);
  if (!latent) {
    std::vector<T> dk = buffer<T>(N * H * dqk), dvv = buffer<T>(N * H * dv);
    ops::sparse_attention_backward<T>(ss, dq.data(), dk.data(), dvv.data(), dO.data(), q.data(),
                                      k.data(), v.data(), o.data(), lse.data(), att_idx);
    std::vector<T> dkvb = buffer<T>(N * H * (dn + dv));
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t h = 0; h < H; ++h) {
        T* dst = dkvb.data() + (t * H + h) * (dn + dv);
        std::copy_n(dk.data() + (t * H + h) * dqk, dn, dst);
        std::copy_n(dvv.data() + (t * H + h) * dv, dv, dst + dn);
        for (std::int64_t e = 0; e < dr; ++e)  // k_pe is every head's: its gradient sums them
          dkv[std::size_t(t * (C + dr) + C + e)] += dk[std::size_t((t * H + h) * dqk + dn + e)];
      }
    ops::linear_rows_backward<T>(dc.data(), false, r.grads.wkv_b.data(), dkvb.data(), c.data(),
                                 w.wkv_b.data(), N, C, H * (dn + dv));
  } else {
    std::vector<T> do_lat = buffer<T>(N * H * C), dq_abs = buffer<T>(N * H * (C + dr));
    std::vector<T> dlat = buffer<T>(N * (C + dr)), dval = buffer<T>(N * C);
    for (std::int64_t h = 0; h < H; ++h) {
      T* dw_uv = r.grads.wkv_b.data() + (h * (dn + dv) + dn) * C;
      // do_lat[h] = dO[h] W_UV[h]; dW_UV[h] += dO[h]^T o_lat[h]
      ops::gemm_strided<T>(false, false, N, C, dv, T(1), dO.data() + h * dv, H * dv,
                           w.wkv_b.data() + (h * (dn + dv) + dn) * C, C, T(0),
                           do_lat.data() + h * C, H * C);
      ops::gemm_strided<T>(true, false, dv, C, N, T(1), dO.data() + h * dv, H * dv,
                           o_lat.data() + h * C, H * C, T(1), dw_uv, C);
    }
    ops::sparse_attention_backward<T>(ss, dq_abs.data(), dlat.data(), dval.data(), do_lat.data(),
                                      qa_abs.data(), lat.data(), c.data(), o_lat.data(), lse.data(),
                                      att_idx);
    for (std::int64_t h = 0; h < H; ++h) {
      T* dw_uk = r.grads.wkv_b.data() + h * (dn + dv) * C;
      // dq_nope[h] = dq_abs[h, :C] W_UK[h]^T; dW_UK[h] += q_nope[h]^T dq_abs[h, :C]
      ops::gemm_strided<T>(false, true, N, dn, C, T(1), dq_abs.data() + h * (C + dr), H * (C + dr),
                           w.wkv_b.data() + h * (dn + dv) * C, C, T(0), dq.data() + h * dqk,
                           H * dqk);
      ops::gemm_strided<T>(true, false, dn, C, N, T(1), q.data() + h * dqk, H * dqk,
                           dq_abs.data() + h * (C + dr), H * (C + dr), T(1), dw_uk, C);
    }
    for (std::int64_t t = 0; t < N; ++t) {
      for (std::int64_t h = 0; h < H; ++h)
        std::copy_n(dq_abs.data() + (t * H + h) * (C + dr) + C, dr,
                    dq.data() + (t * H + h) * dqk + dn);
      for (std::int64_t e = 0; e < C; ++e)  // c is the keys' latent and the values
        dc[std::size_t(t * C + e)] =
            dlat[std::size_t(t * (C + dr) + e)] + dval[std::size_t(t * C + e)];
      std::copy_n(dlat.data() + t * (C + dr) + C, dr, dkv.data() + t * (C + dr) + C);
    }
  }
  Tensor<T> dqr;
  dsa_own_rows_backward(cfg, w, x, own, at, table, dkv.data(), dc.data(), dq.data(), dqr, r.grads,
                        r.dx.data());
  return r;
}

#define LAGA_INSTANTIATE(T)                                                               \
  template struct DsaIndexerParams<T>;                                                    \
  template DsaBlockResult<T> dsa_block<T>(const MlaConfig&, const MlaParams<T>&,          \
                                          const DsaIndexerParams<T>&, const T*, const T*, \
                                          std::int64_t, std::int64_t, DsaStage, DsaAttend);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE
template DsaIndexerParams<float> dsa_indexer_project_backward(
    const MlaConfig&, const DsaIndexerParams<float>&, const float*, const float*, double,
    const float*, const float*, const float*, float*, const float*, const float*, std::int64_t);
template DsaIndexerParams<double> dsa_indexer_project_backward(
    const MlaConfig&, const DsaIndexerParams<double>&, const double*, const double*, double,
    const double*, const double*, const double*, double*, const double*, const double*,
    std::int64_t);
template DsaIndexerProjections<float> dsa_indexer_project(const MlaConfig&,
                                                          const DsaIndexerParams<float>&,
                                                          const float*, const float*, std::int64_t);
template DsaIndexerProjections<double> dsa_indexer_project(const MlaConfig&,
                                                           const DsaIndexerParams<double>&,
                                                           const double*, const double*,
                                                           std::int64_t);

}  // namespace laga
