// Explicit form (B1, Ulysses on MLA, Megatron-Core's training path): per-head
// K/V are materialised for local tokens and ALL heads, then Q, K, V cross the
// wire seq->head. K carries k_pe expanded over heads, as Megatron-Core does.
#include <cstring>

#include "kernels/gemm.hpp"
#include "mla/block_internal.hpp"
#include "mla/exchange.hpp"

namespace laga::detail {

template <class T>
void explicit_forward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                      Tensor<T>& out, MlaSaved<T>& saved) {
  const Dims d(ctx);
  const bool run = computing();
  const std::int64_t W = d.C + d.dr, KV = d.dn + d.dv;
  Tensor<T> q = project_q(ctx, w, x, saved);
  saved.c_hat = project_latent(ctx, w, x, saved);

  // kv (N, H*(dn+dv)) = c_hat wkv_b^T, split into K = [k_nope | k_pe] (N, H, dqk), V (N, H, dv).
  Tensor<T> k_loc({d.B, d.L, d.H * d.dqk}), v_loc({d.B, d.L, d.H * d.dv});
  {
    Tensor<T> kv({d.B, d.L, d.H * KV});
    if (run) {
      linear_forward(kv.data(), saved.c_hat.data(), w.wkv_b.data(), d.N, d.C, d.H * KV);
      split_kv(d, d.N, d.H, kv.data(), saved.kv_a.data() + d.C, W, k_loc.data(), v_loc.data());
    }
  }
  saved.q_h = Tensor<T>({d.B, d.S, d.Hr, d.dqk});
  seq_to_head(ctx.comm, ctx.layout, q.data(), saved.q_h.data(), d.dqk, "q_a2a");
  q.reset();
  saved.k_h = Tensor<T>({d.B, d.S, d.Hr, d.dqk});
  seq_to_head(ctx.comm, ctx.layout, k_loc.data(), saved.k_h.data(), d.dqk, "k_a2a");
  k_loc.reset();
  saved.v_h = Tensor<T>({d.B, d.S, d.Hr, d.dv});
  seq_to_head(ctx.comm, ctx.layout, v_loc.data(), saved.v_h.data(), d.dv, "v_a2a");
  v_loc.reset();

  const AttnShape s{d.B, d.S, d.S, d.Hr, d.Hr, d.dqk, d.dv, ctx.cfg.softmax_scale(), true};
  saved.o_att = Tensor<T>({d.B, d.S, d.Hr, d.dv});
  attention_forward(ctx, s, saved.o_att.data(), saved.q_h.data(), saved.k_h.data(),
                    saved.v_h.data(), saved);
  project_out(ctx, w, saved.o_att.data(), out, saved);
  if (ctx.attention == AttentionKind::eager) saved.o_att.reset();  // only flash's backward reads o
}

template <class T>
void explicit_backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                       const Tensor<T>& dout, MlaSaved<T>& saved, Tensor<T>& dx,
                       MlaParams<T>& grads) {
  const Dims d(ctx);
  const bool run = computing();
  const std::int64_t W = d.C + d.dr, KV = d.dn + d.dv;
  Tensor<T> do_h = project_out_backward(ctx, w, dout, saved, grads);

  Tensor<T> dq_h, dk_h, dv_h;
  head_attention_backward(ctx, saved, do_h, dq_h, dk_h, dv_h);

  Tensor<T> dq_loc({d.B, d.L, d.H * d.dqk});
  head_to_seq(ctx.comm, ctx.layout, dq_h.data(), dq_loc.data(), d.dqk, "q_a2a");
  dq_h.reset();
  Tensor<T> dk_loc({d.B, d.L, d.H * d.dqk});
  head_to_seq(ctx.comm, ctx.layout, dk_h.data(), dk_loc.data(), d.dqk, "k_a2a");
  dk_h.reset();
  Tensor<T> dv_loc({d.B, d.L, d.H * d.dv});
  head_to_seq(ctx.comm, ctx.layout, dv_h.data(), dv_loc.data(), d.dv, "v_a2a");
  dv_h.reset();

  // d kv from [dk_nope | dv] per head; d k_pe = sum over heads of dk's rope
  // part (k_pe was broadcast to every head).
  Tensor<T> dlat_loc = Tensor<T>::zeros({d.B, d.L, W});
  {
    Tensor<T> dkv({d.B, d.L, d.H * KV});
    if (run)
      merge_dkv(d, d.N, d.H, dk_loc.data(), dv_loc.data(), dkv.data(), dlat_loc.data() + d.C, W);
    dk_loc.reset(), dv_loc.reset();
    if (run) {
      // d c_hat (N, C) = dkv wkv_b, written into dlat's first C columns.
      gemm<T>(false, false, d.N, d.C, d.H * KV, T(1), dkv.data(), d.H * KV, w.wkv_b.data(), d.C,
              T(0), dlat_loc.data(), W);
      linear_backward<T>(nullptr, false, grads.wkv_b.data(), dkv.data(), saved.c_hat.data(),
                         w.wkv_b.data(), d.N, d.C, d.H * KV);
    }
  }
  saved.c_hat.reset();
  project_in_backward(ctx, w, x, dq_loc, dlat_loc, saved, dx, grads);
}

#define LAGA_INSTANTIATE(T)                                                                      \
  template void explicit_forward<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&,  \
                                    Tensor<T>&, MlaSaved<T>&);                                   \
  template void explicit_backward<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&, \
                                     const Tensor<T>&, MlaSaved<T>&, Tensor<T>&, MlaParams<T>&);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::detail
