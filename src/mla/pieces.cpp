// The pieces every form shares (form.hpp, Pieces): the input projections,
// the exchanges as the forms use them, laga's up-projection, the head
// attention on tensors and the output projection. The attention kernels
// themselves are the op layer's (ops_attention.hpp).
#include <algorithm>
#include <type_traits>
#include <utility>

#include "core/error.hpp"
#include "mla/canonical_sum.hpp"
#include "mla/exchange.hpp"
#include "mla/form.hpp"
#include "mla/ops_attention.hpp"
#include "mla/ops_model.hpp"

namespace laga::detail {

using ops::mat;

namespace {
// The invariant mode's shards (docs/invariance.md), as the closed forms read
// them (ops::sequence_shards, ops::head_column_shards): the sequence's, and
// the heads' columns of a sum over the heads (per_head columns a head: laga's
// latent gradient dn + dv + dr, absorbed's and laga_fused's parts C + dr).
ops::TokenShards token_shards(const Step& st) {
  return ops::sequence_shards(st.ctx.layout);
}
ops::TokenShards head_column_shards(const Step& st, std::int64_t per_head) {
  return ops::head_column_shards(st.ctx.layout, per_head);
}
// A weight's gradient summed over the tokens canonically, added on rank 0
// only: the gradient all-reduce adds the other ranks' zeros to it.
template <class T>
void token_grad(const Step& st, Tensor<T>& g, ops::In<T> dy, ops::In<T> x, const char* label) {
  ops::canonical_token_sum(st.ctx.comm, mat(g), dy, x, token_shards(st), label,
                           st.ctx.comm.rank() == 0);
}
// A linear layer's backward on a step: dx (none when null) = dy W, beta 0
// or added to when accumulate_dx; W's gradient += dy^T x, this rank's
// partial sum for the gradient all-reduce, or in the invariant mode the
// canonical sum over the tokens under `label` (token_grad; x held narrowed
// is widened by the caller first, ops::widen_kept).
template <class T>
void linear_backward_tokens(const Step& st, ops::Mat<T>* dx, bool accumulate_dx, Tensor<T>& dw,
                            ops::In<T> dy, const Tensor<T>& x, const Tensor<T>& w,
                            const char* label) {
  if (!ops::op_invariant) return ops::linear_backward(dx, accumulate_dx, dw, dy, x, w);
  if (dx) ops::gemm(*dx, accumulate_dx ? T(1) : T(0), dy, false, mat(w), false);
  token_grad(st, dw, dy, mat(x), label);
}

// The first `keys` tokens of every row of a (B, S, .) tensor and of a
// (B, keys, .) one, as blocks of rows both hold contiguously: f(row in the
// (B S) rows, row in the (B keys) rows, rows). One block of all B S rows when
// keys = S (so laga's GEMMs are one call, as before laga2d shared them), else
// one per batch row.
template <class F>
void for_key_blocks(const Step& st, std::int64_t keys, F&& f) {
  if (keys == st.S) return f(std::int64_t(0), std::int64_t(0), st.NS);
  ops::for_batch_rows(st.B, [&](std::int64_t b) { f(b * st.S, b * keys, keys); });
}
}  // namespace

template <class T>
void Pieces<T>::project_in(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                           InputSaved<T>& in) {
  // One GEMM, N = Nq + C + dr wide, where the latent's alone (N = C + dr)
  // would be a skinny GEMM well below the machine's rate.
  in.proj = Tensor<T>({st.B, st.L, st.Nq + st.W}, "proj");
  const ops::Mat<T> proj = mat(in.proj);
  ops::linear(proj, mat(x), w.in_proj);
  st.rope(proj.col_range(st.Nq + st.C, st.dr), 1, 0, false);
  if (st.rq == 0) st.rope(proj.col_range(st.dn, st.Nq - st.dn), st.H, st.dqk, false);
  if (st.ctx.cfg.mla_use_output_gate) {
    // Kimi K3's gate logits, g = x wg^T (its g_proj, on the layer input).
    in.gate = Tensor<T>({st.B, st.L, st.H * st.dv}, "gate");
    ops::linear(mat(in.gate), mat(x), w.wg);
  }
}

template <class T>
void Pieces<T>::project_q_latent(const Step& st, const MlaParams<T>& w, InputSaved<T>& in) {
  in.q_rstd = Tensor<T>({st.B, st.L}, "q_rstd");
  in.qn = Tensor<T>({st.B, st.L, st.rq}, "qn");
  ops::rmsnorm(mat(in.qn), in.q_rstd, mat(in.proj).col_range(0, st.rq), w.q_norm,
               st.ctx.cfg.norm_eps);
}

template <class T>
Tensor<T> Pieces<T>::project_latent(const Step& st, const MlaParams<T>& w, InputSaved<T>& in,
                                    const char* c_hat_name) {
  const ops::Mat<const T> kv_a = mat(in.proj).col_range(st.Nq, st.W);
  in.kv_rstd = Tensor<T>({st.B, st.L}, "kv_rstd");
  Tensor<T> c_hat({st.B, st.L, st.C}, c_hat_name);
  ops::rmsnorm(mat(c_hat), in.kv_rstd, kv_a.col_range(0, st.C), w.kv_norm, st.ctx.cfg.norm_eps);
  if (st.rq == 0) {
    in.kv_a = Tensor<T>({st.B, st.L, st.W}, "kv_a");
    ops::copy(mat(in.kv_a), kv_a);
  }
  return c_hat;
}

template <class T>
Tensor<T> Pieces<T>::queries_to_heads(const Step& st, const MlaParams<T>& w, InputSaved<T>& in) {
  if (st.rq == 0) {
    LAGA_CHECK(in.kv_a.defined(),
               "internal: queries_to_heads before project_latent would free proj before kv_a is "
               "copied out of it");
    Tensor<T> q_h =
        to_heads(st, mat(std::as_const(in.proj)).col_range(0, st.Nq), st.dqk, "q_a2a", "q_h");
    in.proj.reset();
    return q_h;
  }
  project_q_latent(st, w, in);
  Tensor<T> q({st.B, st.L, st.H * st.dqk}, "q");
  ops::linear(mat(q), mat(in.qn), w.wq_b);
  st.rope(mat(q).col_range(st.dn, st.H * st.dqk - st.dn), st.H, st.dqk, false);
  return to_heads(st, q, st.dqk, "q_a2a", "q_h");
}

template <class T>
Tensor<T> Pieces<T>::local_queries(const Step& st, const MlaParams<T>& w, InputSaved<T>& in) {
  Tensor<T> q({st.B, st.L, st.H * st.dqk}, "q_h");
  if (st.rq == 0) {
    LAGA_CHECK(in.kv_a.defined(),
               "internal: local_queries before project_latent would free proj before kv_a is "
               "copied out of it");
    ops::copy(mat(q), mat(std::as_const(in.proj)).col_range(0, st.Nq));
    in.proj.reset();
    return q;
  }
  project_q_latent(st, w, in);
  ops::linear(mat(q), mat(in.qn), w.wq_b);
  st.rope(mat(q).col_range(st.dn, st.H * st.dqk - st.dn), st.H, st.dqk, false);
  return q;
}

template <class T>
Tensor<T> Pieces<T>::local_queries_backward(const Step& st, Tensor<T>& dq, Tensor<T>& dproj) {
  if (st.rq > 0) return std::move(dq);
  dproj = Tensor<T>({st.B, st.L, st.Nq + st.W}, "dproj");
  ops::copy(mat(dproj).col_range(0, st.Nq), mat(std::as_const(dq)));
  dq.reset();
  return {};
}

template <class T>
Tensor<T> Pieces<T>::queries_to_tokens(const Step& st, Tensor<T>& dq_h, Tensor<T>& dproj) {
  if (st.rq > 0) return to_tokens(st, dq_h, st.dqk, "q_a2a", "dq_loc");
  dproj = Tensor<T>({st.B, st.L, st.Nq + st.W}, "dproj");
  redistribute(st.ctx.comm, st.B, st.attention, st.tokens, dq_h.data(), dproj.data(), st.dqk,
               "q_a2a", 0, st.Nq + st.W);
  dq_h.reset();
  return {};
}

template <class T>
Tensor<T> Pieces<T>::gather_latent(const Step& st, const Tensor<T>& c_hat, ops::In<T> kv_a,
                                   StartedSeq<T>* started) {
  // The all-gather's send buffer: [c_hat | k_pe] per local token.
  Tensor<T> lat_loc({st.B, st.L, st.W}, "lat_loc", MemCategory::comm_buffers);
  ops::copy(mat(lat_loc).col_range(0, st.C), mat(c_hat));
  ops::copy(mat(lat_loc).col_range(st.C, st.dr), kv_a.col_range(st.C, st.dr));
  Tensor<T> lat({st.B, st.S, st.W}, "lat");
  if (started)  // lat_loc goes with it: the collective reads it until the wait
    *started = start_gather_seq(st.ctx.comm, st.ctx.layout, std::move(lat_loc), lat.data(), st.W,
                                "latent_ag");
  else
    gather_seq(st.ctx.comm, st.ctx.layout, lat_loc.data(), lat.data(), st.W, "latent_ag");
  return lat;
}

template <class T>
void Pieces<T>::up_project_kv(const Step& st, const MlaParams<T>& w, const Tensor<T>& lat,
                              std::int64_t keys, Tensor<T>& k, Tensor<T>& v) {
  k = Tensor<T>({st.B, keys, st.Hr, st.dqk}, "k_h");
  v = Tensor<T>({st.B, keys, st.Hr, st.dv}, "v_h");
  // kv_h (B keys, H_r (dn+dv)) = c_hat wkv_b[H_r heads' rows]^T: the H_r slice
  // of explicit's up-projection, over the keys.
  Tensor<T> kv_h({st.B, keys, st.Hr * st.KV}, "kv_h");
  const ops::Mat<const T> wkv_b_r = mat(w.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV);
  const ops::Mat<const T> lat_m = mat(lat);
  ops::Mat<T> kv_m = mat(kv_h), k_m = mat(k, st.B * keys, st.Hr * st.dqk),
              v_m = mat(v, st.B * keys, st.Hr * st.dv);
  for_key_blocks(st, keys, [&](std::int64_t lat_row, std::int64_t key_row, std::int64_t rows) {
    const ops::Mat<const T> lat_b = lat_m.row_range(lat_row, rows);
    const ops::Mat<T> kv_b = kv_m.row_range(key_row, rows);
    ops::gemm(kv_b, T(0), lat_b.col_range(0, st.C), false, wkv_b_r, true);
    split_kv(st, st.Hr, kv_b, lat_b.col_range(st.C, st.dr), k_m.row_range(key_row, rows),
             v_m.row_range(key_row, rows));
  });
}

template <class T>
Tensor<T> Pieces<T>::up_project_kv_backward(const Step& st, const MlaParams<T>& w,
                                            const Tensor<T>& lat, std::int64_t keys, Tensor<T>& dk,
                                            Tensor<T>& dv, MlaParams<T>& grads) {
  if (ops::op_invariant) return up_project_kv_backward_invariant(st, w, lat, keys, dk, dv, grads);
  // d[c_hat | k_pe] of every token from this rank's heads (zero past the keys).
  Tensor<T> dlat = Tensor<T>::zeros({st.B, st.S, st.W}, "dlat");
  Tensor<T> dkv_h({st.B, keys, st.Hr * st.KV}, "dkv_h");
  const ops::Mat<const T> wkv_b_r = mat(w.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV);
  const ops::Mat<T> dwkv_b_r = mat(grads.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV);
  const ops::Mat<const T> lat_m = mat(lat),
                          dk_m = mat(std::as_const(dk), st.B * keys, st.Hr * st.dqk),
                          dv_m = mat(std::as_const(dv), st.B * keys, st.Hr * st.dv);
  const ops::Mat<T> dlat_m = mat(dlat), dkv_m = mat(dkv_h);
  for_key_blocks(st, keys, [&](std::int64_t lat_row, std::int64_t key_row, std::int64_t rows) {
    merge_dkv(st, st.Hr, dk_m.row_range(key_row, rows), dv_m.row_range(key_row, rows),
              dkv_m.row_range(key_row, rows),
              dlat_m.row_range(lat_row, rows).col_range(st.C, st.dr));
  });
  dk.reset(), dv.reset();  // before the GEMMs: they are not needed there
  for_key_blocks(st, keys, [&](std::int64_t lat_row, std::int64_t key_row, std::int64_t rows) {
    const ops::Mat<const T> dkv_b = dkv_m.row_range(key_row, rows);
    ops::gemm(dlat_m.row_range(lat_row, rows).col_range(0, st.C), T(0), dkv_b, false, wkv_b_r,
              false);
    ops::gemm(dwkv_b_r, T(1), dkv_b, true, lat_m.row_range(lat_row, rows).col_range(0, st.C),
              false);
  });
  return dlat;
}

// The invariant mode's (docs/invariance.md): wkv_b's gradient as above, and
// this rank's tokens' d[c_hat | k_pe] summed over every rank's heads by the
// canonical reduce-scatter, in place of the sum over this rank's heads and
// the reduce-scatter over the ranks (reduce_latent then passes it on).
template <class T>
Tensor<T> Pieces<T>::up_project_kv_backward_invariant(const Step& st, const MlaParams<T>& w,
                                                      const Tensor<T>& lat, std::int64_t keys,
                                                      Tensor<T>& dk, Tensor<T>& dv,
                                                      MlaParams<T>& grads) {
  LAGA_CHECK(keys == st.S, "internal: the invariant latent backward over ", keys, " keys of ",
             st.S);
  Tensor<T> dkv_h({st.B, keys, st.Hr * st.KV}, "dkv_h");
  Tensor<T> dk_pe({st.B, keys, st.dr}, "dk_pe summed (unused)");
  const ops::Mat<const T> wkv_b_r = mat(w.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV);
  const ops::Mat<T> dwkv_b_r = mat(grads.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV);
  const ops::Mat<const T> dk_m = mat(std::as_const(dk), st.B * keys, st.Hr * st.dqk),
                          dv_m = mat(std::as_const(dv), st.B * keys, st.Hr * st.dv);
  merge_dkv(st, st.Hr, dk_m, dv_m, mat(dkv_h), mat(dk_pe));
  dk_pe.reset();
  ops::gemm(dwkv_b_r, T(1), mat(std::as_const(dkv_h)), true, mat(lat).col_range(0, st.C), false);
  dkv_h.reset();
  Tensor<T> dlat_loc({st.B, st.L, st.W}, "dlat_loc");
  ops::canonical_latent_reduce_scatter(st.ctx.comm, mat(dlat_loc), dk_m, dv_m, wkv_b_r, st.Hr,
                                       st.dn, st.dr, head_column_shards(st, st.KV + st.dr),
                                       token_shards(st), "latent_ag");
  dk.reset(), dv.reset();
  return dlat_loc;
}

template <class T>
Tensor<T> Pieces<T>::latent_head_sum_invariant(const Step& st, Tensor<T>& dlat_heads) {
  Tensor<T> dlat_loc({st.B, st.L, st.W}, "dlat_loc");
  ops::canonical_parts_reduce_scatter(st.ctx.comm, mat(dlat_loc), dlat_heads,
                                      head_column_shards(st, 1), token_shards(st), "latent_ag");
  dlat_heads.reset();
  return dlat_loc;
}

template <class T>
Tensor<T> Pieces<T>::to_heads(const Step& st, Tensor<T>& loc, std::int64_t d, const char* label,
                              const char* name) {
  Tensor<T> h = to_heads(st, mat(std::as_const(loc)), d, label, name);
  loc.reset();
  return h;
}

template <class T>
Tensor<T> Pieces<T>::to_heads(const Step& st, ops::In<T> loc, std::int64_t d, const char* label,
                              const char* name) {
  Tensor<T> h({st.B, st.Sq, st.Hr, d}, name);
  redistribute(st.ctx.comm, st.B, st.tokens, st.attention, loc.p, h.data(), d, label, loc.ld);
  return h;
}

template <class T>
Tensor<T> Pieces<T>::to_tokens(const Step& st, Tensor<T>& h, std::int64_t d, const char* label,
                               const char* name) {
  Tensor<T> loc({st.B, st.L, st.H * d}, name);
  redistribute(st.ctx.comm, st.B, st.attention, st.tokens, h.data(), loc.data(), d, label);
  h.reset();
  return loc;
}

template <class T>
Tensor<T> Pieces<T>::reduce_latent(const Step& st, Tensor<T>& dlat, StartedSeq<T>* started) {
  if (ops::op_invariant) return std::move(dlat);  // the canonical reduce-scatter's already
  Tensor<T> dlat_loc({st.B, st.L, st.W}, "dlat_loc");
  if (started) {  // dlat goes with it: the collective may read it until the wait
    *started = start_reduce_scatter_seq(st.ctx.comm, st.ctx.layout, std::move(dlat),
                                        dlat_loc.data(), st.W, "latent_ag");
  } else {
    reduce_scatter_seq(st.ctx.comm, st.ctx.layout, dlat.data(), dlat_loc.data(), st.W, "latent_ag");
    dlat.reset();
  }
  return dlat_loc;
}

template <class T>
Tensor<T> Pieces<T>::attention_forward(const Step& st, const AttnShape& s, Tensor<T>& o,
                                       const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v) {
  const bool eager = st.ctx.attention == AttentionKind::eager;
  Tensor<T> stats(eager ? Shape{s.B, s.Hq, s.Sq, s.Sk} : Shape{s.B, s.Hq, s.Sq},
                  eager ? "attn_stats eager probs" : "attn_stats flash lse");
  ops::attention_forward(st.ctx.attention, s, o.data(), stats.data(), q.data(), k.data(), v.data());
  return stats;
}

template <class T>
void Pieces<T>::attention_backward(const Step& st, const AttnShape& s, Tensor<T>& dq, Tensor<T>& dk,
                                   Tensor<T>& dv, const Tensor<T>& dout, const Tensor<T>& q,
                                   const Tensor<T>& k, const Tensor<T>& v, const Tensor<T>& o,
                                   Tensor<T>& stats) {
  const bool eager = st.ctx.attention == AttentionKind::eager;
  Tensor<T> dp;  // eager: one head's dp at a time
  if (eager) dp = Tensor<T>({s.Sq, s.Sk}, "eager dp scratch");
  const ops::HeldOperands held{q.narrowed_data(),    k.narrowed_data(), v.narrowed_data(),
                               dout.narrowed_data(), q.narrowed(),      k.narrowed(),
                               v.narrowed(),         dout.narrowed()};
  const bool narrowed = q.narrowed() || k.narrowed() || v.narrowed() || dout.narrowed();
  ops::attention_backward(st.ctx.attention, s, dq.data(), dk.data(), dv.data(), dout.data(),
                          q.data(), k.data(), v.data(), o.data(), stats.data(), dp.data(), nullptr,
                          narrowed ? &held : nullptr);
  dp.reset();
  stats.reset();
}

template <class T>
void Pieces<T>::output_projection(const Step& st, const MlaParams<T>& w, const InputSaved<T>& in,
                                  const Tensor<T>& o_loc, Tensor<T>& out) {
  out = Tensor<T>({st.B, st.L, st.D}, "out");
  if (!st.ctx.cfg.mla_use_output_gate) return ops::linear(mat(out), mat(o_loc), w.wo);
  Tensor<T> gated({st.B, st.L, st.H * st.dv}, "o_gated");
  ops::output_gate(mat(gated), mat(o_loc), mat(in.gate));
  ops::linear(mat(out), mat(std::as_const(gated)), w.wo);
}

template <class T>
Tensor<T> Pieces<T>::output_projection_backward(const Step& st, const MlaParams<T>& w,
                                                InputSaved<T>& in, const Tensor<T>& dout,
                                                const Tensor<T>& o_loc, MlaParams<T>& grads,
                                                const char* name) {
  Tensor<T> do_loc({st.B, st.L, st.H * st.dv}, name);
  ops::Mat<T> do_loc_m = mat(do_loc);
  if (!st.ctx.cfg.mla_use_output_gate) {
    // o_loc may be held narrowed: wo's gradient reads it in place.
    linear_backward_tokens(st, &do_loc_m, false, grads.wo, mat(dout), o_loc, w.wo, "wo_grad");
    return do_loc;
  }
  // y = o_loc * sigmoid(g) again (wo's gradient reads it; not saved: one
  // elementwise pass against B L H dv more held from forward to backward).
  Tensor<T> gated({st.B, st.L, st.H * st.dv}, "o_gated");
  ops::output_gate(mat(gated), mat(o_loc), mat(std::as_const(in.gate)));
  Tensor<T> dgated({st.B, st.L, st.H * st.dv}, "do_gated");
  ops::Mat<T> dgated_m = mat(dgated);
  linear_backward_tokens(st, &dgated_m, false, grads.wo, mat(dout), gated, w.wo, "wo_grad");
  gated.reset();
  in.dgate = Tensor<T>({st.B, st.L, st.H * st.dv}, "dgate");
  ops::output_gate_backward(do_loc_m, mat(in.dgate), mat(std::as_const(dgated)), mat(o_loc),
                            mat(std::as_const(in.gate)));
  in.gate.reset();
  return do_loc;
}

template <class T>
Tensor<T> Pieces<T>::project_out(const Step& st, const MlaParams<T>& w, const InputSaved<T>& in,
                                 const Tensor<T>& o_h, Tensor<T>& out) {
  Tensor<T> o_loc({st.B, st.L, st.H * st.dv}, "o_loc");
  redistribute(st.ctx.comm, st.B, st.attention, st.tokens, o_h.data(), o_loc.data(), st.dv,
               "out_a2a");
  output_projection(st, w, in, o_loc, out);
  // Backward reads it only as wo's gradient's GEMM operand, rounded there;
  // the gate's backward reads it whole.
  if (!st.ctx.cfg.mla_use_output_gate) ops::keep_narrowed(o_loc);
  return o_loc;
}

template <class T>
Tensor<T> Pieces<T>::project_out_backward(const Step& st, const MlaParams<T>& w, InputSaved<T>& in,
                                          const Tensor<T>& dout, Tensor<T>& o_loc,
                                          MlaParams<T>& grads) {
  // The invariant mode's wo gradient reads o_loc as a plain matrix (token_grad).
  if (ops::op_invariant) ops::widen_kept(o_loc);
  Tensor<T> do_loc = output_projection_backward(st, w, in, dout, o_loc, grads, "do_loc");
  o_loc.reset();
  return to_heads(st, do_loc, st.dv, "out_a2a", "do_h");
}

template <class T>
void Pieces<T>::project_in_backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                    Tensor<T>& dq, Tensor<T>& dlat_loc, Tensor<T>& dproj,
                                    InputSaved<T>& in, Tensor<T>& dx, MlaParams<T>& grads,
                                    StartedSeq<T>* dlat_pending) {
  if (!dproj.defined()) dproj = Tensor<T>({st.B, st.L, st.Nq + st.W}, "dproj");
  if (dlat_pending) {
    query_backward(st, w, dq, in, dproj, grads);
    dlat_pending->wait(st.ctx.comm);
    latent_norm_backward(st, w, dlat_loc, in, dproj, grads);
  } else {
    latent_norm_backward(st, w, dlat_loc, in, dproj, grads);
    query_backward(st, w, dq, in, dproj, grads);
  }
  in.proj.reset(), in.kv_a.reset();
  // Both projections' backward in one GEMM each way: dx (N, D) = dproj
  // in_proj, and in_proj's gradient (wq's or wq_a's rows and wkv_a's)
  // += dproj^T x.
  dx = Tensor<T>({st.B, st.L, st.D}, "dx");
  ops::Mat<T> dx_m = mat(dx);
  linear_backward_tokens(st, &dx_m, false, grads.in_proj, mat(std::as_const(dproj)), x, w.in_proj,
                         "in_proj_grad");
  dproj.reset();
  if (in.dgate.defined()) {
    // The output gate's logits g = x wg^T: dx += dg wg, wg's gradient += dg^T x.
    linear_backward_tokens(st, &dx_m, true, grads.wg, mat(std::as_const(in.dgate)), x, w.wg,
                           "wg_grad");
    in.dgate.reset();
  }
}

