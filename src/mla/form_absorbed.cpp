// Absorbed form (B2, the inference-time absorb trick ported to training):
// W_UK is folded into the query and W_UV applied after attention, so the
// attention runs in latent space against ONE key set [c_hat | k_pe] (width
// C+dr) and ONE value set c_hat (width C) shared by all heads:
//
//   q_abs[h] = [q_nope[h] W_UK[h] | q_pe[h]]   (B, S, H_r, C+dr)
//   o_lat[h] = softmax(q_abs[h] . [c_hat | k_pe]^T * scale) c_hat   (B, S, H_r, C)
//   o[h]     = o_lat[h] W_UV[h]^T               (B, S, H_r, dv)
//
// with W_UK[h] = wkv_b rows h(dn+dv) .. +dn (dn, C) and W_UV[h] the next dv
// rows (dv, C). The scores equal explicit's exactly (q_nope . (W_UK c) =
// (q_nope W_UK) . c), but q_abs and o_lat are H_r * C wide per token where
// explicit's K/V are H_r * (dqk + dv): the activation-memory trap the paper
// measures once C > dn.
#include <cstring>

#include "kernels/gemm.hpp"
#include "mla/block_internal.hpp"
#include "mla/exchange.hpp"

namespace laga::detail {

template <class T>
void absorbed_forward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
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
  // The attention kernel takes values as their own contiguous tensor.
  saved.v_lat = Tensor<T>({d.B, d.S, d.C});
  saved.q_abs = Tensor<T>({d.B, d.S, d.Hr, W});
  if (run) {
    for (std::int64_t n = 0; n < d.NS; ++n)
      std::memcpy(saved.v_lat.data() + n * d.C, saved.lat.data() + n * W, sizeof(T) * u(d.C));
    for (std::int64_t h = 0; h < d.Hr; ++h) {
      const T* w_uk = w.wkv_b.data() + (d.h0 + h) * KV * d.C;
      gemm<T>(false, false, d.NS, d.C, d.dn, T(1), saved.q_h.data() + h * d.dqk, d.Hr * d.dqk, w_uk,
              d.C, T(0), saved.q_abs.data() + h * W, d.Hr * W);
      for (std::int64_t n = 0; n < d.NS; ++n)
        std::memcpy(saved.q_abs.data() + (n * d.Hr + h) * W + d.C,
                    saved.q_h.data() + (n * d.Hr + h) * d.dqk + d.dn, sizeof(T) * u(d.dr));
    }
  }
  const AttnShape s{d.B, d.S, d.S, d.Hr, 1, W, d.C, ctx.cfg.softmax_scale(), true};
  saved.o_att = Tensor<T>({d.B, d.S, d.Hr, d.C});  // o_lat: W_UV's gradient needs it
  attention_forward(ctx, s, saved.o_att.data(), saved.q_abs.data(), saved.lat.data(),
                    saved.v_lat.data(), saved);
  Tensor<T> o_h({d.B, d.S, d.Hr, d.dv});
  if (run)
    for (std::int64_t h = 0; h < d.Hr; ++h) {
      const T* w_uv = w.wkv_b.data() + ((d.h0 + h) * KV + d.dn) * d.C;
      gemm<T>(false, true, d.NS, d.dv, d.C, T(1), saved.o_att.data() + h * d.C, d.Hr * d.C, w_uv,
              d.C, T(0), o_h.data() + h * d.dv, d.Hr * d.dv);
    }
  project_out(ctx, w, o_h.data(), out, saved);
}

