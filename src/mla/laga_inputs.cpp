// LagaInputs (form.hpp): the input side laga, laga_fused and laga2d share --
// the queries moved to their heads' ranks (per head, or as the query
// latent) and the latent all-gathered (and up-projected where stored).
#include <algorithm>
#include <type_traits>
#include <utility>

#include "core/error.hpp"
#include "mla/exchange.hpp"
#include "mla/form.hpp"
#include "mla/ops_attention.hpp"

namespace laga::detail {

using ops::mat;

template <class T>
typename LagaInputs<T>::Qkv LagaInputs<T>::forward(const Step& st, const MlaParams<T>& w,
                                                   const Tensor<T>& x, UpProjection up) {
  using P = Pieces<T>;
  const bool latent = st.ctx.variant.queries == QueryExchange::latent;
  Qkv r;
  P::project_in(st, w, x, in);
  if (st.ctx.variant.overlap == Overlap::on) {
    // The latent first: its all-gather is on the link while the queries are
    // projected (their own collective queues behind it); waited for only
    // where the up-projection reads it.
    StartedSeq<T> lat_ag;
    {
      Tensor<T> c_hat = P::project_latent(st, w, in, "c_hat");
      lat = P::gather_latent(st, c_hat, in.kv_a_rows(st), &lat_ag);
    }
    r.q_h = latent ? exchange_query_latent(st, w) : P::queries_to_heads(st, w, in);
    lat_ag.wait(st.ctx.comm);
  } else {
    if (latent) r.q_h = exchange_query_latent(st, w);
    Tensor<T> c_hat = P::project_latent(st, w, in, "c_hat");
    if (!latent) r.q_h = P::queries_to_heads(st, w, in);
    lat = P::gather_latent(st, c_hat, in.kv_a_rows(st));
  }
  if (up == UpProjection::stored) {
    P::up_project_kv(st, w, lat, st.Sk, r.k_h, r.v_h);
    // [c_hat | k_pe]: RMSNorm's and RoPE's rounded outputs, gathered as
    // bf16, so bf16 values; backward reads it as wkv_b's GEMM operand.
    ops::keep_narrowed(lat);
  }
  return r;
}

template <class T>
void LagaInputs<T>::backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                             Tensor<T>& dq_h, Tensor<T>& dk_h, Tensor<T>& dv_h, Tensor<T>& dx,
                             MlaParams<T>& grads) {
  Tensor<T> dproj;  // rq == 0: the per-head dq lands in it
  Tensor<T> dq = queries_backward(st, w, dq_h, dproj, grads);
  ops::widen_kept(lat);
  Tensor<T> dlat = Pieces<T>::up_project_kv_backward(st, w, lat, st.Sk, dk_h, dv_h, grads);
  latent_backward(st, w, x, dq, dproj, dlat, dx, grads);
}

template <class T>
void LagaInputs<T>::backward_from_latent(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                         Tensor<T>& dq_h, Tensor<T>& dlat, Tensor<T>& dx,
                                         MlaParams<T>& grads) {
  Tensor<T> dproj;
  Tensor<T> dq = queries_backward(st, w, dq_h, dproj, grads);
  latent_backward(st, w, x, dq, dproj, dlat, dx, grads);
}

template <class T>
Tensor<T> LagaInputs<T>::queries_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dq_h,
                                          Tensor<T>& dproj, MlaParams<T>& grads) {
  return st.ctx.variant.queries == QueryExchange::latent
             ? query_latent_backward(st, w, dq_h, grads)
             : Pieces<T>::queries_to_tokens(st, dq_h, dproj);
}

