// ring_shift on the in-process, self and dry-run backends: the ring
// neighbours and wire bytes, blocks against each neighbour's for P 1 to 8
// (f32 and f64), rings of a size and stride, count-only and dry runs, the
// refusals and the timeout, deferred delivery, transport faults, the
// observer, and the link model's charge and floor. Part of test_comm_local
// (test_comm_local.cpp); the cases are ring_shift_cases.hpp.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/dry_run_comm.hpp"
#include "comm/link_model.hpp"
#include "comm/local_comm.hpp"
#include "common/error_of.hpp"
#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "core/tensor.hpp"
#include "local_ranks.hpp"
#include "ring_shift_cases.hpp"

namespace laga {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::errors_of;
using test::seconds_since;

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
        const std::string me = test::deferred_where(r, P);
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
        test::note_unless_refused(
            e, "changed send", [&] { c.wait(p); },
            "ring_shift 'kv_send_changed'" + me +
                "send buffer changed between the start and wait()");
        p = c.start_ring_shift(mine.data(), n, got.data(), n, "kv_recv_written",
                               RingDirection::backward);
        got[0] = 0;
        test::note_unless_refused(
            e, "written recv", [&] { c.wait(p); },
            "ring_shift 'kv_recv_written'" + me +
                "recv buffer was written between the start and wait()");
        {
          TensorD block({n});
          block.fill(3.0);
          p = c.start_ring_shift(block.data(), n, got.data(), n, "kv_send_freed");
          block.reset();
          TensorD reused({n});
          reused.fill(3.0);
          test::note_unless_refused(
              e, "released send", [&] { c.wait(p); },
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
  const std::vector<test::TransportFaultCase> cases{
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
  test::expect_transport_faults_caught(cases, test::faulty_ring_shift);
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

}  // namespace
}  // namespace laga
