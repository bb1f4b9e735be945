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
//
// The invariant mode (docs/invariance.md, "Which forms"): the kernel's rows
// are (token, head) pairs of all H_r heads and its dK a sum over all of them,
// an order that follows H_r, which P changes. In the mode the latent
// attention's backward runs one head per call (a head's sums then do not
// depend on the heads beside it; forward needs none: a row's output reads
// only its own row and the keys, the same at every H_r, which
// mla_test_invariant_forms holds), each head's
// d[c_hat | k_pe] is kept apart, and the heads' parts are summed over every
// rank's heads by the canonical tree and scattered to the tokens' owners
// (Pieces::latent_head_sum_invariant), in place of the kernel's sum over
// this rank's heads and the reduce-scatter over the ranks.
//
// Saved for backward: the input projections' tensors, q_h (B, S, H_r, dqk),
// the gathered latent lat (B, S, C+dr) and its values v_lat (B, S, C),
// q_abs (B, S, H_r, C+dr), o_lat (B, S, H_r, C), the statistics, o_loc.
#include "mla/form.hpp"

namespace laga::detail {

namespace {

using ops::mat;

template <class T>
struct AbsorbedTape final : Tape<T> {
  using P = Pieces<T>;
  InputSaved<T> in;
  Tensor<T> q_h;    // (B, S, H_r, dqk)
  Tensor<T> lat;    // (B, S, C+dr): keys [c_hat | k_pe]
  Tensor<T> v_lat;  // (B, S, C): values c_hat, contiguous for the kernel
  Tensor<T> q_abs;  // (B, S, H_r, C+dr): [q_nope W_UK | q_pe]
  Tensor<T> o_lat;  // (B, S, H_r, C): W_UV's gradient and flash's backward read it
  Tensor<T> stats;
  Tensor<T> o_loc;  // (B, L, H*dv)

  // Per head h: W_UK[h] (dn, C) and W_UV[h] (dv, C), rows of wkv_b.
  static ops::Mat<const T> w_uk(const Step& st, const Tensor<T>& wkv_b, std::int64_t h) {
    return mat(wkv_b).row_range((st.h0 + h) * st.KV, st.dn);
  }
  static ops::Mat<const T> w_uv(const Step& st, const Tensor<T>& wkv_b, std::int64_t h) {
    return mat(wkv_b).row_range((st.h0 + h) * st.KV + st.dn, st.dv);
  }
  static ops::Mat<T> w_grad(const Step& st, Tensor<T>& g, std::int64_t h, std::int64_t row,
                            std::int64_t n) {
    return mat(g).row_range((st.h0 + h) * st.KV + row, n);
  }
  static AttnShape latent_attention(const Step& st) {
    return st.sequence_attention(st.Hr, 1, st.W, st.C);
  }

  // The backward through the latent attention, one kernel call: dq_abs (B,
  // S, H_r, C + dr) written, d[c_hat | k_pe] of every token from this rank's
  // heads (B, S, C + dr) returned. Frees the attention's saved tensors.
  Tensor<T> latent_backward(const Step& st, Tensor<T>& dq_abs, Tensor<T>& do_lat) {
    // d keys, then d values added. Zeros: a rank with no heads runs no kernel
    // and adds nothing to d latent.
    Tensor<T> dlat = Tensor<T>::zeros({st.B, st.S, st.W}, "dlat");
    {
      Tensor<T> dv_lat = Tensor<T>::zeros({st.B, st.S, st.C}, "dv_lat");
      Pieces<T>::attention_backward(st, latent_attention(st), dq_abs, dlat, dv_lat, do_lat, q_abs,
                                    lat, v_lat, o_lat, stats);
      ops::add(mat(dlat).col_range(0, st.C), mat(std::as_const(dv_lat)));
    }
    do_lat.reset();
    o_lat.reset(), q_abs.reset(), v_lat.reset(), lat.reset();
    return dlat;
  }

