// The CUDA device's DeviceMemory (core/device.hpp): what a rank's device pool
// allocates from when the forms run on a GPU (mla/runner.cpp, RunSpec::device).
//
// Managed memory (cudaMallocManaged), not cudaMalloc. The forms' copies,
// adds, packing and zeroing are device kernels (the kernel table's
// copy_rows and fill rows, cuda/elementwise.hpp), Tensor::zeros is zero()
// below (cudaMemset), and the device-local transport's reductions are the
// sum_in_rank_order kernel (registered here, register_device_reduction), so
// an fp32 or fp64 step leaves no host loop over this memory. A bf16 step
// still has some, and they keep it managed: the op layer's operand
// roundings and copies (mla/ops_bf16.cpp), the kept tensors' narrowing
// (Tensor::narrow_to_bf16 / widen_from_bf16) and the wire's in-place
// conversions (mla/wire.cpp); so have the reduction-order debugging switch's
// permuted sums and the commands' --comm local communicator, which is made
// without a device (docs/architecture.md, "Device storage and the emulated
// device"). Every CUDA kernel row is followed by a device synchronisation
// (ops::run_row), so the host never reads a page a kernel is still writing.
// The cost of what remains is page migration: a bf16 step time includes it
// (docs/performance.md, "What has not run on a GPU"). Moving those bf16
// steps to the device, and then the storage to cudaMalloc, is the next step.
#pragma once

namespace laga::cuda {

// Makes the CUDA memory the process's memory for Device::cuda
// (register_device_memory) on the current device; idempotent. Throws
// laga::Error with device_unavailable_reason()'s words when there is no
// usable device.
void register_cuda_memory();

}  // namespace laga::cuda
