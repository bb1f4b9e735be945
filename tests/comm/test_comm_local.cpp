// The ledger, the self communicator and the in-process backend: results
// against serial computation for P in {1, 2, 3, 4, 8}, f32 and f64, ledgers
// against the closed form, the failure modes (timeout, a failed or departed
// rank, mismatched collectives) ending promptly with useful errors, and
// started collectives (the link model's overlap; deferred delivery).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>

#include "comm/communicator.hpp"
#include "comm/dry_run_comm.hpp"
#include "comm/link_model.hpp"
#include "comm/local_comm.hpp"
#include "comm_cases.hpp"
#include "common/error_of.hpp"
#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "core/tensor.hpp"
#include "ring_shift_cases.hpp"

namespace laga {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::I64s;
using test::Results;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Runs body on P local ranks, collecting each rank's error message (or "").
std::vector<std::string> errors_of(int P, std::chrono::milliseconds timeout,
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

TEST(Ledger, SumsPerPhaseAndOverall) {
  Ledger l;
  l.record(Phase::forward, "a", {10, 20}, {10, 20});
  l.record(Phase::forward, "a", {1, 2}, {3, 4});
  l.record(Phase::backward, "b", {100, 200}, {100, 200});
  l.record(Phase::grad_sync, "c", {1000, 2000}, {1000, 2000});
  EXPECT_EQ(l.entries().at({Phase::forward, "a"}).calls, 2);
  EXPECT_EQ(l.entries().at({Phase::forward, "a"}).bytes_sent, 11);
  // Derived and measured are kept apart.
  EXPECT_EQ(l.entries().at({Phase::forward, "a"}).measured_sent, 13);
  EXPECT_EQ(l.entries().at({Phase::forward, "a"}).measured_received, 24);
  EXPECT_EQ(l.bytes_sent(Phase::forward), 11);
  EXPECT_EQ(l.bytes_received(Phase::backward), 200);
  EXPECT_EQ(l.bytes_sent(), 1111);
  EXPECT_EQ(l.bytes_received(Phase::count), 2222);
  EXPECT_THROW(l.record(Phase::count, "x", {}, {}), Error);
  l.clear();
  EXPECT_EQ(l.bytes_sent(), 0);
}

TEST(Names, PhasesAndKinds) {
  EXPECT_STREQ(to_string(Phase::forward), "forward");
  EXPECT_STREQ(to_string(Phase::backward), "backward");
  EXPECT_STREQ(to_string(Phase::grad_sync), "grad_sync");
  EXPECT_STREQ(to_string(CollectiveKind::all_to_all), "all_to_all");
  EXPECT_STREQ(to_string(CollectiveKind::all_gather), "all_gather");
  EXPECT_STREQ(to_string(CollectiveKind::reduce_scatter), "reduce_scatter");
  EXPECT_STREQ(to_string(CollectiveKind::all_reduce), "all_reduce");
  EXPECT_STREQ(to_string(CollectiveKind::barrier), "barrier");
  EXPECT_STREQ(to_string(CollectiveKind::ring_shift), "ring_shift");
  EXPECT_STREQ(to_string(RingDirection::forward), "forward");
  EXPECT_STREQ(to_string(RingDirection::backward), "backward");
  for (Backend b : {Backend::local, Backend::mpi, Backend::dry_run, Backend::self, Backend::nccl})
    EXPECT_EQ(parse_backend(to_string(b)), b);
  EXPECT_STREQ(to_string(Backend::dry_run), "dry-run");
  try {
    parse_backend("gloo");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'gloo'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("local, mpi, dry-run, self and nccl"), std::string::npos)
        << e.what();
  }
}

TEST(AllReduceChunk, NearEqualFirstOnesLonger) {
  for (int P : {1, 2, 3, 4, 8}) {
    for (std::int64_t n : {0, 1, 7, 8, 9, 1001}) {
      std::int64_t total = 0;
      for (int r = 0; r < P; ++r) {
        const std::int64_t c = all_reduce_chunk(n, P, r);
        EXPECT_EQ(c, n / P + (r < n % P ? 1 : 0));
        total += c;
      }
      EXPECT_EQ(total, n);
      // Summed over ranks, an all-reduce moves 2 (P-1) n elements each way.
      std::int64_t wire = 0;
      for (int r = 0; r < P; ++r) wire += all_reduce_wire_bytes(n, P, r, DType::f64).sent;
      EXPECT_EQ(wire, 2 * (P - 1) * n * 8);
    }
  }
  EXPECT_THROW(all_reduce_chunk(5, 2, 2), Error);
}

TEST(SelfCommunicator, CopiesAndRecordsZeroBytes) {
  auto comm = make_self_communicator();
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->rank(), 0);
  Results<float> out = test::run_sequence<float>(*comm);
  EXPECT_EQ(test::check_against_serial(out, 1, 0), "");
  EXPECT_EQ(test::check_ledger(out.ledger, 1, 0, 4), "");
  EXPECT_EQ(out.ledger.bytes_sent(), 0);
  EXPECT_EQ(out.ledger.entries().size(), 9u);  // every label shows, with zero bytes
}

class LocalComm : public ::testing::TestWithParam<int> {};

template <class T>
void check_sequence(int P) {
  std::vector<Results<T>> results(P);
  run_local_ranks(P, [&](Communicator& c) {
    EXPECT_EQ(c.size(), P);
    EXPECT_EQ(c.backend(), Backend::local);
    results[c.rank()] = test::run_sequence<T>(c);
  });
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(test::check_against_serial(results[r], P, r), "") << "rank " << r << " of " << P;
    EXPECT_EQ(test::check_ledger(results[r].ledger, P, r, sizeof(T)), "")
        << "rank " << r << " of " << P;
  }
}

TEST_P(LocalComm, EveryCollectiveMatchesSerialF32) {
  check_sequence<float>(GetParam());
}
TEST_P(LocalComm, EveryCollectiveMatchesSerialF64) {
  check_sequence<double>(GetParam());
}

// bf16, the wire of --dtype bf16 (comm_cases.hpp, run_bf16_sequence).
TEST_P(LocalComm, EveryCollectiveMatchesSerialBf16) {
  const int P = GetParam();
  std::vector<test::Bf16Results> results(static_cast<size_t>(P));
  run_local_ranks(P,
                  [&](Communicator& c) { results[size_t(c.rank())] = test::run_bf16_sequence(c); });
  for (int r = 0; r < P; ++r)
    EXPECT_EQ(test::check_bf16_against_serial(results[size_t(r)], P, r), "")
        << "rank " << r << " of " << P;
}

