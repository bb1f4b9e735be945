// allgather_kv: the all-gather of per-head K/V, TransformerEngine's
// cp_comm_type="all_gather" and torchtitan's context parallelism for
// DeepSeek-V3 (docs/forms.md, "allgather_kv"). Each rank keeps its own
// query tokens with ALL heads; K and V, up-projected for local tokens and
// all heads as explicit does (k_pe expanded over heads), are all-gathered
// over the sequence, and each rank attends its tokens [s0, s1) over the
// keys [0, s1) they see; the output never leaves the rank:
//
//   kv (B, L, H (dn+dv)) = c_hat wkv_b^T -> k (B, L, H, dqk), v (B, L, H, dv)
//   k, v                       -> (B, S, H, .)        k_ag, v_ag (all-gather)
//   o (B, L, H, dv) = causal attention of q (B, L, H, dqk) over keys [0, s1)
//   out (B, L, D) = o wo^T
//
// Backward: attention backward, then the all-gathers' adjoints,
// reduce-scatters of dK and dV (zero past s1 from this rank) to the keys'
// owners, then explicit's merge into d[c_hat | k_pe].
//
// No query or output exchange: rank r sends its K and V, B L_r H (dqk + dv)
// elements, to each of the P-1 others, and receives everyone else's, where
// explicit's all-to-alls move only the (H - H_r)/H of Q, K, V and out that
// leave the rank. And every rank holds the whole sequence's K and V,
// B S H (dqk + dv): the form's memory cost at long S. On contiguous shards
// causal work is not balanced: the last rank attends about 2P-1 times the
// first's pairs (the work model's balance reports it); on zigzag shards
// (--seq-layout zigzag, TE's and torchtitan's mirrored chunks) each query
// range attends keys [0, its end) and the ranks' work is even.
//
// Saved for backward: the input projections' tensors, c_hat (B, L, C),
// q (B, L, H, dqk), the gathered k and v (B, S, H, .), the attention
// statistics (eager probabilities (B, H, L, s1), flash lse (B, H, L)), and
// o (B, L, H, dv), which is wo's input and flash's o at once.
#include "mla/form.hpp"

namespace laga::detail {

namespace {

using ops::mat;

template <class T>
struct AllgatherKvTape final : Tape<T> {
  using P = Pieces<T>;
  InputSaved<T> in;
  Tensor<T> c_hat;        // (B, L, C)
  RangeAttention<T> att;  // q_h (B, L, H, dqk), k_h and v_h (B, S, H, .), kv_rows = S
  Tensor<T> o_loc;        // (B, L, H*dv): the attention's output, wo's input

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    // do (B, L, H dv) = dout wo; wo += dout^T o. Flash's backward reads o
    // as its o_att; eager's does not.
    Tensor<T> do_loc = P::output_projection_backward(st, w, in, dout, o_loc, grads, "do_h");
    if (st.ctx.attention == AttentionKind::flash) att.o_att = std::move(o_loc);
    o_loc.reset();
    auto [dq, dk_all, dv_all] = att.backward(st, do_loc);
    dq.reshape({st.B, st.L, st.H * st.dqk});
    Tensor<T> dproj;  // rq == 0: dq lands in it
    Tensor<T> dq_loc = P::local_queries_backward(st, dq, dproj);
    // The all-gathers' adjoints: every rank's keys' gradients, summed at
    // their owner.
    Tensor<T> dk_loc({st.B, st.L, st.H * st.dqk}, "dk_loc");
    Tensor<T> dv_loc({st.B, st.L, st.H * st.dv}, "dv_loc");
    reduce_scatter_seq(st.ctx.comm, st.ctx.layout, dk_all.data(), dk_loc.data(), st.H * st.dqk,
                       "k_ag");
    dk_all.reset();
    reduce_scatter_seq(st.ctx.comm, st.ctx.layout, dv_all.data(), dv_loc.data(), st.H * st.dv,
                       "v_ag");
    dv_all.reset();