template <class T>
void Pieces<T>::latent_norm_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dlat_loc,
                                     InputSaved<T>& in, Tensor<T>& dproj, MlaParams<T>& grads) {
  // A rotation's Jacobian is its transpose: rotate the gradient back.
  st.rope(mat(dlat_loc).col_range(st.C, st.dr), 1, 0, true);
  // d kv_a = [d c | d k_pe], into dproj's last C + dr columns: d c through
  // the norm, d k_pe as it is.
  const ops::Mat<T> dkv_a = mat(dproj).col_range(st.Nq, st.W);
  const ops::Mat<const T> dlat = mat(std::as_const(dlat_loc));
  if (ops::op_invariant) {  // kv_norm's gradient summed over the tokens canonically
    Tensor<T> dw_local = Tensor<T>::zeros(w.kv_norm.shape(), "kv_norm local grad (unused)");
    ops::rmsnorm_backward(dkv_a.col_range(0, st.C), dw_local, dlat.col_range(0, st.C),
                          in.kv_a_rows(st).col_range(0, st.C), w.kv_norm, in.kv_rstd);
    ops::canonical_rmsnorm_weight_grad(st.ctx.comm, grads.kv_norm, dlat.col_range(0, st.C),
                                       in.kv_a_rows(st).col_range(0, st.C), in.kv_rstd,
                                       token_shards(st), "kv_norm_grad", st.ctx.comm.rank() == 0);
  } else {
    ops::rmsnorm_backward(dkv_a.col_range(0, st.C), grads.kv_norm, dlat.col_range(0, st.C),
                          in.kv_a_rows(st).col_range(0, st.C), w.kv_norm, in.kv_rstd);
  }
  ops::copy(dkv_a.col_range(st.C, st.dr), dlat.col_range(st.C, st.dr));
  dlat_loc.reset();
  in.kv_rstd.reset();
}

