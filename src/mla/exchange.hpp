// The four data movements of sequence-parallel MLA, on (B, S, H, d) tensors,
// built on Communicator and recorded under the given label.
//
//   seq_to_head   (B, L_r, H, d)  -> (B, S, H_r, d)   all-to-all
//   head_to_seq   (B, S, H_r, d)  -> (B, L_r, H, d)   all-to-all (inverse)
//   gather_seq    (B, L_r, W)     -> (B, S, W)        all-gather
//   reduce_scatter_seq (B, S, W)  -> (B, L_r, W)      reduce-scatter (sum)
//
// Each is the backward of its partner: seq_to_head <-> head_to_seq, and
// gather_seq <-> reduce_scatter_seq. The two all-to-alls are cases of one
// generalised all-to-all, redistribute, between any two placements of a
// (B, S, H, d) tensor's (token, head) blocks on the ranks (laga2d moves its
// queries and outputs with it, and its query latent with the replicating
// case and its adjoint, redistribute_sum). Staging buffers are counted as
// comm_buffers; at P 1, where both sides hold the same rows and heads, the
// all-to-alls have none (src is already in dst's layout). Under a count-only pool (no storage)
// nothing is packed or copied, but the collective is still issued so the ledger is exact.
// Under --dtype bf16 (T = float, ops::in_bf16) every one of them moves bf16
// on the wire (wire.hpp): its stagings are bf16, and a gather landing in
// place receives into dst's front half and widens there.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/tensor.hpp"
#include "mla/layout.hpp"

namespace laga {

// Which part of a (B, S, H, d) tensor each rank holds: rank r holds the
// tokens of tokens[r] (ascending, disjoint) for heads [head_offset[r],
// head_offset[r] + head_count[r]), locally as (B, rows(r), head_count[r], d)
// with the ranges' rows one after the other.
struct Placement {
  std::vector<std::vector<TokenRange>> tokens;
  std::vector<std::int64_t> head_offset, head_count;
  std::int64_t rows(int rank) const;

  static Placement seq_shards(const SpLayout& lay);         // (B, L_r, H, d): my tokens
  static Placement head_shards(const SpLayout& lay);        // (B, S, H_r, d): my heads
  static Placement query_chunks(const HeadContextGrid& g);  // laga2d: my queries, my heads
  // The same tokens of a tensor without heads, (B, S, 1, d): every rank
  // holds the one head (laga2d's query latent, in its query rows).
  Placement rows_only() const;
};

// The generalised all-to-all: src in `from`'s placement on this rank, dst in
// `to`'s; each (token, head) element moves from the rank that holds it in
// `from` to every rank that holds it in `to`. `from` must hold every element
// once (its ranges and heads tile the tensor); `to` must hold every element
// at least once, and a rank of it gets its own copy of an element that
// another holds too (laga2d's query latent: every head group of a context
// group receives that group's query rows). Rank r sends rank j the
// intersection of its tokens and heads with j's, piece by piece: for each
// range of r's in order, for each range of j's in order, a (B, n, heads, d)
// block. src_ld and dst_ld: the row strides (elements from one token's row
// to the next) of src and dst; 0 is dense (the rank's heads times d). A
// wider stride reads or writes the rows as columns of a wider tensor (the
// queries in the input projections' [q | kv_a], docs/forms.md, "The input
// projections") with no copy beyond the packing every all-to-all does.
template <class T>
void redistribute(Communicator& comm, std::int64_t batch, const Placement& from,
                  const Placement& to, const T* src, T* dst, std::int64_t d,
                  const std::string& label, std::int64_t src_ld = 0, std::int64_t dst_ld = 0);
// Its adjoint: `from` may hold an element on several ranks, `to` holds it
// once, and dst's element is the sum of its copies, added in ascending rank
// order of their holders (so every transport gives the same bits). With
// `from` holding each element once it is redistribute.
template <class T>
void redistribute_sum(Communicator& comm, std::int64_t batch, const Placement& from,
                      const Placement& to, const T* src, T* dst, std::int64_t d,
                      const std::string& label);

template <class T>
void seq_to_head(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t d,
                 const std::string& label);
template <class T>
void head_to_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t d,
                 const std::string& label);
template <class T>
void gather_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t W,
                const std::string& label);
template <class T>
void reduce_scatter_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst,
                        std::int64_t W, const std::string& label);

// The started forms of the last two (communicator.hpp, "Overlap"): the same
// collective, bytes and staging, with dst to be read only after wait(). A
// started call's buffers must outlive its wait on an asynchronous transport
// (MPI nonblocking, NCCL), so the StartedSeq they return owns them: src,
// moved in, which is the send buffer (the gather's, and the reduce-scatter's
// at B = 1 on a contiguous layout), the reduce-scatter's packed send buffer
// otherwise (B > 1, or zigzag: src is then freed at start: the collective
// does not read it), and the gather's rank-major receive staging there,
// which wait() unpacks into dst. Each is
// freed at the wait, so its bytes are live until then (the memory model,
// the count-only run of this code, counts them there too). Under deferred
// delivery (tests) dst holds quiet NaN until the wait at any B.
template <class T>
class StartedSeq {
 public:
  // Waits for the collective, unpacks into dst (the gather, staged) and
  // frees the buffers it held. Dropped without it, the collective is
  // waited for (its modelled time) and dst never receives.
  void wait(Communicator& comm);
  bool pending() const { return call_.pending(); }

  template <class U>
  friend StartedSeq<U> start_gather_seq(Communicator& comm, const SpLayout& lay, Tensor<U> src,
                                        U* dst, std::int64_t W, const std::string& label);
  template <class U>
  friend StartedSeq<U> start_reduce_scatter_seq(Communicator& comm, const SpLayout& lay,
                                                Tensor<U> src, U* dst, std::int64_t W,
                                                const std::string& label);

 private:
  Tensor<T> send_;     // what the collective reads
  Tensor<T> staging_;  // the gather, staged: what it writes, rank-major
  // bf16 on the wire (wire.hpp): the bf16 blocks the collective reads and
  // writes where they are not in dst's front half (the gather, staged; the
  // reduce-scatter's contributions), and the widening the wait does: widen_
  // elements from widen_from_ (null: dst's front half) into dst_.
  Tensor<bf16> wire_;
  const void* widen_from_ = nullptr;
  std::int64_t widen_ = 0;
  // The staged gather: where and how staging_ (or wire_) is unpacked.
  bool unpack_ = false;
  T* dst_ = nullptr;
  SpLayout lay_;
  std::int64_t W_ = 0;
  PendingCollective call_;  // last: destroyed (waited for) before the buffers are freed
};

template <class T>
StartedSeq<T> start_gather_seq(Communicator& comm, const SpLayout& lay, Tensor<T> src, T* dst,
                               std::int64_t W, const std::string& label);
template <class T>
StartedSeq<T> start_reduce_scatter_seq(Communicator& comm, const SpLayout& lay, Tensor<T> src,
                                       T* dst, std::int64_t W, const std::string& label);

}  // namespace laga
