// SwiGLU gate of the MLP (DeepSeek-V3 `MLP.forward`: w2(silu(w1 x) * w3 x)):
//   h = silu(a) * b,  silu(a) = a * sigmoid(a),  a = x w1^T, b = x w3^T.
// Backward, with s = sigmoid(a):
//   da = dh * b * s * (1 + a (1 - s)),   db = dh * silu(a)
// The projections are linear layers (kernels/gemm.hpp); this is the
// element-wise part between them.
#pragma once

#include <cstdint>

namespace laga {

// h, a, b: n elements each (a (N, F) and b (N, F) flattened).
template <class T>
void swiglu_forward(T* h, const T* a, const T* b, std::int64_t n);

// da, db (n) overwritten from dh (n) and the forward inputs a, b.
template <class T>
void swiglu_backward(T* da, T* db, const T* dh, const T* a, const T* b, std::int64_t n);

// Naive versions in double, for tests.
template <class T>
void swiglu_forward_reference(T* h, const T* a, const T* b, std::int64_t n);
template <class T>
void swiglu_backward_reference(T* da, T* db, const T* dh, const T* a, const T* b, std::int64_t n);

}  // namespace laga
