// The MPI backend, run under `mpirun -np N` (N = 2, 3, 4, 8 in CTest).
//
// Each process runs the shared collective sequence on MPI and, in threads,
// on an in-process group of the same size with the same inputs; rank r's MPI
// results must equal the in-process rank r's bit for bit, and the serial
// reference. Then the failure modes: a collective mismatch is named at once,
// and a rank that skips a collective makes its peers time out naming it,
// after which the job still ends cleanly (no orphaned messages, MPI_Finalize).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "comm/local_comm.hpp"
#include "comm/mpi_comm.hpp"
#include "comm_cases.hpp"
#include "common/error_of.hpp"
#include "core/error.hpp"
#include "ring_shift_cases.hpp"

namespace laga {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::Results;

template <class T>
void check_against_local(MpiCommunicator& comm) {
  const int P = comm.size(), r = comm.rank();
  comm.ledger().clear();
  Results<T> mpi = test::run_sequence<T>(comm);
  std::vector<Results<T>> local(P);
  run_local_ranks(P, [&](Communicator& c) { local[c.rank()] = test::run_sequence<T>(c); });
  EXPECT_EQ(test::check_against_serial(mpi, P, r), "") << "rank " << r << " of " << P;
  EXPECT_EQ(test::check_ledger(mpi.ledger, P, r, sizeof(T)), "") << "rank " << r << " of " << P;
  EXPECT_EQ(test::compare_bitwise(mpi, local[r]), "") << "rank " << r << " of " << P;
}

TEST(MpiComm, MatchesInProcessBitForBitF32) {
  MpiCommunicator comm;
  EXPECT_EQ(comm.backend(), Backend::mpi);
  check_against_local<float>(comm);
}

TEST(MpiComm, MatchesInProcessBitForBitF64) {
  MpiCommunicator comm;
  check_against_local<double>(comm);
}

TEST(MpiComm, MatchesInProcessBitForBitBf16) {
  MpiCommunicator comm;
  const int P = comm.size(), r = comm.rank();
  const test::Bf16Results mpi = test::run_bf16_sequence(comm);
  std::vector<test::Bf16Results> local(static_cast<size_t>(P));
  run_local_ranks(P,
                  [&](Communicator& c) { local[size_t(c.rank())] = test::run_bf16_sequence(c); });
  EXPECT_EQ(test::check_bf16_against_serial(mpi, P, r), "") << "rank " << r << " of " << P;
  const test::Bf16Results& mine = local[size_t(r)];
  EXPECT_TRUE(mpi.a2a == mine.a2a && mpi.ag == mine.ag && mpi.rs == mine.rs && mpi.ar == mine.ar)
      << "rank " << r << " of " << P << ": MPI's bf16 results differ from in-process ones";
}

// Under the reduction-order switch (set_reduction_order_seed) the MPI
// reductions still equal the in-process ones bit for bit, seed by seed, and
// differ from rank order for some seed once P >= 3 (a + b is commutative, so
// P = 2 cannot move).
TEST(MpiComm, PerturbedReductionsMatchInProcessBitForBit) {
  MpiCommunicator comm;
  const int P = comm.size(), r = comm.rank();
  const std::vector<float> plain = test::run_reductions<float>(comm);
  int differing = 0;
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    set_reduction_order_seed(seed);
    const std::vector<float> mpi = test::run_reductions<float>(comm);
    std::vector<std::vector<float>> local(static_cast<size_t>(P));
    run_local_ranks(
        P, [&](Communicator& c) { local[size_t(c.rank())] = test::run_reductions<float>(c); });
    set_reduction_order_seed(std::nullopt);
    ASSERT_EQ(mpi.size(), local[size_t(r)].size());
    EXPECT_EQ(std::memcmp(mpi.data(), local[size_t(r)].data(), mpi.size() * sizeof(float)), 0)
        << "rank " << r << " of " << P << ", seed " << seed;
    if (std::memcmp(mpi.data(), plain.data(), mpi.size() * sizeof(float)) != 0) ++differing;
  }
  // Every rank's own verdict: rank r's share of the results may by chance be
  // unmoved, so the group's count is what is checked.
  double moved = differing;
  comm.all_reduce(&moved, 1, "differing");
  if (P >= 3) {
    EXPECT_GT(moved, 0) << "no seed of 1..4 moved a bit at P " << P;
  } else {
    EXPECT_EQ(moved, 0) << "at P " << P << " every order is rank order";
  }
}

