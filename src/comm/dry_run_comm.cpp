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

void DryRunCommunicator::all_to_all_v(const void* send, const std::int64_t* send_counts,
                                      const std::int64_t* send_displs, void* recv,
                                      const std::int64_t* recv_counts,
                                      const std::int64_t* recv_displs, DType dtype,
                                      const std::string& label) {
  const CollectiveKind kind = CollectiveKind::all_to_all;
  const int P = size_, r = rank_;
  check_counts(send_counts, P, "send_counts", kind, label);
  check_counts(recv_counts, P, "recv_counts", kind, label);
  // The one pairing a single rank can check: what it sends itself.
  LAGA_CHECK(send_counts[r] == recv_counts[r], call_name(kind, label), " on rank ", r,
             ": send_counts[", r, "] = ", send_counts[r], " but recv_counts[", r,
             "] = ", recv_counts[r], "; the block a rank keeps must have the same size both ways");
  if (recv) {
    const void* own = send ? at(send, send_displs[r], dtype) : nullptr;
    for (int j = 0; j < P; ++j) {
      if (j == r) continue;
      fill_from_own(at(recv, recv_displs[j], dtype), recv_counts[j], own, send_counts[r], dtype);
    }
    // Last: the own block may be read above, and recv never aliases send here.
    copy_elems(at(recv, recv_displs[r], dtype), own, recv_counts[r], dtype);
  }
  const WireBytes w = all_to_all_wire_bytes(send_counts, recv_counts, P, r, dtype);
  ledger_.record(phase_, label, w.sent, w.received);
}

void DryRunCommunicator::all_gather_v(const void* send, std::int64_t send_count, void* recv,
                                      const std::int64_t* recv_counts,
                                      const std::int64_t* recv_displs, DType dtype,
                                      const std::string& label) {
  const CollectiveKind kind = CollectiveKind::all_gather;
  const int P = size_, r = rank_;
  check_counts(recv_counts, P, "recv_counts", kind, label);
  LAGA_CHECK(send_count >= 0 && send_count == recv_counts[r], call_name(kind, label), " on rank ",
             r, ": send_count = ", send_count, " but recv_counts[", r, "] = ", recv_counts[r],
             "; a rank's own slot must hold exactly what it contributes");
  if (recv) {
    // Place the own shard first (an in-place gather already has it there),
    // then copy it into the peers' slots from its final position.
    void* mine = at(recv, recv_displs[r], dtype);
    copy_elems(mine, send, send_count, dtype);
    const void* own = send ? mine : nullptr;
    for (int j = 0; j < P; ++j)
      if (j != r)
        fill_from_own(at(recv, recv_displs[j], dtype), recv_counts[j], own, send_count, dtype);
  }
  const WireBytes w = all_gather_wire_bytes(send_count, recv_counts, P, r, dtype);
  ledger_.record(phase_, label, w.sent, w.received);
}

void DryRunCommunicator::reduce_scatter_v(const void* send, const std::int64_t* counts,
                                          const std::int64_t* displs, void* recv, DType dtype,
                                          const std::string& label) {
  const CollectiveKind kind = CollectiveKind::reduce_scatter;
  check_counts(counts, size_, "counts", kind, label);
  // MPI receives the peers' blocks into staging before it sums them.
  const Staging staging(dtype, staging_ == StagingRule::mpi ? (size_ - 1) * counts[rank_] : 0);
  copy_elems(recv, send ? at(send, displs[rank_], dtype) : nullptr, counts[rank_], dtype);
  const WireBytes w = reduce_scatter_wire_bytes(counts, size_, rank_, dtype);
  ledger_.record(phase_, label, w.sent, w.received);
}

void DryRunCommunicator::all_reduce(void*, std::int64_t n, DType dtype, const std::string& label) {
  LAGA_CHECK(n >= 0, call_name(CollectiveKind::all_reduce, label), ": n = ", n, " is negative");
  // The in-process backend stages the own reduced chunk for the duration of
  // the call, MPI the P-1 peers' copies of it; registering the same keeps the
  // pool's peaks identical to the backend's.
  const std::int64_t own = all_reduce_chunk(n, size_, rank_);
  const Staging staging(dtype, staging_ == StagingRule::in_process ? own
                               : staging_ == StagingRule::mpi      ? (size_ - 1) * own
                                                                   : 0);
  const WireBytes w = all_reduce_wire_bytes(n, size_, rank_, dtype);
  ledger_.record(phase_, label, w.sent, w.received);
}

void DryRunCommunicator::barrier(const std::string& label) {
  ledger_.record(phase_, label, 0, 0);
}

std::unique_ptr<Communicator> make_dry_run_communicator(int rank, int size) {
  return std::make_unique<DryRunCommunicator>(rank, size);
}

}  // namespace laga