template <class T>
void Pieces<T>::query_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dq,
                               InputSaved<T>& in, Tensor<T>& dproj, MlaParams<T>& grads) {
  const bool per_head = st.ctx.variant.queries == QueryExchange::heads;
  if (st.rq == 0) {
    // dq is dproj's first Nq columns already (queries_to_tokens); rotated
    // back as the latent is.
    st.rope(mat(dproj).col_range(st.dn, st.Nq - st.dn), st.H, st.dqk, true);
    return;
  }
  // d qn (B, L, rq): through wq_b here, or already (the latent exchange's dq
  // is past its rotation and wq_b).
  Tensor<T> dqn_heads;
  if (per_head) {
    st.rope(mat(dq).col_range(st.dn, st.H * st.dqk - st.dn), st.H, st.dqk, true);
    dqn_heads = Tensor<T>({st.B, st.L, st.rq}, "dqn");
    ops::Mat<T> dqn_m = mat(dqn_heads);
    if (ops::op_invariant) ops::widen_kept(in.qn);
    linear_backward_tokens(st, &dqn_m, false, grads.wq_b, mat(std::as_const(dq)),
                           std::as_const(in.qn), w.wq_b, "wq_b_grad");
    in.qn.reset();
    dq.reset();
  }
  const Tensor<T>& dqn = per_head ? dqn_heads : dq;
  // d qa, into dproj's first rq columns; qa is in.proj's.
  if (ops::op_invariant) {  // q_norm's gradient summed over the tokens canonically
    Tensor<T> dw_local = Tensor<T>::zeros(w.q_norm.shape(), "q_norm local grad (unused)");
    ops::rmsnorm_backward(mat(dproj).col_range(0, st.rq), dw_local, mat(dqn),
                          mat(std::as_const(in.proj)).col_range(0, st.rq), w.q_norm, in.q_rstd);
    ops::canonical_rmsnorm_weight_grad(st.ctx.comm, grads.q_norm, mat(dqn),
                                       mat(std::as_const(in.proj)).col_range(0, st.rq), in.q_rstd,
                                       token_shards(st), "q_norm_grad", st.ctx.comm.rank() == 0);
  } else {
    ops::rmsnorm_backward(mat(dproj).col_range(0, st.rq), grads.q_norm, mat(dqn),
                          mat(std::as_const(in.proj)).col_range(0, st.rq), w.q_norm, in.q_rstd);
  }
  in.q_rstd.reset();
  dq.reset();
}

