// LAGA (Latent All-Gather Attention): Q crosses the wire seq->head, the small
// latent [c_hat | k_pe] is all-gathered, and each rank up-projects K/V for its
// OWN heads only from the gathered latent. The attention is then exactly the
// explicit form's, on the same (B, S, H_r, .) tensors; only the wire differs.
//
// Backward: the all-gather's adjoint is a reduce-scatter of d[c_hat | k_pe];
// this rank's wkv_b gradient covers its head rows over the full sequence
// (explicit's covers all rows over local tokens); the all-reduce sums both to
// the same total.
#include <cstring>

#include "kernels/gemm.hpp"
#include "mla/block_internal.hpp"
#include "mla/exchange.hpp"

namespace laga::detail {

template <class T>
void laga_forward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                  Tensor<T>& out, MlaSaved<T>& saved) {
  const Dims d(ctx);
  const bool run = computing();
  const std::int64_t W = d.C + d.dr, KV = d.dn + d.dv;
  Tensor<T> q = project_q(ctx, w, x, saved);
  {
    Tensor<T> c_hat = project_latent(ctx, w, x, saved);
    saved.q_h = Tensor<T>({d.B, d.S, d.Hr, d.dqk});
    seq_to_head(ctx.comm, ctx.layout, q.data(), saved.q_h.data(), d.dqk, "q_a2a");
    q.reset();
    gather_latent(ctx, c_hat, saved);
  }

  // kv_h (B*S, H_r*(dn+dv)) = c_hat wkv_b[H_r rows]^T: the H_r slice of
  // explicit's up-projection, over the full sequence.
  saved.k_h = Tensor<T>({d.B, d.S, d.Hr, d.dqk});
  saved.v_h = Tensor<T>({d.B, d.S, d.Hr, d.dv});
  {
    Tensor<T> kv_h({d.B, d.S, d.Hr * KV});
    if (run && d.Hr > 0) {
      gemm<T>(false, true, d.NS, d.Hr * KV, d.C, T(1), saved.lat.data(), W,
              w.wkv_b.data() + d.h0 * KV * d.C, d.C, T(0), kv_h.data(), d.Hr * KV);
      split_kv(d, d.NS, d.Hr, kv_h.data(), saved.lat.data() + d.C, W, saved.k_h.data(),
               saved.v_h.data());
    }
  }

  const AttnShape s{d.B, d.S, d.S, d.Hr, d.Hr, d.dqk, d.dv, ctx.cfg.softmax_scale(), true};
  saved.o_att = Tensor<T>({d.B, d.S, d.Hr, d.dv});
  attention_forward(ctx, s, saved.o_att.data(), saved.q_h.data(), saved.k_h.data(),
                    saved.v_h.data(), saved);
  project_out(ctx, w, saved.o_att.data(), out, saved);
  if (ctx.attention == AttentionKind::eager) saved.o_att.reset();
}

template <class T>
void laga_backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                   const Tensor<T>& dout, MlaSaved<T>& saved, Tensor<T>& dx, MlaParams<T>& grads) {
  const Dims d(ctx);
  const bool run = computing();
  const std::int64_t W = d.C + d.dr, KV = d.dn + d.dv;
  Tensor<T> do_h = project_out_backward(ctx, w, dout, saved, grads);

  Tensor<T> dq_h, dk_h, dv_h;
  head_attention_backward(ctx, saved, do_h, dq_h, dk_h, dv_h);

  Tensor<T> dq_loc({d.B, d.L, d.H * d.dqk});
  head_to_seq(ctx.comm, ctx.layout, dq_h.data(), dq_loc.data(), d.dqk, "q_a2a");
  dq_h.reset();

  // d[c_hat | k_pe] over the full sequence from this rank's heads.
  Tensor<T> dlat = Tensor<T>::zeros({d.B, d.S, W});
  {
    Tensor<T> dkv_h({d.B, d.S, d.Hr * KV});
    if (run && d.Hr > 0)
      merge_dkv(d, d.NS, d.Hr, dk_h.data(), dv_h.data(), dkv_h.data(), dlat.data() + d.C, W);
    dk_h.reset(), dv_h.reset();
    if (run && d.Hr > 0) {
      const T* wkv_b_r = w.wkv_b.data() + d.h0 * KV * d.C;
      gemm<T>(false, false, d.NS, d.C, d.Hr * KV, T(1), dkv_h.data(), d.Hr * KV, wkv_b_r, d.C, T(0),
              dlat.data(), W);
      gemm<T>(true, false, d.Hr * KV, d.C, d.NS, T(1), dkv_h.data(), d.Hr * KV, saved.lat.data(), W,
              T(1), grads.wkv_b.data() + d.h0 * KV * d.C, d.C);
    }
  }
  saved.lat.reset();
  Tensor<T> dlat_loc({d.B, d.L, W});
  reduce_scatter_seq(ctx.comm, ctx.layout, dlat.data(), dlat_loc.data(), W, "latent_ag");
  dlat.reset();
  project_in_backward(ctx, w, x, dq_loc, dlat_loc, saved, dx, grads);
}

#define LAGA_INSTANTIATE(T)                                                                  \
  template void laga_forward<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&,  \
                                Tensor<T>&, MlaSaved<T>&);                                   \
  template void laga_backward<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&, \
                                 const Tensor<T>&, MlaSaved<T>&, Tensor<T>&, MlaParams<T>&);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::detail
