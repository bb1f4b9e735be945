// The MPI backend's transport: every collective as rounds of nonblocking
// point-to-point messages (mpi_comm.hpp says how they fail), counting the
// bytes each message hands to or gets from MPI for the measured ledger.
#include <algorithm>
#include <chrono>
#include <vector>

#include "comm/collective_util.hpp"
#include "comm/mpi_comm.hpp"
#include "comm/mpi_detail.hpp"
#include "core/error.hpp"

namespace laga {

using namespace comm_detail;
using namespace mpi_detail;
using Clock = std::chrono::steady_clock;

// One round of point-to-point messages of one collective, all under one tag:
// post sends and receives, then wait() until all completed or the deadline.
// Any failure cancels what it can, hands the rest to the communicator as
// orphans, then throws (the base class then calls call_failed, which marks
// the communicator broken and tells the peers).
//
// Measured bytes (`moved`): a send counts the size passed to MPI_Isend when
// it is posted; a receive counts the size MPI_Get_count reports when it
// completes. A null buffer (count-only) sends or expects an empty message and
// counts the bytes it stands for.
class MpiCommunicator::Round {
 public:
  Round(MpiCommunicator& c, CollectiveKind kind, DType dtype, const std::string& label,
        Clock::time_point deadline, Traffic& moved)
      : c_(c),
        kind_(kind),
        dtype_(dtype),
        label_(label),
        tag_(c.tag(c.rounds_++, kind, dtype, label)),
        deadline_(deadline),
        moved_(moved) {}

  ~Round() {
    // Only reached with requests pending when posting threw half way.
    if (std::any_of(reqs_.begin(), reqs_.end(),
                    [](MPI_Request r) { return r != MPI_REQUEST_NULL; }))
      abandon();
  }
  Round(const Round&) = delete;
  Round& operator=(const Round&) = delete;

  void send(int peer, const void* buf, std::int64_t bytes) {
    if (bytes > 0) {
      switch (c_.take_fault()) {  // tests only (TransportFault)
        case TransportFault::none:
          break;
        case TransportFault::short_send:
          bytes -= dtype_bytes(dtype_);
          break;
        case TransportFault::wrong_peer:
          peer = (peer + 1) % c_.size_;
          break;
        case TransportFault::skip_peer:
          return;
      }
    }
    post(peer, const_cast<void*>(buf), bytes, false);
  }
  void recv(int peer, void* buf, std::int64_t bytes) { post(peer, buf, bytes, true); }

  void wait() {
    const int n = static_cast<int>(reqs_.size());
    std::vector<int> done_idx(static_cast<size_t>(n));
    std::vector<MPI_Status> statuses(static_cast<size_t>(n));
    int remaining = n;
    long polls = 0;
    while (remaining > 0) {
      int done = 0;
      const int rc = MPI_Testsome(n, reqs_.data(), &done, done_idx.data(), statuses.data());
      if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS)
        fail_round(cat(where(), ": MPI_Testsome failed: ", mpi_error_string(rc)));
      if (done == MPI_UNDEFINED) break;
      for (int k = 0; k < done; ++k) {
        const int i = done_idx[k];
        const MPI_Status& st = statuses[k];
        if (rc == MPI_ERR_IN_STATUS && st.MPI_ERROR != MPI_SUCCESS) {
          int eclass = 0;
          MPI_Error_class(st.MPI_ERROR, &eclass);
          if (is_recv_[i] && eclass == MPI_ERR_TRUNCATE)
            fail_round(size_mismatch(i, cat("more than ", bytes_[i] / dtype_bytes(dtype_))));
          fail_round(cat(where(), ": ", is_recv_[i] ? "receive from" : "send to", " rank ",
                         peer_[i], " failed: ", mpi_error_string(st.MPI_ERROR)));
        }
        if (is_recv_[i]) {
          int got = 0;
          MPI_Get_count(&st, MPI_BYTE, &got);
          if (got != bytes_[i]) {
            const std::int64_t elem = dtype_bytes(dtype_);
            fail_round(size_mismatch(
                i, got % elem == 0 ? std::to_string(got / elem) : cat(got, " bytes")));
          }
          moved_.received(peer_[i], stands_for_[i] >= 0 ? stands_for_[i] : got);
        }
      }
      remaining -= done;
      if (done > 0) {
        polls = 0;
        continue;
      }
      ++polls;
      if (polls % 16 == 0) probe_for_mismatch();
      if (Clock::now() >= deadline_) time_out();
      back_off(polls);
    }
    reqs_.clear();
  }