TEST_P(LocalComm, ManySmallCollectivesStayInStep) {
  // Thousands of back-to-back rendezvous, mixing one-step barriers with
  // multi-step collectives: the post ring and the retract-on-failure logic
  // must never let a fast rank overwrite what a slow one still reads.
  const int P = GetParam();
  run_local_ranks(P, [&](Communicator& c) {
    for (int it = 0; it < 300; ++it) {
      double v = c.rank() + it;
      c.all_reduce(&v, 1, "x");
      ASSERT_EQ(v, P * (P - 1) / 2.0 + P * it);
      c.barrier("b");
      std::vector<float> got(P);
      float mine = static_cast<float>(c.rank() * 10 + it);
      I64s counts(P, 1), displs(P);
      for (int j = 0; j < P; ++j) displs[j] = j;
      c.all_gather_v(&mine, 1, got.data(), counts.data(), displs.data(), "g");
      for (int j = 0; j < P; ++j) ASSERT_EQ(got[j], static_cast<float>(j * 10 + it));
    }
  });
}

TEST_P(LocalComm, AllReduceStagingIsCountedAsCommBuffers) {
  const int P = GetParam();
  const std::int64_t n = 1001;
  std::vector<MemoryPool> pools(P);
  LocalRunOptions opts;
  opts.pools = &pools;
  run_local_ranks(
      P,
      [&](Communicator& c) {
        std::vector<float> buf(n, 1.0f);
        c.all_reduce(buf.data(), n, "grad");
        EXPECT_EQ(buf[n - 1], static_cast<float>(P));
      },
      opts);
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(pools[r].peak(MemCategory::comm_buffers), all_reduce_chunk(n, P, r) * 4);
    EXPECT_EQ(pools[r].current(MemCategory::comm_buffers), 0);
  }
}

TEST_P(LocalComm, CountOnlyBuffersMoveNothingButAreRecorded) {
  const int P = GetParam();
  std::vector<MemoryPool> pools(P);
  for (MemoryPool& p : pools) p.set_count_only(true);
  LocalRunOptions opts;
  opts.pools = &pools;
  run_local_ranks(
      P,
      [&](Communicator& c) {
        I64s counts(P, 3), displs(P);
        for (int j = 0; j < P; ++j) displs[j] = 3 * j;
        c.all_gather_v(static_cast<const float*>(nullptr), 3, static_cast<float*>(nullptr),
                       counts.data(), displs.data(), "ag");
        c.all_to_all_v(static_cast<const float*>(nullptr), counts.data(), displs.data(),
                       static_cast<float*>(nullptr), counts.data(), displs.data(), "a2a");
        c.reduce_scatter_v(static_cast<const float*>(nullptr), counts.data(), displs.data(),
                           static_cast<float*>(nullptr), "rs");
        c.all_reduce(static_cast<float*>(nullptr), 10, "ar");
        const auto& e = c.ledger().entries();
        EXPECT_EQ(e.at({Phase::forward, "ag"}).bytes_sent, (P - 1) * 3 * 4);
        // Nothing moved, but the transport counted what it would have moved.
        for (const char* label : {"ag", "a2a", "rs", "ar"}) {
          const LedgerEntry& le = e.at({Phase::forward, label});
          EXPECT_EQ(le.measured_sent, le.bytes_sent) << label;
          EXPECT_EQ(le.measured_received, le.bytes_received) << label;
        }
        EXPECT_EQ(e.at({Phase::forward, "a2a"}).bytes_received, (P - 1) * 3 * 4);
        EXPECT_EQ(e.at({Phase::forward, "rs"}).bytes_received, (P - 1) * 3 * 4);
        EXPECT_EQ(e.at({Phase::forward, "ar"}).bytes_sent,
                  all_reduce_wire_bytes(10, P, c.rank(), DType::f32).sent);
      },
      opts);
  for (int r = 0; r < P; ++r)
    EXPECT_EQ(pools[r].peak(MemCategory::comm_buffers), all_reduce_chunk(10, P, r) * 4);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LocalComm, ::testing::Values(1, 2, 3, 4, 8),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return "P" + std::to_string(p.param);
                         });

TEST(LocalComm, CommunicatorsKeepLedgersAcrossRuns) {
  auto comms = make_local_communicators(3);
  for (int run = 0; run < 2; ++run) {
    run_local_ranks(comms, [](Communicator& c) {
      double v = 1;
      c.all_reduce(&v, 1, "ar");
    });
  }
  for (auto& c : comms) EXPECT_EQ(c->ledger().entries().at({Phase::forward, "ar"}).calls, 2);
}

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
  struct Case {
    TransportFault fault;
    std::string rank1, rank0;  // the start of each one's error
  };
  const std::vector<Case> cases{
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
  for (const Case& k : cases) {
    std::vector<std::string> errors(P);
    run_local_ranks(P, [&](Communicator& c) {
      errors[c.rank()] = test::faulty_all_to_all(c, k.fault, c.rank() == 1);
    });
    EXPECT_EQ(errors[1].rfind(k.rank1, 0), 0u) << errors[1];
    EXPECT_NE(errors[1].find("the local backend lost or misdirected data"), std::string::npos)
        << errors[1];
    EXPECT_EQ(errors[0].rfind(k.rank0, 0), 0u) << errors[0];
    EXPECT_EQ(errors[2], "") << "rank 2 moved what its counts say";
  }
  // The same call without a fault passes on every rank.
  run_local_ranks(P, [&](Communicator& c) {
    EXPECT_EQ(test::faulty_all_to_all(c, TransportFault::short_send, false), "");
  });
}

// The link model: the numbers of each algorithm's cost, written out.
TEST(LinkModel, CostsOfEachAlgorithmOnOneLevel) {
  const double a = 1e-6, b = 1e9;
  const WireBytes w{4000, 3000};  // m = 4000: the larger direction
  for (int P : {2, 4, 8}) {
    const double peers = P - 1;
    const Fabric sw = single_level({b, a, Topology::switched});
    const Fabric mesh = single_level({b, a, Topology::full_mesh});
    EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_to_all, P, w, sw), peers * a + 4e-6);
    EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_gather, P, w, sw), peers * a + 4e-6);
    EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::reduce_scatter, P, w, sw),
                     peers * a + 4e-6);
    EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_reduce, P, w, sw),
                     2 * peers * a + 4e-6);
    EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_to_all, P, w, mesh), a + 4e-6 / peers);
    EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::barrier, P, {}, sw),
                     std::ceil(std::log2(P)) * a);
  }
  // A bidirectional ring of 8: mean hop count 16/7, shared by two directions.
  EXPECT_DOUBLE_EQ(
      collective_seconds(CollectiveKind::all_to_all, 8, w, single_level({b, a, Topology::ring})),
      4 * a + 4e-6 * (16.0 / 7 / 2));
  EXPECT_EQ(collective_seconds(CollectiveKind::all_reduce, 1, w, single_level({b, a})), 0);
}

