#include "core/memory_pool.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/error.hpp"

namespace laga {

const char* to_string(MemCategory c) {
  switch (c) {
    case MemCategory::activations:
      return "activations";
    case MemCategory::parameters:
      return "parameters";
    case MemCategory::gradients:
      return "gradients";
    case MemCategory::comm_buffers:
      return "comm_buffers";
    case MemCategory::optimizer:
      return "optimizer";
    case MemCategory::count:
      break;
  }
  return "?";
}

std::int64_t MemoryPool::on_alloc(MemCategory c, std::int64_t bytes, const std::string& name) {
  const int i = idx(c);
  current_[i] += bytes;
  peak_[i] = std::max(peak_[i], current_[i]);
  current_total_ += bytes;
  peak_total_ = std::max(peak_total_, current_total_);
  peak_working_ = std::max(peak_working_, current_[idx(MemCategory::activations)] +
                                              current_[idx(MemCategory::comm_buffers)]);
  peak_held_ = std::max(peak_held_, held());
  peak_requested_ = std::max(peak_requested_, current_total_);
  peak_small_ = std::max(peak_small_, current_total_ - cache_.stats().live_requested);
  ++alloc_count_;
  if (trace_) trace_->push_back({c, bytes});
  if (!live_tracking_ || (c != MemCategory::activations && c != MemCategory::comm_buffers))
    return 0;
  const std::int64_t id = next_id_++;
  live_[id] = {name.empty() ? std::string("(unnamed)") : name, c, bytes};
  const std::int64_t working = current_[idx(MemCategory::activations)] +
                               current_[idx(MemCategory::comm_buffers)] - stretch_base_;
  if (working > snapshot_.bytes || snapshot_.where.empty()) {
    snapshot_.bytes = working;
    snapshot_.where = stage_.empty() ? live_[id].name : stage_ + ": " + live_[id].name;
    snapshot_.live.clear();
    for (auto it = live_.lower_bound(stretch_first_id_); it != live_.end(); ++it)
      snapshot_.live.push_back(it->second);
  }
  return id;
}

void MemoryPool::set_live_tracking(bool on) {
  live_tracking_ = on;
  live_.clear();
  reset_peaks();
}

MemoryPool::PeakSnapshot MemoryPool::working_peak_snapshot() const {
  PeakSnapshot p = snapshot_;
  std::stable_sort(p.live.begin(), p.live.end(),
                   [](const LiveAlloc& a, const LiveAlloc& b) { return a.bytes > b.bytes; });
  return p;
}

void MemoryPool::on_free(MemCategory c, std::int64_t bytes, std::int64_t id) {
  const int i = idx(c);
  LAGA_CHECK(current_[i] >= bytes, "memory pool: freeing ", bytes, " bytes of ", to_string(c),
             " but only ", current_[i], " are live (a tensor freed twice or moved between pools)");
  current_[i] -= bytes;
  current_total_ -= bytes;
  if (trace_) trace_->push_back({c, -bytes});
  if (id != 0) live_.erase(id);
}

void MemoryPool::reset_peaks() {
  peak_ = current_;
  peak_total_ = current_total_;
  peak_held_ = held();
  peak_working_ =
      current_[idx(MemCategory::activations)] + current_[idx(MemCategory::comm_buffers)];
  stretch_first_id_ = next_id_;
  stretch_base_ = peak_working_;
  snapshot_ = {};
}

namespace {
constexpr std::size_t kAlign = 64;  // one cache line; AVX2 loads never straddle two

MemoryPool& default_pool() {
  static MemoryPool pool;
  return pool;
}
thread_local MemoryPool* tls_pool = nullptr;
}  // namespace

void MemoryPool::set_count_only(bool on) {
  cache_.set_count_only(on);
  count_only_ = on;
}

void MemoryPool::set_device_memory(DeviceMemory* memory) {
  LAGA_CHECK(current_total_ == 0, "internal: a memory pool changes device with ", current_total_,
             " bytes live");
  device_memory_ = memory;
}

MemoryPool::Storage MemoryPool::acquire_storage(std::int64_t bytes) {
  Storage s;
  if (device_memory_) {  // a device's pool: its memory, no cache
    if (!count_only_) s.data = device_memory_->allocate(bytes);
  } else if (bytes >= cache_min_bytes_ && cache_.limit() > 0.0) {
    const BlockCache::Block b = cache_.acquire(bytes);  // {nullptr, 0} when out of memory
    s = {b.data, b.mapped, b.place};
  } else if (!count_only_) {
    const std::size_t rounded = (static_cast<std::size_t>(bytes) + kAlign - 1) / kAlign * kAlign;
    s = {std::aligned_alloc(kAlign, rounded), 0, {}};
  }
  if (storage_tracking_ && s.data) {
    const auto begin = reinterpret_cast<std::uintptr_t>(s.data);
    blocks_[begin] = {begin + static_cast<std::uintptr_t>(bytes), next_block_++};
  }
  return s;
}

void MemoryPool::release_storage(Storage storage, std::int64_t bytes) {
  if (storage.data) blocks_.erase(reinterpret_cast<std::uintptr_t>(storage.data));
  if (storage.cached())  // a count-only one too: the cache counts it back
    cache_.release({storage.data, storage.mapped, storage.place}, bytes);
  else if (device_memory_)
    device_memory_->release(storage.data);
  else
    std::free(storage.data);
}

void MemoryPool::set_storage_tracking(bool on) {
  if (on == storage_tracking_) return;  // on again keeps what it knows
  storage_tracking_ = on;
  blocks_.clear();
}

std::int64_t MemoryPool::storage_block(const void* p, std::int64_t bytes) const {
  const auto begin = reinterpret_cast<std::uintptr_t>(p);
  auto it = blocks_.upper_bound(begin);  // the first block starting after p
  if (p == nullptr || bytes < 0 || it == blocks_.begin()) return 0;
  --it;
  return begin + static_cast<std::uintptr_t>(bytes) <= it->second.end ? it->second.number : 0;
}

void MemoryPool::set_cache_min_bytes(std::int64_t bytes) {
  LAGA_CHECK(bytes > 0, "MemoryPool::set_cache_min_bytes(", bytes,
             "): the smallest request the cache serves must be at least 1 byte");
  cache_min_bytes_ = bytes;
}

std::int64_t MemoryPool::held() const {
  const BlockCache::Stats& c = cache_.stats();
  return current_total_ + (c.live_mapped - c.live_requested) + c.cached;
}

std::int64_t MemoryPool::held_bound() {
  const double factor = std::max(cache_.limit(), 1.0);
  return peak_small_ +
         static_cast<std::int64_t>(std::ceil(factor * double(cache_.stats().live_peak)));
}

MemoryPool& current_pool() {
  return tls_pool ? *tls_pool : default_pool();
}

PoolScope::PoolScope(MemoryPool& pool) : previous_(tls_pool) {
  tls_pool = &pool;
}
PoolScope::~PoolScope() {
  tls_pool = previous_;
}

}  // namespace laga