 private:
  // A message of `bytes` to or from peer; split into pieces over the piece
  // limit (pieces of one (peer, tag) arrive in order, so both ends split
  // them identically); an empty message for a null buffer.
  void post(int peer, void* buf, std::int64_t bytes, bool is_recv) {
    static std::byte empty[1];
    std::byte* p = buf ? static_cast<std::byte*>(buf) : empty;
    const std::int64_t wire = buf ? bytes : 0;
    if (!buf && !is_recv) moved_.sent(peer, bytes);  // count-only: the bytes it stands for
    std::int64_t offset = 0;
    do {
      const std::int64_t piece = std::min(wire - offset, c_.max_message_bytes_);
      MPI_Request req = MPI_REQUEST_NULL;
      const int count = static_cast<int>(piece);
      const int rc = is_recv ? MPI_Irecv(p + offset, count, MPI_BYTE, peer, tag_, c_.comm_, &req)
                             : MPI_Isend(p + offset, count, MPI_BYTE, peer, tag_, c_.comm_, &req);
      if (rc != MPI_SUCCESS)
        fail_round(cat(where(), ": ", is_recv ? "MPI_Irecv from" : "MPI_Isend to", " rank ", peer,
                       " failed: ", mpi_error_string(rc)));
      if (buf && !is_recv) moved_.sent(peer, piece);
      reqs_.push_back(req);
      peer_.push_back(peer);
      is_recv_.push_back(is_recv);
      bytes_.push_back(piece);
      stands_for_.push_back(buf ? -1 : bytes);
      offset += piece;
    } while (offset < wire);
  }

  std::string where() const {
    return cat(call_name(kind_, label_), " on rank ", c_.rank_, " of ", c_.size_);
  }

  // Request i received other than it expects; `got` in elements of the call.
  std::string size_mismatch(int i, const std::string& got) const {
    return peer_count_message(kind_, label_, c_.rank_, c_.size_, c_.rank_, peer_[i],
                              bytes_[i] / dtype_bytes(dtype_), got);
  }

  // A peer whose next message to us has our round number but another
  // collective, dtype or label is in a different collective: say so now
  // rather than time out. A message of a later round is no evidence: the
  // probe drives progress, so the peer's message for this round may have just
  // completed our receive and its next one be queued behind it, before
  // MPI_Testsome reported the completion. A failure notice always stops us.
  void probe_for_mismatch() {
    std::vector<int> peers = pending_peers(true);
    for (int peer : peers) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(peer, MPI_ANY_TAG, c_.comm_, &flag, &st) != MPI_SUCCESS || !flag) continue;
      if (st.MPI_TAG == tag_) continue;
      if (((st.MPI_TAG >> c_.kind_shift()) & 7) == kNoticeKind)
        fail_round(cat(where(), " stopped: rank ", peer, " failed (",
                       receive_notice(peer, st, c_.comm_), ")"));
      if (c_.round_of(st.MPI_TAG) != c_.round_of(tag_)) continue;
      fail_round(cat("collective mismatch seen on rank ", c_.rank_, " of ", c_.size_,
                     ": this rank is in ", call_name(kind_, label_), " (", to_string(dtype_),
                     ", its collective #", c_.calls_done(), ") but rank ", peer,
                     " sent it a message of ", c_.describe_tag(st.MPI_TAG, tag_),
                     "; every rank must run the same sequence of collectives with the same labels "
                     "and dtypes"));
    }
  }

  std::vector<int> pending_peers(bool receives) const {
    std::vector<int> peers;
    for (size_t i = 0; i < reqs_.size(); ++i)
      if (reqs_[i] != MPI_REQUEST_NULL && static_cast<bool>(is_recv_[i]) == receives)
        peers.push_back(peer_[i]);
    std::sort(peers.begin(), peers.end());
    peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
    return peers;
  }

  [[noreturn]] void time_out() {
    std::vector<int> missing = pending_peers(true);
    if (missing.empty()) missing = pending_peers(false);
    fail_round(timeout_message(kind_, label_, c_.rank_, c_.size_, c_.timeout(), missing));
  }

  // `message` is complete (names the call, the rank and what to do).
  [[noreturn]] void fail_round(const std::string& message) {
    abandon();
    throw Error(message);
  }

  // Cancels pending receives and gives every pending request a short while to
  // finish; whatever is left is orphaned. (The caller, collective(), then
  // marks the communicator broken and tells the peers.)
  void abandon() {
    for (size_t i = 0; i < reqs_.size(); ++i)
      if (reqs_[i] != MPI_REQUEST_NULL && is_recv_[i]) MPI_Cancel(&reqs_[i]);
    const auto grace = Clock::now() + std::chrono::milliseconds(200);
    long polls = 0;
    for (;;) {
      bool pending = false;
      for (MPI_Request& r : reqs_) {
        if (r == MPI_REQUEST_NULL) continue;
        int flag = 0;
        MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
        pending = pending || !flag;
      }
      if (!pending || Clock::now() >= grace) break;
      back_off(++polls);
    }
    for (MPI_Request r : reqs_) {
      if (r == MPI_REQUEST_NULL) continue;
      c_.orphans_.push_back(r);
      count_orphan();
    }
    reqs_.clear();
  }

  MpiCommunicator& c_;
  CollectiveKind kind_;
  DType dtype_;
  const std::string& label_;
  int tag_;
  Clock::time_point deadline_;
  std::vector<MPI_Request> reqs_;
  std::vector<int> peer_;
  std::vector<char> is_recv_;
  std::vector<std::int64_t> bytes_;
  std::vector<std::int64_t> stands_for_;  // count-only: the bytes an empty message stands for
  Traffic& moved_;
};

