// BlockCache: reuse of a freed block of the same page-rounded size, a larger
// one split and its pieces merged back, a kept block grown where a fresh one
// would not fit, the bound (mapped <= limit x live peak) and count-only's
// agreement under random traffic, trim() and limit 0
// unmapping for real, LAGA_POOL_CACHE's parsing, and (under AddressSanitizer)
// poisoned kept blocks.
#include "core/block_cache.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.hpp"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

namespace laga {
namespace {

const std::int64_t kPage = sysconf(_SC_PAGESIZE);

// Whether the page at p is mapped: mincore fails with ENOMEM on an unmapped
// range, so a block that was really given back to the system reads false.
bool mapped(const BlockCache::Block& b) {
  unsigned char resident = 0;
  return mincore(b.data, static_cast<std::size_t>(kPage), &resident) == 0 || errno != ENOMEM;
}

TEST(BlockCache, ReusesAFreedBlockOfTheSamePageCount) {
  BlockCache cache;
  cache.set_limit(1.25);
  // 3 pages + 1 byte and 4 pages round to the same 4 pages.
  const BlockCache::Block a = cache.acquire(3 * kPage + 1);
  ASSERT_NE(a.data, nullptr);
  EXPECT_EQ(cache.stats().live_mapped, 4 * kPage);
  EXPECT_EQ(cache.stats().live_requested, 3 * kPage + 1);
  std::memset(a.data, 0x5a, static_cast<std::size_t>(3 * kPage + 1));  // writable
  cache.release(a, 3 * kPage + 1);
  EXPECT_EQ(cache.stats().cached, 4 * kPage);
  EXPECT_EQ(cache.stats().live_mapped, 0);
  EXPECT_TRUE(mapped(a));  // kept, not unmapped

  const BlockCache::Block b = cache.acquire(4 * kPage);
  EXPECT_EQ(b.data, a.data);
  EXPECT_EQ(static_cast<unsigned char*>(b.data)[0], 0x5a);  // reused as it was left
  EXPECT_EQ(cache.stats().cached, 0);
  EXPECT_EQ(cache.stats().hits, 1);
  EXPECT_EQ(cache.stats().misses, 1);

  // A larger page count is another block (b, the only one of 4 pages, is live).
  const BlockCache::Block c = cache.acquire(5 * kPage);
  EXPECT_NE(c.data, b.data);
  EXPECT_EQ(cache.stats().misses, 2);
  EXPECT_EQ(cache.stats().live_mapped, 9 * kPage);
  EXPECT_EQ(cache.stats().live_peak, 9 * kPage);
  cache.release(b, 4 * kPage);
  cache.release(c, 5 * kPage);
  EXPECT_EQ(cache.stats().cached, 9 * kPage);
  EXPECT_EQ(cache.stats().mapped_peak, 9 * kPage);
}

// A request takes the smallest kept block of its page count up to 1/8
// more (routing-dependent sizes: an MoE layer's rows), its exact size
// first, and counts the block's pages as live; beyond 1/8 it takes the
// front of the smallest larger one.
TEST(BlockCache, AKeptBlockUpToAnEighthLargerServesARequest) {
  BlockCache cache;
  cache.set_limit(2.0);
  const BlockCache::Block b16 = cache.acquire(16 * kPage);
  const BlockCache::Block b18 = cache.acquire(18 * kPage);
  const BlockCache::Block b20 = cache.acquire(20 * kPage);
  cache.release(b20, 20 * kPage);
  cache.release(b18, 18 * kPage);
  cache.release(b16, 16 * kPage);
  // 16 pages: the exact one, not the 18.
  const BlockCache::Block e = cache.acquire(16 * kPage);
  EXPECT_EQ(e.data, b16.data);
  EXPECT_EQ(e.mapped, 16 * kPage);
  // 17 pages: the 18 (within 17 + 2), live as 18 pages.
  const BlockCache::Block n = cache.acquire(17 * kPage - 5);
  EXPECT_EQ(n.data, b18.data);
  EXPECT_EQ(n.mapped, 18 * kPage);
  EXPECT_EQ(cache.stats().live_mapped, 34 * kPage);
  EXPECT_EQ(cache.stats().live_requested, 33 * kPage - 5);
  EXPECT_EQ(cache.stats().hits, 2);
  EXPECT_EQ(cache.stats().splits, 0);
  // 17 pages again: the 20 is more than 17 + 2: its first 17 pages, the
  // other 3 stay kept.
  const BlockCache::Block f = cache.acquire(17 * kPage);
  EXPECT_EQ(f.data, b20.data);
  EXPECT_EQ(f.mapped, 17 * kPage);
  EXPECT_EQ(cache.stats().splits, 1);
  EXPECT_EQ(cache.stats().misses, 3);  // the first three only
  EXPECT_EQ(cache.stats().cached, 3 * kPage);
  // Released with its own pages, the 18 is kept as 18.
  cache.release(n, 17 * kPage - 5);
  EXPECT_EQ(cache.stats().cached, (3 + 18) * kPage);
  EXPECT_EQ(cache.acquire(18 * kPage).data, b18.data);
  EXPECT_EQ(cache.stats().live_requested, 16 * kPage + 17 * kPage + 18 * kPage);
  cache.release(e, 16 * kPage);
  cache.release(f, 17 * kPage);
  EXPECT_EQ(cache.stats().mapped(), (16 + 18 + 20) * kPage);  // splitting mapped nothing
}

// A kept block larger than a request by more than 1/8 is split: the request
// takes its front pages, the rest serves the next requests, and when the
// pieces are freed they merge back into the whole block, in whatever order
// they come back, so that the next step finds it whole again.
TEST(BlockCache, ALargerKeptBlockIsSplitAndItsPiecesMergeBack) {
  BlockCache cache;
  cache.set_limit(1.0);
  const BlockCache::Block whole = cache.acquire(10 * kPage);
  std::memset(whole.data, 0x10, static_cast<std::size_t>(10 * kPage));
  cache.release(whole, 10 * kPage);
  char* const base = static_cast<char*>(whole.data);
  // 4, then 3, then 3 pages: all from the 10, in order, nothing mapped.
  const BlockCache::Block a = cache.acquire(4 * kPage);
  const BlockCache::Block b = cache.acquire(3 * kPage - 100);
  const BlockCache::Block c = cache.acquire(3 * kPage);
  EXPECT_EQ(a.data, base);
  EXPECT_EQ(b.data, base + 4 * kPage);
  EXPECT_EQ(c.data, base + 7 * kPage);  // the last 3: whole, no split
  EXPECT_EQ(static_cast<unsigned char*>(c.data)[0], 0x10);
  EXPECT_EQ(cache.stats().hits, 3);
  EXPECT_EQ(cache.stats().splits, 2);
  EXPECT_EQ(cache.stats().misses, 1);
  EXPECT_EQ(cache.stats().cached, 0);
  EXPECT_EQ(cache.stats().live_mapped, 10 * kPage);
  // The middle one back first: kept alone; then the front one merges with
  // it, then the last one joins them.
  cache.release(b, 3 * kPage - 100);
  cache.release(a, 4 * kPage);
  EXPECT_EQ(cache.stats().cached, 7 * kPage);
  cache.release(c, 3 * kPage);
  EXPECT_EQ(cache.stats().cached, 10 * kPage);
  // One block of 10 again: a request for all of it is a hit, whole.
  const BlockCache::Block again = cache.acquire(10 * kPage);
  EXPECT_EQ(again.data, base);
  EXPECT_EQ(again.mapped, 10 * kPage);
  EXPECT_EQ(cache.stats().hits, 4);
  EXPECT_EQ(cache.stats().resized + cache.stats().evicted, 0);
  cache.release(again, 10 * kPage);
}

// Merging asks places, not addresses: two mappings the system put side by
// side stay two blocks (one mremap could not grow the pair, and a
// count-only cache, which has no addresses, must decide as this one does).
TEST(BlockCache, BlocksOfTwoMappingsNeverMerge) {
  BlockCache cache;
  cache.set_limit(1.0);
  const BlockCache::Block a = cache.acquire(4 * kPage);
  const BlockCache::Block b = cache.acquire(4 * kPage);
  cache.release(a, 4 * kPage);
  cache.release(b, 4 * kPage);
  // 8 pages: no kept block that large (had the two merged, one would be),
  // and a fresh 8 beside the kept 8 passes the bound of 8: the largest kept
  // block grows, the other is released.
  const BlockCache::Block eight = cache.acquire(8 * kPage);
  EXPECT_EQ(cache.stats().hits, 0);
  EXPECT_EQ(cache.stats().resized, 1);
  EXPECT_EQ(cache.stats().evicted, 1);
  std::memset(eight.data, 0x88, static_cast<std::size_t>(8 * kPage));
  cache.release(eight, 8 * kPage);
}

// A request larger than every kept block, where a fresh block would not
// fit under the bound beside the kept ones, grows the largest kept block
// (mremap): only the new pages are new, and the pages it keeps keep what
// they held.
TEST(BlockCache, ARequestThatWouldPushKeptBlocksOutGrowsTheLargestOne) {
  BlockCache cache;
  cache.set_limit(1.0);
  const BlockCache::Block two = cache.acquire(2 * kPage);
  const BlockCache::Block six = cache.acquire(6 * kPage);
  std::memset(two.data, 0x22, static_cast<std::size_t>(2 * kPage));
  std::memset(six.data, 0x66, static_cast<std::size_t>(6 * kPage));
  cache.release(two, 2 * kPage);
  cache.release(six, 6 * kPage);
  EXPECT_EQ(cache.stats().live_peak, 8 * kPage);
  // 5 pages: the front of the 6 (split; the last page stays kept).
  const BlockCache::Block five = cache.acquire(5 * kPage);
  EXPECT_EQ(five.data, six.data);
  EXPECT_EQ(cache.stats().splits, 1);
  EXPECT_EQ(cache.stats().cached, 3 * kPage);
  // 3 pages: the kept are 2 and 1 pages; 3 more beside them and the live 5
  // pass the bound of 8, so the 2-page block grows to 3 and the 1-page one
  // is released (5 + 3 = 8 fits).
  const BlockCache::Block three = cache.acquire(3 * kPage);
  EXPECT_EQ(three.mapped, 3 * kPage);
  EXPECT_EQ(static_cast<unsigned char*>(three.data)[0], 0x22);
  EXPECT_EQ(static_cast<unsigned char*>(three.data)[2 * kPage - 1], 0x22);
  std::memset(three.data, 0x33, static_cast<std::size_t>(3 * kPage));  // all of it writable
  EXPECT_EQ(static_cast<unsigned char*>(five.data)[5 * kPage - 1], 0x66);
  EXPECT_EQ(cache.stats().resized, 1);
  EXPECT_EQ(cache.stats().evicted, 1);
  EXPECT_EQ(cache.stats().misses, 2);  // the first two only
  EXPECT_EQ(cache.stats().cached, 0);
  EXPECT_LE(cache.stats().mapped(), cache.stats().live_peak);
  cache.release(five, 5 * kPage);
  cache.release(three, 3 * kPage);
}

// Growing a kept block makes room for its new pages as a fresh block does:
// other kept blocks are released, largest first, until they fit.
TEST(BlockCache, GrowingAKeptBlockReleasesOthersLargestFirstToKeepTheBound) {
  BlockCache cache;
  cache.set_limit(1.0);
  const BlockCache::Block one = cache.acquire(kPage);
  const BlockCache::Block two = cache.acquire(2 * kPage);
  const BlockCache::Block six = cache.acquire(6 * kPage);
  cache.release(one, kPage);
  cache.release(two, 2 * kPage);
  cache.release(six, 6 * kPage);
  // 8 pages: none kept that large, and 8 more over 9 kept passes the bound
  // of 9. The 6-page block, the largest, grows by 2: live 8 + kept 3 > 9, so
  // the 2-page block goes and the 1-page one stays (8 + 1 <= 9).
  const BlockCache::Block eight = cache.acquire(8 * kPage);
  EXPECT_EQ(eight.mapped, 8 * kPage);
  EXPECT_EQ(cache.stats().resized, 1);
  EXPECT_EQ(cache.stats().evicted, 1);
  // (two's pages may be mapped again: the grown block may take them.)
  EXPECT_TRUE(mapped(one));
  EXPECT_EQ(cache.stats().cached, kPage);
  EXPECT_LE(cache.stats().mapped(), cache.stats().live_peak);
  cache.release(eight, 8 * kPage);
}

// Random traffic through a mapping cache and a count-only one side by side:
// the bound holds after every request and release, no block is handed out
// twice, and the count-only cache, which has no addresses, makes every
// decision the mapping one makes (its figures equal after every step).
TEST(BlockCache, MappedStaysWithinTheBoundUnderRandomTraffic) {
  for (const double limit : {1.0, 1.25, 2.0}) {
    BlockCache cache, counted;
    cache.set_limit(limit);
    counted.set_limit(limit);
    counted.set_count_only(true);
    std::mt19937 rng(7);
    struct Live {
      BlockCache::Block block, counted;
      std::int64_t bytes;
    };
    std::vector<Live> live;
    std::int64_t acquires = 0;
    for (int op = 0; op < 3000; ++op) {
      if (live.empty() || rng() % 5 < 3) {
        // Sizes from a few page counts, so that some requests find a block.
        const std::int64_t bytes = (1 + std::int64_t(rng() % 12)) * kPage - std::int64_t(rng() % 7);
        const BlockCache::Block block = cache.acquire(bytes);
        unsigned char* p = static_cast<unsigned char*>(block.data);
        ASSERT_NE(p, nullptr);
        ++acquires;
        // A block handed out twice at once would lose this mark.
        std::memset(p, static_cast<int>(live.size() & 0xff), static_cast<std::size_t>(bytes));
        live.push_back({block, counted.acquire(bytes), bytes});
      } else {
        const std::size_t i = rng() % live.size();
        const Live gone = live[i];
        const unsigned char* p = static_cast<const unsigned char*>(gone.block.data);
        for (std::int64_t k = 0; k < gone.bytes; k += kPage / 2)
          ASSERT_EQ(p[k], static_cast<unsigned char>(i & 0xff)) << "block shared by two tensors";
        // Keep the marks matching their indices: move the last block into i.
        live[i] = live.back();
        live.pop_back();
        if (i < live.size())
          std::memset(live[i].block.data, static_cast<int>(i & 0xff),
                      static_cast<std::size_t>(live[i].bytes));
        cache.release(gone.block, gone.bytes);
        counted.release(gone.counted, gone.bytes);
      }
      const BlockCache::Stats &s = cache.stats(), &c = counted.stats();
      ASSERT_LE(double(s.mapped()), limit * double(s.live_peak) + 0.5)
          << "limit " << limit << ", op " << op;
      ASSERT_LE(s.live_requested, s.live_mapped);
      ASSERT_GE(s.cached, 0);
      ASSERT_EQ(s.hits + s.misses + s.resized, acquires);
      ASSERT_EQ(std::make_tuple(s.live_mapped, s.cached, s.live_peak, s.mapped_peak, s.hits,
                                s.splits, s.misses, s.resized, s.evicted),
                std::make_tuple(c.live_mapped, c.cached, c.live_peak, c.mapped_peak, c.hits,
                                c.splits, c.misses, c.resized, c.evicted))
          << "count-only differs, limit " << limit << ", op " << op;
    }
    const BlockCache::Stats& s = cache.stats();
    EXPECT_GT(s.hits - s.splits, 0) << "limit " << limit;
    EXPECT_GT(s.splits, 0) << "limit " << limit;
    // At 2.0 best fit stays under the bound on this traffic; below it bites.
    if (limit < 2.0) {
      EXPECT_GT(s.resized + s.evicted, 0) << "limit " << limit;
    }
    for (const Live& l : live) {
      cache.release(l.block, l.bytes);
      counted.release(l.counted, l.bytes);
    }
  }
}

// A count-only cache counts blocks no system could map (the upfront memory
// check predicts a run of any size before refusing it): a petabyte split
// and merged back is counted as a page would be.
TEST(BlockCache, CountOnlyCountsBlocksOfAnySize) {
  BlockCache cache;
  cache.set_limit(1.25);
  cache.set_count_only(true);
  const std::int64_t huge = std::int64_t{1} << 50;
  const BlockCache::Block whole = cache.acquire(huge);
  EXPECT_EQ(whole.data, nullptr);
  EXPECT_EQ(whole.mapped, huge);
  cache.release(whole, huge);
  const BlockCache::Block front = cache.acquire(huge / 4);
  const BlockCache::Block next = cache.acquire(huge / 4);
  EXPECT_EQ(cache.stats().splits, 2);
  EXPECT_EQ(cache.stats().cached, huge / 2);
  cache.release(next, huge / 4);
  cache.release(front, huge / 4);
  EXPECT_EQ(cache.stats().cached, huge);
  const BlockCache::Block again = cache.acquire(huge);
  EXPECT_EQ(again.mapped, huge);
  EXPECT_EQ(cache.stats().hits, 3);
  EXPECT_EQ(cache.stats().misses, 1);
  cache.release(again, huge);
}

TEST(BlockCache, TrimUnmapsKeptBlocksAndStartsThePeakAgain) {
  BlockCache cache;
  cache.set_limit(1.25);
  const BlockCache::Block keep = cache.acquire(kPage);
  const BlockCache::Block a = cache.acquire(4 * kPage);
  const BlockCache::Block b = cache.acquire(2 * kPage);
  cache.release(a, 4 * kPage);
  cache.release(b, 2 * kPage);
  EXPECT_EQ(cache.trim(), 6 * kPage);
  EXPECT_FALSE(mapped(a));
  EXPECT_FALSE(mapped(b));
  EXPECT_TRUE(mapped(keep));  // live blocks are their tensors'
  EXPECT_EQ(cache.stats().cached, 0);
  EXPECT_EQ(cache.stats().live_peak, kPage);
  EXPECT_EQ(cache.stats().mapped_peak, kPage);
  // The next request of a trimmed size maps afresh.
  const std::int64_t misses = cache.stats().misses;
  const BlockCache::Block c = cache.acquire(4 * kPage);
  EXPECT_EQ(cache.stats().misses, misses + 1);
  cache.release(c, 4 * kPage);
  cache.release(keep, kPage);
}

TEST(BlockCache, LimitZeroUnmapsEveryFreedBlockAndLoweringReleasesNow) {
  BlockCache cache;
  cache.set_limit(2.0);
  const BlockCache::Block a = cache.acquire(4 * kPage);
  const BlockCache::Block b = cache.acquire(4 * kPage);
  cache.release(a, 4 * kPage);
  EXPECT_EQ(cache.stats().cached, 4 * kPage);
  // Off: what is kept goes now, and what is freed later goes at once.
  cache.set_limit(0.0);
  EXPECT_EQ(cache.stats().cached, 0);
  EXPECT_FALSE(mapped(a));
  cache.release(b, 4 * kPage);
  EXPECT_EQ(cache.stats().cached, 0);
  EXPECT_FALSE(mapped(b));
}

TEST(BlockCache, BadLimitsAreRefusedWithTheirRemedy) {
  BlockCache cache;
  for (const double bad : {-1.0, 0.5, 0.999}) {
    try {
      cache.set_limit(bad);
      FAIL() << "limit " << bad << " must be refused";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("factor >= 1"), std::string::npos) << e.what();
    }
  }
}

TEST(BlockCache, ParsesLagaPoolCache) {
  EXPECT_EQ(detail::parse_cache_limit(nullptr, 1.25), 1.25);
  EXPECT_EQ(detail::parse_cache_limit("", 0.0), 0.0);
  EXPECT_EQ(detail::parse_cache_limit("off", 1.25), 0.0);
  EXPECT_EQ(detail::parse_cache_limit("1", 1.25), 1.0);
  EXPECT_EQ(detail::parse_cache_limit("1.5", 1.25), 1.5);
  for (const char* bad : {"0", "0.5", "on", "1.5x", "inf", "nan", "-2"}) {
    try {
      detail::parse_cache_limit(bad, 1.25);
      FAIL() << "'" << bad << "' must be refused";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("LAGA_POOL_CACHE='" + std::string(bad) + "'"), std::string::npos) << what;
      EXPECT_NE(what.find("off"), std::string::npos) << what;
    }
  }
}

