// The contract between the laga tool and the CUDA backend's shared module
// (liblaga_cuda_backend.so; docs/architecture.md, "cuda", and docs/build.md,
// "The CUDA backend"). laga does not link cuBLASLt, cuDNN or NCCL (linked,
// they made every laga process ~250 MB resident, CPU runs included); `laga
// ... --device cuda` loads the module with dlopen (mla/cuda_backend.hpp) and
// reads everything through the one C entry point below.
//
// The module is built from the same headers as laga and binds to laga's own
// symbols (laga is linked with its symbols exported: one op table, one pool
// accounting, one laga::Error), so the table below hands C++ types across.
// What guards that: kCudaBackendAbi, bumped whenever this struct, KernelRow,
// OpCall, OpShape, Op, DeviceMemory or Communicator change in a way the
// other side would read wrongly, and the sizes the module was built with,
// which the loader checks before it touches anything else. abi_version is
// the first member in every version, so any module's can be read.
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "comm/communicator.hpp"
#include "mla/op_table.hpp"

namespace laga::ops {

// 2 came twice (main: copy_rows and fill; dsaops: the DSA indexer ops of
// mla/ops_dsa.hpp); 3: both; 4: Op::kv_fp8_round_trip.
inline constexpr int kCudaBackendAbi = 4;

// The module's exported entry point: extern "C" const CudaBackendApi*
// laga_cuda_backend_api(void).
inline constexpr const char* kCudaBackendEntry = "laga_cuda_backend_api";
// Its file name, looked for beside the laga executable unless
// LAGA_CUDA_BACKEND names the file (mla/cuda_backend.cpp).
inline constexpr const char* kCudaBackendFile = "liblaga_cuda_backend.so";
inline constexpr const char* kCudaBackendEnv = "LAGA_CUDA_BACKEND";

// ncclUniqueId's bytes (cuda/nccl_comm.hpp's NcclId).
using NcclUniqueId = std::array<char, 128>;

struct CudaBackendApi {
  int abi_version = kCudaBackendAbi;  // first, in every version
  // sizeof of the types handed across, as the module was compiled.
  std::size_t kernel_row_bytes = sizeof(KernelRow);
  std::size_t op_call_bytes = sizeof(OpCall);
  std::size_t op_shape_bytes = sizeof(OpShape);
  int op_count = kOpCount;
  // The backend's kernel table rows (cuda/op_table_cuda.cpp).
  std::span<const KernelRow> (*rows)() = nullptr;
  // Empty when a usable device is there; else one sentence naming what is
  // missing (cuda/device.hpp). Never throws.
  std::string (*device_unavailable_reason)() = nullptr;
  // "NVIDIA H100 80GB HBM3 (sm_90), driver 13000, runtime 13000"; throws
  // laga::Error without a device.
  std::string (*device_description)() = nullptr;
  // cuda::register_cuda_memory: the device pool's memory for Device::cuda.
  void (*register_memory)() = nullptr;
  // How many devices this process sees, and make `ordinal` current
  // (cudaSetDevice), for one rank per GPU under MPI.
  int (*device_count)() = nullptr;
  void (*set_device)(int ordinal) = nullptr;
  // The NCCL transport (cuda/nccl_comm.hpp): rank 0 makes the id, every rank
  // of the group joins with it on its current device.
  NcclUniqueId (*make_nccl_id)() = nullptr;
  std::unique_ptr<Communicator> (*make_nccl_communicator)(const NcclUniqueId& id, int rank,
                                                          int size) = nullptr;
};

}  // namespace laga::ops
