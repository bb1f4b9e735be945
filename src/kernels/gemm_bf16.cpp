#include "kernels/gemm_bf16.hpp"

#include <omp.h>

#include <array>
#include <atomic>
#include <bit>
#include <compare>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/error.hpp"
#include "kernels/attention_flash_bf16.hpp"
#include "kernels/bf16_convert.hpp"
#include "kernels/gemm.hpp"

namespace laga {

namespace {

using dnnl::memory;

// Everything a matmul primitive is made for. alpha and beta are baked into
// it (oneDNN 2.6's output scale and sum post-op), by their bits.
struct Key {
  bool ta = false, tb = false, bf16_out = false;
  std::int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
  std::uint32_t alpha = 0, beta = 0;
  int threads = 0;
  auto operator<=>(const Key&) const = default;
};

struct Primitive {
  dnnl::matmul matmul;
  memory::desc a, b, c;
  std::size_t scratchpad_bytes = 0;
  std::string implementation;
};

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// Row-major op(X) (rows, cols) of a matrix stored with row stride ld, or of
// its transpose: oneDNN takes the two strides, so a transpose costs nothing.
memory::desc operand(std::int64_t rows, std::int64_t cols, std::int64_t ld, bool transposed,
                     memory::data_type type) {
  return memory::desc({rows, cols}, type, transposed ? memory::dims{1, ld} : memory::dims{ld, 1});
}

std::shared_ptr<const Primitive> make_primitive(const Key& k) {
  auto p = std::make_shared<Primitive>();
  p->a = operand(k.M, k.K, k.lda, k.ta, memory::data_type::bf16);
  p->b = operand(k.K, k.N, k.ldb, k.tb, memory::data_type::bf16);
  p->c = operand(k.M, k.N, k.ldc, false,
                 k.bf16_out ? memory::data_type::bf16 : memory::data_type::f32);
  dnnl::primitive_attr attr;
  // The caller's thread owns the scratchpad (gemm_bf16 below), so that one
  // primitive can run on several ranks' threads at once whatever oneDNN's
  // build options say about sharing its own.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const float alpha = std::bit_cast<float>(k.alpha), beta = std::bit_cast<float>(k.beta);
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {  // beta 0 must not read C at all: no sum post-op
    dnnl::post_ops po;
    po.append_sum(beta);
    attr.set_post_ops(po);
  }
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p->a, p->b, p->c), attr, cpu_engine());
  p->scratchpad_bytes = pd.scratchpad_desc().get_size();
  p->implementation = pd.impl_info_str();
  p->matmul = dnnl::matmul(pd);
  return p;
}

std::mutex g_cache_mutex;
std::map<Key, std::shared_ptr<const Primitive>> g_cache;

// The cached primitive for k, made on a miss. Made outside the lock (tens of
// microseconds to milliseconds of JIT), so ranks do not queue behind one
// another's misses; two threads missing the same key at once both make it
// and the first one stored is kept.
std::shared_ptr<const Primitive> primitive_for(const Key& k) {
  {
    const std::lock_guard<std::mutex> lock(g_cache_mutex);
    const auto it = g_cache.find(k);
    if (it != g_cache.end()) return it->second;
  }
  std::shared_ptr<const Primitive> made;
  try {
    made = make_primitive(k);
  } catch (const dnnl::error& e) {
    fail("gemm_bf16: oneDNN could not make a bf16 matmul for M ", k.M, " N ", k.N, " K ", k.K,
         " (trans_a ", k.ta, " trans_b ", k.tb, ", lda ", k.lda, " ldb ", k.ldb, " ldc ", k.ldc,
         ", ", k.bf16_out ? "bf16" : "fp32", " out): ", e.what());
  }
  const std::lock_guard<std::mutex> lock(g_cache_mutex);
  return g_cache.emplace(k, std::move(made)).first->second;
}

