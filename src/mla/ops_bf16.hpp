// The op layer's bf16 mixed-precision path (Precision::bf16, --dtype bf16;
// ops.hpp's header says what it rounds where): fp32 operands rounded to
// bf16 into copies the pool counts (kernels/bf16_convert.hpp), multiplied by
// kernels/gemm_bf16.hpp with fp32 sums. T = float only: the tensors stay
// fp32 containers, holding bf16 values where a bf16 run stores bf16.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include "core/bf16.hpp"
#include "core/tensor.hpp"

namespace laga {

// ------------------------------------------------ what a bf16 block run meets
//
// bf16's unit roundoff: 8 significant bits, round to nearest, so one
// rounding moves a value by at most 2^-8 of itself.
inline constexpr double kBf16UnitRoundoff = 1.0 / 256;

// The block's tensors by the bound they meet: out, or dx and every
// parameter gradient.
enum class BlockTensor { output, gradient };

// Roundings on the longest path from the inputs to a tensor. A bf16 run
// rounds, on the way to out: x and in_proj (the first GEMM's operands), its
// output, RoPE's rotation or RMSNorm's c_hat, wkv_b and the K/V
// up-projection's output (or, absorbed, W_UK folded into q), P inside the
// flash kernel, o and wo (the last GEMM's operands) and out: 10 (rq > 0
// adds q's path, RMSNorm, wq_b and its output, which runs beside the
// latent's, not after it). Backward retraces that path with as many
// roundings again (each GEMM's dy and its fresh output, dO and dS in the
// kernel): twice as many.
constexpr int bf16_roundings(BlockTensor t) {
  return t == BlockTensor::output ? 10 : 20;
}
// max |bf16 run - exact| / max |exact|: to first order each rounding adds at
// most u of its value, and with weights that keep the block's activations at
// its input's scale (init_params' 0.1) the errors add without growth
// relative to the tensor's largest value: n u (fp32's own 2^-24 per step
// is far below).
constexpr double bf16_bound_vs_exact(BlockTensor t) {
  return bf16_roundings(t) * kBf16UnitRoundoff;
}
// Between two bf16 runs that round at different places (absorbed's fold,
// laga_fused's unrounded in-kernel K/V) or sum in another fp32 order (which
// can flip a rounding by one ulp): each within n u of the exact block, so
// within 2 n u of each other.
constexpr double bf16_bound_between_runs(BlockTensor t) {
  return 2 * bf16_bound_vs_exact(t);
}

}  // namespace laga

namespace laga::ops {

template <class T>
struct Mat;

namespace bf16_path {

// The copies of an op's operands rounded to bf16 (Copies below) are one
// pool tensor for the op's length (MemCategory::activations, "bf16 operand
// copies"), made before the op asks whether it computes, so that a
// count-only run registers the same bytes and the memory model counts what
// a real run holds (docs/accounting.md, "bf16 operand copies and attention
// scratch"); attention's are mla/ops_attention.cpp's bf16 attention scratch.
//
// One op's operand copies: rounded to bf16 (E = bf16), or to their bf16
// values kept fp32 (E = float, where the GEMMs widen), in one pool tensor
// `label` made here, one block a call so that the pool's block cache has
// fewer sizes to keep from step to step. Copy i holds n[i] values from an
// `align`-byte boundary: 64 for the GEMMs' copies (this file's), 1 (packed
// end to end) for the sparse attention's (mla/ops_sparse.cpp, under their
// own label). Count-only: registered, nothing converted.
template <class E>
class Copies {
 public:
  explicit Copies(const std::vector<std::int64_t>& n, const char* label = "bf16 operand copies",
                  std::int64_t align = 64);
  E* get(std::size_t i);
  // x's n dense values rounded into copy i (to_bf16_threaded's or
  // round_threaded's bits); returns the copy.
  const E* round(std::size_t i, const float* x, std::int64_t n);

 private:
  std::vector<std::int64_t> at_;  // each copy's byte offset in buf_
  Tensor<bf16> buf_;
};
extern template class Copies<bf16>;
extern template class Copies<float>;

// n values converted to bf16 (to_bf16's bits) and back to fp32 (exact),
// vectorised (kernels/bf16_convert.hpp) and split over the rank's threads:
// elementwise, so the same bits on any thread count.
void to_bf16_threaded(const float* x, bf16* y, std::int64_t n);
void to_float_threaded(const bf16* x, float* y, std::int64_t n);
// n values rounded to their bf16 values, kept fp32 (to_float(to_bf16(x))),
// likewise: the copies an fp32 kernel reads where bf16 kernels widen.
void round_threaded(const float* x, float* y, std::int64_t n);
// Every element of m replaced by its bf16 value (to_float(to_bf16(x))):
// what a bf16 tensor holding m would hold.
void round_in_place(const Mat<float>& m);

// ops::gemm, ops::linear and ops::linear_backward under Precision::bf16
// (their contracts; ops.hpp has already counted and checked the shapes).
void gemm(const Mat<float>& C, float beta, const Mat<const float>& A, bool trans_a,
          const Mat<const float>& B, bool trans_b, float alpha);
// The linears on dense rows (x (N, in), y and dy (N, out), w (out, in)), as
// laga::linear_forward/backward take them: ops.hpp's views (checked dense
// there) and the MoE's experts (model/moe.cpp), which hold pointers.
// x_held (both): present when x is held narrowed (ops::keep_narrowed): its
// bf16 values (N, in), read as the operand in place of x's copy (x itself
// null; the values null in a count-only run, which still allocates as a
// real one).
void linear(float* y, const float* x, const float* w, std::int64_t N, std::int64_t in,
            std::int64_t out, std::optional<const bf16*> x_held = std::nullopt);
void linear_backward(float* dx, bool accumulate, float* dw, const float* dy, const float* x,
                     const float* w, std::int64_t N, std::int64_t in, std::int64_t out,
                     std::optional<const bf16*> x_held = std::nullopt);

// Linears whose row counts follow data a count-only run does not have (the
// MoE's routed experts: an expert's rows follow the routing, model/moe.cpp).
// Copies sized per call would make the pool's peak depend on the routing,
// which the memory model cannot predict; so every call's copies come from
// one pool tensor ("bf16 operand copies") made up front, sized for a call of
// `rows` rows at the widest of the (in, out) shapes the run will call, and a
// call of more rows runs in slices of `rows` (a linear's rows are
// independent; dW sums the slices in fp32, as it sums calls). Made whether
// or not the run computes: a count-only run registers the same bytes.
class RowSlicedLinears {
 public:
  struct InOut {
    std::int64_t in, out;
  };
  // backward: the run calls backward() (copies of dy, x and w), else
  // forward() (x and w).
  RowSlicedLinears(std::int64_t rows, std::initializer_list<InOut> shapes, bool backward);
  // y (N, out) = x (N, in) W^T, W (out, in): linear's contract.
  void forward(float* y, const float* x, const float* w, std::int64_t N, std::int64_t in,
               std::int64_t out);
  // dx (N, in) = dy W (or added to), dW += dy^T x: linear_backward's contract.
  void backward(float* dx, bool accumulate, float* dw, const float* dy, const float* x,
                const float* w, std::int64_t N, std::int64_t in, std::int64_t out);

 private:
  // The copies' offsets in buf_ for a call of (in, out) and slices of rows_.
  struct Layout {
    std::int64_t x, dy, bytes;
  };
  Layout layout(std::int64_t in, std::int64_t out) const;
  std::int64_t rows_;
  bool backward_;
  Tensor<bf16> buf_;
};

}  // namespace bf16_path
}  // namespace laga::ops