TEST(LinkModel, TwoLevelsSplitTheBytesExactly) {
  // 16 ranks, 4 per node: 4 nodes. The shares crossing nodes and staying
  // inside sum to the rank's bytes; each level is costed on its own link.
  const LinkModel in{100e9, 1e-6}, out{10e9, 5e-6};
  const Fabric f{in, out, 4};
  const double m = 1.5e9;
  const WireBytes w{std::int64_t(m), 0};
  const double fa = 12.0 / 15, fg = 3.0 / 15;
  EXPECT_DOUBLE_EQ(node_crossing_share(CollectiveKind::all_to_all, 16, 4), fa);
  EXPECT_DOUBLE_EQ(node_crossing_share(CollectiveKind::all_gather, 16, 4), fg);
  EXPECT_EQ(node_crossing_share(CollectiveKind::all_gather, 4, 4), 0);
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_to_all, 16, w, f),
                   std::max(3 * 1e-6 + (1 - fa) * m / 100e9, 12 * 5e-6 + fa * m / 10e9));
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_gather, 16, w, f),
                   3 * 5e-6 + fg * m / 10e9 + 3 * 1e-6 + (1 - fg) * m / 100e9);
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_reduce, 16, w, f),
                   6 * 5e-6 + fg * m / 10e9 + 6 * 1e-6 + (1 - fg) * m / 100e9);
  // On one node the inter link is never used.
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_gather, 4, w, f), 3 * 1e-6 + m / 100e9);
}

TEST(LinkModel, BadLinksAreRefusedNamingTheValue) {
  using test::error_of;
  auto comm = make_self_communicator();
  for (const LinkModel& bad : {LinkModel{0, 1e-6}, LinkModel{-1, 0}, LinkModel{std::nan(""), 0},
                               LinkModel{INFINITY, 0}, LinkModel{1e9, -1e-6}}) {
    const std::string e = error_of([&] { comm->set_link_model(&bad); });
    EXPECT_NE(e.find("link model: "), std::string::npos) << e;
  }
  EXPECT_EQ(comm->link_model(), nullptr);
  EXPECT_NE(error_of([] { parse_topology("torus", "intra link"); })
                .find("intra link: unknown topology 'torus'; the topologies are switch, "
                      "full-mesh and ring"),
            std::string::npos);
}

// Under a link model every collective takes at least its modelled time, and
// results and ledger are bit for bit those of the unshaped run.
TEST_P(LocalComm, LinkModelSetsAFloorAndChangesNothingElse) {
  const int P = GetParam();             // P = 1: nothing to shape, results must still agree
  const LinkModel link{200e6, 300e-6};  // 200 MB/s, 300 us: milliseconds per call
  std::vector<test::Results<float>> plain(P), shaped(P);
  std::vector<std::string> floors(P);
  run_local_ranks(P, [&](Communicator& c) { plain[c.rank()] = test::run_sequence<float>(c); });
  run_local_ranks(P, [&](Communicator& c) {
    c.set_link_model(&link);
    shaped[c.rank()] = test::run_sequence<float>(c);
    floors[c.rank()] = test::check_link_floor(c, link);
  });
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(test::compare_bitwise(plain[r], shaped[r]), "") << "rank " << r;
    EXPECT_EQ(test::check_ledger(shaped[r].ledger, P, r, sizeof(float)), "") << "rank " << r;
    EXPECT_EQ(floors[r], "") << "rank " << r;
  }
}

