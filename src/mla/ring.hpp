// The ring engine the ring forms share (docs/forms.md, "ring_kv",
// "ring_latent"; private to src/mla). A ring form passes one block per
// rank round the ring of ranks, rank r -> r + 1, in P - 1 shifts, and each
// rank attends its own query tokens, with all heads, against the keys and
// values of the block it holds, merging the steps' partial outputs by their
// log-sum-exp:
//
//   step i = 0 .. P-1 holds rank j = r - i's block, tokens [k0, k0 + L_j):
//     send it on and receive rank j - 1's (not after the last step), the
//     transfer started before the step's attention and waited after it
//     with --overlap on, or run first without (the same bytes and bits);
//     j == r: causal attention of q over the block (the diagonal);
//     j <  r: every key precedes every query, attention without a mask;
//     j >  r: keys after every query, no work (the block still passes on);
//     (zigzag shards, two ranges each: the same per query range and key
//     range, one rectangle a step, RingRect; every block then has keys
//     every rank sees, and each step does about the same work)
//     o = e^(lse - lse') o + e^(lse_j - lse') o_j,  lse' = log(e^lse + e^lse_j)
//
// Backward recomputes as flash does: the blocks pass round again, each
// step's attention backward reads the final o and lse (eager: its saved
// probabilities, rescaled in forward to the row's whole normalisation, and
// D = do . o), and the block's gradient accumulator travels with it: the
// rank adds its part to the accumulator of the block it holds and passes it
// on, so after P steps and one more shift every block's gradient, summed
// over the ranks that attended it in ring order, is home.
//
// What the block is, is the form's Codec: a type with
//   const char* pass, grad_pass;             the two passes' labels
//   std::int64_t width(const Step&);         block elements per token
//   RingKv<T> kv(st, w, const Tensor<T>& block, L_j) its keys and values
//   void add_grad(st, w, const Tensor<T>& block, L_j, calls, const T* dkv,
//                 T* acc, grads)
//       adds the step's dK/dV (dkv: the kernel's (B, L_j, H, dqk) then
//       (B, L_j, H, dv), written at the calls' rows, zero elsewhere) into
//       the block's accumulator `acc`, and any parameter gradient into grads
//   Tensor<T> own_block(st, w, InputSaved<T>& in)
//       the rank's own block from the input projections (it may keep what
//       its gradient needs: ring_kv's c_hat)
//   Tensor<T> latent_grad(st, w, Tensor<T>& acc, grads)
//       d[c_hat | k_pe] (B, L, C + dr) of local tokens from the own block's
//       gradient, home after the ring (frees acc and what own_block kept)
// and the form is RingTape<T, Codec> (ring_forward below).
// ring_kv's block is the per-head [K | V] itself; ring_latent's the latent
// [c_hat | k_pe], up-projected with the full wkv_b at every step.
//
// bf16 runs: the blocks are held at 2 bytes an element from end to end.
// The own block holds bf16 values (GEMMs' and RoPE's rounded outputs) and
// is narrowed before the ring (ops::keep_narrowed); a narrowed block goes on
// the wire as it is and the next arrives into a tensor born narrowed
// (shift), so nothing is narrowed or widened on the way; and the attention
// reads a narrowed block's keys and values in place (RingKv's k16, v16;
// ring_latent's up-projection reads its latent in place and narrows the
// K/V it makes). The same bits as fp32 blocks holding those values: every
// reader rounds them to bf16 anyway. The gradient accumulators are sums and
// stay fp32 (they narrow on the wire only).
//
// Uneven shards: the blocks are the SpLayout's seq shards, of any length
// (no S % 2P rule; a rank without tokens attends nothing but still relays),
// contiguous or zigzag (SpLayout::seq_ranges, docs/forms.md, "The zigzag
// layout").
// Packed documents: a past block is attended only by the rows of the
// document that runs into this rank's shard, over the keys from that
// document's start (one unmasked call per batch row), the diagonal under
// the documents' mask; blocks no row sees are skipped, and still passed on.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "mla/form.hpp"
#include "mla/wire.hpp"

