#include "mla/block.hpp"

#include <cstring>

#include "core/error.hpp"
#include "kernels/attention_flash.hpp"
#include "kernels/gemm.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/rope.hpp"
#include "mla/block_internal.hpp"
#include "mla/exchange.hpp"

namespace laga {

const char* to_string(Form f) {
  switch (f) {
    case Form::explicit_form:
      return "explicit";
    case Form::absorbed:
      return "absorbed";
    case Form::laga:
      return "laga";
  }
  return "?";
}

Form parse_form(const std::string& s) {
  if (s == "explicit") return Form::explicit_form;
  if (s == "absorbed") return Form::absorbed;
  if (s == "laga") return Form::laga;
  fail("unknown form '", s, "'; choose explicit, absorbed or laga");
}

const char* to_string(AttentionKind a) {
  return a == AttentionKind::eager ? "eager" : "flash";
}

AttentionKind parse_attention(const std::string& s) {
  if (s == "eager") return AttentionKind::eager;
  if (s == "flash") return AttentionKind::flash;
  fail("unknown attention kernel '", s, "'; choose eager or flash");
}

template <class T>
void MlaSaved<T>::clear() {
  for (Tensor<T>* t : {&qa, &q_rstd, &qn, &kv_a, &kv_rstd, &c_hat, &o_loc, &q_h, &k_h, &v_h, &lat,
                       &v_lat, &q_abs, &o_att, &attn_stats})
    t->reset();
}

namespace detail {

Dims::Dims(const BlockContext& ctx) {
  const MlaConfig& c = ctx.cfg;
  const SpLayout& lay = ctx.layout;
  const int r = ctx.comm.rank();
  LAGA_CHECK(ctx.comm.size() == lay.ranks, "block: the communicator has ", ctx.comm.size(),
             " ranks but the layout was made for ", lay.ranks);
  LAGA_CHECK(lay.heads == c.n_heads, "block: the layout splits ", lay.heads,
             " heads but the config has n_heads = ", c.n_heads);
  LAGA_CHECK(ctx.rope.positions() >= lay.seq, "block: the RoPE table covers ", ctx.rope.positions(),
             " positions but the sequence has ", lay.seq);
  B = lay.batch, L = lay.seq_count[u(r)], S = lay.seq, N = B * L, NS = B * S;
  D = c.dim, H = c.n_heads, Hr = lay.head_count[u(r)], h0 = lay.head_offset[u(r)];
  dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dqk = dn + dr, dv = c.v_head_dim;
  C = c.kv_lora_rank, rq = c.q_lora_rank, pos0 = lay.seq_offset[u(r)];
}

template <class T>
Tensor<T> project_q(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                    MlaSaved<T>& saved) {
  const Dims d(ctx);
  const bool run = computing();
  Tensor<T> q({d.B, d.L, d.H * d.dqk});
  if (d.rq == 0) {
    if (run) linear_forward(q.data(), x.data(), w.wq.data(), d.N, d.D, d.H * d.dqk);
  } else {
    saved.qa = Tensor<T>({d.B, d.L, d.rq});
    saved.q_rstd = Tensor<T>({d.B, d.L});
    saved.qn = Tensor<T>({d.B, d.L, d.rq});
    if (run) {
      linear_forward(saved.qa.data(), x.data(), w.wq_a.data(), d.N, d.D, d.rq);
      rmsnorm_forward(saved.qn.data(), saved.q_rstd.data(), saved.qa.data(), d.rq, w.q_norm.data(),
                      d.N, d.rq, ctx.cfg.norm_eps);
      linear_forward(q.data(), saved.qn.data(), w.wq_b.data(), d.N, d.rq, d.H * d.dqk);
    }
  }
  if (run) rope_apply(q.data() + d.dn, d.B, d.L, d.H, d.H * d.dqk, d.dqk, d.pos0, ctx.rope, false);
  return q;
}

template <class T>
Tensor<T> project_latent(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                         MlaSaved<T>& saved) {
  const Dims d(ctx);
  const bool run = computing();
  const std::int64_t W = d.C + d.dr;
  saved.kv_a = Tensor<T>({d.B, d.L, W});
  saved.kv_rstd = Tensor<T>({d.B, d.L});
  Tensor<T> c_hat({d.B, d.L, d.C});
  if (run) {
    linear_forward(saved.kv_a.data(), x.data(), w.wkv_a.data(), d.N, d.D, W);
    rope_apply(saved.kv_a.data() + d.C, d.B, d.L, 1, W, 0, d.pos0, ctx.rope, false);
    rmsnorm_forward(c_hat.data(), saved.kv_rstd.data(), saved.kv_a.data(), W, w.kv_norm.data(), d.N,
                    d.C, ctx.cfg.norm_eps);
  }
  return c_hat;
}

template <class T>
void gather_latent(const BlockContext& ctx, const Tensor<T>& c_hat, MlaSaved<T>& saved) {
  const Dims d(ctx);
  const std::int64_t W = d.C + d.dr;
  // The all-gather's send buffer: [c_hat | k_pe] per local token.
  Tensor<T> lat_loc({d.B, d.L, W}, MemCategory::comm_buffers);
  if (computing())
    for (std::int64_t n = 0; n < d.N; ++n) {
      std::memcpy(lat_loc.data() + n * W, c_hat.data() + n * d.C, sizeof(T) * u(d.C));
      std::memcpy(lat_loc.data() + n * W + d.C, saved.kv_a.data() + n * W + d.C,
                  sizeof(T) * u(d.dr));
    }
  saved.lat = Tensor<T>({d.B, d.S, W});
  gather_seq(ctx.comm, ctx.layout, lat_loc.data(), saved.lat.data(), W, "latent_ag");
}

template <class T>
void attention_forward(const BlockContext& ctx, const AttnShape& s, T* o, const T* q, const T* k,
                       const T* v, MlaSaved<T>& saved) {
  if (ctx.attention == AttentionKind::eager) {
    saved.attn_stats = Tensor<T>({s.B, s.Hq, s.Sq, s.Sk});
    if (computing() && s.Hq > 0) attention_eager_forward(s, o, saved.attn_stats.data(), q, k, v);
  } else {
    saved.attn_stats = Tensor<T>({s.B, s.Hq, s.Sq});
    if (computing() && s.Hq > 0) attention_flash_forward(s, o, saved.attn_stats.data(), q, k, v);
  }
}

template <class T>
void attention_backward(const BlockContext& ctx, const AttnShape& s, T* dq, T* dk, T* dv,
                        const T* dout, const T* q, const T* k, const T* v, const T* o,
                        MlaSaved<T>& saved) {
  if (ctx.attention == AttentionKind::eager) {
    Tensor<T> dp({s.Sq, s.Sk});  // one head's dp at a time
    if (computing() && s.Hq > 0)
      attention_eager_backward(s, dq, dk, dv, dout, q, k, v, saved.attn_stats.data(), dp.data());
  } else {
    if (computing() && s.Hq > 0)
      attention_flash_backward(s, dq, dk, dv, dout, q, k, v, o, saved.attn_stats.data());
  }
  saved.attn_stats.reset();
}

template <class T>
void project_out(const BlockContext& ctx, const MlaParams<T>& w, const T* o_h, Tensor<T>& out,
                 MlaSaved<T>& saved) {
  const Dims d(ctx);
  saved.o_loc = Tensor<T>({d.B, d.L, d.H * d.dv});
  head_to_seq(ctx.comm, ctx.layout, o_h, saved.o_loc.data(), d.dv, "out_a2a");
  out = Tensor<T>({d.B, d.L, d.D});
  if (computing())
    linear_forward(out.data(), saved.o_loc.data(), w.wo.data(), d.N, d.H * d.dv, d.D);
}

template <class T>
Tensor<T> project_out_backward(const BlockContext& ctx, const MlaParams<T>& w,
                               const Tensor<T>& dout, MlaSaved<T>& saved, MlaParams<T>& grads) {
  const Dims d(ctx);
  Tensor<T> do_loc({d.B, d.L, d.H * d.dv});
  if (computing())
    linear_backward(do_loc.data(), false, grads.wo.data(), dout.data(), saved.o_loc.data(),
                    w.wo.data(), d.N, d.H * d.dv, d.D);
  saved.o_loc.reset();
  Tensor<T> do_h({d.B, d.S, d.Hr, d.dv});
  seq_to_head(ctx.comm, ctx.layout, do_loc.data(), do_h.data(), d.dv, "out_a2a");
  return do_h;
}

template <class T>
void project_in_backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                         Tensor<T>& dq_loc, Tensor<T>& dlat_loc, MlaSaved<T>& saved, Tensor<T>& dx,
                         MlaParams<T>& grads) {
  const Dims d(ctx);
  const bool run = computing();
  const std::int64_t W = d.C + d.dr;
  dx = Tensor<T>({d.B, d.L, d.D});
  if (run) {
    // A rotation's Jacobian is its transpose: rotate the gradients back.
    rope_apply(dq_loc.data() + d.dn, d.B, d.L, d.H, d.H * d.dqk, d.dqk, d.pos0, ctx.rope, true);
    rope_apply(dlat_loc.data() + d.C, d.B, d.L, 1, W, 0, d.pos0, ctx.rope, true);
  }
  // d c_hat must be contiguous for the norm's backward, whose dx lands back in
  // dlat_loc's first C columns: dlat_loc becomes d kv_a = [d c | d k_pe].
  {
    Tensor<T> dc_hat({d.B, d.L, d.C});
    if (run) {
      for (std::int64_t n = 0; n < d.N; ++n)
        std::memcpy(dc_hat.data() + n * d.C, dlat_loc.data() + n * W, sizeof(T) * u(d.C));
      rmsnorm_backward(dlat_loc.data(), W, grads.kv_norm.data(), dc_hat.data(), saved.kv_a.data(),
                       w.kv_norm.data(), saved.kv_rstd.data(), d.N, d.C);
    }
  }
  saved.kv_rstd.reset();
  if (d.rq == 0) {
    if (run)
      linear_backward(dx.data(), false, grads.wq.data(), dq_loc.data(), x.data(), w.wq.data(), d.N,
                      d.D, d.H * d.dqk);
  } else {
    Tensor<T> dqn({d.B, d.L, d.rq});
    if (run)
      linear_backward(dqn.data(), false, grads.wq_b.data(), dq_loc.data(), saved.qn.data(),
                      w.wq_b.data(), d.N, d.rq, d.H * d.dqk);
    saved.qn.reset();
    Tensor<T> dqa({d.B, d.L, d.rq});
    if (run) {
      rmsnorm_backward(dqa.data(), d.rq, grads.q_norm.data(), dqn.data(), saved.qa.data(),
                       w.q_norm.data(), saved.q_rstd.data(), d.N, d.rq);
      linear_backward(dx.data(), false, grads.wq_a.data(), dqa.data(), x.data(), w.wq_a.data(), d.N,
                      d.D, d.rq);
    }
    saved.qa.reset();
    saved.q_rstd.reset();
  }
  dq_loc.reset();
  if (run)
    linear_backward(dx.data(), true, grads.wkv_a.data(), dlat_loc.data(), x.data(), w.wkv_a.data(),
                    d.N, d.D, W);
  dlat_loc.reset();
  saved.kv_a.reset();
}

template <class T>
void split_kv(const Dims& d, std::int64_t rows, std::int64_t heads, const T* kv, const T* kpe,
              std::int64_t ld_kpe, T* k, T* v) {
  const std::int64_t KV = d.dn + d.dv;
  for (std::int64_t n = 0; n < rows; ++n)
    for (std::int64_t h = 0; h < heads; ++h) {
      const T* src = kv + (n * heads + h) * KV;
      T* kh = k + (n * heads + h) * d.dqk;
      std::memcpy(kh, src, sizeof(T) * u(d.dn));
      std::memcpy(kh + d.dn, kpe + n * ld_kpe, sizeof(T) * u(d.dr));
      std::memcpy(v + (n * heads + h) * d.dv, src + d.dn, sizeof(T) * u(d.dv));
    }
}

template <class T>
void merge_dkv(const Dims& d, std::int64_t rows, std::int64_t heads, const T* dk, const T* dv,
               T* dkv, T* dkpe, std::int64_t ld_dkpe) {
  const std::int64_t KV = d.dn + d.dv;
  for (std::int64_t n = 0; n < rows; ++n) {
    T* dpe = dkpe + n * ld_dkpe;
    for (std::int64_t h = 0; h < heads; ++h) {
      const T* dkh = dk + (n * heads + h) * d.dqk;
      T* dst = dkv + (n * heads + h) * KV;
      std::memcpy(dst, dkh, sizeof(T) * u(d.dn));
      std::memcpy(dst + d.dn, dv + (n * heads + h) * d.dv, sizeof(T) * u(d.dv));
      for (std::int64_t i = 0; i < d.dr; ++i) dpe[i] += dkh[d.dn + i];
    }
  }
}

template <class T>
void head_attention_backward(const BlockContext& ctx, MlaSaved<T>& saved, Tensor<T>& do_h,
                             Tensor<T>& dq_h, Tensor<T>& dk_h, Tensor<T>& dv_h) {
  const Dims d(ctx);
  const AttnShape s{d.B, d.S, d.S, d.Hr, d.Hr, d.dqk, d.dv, ctx.cfg.softmax_scale(), true};
  dq_h = Tensor<T>({d.B, d.S, d.Hr, d.dqk});
  dk_h = Tensor<T>({d.B, d.S, d.Hr, d.dqk});
  dv_h = Tensor<T>({d.B, d.S, d.Hr, d.dv});
  attention_backward(ctx, s, dq_h.data(), dk_h.data(), dv_h.data(), do_h.data(), saved.q_h.data(),
                     saved.k_h.data(), saved.v_h.data(), saved.o_att.data(), saved);
  do_h.reset();
  saved.q_h.reset(), saved.k_h.reset(), saved.v_h.reset(), saved.o_att.reset();
}

}  // namespace detail

