#include "mla/dsa_explicit.hpp"

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
  const std::int64_t D = cfg.dim, H = cfg.n_heads, C = cfg.kv_lora_rank;
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
  const DsaRowPositions at{B, L, s0, doc_start ? pos.data() : nullptr};
  DsaBlockResult<T> res;
  comm.set_phase(Phase::forward);
  // ---- the rank's own rows: the MLA's projections, K and V of every head
  DsaOwnRows<T> mine = dsa_own_rows(cfg, w, x, at, table, true, dout != nullptr);
  Tensor<T>& q = mine.q;  // freed once the heads have their copies
  const Tensor<T>&qr = mine.qr, &c = mine.c, &k_pe = mine.k_pe;
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
  dsa_rope_index_rows(ip.q.data(), at, HI, HI * dI, dI, table, false);
  dsa_rope_index_rows(ip.k.data(), at, 1, dI, dI, table, false);

  // ---- the indexer and top-k of the rank's rows against every earlier key
  std::vector<T> kI_all = buffer<T>(NS * dI), kIS = buffer<T>(NK * dI);
  gather_seq(comm, lay, ip.k.data(), kI_all.data(), dI, "index_k_ag");
  copy_rows(kI_all.data(), S, kIS.data(), Sk, B, Sk, dI);
  kI_all = {};
  IndexerShape is;  // the rank's rows: row i is token s0 + i
  is.attn = AttnShape{B, L, Sk, HI, 1, dI, 1, 1.0, true};
  is.attn.doc_start = doc_start ? docs_k.data() : nullptr;
  is.topk = K;
  is.scores = index_scores_of(cfg);
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
  q.reset(), k = {}, v = {};  // backward reads the heads' copies
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
    ops::sparse_attention_head_summed_probs<T>(ss, p_part.data(), q_h.data(), k_h.data(),
                                               lse.data(), att.data());
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
  std::vector<T> dkI = dsa_index_key_grads_home(comm, lay, dkIS.data(), Sk, dI);
  dsa_rope_index_rows(dqI.data(), at, HI, HI * dI, dI, table, true);
  dsa_rope_index_rows(dkI.data(), at, 1, dI, dI, table, true);
  res.indexer_grads = dsa_indexer_project_backward(
      cfg, iw, x, qr.data(), ip.w_scale, ip.k_pre.data(), ip.k_mean.data(), ip.k_rstd.data(),
      dwI.data(), dqI.data(), dkI.data(), N);

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
  Tensor<T> dqr;
  dsa_own_rows_backward(cfg, w, x, mine, at, table, dkv.data(), dc.data(), dq.data(), dqr,
                        res.grads, res.dx.data());
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
