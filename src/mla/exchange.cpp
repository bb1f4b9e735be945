#include "mla/exchange.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "kernels/bf16_convert.hpp"
#include "mla/ops.hpp"
#include "mla/wire.hpp"

namespace laga {

namespace {
using Counts = std::vector<std::int64_t>;
size_t u(std::int64_t i) {
  return static_cast<size_t>(i);
}

// p + off, but null stays null (count-only buffers have no storage).
template <class T>
T* at(T* p, std::int64_t off) {
  return p ? p + off : nullptr;
}
// Copies (add: adds) a (B, rows, heads, d) block between two head-sliced
// layouts: the building block of every all-to-all packing (adding: of
// redistribute_sum's unpacking), from and to the wire's type where it
// differs from the tensors' (ops::move_rows: through the kernel table, so
// that on a device the packing runs there). src element (b, l, h) at
// src + (b * src_rows + src_row0 + l) * src_ld + (src_h0 + h) * d, where
// src_ld is the row stride (src's heads times d when its rows are dense;
// more when they are columns of a wider row, as q is of the input
// projections' [q | kv_a]); dst the same with its own.
template <class S, class D>
void copy_block(const S* src, std::int64_t src_rows, std::int64_t src_row0, std::int64_t src_ld,
                std::int64_t src_h0, D* dst, std::int64_t dst_rows, std::int64_t dst_row0,
                std::int64_t dst_ld, std::int64_t dst_h0, std::int64_t B, std::int64_t rows,
                std::int64_t heads, std::int64_t d, bool add = false) {
  // The packing is memory traffic the time model costs (plan/time_model.hpp):
  // each element read and written, and read again where it is added.
  ops::count_elementwise<S>(B * rows * heads * d, 1);
  ops::count_elementwise<D>(B * rows * heads * d, add ? 2 : 1);
  // Count-only (no storage): nothing to copy; the collective still runs.
  if (heads == 0 || rows == 0 || src == nullptr || dst == nullptr) return;
  for (std::int64_t b = 0; b < B; ++b)
    ops::move_rows(dst + (b * dst_rows + dst_row0) * dst_ld + dst_h0 * d, dst_ld,
                   src + (b * src_rows + src_row0) * src_ld + src_h0 * d, src_ld, rows, heads * d,
                   add);
}
}  // namespace

std::int64_t Placement::rows(int rank) const {
  std::int64_t n = 0;
  for (const TokenRange& t : tokens[u(rank)]) n += t.size();
  return n;
}

Placement Placement::seq_shards(const SpLayout& lay) {
  Placement p;
  for (int r = 0; r < lay.ranks; ++r) {
    p.tokens.push_back(lay.seq_ranges[u(r)]);
    p.head_offset.push_back(0);
    p.head_count.push_back(lay.heads);
  }
  return p;
}

Placement Placement::head_shards(const SpLayout& lay) {
  Placement p;
  p.tokens.assign(u(lay.ranks), {{0, lay.seq}});
  p.head_offset = lay.head_offset;
  p.head_count = lay.head_count;
  return p;
}

Placement Placement::query_chunks(const HeadContextGrid& g) {
  Placement p;
  p.tokens = g.queries;
  p.head_offset = g.head_offset;
  p.head_count = g.head_count;
  return p;
}

Placement Placement::rows_only() const {
  Placement p;
  p.tokens = tokens;
  p.head_offset.assign(tokens.size(), 0);
  p.head_count.assign(tokens.size(), 1);
  return p;
}

namespace {

// The pieces rank `a` of `from` sends rank `b` of `to`, in the order both
// sides pack and unpack them (see redistribute): the tokens [begin, end) and
// where they start in a's and b's local rows, and the heads' first index in
// a's and b's local heads.
struct Piece {
  TokenRange t;
  std::int64_t from_row, to_row;
};
struct Transfer {
  std::vector<Piece> pieces;
  std::int64_t h0 = 0, heads = 0, from_h0 = 0, to_h0 = 0;
  std::int64_t elements(std::int64_t B, std::int64_t d) const {
    std::int64_t n = 0;
    for (const Piece& p : pieces) n += p.t.size();
    return B * n * heads * d;
  }
};
// Whether two lists of token ranges hold the same tokens in the same order.
bool same_rows(const std::vector<TokenRange>& a, const std::vector<TokenRange>& b) {
  const auto merged = [](const std::vector<TokenRange>& v) {
    std::vector<TokenRange> out;
    for (const TokenRange& t : v) {
      if (t.size() == 0) continue;
      if (!out.empty() && out.back().end == t.begin)
        out.back().end = t.end;
      else
        out.push_back(t);
    }
    return out;
  };
  return merged(a) == merged(b);
}

Transfer transfer_of(const Placement& from, int a, const Placement& to, int b) {
  Transfer ps;
  ps.h0 = std::max(from.head_offset[u(a)], to.head_offset[u(b)]);
  ps.heads = std::max<std::int64_t>(0, std::min(from.head_offset[u(a)] + from.head_count[u(a)],
                                                to.head_offset[u(b)] + to.head_count[u(b)]) -
                                           ps.h0);
  ps.from_h0 = ps.h0 - from.head_offset[u(a)];
  ps.to_h0 = ps.h0 - to.head_offset[u(b)];
  if (ps.heads == 0) return ps;
  std::int64_t from_row = 0;
  for (const TokenRange& x : from.tokens[u(a)]) {
    std::int64_t to_row = 0;
    for (const TokenRange& y : to.tokens[u(b)]) {
      const TokenRange t{std::max(x.begin, y.begin), std::min(x.end, y.end)};
      if (t.size() > 0)
        ps.pieces.push_back({t, from_row + t.begin - x.begin, to_row + t.begin - y.begin});
      to_row += y.size();
    }
    from_row += x.size();
  }
  return ps;
}

// redistribute (sum: false) and redistribute_sum (true): the same pieces and
// collective; the adjoint adds what it receives into a zeroed dst.
// Wire: the type the collective moves, T or bf16 (wire.hpp).
template <class Wire, class T>
void exchange_pieces(Communicator& comm, std::int64_t B, const Placement& from, const Placement& to,
                     const T* src, std::int64_t src_ld, T* dst, std::int64_t dst_ld, std::int64_t d,
                     const std::string& label, bool sum) {
  const int P = comm.size(), r = comm.rank();
  LAGA_CHECK(from.tokens.size() == u(P) && to.tokens.size() == u(P), "internal: redistribute '",
             label, "' between placements of ", from.tokens.size(), " and ", to.tokens.size(),
             " ranks on a group of ", P);
  const std::int64_t from_rows = from.rows(r), to_rows = to.rows(r);
  const std::int64_t from_heads = from.head_count[u(r)], to_heads = to.head_count[u(r)];
  std::vector<Transfer> out(u(P)), in(u(P));
  Counts sc(u(P)), rc(u(P));
  for (int j = 0; j < P; ++j) {
    out[u(j)] = transfer_of(from, r, to, j);
    in[u(j)] = transfer_of(from, j, to, r);
    sc[u(j)] = out[u(j)].elements(B, d);
    rc[u(j)] = in[u(j)].elements(B, d);
  }
  if (src_ld == 0) src_ld = from_heads * d;
  if (dst_ld == 0) dst_ld = to_heads * d;
  const Counts sd = offsets_of(sc), rd = offsets_of(rc);
  // One rank whose rows and heads are the same on both sides: src is in
  // dst's layout already, so nothing is packed. Dense rows: the collective
  // copies them over once. Strided rows (columns of a wider row), which the
  // collective cannot read: that one copy is made here, at the strides, and
  // the collective carries nothing (a rank's own block is never on the
  // wire: the ledger is the same).
  // Not in the invariant mode under bf16 (docs/invariance.md): a block
  // every P > 1 rounds to bf16 on its way (its own too) is rounded at P 1
  // as well.
  const bool rounds = std::is_same_v<Wire, bf16> && ops::op_invariant;
  if (P == 1 && same_rows(from.tokens[0], to.tokens[0]) && from_heads == to_heads && !rounds) {
    if (src_ld == from_heads * d && dst_ld == to_heads * d) {
      comm.all_to_all_v(src, sc.data(), sd.data(), dst, rc.data(), rd.data(), label);
      return;
    }
    copy_block(src, from_rows, 0, src_ld, 0, dst, to_rows, 0, dst_ld, 0, B, from_rows, from_heads,
               d);
    const Counts none(1, 0);
    comm.all_to_all_v(src, none.data(), sd.data(), dst, none.data(), rd.data(), label);
    return;
  }
  Tensor<Wire> send({total_of(sc)}, MemCategory::comm_buffers),
      recv({total_of(rc)}, MemCategory::comm_buffers);
  for (int j = 0; j < P; ++j) {
    const Transfer& ps = out[u(j)];
    std::int64_t off = sd[u(j)];
    for (const Piece& p : ps.pieces) {  // (B, n, heads, d) each
      copy_block(src, from_rows, p.from_row, src_ld, ps.from_h0, at(send.data(), off), p.t.size(),
                 0, ps.heads * d, 0, B, p.t.size(), ps.heads, d);
      off += B * p.t.size() * ps.heads * d;
    }
  }
  comm.all_to_all_v(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), label);
  send.reset();
  // Summing: every element of dst has at least one copy, but zero it so that
  // each is the sum of its copies alone, in the senders' rank order.
  if (sum) ops::count_elementwise<T>(B * to_rows * to_heads * d, 1);
  if (sum && dst) {  // redistribute_sum's dst is dense (dst_ld == to_heads d)
    LAGA_CHECK(dst_ld == to_heads * d, "internal: redistribute_sum '", label,
               "' into strided rows would zero the columns between them");
    ops::fill_rows(dst, to_heads * d, B * to_rows, to_heads * d, T(0));
  }
  for (int i = 0; i < P; ++i) {
    const Transfer& ps = in[u(i)];
    std::int64_t off = rd[u(i)];
    for (const Piece& p : ps.pieces) {
      copy_block(at(recv.data(), off), p.t.size(), 0, ps.heads * d, 0, dst, to_rows, p.to_row,
                 dst_ld, ps.to_h0, B, p.t.size(), ps.heads, d, sum);
      off += B * p.t.size() * ps.heads * d;
    }
  }
}

// exchange_pieces on the wire this thread's precision moves T on.
template <class T>
void exchange_pieces_on_wire(Communicator& comm, std::int64_t B, const Placement& from,
                             const Placement& to, const T* src, std::int64_t src_ld, T* dst,
                             std::int64_t dst_ld, std::int64_t d, const std::string& label,
                             bool sum) {
  if constexpr (std::is_same_v<T, float>)
    if (ops::in_bf16<T>())
      return exchange_pieces<bf16>(comm, B, from, to, src, src_ld, dst, dst_ld, d, label, sum);
  exchange_pieces<T>(comm, B, from, to, src, src_ld, dst, dst_ld, d, label, sum);
}

}  // namespace

