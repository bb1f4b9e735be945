#include <nccl.h>

#include "cuda/cuda_error.hpp"

#include "core/error.hpp"

namespace laga::cuda {

void check_nccl(int status, const std::string& call) {
  if (status == ncclSuccess) return;
  const auto r = static_cast<ncclResult_t>(status);
  fail(call, " failed: ", ncclGetErrorString(r),
       "; NCCL_DEBUG=WARN names the cause (every rank must make the same calls)");
}

}  // namespace laga::cuda
