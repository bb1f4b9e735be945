// The in-process backend's failure modes, each ending promptly with a
// useful error: a timeout, a failed or departed rank, mismatched collectives
// and counts, a failed communicator called again; the caller mistakes every
// backend refuses with the same words (comm_cases.hpp's bad_calls); and
// transport faults the measured ledger catches. Part of test_comm_local
// (test_comm_local.cpp).
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/dry_run_comm.hpp"
#include "comm/local_comm.hpp"
#include "comm_cases.hpp"
#include "core/error.hpp"
#include "local_ranks.hpp"

namespace laga {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::errors_of;
using test::I64s;
using test::seconds_since;

TEST(LocalCommFailure, MissingRankTimesOutNamingLabelAndRank) {
  const int P = 4;
  std::vector<double> elapsed(P);
  const auto t0 = Clock::now();
  auto errors = errors_of(P, 200ms, [&](Communicator& c) {
    if (c.rank() == 3) {  // never calls it
      std::this_thread::sleep_for(1000ms);
      return;
    }
    std::vector<float> shard(2, 1.0f), all(2 * P);
    I64s counts(P, 2), displs{0, 2, 4, 6};
    try {
      c.all_gather_v(shard.data(), 2, all.data(), counts.data(), displs.data(), "latent_ag");
    } catch (...) {
      elapsed[c.rank()] = seconds_since(t0);
      throw;
    }
  });
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(errors[r]);
    EXPECT_NE(errors[r].find("all_gather 'latent_ag'"), std::string::npos);
    EXPECT_NE(errors[r].find("rank(s) 3"), std::string::npos);
    EXPECT_NE(errors[r].find("timed out after 200 ms"), std::string::npos);
    EXPECT_LT(elapsed[r], 0.9) << "peers must not wait for rank 3 to wake";
  }
  EXPECT_EQ(errors[3], "");
}

TEST(LocalCommFailure, RunLocalRanksRethrowsTheFirstFailureWithItsRank) {
  LocalRunOptions opts;
  opts.timeout = 150ms;
  const auto t0 = Clock::now();
  try {
    run_local_ranks(
        4,
        [](Communicator& c) {
          if (c.rank() == 3) {
            std::this_thread::sleep_for(500ms);
            return;
          }
          c.barrier("sync");
        },
        opts);
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("rank ", 0), 0u) << m;
    EXPECT_NE(m.find("barrier 'sync'"), std::string::npos) << m;
    EXPECT_NE(m.find("timed out after 150 ms waiting for rank(s) 3"), std::string::npos) << m;
    EXPECT_NE(m.find("--comm-timeout"), std::string::npos) << m;
  }
  EXPECT_LT(seconds_since(t0), 2.0);
}

TEST(LocalCommFailure, ThrowingRankStopsPeersAtOnce) {
  const int P = 4;
  LocalRunOptions opts;
  opts.timeout = 20s;  // far longer than the test may take
  const auto t0 = Clock::now();
  std::vector<std::string> errors(P);
  try {
    run_local_ranks(
        P,
        [&](Communicator& c) {
          if (c.rank() == 2) throw Error("boom in rank 2");
          double v = 1;
          try {
            c.all_reduce(&v, 1, "grad_ar");
          } catch (const Error& e) {
            errors[c.rank()] = e.what();
            throw;
          }
        },
        opts);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank 2 of 4: boom in rank 2");
  }
  EXPECT_LT(seconds_since(t0), 2.0);
  for (int r : {0, 1, 3}) {
    SCOPED_TRACE(errors[r]);
    EXPECT_NE(errors[r].find("all_reduce 'grad_ar'"), std::string::npos);
    EXPECT_NE(errors[r].find("rank 2 failed before reaching it (boom in rank 2)"),
              std::string::npos);
  }
}

TEST(LocalCommFailure, RankThatReturnedEarlyIsNamed) {
  const auto t0 = Clock::now();
  auto errors = errors_of(3, 20s, [](Communicator& c) {
    if (c.rank() == 1) return;
    c.barrier("sync");
  });
  EXPECT_LT(seconds_since(t0), 2.0);
  for (int r : {0, 2}) {
    SCOPED_TRACE(errors[r]);
    EXPECT_NE(errors[r].find("barrier 'sync'"), std::string::npos);
    EXPECT_NE(errors[r].find("rank(s) 1 returned without calling it"), std::string::npos);
  }
}

TEST(LocalCommFailure, MismatchedLabelOrKindIsNamedOnEveryRank) {
  const int P = 3;
  auto errors = errors_of(P, 20s, [](Communicator& c) { c.barrier(c.rank() == 1 ? "b" : "a"); });
  for (int r = 0; r < P; ++r) {
    SCOPED_TRACE(errors[r]);
    EXPECT_NE(errors[r].find("collective mismatch"), std::string::npos);
    EXPECT_NE(errors[r].find("rank 1 called barrier 'b'"), std::string::npos);
  }

  errors = errors_of(P, 20s, [](Communicator& c) {
    double v = 1;
    if (c.rank() == 0)
      c.barrier("step");
    else
      c.all_reduce(&v, 1, "step");
  });
  for (int r = 0; r < P; ++r) {
    SCOPED_TRACE(errors[r]);
    EXPECT_NE(errors[r].find("rank 0 called barrier 'step'"), std::string::npos);
    EXPECT_NE(errors[r].find("rank 2 called all_reduce 'step'"), std::string::npos);
  }

  errors = errors_of(P, 20s, [](Communicator& c) {
    if (c.rank() == 2) {
      double v = 1;
      c.all_reduce(&v, 1, "grad");
    } else {
      float v = 1;
      c.all_reduce(&v, 1, "grad");
    }
  });
  for (int r = 0; r < P; ++r) EXPECT_NE(errors[r].find("(f64"), std::string::npos) << errors[r];
}

