#include "mla/exchange.hpp"

#include <cstring>
#include <vector>

namespace laga {

namespace {
using Counts = std::vector<std::int64_t>;
Counts displs_of(const Counts& c) {
  Counts d(c.size(), 0);
  for (size_t i = 1; i < c.size(); ++i) d[i] = d[i - 1] + c[i - 1];
  return d;
}
std::int64_t total(const Counts& c) {
  std::int64_t s = 0;
  for (auto x : c) s += x;
  return s;
}
size_t u(std::int64_t i) {
  return static_cast<size_t>(i);
}

// p + off, but null stays null (count-only buffers have no storage).
template <class T>
T* at(T* p, std::int64_t off) {
  return p ? p + off : nullptr;
}
// Copies a (B, rows, cols_a) block of `width` elements per (b, row, col) between
// two head-sliced layouts: the building block of both all-to-all packings.
// src element (b, l, h) at src + ((b * src_rows + src_row0 + l) * src_heads + src_h0 + h) * d.
template <class T>
void copy_block(const T* src, std::int64_t src_rows, std::int64_t src_row0, std::int64_t src_heads,
                std::int64_t src_h0, T* dst, std::int64_t dst_rows, std::int64_t dst_row0,
                std::int64_t dst_heads, std::int64_t dst_h0, std::int64_t B, std::int64_t rows,
                std::int64_t heads, std::int64_t d) {
  // Count-only (no storage): nothing to copy; the collective still runs.
  if (heads == 0 || rows == 0 || src == nullptr || dst == nullptr) return;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t l = 0; l < rows; ++l)
      std::memcpy(dst + ((b * dst_rows + dst_row0 + l) * dst_heads + dst_h0) * d,
                  src + ((b * src_rows + src_row0 + l) * src_heads + src_h0) * d,
                  sizeof(T) * u(heads * d));
}
}  // namespace

template <class T>
void seq_to_head(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t d,
                 const std::string& label) {
  const int P = lay.ranks, r = comm.rank();
  const std::int64_t B = lay.batch, L = lay.seq_count[u(r)], H = lay.heads,
                     Hr = lay.head_count[u(r)];
  Counts sc(u(P)), rc(u(P));
  for (int j = 0; j < P; ++j) {
    sc[u(j)] = B * L * lay.head_count[u(j)] * d;
    rc[u(j)] = B * lay.seq_count[u(j)] * Hr * d;
  }
  const Counts sd = displs_of(sc), rd = displs_of(rc);
  if (P == 1) {  // src (B, S, H, d) is dst's layout already: no packing
    comm.all_to_all_v(src, sc.data(), sd.data(), dst, rc.data(), rd.data(), label);
    return;
  }
  Tensor<T> send({total(sc)}, MemCategory::comm_buffers),
      recv({total(rc)}, MemCategory::comm_buffers);
  for (int j = 0; j < P; ++j)  // block j: (B, L, H_j, d)
    copy_block(src, L, 0, H, lay.head_offset[u(j)], at(send.data(), sd[u(j)]), L, 0,
               lay.head_count[u(j)], 0, B, L, lay.head_count[u(j)], d);
  comm.all_to_all_v(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), label);
  send.reset();
  for (int i = 0; i < P; ++i)  // block i: (B, L_i, H_r, d) -> rows seq_offset[i]..
    copy_block(at(recv.data(), rd[u(i)]), lay.seq_count[u(i)], 0, Hr, 0, dst, lay.seq,
               lay.seq_offset[u(i)], Hr, 0, B, lay.seq_count[u(i)], Hr, d);
}

