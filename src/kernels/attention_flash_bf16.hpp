// Flash attention on bf16 Q, K, V (and dO) with fp32 accumulation (issue 27):
// the layout, masks (causal bottom-right, packed documents via doc_start),
// the fully-masked-row convention (o = 0, lse = 0, no gradient) and the
// determinism rule (every sum taken in a fixed block order by one thread:
// bitwise the same for any thread count) of kernels/attention.hpp and
// kernels/attention_flash.hpp, which read first.
//
// Precision, and what is rounded to bf16 where (the FlashAttention 2 recipe
// on GPUs): scores S = Q K^T and dP = dO V^T are exact products of bf16
// values summed in fp32; the softmax statistics (row max, row sum, lse) and
// D_i = dO_i . o_i are fp32; P is rounded to bf16 for the P V and P^T dO
// products, dS = P (dP - D) * scale to bf16 for dS K and dS^T Q, each once,
// right before its product. That is one bf16 rounding (unit roundoff
// u = 2^-8) per term of each sum: of p in o and dv, of dS in dq and dk (plus
// o's error carried into D); nothing else is of bf16 size, every sum itself
// runs in fp32 (tests/kernels/test_attention_flash_bf16.cpp derives its
// tolerance from this).
//
// Outputs are fp32, and that is a choice:
//  - o: the exact fp32 accumulator over the fp32 row sum. The caller rounds
//    it to bf16 for the output projection's bf16 GEMM if it wants (one
//    convert_to_bf16 pass over (B, Sq, Hq, dv), nothing against the
//    attention's S^2 work), and backward's D_i = dO_i . o_i, which every dS
//    subtracts from dP (a difference of nearly equal numbers where a row's
//    attention is peaked), is taken from the unrounded o.
//  - dq, dk, dv: the fp32 sums themselves. dk and dv of a shared key/value
//    head (the latent form: Hk = 1) sum over all Hq heads and every query,
//    and trainers keep gradients and their accumulation in fp32 (fp32 master
//    weights, kernels/gemm_bf16.hpp's linear_backward_bf16 adds dW into fp32);
//    rounding them to bf16 here would be a further rounding the caller
//    cannot undo, where rounding later is one convert call.
//
// Non-finite inputs: as attention.hpp says, a NaN or inf in one token's q,
// k or v reaches exactly the rows that see that token. The other rows of a
// tile holding it are then summed by a scalar path (the AVX512_BF16 copy's
// top comment says why), so they match a clean run to fp32 rounding, not
// bit for bit as in the fp32 kernels.
//
// Memory: the AVX512_BF16 forward packs K and V into two layouts each
// (about 4 (dqk + dv) bytes a key and head); backward also packs Q and dO
// (as much again per query row). The caller may hand the call that memory
// (FlashWorkspace: the op layer gives a pool tensor, so that the pool and
// the memory model count it, mla/block.cpp); else the call allocates it.
//
// Instruction set (FlashBf16Isa): on a CPU with AVX512_BF16 the products run
// on VDPBF16PS (two bf16 products summed into each fp32 lane); elsewhere the
// inputs are widened to fp32 (exactly) and the fp32 flash kernels run on
// them (attention_flash_forward<float>): the same contract, P and dS then
// not rounded (more accurate, slower, and 4 * (q + k + v [+ dO]) bytes of
// fp32 copies per call).
#pragma once

#include <vector>

#include "core/bf16.hpp"
#include "kernels/attention.hpp"