#if defined(__SANITIZE_ADDRESS__)
// A tensor used after it was freed touches a kept block: AddressSanitizer
// reports it because the block is poisoned until it is handed out again.
TEST(BlockCache, KeptBlocksArePoisonedUnderAddressSanitizer) {
  BlockCache cache;
  cache.set_limit(1.25);
  const BlockCache::Block a = cache.acquire(2 * kPage);
  EXPECT_FALSE(__asan_address_is_poisoned(a.data));
  cache.release(a, 2 * kPage);
  EXPECT_TRUE(__asan_address_is_poisoned(a.data));
  EXPECT_TRUE(__asan_address_is_poisoned(static_cast<char*>(a.data) + 2 * kPage - 1));
  const BlockCache::Block b = cache.acquire(2 * kPage);
  ASSERT_EQ(b.data, a.data);
  EXPECT_FALSE(__asan_address_is_poisoned(b.data));
  cache.release(b, 2 * kPage);
  // A split hands out its front only; the rest stays poisoned.
  const BlockCache::Block front = cache.acquire(kPage);
  ASSERT_EQ(front.data, a.data);
  EXPECT_FALSE(__asan_address_is_poisoned(static_cast<char*>(front.data) + kPage - 1));
  EXPECT_TRUE(__asan_address_is_poisoned(static_cast<char*>(front.data) + kPage));
  cache.release(front, kPage);
}
#endif

}  // namespace
}  // namespace laga
