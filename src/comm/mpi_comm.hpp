// MPI backend (OpenMPI; one rank per process, started by mpirun).
//
// Every collective is built from nonblocking point-to-point messages, one (or
// a few, for messages over max_message_bytes()) per peer, polled with
// MPI_Testsome until done or until timeout(): a rank that times out knows
// exactly which peers never delivered and names them. Reductions receive the
// peers' blocks into staging and add them in rank order through the same
// function as the in-process backend, so results are bit-identical to it.
// all_reduce is a reduce-scatter over all_reduce_chunk() chunks followed by an
// all-gather, exactly what the ledger counts.
//
// Each communicator works on its own duplicate of the base communicator and
// tags every message with (round number, collective kind, dtype, label hash):
// messages of different collectives can never be matched to each other, and
// when a peer's message for the same round but another collective, dtype or
// label is waiting, the call stops at once with a "collective mismatch" error
// instead of timing out. (A rank that skipped a collective and went on to the
// next one looks like a fast peer, so that case ends in the timeout.)
//
// A rank whose collective fails sends each peer a short notice with the
// reason; a peer waiting for that rank reads it and stops at once with an
// error naming the rank and the reason (rather than timing out). A peer that
// simply never arrives cannot send one: then the timeout names it.
//
// After a failure: receives still pending are cancelled; sends
// still pending (a large message to a peer that never posted its receive)
// cannot be cancelled in OpenMPI and are left behind ("orphaned") — they keep
// pointing into the caller's buffer. The communicator refuses further calls.
// MpiSession's destructor then calls MPI_Abort instead of MPI_Finalize when
// orphaned requests exist, because MPI_Finalize could wait for them forever:
// mpirun kills every rank and exits non-zero. Small messages (below OpenMPI's
// eager limit, a few KiB on shared memory) never orphan, so a job can catch a
// timeout, report it and finish cleanly.
//
//   int main(int argc, char** argv) {
//     laga::MpiSession mpi(&argc, &argv);
//     auto comm = laga::make_mpi_communicator();
//     ...
//   }
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"

namespace laga {

// MPI_Init_thread / MPI_Finalize for the process. Requests
// MPI_THREAD_SERIALIZED (a communicator may be used from any thread, one at a
// time). If MPI is already initialised, the session neither initialises nor
// finalises it.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  MpiSession() : MpiSession(nullptr, nullptr) {}
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  int thread_level() const { return thread_level_; }  // MPI_THREAD_* provided

  // Ends the whole job now (MPI_Abort on MPI_COMM_WORLD): mpirun kills every
  // rank. For errors a rank cannot recover from without its peers.
  [[noreturn]] static void abort(const std::string& why, int code = 1);

 private:
  bool owns_ = false;
  int world_rank_ = 0, world_size_ = 1, thread_level_ = 0;
};

// Whether this process was started by mpirun/mpiexec/srun (from the
// environment, without initialising MPI): lets a tool pick its backend.
bool launched_under_mpi();
// How many processes that launcher started, from the same environment
// (OMPI_COMM_WORLD_SIZE, PMI_SIZE, MV2_COMM_WORLD_SIZE); 0 when it does not
// say. A tool run with --comm local under `mpirun -np 4` warns: each of the
// four processes would run the whole job alone.
int mpi_launcher_world_size();

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates `base` (collective over base, bounded by create_timeout).
  explicit MpiCommunicator(MPI_Comm base = MPI_COMM_WORLD,
                           std::chrono::milliseconds create_timeout = std::chrono::seconds(300));
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::mpi; }
  StagingRule staging_rule() const override { return StagingRule::mpi; }

  // Messages larger than this are sent as several (MPI counts are int).
  // Tests lower it to exercise the splitting.
  std::int64_t max_message_bytes() const { return max_message_bytes_; }
  void set_max_message_bytes(std::int64_t bytes);

  MPI_Comm mpi_comm() const { return comm_; }

 protected:
  // mpi_transport.cpp
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
  // mpi_comm.cpp: refuse calls once broken; break and tell the peers.
  void check_usable(CollectiveKind kind, const std::string& label) const override;
  void call_failed(const std::string& why) override;

 private:
  class Round;  // mpi_transport.cpp
  // The reduce-scatter step of reduce_scatter_v and of all_reduce (`kind`):
  // every peer's block `rank` into staging, then the rank-ordered sum into
  // recv, which may be send's own block.
  void reduce_own_block(CollectiveKind kind, const void* send, const std::int64_t* counts,
                        const std::int64_t* displs, void* recv, DType dtype,
                        const std::string& label, std::chrono::steady_clock::time_point deadline,
                        Traffic& moved);
  int tag(std::int64_t round, CollectiveKind kind, DType dtype, const std::string& label) const;
  // What a peer's message tag says about the collective it is in, against own.
  std::string describe_tag(int tag, int own) const;
  long round_of(int tag) const;
  void notify_peers(const std::string& why);  // mpi_notice.cpp

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::int64_t rounds_ = 0;  // message rounds so far; the tag's sequence number
  int seq_bits_ = 0, hash_bits_ = 0;
  static constexpr int kDtypeBits = 2;                        // DType's values: f32, f64, bf16
  int kind_shift() const { return hash_bits_ + kDtypeBits; }  // the kind's 3 bits start here
  std::int64_t max_message_bytes_ = std::int64_t{1} << 30;
  std::string broken_;  // why the communicator refuses calls; empty while usable
  std::vector<MPI_Request> orphans_;
};

// A communicator over all ranks of MPI_COMM_WORLD (or of base); MPI must be
// initialised (MpiSession). Every rank of base must call it.
std::unique_ptr<Communicator> make_mpi_communicator();
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm base);

// Requests left pending by timed-out collectives in this process (see top).
std::int64_t mpi_orphaned_requests();

}  // namespace laga
