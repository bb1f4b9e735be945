// DryRunCommunicator — one rank of a P-rank group, run alone.
//
// It reports rank R of size P and records in its ledger exactly the bytes the
// real backends record for rank R (the base class derives them from the
// counts), but no peer exists: nothing is sent, and receive buffers are filled
// with plausible stand-ins so the rank's kernels run on finite data of the
// right scale. Its measured bytes come from its own per-peer loops: received
// from the loop that fills each peer's receive block, sent from a loop over
// the blocks a real rank would hand each peer (nothing leaves the process). This is how `laga
// compare --rank-only R` measures one rank of a job too large for this machine: bytes and memory
// are exact, values are not numerically meaningful.
//
// What lands in the receive buffers (when they have storage):
//   all_to_all_v      the own block (send block R) goes to recv block R as a
//                     real backend would put it; every peer's block j != R is
//                     the own send block R repeated (cycled) or cut to
//                     recv_counts[j] elements, zeros if the own block is empty
//   all_gather_v      likewise: the own shard in place, copies of it for peers
//   reduce_scatter_v  the own contribution only (send block R), not a sum
//   all_reduce        buf unchanged: the own contribution only, not a sum
//   ring_shift        the own send block repeated (cycled) or cut to
//                     recv_count elements, zeros if it is empty (P == 1: the
//                     send block itself, as on every backend)
// Under a count-only pool (null buffers) nothing is copied.
//
// Memory: it stages by the rule it is given (StagingRule::in_process by
// default: the all_reduce's own chunk for the duration of the call; mpi: (P-1)
// x the own block for reduce_scatter and all_reduce), so a dry rank's pool
// peaks equal those of the same rank on that backend. This is how the memory
// prediction (mla/memory_model.hpp) sizes an MPI rank without MPI.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.hpp"

namespace laga {

class DryRunCommunicator final : public Communicator {
 public:
  DryRunCommunicator(int rank, int size, StagingRule staging = StagingRule::in_process);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::dry_run; }
  StagingRule staging_rule() const override { return staging_; }

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
  void transport_barrier(const std::string&) override {}
  void transport_ring_shift(const void* send, std::int64_t send_count, void* recv,
                            std::int64_t recv_count, DType dtype, Ring ring,
                            const std::string& label, Traffic& moved) override;

 private:
  int rank_, size_;
  StagingRule staging_;
};

std::unique_ptr<Communicator> make_dry_run_communicator(int rank, int size);

}  // namespace laga
