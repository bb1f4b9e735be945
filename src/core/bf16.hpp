// bf16 — bfloat16 as a storage type: the top 16 bits of an IEEE fp32 (sign,
// 8 exponent bits, 7 fraction bits). laga does no arithmetic on it: values
// are converted to fp32 to compute (the bf16 GEMMs accumulate in fp32,
// kernels/gemm_bf16.hpp) and back to store.
//
// Rounding fp32 -> bf16 (to_bf16 here, and the vectorised
// kernels/bf16_convert.hpp, which gives the same bits on every path):
//   - finite normal values: round to nearest, ties to even (on the bits: add
//     0x7FFF plus the lowest kept bit, truncate); a value past bf16's largest
//     finite one rounds to inf, as IEEE rounding does;
//   - inf: kept, with its sign;
//   - NaN: stays NaN, sign and the top 7 fraction bits kept, made quiet
//     (fraction bit 6 set), so a signalling NaN whose payload sits only in
//     the dropped bits cannot become inf;
//   - fp32 denormals (|x| < 2^-126): flushed to zero with their sign. That
//     is what AVX512_BF16's VCVTNE2PS2BF16 does, unconditionally, and the
//     portable path must give the same bits; the dot-product instruction the
//     GEMMs run on (VDPBF16PS) treats bf16 denormal inputs as zero anyway, and
//     since bf16 and fp32 share their exponent range, no normal fp32 rounds
//     to a bf16 denormal, so a converted tensor never holds one.
// bf16 -> fp32 is exact (the 16 bits shifted up).
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

namespace laga {

// Trivial, like float (no initialiser: a Tensor's storage starts uninitialised
// and is cleared with memset); bf16{} is +0.
struct bf16 {
  std::uint16_t bits;
  friend constexpr bool operator==(bf16, bf16) = default;  // on the bits: -0 != +0, NaN == NaN
};
static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2 && std::is_trivial_v<bf16>,
              "bf16 must be two packed bytes, trivially copied and cleared");

// fp32 -> bf16 by the rules above, one value; the reference the vectorised
// conversions are tested against.
constexpr bf16 to_bf16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t exponent = u & 0x7F800000u, fraction = u & 0x007FFFFFu;
  if (exponent == 0) return {static_cast<std::uint16_t>((u >> 16) & 0x8000u)};  // 0, denormal
  if (exponent == 0x7F800000u) {
    if (fraction == 0) return {static_cast<std::uint16_t>(u >> 16)};  // inf
    return {static_cast<std::uint16_t>((u >> 16) | 0x0040u)};         // NaN, made quiet
  }
  const std::uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);  // ties to even
  return {static_cast<std::uint16_t>(rounded >> 16)};
}

constexpr float to_float(bf16 x) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(x.bits) << 16);
}

}  // namespace laga