template <class T>
void redistribute(Communicator& comm, std::int64_t B, const Placement& from, const Placement& to,
                  const T* src, T* dst, std::int64_t d, const std::string& label,
                  std::int64_t src_ld, std::int64_t dst_ld) {
  exchange_pieces_on_wire(comm, B, from, to, src, src_ld, dst, dst_ld, d, label, false);
}

template <class T>
void redistribute_sum(Communicator& comm, std::int64_t B, const Placement& from,
                      const Placement& to, const T* src, T* dst, std::int64_t d,
                      const std::string& label) {
  exchange_pieces_on_wire(comm, B, from, to, src, 0, dst, 0, d, label, true);
}

template <class T>
void seq_to_head(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t d,
                 const std::string& label) {
  redistribute(comm, lay.batch, Placement::seq_shards(lay), Placement::head_shards(lay), src, dst,
               d, label);
}

template <class T>
void head_to_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t d,
                 const std::string& label) {
  redistribute(comm, lay.batch, Placement::head_shards(lay), Placement::seq_shards(lay), src, dst,
               d, label);
}

namespace {

// The all-gather's and reduce-scatter's counts of a (B, L_r, W) shard per
// rank: rank-major, B L_r W each.
Counts seq_counts(const SpLayout& lay, std::int64_t W) {
  Counts c(u(lay.ranks));
  for (int i = 0; i < lay.ranks; ++i) c[u(i)] = lay.batch * lay.seq_count[u(i)] * W;
  return c;
}
// The rank-major blocks (B, L_i, W) at displs[i] into (B, S, W), and back,
// range by range of each rank's shard. Where the layout's rank-major order
// is the sequence's (contiguous, B = 1) the two are the same, and the
// collectives use dst or src as is.
bool lands_in_place(const SpLayout& lay) {
  return lay.batch == 1 && lay.rank_major_is_sequence();
}
template <class S, class D>
void unpack_ranks(const SpLayout& lay, const S* blocks, const Counts& displs, D* dst,
                  std::int64_t W) {
  for (int i = 0; i < lay.ranks; ++i) {
    std::int64_t row = 0;  // the range's first row in rank i's (B, L_i) block
    for (const TokenRange& t : lay.seq_ranges[u(i)]) {
      copy_block(at(blocks, displs[u(i)]), lay.seq_count[u(i)], row, W, 0, dst, lay.seq, t.begin, W,
                 0, lay.batch, t.size(), 1, W);
      row += t.size();
    }
  }
}
template <class S, class D>
void pack_ranks(const SpLayout& lay, const S* src, const Counts& displs, D* blocks,
                std::int64_t W) {
  for (int i = 0; i < lay.ranks; ++i) {
    std::int64_t row = 0;
    for (const TokenRange& t : lay.seq_ranges[u(i)]) {
      copy_block(src, lay.seq, t.begin, W, 0, at(blocks, displs[u(i)]), lay.seq_count[u(i)], row, W,
                 0, lay.batch, t.size(), 1, W);
      row += t.size();
    }
  }
}

// bf16 on the wire (wire.hpp) inside fp32 storage: the bf16 value of
// element i at byte 2 i of a float buffer.
void* bf16_at(void* base, std::int64_t i) {
  return base ? static_cast<std::byte*>(base) + i * std::int64_t(sizeof(bf16)) : nullptr;
}
// Under deferred delivery (tests), the part of a float buffer whose front
// half receives bf16 values that the collective does not write until the
// wait: its back half, poisoned too, so that a read before the wait
// computes with NaN there as well.
void poison_back_half(const Communicator& comm, float* dst, std::int64_t n) {
  if (comm.deferred_delivery_for_testing() && dst)
    ops::fill_rows(dst + (n + 1) / 2, n / 2, 1, n / 2, std::numeric_limits<float>::quiet_NaN());
}

// The all-gather with bf16 on the wire. Landing in place, the (B, S, W)
// values arrive in dst's front half and are widened there (the own block is
// narrowed into its place first: src may be dst's own rows, which narrow
// reads ahead of its writes; wire::all_gather_v); otherwise a bf16 staging of the rank-major
// blocks, unpacked and widened.
void gather_seq_bf16(Communicator& comm, const SpLayout& lay, const float* src, float* dst,
                     std::int64_t W, const std::string& label) {
  const Counts rc = seq_counts(lay, W), rd = offsets_of(rc);
  const std::int64_t own = rc[u(comm.rank())], n = total_of(rc);
  if (lands_in_place(lay))
    return wire::all_gather_v(comm, src, own, dst, rc.data(), rd.data(), label);
  Tensor<bf16> recv({n}, MemCategory::comm_buffers);
  bf16* mine = at(recv.data(), rd[u(comm.rank())]);
  wire::narrow(src, mine, own);
  comm.all_gather_v(mine, own, recv.data(), rc.data(), rd.data(), label);
  unpack_ranks(lay, recv.data(), rd, dst, W);
}

// The reduce-scatter with bf16 on the wire: the contributions narrowed into
// a bf16 staging (rank-major), reduced in place into the own block there
// (the fp32 sum of the bf16 values, rounded once), and widened into dst
// (wire::reduce_scatter_v where the blocks are in place).
// The (B, S, W) contributions src as the reduce-scatter's bf16 send buffer:
// rank-major blocks, narrowed (and packed where the layout's rank-major
// order is not the sequence's).
Tensor<bf16> contributions_bf16(const SpLayout& lay, const float* src, std::int64_t W) {
  const Counts c = seq_counts(lay, W);
  Tensor<bf16> send({total_of(c)}, MemCategory::comm_buffers);
  if (lands_in_place(lay))
    wire::narrow(src, send.data(), total_of(c));
  else
    pack_ranks(lay, src, offsets_of(c), send.data(), W);
  return send;
}

void reduce_scatter_seq_bf16(Communicator& comm, const SpLayout& lay, const float* src, float* dst,
                             std::int64_t W, const std::string& label) {
  const Counts c = seq_counts(lay, W), d = offsets_of(c);
  if (lands_in_place(lay)) return wire::reduce_scatter_v(comm, src, c.data(), d.data(), dst, label);
  const int r = comm.rank();
  Tensor<bf16> send = contributions_bf16(lay, src, W);
  comm.reduce_scatter_v(send.data(), c.data(), d.data(), at(send.data(), d[u(r)]), label);
  wire::widen(at(send.data(), d[u(r)]), dst, c[u(r)]);
}

}  // namespace