template <class T>
void head_to_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t d,
                 const std::string& label) {
  const int P = lay.ranks, r = comm.rank();
  const std::int64_t B = lay.batch, L = lay.seq_count[u(r)], H = lay.heads,
                     Hr = lay.head_count[u(r)];
  Counts sc(u(P)), rc(u(P));
  for (int j = 0; j < P; ++j) {
    sc[u(j)] = B * lay.seq_count[u(j)] * Hr * d;
    rc[u(j)] = B * L * lay.head_count[u(j)] * d;
  }
  const Counts sd = displs_of(sc), rd = displs_of(rc);
  if (P == 1) {  // src (B, S, H, d) is dst's layout already: no packing
    comm.all_to_all_v(src, sc.data(), sd.data(), dst, rc.data(), rd.data(), label);
    return;
  }
  Tensor<T> send({total(sc)}, MemCategory::comm_buffers),
      recv({total(rc)}, MemCategory::comm_buffers);
  for (int j = 0; j < P; ++j)  // block j: rows of rank j, (B, L_j, H_r, d)
    copy_block(src, lay.seq, lay.seq_offset[u(j)], Hr, 0, at(send.data(), sd[u(j)]),
               lay.seq_count[u(j)], 0, Hr, 0, B, lay.seq_count[u(j)], Hr, d);
  comm.all_to_all_v(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), label);
  send.reset();
  for (int i = 0; i < P; ++i)  // block i: (B, L, H_i, d) -> heads head_offset[i]..
    copy_block(at(recv.data(), rd[u(i)]), L, 0, lay.head_count[u(i)], 0, dst, L, 0, H,
               lay.head_offset[u(i)], B, L, lay.head_count[u(i)], d);
}

template <class T>
void gather_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t W,
                const std::string& label) {
  const int P = lay.ranks, r = comm.rank();
  const std::int64_t B = lay.batch;
  Counts rc(u(P));
  for (int i = 0; i < P; ++i) rc[u(i)] = B * lay.seq_count[u(i)] * W;
  const Counts rd = displs_of(rc);
  if (B == 1) {  // rank-major (L_0 | L_1 | ...) is already (S, W)
    comm.all_gather_v(src, rc[u(r)], dst, rc.data(), rd.data(), label);
    return;
  }
  Tensor<T> recv({total(rc)}, MemCategory::comm_buffers);
  comm.all_gather_v(src, rc[u(r)], recv.data(), rc.data(), rd.data(), label);
  for (int i = 0; i < P; ++i)
    copy_block(at(recv.data(), rd[u(i)]), lay.seq_count[u(i)], 0, 1, 0, dst, lay.seq,
               lay.seq_offset[u(i)], 1, 0, B, lay.seq_count[u(i)], 1, W);
}

template <class T>
void reduce_scatter_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst,
                        std::int64_t W, const std::string& label) {
  const int P = lay.ranks;
  const std::int64_t B = lay.batch;
  Counts c(u(P));
  for (int i = 0; i < P; ++i) c[u(i)] = B * lay.seq_count[u(i)] * W;
  const Counts d = displs_of(c);
  if (B == 1) {
    comm.reduce_scatter_v(src, c.data(), d.data(), dst, label);
    return;
  }
  Tensor<T> send({total(c)}, MemCategory::comm_buffers);
  for (int i = 0; i < P; ++i)
    copy_block(src, lay.seq, lay.seq_offset[u(i)], 1, 0, at(send.data(), d[u(i)]),
               lay.seq_count[u(i)], 0, 1, 0, B, lay.seq_count[u(i)], 1, W);
  comm.reduce_scatter_v(send.data(), c.data(), d.data(), dst, label);
}

#define LAGA_INSTANTIATE(T)                                                                       \
  template void seq_to_head<T>(Communicator&, const SpLayout&, const T*, T*, std::int64_t,        \
                               const std::string&);                                               \
  template void head_to_seq<T>(Communicator&, const SpLayout&, const T*, T*, std::int64_t,        \
                               const std::string&);                                               \
  template void gather_seq<T>(Communicator&, const SpLayout&, const T*, T*, std::int64_t,         \
                              const std::string&);                                                \
  template void reduce_scatter_seq<T>(Communicator&, const SpLayout&, const T*, T*, std::int64_t, \
                                      const std::string&);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
