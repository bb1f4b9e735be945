// GEMMs on the device through cuBLASLt, row-major, with kernels/gemm.hpp's
// contract (read it first): C (M, N) = alpha op(A) op(B) + beta C, op(A)
// (M, K), op(B) (K, N), lda/ldb/ldc row strides in elements (a head's
// columns of a wider matrix), beta 0 ignores C's old contents.
//
// Types (dtype of A and B, c_dtype of C), every sum in fp32
// (CUBLAS_COMPUTE_32F: true fp32, not TF32):
//   f32 x f32 -> f32           the fp32 path
//   bf16 x bf16 -> f32 | bf16  kernels/gemm_bf16.hpp's mixed precision
// f64 is refused (double runs on the CPU: --device cpu).
//
// Row-major on cuBLASLt's column-major: the row-major C (M, N) with stride
// ldc is the column-major C^T (N, M), so the call computes C^T = op(B)^T
// op(A)^T, B's buffer as cuBLASLt's first operand and A's as its second,
// each transposed exactly when the row-major operand is not.
#pragma once

#include <cstdint>
#include <string>

#include "comm/communicator.hpp"  // DType
#include "cuda/device_buffer.hpp"
#include "mla/device_peak_prediction.hpp"  // kCublasLtWorkspaceBytes

namespace laga::cuda {

struct GemmArgs {
  bool trans_a = false, trans_b = false;
  std::int64_t M = 0, N = 0, K = 0;
  float alpha = 1.0f, beta = 0.0f;
  const void* A = nullptr;
  std::int64_t lda = 0;
  const void* B = nullptr;
  std::int64_t ldb = 0;
  void* C = nullptr;
  std::int64_t ldc = 0;
  DType dtype = DType::f32;    // A and B
  DType c_dtype = DType::f32;  // C
};

// Throws laga::Error naming the first bad value (an extent < 0, a stride
// shorter than its row, a null operand with a non-empty shape, an
// unsupported type pair) and what to do. Every gemm() call runs it first;
// it needs no device.
void check_gemm(const GemmArgs& g);

// The cuBLASLt workspace a GemmContext holds unless told otherwise: a size
// laga chooses (cuBLASLt takes the algorithm that fits it), so it is the
// predictable part of what the CUDA rows keep on the device: one
// GemmContext per rank thread (cuda/op_table_cuda.cpp), so one of these per
// rank in the device peak's prediction (kCublasLtWorkspaceBytes is
// mla/device_peak_prediction.hpp's, which laga compare reads without CUDA;
// docs/accounting.md, "Device memory").

// One cuBLASLt handle, its workspace (a DeviceBuffer: the pool current at
// construction counts it, "cublaslt_workspace", comm_buffers) and the stream
// its calls go on. One per rank thread. The handle is made at the first
// gemm(), so a context made under a count-only pool is accounted without a
// device (cuda_test_gemm_lt checks its bytes against the prediction's).
class GemmContext {
 public:
  // stream: a cudaStream_t (0: the default stream).
  explicit GemmContext(void* stream = nullptr,
                       std::int64_t workspace_bytes = kCublasLtWorkspaceBytes);
  ~GemmContext();
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;

  // Enqueues C = alpha op(A) op(B) + beta C on the stream (check_gemm first;
  // an empty product M N == 0 does nothing, K == 0 scales C by beta). Throws
  // laga::Error naming the shape when cuBLASLt has no algorithm for it.
  void gemm(const GemmArgs& g);
  void* stream() const { return stream_; }
  std::int64_t workspace_bytes() const { return workspace_.bytes(); }

 private:
  void* handle_ = nullptr;  // cublasLtHandle_t
  void* stream_ = nullptr;
  DeviceBuffer workspace_;
};

// "M 4096 N 512 K 7168, A^T, lda 7168, ..." for messages.
std::string describe(const GemmArgs& g);

}  // namespace laga::cuda
