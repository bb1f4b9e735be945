#include "core/memory_pool.hpp"

#include <algorithm>

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

void MemoryPool::on_alloc(MemCategory c, std::int64_t bytes) {
  const int i = idx(c);
  current_[i] += bytes;
  peak_[i] = std::max(peak_[i], current_[i]);
  current_total_ += bytes;
  peak_total_ = std::max(peak_total_, current_total_);
  peak_working_ = std::max(peak_working_, current_[idx(MemCategory::activations)] +
                                              current_[idx(MemCategory::comm_buffers)]);
  ++alloc_count_;
  if (trace_) trace_->push_back({c, bytes});
}

void MemoryPool::on_free(MemCategory c, std::int64_t bytes) {
  const int i = idx(c);
  LAGA_CHECK(current_[i] >= bytes, "memory pool: freeing ", bytes, " bytes of ", to_string(c),
             " but only ", current_[i], " are live (a tensor freed twice or moved between pools)");
  current_[i] -= bytes;
  current_total_ -= bytes;
  if (trace_) trace_->push_back({c, -bytes});
}

void MemoryPool::reset_peaks() {
  peak_ = current_;
  peak_total_ = current_total_;
  peak_working_ =
      current_[idx(MemCategory::activations)] + current_[idx(MemCategory::comm_buffers)];
}

namespace {
MemoryPool& default_pool() {
  static MemoryPool pool;
  return pool;
}
thread_local MemoryPool* tls_pool = nullptr;
}  // namespace

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
