// Vector primitives and the register-blocked tile product behind the flash
// attention kernels (attention_flash_impl.inc). Private to the kernels layer.
//
// One code path serves three widths: AVX-512 (16 floats) in the copy of the
// kernels that defines LAGA_FLASH_AVX512 (attention_flash_avx512.cpp), else
// AVX2+FMA (8 floats), else a scalar fallback that also carries double (the
// gradient-check type, where speed does not matter). Everything above this
// header is written against Simd<T>.
//
// Compiled once per instruction set, so two traps:
//  - Everything here is inline or a template. Under one name, the two copies
//    would be one function to the linker, which keeps either: the AVX2 path
//    could run 512-bit code and fault on a CPU without AVX-512. So the
//    includer names a namespace of its own, LAGA_FLASH_NS, per instruction set.
//  - The library headers' inline functions (std::vector's, say) cannot be
//    renamed, and a copy compiled for AVX-512 may be the one the linker keeps
//    for every other file. So AVX-512 is not a flag of the whole file: the
//    AVX-512 copy turns it on for its own code only, after the includes
//    (LAGA_FLASH_TARGET_BEGIN/END). -mavx512f on the build also exposes GCC
//    12's 512-bit miscompile (docs/build.md); prefer-vector-width=256 keeps
//    the auto-vectoriser at 256 bits here too, while the intrinsics of
//    Avx512Simd are 512-bit.
#pragma once

#ifndef LAGA_FLASH_NS
#error "define LAGA_FLASH_NS (one namespace per instruction set) before including this header"
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(LAGA_FLASH_AVX512)
// GCC 12 reports its own _mm512_undefined_*() placeholders inside the
// AVX-512 intrinsics as maybe-uninitialized once they are inlined (GCC PR
// 105593); the location is inside the header, so silencing it around the
// include is enough and hides nothing of ours.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

// Put around code, after every #include: in the AVX-512 copy, that code (and
// only it) is compiled for AVX-512; elsewhere they are nothing. GCC's target
// pragma does not define __AVX512F__, hence LAGA_FLASH_AVX512 in the #if's.
#if defined(LAGA_FLASH_AVX512)
#define LAGA_FLASH_TARGET_BEGIN \
  _Pragma("GCC push_options")   \
      _Pragma("GCC target(\"avx512f,avx512vl,avx512bw,avx512dq,prefer-vector-width=256\")")
#define LAGA_FLASH_TARGET_END _Pragma("GCC pop_options")
#else
#define LAGA_FLASH_TARGET_BEGIN
#define LAGA_FLASH_TARGET_END
#endif

LAGA_FLASH_TARGET_BEGIN

namespace laga::LAGA_FLASH_NS {

// Scalar "vectors" of width 1: the double path and non-x86 builds.
template <class T>
struct ScalarSimd {
  using V = T;
  static constexpr int W = 1;
  // Register block of tile_gemm: MR rows by NV vectors of C.
  static constexpr int MR = 4, NV = 4;
  static constexpr const char* name = "scalar";

  static V zero() { return T(0); }
  static V set1(T x) { return x; }
  static V load(const T* p) { return *p; }
  static void store(T* p, V v) { *p = v; }
  static V load_n(const T* p, int n) { return n > 0 ? *p : T(0); }
  static void store_n(T* p, V v, int n) {
    if (n > 0) *p = v;
  }
  static V fmadd(V a, V b, V c) { return std::fma(a, b, c); }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static T hsum(V a) { return a; }
  static T hmax(V a) { return a; }
  // 2^x; -inf (a masked score) gives exactly 0.
  static V exp2(V x) { return std::exp2(x); }
  // x where x != -inf, else 0: the row max used as the softmax shift.
  static V finite_or_zero(V x) { return x == -std::numeric_limits<T>::infinity() ? T(0) : x; }
};

// 2^f on f in [-1/2, 1/2] as e^(f ln 2) by its Taylor series to degree 7:
// coefficient k is ln(2)^k / k!. The first term left out is below 6e-9
// relative, under float rounding.
inline constexpr double kExp2Coef[8] = {1.0,
                                        0.6931471805599453,
                                        0.2402265069591007,
                                        0.05550410866482158,
                                        0.009618129107628477,
                                        0.0013333558146428443,
                                        0.00015403530393381608,
                                        1.525273380405984e-05};

#if defined(__AVX2__) && defined(__FMA__)
struct Avx2Simd {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int MR = 6, NV = 2;  // 12 accumulators + 2 B vectors + 1 broadcast of 16 ymm
  static constexpr const char* name = "avx2";

  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  // Lanes [0, n) valid; the rest are neither read nor written (they may lie
  // past the end of the buffer).
  static __m256i lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V load_n(const float* p, int n) {
    return n >= W ? load(p) : (n <= 0 ? zero() : _mm256_maskload_ps(p, lanes(n)));
  }
  static void store_n(float* p, V v, int n) {
    if (n >= W)
      store(p, v);
    else if (n > 0)
      _mm256_maskstore_ps(p, lanes(n), v);
  }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float hsum(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(V a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // 2^x = 2^n * 2^f with n = round(x). x is clamped to [-127, 127]: at n = -127
  // the exponent field is 0, so 2^n is +0 and -inf (and anything below about
  // -126.5, i.e. p < 1e-38) comes out as exactly 0 instead of NaN or a
  // denormal. min_ps and max_ps return their second operand when either is
  // NaN, so x goes second: a NaN stays NaN through the clamp and the
  // polynomial (2^NaN = NaN, as std::exp2), never a clamped 2^-127 = 0.
  static V exp2(V x) {
    x = _mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), x));
    const V n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V f = _mm256_sub_ps(x, n);
    V p = _mm256_set1_ps(static_cast<float>(kExp2Coef[7]));
    for (int k = 6; k >= 0; --k)
      p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(static_cast<float>(kExp2Coef[k])));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static V finite_or_zero(V x) {
    const V ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    return _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), x);
  }
};
#endif

