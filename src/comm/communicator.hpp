// Communicator — the collectives a sequence-parallel MLA block needs, with an
// exact per-rank ledger of the bytes every call moves.
//
// Counts and displacements are in ELEMENTS of the call's dtype; the ledger is
// in BYTES. Every call names a label ("q_a2a", "latent_ag", ...) and is filed
// under the communicator's current phase (forward, backward, grad_sync).
//
// Bytes sent by rank r, as the ledger records them (docs/accounting.md), with
// chunk_j = all_reduce_chunk(n, P, j):
//   all_to_all_v      sum over peers j != r of send_counts[j] * elem
//   all_gather_v      (P-1) * send_count * elem        (own shard to each peer)
//   reduce_scatter_v  sum over peers j != r of counts[j] * elem
//   all_reduce        reduce_scatter of n split into P near-equal chunks, then
//                     all_gather of the own chunk:
//                     ((n - chunk_r) + (P-1) * chunk_r) * elem
//                     which is 2 * (n - chunk_r) * elem when P divides n. (When
//                     it does not, the ranks with a longer chunk send more in
//                     the all-gather; the sum over ranks is 2 (P-1) n elem
//                     either way.)
// Received bytes are the mirror image (for all_reduce they equal the sent
// bytes). Nothing is counted for the data a rank keeps for itself. The
// *_wire_bytes() functions below are these rules in code: backends record
// them and closed forms should call them rather than restate them.
//
// Reductions (reduce_scatter_v, all_reduce) add the P contributions in rank
// order 0, 1, ..., P-1 on every backend, so the in-process and MPI backends
// give bit-identical results.
//
// A collective that does not complete within timeout() (a peer failed or never
// arrived) throws laga::Error naming the collective, its label and the ranks
// that were missing; it never hangs. After a collective has thrown, the
// group's ranks no longer agree on where they are in the sequence: every later
// call on that communicator throws too (make a new one).
//
// Buffers:
//  - Receive regions of different peers must not overlap each other. An
//    all_gather_v may be in place (send == recv + recv_displs[rank]), a
//    reduce_scatter_v may write into its own block (recv == send +
//    displs[rank]); other overlaps of send and recv are not allowed.
//  - Count-only (MemoryPool::count_only(), tensors without storage): a null
//    buffer with a non-zero count moves no data, but the call still
//    synchronises with its peers and the ledger records the bytes as if it
//    had. Count-only must be on for all ranks of a call or for none.
//  - Staging, registered under MemCategory::comm_buffers only while a call
//    runs (elements of the call's dtype):
//      all_to_all_v, all_gather_v, barrier   none
//      reduce_scatter_v                      none in-process; (P-1) * counts[rank] on MPI
//      all_reduce                            chunk_r in-process; (P-1) * chunk_r on MPI
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace laga {

enum class DType { f32, f64 };
inline std::int64_t dtype_bytes(DType t) {
  return t == DType::f32 ? 4 : 8;
}
template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}

// Where a backend stages collective data under MemCategory::comm_buffers
// (the "Staging" list above): what a count-only dry run must register to
// reproduce a backend's pool peaks.
enum class StagingRule {
  in_process,  // LocalCommunicator and DryRunCommunicator: all_reduce stages its own chunk
  mpi,         // MpiCommunicator: (P-1) x own block for reduce_scatter and all_reduce
  none,        // the 1-rank self communicator: no staging
};

enum class Phase : int { forward = 0, backward, grad_sync, count };
const char* to_string(Phase p);

enum class CollectiveKind : int { all_to_all, all_gather, reduce_scatter, all_reduce, barrier };
const char* to_string(CollectiveKind k);

struct LedgerEntry {
  std::int64_t calls = 0;
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;
};

// Per-rank record of every collective: keyed by (phase, label).
class Ledger {
 public:
  void record(Phase phase, const std::string& label, std::int64_t sent, std::int64_t received);
  // Sum over labels of one phase; over all phases when phase == Phase::count.
  std::int64_t bytes_sent(Phase phase = Phase::count) const;
  std::int64_t bytes_received(Phase phase = Phase::count) const;
  const std::map<std::pair<Phase, std::string>, LedgerEntry>& entries() const { return entries_; }
  // The (phase, label)s in the order their first call was recorded: the order
  // a block issues its collectives, for reports.
  const std::vector<std::pair<Phase, std::string>>& order() const { return order_; }
  void clear() { entries_.clear(), order_.clear(); }

