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
  const std::int64_t mapped = round_to_pages(bytes);
  Block block;
  if (const auto fit = kept_by_size_.lower_bound({mapped, Place{}}); fit != kept_by_size_.end()) {
    // The smallest kept block of at least `mapped` bytes: whole when at most
    // 1/8 larger, else its front pages, the rest kept.
    block = take(kept_.find(fit->second));
    if (block.mapped > mapped + mapped / 8 * kSlackEighths) {
      keep({block.place.mapping, block.place.offset + mapped}, block.mapped - mapped);
      block = block_at(block.place, mapped);
      ++stats_.splits;
    }
    ++stats_.hits;
  } else if (!kept_.empty() && !fits_beside_kept(mapped)) {
    // A fresh block would have to push kept ones out: grow the largest kept
    // block (every one is smaller) instead, so that only the pages it grows
    // by are new (and take page faults), not all of them.
    const Block kept = take_largest();
    if (!count_only_) unpoison(kept.data, kept.mapped);  // its addresses may move
    stats_.live_mapped += kept.mapped;  // live from here: make_room must not count or evict it
    make_room(mapped - kept.mapped);
    stats_.live_mapped -= kept.mapped;
    void* const grown = count_only_ ? nullptr : resize_pages(kept.data, kept.mapped, mapped);
    if (count_only_ || grown) {
      // The grown block is a mapping of its own (it may have moved).
      forget(kept);
      const std::int64_t number = next_mapping_++;
      mappings_[number] = {static_cast<char*>(grown), mapped};
      block = {grown, mapped, {number, 0}};
      ++stats_.resized;
    } else {  // no room to grow it: give it and the kept ones back, map afresh
      unmap(kept);
      release_kept();
      block = map_fresh(mapped);
      if (!block.data) return {};
      ++stats_.misses;
    }
  } else {
    make_room(mapped);
    block = map_fresh(mapped);
    // What is kept is memory the system could use: give it back and retry.
    if (!block.data && !count_only_ && release_kept() > 0) block = map_fresh(mapped);
    if (!block.data && !count_only_) return {};
    ++stats_.misses;
  }
  if (!count_only_) unpoison(block.data, block.mapped);
  stats_.live_mapped += block.mapped;
  stats_.live_requested += bytes;
  stats_.live_peak = std::max(stats_.live_peak, stats_.live_mapped);
  stats_.mapped_peak = std::max(stats_.mapped_peak, stats_.mapped());
  return block;
}

void BlockCache::release(const Block& b, std::int64_t bytes) {
  stats_.live_mapped -= b.mapped;
  stats_.live_requested -= bytes;
  if (limit() == 0.0) {
    unmap(b);
    return;
  }
  if (!count_only_) poison(b.data, b.mapped);
  // Merged with the kept blocks right after and right before it in its
  // mapping, so that the pieces of a split block become one again.
  Place place = b.place;
  std::int64_t mapped = b.mapped;
  if (const auto next = kept_.find({place.mapping, place.offset + mapped}); next != kept_.end())
    mapped += take(next).mapped;
  if (const auto after = kept_.lower_bound(place); after != kept_.begin()) {
    const auto before = std::prev(after);
    if (before->first.mapping == place.mapping &&
        before->first.offset + before->second == place.offset) {
      place = before->first;
      mapped += take(before).mapped;
    }
  }
  keep(place, mapped);
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

BlockCache::Block BlockCache::block_at(Place place, std::int64_t mapped) const {
  char* const base = mappings_.at(place.mapping).base;
  return {base ? base + place.offset : nullptr, mapped, place};
}

BlockCache::Block BlockCache::map_fresh(std::int64_t mapped) {
  char* const base = count_only_ ? nullptr : static_cast<char*>(map_pages(mapped));
  if (!base && !count_only_) return {};
  const std::int64_t number = next_mapping_++;
  mappings_[number] = {base, mapped};
  return {base, mapped, {number, 0}};
}

void BlockCache::unmap(const Block& block) {
  if (!count_only_) {                    // else nothing was mapped
    unpoison(block.data, block.mapped);  // the addresses may be mapped again, for anything
    munmap(block.data, static_cast<std::size_t>(block.mapped));
  }
  forget(block);
}

void BlockCache::forget(const Block& block) {
  const auto mapping = mappings_.find(block.place.mapping);
  if ((mapping->second.bytes -= block.mapped) == 0) mappings_.erase(mapping);
}

void BlockCache::keep(Place place, std::int64_t mapped) {
  kept_.emplace(place, mapped);
  kept_by_size_.emplace(mapped, place);
  stats_.cached += mapped;
}

BlockCache::Block BlockCache::take_largest() {
  return take(kept_.find(std::prev(kept_by_size_.end())->second));
}

BlockCache::Block BlockCache::take(Kept::iterator it) {
  const Block block = block_at(it->first, it->second);
  kept_by_size_.erase({it->second, it->first});
  kept_.erase(it);
  stats_.cached -= block.mapped;
  return block;
}

std::int64_t BlockCache::release_kept() {
  std::int64_t released = 0;
  while (!kept_.empty()) {
    const Block block = take(kept_.begin());
    unmap(block);
    released += block.mapped;
  }
  return released;
}

double BlockCache::bound_with(std::int64_t bytes) {
  return limit() * static_cast<double>(std::max(stats_.live_peak, stats_.live_mapped + bytes));
}

bool BlockCache::fits_beside_kept(std::int64_t bytes) {
  return static_cast<double>(stats_.mapped() + bytes) <= bound_with(bytes);
}

void BlockCache::make_room(std::int64_t bytes) {
  const double bound = bound_with(bytes);
  while (!kept_.empty() && static_cast<double>(stats_.mapped() + bytes) > bound) {
    unmap(take_largest());
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
