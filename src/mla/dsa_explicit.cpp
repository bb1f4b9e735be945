#include "mla/dsa_explicit.hpp"

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

// The selection crosses the wire as fp32 values (the communicator moves
// f32, f64 and bf16): 4 bytes an index, as the closed form's int32, and
// exact while every position is below 2^24.
constexpr std::int64_t kExactIndexLimit = std::int64_t(1) << 24;

// Rows [0, n) of each batch row of a (B, from, w) tensor into a (B, to, w)
// one (the rest of dst left as it is).
template <class T>
void copy_rows(const T* src, std::int64_t from, T* dst, std::int64_t to, std::int64_t B,
               std::int64_t n, std::int64_t w) {
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t l = 0; l < n; ++l)
      std::copy_n(src + (b * from + l) * w, w, dst + (b * to + l) * w);
}

}  // namespace

template <class T>
DsaBlockResult<T> dsa_explicit(const MlaConfig& cfg, const MlaParams<T>& w,
                               const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                               const SpLayout& lay, DsaStage stage, Communicator& comm,
                               const std::int64_t* doc_start) {
  cfg.validate();
  lay.validate();
  LAGA_CHECK(cfg.dsa(),
             "dsa_explicit: the config has no DeepSeek Sparse Attention keys (index_n_heads, "
             "index_head_dim, index_topk)");
  LAGA_CHECK(lay.seq_layout == SeqLayout::contiguous,
             "dsa_explicit: the zigzag layout is not implemented; use --seq-layout contiguous");
  LAGA_CHECK(lay.ranks == comm.size(), "dsa_explicit: the layout has ", lay.ranks,
             " ranks, the communicator ", comm.size());
  LAGA_CHECK(lay.heads == cfg.n_heads, "dsa_explicit: the layout splits ", lay.heads,
             " heads, the config has n_heads ", cfg.n_heads);
  LAGA_CHECK(lay.seq < kExactIndexLimit, "dsa_explicit: sequence ", lay.seq,
             " is too long: the selection moves as fp32 values, exact below ", kExactIndexLimit,
             " tokens");
  const int r = comm.rank();
  const std::int64_t B = lay.batch, S = lay.seq, s0 = lay.shard_begin(r);
  const std::int64_t L = lay.seq_count[std::size_t(r)], Sk = s0 + L, N = B * L, NK = B * Sk;
  const std::int64_t NS = B * S, Hr = lay.head_count[std::size_t(r)];
  const std::int64_t D = cfg.dim, H = cfg.n_heads, rq = cfg.q_lora_rank, C = cfg.kv_lora_rank;
  const std::int64_t dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim;
  const std::int64_t dqk = dn + dr, HI = cfg.index_n_heads, dI = cfg.index_head_dim;
  const std::int64_t K = cfg.index_topk, W = C + dr;
  const bool sparse = stage == DsaStage::sparse;
  const RopeTable table(cfg.rope(), S);

  // Packed documents (docs/forms.md, "Packed sequences"): the head layout
  // attends every row, so every token's document start is checked; the
  // rank's own rows rotate from their positions in their documents.
  std::vector<std::int64_t> docs_k, pos;
  if (doc_start) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < S; ++t) {
        const std::int64_t d = doc_start[b * S + t];
        LAGA_CHECK(d >= 0 && d <= t && (t == 0 ? d == 0 : d == t || d == doc_start[b * S + t - 1]),
                   "dsa_explicit: doc_start[", b, ", ", t, "] = ", d,
                   " is not the first token of a document holding token ", t);
        if (t < Sk) docs_k.push_back(d);
        if (t >= s0 && t < Sk) pos.push_back(t - d);
      }
  }
  auto rope_mla = [&](T* p, std::int64_t heads, std::int64_t ld_token, std::int64_t ld_head,
                      bool inverse) {
    if (doc_start)
      ops::rope_rows_at(p, B, L, heads, ld_token, ld_head, pos.data(), table, inverse);
    else
      ops::rope_rows(p, B, L, heads, ld_token, ld_head, s0, table, inverse);
  };
  auto rope_index = [&](T* p, std::int64_t heads, std::int64_t ld_token, bool inverse) {
    for (std::int64_t b = 0; b < B; ++b)
      ops::rope_halves(p + b * L * ld_token, L, heads, ld_token, dI, s0,
                       doc_start ? pos.data() + b * L : nullptr, table, inverse);
  };

  DsaBlockResult<T> res;
  comm.set_phase(Phase::forward);
  // ---- the rank's own rows: the MLA's projections, K and V of every head
  std::vector<T> qa = buffer<T>(N * rq), qr = buffer<T>(N * rq), rstd_q = buffer<T>(N);
  ops::linear_rows(qa.data(), x, w.wq_a.data(), N, D, rq);
  ops::rmsnorm_rows(qr.data(), rstd_q.data(), qa.data(), rq, w.q_norm.data(), N, rq, cfg.norm_eps);
  std::vector<T> q = buffer<T>(N * H * dqk);
  ops::linear_rows(q.data(), qr.data(), w.wq_b.data(), N, rq, H * dqk);
  rope_mla(q.data() + dn, H, H * dqk, dqk, false);
  std::vector<T> kv = buffer<T>(N * W), c = buffer<T>(N * C), rstd_kv = buffer<T>(N);
  ops::linear_rows(kv.data(), x, w.wkv_a.data(), N, D, W);
  ops::rmsnorm_rows(c.data(), rstd_kv.data(), kv.data(), W, w.kv_norm.data(), N, C, cfg.norm_eps);
  std::vector<T> k_pe = buffer<T>(N * dr);
  for (std::int64_t t = 0; t < N; ++t) std::copy_n(kv.data() + t * W + C, dr, k_pe.data() + t * dr);
  rope_mla(k_pe.data(), 1, dr, dr, false);
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
  kvb = {};
  // ... and the indexer's
  DsaIndexerProjections<T> ip = dsa_indexer_project(cfg, iw, x, qr.data(), N);
  rope_index(ip.q.data(), HI, HI * dI, false);
  rope_index(ip.k.data(), 1, dI, false);

  // ---- the indexer and top-k of the rank's rows against every earlier key
  std::vector<T> kI_all = buffer<T>(NS * dI), kIS = buffer<T>(NK * dI);
  gather_seq(comm, lay, ip.k.data(), kI_all.data(), dI, "index_k_ag");
  copy_rows(kI_all.data(), S, kIS.data(), Sk, B, Sk, dI);
  kI_all = {};
  IndexerShape is;  // the rank's rows: row i is token s0 + i
  is.attn = AttnShape{B, L, Sk, HI, 1, dI, 1, 1.0, true};
  is.attn.doc_start = doc_start ? docs_k.data() : nullptr;
  is.topk = K;
  is.validate();
  res.idx.assign(static_cast<std::size_t>(N * K), -1);
  ops::index_topk(is, res.idx.data(), ip.q.data(), kIS.data(), ip.w.data());

  // ---- the key set of every row, for the head layout: the selection of
  // every rank (sparse), or every causal key (the warm-up: nothing moves)
  IndexerShape is_all;  // every row, for the warm-up's key set
  is_all.attn = AttnShape{B, S, S, HI, 1, dI, 1, 1.0, true};
  is_all.attn.doc_start = doc_start;
  is_all.topk = K;
  std::vector<std::int32_t> att;
  const std::int64_t KA = sparse ? K : S;
  att.assign(static_cast<std::size_t>(NS * KA), -1);
  if (sparse) {
    std::vector<float> own(res.idx.begin(), res.idx.end()), all = buffer<float>(NS * K);
    gather_seq(comm, lay, own.data(), all.data(), K, "topk_ag");
    std::transform(all.begin(), all.end(), att.begin(),
                   [](float f) { return static_cast<std::int32_t>(f); });
  } else {
    ops::index_all_causal(is_all, att.data());
  }

  // ---- Q, K, V to the heads, the attention of every row for r's heads
  std::vector<T> q_h = buffer<T>(NS * Hr * dqk), k_h = buffer<T>(NS * Hr * dqk);
  std::vector<T> v_h = buffer<T>(NS * Hr * dv);
  seq_to_head(comm, lay, q.data(), q_h.data(), dqk, "q_a2a");
  seq_to_head(comm, lay, k.data(), k_h.data(), dqk, "k_a2a");
  seq_to_head(comm, lay, v.data(), v_h.data(), dv, "v_a2a");
  q = {}, k = {}, v = {};  // backward reads the heads' copies
  SparseAttnShape ss;
  ss.attn = AttnShape{B, S, S, Hr, Hr, dqk, dv, cfg.softmax_scale(), true};
  ss.K = KA;
  std::vector<T> o_h = buffer<T>(NS * Hr * dv), lse = buffer<T>(B * Hr * S);
  if (Hr > 0)
    ops::sparse_attention_forward<T>(ss, o_h.data(), lse.data(), q_h.data(), k_h.data(), v_h.data(),
                                     att.data());
  std::vector<T> o = buffer<T>(N * H * dv);
  head_to_seq(comm, lay, o_h.data(), o.data(), dv, "out_a2a");
  res.out = buffer<T>(N * D);
  ops::linear_rows(res.out.data(), o.data(), w.wo.data(), N, H * dv, D);

  // ---- the KL target: r's heads' share of the head-summed distribution
  // ((H_r / H) times the kernel's mean over r's heads), summed at the rows'
  // owners
  std::vector<T> p_part = buffer<T>(NS * KA), p_rows = buffer<T>(N * KA);
  if (Hr > 0) {
    ops::head_summed_probs(ss, p_part.data(), q_h.data(), k_h.data(), lse.data(), att.data());
    for (T& e : p_part) e = T(double(e) * double(Hr) / double(H));
  }
  reduce_scatter_seq(comm, lay, p_part.data(), p_rows.data(), KA, "index_target_rs");
  p_part = {};
  // The rank's rows' key set for the KL: its selection (sparse), or every
  // causal key before Sk (the warm-up: the head layout's rows of width S
  // list the same keys in the same order, the slots past Sk empty).
  std::vector<std::int32_t> own_all;
  const std::int32_t* own_idx = res.idx.data();
  std::int64_t KO = K;
  std::vector<T> p_own;
  if (!sparse) {
    own_all.assign(static_cast<std::size_t>(N * Sk), -1);
    ops::index_all_causal(is, own_all.data());
    own_idx = own_all.data(), KO = Sk;
    p_own = buffer<T>(N * Sk);
    for (std::int64_t i = 0; i < N; ++i)
      std::copy_n(p_rows.data() + i * S, Sk, p_own.data() + i * Sk);
  } else {
    p_own = std::move(p_rows);
  }
  std::vector<double> loss(static_cast<std::size_t>(N));
  std::vector<T> dqI = buffer<T>(N * HI * dI), dkIS = buffer<T>(NK * dI), dwI = buffer<T>(N * HI);
  ops::indexer_kl(is, KO, own_idx, p_own.data(), ip.q.data(), kIS.data(), ip.w.data(), loss.data(),
                  dqI.data(), dkIS.data(), dwI.data());
  for (double l : loss) res.kl_loss += l;
  kIS = {}, p_own = {}, p_rows = {};  // the KL's gradients are taken: backward reads them
  if (!dout) return res;

  comm.set_phase(Phase::backward);
  // ---- the indexer's weights: k_I's gradient to the keys' owners first
  std::vector<T> dkI_all = buffer<T>(NS * dI), dkI = buffer<T>(N * dI);
  copy_rows(dkIS.data(), Sk, dkI_all.data(), S, B, Sk, dI);
  reduce_scatter_seq(comm, lay, dkI_all.data(), dkI.data(), dI, "index_k_ag");
  rope_index(dqI.data(), HI, HI * dI, true);
  rope_index(dkI.data(), 1, dI, true);
  res.indexer_grads = dsa_indexer_project_backward(
      cfg, iw, x, qr.data(), ip.w_scale, ip.k_pre.data(), ip.k_mean.data(), ip.k_rstd.data(), dwI,
      dqI.data(), dkI.data(), N);

  // ---- the LM backward: the output's gradient to the heads, the
  // attention's back to the rows' owners
  res.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  res.dx = buffer<T>(N * D);
  std::vector<T> dO = buffer<T>(N * H * dv), dO_h = buffer<T>(NS * Hr * dv);
  ops::linear_rows_backward<T>(dO.data(), false, res.grads.wo.data(), dout, o.data(), w.wo.data(),
                               N, H * dv, D);
  seq_to_head(comm, lay, dO.data(), dO_h.data(), dv, "out_a2a");
  std::vector<T> dq_h = buffer<T>(NS * Hr * dqk), dk_h = buffer<T>(NS * Hr * dqk);
  std::vector<T> dv_h = buffer<T>(NS * Hr * dv);
  if (Hr > 0)
    ops::sparse_attention_backward<T>(ss, dq_h.data(), dk_h.data(), dv_h.data(), dO_h.data(),
                                      q_h.data(), k_h.data(), v_h.data(), o_h.data(), lse.data(),
                                      att.data());
  std::vector<T> dq = buffer<T>(N * H * dqk), dk = buffer<T>(N * H * dqk);
  std::vector<T> dvv = buffer<T>(N * H * dv);
  head_to_seq(comm, lay, dq_h.data(), dq.data(), dqk, "q_a2a");
  head_to_seq(comm, lay, dk_h.data(), dk.data(), dqk, "k_a2a");
  head_to_seq(comm, lay, dv_h.data(), dvv.data(), dv, "v_a2a");

  // ---- the rank's own rows: [dk_nope | dv] per head into wkv_b and c, the
  // heads' k_pe gradients summed (k_pe is every head's), as dsa_block
  std::vector<T> dkvb = buffer<T>(N * H * (dn + dv)), dkv = buffer<T>(N * W);
  std::vector<T> dc = buffer<T>(N * C);
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t h = 0; h < H; ++h) {
      T* dst = dkvb.data() + (t * H + h) * (dn + dv);
      std::copy_n(dk.data() + (t * H + h) * dqk, dn, dst);
      std::copy_n(dvv.data() + (t * H + h) * dv, dv, dst + dn);
      for (std::int64_t e = 0; e < dr; ++e)
        dkv[std::size_t(t * W + C + e)] += dk[std::size_t((t * H + h) * dqk + dn + e)];
    }
  ops::linear_rows_backward<T>(dc.data(), false, res.grads.wkv_b.data(), dkvb.data(), c.data(),
                               w.wkv_b.data(), N, C, H * (dn + dv));
  rope_mla(dkv.data() + C, 1, W, dr, true);
  ops::rmsnorm_rows_backward(dkv.data(), W, res.grads.kv_norm.data(), dc.data(), C, kv.data(), W,
                             w.kv_norm.data(), rstd_kv.data(), N, C);
  ops::linear_rows_backward<T>(res.dx.data(), false, res.grads.wkv_a.data(), dkv.data(), x,
                               w.wkv_a.data(), N, D, W);
  rope_mla(dq.data() + dn, H, H * dqk, dqk, true);
  std::vector<T> dqr = buffer<T>(N * rq), dqa = buffer<T>(N * rq);
  ops::linear_rows_backward<T>(dqr.data(), false, res.grads.wq_b.data(), dq.data(), qr.data(),
                               w.wq_b.data(), N, rq, H * dqk);
  ops::rmsnorm_rows_backward(dqa.data(), rq, res.grads.q_norm.data(), dqr.data(), rq, qa.data(), rq,
                             w.q_norm.data(), rstd_q.data(), N, rq);
  ops::linear_rows_backward<T>(res.dx.data(), true, res.grads.wq_a.data(), dqa.data(), x,
                               w.wq_a.data(), N, D, rq);
  return res;
}

#define LAGA_INSTANTIATE(T)                                                                  \
  template DsaBlockResult<T> dsa_explicit<T>(                                                \
      const MlaConfig&, const MlaParams<T>&, const DsaIndexerParams<T>&, const T*, const T*, \
      const SpLayout&, DsaStage, Communicator&, const std::int64_t*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
