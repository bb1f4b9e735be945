// The ledger, the self communicator and the in-process backend's
// collectives: results against serial computation for P in {1, 2, 3, 4, 8},
// f32, f64 and bf16, ledgers against the closed form, staging and count-only
// buffers, the link model (its costs and the floor it sets), started
// collectives (the link model's overlap; deferred delivery), and the
// reduction-order switch. One binary, test_comm_local, with
// test_comm_local_failure.cpp (the failure modes) and test_comm_local_ring.cpp
// (ring_shift); local_ranks.hpp holds what the three share.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <optional>
#include <thread>
#include <utility>

#include "comm/communicator.hpp"
#include "comm/link_model.hpp"
#include "comm/local_comm.hpp"
#include "comm_cases.hpp"
#include "common/error_of.hpp"
#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "core/tensor.hpp"
#include "local_ranks.hpp"

namespace laga {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::errors_of;
using test::I64s;
using test::Results;

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
        const std::string me = test::deferred_where(r, P);
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
          test::note_unless_refused(
              e, "released send", [&] { c.wait(p); },
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
          test::note_unless_refused(
              e, "released reduce-scatter send", [&] { c.wait(p); },
              "reduce_scatter 'rs_send_freed'" + me + "send block 0 was released");
        }
        p = c.start_all_gather_v(mine.data(), n, gathered.data(), counts.data(), displs.data(),
                                 "ag_send_changed");
        mine[0] += 1;
        test::note_unless_refused(
            e, "changed send", [&] { c.wait(p); },
            "all_gather 'ag_send_changed'" + me +
                "send buffer changed between the start and wait()");
        {
          TensorF into({n * P});
          p = c.start_all_gather_v(mine.data(), n, into.data(), counts.data(), displs.data(),
                                   "ag_recv_freed");
          into.reset();
          test::note_unless_refused(
              e, "released recv", [&] { c.wait(p); },
              "all_gather 'ag_recv_freed'" + me + "recv block 0 was released");
        }
        p = c.start_reduce_scatter_v(send.data(), counts.data(), displs.data(), mine_sum.data(),
                                     "rs_recv_written");
        mine_sum[n - 1] = 0;
        test::note_unless_refused(
            e, "written recv", [&] { c.wait(p); },
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
        test::note_unless_refused(
            e, "plain memory",
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
    if (!test::same_bits(a[r], b[r])) return false;
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
