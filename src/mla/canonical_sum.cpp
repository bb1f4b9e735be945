// The canonical reduction over tokens (canonical_sum.hpp; docs/invariance.md).
#include "mla/canonical_sum.hpp"

#include <algorithm>
#include <bit>
#include <map>
#include <utility>

#include "core/error.hpp"

namespace laga::ops {

std::vector<TreePiece> canonical_pieces(const TokenShards& shards, int r) {
  LAGA_CHECK(r >= 0 && r < shards.ranks() && shards.end.size() == shards.begin.size(),
             "internal: canonical_pieces of rank ", r, " of ", shards.ranks());
  const std::int64_t N = shards.B * shards.S;
  const std::int64_t len = shards.end[r] - shards.begin[r];
  std::vector<TreePiece> pieces;
  for (std::int64_t b = 0; b < shards.B; ++b) {
    const std::int64_t lo = b * shards.S + shards.begin[r], hi = lo + len;
    for (std::int64_t a = lo; a < hi;) {
      int l = 0;  // the largest level whose node at a is aligned and inside [lo, hi)
      while (l < 62) {
        const std::int64_t size = std::int64_t(1) << (l + 1);
        if (a % size != 0 || std::min(a + size, N) > hi) break;
        ++l;
      }
      const std::int64_t stop = std::min(a + (std::int64_t(1) << l), N);
      pieces.push_back({a, stop, b * len + (a - lo)});
      a = stop;
    }
  }
  return pieces;
}

namespace {
// The pieces of tokens [lo, hi) of one row, of N tokens in all (the closed
// form canonical_piece_count's header derives).
std::int64_t pieces_in(std::int64_t lo, std::int64_t hi, std::int64_t N) {
  if (lo >= hi) return 0;
  const auto u = [](std::int64_t v) { return std::uint64_t(v); };
  if (hi == N) {  // the last node may reach past N: they only rise from lo
    if (lo == 0) return 1;
    std::int64_t X = lo;
    for (int j = 0; X < N; ++j) {  // lo rounded up to a multiple of 2^j
      const std::int64_t size = std::int64_t(1) << j;
      X = (lo + size - 1) / size * size;
    }
    return std::popcount(u(X - lo));
  }
  const int t = std::bit_width(u(lo ^ hi)) - 1;
  const std::int64_t M = (hi >> t) << t;
  return std::popcount(u(M - lo)) + std::popcount(u(hi - M));
}
}  // namespace

std::int64_t canonical_piece_count(const TokenShards& shards, int r) {
  LAGA_CHECK(r >= 0 && r < shards.ranks() && shards.end.size() == shards.begin.size(),
             "internal: canonical_piece_count of rank ", r, " of ", shards.ranks());
  const std::int64_t N = shards.B * shards.S;
  std::int64_t n = 0;
  for (std::int64_t b = 0; b < shards.B; ++b)
    n += pieces_in(b * shards.S + shards.begin[r], b * shards.S + shards.end[r], N);
  return n;
}

TokenShards sequence_shards(const SpLayout& layout) {
  TokenShards t;
  t.B = layout.batch, t.S = layout.seq;
  for (int r = 0; r < layout.ranks; ++r) {
    t.begin.push_back(layout.shard_begin(r));
    t.end.push_back(layout.shard_begin(r) + layout.seq_count[std::size_t(r)]);
  }
  return t;
}

TokenShards head_column_shards(const SpLayout& layout, std::int64_t per_head) {
  TokenShards t;
  t.B = 1, t.S = layout.heads * per_head;
  for (int r = 0; r < layout.ranks; ++r) {
    const std::int64_t h0 = layout.head_offset[std::size_t(r)];
    t.begin.push_back(h0 * per_head);
    t.end.push_back((h0 + layout.head_count[std::size_t(r)]) * per_head);
  }
  return t;
}

TokenShards query_chunk_shards(const SpLayout& layout) {
  const TokenShards seq = sequence_shards(layout);
  TokenShards t;
  t.B = 1, t.S = (layout.seq + kQueryChunk - 1) / kQueryChunk;
  // The chunks whose first token lies in [begin, end): an empty shard owns none.
  for (int r = 0; r < seq.ranks(); ++r) {
    t.begin.push_back((seq.begin[std::size_t(r)] + kQueryChunk - 1) / kQueryChunk);
    t.end.push_back((seq.end[std::size_t(r)] + kQueryChunk - 1) / kQueryChunk);
  }
  return t;
}

PieceBytes canonical_token_sum_elements(const TokenShards& shards, int r, std::int64_t width) {
  const int P = shards.ranks();
  std::int64_t all = 0;
  for (int q = 0; q < P; ++q) all += canonical_piece_count(shards, q);
  const std::int64_t own = canonical_piece_count(shards, r);
  return {(P - 1) * own * width, (all - own) * width, all * width};
}

PieceBytes canonical_reduce_scatter_elements(const TokenShards& index, const TokenShards& rows,
                                             int r, std::int64_t n) {
  std::int64_t all = 0, R = 0;
  for (int q = 0; q < index.ranks(); ++q)
    all += canonical_piece_count(index, q), R += rows.local_rows(q);
  const std::int64_t own = canonical_piece_count(index, r), mine = rows.local_rows(r);
  return {own * (R - mine) * n, (all - own) * mine * n, own * R * n + all * mine * n};
}

namespace {

using PieceIndex = std::map<std::pair<std::int64_t, std::int64_t>, std::int64_t>;

// The global tree evaluated on elements [e0, e0 + n) of the pieces, from the
// node [lo, lo + size) down; `index`: each piece's span to the offset of its
// first element in `pieces`.
template <class T>
class TreeEval {
 public:
  TreeEval(const T* pieces, std::int64_t N, const PieceIndex& index)
      : pieces_(pieces), N_(N), index_(index) {}

