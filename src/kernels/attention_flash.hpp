// Fused flash-style attention on the CPU: tiled, online softmax, no (Sq, Sk)
// buffer in forward or backward. Same layout, masking and conventions as
// kernels/attention.hpp (read it first); lse (B, Hq, Sq) is the natural-log
// log-sum-exp of the scaled scores of each query row (0 for a fully masked
// row), saved by forward for the backward's recomputation of p.
#pragma once

#include "kernels/attention.hpp"

namespace laga {

template <class T>
void attention_flash_forward(const AttnShape& s, T* o, T* lse, const T* q, const T* k,
                             const T* v);

// dq, dk, dv overwritten. o and lse are forward's outputs (D_i = do_i . o_i).
template <class T>
void attention_flash_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q,
                              const T* k, const T* v, const T* o, const T* lse);

}  // namespace laga