template <class T>
void gather_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t W,
                const std::string& label) {
  if constexpr (std::is_same_v<T, float>)
    if (ops::in_bf16<T>()) return gather_seq_bf16(comm, lay, src, dst, W, label);
  const Counts rc = seq_counts(lay, W), rd = offsets_of(rc);
  const std::int64_t own = rc[u(comm.rank())];
  if (lands_in_place(lay)) {  // rank-major (L_0 | L_1 | ...) is already (S, W)
    comm.all_gather_v(src, own, dst, rc.data(), rd.data(), label);
    return;
  }
  Tensor<T> recv({total_of(rc)}, MemCategory::comm_buffers);
  comm.all_gather_v(src, own, recv.data(), rc.data(), rd.data(), label);
  unpack_ranks(lay, recv.data(), rd, dst, W);
}

template <class T>
void reduce_scatter_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst,
                        std::int64_t W, const std::string& label) {
  if constexpr (std::is_same_v<T, float>)
    if (ops::in_bf16<T>()) return reduce_scatter_seq_bf16(comm, lay, src, dst, W, label);
  const Counts c = seq_counts(lay, W), d = offsets_of(c);
  if (lands_in_place(lay)) {
    comm.reduce_scatter_v(src, c.data(), d.data(), dst, label);
    return;
  }
  Tensor<T> send({total_of(c)}, MemCategory::comm_buffers);
  pack_ranks(lay, src, d, send.data(), W);
  comm.reduce_scatter_v(send.data(), c.data(), d.data(), dst, label);
}

