// The op layer's bf16 mixed-precision path (Precision::bf16, --dtype bf16;
// ops.hpp's header says what it rounds where): fp32 operands rounded to
// bf16 into this thread's scratch (kernels/bf16_convert.hpp), multiplied by
// kernels/gemm_bf16.hpp with fp32 sums. T = float only: the tensors stay
// fp32 containers, holding bf16 values where a bf16 run stores bf16.
#pragma once

#include <cstdint>

#include "core/bf16.hpp"
#include "core/tensor.hpp"

namespace laga::ops {

template <class T>
struct Mat;

namespace bf16_path {

// The operand slots of one op: each op rounds at most this many inputs at
// once, each into its own slot, and every slot is reused by the next op.
enum class Slot { first, second, third, fourth };

// The (rows, cols) matrix m rounded to bf16, dense (row stride cols), in
// this thread's `slot` scratch: valid until the slot's next use.
const bf16* operand(Slot slot, const Mat<const float>& m);
// n contiguous values rounded to bf16, the same way.
const bf16* operand(Slot slot, const float* x, std::int64_t n);

// Every element of m replaced by its bf16 value (to_float(to_bf16(x))):
// what a bf16 tensor holding m would hold.
void round_in_place(const Mat<float>& m);

// ops::gemm, ops::linear and ops::linear_backward under Precision::bf16
// (their contracts; ops.hpp has already counted and checked the shapes).
void gemm(const Mat<float>& C, float beta, const Mat<const float>& A, bool trans_a,
          const Mat<const float>& B, bool trans_b, float alpha);
void linear(const Mat<float>& y, const Mat<const float>& x, const Tensor<float>& w);
void linear_backward(const Mat<float>* dx, bool accumulate, Tensor<float>& dw,
                     const Mat<const float>& dy, const Mat<const float>& x, const Tensor<float>& w);

}  // namespace bf16_path
}  // namespace laga::ops