  // The invariant mode's backward through the latent attention: dq_abs
  // (B, S, H_r, C + dr) written, this rank's tokens' d[c_hat | k_pe] (B, L,
  // C + dr) returned, summed over every rank's heads canonically. Frees the
  // attention's saved tensors.
  Tensor<T> per_head_backward(const Step& st, Tensor<T>& dq_abs, Tensor<T>& do_lat) {
    for (Tensor<T>* k : {&q_abs, &lat, &v_lat}) ops::widen_kept(*k);
    const AttnShape s = st.sequence_attention(1, 1, st.W, st.C);
    // Each head's d keys with its d values added: the head's d[c_hat | k_pe].
    Tensor<T> dlat_heads({st.Hr, st.B, st.S, st.W}, "dlat of each head");
    {
      Tensor<T> q1({st.B, st.S, 1, st.W}, "q_abs of a head");
      Tensor<T> o1({st.B, st.S, 1, st.C}, "o_lat of a head");
      Tensor<T> do1({st.B, st.S, 1, st.C}, "do_lat of a head");
      Tensor<T> dq1({st.B, st.S, 1, st.W}, "dq_abs of a head");
      Tensor<T> dk1({st.B, st.S, st.W}, "dlat keys of a head");
      Tensor<T> dv1({st.B, st.S, st.C}, "dlat values of a head");
      for (std::int64_t h = 0; h < st.Hr; ++h) {
        ops::copy(mat(q1), Pieces<T>::head_columns(st, q_abs, st.W, h));
        ops::copy(mat(o1), Pieces<T>::head_columns(st, o_lat, st.C, h));
        ops::copy(mat(do1), Pieces<T>::head_columns(st, do_lat, st.C, h));
        Tensor<T> stats1({st.B, 1, st.S}, "attn_stats of a head");
        ops::copy(mat(stats1, st.B, st.S), Pieces<T>::head_stats(st, stats, h));
        Pieces<T>::attention_backward(st, s, dq1, dk1, dv1, do1, q1, lat, v_lat, o1, stats1);
        ops::copy(Pieces<T>::head_columns(st, dq_abs, st.W, h), mat(std::as_const(dq1)));
        const ops::Mat<T> dlat_h = Pieces<T>::head_part(st, dlat_heads, h);
        ops::copy(dlat_h, mat(std::as_const(dk1)));
        ops::add(dlat_h.col_range(0, st.C), mat(std::as_const(dv1)));
      }
    }
    do_lat.reset(), stats.reset();
    o_lat.reset(), q_abs.reset(), v_lat.reset(), lat.reset();
    return Pieces<T>::latent_head_sum_invariant(st, dlat_heads);
  }

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    Tensor<T> do_h = P::project_out_backward(st, w, in, dout, o_loc, grads);

    // Through o = o_lat W_UV^T.
    Tensor<T> do_lat({st.B, st.S, st.Hr, st.C}, "do_lat");
    {
      const ops::Mat<const T> doh = mat(std::as_const(do_h), st.NS, st.Hr * st.dv);
      const ops::Mat<T> dol = mat(do_lat, st.NS, st.Hr * st.C);
      for (std::int64_t h = 0; h < st.Hr; ++h) {
        ops::gemm(dol.col_range(h * st.C, st.C), T(0), doh.col_range(h * st.dv, st.dv), false,
                  w_uv(st, w.wkv_b, h), false);
        ops::gemm(w_grad(st, grads.wkv_b, h, st.dn, st.dv), T(1), doh.col_range(h * st.dv, st.dv),
                  true, mat(o_lat, st.NS, st.Hr * st.C).col_range(h * st.C, st.C), false);
      }
    }
    do_h.reset();
    // Attention reads dO only as its bf16 operand and for D (as
    // HeadAttention::backward): held at 2 bytes, no copy in its scratch
    // (the invariant mode's one-head calls copy it instead).
    if (!ops::op_invariant) ops::keep_narrowed(do_lat);

    Tensor<T> dq_abs({st.B, st.S, st.Hr, st.W}, "dq_abs");
    // The invariant mode: this rank's tokens' d latent, already summed over
    // every rank's heads (reduce_latent passes it on).
    Tensor<T> dlat = ops::op_invariant ? per_head_backward(st, dq_abs, do_lat)
                                       : latent_backward(st, dq_abs, do_lat);

    // Through q_abs = [q_nope W_UK | q_pe].
    ops::widen_kept(q_h);
    Tensor<T> dq_h({st.B, st.S, st.Hr, st.dqk}, "dq_h");
    {
      const ops::Mat<const T> dqa = mat(std::as_const(dq_abs), st.NS, st.Hr * st.W);
      const ops::Mat<T> dqh = mat(dq_h, st.NS, st.Hr * st.dqk);
      const ops::Mat<const T> qh = mat(std::as_const(q_h), st.NS, st.Hr * st.dqk);
      for (std::int64_t h = 0; h < st.Hr; ++h) {
        ops::gemm(dqh.col_range(h * st.dqk, st.dn), T(0), dqa.col_range(h * st.W, st.C), false,
                  w_uk(st, w.wkv_b, h), true);
        ops::gemm(w_grad(st, grads.wkv_b, h, 0, st.dn), T(1), qh.col_range(h * st.dqk, st.dn), true,
                  dqa.col_range(h * st.W, st.C), false);
        ops::copy(dqh.col_range(h * st.dqk + st.dn, st.dr), dqa.col_range(h * st.W + st.C, st.dr));
      }
    }
    dq_abs.reset();
    q_h.reset();

