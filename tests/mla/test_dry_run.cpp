// DryRunCommunicator (src/comm/dry_run_comm.hpp) and the modes `laga compare`
// builds on it:
//  - its ledger equals the in-process backend's, rank by rank, for every
//    collective with uneven counts;
//  - its receive buffers hold what the header promises (own data, copies);
//  - one MLA block: a real full run (P threads), a real dry run of each rank
//    alone, a count-only dry run of each rank, and a count-only full run all
//    report the same bytes per (phase, label) and the same pool peaks (laga
//    with the query-latent exchange too);
//  - at P = 1 a dry run IS a real run: outputs equal bit for bit.
// (Lives in tests/mla, whose CMakeLists globs test_*.cpp; it needs laga_mla.)
#include <gtest/gtest.h>

#include <vector>

#include "comm/dry_run_comm.hpp"
#include "comm/local_comm.hpp"
#include "common/block_inputs.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "mla/layout.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

using Counts = std::vector<std::int64_t>;

// The same sequence of collectives on any communicator: uneven all-to-all
// (rank r sends r + 2 j + 1 elements to j), all-gather of r + 3 elements,
// reduce-scatter with counts j + 2, an all-reduce of 11, a barrier.
void exercise(Communicator& comm) {
  const int P = comm.size(), r = comm.rank();
  Counts sc(P), rc(P);
  for (int j = 0; j < P; ++j) sc[j] = r + 2 * j + 1, rc[j] = j + 2 * r + 1;
  std::vector<float> send(static_cast<size_t>(total_of(sc)), 1.f),
      recv(static_cast<size_t>(total_of(rc)));
  const Counts sd = offsets_of(sc), rd = offsets_of(rc);
  comm.set_phase(Phase::forward);
  comm.all_to_all_v(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), "a2a");
  Counts gc(P);
  for (int j = 0; j < P; ++j) gc[j] = j + 3;
  std::vector<double> mine(static_cast<size_t>(r + 3), 2.0),
      gathered(static_cast<size_t>(total_of(gc)));
  const Counts gd = offsets_of(gc);
  comm.all_gather_v(mine.data(), r + 3, gathered.data(), gc.data(), gd.data(), "ag");
  comm.set_phase(Phase::backward);
  Counts c(P);
  for (int j = 0; j < P; ++j) c[j] = j + 2;
  std::vector<float> full(static_cast<size_t>(total_of(c)), 1.f), own(static_cast<size_t>(c[r]));
  const Counts cd = offsets_of(c);
  comm.reduce_scatter_v(full.data(), c.data(), cd.data(), own.data(), "rs");
  comm.set_phase(Phase::grad_sync);
  std::vector<float> buf(11, 1.f);
  comm.all_reduce(buf.data(), 11, "ar");
  comm.barrier("bar");
}

TEST(DryRunComm, LedgerEqualsTheInProcessBackend) {
  for (int P : {1, 2, 3, 5}) {
    std::vector<Ledger> real(static_cast<size_t>(P));
    run_local_ranks(P, [&](Communicator& comm) {
      exercise(comm);
      real[static_cast<size_t>(comm.rank())] = comm.ledger();
    });
    for (int r = 0; r < P; ++r) {
      DryRunCommunicator dry(r, P);
      exercise(dry);
      const auto& a = real[static_cast<size_t>(r)].entries();
      const auto& b = dry.ledger().entries();
      ASSERT_EQ(a.size(), b.size()) << "P=" << P << " rank " << r;
      for (const auto& [key, e] : a) {
        const auto it = b.find(key);
        ASSERT_NE(it, b.end()) << key.second;
        EXPECT_EQ(it->second.calls, e.calls) << key.second;
        EXPECT_EQ(it->second.bytes_sent, e.bytes_sent)
            << "P=" << P << " rank " << r << " " << key.second;
        EXPECT_EQ(it->second.bytes_received, e.bytes_received)
            << "P=" << P << " rank " << r << " " << key.second;
      }
    }
  }
}

