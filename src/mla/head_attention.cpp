// HeadAttention and RangeAttention (form.hpp): the attention explicit, laga
// and laga2d, allgather_kv run over their saved q, k, v, calling the op
// layer's attention (ops_attention.hpp) per kernel call.
#include <algorithm>
#include <type_traits>
#include <utility>

#include "core/error.hpp"
#include "mla/exchange.hpp"
#include "mla/form.hpp"
#include "mla/ops_attention.hpp"

namespace laga::detail {

using ops::mat;

template <class T>
void HeadAttention<T>::forward(const Step& st, const MlaParams<T>& w, const InputSaved<T>& in,
                               Tensor<T>& out, Tensor<T>& o_loc) {
  o_att = Tensor<T>({st.B, st.S, st.Hr, st.dv}, "o_att");
  stats = Pieces<T>::attention_forward(st, st.head_attention(), o_att, q_h, k_h, v_h);
  o_loc = Pieces<T>::project_out(st, w, in, o_att, out);
  if (st.ctx.attention == AttentionKind::eager) o_att.reset();  // only flash's backward reads o
  // Backward reads q, k, v only as attention's operands, rounded there (o_att
  // stays fp32: flash's backward reads it in fp32, for D = rowsum(dO o)).
  ops::keep_narrowed(q_h), ops::keep_narrowed(k_h), ops::keep_narrowed(v_h);
}

template <class T>
typename HeadAttention<T>::Grads HeadAttention<T>::backward(const Step& st, Tensor<T>& do_h) {
  // Attention reads dO only as its bf16 operand and, widened exactly, for
  // D = rowsum(dO o): held at 2 bytes from here, it needs no copy in the
  // call's scratch (ops::keep_narrowed; the same bits).
  ops::keep_narrowed(do_h);
  Grads g;
  g.dq_h = Tensor<T>({st.B, st.S, st.Hr, st.dqk}, "dq_h");
  g.dk_h = Tensor<T>({st.B, st.S, st.Hr, st.dqk}, "dk_h");
  g.dv_h = Tensor<T>({st.B, st.S, st.Hr, st.dv}, "dv_h");
  Pieces<T>::attention_backward(st, st.head_attention(), g.dq_h, g.dk_h, g.dv_h, do_h, q_h, k_h,
                                v_h, o_att, stats);
  do_h.reset();
  q_h.reset(), k_h.reset(), v_h.reset(), o_att.reset();
  return g;
}

namespace {

// A range of n queries ending at token `end` sees keys [0, end): Sq = n,
// Sk = end, and the kernel's bottom-right alignment puts query i at token
// end - n + i. One call over the whole batch when the rank has one range and
// its rows are the batch's uniform slices (B = 1, or Sk = S = kv_rows so
// that the documents' (B, S) starts are the kernel's (B, Sk)); else one per
// batch row and range, the range that reaches Sk first in each row.
std::vector<AttnCall> attention_calls(const Step& st, std::int64_t kv_rows) {
  const bool eager = st.ctx.attention == AttentionKind::eager;
  const std::int64_t* starts = st.doc_start.empty() ? nullptr : st.doc_start.data();
  std::vector<AttnCall> calls;
  std::int64_t stats = 0;
  // Count-only (no documents there): batch row 0's calls, each standing for
  // all B rows' (AttnCall::repeat), so that the list does not grow with B.
  const ops::BatchCalls rows = ops::batch_calls(st.B);
  LAGA_CHECK(rows.repeat == 1 || !starts, "internal: documents in a count-only run");
  const std::int64_t repeat = rows.repeat;
  auto add = [&](std::int64_t batch, std::int64_t n, std::int64_t end, std::int64_t q_row,
                 std::int64_t kv_row, const std::int64_t* doc_start) {
    AttnCall c;
    c.shape =
        AttnShape{batch, n, end, st.Hr, st.Hr, st.dqk, st.dv, st.ctx.cfg.softmax_scale(), true};
    c.shape.doc_start = doc_start;
    c.q_row = q_row, c.kv_row = kv_row, c.stats = stats, c.all_keys = end == st.Sk;
    c.repeat = batch == 1 ? repeat : 1;
    stats += c.repeat * batch * st.Hr * n * (eager ? end : 1);
    calls.push_back(c);
  };
  const std::vector<TokenRange>& ranges = st.query_ranges;
  if (ranges.size() == 1 && (st.B == 1 || (st.Sk == st.S && kv_rows == st.S))) {
    add(st.B, ranges[0].size(), ranges[0].end, 0, 0, starts);
    return calls;
  }
  for (std::int64_t b = 0; b < rows.issued; ++b) {
    std::int64_t row = b * st.Sq + st.Sq;  // past the last range's rows
    for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
      row -= it->size();
      add(1, it->size(), it->end, row, b * kv_rows, starts ? starts + b * st.S : nullptr);
    }
  }
  return calls;
}

// Row r of a (rows, H_r, d) view of t (of its bf16 values, held narrowed).
template <class T>
T* row(const Step& st, Tensor<T>& t, std::int64_t d, std::int64_t r) {
  return at(t.data(), r * st.Hr * d);
}
template <class T>
const bf16* narrowed_row(const Step& st, const Tensor<T>& t, std::int64_t d, std::int64_t r) {
  return at(t.narrowed_data(), r * st.Hr * d);
}

}  // namespace