// Under a link model every collective takes at least its modelled time, and
// the results and the ledger are bit for bit those of the unshaped run.
TEST(MpiComm, LinkModelSetsAFloorAndChangesNothingElse) {
  MpiCommunicator plain, shaped;
  const LinkModel link{200e6, 300e-6};
  shaped.set_link_model(&link);
  const test::Results<float> a = test::run_sequence<float>(plain);
  const test::Results<float> b = test::run_sequence<float>(shaped);
  EXPECT_EQ(test::compare_bitwise(a, b), "");
  EXPECT_EQ(test::check_ledger(b.ledger, shaped.size(), shaped.rank(), sizeof(float)), "");
  EXPECT_EQ(test::check_link_floor(shaped, link), "");
}

TEST(MpiComm, MessagesSplitIntoPiecesGiveTheSameResults) {
  MpiCommunicator comm;
  comm.set_max_message_bytes(52);  // not a multiple of either element size
  check_against_local<float>(comm);
  check_against_local<double>(comm);
}

TEST(MpiComm, MismatchedLabelIsNamedWithoutWaitingForTheTimeout) {
  MpiCommunicator comm;
  comm.set_timeout(20s);
  const int P = comm.size();
  const auto t0 = Clock::now();
  std::vector<float> shard(3, 1.0f), all(3 * P);
  test::I64s counts(P, 3), displs(P);
  for (int j = 0; j < P; ++j) displs[j] = 3 * j;
  try {
    comm.all_gather_v(shard.data(), 3, all.data(), counts.data(), displs.data(),
                      comm.rank() == 1 ? "k_ag" : "latent_ag");
    ADD_FAILURE() << "expected a mismatch error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("collective mismatch"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0);
  // The communicator is out of step now and says so.
  EXPECT_THROW(comm.barrier("after"), Error);
  MpiCommunicator fresh;
  fresh.barrier("resync");
}

TEST(MpiComm, WrongCountIsNamedAndStopsEveryRankPromptly) {
  // With n = 8 on all ranks but the last (n = 7), for P in {2, 3, 4, 8} some
  // rank receives a message of the wrong size; it fails and its notice stops
  // the ranks still waiting for it, long before the timeout.
  MpiCommunicator comm;
  comm.set_timeout(20s);
  const int P = comm.size();
  std::vector<double> buf(8, 1.0);
  const auto t0 = Clock::now();
  try {
    comm.all_reduce(buf.data(), comm.rank() == P - 1 ? 7 : 8, "grad_ar");
    ADD_FAILURE() << "expected a size error or a peer's failure notice";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("all_reduce 'grad_ar'"), std::string::npos) << m;
    EXPECT_TRUE(m.find("elements from rank") != std::string::npos ||
                m.find("failed (") != std::string::npos)
        << m;
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0);
  MpiCommunicator fresh;
  fresh.barrier("resync");
}

TEST(MpiComm, SkippedCollectiveTimesOutNamingLabelAndRank) {
  MpiCommunicator comm;
  comm.set_timeout(1500ms);
  const int P = comm.size(), skipper = P - 1;
  std::vector<float> shard(4, 2.0f), all(4 * P);
  test::I64s counts(P, 4), displs(P);
  for (int j = 0; j < P; ++j) displs[j] = 4 * j;
  if (comm.rank() == skipper) {
    std::this_thread::sleep_for(3000ms);  // past the peers' timeout, never calling it
  } else {
    const auto t0 = Clock::now();
    try {
      comm.all_gather_v(shard.data(), 4, all.data(), counts.data(), displs.data(), "skipped_ag");
      ADD_FAILURE() << "expected a timeout";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("all_gather 'skipped_ag'"), std::string::npos) << m;
      EXPECT_NE(m.find(cat("timed out after 1500 ms waiting for rank(s) ", skipper)),
                std::string::npos)
          << m;
    }
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    EXPECT_GT(waited, 1.4);
    EXPECT_LT(waited, 2.9) << "peers must stop at their timeout, not wait for rank " << skipper;
    EXPECT_THROW(comm.barrier("after"), Error);
  }
  MpiCommunicator fresh;
  fresh.barrier("resync");
  EXPECT_EQ(mpi_orphaned_requests(), 0) << "small messages must not be left pending";
}

