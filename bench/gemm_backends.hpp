// The sgemm libraries laga_bench gemm measures side by side: oneDNN
// (dnnl_sgemm), OpenBLAS (cblas_sgemm) and BLIS (bli_sgemm). Each is called
// directly, not through laga::gemm, so that the bench compares the libraries
// whatever laga::gemm routes to (docs/performance.md, "Choosing the GEMM
// library").
//
// BLIS is opened with dlopen(RTLD_LOCAL) when it is installed (libblis-dev is
// a bench-only candidate, not a dependency): it exports cblas_sgemm and
// sgemm_ too, which must not interpose on OpenBLAS' in the same process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace laga::bench {

// C (M, N) = op(A) op(B), row-major, lda/ldb/ldc row strides in elements:
// laga::gemm's contract with alpha 1, beta 0.
using SgemmFn = void (*)(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
                         const float* A, std::int64_t lda, const float* B, std::int64_t ldb,
                         float* C, std::int64_t ldc);

struct GemmBackend {
  std::string name;     // "onednn", "openblas", "blis"
  std::string kernels;  // what it runs here, in its own words ("avx512_core_vnni", "Haswell")
  std::string isa;      // "avx512" or "avx2": whose FMA peak its rows are measured against
  SgemmFn sgemm = nullptr;
};

// The #wrong check of the GEMM benchmarks (bench_gemm.cpp, bench_gemm_bf16.cpp),
// sharing no code with any library: the rows of C it samples (every M/64-th
// and the last eight, so edge tiles are in) ...
std::vector<std::int64_t> sampled_rows(std::int64_t M);
// ... and those rows of op(A) op(B) (rows.size(), N) by plain double loops.
std::vector<double> reference_rows(const std::vector<std::int64_t>& rows, bool ta, bool tb,
                                   std::int64_t N, std::int64_t K, const float* A, std::int64_t lda,
                                   const float* B, std::int64_t ldb);

// The libraries present in this process, in the order above; BLIS only when
// libblis.so.4 loads. Sets each one's thread count to `threads`.
std::vector<GemmBackend> gemm_backends(int threads);

}  // namespace laga::bench
