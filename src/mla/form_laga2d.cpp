// laga2d: LAGA on a grid of Ph head groups x Pc context groups (P = Ph Pc),
// for any P (docs/forms.md, "laga2d"; the grid in layout.hpp,
// HeadContextGrid). Rank r attends the H_g heads of its head group for its
// query ranges, two mirrored chunks of the sequence (c and 2Pc-1-c of 2Pc),
// over the keys [0, Sk) up to its last query:
//
//   q (B, L, H dqk) of local tokens  -> (B, Sq, H_g, dqk)   q_a2a (redistribute)
//   [c_hat | k_pe] (B, L, C+dr)      -> (B, S, C+dr)        latent_ag, as laga
//   k, v (B, Sk, H_g, .) = the group's heads' wkv_b rows applied to the first Sk latent rows
//   o (B, Sq, H_g, dv) = causal attention of each query range over its keys
//   o                                -> (B, L, H dv)        out_a2a, then wo
//
// The input side is laga's (LagaInputs, form.hpp), with the query-latent
// exchange (--q-latent: qn (B, L, rq) -> (B, Sq, rq), every head group of
// a context group receiving its query rows, q_latent_a2a) and overlap.
//
// The mirrored chunks balance causal work: an early chunk's queries see few
// keys, its mirror's many, and the pairs of chunk k grow with k, so chunk
// c + chunk 2Pc-1-c is the same for every c (within the chunks' rounding).
// At Ph = P (Pc = 1) the two chunks are adjacent, merge into [0, S), and this
// is the laga form: the same collectives, bytes, GEMMs and kernel calls.
//
// Backward mirrors it: out_a2a reversed, attention backward per range (the
// keys' gradients of a rank's two ranges added), q_a2a reversed, and the
// latent gather's adjoint, a reduce-scatter of d[c_hat | k_pe] (zero past
// Sk). wkv_b's gradient of the group's rows is partial over the context
// groups' keys; grad_allreduce sums it.
//
// Saved for backward: the input projections' tensors, lat (B, S, C+dr),
// (--q-latent) qn_q (B, Sq, rq), q_h (B, Sq, H_g, dqk), k_h and v_h
// (B, Sk, H_g, .), the attention statistics of every call (eager
// probabilities, flash lse and o), o_loc.
#include <algorithm>
#include <cstdio>

#include "mla/form.hpp"
#include "mla/work_model.hpp"

namespace laga::detail {

namespace {

using ops::mat;

template <class T>
struct Laga2dTape final : Tape<T> {
  using P = Pieces<T>;
  LagaInputs<T> inputs;   // laga's input side, over this rank's query rows and keys
  RangeAttention<T> att;  // q_h (B, Sq, H_g, dqk), k_h and v_h (B, Sk, H_g, .); o_att
                          // (B, Sq, H_g, dv): flash's backward reads it, eager's does not
  Tensor<T> o_loc;        // (B, L, H*dv)

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    Tensor<T> do_h = P::project_out_backward(st, w, inputs.in, dout, o_loc, grads);
    auto [dq_h, dk_h, dv_h] = att.backward(st, do_h);
    inputs.backward(st, w, x, dq_h, dk_h, dv_h, dx, grads);
  }
};

template <class T>
std::unique_ptr<Tape<T>> laga2d_forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                        Tensor<T>& out) {
  using P = Pieces<T>;
  auto t = std::make_unique<Laga2dTape<T>>();
  RangeAttention<T>& a = t->att;
  auto [q_h, k_h, v_h] = t->inputs.forward(st, w, x);
  a.q_h = std::move(q_h), a.k_h = std::move(k_h), a.v_h = std::move(v_h), a.kv_rows = st.Sk;
  a.forward(st);
  t->o_loc = P::project_out(st, w, t->inputs.in, a.o_att, out);
  if (st.ctx.attention == AttentionKind::eager) a.o_att.reset();  // only flash's backward reads o
  return t;
}

// laga2d's grid and its attention balance, in words; for laga2d+q-latent,
// where its query exchange pays.
std::string laga2d_note(const MlaConfig& cfg, const SpLayout& lay, FormVariant v) {
  const HeadContextGrid g = laga2d_grid(lay, v);
  if (v.queries == QueryExchange::latent) {
    if (g.context_groups == 1)
      return "laga2d+q-latent: one context group, so it all-gathers the query latent as "
             "laga+q-latent does";
    std::int64_t Hg = 0;
    for (std::int64_t h : g.head_count) Hg = std::max(Hg, h);
    const std::int64_t per_head = Hg * cfg.qk_head_dim();
    return cat("laga2d+q-latent: each rank receives its query rows' latent, rq = ", cfg.q_lora_rank,
               " elements per row, where laga2d's q_a2a moves its head group's queries, H_g dqk = ",
               per_head, " (H_g = ", Hg,
               "): it sends fewer bytes while rq < H_g dqk, so with fewer head groups (more "
               "heads each); here it sends ",
               cfg.q_lora_rank < per_head ? "fewer" : "as many or more", " bytes");
  }
  char balance[32];
  std::snprintf(balance, sizeof balance, "%.3f", attention_balance(cfg, lay, v, nullptr));
  return cat("laga2d: ", g.describe(),
             v.head_groups == 0 ? " by its default rule, Ph = gcd(H, P)" : "",
             "; each rank attends its head group's heads for query chunks c and 2Pc-1-c of ",
             2 * g.context_groups,
             ", over the keys up to its last query. Attention work max/min over ranks ", balance,
             " (unpacked)");
}

}  // namespace

FormEntry laga2d_entry() {
  return {
      .spec = {.form = Form::laga2d,
               .name = "laga2d",
               .flow = "laga on a grid of Ph head groups x Pc context groups (any P): each rank "
                       "attends its group's heads for two mirrored query chunks, so causal work "
                       "is balanced and no rank idles when P > H",
               .traits = {.query_latent = true,
                          .overlap = true,
                          .head_groups = true,
                          .exact_at_one_rank = true},
               .attention =
                   [](const SpLayout& layout, FormVariant v) {
                     return Placement::query_chunks(laga2d_grid(layout, v));
                   },
               .geometry = [](const SpLayout& layout,
                              FormVariant v) { return laga2d_grid(layout, v).describe(); },
               .note = laga2d_note,
               // laga's, to the grid's ranks (CommTerms reads the placement).
               .collectives =
                   [](CommTerms& t) { t.head_parallel([&](Phase ph) { t.latent_gather(ph); }); },
               // laga's tensors over the rank's Sq query rows and Sk keys for its head
               // group's heads, and the gathered latent.
               .saved_elements =
                   [](const SavedShape& s) { return s.head_attention() + s.B * s.S * s.W; },
               .pair_width = head_pair_width},
      .f32 = &laga2d_forward<float>,
      .f64 = &laga2d_forward<double>};
}

}  // namespace laga::detail

namespace laga {

HeadContextGrid laga2d_grid(const SpLayout& layout, FormVariant v) {
  return HeadContextGrid::make(
      layout, HeadContextGrid::resolve_head_groups(layout.heads, layout.ranks, v.head_groups));
}

}  // namespace laga
