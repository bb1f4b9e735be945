#include "kernels/fp8_e4m3.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#include "core/error.hpp"

namespace laga {

const char* to_string(Fp8ScaleFmt f) {
  return f == Fp8ScaleFmt::ue8m0 ? "ue8m0" : "fp32";
}

float fp8_e4m3_round(float v) {
  if (std::isnan(v)) return v;
  const float a = std::fabs(v);
  if (a >= kFp8E4m3Max) return std::copysign(kFp8E4m3Max, v);
  // The spacing of e4m3 values around a: 2^(e - 3) for a in [2^e, 2^(e+1)),
  // e >= -6; 2^-9 below 2^-6 (subnormals). a / spacing is exact (a power of
  // two), and nearbyint rounds it half to even in the default rounding mode;
  // a rounded up to 2^(e+1) is still exact (the next binade's first value).
  int e = 0;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): a in [2^(e-1), 2^e)
  const int step_exp = std::max(e - 1, -6) - 3;
  const float r = std::ldexp(std::nearbyint(std::ldexp(a, -step_exp)), step_exp);
  return std::copysign(std::min(r, kFp8E4m3Max), v);
}

std::uint8_t fp8_e4m3_encode(float v) {
  if (std::isnan(v)) return 0x7f;
  const float r = fp8_e4m3_round(v);
  const std::uint8_t sign = std::signbit(r) ? 0x80 : 0;
  const float a = std::fabs(r);
  if (a == 0) return sign;
  int e = 0;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  const int ub = e - 1;
  if (ub < -6) return std::uint8_t(sign | std::uint8_t(std::ldexp(a, 9)));  // subnormal
  const int mant = int(std::ldexp(a, 3 - ub)) - 8;
  return std::uint8_t(sign | std::uint8_t((ub + 7) << 3) | std::uint8_t(mant));
}

float fp8_e4m3_decode(std::uint8_t code) {
  const int exp = (code >> 3) & 0xf, mant = code & 7;
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  if (exp == 15 && mant == 7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(float(mant), -9);
  return sign * std::ldexp(float(8 + mant), exp - 7 - 3);
}

float fp8_block_scale(float amax, Fp8ScaleFmt fmt) {
  const float s = amax * (1.0f / kFp8E4m3Max);
  if (fmt == Fp8ScaleFmt::fp32) return s;
  // DeepSeek's fast_log2_ceil on the float's bits: the unbiased exponent,
  // plus one when any mantissa bit is set; then 2 to that power.
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(s);
  const int exp = int((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0 ? 1 : 0);
  return std::ldexp(1.0f, exp);
}

void act_quant(const float* x, std::int64_t rows, std::int64_t n, std::int64_t block,
               Fp8ScaleFmt fmt, float* y, float* scales) {
  LAGA_CHECK(block > 0 && n > 0 && n % block == 0, "act_quant: the row width ", n,
             " must be a positive multiple of the block size ", block,
             " (DeepSeek's act_quant asserts the same)");
  const std::int64_t nb = n / block;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * n + b * block;
      float amax = 0;
      for (std::int64_t e = 0; e < block; ++e) {
        LAGA_CHECK(std::isfinite(xb[e]), "act_quant: value ", xb[e], " at row ", r, ", column ",
                   b * block + e,
                   " is not finite; fp8 quantization needs finite activations (check the "
                   "indexer's inputs and weights)");
        amax = std::max(amax, std::fabs(xb[e]));
      }
      const float s = fp8_block_scale(std::max(amax, 1e-4f), fmt);
      scales[r * nb + b] = s;
      float* yb = y + r * n + b * block;
      for (std::int64_t e = 0; e < block; ++e)
        yb[e] = fp8_e4m3_round(std::clamp(xb[e] / s, -kFp8E4m3Max, kFp8E4m3Max));
    }
}

template <class T>
void fp8_round_trip(T* x, std::int64_t rows, std::int64_t n, std::int64_t block, Fp8ScaleFmt fmt) {
  LAGA_CHECK(block > 0 && n > 0 && n % block == 0, "fp8 round trip: the row width ", n,
             " must be a positive multiple of the block size ", block);
  std::vector<float> x32(x, x + rows * n), y(x32.size()),
      s(static_cast<std::size_t>(rows * (n / block)));
  act_quant(x32.data(), rows, n, block, fmt, y.data(), s.data());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t e = 0; e < n; ++e)
      x[r * n + e] = T(y[std::size_t(r * n + e)] * s[std::size_t(r * (n / block) + e / block)]);
}

template void fp8_round_trip<float>(float*, std::int64_t, std::int64_t, std::int64_t, Fp8ScaleFmt);
template void fp8_round_trip<double>(double*, std::int64_t, std::int64_t, std::int64_t,
                                     Fp8ScaleFmt);

}  // namespace laga
