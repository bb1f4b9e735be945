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

// One attention kernel call of this rank: shape.B batch rows, the query rows
// of q_h and o viewed as (B Sq) rows from q_row, the keys of k_h and v_h as
// (B Sk) rows from kv_row, its statistics from element `stats` on.
// all_keys: it reads every key row of its batch rows (shape.Sk = Sk), so its
// backward writes their gradients; another call's go through scratch and are
// added after.
struct AttnCall {
  AttnShape shape;
  std::int64_t q_row = 0, kv_row = 0, stats = 0;
  bool all_keys = false;
};

// A range of n queries ending at token `end` sees keys [0, end): Sq = n,
// Sk = end, and the kernel's bottom-right alignment puts query i at token
// end - n + i. One call over the whole batch when the rank has one range and
// its rows are the batch's uniform slices (B = 1, or Sk = S so that the
// documents' (B, S) starts are the kernel's (B, Sk)); else one per batch row
// and range, the range that reaches Sk first in each row.
std::vector<AttnCall> attention_calls(const Step& st) {
  const bool eager = st.ctx.attention == AttentionKind::eager;
  const std::int64_t* starts = st.doc_start.empty() ? nullptr : st.doc_start.data();
  std::vector<AttnCall> calls;
  std::int64_t stats = 0;
  auto add = [&](std::int64_t batch, std::int64_t n, std::int64_t end, std::int64_t q_row,
                 std::int64_t kv_row, const std::int64_t* doc_start) {
    AttnCall c;
    c.shape =
        AttnShape{batch, n, end, st.Hr, st.Hr, st.dqk, st.dv, st.ctx.cfg.softmax_scale(), true};
    c.shape.doc_start = doc_start;
    c.q_row = q_row, c.kv_row = kv_row, c.stats = stats, c.all_keys = end == st.Sk;
    stats += batch * st.Hr * n * (eager ? end : 1);
    calls.push_back(c);
  };
  const std::vector<TokenRange>& ranges = st.query_ranges;
  if (ranges.size() == 1 && (st.B == 1 || st.Sk == st.S)) {
    add(st.B, ranges[0].size(), ranges[0].end, 0, 0, starts);
    return calls;
  }
  for (std::int64_t b = 0; b < st.B; ++b) {
    std::int64_t row = b * st.Sq + st.Sq;  // past the last range's rows
    for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
      row -= it->size();
      add(1, it->size(), it->end, row, b * st.Sk, starts ? starts + b * st.S : nullptr);
    }
  }
  return calls;
}

template <class T>
struct Laga2dTape final : Tape<T> {
  using P = Pieces<T>;
  LagaInputs<T> inputs;     // laga's input side, over this rank's query rows and keys
  Tensor<T> q_h, k_h, v_h;  // (B, Sq, H_g, dqk), (B, Sk, H_g, dqk), (B, Sk, H_g, dv)
  Tensor<T> o_att;          // (B, Sq, H_g, dv): flash's backward reads it; eager's does not
  Tensor<T> stats;          // every call's, at AttnCall::stats
  Tensor<T> o_loc;          // (B, L, H*dv)
  std::vector<AttnCall> calls;

  // Every call's statistics: eager probabilities or flash lse.
  static Tensor<T> allocate_stats(const Step& st, const std::vector<AttnCall>& calls) {
    const bool eager = st.ctx.attention == AttentionKind::eager;
    std::int64_t n = 0;
    for (const AttnCall& c : calls)
      n += c.shape.B * c.shape.Hq * c.shape.Sq * (eager ? c.shape.Sk : 1);
    return Tensor<T>({n}, eager ? "attn_stats eager probs" : "attn_stats flash lse");
  }

  // p + off; null stays null (count-only tensors have no storage).
  static T* at(T* p, std::int64_t off) { return p ? p + off : nullptr; }
  // Row r of a (rows, H_g, d) view of t.
  static T* row(const Step& st, Tensor<T>& t, std::int64_t d, std::int64_t r) {
    return at(t.data(), r * st.Hr * d);
  }

