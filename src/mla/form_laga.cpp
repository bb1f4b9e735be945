// LAGA (Latent All-Gather Attention): Q crosses the wire seq->head, the small
// latent [c_hat | k_pe] is all-gathered, and each rank up-projects K/V for its
// OWN heads only from the gathered latent. The attention is then exactly the
// explicit form's, on the same (B, S, H_r, .) tensors; only the wire differs.
//
// With the query-latent exchange (QueryExchange::latent, q_lora_rank > 0) the
// queries take the same road as K/V: the normalised query latent
// qn = q_norm(wq_a x) (B, L, rq) is all-gathered instead of all-to-alling
// per-head Q (B, L, H dqk), and each rank applies wq_b for its own heads'
// rows over the full sequence, rotating q_pe at every token's position. The
// FLOPs equal wq_b for all heads on local tokens (S H_r = L H on even
// shards); the bytes are (P-1) rq per local token instead of (H - H_r) dqk.
//
// Backward: the all-gathers' adjoints are reduce-scatters, of d[c_hat | k_pe]
// and (latent exchange) of d qn; this rank's wkv_b (and wq_b) gradient covers
// its head rows over the full sequence (explicit's covers all rows over local
// tokens); the all-reduce sums both to the same total.
//
// Overlap (Overlap::on, `--overlap on`): forward projects the latent first
// and starts its all-gather before the queries' projection and exchange,
// waiting for it at the up-projection; backward starts the latent
// gradient's reduce-scatter before the query path's backward. The same
// collectives and arithmetic: outputs and gradients are bit-identical.
//
// Saved for backward: the input projections' tensors (the latent exchange
// keeps qa and q_rstd of local tokens and the gathered qn_all (B, S, rq) in
// place of qn), the gathered latent lat (B, S, C+dr), the head attention's
// tensors, o_loc.
#include "mla/exchange.hpp"
#include "mla/form.hpp"

namespace laga::detail {

namespace {

using ops::mat;

template <class T>
struct LagaTape final : Tape<T> {
  using P = Pieces<T>;
  InputSaved<T> in;
  Tensor<T> qn_all;  // latent exchange: (B, S, rq) qn of every token, for wq_b's gradient
  Tensor<T> lat;     // (B, S, C+dr): [c_hat | k_pe] of every token
  HeadAttention<T> att;
  Tensor<T> o_loc;  // (B, L, H*dv)

  // wq_b's rows of this rank's heads: (H_r dqk, rq).
  static ops::Mat<const T> own_wq_b(const Step& st, const Tensor<T>& wq_b) {
    return mat(wq_b).row_range(st.h0 * st.dqk, st.Hr * st.dqk);
  }
  // The rope columns of q_h or dq_h (B S rows, H_r heads of dqk); a rank
  // without heads has none to rotate.
  static void rotate(const Step& st, Tensor<T>& q_h, bool inverse) {
    if (st.Hr == 0) return;
    st.rope_sequence(mat(q_h, st.NS, st.Hr * st.dqk).col_range(st.dn, st.Hr * st.dqk - st.dn),
                     st.Hr, st.dqk, inverse);
  }

  // The latent exchange's forward: qn of local tokens gathered over the group
  // (kept as qn_all), then q_h (B, S, H_r, dqk) = qn_all wq_b[own rows]^T with
  // q_pe rotated at every token's position.
  Tensor<T> gather_queries(const Step& st, const MlaParams<T>& w, const Tensor<T>& x) {
    P::project_q_latent(st, w, x, in);
    qn_all = Tensor<T>({st.B, st.S, st.rq}, "qn_all");
    gather_seq(st.ctx.comm, st.ctx.layout, in.qn.data(), qn_all.data(), st.rq, "q_latent_ag");
    in.qn.reset();  // its rows are in qn_all, where wq_b's gradient reads them
    Tensor<T> q_h({st.B, st.S, st.Hr, st.dqk}, "q_h");
    ops::gemm(mat(q_h, st.NS, st.Hr * st.dqk), T(0), mat(std::as_const(qn_all)), false,
              own_wq_b(st, w.wq_b), true);
    rotate(st, q_h, false);
    return q_h;
  }

