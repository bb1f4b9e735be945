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