#if defined(LAGA_FLASH_AVX512)
struct Avx512Simd {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int MR = 6, NV = 4;  // 24 accumulators + 4 B vectors + 1 broadcast of 32 zmm
  static constexpr const char* name = "avx512";

  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __mmask16 lanes(int n) {
    return n >= W ? __mmask16(0xFFFF) : (n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u));
  }
  static V load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
  static void store_n(float* p, V v, int n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float hsum(V a) { return _mm512_reduce_add_ps(a); }
  static float hmax(V a) { return _mm512_reduce_max_ps(a); }
  // As Avx2Simd::exp2.
  static V exp2(V x) {
    x = _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), x));
    const V n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V f = _mm512_sub_ps(x, n);
    V p = _mm512_set1_ps(static_cast<float>(kExp2Coef[7]));
    for (int k = 6; k >= 0; --k)
      p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(static_cast<float>(kExp2Coef[k])));
    const __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  }
  static V finite_or_zero(V x) {
    const V ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_UQ), x);
  }
};
#endif

template <class T>
struct SimdFor {
  using type = ScalarSimd<T>;
};
#if defined(LAGA_FLASH_AVX512)
template <>
struct SimdFor<float> {
  using type = Avx512Simd;
};
#elif defined(__AVX2__) && defined(__FMA__)
template <>
struct SimdFor<float> {
  using type = Avx2Simd;
};
#endif
template <class T>
using Simd = typename SimdFor<T>::type;

// How tile_gemm reads A (M, K): which of its two strides is 1. A compile-time
// choice, so that the micro-kernel's broadcasts are one pointer plus constant
// offsets (rows_adjacent) or M pointers that step by one (cols_adjacent); with
// both strides at run time GCC ran out of general registers and spilled.
enum class ALayout {
  rows_adjacent,  // element (m, k) at a[m + k * as]: A stored transposed (K, as)
  cols_adjacent,  // element (m, k) at a[m * as + k]: A row-major, rows as apart
};