  // Its backward: dq_h (B, S, H_r, dqk) rotated back, wq_b's gradient for
  // this rank's rows, and d qn of every token (B, S, rq) summed over the group
  // for this rank's tokens: d qn (B, L, rq). Frees dq_h and qn_all.
  Tensor<T> reduce_queries(const Step& st, const MlaParams<T>& w, Tensor<T>& dq_h,
                           MlaParams<T>& grads) {
    rotate(st, dq_h, true);
    const ops::Mat<const T> dq_m = mat(std::as_const(dq_h), st.NS, st.Hr * st.dqk);
    // wq_b's gradient first, so that qn_all is gone before d qn_all (both
    // (B, S, rq)) exists.
    ops::gemm(mat(grads.wq_b).row_range(st.h0 * st.dqk, st.Hr * st.dqk), T(1), dq_m, true,
              mat(std::as_const(qn_all)), false);
    qn_all.reset();
    Tensor<T> dqn_all({st.B, st.S, st.rq}, "dqn_all");
    ops::gemm(mat(dqn_all), T(0), dq_m, false, own_wq_b(st, w.wq_b), false);
    dq_h.reset();
    Tensor<T> dqn({st.B, st.L, st.rq}, "dqn");
    reduce_scatter_seq(st.ctx.comm, st.ctx.layout, dqn_all.data(), dqn.data(), st.rq,
                       "q_latent_ag");
    return dqn;
  }

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    Tensor<T> do_h = P::project_out_backward(st, w, dout, o_loc, grads);
    auto [dq_h, dk_h, dv_h] = att.backward(st, do_h);
    Tensor<T> dq = st.ctx.queries == QueryExchange::latent
                       ? reduce_queries(st, w, dq_h, grads)
                       : P::to_tokens(st, dq_h, st.dqk, "q_a2a", "dq_loc");

    Tensor<T> dlat = P::up_project_kv_backward(st, w, lat, st.S, dk_h, dv_h, grads);
    lat.reset();
    // Overlap: the reduce-scatter is on the link while the query path's
    // backward runs (project_in_backward waits for it before the latent's).
    PendingCollective dlat_rs;
    PendingCollective* started = st.ctx.overlap == Overlap::on ? &dlat_rs : nullptr;
    Tensor<T> dlat_loc = P::reduce_latent(st, dlat, started);
    P::project_in_backward(st, w, x, dq, dlat_loc, in, dx, grads, started);
  }
};

template <class T>
std::unique_ptr<Tape<T>> laga_forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                      Tensor<T>& out) {
  using P = Pieces<T>;
  auto t = std::make_unique<LagaTape<T>>();
  HeadAttention<T>& a = t->att;
  const bool latent = st.ctx.queries == QueryExchange::latent;
  Tensor<T> q;  // per-head queries of local tokens (B, L, H*dqk), until their all-to-all
  if (st.ctx.overlap == Overlap::on) {
    // The latent first: its all-gather is on the link while the queries are
    // projected (their own collective queues behind it); waited for only
    // where the up-projection reads it.
    PendingCollective lat_ag;
    {
      Tensor<T> c_hat = P::project_latent(st, w, x, t->in, "c_hat");
      t->lat = P::gather_latent(st, c_hat, t->in.kv_a, &lat_ag);
    }
    if (latent) {
      a.q_h = t->gather_queries(st, w, x);
    } else {
      q = P::project_q(st, w, x, t->in);
      a.q_h = P::to_heads(st, q, st.dqk, "q_a2a", "q_h");
    }
    st.ctx.comm.wait(lat_ag);
  } else {
    if (latent)
      a.q_h = t->gather_queries(st, w, x);
    else
      q = P::project_q(st, w, x, t->in);
    Tensor<T> c_hat = P::project_latent(st, w, x, t->in, "c_hat");
    if (!latent) a.q_h = P::to_heads(st, q, st.dqk, "q_a2a", "q_h");
    t->lat = P::gather_latent(st, c_hat, t->in.kv_a);
  }

  P::up_project_kv(st, w, t->lat, st.S, a.k_h, a.v_h);
  a.forward(st, w, out, t->o_loc);
  return t;
}

}  // namespace

FormEntry laga_entry() {
  return {Form::laga, "laga", &laga_forward<float>, &laga_forward<double>};
}

}  // namespace laga::detail
