// The CUDA backend module's contract (mla/cuda_backend_abi.hpp) and its
// loader's refusals (mla/cuda_backend.hpp), on any build: a table from
// another build is refused naming what differs; a module path that does not
// exist is refused naming it. tools_cuda_backend_module loads the real module
// through laga (with LAGA_CUDA).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/error.hpp"
#include "mla/cuda_backend.hpp"

namespace laga::ops {
namespace {

TEST(CudaBackendAbi, ATableFromThisBuildMatches) {
  EXPECT_EQ(cuda_backend_abi_mismatch(CudaBackendApi{}), "");
}

TEST(CudaBackendAbi, AnotherBuildsTableIsRefusedNamingWhatDiffers) {
  CudaBackendApi a;
  a.abi_version = kCudaBackendAbi + 1;
  EXPECT_NE(cuda_backend_abi_mismatch(a).find("ABI version"), std::string::npos);
  CudaBackendApi b;
  b.kernel_row_bytes += 8;
  EXPECT_NE(cuda_backend_abi_mismatch(b).find("sizeof(KernelRow)"), std::string::npos);
  CudaBackendApi c;
  c.op_shape_bytes += 8;
  EXPECT_NE(cuda_backend_abi_mismatch(c).find("sizeof(OpShape)"), std::string::npos);
  CudaBackendApi d;
  d.op_count -= 1;
  EXPECT_NE(cuda_backend_abi_mismatch(d).find("the number of ops"), std::string::npos);
}

TEST(CudaBackendAbi, AMissingModuleIsRefusedNamingItsPath) {
  const std::string path = "/nonexistent/liblaga_cuda_backend.so";
  ASSERT_EQ(setenv(kCudaBackendEnv, path.c_str(), 1), 0);
  EXPECT_EQ(cuda_backend_path(), path);
  for (int i = 0; i < 2; ++i) {  // the second call gives the first's error
    try {
      load_cuda_backend();
      ADD_FAILURE() << "a module that does not exist loaded";
    } catch (const Error& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find(path + " does not exist"), std::string::npos) << w;
      EXPECT_NE(w.find("named by LAGA_CUDA_BACKEND"), std::string::npos) << w;
    }
  }
  unsetenv(kCudaBackendEnv);
}

}  // namespace
}  // namespace laga::ops