  // out[0, n) = the node's value on those elements; scratch: n per level below.
  void eval(std::int64_t lo, std::int64_t size, std::int64_t e0, std::int64_t n, T* out,
            T* scratch) const {
    const auto it = index_.find({lo, std::min(lo + size, N_)});
    if (it != index_.end()) {
      std::copy_n(pieces_ + it->second + e0, n, out);
      return;
    }
    LAGA_CHECK(size > 1, "internal: the canonical sum has no piece for token ", lo);
    const std::int64_t half = size / 2;
    eval(lo, half, e0, n, out, scratch);
    if (lo + half >= N_) return;  // the right subtree has no token: absent
    eval(lo + half, half, e0, n, scratch, scratch + n);
    for (std::int64_t e = 0; e < n; ++e) out[e] = out[e] + scratch[e];
  }

 private:
  const T* pieces_;
  std::int64_t N_;
  const PieceIndex& index_;
};

constexpr std::int64_t kElementChunk = 1024;

}  // namespace

template <class T>
void canonical_token_sum(Communicator& comm, Mat<T> dst, In<T> a, In<T> b,
                         const TokenShards& shards, const std::string& label, bool add_here) {
  const int P = comm.size(), r = comm.rank();
  LAGA_CHECK(shards.ranks() == P, "internal: token shards of ", shards.ranks(),
             " ranks for a group of ", P);
  LAGA_CHECK(a.rows == shards.local_rows(r) && b.rows == a.rows && dst.rows == a.cols &&
                 dst.cols == b.cols,
             "internal: canonical_token_sum of (", a.rows, ", ", a.cols, ")^T (", b.rows, ", ",
             b.cols, ") into (", dst.rows, ", ", dst.cols, ") with ", shards.local_rows(r),
             " local rows");
  const std::int64_t width = dst.rows * dst.cols, N = shards.B * shards.S;
  if (width == 0 || N == 0) return;
  std::vector<std::vector<TreePiece>> all(static_cast<std::size_t>(P));
  std::vector<std::int64_t> counts(static_cast<std::size_t>(P)), displs(counts.size());
  std::int64_t total = 0;
  for (int q = 0; q < P; ++q) {
    all[q] = canonical_pieces(shards, q);
    counts[q] = std::int64_t(all[q].size()) * width, displs[q] = total, total += counts[q];
  }
  // Every rank's pieces, this rank's written in place (zeros: the bf16
  // path's product into fresh storage would round, a gradient's sum must not).
  Tensor<T> gathered = Tensor<T>::zeros({total}, "canonical sum pieces", MemCategory::comm_buffers);
  {
    const UseInvariant invariant(true);
    Mat<T> all_pieces{gathered.data(), std::max<std::int64_t>(total / width, 0), width, width};
    const std::int64_t first = displs[r] / width;
    for (std::size_t i = 0; i < all[r].size(); ++i) {
      const TreePiece& p = all[r][i];
      const std::int64_t rows = p.stop - p.start;
      Mat<T> piece = all_pieces.row_range(first + std::int64_t(i), 1);
      gemm(Mat<T>{piece.p, dst.rows, dst.cols, dst.cols}, T(1), a.row_range(p.row, rows), true,
           b.row_range(p.row, rows), false);
    }
  }
  comm.all_gather_v(gathered.data() ? gathered.data() + displs[r] : nullptr, counts[r],
                    gathered.data(), counts.data(), displs.data(), label);
  count_elementwise<T>(total + 2 * width, 1);  // the pieces read, dst read and written
  if (!add_here || !runs(width, {dst.p, gathered.data()})) return;

  PieceIndex index;
  std::vector<std::int64_t> order;  // piece numbers, rank by rank
  for (int q = 0; q < P; ++q)
    for (std::size_t i = 0; i < all[q].size(); ++i) {
      const std::int64_t k = displs[q] / width + std::int64_t(i);
      index[{all[q][i].start, all[q][i].stop}] = k * width;
      order.push_back(k);
    }
  const TreeEval<T> tree(gathered.data(), N, index);
  const std::int64_t root = std::int64_t(std::bit_ceil(std::uint64_t(N)));
  const int depth = std::bit_width(std::uint64_t(root)) + 1;
  const bool rank_order = canonical_sum_rank_order.load();
  const std::int64_t chunks = (width + kElementChunk - 1) / kElementChunk;
#pragma omp parallel for schedule(static) if (width > 65536)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t e0 = c * kElementChunk, n = std::min(kElementChunk, width - e0);
    std::vector<T> buf(static_cast<std::size_t>(n * (depth + 1)));
    T* sum = buf.data();
    if (rank_order) {  // the mutation: each rank's pieces in turn, then rank after rank
      std::int64_t k = 0;
      bool have = false;
      T* part = buf.data() + n;
      for (int q = 0; q < P; ++q) {
        for (std::size_t i = 0; i < all[q].size(); ++i, ++k) {
          const T* p = gathered.data() + order[k] * width + e0;
          for (std::int64_t e = 0; e < n; ++e) part[e] = i == 0 ? p[e] : part[e] + p[e];
        }
        if (all[q].empty()) continue;
        for (std::int64_t e = 0; e < n; ++e) sum[e] = have ? sum[e] + part[e] : part[e];
        have = true;
      }
    } else {
      tree.eval(0, root, e0, n, sum, buf.data() + n);
    }
    for (std::int64_t e = 0; e < n; ++e) {
      T& d = dst.p[((e0 + e) / dst.cols) * dst.ld + (e0 + e) % dst.cols];
      d = d + sum[e];
    }
  }
}

