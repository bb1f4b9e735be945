// a2a_p2p: the hierarchical context parallelism of TransformerEngine's
// cp_comm_type="a2a+p2p" (docs/forms.md, "a2a_p2p"): all-to-all inside a
// context group, a ring across context groups. The P ranks form Ph head
// groups x Pc context groups (HeadContextGrid, context-major: rank r in
// context group r / Ph and head group r % Ph, so a context group's Ph ranks
// are consecutive and its all-to-all stays inside a node). Context group c
// attends query chunks c and 2Pc-1-c of 2Pc, laga2d's mirrored chunks, so
// causal work is balanced; rank r attends its head group's H_g heads there.
//
//   kv (B, L, H (dn+dv)) = c_hat wkv_b^T, split into k, v of local tokens and ALL heads
//   q, k, v (B, L, H, .)  -> (B, Sq, H_g, .)     q_a2a, k_a2a, v_a2a (explicit's, to the grid)
//   own block [k | v] (B, Sq, H_g (dqk + dv)): the context group's keys for the group's heads
//   o (B, Sq, H_g, dv) = the ring's attention (mla/ring.hpp) of q over the blocks of the
//                        head group's Pc ranks, passed round them (kv_ring, P-1 -> Pc-1 steps)
//   o -> (B, L, H dv)                            out_a2a, then wo
//
// Backward: out_a2a reversed, the ring's backward (the blocks round again,
// dK/dV home, dkv_ring), dq, dk, dv to local tokens (the all-to-alls
// reversed), then explicit's merge into d[c_hat | k_pe] and wkv_b's gradient.
//
// At Ph = P (Pc = 1) there is no ring: this is explicit (Ulysses), the same
// collectives and bytes. At Ph = 1 (Pc = P) the all-to-alls only move tokens
// to the zigzag chunks and it is ring_kv on zigzag shards. Between, per rank
// and forward, the ring moves B S H_g (dqk + dv) (Pc - 1) / Pc elements in
// Pc - 1 shifts, about B S H (dqk + dv) (Pc - 1) / P: ring_kv's (P - 1) / P
// of B S H (dqk + dv) times (Pc - 1) / (P - 1); the all-to-alls move q, k,
// v (and back o) among a context group's Ph ranks, explicit's
// (Ph - 1) / Ph of a rank's per-head tensors.
//
// Saved for backward: the input projections' tensors, c_hat (B, L, C),
// q_h (B, Sq, H_g, dqk), the own block (B, Sq, H_g (dqk + dv)), the merged
// o_att (B, Sq, H_g, dv) the ring's backward reads, the statistics (flash's
// lse (B, H_g, Sq), or eager's probabilities of every step's rectangle), and
// o_loc, wo's input.
#include "mla/ring.hpp"

