#include "kernels/bf16_convert.hpp"

#include "core/error.hpp"

#if defined(LAGA_HAVE_AVX512BF16_TARGET)
// GCC's AVX-512 headers trip -Wmaybe-uninitialized in their own inline code
// (bench/harness.cpp does the same).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace laga {

namespace {

void convert_portable(const float* x, bf16* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = to_bf16(x[i]);
}

#if defined(LAGA_HAVE_AVX512BF16_TARGET)
// AVX-512 and AVX512_BF16 for this function only (never a flag of the build,
// docs/build.md); called only where the CPU has both. The instruction rounds
// exactly as to_bf16 does (Intel SDM, VCVTNE2PS2BF16: DAZ on its input,
// RNE, NaN made quiet by setting fraction bit 6), so the tail can be the
// portable loop.
__attribute__((target("avx512f,avx512bf16"))) void convert_avx512_bf16(const float* x, bf16* y,
                                                                       std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + i + 16);
    // The first operand goes to the upper half of the result.
    const __m512bh r = _mm512_cvtne2ps_pbh(hi, lo);
    _mm512_storeu_si512(reinterpret_cast<void*>(y + i), reinterpret_cast<const __m512i&>(r));
  }
  convert_portable(x + i, y + i, n - i);
}
#endif

const char* why_no_avx512_bf16() {
#if defined(LAGA_HAVE_AVX512BF16_TARGET)
  __builtin_cpu_init();
  // __builtin_cpu_supports reports AVX-512 only when the OS saves the zmm
  // registers (XCR0).
  if (!__builtin_cpu_supports("avx512f")) return "this CPU (or its OS) has no avx512f";
  if (!__builtin_cpu_supports("avx512bf16")) return "this CPU has no avx512bf16";
  return nullptr;
#else
  return "this build has no AVX512_BF16 conversion (the compiler did not take its target "
         "attribute)";
#endif
}

}  // namespace

const char* to_string(Bf16ConvertIsa isa) {
  return isa == Bf16ConvertIsa::avx512_bf16 ? "avx512_bf16" : "portable";
}

bool bf16_convert_isa_available(Bf16ConvertIsa isa) {
  static const char* const why_not = why_no_avx512_bf16();
  return isa == Bf16ConvertIsa::portable || why_not == nullptr;
}

Bf16ConvertIsa bf16_convert_isa() {
  static const Bf16ConvertIsa best = bf16_convert_isa_available(Bf16ConvertIsa::avx512_bf16)
                                         ? Bf16ConvertIsa::avx512_bf16
                                         : Bf16ConvertIsa::portable;
  return best;
}

void convert_to_bf16(const float* x, bf16* y, std::int64_t n) {
  convert_to_bf16(x, y, n, bf16_convert_isa());
}

void convert_to_bf16(const float* x, bf16* y, std::int64_t n, Bf16ConvertIsa isa) {
  LAGA_CHECK(n >= 0, "convert_to_bf16: negative count ", n, "; this is a bug in the caller");
  if (isa == Bf16ConvertIsa::avx512_bf16) {
    LAGA_CHECK(bf16_convert_isa_available(isa),
               "convert_to_bf16: the avx512_bf16 path cannot run "
               "here: ",
               why_no_avx512_bf16(), "; use Bf16ConvertIsa::portable");
#if defined(LAGA_HAVE_AVX512BF16_TARGET)
    convert_avx512_bf16(x, y, n);
    return;
#endif
  }
  convert_portable(x, y, n);
}

void convert_to_float(const bf16* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = to_float(x[i]);
}

Tensor<bf16> to_bf16(const Tensor<float>& x, MemCategory cat) {
  if (!x.defined()) return Tensor<bf16>();
  Tensor<bf16> y(x.shape(), cat);
  if (x.data() && y.data()) convert_to_bf16(x.data(), y.data(), x.numel());
  return y;
}

Tensor<float> to_float(const Tensor<bf16>& x, MemCategory cat) {
  if (!x.defined()) return Tensor<float>();
  Tensor<float> y(x.shape(), cat);
  if (x.data() && y.data()) convert_to_float(x.data(), y.data(), x.numel());
  return y;
}

}  // namespace laga
