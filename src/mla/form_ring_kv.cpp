// ring_kv: ring attention with per-head K/V, Megatron-Core/TransformerEngine's
// cp_comm_type="p2p" (docs/forms.md, "ring_kv"). Each rank keeps its own
// query tokens with ALL heads, as allgather_kv does; instead of gathering
// every K/V at once, the rank's [K | V] block passes round the ring, one
// neighbour per step, and each rank attends its queries against the block
// it holds, merging the steps' partial outputs by their log-sum-exp:
//
//   kv (B, L, H (dn+dv)) = c_hat wkv_b^T -> own block [k (B, L, H, dqk) | v (B, L, H, dv)]
//   step i = 0 .. P-1 holds rank j = r - i's block, tokens [k0, k0 + L_j):
//     send it to r + 1 and receive r - i - 1's (not after the last step),
//     the transfer started before the step's attention and waited after it
//     with --overlap on, or run first without (the same bytes and bits);
//     j == r: causal attention of q over the own block (the diagonal);
//     j <  r: every key precedes every query, attention without a mask;
//     j >  r: keys after every query, no work (the block still passes on);
//     o = e^(lse - lse') o + e^(lse_j - lse') o_j,  lse' = log(e^lse + e^lse_j)
//   out (B, L, D) = o wo^T
//
// Backward recomputes as flash does: the blocks pass round the ring again,
// each step's attention backward reads the final o and lse (eager: its
// saved probabilities, rescaled in forward to the row's whole
// normalisation, and D = do . o), and a dK/dV accumulator travels with its
// block: the rank adds its part to the accumulator of the block it holds
// and passes it on, so after P steps and one more shift every block's
// gradient, summed over the ranks that attended it in ring order, is home.
// Then explicit's merge into d[c_hat | k_pe].
//
// Uneven shards: the blocks are the SpLayout's seq shards, of any length
// (no S % 2P rule; a rank without tokens sends and attends nothing but
// still relays). The shards are contiguous, so the causal work is not
// balanced (the last rank attends about 2P-1 times the first's pairs; TE
// balances it with two mirrored chunks per rank, which laga's layout does
// not have: the work model's balance reports it). Packed documents: a past
// block is attended only by the rows of the document that runs into this
// rank's shard, over the keys from that document's start (one unmasked
// call per batch row), the diagonal under the documents' mask; blocks no
// row sees are skipped, and still passed on (the ledger counts them).
//
// Saved for backward: the input projections' tensors, c_hat (B, L, C),
// q (B, L, H, dqk), the own block (B, L, H (dqk + dv)), o (B, L, H, dv) (as
// o_loc, wo's input), and the statistics: flash's lse (B, H, L), or eager's
// probabilities of every step whose block precedes the own end,
// B H L L_j each (B H L s1 in all, as allgather_kv).
#include <cmath>

#include "mla/form.hpp"

