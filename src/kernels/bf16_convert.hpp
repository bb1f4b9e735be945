// fp32 <-> bf16 conversion of arrays: the rounding of core/bf16.hpp
// (to nearest even, NaN kept and made quiet, fp32 denormals to signed zero),
// vectorised with AVX512_BF16's VCVTNE2PS2BF16 where the CPU has it, a
// portable loop otherwise. Both give the same bits for every input, so a
// result never depends on the CPU it was converted on (tests/kernels/
// test_bf16_convert.cpp holds each to to_bf16 on every kind of value).
#pragma once

#include <cstdint>

#include "core/bf16.hpp"
#include "core/tensor.hpp"

namespace laga {

enum class Bf16ConvertIsa {
  portable,     // a loop of to_bf16 (core/bf16.hpp): any CPU
  avx512_bf16,  // VCVTNE2PS2BF16, 32 values an instruction: needs avx512f and avx512bf16
};
const char* to_string(Bf16ConvertIsa isa);

// The fastest path this CPU (and this build) runs: chosen once, at the first call.
Bf16ConvertIsa bf16_convert_isa();
// Whether `isa` can run here.
bool bf16_convert_isa_available(Bf16ConvertIsa isa);

// y[i] = to_bf16(x[i]) for i < n, by bf16_convert_isa() or by the path given
// (which must be available: laga::Error otherwise). x and y must not overlap.
void convert_to_bf16(const float* x, bf16* y, std::int64_t n);
void convert_to_bf16(const float* x, bf16* y, std::int64_t n, Bf16ConvertIsa isa);
// y[i] = to_float(x[i]): exact, so one path (the compiler vectorises it).
void convert_to_float(const bf16* x, float* y, std::int64_t n);

// A new tensor of x's shape holding x rounded to bf16 (the bf16 copy of an
// fp32 master weight, or an activation), registered under `cat` with the
// current pool; unbacked (count-only) when x is.
Tensor<bf16> to_bf16(const Tensor<float>& x, MemCategory cat);
// x widened to fp32, the same way.
Tensor<float> to_float(const Tensor<bf16>& x, MemCategory cat);

}  // namespace laga
