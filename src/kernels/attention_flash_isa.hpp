// The flash kernels once per instruction set, each copy in its own namespace
// (attention_flash_simd.hpp says why): attention_flash_impl.inc compiled by
// attention_flash_avx2.cpp (float and double) and, where the compiler has
// AVX-512, attention_flash_avx512.cpp (float only). attention_flash.cpp
// dispatches the public API to them. Private to the kernels layer.
#pragma once

#include "kernels/attention.hpp"

namespace laga::flash_avx2 {
template <class T>
void forward(const AttnShape& s, T* o, T* lse, const T* q, const T* k, const T* v);
template <class T>
void backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
              const T* v, const T* o, const T* lse);
}  // namespace laga::flash_avx2

namespace laga::flash_avx512 {
template <class T>
void forward(const AttnShape& s, T* o, T* lse, const T* q, const T* k, const T* v);
template <class T>
void backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
              const T* v, const T* o, const T* lse);
}  // namespace laga::flash_avx512