namespace laga::detail {

namespace {

using ops::mat;

// [K | V] elements of rank j's block.
std::int64_t block_elems(const Step& st, int j) {
  return st.B * st.ctx.layout.seq_count[static_cast<size_t>(j)] * st.H * (st.dqk + st.dv);
}
// Its K part, (B L_j, H dqk) rows, and its V part after it, (B L_j, H dv).
template <class T>
ops::Mat<T> block_k(const Step& st, T* p, std::int64_t Lj) {
  return {p, st.B * Lj, st.H * st.dqk, st.H * st.dqk};
}
template <class T>
ops::Mat<T> block_v(const Step& st, T* p, std::int64_t Lj) {
  return {at(p, st.B * Lj * st.H * st.dqk), st.B * Lj, st.H * st.dv, st.H * st.dv};
}

// One kernel call of a ring step: batch rows [b0, b0 + shape.B), the first
// shape.Sq query rows of each, against the block's keys [key0, key0 +
// shape.Sk). Its lse (and eager probabilities) sit in the step's
// statistics at batch row b0, laid out compact for its shape.
struct RingCall {
  explicit RingCall(const AttnShape& s) : shape(s) {}
  AttnShape shape;
  std::int64_t b0 = 0, key0 = 0;
  std::vector<std::int64_t> doc_start;  // the diagonal's mask when packed, (B, L) local
  AttnShape kernel_shape() const {
    AttnShape s = shape;
    s.doc_start = doc_start.empty() ? nullptr : doc_start.data();
    return s;
  }
};

// The calls of the step that holds `owner`'s block (see the top).
std::vector<RingCall> ring_calls(const Step& st, int owner) {
  const SpLayout& lay = st.ctx.layout;
  const std::int64_t s0 = st.pos0, L = st.L;
  const std::int64_t k0 = lay.seq_offset[size_t(owner)], Lk = lay.seq_count[size_t(owner)];
  std::vector<RingCall> calls;
  if (L == 0 || Lk == 0 || k0 > s0) return calls;
  auto shape = [&](std::int64_t B, std::int64_t Sq, std::int64_t Sk, bool causal) {
    return AttnShape{B, Sq, Sk, st.H, st.H, st.dqk, st.dv, st.ctx.cfg.softmax_scale(), causal};
  };
  const bool packed = !st.doc_start.empty();
  auto doc = [&](std::int64_t b, std::int64_t t) { return st.doc_start[size_t(b * st.S + t)]; };
  if (k0 == s0) {  // the own block: the diagonal
    RingCall c(shape(st.B, L, L, true));
    if (packed) {
      c.doc_start.resize(size_t(st.B * L));
      for (std::int64_t b = 0; b < st.B; ++b)
        for (std::int64_t t = 0; t < L; ++t)
          c.doc_start[size_t(b * L + t)] = std::max(doc(b, s0 + t), s0) - s0;
    }
    calls.push_back(std::move(c));
    return calls;
  }
  if (!packed) {
    calls.emplace_back(shape(st.B, L, Lk, false));
    return calls;
  }
  // Only the rows of the document that runs into this shard (those whose
  // document started before s0, a prefix of the rows) see earlier tokens:
  // all of them the keys from max(k0, its start).
  for (std::int64_t b = 0; b < st.B; ++b) {
    const std::int64_t start = doc(b, s0);
    if (start == s0) continue;
    std::int64_t rows = 0;
    while (rows < L && doc(b, s0 + rows) == start) ++rows;
    const std::int64_t lo = std::max(k0, start) - k0;
    if (lo >= Lk) continue;
    RingCall c(shape(1, rows, Lk - lo, false));
    c.b0 = b;
    c.key0 = lo;
    calls.push_back(std::move(c));
  }
  return calls;
}

// One step of the ring: the block it holds and what its calls saved.
template <class T>
struct RingStep {
  int owner = 0;
  std::vector<RingCall> calls;
  Tensor<T> probs;  // eager: (B, H, L, L_owner), each call's at its batch row
  Tensor<T> lse;    // eager over several steps, until forward rescales probs: (B, H, L)
};

// Merges a call's partial output into the running one, row by row:
// o (B, L, H, dv) and lse (B, H, L) of the whole rank, o_p and lse_p the
// call's (at its batch row, compact for its shape). `first`: the rows hold
// nothing yet (the diagonal, always step 0), copied as they are, so a rank
// whose rows see only their own block has the kernel's bits.
template <class T>
void merge_partial(const Step& st, const RingCall& c, T* o, T* lse, const T* o_p, const T* lse_p,
                   bool first) {
  const AttnShape& s = c.shape;
  ops::count_elementwise<T>(s.B * s.Sq * st.H * (st.dv + 1), 3);
  if (!ops::runs(s.B * s.Sq * st.H, {o, lse, o_p, lse_p})) return;
  for (std::int64_t bb = 0; bb < s.B; ++bb) {
    const std::int64_t b = c.b0 + bb;
    for (std::int64_t h = 0; h < st.H; ++h)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        T& l = lse[(b * st.H + h) * st.L + i];
        const T lp = lse_p[(bb * st.H + h) * s.Sq + i];
        T* orow = o + ((b * st.L + i) * st.H + h) * st.dv;
        const T* prow = o_p + ((bb * s.Sq + i) * st.H + h) * st.dv;
        if (first) {
          l = lp;
          std::copy(prow, prow + st.dv, orow);
          continue;
        }
        const T m = std::max(l, lp);
        const T merged = m + std::log(std::exp(l - m) + std::exp(lp - m));
        const T a = std::exp(l - merged), w = std::exp(lp - merged);
        for (std::int64_t e = 0; e < st.dv; ++e) orow[e] = a * orow[e] + w * prow[e];
        l = merged;
      }
  }
}

// Eager: a call's probabilities (at its batch row, compact for its shape)
// were normalised over its own keys; times e^(lse_p - lse) they are the
// row's over all its keys, which backward reads.
template <class T>
void rescale_probs(const Step& st, const RingCall& c, T* probs, const T* lse_p, const T* lse) {
  const AttnShape& s = c.shape;
  ops::count_elementwise<T>(s.B * st.H * s.Sq * s.Sk, 2);
  if (!ops::runs(s.B * st.H * s.Sq, {probs, lse_p, lse})) return;
  for (std::int64_t bb = 0; bb < s.B; ++bb)
    for (std::int64_t h = 0; h < st.H; ++h)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        const std::int64_t row = (bb * st.H + h) * s.Sq + i;
        const T f = std::exp(lse_p[row] - lse[((c.b0 + bb) * st.H + h) * st.L + i]);
        for (T* p = probs + row * s.Sk; p != probs + (row + 1) * s.Sk; ++p) *p *= f;
      }
}

