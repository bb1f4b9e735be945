// laga_fused: laga's data flow (form_laga.cpp: queries to their heads, the
// latent [c_hat | k_pe] all-gathered, the rank's own heads attended over
// every token) with the up-projection and the attention as one kernel
// (kernels/attention_flash_latent.hpp; the paper's §4.7 future work). K_nope
// and V of the rank's heads are made a key chunk (128 keys) at a time from
// the gathered latent inside the flash loops, in forward and again in
// backward, and never stored for the whole sequence: laga stores k_h
// (B, S, H_r, dqk) and v_h (B, S, H_r, dv) from forward to backward, and
// their gradients and dkv_h in backward; this form holds none of them. The
// price is the up-projection twice (forward, and recomputed in backward).
//
// Flash only: with --attention eager the form runs laga's own path (the
// eager kernel materialises (S, S) probabilities per head, which dwarf the
// K/V it would save); its row's note says so.
//
// The invariant mode (docs/invariance.md, "Which forms"): the kernel sums
// dc and dk_pe over its heads and its products run on the library's GEMM,
// whose bits follow the thread count; both follow P. In the mode it runs one
// head per call on the flash_latent_invariant rows (every product on
// gemm_invariant; a head's dw_kv summed over the key chunks in ascending
// order, the same at every P), and the heads' d[c_hat | k_pe] are summed
// over every rank's heads canonically (Pieces::latent_head_sum_invariant),
// as absorbed's. K and V are still never stored; the per-head parts of the
// latent's gradient (B, S, H_r, C + dr) are held in backward.
//
// Saved for backward: the input projections' tensors, the gathered latent
// lat (B, S, C+dr), q_h (B, S, H_r, dqk), the output o_att (B, S, H_r, dv)
// and lse (B, H_r, S), o_loc; under bf16, wkv_b's rows of the rank's heads
// rounded to bf16 values (H_r (dn + dv), C), which the kernel reads
// (ops_attention.hpp, FusedLatentKept; docs/accounting.md).
#include <type_traits>
#include <vector>

#include "mla/form.hpp"
#include "mla/ops_attention.hpp"

namespace laga::detail {

namespace {

using ops::mat;

// The kernel's operands at this rank (ops_attention.hpp): its heads'
// queries, the gathered latent and its heads' rows of wkv_b (H_r, dn + dv,
// C).
template <class T>
ops::FusedLatentOperands<T> latent_operands(const Step& st, const MlaParams<T>& w,
                                            const Tensor<T>& q_h, const Tensor<T>& lat) {
  return {st.head_attention(), st.C,       st.dn,
          q_h.data(),          lat.data(), at(w.wkv_b.data(), st.h0 * st.KV * st.C)};
}

template <class T>
struct LagaFusedTape final : Tape<T> {
  LagaInputs<T> inputs;  // what the queries' and the latent's exchanges saved, lat among them
  Tensor<T> q_h;         // (B, S, H_r, dqk)
  Tensor<T> o_att, lse;  // (B, S, H_r, dv), (B, H_r, S): the kernel's backward reads both
  ops::FusedLatentKept<T> kept;  // bf16: the rounded wkv_b rows the kernel reads (a pool tensor)
  std::vector<ops::FusedLatentKept<T>> kept_heads;  // the invariant mode's, one a head
  Tensor<T> o_loc;                                  // (B, L, H*dv)

  // Head h's call in the invariant mode (the file's head): its query q1 (B,
  // S, 1, dqk), every key's latent, its rows of wkv_b.
  static ops::FusedLatentOperands<T> head_operands(const Step& st, const MlaParams<T>& w,
                                                   const Tensor<T>& q1, const Tensor<T>& lat,
                                                   std::int64_t h) {
    return {st.sequence_attention(1, 1, st.dqk, st.dv),    st.C, st.dn, q1.data(), lat.data(),
            at(w.wkv_b.data(), (st.h0 + h) * st.KV * st.C)};
  }

