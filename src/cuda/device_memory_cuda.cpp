#include "cuda/device_memory_cuda.hpp"

#include <cuda_runtime_api.h>

#include <atomic>

#include "comm/local_comm.hpp"
#include "core/device.hpp"
#include "core/error.hpp"
#include "cuda/cuda_error.hpp"
#include "cuda/device.hpp"
#include "cuda/elementwise.hpp"

namespace laga::cuda {

namespace {

class CudaMemory final : public DeviceMemory {
 public:
  Device device() const override { return Device::cuda; }
  void* allocate(std::int64_t bytes) override {
    void* p = nullptr;
    if (cudaMallocManaged(&p, static_cast<std::size_t>(bytes), cudaMemAttachGlobal) !=
        cudaSuccess) {
      (void)cudaGetLastError();  // out of memory: the pool's caller names the tensor
      return nullptr;
    }
    return p;
  }
  void release(void* p) override {
    if (p) (void)cudaFree(p);  // a failure has nowhere to go; the next call reports it
  }
  void to_device(void* dst, const void* src, std::int64_t bytes) override {
    copy(dst, src, bytes, cudaMemcpyHostToDevice, "cudaMemcpy host -> device");
    to_device_ += bytes;
  }
  void to_host(void* dst, const void* src, std::int64_t bytes) override {
    copy(dst, src, bytes, cudaMemcpyDeviceToHost, "cudaMemcpy device -> host");
    to_host_ += bytes;
  }
  void on_device(void* dst, const void* src, std::int64_t bytes) override {
    copy(dst, src, bytes, cudaMemcpyDeviceToDevice, "cudaMemcpy device -> device");
    on_device_ += bytes;
  }
  void zero(void* p, std::int64_t bytes) override {
    if (bytes > 0)
      check_cuda(cudaMemset(p, 0, static_cast<std::size_t>(bytes)),
                 "cudaMemset of a zeroed tensor");
  }
  bool holds(const void* p, std::int64_t) const override {
    cudaPointerAttributes a{};
    if (!p || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeManaged || a.type == cudaMemoryTypeDevice;
  }
  void synchronize() override { check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
  Copied copied() const override { return {to_device_.load(), to_host_.load(), on_device_.load()}; }

 private:
  static void copy(void* dst, const void* src, std::int64_t bytes, cudaMemcpyKind kind,
                   const char* what) {
    if (bytes <= 0) return;
    check_cuda(cudaMemcpy(dst, src, static_cast<std::size_t>(bytes), kind), what);
  }
  std::atomic<std::int64_t> to_device_{0}, to_host_{0}, on_device_{0};
};

// The device-local transport's reduction on the device (comm/local_comm.hpp,
// register_device_reduction): the P block pointers uploaded into this
// thread's array (each rank's thread sums its own chunk), then the kernel
// of cuda/elementwise.hpp, waited for (the transport's next step reads dst).
void sum_on_device(void* dst, const void* const* srcs, int P, std::int64_t n, DType dtype) {
  struct Parts {
    void* p = nullptr;
    int capacity = 0;
    ~Parts() {
      if (p) (void)cudaFree(p);
    }
  };
  thread_local Parts parts;
  if (parts.capacity < P) {
    if (parts.p) (void)cudaFree(parts.p);
    parts.p = nullptr, parts.capacity = 0;
    check_cuda(cudaMalloc(&parts.p, sizeof(void*) * static_cast<std::size_t>(P)),
               "cudaMalloc of the device-local reduction's block pointers");
    parts.capacity = P;
  }
  check_cuda(cudaMemcpy(parts.p, srcs, sizeof(void*) * static_cast<std::size_t>(P),
                        cudaMemcpyHostToDevice),
             "cudaMemcpy of the device-local reduction's block pointers");
  sum_in_rank_order(dst, static_cast<const void* const*>(parts.p), P, n, dtype);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the device-local reduction");
}

}  // namespace

void register_cuda_memory() {
  const std::string missing = device_unavailable_reason();
  LAGA_CHECK(missing.empty(), missing);
  static CudaMemory memory;
  register_device_memory(memory);
  register_device_reduction(Device::cuda, &sum_on_device);
}

}  // namespace laga::cuda