// Started collectives: the same data and ledger as the blocking calls; with
// a link model, wait() returns at the modelled completion, the time between
// start and wait overlaps it, and a blocking call behind a started one
// queues on the link.
TEST_P(LocalComm, StartedCollectivesMoveTheSameDataAndOverlapTheLinkTime) {
  const int P = GetParam();
  const std::int64_t n = 3000;     // elements per rank
  const LinkModel link{100e6, 0};  // 100 MB/s: 12 KB per peer block, ~0.1 ms each
  std::vector<std::int64_t> counts(static_cast<size_t>(P), n), displs(static_cast<size_t>(P));
  for (int i = 0; i < P; ++i) displs[static_cast<size_t>(i)] = i * n;
  std::vector<std::string> errors(static_cast<size_t>(P));
  run_local_ranks(P, [&](Communicator& c) {
    const int r = c.rank();
    std::vector<float> send(static_cast<size_t>(n * P)), mine(static_cast<size_t>(n));
    for (size_t i = 0; i < send.size(); ++i) send[i] = float(r * 100000 + int(i));
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = send[i];
    std::vector<float> ag_block(static_cast<size_t>(n * P)), ag_start(static_cast<size_t>(n * P)),
        rs_block(static_cast<size_t>(n)), rs_start(static_cast<size_t>(n));
    c.all_gather_v(mine.data(), n, ag_block.data(), counts.data(), displs.data(), "ag");
    c.reduce_scatter_v(send.data(), counts.data(), displs.data(), rs_block.data(), "rs");
    PendingCollective ag =
        c.start_all_gather_v(mine.data(), n, ag_start.data(), counts.data(), displs.data(), "ag");
    PendingCollective rs =
        c.start_reduce_scatter_v(send.data(), counts.data(), displs.data(), rs_start.data(), "rs");
    c.wait(ag);
    c.wait(rs);
    std::string& e = errors[static_cast<size_t>(r)];
    if (ag_block != ag_start || rs_block != rs_start) e += "started results differ; ";
    const LedgerEntry& agl = c.ledger().entries().at({Phase::forward, "ag"});
    if (agl.calls != 2) e += "ag recorded " + std::to_string(agl.calls) + " calls; ";
    if (P == 1) return;

    // The modelled time of one all-gather and one reduce-scatter of this size.
    c.set_link_model(&link);
    const Fabric f = single_level(link);
    const double t_ag =
        collective_seconds(CollectiveKind::all_gather, P,
                           all_gather_wire_bytes(n, counts.data(), P, r, DType::f32), f);
    const auto secs = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    // Started, then other work, then wait; pending until waited for. (How
    // long the wait blocks is the overlap bench's to measure, not a unit
    // test's: no upper bounds on time here.)
    PendingCollective p =
        c.start_all_gather_v(mine.data(), n, ag_start.data(), counts.data(), displs.data(), "ag");
    if (!p.pending()) e += "not pending after start; ";
    c.wait(p);
    if (p.pending()) e += "pending after wait; ";
    auto t0 = Clock::now();
    // Started and waited at once: the wait takes the modelled time.
    p = c.start_all_gather_v(mine.data(), n, ag_start.data(), counts.data(), displs.data(), "ag");
    c.wait(p);
    if (secs(Clock::now() - t0) < t_ag) e += "wait returned before the modelled time; ";
    // A blocking call behind a started one queues: both times at least.
    t0 = Clock::now();
    p = c.start_all_gather_v(mine.data(), n, ag_start.data(), counts.data(), displs.data(), "ag");
    c.all_gather_v(mine.data(), n, ag_block.data(), counts.data(), displs.data(), "ag");
    if (secs(Clock::now() - t0) < 2 * t_ag) e += "a call behind a started one did not queue; ";
    c.wait(p);

    // The rank's time in collectives: a blocking call counts all of its
    // modelled time; work between a start and its wait is not counted.
    const auto time_in_collectives = [&](const std::function<void()>& calls) {
      const double before = c.seconds_in_collectives();
      const auto t = Clock::now();
      calls();
      return std::make_pair(c.seconds_in_collectives() - before, secs(Clock::now() - t));
    };
    auto [blocking, wall] = time_in_collectives([&] {
      c.all_gather_v(mine.data(), n, ag_block.data(), counts.data(), displs.data(), "ag");
    });
    if (blocking < t_ag || blocking > wall)
      e += "a blocking call's time in collectives " + std::to_string(blocking) +
           " s is outside [modelled " + std::to_string(t_ag) + ", wall " + std::to_string(wall) +
           "]; ";
    const auto work = std::chrono::duration<double>(2 * t_ag);
    auto [overlapped, wall2] = time_in_collectives([&] {
      p = c.start_all_gather_v(mine.data(), n, ag_start.data(), counts.data(), displs.data(), "ag");
      std::this_thread::sleep_for(work);  // the compute a started call hides
      c.wait(p);
    });
    if (overlapped > wall2 - work.count())
      e += "time in collectives " + std::to_string(overlapped) +
           " s counts the work between start and wait (wall " + std::to_string(wall2) + " s); ";
  });
  for (int r = 0; r < P; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

// Deferred delivery (communicator.hpp, "Overlap"): a started all-gather's
// and reduce-scatter's recv holds quiet NaN until the wait and the right
// result after it, f32 and f64; and a send buffer released (and its memory
// handed out again) or changed, or a recv buffer released or written, before
// the wait is named there, with the call. The rank's other calls go on.
TEST_P(LocalComm, DeferredDeliveryDeliversAtTheWaitAndNamesEarlyReleases) {
  const int P = GetParam();
  const std::int64_t n = 5;
  I64s counts(static_cast<size_t>(P), n), displs(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) displs[static_cast<size_t>(j)] = j * n;
  std::vector<std::string> errors(static_cast<size_t>(P));
  LocalRunOptions opts;
  opts.deferred_delivery_for_testing = true;
  run_local_ranks(
      P,
      [&](Communicator& c) {
        const int r = c.rank();
        std::string& e = errors[static_cast<size_t>(r)];
        const auto expect_error = [&](const std::string& what, const std::function<void()>& fn,
                                      const std::string& words) {
          const std::string got = test::error_of(fn);
          if (got.find(words) == std::string::npos)
            e += what + ": expected '" + words + "', got '" + got + "'; ";
        };
        const std::string me = " on rank " + std::to_string(r) + " of " + std::to_string(P) +
                               " (deferred delivery, a test mode): its ";
        TensorF mine({n}), gathered({n * P});
        for (std::int64_t i = 0; i < n; ++i) mine[i] = float(100 * r + i);
        PendingCollective p = c.start_all_gather_v(mine.data(), n, gathered.data(), counts.data(),
                                                   displs.data(), "ag");
        for (std::int64_t i = 0; i < n * P; ++i)
          if (!std::isnan(gathered[i])) e += "all-gather recv not NaN before the wait; ";
        c.wait(p);
        for (int j = 0; j < P; ++j)
          for (std::int64_t i = 0; i < n; ++i)
            if (gathered[j * n + i] != float(100 * j + i)) e += "all-gather result wrong; ";

        TensorD send({n * P}), mine_sum({n});
        for (int j = 0; j < P; ++j)
          for (std::int64_t i = 0; i < n; ++i) send[j * n + i] = 1000.0 * r + 10.0 * j + double(i);
        p = c.start_reduce_scatter_v(send.data(), counts.data(), displs.data(), mine_sum.data(),
                                     "rs");
        for (std::int64_t i = 0; i < n; ++i)
          if (!std::isnan(mine_sum[i])) e += "reduce-scatter recv not NaN before the wait; ";
        c.wait(p);
        for (std::int64_t i = 0; i < n; ++i)
          if (mine_sum[i] != 1000.0 * P * (P - 1) / 2 + P * (10.0 * r + double(i)))
            e += "reduce-scatter result wrong; ";

        // The send buffer released, and its memory likely handed out again.
        {
          TensorF shard({n});
          shard.fill(1.0f);
          p = c.start_all_gather_v(shard.data(), n, gathered.data(), counts.data(), displs.data(),
                                   "ag_send_freed");
          shard.reset();
          TensorF reused({n});
          reused.fill(1.0f);
          expect_error(
              "released send", [&] { c.wait(p); },
              "all_gather 'ag_send_freed'" + me +
                  "send buffer was released before wait(); an asynchronous transport "
                  "(MPI nonblocking, NCCL) reads the send buffer until the wait");
        }
        {
          TensorD blocks({n * P});
          blocks.fill(2.0);
          p = c.start_reduce_scatter_v(blocks.data(), counts.data(), displs.data(), mine_sum.data(),
                                       "rs_send_freed");
          blocks.reset();
          expect_error(
              "released reduce-scatter send", [&] { c.wait(p); },
              "reduce_scatter 'rs_send_freed'" + me + "send block 0 was released");
        }
        p = c.start_all_gather_v(mine.data(), n, gathered.data(), counts.data(), displs.data(),
                                 "ag_send_changed");
        mine[0] += 1;
        expect_error(
            "changed send", [&] { c.wait(p); },
            "all_gather 'ag_send_changed'" + me +
                "send buffer changed between the start and wait()");
        {
          TensorF into({n * P});
          p = c.start_all_gather_v(mine.data(), n, into.data(), counts.data(), displs.data(),
                                   "ag_recv_freed");
          into.reset();
          expect_error(
              "released recv", [&] { c.wait(p); },
              "all_gather 'ag_recv_freed'" + me + "recv block 0 was released");
        }
        p = c.start_reduce_scatter_v(send.data(), counts.data(), displs.data(), mine_sum.data(),
                                     "rs_recv_written");
        mine_sum[n - 1] = 0;
        expect_error(
            "written recv", [&] { c.wait(p); },
            "reduce_scatter 'rs_recv_written'" + me +
                "recv buffer was written between the start and wait()");
        // A handle dropped without its wait delivers nothing.
        {
          PendingCollective dropped = c.start_all_gather_v(mine.data(), n, gathered.data(),
                                                           counts.data(), displs.data(), "ag");
        }
        if (!std::isnan(gathered[0])) e += "a dropped started call delivered; ";
        // Memory that is not the pool's is refused at the start, on every rank alike.
        std::vector<float> plain(static_cast<size_t>(n));
        expect_error(
            "plain memory",
            [&] {
              c.start_all_gather_v(plain.data(), n, gathered.data(), counts.data(), displs.data(),
                                   "ag");
            },
            "send buffer is not storage of this rank's memory pool");
        c.barrier("still_in_step");
      },
      opts);
  for (int r = 0; r < P; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

TEST(LocalComm, DeferredDeliveryNeedsThePoolToTrackStorage) {
  const std::vector<std::string> errors = errors_of(2, 10s, [](Communicator& c) {
    c.set_deferred_delivery_for_testing(true);
    TensorF mine({3}), all({6});
    const I64s counts{3, 3}, displs{0, 3};
    c.start_all_gather_v(mine.data(), 3, all.data(), counts.data(), displs.data(), "ag");
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("whose storage tracking is off; turn on MemoryPool::set_storage_tracking"),
              std::string::npos)
        << e;
}

// ---------------------------------------------------------------- ring_shift

TEST(RingShift, PeersAreTheRingNeighboursEachWay) {
  const RingPeers one = ring_peers(1, 0, RingDirection::forward);
  EXPECT_EQ(one.to, 0);
  EXPECT_EQ(one.from, 0);
  for (int P : {2, 3, 5}) {
    for (int r = 0; r < P; ++r) {
      const RingPeers f = ring_peers(P, r, RingDirection::forward);
      const RingPeers b = ring_peers(P, r, RingDirection::backward);
      EXPECT_EQ(f.to, (r + 1) % P);
      EXPECT_EQ(f.from, (r + P - 1) % P);
      EXPECT_EQ(b.to, f.from);
      EXPECT_EQ(b.from, f.to);
    }
  }
  EXPECT_THROW(ring_peers(3, 3, RingDirection::forward), Error);
}

TEST(RingShift, WireBytesAreOneBlockEachWay) {
  // send_count e to one neighbour, recv_count e from the other; at P = 2 the
  // two are the same peer; nothing on one rank.
  EXPECT_EQ(ring_shift_wire_bytes(5, 7, 1, DType::f32).sent, 0);
  EXPECT_EQ(ring_shift_wire_bytes(5, 7, 1, DType::f32).received, 0);
  for (int P : {2, 3, 4}) {
    const WireBytes w = ring_shift_wire_bytes(5, 7, P, DType::f64);
    EXPECT_EQ(w.sent, 40);
    EXPECT_EQ(w.received, 56);
  }
  const auto peers = ring_shift_peer_bytes(5, 7, 4, 0, DType::f32, RingDirection::backward);
  EXPECT_EQ(peers[3].sent, 20);
  EXPECT_EQ(peers[1].received, 28);
  EXPECT_EQ(peers[1].sent + peers[2].sent + peers[2].received + peers[3].received, 0);
  const auto two = ring_shift_peer_bytes(5, 7, 2, 1, DType::f32, RingDirection::forward);
  EXPECT_EQ(two[0].sent, 20);
  EXPECT_EQ(two[0].received, 28);
  for (StagingRule rule : {StagingRule::in_process, StagingRule::mpi, StagingRule::none})
    EXPECT_EQ(staging_elements(rule, CollectiveKind::ring_shift, 4, 1000), 0);
}

TEST(RingShift, SelfCommunicatorCopiesTheBlockBackAndRecordsZeroBytes) {
  auto comm = make_self_communicator();
  const test::RingResults<double> out = test::run_ring_shifts<double>(*comm);
  EXPECT_EQ(test::check_ring_against_serial(out, 1, 0), "");
  EXPECT_EQ(test::check_ring_ledger(out.ledger, 1, 0, 8), "");
  EXPECT_EQ(out.ledger.bytes_sent(), 0);
}

class LocalRingShift : public ::testing::TestWithParam<int> {};

template <class T>
void check_ring_sequence(int P) {
  std::vector<test::RingResults<T>> results(P);
  run_local_ranks(P, [&](Communicator& c) { results[c.rank()] = test::run_ring_shifts<T>(c); });
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(test::check_ring_against_serial(results[r], P, r), "") << "rank " << r << " of " << P;
    EXPECT_EQ(test::check_ring_ledger(results[r].ledger, P, r, sizeof(T)), "")
        << "rank " << r << " of " << P;
  }
}

TEST_P(LocalRingShift, BlocksLandOnTheNeighbourF32) {
  check_ring_sequence<float>(GetParam());
}
TEST_P(LocalRingShift, BlocksLandOnTheNeighbourF64) {
  check_ring_sequence<double>(GetParam());
}

TEST_P(LocalRingShift, CountOnlyMovesNothingButIsRecordedAndStagesNothing) {
  const int P = GetParam();
  std::vector<MemoryPool> pools(P);
  for (MemoryPool& p : pools) p.set_count_only(true);
  LocalRunOptions opts;
  opts.pools = &pools;
  std::vector<std::string> diffs(P);
  run_local_ranks(
      P,
      [&](Communicator& c) {
        const int r = c.rank(), from = ring_peers(P, r, RingDirection::forward).from;
        c.ring_shift(static_cast<const float*>(nullptr), test::ring_count(P, r),
                     static_cast<float*>(nullptr), test::ring_count(P, from), "kv_ring");
        c.ring_shift(static_cast<const float*>(nullptr), test::ring_count(P, r),
                     static_cast<float*>(nullptr), test::ring_count(P, from), "kv_ring");
        std::map<std::pair<Phase, std::string>, LedgerEntry> want;
        LedgerEntry& e = want[{Phase::forward, "kv_ring"}];
        e.calls = 2;
        if (P > 1)
          e.bytes_sent = 2 * 4 * test::ring_count(P, r),
          e.bytes_received = 2 * 4 * test::ring_count(P, from);
        diffs[r] = test::check_ledger_against(c.ledger(), want);
      },
      opts);
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(diffs[r], "") << "rank " << r;
    EXPECT_EQ(pools[r].peak(MemCategory::comm_buffers), 0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, LocalRingShift, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return "P" + std::to_string(p.param);
                         });

// One rank of P alone: the bytes recorded (derived and measured) are the
// real rank's, and recv holds the own block as stand-in, count-only or not.
TEST(RingShift, DryRunRecordsTheBytesOfOneRankAlone) {
  for (int P : {1, 2, 5}) {
    for (int r = 0; r < P; ++r) {
      SCOPED_TRACE(cat("rank ", r, " of ", P));
      DryRunCommunicator dry(r, P);
      const RingPeers fwd = ring_peers(P, r, RingDirection::forward);
      const std::vector<float> mine = test::ring_block<float>(20, P, r);
      const std::int64_t n = test::ring_count(P, r), m = test::ring_count(P, fwd.from);
      std::vector<float> recv(static_cast<size_t>(m), test::kUntouched<float>);
      dry.ring_shift(mine.data(), n, recv.data(), m, "kv_ring");
      dry.ring_shift(static_cast<const float*>(nullptr), n, static_cast<float*>(nullptr), m,
                     "kv_ring");
      std::map<std::pair<Phase, std::string>, LedgerEntry> want;
      LedgerEntry& e = want[{Phase::forward, "kv_ring"}];
      e.calls = 2;
      if (P > 1) e.bytes_sent = 2 * 4 * n, e.bytes_received = 2 * 4 * m;
      EXPECT_EQ(test::check_ledger_against(dry.ledger(), want), "");
      for (std::int64_t i = 0; i < m; ++i) {
        const float stand_in = n == 0 ? 0.0f : mine[static_cast<size_t>(i % n)];
        ASSERT_EQ(recv[static_cast<size_t>(i)], stand_in) << "element " << i;
      }
    }
  }
}

TEST(RingShift, WrongRecvCountIsRefusedNamingThePeer) {
  // Rank 2 of 3 expects one element more than rank 1 (forward) or rank 0
  // (backward) sends it; every rank sees the same mismatch.
  const int P = 3;
  for (RingDirection d : {RingDirection::forward, RingDirection::backward}) {
    const int from2 = ring_peers(P, 2, d).from;
    auto errors = errors_of(P, 20s, [&](Communicator& c) {
      const int r = c.rank(), from = ring_peers(P, r, d).from;
      std::vector<float> send(1600, 1.0f), recv(1600);
      c.ring_shift(send.data(), test::ring_count(P, r), recv.data(),
                   test::ring_count(P, from) + (r == 2 ? 1 : 0), "kv_ring", d);
    });
    for (int r = 0; r < P; ++r)
      EXPECT_EQ(errors[r], cat("ring_shift 'kv_ring' on rank ", r, " of 3: rank 2 expects ",
                               test::ring_count(P, from2) + 1, " elements from rank ", from2,
                               " but rank ", from2, " sends it ", test::ring_count(P, from2),
                               "; each rank's recv_count must equal the send_count of the rank "
                               "it receives from, and count-only must be on for all ranks of a "
                               "call or for none"))
          << to_string(d);
  }
  // On one rank the block comes back: every backend refuses alike.
  const std::string one =
      "ring_shift 'kv_ring' on rank 0 of 1: rank 0 expects 3 elements from rank 0 but rank 0 "
      "sends it 2; each rank's recv_count must equal the send_count of the rank it receives "
      "from, and count-only must be on for all ranks of a call or for none";
  const auto call = [](Communicator& c) {
    std::vector<double> send(2), recv(3);
    c.ring_shift(send.data(), 2, recv.data(), 3, "kv_ring");
  };
  auto self = make_self_communicator();
  EXPECT_EQ(test::error_of(call, *self), one);
  DryRunCommunicator dry(0, 1);
  EXPECT_EQ(test::error_of(call, dry), one);
  EXPECT_EQ(errors_of(1, 20s, call)[0], one);
}

TEST(RingShift, DirectionsThatDifferAreNamedOnEveryRank) {
  auto errors = errors_of(3, 20s, [](Communicator& c) {
    std::vector<float> send(2, 1.0f), recv(2);
    c.ring_shift(send.data(), 2, recv.data(), 2, "kv_ring",
                 c.rank() == 1 ? RingDirection::backward : RingDirection::forward);
  });
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(errors[r], cat("ring_shift 'kv_ring' on rank ", r,
                             " of 3: rank 0 shifts forward but rank 1 backward; every rank of a "
                             "ring_shift must pass the same direction, ring size and stride"));
}

// Rings of consecutive ranks (Ring::size): the hierarchical form's rings,
// one per head group.
TEST(RingShift, RingsOfConsecutiveRanksHaveTheirOwnNeighbours) {
  // 6 ranks in rings of 3: {0 1 2} {3 4 5}; of 2: {0 1} {2 3} {4 5}.
  const int fwd3_to[] = {1, 2, 0, 4, 5, 3}, fwd3_from[] = {2, 0, 1, 5, 3, 4};
  for (int r = 0; r < 6; ++r) {
    const RingPeers f = ring_peers(6, r, Ring{RingDirection::forward, 3});
    const RingPeers b = ring_peers(6, r, Ring{RingDirection::backward, 3});
    EXPECT_EQ(f.to, fwd3_to[r]) << r;
    EXPECT_EQ(f.from, fwd3_from[r]) << r;
    EXPECT_EQ(b.to, f.from) << r;
    EXPECT_EQ(b.from, f.to) << r;
    const RingPeers two = ring_peers(6, r, Ring{RingDirection::forward, 2});
    EXPECT_EQ(two.to, r ^ 1) << r;
    EXPECT_EQ(two.from, r ^ 1) << r;
    const RingPeers one = ring_peers(6, r, Ring{RingDirection::forward, 1});
    EXPECT_EQ(one.to, r);
    EXPECT_EQ(one.from, r);
    // Size 0 and size P are the one ring of every rank.
    EXPECT_EQ(ring_peers(6, r, Ring{RingDirection::forward, 6}).to,
              ring_peers(6, r, RingDirection::forward).to);
  }
  EXPECT_THROW(ring_peers(6, 0, Ring{RingDirection::forward, 4}), Error);
  // Strided: 8 ranks in rings of 2 at stride 4: {0 4} {1 5} {2 6} {3 7};
  // of 2 at stride 2: {0 2} {1 3} {4 6} {5 7}; of 3 at stride 2 (6 ranks):
  // {0 2 4} {1 3 5}.
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(ring_peers(8, r, Ring{RingDirection::forward, 2, 4}).to, (r + 4) % 8) << r;
    EXPECT_EQ(ring_peers(8, r, Ring{RingDirection::forward, 2, 2}).to, r ^ 2) << r;
  }
  const int fwd32_to[] = {2, 3, 4, 5, 0, 1};
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(ring_peers(6, r, Ring{RingDirection::forward, 3, 2}).to, fwd32_to[r]) << r;
    EXPECT_EQ(ring_peers(6, fwd32_to[r], Ring{RingDirection::backward, 3, 2}).to, r) << r;
  }
  EXPECT_THROW(ring_peers(6, 0, Ring{RingDirection::forward, 2, 2}), Error);  // 4 does not divide 6
  EXPECT_EQ(Ring(RingDirection::forward, 3, 2).span(6), 5);
  EXPECT_EQ(to_string(Ring{RingDirection::forward, 2, 4}), "forward in rings of 2, stride 4");
  EXPECT_EQ(to_string(Ring{RingDirection::backward, 2}), "backward in rings of 2");
  EXPECT_EQ(to_string(Ring{}), "forward");
  // In rings of one nothing is traffic; in rings of two one peer each way.
  EXPECT_EQ(ring_shift_wire_bytes(5, 7, 4, DType::f32, 1).sent, 0);
  EXPECT_EQ(ring_shift_wire_bytes(5, 7, 4, DType::f32, 2).sent, 20);
  EXPECT_EQ(ring_shift_wire_bytes(5, 7, 4, DType::f32, 2).received, 28);
}

TEST(RingShift, RingsOfConsecutiveRanksPassTheirOwnBlocks) {
  struct Case {
    int P, size, stride;
  };
  for (const Case k : {Case{4, 2, 1},
                       {6, 3, 1},
                       {6, 2, 1},
                       {4, 1, 1},
                       {4, 4, 1},
                       {3, 3, 1},
                       {8, 2, 4},
                       {8, 2, 2},
                       {6, 3, 2},
                       {6, 2, 3},
                       {4, 1, 4}}) {
    std::vector<std::string> diffs(static_cast<size_t>(k.P));
    run_local_ranks(k.P, [&](Communicator& c) {
      diffs[size_t(c.rank())] = test::check_rings_of<float>(c, k.size, k.stride);
    });
    for (int r = 0; r < k.P; ++r)
      EXPECT_EQ(diffs[size_t(r)], "")
          << "rank " << r << " of " << k.P << " in rings of " << k.size << ", stride " << k.stride;
  }
}

TEST(RingShift, RingSizesThatDoNotTileOrDifferAreRefused) {
  auto tile = errors_of(4, 20s, [](Communicator& c) {
    std::vector<float> send(2, 1.0f), recv(2);
    c.ring_shift(send.data(), 2, recv.data(), 2, "kv_ring", Ring{RingDirection::forward, 3});
  });
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(tile[r], cat("ring_shift 'kv_ring' on rank ", r,
                           " of 4: rings of 3 ranks at stride 1 do not tile the group; pass a "
                           "ring size and stride whose product divides 4 (size 0: one ring of "
                           "every rank)"));
  auto differ = errors_of(4, 20s, [](Communicator& c) {
    std::vector<float> send(2, 1.0f), recv(2);
    c.ring_shift(send.data(), 2, recv.data(), 2, "kv_ring",
                 Ring{RingDirection::forward, c.rank() == 2 ? 4 : 2});
  });
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(differ[r], cat("ring_shift 'kv_ring' on rank ", r,
                             " of 4: rank 0 shifts forward in rings of 2 but rank 2 forward in "
                             "rings of 4; every rank of a ring_shift must pass the same "
                             "direction, ring size and stride"));
}

TEST(RingShift, MissingRankTimesOutNamingLabelAndRank) {
  const int P = 4;
  const auto t0 = Clock::now();
  auto errors = errors_of(P, 200ms, [&](Communicator& c) {
    if (c.rank() == 3) {  // never calls it
      std::this_thread::sleep_for(1000ms);
      return;
    }
    std::vector<float> send(2, 1.0f), recv(2);
    c.ring_shift(send.data(), 2, recv.data(), 2, "kv_ring");
  });
  EXPECT_LT(seconds_since(t0), 2.0);
  // The first to time out names rank 3; the others may stop on its failure,
  // which quotes it.
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(errors[r]);
    EXPECT_EQ(errors[r].rfind(cat("ring_shift 'kv_ring' on rank ", r, " of 4 "), 0), 0u);
    EXPECT_NE(errors[r].find("timed out after 200 ms waiting for rank(s) 3"), std::string::npos);
  }
  EXPECT_EQ(errors[3], "");
}

// Deferred delivery: a started ring_shift's recv is quiet NaN until the
// wait and the neighbour's block after it; a send changed or released, or a
// recv written, before the wait is named there.
TEST_P(LocalRingShift, DeferredDeliveryCatchesAnEarlyRead) {
  const int P = GetParam();
  std::vector<std::string> errors(static_cast<size_t>(P));
  LocalRunOptions opts;
  opts.deferred_delivery_for_testing = true;
  run_local_ranks(
      P,
      [&](Communicator& c) {
        const int r = c.rank(), from = ring_peers(P, r, RingDirection::forward).from;
        std::string& e = errors[static_cast<size_t>(r)];
        const auto expect_error = [&](const std::string& what, const std::function<void()>& fn,
                                      const std::string& words) {
          const std::string got = test::error_of(fn);
          if (got.find(words) == std::string::npos)
            e += what + ": expected '" + words + "', got '" + got + "'; ";
        };
        const std::string me =
            cat(" on rank ", r, " of ", P, " (deferred delivery, a test mode): its ");
        const std::int64_t n = 4;
        TensorD mine({n}), got({n});
        for (std::int64_t i = 0; i < n; ++i) mine[i] = 10.0 * r + double(i);
        PendingCollective p = c.start_ring_shift(mine.data(), n, got.data(), n, "kv_ring");
        // What a ring attention would compute before its wait: it must see NaN.
        double early = 0;
        for (std::int64_t i = 0; i < n; ++i) early += got[i];
        if (!std::isnan(early)) e += "recv readable before the wait; ";
        c.wait(p);
        for (std::int64_t i = 0; i < n; ++i)
          if (got[i] != 10.0 * from + double(i)) e += "result wrong after the wait; ";

        p = c.start_ring_shift(mine.data(), n, got.data(), n, "kv_send_changed");
        mine[1] += 1;
        expect_error(
            "changed send", [&] { c.wait(p); },
            "ring_shift 'kv_send_changed'" + me +
                "send buffer changed between the start and wait()");
        p = c.start_ring_shift(mine.data(), n, got.data(), n, "kv_recv_written",
                               RingDirection::backward);
        got[0] = 0;
        expect_error(
            "written recv", [&] { c.wait(p); },
            "ring_shift 'kv_recv_written'" + me +
                "recv buffer was written between the start and wait()");
        {
          TensorD block({n});
          block.fill(3.0);
          p = c.start_ring_shift(block.data(), n, got.data(), n, "kv_send_freed");
          block.reset();
          TensorD reused({n});
          reused.fill(3.0);
          expect_error(
              "released send", [&] { c.wait(p); },
              "ring_shift 'kv_send_freed'" + me + "send buffer was released before wait()");
        }
        c.barrier("still_in_step");
      },
      opts);
  for (int r = 0; r < P; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

// Rank 1 of 3 misbehaves in one forward ring_shift of 2 floats (8 bytes),
// copying from rank 0: the ledger check stops it and rank 0, whose bytes it
// took wrongly; rank 2 (receiving from rank 1, sending to rank 0) is fine.
TEST(RingShift, TransportFaultsAreCaughtByTheMeasuredLedger) {
  const int P = 3;
  struct Case {
    TransportFault fault;
    std::string rank1, rank0;
  };
  const std::vector<Case> cases{
      {TransportFault::short_send, test::ring_mismatch_head(P, 1, 8, 8, 8, 4),
       test::ring_mismatch_head(P, 0, 8, 8, 4, 8)},
      // Read from its own send buffer: the totals agree, the peers do not.
      {TransportFault::wrong_peer,
       test::ring_mismatch_head(P, 1, 8, 8, 8, 8) +
           " (per peer, derived/measured: rank 0: sent 0/0, received 8/0; rank 1: sent 0/0, "
           "received 0/8)",
       test::ring_mismatch_head(P, 0, 8, 8, 0, 8)},
      {TransportFault::skip_peer, test::ring_mismatch_head(P, 1, 8, 8, 8, 0),
       test::ring_mismatch_head(P, 0, 8, 8, 0, 8)},
  };
  for (const Case& k : cases) {
    std::vector<std::string> errors(P);
    run_local_ranks(P, [&](Communicator& c) {
      errors[c.rank()] = test::faulty_ring_shift(c, k.fault, c.rank() == 1);
    });
    EXPECT_EQ(errors[1].rfind(k.rank1, 0), 0u) << errors[1];
    EXPECT_NE(errors[1].find("the local backend lost or misdirected data"), std::string::npos)
        << errors[1];
    EXPECT_EQ(errors[0].rfind(k.rank0, 0), 0u) << errors[0];
    EXPECT_EQ(errors[2], "");
  }
  run_local_ranks(P, [&](Communicator& c) {
    EXPECT_EQ(test::faulty_ring_shift(c, TransportFault::short_send, false), "");
  });
}

// The observer hears a ring_shift as its kind, with its derived bytes, and a
// started one's wait: what the planner's timeline replays.
TEST(RingShift, ObserverHearsTheKindAndTheWait) {
  run_local_ranks(2, [](Communicator& c) {
    std::vector<CollectiveEvent> events;
    c.set_observer([&](const CollectiveEvent& e) { events.push_back(e); });
    std::vector<float> send(3, 1.0f), recv(3);
    c.ring_shift(send.data(), 3, recv.data(), 3, "kv_ring");
    PendingCollective p = c.start_ring_shift(send.data(), 3, recv.data(), 3, "kv_ring");
    c.wait(p);
    ASSERT_EQ(events.size(), 3u);
    EXPECT_EQ(events[0].kind, CollectiveKind::ring_shift);
    EXPECT_EQ(events[0].bytes.sent, 12);
    EXPECT_EQ(events[0].bytes.received, 12);
    EXPECT_FALSE(events[0].started);
    EXPECT_TRUE(events[1].started);
    EXPECT_EQ(events[2].what, CollectiveEvent::What::waited);
    EXPECT_EQ(events[2].id, events[1].id);
  });
}

// The link model's charge: one message to a neighbour, a + m / b on every
// topology; over nodes, the step's slowest message, one that crosses.
TEST(LinkModel, RingShiftIsOneNeighbourMessage) {
  const double a = 2e-6, b = 1e9;
  const WireBytes w{4000, 3000};
  for (Topology t : {Topology::switched, Topology::full_mesh, Topology::ring})
    for (int P : {2, 3, 8})
      EXPECT_DOUBLE_EQ(
          collective_seconds(CollectiveKind::ring_shift, P, w, single_level({b, a, t})), a + 4e-6)
          << to_string(t) << " P " << P;
  EXPECT_EQ(collective_seconds(CollectiveKind::ring_shift, 1, w, single_level({b, a})), 0);
  const LinkModel in{100e9, 1e-6}, out{10e9, 5e-6};
  const Fabric f{in, out, 4};
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::ring_shift, 16, w, f), 5e-6 + 4000 / 10e9);
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::ring_shift, 4, w, f), 1e-6 + 4000 / 100e9);
  // An inter link faster than the intra one: the intra message bounds the step.
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::ring_shift, 16, w, Fabric{out, in, 4}),
                   5e-6 + 4000 / 10e9);
  // 4 of the 16 neighbour messages cross nodes; 3 of 10 on nodes of 4, 4, 2.
  EXPECT_DOUBLE_EQ(node_crossing_share(CollectiveKind::ring_shift, 16, 4), 4.0 / 16);
  EXPECT_DOUBLE_EQ(node_crossing_share(CollectiveKind::ring_shift, 10, 4), 3.0 / 10);
  EXPECT_EQ(node_crossing_share(CollectiveKind::ring_shift, 4, 4), 0);
}

