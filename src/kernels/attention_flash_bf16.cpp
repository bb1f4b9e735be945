// The public bf16 flash attention API (kernels/attention_flash_bf16.hpp): the
// choice of instruction set, the fp32 fallback, and the dispatch to the
// AVX512_BF16 kernels (attention_flash_bf16_avx512.cpp).
#include "kernels/attention_flash_bf16.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.hpp"
#include "kernels/attention_flash.hpp"
#include "kernels/bf16_convert.hpp"

#if defined(LAGA_FLASH_HAVE_AVX512BF16)
namespace laga::flash_bf16 {
// workspace: workspace_bytes(s, pass) bytes, 64-byte aligned; null: the
// call allocates its buffers.
void forward(const AttnShape& s, float* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
             unsigned char* workspace);
// bound: the most of any shape no larger than s (every schedule).
std::int64_t workspace_bytes(const AttnShape& s, bool backward, bool bound = false);
std::int64_t allocated_peak();
void reset_allocated_peak();
void backward(const AttnShape& s, float* dq, float* dk, float* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const float* o, const float* lse,
              unsigned char* workspace);
}  // namespace laga::flash_bf16
#endif

namespace laga {

namespace {

// That copy is compiled for AVX-512 F, VL, BW, DQ (the fp32 kernels' helpers
// it shares, attention_flash_simd.hpp) and AVX512_BF16, so all five are
// required. __builtin_cpu_supports reports AVX-512 only when the OS also
// saves the zmm registers (XCR0).
const char* why_no_avx512_bf16() {
#if defined(LAGA_FLASH_HAVE_AVX512BF16)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) return "this CPU (or its OS) has no avx512f";
  if (!__builtin_cpu_supports("avx512vl")) return "this CPU (or its OS) has no avx512vl";
  if (!__builtin_cpu_supports("avx512bw")) return "this CPU (or its OS) has no avx512bw";
  if (!__builtin_cpu_supports("avx512dq")) return "this CPU (or its OS) has no avx512dq";
  if (!__builtin_cpu_supports("avx512bf16")) return "this CPU has no avx512bf16";
  return nullptr;
#else
  return "this build has no AVX512_BF16 flash kernels (the compiler did not take their target "
         "pragma)";
#endif
}

const char* why_not_here() {
  static const char* const why = why_no_avx512_bf16();
  return why;
}

FlashBf16Isa environment_choice() {
  static const FlashBf16Isa isa = detail::resolve_flash_bf16_isa(
      std::getenv("LAGA_FLASH_BF16_ISA"), why_not_here(), flash_bf16_dot_products_pay());
  return isa;
}

constexpr int kNotSet = -1;
std::atomic<int> g_set_isa{kNotSet};

constexpr const char* kNeeds =
    "the AVX512_BF16 flash kernels need avx512f, avx512vl, avx512bw, avx512dq and avx512bf16";

// Where the fp32 path keeps its widened copies: the caller's workspace,
// front to back (the copies are what attention_flash_bf16_workspace_bytes
// counts on that path), or vectors of its own.
class Widened {
 public:
  explicit Widened(const FlashWorkspace& ws) : at_(static_cast<float*>(ws.data)) {}
  const float* operator()(const bf16* x, std::int64_t n) {
    float* y = at_;
    if (y) {
      at_ += n;
    } else {
      own_.emplace_back(static_cast<size_t>(n));
      y = own_.back().data();
    }
    convert_to_float(x, y, n);
    return y;
  }

