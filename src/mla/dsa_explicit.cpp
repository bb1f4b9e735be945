#include "mla/dsa_explicit.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "mla/dsa_rows.hpp"
#include "mla/exchange.hpp"
#include "mla/ops_dsa.hpp"

namespace laga {

template <class T>
DsaBlockResult<T> dsa_explicit(const MlaConfig& cfg, const MlaParams<T>& w,
                               const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                               const SpLayout& lay, DsaStage stage, Communicator& comm,
                               const std::int64_t* doc_start) {
  check_dsa_form_inputs("dsa_explicit", cfg, lay, comm, true);
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
  // Every buffer is a pool tensor, freed (reset) where nothing reads it
  // again: dsa_memory (mla/dsa_model.cpp) writes the same sequence out.
  auto zeros = [](std::int64_t n, const char* name) { return Tensor<T>::zeros({n}, name); };
  auto m = [](Tensor<T>& t, std::int64_t rows, std::int64_t cols) {
    return ops::mat(t, rows, cols);
  };
  DsaBlockResult<T> res;
  comm.set_phase(Phase::forward);
  // ---- the rank's own rows: the MLA's projections, K and V of every head
  DsaOwnRows<T> mine = dsa_own_rows(cfg, w, x, at, table, true, dout != nullptr);
  Tensor<T>& q = mine.q;  // freed once the heads have their copies
  Tensor<T>&qr = mine.qr, &c = mine.c, &k_pe = mine.k_pe;
  DsaHeadKv<T> kv = dsa_head_kv(cfg, w, c, k_pe, N);
  Tensor<T>&k = kv.k, &v = kv.v;
  k_pe.reset();
  // ... and the indexer's
  DsaIndexerProjections<T> ip = dsa_indexer_rows(cfg, iw, x, qr.data(), at, table, N);

  // ---- the indexer and top-k of the rank's rows against every earlier key
  Tensor<T> kI_all = zeros(NS * dI, "dsa index keys gathered");
  gather_seq(comm, lay, ip.k.data(), kI_all.data(), dI, "index_k_ag");
  ip.k.reset();
  Tensor<T> kIS = zeros(NK * dI, "dsa index keys (B, Sk)");
  for (std::int64_t b = 0; b < B; ++b)
    ops::copy(m(kIS, NK, dI).row_range(b * Sk, Sk), m(kI_all, NS, dI).row_range(b * S, Sk));
  kI_all.reset();
  IndexerShape is;  // the rank's rows: row i is token s0 + i
  is.attn = AttnShape{B, L, Sk, HI, 1, dI, 1, 1.0, true};
  is.attn.doc_start = doc_start ? docs_k.data() : nullptr;
  is.topk = K;
  is.scores = index_scores_of(cfg);
  is.validate();
  TensorI32 idx({N * K}, "dsa top-k indices");
  idx.fill(-1);
  ops::index_topk(is, idx.data(), ip.q.data(), kIS.data(), ip.w.data());

  // ---- the key set of every row, for the head layout: the selection of
  // every rank (sparse), or every causal key (the warm-up: nothing moves)
  IndexerShape is_all;  // every row, for the warm-up's key set
  is_all.attn = AttnShape{B, S, S, HI, 1, dI, 1, 1.0, true};
  is_all.attn.doc_start = doc_start;
  is_all.topk = K;
  const std::int64_t KA = sparse ? K : S;
  TensorI32 att({NS * KA}, "dsa every row's key set");
  att.fill(-1);
  if (sparse) {
    // every rank's selection, (B, L_j, K) int32 each, all-gathered
    // rank-major ("topk_ag", 4-byte words: a gather copies every bit) and
    // laid out as (B, S, K) rows (dsa_gather_indices' sequence, on pool
    // tensors)
    TensorI32 rank_major({NS * K}, "dsa selections rank-major");
    std::vector<std::int64_t> counts, displs;
    for (int j = 0; j < lay.ranks; ++j) {
      displs.push_back(counts.empty() ? 0 : displs.back() + counts.back());
      counts.push_back(B * lay.seq_count[std::size_t(j)] * K);
    }
    comm.all_gather_v(idx.data(), N * K, rank_major.data(), counts.data(), displs.data(),
                      DType::f32, "topk_ag");
    for (int j = 0; j < lay.ranks; ++j) {
      const std::int64_t sj = lay.shard_begin(j), Lj = lay.seq_count[std::size_t(j)];
      for (std::int64_t b = 0; b < B; ++b)
        ops::cast(ops::at(att.data(), (b * S + sj) * K),
                  ops::at(static_cast<const std::int32_t*>(rank_major.data()),
                          displs[std::size_t(j)] + b * Lj * K),
                  Lj * K);
    }
  } else {
    ops::index_all_causal(is_all, att.data());
  }

  // ---- Q, K, V to the heads, the attention of every row for r's heads
  Tensor<T> q_h = zeros(NS * Hr * dqk, "dsa q_h"), k_h = zeros(NS * Hr * dqk, "dsa k_h");
  Tensor<T> v_h = zeros(NS * Hr * dv, "dsa v_h");
  seq_to_head(comm, lay, q.data(), q_h.data(), dqk, "q_a2a");
  seq_to_head(comm, lay, k.data(), k_h.data(), dqk, "k_a2a");
  seq_to_head(comm, lay, v.data(), v_h.data(), dv, "v_a2a");
  q.reset(), k.reset(), v.reset();  // backward reads the heads' copies
  SparseAttnShape ss;
  ss.attn = AttnShape{B, S, S, Hr, Hr, dqk, dv, cfg.softmax_scale(), true};
  ss.K = KA;
  Tensor<T> o_h = zeros(NS * Hr * dv, "dsa o_h"), lse = zeros(B * Hr * S, "dsa lse");
  if (Hr > 0)
    ops::sparse_attention_forward<T>(ss, o_h.data(), lse.data(), q_h.data(), k_h.data(), v_h.data(),
                                     att.data());
  Tensor<T> o = zeros(N * H * dv, "dsa o");
  head_to_seq(comm, lay, o_h.data(), o.data(), dv, "out_a2a");
  Tensor<T> out = zeros(N * D, "dsa output");
  ops::linear_rows(out.data(), o.data(), w.wo.data(), N, H * dv, D);

  // ---- the KL target: r's heads' share of the head-summed distribution
  // ((H_r / H) times the kernel's mean over r's heads), summed at the rows'
  // owners
  Tensor<T> p_part = zeros(NS * KA, "dsa KL target part"), p_rows = zeros(N * KA, "dsa KL target");
  if (Hr > 0) {
    ops::sparse_attention_head_summed_probs<T>(ss, p_part.data(), q_h.data(), k_h.data(),
                                               lse.data(), att.data());
    ops::scale_ratio(m(p_part, NS, KA), double(Hr), double(H));
  }
  dsa_reduce_scatter_seq_fp32(comm, lay, p_part.data(), p_rows.data(), KA, "index_target_rs");
  p_part.reset();
  // The rank's rows' key set for the KL: its selection (sparse), or every
  // causal key before Sk (the warm-up: the head layout's rows of width S
  // list the same keys in the same order, the slots past Sk empty).
  TensorI32 own_all;
  const std::int32_t* own_idx = idx.data();
  std::int64_t KO = K;
  Tensor<T> p_own;
  if (!sparse) {
    own_all = TensorI32({N * Sk}, "dsa own rows' causal keys");
    own_all.fill(-1);
    ops::index_all_causal(is, own_all.data());
    own_idx = own_all.data(), KO = Sk;
    p_own = zeros(N * Sk, "dsa KL target (B, L, Sk)");
    ops::copy(m(p_own, N, Sk), m(p_rows, N, S).col_range(0, Sk));
    p_rows.reset();
  } else {
    p_own = std::move(p_rows);
  }
  std::vector<double> loss(static_cast<std::size_t>(N));
  Tensor<T> dqI = zeros(N * HI * dI, "dsa index dq"), dkIS = zeros(NK * dI, "dsa index dk (B, Sk)");
  Tensor<T> dwI = zeros(N * HI, "dsa index dw");
  ops::indexer_kl(is, KO, own_idx, p_own.data(), ip.q.data(), kIS.data(), ip.w.data(), loss.data(),
                  dqI.data(), dkIS.data(), dwI.data());
  for (double l : loss) res.kl_loss += l;
  // the KL's gradients are taken: backward reads them
  kIS.reset(), p_own.reset(), own_all.reset(), ip.q.reset(), ip.w.reset();
  res.out = ops::to_vector(out);
  res.idx = ops::to_vector(idx);
  idx.reset();
  if (!dout) return res;

  comm.set_phase(Phase::backward);
  // ---- the indexer's weights: k_I's gradient to the keys' owners first
  Tensor<T> dkI = dsa_index_key_grads_home(comm, lay, dkIS.data(), Sk, dI);
  dkIS.reset();
  res.indexer_grads =
      dsa_indexer_rows_backward(cfg, iw, x, qr.data(), ip, at, table, dqI, dkI, dwI, N);

  // ---- the LM backward: the output's gradient to the heads, the
  // attention's back to the rows' owners
  res.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  Tensor<T> dx = zeros(N * D, "dsa dx");
  Tensor<T> dO = zeros(N * H * dv, "dsa dO"), dO_h = zeros(NS * Hr * dv, "dsa dO_h");
  ops::linear_rows_backward<T>(dO.data(), false, res.grads.wo.data(), dout, o.data(), w.wo.data(),
                               N, H * dv, D);
  seq_to_head(comm, lay, dO.data(), dO_h.data(), dv, "out_a2a");
  o.reset(), dO.reset();
  Tensor<T> dq_h = zeros(NS * Hr * dqk, "dsa dq_h"), dk_h = zeros(NS * Hr * dqk, "dsa dk_h");
  Tensor<T> dv_h = zeros(NS * Hr * dv, "dsa dv_h");
  if (Hr > 0)
    ops::sparse_attention_backward<T>(ss, dq_h.data(), dk_h.data(), dv_h.data(), dO_h.data(),
                                      q_h.data(), k_h.data(), v_h.data(), o_h.data(), lse.data(),
                                      att.data());
  dO_h.reset(), q_h.reset(), k_h.reset(), v_h.reset(), o_h.reset(), lse.reset(), att.reset();
  Tensor<T> dq = zeros(N * H * dqk, "dsa dq"), dk = zeros(N * H * dqk, "dsa dk");
  Tensor<T> dvv = zeros(N * H * dv, "dsa dv");
  head_to_seq(comm, lay, dq_h.data(), dq.data(), dqk, "q_a2a");
  head_to_seq(comm, lay, dk_h.data(), dk.data(), dqk, "k_a2a");
  head_to_seq(comm, lay, dv_h.data(), dvv.data(), dv, "v_a2a");
  dq_h.reset(), dk_h.reset(), dv_h.reset();

  // ---- the rank's own rows: [dk_nope | dv] per head into wkv_b and c, the
  // heads' k_pe gradients summed (k_pe is every head's), as dsa_block
  Tensor<T> dkv = zeros(N * W, "dsa dkv"), dc = zeros(N * C, "dsa dc");
  dsa_head_kv_backward(cfg, w, c, dk, dvv, dkv, dc, res.grads, N);
  c.reset();
  Tensor<T> dqr;
  dsa_own_rows_backward(cfg, w, x, mine, at, table, dkv.data(), dc.data(), dq.data(), dqr,
                        res.grads, dx.data());
  res.dx = ops::to_vector(dx);
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