TEST(DryRunComm, ReceiveBuffersHoldOwnDataAndCopiesOfIt) {
  DryRunCommunicator comm(1, 3);
  EXPECT_EQ(comm.rank(), 1);
  EXPECT_EQ(comm.size(), 3);
  // all-to-all: own block {10, 11} to slot 1; peers get it cycled/cut.
  const Counts sc{1, 2, 3}, rc{3, 2, 1};
  const std::vector<float> send{0, 10, 11, 0, 0, 0};
  std::vector<float> recv(6, -1);
  const Counts sd = offsets_of(sc), rd = offsets_of(rc);
  comm.all_to_all_v(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), "x");
  EXPECT_EQ(recv, (std::vector<float>{10, 11, 10, 10, 11, 10}));
  // all-gather: own shard in its slot, copies elsewhere.
  const Counts gc{1, 2, 3};
  const std::vector<float> mine{5, 6};
  std::vector<float> g(6, -1);
  const Counts gd = offsets_of(gc);
  comm.all_gather_v(mine.data(), 2, g.data(), gc.data(), gd.data(), "g");
  EXPECT_EQ(g, (std::vector<float>{5, 5, 6, 5, 6, 5}));
  // reduce-scatter: the own contribution only.
  const Counts c{1, 2, 1};
  const std::vector<float> full{1, 2, 3, 4};
  std::vector<float> own(2, -1);
  const Counts cd = offsets_of(c);
  comm.reduce_scatter_v(full.data(), c.data(), cd.data(), own.data(), "r");
  EXPECT_EQ(own, (std::vector<float>{2, 3}));
  // all-reduce: unchanged.
  std::vector<float> buf{1, 2, 3};
  comm.all_reduce(buf.data(), 3, "a");
  EXPECT_EQ(buf, (std::vector<float>{1, 2, 3}));
  // Mismatched own counts and bad ranks are named.
  const Counts bad{1, 5, 3};
  EXPECT_THROW(
      comm.all_to_all_v(send.data(), sc.data(), sd.data(), recv.data(), bad.data(), rd.data(), "x"),
      Error);
  EXPECT_THROW(DryRunCommunicator(3, 3), Error);
}

// ---------------------------------------------------------------- the block

MlaConfig small_config(std::int64_t rq = 0) {
  MlaConfig c;
  c.dim = 32, c.n_heads = 5, c.q_lora_rank = rq, c.kv_lora_rank = 16, c.qk_nope_head_dim = 8,
  c.qk_rope_head_dim = 4, c.v_head_dim = 6;
  c.validate();
  return c;
}

struct Measured {
  Ledger ledger;
  RankMemory memory;
};

void expect_same(const Measured& a, const Measured& b, const std::string& what) {
  EXPECT_EQ(a.memory.peak_activations, b.memory.peak_activations) << what;
  EXPECT_EQ(a.memory.peak_comm_buffers, b.memory.peak_comm_buffers) << what;
  EXPECT_EQ(a.memory.peak_working, b.memory.peak_working) << what;
  EXPECT_EQ(a.memory.gradients, b.memory.gradients) << what;
  const auto& ea = a.ledger.entries();
  const auto& eb = b.ledger.entries();
  ASSERT_EQ(ea.size(), eb.size()) << what;
  for (const auto& [key, e] : ea) {
    const auto it = eb.find(key);
    ASSERT_NE(it, eb.end()) << what << " " << key.second;
    EXPECT_EQ(e.bytes_sent, it->second.bytes_sent)
        << what << " " << to_string(key.first) << "/" << key.second;
    EXPECT_EQ(e.bytes_received, it->second.bytes_received) << what << " " << key.second;
  }
}