// This thread's scratchpad, grown to the largest a primitive run on it has
// asked for and kept (one per rank thread, as oneDNN's own would be).
void* thread_scratchpad(std::size_t bytes) {
  struct Buffer {
    void* p = nullptr;
    std::size_t size = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer buffer;
  if (bytes > buffer.size) {
    std::free(buffer.p);
    buffer.size = 0;
    // Page-aligned: oneDNN aligns offsets within the scratchpad, not its base.
    buffer.p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    LAGA_CHECK(buffer.p, "gemm_bf16: out of memory allocating ", bytes,
               " bytes of oneDNN scratchpad; use a shorter sequence or more ranks");
    buffer.size = bytes;
  }
  return buffer.p;
}

template <class TC>
Key key_of(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
           std::int64_t lda, std::int64_t ldb, float beta, std::int64_t ldc) {
  // -0.0 and 0.0 are the same beta (neither reads C): one key.
  if (beta == 0.0f) beta = 0.0f;
  return {ta,
          tb,
          std::is_same_v<TC, bf16>,
          M,
          N,
          K,
          lda,
          ldb,
          ldc,
          std::bit_cast<std::uint32_t>(alpha),
          std::bit_cast<std::uint32_t>(beta),
          omp_get_max_threads()};
}

void check_strides(const char* who, bool ta, bool tb, std::int64_t M, std::int64_t N,
                   std::int64_t K, std::int64_t lda, std::int64_t ldb, std::int64_t ldc) {
  LAGA_CHECK(M >= 0 && N >= 0 && K >= 0, who, ": negative extent (M ", M, " N ", N, " K ", K,
             "); this is a bug in the caller");
  // Row-major: a stored row of op(A) is K wide, or M for A^T; likewise B.
  LAGA_CHECK(
      lda >= std::max<std::int64_t>(1, ta ? M : K) &&
          ldb >= std::max<std::int64_t>(1, tb ? K : N) && ldc >= std::max<std::int64_t>(1, N),
      who, ": a row stride is shorter than its row (M ", M, " N ", N, " K ", K, ", trans_a ", ta,
      " trans_b ", tb, ": lda ", lda, " ldb ", ldb, " ldc ", ldc, "); this is a bug in the caller");
}

float widen(float x) {
  return x;
}
float widen(bf16 x) {
  return to_float(x);
}
template <class TC>
TC narrow(float x) {
  if constexpr (std::is_same_v<TC, bf16>)
    return to_bf16(x);
  else
    return x;
}

// Whether oneDNN runs bf16 matmuls here at all: oneDNN 2.6 has none below
// avx512_core (its reference kernels included), so an AVX2-only CPU, or
// ONEDNN_MAX_CPU_ISA=AVX2, gets none. Asked once, with a tiny primitive.
bool onednn_has_bf16_matmul() {
  static const bool has = [] {
    try {
      const memory::desc a({1, 1}, memory::data_type::bf16, memory::format_tag::ab);
      const memory::desc c({1, 1}, memory::data_type::f32, memory::format_tag::ab);
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, a, c), cpu_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return has;
}

// oneDNN's bf16 matmul outruns its fp32 one here (gemm_bf16_path's auto).
bool onednn_bf16_pays() {
  return dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_amx ||
         flash_bf16_dot_products_pay();
}

GemmBf16Path environment_path() {
  static const GemmBf16Path path = detail::resolve_gemm_bf16_path(
      std::getenv("LAGA_GEMM_BF16"), onednn_has_bf16_matmul(), onednn_bf16_pays());
  return path;
}

constexpr int kNotSet = -1;
std::atomic<int> g_set_path{kNotSet};

// This thread's fp32 copy of one operand, grown to the largest it has held
// and kept (a fresh vector a call would map and fault in large operands on
// every call).
float* widening_scratch(int slot, std::int64_t n) {
  thread_local std::array<std::vector<float>, 3> slots;
  std::vector<float>& s = slots[static_cast<std::size_t>(slot)];
  if (static_cast<std::int64_t>(s.size()) < n) s.resize(static_cast<std::size_t>(n));
  return s.data();
}

// op(A) and op(B) widened to fp32 (exactly: every bf16 is an fp32) and
// multiplied by laga::gemm<float>, which sums in fp32 too, so the result
// meets the same bound; a bf16 C is computed in fp32 and rounded once.
template <class TC>
void gemm_by_widening(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                      const bf16* A, std::int64_t lda, const bf16* B, std::int64_t ldb, float beta,
                      TC* C, std::int64_t ldc) {
  auto widen_matrix = [](int slot, const bf16* X, std::int64_t rows, std::int64_t cols,
                         std::int64_t ld) {
    float* out = widening_scratch(slot, rows * cols);
    for (std::int64_t r = 0; r < rows; ++r) convert_to_float(X + r * ld, out + r * cols, cols);
    return out;
  };
  const float* a = widen_matrix(0, A, ta ? K : M, ta ? M : K, lda);
  const float* b = widen_matrix(1, B, tb ? N : K, tb ? K : N, ldb);
  if constexpr (std::is_same_v<TC, float>) {
    gemm<float>(ta, tb, M, N, K, alpha, a, ta ? M : K, b, tb ? K : N, beta, C, ldc);
  } else {
    float* c = widening_scratch(2, M * N);
    if (beta != 0.0f)
      for (std::int64_t i = 0; i < M; ++i) convert_to_float(C + i * ldc, c + i * N, N);
    gemm<float>(ta, tb, M, N, K, alpha, a, ta ? M : K, b, tb ? K : N, beta, c, N);
    for (std::int64_t i = 0; i < M; ++i) convert_to_bf16(c + i * N, C + i * ldc, N);
  }
}

}  // namespace

GemmBf16Path detail::resolve_gemm_bf16_path(const char* setting, bool has_matmul, bool pays) {
  const std::string value = setting ? setting : "";
  if (value.empty() || value == "auto")
    return has_matmul && pays ? GemmBf16Path::onednn_bf16 : GemmBf16Path::widened_fp32;
  if (value == "widened_fp32") return GemmBf16Path::widened_fp32;
  LAGA_CHECK(value == "onednn_bf16", "LAGA_GEMM_BF16='", value,
             "' is not a bf16 GEMM path; use onednn_bf16, widened_fp32 or auto");
  LAGA_CHECK(has_matmul, "LAGA_GEMM_BF16=onednn_bf16, but oneDNN has no bf16 matmul on this CPU ",
             "(it needs avx512_core); unset LAGA_GEMM_BF16 or set it to widened_fp32 or auto");
  return GemmBf16Path::onednn_bf16;
}

const char* to_string(GemmBf16Path p) {
  return p == GemmBf16Path::onednn_bf16 ? "onednn_bf16" : "widened_fp32";
}

GemmBf16Path gemm_bf16_path() {
  const int set = g_set_path.load(std::memory_order_relaxed);
  return set == kNotSet ? environment_path() : static_cast<GemmBf16Path>(set);
}

GemmBf16Path set_gemm_bf16_path(GemmBf16Path p) {
  LAGA_CHECK(p == GemmBf16Path::widened_fp32 || onednn_has_bf16_matmul(),
             "set_gemm_bf16_path(onednn_bf16): oneDNN has no bf16 matmul on this CPU (it needs "
             "avx512_core)");
  const GemmBf16Path previous = gemm_bf16_path();
  g_set_path.store(static_cast<int>(p), std::memory_order_relaxed);
  return previous;
}

template <class TC>
void gemm_bf16(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
               const bf16* A, std::int64_t lda, const bf16* B, std::int64_t ldb, float beta, TC* C,
               std::int64_t ldc) {
  check_strides("gemm_bf16", ta, tb, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: C = beta C, where beta 0 ignores C (NaN included)
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j)
        C[i * ldc + j] = narrow<TC>(beta == 0.0f ? 0.0f : beta * widen(C[i * ldc + j]));
    return;
  }
  if (gemm_bf16_path() == GemmBf16Path::widened_fp32) {
    gemm_by_widening(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const std::shared_ptr<const Primitive> p =
      primitive_for(key_of<TC>(ta, tb, M, N, K, alpha, lda, ldb, beta, ldc));
  try {
    thread_local dnnl::stream stream(cpu_engine());
    dnnl::engine& engine = cpu_engine();
    // oneDNN's memory objects take non-const handles; it only reads A and B.
    memory a(p->a, engine, const_cast<bf16*>(A)), b(p->b, engine, const_cast<bf16*>(B)),
        c(p->c, engine, C);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}};
    if (p->scratchpad_bytes > 0)
      args.emplace(DNNL_ARG_SCRATCHPAD,
                   memory(memory::desc({std::int64_t(p->scratchpad_bytes)}, memory::data_type::u8,
                                       memory::format_tag::a),
                          engine, thread_scratchpad(p->scratchpad_bytes)));
    p->matmul.execute(stream, args);
    stream.wait();
  } catch (const dnnl::error& e) {
    fail("gemm_bf16: oneDNN's matmul (", p->implementation, ") failed on M ", M, " N ", N, " K ", K,
         " lda ", lda, " ldb ", ldb, " ldc ", ldc, ": ", e.what(),
         "; out of memory is the likely cause: use a shorter sequence or more ranks");
  }
}

