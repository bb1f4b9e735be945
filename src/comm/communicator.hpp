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
//   ring_shift        send_count * elem to the one ring neighbour it sends
//                     to (rank + 1 forward, rank - 1 backward, within its
//                     ring: Ring); received: recv_count * elem from the
//                     other one. Zero in a ring of one rank (the neighbour
//                     is the rank itself), and in a ring of two both
//                     neighbours are the same peer.
// Received bytes are the mirror image (for all_reduce they equal the sent
// bytes). Nothing is counted for the data a rank keeps for itself. The
// *_wire_bytes() functions below are these rules in code: the base class
// records them for every backend, next to the bytes the backend's transport
// measured moving (LedgerEntry), and a call whose two differ throws
// laga::Error naming the collective, label, rank and both counts.
//
// Reductions (reduce_scatter_v, all_reduce) add the P contributions in rank
// order 0, 1, ..., P-1 on every backend, so the in-process and MPI backends
// give bit-identical results. A debugging switch (set_reduction_order_seed,
// `laga train --perturb-reductions SEED`) replaces that order by a permuted
// one drawn from the seed, still the same on every rank and backend.
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
//    displs[rank]); other overlaps of send and recv are not allowed (a
//    ring_shift never runs in place: the block arriving would overwrite the
//    one still leaving, so a ring pass double-buffers its block).
//  - Count-only (MemoryPool::count_only(), tensors without storage): a null
//    buffer with a non-zero count moves no data, but the call still
//    synchronises with its peers and the ledger records the bytes as if it
//    had. Count-only must be on for all ranks of a call or for none.
//  - Staging, registered under MemCategory::comm_buffers only while a call
//    runs (elements of the call's dtype), by StagingRule (staging_elements()):
//      all_to_all_v, all_gather_v, barrier   none
//      ring_shift                            none (send and recv are the wire's ends)
//      reduce_scatter_v                      none in-process; (P-1) * counts[rank] on MPI and NCCL
//      all_reduce                            chunk_r in-process (local and dry-run);
//                                            (P-1) * chunk_r on MPI and NCCL; none on self
//
// Link model (comm/link_model.hpp): with set_link_model, every collective of
// this rank returns no earlier than its start plus the modelled time of the
// call (collective_seconds of the rank's derived bytes and P on one level of
// that link): the transport runs as before, then the rank waits out the rest.
// The modelled time depends only on the bytes and P, so a shaped run is
// deterministic up to the real transport's own time, which on one machine is
// small against the modelled links; results and the ledger are unchanged. A
// rank that arrives late pays its modelled time from its own arrival, so a
// call whose ranks arrive apart finishes earlier on the early ranks than a
// link that starts only when the last rank is there would (docs/planning.md).
// A rank's link carries one collective at a time: a call that starts while
// an earlier one is still on the link (a started, not yet waited for one,
// below) begins its modelled time when that one ends.
//
// Overlap (start_all_gather_v, start_reduce_scatter_v, start_ring_shift, wait): the checks,
// the transport and the ledger record of a started collective happen when it
// starts, exactly as in the blocking call, so results and bytes are the same
// bit for bit. What overlaps is the collective's modelled link time (above)
// with whatever the rank computes between start and wait: wait returns at
// the modelled completion, or at once when it is past. Without a link model
// both backends move the data at start (in-process copies, MPI over shared
// memory), so there is no link time to hide and the two orders cost the
// same (docs/forms.md, "Overlap").
//
// The caller's side is the contract of an asynchronous transport (MPI
// nonblocking, NCCL), although these backends finish at start: `recv` is
// read, and written, only after wait(), and `send` stays allocated and
// unchanged until wait() returns. Since the data is here at start, a caller
// that breaks it passes every check of results on these backends, so tests
// run the started calls under deferred delivery
// (set_deferred_delivery_for_testing): the transport still runs at start (the
// cross-rank order, the ledger and the link clock are unchanged), then the
// communicator moves each recv block's result into a copy of its own (not in
// any memory pool, so every count and peak is unchanged), fills the block
// with quiet NaN, and notes each send block's pool block
// (MemoryPool::storage_block) and checksum. wait() then throws, naming the
// call, if a send block was released (its pool block is gone or handed out
// again) or changed, or a recv block was released or written, and only then
// copies the results in. A read before the wait computes with NaN, which
// every comparison of results sees. Every buffer of a started call must then
// be storage of the rank's memory pool with storage tracking on from before
// it was allocated (LocalRunOptions::deferred_delivery_for_testing sets up
// both on every rank; a buffer it does not track is refused at start). What
// it cannot see: a read of recv before the wait whose result is never used,
// a write into recv that leaves quiet NaN there, and the timing of a real
// asynchronous transport, whose data does not all arrive at the wait.
//
// Checks: every backend makes the same checks of one rank's own arguments
// before anything moves, and words them alike ("<collective> '<label>' on
// rank r of P: ..."): counts and n non-negative, the own block the same size
// both ways, receive blocks disjoint, and send/recv overlapping only in the
// two in-place forms above. Checks that need the peers' arguments (what a
// peer sends against what this rank expects) are the transport's; both
// backends word them as comm_detail::peer_count_message does. (A ring_shift
// on one rank receives from itself: its recv_count against its own
// send_count is checked with the rank's own arguments, in that wording, on
// every backend.)
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace laga {

struct LinkModel;  // comm/link_model.hpp

// The element types a collective moves. bf16 (core/bf16.hpp) is the wire
// type of `--dtype bf16`'s activations (docs/accounting.md, "bf16 on the
// wire"): moved as 2-byte values; a reduction of bf16 contributions adds
// them in fp32, in the same order as the other types, and rounds the sum to
// bf16 once (sum_in_rank_order).
enum class DType { f32, f64, bf16 };
inline std::int64_t dtype_bytes(DType t) {
  return t == DType::f32 ? 4 : t == DType::f64 ? 8 : 2;
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
struct bf16;  // core/bf16.hpp
template <>
constexpr DType dtype_of<bf16>() {
  return DType::bf16;
}

// The reduction-order switch (docs/convergence.md, "Reproducibility under
// perturbed reductions"): with a seed set, every reduction of every
// communicator in the process adds its P contributions in an order permuted
// by (seed, the 1024-element block of the reduced range), instead of rank
// order. It stands in for a backend whose reduction order is not fixed (the
// paper's NPU): the rounding changes in the last bits, yet a run stays
// deterministic for its seed, and the in-process and MPI backends still agree,
// because the order depends only on the seed, P and the element's place in
// the range each backend reduces alike. Floating-point addition is
// commutative, so at P <= 2 every order gives the same bits: it perturbs
// only P >= 3. std::nullopt (the default) is rank order, bit for bit as
// without the switch. Set it before any rank starts; every process of an MPI
// group must set the same seed.
void set_reduction_order_seed(std::optional<std::uint64_t> seed);
std::optional<std::uint64_t> reduction_order_seed();

enum class Phase : int { forward = 0, backward, grad_sync, count };
const char* to_string(Phase p);

// ring_shift stays last: the MPI backend's message tags hold a kind in 3 bits,
// and 7 is its failure notice.
enum class CollectiveKind : int {
  all_to_all,
  all_gather,
  reduce_scatter,
  all_reduce,
  barrier,
  ring_shift
};
const char* to_string(CollectiveKind k);

// Which way a ring_shift passes its block round the ring of ranks 0..P-1.
// forward: to rank + 1, from rank - 1 (the ring attention's K/V pass);
// backward: to rank - 1, from rank + 1 (dK/dV going home). Every rank of a
// call must pass the same direction.
enum class RingDirection { forward, backward };
const char* to_string(RingDirection d);  // "forward", "backward"
// Which rings a ring_shift passes its blocks round, and which way. The P
// ranks form P / size rings of `size` ranks each, `stride` apart: the
// ranks are cut into blocks of size * stride consecutive ranks, and in each
// block rank r's ring is the ranks of the block with r's residue mod
// stride, at place (r mod (size stride)) / stride. Each ring passes its own
// blocks: the hierarchical form's rings across context groups, one per head
// group, a context group's ranks consecutive (stride = its size; docs/
// forms.md, "a2a_p2p"). size 0 is P: one ring of every rank. Every rank of
// a call passes the same Ring, and size * stride must divide P.
struct Ring {
  RingDirection direction = RingDirection::forward;
  int size = 0;
  int stride = 1;
  Ring(RingDirection d = RingDirection::forward,  // NOLINT: a direction alone is the whole ring
       int ring_size = 0, int ring_stride = 1)
      : direction(d), size(ring_size), stride(ring_stride) {}
  // The ranks in each ring of a group of P.
  int ranks(int P) const { return size == 0 ? P : size; }
  // The consecutive ranks one ring's members span, first to last: the
  // link model's extent of a call (CollectiveEvent::ranks).
  int span(int P) const { return (ranks(P) - 1) * stride + 1; }
  // Whether these rings tile a group of P (size * stride divides P).
  bool tiles(int P) const { return size >= 0 && stride >= 1 && P % (ranks(P) * stride) == 0; }
  friend bool operator==(const Ring&, const Ring&) = default;
};
// "forward", "backward in rings of 2", "forward in rings of 2, stride 4"
std::string to_string(Ring ring);
// The two neighbours of rank r of P in a ring_shift: the one it sends to and
// the one it receives from (both r in a ring of one). laga::Error unless
// 0 <= r < P and the rings tile P (Ring::tiles).
struct RingPeers {
  int to = 0;
  int from = 0;
};
RingPeers ring_peers(int P, int r, Ring ring);

// Which implementation moves the bytes. The CLI's --comm takes "local" or
// "mpi"; the dry-run and self communicators are made by code, not chosen,
// as is nccl (cuda/nccl_comm.hpp: one rank per GPU, built with LAGA_CUDA).
enum class Backend { local, mpi, dry_run, self, nccl };
const char* to_string(Backend b);  // "local", "mpi", "dry-run", "self", "nccl"
// The inverse of to_string; an unknown name is a laga::Error listing the names.
Backend parse_backend(const std::string& s);

// Where a backend stages collective data while a call runs (see "Staging"
// above); the memory model predicts comm_buffers from it.
enum class StagingRule {
  in_process,  // LocalCommunicator and DryRunCommunicator: all_reduce stages its own chunk
  mpi,         // MpiCommunicator: (P-1) x own block for reduce_scatter and all_reduce
  none,        // the 1-rank self communicator: no staging
};
// Elements staged by one call of `kind` under `rule`, where `own` is the
// rank's own block (reduce_scatter: counts[rank]; all_reduce: its chunk).
std::int64_t staging_elements(StagingRule rule, CollectiveKind kind, int P, std::int64_t own);

struct WireBytes {
  std::int64_t sent = 0;
  std::int64_t received = 0;
};

// Per (phase, label): how many calls, and their bytes twice over. bytes_sent
// and bytes_received are DERIVED from each call's counts by the rules above;
// measured_* are what the transport itself counted where the bytes move
// (docs/accounting.md, "Derived and measured"). A call whose two differ
// throws, so in a ledger that exists they are equal.
struct LedgerEntry {
  std::int64_t calls = 0;
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;
  std::int64_t measured_sent = 0;
  std::int64_t measured_received = 0;
};

// Per-rank record of every collective: keyed by (phase, label).
class Ledger {
 public:
  void record(Phase phase, const std::string& label, WireBytes derived, WireBytes measured);
  // Sum over labels of one phase; over all phases when phase == Phase::count.
  std::int64_t bytes_sent(Phase phase = Phase::count) const;
  std::int64_t bytes_received(Phase phase = Phase::count) const;
  const std::map<std::pair<Phase, std::string>, LedgerEntry>& entries() const { return entries_; }
  // The (phase, label)s in the order their first call was recorded: the order
  // a block issues its collectives, for reports.
  const std::vector<std::pair<Phase, std::string>>& order() const { return order_; }
  // Files a whole entry as it was recorded elsewhere (a peer's report).
  void record_entry(Phase phase, const std::string& label, const LedgerEntry& e);
  void clear() { entries_.clear(), order_.clear(); }

 private:
  std::map<std::pair<Phase, std::string>, LedgerEntry> entries_;
  std::vector<std::pair<Phase, std::string>> order_;
};

// What a transport moved in one call, per peer, counted by the transport
// itself: the sizes it hands to MPI_Isend / gets from MPI_Irecv, or copies
// out of a peer's memory. Count-only calls (null buffers) move nothing; the
// transport still counts, from its own per-peer loop, the bytes it would
// have handed over (docs/accounting.md).
class Traffic {
 public:
  explicit Traffic(int P) : peers_(static_cast<size_t>(P)) {}
  void sent(int peer, std::int64_t bytes) { peers_.at(static_cast<size_t>(peer)).sent += bytes; }
  void received(int peer, std::int64_t bytes) {
    peers_.at(static_cast<size_t>(peer)).received += bytes;
  }
  const std::vector<WireBytes>& per_peer() const { return peers_; }
  WireBytes total() const;

 private:
  std::vector<WireBytes> peers_;
};

// A transport fault for tests that the measured ledger must catch: the
// backend misbehaves once, in the first message it sends (MPI, any
// collective) or the first block it copies from a peer (in-process,
// all_to_all_v and ring_shift only) with a non-zero count, then behaves
// again. The dry-run
// and self backends ignore it. Never set outside tests.
enum class TransportFault {
  none,
  short_send,  // one element too few to (MPI) / from (in-process) one peer
  wrong_peer,  // one peer's block goes to (MPI) / is read from (in-process) another rank
  skip_peer,   // one peer's block is not moved at all
};

class Communicator;
class MemoryPool;  // core/memory_pool.hpp

// A collective started by Communicator::start_* and not yet waited for. Its
// destructor, and assigning over it, wait for its modelled time (a path
// that leaves early, e.g. on an exception, never leaves the link model's
// clock behind) but, under deferred delivery, deliver nothing: the buffers
// may be gone by then. The communicator that started it must outlive it.
class PendingCollective {
 public:
  PendingCollective() = default;
  PendingCollective(PendingCollective&& o) noexcept
      : owner_(o.owner_),
        id_(o.id_),
        done_at_(o.done_at_),
        pending_(std::exchange(o.pending_, false)) {}
  PendingCollective& operator=(PendingCollective&& o) noexcept;
  PendingCollective(const PendingCollective&) = delete;
  PendingCollective& operator=(const PendingCollective&) = delete;
  ~PendingCollective();
  bool pending() const { return pending_; }

 private:
  friend class Communicator;
  Communicator* owner_ = nullptr;                    // the communicator that started it
  std::int64_t id_ = -1;                             // its CollectiveEvent::id
  std::chrono::steady_clock::time_point done_at_{};  // its modelled completion
  bool pending_ = false;
};

// What a CollectiveObserver hears, in the rank's own order: each collective
// as it is issued (after its checks and transport, with its derived bytes),
// and the wait for each started one. The planner's time model replays a
// count-only rank's events as a timeline (plan/time_model.hpp), so overlap
// is costed from the order the code really issues and waits.
struct CollectiveEvent {
  enum class What { issued, waited };
  What what = What::issued;
  CollectiveKind kind = CollectiveKind::all_to_all;  // issued only
  Phase phase = Phase::forward;
  std::string label;     // issued only
  WireBytes bytes;       // issued only: derived
  bool started = false;  // issued by a start_* call: complete at its wait
  std::int64_t id = -1;  // a started call's number on its communicator; its wait has the same
  // issued only: the ranks one call spans, whose count the link model's cost
  // takes (comm/link_model.hpp): the group's P, or the consecutive ranks a
  // ring_shift's ring spans (Ring::span).
  int ranks = 0;
};
using CollectiveObserver = std::function<void(const CollectiveEvent&)>;

// The public collectives are not virtual: each checks its arguments (the same
// checks and wording on every backend), derives the wire bytes from the
// counts, runs the backend's transport, and records both the derived and the
// measured bytes in the ledger. A backend implements only the transport_*
// hooks and the cross-rank checks that need its peers.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;
  // How this backend's transport stages data (communicator.hpp, "Staging").
  virtual StagingRule staging_rule() const = 0;

  // send: elements for peer j at send + send_displs[j], send_counts[j] of them;
  // recv: from peer j at recv + recv_displs[j], recv_counts[j] of them.
  void all_to_all_v(const void* send, const std::int64_t* send_counts,
                    const std::int64_t* send_displs, void* recv, const std::int64_t* recv_counts,
                    const std::int64_t* recv_displs, DType dtype, const std::string& label);
  // Every rank contributes send_count elements; rank j's land at
  // recv + recv_displs[j] (recv_counts[j] == rank j's send_count).
  void all_gather_v(const void* send, std::int64_t send_count, void* recv,
                    const std::int64_t* recv_counts, const std::int64_t* recv_displs, DType dtype,
                    const std::string& label);
  // send holds P blocks, block j at displs[j] with counts[j] elements; rank r
  // receives sum over ranks of their block r into recv (counts[r] elements).
  void reduce_scatter_v(const void* send, const std::int64_t* counts, const std::int64_t* displs,
                        void* recv, DType dtype, const std::string& label);
  // Started forms of the two above ("Overlap"): recv is valid after wait().
  PendingCollective start_all_gather_v(const void* send, std::int64_t send_count, void* recv,
                                       const std::int64_t* recv_counts,
                                       const std::int64_t* recv_displs, DType dtype,
                                       const std::string& label);
  PendingCollective start_reduce_scatter_v(const void* send, const std::int64_t* counts,
                                           const std::int64_t* displs, void* recv, DType dtype,
                                           const std::string& label);
  // Every rank sends its send_count elements to its neighbour ring_peers().to
  // and receives recv_count elements from ring_peers().from (recv_count must
  // equal that rank's send_count): one step of a ring pass. send and recv
  // must not overlap.
  void ring_shift(const void* send, std::int64_t send_count, void* recv, std::int64_t recv_count,
                  DType dtype, const std::string& label, Ring ring = {});
  PendingCollective start_ring_shift(const void* send, std::int64_t send_count, void* recv,
                                     std::int64_t recv_count, DType dtype, const std::string& label,
                                     Ring ring = {});
  // Returns when the started collective is complete (its modelled time);
  // under deferred delivery, with recv holding its result ("Overlap").
  void wait(PendingCollective& p);
  // In-place sum over ranks of n elements.
  void all_reduce(void* buf, std::int64_t n, DType dtype, const std::string& label);
  void barrier(const std::string& label);

  Phase phase() const { return phase_; }
  void set_phase(Phase p) { phase_ = p; }
  Ledger& ledger() { return ledger_; }
  const Ledger& ledger() const { return ledger_; }
  // Wall seconds this rank has spent inside collective calls and waits so
  // far: the transport, waiting for its peers (their skew included) and the
  // link model's hold. The compute a started collective hides is not in it.
  double seconds_in_collectives() const { return seconds_in_collectives_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  // Shapes every later collective of this rank by `link` (copied), or stops
  // shaping when null ("Link model" above).
  void set_link_model(const LinkModel* link);
  const LinkModel* link_model() const { return link_model_.get(); }
  // Tests only: see TransportFault.
  void inject_fault_for_testing(TransportFault f) { fault_ = f; }
  // Tests only: started collectives deliver their results at wait() and
  // check their buffers there ("Overlap"). Set it between calls, with no
  // started one pending.
  void set_deferred_delivery_for_testing(bool on) { deferred_delivery_ = on; }
  bool deferred_delivery_for_testing() const { return deferred_delivery_; }
  // Tells `observer` of every later collective and wait (CollectiveEvent);
  // an empty one stops telling.
  void set_observer(CollectiveObserver observer) { observer_ = std::move(observer); }

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
  PendingCollective start_all_gather_v(const T* send, std::int64_t n, T* recv,
                                       const std::int64_t* rc, const std::int64_t* rd,
                                       const std::string& label) {
    return start_all_gather_v(static_cast<const void*>(send), n, static_cast<void*>(recv), rc, rd,
                              dtype_of<T>(), label);
  }
  template <class T>
  PendingCollective start_reduce_scatter_v(const T* send, const std::int64_t* counts,
                                           const std::int64_t* displs, T* recv,
                                           const std::string& label) {
    return start_reduce_scatter_v(static_cast<const void*>(send), counts, displs,
                                  static_cast<void*>(recv), dtype_of<T>(), label);
  }
  template <class T>
  void ring_shift(const T* send, std::int64_t send_count, T* recv, std::int64_t recv_count,
                  const std::string& label, Ring ring = {}) {
    ring_shift(static_cast<const void*>(send), send_count, static_cast<void*>(recv), recv_count,
               dtype_of<T>(), label, ring);
  }
  template <class T>
  PendingCollective start_ring_shift(const T* send, std::int64_t send_count, T* recv,
                                     std::int64_t recv_count, const std::string& label,
                                     Ring ring = {}) {
    return start_ring_shift(static_cast<const void*>(send), send_count, static_cast<void*>(recv),
                            recv_count, dtype_of<T>(), label, ring);
  }
  template <class T>
  void all_reduce(T* buf, std::int64_t n, const std::string& label) {
    all_reduce(static_cast<void*>(buf), n, dtype_of<T>(), label);
  }

 protected:
  // The transports. Arguments have passed every check one rank can make
  // (counts >= 0, the own block, buffer overlaps); checks that need the peers'
  // arguments are the transport's, worded by comm_detail::peer_count_message.
  // Each counts what it moves, per peer, into `moved`.
  virtual void transport_all_to_all(const void* send, const std::int64_t* send_counts,
                                    const std::int64_t* send_displs, void* recv,
                                    const std::int64_t* recv_counts,
                                    const std::int64_t* recv_displs, DType dtype,
                                    const std::string& label, Traffic& moved) = 0;
  virtual void transport_all_gather(const void* send, std::int64_t send_count, void* recv,
                                    const std::int64_t* recv_counts,
                                    const std::int64_t* recv_displs, DType dtype,
                                    const std::string& label, Traffic& moved) = 0;
  virtual void transport_reduce_scatter(const void* send, const std::int64_t* counts,
                                        const std::int64_t* displs, void* recv, DType dtype,
                                        const std::string& label, Traffic& moved) = 0;
  virtual void transport_all_reduce(void* buf, std::int64_t n, DType dtype,
                                    const std::string& label, Traffic& moved) = 0;
  virtual void transport_barrier(const std::string& label) = 0;
  // To ring_peers(size(), rank(), ring).to, from .from; in a ring of one a
  // copy of send into recv.
  virtual void transport_ring_shift(const void* send, std::int64_t send_count, void* recv,
                                    std::int64_t recv_count, DType dtype, Ring ring,
                                    const std::string& label, Traffic& moved) = 0;

  // Throws when the backend refuses calls (an earlier one failed).
  virtual void check_usable(CollectiveKind kind, const std::string& label) const;
  // Told why a call failed (a check, the transport or the ledger), so the
  // backend can stop its waiting peers and refuse later calls.
  virtual void call_failed(const std::string& why);

  // Elements this backend stages for a call of `kind` (staging_rule()).
  std::int64_t staging_for(CollectiveKind kind, std::int64_t own) const {
    return staging_elements(staging_rule(), kind, size(), own);
  }
  // The fault to apply in this call (tests only); consumed by take_fault().
  TransportFault take_fault() { return std::exchange(fault_, TransportFault::none); }
  // Collectives completed so far: the position in the sequence.
  std::int64_t calls_done() const { return calls_; }

 private:
  friend class PendingCollective;  // its destructor completes it without delivering
  // The bodies of all_gather_v / reduce_scatter_v and their start_* forms.
  std::chrono::steady_clock::time_point all_gather_call(const void* send, std::int64_t send_count,
                                                        void* recv, const std::int64_t* recv_counts,
                                                        const std::int64_t* recv_displs,
                                                        DType dtype, const std::string& label,
                                                        bool started);
  std::chrono::steady_clock::time_point reduce_scatter_call(const void* send,
                                                            const std::int64_t* counts,
                                                            const std::int64_t* displs, void* recv,
                                                            DType dtype, const std::string& label,
                                                            bool started);
  std::chrono::steady_clock::time_point ring_shift_call(const void* send, std::int64_t send_count,
                                                        void* recv, std::int64_t recv_count,
                                                        DType dtype, const std::string& label,
                                                        Ring ring, bool started);
  // Waits out p's modelled time; with `deliver`, what wait() does besides.
  void complete(PendingCollective& p, bool deliver);

  // Deferred delivery ("Overlap"): one buffer of a started call (a peer's
  // block, or index -1: the whole buffer) and what its wait checks.
  struct DeferredBuffer {
    DeferredBuffer(void* p_, std::int64_t bytes_, int index_ = -1)
        : p(p_), bytes(bytes_), index(index_) {}
    void* p = nullptr;
    std::int64_t bytes = 0;
    int index = -1;
    std::int64_t block = 0;             // its pool block (MemoryPool::storage_block) at start
    std::uint64_t sum = 0;              // send: a checksum of its bytes at start
    std::vector<unsigned char> staged;  // recv: the result, copied in at the wait
  };
  struct DeferredCall {
    CollectiveKind kind = CollectiveKind::all_gather;
    std::string label;
    DType dtype = DType::f32;
    const MemoryPool* pool = nullptr;  // the rank's, whose storage the buffers are
    std::vector<DeferredBuffer> send, recv;
  };
  // Before the transport (a refused call moves nothing): every buffer must
  // be a live block of this thread's pool, with its storage tracked.
  DeferredCall defer_check(CollectiveKind kind, const std::string& label, DType dtype,
                           std::vector<DeferredBuffer> send,
                           std::vector<DeferredBuffer> recv) const;
  // After the transport: the send checksums, recv's results staged and recv
  // poisoned; kept for the wait of the started call just run.
  void defer(DeferredCall call);
  // At the wait: the checks, then the results into recv.
  void deliver(const DeferredCall& call) const;
  // The started call just run (its id is started_ - 1), complete at `done`;
  // `deferred` (deferred delivery only), its buffers, defer()red first.
  PendingCollective pending_until(std::chrono::steady_clock::time_point done,
                                  std::optional<DeferredCall> deferred);
  // check_usable, then body(moved, checks) -- the checks of the call's own
  // arguments and the transport, returning the derived bytes per peer --
  // then the ledger; call_failed on any error. Returns the call's modelled
  // completion (now without a link model), having waited for it unless
  // `started` (the start_* forms).
  // `ranks`: the ranks one call spans (CollectiveEvent::ranks); 0 is size().
  template <class Body>
  std::chrono::steady_clock::time_point run(CollectiveKind kind, const std::string& label,
                                            Body&& body, bool started = false, int ranks = 0);

  Phase phase_ = Phase::forward;
  Ledger ledger_;
  std::chrono::milliseconds timeout_{std::chrono::seconds(300)};
  TransportFault fault_ = TransportFault::none;
  std::int64_t calls_ = 0;
  std::shared_ptr<const LinkModel> link_model_;
  // Link model: when the last collective this rank put on its link ends.
  std::chrono::steady_clock::time_point link_free_at_{};
  CollectiveObserver observer_;
  std::int64_t started_ = 0;  // start_* calls so far: the next one's id
  double seconds_in_collectives_ = 0;
  bool deferred_delivery_ = false;
  std::map<std::int64_t, DeferredCall> deferred_;  // by the started call's id
};

// The chunk of an n-element all_reduce that rank r owns in its
// reduce-scatter step: n split into P near-equal parts, the first n % P one
// element longer.
std::int64_t all_reduce_chunk(std::int64_t n, int P, int r);

// The ledger's byte rules in closed form, for rank r of P (see the top of
// this file). Counts in elements; the result in bytes. The *_peer_bytes
// forms give the same rule per peer (entry j: what rank r sends to and
// receives from rank j; entry r is zero); the *_wire_bytes totals are their
// sums.
std::vector<WireBytes> all_to_all_peer_bytes(const std::int64_t* send_counts,
                                             const std::int64_t* recv_counts, int P, int r,
                                             DType dtype);
std::vector<WireBytes> all_gather_peer_bytes(std::int64_t send_count,
                                             const std::int64_t* recv_counts, int P, int r,
                                             DType dtype);
std::vector<WireBytes> reduce_scatter_peer_bytes(const std::int64_t* counts, int P, int r,
                                                 DType dtype);
std::vector<WireBytes> all_reduce_peer_bytes(std::int64_t n, int P, int r, DType dtype);
std::vector<WireBytes> ring_shift_peer_bytes(std::int64_t send_count, std::int64_t recv_count,
                                             int P, int r, DType dtype, Ring ring);
WireBytes all_to_all_wire_bytes(const std::int64_t* send_counts, const std::int64_t* recv_counts,
                                int P, int r, DType dtype);
WireBytes all_gather_wire_bytes(std::int64_t send_count, const std::int64_t* recv_counts, int P,
                                int r, DType dtype);
WireBytes reduce_scatter_wire_bytes(const std::int64_t* counts, int P, int r, DType dtype);
WireBytes all_reduce_wire_bytes(std::int64_t n, int P, int r, DType dtype);
// The same on every rank and in both directions (one peer each way), hence
// no r and no direction: zero in rings of one rank.
WireBytes ring_shift_wire_bytes(std::int64_t send_count, std::int64_t recv_count, int P,
                                DType dtype, int ring_size = 0);

// A communicator of one rank: every collective is a local copy, nothing is
// sent, and the ledger records zero-byte calls.
std::unique_ptr<Communicator> make_self_communicator();

}  // namespace laga
