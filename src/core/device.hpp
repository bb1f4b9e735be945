// Where a tensor's bytes live and where a kernel runs (docs/architecture.md,
// "Device storage and the emulated device").
//
// A device other than the CPU is a DeviceMemory: its allocations and the
// copies between it and the host. A MemoryPool given one (set_device_memory)
// is that device's pool: its tensors' storage comes from the device, with
// the pool's accounting unchanged (one allocation path; a count-only device
// pool counts and allocates nothing, so count-only predicts the device peak
// as it predicts the host's). The kernel table (mla/op_table.hpp) has rows
// per device; the block runner (mla/runner.cpp) uploads a rank's shard and
// parameters into its device pool, runs the form there, and downloads what
// it returns.
//
// Two devices implement DeviceMemory:
// - cuda (cuda/device_memory_cuda.cpp, built with LAGA_CUDA): managed
//   memory (cudaMallocManaged), registered by the program that runs on a GPU
//   (cuda::register_cuda_memory).
// - emulated (here): the CPU standing in for a device, so that every line of
//   the device plumbing runs in CI without one. Its allocations are separate
//   host allocations it keeps a list of; its copies refuse a pointer on the
//   wrong side (a host pointer where device memory is due, or the reverse);
//   its kernel rows are the CPU's kernels behind a check that every operand
//   is its memory (op_table.cpp), so a form that hands a host buffer to a
//   device kernel fails here as it would on a GPU.
#pragma once

#include <cstdint>

namespace laga {

// A closed set: every device a kernel row or a pool can be on.
enum class Device { cpu, cuda, emulated };
const char* to_string(Device d);  // "cpu", "cuda", "emulated"

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual Device device() const = 0;
  // `bytes` (> 0) bytes, 64-byte aligned, uninitialised; null when the
  // device has no memory left.
  virtual void* allocate(std::int64_t bytes) = 0;
  virtual void release(void* p) = 0;
  // Synchronous copies of `bytes` bytes: host -> device, device -> host,
  // device -> device (the device-local transport's).
  virtual void to_device(void* dst, const void* src, std::int64_t bytes) = 0;
  virtual void to_host(void* dst, const void* src, std::int64_t bytes) = 0;
  virtual void on_device(void* dst, const void* src, std::int64_t bytes) = 0;
  // `bytes` bytes at p (device memory) set to zero on the device
  // (Tensor::zeros of a device pool's tensor: cudaMemset on a GPU).
  virtual void zero(void* p, std::int64_t bytes) = 0;
  // Whether [p, p + bytes) lies inside one live allocation of this memory.
  virtual bool holds(const void* p, std::int64_t bytes) const = 0;
  // Waits for the device's queued work (after a kernel, before the host
  // reads what it wrote); the emulated device has none.
  virtual void synchronize() {}
  // Whether a kernel row's operands are checked against holds() before it
  // runs (op_table.cpp): on for the emulated device, whose point it is.
  virtual bool checks_operands() const { return false; }

  // Bytes this memory has copied since the process started, by direction
  // (all threads): what a run moved across the block's boundary and between
  // ranks on the device.
  struct Copied {
    std::int64_t to_device = 0, to_host = 0, on_device = 0;
  };
  virtual Copied copied() const = 0;
};

// The emulated device's memory (one per process; thread-safe: ranks are
// threads).
DeviceMemory& emulated_memory();
// The memory of `d` in this process: the emulated one, the registered CUDA
// one, or null (cpu, or cuda before register_device_memory).
DeviceMemory* device_memory(Device d);
// Makes `m` the memory of m.device() (a backend's, once per process).
void register_device_memory(DeviceMemory& m);

}  // namespace laga
