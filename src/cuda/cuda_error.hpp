// The one way a CUDA library status becomes a laga::Error: the call, the
// library's own name and text for the status, and what to do
// (core/error.hpp's rule). Host code only; no CUDA header is needed to include
// this one (the statuses travel as ints).
#pragma once

#include <string>

namespace laga::cuda {

// Each throws laga::Error unless `status` is its library's success value.
// `call`: what was asked ("cudaMalloc of 1.5 GiB", "cublasLtMatmul").
void check_cuda(int status, const std::string& call);    // cudaError_t
void check_cublas(int status, const std::string& call);  // cublasStatus_t
void check_nccl(int status, const std::string& call);    // ncclResult_t

}  // namespace laga::cuda