// The call's rows of a (B, H, L) statistic, compact for its shape (the
// kernels read lse and D that way).
template <class T>
void gather_rows(const Step& st, const RingCall& c, const T* full, T* part) {
  const AttnShape& s = c.shape;
  if (!ops::runs(s.B * s.Sq * st.H, {full, part})) return;
  for (std::int64_t bb = 0; bb < s.B; ++bb)
    for (std::int64_t h = 0; h < st.H; ++h)
      std::copy_n(full + ((c.b0 + bb) * st.H + h) * st.L, s.Sq, part + (bb * st.H + h) * s.Sq);
}

// One shift of `cur` on to rank r + 1, receiving rank `from`'s block (or
// accumulator) into a new buffer, which it returns: started, and held in
// `pending` until its wait, with Overlap::on; else done here. Either way the
// same bytes move, so the same bits arrive. `cur` must live until the wait.
template <class T>
Tensor<T> shift(const Step& st, const Tensor<T>& cur, int from, const char* label, const char* name,
                PendingCollective& pending) {
  Tensor<T> next({block_elems(st, from)}, name, MemCategory::comm_buffers);
  if (st.ctx.variant.overlap == Overlap::on)
    pending =
        st.ctx.comm.start_ring_shift(cur.data(), cur.numel(), next.data(), next.numel(), label);
  else
    st.ctx.comm.ring_shift(cur.data(), cur.numel(), next.data(), next.numel(), label);
  return next;
}
void wait(const Step& st, PendingCollective& pending) {
  if (pending.pending()) st.ctx.comm.wait(pending);
}

