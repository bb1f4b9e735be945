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
// collectives and arithmetic: outputs and gradients are bit-identical. Each
// started collective holds what it sends (and its staging) until its wait
// (StartedSeq, exchange.hpp), as an asynchronous transport needs.
// The input side (both exchanges, overlap, the up-projection) is laga2d's
// too: LagaInputs, form.hpp.
//
// Saved for backward: the input projections' tensors (the latent exchange
// keeps proj = [qa | kv_a] and q_rstd of local tokens and the gathered qn_q
// (B, S, rq) in place of qn), the gathered latent lat (B, S, C+dr), the head attention's
// tensors, o_loc.
#include "mla/form.hpp"

namespace laga::detail {

namespace {

template <class T>
struct LagaTape final : Tape<T> {
  LagaInputs<T> inputs;  // what the queries' and the latent's exchanges saved
  HeadAttention<T> att;
  Tensor<T> o_loc;  // (B, L, H*dv)

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    Tensor<T> do_h = Pieces<T>::project_out_backward(st, w, inputs.in, dout, o_loc, grads);
    auto [dq_h, dk_h, dv_h] = att.backward(st, do_h);
    inputs.backward(st, w, x, dq_h, dk_h, dv_h, dx, grads);
  }
};

template <class T>
std::unique_ptr<Tape<T>> laga_forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                      Tensor<T>& out) {
  auto t = std::make_unique<LagaTape<T>>();
  auto [q_h, k_h, v_h] = t->inputs.forward(st, w, x);
  t->att.q_h = std::move(q_h), t->att.k_h = std::move(k_h), t->att.v_h = std::move(v_h);
  t->att.forward(st, w, t->inputs.in, out, t->o_loc);
  return t;
}

}  // namespace

FormEntry laga_entry() {
  return {
      .spec = {.form = Form::laga,
               .name = "laga",
               .flow = "all-to-all Q, all-gather [c | k_pe], up-project K/V locally for the "
                       "rank's own heads, attend as explicit, all-to-all out (the paper's)",
               .traits = {.query_latent = true,
                          .overlap = true,
                          .exact_at_one_rank = true,
                          .invariant = true},
               .attention = head_shards,
               .geometry = nullptr,
               .note = nullptr,
               // The queries to their heads; the latent gathered.
               .collectives =
                   [](CommTerms& t) { t.head_parallel([&](Phase ph) { t.latent_gather(ph); }); },
               // The head attention's tensors and the gathered latent (B, S, C+dr).
               .saved_elements =
                   [](const SavedShape& s) { return s.head_attention() + s.B * s.S * s.W; },
               .pair_width = head_pair_width},
      .f32 = &laga_forward<float>,
      .f64 = &laga_forward<double>};
}

}  // namespace laga::detail
