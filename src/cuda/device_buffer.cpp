#include "cuda/device_buffer.hpp"

#include <cuda_runtime_api.h>

#include <utility>

#include "core/error.hpp"
#include "cuda/cuda_error.hpp"

namespace laga::cuda {

DeviceBuffer::DeviceBuffer(std::int64_t bytes, const char* name, MemCategory category)
    : name_(name ? name : ""), category_(category) {
  LAGA_CHECK(bytes >= 0, "device buffer '", name_, "': ", bytes,
             " bytes asked for; a size is >= 0 (this is a bug in the caller)");
  if (bytes == 0) return;
  MemoryPool& pool = current_pool();
  if (!pool.count_only()) {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, static_cast<std::size_t>(bytes));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error so later calls can report theirs
      std::size_t free_bytes = 0, total_bytes = 0;
      const bool known = cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
      (void)cudaGetLastError();
      fail("cudaMalloc of ", bytes, " bytes for '", name_, "' failed: ", cudaGetErrorName(e), " (",
           cudaGetErrorString(e), ")",
           known ? cat("; the device has ", free_bytes, " of ", total_bytes, " bytes free")
                 : std::string(),
           "; a smaller --seq or more ranks need less (laga compare --count-only predicts the "
           "peak)");
    }
    data_ = p;
  }
  pool_ = &pool;
  bytes_ = bytes;
  id_ = pool.on_alloc(category_, bytes, name_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      id_(std::exchange(o.id_, 0)),
      name_(o.name_),
      category_(o.category_),
      pool_(std::exchange(o.pool_, nullptr)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    id_ = std::exchange(o.id_, 0);
    name_ = o.name_;
    category_ = o.category_;
    pool_ = std::exchange(o.pool_, nullptr);
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (data_) (void)cudaFree(data_);  // a failure here has nowhere to go; the next call reports it
  if (pool_) pool_->on_free(category_, bytes_, id_);
  data_ = nullptr;
  pool_ = nullptr;
  bytes_ = 0;
  id_ = 0;
}

void DeviceBuffer::upload(const void* host, std::int64_t bytes) {
  LAGA_CHECK(bytes == bytes_, "upload into device buffer '", name_, "': ", bytes,
             " bytes given for a buffer of ", bytes_, "; copy the whole buffer");
  if (!data_) return;
  check_cuda(cudaMemcpy(data_, host, static_cast<std::size_t>(bytes), cudaMemcpyHostToDevice),
             cat("cudaMemcpy to device of '", name_, "'"));
}

void DeviceBuffer::download(void* host, std::int64_t bytes) const {
  LAGA_CHECK(bytes == bytes_, "download of device buffer '", name_, "': ", bytes,
             " bytes asked for from a buffer of ", bytes_, "; copy the whole buffer");
  if (!data_) return;
  check_cuda(cudaMemcpy(host, data_, static_cast<std::size_t>(bytes), cudaMemcpyDeviceToHost),
             cat("cudaMemcpy from device of '", name_, "'"));
}

void DeviceBuffer::zero() {
  if (!data_) return;
  check_cuda(cudaMemset(data_, 0, static_cast<std::size_t>(bytes_)),
             cat("cudaMemset of '", name_, "'"));
}

}  // namespace laga::cuda