template <class T>
StartedSeq<T> start_gather_seq(Communicator& comm, const SpLayout& lay, Tensor<T> src, T* dst,
                               std::int64_t W, const std::string& label) {
  const Counts rc = seq_counts(lay, W), rd = offsets_of(rc);
  const int r = comm.rank();
  StartedSeq<T> s;
  if constexpr (std::is_same_v<T, float>) {
    if (ops::in_bf16<T>()) {  // as gather_seq_bf16, finished at the wait
      const std::int64_t n = total_of(rc);
      s.dst_ = dst, s.lay_ = lay, s.W_ = W;
      void* recv = dst;
      if (lands_in_place(lay)) {
        s.widen_ = n;
        poison_back_half(comm, dst, n);
      } else {
        s.wire_ = Tensor<bf16>({n}, MemCategory::comm_buffers);
        s.unpack_ = true;
        recv = s.wire_.data();
        if (comm.deferred_delivery_for_testing() && dst)
          ops::fill_rows(dst, W, lay.batch * lay.seq, W, std::numeric_limits<T>::quiet_NaN());
      }
      // The own block, narrowed into its place in recv: src is not read
      // again, so it is freed now.
      void* mine = bf16_at(recv, rd[u(r)]);
      wire::narrow(src.data(), mine, rc[u(r)]);
      src.reset();
      s.call_ =
          comm.start_all_gather_v(mine, rc[u(r)], recv, rc.data(), rd.data(), DType::bf16, label);
      return s;
    }
  }
  s.send_ = std::move(src);
  T* recv = dst;
  if (!lands_in_place(lay)) {
    s.staging_ = Tensor<T>({total_of(rc)}, MemCategory::comm_buffers);
    s.unpack_ = true, s.dst_ = dst, s.lay_ = lay, s.W_ = W;
    recv = s.staging_.data();
    // dst is the result here, not the collective's recv: under deferred
    // delivery it holds the communicator's poison too until the wait.
    if (comm.deferred_delivery_for_testing() && dst)
      ops::fill_rows(dst, W, lay.batch * lay.seq, W, std::numeric_limits<T>::quiet_NaN());
  }
  s.call_ = comm.start_all_gather_v(s.send_.data(), rc[u(r)], recv, rc.data(), rd.data(), label);
  return s;
}

