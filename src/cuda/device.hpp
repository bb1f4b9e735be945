// The CUDA device this process computes on: whether there is one, and what it
// is. One rank per GPU (docs/build.md, "The CUDA backend"): the device is
// cudaGetDevice()'s, chosen by the caller (cudaSetDevice) before any op.
#pragma once

#include <cstdint>
#include <string>

namespace laga::cuda {

struct DeviceInfo {
  int ordinal = 0;
  std::string name;  // "NVIDIA H100 80GB HBM3"
  int sm_major = 0, sm_minor = 0;
  std::int64_t memory_bytes = 0;
  int multiprocessors = 0;
  int driver_version = 0;   // cudaDriverGetVersion: 13000 is CUDA 13.0
  int runtime_version = 0;  // cudaRuntimeGetVersion
};

// Empty when a device is there and this build can run on it; otherwise one
// sentence naming what is missing and what to do (`laga ... --device cuda`
// prints it). Never throws: "no CUDA device" is an answer, not an error.
std::string device_unavailable_reason();

// The current device. Throws laga::Error with device_unavailable_reason()'s
// words when there is none.
DeviceInfo current_device();

// The compute capability this build's kernels were compiled for (the
// lowest of CMAKE_CUDA_ARCHITECTURES, 90 by default): a device below it is
// refused by device_unavailable_reason.
int built_compute_capability();

}  // namespace laga::cuda