    Tensor<T> dproj;  // rq == 0: dq lands in it
    Tensor<T> dq_loc = P::queries_to_tokens(st, dq_h, dproj);
    Tensor<T> dlat_loc = P::reduce_latent(st, dlat);
    P::project_in_backward(st, w, x, dq_loc, dlat_loc, dproj, in, dx, grads);
  }
};

template <class T>
std::unique_ptr<Tape<T>> absorbed_forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                          Tensor<T>& out) {
  using P = Pieces<T>;
  using Tp = AbsorbedTape<T>;
  auto t = std::make_unique<Tp>();
  P::project_in(st, w, x, t->in);
  {
    Tensor<T> c_hat = P::project_latent(st, w, t->in, "c_hat");
    t->q_h = P::queries_to_heads(st, w, t->in);
    t->lat = P::gather_latent(st, c_hat, t->in.kv_a_rows(st));
  }
  // The attention kernel takes values as their own contiguous tensor.
  t->v_lat = Tensor<T>({st.B, st.S, st.C}, "v_lat");
  t->q_abs = Tensor<T>({st.B, st.S, st.Hr, st.W}, "q_abs");
  ops::copy(mat(t->v_lat), mat(t->lat).col_range(0, st.C));
  {
    const ops::Mat<const T> qh = mat(std::as_const(t->q_h), st.NS, st.Hr * st.dqk);
    const ops::Mat<T> qa = mat(t->q_abs, st.NS, st.Hr * st.W);
    for (std::int64_t h = 0; h < st.Hr; ++h) {
      ops::gemm(qa.col_range(h * st.W, st.C), T(0), qh.col_range(h * st.dqk, st.dn), false,
                Tp::w_uk(st, w.wkv_b, h), false);
      ops::copy(qa.col_range(h * st.W + st.C, st.dr), qh.col_range(h * st.dqk + st.dn, st.dr));
    }
  }
  t->o_lat = Tensor<T>({st.B, st.S, st.Hr, st.C}, "o_lat");
  t->stats =
      P::attention_forward(st, Tp::latent_attention(st), t->o_lat, t->q_abs, t->lat, t->v_lat);
  Tensor<T> o_h({st.B, st.S, st.Hr, st.dv}, "o_h");
  {
    const ops::Mat<const T> ol = mat(std::as_const(t->o_lat), st.NS, st.Hr * st.C);
    const ops::Mat<T> oh = mat(o_h, st.NS, st.Hr * st.dv);
    for (std::int64_t h = 0; h < st.Hr; ++h)
      ops::gemm(oh.col_range(h * st.dv, st.dv), T(0), ol.col_range(h * st.C, st.C), false,
                Tp::w_uv(st, w.wkv_b, h), true);
  }
  t->o_loc = P::project_out(st, w, t->in, o_h, out);
  // Backward reads q_abs, lat and v_lat only as attention's operands and
  // q_h as W_UK's gradient's GEMM operand, each rounded there: kept at 2
  // bytes (ops::keep_narrowed). o_lat stays fp32 (flash's D reads it).
  for (Tensor<T>* k : {&t->q_h, &t->lat, &t->v_lat, &t->q_abs}) ops::keep_narrowed(*k);
  return t;
}

}  // namespace

FormEntry absorbed_entry() {
  return {
      .spec = {
          .form = Form::absorbed,
          .name = "absorbed",
          .flow = "all-to-all Q, all-gather [c | k_pe], fold W_UK into q, attend in "
                  "latent space, unfold W_UV after, all-to-all out (the inference trick)",
          .traits = {.invariant = true},
          .attention = head_shards,
          .geometry = nullptr,
          .note = nullptr,
          // In the invariant mode the latent's gradient is each head's
          // d[c_hat | k_pe] summed over the heads (one column a head: the head
          // index) by the canonical tree (pieces.cpp latent_head_sum_invariant).
          .collectives =
              [](CommTerms& t) { t.head_parallel([&](Phase ph) { t.latent_gather(ph, 1); }); },
          // q_h, the gathered latent, its values c_hat, q_abs = [q_nope W_UK | q_pe]
          // and o_lat, both H_r x latent wide, and the attention statistics.
          .saved_elements =
              [](const SavedShape& s) {
                const std::int64_t B = s.B, S = s.S, Hr = s.Hr;
                return B * S * Hr * s.dqk + B * S * s.W + B * S * s.C + B * S * Hr * s.W +
                       B * S * Hr * s.C + (s.eager ? B * Hr * S * S : B * Hr * S);
              },
          // q_abs . [c_hat | k_pe] is C + dr wide, p . c_hat C wide.
          .pair_width = [](const MlaConfig& c) { return 2 * c.kv_lora_rank + c.qk_rope_head_dim; }},
      .f32 = &absorbed_forward<float>,
      .f64 = &absorbed_forward<double>};
}

}  // namespace laga::detail
