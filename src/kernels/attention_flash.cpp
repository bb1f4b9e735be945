// The public flash attention API (kernels/attention_flash.hpp): the choice of
// instruction set, and the dispatch of every call to that copy of the kernels
// (attention_flash_isa.hpp).
#include "kernels/attention_flash.hpp"

#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "core/error.hpp"
#include "kernels/attention_flash_isa.hpp"

namespace laga {

namespace {

// Why the AVX-512 kernels cannot run here, or null when they can. That copy is
// compiled for AVX-512 F, VL, BW and DQ, and GCC may use any of the four
// anywhere in it (EVEX encodings, mask registers), so all four are required,
// not only the F of the intrinsics. __builtin_cpu_supports
// reports AVX-512 only when the OS also saves the zmm registers (XCR0).
const char* why_no_avx512() {
#if defined(LAGA_FLASH_HAVE_AVX512)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) return "this CPU (or its OS) has no avx512f";
  if (!__builtin_cpu_supports("avx512vl")) return "this CPU (or its OS) has no avx512vl";
  if (!__builtin_cpu_supports("avx512bw")) return "this CPU (or its OS) has no avx512bw";
  if (!__builtin_cpu_supports("avx512dq")) return "this CPU (or its OS) has no avx512dq";
  return nullptr;
#else
  return "this build has no AVX-512 flash kernels (the compiler did not take its AVX-512 target "
         "pragma)";
#endif
}

const char* why_no_avx512_here() {
  static const char* const why = why_no_avx512();
  return why;
}

// The environment's choice, resolved once; a bad value throws at every call
// (a static whose initialiser throws is initialised again next time).
FlashIsa environment_choice() {
  static const FlashIsa isa =
      detail::resolve_flash_isa(std::getenv("LAGA_FLASH_ISA"), why_no_avx512_here());
  return isa;
}

constexpr int kNotSet = -1;
std::atomic<int> g_set_isa{kNotSet};  // set_flash_isa()'s choice

constexpr const char* kAvx512Needs =
    "the AVX-512 flash kernels need avx512f, avx512vl, avx512bw and avx512dq";

}  // namespace

const char* to_string(FlashIsa isa) {
  return isa == FlashIsa::avx512 ? "avx512" : "avx2";
}

std::vector<FlashIsa> flash_isas_available() {
  std::vector<FlashIsa> isas{FlashIsa::avx2};
  if (!why_no_avx512_here()) isas.push_back(FlashIsa::avx512);
  return isas;
}

FlashIsa detail::resolve_flash_isa(const char* setting, const char* avx512_unusable) {
  const std::string value = setting ? setting : "";
  if (value.empty() || value == "auto") return avx512_unusable ? FlashIsa::avx2 : FlashIsa::avx512;
  if (value == "avx2") return FlashIsa::avx2;
  if (value == "avx512") {
    LAGA_CHECK(!avx512_unusable, "LAGA_FLASH_ISA=avx512, but ", avx512_unusable, " (", kAvx512Needs,
               "); unset LAGA_FLASH_ISA or set it to avx2 or auto");
    return FlashIsa::avx512;
  }
  fail("LAGA_FLASH_ISA='", value,
       "' is not an instruction set of the flash kernels; use avx2, avx512 or auto");
}

FlashIsa flash_isa() {
  const int set = g_set_isa.load(std::memory_order_relaxed);
  return set == kNotSet ? environment_choice() : static_cast<FlashIsa>(set);
}

FlashIsa set_flash_isa(FlashIsa isa) {
  const char* why = isa == FlashIsa::avx512 ? why_no_avx512_here() : nullptr;
  LAGA_CHECK(!why, "set_flash_isa(avx512): ", why, " (", kAvx512Needs,
             "); flash_isas_available() lists what runs here");
  const FlashIsa previous = flash_isa();
  g_set_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
  return previous;
}

// flash_isa() is asked for double too, which always runs the one scalar copy,
// so that a mistyped LAGA_FLASH_ISA fails whichever kernel runs first.
template <class T>
void attention_flash_forward(const AttnShape& s, T* o, T* lse, const T* q, const T* k, const T* v) {
  [[maybe_unused]] const FlashIsa isa = flash_isa();
#if defined(LAGA_FLASH_HAVE_AVX512)
  if constexpr (std::is_same_v<T, float>)
    if (isa == FlashIsa::avx512) return flash_avx512::forward(s, o, lse, q, k, v);
#endif
  flash_avx2::forward(s, o, lse, q, k, v);
}

template <class T>
void attention_flash_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q,
                              const T* k, const T* v, const T* o, const T* lse) {
  [[maybe_unused]] const FlashIsa isa = flash_isa();
#if defined(LAGA_FLASH_HAVE_AVX512)
  if constexpr (std::is_same_v<T, float>)
    if (isa == FlashIsa::avx512)
      return flash_avx512::backward(s, dq, dk, dv, dout, q, k, v, o, lse);
#endif
  flash_avx2::backward(s, dq, dk, dv, dout, q, k, v, o, lse);
}

#define LAGA_INSTANTIATE(T)                                                                   \
  template void attention_flash_forward<T>(const AttnShape&, T*, T*, const T*, const T*,      \
                                           const T*);                                         \
  template void attention_flash_backward<T>(const AttnShape&, T*, T*, T*, const T*, const T*, \
                                            const T*, const T*, const T*, const T*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