namespace laga::detail::ring {

// Rows of a block (B L_j, width) split in two contiguous parts: the first
// (B L_j, a) rows at p, then (B L_j, b) rows: [K | V], or [c_hat | k_pe].
template <class T>
ops::Mat<T> first_part(T* p, std::int64_t rows, std::int64_t a) {
  return {p, rows, a, a};
}
template <class T>
ops::Mat<T> second_part(T* p, std::int64_t rows, std::int64_t a, std::int64_t b) {
  return {at(p, rows * a), rows, b, b};
}
// The per-head [K | V] parts of a (B L_j) block of `heads` heads.
template <class T>
ops::Mat<T> block_k(const Step& st, std::int64_t heads, T* p, std::int64_t Lj) {
  return first_part(p, st.B * Lj, heads * st.dqk);
}
template <class T>
ops::Mat<T> block_v(const Step& st, std::int64_t heads, T* p, std::int64_t Lj) {
  return second_part(p, st.B * Lj, heads * st.dqk, heads * st.dv);
}

// The ring a ring form's attention runs round (docs/forms.md): its members,
// each one's rows (a layout with one "rank" per member: its rows and their
// count), this rank's place in it, the size the shifts pass (Ring), and
// the heads attended. ring_kv and ring_latent: one ring of every rank, each
// its own tokens with all H heads (of_ranks); a2a_p2p: the Pc ranks of a
// head group, each its context group's query rows, the group's heads
// (form_a2a_p2p.cpp). The rows a member holds are its queries and its
// block's keys alike.
struct RingView {
  SpLayout members;
  int place = 0;
  Ring ring;           // the shifts' rings (Ring::size 0: one ring of every rank)
  std::int64_t L = 0;  // this rank's rows, members.seq_count[place]
  std::int64_t H = 0;  // heads attended
  int ranks() const { return members.ranks; }
  std::int64_t rows(int member) const { return members.seq_count[size_t(member)]; }
  // One ring of every rank of `layout`, rank r at place r, its own tokens.
  static RingView of_ranks(const SpLayout& layout, int rank, std::int64_t heads) {
    return {layout, rank, Ring{}, layout.seq_count[size_t(rank)], heads};
  }
  static RingView of_ranks(const Step& st) {
    return of_ranks(st.ctx.layout, st.ctx.comm.rank(), st.H);
  }
};

// A block's keys and values for the attention: views of it, or made from
// it (held in `storage`); held narrowed (bf16 runs, see the top), their
// bf16 values, k and v null then.
template <class T>
struct RingKv {
  const T* k = nullptr;       // (B, L_j, H, dqk)
  const T* v = nullptr;       // (B, L_j, H, dv)
  const bf16* k16 = nullptr;  // as k, held narrowed (null in a count-only run)
  const bf16* v16 = nullptr;  // as v
  bool held = false;          // k16 and v16 are the keys and values
  Tensor<T> storage;
  // Views of a [K | V] block of `heads` heads, or of its bf16 values.
  static RingKv of_block(const Step& st, std::int64_t heads, const Tensor<T>& block,
                         std::int64_t Lj) {
    RingKv r;
    r.held = block.narrowed();
    if (r.held) {
      r.k16 = block_k(st, heads, block.narrowed_data(), Lj).p;
      r.v16 = block_v(st, heads, block.narrowed_data(), Lj).p;
    } else {
      r.k = block_k(st, heads, block.data(), Lj).p;
      r.v = block_v(st, heads, block.data(), Lj).p;
    }
    return r;
  }
  // The operands of a call whose keys start k_off (B L_j H) rows in, with
  // q's (q_held: q's bf16 values at the call's rows, or none).
  ops::HeldOperands narrowed(const Step& st, std::int64_t k_off, const bf16* q16,
                             bool q_held) const {
    ops::HeldOperands n;
    n.q = q16, n.q_held = q_held;
    n.k = at(k16, k_off * st.dqk), n.v = at(v16, k_off * st.dv), n.k_held = n.v_held = held;
    return n;
  }
};

using ops::mat;

// The (query row, key row) rectangle a ring step attends: local rows
// [q_row, q_row + rows) against the block's rows [k_row, k_row + keys).
// The own block's is every row against every row under the causal mask:
// the local tokens are in ascending order (SpLayout::seq_ranges), so the
// causal mask of the rows as they lie is the sequence's. Another block's
// keys either all precede a query range or all follow it (whole chunks of
// one tiling), and on contiguous and zigzag shards those that precede form
// one rectangle, unmasked (zigzag: rank j < r's first chunk against both
// of r's; rank j > r's two chunks against r's second): one call, and no
// key row written twice. Empty (rows 0) when no key precedes.
struct RingRect {
  std::int64_t q_row = 0, rows = 0, k_row = 0, keys = 0;
  bool diagonal = false;
  // The step's statistics: lse (B, H, rows), eager's probabilities (B, H,
  // rows, keys).
  std::int64_t lse_elems(std::int64_t B, std::int64_t H) const { return B * H * rows; }
  std::int64_t probs_elems(std::int64_t B, std::int64_t H) const { return B * H * rows * keys; }
};
inline RingRect ring_rect(const SpLayout& lay, int r, int owner) {
  const std::vector<TokenRange>& mine = lay.seq_ranges[size_t(r)];
  const std::vector<TokenRange>& theirs = lay.seq_ranges[size_t(owner)];
  const std::int64_t L = lay.seq_count[size_t(r)];
  if (owner == r) return {0, L, 0, L, true};
  // Which of my ranges (by index) see which of theirs.
  std::vector<std::size_t> qs, ks;
  std::size_t visible = 0;
  for (std::size_t a = 0; a < mine.size(); ++a)
    for (std::size_t b = 0; b < theirs.size(); ++b) {
      if (theirs[b].end > mine[a].begin) continue;
      ++visible;
      if (std::find(qs.begin(), qs.end(), a) == qs.end()) qs.push_back(a);
      if (std::find(ks.begin(), ks.end(), b) == ks.end()) ks.push_back(b);
    }
  RingRect rect;
  if (visible == 0) return rect;
  std::sort(ks.begin(), ks.end());
  LAGA_CHECK(visible == qs.size() * ks.size() && qs.back() - qs.front() + 1 == qs.size() &&
                 ks.back() - ks.front() + 1 == ks.size(),
             "ring: rank ", r, "'s seq ranges against rank ", owner,
             "'s are no one rectangle; the ring forms run contiguous or zigzag shards "
             "(--seq-layout)");
  auto rows_before = [](const std::vector<TokenRange>& v, std::size_t n) {
    std::int64_t rows = 0;
    for (std::size_t i = 0; i < n; ++i) rows += v[i].size();
    return rows;
  };
  rect.q_row = rows_before(mine, qs.front());
  rect.rows = rows_before(mine, qs.back() + 1) - rect.q_row;
  rect.k_row = rows_before(theirs, ks.front());
  rect.keys = rows_before(theirs, ks.back() + 1) - rect.k_row;
  return rect;
}

// A ring form's saved statistics (FormSpec::saved_elements): flash's lse
// (B, H, L), or eager's probabilities of every step's rectangle.
inline std::int64_t ring_saved_stats(const RingView& g, std::int64_t B, bool eager) {
  if (!eager) return B * g.H * g.L;
  std::int64_t n = 0;
  for (int j = 0; j < g.ranks(); ++j) n += ring_rect(g.members, g.place, j).probs_elems(B, g.H);
  return n;
}
inline std::int64_t ring_saved_stats(const SavedShape& s) {
  return ring_saved_stats(RingView::of_ranks(s.layout, s.rank, s.Hr), s.B, s.eager);
}

// One kernel call of a ring step: batch rows [b0, b0 + shape.B), query rows
// [q_row, q_row + shape.Sq) of the L local ones, against the block's rows
// [key0, key0 + shape.Sk) of each. Its lse (and eager probabilities) sit in
// the step's statistics from lse_off (probs_off), compact for its shape.
struct RingCall {
  explicit RingCall(const AttnShape& s) : shape(s) {}
  AttnShape shape;
  std::int64_t b0 = 0, q_row = 0, key0 = 0;
  std::int64_t lse_off = 0, probs_off = 0;
  // How many batch rows' identical calls this one stands for: 1, or in a
  // count-only run B (batch row 0's, ops::RepeatCounts).
  std::int64_t repeat = 1;
  std::vector<std::int64_t> doc_start;  // the diagonal's mask when packed, (B, L) local
  AttnShape kernel_shape() const {
    AttnShape s = shape;
    s.doc_start = doc_start.empty() ? nullptr : doc_start.data();
    return s;
  }
};

// The calls of the step that holds `owner`'s block (see the top): one over
// every batch row where the rectangle is the whole shard and block, else
// one per batch row (the kernel's batch rows must be the tensors' own).
inline std::vector<RingCall> ring_calls(const Step& st, const RingView& g, int owner,
                                        const RingRect& rect) {
  const SpLayout& lay = g.members;
  const std::int64_t Lk = lay.seq_count[size_t(owner)];
  std::vector<RingCall> calls;
  if (rect.rows == 0 || rect.keys == 0) return calls;
  auto shape = [&](std::int64_t B, std::int64_t Sq, std::int64_t Sk, bool causal) {
    return AttnShape{B, Sq, Sk, g.H, g.H, st.dqk, st.dv, st.ctx.cfg.softmax_scale(), causal};
  };
  auto add = [&](RingCall c, std::int64_t b0, std::int64_t lo) {
    c.b0 = b0, c.q_row = rect.q_row, c.key0 = rect.k_row + lo;
    c.lse_off = b0 * g.H * rect.rows;
    c.probs_off = b0 * g.H * rect.rows * rect.keys;
    calls.push_back(std::move(c));
  };
  const bool whole = rect.rows == g.L && rect.keys == Lk;
  if (st.doc_start.empty()) {
    const std::int64_t B = whole ? st.B : 1;
    // Count-only (no documents): row 0's call, standing for every row.
    const ops::BatchCalls rows = ops::batch_calls(st.B);
    if (B == 1 && rows.repeat > 1) {
      RingCall c(shape(1, rect.rows, rect.keys, rect.diagonal));
      c.repeat = rows.repeat;
      add(std::move(c), 0, 0);
      return calls;
    }
    for (std::int64_t b0 = 0; b0 < st.B; b0 += B)
      add(RingCall(shape(B, rect.rows, rect.keys, rect.diagonal)), b0, 0);
    return calls;
  }
  // Packed: the global positions of the local rows and of the block's.
  auto doc = [&](std::int64_t b, std::int64_t t) { return st.doc_start[size_t(b * st.S + t)]; };
  const std::vector<std::int64_t> qpos = lay.positions(g.place);
  if (rect.diagonal) {
    // Each row's keys from the first local row of its document.
    RingCall c(shape(st.B, g.L, g.L, true));
    c.doc_start.resize(size_t(st.B * g.L));
    for (std::int64_t b = 0; b < st.B; ++b)
      for (std::int64_t t = 0; t < g.L; ++t)
        c.doc_start[size_t(b * g.L + t)] =
            std::lower_bound(qpos.begin(), qpos.end(), doc(b, qpos[size_t(t)])) - qpos.begin();
    add(std::move(c), 0, 0);
    return calls;
  }
  // Only the rows of the document that runs into the rectangle's first
  // query (a prefix of its rows: a document reaching back past the keys'
  // end holds every token from there to its last) see earlier tokens:
  // each of them the keys from that document's start.
  const std::vector<std::int64_t> kpos = lay.positions(owner);
  const auto k0 = kpos.begin() + rect.k_row, k1 = k0 + rect.keys;
  for (std::int64_t b = 0; b < st.B; ++b) {
    const std::int64_t start = doc(b, qpos[size_t(rect.q_row)]);
    if (start > *(k1 - 1)) continue;
    std::int64_t rows = 0;
    while (rows < rect.rows && doc(b, qpos[size_t(rect.q_row + rows)]) == start) ++rows;
    const std::int64_t lo = std::lower_bound(k0, k1, start) - k0;
    add(RingCall(shape(1, rows, rect.keys - lo, false)), b, lo);
  }
  return calls;
}

// The call a step makes without documents, which each of its calls with
// documents fits in (fewer batch rows, rows and keys): what the step's bf16
// attention scratch is sized by (Pieces::attention_scratch), so that the
// count-only run, which has no documents, allocates what the real one does.
inline AttnShape ring_widest_call(const Step& st, const RingView& g, int owner,
                                  const RingRect& rect) {
  const bool whole = rect.rows == g.L && rect.keys == g.members.seq_count[size_t(owner)];
  return AttnShape{whole ? st.B : 1,           rect.rows,    rect.keys, g.H, g.H, st.dqk, st.dv,
                   st.ctx.cfg.softmax_scale(), rect.diagonal};
}

// The codec parts of a block that is per-head [K | V] itself (ring_kv: all
// H heads, Step::H; a2a_p2p: its head group's, Step::Hr): the attention
// reads it in place, and a step's dK/dV is added into the accumulator at
// its calls' rows. The form's codec derives from it and adds own_block and
// latent_grad.
template <class T, std::int64_t Step::*Heads>
struct PerHeadKv {
  static constexpr const char* pass = "kv_ring";
  static constexpr const char* grad_pass = "dkv_ring";
  std::int64_t width(const Step& st) const { return st.*Heads * (st.dqk + st.dv); }
  RingKv<T> kv(const Step& st, const MlaParams<T>&, const Tensor<T>& block, std::int64_t Lj) const {
    return RingKv<T>::of_block(st, st.*Heads, block, Lj);
  }
  void add_grad(const Step& st, const MlaParams<T>&, const Tensor<T>&, std::int64_t Lj,
                const std::vector<RingCall>& calls, const T* dkv, T* acc, MlaParams<T>&) const {
    const std::int64_t H = st.*Heads;
    for (const RingCall& c : calls) {
      const ops::RepeatCounts rows(c.repeat);
      ops::for_batch_rows(c.shape.B, [&](std::int64_t bb) {
        const std::int64_t row = (c.b0 + bb) * Lj + c.key0, n = c.shape.Sk;
        ops::add(block_k(st, H, acc, Lj).row_range(row, n),
                 block_k(st, H, dkv, Lj).row_range(row, n));
        ops::add(block_v(st, H, acc, Lj).row_range(row, n),
                 block_v(st, H, dkv, Lj).row_range(row, n));
      });
    }
  }
};

// One step of the ring: the block it holds and what its calls saved.
template <class T>
struct RingStep {
  int owner = 0;
  RingRect rect;  // what it attends (forward's; backward reads it)
  std::vector<RingCall> calls;
  Tensor<T> probs;  // eager: (B, H, rows, keys) of its RingRect, each call's at probs_off
  Tensor<T> lse;    // eager over several steps, until forward rescales probs: (B, H, rows)
};

// A shift in flight (Overlap::on), until its wait: its call and, with bf16
// on the wire (wire.hpp) and an fp32 tensor leaving (a gradient
// accumulator), the bf16 copy of it, which must live until then, and the
// arriving one, whose front half receives bf16 values that the wait widens.
template <class T>
struct InFlight {
  Tensor<bf16> leaving;
  T* arriving = nullptr;
  std::int64_t arriving_elems = 0;
  PendingCollective call;  // last: destroyed (waited for) before `leaving` is freed
};

// One shift of `cur` on to rank r + 1, receiving rank r - 1's block (or
// accumulator, next_elems elements) into a new buffer, which it returns: started, and held in
// `flight` until its wait, with Overlap::on; else done here. Either way the
// same bytes move, so the same bits arrive. `cur` must live until the wait.
// A block held narrowed (bf16 runs, see the top) moves as it is, into a
// buffer born narrowed. Else, with bf16 on the wire, what moves is cur
// narrowed to bf16, and the new buffer's front half receives it
// (wire.hpp).
template <class T>
Tensor<T> shift(const Step& st, const RingView& g, const Tensor<T>& cur, std::int64_t next_elems,
                const char* label, const char* name, InFlight<T>& flight) {
  const bool overlap = st.ctx.variant.overlap == Overlap::on;
  Communicator& comm = st.ctx.comm;
  if (cur.narrowed()) {
    Tensor<T> next = Tensor<T>::born_narrowed({next_elems}, name, MemCategory::comm_buffers);
    const void* leaving = cur.narrowed_data();
    if (overlap)
      flight.call = comm.start_ring_shift(leaving, cur.numel(), next.narrowed_data(), next.numel(),
                                          DType::bf16, label, g.ring);
    else
      comm.ring_shift(leaving, cur.numel(), next.narrowed_data(), next.numel(), DType::bf16, label,
                      g.ring);
    return next;
  }
  Tensor<T> next({next_elems}, name, MemCategory::comm_buffers);
  if constexpr (std::is_same_v<T, float>) {
    if (ops::in_bf16<T>()) {
      Tensor<bf16> leaving({cur.numel()}, "ring block, bf16 on the wire",
                           MemCategory::comm_buffers);
      wire::narrow(cur.data(), leaving.data(), cur.numel());
      if (overlap) {
        flight.call =
            comm.start_ring_shift(static_cast<const void*>(leaving.data()), leaving.numel(),
                                  next.data(), next.numel(), DType::bf16, label, g.ring);
        flight.leaving = std::move(leaving);
        flight.arriving = next.data(), flight.arriving_elems = next.numel();
        return next;
      }
      comm.ring_shift(static_cast<const void*>(leaving.data()), leaving.numel(), next.data(),
                      next.numel(), DType::bf16, label, g.ring);
      leaving.reset();
      wire::widen(next.data(), next.data(), next.numel());
      return next;
    }
  }
  if (overlap)
    flight.call =
        comm.start_ring_shift(cur.data(), cur.numel(), next.data(), next.numel(), label, g.ring);
  else
    comm.ring_shift(cur.data(), cur.numel(), next.data(), next.numel(), label, g.ring);
  return next;
}
template <class T>
void wait(const Step& st, InFlight<T>& flight) {
  if (!flight.call.pending()) return;
  st.ctx.comm.wait(flight.call);
  if constexpr (std::is_same_v<T, float>)
    if (flight.arriving_elems > 0)
      wire::widen(flight.arriving, flight.arriving, flight.arriving_elems);
  flight = InFlight<T>{};
}

// The attention of the ring: what forward keeps for backward.
template <class T>
struct RingAttention {
  Tensor<T> lse;                   // flash: (B, H, L), the merged lse
  std::vector<RingStep<T>> steps;  // P, in ring order

