// NcclCommunicator — the Communicator's transport over NCCL: one rank per
// GPU (under MPI one process per GPU; or threads of one process, each on its
// own device). The public collectives, their checks, the derived wire bytes
// and the ledger are the base class's (comm/communicator.hpp); this class is
// only the transport_* hooks, as the MPI backend is, and records what it
// hands to NCCL per peer as the measured bytes, so both ledgers hold the
// same rules.
//
// Buffers are device (or managed) memory of the rank's GPU; a host buffer (the
// tools' gathers of results after the measured step) is moved through a
// device copy outside the pool (nccl_comm.cpp, HostStage). Each collective is point
// to point in one NCCL group (ncclSend / ncclRecv per peer with a non-zero
// count; the own block by a device copy), so the v-collectives need no
// padding, and reductions are made like the MPI backend's: every rank sends
// each owner its block, the owner adds the P contributions in rank order
// (sum_in_rank_order, cuda/elementwise.hpp; bf16 in fp32, rounded once),
// all_reduce as that reduce-scatter of near-equal chunks and an all-gather.
// So it stages as StagingRule::mpi: (P-1) x the own block, in the pool
// (a DeviceBuffer under comm_buffers).
//
// Before it moves data, each call all-gathers every rank's counts (one small
// ncclAllGather) and checks what this rank expects from each peer against
// what that peer sends, worded by comm_detail::peer_count_message, so ranks
// that disagree fail with the same words rather than hang or corrupt. A call
// that does not finish within timeout() aborts the NCCL communicator and
// throws naming the collective and its label; the communicator refuses every
// later call.
//
// Made by `laga compare|forward --device cuda --comm nccl` under mpirun
// (tools/cli_common.cpp, run_group, through the backend's module). Not run on a GPU yet
// (docs/performance.md, "The CUDA backend"). Count-only
// (null buffers): nothing moves, the counts are recorded as the other
// backends record them.
#pragma once

#include <array>
#include <memory>
#include <string>

#include "comm/communicator.hpp"

namespace laga::cuda {

// ncclUniqueId's 128 bytes: made by rank 0 (make_nccl_id) and given to every
// rank of the group by the caller (MPI_Bcast, or a shared variable).
using NcclId = std::array<char, 128>;
NcclId make_nccl_id();

class NcclCommunicator final : public Communicator {
 public:
  // Joins the group on the current device. stream: the cudaStream_t its
  // collectives run on (0: the default stream).
  NcclCommunicator(const NcclId& id, int rank, int size, void* stream = nullptr);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::nccl; }
  StagingRule staging_rule() const override { return StagingRule::mpi; }

 protected:
  void transport_all_to_all(const void* send, const std::int64_t* send_counts,
                            const std::int64_t* send_displs, void* recv,
                            const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                            DType dtype, const std::string& label, Traffic& moved) override;
  void transport_all_gather(const void* send, std::int64_t send_count, void* recv,
                            const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                            DType dtype, const std::string& label, Traffic& moved) override;
  void transport_reduce_scatter(const void* send, const std::int64_t* counts,
                                const std::int64_t* displs, void* recv, DType dtype,
                                const std::string& label, Traffic& moved) override;
  void transport_all_reduce(void* buf, std::int64_t n, DType dtype, const std::string& label,
                            Traffic& moved) override;
  void transport_barrier(const std::string& label) override;
  void transport_ring_shift(const void* send, std::int64_t send_count, void* recv,
                            std::int64_t recv_count, DType dtype, Ring ring,
                            const std::string& label, Traffic& moved) override;
  void check_usable(CollectiveKind kind, const std::string& label) const override;
  void call_failed(const std::string& why) override;

 private:
  // Every rank's n counts, rank-major (P x n), by one ncclAllGather.
  std::vector<std::int64_t> gather_counts(const std::int64_t* mine, int n, CollectiveKind kind,
                                          const std::string& label);
  // Waits for the stream within timeout(); on timeout aborts and throws.
  void finish(CollectiveKind kind, const std::string& label);
  void reduce_into(const void* send, const std::int64_t* counts, const std::int64_t* displs,
                   void* recv, DType dtype, CollectiveKind kind, const std::string& label,
                   Traffic& moved);

  int rank_ = 0, size_ = 1;
  void* comm_ = nullptr;    // ncclComm_t
  void* stream_ = nullptr;  // cudaStream_t
  std::string broken_;      // why the communicator refuses calls (empty: usable)
};

}  // namespace laga::cuda
