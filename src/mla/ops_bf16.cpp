#include "mla/ops_bf16.hpp"

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

#include "core/tensor.hpp"
#include "kernels/bf16_convert.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_bf16.hpp"
#include "mla/op_table.hpp"
#include "mla/ops.hpp"

namespace laga::ops::bf16_path {

namespace {

// Where bf16 GEMMs widen to fp32 (an Intel CPU without AMX: gemm_bf16.hpp),
// the op rounds each operand straight into an fp32 copy of its bf16 values
// and runs the fp32 GEMM on it: the same exact products and fp32 sums as
// gemm_bf16's widening, without the bf16 copy in between (one pass over each
// operand where that would take two).
// Which the kernel table's bf16 gemm row says (op_table_cpu.cpp: the row
// LAGA_GEMM_BF16 selects).
const KernelRow& gemm_row() {
  OpShape s;
  s.invariant = op_invariant;  // the invariant row widens: fp32 copies of bf16 values
  return pick(op_device, Op::gemm, RunDtype::bf16, s);
}
bool widened() {
  return gemm_row().operands == Bf16Operands::fp32_values;
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

// The (rows, cols) matrix m into y dense (row stride cols): rounded to bf16
// (E = bf16) or to its bf16 values kept fp32 (E = float, where the GEMMs
// widen). Rows, or a contiguous operand's chunks, split over the rank's
// threads as its GEMMs are: elementwise, so the same bits on any count.
template <class E>
void copy_rounded(const Mat<const float>& m, E* y) {
  if (m.ld == m.cols) {
    if constexpr (std::is_same_v<E, bf16>)
      to_bf16_threaded(m.p, y, m.rows * m.cols);
    else
      round_threaded(m.p, y, m.rows * m.cols);
    return;
  }
#pragma omp parallel for schedule(static) if (m.rows * m.cols > 65536)
  for (std::int64_t i = 0; i < m.rows; ++i) {
    if constexpr (std::is_same_v<E, bf16>)
      convert_to_bf16(m.p + i * m.ld, y + i * m.cols, m.cols);
    else
      round_into(m.p + i * m.ld, y + i * m.cols, m.cols);
  }
}

// Copies of Mat operands (strided or dense), converted together.
template <class E>
class MatCopies : public Copies<E> {
 public:
  explicit MatCopies(std::initializer_list<Mat<const float>> operands)
      : Copies<E>(numels(operands)), ops_(operands) {}
  // Converts every operand (once the op computes) but `skip`, which the
  // caller fills; get(i) gives operand i's copy.
  void fill(std::ptrdiff_t skip = -1) {
    for (std::size_t i = 0; i < ops_.size(); ++i)
      if (std::ptrdiff_t(i) != skip) copy_rounded(ops_[i], this->get(i));
  }

 private:
  static std::vector<std::int64_t> numels(std::initializer_list<Mat<const float>> operands) {
    std::vector<std::int64_t> n;
    for (const Mat<const float>& m : operands) n.push_back(m.rows * m.cols);
    return n;
  }
  std::vector<Mat<const float>> ops_;
};

Mat<const float> dense(const float* x, std::int64_t rows, std::int64_t cols) {
  return {x, rows, cols, cols};
}

// One product of the copies, bf16 or (widened) fp32 copies of bf16 values.
template <class E>
void linear_of_copies(float* y, const E* x, const E* w, std::int64_t N, std::int64_t in,
                      std::int64_t out) {
  if constexpr (std::is_same_v<E, float>)  // laga::linear_forward's gemm, through the table
    run_gemm<float>(false, true, N, out, in, 1.0f, x, in, w, in, 0.0f, y, out);
  else
    linear_forward_bf16<float>(y, x, w, N, in, out);
}
template <class E>
void linear_backward_of_copies(float* dx, bool accumulate, float* dw, const E* dy, const E* x,
                               const E* w, std::int64_t N, std::int64_t in, std::int64_t out) {
  if constexpr (std::is_same_v<E, float>) {  // laga::linear_backward's gemms, through the table
    if (dx)
      run_gemm<float>(false, false, N, in, out, 1.0f, dy, out, w, in, accumulate ? 1.0f : 0.0f, dx,
                      in);
    if (dw) run_gemm<float>(true, false, out, in, N, 1.0f, dy, out, x, in, 1.0f, dw, in);
  } else
    linear_backward_bf16<float>(dx, accumulate, dw, dy, x, w, N, in, out);
}

// The copies of an op whose operand `held` may be held narrowed
// (ops::keep_narrowed): its bf16 values are then the bf16 operand as they
// are (its copy has no rows), and widened GEMMs widen them into the copy
// (exactly). The same bits as its copy rounded from fp32.
template <class E>
Mat<const float> held_or_copied(const Mat<const float>& m, std::optional<const bf16*> held) {
  return held && std::is_same_v<E, bf16> ? dense(nullptr, 0, m.cols) : m;
}
template <class E>
const E* held_operand(Copies<E>& c, std::size_t i, std::optional<const bf16*> held,
                      std::int64_t n) {
  if (!held) return c.get(i);
  if constexpr (std::is_same_v<E, bf16>) {
    return *held;
  } else {
    to_float_threaded(*held, c.get(i), n);
    return c.get(i);
  }
}

// linear's and linear_backward's bodies on copies of element E (bf16, or
// fp32 where the GEMMs widen); false where the op does not compute.
template <class E>
bool linear_as(float* y, const float* x, const float* w, std::int64_t N, std::int64_t in,
               std::int64_t out, std::optional<const bf16*> x_held) {
  const void* xp = x_held ? static_cast<const void*>(*x_held) : x;
  MatCopies<E> c{held_or_copied<E>(dense(x, N, in), x_held), dense(w, out, in)};
  if (!runs(N * out, {y, xp, w})) return false;
  c.fill(x_held ? 0 : -1);
  linear_of_copies(y, held_operand(c, 0, x_held, N * in), c.get(1), N, in, out);
  return true;
}
template <class E>
bool linear_backward_as(float* dx, bool accumulate, float* dw, const float* dy, const float* x,
                        const float* w, std::int64_t N, std::int64_t in, std::int64_t out,
                        std::optional<const bf16*> x_held) {
  const void* xp = x_held ? static_cast<const void*>(*x_held) : x;
  MatCopies<E> c{dense(dy, N, out), held_or_copied<E>(dense(x, N, in), x_held), dense(w, out, in)};
  if (!runs(N * out, {dy, xp, w, dw, dx ? dx : w})) return false;
  c.fill(x_held ? 1 : -1);
  linear_backward_of_copies(dx, accumulate, dw, c.get(0), held_operand(c, 1, x_held, N * in),
                            c.get(2), N, in, out);
  return true;
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
  const KernelRow& row = gemm_row();
  OpCall call;
  call.op = Op::gemm, call.dtype = RunDtype::bf16;
  call.shape.m = C.rows, call.shape.n = C.cols, call.shape.k = K;
  call.shape.lda = A.cols, call.shape.ldb = B.cols, call.shape.ldc = C.ld;
  call.shape.trans_a = trans_a, call.shape.trans_b = trans_b;
  call.shape.invariant = op_invariant;
  call.out[0] = C.p, call.alpha = alpha, call.beta = beta;
  // The operands' copies dense, in the form the row takes them.
  auto run_on = [&](auto& c) {
    if (!runs(C.rows * C.cols, {C.p, A.p, B.p})) return false;
    c.fill();
    call.in[0] = c.get(0), call.in[1] = c.get(1);
    run_row(row, call);
    return true;
  };
  if (row.operands == Bf16Operands::fp32_values) {
    MatCopies<float> c{A, B};
    if (!run_on(c)) return;
  } else {
    MatCopies<bf16> c{A, B};
    if (!run_on(c)) return;
  }
  if (beta == 0.0f) round_in_place(C);
}

void linear(float* y, const float* x, const float* w, std::int64_t N, std::int64_t in,
            std::int64_t out, std::optional<const bf16*> x_held) {
  if (N * out == 0) return;
  if (!(widened() ? linear_as<float>(y, x, w, N, in, out, x_held)
                  : linear_as<bf16>(y, x, w, N, in, out, x_held)))
    return;
  round_in_place(Mat<float>{y, N, out, out});
}

// dx: fresh, an activation gradient a bf16 run stores, rounded; added to,
// an fp32 sum (the gemm rule above). dW is always added into the fp32
// gradient (the master weights' precision).
void linear_backward(float* dx, bool accumulate, float* dw, const float* dy, const float* x,
                     const float* w, std::int64_t N, std::int64_t in, std::int64_t out,
                     std::optional<const bf16*> x_held) {
  if (N * out == 0) return;
  if (!(widened() ? linear_backward_as<float>(dx, accumulate, dw, dy, x, w, N, in, out, x_held)
                  : linear_backward_as<bf16>(dx, accumulate, dw, dy, x, w, N, in, out, x_held)))
    return;
  if (dx && !accumulate) round_in_place(Mat<float>{dx, N, in, in});
}

// ------------------------------------------------------------ Copies

template <class E>
Copies<E>::Copies(const std::vector<std::int64_t>& n, const char* label, std::int64_t align) {
  std::int64_t bytes = 0;
  for (const std::int64_t values : n) {
    at_.push_back(bytes);
    bytes += (values * std::int64_t(sizeof(E)) + align - 1) / align * align;
  }
  buf_ = Tensor<bf16>({bytes / 2}, label);
}

template <class E>
E* Copies<E>::get(std::size_t i) {
  return reinterpret_cast<E*>(reinterpret_cast<unsigned char*>(buf_.data()) + at_[i]);
}

template <class E>
const E* Copies<E>::round(std::size_t i, const float* x, std::int64_t n) {
  copy_rounded(dense(x, 1, n), get(i));
  return get(i);
}

template class Copies<bf16>;
template class Copies<float>;

// ------------------------------------------------------ RowSlicedLinears

namespace {

std::int64_t copy_bytes(std::int64_t elements) {
  const std::int64_t e = widened() ? std::int64_t(sizeof(float)) : std::int64_t(sizeof(bf16));
  return (elements * e + 63) / 64 * 64;
}

}  // namespace

RowSlicedLinears::RowSlicedLinears(std::int64_t rows, std::initializer_list<InOut> shapes,
                                   bool backward)
    : rows_(rows), backward_(backward) {
  LAGA_CHECK(rows >= 1, "internal: RowSlicedLinears needs slices of at least one row, not ", rows);
  std::int64_t bytes = 0;
  for (const InOut& s : shapes) bytes = std::max(bytes, layout(s.in, s.out).bytes);
  buf_ = Tensor<bf16>({bytes / 2}, "bf16 operand copies");
}

RowSlicedLinears::Layout RowSlicedLinears::layout(std::int64_t in, std::int64_t out) const {
  Layout l;
  l.x = copy_bytes(out * in);                                  // w (out, in) first
  l.dy = l.x + copy_bytes(rows_ * in);                         // then a slice of x (rows, in)
  l.bytes = l.dy + (backward_ ? copy_bytes(rows_ * out) : 0);  // and of dy (rows, out)
  return l;
}

void RowSlicedLinears::forward(float* y, const float* x, const float* w, std::int64_t N,
                               std::int64_t in, std::int64_t out) {
  const Layout l = layout(in, out);
  LAGA_CHECK(!backward_ && l.bytes <= buf_.numel() * 2, "internal: RowSlicedLinears made for ",
             backward_ ? "backward" : "other shapes", " ran a forward of (", in, " -> ", out, ")");
  if (!runs(N * out, {y, x, w, buf_.data()})) return;
  unsigned char* base = reinterpret_cast<unsigned char*>(buf_.data());
  const auto run = [&](auto* wc, auto* xc) {
    copy_rounded(dense(w, out, in), wc);
    for (std::int64_t r0 = 0; r0 < N; r0 += rows_) {
      const std::int64_t n = std::min(rows_, N - r0);
      copy_rounded(dense(x + r0 * in, n, in), xc);
      linear_of_copies(y + r0 * out, xc, wc, n, in, out);
    }
  };
  if (widened())
    run(reinterpret_cast<float*>(base), reinterpret_cast<float*>(base + l.x));
  else
    run(reinterpret_cast<bf16*>(base), reinterpret_cast<bf16*>(base + l.x));
  round_in_place(Mat<float>{y, N, out, out});
}

void RowSlicedLinears::backward(float* dx, bool accumulate, float* dw, const float* dy,
                                const float* x, const float* w, std::int64_t N, std::int64_t in,
                                std::int64_t out) {
  const Layout l = layout(in, out);
  LAGA_CHECK(backward_ && l.bytes <= buf_.numel() * 2, "internal: RowSlicedLinears made for ",
             backward_ ? "other shapes" : "forward", " ran a backward of (", in, " -> ", out, ")");
  if (!runs(N * out, {dy, x, w, dw, dx ? dx : w, buf_.data()})) return;
  unsigned char* base = reinterpret_cast<unsigned char*>(buf_.data());
  const auto run = [&](auto* wc, auto* xc, auto* dyc) {
    copy_rounded(dense(w, out, in), wc);
    for (std::int64_t r0 = 0; r0 < N; r0 += rows_) {
      const std::int64_t n = std::min(rows_, N - r0);
      copy_rounded(dense(x + r0 * in, n, in), xc);
      copy_rounded(dense(dy + r0 * out, n, out), dyc);
      linear_backward_of_copies(dx ? dx + r0 * in : nullptr, accumulate, dw, dyc, xc, wc, n, in,
                                out);
    }
  };
  if (widened())
    run(reinterpret_cast<float*>(base), reinterpret_cast<float*>(base + l.x),
        reinterpret_cast<float*>(base + l.dy));
  else
    run(reinterpret_cast<bf16*>(base), reinterpret_cast<bf16*>(base + l.x),
        reinterpret_cast<bf16*>(base + l.dy));
  if (dx && !accumulate) round_in_place(Mat<float>{dx, N, in, in});
}

}  // namespace laga::ops::bf16_path