  void attend(const Step& st) {
    o_att = Tensor<T>({st.B, st.Sq, st.Hr, st.dv}, "o_att");
    stats = allocate_stats(st, calls);
    for (const AttnCall& c : calls)
      P::attend(st, c.shape, row(st, o_att, st.dv, c.q_row), at(stats.data(), c.stats),
                row(st, q_h, st.dqk, c.q_row), row(st, k_h, st.dqk, c.kv_row),
                row(st, v_h, st.dv, c.kv_row));
  }

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    Tensor<T> do_h = P::project_out_backward(st, w, dout, o_loc, grads);
    Tensor<T> dq_h({st.B, st.Sq, st.Hr, st.dqk}, "dq_h");
    Tensor<T> dk_h({st.B, st.Sk, st.Hr, st.dqk}, "dk_h");
    Tensor<T> dv_h({st.B, st.Sk, st.Hr, st.dv}, "dv_h");
    {
      // Scratch: eager's dp of one head, and the keys' gradients of a call
      // that does not reach Sk, added into dk_h and dv_h after it.
      const bool eager = st.ctx.attention == AttentionKind::eager;
      std::int64_t dp = 0, part = 0;
      for (const AttnCall& c : calls) {
        dp = std::max(dp, c.shape.Sq * c.shape.Sk);
        if (!c.all_keys) part = std::max(part, c.shape.Sk);
      }
      Tensor<T> dp_scratch;
      if (eager) dp_scratch = Tensor<T>({dp}, "eager dp scratch");
      Tensor<T> dk_part({part, st.Hr, st.dqk}, "dk_part"), dv_part({part, st.Hr, st.dv}, "dv_part");
      for (const AttnCall& c : calls) {
        const AttnShape& s = c.shape;
        T* dk = c.all_keys ? row(st, dk_h, st.dqk, c.kv_row) : dk_part.data();
        T* dv = c.all_keys ? row(st, dv_h, st.dv, c.kv_row) : dv_part.data();
        P::attend_backward(st, s, row(st, dq_h, st.dqk, c.q_row), dk, dv,
                           row(st, do_h, st.dv, c.q_row), row(st, q_h, st.dqk, c.q_row),
                           row(st, k_h, st.dqk, c.kv_row), row(st, v_h, st.dv, c.kv_row),
                           row(st, o_att, st.dv, c.q_row), at(stats.data(), c.stats),
                           dp_scratch.data());
        if (c.all_keys) continue;
        ops::add(mat(dk_h, st.B * st.Sk, st.Hr * st.dqk).row_range(c.kv_row, s.Sk),
                 mat(std::as_const(dk_part), part, st.Hr * st.dqk).row_range(0, s.Sk));
        ops::add(mat(dv_h, st.B * st.Sk, st.Hr * st.dv).row_range(c.kv_row, s.Sk),
                 mat(std::as_const(dv_part), part, st.Hr * st.dv).row_range(0, s.Sk));
      }
    }
    stats.reset(), do_h.reset();
    q_h.reset(), k_h.reset(), v_h.reset(), o_att.reset();
    inputs.backward(st, w, x, dq_h, dk_h, dv_h, dx, grads);
  }
};

template <class T>
std::unique_ptr<Tape<T>> laga2d_forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                        Tensor<T>& out) {
  using P = Pieces<T>;
  auto t = std::make_unique<Laga2dTape<T>>();
  t->calls = attention_calls(st);
  auto [q_h, k_h, v_h] = t->inputs.forward(st, w, x);
  t->q_h = std::move(q_h), t->k_h = std::move(k_h), t->v_h = std::move(v_h);
  t->attend(st);
  t->o_loc = P::project_out(st, w, t->o_att, out);
  if (st.ctx.attention == AttentionKind::eager) t->o_att.reset();  // only flash's backward reads o
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
