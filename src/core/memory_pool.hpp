// MemoryPool — per-rank accounting of live bytes by category.
//
// Every Tensor registers its bytes with the pool current on its thread when it
// is allocated and unregisters them when freed, so the pool knows at any time
// how many bytes of each category are live, and the high-water mark of each
// category and of their sum. Ranks run as threads each install their own pool
// (PoolScope), so one process measures P ranks apart.
//
// Peaks are exact for what laga allocates through Tensor; allocator overhead,
// BLAS/OpenMP internal buffers and stack are not counted (docs/accounting.md).
//
// The pool also hands tensors their storage: large blocks from its own
// BlockCache (block_cache.hpp), which keeps freed blocks for reuse, the rest
// from aligned_alloc. The counts above are of the bytes tensors ask for,
// whichever the source: the cache sits below them and changes none of them.
// held() adds what the cache holds on top.
//
// Thread safety: a pool (its counts and its cache) is used by one thread at
// a time: its rank's thread, or another one once that thread is joined.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/block_cache.hpp"
#include "core/device.hpp"

namespace laga {

enum class MemCategory : int {
  activations = 0,  // forward/backward tensors: saved-for-backward and transients
  parameters,
  gradients,     // parameter gradients
  comm_buffers,  // pack/unpack staging for collectives
  optimizer,     // AdamW moments
  count
};
constexpr int kNumMemCategories = static_cast<int>(MemCategory::count);
const char* to_string(MemCategory c);

class MemoryPool {
 public:
  // Returns the allocation's id for on_free (0 unless live tracking is on).
  // name: what the bytes are, for the live list ("q_h [1, 64, 4, 24]").
  std::int64_t on_alloc(MemCategory c, std::int64_t bytes, const std::string& name = {});
  void on_free(MemCategory c, std::int64_t bytes, std::int64_t id = 0);

  std::int64_t current(MemCategory c) const { return current_[idx(c)]; }
  std::int64_t peak(MemCategory c) const { return peak_[idx(c)]; }
  std::int64_t current_total() const { return current_total_; }
  std::int64_t peak_total() const { return peak_total_; }
  // Peak of activations + comm_buffers together: the "activation memory" a
  // training framework would see besides parameters, gradients and optimizer.
  std::int64_t peak_working() const { return peak_working_; }
  std::int64_t alloc_count() const { return alloc_count_; }

  // Sets every peak to the current value, so a measured region starts clean.
  void reset_peaks();

  // Count-only: tensors allocated under this pool are accounted but get no
  // storage, so one rank of any size can be measured without the memory.
  // Its cache maps nothing but counts as a real one would (held() too). Only
  // while no cached block is live (BlockCache::set_count_only).
  void set_count_only(bool on);

  // Storage for `bytes` (> 0) bytes of a tensor, 64-byte aligned and
  // uninitialised: from the cache when its limit is not 0 and bytes >=
  // cache_min_bytes(), else from aligned_alloc. data is nullptr when there is
  // no memory, and always in count-only mode (where `mapped` still says
  // whether, and what, the cache counted for the request). The caller
  // accounts the bytes with on_alloc.
  struct Storage {
    void* data = nullptr;
    // > 0: from the cache, its block's mapped bytes (release_storage gives
    // it back there); 0: from aligned_alloc.
    std::int64_t mapped = 0;
    BlockCache::Place place;  // the cache's name for the block
    bool cached() const { return mapped > 0; }
  };
  Storage acquire_storage(std::int64_t bytes);
  // Gives back what acquire_storage(bytes) returned, with the same bytes.
  void release_storage(Storage storage, std::int64_t bytes);

  // Storage tracking (tests: Communicator's deferred delivery,
  // comm/communicator.hpp "Overlap"): while on, the pool keeps the address
  // range of every block acquire_storage hands out, each under a number never
  // used again, so a caller that noted a buffer's block can tell later
  // whether that block is still live there: not released, nor released and
  // handed out again at the same address (the cache does that). Only blocks
  // acquired while it is on are known; turning it off forgets them. Off by
  // default: a map update per allocation.
  void set_storage_tracking(bool on);
  bool storage_tracking() const { return storage_tracking_; }
  // The number of the tracked live block that holds all of [p, p + bytes),
  // or 0 when none does (tracking off, not this pool's storage, released).
  std::int64_t storage_block(const void* p, std::int64_t bytes) const;

  // A device's pool (core/device.hpp): from now on the storage of its
  // tensors comes from `memory` (null: the host again), counted exactly as
  // the host's is; the block cache is not used (held() is then the live
  // bytes). Only while nothing is live in the pool.
  void set_device_memory(DeviceMemory* memory);
  DeviceMemory* device_memory() const { return device_memory_; }
  // Where this pool's tensors live: cpu, or its DeviceMemory's device.
  Device device() const { return device_memory_ ? device_memory_->device() : Device::cpu; }

