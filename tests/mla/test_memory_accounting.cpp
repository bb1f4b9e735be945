// The pool's peaks for one forward+backward of each form equal the largest sum
// of live tensor bytes recomputed here from the raw allocation/free sequence,
// and every byte allocated is freed again by the end (nothing leaks into the
// next step). Count-only runs report exactly the same peaks and ledger. laga
// with the query-latent exchange (rq > 0 here) too.
#include <gtest/gtest.h>

#include "core/rng.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

struct Peaks {
  std::int64_t activations = 0, working = 0, final_activations = 0, final_comm = 0;
};

Peaks replay(const std::vector<MemoryPool::Event>& trace) {
  Peaks p;
  std::int64_t act = 0, comm = 0;
  for (const auto& e : trace) {
    if (e.category == MemCategory::activations) act += e.delta;
    if (e.category == MemCategory::comm_buffers) comm += e.delta;
    p.activations = std::max(p.activations, act);
    p.working = std::max(p.working, act + comm);
  }
  p.final_activations = act;
  p.final_comm = comm;
  return p;
}

TEST(MemoryAccounting, PoolPeakEqualsReplayedLiveBytes) {
  MlaConfig cfg = MlaConfig::preset("tiny");
  cfg.q_lora_rank = 12;
  const std::int64_t B = 2, S = 37;
  auto w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
  init_params(w, 1, 0.1);
  TensorF x({B, S, cfg.dim}), dout({B, S, cfg.dim});
  fill_normal(x.data(), x.numel(), 1, 1, 0, 1.0);
  fill_normal(dout.data(), dout.numel(), 1, 2, 0, 1.0);
  const SpLayout lay = SpLayout::even(B, S, cfg.n_heads, 1);
  const RopeTable rope(cfg.rope(), S);
  std::vector<FormVariant> variants;
  for (Form f : all_forms()) variants.push_back(f);
  variants.push_back({Form::laga, QueryExchange::latent});
  for (FormVariant form : variants)
    for (AttentionKind att : {AttentionKind::eager, AttentionKind::flash}) {
      const std::string tag = to_string(form) + "/" + to_string(att);
      RankReport real, counted;
      for (bool count_only : {false, true}) {
        MemoryPool pool;
        pool.set_count_only(count_only);
        std::vector<MemoryPool::Event> trace;
        PoolScope scope(pool);
        auto comm = make_self_communicator();
        RunSpec spec;
        spec.variant.form = form.form;
        spec.variant.queries = form.queries;
        spec.attention = att;
        Peaks peaks;
        {
          TensorF xs = x.clone(), ds = dout.clone();  // inputs live before the trace starts
          pool.set_trace(&trace);
          RankResult<float> res = run_rank(*comm, cfg, lay, rope, w, xs, ds, spec);
          pool.set_trace(nullptr);
          peaks = replay(trace);
          (count_only ? counted : real) = res.report;
          // run_rank measures above what was live when forward started: the
          // rank's shard slices of x and dout (here P = 1: whole copies).
          const std::int64_t slices = xs.bytes() + ds.bytes();
          EXPECT_EQ(res.report.memory.peak_activations + slices, peaks.activations) << tag;
          EXPECT_EQ(res.report.memory.peak_working + slices, peaks.working) << tag;
          // Still live after the step: only out and dx, handed back.
          EXPECT_EQ(peaks.final_activations, res.out.bytes() + res.dx.bytes()) << tag;
          EXPECT_EQ(peaks.final_comm, 0) << tag << ": comm buffers leaked";
        }
      }
      EXPECT_EQ(real.memory.peak_activations, counted.memory.peak_activations) << tag;
      EXPECT_EQ(real.memory.peak_working, counted.memory.peak_working) << tag;
      // (At P = 1 nothing crosses the wire, so there is no ledger to compare
      // here; real and count-only ledgers at P = 3, uneven, are compared in
      // test_dry_run.cpp, CountOnlyAndRealRunsReportTheSameBytesAndPeaks.)
    }
}

}  // namespace
}  // namespace laga

namespace laga {
namespace {

// A rank's report crosses to the reporting rank as doubles (pack_report):
// every scalar comes back exactly, byte counts beyond 2^53 included, and
// packing writes exactly packed_report_size doubles, no more (a field added
// to the report and not to the size overran the buffer once).
TEST(RankReportPacking, EveryFieldComesBackAndTheSizeIsExact) {
  RankReport r;
  r.rank = 3;
  r.forward_ms = 1.5, r.backward_ms = 2.25, r.sync_ms = 0.125, r.comm_ms = 7.0;
  RankMemory& m = r.memory;
  m.peak_activations = 101, m.peak_comm_buffers = 102, m.peak_working = 103;
  m.peak_forward_backward = 104, m.peak_grad_sync = 105, m.after_forward = 106;
  m.gradients = 107, m.parameters = (std::int64_t(1) << 60) + 108;
  const std::vector<LedgerKey> keys = {{Phase::forward, "q_a2a"}, {Phase::backward, "kv_ag"}};
  LedgerEntry e;
  e.calls = 2, e.bytes_sent = 300, e.bytes_received = 301;
  for (const LedgerKey& k : keys) r.ledger.record_entry(k.first, k.second, e);
  const std::size_t n = packed_report_size(keys.size());
  std::vector<double> buf(n + 1, -99.0);
  pack_report(r, keys, buf.data());
  EXPECT_EQ(buf[n], -99.0) << "pack_report wrote past packed_report_size";
  EXPECT_NE(buf[n - 1], -99.0) << "pack_report wrote less than packed_report_size";
  const RankReport u = unpack_report(buf.data(), keys);
  EXPECT_EQ(u.rank, 3);
  EXPECT_EQ(u.forward_ms, 1.5);
  EXPECT_EQ(u.backward_ms, 2.25);
  EXPECT_EQ(u.sync_ms, 0.125);
  EXPECT_EQ(u.comm_ms, 7.0);
  EXPECT_EQ(u.memory.peak_activations, 101);
  EXPECT_EQ(u.memory.peak_comm_buffers, 102);
  EXPECT_EQ(u.memory.peak_working, 103);
  EXPECT_EQ(u.memory.peak_forward_backward, 104);
  EXPECT_EQ(u.memory.peak_grad_sync, 105);
  EXPECT_EQ(u.memory.after_forward, 106);
  EXPECT_EQ(u.memory.gradients, 107);
  EXPECT_EQ(u.memory.parameters, m.parameters);
  ASSERT_EQ(u.ledger.entries().size(), keys.size());
  for (const LedgerKey& k : keys) {
    const LedgerEntry& got = u.ledger.entries().at(k);
    EXPECT_EQ(got.calls, 2);
    EXPECT_EQ(got.bytes_sent, 300);
    EXPECT_EQ(got.bytes_received, 301);
  }
}

}  // namespace
}  // namespace laga