TEST(LocalCommFailure, InconsistentCountsAreNamed) {
  const int P = 3;
  auto errors = errors_of(P, 20s, [](Communicator& c) {
    std::vector<float> shard(4, 1.0f), all(12);
    // Rank 1 is consistent with itself (it contributes 3 and expects 3 from
    // itself) but not with its peers, which expect 4 from it.
    I64s counts{4, c.rank() == 1 ? 3 : 4, 4}, displs{0, 4, 8};
    const std::int64_t n = c.rank() == 1 ? 3 : 4;
    c.all_gather_v(shard.data(), n, all.data(), counts.data(), displs.data(), "latent_ag");
  });
  for (int r = 0; r < P; ++r) {
    SCOPED_TRACE(errors[r]);
    EXPECT_NE(errors[r].find("all_gather 'latent_ag'"), std::string::npos);
    EXPECT_NE(errors[r].find("expects 4 elements from rank 1 but rank 1 sends it 3"),
              std::string::npos);
  }

  errors = errors_of(P, 20s, [](Communicator& c) {
    std::vector<double> buf(4, 1.0);
    c.all_reduce(buf.data(), c.rank() == 2 ? 3 : 4, "grad");
  });
  for (int r = 0; r < P; ++r)
    EXPECT_NE(errors[r].find("from rank 2 but rank 2 sends it"), std::string::npos) << errors[r];

  errors = errors_of(P, 20s, [](Communicator& c) {
    std::vector<float> buf(4, 1.0f);
    c.all_reduce(c.rank() == 0 ? nullptr : buf.data(), 4, "grad");
  });
  for (int r = 0; r < P; ++r)
    EXPECT_NE(errors[r].find("count-only must be on for all ranks"), std::string::npos)
        << errors[r];
}

TEST(LocalCommFailure, FailedCommunicatorRefusesLaterCalls) {
  auto errors = errors_of(2, 20s, [](Communicator& c) {
    try {
      c.barrier(c.rank() == 0 ? "a" : "b");
    } catch (const Error&) {
    }
    c.barrier("after");
  });
  for (const auto& e : errors) EXPECT_NE(e.find("already failed"), std::string::npos) << e;
}

TEST(BadCalls, EveryBackendRefusesTheSameMistakeWithTheSameWords) {
  // The in-process backend at P = 3, each rank of 3 run alone as a dry run,
  // and the self communicator; test_comm_mpi runs the same list under mpirun.
  const int P = 3;
  for (const test::BadCall& bad : test::bad_calls()) {
    SCOPED_TRACE(bad.name);
    std::vector<std::string> local(P);
    run_local_ranks(P, [&](Communicator& c) { local[c.rank()] = test::error_of(bad.call, c); });
    for (int r = 0; r < P; ++r) {
      EXPECT_EQ(local[r], bad.expected(P, r)) << "local, rank " << r;
      DryRunCommunicator dry(r, P);
      EXPECT_EQ(test::error_of(bad.call, dry), bad.expected(P, r)) << "dry-run, rank " << r;
    }
    if (bad.min_ranks <= 1) {
      auto self = make_self_communicator();
      EXPECT_EQ(test::error_of(bad.call, *self), bad.expected(1, 0)) << "self";
    }
  }
}

TEST(BadCalls, NothingIsRecordedForARefusedCall) {
  DryRunCommunicator dry(0, 2);
  EXPECT_NE(test::error_of(test::bad_calls()[0].call, dry), "");
  EXPECT_TRUE(dry.ledger().entries().empty());
}

// Rank 1 of 3 misbehaves in one all_to_all_v of 2 floats per peer (8 bytes):
// the bytes its transport copies differ from what the counts say, and the
// ledger check stops it and the peer it short-changed.
TEST(LocalComm, TransportFaultsAreCaughtByTheMeasuredLedger) {
  const int P = 3;
  const std::vector<test::TransportFaultCase> cases{
      // One float fewer from rank 0.
      {TransportFault::short_send, test::mismatch_head(P, 1, 16, 16, 16, 12),
       test::mismatch_head(P, 0, 16, 16, 12, 16)},
      // Rank 0's block read from rank 1's own memory: the totals agree, the
      // peers do not.
      {TransportFault::wrong_peer,
       test::mismatch_head(P, 1, 16, 16, 16, 16) +
           " (per peer, derived/measured: rank 0: sent 8/8, received 8/0; rank 1: sent 0/0, "
           "received 0/8)",
       test::mismatch_head(P, 0, 16, 16, 8, 16)},
      // Nothing from rank 0.
      {TransportFault::skip_peer, test::mismatch_head(P, 1, 16, 16, 16, 8),
       test::mismatch_head(P, 0, 16, 16, 8, 16)},
  };
  test::expect_transport_faults_caught(cases,
                                       [](Communicator& c, TransportFault fault, bool inject) {
                                         return test::faulty_all_to_all(c, fault, inject);
                                       });
}

}  // namespace
}  // namespace laga