 private:
  float* at_;
  std::vector<std::vector<float>> own_;
};

// A workspace given is one of the size the call needs, 64-byte aligned.
void check_workspace(const FlashWorkspace& ws, const AttnShape& s, bool backward) {
  if (!ws.data) return;
  const std::int64_t need = attention_flash_bf16_workspace_bytes(s, backward);
  LAGA_CHECK(ws.bytes >= need, "bf16 flash attention (", backward ? "backward" : "forward",
             "): a workspace of ", ws.bytes, " bytes, but the call needs ", need,
             " (attention_flash_bf16_workspace_bytes at this thread's OpenMP thread count)");
  LAGA_CHECK(reinterpret_cast<std::uintptr_t>(ws.data) % 64 == 0,
             "bf16 flash attention: the workspace must be 64-byte aligned");
}

thread_local std::int64_t t_workspace_high_water = 0;

void note_workspace(const AttnShape& s, bool backward) {
  t_workspace_high_water =
      std::max(t_workspace_high_water, attention_flash_bf16_workspace_bytes(s, backward));
}

}  // namespace

std::int64_t attention_flash_bf16_workspace_bytes(const AttnShape& s, bool backward) {
#if defined(LAGA_FLASH_HAVE_AVX512BF16)
  if (flash_bf16_isa() == FlashBf16Isa::avx512_bf16)
    return flash_bf16::workspace_bytes(s, backward);
#endif
  s.validate();
  // widened(): q, k, v, and dout in backward.
  const std::int64_t q = s.B * s.Sq * s.Hq * s.dqk, k = s.B * s.Sk * s.Hk * s.dqk,
                     v = s.B * s.Sk * s.Hk * s.dv, dout = s.B * s.Sq * s.Hq * s.dv;
  return std::int64_t(sizeof(float)) * (q + k + v + (backward ? dout : 0));
}

std::int64_t attention_flash_bf16_workspace_bound(const AttnShape& s, bool backward) {
#if defined(LAGA_FLASH_HAVE_AVX512BF16)
  if (flash_bf16_isa() == FlashBf16Isa::avx512_bf16)
    return flash_bf16::workspace_bytes(s, backward, true);
#endif
  return attention_flash_bf16_workspace_bytes(s, backward);  // the widened copies: monotone
}

std::int64_t attention_flash_bf16_workspace_high_water() {
  return t_workspace_high_water;
}

void reset_attention_flash_bf16_workspace_high_water() {
  t_workspace_high_water = 0;
}

std::int64_t detail::flash_bf16_allocated_peak() {
#if defined(LAGA_FLASH_HAVE_AVX512BF16)
  return flash_bf16::allocated_peak();
#else
  return -1;
#endif
}

void detail::reset_flash_bf16_allocated_peak() {
#if defined(LAGA_FLASH_HAVE_AVX512BF16)
  flash_bf16::reset_allocated_peak();
#endif
}

const char* to_string(FlashBf16Isa isa) {
  return isa == FlashBf16Isa::avx512_bf16 ? "avx512_bf16" : "fp32";
}

std::vector<FlashBf16Isa> flash_bf16_isas_available() {
  std::vector<FlashBf16Isa> isas{FlashBf16Isa::fp32};
  if (!why_not_here()) isas.push_back(FlashBf16Isa::avx512_bf16);
  return isas;
}

const char* flash_bf16_why_no_avx512_bf16() {
  return why_not_here();
}

bool flash_bf16_dot_products_pay() {
  __builtin_cpu_init();
  return !__builtin_cpu_is("intel");
}

FlashBf16Isa detail::resolve_flash_bf16_isa(const char* setting, const char* unusable, bool pays) {
  const std::string value = setting ? setting : "";
  if (value.empty() || value == "auto")
    return unusable || !pays ? FlashBf16Isa::fp32 : FlashBf16Isa::avx512_bf16;
  if (value == "fp32") return FlashBf16Isa::fp32;
  if (value == "avx512_bf16") {
    LAGA_CHECK(!unusable, "LAGA_FLASH_BF16_ISA=avx512_bf16, but ", unusable, " (", kNeeds,
               "); unset LAGA_FLASH_BF16_ISA or set it to fp32 or auto");
    return FlashBf16Isa::avx512_bf16;
  }
  fail("LAGA_FLASH_BF16_ISA='", value,
       "' is not an instruction set of the bf16 flash kernels; use fp32, avx512_bf16 or auto");
}

FlashBf16Isa flash_bf16_isa() {
  const int set = g_set_isa.load(std::memory_order_relaxed);
  return set == kNotSet ? environment_choice() : static_cast<FlashBf16Isa>(set);
}

FlashBf16Isa set_flash_bf16_isa(FlashBf16Isa isa) {
  const char* why = isa == FlashBf16Isa::avx512_bf16 ? why_not_here() : nullptr;
  LAGA_CHECK(!why, "set_flash_bf16_isa(avx512_bf16): ", why, " (", kNeeds,
             "); flash_bf16_isas_available() lists what runs here");
  const FlashBf16Isa previous = flash_bf16_isa();
  g_set_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
  return previous;
}

void attention_flash_forward_bf16(const AttnShape& s, float* o, float* lse, const bf16* q,
                                  const bf16* k, const bf16* v, const FlashWorkspace& workspace) {
  const FlashBf16Isa isa = flash_bf16_isa();
  s.validate();
  check_workspace(workspace, s, false);
  note_workspace(s, false);
#if defined(LAGA_FLASH_HAVE_AVX512BF16)
  if (isa == FlashBf16Isa::avx512_bf16)
    return flash_bf16::forward(s, o, lse, q, k, v, static_cast<unsigned char*>(workspace.data));
#endif
  (void)isa;
  Widened widened(workspace);
  const float* qf = widened(q, s.B * s.Sq * s.Hq * s.dqk);
  const float* kf = widened(k, s.B * s.Sk * s.Hk * s.dqk);
  const float* vf = widened(v, s.B * s.Sk * s.Hk * s.dv);
  attention_flash_forward<float>(s, o, lse, qf, kf, vf);
}

void attention_flash_backward_bf16(const AttnShape& s, float* dq, float* dk, float* dv,
                                   const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                                   const float* o, const float* lse,
                                   const FlashWorkspace& workspace) {
  const FlashBf16Isa isa = flash_bf16_isa();
  s.validate();
  check_workspace(workspace, s, true);
  note_workspace(s, true);
#if defined(LAGA_FLASH_HAVE_AVX512BF16)
  if (isa == FlashBf16Isa::avx512_bf16)
    return flash_bf16::backward(s, dq, dk, dv, dout, q, k, v, o, lse,
                                static_cast<unsigned char*>(workspace.data));
#endif
  (void)isa;
  Widened widened(workspace);
  const float* qf = widened(q, s.B * s.Sq * s.Hq * s.dqk);
  const float* kf = widened(k, s.B * s.Sk * s.Hk * s.dqk);
  const float* vf = widened(v, s.B * s.Sk * s.Hk * s.dv);
  const float* df = widened(dout, s.B * s.Sq * s.Hq * s.dv);
  attention_flash_backward<float>(s, dq, dk, dv, df, qf, kf, vf, o, lse);
}

}  // namespace laga