template <class T>
void Pieces<T>::split_kv(const Step& st, std::int64_t heads, ops::In<T> kv, ops::In<T> k_pe,
                         ops::Mat<T> km, ops::Mat<T> vm) {
  for (std::int64_t h = 0; h < heads; ++h) {
    ops::copy(km.col_range(h * st.dqk, st.dn), kv.col_range(h * st.KV, st.dn));
    ops::copy(km.col_range(h * st.dqk + st.dn, st.dr), k_pe);
    ops::copy(vm.col_range(h * st.dv, st.dv), kv.col_range(h * st.KV + st.dn, st.dv));
  }
}

template <class T>
void Pieces<T>::merge_dkv(const Step& st, std::int64_t heads, ops::In<T> dkm, ops::In<T> dvm,
                          ops::Mat<T> dkvm, ops::Mat<T> dk_pe) {
  for (std::int64_t h = 0; h < heads; ++h) {
    ops::copy(dkvm.col_range(h * st.KV, st.dn), dkm.col_range(h * st.dqk, st.dn));
    ops::copy(dkvm.col_range(h * st.KV + st.dn, st.dv), dvm.col_range(h * st.dv, st.dv));
    ops::add(dk_pe, dkm.col_range(h * st.dqk + st.dn, st.dr));
  }
}