template <class T>
StartedSeq<T> start_reduce_scatter_seq(Communicator& comm, const SpLayout& lay, Tensor<T> src,
                                       T* dst, std::int64_t W, const std::string& label) {
  const Counts c = seq_counts(lay, W), d = offsets_of(c);
  const int r = comm.rank();
  StartedSeq<T> s;
  if constexpr (std::is_same_v<T, float>) {
    if (ops::in_bf16<T>()) {  // as reduce_scatter_seq_bf16, finished at the wait
      s.wire_ = contributions_bf16(lay, src.data(), W);
      src.reset();
      bf16* mine = at(s.wire_.data(), d[u(r)]);  // reduced in place: recv is the own block
      s.widen_from_ = mine, s.dst_ = dst, s.widen_ = c[u(r)];
      s.call_ = comm.start_reduce_scatter_v(s.wire_.data(), c.data(), d.data(), mine, label);
      return s;
    }
  }
  if (lands_in_place(lay)) {
    s.send_ = std::move(src);
  } else {
    s.send_ = Tensor<T>({total_of(c)}, MemCategory::comm_buffers);
    pack_ranks(lay, src.data(), d, s.send_.data(), W);
    src.reset();
  }
  s.call_ = comm.start_reduce_scatter_v(s.send_.data(), c.data(), d.data(), dst, label);
  return s;
}

