// In-process backend: P ranks as threads of one process, sharing memory.
//
// Each collective is a rendezvous: every rank posts its buffer pointers (and
// copies of its counts) into the group, waits until all P ranks have posted,
// copies what it needs straight out of its peers' buffers, and meets them
// once more so no buffer is freed while a peer still reads it. Nothing goes
// through an intermediate buffer, so a "send" costs one memcpy on the
// receiving thread; the ledger still records the bytes an MPI rank would put
// on the wire (communicator.hpp). Measured bytes: each rank counts what it
// copies (or, count-only, would copy) out of each peer's memory, and reports
// those counts at the collective's last rendezvous, where every rank reads
// what its peers took from it as its bytes sent.
//
// Failure: a collective that throws (timeout, mismatch, bad counts) marks its
// rank failed in the group, and so does run_local_ranks for an exception out
// of a rank's body; a peer waiting for a failed rank stops at once with an
// error naming it, instead of waiting for the timeout. A rank whose body
// returns is marked finished, and peers still waiting for it stop as well.
//
//   laga::run_local_ranks(4, [&](laga::Communicator& comm) {
//     comm.all_gather_v(shard, n, gathered, counts, displs, "latent_ag");
//   });
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/memory_pool.hpp"

namespace laga {

class LocalGroup;  // the shared rendezvous state of P ranks (local_comm.cpp)

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank);
  // Marks the rank finished: peers waiting for it stop with an error.
  ~LocalCommunicator() override;
  LocalCommunicator(const LocalCommunicator&) = delete;
  LocalCommunicator& operator=(const LocalCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override;
  Backend backend() const override { return Backend::local; }
  StagingRule staging_rule() const override { return StagingRule::in_process; }

  // For callers that run their own threads: report that this rank will take
  // no (further) part in collectives, because it failed or is done.
  void mark_failed(const std::string& why);
  void mark_finished();

  const std::shared_ptr<LocalGroup>& group() const { return group_; }

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
  std::shared_ptr<LocalGroup> group_;
  int rank_;
};

// P communicators of one new group; give each to its own thread. `device`:
// the ranks share that device and exchange its buffers (the device-local
// transport: every copy between ranks is the device's device-to-device
// copy, cudaMemcpy on a GPU, the emulated device's checked one in CI; the
// ledger is recorded as for host buffers, by the same code); null: host
// buffers.
std::vector<std::unique_ptr<Communicator>> make_local_communicators(int P,
                                                                    DeviceMemory* device = nullptr);

// A device's reduction for the device-local transport: dst = the sum of the
// P blocks at srcs (host array of device pointers) in rank order, bf16 in
// fp32 rounded once (sum_in_rank_order's contract), run on the device and
// finished when it returns. The CUDA backend registers its kernel
// (cuda/device_memory_cuda.cpp); a device without one (the emulated device)
// is summed by the host, which can address its memory.
using DeviceReduction = void (*)(void* dst, const void* const* srcs, int P, std::int64_t n,
                                 DType dtype);
void register_device_reduction(Device device, DeviceReduction sum);

struct LocalRunOptions {
  // Collective timeout for every rank; zero keeps each communicator's own.
  std::chrono::milliseconds timeout{0};
  // OpenMP/BLAS threads per rank; zero means threads_per_rank(P), so that
  // BLAS threads x ranks <= cores.
  int threads_per_rank = 0;
  // When set (size P), rank r's thread runs under (*pools)[r]; otherwise under
  // a pool of its own that ends with the thread, so tensors made in the body
  // must not outlive it.
  std::vector<MemoryPool>* pools = nullptr;
  // Tests only: every rank's started collectives deliver at wait() and check
  // their buffers there (communicator.hpp, "Overlap"): each rank's pool
  // tracks its storage from the start of its thread, and its communicator
  // defers.
  bool deferred_delivery_for_testing = false;
  // The device the ranks share (make_local_communicators); null: host.
  DeviceMemory* device = nullptr;
};

// Runs body(comm) on P threads, one per rank, and joins them. If any rank
// threw, rethrows the first failure in time (the cause; later ones are
// usually peers stopping because of it) as laga::Error "rank r of P: ...".
void run_local_ranks(int P, const std::function<void(Communicator&)>& body,
                     const LocalRunOptions& options = {});
// The same on communicators from make_local_communicators(), which keep their
// ledgers (and settings) across runs.
void run_local_ranks(std::vector<std::unique_ptr<Communicator>>& comms,
                     const std::function<void(Communicator&)>& body,
                     const LocalRunOptions& options = {});

}  // namespace laga
