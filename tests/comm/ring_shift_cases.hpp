// The ring_shift cases both comm backends run (comm_cases.hpp's inputs and
// ledger check): blocks of uneven sizes passed to the ring neighbour each
// way, blocking and started, a whole ring pass as a ring attention runs it,
// rings of a size and stride (Ring), and the ledger each must leave.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.hpp"
#include "comm_cases.hpp"
#include "common/error_of.hpp"
#include "core/error.hpp"

namespace laga::test {

// ring_shift: rank r's block has ring_count(P, r) elements (a zero among
// them; the last rank's long enough to span pieces of a split message).
inline std::int64_t ring_count(int P, int r) {
  return (3 * r + 2) % 5 + (r == P - 1 ? 1500 : 0);
}
// The element i of rank r's block in stream `stream`.
template <class T>
std::vector<T> ring_block(int stream, int P, int r) {
  std::vector<T> b(static_cast<size_t>(ring_count(P, r)));
  for (size_t i = 0; i < b.size(); ++i)
    b[i] = input_value<T>(stream, r, static_cast<std::int64_t>(i));
  return b;
}

template <class T>
struct RingResults {
  // One guard element each side of what arrived.
  std::vector<T> forward, backward, started;
  // The whole ring pass: what arrived at each of its P - 1 steps, in order.
  std::vector<std::vector<T>> pass;
  Ledger ledger;
};

// One ring_shift each way, one started and waited for, then a full forward
// ring pass of P - 1 steps double-buffered as a ring attention runs it.
template <class T>
RingResults<T> run_ring_shifts(Communicator& comm) {
  const int P = comm.size(), r = comm.rank();
  const RingPeers fwd = ring_peers(P, r, RingDirection::forward);
  const RingPeers bwd = ring_peers(P, r, RingDirection::backward);
  RingResults<T> out;
  comm.set_phase(Phase::forward);
  const std::vector<T> mine = ring_block<T>(20, P, r);
  const std::int64_t n = ring_count(P, r);
  auto guarded = [&](int from) {
    return std::vector<T>(static_cast<size_t>(ring_count(P, from) + 2), kUntouched<T>);
  };
  out.forward = guarded(fwd.from);
  comm.ring_shift(mine.data(), n, out.forward.data() + 1, ring_count(P, fwd.from), "kv_ring");
  out.started = guarded(fwd.from);
  PendingCollective p = comm.start_ring_shift(mine.data(), n, out.started.data() + 1,
                                              ring_count(P, fwd.from), "kv_ring");
  comm.wait(p);

  std::vector<T> held = mine, next;
  for (int s = 0; s + 1 < P; ++s) {
    // At step s this rank holds the block that started on rank r - s.
    const int origin = ((r - s - 1) % P + P) % P;
    next.assign(static_cast<size_t>(ring_count(P, origin)), kUntouched<T>);
    p = comm.start_ring_shift(held.data(), static_cast<std::int64_t>(held.size()), next.data(),
                              ring_count(P, origin), "kv_pass");
    comm.wait(p);
    out.pass.push_back(next);
    std::swap(held, next);
  }

  comm.set_phase(Phase::backward);
  const std::vector<T> grads = ring_block<T>(21, P, r);
  out.backward = guarded(bwd.from);
  comm.ring_shift(grads.data(), n, out.backward.data() + 1, ring_count(P, bwd.from), "dkv_home",
                  RingDirection::backward);
  out.ledger = comm.ledger();
  return out;
}

// Differences from what each neighbour holds, for rank r; empty when exact.
template <class T>
std::string check_ring_against_serial(const RingResults<T>& got, int P, int r) {
  std::string diffs;
  auto expect_block = [&](const std::vector<T>& v, std::int64_t guard, const std::vector<T>& want,
                          const std::string& what) {
    const std::int64_t n = static_cast<std::int64_t>(want.size());
    if (static_cast<std::int64_t>(v.size()) != n + 2 * guard) {
      diffs += cat(what, ": ", v.size(), " elements, expected ", n + 2 * guard, "\n");
      return;
    }
    if (guard && (std::memcmp(&v[0], &kUntouched<T>, sizeof(T)) != 0 ||
                  std::memcmp(&v[n + 1], &kUntouched<T>, sizeof(T)) != 0))
      diffs += cat(what, ": a guard element was written\n");
    for (std::int64_t i = 0; i < n && diffs.size() < 2000; ++i)
      if (std::memcmp(&v[guard + i], &want[i], sizeof(T)) != 0)
        diffs += cat(what, "[", i, "] = ", v[guard + i], " but the sender holds ", want[i], "\n");
  };
  const int left = (r - 1 + P) % P, right = (r + 1) % P;
  expect_block(got.forward, 1, ring_block<T>(20, P, left), "ring_shift forward");
  expect_block(got.started, 1, ring_block<T>(20, P, left), "start_ring_shift forward");
  expect_block(got.backward, 1, ring_block<T>(21, P, right), "ring_shift backward");
  if (static_cast<int>(got.pass.size()) != P - 1)
    diffs += cat("ring pass: ", got.pass.size(), " steps, expected ", P - 1, "\n");
  for (int s = 0; s < static_cast<int>(got.pass.size()); ++s) {
    const int origin = ((r - s - 1) % P + P) % P;
    expect_block(got.pass[s], 0, ring_block<T>(20, P, origin), cat("ring pass step ", s));
  }
  return diffs;
}

// The ledger rank r must hold after run_ring_shifts, from the rule in
// communicator.hpp (send_count e to one neighbour, recv_count e from the
// other; nothing at P = 1) written out here.
inline std::map<std::pair<Phase, std::string>, LedgerEntry> expected_ring_ledger(
    int P, int r, std::int64_t elem) {
  std::map<std::pair<Phase, std::string>, LedgerEntry> m;
  auto add = [&](Phase ph, const std::string& label, std::int64_t sent, std::int64_t recv) {
    LedgerEntry& e = m[{ph, label}];
    e.calls += 1;
    if (P == 1) return;
    e.bytes_sent += sent * elem;
    e.bytes_received += recv * elem;
  };
  const int left = (r - 1 + P) % P, right = (r + 1) % P;
  add(Phase::forward, "kv_ring", ring_count(P, r), ring_count(P, left));
  add(Phase::forward, "kv_ring", ring_count(P, r), ring_count(P, left));
  for (int s = 0; s + 1 < P; ++s)
    add(Phase::forward, "kv_pass", ring_count(P, ((r - s) % P + P) % P),
        ring_count(P, ((r - s - 1) % P + P) % P));
  add(Phase::backward, "dkv_home", ring_count(P, r), ring_count(P, right));
  return m;
}

inline std::string check_ring_ledger(const Ledger& got, int P, int r, std::int64_t elem) {
  return check_ledger_against(got, expected_ring_ledger(P, r, elem));
}

// Rings of `size` ranks `stride` apart (Ring): a forward pass of size - 1
// started shifts, each arrival checked against the block of the ring member
// it started on, then one blocking shift backward, checked likewise, and
// the ledger of both (nothing in rings of one). The differences, empty when
// exact.
template <class T>
std::string check_rings_of(Communicator& comm, int size, int stride = 1) {
  const int P = comm.size(), r = comm.rank(), block = size * stride;
  const int base = r - r % block + r % stride, place = (r % block) / stride;
  auto member = [&](int k) { return base + ((k % size + size) % size) * stride; };
  const Ring fwd{RingDirection::forward, size, stride}, bwd{RingDirection::backward, size, stride};
  std::string diffs;
  std::vector<T> held = ring_block<T>(30, P, r), next;
  std::int64_t sent = 0, received = 0;
  for (int s = 0; s + 1 < size; ++s) {
    const int origin = member(place - s - 1);
    next.assign(static_cast<size_t>(ring_count(P, origin)), kUntouched<T>);
    PendingCollective p =
        comm.start_ring_shift(held.data(), static_cast<std::int64_t>(held.size()), next.data(),
                              ring_count(P, origin), "rings_pass", fwd);
    comm.wait(p);
    if (next != ring_block<T>(30, P, origin))
      diffs += cat("step ", s, " on rank ", r, ": not rank ", origin, "'s block\n");
    sent += static_cast<std::int64_t>(held.size()), received += ring_count(P, origin);
    std::swap(held, next);
  }
  const int from = member(place + 1);
  std::vector<T> back(static_cast<size_t>(ring_count(P, from)), kUntouched<T>);
  const std::vector<T> mine = ring_block<T>(31, P, r);
  comm.ring_shift(mine.data(), ring_count(P, r), back.data(), ring_count(P, from), "rings_home",
                  bwd);
  if (back != ring_block<T>(31, P, from))
    diffs += cat("backward on rank ", r, ": not rank ", from, "'s block\n");
  const std::int64_t e = sizeof(T);
  std::map<std::pair<Phase, std::string>, LedgerEntry> want;
  LedgerEntry& pass = want[{comm.phase(), "rings_pass"}];
  pass.calls = size - 1, pass.bytes_sent = sent * e, pass.bytes_received = received * e;
  LedgerEntry& home = want[{comm.phase(), "rings_home"}];
  home.calls = 1;
  if (size > 1)
    home.bytes_sent = ring_count(P, r) * e, home.bytes_received = ring_count(P, from) * e;
  if (size == 1) want.erase({comm.phase(), "rings_pass"});
  return diffs + check_ledger_against(comm.ledger(), want);
}

template <class T>
std::string compare_ring_bitwise(const RingResults<T>& a, const RingResults<T>& b) {
  std::string diffs;
  if (!same_bits(a.forward, b.forward)) diffs += "ring_shift forward differs\n";
  if (!same_bits(a.started, b.started)) diffs += "start_ring_shift differs\n";
  if (!same_bits(a.backward, b.backward)) diffs += "ring_shift backward differs\n";
  if (a.pass.size() != b.pass.size()) diffs += "ring pass lengths differ\n";
  for (size_t s = 0; s < std::min(a.pass.size(), b.pass.size()); ++s)
    if (!same_bits(a.pass[s], b.pass[s])) diffs += cat("ring pass step ", s, " differs\n");
  return diffs;
}

// A ring_shift of 2 floats forward, for the transport fault tests: the error
// text, or "".
inline std::string faulty_ring_shift(Communicator& comm, TransportFault fault, bool inject) {
  std::vector<float> send(2, 1.0f), recv(2);
  if (inject) comm.inject_fault_for_testing(fault);
  return error_of([&] { comm.ring_shift(send.data(), 2, recv.data(), 2, "ring"); });
}

// The start of the ledger check's message for faulty_ring_shift's call.
inline std::string ring_mismatch_head(int P, int r, std::int64_t derived_sent,
                                      std::int64_t derived_received, std::int64_t measured_sent,
                                      std::int64_t measured_received) {
  return transport_mismatch_head("ring_shift 'ring'", P, r, derived_sent, derived_received,
                                 measured_sent, measured_received);
}

}  // namespace laga::test
