// Explicit form (B1, Ulysses on MLA, Megatron-Core's training path): per-head
// K/V are materialised for local tokens and ALL heads, then Q, K, V cross the
// wire seq->head. K carries k_pe expanded over heads, as Megatron-Core does.
//
// Saved for backward: the input projections' tensors, c_hat (B, L, C), the
// head attention's q_h, k_h, v_h (B, S, H_r, .) and statistics, o_loc.
#include "mla/form.hpp"

namespace laga::detail {

namespace {

using ops::mat;

template <class T>
struct ExplicitTape final : Tape<T> {
  using P = Pieces<T>;
  InputSaved<T> in;
  Tensor<T> c_hat;  // (B, L, C)
  HeadAttention<T> att;
  Tensor<T> o_loc;  // (B, L, H*dv)

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    Tensor<T> do_h = P::project_out_backward(st, w, in, dout, o_loc, grads);
    auto [dq_h, dk_h, dv_h] = att.backward(st, do_h);
    Tensor<T> dproj;  // rq == 0: dq lands in it
    Tensor<T> dq_loc = P::queries_to_tokens(st, dq_h, dproj);
    Tensor<T> dk_loc = P::to_tokens(st, dk_h, st.dqk, "k_a2a", "dk_loc");
    Tensor<T> dv_loc = P::to_tokens(st, dv_h, st.dv, "v_a2a", "dv_loc");

    // d kv from [dk_nope | dv] per head; d k_pe = sum over heads of dk's rope
    // part (k_pe was broadcast to every head); wkv_b's gradient.
    Tensor<T> dlat_loc = P::local_kv_backward(st, w, mat(std::as_const(dk_loc)),
                                              mat(std::as_const(dv_loc)), c_hat, grads);
    dk_loc.reset(), dv_loc.reset();
    c_hat.reset();
    P::project_in_backward(st, w, x, dq_loc, dlat_loc, dproj, in, dx, grads);
  }
};

template <class T>
std::unique_ptr<Tape<T>> explicit_forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                          Tensor<T>& out) {
  using P = Pieces<T>;
  auto t = std::make_unique<ExplicitTape<T>>();
  P::project_in(st, w, x, t->in);
  t->c_hat = P::project_latent(st, w, t->in, "c_hat");

  // kv (N, H*(dn+dv)) = c_hat wkv_b^T, split into K = [k_nope | k_pe] (N, H, dqk), V (N, H, dv).
  auto [k_loc, v_loc] = P::local_kv(st, w, t->c_hat, t->in);
  HeadAttention<T>& a = t->att;
  a.q_h = P::queries_to_heads(st, w, t->in);
  a.k_h = P::to_heads(st, k_loc, st.dqk, "k_a2a", "k_h");
  a.v_h = P::to_heads(st, v_loc, st.dv, "v_a2a", "v_h");
  a.forward(st, w, t->in, out, t->o_loc);
  return t;
}

}  // namespace

FormEntry explicit_entry() {
  return {.spec = {.form = Form::explicit_form,
                   .name = "explicit",
                   .flow = "up-project K/V for local tokens and all heads, all-to-all Q, K, V "
                           "seq->head, attend, all-to-all out head->seq (Megatron-Core)",
                   .traits = {.reference = true, .invariant = true},
                   .attention = head_shards,
                   .geometry = nullptr,
                   .note = nullptr,
                   // q_a2a, then per-head K and V of local tokens to their heads;
                   // in the invariant mode wkv_b's gradient, summed over the tokens
                   // it up-projected here, is a canonical token sum.
                   .collectives =
                       [](CommTerms& t) {
                         t.head_parallel([&](Phase ph) {
                           t.to_heads(ph, "k_a2a", t.cfg.qk_head_dim());
                           t.to_heads(ph, "v_a2a", t.cfg.v_head_dim);
                         });
                         t.token_sum("wkv_b_grad", t.weights.wkv_b);
                       },
                   // The head attention's tensors and c_hat (B, L, C) of local tokens.
                   .saved_elements =
                       [](const SavedShape& s) { return s.head_attention() + s.B * s.L * s.C; },
                   .pair_width = head_pair_width},
          .f32 = &explicit_forward<float>,
          .f64 = &explicit_forward<double>};
}

}  // namespace laga::detail