template <class T>
void mla_forward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x, Tensor<T>& out,
                 MlaSaved<T>& saved) {
  const detail::Dims d(ctx);
  LAGA_CHECK(x.shape() == Shape({d.B, d.L, d.D}), "mla_forward: x on rank ", ctx.comm.rank(),
             " has shape ", to_string(x.shape()), " but this rank's shard needs ",
             to_string(Shape{d.B, d.L, d.D}));
  saved.clear();
  ctx.comm.set_phase(Phase::forward);
  switch (ctx.form) {
    case Form::explicit_form:
      detail::explicit_forward(ctx, w, x, out, saved);
      break;
    case Form::laga:
      detail::laga_forward(ctx, w, x, out, saved);
      break;
    case Form::absorbed:
      detail::absorbed_forward(ctx, w, x, out, saved);
      break;
  }
}

template <class T>
void mla_backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                  const Tensor<T>& dout, MlaSaved<T>& saved, Tensor<T>& dx, MlaParams<T>& grads) {
  LAGA_CHECK(dout.shape() == x.shape(), "mla_backward: dout has shape ", to_string(dout.shape()),
             " but x has ", to_string(x.shape()));
  ctx.comm.set_phase(Phase::backward);
  switch (ctx.form) {
    case Form::explicit_form:
      detail::explicit_backward(ctx, w, x, dout, saved, dx, grads);
      break;
    case Form::laga:
      detail::laga_backward(ctx, w, x, dout, saved, dx, grads);
      break;
    case Form::absorbed:
      detail::absorbed_backward(ctx, w, x, dout, saved, dx, grads);
      break;
  }
  saved.clear();
}

