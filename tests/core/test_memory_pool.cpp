// MemoryPool / PoolScope: live and peak bytes per category, peak_working,
// reset_peaks, scope nesting, cross-thread frees, and count-only mode.
#include "core/memory_pool.hpp"

#include <gtest/gtest.h>

#include <cstdint>
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

}  // namespace
}  // namespace laga