template <class T>
void absorbed_backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                       const Tensor<T>& dout, MlaSaved<T>& saved, Tensor<T>& dx,
                       MlaParams<T>& grads) {
  const Dims d(ctx);
  const bool run = computing();
  const std::int64_t W = d.C + d.dr, KV = d.dn + d.dv;
  Tensor<T> do_h = project_out_backward(ctx, w, dout, saved, grads);

  // Through o = o_lat W_UV^T.
  Tensor<T> do_lat({d.B, d.S, d.Hr, d.C});
  if (run)
    for (std::int64_t h = 0; h < d.Hr; ++h) {
      const std::int64_t row = (d.h0 + h) * KV + d.dn;
      gemm<T>(false, false, d.NS, d.C, d.dv, T(1), do_h.data() + h * d.dv, d.Hr * d.dv,
              w.wkv_b.data() + row * d.C, d.C, T(0), do_lat.data() + h * d.C, d.Hr * d.C);
      gemm<T>(true, false, d.dv, d.C, d.NS, T(1), do_h.data() + h * d.dv, d.Hr * d.dv,
              saved.o_att.data() + h * d.C, d.Hr * d.C, T(1), grads.wkv_b.data() + row * d.C, d.C);
    }
  do_h.reset();

  const AttnShape s{d.B, d.S, d.S, d.Hr, 1, W, d.C, ctx.cfg.softmax_scale(), true};
  Tensor<T> dq_abs({d.B, d.S, d.Hr, W});
  Tensor<T> dlat({d.B, d.S, W});  // d keys; d values are added below
  {
    Tensor<T> dv_lat({d.B, d.S, d.C});
    attention_backward(ctx, s, dq_abs.data(), dlat.data(), dv_lat.data(), do_lat.data(),
                       saved.q_abs.data(), saved.lat.data(), saved.v_lat.data(), saved.o_att.data(),
                       saved);
    if (run)
      for (std::int64_t n = 0; n < d.NS; ++n)
        for (std::int64_t c = 0; c < d.C; ++c) dlat.data()[n * W + c] += dv_lat.data()[n * d.C + c];
  }
  if (!run || d.Hr == 0) dlat.fill(T(0));  // no heads: this rank adds nothing to d latent
  do_lat.reset();
  saved.o_att.reset(), saved.q_abs.reset(), saved.v_lat.reset(), saved.lat.reset();

  // Through q_abs = [q_nope W_UK | q_pe].
  Tensor<T> dq_h({d.B, d.S, d.Hr, d.dqk});
  if (run)
    for (std::int64_t h = 0; h < d.Hr; ++h) {
      const std::int64_t row = (d.h0 + h) * KV;
      gemm<T>(false, true, d.NS, d.dn, d.C, T(1), dq_abs.data() + h * W, d.Hr * W,
              w.wkv_b.data() + row * d.C, d.C, T(0), dq_h.data() + h * d.dqk, d.Hr * d.dqk);
      gemm<T>(true, false, d.dn, d.C, d.NS, T(1), saved.q_h.data() + h * d.dqk, d.Hr * d.dqk,
              dq_abs.data() + h * W, d.Hr * W, T(1), grads.wkv_b.data() + row * d.C, d.C);
      for (std::int64_t n = 0; n < d.NS; ++n)
        std::memcpy(dq_h.data() + (n * d.Hr + h) * d.dqk + d.dn,
                    dq_abs.data() + (n * d.Hr + h) * W + d.C, sizeof(T) * u(d.dr));
    }
  dq_abs.reset();
  saved.q_h.reset();

  Tensor<T> dq_loc({d.B, d.L, d.H * d.dqk});
  head_to_seq(ctx.comm, ctx.layout, dq_h.data(), dq_loc.data(), d.dqk, "q_a2a");
  dq_h.reset();
  Tensor<T> dlat_loc({d.B, d.L, W});
  reduce_scatter_seq(ctx.comm, ctx.layout, dlat.data(), dlat_loc.data(), W, "latent_ag");
  dlat.reset();
  project_in_backward(ctx, w, x, dq_loc, dlat_loc, saved, dx, grads);
}

#define LAGA_INSTANTIATE(T)                                                                      \
  template void absorbed_forward<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&,  \
                                    Tensor<T>&, MlaSaved<T>&);                                   \
  template void absorbed_backward<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&, \
                                     const Tensor<T>&, MlaSaved<T>&, Tensor<T>&, MlaParams<T>&);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::detail
