// The CUDA backend's shared module's entry point (mla/cuda_backend_abi.hpp):
// what `laga ... --device cuda` reads after dlopen. Built into
// liblaga_cuda_backend.so with the rest of this directory's objects, and
// into laga_cuda (where nothing calls it).
#include <cuda_runtime_api.h>

#include "core/error.hpp"
#include "cuda/cuda_error.hpp"
#include "cuda/device.hpp"
#include "cuda/device_memory_cuda.hpp"
#include "cuda/nccl_comm.hpp"
#include "mla/cuda_backend_abi.hpp"

namespace laga::ops {
std::span<const KernelRow> cuda_kernel_rows();  // cuda/op_table_cuda.cpp
}

namespace {

using namespace laga;

std::string device_description() {
  const cuda::DeviceInfo d = cuda::current_device();
  return cat(d.name, " (device ", d.ordinal, ", sm_", d.sm_major, d.sm_minor, ", ",
             d.memory_bytes / (1 << 20), " MiB), driver ", d.driver_version, ", runtime ",
             d.runtime_version);
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

void set_device(int ordinal) {
  cuda::check_cuda(cudaSetDevice(ordinal), cat("cudaSetDevice(", ordinal, ")"));
}

ops::NcclUniqueId make_nccl_id() {
  return cuda::make_nccl_id();
}

std::unique_ptr<Communicator> make_nccl_communicator(const ops::NcclUniqueId& id, int rank,
                                                     int size) {
  return std::make_unique<cuda::NcclCommunicator>(id, rank, size);
}

const ops::CudaBackendApi api = [] {
  ops::CudaBackendApi a;
  a.rows = &ops::cuda_kernel_rows;
  a.device_unavailable_reason = &cuda::device_unavailable_reason;
  a.device_description = &device_description;
  a.register_memory = &cuda::register_cuda_memory;
  a.device_count = &device_count;
  a.set_device = &set_device;
  a.make_nccl_id = &make_nccl_id;
  a.make_nccl_communicator = &make_nccl_communicator;
  return a;
}();

}  // namespace

extern "C" __attribute__((visibility("default"))) const laga::ops::CudaBackendApi*
laga_cuda_backend_api() {
  return &api;
}
