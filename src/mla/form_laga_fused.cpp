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
// Saved for backward: the input projections' tensors, the gathered latent
// lat (B, S, C+dr), q_h (B, S, H_r, dqk), the output o_att (B, S, H_r, dv)
// and lse (B, H_r, S), o_loc.
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/attention_flash_latent.hpp"
#include "mla/form.hpp"

namespace laga::detail {

namespace {

// The kernel's operands at this rank: its heads' queries, the gathered
// latent and its heads' rows of wkv_b (H_r, dn + dv, C).
//
// Under bf16 mixed precision (ops.hpp, "Precision") there is no bf16 latent
// kernel: the fp32 one runs on bf16 values -- q_h and lat are bf16 already
// (GEMM, RMSNorm and RoPE outputs, moved unchanged), and wkv_b's rows are
// taken from `w_kv_bf16`, their rounded copy -- so its in-kernel K/V
// up-projection and P are fp32, not rounded as explicit's bf16 k_h, v_h
// and the bf16 flash kernel's P are.
template <class T>
LatentAttnParams<T> latent_params(const Step& st, const MlaParams<T>& w, const Tensor<T>& q_h,
                                  const Tensor<T>& lat, const std::vector<T>& w_kv_bf16) {
  LatentAttnParams<T> p;
  p.shape = st.head_attention();
  p.C = st.C, p.dn = st.dn;
  p.q = q_h.data();
  p.c = lat.data(), p.ld_c = st.W;
  p.k_pe = at(lat.data(), st.C), p.ld_k_pe = st.W;
  p.w_kv = !w_kv_bf16.empty() ? w_kv_bf16.data() : at(w.wkv_b.data(), st.h0 * st.KV * st.C);
  return p;
}

// This rank's heads' rows of wkv_b (H_r (dn + dv), C) rounded to bf16 under
// bf16 mixed precision; empty otherwise (the kernel reads wkv_b itself), and
// count-only. Scratch outside the pool, as every bf16 operand copy is
// (ops_bf16.cpp): the pool and the memory model count an fp32 run's tensors
// (docs/performance.md, "bf16 mixed precision", says what that leaves out).
template <class T>
std::vector<T> bf16_rows_of_wkv_b(const Step& st, const MlaParams<T>& w) {
  if (current_pool().count_only() || !ops::in_bf16<T>()) return {};
  const T* first = at(w.wkv_b.data(), st.h0 * st.KV * st.C);
  std::vector<T> rows(first, first + st.Hr * st.KV * st.C);
  if constexpr (std::is_same_v<T, float>)
    ops::bf16_path::round_in_place(
        {rows.data(), 1, std::int64_t(rows.size()), std::int64_t(rows.size())});
  return rows;
}

// Counts what the kernel does (mla/ops.hpp, "Op counts"): its attention as
// the flash kernel's of the same shape (the same tile products), and its
// chunk GEMMs, `passes` up-projection-shaped products per key chunk (1 in
// forward; 3 in backward: the recomputation, dc and dw_kv). Per chunk
// shape, in bulk: a count-only run at S = 10^14 must not walk the chunks.
inline void count_latent_attention(const Step& st, const AttnShape& s, ops::AttentionPass pass) {
  if (!ops::op_counter) return;
  const double per_pair_forward = double(s.dqk + s.dv);
  const double per_pair =
      pass == ops::AttentionPass::forward ? per_pair_forward : 3.0 * s.dqk + 2.0 * s.dv;
  ops::count_attention(s, AttentionKind::flash, pass,
                       [&] { return s.useful_flops_forward() * per_pair / per_pair_forward; });
  const std::int64_t full = s.Sk / kLatentKeyChunk, rest = s.Sk % kLatentKeyChunk;
  const std::int64_t ldkv = st.Hr * st.KV;
  for (const auto& [rows, chunks] : {std::pair{kLatentKeyChunk, full}, std::pair{rest, 1L}}) {
    if (rows == 0 || chunks == 0 || ldkv == 0) continue;
    std::vector<ops::GemmCall> calls{{false, true, rows, ldkv, st.C, st.W, st.C, ldkv, false}};
    if (pass == ops::AttentionPass::backward) {
      calls.push_back({false, false, rows, st.C, ldkv, ldkv, st.C, st.W, false});  // dc
      calls.push_back({true, false, ldkv, st.C, rows, ldkv, st.W, st.C, true});    // dw_kv
    }
    for (const ops::GemmCall& g : calls)
      ops::op_counter->add_gemm(g, s.B * chunks * ops::op_repeat);
  }
}

template <class T>
struct LagaFusedTape final : Tape<T> {
  LagaInputs<T> inputs;      // what the queries' and the latent's exchanges saved, lat among them
  Tensor<T> q_h;             // (B, S, H_r, dqk)
  Tensor<T> o_att, lse;      // (B, S, H_r, dv), (B, H_r, S): the kernel's backward reads both
  std::vector<T> w_kv_bf16;  // bf16 only: latent_params' rounded wkv_b rows
  Tensor<T> o_loc;           // (B, L, H*dv)

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    // The kernel reads q and the latent in fp32: widened first, while the
    // least is live (each is briefly there in both widths).
    ops::widen_kept(q_h), ops::widen_kept(inputs.lat);
    Tensor<T> do_h = Pieces<T>::project_out_backward(st, w, dout, o_loc, grads);
    Tensor<T> dq_h({st.B, st.S, st.Hr, st.dqk}, "dq_h");
    // The kernel writes dc and dk_pe of every key; a rank without heads
    // (P > H) runs no kernel and sends zero.
    const Shape dlat_shape{st.B, st.S, st.W};
    Tensor<T> dlat =
        st.Hr == 0 ? Tensor<T>::zeros(dlat_shape, "dlat") : Tensor<T>(dlat_shape, "dlat");
    const LatentAttnParams<T> p = latent_params(st, w, q_h, inputs.lat, w_kv_bf16);
    count_latent_attention(st, p.shape, ops::AttentionPass::backward);
    if (ops::runs(st.B * st.S * st.Hr,
                  {dq_h.data(), dlat.data(), do_h.data(), o_att.data(), lse.data(), p.q, p.c}))
      attention_flash_latent_backward<T>(p,
                                         {dq_h.data(), dlat.data(), st.W, at(dlat.data(), st.C),
                                          st.W, at(grads.wkv_b.data(), st.h0 * st.KV * st.C)},
                                         do_h.data(), o_att.data(), lse.data());
    do_h.reset(), o_att.reset(), lse.reset(), q_h.reset();
    w_kv_bf16 = {};
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
  t->w_kv_bf16 = bf16_rows_of_wkv_b(st, w);
  const LatentAttnParams<T> p = latent_params(st, w, t->q_h, t->inputs.lat, t->w_kv_bf16);
  count_latent_attention(st, p.shape, ops::AttentionPass::forward);
  if (ops::runs(st.B * st.S * st.Hr, {t->o_att.data(), t->lse.data(), p.q, p.c}))
    attention_flash_latent_forward<T>(p, t->o_att.data(), t->lse.data());
  t->o_loc = Pieces<T>::project_out(st, w, t->o_att, out);
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
              .traits = {.query_latent = true, .overlap = true},
              .attention = head_shards,
              .geometry = nullptr,
              .note = [](const MlaConfig&, const SpLayout&, FormVariant) -> std::string {
                return "laga_fused: flash only; with --attention eager it runs laga's unfused path";
              },
              // laga's collectives: the queries to their heads, the latent gathered.
              .collectives =
                  [](CommTerms& t) { t.head_parallel([&](Phase ph) { t.latent_gather(ph); }); },
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
