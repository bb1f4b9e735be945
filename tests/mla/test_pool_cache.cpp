// The pools' block cache under whole blocks: a second step on each rank gets
// the first step's freed blocks back, holding the first step's values instead
// of a fresh mapping's zeros, and must give bit for bit the same out, dx and
// gradients and the same memory figures, mapping nothing afresh. A kernel
// that read storage before writing it (or added into it) would differ here.
// And a count-only run, whose caches map nothing, predicts every rank's held
// bytes and cache figures byte for byte. Every form, laga with the
// query-latent exchange, eager and flash, P = 3 over an uneven layout, every
// tensor through the cache (min bytes 1).
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

struct Case {
  const MlaConfig* cfg;
  FormVariant form;
  AttentionKind attention;
  std::string name() const { return to_string(form) + " " + to_string(attention); }
};

std::vector<Case> cases(const MlaConfig& rq0, const MlaConfig& rq7) {
  std::vector<Case> all;
  for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
    for (Form f : all_forms()) all.push_back({&rq0, f, a});
    all.push_back({&rq7, {Form::laga, QueryExchange::latent}, a});
  }
  return all;
}

const SpLayout kLayout = SpLayout::custom(2, {5, 1, 4}, {0, 3, 2});

// One step of a rank: results (empty when count-only), memory figures,
// blocks mapped afresh.
struct Step {
  std::vector<float> values;
  RankMemory memory;
  std::int64_t fresh = 0;
};
struct Rank {
  std::array<Step, 2> steps;
  BlockCache::Stats cache;  // after both steps
  std::int64_t peak_held = 0;
};

// Runs body(comm, pool, step) on every rank of kLayout, each rank's pool
// with the cache at `limit` serving every tensor of at least `min_bytes`,
// real or count-only; step() runs one block step of the rank.
template <class Body>
void on_every_rank(const Case& c, double limit, std::int64_t min_bytes, bool count_only,
                   Body&& body) {
  const MlaConfig& cfg = *c.cfg;
  const SpLayout& lay = kLayout;
  MlaParams<float> w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
  init_params(w, 3, 0.1);
  TensorF x({lay.batch, lay.seq, cfg.dim}), dout({lay.batch, lay.seq, cfg.dim});
  fill_normal(x.data(), x.numel(), 5, 1, 0, 1.0);
  fill_normal(dout.data(), dout.numel(), 5, 2, 0, 1.0);
  const RopeTable rope(cfg.rope(), lay.seq);
  RunSpec spec;
  spec.variant = FormVariant(c.form);
  spec.attention = c.attention;
  std::vector<MemoryPool> pools(static_cast<size_t>(lay.ranks));
  for (MemoryPool& p : pools) {
    p.set_count_only(count_only);
    p.cache().set_limit(limit);
    p.set_cache_min_bytes(min_bytes);
  }
  LocalRunOptions opts;
  opts.pools = &pools;
  run_local_ranks(
      lay.ranks,
      [&](Communicator& comm) {
        body(comm, pools[static_cast<size_t>(comm.rank())],
             [&] { return run_rank(comm, cfg, lay, rope, w, x, dout, spec); });
      },
      opts);
}

// Two steps on every rank of kLayout, each rank's pool with the cache at
// `limit` for every tensor, real or count-only.
std::vector<Rank> two_steps(const Case& c, double limit, bool count_only) {
  std::vector<Rank> ranks(static_cast<size_t>(kLayout.ranks));
  on_every_rank(c, limit, 1, count_only, [&](Communicator& comm, MemoryPool& pool, auto step_of) {
    Rank& rank = ranks[static_cast<size_t>(comm.rank())];
    for (Step& step : rank.steps) {
      const std::int64_t not_reused = pool.cache().stats().not_reused();
      const RankResult<float> res = step_of();
      step = {count_only ? std::vector<float>{} : values_of(res), res.report.memory,
              pool.cache().stats().not_reused() - not_reused};
    }
    rank.cache = pool.cache().stats();
    rank.peak_held = pool.peak_held();
  });
  return ranks;
}

TEST(PoolCache, ASecondStepOnReusedBlocksGivesTheSameResultsAndFigures) {
  const MlaConfig rq0 = small_config(0), rq7 = small_config(7);
  for (const Case& c : cases(rq0, rq7)) {
    // A limit that keeps every block, so that the second step finds all.
    const std::vector<Rank> ranks = two_steps(c, 8.0, false);
    for (int r = 0; r < kLayout.ranks; ++r) {
      const std::string what = c.name() + " rank " + std::to_string(r);
      const auto& [first, second] = ranks[static_cast<size_t>(r)].steps;
      EXPECT_GT(first.fresh, 0) << what;
      EXPECT_EQ(second.fresh, 0) << what << ": the second step mapped blocks afresh";
      EXPECT_TRUE(second.values == first.values) << what << ": results differ on reused blocks";
      expect_same_memory(first.memory, second.memory, what);
    }
  }
}