    // As explicit: d kv from [dk_nope | dv] per head; d k_pe = the sum over
    // heads of dk's rope part.
    Tensor<T> dlat_loc = Tensor<T>::zeros({st.B, st.L, st.W}, "dlat_loc");
    {
      Tensor<T> dkv({st.B, st.L, st.H * st.KV}, "dkv");
      P::merge_dkv(st, st.H, mat(dk_loc), mat(dv_loc), mat(dkv),
                   mat(dlat_loc).col_range(st.C, st.dr));
      dk_loc.reset(), dv_loc.reset();
      ops::gemm(mat(dlat_loc).col_range(0, st.C), T(0), mat(dkv), false, mat(w.wkv_b), false);
      ops::linear_backward<T>(nullptr, false, grads.wkv_b, mat(dkv), mat(c_hat), w.wkv_b);
    }
    c_hat.reset();
    P::project_in_backward(st, w, x, dq_loc, dlat_loc, dproj, in, dx, grads);
  }
};

template <class T>
std::unique_ptr<Tape<T>> allgather_kv_forward(const Step& st, const MlaParams<T>& w,
                                              const Tensor<T>& x, Tensor<T>& out) {
  using P = Pieces<T>;
  auto t = std::make_unique<AllgatherKvTape<T>>();
  P::project_in(st, w, x, t->in);
  t->c_hat = P::project_latent(st, w, t->in, "c_hat");
  RangeAttention<T>& a = t->att;
  a.kv_rows = st.S;
  {
    // kv (N, H (dn+dv)) = c_hat wkv_b^T, split into K (N, H, dqk) and V (N, H, dv),
    // the all-gathers' send buffers.
    Tensor<T> k_loc({st.B, st.L, st.H * st.dqk}, "k_loc", MemCategory::comm_buffers);
    Tensor<T> v_loc({st.B, st.L, st.H * st.dv}, "v_loc", MemCategory::comm_buffers);
    {
      Tensor<T> kv({st.B, st.L, st.H * st.KV}, "kv");
      ops::linear(mat(kv), mat(t->c_hat), w.wkv_b);
      P::split_kv(st, st.H, mat(std::as_const(kv)), t->in.kv_a_rows(st).col_range(st.C, st.dr),
                  mat(k_loc), mat(v_loc));
    }
    a.k_h = Tensor<T>({st.B, st.S, st.H, st.dqk}, "k_h");
    gather_seq(st.ctx.comm, st.ctx.layout, k_loc.data(), a.k_h.data(), st.H * st.dqk, "k_ag");
    k_loc.reset();
    a.v_h = Tensor<T>({st.B, st.S, st.H, st.dv}, "v_h");
    gather_seq(st.ctx.comm, st.ctx.layout, v_loc.data(), a.v_h.data(), st.H * st.dv, "v_ag");
  }
  a.q_h = P::local_queries(st, w, t->in);
  a.forward(st);
  // The output is already the rank's tokens with all heads: o_loc.
  t->o_loc = std::move(a.o_att);
  t->o_loc.reshape({st.B, st.L, st.H * st.dv});
  P::output_projection(st, w, t->in, t->o_loc, out);
  return t;
}

}  // namespace

FormEntry allgather_kv_entry() {
  return {.spec = {.form = Form::allgather_kv,
                   .name = "allgather_kv",
                   .flow = "up-project K/V for local tokens and all heads, all-gather K and V, "
                           "attend local queries with all heads over the keys they see, output "
                           "stays local (TransformerEngine all_gather, torchtitan)",
                   // At P 1 the same GEMMs and one kernel call, as explicit.
                   .traits = {.exact_at_one_rank = true},
                   .attention = own_tokens_all_heads,
                   .geometry =
                       [](const SpLayout& layout, FormVariant) {
                         return cat("each rank its own tokens, all ", layout.heads, " heads");
                       },
                   .note = nullptr,
                   // K and V of every token to every rank; their gradients back.
                   .collectives =
                       [](CommTerms& t) {
                         const std::int64_t H = t.cfg.n_heads;
                         t.add(Phase::forward, "k_ag", t.all_gather(H * t.cfg.qk_head_dim()),
                               CollectiveKind::all_gather);
                         t.add(Phase::forward, "v_ag", t.all_gather(H * t.cfg.v_head_dim),
                               CollectiveKind::all_gather);
                         if (!t.backward) return;
                         t.add(Phase::backward, "k_ag", t.reduce_scatter(H * t.cfg.qk_head_dim()),
                               CollectiveKind::reduce_scatter);
                         t.add(Phase::backward, "v_ag", t.reduce_scatter(H * t.cfg.v_head_dim),
                               CollectiveKind::reduce_scatter);
                       },
                   // q (B, L, H, dqk), the whole sequence's k and v (B, S, H, .), the
                   // statistics (its o is o_loc, which every form saves) and c_hat.
                   .saved_elements =
                       [](const SavedShape& s) {
                         const std::int64_t B = s.B, L = s.L, H = s.Hr;
                         std::int64_t n = B * L * H * s.dqk + B * s.S * H * (s.dqk + s.dv);
                         n += s.attention_stats();
                         return n + B * L * s.C;
                       },
                   .pair_width = head_pair_width},
          .f32 = &allgather_kv_forward<float>,
          .f64 = &allgather_kv_forward<double>};
}

}  // namespace laga::detail