// Under a link model a ring_shift holds the rank its modelled time, and a
// started one lets the rank compute meanwhile: wait returns at the
// modelled completion.
TEST(RingShift, LinkModelHoldsTheModelledTimeAndStartedOverlaps) {
  const LinkModel link{100e6, 200e-6};
  const std::int64_t n = 25000;               // 100 kB: 1.2 ms with the latency
  const double t = 200e-6 + 4.0 * n / 100e6;  // a + m / b, written out
  std::vector<std::string> errors(3);
  run_local_ranks(3, [&](Communicator& c) {
    c.set_link_model(&link);
    std::vector<float> send(n, 1.0f), recv(n);
    auto t0 = Clock::now();
    c.ring_shift(send.data(), n, recv.data(), n, "kv_ring");
    if (seconds_since(t0) < t) errors[c.rank()] += "blocking call shorter than modelled; ";
    t0 = Clock::now();
    PendingCollective p = c.start_ring_shift(send.data(), n, recv.data(), n, "kv_ring");
    if (!p.pending()) errors[c.rank()] += "not pending; ";
    c.wait(p);
    if (seconds_since(t0) < t) errors[c.rank()] += "wait returned before the modelled time; ";
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// ---- the reduction-order switch (set_reduction_order_seed,
// `laga train --perturb-reductions`).

// Every rank's run_reductions result on P local ranks under `seed`; the
// switch is reset afterwards, also when a rank throws.
std::vector<std::vector<float>> reductions_under(int P, std::optional<std::uint64_t> seed) {
  struct Reset {
    ~Reset() { set_reduction_order_seed(std::nullopt); }
  } reset;
  set_reduction_order_seed(seed);
  std::vector<std::vector<float>> out(static_cast<size_t>(P));
  run_local_ranks(P,
                  [&](Communicator& c) { out[size_t(c.rank())] = test::run_reductions<float>(c); });
  return out;
}

bool bitwise_equal(const std::vector<std::vector<float>>& a,
                   const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t r = 0; r < a.size(); ++r)
    if (a[r].size() != b[r].size() ||
        std::memcmp(a[r].data(), b[r].data(), a[r].size() * sizeof(float)) != 0)
      return false;
  return true;
}

TEST(PerturbedReductions, OffByDefaultAndOffAgainIsRankOrder) {
  EXPECT_FALSE(reduction_order_seed().has_value());
  for (int P : {2, 3, 4}) {
    const auto before = reductions_under(P, std::nullopt);
    // The serial reference adds in rank order: off is exactly today's sum.
    run_local_ranks(P, [&](Communicator& c) {
      EXPECT_EQ(test::check_against_serial(test::run_sequence<float>(c), P, c.rank()), "");
    });
    (void)reductions_under(P, 7);
    EXPECT_FALSE(reduction_order_seed().has_value());
    EXPECT_TRUE(bitwise_equal(reductions_under(P, std::nullopt), before)) << "P " << P;
  }
}

TEST(PerturbedReductions, ASeedChangesTheLastBitsAtThreeRanksOrMore) {
  for (int P : {3, 4, 8}) {
    const auto plain = reductions_under(P, std::nullopt);
    int differing = 0;
    for (std::uint64_t seed = 1; seed <= 4; ++seed) {
      const auto a = reductions_under(P, seed);
      // The same seed twice: the same bits (a run stays deterministic).
      EXPECT_TRUE(bitwise_equal(a, reductions_under(P, seed))) << "P " << P << " seed " << seed;
      if (!bitwise_equal(a, plain)) ++differing;
      // Only the rounding moves: every element within a few ulps of the sum's
      // magnitude (inputs reach 2^10 * a normal, so 1e-3 absolute is loose).
      for (size_t r = 0; r < a.size(); ++r)
        for (size_t i = 0; i < a[r].size(); ++i)
          ASSERT_NEAR(a[r][i], plain[r][i], 1e-3) << "P " << P << " rank " << r << " i " << i;
    }
    EXPECT_GT(differing, 0) << "P " << P << ": no seed of 1..4 changed a bit";
  }
}

TEST(PerturbedReductions, TwoRanksCannotBePerturbed) {
  // a + b == b + a in IEEE arithmetic: at P = 2 every order is rank order.
  const auto plain = reductions_under(2, std::nullopt);
  for (std::uint64_t seed = 1; seed <= 4; ++seed)
    EXPECT_TRUE(bitwise_equal(reductions_under(2, seed), plain)) << "seed " << seed;
}

}  // namespace
}  // namespace laga