TEST(PoolCache, ACountOnlyRunPredictsWhatEveryRankHolds) {
  const MlaConfig rq0 = small_config(0), rq7 = small_config(7);
  std::int64_t evicted = 0, resized = 0;
  for (const Case& c : cases(rq0, rq7)) {
    // The default limit: tight enough that some steps evict.
    const std::vector<Rank> real = two_steps(c, 1.25, false), counted = two_steps(c, 1.25, true);
    for (int r = 0; r < kLayout.ranks; ++r) {
      const std::string what = c.name() + " rank " + std::to_string(r);
      const Rank &a = real[static_cast<size_t>(r)], &b = counted[static_cast<size_t>(r)];
      EXPECT_EQ(a.peak_held, b.peak_held) << what;
      EXPECT_EQ(a.cache.mapped_peak, b.cache.mapped_peak) << what;
      EXPECT_EQ(a.cache.live_peak, b.cache.live_peak) << what;
      EXPECT_EQ(a.cache.cached, b.cache.cached) << what;
      EXPECT_EQ(a.cache.hits, b.cache.hits) << what;
      EXPECT_EQ(a.cache.misses, b.cache.misses) << what;
      EXPECT_EQ(a.cache.resized, b.cache.resized) << what;
      EXPECT_EQ(a.cache.evicted, b.cache.evicted) << what;
      evicted += a.cache.evicted;
      resized += a.cache.resized;
      for (int step = 0; step < 2; ++step)
        expect_same_memory(a.steps[size_t(step)].memory, b.steps[size_t(step)].memory,
                           what + " step " + std::to_string(step + 1));
    }
  }
  EXPECT_GT(evicted, 0) << "no case evicted: the bound was never exercised";
  EXPECT_GT(resized, 0) << "no case resized a kept block: its counting was never exercised";
}

// Per rank: the most its pool held over `steps` steps (the peak of each,
// run_rank starting every step's peaks afresh), and after them
// MemoryPool::held_bound() and the peak of the tensors' own bytes.
struct Held {
  std::int64_t most = 0, bound = 0, requested = 0;
};
std::vector<Held> held_over(const Case& c, int steps, std::int64_t min_bytes, bool count_only) {
  std::vector<Held> held(static_cast<size_t>(kLayout.ranks));
  on_every_rank(c, 1.25, min_bytes, count_only,
                [&](Communicator& comm, MemoryPool& pool, auto step_of) {
                  Held& h = held[static_cast<size_t>(comm.rank())];
                  for (int i = 0; i < steps; ++i) {
                    (void)step_of();
                    h.most = std::max(h.most, pool.peak_held());
                    h.requested = std::max(h.requested, pool.peak_total());
                  }
                  h.bound = pool.held_bound();
                });
  return held;
}

// A count-only run of one step bounds what the pool holds over many: the
// cache never maps more than max(limit, 1) x its live peak, which one
// counted step gives exactly; small tensors (under the cache's minimum
// size, from malloc) count at their own peak. This is the figure the
// upfront memory check adds (MemoryPrediction::cache_allowance). And a
// repeated step holds what the first did: its blocks split and merge back
// the same way every step, so no later step maps more (the bound's own
// reach is BlockCache.MappedStaysWithinTheBoundUnderRandomTraffic's).
TEST(PoolCache, OneCountedStepBoundsWhatLaterStepsHold) {
  const MlaConfig rq0 = small_config(0), rq7 = small_config(7);
  for (const Case& c : cases(rq0, rq7))
    for (std::int64_t min_bytes : {std::int64_t(1), std::int64_t(2048)}) {
      const std::vector<Held> counted = held_over(c, 1, min_bytes, true),
                              real = held_over(c, 4, min_bytes, false);
      for (int r = 0; r < kLayout.ranks; ++r) {
        const std::string what =
            c.name() + " rank " + std::to_string(r) + " min " + std::to_string(min_bytes);
        const Held &a = real[static_cast<size_t>(r)], &b = counted[static_cast<size_t>(r)];
        EXPECT_LE(a.most, b.bound) << what;
        EXPECT_EQ(a.most, b.most) << what << ": a later step held more than the first";
        EXPECT_EQ(a.bound, b.bound) << what << ": later steps raised the live peaks";
        EXPECT_EQ(a.requested, b.requested) << what;
      }
    }
}

}  // namespace
}  // namespace laga