template <class T>
void mla_sync_gradients(Communicator& comm, MlaParams<T>& grads) {
  comm.set_phase(Phase::grad_sync);
  Tensor<T> flat({grads.numel()}, MemCategory::comm_buffers);
  const bool run = detail::computing();
  std::int64_t off = 0;
  grads.for_each([&](const std::string&, Tensor<T>& g) {
    if (run) std::memcpy(flat.data() + off, g.data(), static_cast<size_t>(g.bytes()));
    off += g.numel();
  });
  comm.all_reduce(flat.data(), flat.numel(), "grad_allreduce");
  off = 0;
  grads.for_each([&](const std::string&, Tensor<T>& g) {
    if (run) std::memcpy(g.data(), flat.data() + off, static_cast<size_t>(g.bytes()));
    off += g.numel();
  });
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template struct MlaSaved<T>;                                                                     \
  template void mla_forward<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&,         \
                               Tensor<T>&, MlaSaved<T>&);                                          \
  template void mla_backward<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&,        \
                                const Tensor<T>&, MlaSaved<T>&, Tensor<T>&, MlaParams<T>&);        \
  template void mla_sync_gradients<T>(Communicator&, MlaParams<T>&);                               \
  namespace detail {                                                                               \
  template Tensor<T> project_q<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&,      \
                                  MlaSaved<T>&);                                                   \
  template Tensor<T> project_latent<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&, \
                                       MlaSaved<T>&);                                              \
  template void gather_latent<T>(const BlockContext&, const Tensor<T>&, MlaSaved<T>&);             \
  template void attention_forward<T>(const BlockContext&, const AttnShape&, T*, const T*,          \
                                     const T*, const T*, MlaSaved<T>&);                            \
  template void attention_backward<T>(const BlockContext&, const AttnShape&, T*, T*, T*, const T*, \
                                      const T*, const T*, const T*, const T*, MlaSaved<T>&);       \
  template void project_out<T>(const BlockContext&, const MlaParams<T>&, const T*, Tensor<T>&,     \
                               MlaSaved<T>&);                                                      \
  template Tensor<T> project_out_backward<T>(const BlockContext&, const MlaParams<T>&,             \
                                             const Tensor<T>&, MlaSaved<T>&, MlaParams<T>&);       \
  template void split_kv<T>(const Dims&, std::int64_t, std::int64_t, const T*, const T*,           \
                            std::int64_t, T*, T*);                                                 \
  template void merge_dkv<T>(const Dims&, std::int64_t, std::int64_t, const T*, const T*, T*, T*,  \
                             std::int64_t);                                                        \
  template void head_attention_backward<T>(const BlockContext&, MlaSaved<T>&, Tensor<T>&,          \
                                           Tensor<T>&, Tensor<T>&, Tensor<T>&);                    \
  template void project_in_backward<T>(const BlockContext&, const MlaParams<T>&, const Tensor<T>&, \
                                       Tensor<T>&, Tensor<T>&, MlaSaved<T>&, Tensor<T>&,           \
                                       MlaParams<T>&);                                             \
  }
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
