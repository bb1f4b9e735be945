// BlockCache — large tensor storage kept after it is freed, for the next
// allocation of the same size, so that a training step that allocates what
// the previous step freed maps no fresh memory and takes no page faults.
//
// Why: glibc maps every allocation above its mmap threshold afresh and unmaps
// it when freed, so each step's large activations were faulted in again, one
// fault per 4 KiB (docs/performance.md, "Page faults"); raising glibc's
// thresholds instead fragments its heap, a footprint no laga figure sees.
//
// How: a block is an anonymous mmap of the request rounded up to whole pages;
// when freed it is kept in a free list of its mapped size, and a request
// reuses the smallest kept block of at least its page-rounded size and at
// most 1/8 more (kSlackEighths): its exact size whenever one is kept, as in a
// dense step, whose shapes repeat every step (size classes found no more
// blocks on the block's allocation traces and mapped more); and a block a
// little larger for the tensors whose sizes follow the routing (an MoE
// layer's rows under expert parallelism differ from step to step, and at
// exact sizes every step mapped them afresh: docs/performance.md, "Page
// faults"). Each MemoryPool owns one (a rank's footprint is its own) and
// decides which requests come here.
//
// The bound: mapped() = live_mapped + cached never exceeds
// limit x live_peak, live_peak being the peak of live_mapped since
// construction or the last trim(). A request that finds no kept block of its
// size maps a fresh one when that fits under the bound beside every kept
// block. Where it would not, it takes the kept block nearest in size and
// resizes it (mremap: a shrink maps nothing, a growth only its new pages),
// releasing other kept blocks, largest first, until the growth fits (or
// none is left: live blocks alone are within it, limit >= 1). Evicting to
// map afresh instead had each MoE step of `laga train` fault in ~6,200
// pages (4 KiB) of its routing-sized tensors again; resizing leaves ~1,000
// (docs/performance.md, "Page faults"). Freeing and reusing change mapped()
// not at all.
//
// Count-only: a cache in count-only mode maps nothing and hands out nullptr,
// but keeps, reuses, evicts and counts its (empty) blocks exactly as a
// mapping one would, so a count-only run predicts every figure of stats()
// byte for byte.
//
// Thread safety: none of its own. It is used under its pool's rule: one
// thread at a time (a rank's thread, or another one after a join).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

namespace laga {

class BlockCache {
 public:
  // Byte counts, all in whole mapped pages except live_requested.
  struct Stats {
    std::int64_t live_mapped = 0;     // blocks in use by tensors
    std::int64_t live_requested = 0;  // what those tensors asked for (<= live_mapped)
    std::int64_t cached = 0;          // freed blocks kept for reuse
    std::int64_t live_peak = 0;       // peak of live_mapped since construction or trim()
    std::int64_t mapped_peak = 0;     // peak of live_mapped + cached, same span
    // Block counts since construction: requests served by a kept block, by
    // a fresh mapping, by a kept block of another size resized to theirs,
    // and kept blocks unmapped to honour the bound (also after a lowered
    // limit; trim() and a failed mapping's retry not counted).
    std::int64_t hits = 0, misses = 0, resized = 0, evicted = 0;
    std::int64_t mapped() const { return live_mapped + cached; }
    // Requests that took new pages: a fresh block, or a kept one resized.
    std::int64_t not_reused() const { return misses + resized; }
  };

  BlockCache() = default;
  ~BlockCache();  // unmaps every kept block (live ones belong to their tensors)
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // A block and the bytes mapped for it (whole pages, at least the request).
  struct Block {
    void* data = nullptr;
    std::int64_t mapped = 0;
  };
  // A block of at least `bytes` (> 0) bytes, page-aligned; its contents are
  // whatever its last user left (a fresh mapping reads as zeros). data is
  // nullptr when the system has no memory even after every kept block is
  // released, and always in count-only mode (mapped says what was counted).
  Block acquire(std::int64_t bytes);
  // Gives back a block from acquire(bytes), with the same bytes: kept when
  // the cache is on, unmapped when it is off.
  void release(const Block& block, std::int64_t bytes);
  // Unmaps every kept block and starts live_peak again from live_mapped;
  // returns the bytes unmapped.
  std::int64_t trim();

  // The factor of the bound: 0 keeps nothing (every freed block is unmapped
  // at once), else a number >= 1; lowering it releases kept blocks now. Until
  // set, default_cache_limit().
  void set_limit(double limit);
  double limit();

  const Stats& stats() const { return stats_; }

  // Switches count-only mode; only while no block is live (kept ones are
  // released first, so mapped and counted blocks never meet).
  void set_count_only(bool on);
  bool count_only() const { return count_only_; }

  // The smallest request that deserves a block of its own: glibc's default
  // mmap threshold (128 KiB); below it glibc serves requests from its heap,
  // which it keeps mapped.
  static constexpr std::int64_t kDefaultMinBytes = std::int64_t{128} << 10;
  // A kept block serves a request of up to 1/8 fewer pages than its own.
  static constexpr std::int64_t kSlackEighths = 1;

 private:
  void unmap(void* block, std::int64_t mapped);
  // Unmaps every kept block; returns the bytes.
  std::int64_t release_kept();
  // Releases kept blocks, largest first, until `bytes` more fit under the
  // bound or none is left.
  void make_room(std::int64_t bytes);
  // The bound when `bytes` more go live, and whether a fresh block of them
  // fits under it beside every kept block.
  double bound_with(std::int64_t bytes);
  bool fits_beside_kept(std::int64_t bytes);
  // The kept block nearest to `mapped` bytes in size (the larger one on a
  // tie: shrinking maps no page), taken out of the cache.
  Block take_nearest(std::int64_t mapped);

  static constexpr double kUnset = -1.0;
  double limit_ = kUnset;
  bool count_only_ = false;
  Stats stats_;
  // mapped size -> kept blocks (nullptr in count-only mode)
  std::map<std::int64_t, std::vector<void*>> kept_;
};

// The limit a BlockCache starts with: LAGA_POOL_CACHE when set, else 1.25
// (0 under AddressSanitizer, whose redzones and quarantine find overflows and
// use after free only in memory from malloc). Read once; a bad value throws
// at every call.
double default_cache_limit();

namespace detail {
// LAGA_POOL_CACHE's value: unset or empty -> `fallback`; "off" -> 0; a number
// >= 1 -> itself. Anything else throws laga::Error naming the variable.
double parse_cache_limit(const char* setting, double fallback);
}  // namespace detail

}  // namespace laga
