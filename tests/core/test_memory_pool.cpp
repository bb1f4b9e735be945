// MemoryPool / PoolScope: live and peak bytes per category, peak_working,
// reset_peaks, scope nesting, cross-thread frees, count-only mode, and the
// pool's block cache under tensors (reuse, counts unchanged, held bytes,
// per-pool caches), and storage tracking (a released or reused block told
// apart).
#include "core/memory_pool.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"

namespace laga {
namespace {

constexpr std::int64_t kF = sizeof(float);
constexpr std::int64_t kD = sizeof(double);

TEST(MemCategory, Names) {
  EXPECT_STREQ(to_string(MemCategory::activations), "activations");
  EXPECT_STREQ(to_string(MemCategory::parameters), "parameters");
  EXPECT_STREQ(to_string(MemCategory::gradients), "gradients");
  EXPECT_STREQ(to_string(MemCategory::comm_buffers), "comm_buffers");
  EXPECT_STREQ(to_string(MemCategory::optimizer), "optimizer");
  EXPECT_EQ(kNumMemCategories, 5);
}

TEST(MemoryPool, CurrentAndPeakPerCategory) {
  MemoryPool pool;
  pool.on_alloc(MemCategory::activations, 100);
  pool.on_alloc(MemCategory::parameters, 40);
  pool.on_alloc(MemCategory::activations, 50);
  EXPECT_EQ(pool.current(MemCategory::activations), 150);
  EXPECT_EQ(pool.current(MemCategory::parameters), 40);
  EXPECT_EQ(pool.current(MemCategory::gradients), 0);
  EXPECT_EQ(pool.current_total(), 190);
  pool.on_free(MemCategory::activations, 100);
  pool.on_alloc(MemCategory::gradients, 30);
  EXPECT_EQ(pool.current(MemCategory::activations), 50);
  EXPECT_EQ(pool.peak(MemCategory::activations), 150);
  EXPECT_EQ(pool.peak(MemCategory::parameters), 40);
  EXPECT_EQ(pool.peak(MemCategory::gradients), 30);
  EXPECT_EQ(pool.current_total(), 120);
  // The total's peak is the peak of the sum, not the sum of the peaks (220).
  EXPECT_EQ(pool.peak_total(), 190);
  EXPECT_EQ(pool.alloc_count(), 4);
}

TEST(MemoryPool, PeakWorkingIsActivationsPlusCommBuffers) {
  MemoryPool pool;
  pool.on_alloc(MemCategory::parameters, 1000);  // not working memory
  pool.on_alloc(MemCategory::activations, 60);
  pool.on_alloc(MemCategory::comm_buffers, 30);  // working = 90
  pool.on_free(MemCategory::activations, 60);
  pool.on_alloc(MemCategory::gradients, 500);    // not working memory
  pool.on_alloc(MemCategory::comm_buffers, 40);  // working = 70
  EXPECT_EQ(pool.peak_working(), 90);
  EXPECT_EQ(pool.peak(MemCategory::comm_buffers), 70);
  EXPECT_EQ(pool.peak(MemCategory::activations), 60);
}

TEST(MemoryPool, ResetPeaksStartsFromCurrent) {
  MemoryPool pool;
  pool.on_alloc(MemCategory::activations, 500);
  pool.on_alloc(MemCategory::comm_buffers, 20);
  pool.on_free(MemCategory::activations, 400);
  pool.reset_peaks();
  EXPECT_EQ(pool.peak(MemCategory::activations), 100);
  EXPECT_EQ(pool.peak(MemCategory::comm_buffers), 20);
  EXPECT_EQ(pool.peak_total(), 120);
  EXPECT_EQ(pool.peak_working(), 120);
  pool.on_alloc(MemCategory::activations, 10);
  EXPECT_EQ(pool.peak(MemCategory::activations), 110);
  EXPECT_EQ(pool.peak_total(), 130);
  EXPECT_EQ(pool.peak_working(), 130);
  // Current values are untouched by reset_peaks.
  EXPECT_EQ(pool.current(MemCategory::activations), 110);
}

TEST(MemoryPool, FreeingMoreThanLiveThrowsAndNamesTheCategory) {
  MemoryPool pool;
  pool.on_alloc(MemCategory::gradients, 8);
  try {
    pool.on_free(MemCategory::gradients, 16);
    FAIL() << "over-free must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gradients"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.current(MemCategory::gradients), 8);  // unchanged
}

TEST(PoolScope, NestingRestoresTheOuterPool) {
  MemoryPool outer, inner;
  MemoryPool& before = current_pool();
  {
    PoolScope so(outer);
    EXPECT_EQ(&current_pool(), &outer);
    TensorF a({10});
    {
      PoolScope si(inner);
      EXPECT_EQ(&current_pool(), &inner);
      TensorF b({20});
      EXPECT_EQ(inner.current(MemCategory::activations), 20 * kF);
      EXPECT_EQ(outer.current(MemCategory::activations), 10 * kF);
      // `a` was allocated under `outer` and returns its bytes there, even
      // when freed while `inner` is current.
      a.reset();
      EXPECT_EQ(outer.current(MemCategory::activations), 0);
      EXPECT_EQ(inner.current(MemCategory::activations), 20 * kF);
    }
    EXPECT_EQ(&current_pool(), &outer);
    EXPECT_EQ(inner.current_total(), 0);
    EXPECT_EQ(inner.peak_total(), 20 * kF);
    TensorD c({3});
    EXPECT_EQ(outer.current(MemCategory::activations), 3 * kD);
  }
  EXPECT_EQ(&current_pool(), &before);
  EXPECT_EQ(outer.current_total(), 0);
}

TEST(PoolScope, EachThreadHasItsOwnCurrentPool) {
  MemoryPool main_pool, worker_pool;
  PoolScope scope(main_pool);
  MemoryPool* seen_by_worker = nullptr;
  std::thread t([&] {
    // A new thread starts on the process default, not on main's scope.
    MemoryPool* start = &current_pool();
    PoolScope ws(worker_pool);
    seen_by_worker = &current_pool();
    TensorF x({5});
    EXPECT_NE(start, &main_pool);
  });
  t.join();
  EXPECT_EQ(seen_by_worker, &worker_pool);
  EXPECT_EQ(&current_pool(), &main_pool);
  EXPECT_EQ(worker_pool.peak_total(), 5 * kF);
  EXPECT_EQ(worker_pool.current_total(), 0);
  EXPECT_EQ(main_pool.peak_total(), 0);
}

TEST(PoolScope, TensorFreedOnAnotherThreadReturnsBytesToItsOwnPool) {
  MemoryPool rank0, rank1;
  std::vector<TensorF> made_on_rank1;
  std::thread t([&] {
    PoolScope s(rank1);
    made_on_rank1.emplace_back(Shape{64}, MemCategory::comm_buffers);
    made_on_rank1.emplace_back(Shape{16}, MemCategory::activations);
  });
  t.join();
  EXPECT_EQ(rank1.current(MemCategory::comm_buffers), 64 * kF);
  EXPECT_EQ(rank1.current(MemCategory::activations), 16 * kF);
  {
    PoolScope s(rank0);  // freed while rank0 is current on this thread
    made_on_rank1.clear();
  }
  EXPECT_EQ(rank1.current_total(), 0);
  EXPECT_EQ(rank1.peak(MemCategory::comm_buffers), 64 * kF);
  EXPECT_EQ(rank0.current_total(), 0);
  EXPECT_EQ(rank0.peak_total(), 0);
  EXPECT_EQ(rank0.alloc_count(), 0);

  // And the other way round: made here, freed on a thread with its own pool.
  TensorD here;
  {
    PoolScope s(rank0);
    here = TensorD({10}, MemCategory::parameters);
  }
  std::thread t2([&] {
    PoolScope s(rank1);
    here.reset();
  });
  t2.join();
  EXPECT_EQ(rank0.current(MemCategory::parameters), 0);
  EXPECT_EQ(rank0.peak(MemCategory::parameters), 10 * kD);
  EXPECT_EQ(rank1.current_total(), 0);
}

TEST(MemoryPool, CountOnlyAccountsWithoutStorage) {
  MemoryPool pool;
  pool.set_count_only(true);
  EXPECT_TRUE(pool.count_only());
  PoolScope scope(pool);
  {
    // 2^34 floats = 64 GiB: would fail to allocate if it were backed.
    TensorF huge({1 << 17, 1 << 17}, MemCategory::activations);
    EXPECT_EQ(huge.data(), nullptr);
    EXPECT_FALSE(huge.backed());
    EXPECT_TRUE(huge.defined());
    EXPECT_EQ(huge.bytes(), (std::int64_t{1} << 34) * kF);
    EXPECT_EQ(pool.current(MemCategory::activations), (std::int64_t{1} << 34) * kF);

    auto z = TensorD::zeros({3, 5}, MemCategory::gradients);  // must not write to nullptr
    EXPECT_EQ(z.data(), nullptr);
    EXPECT_EQ(pool.current(MemCategory::gradients), 15 * kD);
    z.fill(1.0);  // a no-op on an unbacked tensor, not a crash

    TensorD c = z.clone(MemCategory::optimizer);
    EXPECT_EQ(c.data(), nullptr);
    EXPECT_EQ(pool.current(MemCategory::optimizer), 15 * kD);
  }
  EXPECT_EQ(pool.current_total(), 0);
  EXPECT_EQ(pool.peak(MemCategory::activations), (std::int64_t{1} << 34) * kF);
  EXPECT_EQ(pool.alloc_count(), 3);

  // Switching count-only off backs new tensors again.
  pool.set_count_only(false);
  TensorF real({4});
  EXPECT_NE(real.data(), nullptr);
  EXPECT_TRUE(real.backed());
}

TEST(MemoryPool, CountOnlyIsPerPool) {
  MemoryPool counting, real;
  counting.set_count_only(true);
  TensorF backed_one;
  {
    PoolScope s1(counting);
    TensorF a({8});
    EXPECT_EQ(a.data(), nullptr);
    PoolScope s2(real);
    backed_one = TensorF({8});
  }
  EXPECT_NE(backed_one.data(), nullptr);
  EXPECT_EQ(real.current_total(), 8 * kF);
}

// Tensors of 2^16 floats (256 KiB, whole pages) take the cache's path.
constexpr std::int64_t kLarge = std::int64_t{1} << 16;

// A pool whose cache is on whatever LAGA_POOL_CACHE and the build say.
void cache_on(MemoryPool& pool) {
  pool.cache().set_limit(1.25);
}

TEST(MemoryPoolCache, ASecondTensorOfTheSameSizeGetsTheFreedBlock) {
  MemoryPool pool;
  cache_on(pool);
  PoolScope scope(pool);
  TensorF a({kLarge});
  const float* block = a.data();
  a.fill(7.0f);
  a.reset();
  EXPECT_EQ(pool.cache().stats().cached, kLarge * kF);
  EXPECT_EQ(pool.current_total(), 0);  // the counts see the tensor gone

  TensorF b({4, kLarge / 4});  // another shape, the same bytes
  EXPECT_EQ(b.data(), block);
  EXPECT_EQ(pool.cache().stats().hits, 1);
  EXPECT_EQ(pool.cache().stats().cached, 0);
  b.reset();
  // zeros() on a reused block still starts at 0.
  TensorF z = TensorF::zeros({kLarge});
  ASSERT_EQ(z.data(), block);
  for (std::int64_t i = 0; i < kLarge; i += 1021) ASSERT_EQ(z[i], 0.0f) << i;
}

// Storage tracking: a live tensor's block is found from any range inside
// it, not past its end; a released one is gone, and a block handed out again
// at the same address (the cache's reuse) has another number, so a caller
// that noted the first can tell the two apart.
TEST(MemoryPoolCache, StorageTrackingTellsAReleasedOrReusedBlock) {
  MemoryPool pool;
  cache_on(pool);
  PoolScope scope(pool);
  TensorF untracked({kLarge});
  pool.set_storage_tracking(true);
  EXPECT_EQ(pool.storage_block(untracked.data(), kF), 0);  // acquired before tracking
  TensorF a({kLarge}), small({10});
  const std::int64_t na = pool.storage_block(a.data(), kLarge * kF);
  EXPECT_NE(na, 0);
  EXPECT_EQ(pool.storage_block(a.data() + 100, 10 * kF), na);   // a view inside it
  EXPECT_EQ(pool.storage_block(a.data() + 1, kLarge * kF), 0);  // one element past its end
  EXPECT_NE(pool.storage_block(small.data(), 10 * kF), 0);      // from the heap, tracked too
  EXPECT_NE(pool.storage_block(small.data(), 10 * kF), na);
  EXPECT_EQ(pool.storage_block(nullptr, 0), 0);
  const float* block = a.data();
  a.reset();
  EXPECT_EQ(pool.storage_block(block, kF), 0);
  TensorF b({kLarge});
  ASSERT_EQ(b.data(), block);  // the cache hands out the same block again
  const std::int64_t nb = pool.storage_block(b.data(), kF);
  EXPECT_NE(nb, 0);
  EXPECT_NE(nb, na);
  pool.set_storage_tracking(false);
  EXPECT_EQ(pool.storage_block(b.data(), kF), 0);
}

TEST(MemoryPoolCache, SmallTensorsStayOnTheHeap) {
  MemoryPool pool;
  cache_on(pool);
  PoolScope scope(pool);
  TensorF small({BlockCache::kDefaultMinBytes / kF - 1});
  small.reset();
  EXPECT_EQ(pool.cache().stats().misses, 0);
  EXPECT_EQ(pool.cache().stats().cached, 0);
  // A lower threshold routes them through the cache.
  pool.set_cache_min_bytes(1);
  TensorF now_cached({100});
  EXPECT_EQ(pool.cache().stats().misses, 1);
  EXPECT_EQ(pool.cache().stats().live_requested, 100 * kF);
  EXPECT_THROW(pool.set_cache_min_bytes(0), Error);
}

// The same tensors with the cache on and off: every count, peak and traced
// event is the same; only held() differs, by exactly what the cache holds.
TEST(MemoryPoolCache, CountsAreTheSameWithAndWithoutTheCache) {
  const auto run = [](MemoryPool& pool) {
    std::vector<MemoryPool::Event> trace;
    pool.set_trace(&trace);
    PoolScope scope(pool);
    TensorF w({3, kLarge}, MemCategory::parameters);
    for (int step = 0; step < 3; ++step) {
      TensorF a({kLarge + 5});  // not whole pages: rounded in the cache only
      TensorD b({kLarge / 2}, MemCategory::comm_buffers);
      a.reset();
      TensorF c({2, kLarge}, MemCategory::gradients);
      TensorF tiny({3});
    }
    pool.set_trace(nullptr);
    return trace;
  };
  MemoryPool on, off;
  cache_on(on);
  off.cache().set_limit(0.0);
  const std::vector<MemoryPool::Event> t_on = run(on), t_off = run(off);
  ASSERT_EQ(t_on.size(), t_off.size());
  for (std::size_t i = 0; i < t_on.size(); ++i) {
    EXPECT_EQ(t_on[i].category, t_off[i].category) << i;
    EXPECT_EQ(t_on[i].delta, t_off[i].delta) << i;
  }
  for (int c = 0; c < kNumMemCategories; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    EXPECT_EQ(on.peak(cat), off.peak(cat)) << to_string(cat);
    EXPECT_EQ(on.current(cat), off.current(cat)) << to_string(cat);
  }
  EXPECT_EQ(on.peak_total(), off.peak_total());
  EXPECT_EQ(on.peak_working(), off.peak_working());
  EXPECT_EQ(on.alloc_count(), off.alloc_count());
  // Steps 2 and 3 reused step 1's blocks (a, b, c each step: 3 misses in all).
  EXPECT_EQ(on.cache().stats().misses, 3 + 1);  // + w
  EXPECT_EQ(on.cache().stats().hits, 6);
  EXPECT_EQ(off.cache().stats().misses + off.cache().stats().hits, 0);
  // Nothing live: what the cache keeps is all the pool holds.
  EXPECT_EQ(on.held(), on.cache().stats().cached);
  EXPECT_GT(on.held(), 0);
  EXPECT_EQ(off.held(), 0);
  EXPECT_EQ(off.peak_held(), off.peak_total());
  EXPECT_GT(on.peak_held(), on.peak_total());
}

TEST(MemoryPoolCache, HeldIsLivePlusRoundingPlusKept) {
  MemoryPool pool;
  cache_on(pool);
  PoolScope scope(pool);
  const std::int64_t page = sysconf(_SC_PAGESIZE);
  TensorF a({kLarge + 1});  // one float over whole pages: a page of rounding
  const std::int64_t rounding = page - kF;
  EXPECT_EQ(pool.current_total(), (kLarge + 1) * kF);
  EXPECT_EQ(pool.held(), pool.current_total() + rounding);
  TensorF b({kLarge});
  b.reset();
  EXPECT_EQ(pool.held(), (kLarge + 1) * kF + rounding + kLarge * kF);
  EXPECT_EQ(pool.peak_held(), pool.held());
  pool.reset_peaks();
  EXPECT_EQ(pool.peak_held(), pool.held());
  EXPECT_EQ(pool.cache().trim(), kLarge * kF);
  EXPECT_EQ(pool.held(), pool.current_total() + rounding);
}

// The cache allowance the upfront memory check adds per rank, worked out by
// hand on one allocation sequence: held_bound() = the small tensors' peak +
// max(limit, 1) x the cache's live peak (in mapped pages), less the peak of
// what tensors asked for. K = 256 KiB (whole pages); a is one float over K
// (a page of rounding), b is 2K; a's block is kept when a is freed, then c
// (K, another page count: a miss) evicts it under the bound.
TEST(MemoryPoolCache, TheCacheAllowanceIsTheBoundLessThePeakRequested) {
  const std::int64_t page = sysconf(_SC_PAGESIZE), K = kLarge * kF;
  for (const double limit : {1.25, 1.0, 2.0, 0.0})
    for (const bool count_only : {false, true}) {
      MemoryPool pool;
      pool.set_count_only(count_only);
      pool.cache().set_limit(limit);
      PoolScope scope(pool);
      const std::string what = "limit " + std::to_string(limit) + (count_only ? " count-only" : "");
      {
        TensorF s({100});  // 400 B: from the heap, a small tensor
        TensorF a({kLarge + 1}), b({2 * kLarge});
        // live mapped: K + page + 2K; requested: 400 + K + 4 + 2K
        a.reset();
        TensorF c({kLarge});
      }
      const std::int64_t requested = 400 + 3 * K + 4;
      if (limit == 0.0) {
        // Off: every tensor is a small one (aligned_alloc); nothing beyond.
        EXPECT_EQ(pool.cache().stats().live_peak, 0) << what;
        EXPECT_EQ(pool.held_bound(), requested) << what;
        EXPECT_EQ(pool.cache_allowance(), 0) << what;
        continue;
      }
      const std::int64_t bound =
          400 + static_cast<std::int64_t>(std::ceil(limit * double(3 * K + page)));
      EXPECT_EQ(pool.cache().stats().live_peak, 3 * K + page) << what;
      EXPECT_EQ(pool.held_bound(), bound) << what;
      EXPECT_EQ(pool.cache_allowance(), bound - requested) << what;
      if (limit == 1.25 && page == 4096) {
        EXPECT_EQ(pool.cache_allowance(), 201724) << what;
      }
      // reset_peaks() starts the stretch's peaks again, not the allowance's.
      pool.reset_peaks();
      EXPECT_EQ(pool.cache_allowance(), bound - requested) << what;
    }
}

// The address space this process has mapped (/proc/self/statm, in pages).
std::int64_t mapped_pages() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t pages = -1;
  statm >> pages;
  return pages;
}

// A count-only pool's cache maps nothing but counts what a real one does, so
// a count-only run predicts held() and every cache figure byte for byte.
TEST(MemoryPoolCache, CountOnlyPoolsCountTheCacheWithoutMapping) {
  const auto run = [](MemoryPool& pool) {
    PoolScope scope(pool);
    pool.cache().set_limit(1.0);  // tight: some requests evict
    for (int step = 0; step < 3; ++step) {
      TensorF a({kLarge + 3}), b({2 * kLarge});
      a.reset();
      TensorF c({3 * kLarge});  // a miss that evicts under limit 1.0
      TensorD d({kLarge / 2}, MemCategory::comm_buffers);
    }
  };
  MemoryPool real, counted;
  counted.set_count_only(true);
  run(real);
  run(counted);
  const BlockCache::Stats &r = real.cache().stats(), &c = counted.cache().stats();
  EXPECT_GT(r.evicted, 0);
  EXPECT_GT(r.hits, 0);
  EXPECT_EQ(c.hits, r.hits);
  EXPECT_EQ(c.misses, r.misses);
  EXPECT_EQ(c.evicted, r.evicted);
  EXPECT_EQ(c.cached, r.cached);
  EXPECT_EQ(c.live_peak, r.live_peak);
  EXPECT_EQ(c.mapped_peak, r.mapped_peak);
  EXPECT_EQ(counted.peak_held(), real.peak_held());
  EXPECT_EQ(counted.held(), real.held());

  // 2^38 floats = 1 TiB: more than any machine here maps, so it must not be.
  PoolScope scope(counted);
  const std::int64_t before = mapped_pages();
  TensorF huge({std::int64_t{1} << 38});
  EXPECT_EQ(huge.data(), nullptr);
  EXPECT_LT(mapped_pages() - before, (std::int64_t{1} << 30) / sysconf(_SC_PAGESIZE));
  EXPECT_EQ(counted.cache().stats().live_mapped, (std::int64_t{1} << 38) * kF);
  // Switching to real storage with a counted block live would mix the two.
  EXPECT_THROW(counted.set_count_only(false), Error);
  huge.reset();
  counted.set_count_only(false);
  EXPECT_EQ(counted.cache().stats().cached, 0);  // the counted blocks are gone
  TensorF real_now({kLarge});
  EXPECT_NE(real_now.data(), nullptr);
}

// Ranks as threads: each pool's cache serves its own thread, at the same
// time as the other's, and a pool's stats are its own tensors' only.
TEST(MemoryPoolCache, PoolsOnThreadsHaveTheirOwnCaches) {
  MemoryPool rank0, rank1;
  cache_on(rank0);
  cache_on(rank1);
  const auto steps = [](MemoryPool& pool, std::int64_t n, float mark) {
    PoolScope scope(pool);
    for (int step = 0; step < 200; ++step) {
      TensorF a({n});
      a.fill(mark);
      TensorF b({2 * n});
      b.fill(mark);
      ASSERT_EQ(a[n - 1], mark);  // no other thread wrote into a
    }
  };
  std::thread t0([&] { steps(rank0, kLarge, 1.0f); });
  std::thread t1([&] { steps(rank1, 3 * kLarge, 2.0f); });
  t0.join();
  t1.join();
  EXPECT_EQ(rank0.cache().stats().misses, 2);
  EXPECT_EQ(rank1.cache().stats().misses, 2);
  EXPECT_EQ(rank0.cache().stats().cached, 3 * kLarge * kF);
  EXPECT_EQ(rank1.cache().stats().cached, 9 * kLarge * kF);
  EXPECT_EQ(rank0.peak_held(), 3 * kLarge * kF);
  EXPECT_EQ(rank1.peak_held(), 9 * kLarge * kF);
}

TEST(MemoryPoolCache, ATensorFreedElsewhereReturnsItsBlockToItsOwnPool) {
  MemoryPool owner, other;
  cache_on(owner);
  cache_on(other);
  TensorF t;
  std::thread made([&] {
    PoolScope s(owner);
    t = TensorF({kLarge});
  });
  made.join();
  {
    PoolScope s(other);
    t.reset();
  }
  EXPECT_EQ(owner.cache().stats().cached, kLarge * kF);
  EXPECT_EQ(other.cache().stats().cached, 0);
  EXPECT_EQ(other.cache().stats().misses, 0);
}

#if defined(__SANITIZE_ADDRESS__)
// The sanitizer pass finds a tensor used after it was freed: with the cache
// off (the default under AddressSanitizer) as heap-use-after-free, and with
// it on as a read of the poisoned block the cache keeps.
float read_after_free(double cache_limit) {
  MemoryPool pool;
  pool.cache().set_limit(cache_limit);
  PoolScope scope(pool);
  TensorF t({kLarge});
  const volatile float* stale = t.data();  // volatile: the read is not optimised away
  t.reset();
  return stale[5];
}

TEST(MemoryPoolCacheDeathTest, UseAfterFreeIsFoundUnderAddressSanitizer) {
  EXPECT_EQ(default_cache_limit(), 0.0) << "LAGA_POOL_CACHE is set in the environment";
  EXPECT_DEATH(read_after_free(0.0), "heap-use-after-free");
  EXPECT_DEATH(read_after_free(1.25), "use-after-poison");
}
#endif

}  // namespace
}  // namespace laga