 private:
  std::map<std::pair<Phase, std::string>, LedgerEntry> entries_;
  std::vector<std::pair<Phase, std::string>> order_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;

  // send: elements for peer j at send + send_displs[j], send_counts[j] of them;
  // recv: from peer j at recv + recv_displs[j], recv_counts[j] of them.
  virtual void all_to_all_v(const void* send, const std::int64_t* send_counts,
                            const std::int64_t* send_displs, void* recv,
                            const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                            DType dtype, const std::string& label) = 0;
  // Every rank contributes send_count elements; rank j's land at
  // recv + recv_displs[j] (recv_counts[j] == rank j's send_count).
  virtual void all_gather_v(const void* send, std::int64_t send_count, void* recv,
                            const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                            DType dtype, const std::string& label) = 0;
  // send holds P blocks, block j at displs[j] with counts[j] elements; rank r
  // receives sum over ranks of their block r into recv (counts[r] elements).
  virtual void reduce_scatter_v(const void* send, const std::int64_t* counts,
                                const std::int64_t* displs, void* recv, DType dtype,
                                const std::string& label) = 0;
  // In-place sum over ranks of n elements.
  virtual void all_reduce(void* buf, std::int64_t n, DType dtype, const std::string& label) = 0;
  virtual void barrier(const std::string& label) = 0;

  Phase phase() const { return phase_; }
  void set_phase(Phase p) { phase_ = p; }
  Ledger& ledger() { return ledger_; }
  const Ledger& ledger() const { return ledger_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  // Typed conveniences.
  template <class T>
  void all_to_all_v(const T* send, const std::int64_t* sc, const std::int64_t* sd, T* recv,
                    const std::int64_t* rc, const std::int64_t* rd, const std::string& label) {
    all_to_all_v(static_cast<const void*>(send), sc, sd, static_cast<void*>(recv), rc, rd,
                 dtype_of<T>(), label);
  }
  template <class T>
  void all_gather_v(const T* send, std::int64_t n, T* recv, const std::int64_t* rc,
                    const std::int64_t* rd, const std::string& label) {
    all_gather_v(static_cast<const void*>(send), n, static_cast<void*>(recv), rc, rd, dtype_of<T>(),
                 label);
  }
  template <class T>
  void reduce_scatter_v(const T* send, const std::int64_t* counts, const std::int64_t* displs,
                        T* recv, const std::string& label) {
    reduce_scatter_v(static_cast<const void*>(send), counts, displs, static_cast<void*>(recv),
                     dtype_of<T>(), label);
  }
  template <class T>
  void all_reduce(T* buf, std::int64_t n, const std::string& label) {
    all_reduce(static_cast<void*>(buf), n, dtype_of<T>(), label);
  }

 protected:
  Phase phase_ = Phase::forward;
  Ledger ledger_;
  std::chrono::milliseconds timeout_{std::chrono::seconds(300)};
};

// The chunk of an n-element all_reduce that rank r owns in its
// reduce-scatter step: n split into P near-equal parts, the first n % P one
// element longer.
std::int64_t all_reduce_chunk(std::int64_t n, int P, int r);

// The ledger's byte rules in closed form, for rank r of P (see the top of
// this file). Counts in elements; the result in bytes.
struct WireBytes {
  std::int64_t sent = 0;
  std::int64_t received = 0;
};
WireBytes all_to_all_wire_bytes(const std::int64_t* send_counts, const std::int64_t* recv_counts,
                                int P, int r, DType dtype);
WireBytes all_gather_wire_bytes(std::int64_t send_count, const std::int64_t* recv_counts, int P,
                                int r, DType dtype);
WireBytes reduce_scatter_wire_bytes(const std::int64_t* counts, int P, int r, DType dtype);
WireBytes all_reduce_wire_bytes(std::int64_t n, int P, int r, DType dtype);

// A communicator of one rank: every collective is a local copy, nothing is
// sent, and the ledger records zero-byte calls.
std::unique_ptr<Communicator> make_self_communicator();

}  // namespace laga
