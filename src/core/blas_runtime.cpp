#include "core/blas_runtime.hpp"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iostream>

extern "C" char* openblas_get_corename(void);

namespace laga {

std::string blas_core_name() {
  const char* name = openblas_get_corename();
  return name ? name : "unknown";
}

void ensure_fast_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;  // the user's choice
  const std::string core = blas_core_name();
  const bool pre_avx2 = core == "Prescott" || core == "Core2" || core == "Penryn" ||
                        core == "Dunnington" || core == "Nehalem" || core == "Atom";
  if (!pre_avx2 || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return;
  setenv("OPENBLAS_CORETYPE", "Haswell", 1);
  execv("/proc/self/exe", argv);
  // Still here: the re-exec failed; run on, slowly, and say so.
  std::cerr << "laga: warning: OpenBLAS runs its '" << core
            << "' kernels on this AVX2 CPU and re-executing with OPENBLAS_CORETYPE=Haswell failed ("
            << std::strerror(errno)
            << "); set OPENBLAS_CORETYPE=Haswell yourself for 3-8x faster GEMMs\n";
  unsetenv("OPENBLAS_CORETYPE");
}

}  // namespace laga
