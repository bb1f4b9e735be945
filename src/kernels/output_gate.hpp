// Kimi K3's MLA output gate (mla_use_output_gate; docs/mla-math.md, "Gated
// NoPE MLA"): full-rank and channel-wise, between the attention and wo,
//   y = o * sigmoid(g),   g = x wg^T (N, H dv),  o the heads' output (N, H dv),
// then out = y wo^T. Backward, with s = sigmoid(g):
//   do = dy * s,   dg = dy * o * s (1 - s).
// wg is a linear layer (kernels/gemm.hpp); this is the element-wise part.
#pragma once

#include <cstdint>

namespace laga {

// y, o, g: n elements each ((N, H dv) flattened).
template <class T>
void output_gate_forward(T* y, const T* o, const T* g, std::int64_t n);

// d_o, dg (n) overwritten from dy (n) and the forward inputs o, g.
template <class T>
void output_gate_backward(T* d_o, T* dg, const T* dy, const T* o, const T* g, std::int64_t n);

// Naive versions in double, written differently, for tests.
template <class T>
void output_gate_forward_reference(T* y, const T* o, const T* g, std::int64_t n);
template <class T>
void output_gate_backward_reference(T* d_o, T* dg, const T* dy, const T* o, const T* g,
                                    std::int64_t n);

}  // namespace laga