template <class TY>
void linear_forward_bf16(TY* y, const bf16* x, const bf16* w, std::int64_t N, std::int64_t in,
                         std::int64_t out) {
  gemm_bf16<TY>(false, true, N, out, in, 1.0f, x, in, w, in, 0.0f, y, out);
}

template <class TX>
void linear_backward_bf16(TX* dx, bool accumulate_dx, float* dw, const bf16* dy, const bf16* x,
                          const bf16* w, std::int64_t N, std::int64_t in, std::int64_t out) {
  if (dx)
    gemm_bf16<TX>(false, false, N, in, out, 1.0f, dy, out, w, in, accumulate_dx ? 1.0f : 0.0f, dx,
                  in);
  if (dw) gemm_bf16<float>(true, false, out, in, N, 1.0f, dy, out, x, in, 1.0f, dw, in);
}

std::string gemm_bf16_implementation(bool ta, bool tb, std::int64_t M, std::int64_t N,
                                     std::int64_t K, std::int64_t lda, std::int64_t ldb,
                                     std::int64_t ldc, bool bf16_out) {
  check_strides("gemm_bf16_implementation", ta, tb, M, N, K, lda, ldb, ldc);
  LAGA_CHECK(M > 0 && N > 0 && K > 0, "gemm_bf16_implementation: M ", M, " N ", N, " K ", K,
             " runs no oneDNN primitive (an empty product is done in place)");
  if (gemm_bf16_path() == GemmBf16Path::widened_fp32)
    return onednn_has_bf16_matmul()
               ? "fp32 sgemm on widened operands (LAGA_GEMM_BF16 widened_fp32, or auto where "
                 "oneDNN's bf16 matmul is slower than its fp32 one: an Intel CPU without AMX)"
               : "fp32 sgemm on widened operands (oneDNN has no bf16 matmul on this CPU)";
  const Key k = bf16_out ? key_of<bf16>(ta, tb, M, N, K, 1.0f, lda, ldb, 0.0f, ldc)
                         : key_of<float>(ta, tb, M, N, K, 1.0f, lda, ldb, 0.0f, ldc);
  return primitive_for(k)->implementation;
}

