// laga's small device kernels (elementwise.cu): RMSNorm and interleaved RoPE
// with their backward, and the ring's merge of partial attention outputs by
// log-sum-exp. fp32 on the device; the math is the CPU kernels' (read
// kernels/rmsnorm.hpp, kernels/rope.hpp and mla/ring.hpp's merge_partial),
// every pointer a device pointer with its shape beside it.
#pragma once

#include <cstdint>

#include "comm/communicator.hpp"  // DType

#include "kernels/lse_merge.hpp"
#include "kernels/rope.hpp"

namespace laga::cuda {

// y (N, C) contiguous, x (N, C) with row stride ldx, w (C), rstd (N) written.
void rmsnorm_forward(float* y, float* rstd, const float* x, std::int64_t ldx, const float* w,
                     std::int64_t N, std::int64_t C, double eps, void* stream = nullptr);
// dx (N, C) stride lddx overwritten; dw (C) added to (one thread per column
// sums the rows in order: deterministic); dy stride lddy, x stride ldx.
void rmsnorm_backward(float* dx, std::int64_t lddx, float* dw, const float* dy, std::int64_t lddy,
                      const float* x, std::int64_t ldx, const float* w, const float* rstd,
                      std::int64_t N, std::int64_t C, void* stream = nullptr);

// A RopeTable's cos and sin on the device, fp32 (positions, dim / 2) each,
// rounded from the table's doubles.
struct DeviceRope {
  const float* cos = nullptr;
  const float* sin = nullptr;
  std::int64_t dim = 0, positions = 0;
};

// kernels/rope.hpp's rope_apply on the device: x's rope part, element i of
// token (b, l) and head h at x + (b L + l) ld_token + h ld_head + i, rotated
// in place at position positions[b L + l] (device, (B, L)) or, when
// positions is null, at pos0 + l. inverse: the backward. A position outside
// [0, table.positions) is clamped away (the kernel leaves that token
// unrotated): the caller checks positions on the host, as rope_apply_at does.
void rope_apply(float* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                std::int64_t ld_head, std::int64_t pos0, const std::int64_t* positions,
                const DeviceRope& table, bool inverse, void* stream = nullptr);

// The ring's merge of a step's partial output into the rank's by
// log-sum-exp: kernels/lse_merge.hpp's contract (its shape, offsets and
// `first` copy) with device pointers; fp32.
void lse_merge(const LseMergeShape& s, float* o, float* lse, const float* o_p, const float* lse_p,
               void* stream = nullptr);

// out[i] = sum over p = 0 .. P-1, in that order, of parts[p][i] (P device
// pointers, themselves in device memory), n elements of dtype; bf16 parts
// are added in fp32 and the sum rounded once (comm/communicator.hpp,
// "Reductions": the order every backend sums in). `out` may be one of the
// parts.
void sum_in_rank_order(void* out, const void* const* parts, int P, std::int64_t n, DType dtype,
                       void* stream = nullptr);

// The forms' data movement on the device (mla/op_table.hpp, Op::copy_rows
// and Op::fill; the CPU rows' loops in mla/op_table_cpu.cpp): rows x cols
// elements, each side at its own row stride. copy_rows: dst = src, or
// dst += src when accumulate; `to` is dst's element type and src_bf16 says
// src holds bf16 (to f32: widened exactly, optionally added; to bf16: moved
// as they are); to bf16 from f32 src rounds as core/bf16.hpp's to_bf16 (to
// nearest even, NaN made quiet, fp32 denormals to signed zero: the CPU's
// bits, not __float2bfloat16_rn's, which keeps denormals). A sum into bf16
// is the caller's refusal (copy_rows_refusal).
void copy_rows(void* dst, std::int64_t ldd, const void* src, std::int64_t lds, std::int64_t rows,
               std::int64_t cols, DType to, bool src_bf16, bool accumulate, void* stream = nullptr);
// dst (rows x cols, stride ldd) = value, in `to` (f32 or f64).
void fill_rows(void* dst, std::int64_t ldd, std::int64_t rows, std::int64_t cols, DType to,
               double value, void* stream = nullptr);

}  // namespace laga::cuda
