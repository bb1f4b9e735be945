// ring_kv: ring attention with per-head K/V, Megatron-Core/TransformerEngine's
// cp_comm_type="p2p" (docs/forms.md, "ring_kv"). Each rank keeps its own
// query tokens with ALL heads, as allgather_kv does; instead of gathering
// every K/V at once, the rank's per-head [K | V] block passes round the
// ring (mla/ring.hpp, the engine both ring forms share):
//
//   kv (B, L, H (dn+dv)) = c_hat wkv_b^T -> own block [k (B, L, H, dqk) | v (B, L, H, dv)]
//   o (B, L, H, dv) = the ring's attention of q (B, L, H, dqk) over every block
//   out (B, L, D) = o wo^T
//
// Backward: the ring's backward (the blocks round again, the dK/dV
// accumulators travelling with them and one shift more home), then
// explicit's merge into d[c_hat | k_pe] and wkv_b's gradient, local tokens
// only. On contiguous shards causal work is not balanced (the last rank
// attends about 2P-1 times the first's pairs: the work model's balance
// reports it); on zigzag shards (--seq-layout zigzag, TE's two mirrored
// chunks per rank) it is, one rectangle of rows a step (ring.hpp).
//
// Saved for backward: the input projections' tensors, c_hat (B, L, C),
// q (B, L, H, dqk), the own block (B, L, H (dqk + dv)), o (B, L, H, dv) (as
// o_loc, wo's input), and the statistics: flash's lse (B, H, L), or eager's
// probabilities of every step whose block precedes the own end,
// B H L L_j each (B H L s1 in all, as allgather_kv).
#include "mla/ring.hpp"

namespace laga::detail {

namespace {

using ops::mat;
using ring::block_k;
using ring::block_v;

// The block is the per-head [K | V] of all heads itself (ring::PerHeadKv).
template <class T>
struct KvBlocks : ring::PerHeadKv<T, &Step::H> {
  using ring::PerHeadKv<T, &Step::H>::width;
  // kv (N, H (dn+dv)) = c_hat wkv_b^T, split into the own block's K and V;
  // c_hat kept for wkv_b's gradient.
  Tensor<T> own_block(const Step& st, const MlaParams<T>& w, InputSaved<T>& in) {
    c_hat = Pieces<T>::project_latent(st, w, in, "c_hat");
    Tensor<T> own({st.B * st.L * width(st)}, "kv_own");
    Tensor<T> kv({st.B, st.L, st.H * st.KV}, "kv");
    ops::linear(mat(kv), mat(std::as_const(c_hat)), w.wkv_b);
    Pieces<T>::split_kv(st, st.H, mat(std::as_const(kv)), in.kv_a_rows(st).col_range(st.C, st.dr),
                        block_k(st, st.H, own.data(), st.L), block_v(st, st.H, own.data(), st.L));
    return own;
  }
  // As explicit: d kv from [dk_nope | dv] per head; d k_pe = the sum over
  // heads of dk's rope part; d c_hat = dkv wkv_b, wkv_b += dkv^T c_hat.
  Tensor<T> latent_grad(const Step& st, const MlaParams<T>& w, Tensor<T>& acc,
                        MlaParams<T>& grads) {
    const T* a = acc.data();
    Tensor<T> dlat_loc = Pieces<T>::local_kv_backward(st, w, block_k(st, st.H, a, st.L),
                                                      block_v(st, st.H, a, st.L), c_hat, grads);
    acc.reset(), c_hat.reset();
    return dlat_loc;
  }
  Tensor<T> c_hat;  // (B, L, C)
};

}  // namespace

FormEntry ring_kv_entry() {
  return {.spec = {.form = Form::ring_kv,
                   .name = "ring_kv",
                   .flow = "up-project K/V for local tokens and all heads, pass the [K | V] "
                           "blocks round the ring (P-1 steps, each hidden under the step's "
                           "attention with --overlap on), merge the steps' partial outputs by "
                           "their lse; backward rings dK/dV home (TransformerEngine p2p)",
                   // At P 1 one causal call over the own block, as explicit.
                   .traits = {.overlap = true, .exact_at_one_rank = true},
                   .attention = own_tokens_all_heads,
                   .geometry =
                       [](const SpLayout& layout, FormVariant) {
                         return cat("each rank its own tokens, all ", layout.heads,
                                    " heads; K/V round a ring of ", layout.ranks);
                       },
                   .note = nullptr,
                   // The ring's frame: the [K | V] blocks' pass (comm_model.hpp).
                   .collectives =
                       [](CommTerms& t) {
                         t.ring_form(KvBlocks<float>::pass, KvBlocks<float>::grad_pass,
                                     t.cfg.n_heads * (t.cfg.qk_head_dim() + t.cfg.v_head_dim));
                       },
                   // q (B, L, H, dqk), the own block (B, L, H, dqk + dv),
                   // the statistics (its o is o_loc, which every form saves)
                   // and c_hat.
                   .saved_elements =
                       [](const SavedShape& s) {
                         const std::int64_t B = s.B, L = s.L, H = s.Hr;
                         std::int64_t n = B * L * H * s.dqk + B * L * H * (s.dqk + s.dv);
                         return n + ring::ring_saved_stats(s) + B * L * s.C;
                       },
                   .pair_width = head_pair_width},
          .f32 = &ring::ring_forward<float, KvBlocks<float>>,
          .f64 = &ring::ring_forward<double, KvBlocks<double>>};
}

}  // namespace laga::detail
