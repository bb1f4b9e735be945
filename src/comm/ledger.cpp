// The ledger and the byte rules it records (communicator.hpp's table): what
// each collective moves per peer, derived from its counts, and the staging
// each backend's rule registers.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "comm/collective_util.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"

namespace laga {

std::int64_t staging_elements(StagingRule rule, CollectiveKind kind, int P, std::int64_t own) {
  switch (rule) {
    case StagingRule::in_process:
      return kind == CollectiveKind::all_reduce ? own : 0;
    case StagingRule::mpi:
      return kind == CollectiveKind::reduce_scatter || kind == CollectiveKind::all_reduce
                 ? (P - 1) * own
                 : 0;
    case StagingRule::none:
      return 0;
  }
  return 0;
}

namespace comm_detail {
WireBytes sum_of(const std::vector<WireBytes>& per_peer) {
  WireBytes t;
  for (const WireBytes& w : per_peer) t.sent += w.sent, t.received += w.received;
  return t;
}
}  // namespace comm_detail

using comm_detail::sum_of;

WireBytes Traffic::total() const {
  return sum_of(peers_);
}

void Ledger::record(Phase phase, const std::string& label, WireBytes derived, WireBytes measured) {
  LAGA_CHECK(phase != Phase::count, "ledger: collective '", label,
             "' recorded under Phase::count, which only selects all phases in queries; set a real "
             "phase with set_phase()");
  const auto [it, first] = entries_.try_emplace({phase, label});
  if (first) order_.push_back(it->first);
  LedgerEntry& e = it->second;
  e.calls += 1;
  e.bytes_sent += derived.sent;
  e.bytes_received += derived.received;
  e.measured_sent += measured.sent;
  e.measured_received += measured.received;
}

void Ledger::record_entry(Phase phase, const std::string& label, const LedgerEntry& e) {
  const auto [it, first] = entries_.try_emplace({phase, label}, e);
  LAGA_CHECK(first, "ledger: '", label, "' in phase ", to_string(phase), " is already recorded");
  order_.push_back(it->first);
}

namespace {
// The sum of one field over the entries of `phase` (Phase::count: of all).
std::int64_t phase_total(const std::map<std::pair<Phase, std::string>, LedgerEntry>& entries,
                         Phase phase, std::int64_t LedgerEntry::*field) {
  std::int64_t total = 0;
  for (const auto& [key, e] : entries)
    if (phase == Phase::count || key.first == phase) total += e.*field;
  return total;
}
}  // namespace

std::int64_t Ledger::bytes_sent(Phase phase) const {
  return phase_total(entries_, phase, &LedgerEntry::bytes_sent);
}

std::int64_t Ledger::bytes_received(Phase phase) const {
  return phase_total(entries_, phase, &LedgerEntry::bytes_received);
}

std::int64_t all_reduce_chunk(std::int64_t n, int P, int r) {
  LAGA_CHECK(P >= 1 && r >= 0 && r < P && n >= 0, "all_reduce_chunk(n=", n, ", P=", P, ", r=", r,
             "): need n >= 0 and 0 <= r < P");
  return n / P + (r < n % P ? 1 : 0);
}

namespace {
// Every peer j but r: elems(j), a pair {sent, received} in elements of
// dtype, as bytes. The own rank's entry stays zero.
template <class Elems>
std::vector<WireBytes> each_peer(int P, int r, DType dtype, Elems elems) {
  std::vector<WireBytes> w(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    if (j == r) continue;
    const auto [sent, received] = elems(j);
    w[j] = {sent * dtype_bytes(dtype), received * dtype_bytes(dtype)};
  }
  return w;
}
}  // namespace

std::vector<WireBytes> all_to_all_peer_bytes(const std::int64_t* send_counts,
                                             const std::int64_t* recv_counts, int P, int r,
                                             DType dtype) {
  return each_peer(P, r, dtype, [&](int j) { return std::pair{send_counts[j], recv_counts[j]}; });
}

std::vector<WireBytes> all_gather_peer_bytes(std::int64_t send_count,
                                             const std::int64_t* recv_counts, int P, int r,
                                             DType dtype) {
  // The own shard goes to every peer; each peer's shard comes back.
  return each_peer(P, r, dtype, [&](int j) { return std::pair{send_count, recv_counts[j]}; });
}

std::vector<WireBytes> reduce_scatter_peer_bytes(const std::int64_t* counts, int P, int r,
                                                 DType dtype) {
  // Block j goes to rank j; every peer's copy of the own block comes in.
  return each_peer(P, r, dtype, [&](int j) { return std::pair{counts[j], counts[r]}; });
}

std::vector<WireBytes> all_reduce_peer_bytes(std::int64_t n, int P, int r, DType dtype) {
  // reduce-scatter: peer j's chunk out, its copy of the own chunk in;
  // all-gather: the reduced own chunk out, peer j's reduced chunk in.
  const std::int64_t own = all_reduce_chunk(n, P, r);
  return each_peer(P, r, dtype, [&](int j) {
    const std::int64_t both = all_reduce_chunk(n, P, j) + own;
    return std::pair{both, both};
  });
}

std::vector<WireBytes> ring_shift_peer_bytes(std::int64_t send_count, std::int64_t recv_count,
                                             int P, int r, DType dtype, Ring ring) {
  // One neighbour each way (in a ring of two the same one); in a ring of
  // one the block goes to the rank itself, which is not traffic.
  std::vector<WireBytes> w(static_cast<size_t>(P));
  const RingPeers peers = ring_peers(P, r, ring);
  if (peers.to == r) return w;
  w[peers.to].sent += send_count * dtype_bytes(dtype);
  w[peers.from].received += recv_count * dtype_bytes(dtype);
  return w;
}

WireBytes all_to_all_wire_bytes(const std::int64_t* send_counts, const std::int64_t* recv_counts,
                                int P, int r, DType dtype) {
  return sum_of(all_to_all_peer_bytes(send_counts, recv_counts, P, r, dtype));
}

WireBytes all_gather_wire_bytes(std::int64_t send_count, const std::int64_t* recv_counts, int P,
                                int r, DType dtype) {
  return sum_of(all_gather_peer_bytes(send_count, recv_counts, P, r, dtype));
}

WireBytes reduce_scatter_wire_bytes(const std::int64_t* counts, int P, int r, DType dtype) {
  return sum_of(reduce_scatter_peer_bytes(counts, P, r, dtype));
}

WireBytes all_reduce_wire_bytes(std::int64_t n, int P, int r, DType dtype) {
  return sum_of(all_reduce_peer_bytes(n, P, r, dtype));
}

WireBytes ring_shift_wire_bytes(std::int64_t send_count, std::int64_t recv_count, int P,
                                DType dtype, int ring_size) {
  return sum_of(ring_shift_peer_bytes(send_count, recv_count, P, 0, dtype,
                                      {RingDirection::forward, ring_size}));
}

}  // namespace laga
