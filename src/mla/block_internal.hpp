// Pieces shared by the three forms' files. Not part of the public API.
#pragma once

#include "core/memory_pool.hpp"
#include "kernels/attention.hpp"
#include "mla/block.hpp"

namespace laga::detail {

inline size_t u(std::int64_t i) {
  return static_cast<size_t>(i);
}
// False under a count-only pool: tensors have no storage and kernels must not run.
inline bool computing() {
  return !current_pool().count_only();
}

// Dims of one block on one rank.
struct Dims {
  std::int64_t B, L, S, N, NS, D, H, Hr, h0, dn, dr, dqk, dv, C, rq, pos0;
  Dims(const BlockContext& ctx);
};

// Local projections before the collectives: q (B, L, H*dqk) with q_pe
// rotated; saved.kv_a with k_pe rotated, kv_rstd; c_hat (B, L, C) returned.
template <class T>
Tensor<T> project_q(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                    MlaSaved<T>& saved);
template <class T>
Tensor<T> project_latent(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                         MlaSaved<T>& saved);

// [c_hat | k_pe] of local tokens (B, L, C+dr), gathered over the group into
// saved.lat (B, S, C+dr).
template <class T>
void gather_latent(const BlockContext& ctx, const Tensor<T>& c_hat, MlaSaved<T>& saved);

// Attention over the head shard: o (B, S, H_r, dv) from q, k, v; saves the
// statistics (probs or lse) in saved.attn_stats.
template <class T>
void attention_forward(const BlockContext& ctx, const AttnShape& s, T* o, const T* q, const T* k,
                       const T* v, MlaSaved<T>& saved);
template <class T>
void attention_backward(const BlockContext& ctx, const AttnShape& s, T* dq, T* dk, T* dv,
                        const T* dout, const T* q, const T* k, const T* v, const T* o,
                        MlaSaved<T>& saved);

// o_h (B, S, H_r, dv) -> saved.o_loc (B, L, H*dv) -> out = o_loc Wo^T.
template <class T>
void project_out(const BlockContext& ctx, const MlaParams<T>& w, const T* o_h, Tensor<T>& out,
                 MlaSaved<T>& saved);
// dout -> dWo, and dO_h (B, S, H_r, dv) returned.
template <class T>
Tensor<T> project_out_backward(const BlockContext& ctx, const MlaParams<T>& w,
                               const Tensor<T>& dout, MlaSaved<T>& saved, MlaParams<T>& grads);

// From dq_loc (B, L, H*dqk) and dlat_loc (B, L, C+dr) = d[c_hat | k_pe]
// (both before the inverse rotation) to dx and the wq*, q_norm, wkv_a,
// kv_norm gradients. Both inputs are consumed.
template <class T>
void project_in_backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                         Tensor<T>& dq_loc, Tensor<T>& dlat_loc, MlaSaved<T>& saved, Tensor<T>& dx,
                         MlaParams<T>& grads);

// K = [k_nope | k_pe] (rows, heads, dqk) and V (rows, heads, dv) from kv
// (rows, heads*(dn+dv)) and each row's rotated k_pe at kpe + row * ld_kpe,
// which every head shares (Megatron-Core expands it the same way).
template <class T>
void split_kv(const Dims& d, std::int64_t rows, std::int64_t heads, const T* kv, const T* kpe,
              std::int64_t ld_kpe, T* k, T* v);
// The adjoint of split_kv: dkv (rows, heads*(dn+dv)) from dk's nope part and
// dv; dk's rope parts are summed over heads, in head order, into
// dkpe + row * ld_dkpe (added to what is there).
template <class T>
void merge_dkv(const Dims& d, std::int64_t rows, std::int64_t heads, const T* dk, const T* dv,
               T* dkv, T* dkpe, std::int64_t ld_dkpe);
// The head-dim attention backward of explicit and laga: from do_h and the
// saved q_h, k_h, v_h (and o_att) to dq_h, dk_h, dv_h (B, S, H_r, .); frees
// do_h and those saved tensors.
template <class T>
void head_attention_backward(const BlockContext& ctx, MlaSaved<T>& saved, Tensor<T>& do_h,
                             Tensor<T>& dq_h, Tensor<T>& dk_h, Tensor<T>& dv_h);

// The forms.
template <class T>
void explicit_forward(const BlockContext&, const MlaParams<T>&, const Tensor<T>& x, Tensor<T>& out,
                      MlaSaved<T>&);
template <class T>
void explicit_backward(const BlockContext&, const MlaParams<T>&, const Tensor<T>& x,
                       const Tensor<T>& dout, MlaSaved<T>&, Tensor<T>& dx, MlaParams<T>& grads);
template <class T>
void laga_forward(const BlockContext&, const MlaParams<T>&, const Tensor<T>& x, Tensor<T>& out,
                  MlaSaved<T>&);
template <class T>
void laga_backward(const BlockContext&, const MlaParams<T>&, const Tensor<T>& x,
                   const Tensor<T>& dout, MlaSaved<T>&, Tensor<T>& dx, MlaParams<T>& grads);
template <class T>
void absorbed_forward(const BlockContext&, const MlaParams<T>&, const Tensor<T>& x, Tensor<T>& out,
                      MlaSaved<T>&);
template <class T>
void absorbed_backward(const BlockContext&, const MlaParams<T>&, const Tensor<T>& x,
                       const Tensor<T>& dout, MlaSaved<T>&, Tensor<T>& dx, MlaParams<T>& grads);

}  // namespace laga::detail