template <class T>
void RangeAttention<T>::forward(const Step& st) {
  LAGA_CHECK(kv_rows >= st.Sk, "internal: RangeAttention over ", kv_rows,
             " key rows per batch row, but its queries see ", st.Sk);
  calls = attention_calls(st, kv_rows);
  const bool eager = st.ctx.attention == AttentionKind::eager;
  std::int64_t n = 0;  // every call's statistics: eager probabilities or flash lse
  for (const AttnCall& c : calls)
    n += c.repeat * c.shape.B * c.shape.Hq * c.shape.Sq * (eager ? c.shape.Sk : 1);
  o_att = Tensor<T>({st.B, st.Sq, st.Hr, st.dv}, "o_att");
  stats = Tensor<T>({n}, eager ? "attn_stats eager probs" : "attn_stats flash lse");
  for (const AttnCall& c : calls) {
    const ops::RepeatCounts rows(c.repeat);
    ops::attention_forward(st.ctx.attention, c.shape, row(st, o_att, st.dv, c.q_row),
                           at(stats.data(), c.stats), row(st, q_h, st.dqk, c.q_row),
                           row(st, k_h, st.dqk, c.kv_row), row(st, v_h, st.dv, c.kv_row));
  }
  // As HeadAttention's: backward reads q, k, v only as attention's operands.
  ops::keep_narrowed(q_h), ops::keep_narrowed(k_h), ops::keep_narrowed(v_h);
}

template <class T>
typename RangeAttention<T>::Grads RangeAttention<T>::backward(const Step& st, Tensor<T>& do_h) {
  ops::keep_narrowed(do_h);  // as HeadAttention's
  Grads g;
  g.dq_h = Tensor<T>({st.B, st.Sq, st.Hr, st.dqk}, "dq_h");
  // Key rows past Sk are no call's: zero, where the tensor has them.
  const Shape dk_shape{st.B, kv_rows, st.Hr, st.dqk}, dv_shape{st.B, kv_rows, st.Hr, st.dv};
  g.dk_h = kv_rows > st.Sk ? Tensor<T>::zeros(dk_shape, "dk_h") : Tensor<T>(dk_shape, "dk_h");
  g.dv_h = kv_rows > st.Sk ? Tensor<T>::zeros(dv_shape, "dv_h") : Tensor<T>(dv_shape, "dv_h");
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
      const ops::RepeatCounts rows(c.repeat);
      const AttnShape& s = c.shape;
      T* dk = c.all_keys ? row(st, g.dk_h, st.dqk, c.kv_row) : dk_part.data();
      T* dv = c.all_keys ? row(st, g.dv_h, st.dv, c.kv_row) : dv_part.data();
      const ops::HeldOperands held{narrowed_row(st, q_h, st.dqk, c.q_row),
                                   narrowed_row(st, k_h, st.dqk, c.kv_row),
                                   narrowed_row(st, v_h, st.dv, c.kv_row),
                                   narrowed_row(st, do_h, st.dv, c.q_row),
                                   q_h.narrowed(),
                                   k_h.narrowed(),
                                   v_h.narrowed(),
                                   do_h.narrowed()};
      const bool narrowed = q_h.narrowed() || k_h.narrowed() || v_h.narrowed() || do_h.narrowed();
      ops::attention_backward(st.ctx.attention, s, row(st, g.dq_h, st.dqk, c.q_row), dk, dv,
                              row(st, do_h, st.dv, c.q_row), row(st, q_h, st.dqk, c.q_row),
                              row(st, k_h, st.dqk, c.kv_row), row(st, v_h, st.dv, c.kv_row),
                              row(st, o_att, st.dv, c.q_row), at(stats.data(), c.stats),
                              dp_scratch.data(), nullptr, narrowed ? &held : nullptr);
      if (c.all_keys) continue;
      ops::add(mat(g.dk_h, st.B * kv_rows, st.Hr * st.dqk).row_range(c.kv_row, s.Sk),
               mat(std::as_const(dk_part), part, st.Hr * st.dqk).row_range(0, s.Sk));
      ops::add(mat(g.dv_h, st.B * kv_rows, st.Hr * st.dv).row_range(c.kv_row, s.Sk),
               mat(std::as_const(dv_part), part, st.Hr * st.dv).row_range(0, s.Sk));
    }
  }
  stats.reset(), do_h.reset();
  q_h.reset(), k_h.reset(), v_h.reset(), o_att.reset();
  return g;
}

template struct RangeAttention<float>;
template struct RangeAttention<double>;
template struct HeadAttention<float>;
template struct HeadAttention<double>;

}  // namespace laga::detail