  // q (B, L, H, dqk) of local tokens and the own block (B L width);
  // returns o (B, L, H dv), the merged output.
  template <class Codec>
  Tensor<T> forward(const Step& st, const RingView& g, const MlaParams<T>& w, const Codec& codec,
                    const Tensor<T>& q, const Tensor<T>& own) {
    const int ranks = g.ranks(), r = g.place;
    const bool eager = st.ctx.attention == AttentionKind::eager;
    const SpLayout& lay = g.members;
    auto elems = [&](int j) { return st.B * lay.seq_count[size_t(j)] * codec.width(st); };
    Tensor<T> o({st.B, g.L, g.H * st.dv}, "o_loc");
    Tensor<T> merged({st.B, g.H, g.L}, eager ? "ring lse" : "attn_stats flash lse");
    const Tensor<T>* cur = &own;
    Tensor<T> held;
    steps.resize(size_t(ranks));
    for (int i = 0; i < ranks; ++i) {
      RingStep<T>& step = steps[size_t(i)];
      step.owner = (r - i + ranks) % ranks;
      const std::int64_t Lk = lay.seq_count[size_t(step.owner)];
      const int next_owner = (step.owner - 1 + ranks) % ranks;
      InFlight<T> pending;
      Tensor<T> next;
      if (i + 1 < ranks)
        next = shift(st, g, *cur, elems(next_owner), codec.pass, "ring_block", pending);
      // What every block with keys the own tokens see costs, packed or
      // not: the count-only run, which has no documents, must allocate what
      // the real one does (RingRect).
      step.rect = ring_rect(lay, r, step.owner);
      const RingRect& rect = step.rect;
      step.calls = ring_calls(st, g, step.owner, rect);
      if (rect.rows > 0) {
        if (eager) {
          step.probs = Tensor<T>({rect.probs_elems(st.B, g.H)}, "attn_stats eager probs");
          if (ranks > 1) step.lse = Tensor<T>({rect.lse_elems(st.B, g.H)}, "ring step lse");
        }
        const RingKv<T> kv = codec.kv(st, w, *cur, Lk);
        Tensor<T> o_part({st.B, g.L, g.H * st.dv}, "o_part");
        Tensor<T> lse_part;
        if (!step.lse.defined()) lse_part = Tensor<T>({rect.lse_elems(st.B, g.H)}, "lse_part");
        T* lse_base = step.lse.defined() ? step.lse.data() : lse_part.data();
        // q and the block's K/V held narrowed (bf16 runs) are read in
        // place, rows at the call's offsets; their copies are not in the
        // scratch.
        const auto kept = kv.narrowed(st, 0, nullptr, q.narrowed());
        Tensor<bf16> scratch;
        if (rect.keys > 0)  // as ring_calls without documents: a call
          scratch =
              ops::attention_scratch<T>(st.ctx.attention, ring_widest_call(st, g, step.owner, rect),
                                        ops::AttentionPass::forward, &kept);
        for (const RingCall& c : step.calls) {
          const ops::RepeatCounts rows(c.repeat);
          const AttnShape s = c.kernel_shape();
          const std::int64_t q_off = (c.b0 * g.L + c.q_row) * g.H,
                             k_off = (c.b0 * Lk + c.key0) * g.H;
          T* o_p = at(o_part.data(), q_off * st.dv);
          T* lse_p = at(lse_base, c.lse_off);
          T* probs = at(step.probs.data(), c.probs_off);
          const auto narrow =
              kv.narrowed(st, k_off, at(q.narrowed_data(), q_off * st.dqk), q.narrowed());
          ops::attention_forward(st.ctx.attention, s, o_p, eager ? probs : lse_p,
                                 at(q.data(), q_off * st.dqk), at(kv.k, k_off * st.dqk),
                                 at(kv.v, k_off * st.dv), eager ? lse_p : nullptr,
                                 narrow.any() ? &narrow : nullptr, &scratch);
          ops::lse_merge(c.shape, g.L, g.H, c.b0, c.q_row, o.data(), merged.data(),
                         static_cast<const T*>(o_p), static_cast<const T*>(lse_p));
        }
      }
      wait(st, pending);
      if (i + 1 < ranks) {
        held = std::move(next);
        cur = &held;
      }
    }
    held.reset();
    for (RingStep<T>& step : steps) {
      if (!step.lse.defined()) continue;
      for (const RingCall& c : step.calls) {
        const ops::RepeatCounts rows(c.repeat);
        ops::rescale_probs(c.shape, g.L, g.H, c.b0, c.q_row, at(step.probs.data(), c.probs_off),
                           at(step.lse.data(), c.lse_off), merged.data());
      }
      step.lse.reset();
    }
    if (!eager) lse = std::move(merged);
    return o;
  }

