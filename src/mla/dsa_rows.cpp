#include "mla/dsa_rows.hpp"

#include <algorithm>
#include <type_traits>

#include "core/precision.hpp"
#include "mla/exchange.hpp"
#include "mla/ops_dsa.hpp"
#include "mla/wire.hpp"

namespace laga {

namespace {

// A pool tensor of n zeros (activations), named for the pool's live list.
template <class T>
Tensor<T> zeros(std::int64_t n, const char* name) {
  return Tensor<T>::zeros({n}, name);
}

}  // namespace

template <class T>
void dsa_rope_rows(T* p, const DsaRowPositions& at, std::int64_t heads, std::int64_t ld_token,
                   std::int64_t ld_head, const RopeTable& table, bool inverse) {
  if (at.positions)
    ops::rope_rows_at(p, at.B, at.L, heads, ld_token, ld_head, at.positions, table, inverse);
  else
    ops::rope_rows(p, at.B, at.L, heads, ld_token, ld_head, at.pos0, table, inverse);
}

template <class T>
void dsa_rope_index_rows(T* p, const DsaRowPositions& at, std::int64_t heads, std::int64_t ld_token,
                         std::int64_t head_dim, const RopeTable& table, bool inverse) {
  for (std::int64_t b = 0; b < at.B; ++b)
    ops::rope_halves(ops::at(p, b * at.L * ld_token), at.L, heads, ld_token, head_dim, at.pos0,
                     at.positions ? at.positions + b * at.L : nullptr, table, inverse);
}

template <class T>
void dsa_index_values_as_stored(const MlaConfig& cfg, std::int64_t N, T* qI, T* kI, T* w) {
  const std::int64_t HI = cfg.index_n_heads, dI = cfg.index_head_dim;
  if (qI) ops::round_as_stored(qI, N, HI * dI);
  if (kI) ops::round_as_stored(kI, N, dI);
  if (w) ops::round_as_stored(w, N, HI);
}

template <class T>
DsaOwnRows<T> dsa_own_rows(const MlaConfig& cfg, const MlaParams<T>& w, const T* x,
                           const DsaRowPositions& at, const RopeTable& table, bool with_q,
                           bool backward_to_come) {
  const std::int64_t N = at.B * at.L, D = cfg.dim, H = cfg.n_heads, rq = cfg.q_lora_rank;
  const std::int64_t C = cfg.kv_lora_rank, dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim;
  const std::int64_t dqk = dn + dr, W = C + dr;
  DsaOwnRows<T> f;
  f.qa = zeros<T>(N * rq, "dsa qa"), f.qr = zeros<T>(N * rq, "dsa qr");
  f.rstd_q = zeros<T>(N, "dsa rstd_q");
  ops::linear_rows(f.qa.data(), x, w.wq_a.data(), N, D, rq);
  ops::rmsnorm_rows(f.qr.data(), f.rstd_q.data(), f.qa.data(), rq, w.q_norm.data(), N, rq,
                    cfg.norm_eps);
  ops::round_as_stored(f.qr.data(), N, rq);
  if (with_q) {
    f.q = zeros<T>(N * H * dqk, "dsa q");
    ops::linear_rows(f.q.data(), f.qr.data(), w.wq_b.data(), N, rq, H * dqk);
    dsa_rope_rows(ops::at(f.q.data(), dn), at, H, H * dqk, dqk, table, false);
  }
  f.kv = zeros<T>(N * W, "dsa kv"), f.c = zeros<T>(N * C, "dsa c");
  f.rstd_kv = zeros<T>(N, "dsa rstd_kv");
  ops::linear_rows(f.kv.data(), x, w.wkv_a.data(), N, D, W);
  ops::rmsnorm_rows(f.c.data(), f.rstd_kv.data(), f.kv.data(), W, w.kv_norm.data(), N, C,
                    cfg.norm_eps);
  if (cfg.kv_fp8_round_trip) {
    LAGA_CHECK(!backward_to_come,
               "DSA: kv_fp8_round_trip simulates DeepSeek's fp8 kv cache at inference and has "
               "no backward (the rounding's gradient is zero almost everywhere); run forward "
               "only, or set kv_fp8_round_trip false to train");
    ops::kv_fp8_round_trip(f.c.data(), N, C);
  }
  f.k_pe = zeros<T>(N * dr, "dsa k_pe");
  ops::copy(ops::mat(f.k_pe, N, dr), ops::mat(f.kv, N, W).col_range(C, dr));
  dsa_rope_rows(f.k_pe.data(), at, 1, dr, dr, table, false);
  return f;
}

template <class T>
void dsa_own_rows_backward(const MlaConfig& cfg, const MlaParams<T>& w, const T* x,
                           const DsaOwnRows<T>& f, const DsaRowPositions& at,
                           const RopeTable& table, T* dkv, const T* dc, T* dq, Tensor<T>& dqr,
                           MlaParams<T>& grads, T* dx) {
  const std::int64_t N = at.B * at.L, D = cfg.dim, H = cfg.n_heads, rq = cfg.q_lora_rank;
  const std::int64_t C = cfg.kv_lora_rank, dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim;
  const std::int64_t dqk = dn + dr, W = C + dr;
  // The kv path: k_pe rotated back, kv_norm, wkv_a (dx written).
  dsa_rope_rows(ops::at(dkv, C), at, 1, W, dr, table, true);
  ops::rmsnorm_rows_backward(dkv, W, grads.kv_norm.data(), dc, C, f.kv.data(), W, w.kv_norm.data(),
                             f.rstd_kv.data(), N, C);
  ops::linear_rows_backward<T>(dx, false, grads.wkv_a.data(), dkv, x, w.wkv_a.data(), N, D, W);
  // The q path: q's rope part rotated back and wq_b (unless the caller
  // made dqr), q_norm, wq_a (dx added to).
  if (dq) {
    dsa_rope_rows(ops::at(dq, dn), at, H, H * dqk, dqk, table, true);
    dqr = zeros<T>(N * rq, "dsa dqr");
    ops::linear_rows_backward<T>(dqr.data(), false, grads.wq_b.data(), dq, f.qr.data(),
                                 w.wq_b.data(), N, rq, H * dqk);
  }
  Tensor<T> dqa = zeros<T>(N * rq, "dsa dqa");
  ops::rmsnorm_rows_backward(dqa.data(), rq, grads.q_norm.data(), dqr.data(), rq, f.qa.data(), rq,
                             w.q_norm.data(), f.rstd_q.data(), N, rq);
  ops::linear_rows_backward<T>(dx, true, grads.wq_a.data(), dqa.data(), x, w.wq_a.data(), N, D, rq);
}

template <class T>
Tensor<T> dsa_index_key_grads_home(Communicator& comm, const SpLayout& lay, const T* dk_prefix,
                                   std::int64_t Sk, std::int64_t dI) {
  const std::int64_t B = lay.batch, S = lay.seq, L = lay.seq_count[std::size_t(comm.rank())];
  Tensor<T> padded = zeros<T>(B * S * dI, "dsa index dk padded");
  Tensor<T> own = zeros<T>(B * L * dI, "dsa index dk own");
  for (std::int64_t b = 0; b < B; ++b)
    ops::copy(ops::mat(padded, B * S, dI).block(b * S, Sk, 0, dI),
              ops::Mat<const T>{ops::at(dk_prefix, b * Sk * dI), Sk, dI, dI});
  reduce_scatter_seq(comm, lay, padded.data(), own.data(), dI, "index_k_ag");
  return own;
}

template <class T>
DsaHeadKv<T> dsa_head_kv(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& c,
                         const Tensor<T>& k_pe, std::int64_t N) {
  const std::int64_t H = cfg.n_heads, C = cfg.kv_lora_rank, dn = cfg.qk_nope_head_dim;
  const std::int64_t dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim, dqk = dn + dr;
  Tensor<T> kvb = Tensor<T>::zeros({N * H * (dn + dv)}, "dsa kv_b");
  ops::linear_rows(kvb.data(), c.data(), w.wkv_b.data(), N, C, H * (dn + dv));
  DsaHeadKv<T> kv{Tensor<T>::zeros({N * H * dqk}, "dsa k"),
                  Tensor<T>::zeros({N * H * dv}, "dsa v")};
  const auto src = ops::mat(kvb, N, H * (dn + dv));
  for (std::int64_t h = 0; h < H; ++h) {
    ops::copy(ops::mat(kv.k, N, H * dqk).col_range(h * dqk, dn), src.col_range(h * (dn + dv), dn));
    ops::copy(ops::mat(kv.k, N, H * dqk).col_range(h * dqk + dn, dr), ops::mat(k_pe, N, dr));
    ops::copy(ops::mat(kv.v, N, H * dv).col_range(h * dv, dv),
              src.col_range(h * (dn + dv) + dn, dv));
  }
  return kv;
}

void check_dsa_form_inputs(const char* fn, const MlaConfig& cfg, const SpLayout& lay,
                           const Communicator& comm, bool head_sharded) {
  cfg.validate();
  lay.validate();
  LAGA_CHECK(cfg.dsa(), fn,
             ": the config has no DeepSeek Sparse Attention keys (index_n_heads, index_head_dim, "
             "index_topk)");
  LAGA_CHECK(lay.seq_layout == SeqLayout::contiguous, fn,
             ": the zigzag layout is not implemented; use --seq-layout contiguous");
  LAGA_CHECK(lay.ranks == comm.size(), fn, ": the layout has ", lay.ranks,
             " ranks, the communicator ", comm.size());
  if (!head_sharded) return;
  std::int64_t heads = 0;
  for (std::int64_t h : lay.head_count) heads += h;
  LAGA_CHECK(heads == cfg.n_heads, fn, ": the layout's ranks hold ", heads,
             " heads, the config has n_heads ", cfg.n_heads);
}

template <class T>
DsaIndexerProjections<T> dsa_indexer_rows(const MlaConfig& cfg, const DsaIndexerParams<T>& iw,
                                          const T* x, const T* qr, const DsaRowPositions& at,
                                          const RopeTable& table, std::int64_t N) {
  const std::int64_t HI = cfg.index_n_heads, dI = cfg.index_head_dim;
  DsaIndexerProjections<T> ip = dsa_indexer_project(cfg, iw, x, qr, N);
  dsa_rope_index_rows(ip.q.data(), at, HI, HI * dI, dI, table, false);
  dsa_rope_index_rows(ip.k.data(), at, 1, dI, dI, table, false);
  dsa_index_values_as_stored(cfg, N, ip.q.data(), ip.k.data(), ip.w.data());
  return ip;
}

template <class T>
DsaIndexerParams<T> dsa_indexer_rows_backward(const MlaConfig& cfg, const DsaIndexerParams<T>& iw,
                                              const T* x, const T* qr, DsaIndexerProjections<T>& ip,
                                              const DsaRowPositions& at, const RopeTable& table,
                                              Tensor<T>& dq, Tensor<T>& dk, Tensor<T>& dw,
                                              std::int64_t N) {
  const std::int64_t HI = cfg.index_n_heads, dI = cfg.index_head_dim;
  dsa_rope_index_rows(dq.data(), at, HI, HI * dI, dI, table, true);
  dsa_rope_index_rows(dk.data(), at, 1, dI, dI, table, true);
  DsaIndexerParams<T> grads =
      dsa_indexer_project_backward(cfg, iw, x, qr, ip.w_scale, ip.k_pre.data(), ip.k_mean.data(),
                                   ip.k_rstd.data(), dw.data(), dq.data(), dk.data(), N);
  dq.reset(), dk.reset(), dw.reset(), ip.k_pre.reset(), ip.k_mean.reset(), ip.k_rstd.reset();
  return grads;
}

template <class T>
void dsa_absorb_q(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& q, Tensor<T>& qa,
                  std::int64_t N) {
  const std::int64_t H = cfg.n_heads, C = cfg.kv_lora_rank, dn = cfg.qk_nope_head_dim;
  const std::int64_t dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim, dqk = dn + dr, W = C + dr;
  for (std::int64_t h = 0; h < H; ++h) {
    ops::gemm_strided<T>(false, false, N, C, dn, T(1), ops::at(q.data(), h * dqk), H * dqk,
                         ops::at(w.wkv_b.data(), h * (dn + dv) * C), C, T(0),
                         ops::at(qa.data(), h * W), H * W);
    ops::copy(ops::mat(qa, N, H * W).col_range(h * W + C, dr),
              ops::mat(q, N, H * dqk).col_range(h * dqk + dn, dr));
  }
}

template <class T>
void dsa_latent_out(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& o_lat,
                    Tensor<T>& o, std::int64_t N) {
  const std::int64_t H = cfg.n_heads, C = cfg.kv_lora_rank, dn = cfg.qk_nope_head_dim;
  const std::int64_t dv = cfg.v_head_dim;
  for (std::int64_t h = 0; h < H; ++h)
    ops::gemm_strided<T>(false, true, N, dv, C, T(1), ops::at(o_lat.data(), h * C), H * C,
                         ops::at(w.wkv_b.data(), (h * (dn + dv) + dn) * C), C, T(0),
                         ops::at(o.data(), h * dv), H * dv);
}

template <class T>
void dsa_latent_out_backward(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& dO,
                             const Tensor<T>& o_lat, Tensor<T>& do_lat, MlaParams<T>& grads,
                             std::int64_t N) {
  const std::int64_t H = cfg.n_heads, C = cfg.kv_lora_rank, dn = cfg.qk_nope_head_dim;
  const std::int64_t dv = cfg.v_head_dim;
  for (std::int64_t h = 0; h < H; ++h) {
    ops::gemm_strided<T>(false, false, N, C, dv, T(1), ops::at(dO.data(), h * dv), H * dv,
                         ops::at(w.wkv_b.data(), (h * (dn + dv) + dn) * C), C, T(0),
                         ops::at(do_lat.data(), h * C), H * C);
    ops::gemm_strided<T>(true, false, dv, C, N, T(1), ops::at(dO.data(), h * dv), H * dv,
                         ops::at(o_lat.data(), h * C), H * C, T(1),
                         ops::at(grads.wkv_b.data(), (h * (dn + dv) + dn) * C), C);
  }
}

template <class T>
void dsa_absorb_q_backward(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& q,
                           const Tensor<T>& dqa, Tensor<T>& dq, MlaParams<T>& grads,
                           std::int64_t N) {
  const std::int64_t H = cfg.n_heads, C = cfg.kv_lora_rank, dn = cfg.qk_nope_head_dim;
  const std::int64_t dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim, dqk = dn + dr, W = C + dr;
  for (std::int64_t h = 0; h < H; ++h) {
    ops::gemm_strided<T>(false, true, N, dn, C, T(1), ops::at(dqa.data(), h * W), H * W,
                         ops::at(w.wkv_b.data(), h * (dn + dv) * C), C, T(0),
                         ops::at(dq.data(), h * dqk), H * dqk);
    ops::gemm_strided<T>(true, false, dn, C, N, T(1), ops::at(q.data(), h * dqk), H * dqk,
                         ops::at(dqa.data(), h * W), H * W, T(1),
                         ops::at(grads.wkv_b.data(), h * (dn + dv) * C), C);
    ops::copy(ops::mat(dq, N, H * dqk).col_range(h * dqk + dn, dr),
              ops::mat(dqa, N, H * W).col_range(h * W + C, dr));
  }
}

template <class T>
void dsa_head_kv_backward(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& c,
                          Tensor<T>& dk, Tensor<T>& dv, Tensor<T>& dkv, Tensor<T>& dc,
                          MlaParams<T>& grads, std::int64_t N) {
  const std::int64_t H = cfg.n_heads, C = cfg.kv_lora_rank, dn = cfg.qk_nope_head_dim;
  const std::int64_t dr = cfg.qk_rope_head_dim, dvh = cfg.v_head_dim, dqk = dn + dr;
  Tensor<T> dkvb = Tensor<T>::zeros({N * H * (dn + dvh)}, "dsa dkv_b");
  const auto dst = ops::mat(dkvb, N, H * (dn + dvh));
  for (std::int64_t h = 0; h < H; ++h) {
    ops::copy(dst.col_range(h * (dn + dvh), dn), ops::mat(dk, N, H * dqk).col_range(h * dqk, dn));
    ops::copy(dst.col_range(h * (dn + dvh) + dn, dvh),
              ops::mat(dv, N, H * dvh).col_range(h * dvh, dvh));
    ops::add(ops::mat(dkv, N, C + dr).col_range(C, dr),
             ops::mat(dk, N, H * dqk).col_range(h * dqk + dn, dr));
  }
  dk.reset(), dv.reset();
  ops::linear_rows_backward<T>(dc.data(), false, grads.wkv_b.data(), dkvb.data(), c.data(),
                               w.wkv_b.data(), N, C, H * (dn + dvh));
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template void dsa_rope_rows<T>(T*, const DsaRowPositions&, std::int64_t, std::int64_t,           \
                                 std::int64_t, const RopeTable&, bool);                            \
  template void dsa_rope_index_rows<T>(T*, const DsaRowPositions&, std::int64_t, std::int64_t,     \
                                       std::int64_t, const RopeTable&, bool);                      \
  template void dsa_index_values_as_stored<T>(const MlaConfig&, std::int64_t, T*, T*, T*);         \
  template void dsa_absorb_q<T>(const MlaConfig&, const MlaParams<T>&, const Tensor<T>&,           \
                                Tensor<T>&, std::int64_t);                                         \
  template void dsa_latent_out<T>(const MlaConfig&, const MlaParams<T>&, const Tensor<T>&,         \
                                  Tensor<T>&, std::int64_t);                                       \
  template void dsa_latent_out_backward<T>(const MlaConfig&, const MlaParams<T>&,                  \
                                           const Tensor<T>&, const Tensor<T>&, Tensor<T>&,         \
                                           MlaParams<T>&, std::int64_t);                           \
  template void dsa_absorb_q_backward<T>(const MlaConfig&, const MlaParams<T>&, const Tensor<T>&,  \
                                         const Tensor<T>&, Tensor<T>&, MlaParams<T>&,              \
                                         std::int64_t);                                            \
  template DsaIndexerProjections<T> dsa_indexer_rows<T>(                                           \
      const MlaConfig&, const DsaIndexerParams<T>&, const T*, const T*, const DsaRowPositions&,    \
      const RopeTable&, std::int64_t);                                                             \
  template DsaIndexerParams<T> dsa_indexer_rows_backward<T>(                                       \
      const MlaConfig&, const DsaIndexerParams<T>&, const T*, const T*, DsaIndexerProjections<T>&, \
      const DsaRowPositions&, const RopeTable&, Tensor<T>&, Tensor<T>&, Tensor<T>&, std::int64_t); \
  template void dsa_head_kv_backward<T>(const MlaConfig&, const MlaParams<T>&, const Tensor<T>&,   \
                                        Tensor<T>&, Tensor<T>&, Tensor<T>&, Tensor<T>&,            \
                                        MlaParams<T>&, std::int64_t);                              \
  template DsaHeadKv<T> dsa_head_kv<T>(const MlaConfig&, const MlaParams<T>&, const Tensor<T>&,    \
                                       const Tensor<T>&, std::int64_t);                            \
  template DsaOwnRows<T> dsa_own_rows<T>(const MlaConfig&, const MlaParams<T>&, const T*,          \
                                         const DsaRowPositions&, const RopeTable&, bool, bool);    \
  template void dsa_own_rows_backward<T>(                                                          \
      const MlaConfig&, const MlaParams<T>&, const T*, const DsaOwnRows<T>&,                       \
      const DsaRowPositions&, const RopeTable&, T*, const T*, T*, Tensor<T>&, MlaParams<T>&, T*);  \
  template Tensor<T> dsa_index_key_grads_home<T>(Communicator&, const SpLayout&, const T*,         \
                                                 std::int64_t, std::int64_t);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

static_assert(sizeof(std::int32_t) == sizeof(float));
TensorI32 dsa_gather_indices(Communicator& comm, const SpLayout& lay, const TensorI32& own,
                             std::int64_t K) {
  const std::int64_t B = lay.batch, S = lay.seq;
  std::vector<std::int64_t> counts, displs;
  std::int64_t off = 0;
  for (int j = 0; j < lay.ranks; ++j) {
    counts.push_back(B * lay.seq_count[std::size_t(j)] * K);
    displs.push_back(off);
    off += counts.back();
  }
  TensorI32 rank_major = TensorI32::zeros({off}, "dsa selections rank-major");
  TensorI32 all = TensorI32::zeros({B * S * K}, "dsa every row's selection");
  comm.all_gather_v(own.data(), own.numel(), rank_major.data(), counts.data(), displs.data(),
                    DType::f32, "topk_ag");
  for (int j = 0; j < lay.ranks; ++j) {
    const std::int64_t s0 = lay.shard_begin(j), L = lay.seq_count[std::size_t(j)];
    for (std::int64_t b = 0; b < B; ++b)
      ops::cast(ops::at(all.data(), (b * S + s0) * K),
                ops::at(rank_major.data(), displs[std::size_t(j)] + b * L * K), L * K);
  }
  return all;
}

template <class T>
void dsa_all_gather_v(Communicator& comm, const T* send, std::int64_t send_count, T* recv,
                      const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                      const std::string& label) {
  if constexpr (std::is_same_v<T, float>)
    if (ops::in_bf16<T>())
      return wire::all_gather_v(comm, send, send_count, recv, recv_counts, recv_displs, label);
  comm.all_gather_v(send, send_count, recv, recv_counts, recv_displs, label);
}

template <class T>
void dsa_reduce_scatter_v(Communicator& comm, const T* send, const std::int64_t* counts,
                          const std::int64_t* displs, T* recv, const std::string& label) {
  if constexpr (std::is_same_v<T, float>)
    if (ops::in_bf16<T>()) return wire::reduce_scatter_v(comm, send, counts, displs, recv, label);
  comm.reduce_scatter_v(send, counts, displs, recv, label);
}

// exchange.hpp's collectives choose their wire by the thread's precision
// (ops::in_bf16): an fp32 scope around one gives it fp32's, as ops_dsa.cpp's
// Fp32Ops runs the indexer's ops at fp32.
template <class T>
void dsa_reduce_scatter_seq_fp32(Communicator& comm, const SpLayout& lay, const T* src, T* dst,
                                 std::int64_t W, const std::string& label) {
  const UsePrecision fp32(Precision::fp32);
  reduce_scatter_seq(comm, lay, src, dst, W, label);
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template void dsa_all_gather_v<T>(Communicator&, const T*, std::int64_t, T*,                     \
                                    const std::int64_t*, const std::int64_t*, const std::string&); \
  template void dsa_reduce_scatter_v<T>(Communicator&, const T*, const std::int64_t*,              \
                                        const std::int64_t*, T*, const std::string&);              \
  template void dsa_reduce_scatter_seq_fp32<T>(Communicator&, const SpLayout&, const T*, T*,       \
                                               std::int64_t, const std::string&);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
