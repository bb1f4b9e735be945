// BlockCache — large tensor storage kept after it is freed, for the next
// allocation of the same size, so that a training step that allocates what
// the previous step freed maps no fresh memory and takes no page faults.
//
// Why: glibc maps every allocation above its mmap threshold afresh and unmaps
// it when freed, so each step's large activations were faulted in again, one
// fault per 4 KiB (docs/performance.md, "Page faults"); raising glibc's
// thresholds instead fragments its heap, a footprint no laga figure sees.
//
// How: a mapping is an anonymous mmap of a request rounded up to whole
// pages; a block is a run of whole pages of one mapping: all of it, or a
// part split off. A freed block is kept, merged with the kept blocks just
// before and after it in its mapping, and a request takes the smallest kept
// block of at least its page-rounded size (best fit). A kept block up to 1/8
// larger (kSlackEighths) is taken whole: its exact size whenever one is kept,
// as in a dense step, whose shapes repeat every step, and one a little larger
// for the tensors whose sizes follow the routing (an MoE layer's rows under
// expert parallelism differ from step to step). A larger one is split: the
// request takes its front pages and the rest stays kept, so a step that
// allocates many sizes (bf16's tensors held at 2 bytes beside their 4-byte
// copies) reuses pages it already has instead of faulting in new ones; when
// the step's tensors are freed, the pieces merge back into the whole
// mapping, and the next step splits it the same way (docs/performance.md,
// "Page faults").
//
// The bound: mapped() = live_mapped + cached never exceeds
// limit x live_peak, live_peak being the peak of live_mapped since
// construction or the last trim(). A request larger than every kept block
// maps a fresh one when that fits under the bound beside every kept block.
// Where it would not, it grows the largest kept block (mremap: only the new
// pages are new), releasing other kept blocks, largest first, until the
// growth fits (or none is left: live blocks alone are within it, limit >=
// 1). Evicting to map afresh instead had each MoE step of `laga train`
// fault in ~6,200 pages (4 KiB) of its routing-sized tensors again;
// resizing leaves ~1,000 (docs/performance.md, "Page faults"). Freeing,
// reusing and splitting change mapped() not at all.
//
// Where a block lies is its place: its mapping's number and its offset
// there. Merging asks places, never addresses, so that it never
// joins two mappings the system happened to put side by side (one system
// call could not resize the pair), and so that a count-only run, which has
// no addresses, makes every decision a mapping run makes.
//
// Count-only: a cache in count-only mode maps nothing and hands out nullptr,
// but keeps, reuses, evicts and counts its (empty) blocks exactly as a
// mapping one would, so a count-only run predicts every figure of stats()
// byte for byte.
//
// Thread safety: none of its own. It is used under its pool's rule: one
// thread at a time (a rank's thread, or another one after a join).
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <set>
#include <utility>

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
    // Block counts since construction: requests served by a kept block (of
    // those, `splits` by the front of a larger one), by a fresh mapping, by
    // a smaller kept block grown to their size, and kept blocks unmapped to
    // honour the bound (also after a lowered limit; trim() and a failed
    // mapping's retry not counted).
    std::int64_t hits = 0, splits = 0, misses = 0, resized = 0, evicted = 0;
    std::int64_t mapped() const { return live_mapped + cached; }
    // Requests that took new pages: a fresh block, or a kept one resized.
    std::int64_t not_reused() const { return misses + resized; }
  };

  BlockCache() = default;
  ~BlockCache();  // unmaps every kept block (live ones belong to their tensors)
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // Where a block lies: the number of its mapping (from 1, never reused)
  // and its offset there, in bytes.
  struct Place {
    std::int64_t mapping = 0, offset = 0;
    auto operator<=>(const Place&) const = default;
  };
  // A block, the bytes mapped for it (whole pages, at least the request) and
  // its place (the cache's name for it: release() needs it back).
  struct Block {
    void* data = nullptr;
    std::int64_t mapped = 0;
    Place place;
  };
  // A block of at least `bytes` (> 0) bytes, page-aligned; its contents are
  // whatever its last user left (a fresh mapping reads as zeros). data is
  // nullptr when the system has no memory even after every kept block is
  // released, and always in count-only mode (mapped says what was counted).
  Block acquire(std::int64_t bytes);
  // Gives back a block from acquire(bytes), with the same bytes: kept (and
  // merged with its kept neighbours) when the cache is on, unmapped when it
  // is off.
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
  // A mapping's address (nullptr in count-only mode) and the bytes of it
  // still mapped, live or kept (it is forgotten at 0).
  struct Mapping {
    char* base = nullptr;
    std::int64_t bytes = 0;
  };
  using Kept = std::map<Place, std::int64_t>;  // place -> mapped bytes

  // The block of `mapped` bytes at `place`, with its address.
  Block block_at(Place place, std::int64_t mapped) const;
  // A fresh mapping of `mapped` bytes as one block; data is nullptr when the
  // system has none (count-only: always, and the mapping is counted).
  Block map_fresh(std::int64_t mapped);
  // Unmaps one block (live or just taken out of the cache).
  void unmap(const Block& block);
  // Takes a block's bytes off its mapping's (unmapped, or moved by mremap).
  void forget(const Block& block);
  // Keeps a block / takes the kept block at `it`, or the largest (one must
  // be kept), out of the cache.
  void keep(Place place, std::int64_t mapped);
  Block take(Kept::iterator it);
  Block take_largest();
  // Unmaps every kept block; returns the bytes.
  std::int64_t release_kept();
  // Releases kept blocks, largest first, until `bytes` more fit under the
  // bound or none is left.
  void make_room(std::int64_t bytes);
  // The bound when `bytes` more go live, and whether a fresh block of them
  // fits under it beside every kept block.
  double bound_with(std::int64_t bytes);
  bool fits_beside_kept(std::int64_t bytes);

  static constexpr double kUnset = -1.0;
  double limit_ = kUnset;
  bool count_only_ = false;
  Stats stats_;
  std::map<std::int64_t, Mapping> mappings_;  // number -> mapping
  std::int64_t next_mapping_ = 1;             // mapping 0 is no block's
  // The kept blocks, by place, and by size then place.
  Kept kept_;
  std::set<std::pair<std::int64_t, Place>> kept_by_size_;
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