  // The invariant mode's forward: o_att and lse written, one head a call.
  void per_head_forward(const Step& st, const MlaParams<T>& w) {
    Tensor<T> q1({st.B, st.S, 1, st.dqk}, "q_h of a head");
    Tensor<T> o1({st.B, st.S, 1, st.dv}, "o_att of a head");
    Tensor<T> lse1({st.B, 1, st.S}, "lse of a head");
    kept_heads.resize(std::size_t(st.Hr));
    for (std::int64_t h = 0; h < st.Hr; ++h) {
      ops::copy(mat(q1), Pieces<T>::head_columns(st, q_h, st.dqk, h));
      ops::fused_latent_attention_forward(head_operands(st, w, q1, inputs.lat, h), o1.data(),
                                          lse1.data(), kept_heads[std::size_t(h)]);
      ops::copy(Pieces<T>::head_columns(st, o_att, st.dv, h), mat(std::as_const(o1)));
      ops::copy(Pieces<T>::head_stats(st, lse, h), mat(std::as_const(lse1), st.B, st.S));
    }
  }

  // The invariant mode's backward through the kernel: dq_h written, wkv_b's
  // gradient of this rank's heads added, this rank's tokens' d[c_hat | k_pe]
  // (B, L, C + dr) returned, summed over every rank's heads canonically.
  Tensor<T> per_head_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dq_h,
                              Tensor<T>& do_h, MlaParams<T>& grads) {
    Tensor<T> dlat_heads({st.Hr, st.B, st.S, st.W}, "dlat of each head");
    {
      Tensor<T> q1({st.B, st.S, 1, st.dqk}, "q_h of a head");
      Tensor<T> o1({st.B, st.S, 1, st.dv}, "o_att of a head");
      Tensor<T> do1({st.B, st.S, 1, st.dv}, "do_h of a head");
      Tensor<T> lse1({st.B, 1, st.S}, "lse of a head");
      Tensor<T> dq1({st.B, st.S, 1, st.dqk}, "dq_h of a head");
      Tensor<T> dlat1({st.B, st.S, st.W}, "dlat of a head");
      for (std::int64_t h = 0; h < st.Hr; ++h) {
        ops::copy(mat(q1), Pieces<T>::head_columns(st, q_h, st.dqk, h));
        ops::copy(mat(o1), Pieces<T>::head_columns(st, o_att, st.dv, h));
        ops::copy(mat(do1), Pieces<T>::head_columns(st, do_h, st.dv, h));
        ops::copy(mat(lse1, st.B, st.S), Pieces<T>::head_stats(st, lse, h));
        ops::fused_latent_attention_backward(
            head_operands(st, w, q1, inputs.lat, h), dq1.data(), dlat1.data(),
            at(grads.wkv_b.data(), (st.h0 + h) * st.KV * st.C), do1.data(), o1.data(), lse1.data(),
            kept_heads[std::size_t(h)]);
        ops::copy(Pieces<T>::head_columns(st, dq_h, st.dqk, h), mat(std::as_const(dq1)));
        ops::copy(Pieces<T>::head_part(st, dlat_heads, h), mat(std::as_const(dlat1)));
      }
    }
    kept_heads.clear();
    do_h.reset(), o_att.reset(), lse.reset(), q_h.reset();
    return Pieces<T>::latent_head_sum_invariant(st, dlat_heads);
  }

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    // The kernel reads q and the latent in fp32: widened first, while the
    // least is live (each is briefly there in both widths).
    ops::widen_kept(q_h), ops::widen_kept(inputs.lat);
    Tensor<T> do_h = Pieces<T>::project_out_backward(st, w, inputs.in, dout, o_loc, grads);
    Tensor<T> dq_h({st.B, st.S, st.Hr, st.dqk}, "dq_h");
    if (ops::op_invariant) {  // reduce_latent passes the summed gradient on
      Tensor<T> dlat_loc = per_head_backward(st, w, dq_h, do_h, grads);
      inputs.backward_from_latent(st, w, x, dq_h, dlat_loc, dx, grads);
      return;
    }
    // The kernel writes dc and dk_pe of every key; a rank without heads
    // (P > H) runs no kernel and sends zero.
    const Shape dlat_shape{st.B, st.S, st.W};
    Tensor<T> dlat =
        st.Hr == 0 ? Tensor<T>::zeros(dlat_shape, "dlat") : Tensor<T>(dlat_shape, "dlat");
    ops::fused_latent_attention_backward(latent_operands(st, w, q_h, inputs.lat), dq_h.data(),
                                         dlat.data(), at(grads.wkv_b.data(), st.h0 * st.KV * st.C),
                                         do_h.data(), o_att.data(), lse.data(), kept);
    do_h.reset(), o_att.reset(), lse.reset(), q_h.reset();
    inputs.backward_from_latent(st, w, x, dq_h, dlat, dx, grads);
  }
};

