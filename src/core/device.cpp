#include "core/device.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "core/error.hpp"

namespace laga {

const char* to_string(Device d) {
  switch (d) {
    case Device::cpu:
      return "cpu";
    case Device::cuda:
      return "cuda";
    case Device::emulated:
      return "emulated";
  }
  return "?";
}

namespace {

// The emulated device: separate host allocations, kept by their first byte,
// so that a pointer can be told to be its memory or not.
class EmulatedMemory final : public DeviceMemory {
 public:
  Device device() const override { return Device::emulated; }
  void* allocate(std::int64_t bytes) override {
    const std::size_t rounded = (static_cast<std::size_t>(bytes) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) return nullptr;
    const std::lock_guard<std::mutex> lock(mutex_);
    live_[reinterpret_cast<std::uintptr_t>(p)] = static_cast<std::uintptr_t>(bytes);
    return p;
  }
  void release(void* p) override {
    if (!p) return;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      LAGA_CHECK(live_.erase(reinterpret_cast<std::uintptr_t>(p)) == 1,
                 "internal: the emulated device released memory it did not allocate");
    }
    std::free(p);
  }
  void to_device(void* dst, const void* src, std::int64_t bytes) override {
    check(dst, bytes, true, "host -> device copy's destination");
    check(src, bytes, false, "host -> device copy's source");
    copy(dst, src, bytes);
    to_device_ += bytes;
  }
  void to_host(void* dst, const void* src, std::int64_t bytes) override {
    check(dst, bytes, false, "device -> host copy's destination");
    check(src, bytes, true, "device -> host copy's source");
    copy(dst, src, bytes);
    to_host_ += bytes;
  }
  void on_device(void* dst, const void* src, std::int64_t bytes) override {
    check(dst, bytes, true, "device -> device copy's destination");
    check(src, bytes, true, "device -> device copy's source");
    copy(dst, src, bytes);
    on_device_ += bytes;
  }
  void zero(void* p, std::int64_t bytes) override {
    check(p, bytes, true, "zeroed block");
    if (bytes > 0) std::memset(p, 0, static_cast<std::size_t>(bytes));
  }
  bool holds(const void* p, std::int64_t bytes) const override {
    if (!p) return false;
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    const std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.upper_bound(a);  // the first allocation starting after p
    if (it == live_.begin()) return false;
    --it;
    return a + static_cast<std::uintptr_t>(bytes) <= it->first + it->second;
  }
  bool checks_operands() const override { return true; }
  Copied copied() const override { return {to_device_.load(), to_host_.load(), on_device_.load()}; }

 private:
  static void copy(void* dst, const void* src, std::int64_t bytes) {
    if (bytes > 0) std::memcpy(dst, src, static_cast<std::size_t>(bytes));
  }
  // A copy of no bytes names no memory; otherwise the pointer must be on
  // the side the copy says.
  void check(const void* p, std::int64_t bytes, bool on_device, const char* what) const {
    if (bytes == 0) return;
    LAGA_CHECK(p && holds(p, bytes) == on_device, "emulated device: the ", what, " (", bytes,
               " bytes) is ",
               on_device ? "not device memory" : "device memory where host memory is due",
               "; a device tensor must come from a device pool (MemoryPool::set_device_memory)");
  }
  std::atomic<std::int64_t> to_device_{0}, to_host_{0}, on_device_{0};
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::uintptr_t> live_;  // first byte -> bytes
};

std::atomic<DeviceMemory*> cuda_memory{nullptr};

}  // namespace

DeviceMemory& emulated_memory() {
  static EmulatedMemory m;
  return m;
}

DeviceMemory* device_memory(Device d) {
  switch (d) {
    case Device::cpu:
      return nullptr;
    case Device::cuda:
      return cuda_memory.load();
    case Device::emulated:
      return &emulated_memory();
  }
  return nullptr;
}

void register_device_memory(DeviceMemory& m) {
  LAGA_CHECK(m.device() == Device::cuda,
             "register_device_memory: only the CUDA backend registers its memory (",
             to_string(m.device()), " is built in)");
  cuda_memory.store(&m);
}

}  // namespace laga