namespace {

// The reduce-scatter's exchange and tree, whatever makes the pieces
// (canonical_reduce_scatter's GEMMs, canonical_parts_reduce_scatter's sums):
// fill(piece, global row, rows, out) writes this rank's piece's rows [row,
// row + rows) of the global B S, n wide, into out (rows, n). Each rank's
// pieces' rows of rank q's tokens go to q (all_to_all_v under label), which
// evaluates the tree over the index from every rank's pieces.
template <class T, class Fill>
void reduce_scatter_pieces(Communicator& comm, Mat<T> dst, std::int64_t n, const TokenShards& index,
                           const TokenShards& rows, const std::string& label, Fill&& fill) {
  const int P = comm.size(), r = comm.rank();
  const std::int64_t R = rows.B * rows.S, K = index.S;
  if (dst.rows * n == 0 && R * n == 0) return;
  std::vector<std::vector<TreePiece>> all(static_cast<std::size_t>(P));
  for (int q = 0; q < P; ++q) all[q] = canonical_pieces(index, q);
  // To rank q, every piece's rows of q's tokens; from rank q, its pieces' of ours.
  std::vector<std::int64_t> sc(static_cast<std::size_t>(P)), sd(sc.size()), rc(sc.size()),
      rd(sc.size());
  std::int64_t sent = 0, received = 0;
  for (int q = 0; q < P; ++q) {
    sc[q] = std::int64_t(all[r].size()) * rows.local_rows(q) * n, sd[q] = sent, sent += sc[q];
    rc[q] = std::int64_t(all[q].size()) * rows.local_rows(r) * n, rd[q] = received;
    received += rc[q];
  }
  Tensor<T> send =
      Tensor<T>::zeros({sent}, "canonical reduce-scatter pieces", MemCategory::comm_buffers);
  Tensor<T> recv({received}, "canonical reduce-scatter received", MemCategory::comm_buffers);
  for (int q = 0; q < P; ++q) {
    const std::int64_t len = rows.end[q] - rows.begin[q];
    for (std::size_t i = 0; i < all[r].size(); ++i)
      for (std::int64_t bb = 0; bb < rows.B; ++bb) {
        T* at = send.data() ? send.data() + sd[q] + ((std::int64_t(i) * rows.B + bb) * len) * n
                            : nullptr;
        fill(all[r][i], bb * rows.S + rows.begin[q], len, Mat<T>{at, len, n, n});
      }
  }
  comm.all_to_all_v(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), label);
  const std::int64_t width = dst.rows * n;
  count_elementwise<T>(received + width, 1);
  if (!runs(width, {dst.p, recv.data()})) return;
  PieceIndex idx;
  std::vector<std::int64_t> order;
  for (int q = 0; q < P; ++q)
    for (std::size_t i = 0; i < all[q].size(); ++i) {
      idx[{all[q][i].start, all[q][i].stop}] = rd[q] + std::int64_t(i) * width;
      order.push_back(rd[q] + std::int64_t(i) * width);
    }
  const TreeEval<T> tree(recv.data(), K, idx);
  const std::int64_t root =
      std::int64_t(std::bit_ceil(std::uint64_t(std::max<std::int64_t>(K, 1))));
  const int depth = std::bit_width(std::uint64_t(root)) + 1;
  const std::int64_t chunks = (width + kElementChunk - 1) / kElementChunk;
  const bool rank_order = canonical_sum_rank_order.load();
#pragma omp parallel for schedule(static) if (width > 65536)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t e0 = c * kElementChunk, m = std::min(kElementChunk, width - e0);
    std::vector<T> buf(static_cast<std::size_t>(m * (depth + 1)));
    if (rank_order) {  // the mutation: the pieces in rank order, left to right
      for (std::size_t j = 0; j < order.size(); ++j)
        for (std::int64_t e = 0; e < m; ++e)
          buf[e] =
              j == 0 ? recv.data()[order[j] + e0 + e] : buf[e] + recv.data()[order[j] + e0 + e];
    } else {
      tree.eval(0, root, e0, m, buf.data(), buf.data() + m);
    }
    for (std::int64_t e = 0; e < m; ++e) dst.p[((e0 + e) / n) * dst.ld + (e0 + e) % n] = buf[e];
  }
}