template <class T>
std::unique_ptr<Tape<T>> laga_fused_forward(const Step& st, const MlaParams<T>& w,
                                            const Tensor<T>& x, Tensor<T>& out) {
  // Eager: laga's path (the file's head says why).
  if (st.ctx.attention == AttentionKind::eager) {
    const FormEntry& laga = form_entry(Form::laga);
    if constexpr (std::is_same_v<T, float>)
      return laga.f32(st, w, x, out);
    else
      return laga.f64(st, w, x, out);
  }
  auto t = std::make_unique<LagaFusedTape<T>>();
  t->q_h = t->inputs.forward(st, w, x, UpProjection::in_kernel).q_h;
  t->o_att = Tensor<T>({st.B, st.S, st.Hr, st.dv}, "o_att");
  t->lse = Tensor<T>({st.B, st.Hr, st.S}, "attn_stats flash lse");
  if (ops::op_invariant)
    t->per_head_forward(st, w);
  else
    ops::fused_latent_attention_forward(latent_operands(st, w, t->q_h, t->inputs.lat),
                                        t->o_att.data(), t->lse.data(), t->kept);
  t->o_loc = Pieces<T>::project_out(st, w, t->inputs.in, t->o_att, out);
  // q_h and the gathered latent hold bf16 values (rounded where made,
  // moved as bf16): kept at 2 bytes until backward widens them.
  ops::keep_narrowed(t->q_h), ops::keep_narrowed(t->inputs.lat);
  return t;
}

}  // namespace

FormEntry laga_fused_entry() {
  return {.spec = {
              .form = Form::laga_fused,
              .name = "laga_fused",
              .flow = "laga, with the up-projection fused into flash attention: K/V of the "
                      "rank's heads made per key chunk from the gathered latent, never stored",
              .traits = {.query_latent = true, .overlap = true, .invariant = true},
              .attention = head_shards,
              .geometry = nullptr,
              .note = [](const MlaConfig&, const SpLayout&, FormVariant) -> std::string {
                return "laga_fused: flash only; with --attention eager it runs laga's unfused path";
              },
              // laga's collectives: the queries to their heads, the latent gathered.
              // In the invariant mode the latent's gradient is each head's
              // d[c_hat | k_pe] summed over the heads (one column a head: the head
              // index) by the canonical tree (pieces.cpp latent_head_sum_invariant).
              .collectives =
                  [](CommTerms& t) { t.head_parallel([&](Phase ph) { t.latent_gather(ph, 1); }); },
              // q_h, flash's o_att and lse (the head attention's less k_h, v_h) and
              // the gathered latent (B, S, C+dr).
              .saved_elements =
                  [](const SavedShape& s) {
                    if (s.eager) return s.head_attention() + s.B * s.S * s.W;
                    return s.B * s.Hr * (s.Sq * s.dqk + s.Sq * s.dv + s.Sq) + s.B * s.S * s.W;
                  },
              .pair_width = head_pair_width},
          .f32 = &laga_fused_forward<float>,
          .f64 = &laga_fused_forward<double>};
}

}  // namespace laga::detail
