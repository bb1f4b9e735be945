#include "mla/ops_bf16.hpp"

#include <algorithm>
#include <array>
#include <vector>

#include "core/tensor.hpp"
#include "kernels/bf16_convert.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_bf16.hpp"
#include "mla/ops.hpp"

namespace laga::ops::bf16_path {

namespace {

// Where bf16 GEMMs widen to fp32 (an Intel CPU without AMX: gemm_bf16.hpp),
// the op rounds each operand straight into an fp32 copy of its bf16 values
// and runs the fp32 GEMM on it: the same exact products and fp32 sums as
// gemm_bf16's widening, without the bf16 copy in between (one pass over each
// operand where that would take two).
bool widened() {
  return gemm_bf16_path() == GemmBf16Path::widened_fp32;
}

// n contiguous values into `out`, rounded to bf16 values, a chunk at a time
// through bf16 (in L1): one pass over the operand.
constexpr std::int64_t kChunk = 2048;
void round_into(const float* x, float* out, std::int64_t n) {
  std::array<bf16, kChunk> chunk;
  for (std::int64_t j = 0; j < n; j += kChunk) {
    const std::int64_t c = std::min(kChunk, n - j);
    convert_to_bf16(x + j, chunk.data(), c);
    convert_to_float(chunk.data(), out + j, c);
  }
}

}  // namespace

// Chunks of kChunk split over the threads where n is large enough to pay
// for waking them. A single thread converting a GEMM's operands left the
// other core idle for ~5% of a bf16 block's step (docs/performance.md,
// "bf16 on AMD Zen 4").
void to_bf16_threaded(const float* x, bf16* y, std::int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (std::int64_t j = 0; j < n; j += kChunk)
    convert_to_bf16(x + j, y + j, std::min(kChunk, n - j));
}

void round_threaded(const float* x, float* y, std::int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (std::int64_t j = 0; j < n; j += kChunk) round_into(x + j, y + j, std::min(kChunk, n - j));
}

void to_float_threaded(const bf16* x, float* y, std::int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (std::int64_t j = 0; j < n; j += kChunk)
    convert_to_float(x + j, y + j, std::min(kChunk, n - j));
}

// The copies an op rounds its operands into: pool tensors for the op's
// length (ops_bf16.hpp says why), converted where the operand has storage
// (count-only: the tensor is registered, nothing is converted).
Tensor<bf16> operand(const Mat<const float>& m) {
  Tensor<bf16> out({m.rows, m.cols}, "bf16 operand copy");
  if (!out.data() || !m.p) return out;
  bf16* y = out.data();
  if (m.ld == m.cols) {
    to_bf16_threaded(m.p, y, m.rows * m.cols);
    return out;
  }
#pragma omp parallel for schedule(static) if (m.rows * m.cols > 65536)
  for (std::int64_t i = 0; i < m.rows; ++i) convert_to_bf16(m.p + i * m.ld, y + i * m.cols, m.cols);
  return out;
}

Tensor<bf16> operand(const float* x, std::int64_t n) {
  return operand(Mat<const float>{x, 1, n, n});
}

// The dense rounded copy, rows (or a contiguous operand's chunks) split
// over the rank's threads as its GEMMs are: elementwise, so the same bits
// on any thread count.
Tensor<float> rounded_fp32(const Mat<const float>& m) {
  Tensor<float> out({m.rows, m.cols}, "bf16 operand copy (fp32)");
  if (!out.data() || !m.p) return out;
  float* y = out.data();
  if (m.ld == m.cols) {
    round_threaded(m.p, y, m.rows * m.cols);
    return out;
  }
#pragma omp parallel for schedule(static) if (m.rows * m.cols > 65536)
  for (std::int64_t i = 0; i < m.rows; ++i) round_into(m.p + i * m.ld, y + i * m.cols, m.cols);
  return out;
}

Tensor<float> rounded_fp32(const float* x, std::int64_t n) {
  return rounded_fp32(Mat<const float>{x, 1, n, n});
}

Tensor<float> widened_fp32(const bf16* x, std::int64_t n) {
  Tensor<float> out({n}, "bf16 operand copy (fp32)");
  if (out.data() && x) to_float_threaded(x, out.data(), n);
  return out;
}

// Through the vectorised conversions (the same bits as to_bf16, one value at
// a time: kernels/bf16_convert.hpp), a chunk of a row at a time.
void round_in_place(const Mat<float>& m) {
#pragma omp parallel for schedule(static) if (m.rows * m.cols > 65536)
  for (std::int64_t i = 0; i < m.rows; ++i) round_into(m.p + i * m.ld, m.p + i * m.ld, m.cols);
}

// A product into fresh storage (beta 0) is a value a bf16 run would store:
// rounded once, at the end, as gemm_bf16<bf16> would. A product added into
// C (beta != 0) is an fp32 accumulator -- a weight gradient summed over
// calls, or a partial sum over key blocks -- and is kept fp32, since rounding
// every partial sum would add one roundoff per call to the total.
void gemm(const Mat<float>& C, float beta, const Mat<const float>& A, bool trans_a,
          const Mat<const float>& B, bool trans_b, float alpha) {
  const std::int64_t K = trans_a ? A.rows : A.cols;
  if (C.rows * C.cols == 0) return;
  if (widened()) {
    const Tensor<float> a = rounded_fp32(A), b = rounded_fp32(B);
    if (!runs(C.rows * C.cols, {C.p, A.p, B.p})) return;
    laga::gemm<float>(trans_a, trans_b, C.rows, C.cols, K, alpha, a.data(), A.cols, b.data(),
                      B.cols, beta, C.p, C.ld);
  } else {
    const Tensor<bf16> a = operand(A), b = operand(B);
    if (!runs(C.rows * C.cols, {C.p, A.p, B.p})) return;
    gemm_bf16<float>(trans_a, trans_b, C.rows, C.cols, K, alpha, a.data(), A.cols, b.data(), B.cols,
                     beta, C.p, C.ld);
  }
  if (beta == 0.0f) round_in_place(C);
}

void linear(float* y, const float* x, const float* w, std::int64_t N, std::int64_t in,
            std::int64_t out) {
  if (N * out == 0) return;
  if (widened()) {
    const Tensor<float> xr = rounded_fp32(x, N * in), wr = rounded_fp32(w, out * in);
    if (!runs(N * out, {y, x, w})) return;
    laga::linear_forward<float>(y, xr.data(), wr.data(), N, in, out);
  } else {
    const Tensor<bf16> xb = operand(x, N * in), wb = operand(w, out * in);
    if (!runs(N * out, {y, x, w})) return;
    linear_forward_bf16<float>(y, xb.data(), wb.data(), N, in, out);
  }
  round_in_place(Mat<float>{y, N, out, out});
}

// dx: fresh, an activation gradient a bf16 run stores, rounded; added to,
// an fp32 sum (the gemm rule above). dW is always added into the fp32
// gradient (the master weights' precision).
void linear_backward(float* dx, bool accumulate, float* dw, const float* dy, const float* x,
                     const float* w, std::int64_t N, std::int64_t in, std::int64_t out) {
  if (N * out == 0) return;
  if (widened()) {
    const Tensor<float> dyr = rounded_fp32(dy, N * out), xr = rounded_fp32(x, N * in),
                        wr = rounded_fp32(w, out * in);
    if (!runs(N * out, {dy, x, w, dw, dx ? dx : w})) return;
    laga::linear_backward<float>(dx, accumulate, dw, dyr.data(), xr.data(), wr.data(), N, in, out);
  } else {
    const Tensor<bf16> dyb = operand(dy, N * out), xb = operand(x, N * in),
                       wb = operand(w, out * in);
    if (!runs(N * out, {dy, x, w, dw, dx ? dx : w})) return;
    linear_backward_bf16<float>(dx, accumulate, dw, dyb.data(), xb.data(), wb.data(), N, in, out);
  }
  if (dx && !accumulate) round_in_place(Mat<float>{dx, N, in, in});
}

}  // namespace laga::ops::bf16_path
