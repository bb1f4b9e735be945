#include "cuda/device.hpp"

#include <cuda_runtime_api.h>

#include "core/error.hpp"
#include "cuda/cuda_error.hpp"

namespace laga::cuda {

int built_compute_capability() {
  return LAGA_CUDA_MIN_ARCH;
}

std::string device_unavailable_reason() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    return cat("no usable CUDA device: cudaGetDeviceCount says ", cudaGetErrorName(e), " (",
               cudaGetErrorString(e),
               "); run on a machine with an NVIDIA GPU and its driver, or use --device cpu");
  }
  if (count == 0) {
    return "no CUDA device: cudaGetDeviceCount found none; run on a machine with an NVIDIA GPU, or "
           "use --device cpu";
  }
  int dev = 0;
  cudaDeviceProp p{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&p, dev) != cudaSuccess)
    return "the CUDA device's properties cannot be read; check it with nvidia-smi, or use --device "
           "cpu";
  const int cc = p.major * 10 + p.minor;
  if (cc < built_compute_capability()) {
    return cat("CUDA device ", dev, " (", p.name, ") has compute capability ", p.major, ".",
               p.minor, " but this build's kernels are for sm_", built_compute_capability(),
               " and later; rebuild with -DCMAKE_CUDA_ARCHITECTURES=", cc, " or use --device cpu");
  }
  return {};
}

DeviceInfo current_device() {
  const std::string why = device_unavailable_reason();
  LAGA_CHECK(why.empty(), why);
  DeviceInfo d;
  check_cuda(cudaGetDevice(&d.ordinal), "cudaGetDevice");
  cudaDeviceProp p{};
  check_cuda(cudaGetDeviceProperties(&p, d.ordinal), "cudaGetDeviceProperties");
  d.name = p.name;
  d.sm_major = p.major;
  d.sm_minor = p.minor;
  d.memory_bytes = static_cast<std::int64_t>(p.totalGlobalMem);
  d.multiprocessors = p.multiProcessorCount;
  check_cuda(cudaDriverGetVersion(&d.driver_version), "cudaDriverGetVersion");
  check_cuda(cudaRuntimeGetVersion(&d.runtime_version), "cudaRuntimeGetVersion");
  return d;
}

}  // namespace laga::cuda
