#include "core/block_cache.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <string>

#include "core/error.hpp"

// GCC says __SANITIZE_ADDRESS__; clang 14 (scripts/fuzz.sh) says only
// __has_feature(address_sanitizer).
#if defined(__SANITIZE_ADDRESS__)
#define LAGA_ADDRESS_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LAGA_ADDRESS_SANITIZER 1
#endif
#endif
#ifndef LAGA_ADDRESS_SANITIZER
#define LAGA_ADDRESS_SANITIZER 0
#endif
#if LAGA_ADDRESS_SANITIZER
#include <sanitizer/asan_interface.h>
#endif

namespace laga {

namespace {

// A step's large tensors peak at different times, so keeping a block of each
// for the next step takes more than the live peak: at 1.0 the explicit block
// mapped 5 blocks afresh a step, at 1.25 no form mapped any
// (docs/performance.md, "Page faults").
constexpr double kDefaultLimit = 1.25;

std::int64_t page_bytes() {
  static const std::int64_t page = sysconf(_SC_PAGESIZE);
  return page;
}

std::int64_t round_to_pages(std::int64_t bytes) {
  const std::int64_t page = page_bytes();
  return (bytes + page - 1) / page * page;
}

// Under AddressSanitizer a kept block is poisoned, so that a tensor used after
// it was freed is reported while its block waits for reuse.
void poison(void* block, std::int64_t mapped) {
#if LAGA_ADDRESS_SANITIZER
  ASAN_POISON_MEMORY_REGION(block, static_cast<std::size_t>(mapped));
#else
  (void)block, (void)mapped;
#endif
}
void unpoison(void* block, std::int64_t mapped) {
#if LAGA_ADDRESS_SANITIZER
  ASAN_UNPOISON_MEMORY_REGION(block, static_cast<std::size_t>(mapped));
#else
  (void)block, (void)mapped;
#endif
}

void* map_pages(std::int64_t mapped) {
  void* p = mmap(nullptr, static_cast<std::size_t>(mapped), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// The block at `block` of `from` mapped bytes as one of `to`: shrunk in
// place (its tail unmapped) or grown, moved if its neighbour is taken; the
// pages it keeps keep their contents and stay resident. nullptr when the
// system has no room to grow it (the block is then unchanged).
void* resize_pages(void* block, std::int64_t from, std::int64_t to) {
  void* p =
      mremap(block, static_cast<std::size_t>(from), static_cast<std::size_t>(to), MREMAP_MAYMOVE);
  return p == MAP_FAILED ? nullptr : p;
}

}  // namespace

BlockCache::~BlockCache() {
  release_kept();
}

BlockCache::Block BlockCache::acquire(std::int64_t bytes) {
  std::int64_t mapped = round_to_pages(bytes);
  void* block = nullptr;
  // The smallest kept block of mapped .. mapped + mapped / 8 bytes.
  const std::int64_t most = mapped + mapped / 8 * kSlackEighths;
  if (const auto it = kept_.lower_bound(mapped); it != kept_.end() && it->first <= most) {
    mapped = it->first;
    block = it->second.back();
    it->second.pop_back();
    if (it->second.empty()) kept_.erase(it);
    stats_.cached -= mapped;
    if (!count_only_) unpoison(block, mapped);
    ++stats_.hits;
  } else if (!kept_.empty() && !fits_beside_kept(mapped)) {
    // A fresh block would have to push kept ones out: take the kept block
    // nearest in size and resize it instead, so that only the pages it grows
    // by are new (and take page faults), not all of them.
    const Block kept = take_nearest(mapped);
    const std::int64_t size = kept.mapped;
    block = kept.data;
    stats_.live_mapped += size;  // live from here: make_room must not count or evict it
    if (mapped > size) make_room(mapped - size);
    stats_.live_mapped -= size;
    void* const resized = count_only_ ? nullptr : resize_pages(block, size, mapped);
    if (count_only_ || resized) {
      block = resized;
      ++stats_.resized;
    } else {  // no room to grow it: give it and the kept ones back, map afresh
      unmap(block, size);
      release_kept();
      block = map_pages(mapped);
      if (!block) return {};
      ++stats_.misses;
    }
  } else {
    make_room(mapped);
    if (!count_only_) {
      block = map_pages(mapped);
      // What is kept is memory the system could use: give it back and retry.
      if (!block && release_kept() > 0) block = map_pages(mapped);
      if (!block) return {};
    }
    ++stats_.misses;
  }
  stats_.live_mapped += mapped;
  stats_.live_requested += bytes;
  stats_.live_peak = std::max(stats_.live_peak, stats_.live_mapped);
  stats_.mapped_peak = std::max(stats_.mapped_peak, stats_.mapped());
  return {block, mapped};
}

void BlockCache::release(const Block& b, std::int64_t bytes) {
  void* const block = b.data;
  const std::int64_t mapped = b.mapped;
  stats_.live_mapped -= mapped;
  stats_.live_requested -= bytes;
  if (limit() == 0.0) {
    unmap(block, mapped);
    return;
  }
  kept_[mapped].push_back(block);
  stats_.cached += mapped;
  if (!count_only_) poison(block, mapped);
}

std::int64_t BlockCache::trim() {
  const std::int64_t released = release_kept();
  stats_.live_peak = stats_.live_mapped;
  stats_.mapped_peak = stats_.mapped();
  return released;
}

void BlockCache::set_limit(double limit) {
  LAGA_CHECK(limit == 0.0 || (std::isfinite(limit) && limit >= 1.0), "BlockCache::set_limit(",
             limit,
             "): use 0 (off: every freed block is unmapped) or a factor >= 1 (the bound on "
             "what the cache maps, in units of the peak of its live blocks)");
  limit_ = limit;
  make_room(0);
}

double BlockCache::limit() {
  if (limit_ == kUnset) limit_ = default_cache_limit();
  return limit_;
}

void BlockCache::set_count_only(bool on) {
  if (on == count_only_) return;
  LAGA_CHECK(stats_.live_mapped == 0, "BlockCache::set_count_only(", on ? "true" : "false",
             "): ", stats_.live_mapped,
             " bytes of blocks are still live; switch a pool to or from count-only before it "
             "allocates, or after its tensors are freed");
  release_kept();
  count_only_ = on;
}

void BlockCache::unmap(void* block, std::int64_t mapped) {
  if (count_only_) return;  // nothing was mapped
  unpoison(block, mapped);  // the addresses may be mapped again, for anything
  munmap(block, static_cast<std::size_t>(mapped));
}

std::int64_t BlockCache::release_kept() {
  std::int64_t released = 0;
  for (auto& [mapped, blocks] : kept_)
    for (void* block : blocks) {
      unmap(block, mapped);
      released += mapped;
    }
  kept_.clear();
  stats_.cached = 0;
  return released;
}

double BlockCache::bound_with(std::int64_t bytes) {
  return limit() * static_cast<double>(std::max(stats_.live_peak, stats_.live_mapped + bytes));
}

bool BlockCache::fits_beside_kept(std::int64_t bytes) {
  return static_cast<double>(stats_.mapped() + bytes) <= bound_with(bytes);
}

BlockCache::Block BlockCache::take_nearest(std::int64_t mapped) {
  auto it = kept_.lower_bound(mapped);  // the smallest at least as large
  if (it == kept_.end() ||
      (it != kept_.begin() && mapped - std::prev(it)->first < it->first - mapped))
    it = std::prev(it);  // the largest smaller one is nearer (a tie shrinks: no new pages)
  const Block block{it->second.back(), it->first};
  it->second.pop_back();
  if (it->second.empty()) kept_.erase(it);
  stats_.cached -= block.mapped;
  if (!count_only_) unpoison(block.data, block.mapped);
  return block;
}

void BlockCache::make_room(std::int64_t bytes) {
  const double bound = bound_with(bytes);
  while (!kept_.empty() && static_cast<double>(stats_.mapped() + bytes) > bound) {
    const auto largest = std::prev(kept_.end());
    const std::int64_t mapped = largest->first;
    unmap(largest->second.back(), mapped);
    largest->second.pop_back();
    if (largest->second.empty()) kept_.erase(largest);
    stats_.cached -= mapped;
    ++stats_.evicted;
  }
}

double detail::parse_cache_limit(const char* setting, double fallback) {
  const std::string value = setting ? setting : "";
  if (value.empty()) return fallback;
  if (value == "off") return 0.0;
  char* end = nullptr;
  const double limit = std::strtod(value.c_str(), &end);
  if (end == value.c_str() + value.size() && std::isfinite(limit) && limit >= 1.0) return limit;
  fail("LAGA_POOL_CACHE='", value,
       "' is not a limit of the memory pools' block cache; use off (every freed block is "
       "unmapped at once) or a factor >= 1 (the cache maps at most that times the peak of its "
       "live blocks; default ",
       kDefaultLimit, ")");
}

double default_cache_limit() {
  static const double limit = detail::parse_cache_limit(
      std::getenv("LAGA_POOL_CACHE"), LAGA_ADDRESS_SANITIZER ? 0.0 : kDefaultLimit);
  return limit;
}

}  // namespace laga