void MpiCommunicator::transport_all_to_all(const void* send, const std::int64_t* send_counts,
                                           const std::int64_t* send_displs, void* recv,
                                           const std::int64_t* recv_counts,
                                           const std::int64_t* recv_displs, DType dtype,
                                           const std::string& label, Traffic& moved) {
  const std::int64_t elem = dtype_bytes(dtype);
  Round round(*this, CollectiveKind::all_to_all, dtype, label, Clock::now() + timeout(), moved);
  for (int j = 0; j < size_; ++j)
    if (j != rank_)
      round.recv(j, recv ? at(recv, recv_displs[j], dtype) : nullptr, recv_counts[j] * elem);
  for (int j = 0; j < size_; ++j)
    if (j != rank_)
      round.send(j, send ? at(send, send_displs[j], dtype) : nullptr, send_counts[j] * elem);
  round.wait();
  copy_elems(recv ? at(recv, recv_displs[rank_], dtype) : nullptr,
             send ? at(send, send_displs[rank_], dtype) : nullptr, send_counts[rank_], dtype);
}

void MpiCommunicator::transport_all_gather(const void* send, std::int64_t send_count, void* recv,
                                           const std::int64_t* recv_counts,
                                           const std::int64_t* recv_displs, DType dtype,
                                           const std::string& label, Traffic& moved) {
  const std::int64_t elem = dtype_bytes(dtype);
  Round round(*this, CollectiveKind::all_gather, dtype, label, Clock::now() + timeout(), moved);
  for (int j = 0; j < size_; ++j)
    if (j != rank_)
      round.recv(j, recv ? at(recv, recv_displs[j], dtype) : nullptr, recv_counts[j] * elem);
  for (int j = 0; j < size_; ++j)
    if (j != rank_) round.send(j, send, send_count * elem);
  round.wait();
  copy_elems(recv ? at(recv, recv_displs[rank_], dtype) : nullptr, send, send_count, dtype);
}

