#include "cuda/cuda_error.hpp"

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "core/error.hpp"

namespace laga::cuda {

void check_cuda(int status, const std::string& call) {
  if (status == cudaSuccess) return;
  const auto e = static_cast<cudaError_t>(status);
  fail(call, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
       "); check the device with nvidia-smi, and run with --device cpu where no GPU is usable");
}

void check_cublas(int status, const std::string& call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  const auto s = static_cast<cublasStatus_t>(status);
  fail(call, " failed: ", cublasLtGetStatusName(s), " (", cublasLtGetStatusString(s),
       "); the shape or the device does not suit cuBLASLt: run laga_cuda_check to see which op");
}

void check_nccl(int status, const std::string& call) {
  if (status == ncclSuccess) return;
  const auto r = static_cast<ncclResult_t>(status);
  fail(call, " failed: ", ncclGetErrorString(r),
       "; NCCL_DEBUG=WARN names the cause (every rank must make the same calls)");
}

}  // namespace laga::cuda
