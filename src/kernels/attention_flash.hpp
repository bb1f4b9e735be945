// Fused flash-style attention on the CPU: tiled, online softmax, no (Sq, Sk)
// buffer in forward or backward. Same layout, masking and conventions as
// kernels/attention.hpp (read it first); lse (B, Hq, Sq) is the natural-log
// log-sum-exp of the scaled scores of each query row (0 for a fully masked
// row), saved by forward for the backward's recomputation of p.
//
// The float kernels exist once per instruction set and one is picked at run
// time (FlashIsa below); double always runs the same scalar code.
#pragma once

#include <vector>

#include "kernels/attention.hpp"

namespace laga {

template <class T>
void attention_flash_forward(const AttnShape& s, T* o, T* lse, const T* q, const T* k, const T* v);

// dq, dk, dv overwritten. o and lse are forward's outputs (D_i = do_i . o_i).
template <class T>
void attention_flash_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q,
                              const T* k, const T* v, const T* o, const T* lse);

// Instruction set of the float flash kernels. avx512 exists when the compiler
// could build it and runs when the CPU has AVX-512 F, VL, BW and DQ.
enum class FlashIsa { avx2, avx512 };
const char* to_string(FlashIsa isa);  // "avx2", "avx512"

// The ones this build has and this CPU runs, narrowest first; avx2 always.
std::vector<FlashIsa> flash_isas_available();

// The one in use: the last set_flash_isa(), else what the environment
// variable LAGA_FLASH_ISA (avx2, avx512 or auto; unset = auto) selects, read
// at the first call; auto is the widest available. Throws laga::Error for an
// unknown value or an unavailable ISA, naming the value or what is missing.
FlashIsa flash_isa();

// Selects the ISA for all later calls and returns the previous one (tests and
// benchmarks; not while kernels are running). Throws laga::Error, changing
// nothing, when `isa` is not available.
FlashIsa set_flash_isa(FlashIsa isa);

namespace detail {
// LAGA_FLASH_ISA's value (null or empty: auto) resolved, where
// `avx512_unusable` says why AVX-512 cannot run (null: it can). flash_isa()'s
// rule, taking the machine as an argument so that tests can reach every error.
FlashIsa resolve_flash_isa(const char* setting, const char* avx512_unusable);
}  // namespace detail

}  // namespace laga
