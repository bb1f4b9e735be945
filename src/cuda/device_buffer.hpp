// DeviceBuffer — device memory with the host pool's accounting: the one way
// laga allocates on a GPU (docs/accounting.md, "Device memory").
//
// A buffer registers its bytes with the MemoryPool current on the allocating
// thread (core/memory_pool.hpp) under a MemCategory and a name, exactly as a
// Tensor does, and unregisters them there when freed. A rank that computes on
// a GPU installs the pool that stands for its device (PoolScope), so the
// pool's peaks are the device's peaks, and under a count-only pool a buffer
// is accounted but gets no storage (data() == nullptr, no CUDA call is
// made): the count-only run predicts the device peak as it predicts the
// host's, and runs on a machine without a GPU.
//
// Storage is cudaMalloc'd and cudaFree'd per buffer: no cache below it yet,
// so what the device holds for laga is what the pool counts (the host pool's
// BlockCache has no device counterpart; cudaFree synchronises the device,
// which a later step that times whole blocks would want cached away).
// Allocation failure throws laga::Error naming the bytes, the name and the
// device's free memory, and leaves nothing registered.
#pragma once

#include <cstdint>

#include "core/memory_pool.hpp"

namespace laga::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // bytes >= 0 (0: no storage, nothing registered). name: a string literal
  // (kept as a pointer), what the bytes are in the pool's live list.
  DeviceBuffer(std::int64_t bytes, const char* name,
               MemCategory category = MemCategory::activations);
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  // Frees the storage and unregisters the bytes now.
  void reset();

  void* data() { return data_; }
  const void* data() const { return data_; }
  template <class T>
  T* as() {
    return static_cast<T*>(data_);
  }
  template <class T>
  const T* as() const {
    return static_cast<const T*>(data_);
  }
  std::int64_t bytes() const { return bytes_; }
  // Whether it has storage (false for an empty buffer and under count-only).
  bool backed() const { return data_ != nullptr; }
  const char* name() const { return name_; }

  // Host <-> device copies of the whole buffer (synchronous). `bytes` must
  // equal bytes(); on an unbacked buffer they do nothing (count-only).
  void upload(const void* host, std::int64_t bytes);
  void download(void* host, std::int64_t bytes) const;
  // Sets every byte to 0 (cudaMemset); nothing on an unbacked buffer.
  void zero();

 private:
  void* data_ = nullptr;
  std::int64_t bytes_ = 0;
  std::int64_t id_ = 0;
  const char* name_ = "";
  MemCategory category_ = MemCategory::activations;
  MemoryPool* pool_ = nullptr;
};

}  // namespace laga::cuda
