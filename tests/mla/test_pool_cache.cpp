// The pools' block cache under whole blocks: a second step on each rank gets
// the first step's freed blocks back, holding the first step's values instead
// of a fresh mapping's zeros, and must give bit for bit the same out, dx and
// gradients and the same memory figures, mapping nothing afresh. A kernel
// that read storage before writing it (or added into it) would differ here.
// Every form, laga with the query-latent exchange, eager and flash, P = 3
// over an uneven layout, every tensor through the cache (min bytes 1).
#include <gtest/gtest.h>

#include <array>
#include <string>
#include <vector>

#include "comm/local_comm.hpp"
#include "core/rng.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

MlaConfig small_config(std::int64_t rq) {
  MlaConfig c;
  c.dim = 32, c.n_heads = 5, c.q_lora_rank = rq, c.kv_lora_rank = 16, c.qk_nope_head_dim = 8,
  c.qk_rope_head_dim = 4, c.v_head_dim = 6;
  c.validate();
  return c;
}

// out, dx and every gradient of one step, flattened.
std::vector<float> values_of(const RankResult<float>& res) {
  std::vector<float> v(res.out.data(), res.out.data() + res.out.numel());
  v.insert(v.end(), res.dx.data(), res.dx.data() + res.dx.numel());
  res.grads.for_each([&](const std::string&, const TensorF& g) {
    v.insert(v.end(), g.data(), g.data() + g.numel());
  });
  return v;
}

void expect_same_memory(const RankMemory& a, const RankMemory& b, const std::string& what) {
  EXPECT_EQ(a.peak_activations, b.peak_activations) << what;
  EXPECT_EQ(a.peak_comm_buffers, b.peak_comm_buffers) << what;
  EXPECT_EQ(a.peak_working, b.peak_working) << what;
  EXPECT_EQ(a.peak_forward_backward, b.peak_forward_backward) << what;
  EXPECT_EQ(a.peak_grad_sync, b.peak_grad_sync) << what;
  EXPECT_EQ(a.after_forward, b.after_forward) << what;
  EXPECT_EQ(a.gradients, b.gradients) << what;
}

TEST(PoolCache, ASecondStepOnReusedBlocksGivesTheSameResultsAndFigures) {
  const MlaConfig cfg0 = small_config(0), cfg7 = small_config(7);
  std::vector<std::pair<const MlaConfig*, FormVariant>> runs;
  for (Form f : all_forms()) runs.push_back({&cfg0, f});
  runs.push_back({&cfg7, {Form::laga, QueryExchange::latent}});
  const SpLayout lay = SpLayout::custom(2, {5, 1, 4}, {0, 3, 2});
  for (const auto& [cfg_p, f] : runs)
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
      const MlaConfig& cfg = *cfg_p;
      const std::string what = to_string(f) + " " + to_string(a);
      MlaParams<float> w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
      init_params(w, 3, 0.1);
      TensorF x({lay.batch, lay.seq, cfg.dim}), dout({lay.batch, lay.seq, cfg.dim});
      fill_normal(x.data(), x.numel(), 5, 1, 0, 1.0);
      fill_normal(dout.data(), dout.numel(), 5, 2, 0, 1.0);
      const RopeTable rope(cfg.rope(), lay.seq);
      RunSpec spec;
      spec.form = f.form;
      spec.queries = f.queries;
      spec.attention = a;
      std::vector<MemoryPool> pools(static_cast<size_t>(lay.ranks));
      for (MemoryPool& p : pools) {
        // A limit that keeps every block, so that the second step finds all.
        p.cache().set_limit(8.0);
        p.set_cache_min_bytes(1);
      }
      LocalRunOptions opts;
      opts.pools = &pools;
      // Per rank and step: results, memory figures, blocks mapped afresh.
      struct Step {
        std::vector<float> values;
        RankMemory memory;
        std::int64_t fresh = 0;
      };
      std::vector<std::array<Step, 2>> steps(static_cast<size_t>(lay.ranks));
      run_local_ranks(
          lay.ranks,
          [&](Communicator& comm) {
            const MemoryPool& pool = pools[static_cast<size_t>(comm.rank())];
            for (Step& step : steps[static_cast<size_t>(comm.rank())]) {
              const std::int64_t misses = pool.cache().stats().misses;
              const RankResult<float> res = run_rank(comm, cfg, lay, rope, w, x, dout, spec);
              step = {values_of(res), res.report.memory, pool.cache().stats().misses - misses};
            }
          },
          opts);
      for (int r = 0; r < lay.ranks; ++r) {
        const std::string rank = what + " rank " + std::to_string(r);
        const auto& [first, second] = steps[static_cast<size_t>(r)];
        EXPECT_GT(first.fresh, 0) << rank;
        EXPECT_EQ(second.fresh, 0) << rank << ": the second step mapped blocks afresh";
        EXPECT_TRUE(second.values == first.values) << rank << ": results differ on reused blocks";
        expect_same_memory(first.memory, second.memory, rank);
      }
    }
}

}  // namespace
}  // namespace laga