namespace laga::detail {

namespace {

using ops::mat;
using ring::block_k;
using ring::block_v;
using ring::RingView;

// Its default Ph: the largest divisor of P below P that divides H (1 at
// P 1), the most all-to-all that still leaves a ring of Pc >= 2 context
// groups (laga2d's gcd(H, P) would be Pc 1 wherever P divides H: explicit).
int default_head_groups(std::int64_t H, int P) {
  for (int d = P - 1; d > 1; --d)
    if (P % d == 0 && H % d == 0) return d;
  return 1;
}

// The grid: --head-groups Ph (or its default), context-major.
HeadContextGrid a2a_p2p_grid(const SpLayout& layout, FormVariant v) {
  const int Ph = v.head_groups == 0 ? default_head_groups(layout.heads, layout.ranks)
                                    : HeadContextGrid::resolve_head_groups(
                                          layout.heads, layout.ranks, v.head_groups);
  return HeadContextGrid::make(layout, Ph, GridOrder::context_major);
}

// Rank r's ring: the Pc ranks of its head group (stride Ph apart), in
// context-group order, each holding its context group's query rows.
RingView ring_of(const SpLayout& layout, FormVariant v, int rank) {
  const HeadContextGrid g = a2a_p2p_grid(layout, v);
  const int hg = g.head_group(rank), Pc = g.context_groups;
  RingView view;
  SpLayout& m = view.members;
  m.batch = layout.batch, m.seq = layout.seq, m.ranks = Pc;
  m.seq_layout = SeqLayout::zigzag;
  for (int c = 0; c < Pc; ++c) {
    const int member = g.rank_at(hg, c);
    m.seq_ranges.push_back(g.queries[size_t(member)]);
    m.seq_count.push_back(g.query_rows(member));
  }
  view.place = g.context_group(rank);
  view.ring = Ring{RingDirection::forward, Pc, g.head_groups};
  view.L = m.seq_count[size_t(view.place)];
  view.H = g.head_count[size_t(rank)];
  return view;
}
RingView ring_of(const Step& st) {
  return ring_of(st.ctx.layout, st.ctx.variant, st.ctx.comm.rank());
}

// The block is the per-head [K | V] of the head group's H_g heads over the
// context group's rows (ring::PerHeadKv).
template <class T>
struct HeadGroupKv : ring::PerHeadKv<T, &Step::Hr> {
  using ring::PerHeadKv<T, &Step::Hr>::width;
  // kv (B, L, H (dn+dv)) = c_hat wkv_b^T of local tokens and all heads, split
  // into K and V, each sent to the grid (k_a2a, v_a2a) straight into the own
  // block's two parts; c_hat kept for wkv_b's gradient.
  Tensor<T> own_block(const Step& st, const MlaParams<T>& w, InputSaved<T>& in) {
    c_hat = Pieces<T>::project_latent(st, w, in, "c_hat");
    auto [k_loc, v_loc] = Pieces<T>::local_kv(st, w, c_hat, in);
    Tensor<T> own({st.B * st.Sq * width(st)}, "kv_own");
    redistribute(st.ctx.comm, st.B, st.tokens, st.attention, std::as_const(k_loc).data(),
                 block_k(st, st.Hr, own.data(), st.Sq).p, st.dqk, "k_a2a");
    k_loc.reset();
    redistribute(st.ctx.comm, st.B, st.tokens, st.attention, std::as_const(v_loc).data(),
                 block_v(st, st.Hr, own.data(), st.Sq).p, st.dv, "v_a2a");
    return own;
  }
  // The own block's gradient, home after the ring, back to local tokens
  // (the all-to-alls reversed), then explicit's merge.
  Tensor<T> latent_grad(const Step& st, const MlaParams<T>& w, Tensor<T>& acc,
                        MlaParams<T>& grads) {
    Tensor<T> dk_loc({st.B, st.L, st.H * st.dqk}, "dk_loc"),
        dv_loc({st.B, st.L, st.H * st.dv}, "dv_loc");
    const T* a = std::as_const(acc).data();
    redistribute(st.ctx.comm, st.B, st.attention, st.tokens, block_k(st, st.Hr, a, st.Sq).p,
                 dk_loc.data(), st.dqk, "k_a2a");
    redistribute(st.ctx.comm, st.B, st.attention, st.tokens, block_v(st, st.Hr, a, st.Sq).p,
                 dv_loc.data(), st.dv, "v_a2a");
    acc.reset();
    Tensor<T> dlat_loc = Pieces<T>::local_kv_backward(st, w, mat(std::as_const(dk_loc)),
                                                      mat(std::as_const(dv_loc)), c_hat, grads);
    c_hat.reset();
    return dlat_loc;
  }
  Tensor<T> c_hat;  // (B, L, C)
};

template <class T>
struct A2aP2pTape final : Tape<T> {
  using P = Pieces<T>;
  InputSaved<T> in;
  HeadGroupKv<T> codec;
  Tensor<T> q_h;    // (B, Sq, H_g, dqk)
  Tensor<T> own;    // (B Sq, H_g (dqk + dv)): the own block
  Tensor<T> o_att;  // (B, Sq, H_g, dv): the merged output, whose D = rowsum(dO o) backward reads
  Tensor<T> o_loc;  // (B, L, H dv): wo's input
  ring::RingAttention<T> att;

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    // q_h, dO and the blocks stay narrowed: as ring.hpp's RingTape.
    Tensor<T> do_h = P::project_out_backward(st, w, in, dout, o_loc, grads);
    ops::keep_narrowed(do_h);
    auto [dq_h, acc] = att.backward(st, ring_of(st), w, codec, q_h, own, o_att, do_h, grads);
    do_h.reset(), o_att.reset(), own.reset(), q_h.reset();
    Tensor<T> dproj;  // rq == 0: dq lands in it
    Tensor<T> dq_loc = P::queries_to_tokens(st, dq_h, dproj);
    Tensor<T> dlat_loc = codec.latent_grad(st, w, acc, grads);
    P::project_in_backward(st, w, x, dq_loc, dlat_loc, dproj, in, dx, grads);
  }
};

template <class T>
std::unique_ptr<Tape<T>> a2a_p2p_forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                         Tensor<T>& out) {
  using P = Pieces<T>;
  auto t = std::make_unique<A2aP2pTape<T>>();
  P::project_in(st, w, x, t->in);
  t->own = t->codec.own_block(st, w, t->in);  // project_latent before the queries free proj
  t->q_h = P::queries_to_heads(st, w, t->in);
  // q_h and the own block hold bf16 values (GEMMs' and RoPE's rounded
  // outputs, moved unchanged): held at 2 bytes from here, the ring's blocks
  // likewise (ring.hpp, the top).
  ops::keep_narrowed(t->q_h), ops::keep_narrowed(t->own);
  t->o_att = t->att.forward(st, ring_of(st), w, t->codec, t->q_h, t->own);
  t->o_loc = P::project_out(st, w, t->in, t->o_att, out);
  return t;
}