template <class T>
typename Pieces<T>::LocalKv Pieces<T>::local_kv(const Step& st, const MlaParams<T>& w,
                                                const Tensor<T>& c_hat, const InputSaved<T>& in) {
  LocalKv r{Tensor<T>({st.B, st.L, st.H * st.dqk}, "k_loc"),
            Tensor<T>({st.B, st.L, st.H * st.dv}, "v_loc")};
  Tensor<T> kv({st.B, st.L, st.H * st.KV}, "kv");
  ops::linear(mat(kv), mat(c_hat), w.wkv_b);
  split_kv(st, st.H, mat(std::as_const(kv)), in.kv_a_rows(st).col_range(st.C, st.dr), mat(r.k),
           mat(r.v));
  return r;
}

template <class T>
Tensor<T> Pieces<T>::local_kv_backward(const Step& st, const MlaParams<T>& w, ops::In<T> dk,
                                       ops::In<T> dv, const Tensor<T>& c_hat, MlaParams<T>& grads) {
  Tensor<T> dlat_loc = Tensor<T>::zeros({st.B, st.L, st.W}, "dlat_loc");
  Tensor<T> dkv({st.B, st.L, st.H * st.KV}, "dkv");
  merge_dkv(st, st.H, dk, dv, mat(dkv), mat(dlat_loc).col_range(st.C, st.dr));
  ops::gemm(mat(dlat_loc).col_range(0, st.C), T(0), mat(std::as_const(dkv)), false, mat(w.wkv_b),
            false);
  linear_backward_tokens<T>(st, nullptr, false, grads.wkv_b, mat(std::as_const(dkv)), c_hat,
                            w.wkv_b, "wkv_b_grad");
  return dlat_loc;
}

template struct Pieces<float>;
template struct Pieces<double>;

}  // namespace laga::detail
