#include "gemm_backends.hpp"

#include <cblas.h>
#include <dlfcn.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl_debug.h>

#include <algorithm>

#include "core/error.hpp"
#include "harness.hpp"
#include "kernels/gemm.hpp"

extern "C" char* openblas_get_corename(void);

namespace laga::bench {

namespace {

void onednn_sgemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const float* A,
                  std::int64_t lda, const float* B, std::int64_t ldb, float* C, std::int64_t ldc) {
  const dnnl_status_t st =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
  LAGA_CHECK(st == dnnl_success, "laga_bench: dnnl_sgemm failed with status ", int(st));
}

void openblas_sgemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K,
                    const float* A, std::int64_t lda, const float* B, std::int64_t ldb, float* C,
                    std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), 1.0f, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), 0.0f, C,
              static_cast<blasint>(ldc));
}

// BLIS's typed API takes a row and a column stride per matrix, so row-major
// is (rs = ld, cs = 1) and no transposition flag is needed for the layout.
// trans_t: BLIS_NO_TRANSPOSE 0, BLIS_TRANSPOSE 8 (bli_type_defs.h).
using BliSgemm = void (*)(int transa, int transb, long m, long n, long k, const float* alpha,
                          const float* a, long rsa, long csa, const float* b, long rsb, long csb,
                          const float* beta, float* c, long rsc, long csc);
BliSgemm bli_sgemm_fn = nullptr;

void blis_sgemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const float* A,
                std::int64_t lda, const float* B, std::int64_t ldb, float* C, std::int64_t ldc) {
  const float one = 1.0f, zero = 0.0f;
  bli_sgemm_fn(ta ? 8 : 0, tb ? 8 : 0, M, N, K, &one, A, lda, 1, B, ldb, 1, &zero, C, ldc, 1);
}

}  // namespace

std::vector<std::int64_t> sampled_rows(std::int64_t M) {
  std::vector<std::int64_t> rows;
  const std::int64_t stride = std::max<std::int64_t>(1, M / 64);
  for (std::int64_t i = 0; i < M; i += stride) rows.push_back(i);
  for (std::int64_t i = std::max(M - 8, std::int64_t(0)); i < M; ++i)
    if (rows.back() < i) rows.push_back(i);
  return rows;
}

// Loops ordered so that the inner one runs along contiguous memory for
// either op(B).
std::vector<double> reference_rows(const std::vector<std::int64_t>& rows, bool ta, bool tb,
                                   std::int64_t N, std::int64_t K, const float* A, std::int64_t lda,
                                   const float* B, std::int64_t ldb) {
  std::vector<double> ref(rows.size() * size_t(N), 0.0);
#pragma omp parallel for schedule(dynamic)
  for (size_t r = 0; r < rows.size(); ++r) {
    const std::int64_t i = rows[r];
    double* out = ref.data() + r * size_t(N);
    auto a = [&](std::int64_t k) { return double(ta ? A[k * lda + i] : A[i * lda + k]); };
    if (tb) {
      for (std::int64_t j = 0; j < N; ++j) {
        double acc = 0;
        for (std::int64_t k = 0; k < K; ++k) acc += a(k) * double(B[j * ldb + k]);
        out[j] = acc;
      }
    } else {
      for (std::int64_t k = 0; k < K; ++k) {
        const double ak = a(k);
        for (std::int64_t j = 0; j < N; ++j) out[j] += ak * double(B[k * ldb + j]);
      }
    }
  }
  return ref;
}

std::vector<GemmBackend> gemm_backends(int threads) {
  std::vector<GemmBackend> out;
  // oneDNN's OpenMP runtime takes the calling thread's omp_get_max_threads(),
  // which laga::set_rank_threads has set; ONEDNN_MAX_CPU_ISA caps its JIT
  // (laga::gemm's ISA is oneDNN's).
  out.push_back(
      {"onednn", dnnl_cpu_isa2str(dnnl_get_effective_cpu_isa()), gemm_isa(), &onednn_sgemm});
  // OpenBLAS picks its kernels at load time from the CPU model
  // (OPENBLAS_CORETYPE overrides it); its AVX-512 families are these three.
  const std::string core = openblas_get_corename();
  const bool openblas_avx512 =
      core == "SkylakeX" || core == "Cooperlake" || core == "SapphireRapids";
  out.push_back({"openblas", core, openblas_avx512 ? "avx512" : "avx2", &openblas_sgemm});

  // Leaked on purpose: BLIS's worker threads may outlive any scope here.
  void* blis = dlopen("libblis.so.4", RTLD_NOW | RTLD_LOCAL);
  if (blis != nullptr) {
    bli_sgemm_fn = reinterpret_cast<BliSgemm>(dlsym(blis, "bli_sgemm"));
    const auto arch_id = reinterpret_cast<int (*)()>(dlsym(blis, "bli_arch_query_id"));
    const auto arch_name = reinterpret_cast<const char* (*)(int)>(dlsym(blis, "bli_arch_string"));
    const auto set_threads =
        reinterpret_cast<void (*)(long)>(dlsym(blis, "bli_thread_set_num_threads"));
    LAGA_CHECK(bli_sgemm_fn && arch_id && arch_name && set_threads,
               "laga_bench: libblis.so.4 lacks bli_sgemm/bli_arch_query_id/bli_arch_string/"
               "bli_thread_set_num_threads; is it BLIS 0.9 or newer?");
    set_threads(threads);
    const std::string arch = arch_name(arch_id());
    // BLIS's AVX-512 configurations: skx, knl, zen4; the rest are AVX2 or
    // narrower (generic: plain C), whose %peak against AVX2 understates.
    const bool avx512 = arch == "skx" || arch == "knl" || arch == "zen4";
    out.push_back({"blis", arch, avx512 ? "avx512" : "avx2", &blis_sgemm});
  }
  return out;
}

}  // namespace laga::bench