// The node [lo, lo + size) of the tree over the parts' index, on elements
// [off, off + m) of each part (parts: this rank's, `stride` apart, the first
// index `first`; N the index's extent): left child + right child, an absent
// right child (past N) passed over, as TreeEval.
template <class T>
void parts_node(const T* parts, std::int64_t stride, std::int64_t first, std::int64_t N,
                std::int64_t lo, std::int64_t size, std::int64_t off, std::int64_t m, T* out,
                T* scratch) {
  if (size == 1) {
    std::copy_n(parts + (lo - first) * stride + off, m, out);
    return;
  }
  const std::int64_t half = size / 2;
  parts_node(parts, stride, first, N, lo, half, off, m, out, scratch);
  if (lo + half >= N) return;
  parts_node(parts, stride, first, N, lo + half, half, off, m, scratch, scratch + m);
  for (std::int64_t e = 0; e < m; ++e) out[e] = out[e] + scratch[e];
}

}  // namespace

template <class T>
void canonical_reduce_scatter(Communicator& comm, Mat<T> dst, In<T> a, In<T> b,
                              const TokenShards& index, const TokenShards& rows,
                              const std::string& label) {
  const int P = comm.size(), r = comm.rank();
  LAGA_CHECK(index.ranks() == P && rows.ranks() == P && index.B == 1,
             "internal: canonical_reduce_scatter's shards are not of one row for a group of ", P);
  const std::int64_t R = rows.B * rows.S, n = b.cols;
  LAGA_CHECK(a.rows == R && a.cols == index.end[r] - index.begin[r] && b.rows == a.cols &&
                 dst.rows == rows.local_rows(r) && dst.cols == n,
             "internal: canonical_reduce_scatter of (", a.rows, ", ", a.cols, ") (", b.rows, ", ",
             b.cols, ") into (", dst.rows, ", ", dst.cols, ")");
  reduce_scatter_pieces<T>(comm, dst, n, index, rows, label,
                           [&](const TreePiece& p, std::int64_t row, std::int64_t len, Mat<T> out) {
                             // p.row: its first column of a, row of b
                             const UseInvariant invariant(true);
                             const std::int64_t k = p.stop - p.start;
                             gemm(out, T(1), a.block(row, len, p.row, k), false,
                                  b.row_range(p.row, k), false);
                           });
  // A fresh product: a bf16 run stores it rounded once (a count-only run
  // has no storage to round).
  if (in_bf16<T>() && dst.p) {
    if constexpr (std::is_same_v<T, float>) bf16_path::round_in_place(dst);
  }
}

