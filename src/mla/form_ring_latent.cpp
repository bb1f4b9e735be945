// ring_latent: the ring of the latent, pith-train's "pass-latent" ring
// attention (docs/forms.md, "ring_latent"). The ring of mla/ring.hpp, with
// the block each rank passes on being its tokens' latent [c_hat | k_pe]
// (C + dr per token: 576 at DeepSeek-V3, against ring_kv's H (dqk + dv) =
// 40,960), and every step up-projecting ALL heads' K and V from the block
// it holds with the full wkv_b. No head is split, so there is no
// head-divisibility limit; the price is the up-projection done once per
// step, P times over the sequence, where explicit does it once:
//
//   own block [c_hat (B L, C) | k_pe (B L, dr)]               local
//   step j: k, v (B, L_j, H, .) = split(c_j wkv_b^T, k_pe_j)  every step, all heads
//   o (B, L, H, dv) = the ring's attention of q over every block's k, v
//   out (B, L, D) = o wo^T
//
// Backward: the blocks round again, each step recomputing its K/V from the
// latent, and its dK/dV taken through the up-projection at once: the
// block's d[c_hat | k_pe] = [dkv wkv_b | sum over heads of dk_pe] joins the
// accumulator that travels home with it, and wkv_b's gradient += dkv^T c_j
// stays on the rank (summed over ranks by the gradient all-reduce). Home,
// d[c_hat | k_pe] of local tokens goes through the latent norm as every
// form's does.
//
// Saved for backward: the input projections' tensors, q (B, L, H, dqk), the
// own latent block (B, L, C + dr), o (B, L, H, dv) (as o_loc) and the
// statistics (flash's lse (B, H, L), or eager's probabilities, B H L s1):
// no per-head K or V, of any token.
#include "mla/ring.hpp"