// One rank alone on a dry-run communicator, real or count-only.
Measured dry_rank(const MlaConfig& cfg, const SpLayout& lay, const RunSpec& spec, int r,
                  bool count_only, std::vector<float>* out_copy = nullptr) {
  MemoryPool pool;
  pool.set_count_only(count_only);
  PoolScope scope(pool);
  const test::BlockInputs<float> in = test::make_inputs(cfg, lay.batch, lay.seq, !count_only);
  const RopeTable rope(cfg.rope(), lay.seq);
  DryRunCommunicator comm(r, lay.ranks);
  RankResult<float> res = run_rank(comm, cfg, lay, rope, in.w, in.x, in.dout, spec);
  // A plain vector: tensors made here belong to this function's pool.
  if (out_copy && res.out.data())
    out_copy->assign(res.out.data(), res.out.data() + res.out.numel());
  return {res.report.ledger, res.report.memory};
}

// All P ranks as threads; pools count-only or not.
std::vector<Measured> full_run(const MlaConfig& cfg, const SpLayout& lay, const RunSpec& spec,
                               bool count_only, std::vector<float>* out_copy = nullptr) {
  MemoryPool main_pool;
  main_pool.set_count_only(count_only);
  PoolScope scope(main_pool);
  const test::BlockInputs<float> in = test::make_inputs(cfg, lay.batch, lay.seq, !count_only);
  const RopeTable rope(cfg.rope(), lay.seq);
  std::vector<Measured> m(static_cast<size_t>(lay.ranks));
  std::vector<MemoryPool> pools(static_cast<size_t>(lay.ranks));
  for (MemoryPool& p : pools) p.set_count_only(count_only);
  LocalRunOptions opts;
  opts.pools = &pools;
  run_local_ranks(
      lay.ranks,
      [&](Communicator& comm) {
        RankResult<float> res = run_rank(comm, cfg, lay, rope, in.w, in.x, in.dout, spec);
        m[static_cast<size_t>(comm.rank())] = {res.report.ledger, res.report.memory};
        if (out_copy && comm.rank() == 0 && res.out.data())
          out_copy->assign(res.out.data(), res.out.data() + res.out.numel());
      },
      opts);
  return m;
}

TEST(DryRun, CountOnlyAndRealRunsReportTheSameBytesAndPeaks) {
  // Every form at rq = 0, and laga with the query-latent exchange at rq = 7.
  const MlaConfig cfg0 = small_config(), cfg7 = small_config(7);
  std::vector<std::pair<const MlaConfig*, FormVariant>> runs;
  for (Form f : all_forms()) runs.push_back({&cfg0, f});
  runs.push_back({&cfg7, {Form::laga, QueryExchange::latent}});
  for (const SpLayout& lay :
       {SpLayout::even(1, 12, 5, 3), SpLayout::custom(2, {5, 1, 4}, {0, 3, 2})})
    for (const auto& [cfg_p, f] : runs)
      for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
        const MlaConfig& cfg = *cfg_p;
        RunSpec spec;
        spec.variant.form = f.form;
        spec.variant.queries = f.queries;
        spec.attention = a;
        const std::string what = to_string(f) + " " + to_string(a) + " " + lay.describe() +
                                 " B=" + std::to_string(lay.batch);
        const std::vector<Measured> real = full_run(cfg, lay, spec, false);
        const std::vector<Measured> counted = full_run(cfg, lay, spec, true);
        for (int r = 0; r < lay.ranks; ++r) {
          const std::string w = what + " rank " + std::to_string(r);
          expect_same(real[r], counted[r], w + ": full real vs full count-only");
          expect_same(real[r], dry_rank(cfg, lay, spec, r, false), w + ": full vs rank-only real");
          expect_same(real[r], dry_rank(cfg, lay, spec, r, true),
                      w + ": full vs rank-only count-only");
        }
      }
}

TEST(DryRun, OneRankDryRunIsARealRun) {
  const MlaConfig cfg = small_config();
  const SpLayout lay = SpLayout::even(2, 9, 5, 1);
  RunSpec spec;
  spec.variant.form = Form::laga;
  std::vector<float> a, b;
  dry_rank(cfg, lay, spec, 0, false, &a);
  full_run(cfg, lay, spec, false, &b);
  ASSERT_EQ(a.size(), static_cast<size_t>(2 * 9 * cfg.dim));
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace laga
