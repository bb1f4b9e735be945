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
  // Pool tensors throughout (activations), so the block has a count-only
  // run (tests/mla/test_dsa_memory.cpp holds its peak to a real run's).
  auto zeros = [](std::int64_t n, const char* name) { return Tensor<T>::zeros({n}, name); };
  auto m = [](Tensor<T>& t, std::int64_t rows, std::int64_t cols) {
    return ops::mat(t, rows, cols);
  };
  // ---- the MLA's projections (DeepSeek's MLA.forward)
  const DsaRowPositions at{B, S, 0, nullptr};
  DsaOwnRows<T> own = dsa_own_rows(cfg, w, x, at, table, true, dout != nullptr);
  Tensor<T>&qr = own.qr, &q = own.q, &c = own.c, &k_pe = own.k_pe;
  DsaHeadKv<T> kv = dsa_head_kv(cfg, w, c, k_pe, N);
  Tensor<T>&k = kv.k, &v = kv.v;

  // ---- the lightning indexer (DeepSeek's Indexer.forward; fp8 scoring when cfg.index_fp8)
  DsaIndexerProjections<T> ip = dsa_indexer_rows(cfg, iw, x, qr.data(), at, table, N);
  Tensor<T>& qI = ip.q;  // the names the rest of this function reads
  Tensor<T>& kI = ip.k;
  Tensor<T>& wI = ip.w;
  IndexerShape is;
  is.attn = AttnShape{B, S, S, HI, 1, dI, 1, 1.0, true};
  is.topk = K;
  is.scores = index_scores_of(cfg);
  is.validate();
  TensorI32 idx({N * K}, "dsa top-k indices");
  idx.fill(-1);
  ops::index_topk(is, idx.data(), qI.data(), kI.data(), wI.data());

  // ---- the main attention: the selected keys (sparse) or every causal key
  // (the dense warm-up), one gather kernel either way.
  TensorI32 all;
  const std::int32_t* att_idx = idx.data();
  std::int64_t KA = K;
  if (stage == DsaStage::dense_warmup) {
    all = TensorI32({N * S}, "dsa every causal key");
    all.fill(-1);
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
  Tensor<T> qa_abs, lat, o = zeros(N * H * dv, "dsa o"), lse = zeros(B * H * S, "dsa lse");
  Tensor<T> o_lat;
  const T *q_att = q.data(), *k_att = k.data(), *v_att = v.data();
  if (latent) {
    qa_abs = zeros(N * H * (C + dr), "dsa absorbed q"), lat = zeros(N * (C + dr), "dsa latent");
    o_lat = zeros(N * H * C, "dsa o_lat");
    dsa_absorb_q(cfg, w, q, qa_abs, N);
    ops::copy(m(lat, N, C + dr).col_range(0, C), m(c, N, C));
    ops::copy(m(lat, N, C + dr).col_range(C, dr), m(k_pe, N, dr));
    q_att = qa_abs.data(), k_att = lat.data(), v_att = c.data();
  }
  ops::sparse_attention_forward<T>(ss, latent ? o_lat.data() : o.data(), lse.data(), q_att, k_att,
                                   v_att, att_idx);
  if (latent) dsa_latent_out(cfg, w, o_lat, o, N);
  Tensor<T> out = zeros(N * D, "dsa output");
  ops::linear_rows(out.data(), o.data(), w.wo.data(), N, H * dv, D);

  // ---- the indexer's KL against the main attention's head-summed distribution
  Tensor<T> p = zeros(N * KA, "dsa KL target");
  ops::sparse_attention_head_summed_probs<T>(ss, p.data(), q_att, k_att, lse.data(), att_idx);
  std::vector<double> loss(static_cast<std::size_t>(N));
  Tensor<T> dqI = zeros(N * HI * dI, "dsa index dq"), dkI = zeros(N * dI, "dsa index dk");
  Tensor<T> dwI = zeros(N * HI, "dsa index dw");
  ops::indexer_kl(is, KA, att_idx, p.data(), qI.data(), kI.data(), wI.data(), loss.data(),
                  dqI.data(), dkI.data(), dwI.data());
  for (double l : loss) r.kl_loss += l;
  p.reset(), qI.reset(), kI.reset(), wI.reset();
  r.out = ops::to_vector(out);
  r.idx = ops::to_vector(idx);
  if (!dout) return r;

  // ---- the indexer's weights from the KL (its input detached: no dx, no dqr)
  r.indexer_grads =
      dsa_indexer_rows_backward(cfg, iw, x, qr.data(), ip, at, table, dqI, dkI, dwI, N);

  // ---- the LM backward through the attended keys
  r.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  Tensor<T> dx = zeros(N * D, "dsa dx");
  Tensor<T> dO = zeros(N * H * dv, "dsa dO");
  ops::linear_rows_backward<T>(dO.data(), false, r.grads.wo.data(), dout, o.data(), w.wo.data(), N,
                               H * dv, D);
  Tensor<T> dq = zeros(N * H * dqk, "dsa dq"), dkv = zeros(N * (C + dr), "dsa dkv");
  Tensor<T> dc = zeros(N * C, "dsa dc");
  if (!latent) {
    Tensor<T> dk = zeros(N * H * dqk, "dsa dk"), dvv = zeros(N * H * dv, "dsa dv");
    ops::sparse_attention_backward<T>(ss, dq.data(), dk.data(), dvv.data(), dO.data(), q.data(),
                                      k.data(), v.data(), o.data(), lse.data(), att_idx);
    dsa_head_kv_backward(cfg, w, c, dk, dvv, dkv, dc, r.grads, N);
  } else {
    Tensor<T> do_lat = zeros(N * H * C, "dsa do_lat"),
              dq_abs = zeros(N * H * (C + dr), "dsa dq_abs");
    Tensor<T> dlat = zeros(N * (C + dr), "dsa dlatent"), dval = zeros(N * C, "dsa dvalues");
    dsa_latent_out_backward(cfg, w, dO, o_lat, do_lat, r.grads, N);
    ops::sparse_attention_backward<T>(ss, dq_abs.data(), dlat.data(), dval.data(), do_lat.data(),
                                      qa_abs.data(), lat.data(), c.data(), o_lat.data(), lse.data(),
                                      att_idx);
    dsa_absorb_q_backward(cfg, w, q, dq_abs, dq, r.grads, N);
    // c is the keys' latent and the values
    ops::copy(m(dc, N, C), m(dlat, N, C + dr).col_range(0, C));
    ops::add(m(dc, N, C), m(dval, N, C));
    ops::copy(m(dkv, N, C + dr).col_range(C, dr), m(dlat, N, C + dr).col_range(C, dr));
  }
  Tensor<T> dqr;
  dsa_own_rows_backward(cfg, w, x, own, at, table, dkv.data(), dc.data(), dq.data(), dqr, r.grads,
                        dx.data());
  r.dx = ops::to_vector(dx);
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