void MpiCommunicator::reduce_own_block(CollectiveKind kind, const void* send,
                                       const std::int64_t* counts, const std::int64_t* displs,
                                       void* recv, DType dtype, const std::string& label,
                                       Clock::time_point deadline, Traffic& moved) {
  const std::int64_t elem = dtype_bytes(dtype);
  const std::int64_t own = counts[rank_];
  // Peer j's contribution to the own block lands in slot j (j < rank) or
  // j - 1 (j > rank).
  Staging staging(dtype, staging_for(kind, own));
  auto slot = [&](int j) -> void* {
    return staging.data() ? at(staging.data(), (j < rank_ ? j : j - 1) * own, dtype) : nullptr;
  };
  Round round(*this, kind, dtype, label, deadline, moved);
  for (int j = 0; j < size_; ++j)
    if (j != rank_) round.recv(j, slot(j), own * elem);
  for (int j = 0; j < size_; ++j)
    if (j != rank_) round.send(j, send ? at(send, displs[j], dtype) : nullptr, counts[j] * elem);
  round.wait();
  if (recv && own > 0) {
    std::vector<const void*> srcs(static_cast<size_t>(size_));
    for (int j = 0; j < size_; ++j) srcs[j] = j == rank_ ? at(send, displs[rank_], dtype) : slot(j);
    sum_in_rank_order(recv, srcs.data(), size_, own, dtype);
  }
}

void MpiCommunicator::transport_reduce_scatter(const void* send, const std::int64_t* counts,
                                               const std::int64_t* displs, void* recv, DType dtype,
                                               const std::string& label, Traffic& moved) {
  reduce_own_block(CollectiveKind::reduce_scatter, send, counts, displs, recv, dtype, label,
                   Clock::now() + timeout(), moved);
}

void MpiCommunicator::transport_all_reduce(void* buf, std::int64_t n, DType dtype,
                                           const std::string& label, Traffic& moved) {
  // A reduce-scatter of buf's all_reduce_chunk() chunks into the own chunk in
  // place, then an all-gather of the reduced chunks.
  const CollectiveKind kind = CollectiveKind::all_reduce;
  const int P = size_;
  const std::int64_t elem = dtype_bytes(dtype);
  const auto deadline = Clock::now() + timeout();
  std::vector<std::int64_t> chunks(static_cast<size_t>(P)), offset(static_cast<size_t>(P) + 1, 0);
  for (int j = 0; j < P; ++j) {
    chunks[j] = all_reduce_chunk(n, P, j);
    offset[j + 1] = offset[j] + chunks[j];
  }
  auto chunk = [&](int j) -> void* { return buf ? at(buf, offset[j], dtype) : nullptr; };
  reduce_own_block(kind, buf, chunks.data(), offset.data(), chunk(rank_), dtype, label, deadline,
                   moved);
  Round gather(*this, kind, dtype, label, deadline, moved);
  for (int j = 0; j < P; ++j)
    if (j != rank_) gather.recv(j, chunk(j), chunks[j] * elem);
  for (int j = 0; j < P; ++j)
    if (j != rank_) gather.send(j, chunk(rank_), chunks[rank_] * elem);
  gather.wait();
}

void MpiCommunicator::transport_ring_shift(const void* send, std::int64_t send_count, void* recv,
                                           std::int64_t recv_count, DType dtype, Ring ring,
                                           const std::string& label, Traffic& moved) {
  // One message each way, straight between the caller's buffers (they never
  // overlap), so nothing is staged. Only the neighbours are waited for: a
  // rank that never calls is named by the rank receiving from it, while its
  // other neighbour's send may complete (eagerly, when small).
  const RingPeers peers = ring_peers(size_, rank_, ring);
  if (peers.to == rank_) {  // a ring of one
    copy_elems(recv, send, send_count, dtype);
    return;
  }
  const std::int64_t elem = dtype_bytes(dtype);
  Round round(*this, CollectiveKind::ring_shift, dtype, label, Clock::now() + timeout(), moved);
  round.recv(peers.from, recv, recv_count * elem);
  round.send(peers.to, send, send_count * elem);
  round.wait();
}

void MpiCommunicator::transport_barrier(const std::string& label) {
  Traffic none(size_);  // empty messages: nothing to measure
  Round round(*this, CollectiveKind::barrier, DType::f32, label, Clock::now() + timeout(), none);
  for (int j = 0; j < size_; ++j)
    if (j != rank_) round.recv(j, nullptr, 0);
  for (int j = 0; j < size_; ++j)
    if (j != rank_) round.send(j, nullptr, 0);
  round.wait();
}

}  // namespace laga