TEST(MpiComm, BadCallsGiveTheSameErrorsAsTheOtherBackends) {
  // The list test_comm_local runs on the in-process, dry-run and self
  // backends: the same text on every rank of every size.
  for (const test::BadCall& bad : test::bad_calls()) {
    MpiCommunicator comm;
    if (comm.size() < bad.min_ranks) continue;
    EXPECT_EQ(test::error_of(bad.call, comm), bad.expected(comm.size(), comm.rank())) << bad.name;
  }
  MpiCommunicator fresh;
  fresh.barrier("resync");
}

// The last rank misbehaves in `faulty_call` (faulty_all_to_all,
// faulty_ring_shift), in its first send, to rank 0, once per fault: its own
// ledger check names the mismatch, its error starting with
// want(fault, P, last rank) and naming the MPI backend; rank 0,
// short-changed, stops on the short message or on the faulty rank's failure
// notice; other ranks may complete the call. Every rank ends within 10 s.
void expect_transport_faults_caught(
    const std::function<std::string(Communicator&, TransportFault, bool inject)>& faulty_call,
    const std::function<std::string(TransportFault, int P, int f)>& want) {
  for (TransportFault fault :
       {TransportFault::short_send, TransportFault::wrong_peer, TransportFault::skip_peer}) {
    MpiCommunicator comm;
    comm.set_timeout(20s);
    const int P = comm.size(), f = P - 1;
    const auto t0 = Clock::now();
    const std::string err = faulty_call(comm, fault, comm.rank() == f);
    if (comm.rank() == f) {
      EXPECT_EQ(err.rfind(want(fault, P, f), 0), 0u) << err;
      EXPECT_NE(err.find("the mpi backend lost or misdirected data"), std::string::npos) << err;
    } else if (comm.rank() == 0) {
      EXPECT_NE(err, "") << "rank 0 did not get its block from rank " << f;
    }
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0);
    MpiCommunicator fresh;
    fresh.barrier("resync");
  }
}

TEST(MpiComm, TransportFaultsAreCaughtByTheMeasuredLedger) {
  // An all_to_all_v of 2 floats (8 bytes) per peer.
  expect_transport_faults_caught(
      [](Communicator& c, TransportFault fault, bool inject) {
        return test::faulty_all_to_all(c, fault, inject);
      },
      [](TransportFault fault, int P, int f) {
        const std::int64_t d = 8 * (P - 1);
        if (fault == TransportFault::short_send) return test::mismatch_head(P, f, d, d, d - 4, d);
        if (fault == TransportFault::skip_peer) return test::mismatch_head(P, f, d, d, d - 8, d);
        return test::mismatch_head(P, f, d, d, d, d) +
               " (per peer, derived/measured: rank 0: sent 8/0, received 8/8; rank 1: sent ";
      });
}

template <class T>
void check_ring_against_local(MpiCommunicator& comm) {
  const int P = comm.size(), r = comm.rank();
  comm.ledger().clear();
  const test::RingResults<T> mpi = test::run_ring_shifts<T>(comm);
  std::vector<test::RingResults<T>> local(P);
  run_local_ranks(P, [&](Communicator& c) { local[c.rank()] = test::run_ring_shifts<T>(c); });
  EXPECT_EQ(test::check_ring_against_serial(mpi, P, r), "") << "rank " << r << " of " << P;
  EXPECT_EQ(test::check_ring_ledger(mpi.ledger, P, r, sizeof(T)), "")
      << "rank " << r << " of " << P;
  EXPECT_EQ(test::compare_ring_bitwise(mpi, local[r]), "") << "rank " << r << " of " << P;
}

TEST(MpiRingShift, BlocksLandOnTheNeighbourAsInProcess) {
  MpiCommunicator comm;
  comm.set_timeout(20s);  // a block sent the wrong way fails here, not at CTest's limit
  check_ring_against_local<float>(comm);
  check_ring_against_local<double>(comm);
  comm.set_max_message_bytes(52);  // the long block in pieces
  check_ring_against_local<float>(comm);
}

// Rings of every size and stride that tile P (Ring): each rank's arrivals are
// its own ring's blocks, and the ledger one block each way per shift.
TEST(MpiRingShift, RingsOfConsecutiveRanksPassTheirOwnBlocks) {
  MpiCommunicator comm;
  comm.set_timeout(20s);
  const int P = comm.size();
  for (int size = 1; size <= P; ++size)
    for (int stride = 1; size * stride <= P; ++stride) {
      if (P % (size * stride) != 0) continue;
      comm.ledger().clear();
      EXPECT_EQ(test::check_rings_of<double>(comm, size, stride), "")
          << "rank " << comm.rank() << " of " << P << " in rings of " << size << ", stride "
          << stride;
    }
}

