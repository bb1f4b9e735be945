// What test_comm_local's three files (test_comm_local.cpp,
// test_comm_local_failure.cpp, test_comm_local_ring.cpp) share: each
// rank's error from a group of in-process ranks, the transport-fault check
// run on them, and the words a deferred-delivery refusal starts with.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/local_comm.hpp"
#include "common/error_of.hpp"
#include "core/error.hpp"

namespace laga::test {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs body on P local ranks, collecting each rank's error message (or "").
inline std::vector<std::string> errors_of(int P, std::chrono::milliseconds timeout,
                                          const std::function<void(Communicator&)>& body) {
  std::vector<std::string> errors(P);
  LocalRunOptions opts;
  opts.timeout = timeout;
  run_local_ranks(
      P,
      [&](Communicator& c) {
        try {
          body(c);
        } catch (const Error& e) {
          errors[c.rank()] = e.what();
        }
      },
      opts);
  return errors;
}

// One transport fault injected on rank 1, and the start of the error rank 1
// (which misbehaved) and rank 0 (whose bytes it took wrongly) must give.
struct TransportFaultCase {
  TransportFault fault;
  std::string rank1, rank0;
};

// Runs `faulty_call` (faulty_all_to_all, faulty_ring_shift) on P = 3 local
// ranks once per case, the fault injected on rank 1 only: the measured
// ledger stops rank 1, naming the local backend, and rank 0; rank 2 moved
// what its counts say. Then the same call without a fault passes on every
// rank.
inline void expect_transport_faults_caught(
    const std::vector<TransportFaultCase>& cases,
    const std::function<std::string(Communicator&, TransportFault, bool inject)>& faulty_call) {
  const int P = 3;
  for (const TransportFaultCase& k : cases) {
    std::vector<std::string> errors(P);
    run_local_ranks(
        P, [&](Communicator& c) { errors[c.rank()] = faulty_call(c, k.fault, c.rank() == 1); });
    EXPECT_EQ(errors[1].rfind(k.rank1, 0), 0u) << errors[1];
    EXPECT_NE(errors[1].find("the local backend lost or misdirected data"), std::string::npos)
        << errors[1];
    EXPECT_EQ(errors[0].rfind(k.rank0, 0), 0u) << errors[0];
    EXPECT_EQ(errors[2], "") << "rank 2 moved what its counts say";
  }
  run_local_ranks(P, [&](Communicator& c) {
    EXPECT_EQ(faulty_call(c, TransportFault::short_send, false), "");
  });
}

// For checks made inside a rank's thread that collect what failed in one
// string: appends to `failures` unless fn throws an Error whose message
// contains `words`.
inline void note_unless_refused(std::string& failures, const std::string& what,
                                const std::function<void()>& fn, const std::string& words) {
  const std::string got = error_of(fn);
  if (got.find(words) == std::string::npos)
    failures += what + ": expected '" + words + "', got '" + got + "'; ";
}

// The words after the call's name in a deferred-delivery refusal on rank r
// of P, up to the buffer it names.
inline std::string deferred_where(int r, int P) {
  return cat(" on rank ", r, " of ", P, " (deferred delivery, a test mode): its ");
}

}  // namespace laga::test
