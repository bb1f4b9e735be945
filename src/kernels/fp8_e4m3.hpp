// DeepSeek's fp8 block quantization of activations (DeepSeek-V3.2-Exp,
// inference/kernel.py, act_quant; docs/forms.md, "DeepSeek Sparse Attention
// (DSA)", "The fp8 indexer"), on the CPU, for the indexer's fp8 option.
//
// e4m3 here is float8_e4m3fn (OCP FP8 E4M3, torch.float8_e4m3fn): 1 sign,
// 4 exponent (bias 7) and 3 mantissa bits, no infinities, S.1111.111 NaN,
// largest finite 448, smallest normal 2^-6, subnormals k 2^-9.
//
// act_quant over blocks of `block` consecutive values of a row:
//   amax = max(max |x|, 1e-4)
//   s    = amax * (1/448)                      (fp32 multiply, as DeepSeek's)
//   s    = 2^ceil(log2 s)   when scale_fmt is ue8m0 (DeepSeek's
//          fast_round_scale: the exponent of s, plus one if any mantissa bit
//          is set; V3.2's config sets scale_fmt "ue8m0")
//   y    = e4m3(clamp(x / s, -448, 448))      (fp32 divide, then the cast)
// The cast rounds to nearest, ties to even (the CUDA/torch conversion); after
// the clamp it never saturates, but fp8_e4m3_round saturates anyway (a
// value beyond 448 becomes +-448, as __NV_SATFINITE). DeepSeek's code does
// not guard NaN or inf (what its clamp and cast make of them is the GPU's);
// laga refuses them: act_quant throws laga::Error naming the row and column.
#pragma once

#include <cstdint>

namespace laga {

enum class Fp8ScaleFmt {
  fp32,   // s = amax / 448 as computed (DeepSeek's scale_fmt None)
  ue8m0,  // s rounded up to a power of two (scale_fmt "ue8m0", V3.2's)
};
const char* to_string(Fp8ScaleFmt f);

inline constexpr float kFp8E4m3Max = 448.0f;
inline constexpr std::int64_t kActQuantBlock = 128;  // model.py block_size, act_quant blocks

// v rounded to the nearest e4m3 value, ties to even, |v| > 448 to +-448.
// v must not be NaN (the caller checks; a NaN returns NaN).
float fp8_e4m3_round(float v);
// The byte of v's e4m3 value (v rounded as above), and a byte's value (NaN
// for the two NaN codes).
std::uint8_t fp8_e4m3_encode(float v);
float fp8_e4m3_decode(std::uint8_t code);

// DeepSeek's rounding of a block's scale: s itself (fp32), or the smallest
// power of two >= s (ue8m0). s must be a positive normal float.
float fp8_block_scale(float amax, Fp8ScaleFmt fmt);

// x (rows, n) row-major, n a multiple of block: y (rows, n) the e4m3 values
// (held as floats, each exactly an e4m3 value), scales (rows, n / block).
// Throws laga::Error on a non-finite x or a bad extent.
void act_quant(const float* x, std::int64_t rows, std::int64_t n, std::int64_t block,
               Fp8ScaleFmt fmt, float* y, float* scales);

// DeepSeek's simulation of its fp8 kv cache (MLA.forward: act_quant of the
// latent, then values times scales, back to the activation dtype), in place
// over x (rows, n): x = y s, through fp32. Throws as act_quant.
template <class T>
void fp8_round_trip(T* x, std::int64_t rows, std::int64_t n, std::int64_t block, Fp8ScaleFmt fmt);

}  // namespace laga