std::int64_t gemm_bf16_cached_primitives() {
  const std::lock_guard<std::mutex> lock(g_cache_mutex);
  return static_cast<std::int64_t>(g_cache.size());
}

template void gemm_bf16<float>(bool, bool, std::int64_t, std::int64_t, std::int64_t, float,
                               const bf16*, std::int64_t, const bf16*, std::int64_t, float, float*,
                               std::int64_t);
template void gemm_bf16<bf16>(bool, bool, std::int64_t, std::int64_t, std::int64_t, float,
                              const bf16*, std::int64_t, const bf16*, std::int64_t, float, bf16*,
                              std::int64_t);
template void linear_forward_bf16<float>(float*, const bf16*, const bf16*, std::int64_t,
                                         std::int64_t, std::int64_t);
template void linear_forward_bf16<bf16>(bf16*, const bf16*, const bf16*, std::int64_t, std::int64_t,
                                        std::int64_t);
template void linear_backward_bf16<float>(float*, bool, float*, const bf16*, const bf16*,
                                          const bf16*, std::int64_t, std::int64_t, std::int64_t);
template void linear_backward_bf16<bf16>(bf16*, bool, float*, const bf16*, const bf16*, const bf16*,
                                         std::int64_t, std::int64_t, std::int64_t);

}  // namespace laga