namespace laga::detail {

namespace {

using ops::mat;
using ring::block_k;
using ring::block_v;

// The latent block, [c_hat (B L_j, C) | k_pe (B L_j, dr)] as two
// contiguous parts (the GEMMs read c_hat dense).
template <class T>
ops::Mat<T> block_c(const Step& st, T* p, std::int64_t Lj) {
  return ring::first_part(p, st.B * Lj, st.C);
}
template <class T>
ops::Mat<T> block_pe(const Step& st, T* p, std::int64_t Lj) {
  return ring::second_part(p, st.B * Lj, st.C, st.dr);
}

template <class T>
struct LatentBlocks {
  static constexpr const char* pass = "latent_ring";
  static constexpr const char* grad_pass = "dlatent_ring";
  std::int64_t width(const Step& st) const { return st.W; }
  // kv (B L_j, H (dn+dv)) = c_j wkv_b^T of every head, split with k_pe. A
  // block held narrowed (bf16 runs, ring.hpp's top) is read in place: c_j
  // as the GEMM's bf16 operand, k_pe widened (exactly) for the split; the
  // K/V made (bf16 values: the GEMM's rounded output and k_pe) are then
  // held narrowed too, and the attention reads them in place.
  ring::RingKv<T> kv(const Step& st, const MlaParams<T>& w, const Tensor<T>& block,
                     std::int64_t Lj) const {
    Tensor<T> storage({st.B * Lj * st.H * (st.dqk + st.dv)}, "ring k_v");
    {
      Tensor<T> kv({st.B * Lj, st.H * st.KV}, "kv");
      Tensor<T> pe;  // a held block's k_pe, widened
      if (block.narrowed()) {
        const bf16* b16 = block.narrowed_data();
        ops::linear(mat(kv), ops::In<T>{nullptr, st.B * Lj, st.C, st.C}, w.wkv_b,
                    std::optional(block_c(st, b16, Lj).p));
        pe = Tensor<T>({st.B * Lj, st.dr}, "ring k_pe");
        ops::widen(mat(pe), block_pe(st, b16, Lj));
      } else {
        ops::linear(mat(kv), block_c(st, block.data(), Lj), w.wkv_b);
      }
      Pieces<T>::split_kv(st, st.H, mat(std::as_const(kv)),
                          pe.defined() ? mat(std::as_const(pe)) : block_pe(st, block.data(), Lj),
                          block_k(st, st.H, storage.data(), Lj),
                          block_v(st, st.H, storage.data(), Lj));
    }
    ops::keep_narrowed(storage);
    ring::RingKv<T> r = ring::RingKv<T>::of_block(st, st.H, storage, Lj);
    r.storage = std::move(storage);
    return r;
  }
  // The step's dK/dV through the up-projection (zero rows outside the calls
  // pass nothing): d k_pe += sum over heads of dk's rope part, dc += dkv
  // wkv_b, into the accumulator; wkv_b's gradient += dkv^T c_j.
  void add_grad(const Step& st, const MlaParams<T>& w, const Tensor<T>& block, std::int64_t Lj,
                const std::vector<ring::RingCall>&, const T* dkv_heads, T* acc,
                MlaParams<T>& grads) const {
    Tensor<T> dkv({st.B * Lj, st.H * st.KV}, "dkv");
    Pieces<T>::merge_dkv(st, st.H, block_k(st, st.H, dkv_heads, Lj),
                         block_v(st, st.H, dkv_heads, Lj), mat(dkv), block_pe(st, acc, Lj));
    ops::gemm(block_c(st, acc, Lj), T(1), mat(std::as_const(dkv)), false, mat(w.wkv_b), false);
    if (block.narrowed())  // c_j's bf16 values read in place (kv above)
      ops::linear_backward<T>(nullptr, false, grads.wkv_b, mat(dkv),
                              ops::In<T>{nullptr, st.B * Lj, st.C, st.C}, w.wkv_b,
                              std::optional(block_c(st, block.narrowed_data(), Lj).p));
    else
      ops::linear_backward<T>(nullptr, false, grads.wkv_b, mat(dkv), block_c(st, block.data(), Lj),
                              w.wkv_b);
  }
  // [c_hat | k_pe] of local tokens.
  Tensor<T> own_block(const Step& st, const MlaParams<T>& w, InputSaved<T>& in) const {
    Tensor<T> c_hat = Pieces<T>::project_latent(st, w, in, "c_hat");
    Tensor<T> own({st.B * st.L * width(st)}, "lat_own");
    ops::copy(block_c(st, own.data(), st.L), mat(std::as_const(c_hat)));
    ops::copy(block_pe(st, own.data(), st.L), in.kv_a_rows(st).col_range(st.C, st.dr));
    return own;
  }
  // The accumulator is d[c_hat | k_pe] already, in two parts: (B, L, C + dr)
  // as the latent norm's backward reads it.
  Tensor<T> latent_grad(const Step& st, const MlaParams<T>&, Tensor<T>& acc, MlaParams<T>&) const {
    Tensor<T> dlat_loc({st.B, st.L, st.W}, "dlat_loc");
    ops::copy(mat(dlat_loc).col_range(0, st.C), block_c(st, std::as_const(acc).data(), st.L));
    ops::copy(mat(dlat_loc).col_range(st.C, st.dr), block_pe(st, std::as_const(acc).data(), st.L));
    acc.reset();
    return dlat_loc;
  }
};

}  // namespace

FormEntry ring_latent_entry() {
  return {.spec = {.form = Form::ring_latent,
                   .name = "ring_latent",
                   .flow = "pass the latent [c | k_pe] of local tokens round the ring, each step "
                           "up-projecting all heads' K/V from the block it holds, merge the "
                           "steps' partial outputs by their lse; backward rings the latent's "
                           "gradient home (pith-train's pass-latent ring)",
                   .traits = {.overlap = true, .exact_at_one_rank = true},
                   .attention = own_tokens_all_heads,
                   .geometry =
                       [](const SpLayout& layout, FormVariant) {
                         return cat("each rank its own tokens, all ", layout.heads,
                                    " heads; the latent round a ring of ", layout.ranks);
                       },
                   .note = nullptr,
                   // The ring's frame: the latent blocks' pass (comm_model.hpp).
                   .collectives =
                       [](CommTerms& t) {
                         t.ring_form(LatentBlocks<float>::pass, LatentBlocks<float>::grad_pass,
                                     t.cfg.kv_lora_rank + t.cfg.qk_rope_head_dim);
                       },
                   // q (B, L, H, dqk), the own latent block (B, L, C + dr)
                   // and the statistics (its o is o_loc, which every form
                   // saves).
                   .saved_elements =
                       [](const SavedShape& s) {
                         const std::int64_t B = s.B, L = s.L, H = s.Hr;
                         std::int64_t n = B * L * H * s.dqk + B * L * s.W;
                         return n + ring::ring_saved_stats(s);
                       },
                   .pair_width = head_pair_width},
          .f32 = &ring::ring_forward<float, LatentBlocks<float>>,
          .f64 = &ring::ring_forward<double, LatentBlocks<double>>};
}

}  // namespace laga::detail