std::string a2a_p2p_geometry(const SpLayout& layout, FormVariant v) {
  const HeadContextGrid g = a2a_p2p_grid(layout, v);
  return cat(g.describe(), ", context-major; K/V round rings of ", g.context_groups);
}

std::string a2a_p2p_note(const MlaConfig&, const SpLayout& lay, FormVariant v) {
  const HeadContextGrid g = a2a_p2p_grid(lay, v);
  return cat("a2a_p2p: ", g.describe(),
             v.head_groups == 0 ? " by its default rule (the largest divisor of P below P "
                                  "that divides H; --head-groups sets it)"
                                : "",
             "; all-to-all of q, k, v inside each context group of ", g.head_groups,
             " consecutive ranks, per-head [K | V] round a ring of ", g.context_groups,
             " context groups (",
             g.context_groups == 1 ? "none: explicit's bytes" : "zigzag chunks", ")");
}

}  // namespace

FormEntry a2a_p2p_entry() {
  return {
      .spec = {.form = Form::a2a_p2p,
               .name = "a2a_p2p",
               .flow = "hierarchical (TransformerEngine a2a+p2p): on a grid of Ph head groups x "
                       "Pc context groups, all-to-all Q, K, V inside each context group to its "
                       "head groups, pass the [K | V] blocks round a ring of the Pc context "
                       "groups (zigzag chunks), merge by lse; --head-groups sets Ph",
               // At P 1 one causal call over [0, S), as explicit.
               .traits = {.overlap = true, .head_groups = true, .exact_at_one_rank = true},
               .attention =
                   [](const SpLayout& layout, FormVariant v) {
                     return Placement::query_chunks(a2a_p2p_grid(layout, v));
                   },
               .geometry = a2a_p2p_geometry,
               .note = a2a_p2p_note,
               // q, k, v to the grid and out back (explicit's to the grid),
               // the ring's passes over the head group's blocks.
               .collectives =
                   [](CommTerms& t) {
                     t.head_parallel([&](Phase ph) {
                       t.to_heads(ph, "k_a2a", t.cfg.qk_head_dim());
                       t.to_heads(ph, "v_a2a", t.cfg.v_head_dim);
                       if (ph == Phase::backward) return;
                       const RingView g = ring_of(t.layout, t.variant, t.rank);
                       std::vector<std::int64_t> blocks;
                       for (int c = 0; c < g.ranks(); ++c)
                         blocks.push_back(t.layout.batch * g.rows(c) * g.H *
                                          (t.cfg.qk_head_dim() + t.cfg.v_head_dim));
                       t.ring_form(HeadGroupKv<float>::pass, HeadGroupKv<float>::grad_pass, blocks,
                                   g.place);
                     });
                   },
               // q_h, the own block, o_att, the statistics and c_hat.
               .saved_elements =
                   [](const SavedShape& s) {
                     const RingView g = ring_of(s.layout, s.variant, s.rank);
                     const std::int64_t n = s.B * g.L * g.H * (s.dqk + (s.dqk + s.dv) + s.dv);
                     return n + ring::ring_saved_stats(g, s.B, s.eager) + s.B * s.L * s.C;
                   },
               .pair_width = head_pair_width},
      .f32 = &a2a_p2p_forward<float>,
      .f64 = &a2a_p2p_forward<double>};
}

}  // namespace laga::detail
