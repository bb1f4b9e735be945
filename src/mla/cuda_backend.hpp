// Loading the CUDA backend at run time (issue 52; docs/architecture.md,
// "cuda"; the contract: mla/cuda_backend_abi.hpp). The CPU-only runs never
// load it, so they pay nothing for cuBLASLt, cuDNN and NCCL; `--device cuda`
// loads liblaga_cuda_backend.so once per process, checks its ABI, asks it for
// a device and registers its kernel rows and device memory.
#pragma once

#include <string>

#include "mla/cuda_backend_abi.hpp"

namespace laga::ops {

// Where the module is looked for: $LAGA_CUDA_BACKEND when set, else
// liblaga_cuda_backend.so in the directory of this executable
// (/proc/self/exe), where the build and scripts/gpu_check.sh's bundle put it.
std::string cuda_backend_path();

// The module's entry table, loaded once (later calls return the same, or
// throw the same error). Throws laga::Error naming what is missing: the
// module (a build without CUDA, or no file at the path), dlopen's own words
// (dlerror: a missing library or symbol), the entry point, or an ABI that
// differs from this program's (a module from another build).
const CudaBackendApi& load_cuda_backend();

// load_cuda_backend(), then: a usable device (else laga::Error with the
// module's device_unavailable_reason), the device pool's memory and the
// kernel rows registered for Device::cuda. What `--device cuda` calls before
// any block runs; idempotent.
const CudaBackendApi& use_cuda_backend();

// Empty when a module's table `a` matches this program's (its ABI version,
// the sizes of the types handed across, the number of ops); else what
// differs, in words. load_cuda_backend refuses a module on it.
std::string cuda_backend_abi_mismatch(const CudaBackendApi& a);

}  // namespace laga::ops
