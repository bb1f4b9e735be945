// check_cuda only: the cuBLAS and NCCL checks are in files of their own
// (cuda_error_cublas.cpp, cuda_error_nccl.cpp), so that a program linking
// laga_cuda statically that calls only the runtime does not pull cuBLASLt or
// NCCL in under --as-needed. (laga itself links none of it: it loads the
// module liblaga_cuda_backend.so for --device cuda, mla/cuda_backend.hpp.)
#include "cuda/cuda_error.hpp"

#include <cuda_runtime_api.h>

#include "core/error.hpp"

namespace laga::cuda {

void check_cuda(int status, const std::string& call) {
  if (status == cudaSuccess) return;
  const auto e = static_cast<cudaError_t>(status);
  fail(call, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
       "); check the device with nvidia-smi, and run with --device cpu where no GPU is usable");
}

}  // namespace laga::cuda
