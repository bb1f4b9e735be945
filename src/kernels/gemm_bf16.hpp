// bf16 GEMMs for mixed-precision training (issue 27): bf16 operands, products
// summed in fp32, the result stored as fp32 or rounded to bf16. Row-major,
// the same contract as kernels/gemm.hpp's gemm() (strides in elements, beta 0
// ignores C's old contents, NaN included), and the linear layers built on it:
// forward y = x W^T, dx = dy W, dW += dy^T x into the fp32 gradient.
//
// They run on oneDNN's matmul primitive: on a CPU with AMX its AMX kernels
// (brg:avx512_core_amx_bf16), with AVX512_BF16 its brgemm kernels
// (brg:avx512_core_bf16) doing the dot products with VDPBF16PS; on AVX-512
// without it oneDNN emulates bf16 (avx512_core). Or the operands are widened
// to fp32 (exactly: every bf16 is an fp32) and multiplied by gemm<float>:
// the same exact products and fp32 sums, in another order, through two fp32
// copies of the operands kept per thread (not in the memory pool). Which one
// runs is gemm_bf16_path() below: widening where oneDNN has no bf16 matmul
// (below avx512_core), or where its bf16 matmul is slower than its fp32 one.
// oneDNN 2.6 runs the brgemm kernels only on dense operands (lda, ldb, ldc
// equal to the rows' widths); a strided operand (one head of a (S, H, d)
// tensor) goes to its jit gemm instead (gemm_bf16_implementation says which,
// docs/performance.md measures both).
//
// Primitives are made once per (transposes, M, N, K, strides, output type,
// alpha, beta, threads) and kept in a process-wide cache that any thread
// (any in-process rank) may use at once. The threads are the calling
// thread's OpenMP count (core/threads.hpp, set_rank_threads), which oneDNN
// fixes a primitive's work split by when it is made, hence in the key.
#pragma once

#include <cstdint>
#include <string>

#include "core/bf16.hpp"

namespace laga {

// How gemm_bf16 multiplies (above): oneDNN's bf16 matmul, or the operands
// widened to fp32 through gemm<float>.
enum class GemmBf16Path { onednn_bf16, widened_fp32 };
const char* to_string(GemmBf16Path p);  // "onednn_bf16", "widened_fp32"

// The one in use: the last set_gemm_bf16_path(), else LAGA_GEMM_BF16
// (onednn_bf16, widened_fp32 or auto; unset = auto), read at the first call.
// auto is onednn_bf16 where oneDNN has a bf16 matmul and it outruns its fp32
// one: on a CPU with AMX (oneDNN's effective ISA avx512_core_amx), or where
// VDPBF16PS outruns the FMAs (flash_bf16_dot_products_pay: AMD's Zen 4 and
// 5); else widened_fp32. An Intel Xeon without AMX issues VDPBF16PS at half
// its FMA rate, and oneDNN's bf16 matmul runs the block's shapes at
// 0.49-0.65x its fp32 one there (docs/performance.md, "bf16 GEMMs on an
// Intel Xeon without AMX"). Decided by the CPU, not by a timing, so a run's
// bits do not depend on the machine's load. Throws laga::Error for an
// unknown value, or onednn_bf16 where oneDNN has no bf16 matmul.
GemmBf16Path gemm_bf16_path();
// Selects the path for later calls and returns the previous one (tests,
// benchmarks; not while GEMMs run). Throws laga::Error, changing nothing,
// for onednn_bf16 where oneDNN has no bf16 matmul.
GemmBf16Path set_gemm_bf16_path(GemmBf16Path p);

namespace detail {
// LAGA_GEMM_BF16's value (null or empty: auto) resolved, where `has_matmul`
// says whether oneDNN has a bf16 matmul here and `pays` whether it outruns
// its fp32 one.
GemmBf16Path resolve_gemm_bf16_path(const char* setting, bool has_matmul, bool pays);
}  // namespace detail

// C (M, N) = alpha * op(A) op(B) + beta * C, op(A) (M, K), op(B) (K, N), A
// and B bf16, each product and sum in fp32. TC is float (the fp32 result, or
// an fp32 gradient accumulated into with beta 1) or bf16 (C rounded once, at
// the end, to_bf16's rounding; with beta != 0 the old bf16 C is widened, added
// in fp32 and rounded again). A stride shorter than its row throws laga::Error.
template <class TC>
void gemm_bf16(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
               float alpha, const bf16* A, std::int64_t lda, const bf16* B, std::int64_t ldb,
               float beta, TC* C, std::int64_t ldc);

// y (N, out) = x (N, in) W^T, W (out, in); y fp32 or bf16.
template <class TY>
void linear_forward_bf16(TY* y, const bf16* x, const bf16* w, std::int64_t N, std::int64_t in,
                         std::int64_t out);

// dx (N, in) = dy W (overwritten, or added to when accumulate_dx; skipped when
// dx is null), dx fp32 or bf16; dW (out, in) += dy^T x into the fp32 gradient
// (always accumulated, as linear_backward does; skipped when null).
template <class TX>
void linear_backward_bf16(TX* dx, bool accumulate_dx, float* dw, const bf16* dy, const bf16* x,
                          const bf16* w, std::int64_t N, std::int64_t in, std::int64_t out);

// Which oneDNN implementation a gemm_bf16 call of these extents and strides
// runs here, in oneDNN's words ("brg:avx512_core_bf16", "gemm:jit", "ref:any"),
// or that it widens to fp32 and why, for reports; makes (and caches) the
// primitive if needed.
std::string gemm_bf16_implementation(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N,
                                     std::int64_t K, std::int64_t lda, std::int64_t ldb,
                                     std::int64_t ldc, bool bf16_out);

// Primitives in the cache now (tests: one per distinct call).
std::int64_t gemm_bf16_cached_primitives();

}  // namespace laga