TEST(MpiRingShift, CountOnlyIsRecordedAsDerived) {
  MpiCommunicator comm;
  comm.set_timeout(20s);
  const int P = comm.size(), r = comm.rank();
  const int from = ring_peers(P, r, RingDirection::forward).from;
  comm.ring_shift(static_cast<const double*>(nullptr), test::ring_count(P, r),
                  static_cast<double*>(nullptr), test::ring_count(P, from), "kv_ring");
  std::map<std::pair<Phase, std::string>, LedgerEntry> want;
  LedgerEntry& e = want[{Phase::forward, "kv_ring"}];
  e.calls = 1;
  e.bytes_sent = 8 * test::ring_count(P, r);
  e.bytes_received = 8 * test::ring_count(P, from);
  EXPECT_EQ(test::check_ledger_against(comm.ledger(), want), "");
}

TEST(MpiRingShift, WrongRecvCountIsNamedWithThePeer) {
  // Rank 1 expects one element more than rank 0 sends it.
  MpiCommunicator comm;
  comm.set_timeout(20s);
  const int P = comm.size(), r = comm.rank();
  std::vector<float> send(4, 1.0f), recv(4);
  const auto t0 = Clock::now();
  const std::string err = test::error_of(
      [&] { comm.ring_shift(send.data(), 2, recv.data(), r == 1 ? 3 : 2, "kv_ring"); });
  if (r == 1) {
    EXPECT_EQ(err, cat("ring_shift 'kv_ring' on rank 1 of ", P,
                       ": rank 1 expects 3 elements from rank 0 but rank 0 sends it 2; each rank's "
                       "recv_count must equal the send_count of the rank it receives from, and "
                       "count-only must be on for all ranks of a call or for none"));
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0);
  MpiCommunicator fresh;
  fresh.barrier("resync");
}

TEST(MpiRingShift, SkippedShiftTimesOutOnTheRankReceivingFromIt) {
  // The last rank never calls: rank 0, which receives from it, times out
  // naming it; the others only wait for their own neighbours and may finish.
  MpiCommunicator comm;
  comm.set_timeout(1500ms);
  const int P = comm.size(), skipper = P - 1;
  std::vector<float> send(4, 2.0f), recv(4);
  if (comm.rank() == skipper) {
    std::this_thread::sleep_for(3000ms);
  } else {
    const auto t0 = Clock::now();
    const std::string err =
        test::error_of([&] { comm.ring_shift(send.data(), 4, recv.data(), 4, "skipped_ring"); });
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    if (comm.rank() == 0) {
      EXPECT_EQ(err.rfind(cat("ring_shift 'skipped_ring' on rank 0 of ", P,
                              " timed out after 1500 ms waiting for rank(s) ", skipper),
                          0),
                0u)
          << err;
      EXPECT_GT(waited, 1.4);
      EXPECT_LT(waited, 2.9) << "rank 0 must stop at its timeout";
    }
  }
  MpiCommunicator fresh;
  fresh.barrier("resync");
  EXPECT_EQ(mpi_orphaned_requests(), 0) << "small messages must not be left pending";
}

TEST(MpiRingShift, TransportFaultsAreCaughtByTheMeasuredLedger) {
  // Its one send of 2 floats (8 bytes), to rank 0.
  expect_transport_faults_caught(test::faulty_ring_shift, [](TransportFault fault, int P, int f) {
    if (fault == TransportFault::short_send) return test::ring_mismatch_head(P, f, 8, 8, 4, 8);
    if (fault == TransportFault::skip_peer) return test::ring_mismatch_head(P, f, 8, 8, 0, 8);
    return test::ring_mismatch_head(P, f, 8, 8, 8, 8) +
           " (per peer, derived/measured: rank 0: sent 8/0, received ";
  });
}

}  // namespace
}  // namespace laga

int main(int argc, char** argv) {
  laga::MpiSession mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (mpi.world_rank() != 0) {
    // One report is enough; a failing rank still fails the run through its
    // exit code, and its failure messages still print.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  return RUN_ALL_TESTS();
}