template <class T>
struct RingKvTape final : Tape<T> {
  using P = Pieces<T>;
  InputSaved<T> in;
  Tensor<T> c_hat;                 // (B, L, C)
  Tensor<T> q;                     // (B, L, H, dqk)
  Tensor<T> kv_own;                // (B L H (dqk + dv)): [k | v] of local tokens
  Tensor<T> o_loc;                 // (B, L, H dv): the merged output, wo's input
  Tensor<T> lse;                   // flash: (B, H, L), the merged lse
  std::vector<RingStep<T>> steps;  // P, in ring order

  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                Tensor<T>& dx, MlaParams<T>& grads) override {
    const int ranks = st.ctx.layout.ranks;
    const bool eager = st.ctx.attention == AttentionKind::eager;
    const SpLayout& lay = st.ctx.layout;
    // do (B, L, H dv) = dout wo; wo += dout^T o.
    Tensor<T> do_loc({st.B, st.L, st.H * st.dv}, "do_h");
    {
      ops::Mat<T> do_m = mat(do_loc);
      ops::linear_backward(&do_m, false, grads.wo, mat(dout), mat(o_loc), w.wo);
    }
    // Eager over several blocks: D = do . o of the whole row, (B, H, L).
    Tensor<T> delta;
    if (eager && ranks > 1) {
      delta = Tensor<T>({st.B, st.H, st.L}, "ring delta");
      ops::count_elementwise<T>(st.B * st.L * st.H * st.dv, 2);
      if (ops::runs(st.B * st.L * st.H, {delta.data(), do_loc.data(), o_loc.data()}))
        for (std::int64_t b = 0; b < st.B; ++b)
          for (std::int64_t i = 0; i < st.L; ++i)
            for (std::int64_t h = 0; h < st.H; ++h) {
              const std::int64_t off = ((b * st.L + i) * st.H + h) * st.dv;
              T D = 0;
              for (std::int64_t e = 0; e < st.dv; ++e)
                D += do_loc.data()[off + e] * o_loc.data()[off + e];
              delta.data()[(b * st.H + h) * st.L + i] = D;
            }
    }
    Tensor<T> dq = Tensor<T>::zeros({st.B, st.L, st.H * st.dqk}, "dq_h");
    const Tensor<T>* cur = &kv_own;
    Tensor<T> held;  // the block held, once it is not the own one
    Tensor<T> acc = Tensor<T>::zeros({kv_own.numel()}, "dkv_acc", MemCategory::comm_buffers);
    Tensor<T> acc_sent;             // the accumulator on its way to r + 1, until its wait
    PendingCollective acc_pending;  // its shift (Overlap::on)
    for (int i = 0; i < ranks; ++i) {
      RingStep<T>& step = steps[size_t(i)];
      const std::int64_t Lk = lay.seq_count[size_t(step.owner)];
      const int next_owner = (step.owner - 1 + ranks) % ranks;
      PendingCollective kv_pending;
      Tensor<T> next;
      if (i + 1 < ranks) next = shift(st, *cur, next_owner, "kv_ring", "kv_block", kv_pending);
      // The step's gradients into scratch of the step's full extents (what
      // the count-only run, which has no documents, allocates too), each
      // call's at its rows: dq added at once, the block's dK/dV once its
      // accumulator has arrived.
      const bool precedes = st.L > 0 && Lk > 0 && lay.seq_offset[size_t(step.owner)] <= st.pos0;
      Tensor<T> dq_part, dkv_part, rows_stat, dp;
      if (precedes) {
        dq_part = Tensor<T>({st.B * st.L, st.H * st.dqk}, "dq_part");
        dkv_part = Tensor<T>({block_elems(st, step.owner)}, "dkv_part");
        // The calls' rows of lse (flash) or D (eager over several blocks).
        if (!eager || delta.defined()) rows_stat = Tensor<T>({st.B, st.H, st.L}, "ring stats rows");
        if (eager) dp = Tensor<T>({st.L, Lk}, "eager dp scratch");
      }
      for (const RingCall& c : step.calls) {
        const AttnShape s = c.kernel_shape();
        const std::int64_t q_off = c.b0 * st.L * st.H, k_off = (c.b0 * Lk + c.key0) * st.H;
        T* stat = at(rows_stat.data(), c.b0 * st.H * st.L);
        if (rows_stat.defined()) gather_rows(st, c, eager ? delta.data() : lse.data(), stat);
        P::attend_backward(
            st, s, at(dq_part.data(), q_off * st.dqk),
            at(block_k(st, dkv_part.data(), Lk).p, k_off * st.dqk),
            at(block_v(st, dkv_part.data(), Lk).p, k_off * st.dv), at(do_loc.data(), q_off * st.dv),
            at(q.data(), q_off * st.dqk), at(block_k(st, cur->data(), Lk).p, k_off * st.dqk),
            at(block_v(st, cur->data(), Lk).p, k_off * st.dv), at(o_loc.data(), q_off * st.dv),
            eager ? at(step.probs.data(), c.b0 * st.H * st.L * Lk) : stat, dp.data(),
            eager ? stat : nullptr);
        for (std::int64_t b = c.b0; b < c.b0 + s.B; ++b)
          ops::add(mat(dq).row_range(b * st.L, s.Sq),
                   mat(std::as_const(dq_part)).row_range(b * st.L, s.Sq));
      }
      step.probs.reset(), dq_part.reset(), rows_stat.reset(), dp.reset();
      wait(st, acc_pending);
      acc_sent.reset();
      for (const RingCall& c : step.calls)
        for (std::int64_t b = c.b0; b < c.b0 + c.shape.B; ++b) {
          const std::int64_t row = b * Lk + c.key0, n = c.shape.Sk;
          const T* part = dkv_part.data();
          ops::add(block_k(st, acc.data(), Lk).row_range(row, n),
                   block_k(st, part, Lk).row_range(row, n));
          ops::add(block_v(st, acc.data(), Lk).row_range(row, n),
                   block_v(st, part, Lk).row_range(row, n));
        }
      dkv_part.reset();
      wait(st, kv_pending);
      // The accumulator goes on with its block; after the last step, home.
      if (ranks > 1) {
        Tensor<T> arriving = shift(st, acc, next_owner, "dkv_ring", "dkv_acc", acc_pending);
        acc_sent = std::move(acc);
        acc = std::move(arriving);
      }
      if (i + 1 < ranks) {
        held = std::move(next);
        cur = &held;
      }
    }
    wait(st, acc_pending);
    acc_sent.reset(), held.reset(), delta.reset(), do_loc.reset();
    o_loc.reset(), lse.reset(), kv_own.reset();
    steps.clear();

    Tensor<T> dproj;  // rq == 0: dq lands in it
    Tensor<T> dq_loc = P::local_queries_backward(st, dq, dproj);
    // As explicit: d kv from [dk_nope | dv] per head; d k_pe = the sum over
    // heads of dk's rope part.
    Tensor<T> dlat_loc = Tensor<T>::zeros({st.B, st.L, st.W}, "dlat_loc");
    {
      Tensor<T> dkv({st.B, st.L, st.H * st.KV}, "dkv");
      const T* a = acc.data();
      P::merge_dkv(st, st.H, block_k(st, a, st.L), block_v(st, a, st.L), mat(dkv),
                   mat(dlat_loc).col_range(st.C, st.dr));
      acc.reset();
      ops::gemm(mat(dlat_loc).col_range(0, st.C), T(0), mat(dkv), false, mat(w.wkv_b), false);
      ops::linear_backward<T>(nullptr, false, grads.wkv_b, mat(dkv), mat(c_hat), w.wkv_b);
    }
    c_hat.reset();
    P::project_in_backward(st, w, x, dq_loc, dlat_loc, dproj, in, dx, grads);
  }
};

