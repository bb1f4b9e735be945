// LAGA (Latent All-Gather Attention): Q crosses the wire seq->head, the small
// latent [c_hat | k_pe] is all-gathered, and each rank up-projects K/V for its
// OWN heads only from the gathered latent. The attention is then exactly the
// explicit form's, on the same (B, S, H_r, .) tensors; only the wire differs.
//
// Backward: the all-gather's adjoint is a reduce-scatter of d[c_hat | k_pe];
// this rank's wkv_b gradient covers its head rows over the full sequence
// (explicit's covers all rows over local tokens); the all-reduce sums both to
// the same total.
//
// Saved for backward: the input projections' tensors, the gathered latent
// lat (B, S, C+dr), the head attention's tensors, o_loc.
#include "mla/form.hpp"

namespace laga::detail {

namespace {

using ops::mat;

template <class T>
struct LagaTape final : Tape<T> {
  using P = Pieces<T>;
  InputSaved<T> in;
  Tensor<T> lat;  // (B, S, C+dr): [c_hat | k_pe] of every token
  HeadAttention<T> att;
  Tensor<T> o_loc;  // (B, L, H*dv)

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    Tensor<T> do_h = P::project_out_backward(st, w, dout, o_loc, grads);
    auto [dq_h, dk_h, dv_h] = att.backward(st, do_h);
    Tensor<T> dq_loc = P::to_tokens(st, dq_h, st.dqk, "q_a2a", "dq_loc");

    // d[c_hat | k_pe] over the full sequence from this rank's heads.
    Tensor<T> dlat = Tensor<T>::zeros({st.B, st.S, st.W}, "dlat");
    {
      Tensor<T> dkv_h({st.B, st.S, st.Hr * st.KV}, "dkv_h");
      P::merge_dkv(st, st.Hr, dk_h, dv_h, dkv_h, mat(dlat).col_range(st.C, st.dr));
      dk_h.reset(), dv_h.reset();
      const ops::Mat<const T> wkv_b_r = mat(w.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV);
      ops::gemm(mat(dlat).col_range(0, st.C), T(0), mat(dkv_h), false, wkv_b_r, false);
      ops::gemm(mat(grads.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV), T(1), mat(dkv_h), true,
                mat(lat).col_range(0, st.C), false);
    }
    lat.reset();
    Tensor<T> dlat_loc = P::reduce_latent(st, dlat);
    P::project_in_backward(st, w, x, dq_loc, dlat_loc, in, dx, grads);
  }
};

template <class T>
std::unique_ptr<Tape<T>> laga_forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                      Tensor<T>& out) {
  using P = Pieces<T>;
  auto t = std::make_unique<LagaTape<T>>();
  HeadAttention<T>& a = t->att;
  Tensor<T> q = P::project_q(st, w, x, t->in);
  {
    Tensor<T> c_hat = P::project_latent(st, w, x, t->in, "c_hat");
    a.q_h = P::to_heads(st, q, st.dqk, "q_a2a", "q_h");
    t->lat = P::gather_latent(st, c_hat, t->in.kv_a);
  }

  // kv_h (B*S, H_r*(dn+dv)) = c_hat wkv_b[H_r rows]^T: the H_r slice of
  // explicit's up-projection, over the full sequence.
  a.k_h = Tensor<T>({st.B, st.S, st.Hr, st.dqk}, "k_h");
  a.v_h = Tensor<T>({st.B, st.S, st.Hr, st.dv}, "v_h");
  {
    Tensor<T> kv_h({st.B, st.S, st.Hr * st.KV}, "kv_h");
    ops::gemm(mat(kv_h), T(0), mat(t->lat).col_range(0, st.C), false,
              mat(w.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV), true);
    P::split_kv(st, st.Hr, mat(std::as_const(kv_h)), mat(t->lat).col_range(st.C, st.dr), a.k_h,
                a.v_h);
  }
  a.forward(st, w, out, t->o_loc);
  return t;
}

}  // namespace

FormEntry laga_entry() {
  return {Form::laga, "laga", &laga_forward<float>, &laga_forward<double>};
}

}  // namespace laga::detail
