// The CUDA device's DeviceMemory (core/device.hpp): what a rank's device pool
// allocates from when the forms run on a GPU (mla/runner.cpp, RunSpec::device).
//
// Managed memory (cudaMallocManaged), not cudaMalloc: the forms' host-side
// steps (ops::copy and ops::add, the exchanges' packing, Tensor::fill and
// zeros, the device-local transport's reductions) still run on the host, and
// managed memory keeps them correct on a GPU, with pages migrating to
// whichever side touches them. Every CUDA kernel row is followed by a device
// synchronisation (ops::run_row), so the host never reads a page a kernel is
// still writing. The cost is the migrations: a step time measured this way
// includes them (docs/performance.md, "What has not run on a GPU"). Moving
// those host steps to device kernels, and the storage to cudaMalloc, is the
// next step.
#pragma once

namespace laga::cuda {

// Makes the CUDA memory the process's memory for Device::cuda
// (register_device_memory) on the current device; idempotent. Throws
// laga::Error with device_unavailable_reason()'s words when there is no
// usable device.
void register_cuda_memory();

}  // namespace laga::cuda
