#include "cuda/gemm_lt.hpp"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <memory>

#include "core/error.hpp"
#include "cuda/cuda_error.hpp"

namespace laga::cuda {

namespace {

const char* dtype_name(DType t) {
  return t == DType::f32 ? "f32" : t == DType::f64 ? "f64" : "bf16";
}

cudaDataType_t cuda_type(DType t) {
  return t == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
}

template <class T, class Destroy>
struct Owned {
  T value{};
  Destroy destroy;
  ~Owned() {
    if (value) destroy(value);
  }
};

}  // namespace

std::string describe(const GemmArgs& g) {
  return cat("M ", g.M, " N ", g.N, " K ", g.K, g.trans_a ? ", A^T" : "", g.trans_b ? ", B^T" : "",
             ", lda ", g.lda, " ldb ", g.ldb, " ldc ", g.ldc, ", ", dtype_name(g.dtype), " x ",
             dtype_name(g.dtype), " -> ", dtype_name(g.c_dtype));
}

void check_gemm(const GemmArgs& g) {
  const auto where = [&] { return cat("cuda gemm (", describe(g), "): "); };
  LAGA_CHECK(g.M >= 0 && g.N >= 0 && g.K >= 0, where(), "extents must be >= 0");
  LAGA_CHECK(
      g.dtype != DType::f64 && g.c_dtype != DType::f64, where(),
      "cuBLASLt GEMMs here take f32 or bf16, not f64; double runs on the CPU (--device cpu)");
  LAGA_CHECK(!(g.dtype == DType::f32 && g.c_dtype == DType::bf16), where(),
             "f32 operands with a bf16 result is not a supported pair; use f32 -> f32, or round "
             "the operands to bf16 first (bf16 x bf16 -> bf16)");
  const std::int64_t a_row = g.trans_a ? g.M : g.K;  // the stored A's row length
  const std::int64_t b_row = g.trans_b ? g.K : g.N;
  LAGA_CHECK(g.lda >= (a_row > 0 ? a_row : 1), where(), "lda ", g.lda,
             " is shorter than A's stored row of ", a_row, " elements; pass lda >= ", a_row);
  LAGA_CHECK(g.ldb >= (b_row > 0 ? b_row : 1), where(), "ldb ", g.ldb,
             " is shorter than B's stored row of ", b_row, " elements; pass ldb >= ", b_row);
  LAGA_CHECK(g.ldc >= (g.N > 0 ? g.N : 1), where(), "ldc ", g.ldc, " is shorter than C's row of ",
             g.N, " elements; pass ldc >= ", g.N);
  if (g.M > 0 && g.N > 0) {
    LAGA_CHECK(g.C != nullptr, where(), "C is null; pass the device output");
    if (g.K > 0)
      LAGA_CHECK(g.A != nullptr && g.B != nullptr, where(), g.A ? "B" : "A",
                 " is null; pass device operands (a count-only run skips the op, it does not call "
                 "it with null operands)");
  }
  LAGA_CHECK(g.beta == 0.0f || g.beta == 1.0f, where(), "beta ", g.beta,
             " is not 0 or 1, the two laga's ops use (overwrite, accumulate)");
}

GemmContext::GemmContext(void* stream, std::int64_t workspace_bytes)
    : stream_(stream),
      workspace_(workspace_bytes, "cublaslt_workspace", MemCategory::comm_buffers) {}

GemmContext::~GemmContext() {
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

void GemmContext::gemm(const GemmArgs& g) {
  check_gemm(g);
  if (g.M == 0 || g.N == 0) return;
  const std::string what = cat("cublasLtMatmul (", describe(g), ")");
  // Column-major view: C^T (N, M) = op(B)^T (N, K) op(A)^T (K, M).
  const cublasOperation_t op_first = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  Owned<cublasLtMatmulDesc_t, decltype(&cublasLtMatmulDescDestroy)> desc{
      nullptr, &cublasLtMatmulDescDestroy};
  check_cublas(cublasLtMatmulDescCreate(&desc.value, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
  check_cublas(cublasLtMatmulDescSetAttribute(desc.value, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                              sizeof(op_first)),
               what);
  check_cublas(cublasLtMatmulDescSetAttribute(desc.value, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                              sizeof(op_second)),
               what);
  using Layout = Owned<cublasLtMatrixLayout_t, decltype(&cublasLtMatrixLayoutDestroy)>;
  Layout first{nullptr, &cublasLtMatrixLayoutDestroy},
      second{nullptr, &cublasLtMatrixLayoutDestroy}, out{nullptr, &cublasLtMatrixLayoutDestroy};
  const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  // Stored (column-major) extents: B's buffer is (b_row, rows of B) with ld ldb.
  const std::int64_t K1 = g.K > 0 ? g.K : 1;
  check_cublas(cublasLtMatrixLayoutCreate(&first.value, cuda_type(g.dtype), u(g.trans_b ? K1 : g.N),
                                          u(g.trans_b ? g.N : K1), g.ldb),
               what);
  check_cublas(cublasLtMatrixLayoutCreate(&second.value, cuda_type(g.dtype),
                                          u(g.trans_a ? g.M : K1), u(g.trans_a ? K1 : g.M), g.lda),
               what);
  check_cublas(cublasLtMatrixLayoutCreate(&out.value, cuda_type(g.c_dtype), u(g.N), u(g.M), g.ldc),
               what);
  if (!handle_) {
    cublasLtHandle_t h = nullptr;
    check_cublas(cublasLtCreate(&h), "cublasLtCreate");
    handle_ = h;
  }
  auto* handle = static_cast<cublasLtHandle_t>(handle_);
  auto* stream = static_cast<cudaStream_t>(stream_);
  if (g.K == 0) {  // C = beta C: 0 clears, 1 keeps
    if (g.beta == 0.0f) {
      const std::int64_t elem = g.c_dtype == DType::bf16 ? 2 : 4;
      check_cuda(cudaMemset2DAsync(g.C, static_cast<std::size_t>(g.ldc * elem), 0,
                                   static_cast<std::size_t>(g.N * elem),
                                   static_cast<std::size_t>(g.M), stream),
                 what);
    }
    return;
  }
  Owned<cublasLtMatmulPreference_t, decltype(&cublasLtMatmulPreferenceDestroy)> pref{
      nullptr, &cublasLtMatmulPreferenceDestroy};
  check_cublas(cublasLtMatmulPreferenceCreate(&pref.value), what);
  const std::uint64_t ws = static_cast<std::uint64_t>(workspace_.bytes());
  check_cublas(cublasLtMatmulPreferenceSetAttribute(
                   pref.value, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
               what);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  check_cublas(cublasLtMatmulAlgoGetHeuristic(handle, desc.value, first.value, second.value,
                                              out.value, out.value, pref.value, 1, &result, &found),
               what);
  LAGA_CHECK(found > 0, what,
             ": cuBLASLt has no algorithm for this shape and these strides on "
             "this device; run laga_cuda_check to see which shapes pass");
  check_cublas(cublasLtMatmul(handle, desc.value, &g.alpha, g.B, first.value, g.A, second.value,
                              &g.beta, g.C, out.value, g.C, out.value, &result.algo,
                              workspace_.data(), workspace_.bytes(), stream),
               what);
}

}  // namespace laga::cuda
