// One fixed sequence of collectives with uneven, gapped layouts, its serial
// reference, and the ledger it must produce — shared by the in-process and
// MPI tests so both backends are checked against the same answers. With it,
// what else both run: the caller mistakes every backend refuses alike
// (bad_calls), the transport-fault and link-model checks, the reductions
// under the reduction-order switch and the bf16 sequence. The ring_shift
// cases, on these inputs and ledger check, are ring_shift_cases.hpp.
//
// Inputs are Philox normals scaled by powers of two from 2^-10 to 2^10, so a
// sum's rounding depends on the order of its terms: a reduction that does not
// add in rank order 0..P-1 fails the bit-exact comparisons.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/link_model.hpp"
#include "common/error_of.hpp"
#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"

namespace laga::test {

// What no collective may write: the gaps between blocks keep it.
template <class T>
constexpr T kUntouched = T(-7777);

template <class T>
T input_value(int stream, int rank, std::int64_t i) {
  const double scale = std::ldexp(1.0, static_cast<int>((i * 7 + rank * 3) % 21) - 10);
  return static_cast<T>(rng_normal(1234, static_cast<std::uint64_t>(stream * 64 + rank),
                                   static_cast<std::uint64_t>(i)) *
                        scale);
}

using I64s = std::vector<std::int64_t>;

// all_to_all_v: rank r sends a2a_count(P, r, j) elements to rank j (zeros
// included). Send blocks are packed with a 1-element gap, receive blocks in
// reverse peer order with a 2-element gap.
inline std::int64_t a2a_count(int P, int from, int to) {
  return (3 * from + 5 * to + P) % 7;
}
// all_gather_v: rank r contributes ag_count(r) elements; received in reverse
// rank order with gaps.
inline std::int64_t ag_count(int r) {
  return (2 * r + 3) % 5;
}
// reduce_scatter_v: block j has rs_count(P, j) elements; the last one is long
// enough to span several accumulator blocks.
inline std::int64_t rs_count(int P, int j) {
  return (3 * j + 2) % 5 + (j == P - 1 ? 2500 : 0);
}
inline const std::vector<std::int64_t>& ar_sizes() {
  static const std::vector<std::int64_t> sizes{0, 1, 5, 13, 3001};
  return sizes;
}

struct Layout {
  I64s counts, displs;
  std::int64_t total = 0;  // elements including gaps
};
inline Layout packed(const I64s& counts, int gap, bool reverse) {
  Layout l{counts, I64s(counts.size()), 0};
  const int P = static_cast<int>(counts.size());
  for (int k = 0; k < P; ++k) {
    const int j = reverse ? P - 1 - k : k;
    l.displs[j] = l.total;
    l.total += counts[j] + gap;
  }
  return l;
}

inline Layout a2a_send_layout(int P, int r) {
  I64s c(P);
  for (int j = 0; j < P; ++j) c[j] = a2a_count(P, r, j);
  return packed(c, 1, false);
}
inline Layout a2a_recv_layout(int P, int r) {
  I64s c(P);
  for (int j = 0; j < P; ++j) c[j] = a2a_count(P, j, r);
  return packed(c, 2, true);
}
inline Layout ag_layout(int P) {
  I64s c(P);
  for (int j = 0; j < P; ++j) c[j] = ag_count(j);
  return packed(c, 2, true);
}
inline Layout rs_layout(int P) {
  I64s c(P);
  for (int j = 0; j < P; ++j) c[j] = rs_count(P, j);
  return packed(c, 1, false);
}

// Whether x and y hold the same bits: unlike ==, -0 differs from +0 and a
// NaN equals the same NaN.
template <class T>
bool same_bits(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() &&
         (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0);
}

template <class T>
struct Results {
  std::vector<T> a2a, ag, ag_inplace, rs, rs_inplace;
  std::vector<std::vector<T>> ar;
  Ledger ledger;
};

// Runs the sequence on one rank.
template <class T>
Results<T> run_sequence(Communicator& comm) {
  const int P = comm.size(), r = comm.rank();
  Results<T> out;

  comm.set_phase(Phase::forward);
  {
    const Layout s = a2a_send_layout(P, r), d = a2a_recv_layout(P, r);
    std::vector<T> send(s.total, kUntouched<T>);
    for (int j = 0; j < P; ++j)
      for (std::int64_t i = 0; i < s.counts[j]; ++i)
        send[s.displs[j] + i] = input_value<T>(1, r, j * 100 + i);
    out.a2a.assign(d.total, kUntouched<T>);
    comm.all_to_all_v(send.data(), s.counts.data(), s.displs.data(), out.a2a.data(),
                      d.counts.data(), d.displs.data(), "q_a2a");
  }
  {
    const Layout g = ag_layout(P);
    std::vector<T> shard(ag_count(r));
    for (std::int64_t i = 0; i < ag_count(r); ++i) shard[i] = input_value<T>(2, r, i);
    out.ag.assign(g.total, kUntouched<T>);
    comm.all_gather_v(shard.data(), ag_count(r), out.ag.data(), g.counts.data(), g.displs.data(),
                      "latent_ag");
    // In place: the own shard already sits at its place in recv.
    out.ag_inplace.assign(g.total, kUntouched<T>);
    std::copy(shard.begin(), shard.end(), out.ag_inplace.begin() + g.displs[r]);
    comm.all_gather_v(out.ag_inplace.data() + g.displs[r], ag_count(r), out.ag_inplace.data(),
                      g.counts.data(), g.displs.data(), "latent_ag");
  }

  comm.set_phase(Phase::backward);
  {
    const Layout l = rs_layout(P);
    std::vector<T> send(l.total, kUntouched<T>);
    for (int j = 0; j < P; ++j)
      for (std::int64_t i = 0; i < l.counts[j]; ++i)
        send[l.displs[j] + i] = input_value<T>(3, r, l.displs[j] + i);
    out.rs.assign(l.counts[r] + 2, kUntouched<T>);  // 1 guard element each side
    comm.reduce_scatter_v(send.data(), l.counts.data(), l.displs.data(), out.rs.data() + 1,
                          "latent_rs");
    // Into the own block of send.
    comm.reduce_scatter_v(send.data(), l.counts.data(), l.displs.data(), send.data() + l.displs[r],
                          "latent_rs");
    out.rs_inplace = send;
  }

  comm.set_phase(Phase::grad_sync);
  for (size_t k = 0; k < ar_sizes().size(); ++k) {
    const std::int64_t n = ar_sizes()[k];
    std::vector<T> buf(n);
    for (std::int64_t i = 0; i < n; ++i) buf[i] = input_value<T>(10 + static_cast<int>(k), r, i);
    comm.all_reduce(buf.data(), n, "grad_ar_" + std::to_string(n));
    out.ar.push_back(std::move(buf));
  }
  comm.barrier("step_end");
  out.ledger = comm.ledger();
  return out;
}

// Differences from the serial computation for rank r; empty when exact.
template <class T>
std::string check_against_serial(const Results<T>& got, int P, int r) {
  std::string diffs;
  auto expect = [&](const std::vector<T>& v, std::int64_t i, T want, const char* what) {
    if (i >= static_cast<std::int64_t>(v.size())) {
      diffs += cat(what, ": index ", i, " out of range\n");
    } else if (std::memcmp(&v[i], &want, sizeof(T)) != 0 && diffs.size() < 2000) {
      diffs += cat(what, "[", i, "] = ", v[i], " but serial gives ", want, "\n");
    }
  };
  {
    const Layout d = a2a_recv_layout(P, r);
    std::vector<T> want(d.total, kUntouched<T>);
    for (int j = 0; j < P; ++j) {
      for (std::int64_t i = 0; i < d.counts[j]; ++i)
        want[d.displs[j] + i] = input_value<T>(1, j, r * 100 + i);
    }
    if (got.a2a.size() != want.size()) diffs += "a2a: wrong size\n";
    for (size_t i = 0; i < want.size(); ++i) expect(got.a2a, i, want[i], "all_to_all_v");
  }
  {
    const Layout g = ag_layout(P);
    std::vector<T> want(g.total, kUntouched<T>);
    for (int j = 0; j < P; ++j)
      for (std::int64_t i = 0; i < ag_count(j); ++i)
        want[g.displs[j] + i] = input_value<T>(2, j, i);
    for (size_t i = 0; i < want.size(); ++i) {
      expect(got.ag, i, want[i], "all_gather_v");
      expect(got.ag_inplace, i, want[i], "all_gather_v in place");
    }
  }
  {
    const Layout l = rs_layout(P);
    auto summed = [&](std::int64_t i) {
      T acc = input_value<T>(3, 0, l.displs[r] + i);
      for (int j = 1; j < P; ++j) acc += input_value<T>(3, j, l.displs[r] + i);
      return acc;
    };
    expect(got.rs, 0, kUntouched<T>, "reduce_scatter_v guard");
    expect(got.rs, l.counts[r] + 1, kUntouched<T>, "reduce_scatter_v guard");
    for (std::int64_t i = 0; i < l.counts[r]; ++i)
      expect(got.rs, i + 1, summed(i), "reduce_scatter_v");
    // In place: the own block holds the sum, the rest of send is untouched.
    for (int j = 0; j < P; ++j) {
      for (std::int64_t i = 0; i < l.counts[j]; ++i) {
        const T want = j == r ? summed(i) : input_value<T>(3, r, l.displs[j] + i);
        expect(got.rs_inplace, l.displs[j] + i, want, "reduce_scatter_v into own block");
      }
    }
  }
  for (size_t k = 0; k < ar_sizes().size(); ++k) {
    const std::int64_t n = ar_sizes()[k];
    if (got.ar.size() <= k || static_cast<std::int64_t>(got.ar[k].size()) != n) {
      diffs += "all_reduce: wrong size\n";
      continue;
    }
    for (std::int64_t i = 0; i < n; ++i) {
      T acc = input_value<T>(10 + static_cast<int>(k), 0, i);
      for (int j = 1; j < P; ++j) acc += input_value<T>(10 + static_cast<int>(k), j, i);
      expect(got.ar[k], i, acc, "all_reduce");
    }
  }
  return diffs;
}

// The ledger rank r must hold after run_sequence, written out from the rules
// in communicator.hpp rather than through the *_wire_bytes helpers.
inline std::map<std::pair<Phase, std::string>, LedgerEntry> expected_ledger(int P, int r,
                                                                            std::int64_t elem) {
  std::map<std::pair<Phase, std::string>, LedgerEntry> m;
  auto add = [&](Phase ph, const std::string& label, std::int64_t sent, std::int64_t recv) {
    LedgerEntry& e = m[{ph, label}];
    e.calls += 1;
    e.bytes_sent += sent * elem;
    e.bytes_received += recv * elem;
  };
  std::int64_t s = 0, v = 0;
  for (int j = 0; j < P; ++j)
    if (j != r) s += a2a_count(P, r, j), v += a2a_count(P, j, r);
  add(Phase::forward, "q_a2a", s, v);
  v = 0;
  for (int j = 0; j < P; ++j)
    if (j != r) v += ag_count(j);
  add(Phase::forward, "latent_ag", (P - 1) * ag_count(r), v);
  add(Phase::forward, "latent_ag", (P - 1) * ag_count(r), v);
  s = 0;
  for (int j = 0; j < P; ++j)
    if (j != r) s += rs_count(P, j);
  add(Phase::backward, "latent_rs", s, (P - 1) * rs_count(P, r));
  add(Phase::backward, "latent_rs", s, (P - 1) * rs_count(P, r));
  for (std::int64_t n : ar_sizes()) {
    const std::int64_t chunk = n / P + (r < n % P ? 1 : 0);
    const std::int64_t wire = (n - chunk) + (P - 1) * chunk;
    add(Phase::grad_sync, "grad_ar_" + std::to_string(n), wire, wire);
  }
  add(Phase::grad_sync, "step_end", 0, 0);
  return m;
}

// "" when the ledger holds exactly `want`: calls and derived bytes, and the
// bytes the transport measured equal to the derived ones; else what differs.
inline std::string check_ledger_against(
    const Ledger& got, const std::map<std::pair<Phase, std::string>, LedgerEntry>& want) {
  std::string diffs;
  if (got.entries().size() != want.size())
    diffs += cat("ledger has ", got.entries().size(), " entries, expected ", want.size(), "\n");
  for (const auto& [key, w] : want) {
    auto it = got.entries().find(key);
    if (it == got.entries().end()) {
      diffs += cat("ledger lacks ", to_string(key.first), "/", key.second, "\n");
      continue;
    }
    const LedgerEntry& g = it->second;
    if (g.calls != w.calls || g.bytes_sent != w.bytes_sent || g.bytes_received != w.bytes_received)
      diffs += cat(to_string(key.first), "/", key.second, ": calls ", g.calls, " sent ",
                   g.bytes_sent, " received ", g.bytes_received, ", expected calls ", w.calls,
                   " sent ", w.bytes_sent, " received ", w.bytes_received, "\n");
    // What the transport measured must be the same bytes.
    if (g.measured_sent != w.bytes_sent || g.measured_received != w.bytes_received)
      diffs += cat(to_string(key.first), "/", key.second, ": measured sent ", g.measured_sent,
                   " received ", g.measured_received, ", expected sent ", w.bytes_sent,
                   " received ", w.bytes_received, "\n");
  }
  return diffs;
}

inline std::string check_ledger(const Ledger& got, int P, int r, std::int64_t elem) {
  return check_ledger_against(got, expected_ledger(P, r, elem));
}

// Bitwise comparison of two ranks' results (MPI against in-process).
template <class T>
std::string compare_bitwise(const Results<T>& a, const Results<T>& b) {
  std::string diffs;
  if (!same_bits(a.a2a, b.a2a)) diffs += "all_to_all_v differs\n";
  if (!same_bits(a.ag, b.ag)) diffs += "all_gather_v differs\n";
  if (!same_bits(a.ag_inplace, b.ag_inplace)) diffs += "all_gather_v in place differs\n";
  if (!same_bits(a.rs, b.rs)) diffs += "reduce_scatter_v differs\n";
  if (!same_bits(a.rs_inplace, b.rs_inplace)) diffs += "reduce_scatter_v into own block differs\n";
  if (a.ar.size() != b.ar.size()) diffs += "all_reduce count differs\n";
  for (size_t k = 0; k < std::min(a.ar.size(), b.ar.size()); ++k)
    if (!same_bits(a.ar[k], b.ar[k])) diffs += cat("all_reduce n=", ar_sizes()[k], " differs\n");
  if (a.ledger.entries().size() != b.ledger.entries().size()) diffs += "ledger sizes differ\n";
  for (const auto& [key, e] : a.ledger.entries()) {
    auto it = b.ledger.entries().find(key);
    if (it == b.ledger.entries().end() || it->second.calls != e.calls ||
        it->second.bytes_sent != e.bytes_sent || it->second.bytes_received != e.bytes_received)
      diffs += cat("ledger entry ", to_string(key.first), "/", key.second, " differs\n");
  }
  return diffs;
}

// Each collective of one kind on its own under `link` (set on the
// communicator by the caller), timed on this rank: "" when every call took
// at least its modelled time (collective_seconds of its ledger bytes), else
// what fell short. No upper bound: a loaded machine may always be slower.
inline std::string check_link_floor(Communicator& comm, const LinkModel& link) {
  const int P = comm.size(), r = comm.rank();
  using Clock = std::chrono::steady_clock;
  std::string diffs;
  auto timed = [&](CollectiveKind kind, const char* label, const std::function<void()>& call) {
    const Ledger before = comm.ledger();
    const auto t0 = Clock::now();
    call();
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    const LedgerEntry& e = comm.ledger().entries().at({comm.phase(), label});
    const LedgerEntry* b = before.entries().count({comm.phase(), label})
                               ? &before.entries().at({comm.phase(), label})
                               : nullptr;
    const WireBytes bytes{e.bytes_sent - (b ? b->bytes_sent : 0),
                          e.bytes_received - (b ? b->bytes_received : 0)};
    const double floor = collective_seconds(kind, P, bytes, single_level(link));
    if (took < floor)
      diffs += cat(label, " took ", took, " s, less than its modelled ", floor, " s\n");
  };
  const std::int64_t n = 20000;  // elements per peer
  std::vector<float> send(static_cast<size_t>(n * P), float(r)), recv(send.size());
  I64s counts(P, n), displs(P);
  for (int j = 0; j < P; ++j) displs[j] = j * n;
  timed(CollectiveKind::all_to_all, "link_a2a", [&] {
    comm.all_to_all_v(send.data(), counts.data(), displs.data(), recv.data(), counts.data(),
                      displs.data(), "link_a2a");
  });
  timed(CollectiveKind::all_gather, "link_ag", [&] {
    comm.all_gather_v(send.data(), n, recv.data(), counts.data(), displs.data(), "link_ag");
  });
  timed(CollectiveKind::reduce_scatter, "link_rs", [&] {
    comm.reduce_scatter_v(send.data(), counts.data(), displs.data(), recv.data(), "link_rs");
  });
  timed(CollectiveKind::all_reduce, "link_ar",
        [&] { comm.all_reduce(send.data(), n * P, "link_ar"); });
  timed(CollectiveKind::barrier, "link_barrier", [&] { comm.barrier("link_barrier"); });
  timed(CollectiveKind::ring_shift, "link_ring",
        [&] { comm.ring_shift(send.data(), n, recv.data(), n, "link_ring"); });
  timed(CollectiveKind::ring_shift, "link_ring_started", [&] {
    PendingCollective p = comm.start_ring_shift(send.data(), n, recv.data(), n, "link_ring_started",
                                                RingDirection::backward);
    comm.wait(p);
  });
  return diffs;
}

// One caller mistake each, made identically by every rank: every backend must
// refuse it before anything moves, with the same text. `expected(P, r)` is
// the whole message on rank r of P, written out here rather than taken from
// the library's formatting.
struct BadCall {
  std::string name;
  int min_ranks = 1;  // a mistake that needs peers to exist
  std::function<void(Communicator&)> call;
  std::function<std::string(int P, int r)> expected;
};

inline std::string where(const char* call, int P, int r) {
  return cat(call, " on rank ", r, " of ", P, ": ");
}

inline std::vector<BadCall> bad_calls() {
  std::vector<BadCall> v;
  // Unit counts and packed displacements for P ranks, `per` elements each.
  auto even = [](int P, std::int64_t per) {
    Layout l{I64s(P, per), I64s(P), per * P};
    for (int j = 0; j < P; ++j) l.displs[j] = per * j;
    return l;
  };
  v.push_back({"negative send count", 1,
               [=](Communicator& c) {
                 const int P = c.size(), r = c.rank();
                 Layout l = even(P, 1);
                 I64s sc = l.counts;
                 sc[(r + 1) % P] = -1;
                 std::vector<float> send(P), recv(P);
                 c.all_to_all_v(send.data(), sc.data(), l.displs.data(), recv.data(),
                                l.counts.data(), l.displs.data(), "bad_a2a");
               },
               [](int P, int r) {
                 return where("all_to_all 'bad_a2a'", P, r) +
                        cat("send_counts[", (r + 1) % P,
                            "] = -1 is negative; counts are element counts >= 0");
               }});
  v.push_back({"own block of different sizes", 1,
               [=](Communicator& c) {
                 const int P = c.size(), r = c.rank();
                 Layout s = even(P, 1), d = even(P, 2);
                 I64s rc = s.counts;
                 rc[r] = 2;
                 std::vector<float> send(P), recv(2 * P);
                 c.all_to_all_v(send.data(), s.counts.data(), s.displs.data(), recv.data(),
                                rc.data(), d.displs.data(), "bad_a2a");
               },
               [](int P, int r) {
                 return where("all_to_all 'bad_a2a'", P, r) +
                        cat("send_counts[", r, "] = 1 but recv_counts[", r,
                            "] = 2; the block a rank keeps must have the same size both ways");
               }});
  v.push_back({"negative send_count", 1,
               [=](Communicator& c) {
                 Layout l = even(c.size(), 1);
                 std::vector<double> send(1), recv(c.size());
                 c.all_gather_v(send.data(), -2, recv.data(), l.counts.data(), l.displs.data(),
                                "bad_ag");
               },
               [](int P, int r) {
                 return where("all_gather 'bad_ag'", P, r) +
                        "send_count = -2 is negative; counts are element counts >= 0";
               }});
  v.push_back({"own slot of another size", 1,
               [=](Communicator& c) {
                 Layout l = even(c.size(), 3);
                 std::vector<double> send(2), recv(l.total);
                 c.all_gather_v(send.data(), 2, recv.data(), l.counts.data(), l.displs.data(),
                                "bad_ag");
               },
               [](int P, int r) {
                 return where("all_gather 'bad_ag'", P, r) +
                        cat("send_count = 2 but recv_counts[", r,
                            "] = 3; a rank's own slot must hold exactly what it contributes");
               }});
  v.push_back({"negative reduce-scatter count", 1,
               [=](Communicator& c) {
                 const int P = c.size();
                 Layout l = even(P, 1);
                 l.counts[P - 1] = -3;
                 std::vector<float> send(P), recv(1);
                 c.reduce_scatter_v(send.data(), l.counts.data(), l.displs.data(), recv.data(),
                                    "bad_rs");
               },
               [](int P, int r) {
                 return where("reduce_scatter 'bad_rs'", P, r) +
                        cat("counts[", P - 1, "] = -3 is negative; counts are element counts >= 0");
               }});
  v.push_back({"negative n", 1,
               [=](Communicator& c) {
                 std::vector<double> buf(4);
                 c.all_reduce(buf.data(), -1, "bad_ar");
               },
               [](int P, int r) {
                 return where("all_reduce 'bad_ar'", P, r) +
                        "n = -1 is negative; counts are element counts >= 0";
               }});
  v.push_back({"gather in place at the wrong offset", 1,
               [=](Communicator& c) {
                 const int P = c.size(), r = c.rank();
                 Layout l = even(P, 2);
                 std::vector<float> recv(l.total + 1);
                 c.all_gather_v(recv.data() + l.displs[r] + 1, 2, recv.data(), l.counts.data(),
                                l.displs.data(), "bad_ag");
               },
               [](int P, int r) {
                 return where("all_gather 'bad_ag'", P, r) +
                        cat("send overlaps recv block ", r,
                            "; an all_gather_v is in place only as send == recv + "
                            "recv_displs[rank]");
               }});
  v.push_back({"reduce-scatter into send at the wrong offset", 1,
               [=](Communicator& c) {
                 const int P = c.size(), r = c.rank();
                 Layout l = even(P, 2);
                 std::vector<double> send(l.total + 1);
                 c.reduce_scatter_v(send.data(), l.counts.data(), l.displs.data(),
                                    send.data() + l.displs[r] + 1, "bad_rs");
               },
               [](int P, int r) {
                 return where("reduce_scatter 'bad_rs'", P, r) +
                        cat("recv overlaps send block ", r,
                            "; a reduce_scatter_v writes into send only as recv == send + "
                            "displs[rank]");
               }});
  v.push_back({"all-to-all in place", 1,
               [=](Communicator& c) {
                 Layout l = even(c.size(), 1);
                 std::vector<float> buf(l.total);
                 c.all_to_all_v(buf.data(), l.counts.data(), l.displs.data(), buf.data(),
                                l.counts.data(), l.displs.data(), "bad_a2a");
               },
               [](int P, int r) {
                 return where("all_to_all 'bad_a2a'", P, r) +
                        "send block 0 overlaps recv block 0; an all_to_all_v cannot run in place; "
                        "use separate send and recv buffers";
               }});
  v.push_back({"negative ring_shift recv_count", 1,
               [=](Communicator& c) {
                 std::vector<float> send(2), recv(2);
                 c.ring_shift(send.data(), 2, recv.data(), -1, "bad_ring");
               },
               [](int P, int r) {
                 return where("ring_shift 'bad_ring'", P, r) +
                        "recv_count = -1 is negative; counts are element counts >= 0";
               }});
  v.push_back({"ring_shift in place", 1,
               [=](Communicator& c) {
                 std::vector<double> buf(3);
                 c.ring_shift(buf.data(), 2, buf.data() + 1, 2, "bad_ring",
                              RingDirection::backward);
               },
               [](int P, int r) {
                 return where("ring_shift 'bad_ring'", P, r) +
                        "send overlaps recv; a ring_shift cannot run in place, since the block "
                        "arriving would overwrite the one leaving; use separate send and recv "
                        "buffers";
               }});
  v.push_back({"receive blocks overlapping", 2,
               [=](Communicator& c) {
                 const int P = c.size();
                 Layout l = even(P, 1);
                 const I64s zero(P, 0);
                 std::vector<float> send(1), recv(P);
                 c.all_gather_v(send.data(), 1, recv.data(), l.counts.data(), zero.data(),
                                "bad_ag");
               },
               [](int P, int r) {
                 return where("all_gather 'bad_ag'", P, r) +
                        "recv block 0 overlaps recv block 1; the receive regions of different "
                        "peers must not overlap";
               }});
  return v;
}

// The error text of `call` on comm, or "" when it did not throw.
inline std::string error_of(const std::function<void(Communicator&)>& call, Communicator& comm) {
  return error_of([&] { call(comm); });
}

// An all_to_all_v of `per` floats to and from every rank, for the transport
// fault tests: returns the error text, or "".
inline std::string faulty_all_to_all(Communicator& comm, TransportFault fault, bool inject,
                                     std::int64_t per = 2) {
  const int P = comm.size();
  I64s counts(P, per), displs(P);
  for (int j = 0; j < P; ++j) displs[j] = per * j;
  std::vector<float> send(per * P, 1.0f), recv(per * P);
  if (inject) comm.inject_fault_for_testing(fault);
  return error_of(
      [&](Communicator& c) {
        c.all_to_all_v(send.data(), counts.data(), displs.data(), recv.data(), counts.data(),
                       displs.data(), "a2a");
      },
      comm);
}

// What the ledger check says on the rank whose derived and measured bytes
// differ in `call` (as the message names it, kind and label): the start of
// its message.
inline std::string transport_mismatch_head(const std::string& call, int P, int r,
                                           std::int64_t derived_sent, std::int64_t derived_received,
                                           std::int64_t measured_sent,
                                           std::int64_t measured_received) {
  return cat(call, " on rank ", r, " of ", P,
             ": the transport moved other bytes than the call's counts give: derived ",
             derived_sent, " bytes sent and ", derived_received, " received, measured ",
             measured_sent, " sent and ", measured_received, " received");
}

// The start of that message for faulty_all_to_all's call.
inline std::string mismatch_head(int P, int r, std::int64_t derived_sent,
                                 std::int64_t derived_received, std::int64_t measured_sent,
                                 std::int64_t measured_received) {
  return transport_mismatch_head("all_to_all 'a2a'", P, r, derived_sent, derived_received,
                                 measured_sent, measured_received);
}

// The two reductions under the reduction-order switch
// (set_reduction_order_seed): an all_reduce of 3000 elements (three of the
// switch's 1024-element blocks, so each block draws its own order) and a
// reduce_scatter_v of rs_layout, on this rank; the all_reduce's result, then
// the own reduced block.
template <class T>
std::vector<T> run_reductions(Communicator& comm) {
  const int P = comm.size(), r = comm.rank();
  comm.set_phase(Phase::grad_sync);
  std::vector<T> buf(3000);
  for (std::int64_t i = 0; i < 3000; ++i) buf[size_t(i)] = input_value<T>(20, r, i);
  comm.all_reduce(buf.data(), std::int64_t(buf.size()), "grad_allreduce");
  const Layout l = rs_layout(P);
  std::vector<T> send(size_t(l.total));
  for (std::int64_t i = 0; i < l.total; ++i) send[size_t(i)] = input_value<T>(21, r, i);
  std::vector<T> own(size_t(l.counts[r]));
  comm.reduce_scatter_v(send.data(), l.counts.data(), l.displs.data(), own.data(), "latent_rs");
  buf.insert(buf.end(), own.begin(), own.end());
  return buf;
}

// bf16 (DType::bf16, the wire of --dtype bf16): an all_to_all_v, an
// all_gather_v, a reduce_scatter_v and an all_reduce of bf16 values, and
// what they must give. A reduction adds the bf16 contributions in fp32, in
// rank order, and rounds the sum once: element 0 of each reduction is 1 on
// rank 0 and 2^-8 on every other rank, whose fp32 sum 1 + (P - 1) 2^-8
// bf16 rounds to 1 + 2^-7 at P 3 and 4, where adding in bf16 a rank at a
// time would round every 1 + 2^-8 back to 1 (a tie, to even).
inline bf16 bf16_input(int stream, int rank, std::int64_t i) {
  if (i == 0 && stream >= 32) return to_bf16(rank == 0 ? 1.0f : 0x1p-8f);
  return to_bf16(input_value<float>(stream, rank, i));
}

struct Bf16Results {
  std::vector<bf16> a2a, ag, rs, ar;
  Ledger ledger;
};

inline Bf16Results run_bf16_sequence(Communicator& comm) {
  const int P = comm.size(), r = comm.rank();
  Bf16Results out;
  const Layout s = a2a_send_layout(P, r), d = a2a_recv_layout(P, r);
  std::vector<bf16> send(size_t(s.total), bf16{0});
  for (int j = 0; j < P; ++j)
    for (std::int64_t i = 0; i < s.counts[j]; ++i)
      send[size_t(s.displs[j] + i)] = bf16_input(30, r, j * 100 + i);
  out.a2a.assign(size_t(d.total), bf16{0});
  comm.all_to_all_v(send.data(), s.counts.data(), s.displs.data(), out.a2a.data(), d.counts.data(),
                    d.displs.data(), "q_a2a");
  const Layout g = ag_layout(P);
  std::vector<bf16> shard(size_t(ag_count(r)));
  for (std::int64_t i = 0; i < ag_count(r); ++i) shard[size_t(i)] = bf16_input(31, r, i);
  out.ag.assign(size_t(g.total), bf16{0});
  comm.all_gather_v(shard.data(), ag_count(r), out.ag.data(), g.counts.data(), g.displs.data(),
                    "latent_ag");
  const Layout l = rs_layout(P);
  std::vector<bf16> contrib(size_t(l.total), bf16{0});
  for (int j = 0; j < P; ++j)
    for (std::int64_t i = 0; i < l.counts[j]; ++i)
      contrib[size_t(l.displs[j] + i)] = bf16_input(32, r, i);
  out.rs.assign(size_t(l.counts[r]), bf16{0});
  comm.reduce_scatter_v(contrib.data(), l.counts.data(), l.displs.data(), out.rs.data(),
                        "latent_rs");
  out.ar.resize(3001);
  for (std::int64_t i = 0; i < 3001; ++i) out.ar[size_t(i)] = bf16_input(33, r, i);
  comm.all_reduce(out.ar.data(), 3001, "grad_allreduce");
  out.ledger = comm.ledger();
  return out;
}

// "" when rank r's results are the serial ones (bits), else what differs.
inline std::string check_bf16_against_serial(const Bf16Results& got, int P, int r) {
  const auto reduced = [P](int stream, std::int64_t i) {
    float sum = to_float(bf16_input(stream, 0, i));
    for (int j = 1; j < P; ++j) sum += to_float(bf16_input(stream, j, i));
    return to_bf16(sum);
  };
  const Layout d = a2a_recv_layout(P, r), g = ag_layout(P), l = rs_layout(P);
  for (int j = 0; j < P; ++j)
    for (std::int64_t i = 0; i < d.counts[j]; ++i)
      if (!(got.a2a[size_t(d.displs[j] + i)] == bf16_input(30, j, r * 100 + i)))
        return cat("all_to_all_v bf16: element ", i, " from rank ", j);
  for (int j = 0; j < P; ++j)
    for (std::int64_t i = 0; i < g.counts[j]; ++i)
      if (!(got.ag[size_t(g.displs[j] + i)] == bf16_input(31, j, i)))
        return cat("all_gather_v bf16: element ", i, " of rank ", j);
  for (std::int64_t i = 0; i < l.counts[r]; ++i)
    if (!(got.rs[size_t(i)] == reduced(32, i)))
      return cat("reduce_scatter_v bf16: element ", i, " is ", to_float(got.rs[size_t(i)]),
                 ", the fp32 sum rounded once is ", to_float(reduced(32, i)));
  for (std::int64_t i = 0; i < 3001; ++i)
    if (!(got.ar[size_t(i)] == reduced(33, i)))
      return cat("all_reduce bf16: element ", i, " is ", to_float(got.ar[size_t(i)]),
                 ", the fp32 sum rounded once is ", to_float(reduced(33, i)));
  // The ledger: 2 bytes an element.
  for (const auto& [key, e] : got.ledger.entries()) {
    WireBytes w;
    if (key.second == "q_a2a") {
      const Layout s = a2a_send_layout(P, r);
      w = all_to_all_wire_bytes(s.counts.data(), d.counts.data(), P, r, DType::bf16);
    } else if (key.second == "latent_ag") {
      w = all_gather_wire_bytes(ag_count(r), g.counts.data(), P, r, DType::bf16);
    } else if (key.second == "latent_rs") {
      w = reduce_scatter_wire_bytes(l.counts.data(), P, r, DType::bf16);
    } else {
      w = all_reduce_wire_bytes(3001, P, r, DType::bf16);
    }
    if (e.bytes_sent != w.sent || e.bytes_received != w.received)
      return cat("ledger ", key.second, ": ", e.bytes_sent, " sent, ", w.sent, " expected");
  }
  return "";
}

}  // namespace laga::test