template <class T>
void canonical_parts_reduce_scatter(Communicator& comm, Mat<T> dst, const Tensor<T>& parts,
                                    const TokenShards& index, const TokenShards& rows,
                                    const std::string& label) {
  const int P = comm.size(), r = comm.rank();
  LAGA_CHECK(index.ranks() == P && rows.ranks() == P && index.B == 1,
             "internal: canonical_parts_reduce_scatter's shards are not of one row for a group "
             "of ",
             P);
  const std::int64_t R = rows.B * rows.S, n = dst.cols, first = index.begin[r];
  const std::int64_t K = index.S, own = index.end[r] - first;
  LAGA_CHECK(parts.numel() == own * R * n && dst.rows == rows.local_rows(r),
             "internal: canonical_parts_reduce_scatter of ", parts.numel(), " elements as ", own,
             " parts of (", R, ", ", n, ") into (", dst.rows, ", ", dst.cols, ")");
  const int depth = std::bit_width(std::uint64_t(std::max<std::int64_t>(K, 1))) + 1;
  reduce_scatter_pieces<T>(
      comm, dst, n, index, rows, label,
      [&](const TreePiece& p, std::int64_t row, std::int64_t len, Mat<T> out) {
        const std::int64_t m = len * n;
        count_elementwise<T>(m * (p.stop - p.start), 1);
        if (!runs(m, {out.p, parts.data()})) return;
        const std::int64_t size = std::int64_t(std::bit_ceil(std::uint64_t(p.stop - p.start)));
        const std::int64_t chunks = (m + kElementChunk - 1) / kElementChunk;
#pragma omp parallel for schedule(static) if (m > 65536)
        for (std::int64_t c = 0; c < chunks; ++c) {
          const std::int64_t e0 = c * kElementChunk, mm = std::min(kElementChunk, m - e0);
          std::vector<T> scratch(static_cast<std::size_t>(mm * depth));
          parts_node(parts.data(), R * n, first, K, p.start, size, row * n + e0, mm, out.p + e0,
                     scratch.data());
        }
      });
}

template <class T>
void canonical_rmsnorm_weight_grad(Communicator& comm, Tensor<T>& dw, In<T> dy, In<T> x,
                                   const Tensor<T>& rstd, const TokenShards& shards,
                                   const std::string& label, bool add_here) {
  const std::int64_t rows = dy.rows, C = dy.cols;
  Tensor<T> g({rows, C}, "canonical rmsnorm terms"), ones({rows, 1}, "canonical rmsnorm ones");
  count_elementwise<T>(rows * C, 4);
  if (runs(rows * C, {g.data(), ones.data(), dy.p, x.p, rstd.data()})) {
    for (std::int64_t t = 0; t < rows; ++t) {
      ones.data()[t] = T(1);
      const T r = rstd.data()[t];
      for (std::int64_t j = 0; j < C; ++j)
        g.data()[t * C + j] = dy.p[t * dy.ld + j] * (x.p[t * x.ld + j] * r);
    }
  }
  const UsePrecision fp32(Precision::fp32, op_grad_reduce);
  canonical_token_sum<T>(comm, Mat<T>{dw.data(), 1, C, C}, mat(std::as_const(ones)),
                         mat(std::as_const(g)), shards, label, add_here);
}