// C (M, N) = [C +] A (M, K) B (K, N) on a register block of M rows by NV
// vectors: the one place where the FLOPs of the kernels are spent.
// A is read as ALayout AL says, with stride `as`; B row k is b + k * ldb,
// contiguous along N; C row m is c + m * ldc.
// n: valid columns of this panel (TAIL: fewer than NV * W, loads and stores are
// masked so nothing past column n is touched). ACC (C += rather than C =) is a
// template argument so that the accumulators go straight from C, or zero,
// into registers; as a run-time flag GCC merged both through the stack.
template <class T, int M, bool TAIL, bool ACC, ALayout AL>
void micro_kernel(std::int64_t K, const T* a, std::int64_t as, const T* b, std::int64_t ldb, T* c,
                  std::int64_t ldc, int n) {
  using S = Simd<T>;
  using V = typename S::V;
  constexpr int NV = S::NV, W = S::W;
  int cnt[NV];
  for (int v = 0; v < NV; ++v) cnt[v] = TAIL ? std::clamp(n - v * W, 0, W) : W;
  V acc[M][NV];
  const T* cm = c;
  for (int m = 0; m < M; ++m, cm += ldc)
    for (int v = 0; v < NV; ++v)
      acc[m][v] = !ACC ? S::zero() : TAIL ? S::load_n(cm + v * W, cnt[v]) : S::load(cm + v * W);
  // cols_adjacent: row m of A starts at a + m * as and walks by 1.
  const T* arow[M];
  for (int m = 0; m < M; ++m) arow[m] = a + m * as;
  for (std::int64_t k = 0; k < K; ++k, b += ldb) {
    V bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = TAIL ? S::load_n(b + v * W, cnt[v]) : S::load(b + v * W);
    for (int m = 0; m < M; ++m) {
      const V am = S::set1(AL == ALayout::rows_adjacent ? a[k * as + m] : arow[m][k]);
      for (int v = 0; v < NV; ++v) acc[m][v] = S::fmadd(am, bv[v], acc[m][v]);
    }
  }
  // Without this, GCC keeps the M * NV addresses of C computed for the loads
  // alive across the loop for the stores, out of general registers, and
  // spills them (and the accumulators with them) to the stack. The empty asm
  // makes c opaque here, so the stores recompute the addresses.
  asm("" : "+r"(c));
  for (int m = 0; m < M; ++m, c += ldc)
    for (int v = 0; v < NV; ++v) {
      if (TAIL)
        S::store_n(c + v * W, acc[m][v], cnt[v]);
      else
        S::store(c + v * W, acc[m][v]);
    }
}

template <class T, bool TAIL, bool ACC, ALayout AL, std::size_t... I>
constexpr auto micro_kernel_table(std::index_sequence<I...>) {
  using Fn =
      void (*)(std::int64_t, const T*, std::int64_t, const T*, std::int64_t, T*, std::int64_t, int);
  return std::array<Fn, sizeof...(I)>{&micro_kernel<T, int(I) + 1, TAIL, ACC, AL>...};
}

// The whole tile, blocked as a BLAS would: K in chunks of KC, so that one
// panel of B (KC by NV * W, at most 24 KiB) stays in L1 while every block of
// MR rows of A streams past it; then panels along N; then row blocks. B rows
// should be contiguous or nearly (a packed tile): rows a multiple of 4 KiB
// apart all fall into the same L1 sets, and the panel then no longer stays.
template <class T, ALayout AL>
void tile_gemm(std::int64_t M, std::int64_t N, std::int64_t K, const T* a, std::int64_t as,
               const T* b, std::int64_t ldb, T* c, std::int64_t ldc, bool accumulate) {
  using S = Simd<T>;
  constexpr int MR = S::MR, NB = S::NV * S::W;
  constexpr std::int64_t KC = std::max<std::int64_t>(16, 24576 / (NB * std::int64_t(sizeof(T))));
  constexpr auto rows = std::make_index_sequence<MR>{};
  static constexpr auto full0 = micro_kernel_table<T, false, false, AL>(rows);
  static constexpr auto tail0 = micro_kernel_table<T, true, false, AL>(rows);
  static constexpr auto full1 = micro_kernel_table<T, false, true, AL>(rows);
  static constexpr auto tail1 = micro_kernel_table<T, true, true, AL>(rows);
  // Offsets of A element (m, k).
  const std::int64_t ars = AL == ALayout::rows_adjacent ? 1 : as;
  const std::int64_t acs = AL == ALayout::rows_adjacent ? as : 1;
  if (K == 0 && !accumulate) {  // an empty sum: C = 0
    for (std::int64_t m = 0; m < M; ++m) std::fill(c + m * ldc, c + m * ldc + N, T(0));
    return;
  }
  for (std::int64_t k0 = 0; k0 < K; k0 += KC) {
    const std::int64_t kc = std::min(KC, K - k0);
    for (std::int64_t n0 = 0; n0 < N; n0 += NB) {
      const int n = static_cast<int>(std::min<std::int64_t>(NB, N - n0));
      const bool acc = accumulate || k0 > 0;
      const auto& table = n == NB ? (acc ? full1 : full0) : (acc ? tail1 : tail0);
      for (std::int64_t m0 = 0; m0 < M; m0 += MR) {
        const int m = static_cast<int>(std::min<std::int64_t>(MR, M - m0));
        table[static_cast<std::size_t>(m - 1)](kc, a + m0 * ars + k0 * acs, as, b + k0 * ldb + n0,
                                               ldb, c + m0 * ldc + n0, ldc, n);
      }
    }
  }
}

}  // namespace laga::LAGA_FLASH_NS

LAGA_FLASH_TARGET_END