template <class T>
void LagaInputs<T>::latent_backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                    Tensor<T>& dq, Tensor<T>& dproj, Tensor<T>& dlat, Tensor<T>& dx,
                                    MlaParams<T>& grads) {
  using P = Pieces<T>;
  lat.reset();
  // Overlap: the reduce-scatter is on the link while the query path's
  // backward runs (project_in_backward waits for it before the latent's).
  StartedSeq<T> dlat_rs;
  StartedSeq<T>* started = st.ctx.variant.overlap == Overlap::on ? &dlat_rs : nullptr;
  Tensor<T> dlat_loc = P::reduce_latent(st, dlat, started);
  P::project_in_backward(st, w, x, dq, dlat_loc, dproj, in, dx, grads, started);
}

namespace {
// wq_b's (or its gradient's) rows of this rank's heads: (H_r dqk, rq), a
// const view of a const tensor.
template <class Weight>
auto own_rows(const Step& st, Weight& wq_b) {
  return mat(wq_b).row_range(st.h0 * st.dqk, st.Hr * st.dqk);
}
// The rope columns of q_h or dq_h (B Sq rows, H_r heads of dqk); a rank
// without heads has none to rotate.
template <class T>
void rotate_queries(const Step& st, Tensor<T>& q_h, bool inverse) {
  if (st.Hr == 0) return;
  st.rope_queries(mat(q_h, st.B * st.Sq, st.Hr * st.dqk).col_range(st.dn, st.Hr * st.dqk - st.dn),
                  st.Hr, st.dqk, inverse);
}
}  // namespace

template <class T>
Tensor<T> LagaInputs<T>::exchange_query_latent(const Step& st, const MlaParams<T>& w) {
  Pieces<T>::project_q_latent(st, w, in);
  qn_q = Tensor<T>({st.B, st.Sq, st.rq}, "qn_q");
  if (st.attends_all_queries)
    gather_seq(st.ctx.comm, st.ctx.layout, in.qn.data(), qn_q.data(), st.rq, "q_latent_ag");
  else
    redistribute(st.ctx.comm, st.B, st.tokens.rows_only(), st.attention.rows_only(), in.qn.data(),
                 qn_q.data(), st.rq, "q_latent_a2a");
  in.qn.reset();  // its rows are in qn_q, where wq_b's gradient reads them
  Tensor<T> q_h({st.B, st.Sq, st.Hr, st.dqk}, "q_h");
  ops::gemm(mat(q_h, st.B * st.Sq, st.Hr * st.dqk), T(0), mat(std::as_const(qn_q)), false,
            own_rows(st, w.wq_b), true);
  rotate_queries(st, q_h, false);
  return q_h;
}

template <class T>
Tensor<T> LagaInputs<T>::query_latent_backward(const Step& st, const MlaParams<T>& w,
                                               Tensor<T>& dq_h, MlaParams<T>& grads) {
  rotate_queries(st, dq_h, true);
  const ops::Mat<const T> dq_m = mat(std::as_const(dq_h), st.B * st.Sq, st.Hr * st.dqk);
  // wq_b's gradient first, so that qn_q is gone before d qn_q (both
  // (B, Sq, rq)) exists.
  ops::gemm(own_rows(st, grads.wq_b), T(1), dq_m, true, mat(std::as_const(qn_q)), false);
  qn_q.reset();
  Tensor<T> dqn_q({st.B, st.Sq, st.rq}, "dqn_q");
  ops::gemm(mat(dqn_q), T(0), dq_m, false, own_rows(st, w.wq_b), false);
  dq_h.reset();
  Tensor<T> dqn({st.B, st.L, st.rq}, "dqn");
  if (st.attends_all_queries)
    reduce_scatter_seq(st.ctx.comm, st.ctx.layout, dqn_q.data(), dqn.data(), st.rq, "q_latent_ag");
  else
    redistribute_sum(st.ctx.comm, st.B, st.attention.rows_only(), st.tokens.rows_only(),
                     dqn_q.data(), dqn.data(), st.rq, "q_latent_a2a");
  return dqn;
}

template struct LagaInputs<float>;
template struct LagaInputs<double>;

}  // namespace laga::detail
