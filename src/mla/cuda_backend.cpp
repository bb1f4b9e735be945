#include "mla/cuda_backend.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "core/device.hpp"
#include "core/error.hpp"

namespace laga::ops {

namespace {

// Set by CMake when this build makes the module (src/cuda/CMakeLists.txt).
#if defined(LAGA_CUDA_BACKEND_BUILT)
constexpr bool kModuleBuilt = true;
#else
constexpr bool kModuleBuilt = false;
#endif

std::string executable_dir() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

struct Loaded {
  const CudaBackendApi* api = nullptr;
  std::string error;  // why there is no api
};

Loaded load(const std::string& path) {
  const char* env = std::getenv(kCudaBackendEnv);
  const bool named = env && *env;
  if (!named && !kModuleBuilt)
    return {nullptr,
            "this laga was built without the CUDA backend (LAGA_CUDA=OFF, or CMake found no nvcc "
            "when it was configured), so there is no " +
                std::string(kCudaBackendFile) +
                "; configure on a machine with the CUDA toolkit (docs/build.md, \"The CUDA "
                "backend\"), or use --device cpu"};
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    return {nullptr,
            cat("the CUDA backend module ", path, " does not exist (",
                named ? cat("named by ", kCudaBackendEnv)
                      : cat("looked for beside the laga executable; set ", kCudaBackendEnv,
                            " to its path"),
                "); build it with cmake --build BUILD --target laga_cuda_backend (docs/build.md, "
                "\"The CUDA backend\"), or use --device cpu")};
  // RTLD_NOW: a library or a laga symbol the module needs and cannot find is
  // dlopen's error now, in its words, not a crash at the first call.
  // Never closed: its rows and memory live as long as the process.
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h)
    return {nullptr, cat("cannot load the CUDA backend module ", path, ": ", dlerror(),
                         " (its CUDA libraries -- cudart, cuBLASLt, cuDNN 9, NCCL -- must be on "
                         "the loader's path, LD_LIBRARY_PATH; docs/build.md, \"The CUDA "
                         "backend\")")};
  using Entry = const CudaBackendApi* (*)();
  const auto entry = reinterpret_cast<Entry>(dlsym(h, kCudaBackendEntry));
  if (!entry)
    return {nullptr, cat("the CUDA backend module ", path, " has no entry point ",
                         kCudaBackendEntry, " (not laga's module?); rebuild laga_cuda_backend")};
  const CudaBackendApi* a = entry();
  if (const std::string d = a ? cuda_backend_abi_mismatch(*a) : "no table; "; !d.empty())
    return {nullptr, cat("the CUDA backend module ", path, " does not match this laga (", d,
                         "it comes from another build): build laga and laga_cuda_backend from "
                         "one tree, or point ",
                         kCudaBackendEnv, " at the module built with this laga")};
  return {a, {}};
}

}  // namespace

std::string cuda_backend_abi_mismatch(const CudaBackendApi& a) {
  const auto differs = [](const char* what, auto module, auto here) {
    return module == here ? std::string()
                          : cat(what, " ", module, " in the module, ", here, " in laga; ");
  };
  std::string d;
  if (a.abi_version != kCudaBackendAbi)
    return differs("ABI version", a.abi_version, kCudaBackendAbi);
  d += differs("sizeof(KernelRow)", a.kernel_row_bytes, sizeof(KernelRow));
  d += differs("sizeof(OpCall)", a.op_call_bytes, sizeof(OpCall));
  d += differs("sizeof(OpShape)", a.op_shape_bytes, sizeof(OpShape));
  d += differs("the number of ops", a.op_count, kOpCount);
  return d;
}

std::string cuda_backend_path() {
  const char* env = std::getenv(kCudaBackendEnv);
  if (env && *env) return env;
  return executable_dir() + "/" + kCudaBackendFile;
}

const CudaBackendApi& load_cuda_backend() {
  static const Loaded loaded = load(cuda_backend_path());
  LAGA_CHECK(loaded.api, loaded.error);
  return *loaded.api;
}

const CudaBackendApi& use_cuda_backend() {
  const CudaBackendApi& a = load_cuda_backend();
  static std::once_flag registered;
  const std::string missing = a.device_unavailable_reason();
  LAGA_CHECK(missing.empty(), missing);
  std::call_once(registered, [&] {
    a.register_memory();
    register_kernel_rows(Device::cuda, a.rows());
  });
  return a;
}

}  // namespace laga::ops