  // The pool's block cache: its limit, trim() (where a run ends) and stats.
  BlockCache& cache() { return cache_; }
  const BlockCache& cache() const { return cache_; }
  std::int64_t cache_min_bytes() const { return cache_min_bytes_; }
  // BlockCache::kDefaultMinBytes unless set (a test routes small tensors
  // through the cache with a lower one).
  void set_cache_min_bytes(std::int64_t bytes);

  // What this pool's tensors hold from the system: the live bytes
  // (current_total) plus the page rounding of live cached blocks plus the
  // blocks kept for reuse. Its peak moves on allocation and starts again at
  // reset_peaks(), as the others do.
  std::int64_t held() const;
  std::int64_t peak_held() const { return peak_held_; }
  // The most the pool can hold at any time, given the live peaks since it
  // was made: its small tensors (those not from the cache) at their peak,
  // plus what the cache may map, max(limit, 1) x its live peak
  // (BlockCache, "The bound"). A count-only run of one step gives the bound
  // of every later step of the same shapes, where held() itself can grow
  // as the cache keeps more (docs/accounting.md, "The block cache").
  std::int64_t held_bound();
  // held_bound() less the peak of the tensors' own bytes since the pool was
  // made (not restarted by reset_peaks): what the pool may hold beyond what
  // its tensors ask for, at most, in any number of steps of the same shapes.
  std::int64_t cache_allowance() { return held_bound() - peak_requested_; }

  // Optional log of every event as (category, +bytes on alloc / -bytes on
  // free), so a test can recompute the peaks from the raw sequence.
  struct Event {
    MemCategory category;
    std::int64_t delta;
  };
  void set_trace(std::vector<Event>* trace) { trace_ = trace; }
  bool count_only() const { return count_only_; }

  // Live tracking: the pool keeps every live activation and comm buffer by
  // name, and a snapshot of them where the working peak (activations + comm
  // buffers) of the current stretch is reached. A stretch starts at
  // reset_peaks(), and the snapshot holds only what was allocated in it, in
  // bytes above what was live at its start. Off by default: it costs a map
  // update per allocation (the memory prediction turns it on).
  struct LiveAlloc {
    std::string name;
    MemCategory category;
    std::int64_t bytes;
  };
  struct PeakSnapshot {
    std::int64_t bytes = 0;       // working bytes above the stretch's start
    std::string where;            // "<stage>: <the allocation that reached it>"
    std::vector<LiveAlloc> live;  // largest first
  };
  void set_live_tracking(bool on);
  bool live_tracking() const { return live_tracking_; }
  void set_stage(std::string stage) { stage_ = std::move(stage); }
  PeakSnapshot working_peak_snapshot() const;

 private:
  static int idx(MemCategory c) { return static_cast<int>(c); }
  std::array<std::int64_t, kNumMemCategories> current_{};
  std::array<std::int64_t, kNumMemCategories> peak_{};
  std::int64_t current_total_ = 0, peak_total_ = 0, peak_working_ = 0;
  std::int64_t alloc_count_ = 0, peak_held_ = 0;
  // Since the pool was made (reset_peaks leaves them): the peak of
  // current_total, and of it less the cache's live requests.
  std::int64_t peak_requested_ = 0, peak_small_ = 0;
  bool count_only_ = false;
  DeviceMemory* device_memory_ = nullptr;
  BlockCache cache_;
  std::int64_t cache_min_bytes_ = BlockCache::kDefaultMinBytes;
  std::vector<Event>* trace_ = nullptr;
  // Storage tracking: each tracked live block by its first byte: its end and number.
  struct TrackedBlock {
    std::uintptr_t end;
    std::int64_t number;
  };
  bool storage_tracking_ = false;
  std::int64_t next_block_ = 1;
  std::map<std::uintptr_t, TrackedBlock> blocks_;
  bool live_tracking_ = false;
  std::int64_t next_id_ = 1, stretch_first_id_ = 1, stretch_base_ = 0;
  std::map<std::int64_t, LiveAlloc> live_;
  PeakSnapshot snapshot_;
  std::string stage_;
};

// The pool Tensors on this thread register with: the one installed by the
// innermost live PoolScope, else a process-wide default.
MemoryPool& current_pool();

class PoolScope {
 public:
  explicit PoolScope(MemoryPool& pool);
  ~PoolScope();
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  MemoryPool* previous_;
};

}  // namespace laga
