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
//
// The invariant mode (docs/invariance.md, "Which forms"): out is row-wise
// and already the same bits at every P, but a key's dK, dV sums over every
// query row, in blocks that follow the shards, then over the ranks. So
// backward instead gathers every token's q and dO (q_chunk_ag, do_chunk_ag)
// and attends the global sequence's kQueryChunk-token query chunks, each in
// one call (forward recomputed, then backward) over keys [0, its end) -- the
// same call whatever P; each chunk's dK, dV of every token is a part of a
// sum over the chunk index, owned by the rank holding the chunk's first
// token, summed in the one tree over that index and scattered to the keys'
// owners (ops::canonical_parts_reduce_scatter, kv_chunk_sum); a rank's dq
// rows are its rows of the calls of the chunks it holds tokens of (a chunk
// a shard boundary cuts is run on each of its ranks: the same call, the
// same bits). The package's path (python/laga_torch/tape.py,
// _gather_backward_invariant) is the same sum.
#include <algorithm>

#include "mla/canonical_sum.hpp"
#include "mla/form.hpp"
#include "mla/ops_attention.hpp"

namespace laga::detail {

namespace {

using ops::mat;

// The invariant mode's attention backward (above): from the rank's dO
// (B, L, H dv; freed) and its saved attention (its q, k, v read, then freed),
// dq (B, L, H dqk) of its rows and dkv (B, L, H (dqk + dv)) = [dK | dV] of
// its tokens, summed over every rank's query chunks canonically.
template <class T>
struct ChunkGrads {
  Tensor<T> dq, dkv;
};
template <class T>
ChunkGrads<T> chunk_backward(const Step& st, RangeAttention<T>& a, Tensor<T>& do_loc) {
  Communicator& comm = st.ctx.comm;
  const SpLayout& lay = st.ctx.layout;
  const std::int64_t B = st.B, S = st.S, L = st.L, H = st.Hr, dqk = st.dqk, dv = st.dv;
  const std::int64_t n = H * (dqk + dv), CH = ops::kQueryChunk;
  const std::int64_t s0 = lay.shard_begin(comm.rank()), s1 = s0 + L;
  const bool eager = st.ctx.attention == AttentionKind::eager;
  // q and dO of every token; the keys and values fp32 again (held narrowed
  // in a bf16 run: the calls read them as plain operands).
  Tensor<T> q_all({B, S, H, dqk}, "q_all");
  ops::widen_kept(a.q_h);
  gather_seq(comm, lay, a.q_h.data(), q_all.data(), H * dqk, "q_chunk_ag");
  a.q_h.reset(), a.o_att.reset(), a.stats.reset();
  Tensor<T> do_all({B, S, H, dv}, "do_all");
  gather_seq(comm, lay, do_loc.data(), do_all.data(), H * dv, "do_chunk_ag");
  do_loc.reset();
  ops::widen_kept(a.k_h), ops::widen_kept(a.v_h);

  const ops::TokenShards chunks = ops::query_chunk_shards(lay);
  const std::int64_t first = chunks.begin[std::size_t(comm.rank())];
  const std::int64_t owned = chunks.end[std::size_t(comm.rank())] - first;
  ChunkGrads<T> g;
  g.dq = Tensor<T>({B, L, H * dqk}, "dq");
  Tensor<T> parts = Tensor<T>::zeros({owned, B * S, n}, "dkv chunk parts");
  {
    // One chunk call's o, statistics and gradients; its keys' at most S.
    Tensor<T> o_c({CH, H, dv}, "chunk o"), dq_c({CH, H, dqk}, "chunk dq");
    Tensor<T> stats_c({H * CH * (eager ? S : 1)}, "chunk stats");
    Tensor<T> dk_c({S, H, dqk}, "chunk dk"), dv_c({S, H, dv}, "chunk dv");
    Tensor<T> dp_scratch;
    if (eager) dp_scratch = Tensor<T>({CH * S}, "eager dp scratch");
    const std::int64_t* starts = st.doc_start.empty() ? nullptr : st.doc_start.data();
    const ops::BatchCalls rows = ops::batch_calls(B);
    // The chunks this rank holds tokens of (none without tokens).
    const std::int64_t c_lo = L > 0 ? s0 / CH : 0, c_hi = L > 0 ? (s1 + CH - 1) / CH : 0;
    for (std::int64_t c = c_lo; c < c_hi; ++c) {
      const std::int64_t q0 = c * CH, e = std::min(q0 + CH, S), m = e - q0;
      const std::int64_t lo = std::max(q0, s0), hi = std::min(e, s1);
      for (std::int64_t b = 0; b < rows.issued; ++b) {
        const ops::RepeatCounts repeat(rows.repeat);
        AttnShape s{1, m, e, H, H, dqk, dv, st.ctx.cfg.softmax_scale(), true};
        s.doc_start = starts ? starts + b * S : nullptr;
        const T* q = at(std::as_const(q_all).data(), (b * S + q0) * H * dqk);
        const T* dO = at(std::as_const(do_all).data(), (b * S + q0) * H * dv);
        const T* k = at(std::as_const(a.k_h).data(), b * a.kv_rows * H * dqk);
        const T* v = at(std::as_const(a.v_h).data(), b * a.kv_rows * H * dv);
        ops::attention_forward(st.ctx.attention, s, o_c.data(), stats_c.data(), q, k, v);
        ops::attention_backward(st.ctx.attention, s, dq_c.data(), dk_c.data(), dv_c.data(), dO, q,
                                k, v, std::as_const(o_c).data(), std::as_const(stats_c).data(),
                                dp_scratch.data());
        ops::copy(mat(g.dq, B * L, H * dqk).row_range(b * L + lo - s0, hi - lo),
                  mat(std::as_const(dq_c), CH, H * dqk).row_range(lo - q0, hi - lo));
        if (c < first || c >= first + owned) continue;  // another rank's part
        const ops::Mat<T> part =
            mat(parts, owned * B * S, n).row_range(((c - first) * B + b) * S, e);
        ops::copy(part.col_range(0, H * dqk), mat(std::as_const(dk_c), S, H * dqk).row_range(0, e));
        ops::copy(part.col_range(H * dqk, H * dv),
                  mat(std::as_const(dv_c), S, H * dv).row_range(0, e));
      }
    }
  }
  q_all.reset(), do_all.reset(), a.k_h.reset(), a.v_h.reset();
  g.dkv = Tensor<T>({B, L, n}, "dkv_loc");
  ops::canonical_parts_reduce_scatter(comm, mat(g.dkv), parts, chunks, ops::sequence_shards(lay),
                                      "kv_chunk_sum");
  return g;
}

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
    if (ops::op_invariant) {
      o_loc.reset();
      ChunkGrads<T> g = chunk_backward(st, att, do_loc);
      Tensor<T> dproj;  // rq == 0: dq lands in it
      Tensor<T> dq_loc = P::local_queries_backward(st, g.dq, dproj);
      const ops::Mat<const T> dkv = mat(std::as_const(g.dkv));
      Tensor<T> dlat_loc =
          P::local_kv_backward(st, w, dkv.col_range(0, st.H * st.dqk),
                               dkv.col_range(st.H * st.dqk, st.H * st.dv), c_hat, grads);
      g.dkv.reset(), c_hat.reset();
      return P::project_in_backward(st, w, x, dq_loc, dlat_loc, dproj, in, dx, grads);
    }
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
                   .traits = {.exact_at_one_rank = true, .invariant = true},
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
                         if (t.invariant) {  // the query chunks' sum (above); wkv_b's as explicit's
                           t.add(Phase::backward, "q_chunk_ag",
                                 t.all_gather(H * t.cfg.qk_head_dim()), CollectiveKind::all_gather);
                           t.add(Phase::backward, "do_chunk_ag", t.all_gather(H * t.cfg.v_head_dim),
                                 CollectiveKind::all_gather);
                           t.query_chunk_sum("kv_chunk_sum",
                                             H * (t.cfg.qk_head_dim() + t.cfg.v_head_dim));
                           return t.token_sum("wkv_b_grad", t.weights.wkv_b);
                         }
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