namespace laga {

// Memory a call works in, from its caller: `bytes` at `data`, 64-byte
// aligned, at least attention_flash_bf16_workspace_bytes(s, pass) (checked).
// Empty (data null): the call allocates its own.
struct FlashWorkspace {
  void* data = nullptr;
  std::int64_t bytes = 0;
};

// o (B, Sq, Hq, dv) and lse (B, Hq, Sq) fp32, overwritten.
void attention_flash_forward_bf16(const AttnShape& s, float* o, float* lse, const bf16* q,
                                  const bf16* k, const bf16* v,
                                  const FlashWorkspace& workspace = {});

// dq (B, Sq, Hq, dqk), dk (B, Sk, Hk, dqk), dv (B, Sk, Hk, dv) fp32,
// overwritten. dout bf16 (it is an operand of dP = dO V^T and dV = P^T dO);
// o and lse are forward's fp32 outputs.
void attention_flash_backward_bf16(const AttnShape& s, float* dq, float* dk, float* dv,
                                   const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                                   const float* o, const float* lse,
                                   const FlashWorkspace& workspace = {});

// The bytes one call of the two above works in besides its arguments (its
// FlashWorkspace), at this thread's OpenMP thread count and flash_bf16_isa():
// on avx512_bf16, the kernels' bf16 layouts of K and V for every head (and,
// in backward, of Q, dO and their statistics) and each thread's tiles; on
// fp32, the widened fp32 copies of q, k, v (and dout) -- the fp32 flash
// kernel's own per-thread tiles not included. Computed from the shape, the
// same figure the calls allocate (tests/kernels/test_attention_flash_bf16).
std::int64_t attention_flash_bf16_workspace_bytes(const AttnShape& s, bool backward);
// At least attention_flash_bf16_workspace_bytes of every shape whose
// extents are no larger than s's (the backward's per-head schedule, the
// larger, whichever the call would take): one workspace for several calls
// whose extents follow the data.
std::int64_t attention_flash_bf16_workspace_bound(const AttnShape& s, bool backward);
// The largest workspace of this thread's calls since its last reset, which
// the kernel tests hold to what the calls allocate.
std::int64_t attention_flash_bf16_workspace_high_water();
void reset_attention_flash_bf16_workspace_high_water();

// How the bf16 kernels run: fp32 (widen, then the fp32 flash kernels of
// flash_isa(); any CPU) or avx512_bf16 (VDPBF16PS; needs avx512f, avx512vl,
// avx512bw, avx512dq and avx512bf16, and a compiler that builds it).
enum class FlashBf16Isa { fp32, avx512_bf16 };
const char* to_string(FlashBf16Isa isa);  // "fp32", "avx512_bf16"

// The ones this build has and this CPU runs; fp32 always, first.
std::vector<FlashBf16Isa> flash_bf16_isas_available();
// Why avx512_bf16 cannot run here, or null when it can (for reports).
const char* flash_bf16_why_no_avx512_bf16();

// Whether VDPBF16PS outruns the fp32 FMAs on this CPU, decided by vendor so
// that a run's bits do not depend on a timing: AMD's Zen 4 and Zen 5 issue it
// at twice FMA's FLOP rate (docs/performance.md: 765-870 GFLOP/s against
// 420-530 on 2 cores); Intel's Xeons issue it on one port where FMA has two,
// half FMA's rate (this repository's Xeon: 214 against 433 GFLOP/s), and there
// the bf16 kernel's backward is 15% slower than widening to the fp32 kernels.
// Other vendors: assumed to pay.
bool flash_bf16_dot_products_pay();

// The one in use: the last set_flash_bf16_isa(), else LAGA_FLASH_BF16_ISA
// (fp32, avx512_bf16 or auto; unset = auto), read at the first call; auto is
// avx512_bf16 where it is available and its dot products pay
// (flash_bf16_dot_products_pay), else fp32. Throws laga::Error for an unknown value or an
// unavailable ISA.
FlashBf16Isa flash_bf16_isa();
// Selects the ISA for later calls, returns the previous one (tests,
// benchmarks; not while kernels run). Throws laga::Error, changing nothing,
// when `isa` is not available.
FlashBf16Isa set_flash_bf16_isa(FlashBf16Isa isa);

namespace detail {
// LAGA_FLASH_BF16_ISA's value (null or empty: auto) resolved, where
// `unusable` says why avx512_bf16 cannot run (null: it can) and `pays`
// whether auto should take it when it can.
FlashBf16Isa resolve_flash_bf16_isa(const char* setting, const char* unusable, bool pays = true);
// The most bytes the AVX512_BF16 kernels' buffers held at once, process-wide,
// since the last reset (tests: one call at a time); -1 in a build without
// those kernels.
std::int64_t flash_bf16_allocated_peak();
void reset_flash_bf16_allocated_peak();
}  // namespace detail

}  // namespace laga