template <class T>
void StartedSeq<T>::wait(Communicator& comm) {
  comm.wait(call_);
  // Count-only too (no storage): the unpacking's traffic is counted.
  // The staged gather's blocks: in wire_ with bf16 on the wire (a count-only
  // tensor has its shape too), else in staging_.
  if (unpack_ && !wire_.defined())
    unpack_ranks(lay_, staging_.data(), offsets_of(seq_counts(lay_, W_)), dst_, W_);
  if constexpr (std::is_same_v<T, float>) {
    if (unpack_ && wire_.defined())
      unpack_ranks(lay_, wire_.data(), offsets_of(seq_counts(lay_, W_)), dst_, W_);
    if (widen_ > 0)
      wire::widen(widen_from_ ? widen_from_ : static_cast<const void*>(dst_), dst_, widen_);
  }
  unpack_ = false;
  widen_ = 0;
  staging_.reset();
  wire_.reset();
  send_.reset();
}

#define LAGA_INSTANTIATE(T)                                                                       \
  template void redistribute<T>(Communicator&, std::int64_t, const Placement&, const Placement&,  \
                                const T*, T*, std::int64_t, const std::string&, std::int64_t,     \
                                std::int64_t);                                                    \
  template void redistribute_sum<T>(Communicator&, std::int64_t, const Placement&,                \
                                    const Placement&, const T*, T*, std::int64_t,                 \
                                    const std::string&);                                          \
  template void seq_to_head<T>(Communicator&, const SpLayout&, const T*, T*, std::int64_t,        \
                               const std::string&);                                               \
  template void head_to_seq<T>(Communicator&, const SpLayout&, const T*, T*, std::int64_t,        \
                               const std::string&);                                               \
  template void gather_seq<T>(Communicator&, const SpLayout&, const T*, T*, std::int64_t,         \
                              const std::string&);                                                \
  template void reduce_scatter_seq<T>(Communicator&, const SpLayout&, const T*, T*, std::int64_t, \
                                      const std::string&);                                        \
  template StartedSeq<T> start_gather_seq<T>(Communicator&, const SpLayout&, Tensor<T>, T*,       \
                                             std::int64_t, const std::string&);                   \
  template StartedSeq<T> start_reduce_scatter_seq<T>(Communicator&, const SpLayout&, Tensor<T>,   \
                                                     T*, std::int64_t, const std::string&);       \
  template class StartedSeq<T>;
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
