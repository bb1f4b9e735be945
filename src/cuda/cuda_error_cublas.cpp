#include <cublasLt.h>

#include "cuda/cuda_error.hpp"

#include "core/error.hpp"

namespace laga::cuda {

void check_cublas(int status, const std::string& call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  const auto s = static_cast<cublasStatus_t>(status);
  fail(call, " failed: ", cublasLtGetStatusName(s), " (", cublasLtGetStatusString(s),
       "); the shape or the device does not suit cuBLASLt: run laga_cuda_check to see which op");
}

}  // namespace laga::cuda