template <class T>
std::unique_ptr<Tape<T>> ring_kv_forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                         Tensor<T>& out) {
  using P = Pieces<T>;
  const int ranks = st.ctx.layout.ranks, r = st.ctx.comm.rank();
  const bool eager = st.ctx.attention == AttentionKind::eager;
  const SpLayout& lay = st.ctx.layout;
  auto t = std::make_unique<RingKvTape<T>>();
  P::project_in(st, w, x, t->in);
  t->c_hat = P::project_latent(st, w, t->in, "c_hat");
  // kv (N, H (dn+dv)) = c_hat wkv_b^T, split into the own block's K and V.
  t->kv_own = Tensor<T>({block_elems(st, r)}, "kv_own");
  {
    Tensor<T> kv({st.B, st.L, st.H * st.KV}, "kv");
    ops::linear(mat(kv), mat(t->c_hat), w.wkv_b);
    P::split_kv(st, st.H, mat(std::as_const(kv)), t->in.kv_a_rows(st).col_range(st.C, st.dr),
                block_k(st, t->kv_own.data(), st.L), block_v(st, t->kv_own.data(), st.L));
  }
  t->q = P::local_queries(st, w, t->in);
  Tensor<T> o({st.B, st.L, st.H * st.dv}, "o_loc");
  Tensor<T> lse({st.B, st.H, st.L}, eager ? "ring lse" : "attn_stats flash lse");
  const Tensor<T>* cur = &t->kv_own;
  Tensor<T> held;
  t->steps.resize(size_t(ranks));
  for (int i = 0; i < ranks; ++i) {
    RingStep<T>& step = t->steps[size_t(i)];
    step.owner = (r - i + ranks) % ranks;
    const std::int64_t Lk = lay.seq_count[size_t(step.owner)];
    PendingCollective pending;
    Tensor<T> next;
    if (i + 1 < ranks)
      next = shift(st, *cur, (step.owner - 1 + ranks) % ranks, "kv_ring", "kv_block", pending);
    step.calls = ring_calls(st, step.owner);
    // Eager's probabilities for every block that does not follow the own
    // tokens, packed or not: the count-only run, which has no documents,
    // must allocate what the real one does.
    const bool precedes = st.L > 0 && Lk > 0 && lay.seq_offset[size_t(step.owner)] <= st.pos0;
    if (eager && precedes) {
      step.probs = Tensor<T>({st.B, st.H, st.L, Lk}, "attn_stats eager probs");
      if (ranks > 1) step.lse = Tensor<T>({st.B, st.H, st.L}, "ring step lse");
    }
    if (precedes) {
      Tensor<T> o_part({st.B, st.L, st.H * st.dv}, "o_part");
      Tensor<T> lse_part;
      if (!step.lse.defined()) lse_part = Tensor<T>({st.B, st.H, st.L}, "lse_part");
      T* lse_base = step.lse.defined() ? step.lse.data() : lse_part.data();
      for (const RingCall& c : step.calls) {
        const AttnShape s = c.kernel_shape();
        const std::int64_t q_off = c.b0 * st.L * st.H, k_off = (c.b0 * Lk + c.key0) * st.H;
        T* o_p = at(o_part.data(), q_off * st.dv);
        T* lse_p = at(lse_base, c.b0 * st.H * st.L);
        T* probs = at(step.probs.data(), c.b0 * st.H * st.L * Lk);
        P::attend(st, s, o_p, eager ? probs : lse_p, at(t->q.data(), q_off * st.dqk),
                  at(block_k(st, cur->data(), Lk).p, k_off * st.dqk),
                  at(block_v(st, cur->data(), Lk).p, k_off * st.dv), eager ? lse_p : nullptr);
        merge_partial(st, c, o.data(), lse.data(), o_p, lse_p, i == 0);
      }
    }
    wait(st, pending);
    if (i + 1 < ranks) {
      held = std::move(next);
      cur = &held;
    }
  }
  held.reset();
  for (RingStep<T>& step : t->steps) {
    if (!step.lse.defined()) continue;
    const std::int64_t Lk = lay.seq_count[size_t(step.owner)];
    for (const RingCall& c : step.calls)
      rescale_probs(st, c, at(step.probs.data(), c.b0 * st.H * st.L * Lk),
                    at(step.lse.data(), c.b0 * st.H * st.L), lse.data());
    step.lse.reset();
  }
  t->o_loc = std::move(o);
  if (eager)
    lse.reset();
  else
    t->lse = std::move(lse);
  out = Tensor<T>({st.B, st.L, st.D}, "out");
  ops::linear(mat(out), mat(std::as_const(t->o_loc)), w.wo);
  return t;
}

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
                   // Forward: one pass of the [K | V] blocks. Backward: the
                   // pass again (recomputation), and the dK/dV accumulators'
                   // pass with one more shift home.
                   .collectives =
                       [](CommTerms& t) {
                         const std::int64_t width =
                             t.cfg.n_heads * (t.cfg.qk_head_dim() + t.cfg.v_head_dim);
                         t.add_ring(Phase::forward, "kv_ring", width, false);
                         if (!t.backward) return;
                         t.add_ring(Phase::backward, "kv_ring", width, false);
                         t.add_ring(Phase::backward, "dkv_ring", width, true);
                       },
                   // q (B, L, H, dqk), the own block (B, L, H, dqk + dv),
                   // the statistics (its o is o_loc, which every form saves)
                   // and c_hat.
                   .saved_elements =
                       [](const SavedShape& s) {
                         const std::int64_t B = s.B, L = s.L, H = s.Hr;
                         std::int64_t n = B * L * H * s.dqk + B * L * H * (s.dqk + s.dv);
                         n += s.eager ? B * H * L * s.Sk : B * H * L;
                         return n + B * L * s.C;
                       },
                   .pair_width = head_pair_width},
          .f32 = &ring_kv_forward<float>,
          .f64 = &ring_kv_forward<double>};
}

}  // namespace laga::detail
