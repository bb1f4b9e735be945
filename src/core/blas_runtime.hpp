// Making sure OpenBLAS runs kernels that fit the CPU.
//
// OpenBLAS picks its kernels at load time from the CPU model. Debian 12's
// 0.3.21 does not know the newest Xeons (family 6 model 207 here) and falls
// back to its SSE3 "Prescott" kernels: sgemm at 9 GFLOP/s where its AVX2
// "Haswell" kernels give 30-70 on the same two cores. The choice cannot be
// changed after the library has loaded, so a program that finds a pre-AVX2
// kernel on an AVX2+FMA CPU re-executes itself once with
// OPENBLAS_CORETYPE=Haswell. A user's own OPENBLAS_CORETYPE is never touched,
// and AVX-512 kernels are never chosen automatically (older OpenBLAS builds
// compute wrong results with them on some of these CPUs).
#pragma once

#include <string>

namespace laga {

// The kernel family OpenBLAS is running ("Haswell", "Prescott", ...).
std::string blas_core_name();

// Call first thing in main(). Returns only if no re-exec was needed or the
// re-exec failed (then with a warning on stderr).
void ensure_fast_blas_kernels(char** argv);

}  // namespace laga
