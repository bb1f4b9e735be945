#include "mla/ops_bf16.hpp"

#include <algorithm>
#include <array>
#include <vector>

#include "kernels/bf16_convert.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_bf16.hpp"
#include "mla/ops.hpp"

namespace laga::ops::bf16_path {

namespace {

// This thread's (this rank's) scratch of T, one buffer a slot, grown to the
// largest operand it has held and kept: not counted by the memory pool
// (docs/performance.md, "bf16 mixed precision", says what that leaves out).
// bf16 for oneDNN's bf16 kernels; fp32 holding bf16 values for the fp32
// kernels where those do not pay (gemm_bf16_path's widened_fp32).
struct Scratch {
  std::array<std::vector<bf16>, 4> bf16s;
  std::array<std::vector<float>, 4> floats;
  auto& of(bf16*) { return bf16s; }
  auto& of(float*) { return floats; }
};
thread_local Scratch this_thread_scratch;

template <class T>
T* scratch(Slot slot, std::int64_t n) {
  std::vector<T>& s =
      this_thread_scratch.of(static_cast<T*>(nullptr))[static_cast<std::size_t>(slot)];
  if (static_cast<std::int64_t>(s.size()) < n) s.resize(static_cast<std::size_t>(n));
  return s.data();
}

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

std::int64_t scratch_bytes() {
  std::int64_t bytes = 0;
  for (const auto& s : this_thread_scratch.bf16s)
    bytes += std::int64_t(s.capacity() * sizeof(bf16));
  for (const auto& s : this_thread_scratch.floats)
    bytes += std::int64_t(s.capacity() * sizeof(float));
  return bytes;
}

void free_scratch() {
  this_thread_scratch = Scratch{};
}

// Chunks of kChunk split over the threads where n is large enough to pay
// for waking them. A single thread converting a GEMM's operands left the
// other core idle for ~5% of a bf16 block's step (docs/performance.md,
// "bf16 on AMD Zen 4").
void to_bf16_threaded(const float* x, bf16* y, std::int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (std::int64_t j = 0; j < n; j += kChunk)
    convert_to_bf16(x + j, y + j, std::min(kChunk, n - j));
}

void to_float_threaded(const bf16* x, float* y, std::int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (std::int64_t j = 0; j < n; j += kChunk)
    convert_to_float(x + j, y + j, std::min(kChunk, n - j));
}

const bf16* operand(Slot slot, const Mat<const float>& m) {
  if (m.ld == m.cols) return operand(slot, m.p, m.rows * m.cols);
  bf16* out = scratch<bf16>(slot, m.rows * m.cols);
#pragma omp parallel for schedule(static) if (m.rows * m.cols > 65536)
  for (std::int64_t i = 0; i < m.rows; ++i)
    convert_to_bf16(m.p + i * m.ld, out + i * m.cols, m.cols);
  return out;
}

const bf16* operand(Slot slot, const float* x, std::int64_t n) {
  bf16* out = scratch<bf16>(slot, n);
  to_bf16_threaded(x, out, n);
  return out;
}

// The dense rounded copy, rows (or a contiguous operand's chunks) split
// over the rank's threads as its GEMMs are: elementwise, so the same bits
// on any thread count.
const float* rounded_fp32(Slot slot, const Mat<const float>& m) {
  float* out = scratch<float>(slot, m.rows * m.cols);
#pragma omp parallel for schedule(static) if (m.rows * m.cols > 65536)
  for (std::int64_t i = 0; i < m.rows; ++i) round_into(m.p + i * m.ld, out + i * m.cols, m.cols);
  return out;
}

const float* rounded_fp32(Slot slot, const float* x, std::int64_t n) {
  float* out = scratch<float>(slot, n);
#pragma omp parallel for schedule(static) if (n > 65536)
  for (std::int64_t j = 0; j < n; j += kChunk) round_into(x + j, out + j, std::min(kChunk, n - j));
  return out;
}

const float* widened_fp32(Slot slot, const bf16* x, std::int64_t n) {
  float* out = scratch<float>(slot, n);
  to_float_threaded(x, out, n);
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
  if (widened()) {
    const float* a = rounded_fp32(Slot::first, A);
    const float* b = rounded_fp32(Slot::second, B);
    laga::gemm<float>(trans_a, trans_b, C.rows, C.cols, K, alpha, a, A.cols, b, B.cols, beta, C.p,
                      C.ld);
    if (beta == 0.0f) round_in_place(C);
    return;
  }
  const bf16* a = operand(Slot::first, A);
  const bf16* b = operand(Slot::second, B);
  gemm_bf16<float>(trans_a, trans_b, C.rows, C.cols, K, alpha, a, A.cols, b, B.cols, beta, C.p,
                   C.ld);
  if (beta == 0.0f) round_in_place(C);
}

void linear(float* y, const float* x, const float* w, std::int64_t N, std::int64_t in,
            std::int64_t out) {
  if (widened()) {
    laga::linear_forward<float>(y, rounded_fp32(Slot::first, x, N * in),
                                rounded_fp32(Slot::second, w, out * in), N, in, out);
    round_in_place(Mat<float>{y, N, out, out});
    return;
  }
  const bf16* xb = operand(Slot::first, x, N * in);
  const bf16* wb = operand(Slot::second, w, out * in);
  linear_forward_bf16<float>(y, xb, wb, N, in, out);
  round_in_place(Mat<float>{y, N, out, out});
}

// dx: fresh, an activation gradient a bf16 run stores, rounded; added to,
// an fp32 sum (the gemm rule above). dW is always added into the fp32
// gradient (the master weights' precision).
void linear_backward(float* dx, bool accumulate, float* dw, const float* dy, const float* x,
                     const float* w, std::int64_t N, std::int64_t in, std::int64_t out) {
  if (widened()) {
    laga::linear_backward<float>(dx, accumulate, dw, rounded_fp32(Slot::first, dy, N * out),
                                 rounded_fp32(Slot::second, x, N * in),
                                 rounded_fp32(Slot::third, w, out * in), N, in, out);
    if (dx && !accumulate) round_in_place(Mat<float>{dx, N, in, in});
    return;
  }
  const bf16* dyb = operand(Slot::first, dy, N * out);
  const bf16* xb = operand(Slot::second, x, N * in);
  const bf16* wb = operand(Slot::third, w, out * in);
  linear_backward_bf16<float>(dx, accumulate, dw, dyb, xb, wb, N, in, out);
  if (dx && !accumulate) round_in_place(Mat<float>{dx, N, in, in});
}

}  // namespace laga::ops::bf16_path
