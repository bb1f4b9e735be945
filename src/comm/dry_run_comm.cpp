#include "comm/dry_run_comm.hpp"

#include <algorithm>
#include <cstring>

#include "comm/collective_util.hpp"
#include "core/error.hpp"

namespace laga {

using namespace comm_detail;

namespace {

// n elements at dst from the own block `own` (own_n elements), repeated as
// often as needed; zeros when the own block is empty. Stand-in data for a
// peer that does not exist (dry_run_comm.hpp says which).
void fill_from_own(void* dst, std::int64_t n, const void* own, std::int64_t own_n, DType t) {
  if (dst == nullptr || n == 0) return;
  if (own == nullptr || own_n == 0) {
    std::memset(dst, 0, static_cast<std::size_t>(n * dtype_bytes(t)));
    return;
  }
  for (std::int64_t done = 0; done < n;) {
    const std::int64_t m = std::min(own_n, n - done);
    copy_elems(at(dst, done, t), own, m, t);
    done += m;
  }
}

}  // namespace

DryRunCommunicator::DryRunCommunicator(int rank, int size, StagingRule staging)
    : rank_(rank), size_(size), staging_(staging) {
  LAGA_CHECK(size >= 1 && rank >= 0 && rank < size, "dry-run communicator: rank ", rank, " of ",
             size, " does not exist; need 0 <= rank < size (--rank-only R with R < --sp)");
}

void DryRunCommunicator::transport_all_to_all(const void* send, const std::int64_t* send_counts,
                                              const std::int64_t* send_displs, void* recv,
                                              const std::int64_t* recv_counts,
                                              const std::int64_t* recv_displs, DType dtype,
                                              const std::string&, Traffic& moved) {
  const int P = size_, r = rank_;
  const std::int64_t elem = dtype_bytes(dtype);
  const void* own = send ? at(send, send_displs[r], dtype) : nullptr;
  for (int j = 0; j < P; ++j) {
    if (j == r) continue;
    moved.sent(j, send_counts[j] * elem);
    if (recv)
      fill_from_own(at(recv, recv_displs[j], dtype), recv_counts[j], own, send_counts[r], dtype);
    moved.received(j, recv_counts[j] * elem);
  }
  // Last: the own block may be read above, and recv never aliases send here.
  if (recv) copy_elems(at(recv, recv_displs[r], dtype), own, recv_counts[r], dtype);
}

void DryRunCommunicator::transport_all_gather(const void* send, std::int64_t send_count, void* recv,
                                              const std::int64_t* recv_counts,
                                              const std::int64_t* recv_displs, DType dtype,
                                              const std::string&, Traffic& moved) {
  const int P = size_, r = rank_;
  const std::int64_t elem = dtype_bytes(dtype);
  // Place the own shard first (an in-place gather already has it there),
  // then copy it into the peers' slots from its final position.
  const void* own = nullptr;
  if (recv) {
    void* mine = at(recv, recv_displs[r], dtype);
    copy_elems(mine, send, send_count, dtype);
    own = send ? mine : nullptr;
  }
  for (int j = 0; j < P; ++j) {
    if (j == r) continue;
    moved.sent(j, send_count * elem);
    if (recv)
      fill_from_own(at(recv, recv_displs[j], dtype), recv_counts[j], own, send_count, dtype);
    moved.received(j, recv_counts[j] * elem);
  }
}

void DryRunCommunicator::transport_reduce_scatter(const void* send, const std::int64_t* counts,
                                                  const std::int64_t* displs, void* recv,
                                                  DType dtype, const std::string&, Traffic& moved) {
  const std::int64_t elem = dtype_bytes(dtype);
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    moved.sent(j, counts[j] * elem);          // block j to its owner
    moved.received(j, counts[rank_] * elem);  // peer j's copy of the own block (not summed)
  }
  // Staged as the rule's backend would (MPI: the peers' blocks before the sum).
  const Staging staging(dtype, staging_for(CollectiveKind::reduce_scatter, counts[rank_]));
  copy_elems(recv, send ? at(send, displs[rank_], dtype) : nullptr, counts[rank_], dtype);
}

void DryRunCommunicator::transport_all_reduce(void*, std::int64_t n, DType dtype,
                                              const std::string&, Traffic& moved) {
  const std::int64_t elem = dtype_bytes(dtype);
  const std::int64_t own = all_reduce_chunk(n, size_, rank_);
  // Registered like the rule's backend stages it so the pool's peaks match
  // it; buf keeps the own contribution.
  const Staging staging(dtype, staging_for(CollectiveKind::all_reduce, own));
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    const std::int64_t theirs = all_reduce_chunk(n, size_, j);
    moved.sent(j, (theirs + own) * elem);      // their chunk, then the reduced own chunk
    moved.received(j, (own + theirs) * elem);  // their copy of the own chunk, then theirs
  }
}

void DryRunCommunicator::transport_ring_shift(const void* send, std::int64_t send_count, void* recv,
                                              std::int64_t recv_count, DType dtype, Ring ring,
                                              const std::string&, Traffic& moved) {
  const RingPeers peers = ring_peers(size_, rank_, ring);
  if (peers.to == rank_) {  // a ring of one: the block comes back to its sender, not traffic
    copy_elems(recv, send, send_count, dtype);
    return;
  }
  const std::int64_t elem = dtype_bytes(dtype);
  moved.sent(peers.to, send_count * elem);
  fill_from_own(recv, recv_count, send, send_count, dtype);
  moved.received(peers.from, recv_count * elem);
}

std::unique_ptr<Communicator> make_dry_run_communicator(int rank, int size) {
  return std::make_unique<DryRunCommunicator>(rank, size);
}

}  // namespace laga