template <class T>
void canonical_latent_reduce_scatter(Communicator& comm, Mat<T> dlat_loc, In<T> dk, In<T> dv,
                                     In<T> wkv_b_r, std::int64_t Hr, std::int64_t dn,
                                     std::int64_t dr, const TokenShards& heads,
                                     const TokenShards& rows, const std::string& label) {
  const std::int64_t R = dk.rows, dvd = Hr > 0 ? dv.cols / Hr : 0, KV = dn + dvd, Kh = KV + dr;
  const std::int64_t C = wkv_b_r.cols, W = C + dr, dqk = dn + dr;
  Tensor<T> a({R, Hr * Kh}, "canonical latent terms");
  Tensor<T> b = Tensor<T>::zeros({Hr * Kh, W}, "canonical latent weights");
  count_elementwise<T>(R * Hr * Kh, 2);
  if (runs(R * Hr * Kh, {a.data(), b.data(), dk.p, dv.p, wkv_b_r.p})) {
    for (std::int64_t t = 0; t < R; ++t)
      for (std::int64_t h = 0; h < Hr; ++h) {
        T* row = a.data() + t * Hr * Kh + h * Kh;
        const T* k = dk.p + t * dk.ld + h * dqk;
        std::copy_n(k, dn, row);
        std::copy_n(dv.p + t * dv.ld + h * dvd, dvd, row + dn);
        std::copy_n(k + dn, dr, row + KV);
      }
    for (std::int64_t h = 0; h < Hr; ++h) {
      for (std::int64_t i = 0; i < KV; ++i)
        std::copy_n(wkv_b_r.p + (h * KV + i) * wkv_b_r.ld, C, b.data() + (h * Kh + i) * W);
      for (std::int64_t i = 0; i < dr; ++i) b.data()[(h * Kh + KV + i) * W + C + i] = T(1);
    }
  }
  canonical_reduce_scatter<T>(comm, dlat_loc, mat(std::as_const(a)), mat(std::as_const(b)), heads,
                              rows, label);
}

template void canonical_token_sum<float>(Communicator&, Mat<float>, In<float>, In<float>,
                                         const TokenShards&, const std::string&, bool);
template void canonical_token_sum<double>(Communicator&, Mat<double>, In<double>, In<double>,
                                          const TokenShards&, const std::string&, bool);
template void canonical_rmsnorm_weight_grad<float>(Communicator&, Tensor<float>&, In<float>,
                                                   In<float>, const Tensor<float>&,
                                                   const TokenShards&, const std::string&, bool);
template void canonical_rmsnorm_weight_grad<double>(Communicator&, Tensor<double>&, In<double>,
                                                    In<double>, const Tensor<double>&,
                                                    const TokenShards&, const std::string&, bool);
template void canonical_latent_reduce_scatter<float>(Communicator&, Mat<float>, In<float>,
                                                     In<float>, In<float>, std::int64_t,
                                                     std::int64_t, std::int64_t, const TokenShards&,
                                                     const TokenShards&, const std::string&);
template void canonical_latent_reduce_scatter<double>(Communicator&, Mat<double>, In<double>,
                                                      In<double>, In<double>, std::int64_t,
                                                      std::int64_t, std::int64_t,
                                                      const TokenShards&, const TokenShards&,
                                                      const std::string&);
template void canonical_parts_reduce_scatter<float>(Communicator&, Mat<float>, const Tensor<float>&,
                                                    const TokenShards&, const TokenShards&,
                                                    const std::string&);
template void canonical_parts_reduce_scatter<double>(Communicator&, Mat<double>,
                                                     const Tensor<double>&, const TokenShards&,
                                                     const TokenShards&, const std::string&);
template void canonical_reduce_scatter<float>(Communicator&, Mat<float>, In<float>, In<float>,
                                              const TokenShards&, const TokenShards&,
                                              const std::string&);
template void canonical_reduce_scatter<double>(Communicator&, Mat<double>, In<double>, In<double>,
                                               const TokenShards&, const TokenShards&,
                                               const std::string&);

}  // namespace laga::ops