  // From do (B, L, H dv) of local tokens: dq (B, L, H dqk), returned with
  // the own block's gradient (B L width), home after the ring; the codec's
  // parameter gradients added. Frees what forward kept.
  template <class Codec>
  std::pair<Tensor<T>, Tensor<T>> backward(const Step& st, const RingView& g, const MlaParams<T>& w,
                                           const Codec& codec, const Tensor<T>& q,
                                           const Tensor<T>& own, const Tensor<T>& o,
                                           const Tensor<T>& do_loc, MlaParams<T>& grads) {
    const int ranks = g.ranks();
    const bool eager = st.ctx.attention == AttentionKind::eager;
    const SpLayout& lay = g.members;
    auto elems = [&](int j) { return st.B * lay.seq_count[size_t(j)] * codec.width(st); };
    // Eager over several blocks: D = do . o of the whole row, (B, H, L).
    Tensor<T> delta;
    if (eager && ranks > 1) {
      delta = Tensor<T>({st.B, g.H, g.L}, "ring delta");
      ops::attention_delta(st.B, g.L, g.H, st.dv, delta.data(), do_loc.data(), o.data());
    }
    Tensor<T> dq = Tensor<T>::zeros({st.B, g.L, g.H * st.dqk}, "dq_h");
    const Tensor<T>* cur = &own;
    Tensor<T> held;  // the block held, once it is not the own one
    Tensor<T> acc = Tensor<T>::zeros({own.numel()}, "ring grad acc", MemCategory::comm_buffers);
    Tensor<T> acc_sent;       // the accumulator on its way to r + 1, until its wait
    InFlight<T> acc_pending;  // its shift (Overlap::on)
    for (int i = 0; i < ranks; ++i) {
      RingStep<T>& step = steps[size_t(i)];
      const std::int64_t Lk = lay.seq_count[size_t(step.owner)];
      const int next_owner = (step.owner - 1 + ranks) % ranks;
      InFlight<T> kv_pending;
      Tensor<T> next;
      if (i + 1 < ranks)
        next = shift(st, g, *cur, elems(next_owner), codec.pass, "ring_block", kv_pending);
      // The step's gradients into scratch of the step's full extents (what
      // the count-only run, which has no documents, allocates too), each
      // call's at its rows: dq added at once, the block's dK/dV once its
      // accumulator has arrived.
      Tensor<T> dkv;
      const RingRect& rect = step.rect;
      if (rect.rows > 0) {
        const RingKv<T> kv = codec.kv(st, w, *cur, Lk);
        Tensor<T> dq_part({st.B * g.L, g.H * st.dqk}, "dq_part");
        dkv = Tensor<T>::zeros({st.B * Lk * g.H * (st.dqk + st.dv)}, "dkv_part");
        Tensor<T> rows_stat, dp;  // the calls' rows of lse (flash) or D (eager, several blocks)
        if (!eager || delta.defined())
          rows_stat = Tensor<T>({rect.lse_elems(st.B, g.H)}, "ring stats rows");
        if (eager) dp = Tensor<T>({g.L, Lk}, "eager dp scratch");
        // q, dO and the block's K/V held narrowed (bf16 runs: the tapes'
        // backward) are read in place, rows at the call's offsets; their
        // copies are not in the scratch.
        auto narrow = kv.narrowed(st, 0, nullptr, q.narrowed());
        narrow.dout_held = do_loc.narrowed();
        Tensor<bf16> scratch;
        if (rect.keys > 0)  // as ring_calls without documents: a call
          scratch =
              ops::attention_scratch<T>(st.ctx.attention, ring_widest_call(st, g, step.owner, rect),
                                        ops::AttentionPass::backward, &narrow);
        for (const RingCall& c : step.calls) {
          const ops::RepeatCounts rows(c.repeat);
          const AttnShape s = c.kernel_shape();
          const std::int64_t q_off = (c.b0 * g.L + c.q_row) * g.H,
                             k_off = (c.b0 * Lk + c.key0) * g.H;
          T* stat = at(rows_stat.data(), c.lse_off);
          if (rows_stat.defined())
            ops::gather_stat_rows(c.shape, g.L, g.H, c.b0, c.q_row,
                                  eager ? delta.data() : lse.data(), stat);
          const auto call =
              kv.narrowed(st, k_off, at(q.narrowed_data(), q_off * st.dqk), q.narrowed());
          narrow.q = call.q, narrow.k = call.k, narrow.v = call.v;
          narrow.dout = at(do_loc.narrowed_data(), q_off * st.dv);
          ops::attention_backward(
              st.ctx.attention, s, at(dq_part.data(), q_off * st.dqk),
              at(block_k(st, g.H, dkv.data(), Lk).p, k_off * st.dqk),
              at(block_v(st, g.H, dkv.data(), Lk).p, k_off * st.dv),
              at(do_loc.data(), q_off * st.dv), at(q.data(), q_off * st.dqk),
              at(kv.k, k_off * st.dqk), at(kv.v, k_off * st.dv), at(o.data(), q_off * st.dv),
              eager ? at(step.probs.data(), c.probs_off) : stat, dp.data(), eager ? stat : nullptr,
              narrow.any() ? &narrow : nullptr, &scratch);
          ops::for_batch_rows(s.B, [&](std::int64_t bb) {
            const std::int64_t row = (c.b0 + bb) * g.L + c.q_row;
            ops::add(mat(dq).row_range(row, s.Sq),
                     mat(std::as_const(dq_part)).row_range(row, s.Sq));
          });
        }
      }
      step.probs.reset();
      wait(st, acc_pending);
      acc_sent.reset();
      if (dkv.defined())
        codec.add_grad(st, w, *cur, Lk, step.calls, std::as_const(dkv).data(), acc.data(), grads);
      dkv.reset();
      wait(st, kv_pending);
      // The accumulator goes on with its block; after the last step, home.
      if (ranks > 1) {
        Tensor<T> arriving =
            shift(st, g, acc, elems(next_owner), codec.grad_pass, "ring_grad_acc", acc_pending);
        // The accumulator is read until the wait, unless what the wire
        // reads is its bf16 copy (InFlight::leaving): then it is freed now.
        if (!acc_pending.leaving.defined()) acc_sent = std::move(acc);
        acc = std::move(arriving);
      }
      if (i + 1 < ranks) {
        held = std::move(next);
        cur = &held;
      }
    }
    wait(st, acc_pending);
    steps.clear();
    lse.reset();
    return {std::move(dq), std::move(acc)};
  }
};

// A ring form's whole frame: the input projections, the own block, the
// queries of local tokens with all heads, the ring's attention, wo; and
// backward reversed. Only the codec differs between the ring forms.
template <class T, class Codec>
struct RingTape final : Tape<T> {
  using P = Pieces<T>;
  InputSaved<T> in;
  Codec codec;
  Tensor<T> q;      // (B, L, H, dqk)
  Tensor<T> own;    // (B L width): the own block
  Tensor<T> o_loc;  // (B, L, H dv): the merged output, wo's input
  RingAttention<T> att;

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    // q, dO and the blocks are read only as attention's (and the
    // up-projection's) bf16 operands (and dO, widened exactly, for D): they
    // stay held at 2 bytes, read in place every step (RingAttention's
    // backward, see the top), the same bits.
    // do (B, L, H dv) = dout wo; wo += dout^T o.
    Tensor<T> do_loc = P::output_projection_backward(st, w, in, dout, o_loc, grads, "do_h");
    ops::keep_narrowed(do_loc);
    auto [dq, acc] =
        att.backward(st, RingView::of_ranks(st), w, codec, q, own, o_loc, do_loc, grads);
    do_loc.reset(), o_loc.reset(), own.reset(), q.reset();
    Tensor<T> dproj;  // rq == 0: dq lands in it
    Tensor<T> dq_loc = P::local_queries_backward(st, dq, dproj);
    Tensor<T> dlat_loc = codec.latent_grad(st, w, acc, grads);
    P::project_in_backward(st, w, x, dq_loc, dlat_loc, dproj, in, dx, grads);
  }
};

template <class T, class Codec>
std::unique_ptr<Tape<T>> ring_forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                      Tensor<T>& out) {
  using P = Pieces<T>;
  auto t = std::make_unique<RingTape<T, Codec>>();
  P::project_in(st, w, x, t->in);
  t->own = t->codec.own_block(st, w, t->in);
  t->q = P::local_queries(st, w, t->in);
  // The queries and the own block hold bf16 values (GEMMs' and RoPE's
  // rounded outputs): held at 2 bytes from here (ops::keep_narrowed), the
  // ring's blocks likewise (see the top). o_loc is the merged output in
  // fp32, whose D = rowsum(dO o) backward reads.
  ops::keep_narrowed(t->q), ops::keep_narrowed(t->own);
  t->o_loc = t->att.forward(st, RingView::of_ranks(st), w, t->codec, t->q, t->own);
  P::output_projection(st, w, t->in, t->o_loc, out);
  return t;
}

}  // namespace laga::detail::ring
