// The CPU backend's kernel table (op_table.hpp): one row per kernel variant
// the CPU build has. The environment switches that chose a variant before
// the table existed still do (kernels/gemm_bf16.hpp, LAGA_GEMM_BF16;
// kernels/attention_flash.hpp, LAGA_FLASH_ISA;
// kernels/attention_flash_bf16.hpp, LAGA_FLASH_BF16_ISA): the rows they
// choose between answer why_not with the switch's current choice, so
// exactly one of them takes a call, and a row naming an ISA this machine
// lacks refuses naming what is missing.
#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/bf16.hpp"
#include "kernels/adamw.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash.hpp"
#include "kernels/attention_flash_bf16.hpp"
#include "kernels/attention_flash_latent.hpp"
#include "kernels/attention_sparse.hpp"
#include "kernels/bf16_convert.hpp"
#include "kernels/cross_entropy.hpp"
#include "kernels/dsa_indexer.hpp"
#include "kernels/embedding.hpp"
#include "kernels/fp8_e4m3.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_bf16.hpp"
#include "kernels/gemm_invariant.hpp"
#include "kernels/lse_merge.hpp"
#include "kernels/output_gate.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/rope.hpp"
#include "kernels/swiglu.hpp"
#include "mla/form_spec.hpp"
#include "mla/op_table.hpp"

namespace laga::ops {

namespace {

using Why = std::optional<std::string>;

Why dtype_not_in(RunDtype d, std::initializer_list<RunDtype> ok) {
  for (RunDtype o : ok)
    if (o == d) return std::nullopt;
  std::string names;
  for (RunDtype o : ok) names += std::string(names.empty() ? "" : " or ") + to_string(o);
  return std::string("dtype ") + to_string(d) + " (it takes " + names + ")";
}

// ------------------------------------------------------------------ gemm

template <class T>
void run_gemm(const OpCall& c) {
  const OpShape& s = c.shape;
  laga::gemm<T>(s.trans_a, s.trans_b, s.m, s.n, s.k, T(c.alpha), static_cast<const T*>(c.in[0]),
                s.lda, static_cast<const T*>(c.in[1]), s.ldb, T(c.beta), static_cast<T*>(c.out[0]),
                s.ldc);
}
void run_gemm_bf16(const OpCall& c) {
  const OpShape& s = c.shape;
  gemm_bf16<float>(s.trans_a, s.trans_b, s.m, s.n, s.k, float(c.alpha),
                   static_cast<const bf16*>(c.in[0]), s.lda, static_cast<const bf16*>(c.in[1]),
                   s.ldb, float(c.beta), static_cast<float*>(c.out[0]), s.ldc);
}
// The invariant mode (op_table.hpp, op_invariant) is served by
// gemm_invariant alone: the library rows' blocking and threading follow M.
Why library_gemm_takes(const OpShape& s) {
  if (s.invariant)
    return std::string(
        "the invariant mode (a library GEMM's sums depend on the row count; "
        "gemm_invariant takes the call)");
  return std::nullopt;
}
template <class T>
void run_gemm_invariant(const OpCall& c) {
  const OpShape& s = c.shape;
  gemm_invariant<T>(s.trans_a, s.trans_b, s.m, s.n, s.k, T(c.alpha), static_cast<const T*>(c.in[0]),
                    s.lda, static_cast<const T*>(c.in[1]), s.ldb, T(c.beta),
                    static_cast<T*>(c.out[0]), s.ldc);
}

Why gemm_bf16_takes(GemmBf16Path path, RunDtype d) {
  if (Why w = dtype_not_in(d, {RunDtype::bf16})) return w;
  if (gemm_bf16_path() != path)
    return std::string("LAGA_GEMM_BF16 (gemm_bf16_path) selects ") + to_string(gemm_bf16_path());
  return std::nullopt;
}

// ------------------------------------------------- per-head and latent attention

AttentionKind kind(const OpShape& s) {
  return s.attention;
}
Why flash_only(const OpShape& s) {
  if (kind(s) != AttentionKind::flash)
    return std::string("attention ") + to_string(kind(s)) + " (a flash kernel)";
  return std::nullopt;
}
Why eager_only(const OpShape& s) {
  if (kind(s) != AttentionKind::eager)
    return std::string("attention ") + to_string(kind(s)) + " (the eager kernel)";
  return std::nullopt;
}
Why flash_isa_is(FlashIsa isa) {
  const std::vector<FlashIsa> have = flash_isas_available();
  if (std::find(have.begin(), have.end(), isa) == have.end())
    return std::string("ISA ") + to_string(isa) + ": this build or CPU does not run it";
  if (flash_isa() != isa)
    return std::string("LAGA_FLASH_ISA (flash_isa) selects ") + to_string(flash_isa());
  return std::nullopt;
}
Why flash_bf16_isa_is(FlashBf16Isa isa) {
  if (isa == FlashBf16Isa::avx512_bf16)
    if (const char* why = flash_bf16_why_no_avx512_bf16())
      return std::string("ISA avx512_bf16: ") + why;
  if (flash_bf16_isa() != isa)
    return std::string("LAGA_FLASH_BF16_ISA (flash_bf16_isa) selects ") +
           to_string(flash_bf16_isa());
  return std::nullopt;
}
// A latent (absorbed) call has one shared key/value head; a per-head call
// as many as its query heads.
Why heads_fit(Op op, const OpShape& s) {
  const bool latent = op == Op::latent_attention_forward || op == Op::latent_attention_backward;
  if (latent && s.attn.Hk != 1)
    return "Hk " + std::to_string(s.attn.Hk) + " (latent attention shares one key/value head)";
  return std::nullopt;
}

template <class T>
void run_eager_forward(const OpCall& c) {
  attention_eager_forward(c.shape.attn, static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]),
                          static_cast<const T*>(c.in[0]), static_cast<const T*>(c.in[1]),
                          static_cast<const T*>(c.in[2]), static_cast<T*>(c.out[2]));
}
template <class T>
void run_eager_backward(const OpCall& c) {
  attention_eager_backward(c.shape.attn, static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]),
                           static_cast<T*>(c.out[2]), static_cast<const T*>(c.in[0]),
                           static_cast<const T*>(c.in[1]), static_cast<const T*>(c.in[2]),
                           static_cast<const T*>(c.in[3]), static_cast<const T*>(c.in[5]),
                           static_cast<T*>(c.out[3]), static_cast<const T*>(c.in[6]));
}
// T: the kernel's element type (float for a bf16 call whose operands are
// fp32 values of bf16 numbers).
template <class T>
void run_flash_forward(const OpCall& c) {
  attention_flash_forward(c.shape.attn, static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]),
                          static_cast<const T*>(c.in[0]), static_cast<const T*>(c.in[1]),
                          static_cast<const T*>(c.in[2]));
}
template <class T>
void run_flash_backward(const OpCall& c) {
  attention_flash_backward(c.shape.attn, static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]),
                           static_cast<T*>(c.out[2]), static_cast<const T*>(c.in[0]),
                           static_cast<const T*>(c.in[1]), static_cast<const T*>(c.in[2]),
                           static_cast<const T*>(c.in[3]), static_cast<const T*>(c.in[4]),
                           static_cast<const T*>(c.in[5]));
}
void run_flash_bf16_forward(const OpCall& c) {
  attention_flash_forward_bf16(c.shape.attn, static_cast<float*>(c.out[0]),
                               static_cast<float*>(c.out[1]), static_cast<const bf16*>(c.in[0]),
                               static_cast<const bf16*>(c.in[1]), static_cast<const bf16*>(c.in[2]),
                               {c.workspace, c.workspace_bytes});
}
void run_flash_bf16_backward(const OpCall& c) {
  attention_flash_backward_bf16(
      c.shape.attn, static_cast<float*>(c.out[0]), static_cast<float*>(c.out[1]),
      static_cast<float*>(c.out[2]), static_cast<const bf16*>(c.in[0]),
      static_cast<const bf16*>(c.in[1]), static_cast<const bf16*>(c.in[2]),
      static_cast<const bf16*>(c.in[3]), static_cast<const float*>(c.in[4]),
      static_cast<const float*>(c.in[5]), {c.workspace, c.workspace_bytes});
}
std::int64_t flash_bf16_workspace(RunDtype, const OpShape& s) {
  return attention_flash_bf16_workspace_bytes(s.attn, false);
}
std::int64_t flash_bf16_workspace_backward(RunDtype, const OpShape& s) {
  return attention_flash_bf16_workspace_bytes(s.attn, true);
}

// --------------------------------------------------- fused latent attention

template <class T>
LatentAttnParams<T> latent_params(const OpCall& c) {
  const OpShape& s = c.shape;
  LatentAttnParams<T> p;
  p.shape = s.attn, p.C = s.C, p.dn = s.dn;
  p.invariant = s.invariant;  // the flash_latent_invariant rows' calls
  p.q = static_cast<const T*>(c.in[0]);
  p.c = static_cast<const T*>(c.in[1]), p.ld_c = s.ld_c;
  p.k_pe = static_cast<const T*>(c.in[2]), p.ld_k_pe = s.ld_k_pe;
  p.w_kv = static_cast<const T*>(c.in[3]);
  return p;
}
// The library rows take the mode's calls off, the invariant rows on
// (op_invariant; docs/invariance.md).
Why fused_latent_takes(const OpShape& s, bool invariant_row) {
  if (s.invariant && !invariant_row)
    return std::string(
        "the invariant mode (the library GEMMs inside follow the thread count; "
        "flash_latent_invariant takes the call)");
  if (!s.invariant && invariant_row) return std::string("only the invariant mode's calls");
  return std::nullopt;
}
template <class T>
void run_fused_forward(const OpCall& c) {
  attention_flash_latent_forward<T>(latent_params<T>(c), static_cast<T*>(c.out[0]),
                                    static_cast<T*>(c.out[1]));
}
template <class T>
void run_fused_backward(const OpCall& c) {
  const OpShape& s = c.shape;
  attention_flash_latent_backward<T>(
      latent_params<T>(c),
      {static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]), s.ld_dc, static_cast<T*>(c.out[2]),
       s.ld_dk_pe, static_cast<T*>(c.out[3])},
      static_cast<const T*>(c.in[4]), static_cast<const T*>(c.in[5]),
      static_cast<const T*>(c.in[6]));
}

// ---------------------------------------------------------- sparse attention

template <class T>
void run_sparse_forward(const OpCall& c) {
  sparse_attention_forward<T>({c.shape.attn, c.shape.k}, static_cast<T*>(c.out[0]),
                              static_cast<T*>(c.out[1]), static_cast<const T*>(c.in[0]),
                              static_cast<const T*>(c.in[1]), static_cast<const T*>(c.in[2]),
                              static_cast<const std::int32_t*>(c.in[3]));
}
template <class T>
void run_sparse_backward(const OpCall& c) {
  sparse_attention_backward<T>({c.shape.attn, c.shape.k}, static_cast<T*>(c.out[0]),
                               static_cast<T*>(c.out[1]), static_cast<T*>(c.out[2]),
                               static_cast<const T*>(c.in[0]), static_cast<const T*>(c.in[1]),
                               static_cast<const T*>(c.in[2]), static_cast<const T*>(c.in[3]),
                               static_cast<const T*>(c.in[4]), static_cast<const T*>(c.in[5]),
                               static_cast<const std::int32_t*>(c.in[6]));
}
// bf16 mixed precision: bf16 q, k, v (and dout), fp32 o, lse and
// gradients (kernels/attention_sparse.hpp, "bf16 mixed precision").
void run_sparse_bf16_forward(const OpCall& c) {
  sparse_attention_forward_bf16(
      {c.shape.attn, c.shape.k}, static_cast<float*>(c.out[0]), static_cast<float*>(c.out[1]),
      static_cast<const bf16*>(c.in[0]), static_cast<const bf16*>(c.in[1]),
      static_cast<const bf16*>(c.in[2]), static_cast<const std::int32_t*>(c.in[3]));
}
void run_sparse_bf16_backward(const OpCall& c) {
  sparse_attention_backward_bf16(
      {c.shape.attn, c.shape.k}, static_cast<float*>(c.out[0]), static_cast<float*>(c.out[1]),
      static_cast<float*>(c.out[2]), static_cast<const bf16*>(c.in[0]),
      static_cast<const bf16*>(c.in[1]), static_cast<const bf16*>(c.in[2]),
      static_cast<const bf16*>(c.in[3]), static_cast<const float*>(c.in[4]),
      static_cast<const float*>(c.in[5]), static_cast<const std::int32_t*>(c.in[6]));
}
// sparse_gather runs fp64 and fp32, sparse_gather_bf16 bf16.
Why sparse_takes(RunDtype d, const OpShape&) {
  if (d == RunDtype::bf16) return std::string("dtype bf16 (sparse_gather_bf16 takes it)");
  return std::nullopt;
}
Why sparse_bf16_takes(RunDtype d, const OpShape&) {
  return dtype_not_in(d, {RunDtype::bf16});
}

// ------------------------------------------- DSA's lightning indexer

// kernels/dsa_indexer.hpp's kernels; the indexer ops carry their
// IndexerShape as the call's context (op_table.hpp, Op::index_topk).
template <class T>
void run_layernorm_forward(const OpCall& c) {
  layernorm_forward(static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]), static_cast<T*>(c.out[2]),
                    static_cast<const T*>(c.in[0]), static_cast<const T*>(c.in[1]),
                    static_cast<const T*>(c.in[2]), c.shape.rows, c.shape.cols, c.alpha);
}
template <class T>
void run_layernorm_backward(const OpCall& c) {
  layernorm_backward(static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]),
                     static_cast<T*>(c.out[2]), static_cast<const T*>(c.in[0]),
                     static_cast<const T*>(c.in[1]), static_cast<const T*>(c.in[2]),
                     static_cast<const T*>(c.in[3]), static_cast<const T*>(c.in[4]), c.shape.rows,
                     c.shape.cols);
}
template <class T, bool Inverse>
void run_rope_halves(const OpCall& c) {
  const OpShape& s = c.shape;
  rope_halves_apply(static_cast<T*>(c.out[0]), s.tokens, s.heads, s.ld_token, s.ld_head, s.pos0,
                    static_cast<const std::int64_t*>(c.in[0]),
                    *static_cast<const RopeTable*>(c.context), Inverse);
}
const IndexerShape& indexer_of(const OpCall& c) {
  return *static_cast<const IndexerShape*>(c.context);
}
template <class T>
void run_index_topk(const OpCall& c) {
  dsa_index_topk(indexer_of(c), static_cast<std::int32_t*>(c.out[0]),
                 static_cast<const T*>(c.in[0]), static_cast<const T*>(c.in[1]),
                 static_cast<const T*>(c.in[2]));
}
template <class T>
void run_indexer_kl(const OpCall& c) {
  dsa_indexer_kl(indexer_of(c), c.shape.n, static_cast<const std::int32_t*>(c.in[0]),
                 static_cast<const T*>(c.in[1]), static_cast<const T*>(c.in[2]),
                 static_cast<const T*>(c.in[3]), static_cast<const T*>(c.in[4]),
                 static_cast<double*>(c.out[0]), static_cast<T*>(c.out[1]),
                 static_cast<T*>(c.out[2]), static_cast<T*>(c.out[3]));
}
// The indexer's kernels run fp64 and fp32; no bf16 path yet.
Why indexer_takes(RunDtype d, const OpShape&) {
  if (d == RunDtype::bf16)
    return std::string(
        "dtype bf16 (the indexer's kernels run fp64 and fp32 only; use --dtype fp32)");
  return std::nullopt;
}
// f(double{}) for an fp64 call, else f(float{}) (fp32, and a bf16 run's fp32
// tensors): the element type of a row that runs both.
template <class F>
void by_dtype(const OpCall& c, F&& f) {
  c.dtype == RunDtype::fp64 ? f(double{}) : f(float{});
}

// ------------------------------------------------------ row-wise ops

template <class T>
void run_lse_merge(const OpCall& c) {
  const OpShape& s = c.shape;
  lse_merge<T>({s.attn.B, s.attn.Sq, s.cols, s.attn.dv, s.rows, s.b0, s.q_row, s.attn.causal},
               static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]), static_cast<const T*>(c.in[0]),
               static_cast<const T*>(c.in[1]));
}
template <class T>
void run_rmsnorm_forward(const OpCall& c) {
  const OpShape& s = c.shape;
  rmsnorm_forward(static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]),
                  static_cast<const T*>(c.in[0]), s.lda, static_cast<const T*>(c.in[1]), s.rows,
                  s.cols, c.alpha);
}
template <class T>
void run_rmsnorm_backward(const OpCall& c) {
  const OpShape& s = c.shape;
  laga::rmsnorm_backward(static_cast<T*>(c.out[0]), s.ldc, static_cast<T*>(c.out[1]),
                         static_cast<const T*>(c.in[0]), s.ldb, static_cast<const T*>(c.in[1]),
                         s.lda, static_cast<const T*>(c.in[2]), static_cast<const T*>(c.in[3]),
                         s.rows, s.cols);
}
template <class T, bool Inverse>
void run_rope(const OpCall& c) {
  const OpShape& s = c.shape;
  const auto& table = *static_cast<const RopeTable*>(c.context);
  const auto* positions = static_cast<const std::int64_t*>(c.in[0]);
  if (positions)
    rope_apply_at(static_cast<T*>(c.out[0]), s.batch, s.tokens, s.heads, s.ld_token, s.ld_head,
                  positions, table, Inverse);
  else
    rope_apply(static_cast<T*>(c.out[0]), s.batch, s.tokens, s.heads, s.ld_token, s.ld_head, s.pos0,
               table, Inverse);
}

// Rows that run in fp32 on a bf16 call's fp32 values (the op layer rounds
// what a bf16 run stores) and in double.
Why f64_f32_bf16(RunDtype d, const OpShape&) {
  return dtype_not_in(d, {RunDtype::fp64, RunDtype::fp32, RunDtype::bf16});
}

// The rows. Each op has one row per element type it runs (rank orders them
// only where two could take one call; the switches keep that from happening).
template <class T>
constexpr RunDtype dtype_of = std::is_same_v<T, double> ? RunDtype::fp64 : RunDtype::fp32;

// The model's kernels, unpacked from their slots (op_table.hpp, Op).
template <class T>
void run_embedding(const OpCall& c) {
  embedding_forward(static_cast<T*>(c.out[0]), static_cast<const std::int32_t*>(c.in[0]),
                    static_cast<const T*>(c.in[1]), c.shape.rows, c.shape.n, c.shape.cols);
}
template <class T>
void run_embedding_backward(const OpCall& c) {
  embedding_backward(static_cast<T*>(c.out[0]), static_cast<const T*>(c.in[0]),
                     static_cast<const std::int32_t*>(c.in[1]), c.shape.rows, c.shape.n,
                     c.shape.cols);
}
template <class T>
void run_swiglu(const OpCall& c) {
  swiglu_forward(static_cast<T*>(c.out[0]), static_cast<const T*>(c.in[0]),
                 static_cast<const T*>(c.in[1]), c.shape.rows);
}
template <class T>
void run_swiglu_backward(const OpCall& c) {
  swiglu_backward(static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]),
                  static_cast<const T*>(c.in[0]), static_cast<const T*>(c.in[1]),
                  static_cast<const T*>(c.in[2]), c.shape.rows);
}
template <class T>
void run_output_gate(const OpCall& c) {
  output_gate_forward(static_cast<T*>(c.out[0]), static_cast<const T*>(c.in[0]),
                      static_cast<const T*>(c.in[1]), c.shape.rows);
}
template <class T>
void run_output_gate_backward(const OpCall& c) {
  output_gate_backward(static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]),
                       static_cast<const T*>(c.in[0]), static_cast<const T*>(c.in[1]),
                       static_cast<const T*>(c.in[2]), c.shape.rows);
}
template <class T>
void run_cross_entropy(const OpCall& c) {
  cross_entropy_forward(static_cast<T*>(c.out[0]), static_cast<double*>(c.out[1]),
                        static_cast<const T*>(c.in[0]), static_cast<const std::int32_t*>(c.in[1]),
                        c.shape.rows, c.shape.cols);
}
template <class T>
void run_cross_entropy_backward(const OpCall& c) {
  cross_entropy_backward(static_cast<T*>(c.out[0]), static_cast<const T*>(c.in[0]),
                         static_cast<const double*>(c.in[1]),
                         static_cast<const std::int32_t*>(c.in[2]), c.alpha, c.shape.rows,
                         c.shape.cols);
}
template <class T>
void run_adamw(const OpCall& c) {
  adamw_step(static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]), static_cast<T*>(c.out[2]),
             static_cast<const T*>(c.in[0]), c.shape.rows, c.shape.k,
             *static_cast<const AdamWHyper*>(c.context));
}

#define LAGA_ROW_DTYPE(T) [](RunDtype d, const OpShape&) { return dtype_not_in(d, {dtype_of<T>}); }

// ------------------------------------------ data movement (copy_rows, fill)

// The forms' copies, sums and conversions, as the op layer ran them before
// they were ops (mla/ops.hpp's copy, add, widen; mla/exchange.cpp's
// packing): row by row, a memcpy or an elementwise loop.
template <class S, class D>
void copy_rows_as(const OpCall& c) {
  const OpShape& s = c.shape;
  const S* src = static_cast<const S*>(c.in[0]);
  D* dst = static_cast<D*>(c.out[0]);
  for (std::int64_t i = 0; i < s.rows; ++i) {
    const S* x = src + i * s.lda;
    D* y = dst + i * s.ldc;
    if constexpr (std::is_same_v<S, D>) {
      if constexpr (std::is_same_v<S, bf16>) {  // a sum into bf16 is refused
        std::memcpy(y, x, sizeof(S) * static_cast<std::size_t>(s.cols));
      } else if (!s.accumulate) {
        std::memcpy(y, x, sizeof(S) * static_cast<std::size_t>(s.cols));
      } else {
        for (std::int64_t j = 0; j < s.cols; ++j) y[j] += x[j];
      }
    } else if constexpr (std::is_same_v<D, bf16>) {  // refused with accumulate
      convert_to_bf16(x, y, s.cols);
    } else if (s.accumulate) {
      for (std::int64_t j = 0; j < s.cols; ++j) y[j] += to_float(x[j]);
    } else {
      convert_to_float(x, y, s.cols);
    }
  }
}
void run_copy_rows(const OpCall& c) {
  switch (c.dtype) {
    case RunDtype::fp64:
      return copy_rows_as<double, double>(c);
    case RunDtype::fp32:
      return c.shape.src_bf16 ? copy_rows_as<bf16, float>(c) : copy_rows_as<float, float>(c);
    case RunDtype::bf16:
      return c.shape.src_bf16 ? copy_rows_as<bf16, bf16>(c) : copy_rows_as<float, bf16>(c);
  }
}
template <class T>
void fill_as(const OpCall& c) {
  T* dst = static_cast<T*>(c.out[0]);
  const T v = T(c.alpha);
  for (std::int64_t i = 0; i < c.shape.rows; ++i)
    std::fill(dst + i * c.shape.ldc, dst + i * c.shape.ldc + c.shape.cols, v);
}
void run_fill(const OpCall& c) {
  c.dtype == RunDtype::fp64 ? fill_as<double>(c) : fill_as<float>(c);
}

const KernelRow kRows[] = {
    // gemm: OpenBLAS (double), oneDNN's sgemm (float), and bf16 mixed
    // precision either on oneDNN's bf16 matmul or widened to the fp32 one.
    {Device::cpu, Op::gemm, "gemm_fp64",
     [](RunDtype d, const OpShape& s) -> Why {
       if (Why w = library_gemm_takes(s)) return w;
       return dtype_not_in(d, {RunDtype::fp64});
     },
     &run_gemm<double>},
    {Device::cpu, Op::gemm, "gemm_fp32",
     [](RunDtype d, const OpShape& s) -> Why {
       if (Why w = library_gemm_takes(s)) return w;
       return dtype_not_in(d, {RunDtype::fp32});
     },
     &run_gemm<float>},
    {Device::cpu, Op::gemm, "gemm_bf16_onednn",
     [](RunDtype d, const OpShape& s) -> Why {
       if (Why w = library_gemm_takes(s)) return w;
       return gemm_bf16_takes(GemmBf16Path::onednn_bf16, d);
     },
     &run_gemm_bf16, 0, Bf16Operands::bf16},
    {Device::cpu, Op::gemm, "gemm_bf16_widened_fp32",
     [](RunDtype d, const OpShape& s) -> Why {
       if (Why w = library_gemm_takes(s)) return w;
       return gemm_bf16_takes(GemmBf16Path::widened_fp32, d);
     },
     &run_gemm<float>, 0, Bf16Operands::fp32_values},
    // The invariant mode's GEMM (kernels/gemm_invariant.hpp), every dtype;
    // bf16 widened (exact products of bf16 values, fp32 sums).
    {Device::cpu, Op::gemm, "gemm_invariant",
     [](RunDtype, const OpShape& s) -> Why {
       if (!s.invariant)
         return std::string("not the invariant mode (the library GEMMs are faster)");
       return std::nullopt;
     },
     [](const OpCall& c) {
       c.dtype == RunDtype::fp64 ? run_gemm_invariant<double>(c) : run_gemm_invariant<float>(c);
     },
     0, Bf16Operands::fp32_values},

// Per-head and latent attention share kernels (kernels/attention.hpp: Hk
// divides Hq), differing in heads_fit.
#define LAGA_ATTENTION_ROWS(FWD, BWD)                                                              \
  {Device::cpu, Op::FWD, "attention_eager",                                                        \
   [](RunDtype d, const OpShape& s) -> Why {                                                       \
     if (Why w = eager_only(s)) return w;                                                          \
     if (d == RunDtype::bf16)                                                                      \
       return std::string("dtype bf16 (the eager kernel has none; use --attention flash)");        \
     return heads_fit(Op::FWD, s);                                                                 \
   },                                                                                              \
   [](const OpCall& c) {                                                                           \
     c.dtype == RunDtype::fp64 ? run_eager_forward<double>(c) : run_eager_forward<float>(c);       \
   }},                                                                                             \
      {Device::cpu, Op::BWD, "attention_eager",                                                    \
       [](RunDtype d, const OpShape& s) -> Why {                                                   \
         if (Why w = eager_only(s)) return w;                                                      \
         if (d == RunDtype::bf16)                                                                  \
           return std::string("dtype bf16 (the eager kernel has none; use --attention flash)");    \
         return heads_fit(Op::BWD, s);                                                             \
       },                                                                                          \
       [](const OpCall& c) {                                                                       \
         c.dtype == RunDtype::fp64 ? run_eager_backward<double>(c) : run_eager_backward<float>(c); \
       }},                                                                                         \
      {Device::cpu, Op::FWD, "flash_fp64",                                                         \
       [](RunDtype d, const OpShape& s) -> Why {                                                   \
         if (Why w = flash_only(s)) return w;                                                      \
         if (Why w = dtype_not_in(d, {RunDtype::fp64})) return w;                                  \
         return heads_fit(Op::FWD, s);                                                             \
       },                                                                                          \
       &run_flash_forward<double>},                                                                \
      {Device::cpu, Op::BWD, "flash_fp64",                                                         \
       [](RunDtype d, const OpShape& s) -> Why {                                                   \
         if (Why w = flash_only(s)) return w;                                                      \
         if (Why w = dtype_not_in(d, {RunDtype::fp64})) return w;                                  \
         return heads_fit(Op::BWD, s);                                                             \
       },                                                                                          \
       &run_flash_backward<double>},                                                               \
      {Device::cpu, Op::FWD, "flash_avx2",                                                         \
       [](RunDtype d, const OpShape& s) -> Why {                                                   \
         if (Why w = flash_only(s)) return w;                                                      \
         if (Why w = dtype_not_in(d, {RunDtype::fp32})) return w;                                  \
         if (Why w = flash_isa_is(FlashIsa::avx2)) return w;                                       \
         return heads_fit(Op::FWD, s);                                                             \
       },                                                                                          \
       &run_flash_forward<float>},                                                                 \
      {Device::cpu, Op::BWD, "flash_avx2",                                                         \
       [](RunDtype d, const OpShape& s) -> Why {                                                   \
         if (Why w = flash_only(s)) return w;                                                      \
         if (Why w = dtype_not_in(d, {RunDtype::fp32})) return w;                                  \
         if (Why w = flash_isa_is(FlashIsa::avx2)) return w;                                       \
         return heads_fit(Op::BWD, s);                                                             \
       },                                                                                          \
       &run_flash_backward<float>},                                                                \
      {Device::cpu, Op::FWD, "flash_avx512",                                                       \
       [](RunDtype d, const OpShape& s) -> Why {                                                   \
         if (Why w = flash_only(s)) return w;                                                      \
         if (Why w = dtype_not_in(d, {RunDtype::fp32})) return w;                                  \
         if (Why w = flash_isa_is(FlashIsa::avx512)) return w;                                     \
         return heads_fit(Op::FWD, s);                                                             \
       },                                                                                          \
       &run_flash_forward<float>},                                                                 \
      {Device::cpu, Op::BWD, "flash_avx512",                                                       \
       [](RunDtype d, const OpShape& s) -> Why {                                                   \
         if (Why w = flash_only(s)) return w;                                                      \
         if (Why w = dtype_not_in(d, {RunDtype::fp32})) return w;                                  \
         if (Why w = flash_isa_is(FlashIsa::avx512)) return w;                                     \
         return heads_fit(Op::BWD, s);                                                             \
       },                                                                                          \
       &run_flash_backward<float>},                                                                \
      {Device::cpu,                                                                                \
       Op::FWD,                                                                                    \
       "flash_bf16_avx512_bf16",                                                                   \
       [](RunDtype d, const OpShape& s) -> Why {                                                   \
         if (Why w = flash_only(s)) return w;                                                      \
         if (Why w = dtype_not_in(d, {RunDtype::bf16})) return w;                                  \
         if (Why w = flash_bf16_isa_is(FlashBf16Isa::avx512_bf16)) return w;                       \
         return heads_fit(Op::FWD, s);                                                             \
       },                                                                                          \
       &run_flash_bf16_forward,                                                                    \
       0,                                                                                          \
       Bf16Operands::bf16,                                                                         \
       &flash_bf16_workspace},                                                                     \
      {Device::cpu,                                                                                \
       Op::BWD,                                                                                    \
       "flash_bf16_avx512_bf16",                                                                   \
       [](RunDtype d, const OpShape& s) -> Why {                                                   \
         if (Why w = flash_only(s)) return w;                                                      \
         if (Why w = dtype_not_in(d, {RunDtype::bf16})) return w;                                  \
         if (Why w = flash_bf16_isa_is(FlashBf16Isa::avx512_bf16)) return w;                       \
         return heads_fit(Op::BWD, s);                                                             \
       },                                                                                          \
       &run_flash_bf16_backward,                                                                   \
       0,                                                                                          \
       Bf16Operands::bf16,                                                                         \
       &flash_bf16_workspace_backward},                                                            \
      {Device::cpu,                                                                                \
       Op::FWD,                                                                                    \
       "flash_bf16_widened_fp32",                                                                  \
       [](RunDtype d, const OpShape& s) -> Why {                                                   \
         if (Why w = flash_only(s)) return w;                                                      \
         if (Why w = dtype_not_in(d, {RunDtype::bf16})) return w;                                  \
         if (Why w = flash_bf16_isa_is(FlashBf16Isa::fp32)) return w;                              \
         return heads_fit(Op::FWD, s);                                                             \
       },                                                                                          \
       &run_flash_forward<float>,                                                                  \
       0,                                                                                          \
       Bf16Operands::fp32_values},                                                                 \
  {                                                                                                \
    Device::cpu, Op::BWD, "flash_bf16_widened_fp32",                                               \
        [](RunDtype d, const OpShape& s) -> Why {                                                  \
          if (Why w = flash_only(s)) return w;                                                     \
          if (Why w = dtype_not_in(d, {RunDtype::bf16})) return w;                                 \
          if (Why w = flash_bf16_isa_is(FlashBf16Isa::fp32)) return w;                             \
          return heads_fit(Op::BWD, s);                                                            \
        },                                                                                         \
        &run_flash_backward<float>, 0, Bf16Operands::fp32_values                                   \
  }

    LAGA_ATTENTION_ROWS(attention_forward, attention_backward),
    LAGA_ATTENTION_ROWS(latent_attention_forward, latent_attention_backward),
#undef LAGA_ATTENTION_ROWS

    // The fused latent attention: one kernel per element type; a bf16 run
    // runs the fp32 kernel on bf16 values (its in-kernel K/V and P fp32:
    // form_laga_fused.cpp).
    // In the invariant mode (OpShape::invariant) the flash_latent_invariant
    // rows take the call: the same kernel with every product on
    // gemm_invariant (LatentAttnParams::invariant; docs/invariance.md).
    {Device::cpu, Op::fused_latent_attention_forward, "flash_latent_fp64",
     [](RunDtype d, const OpShape& s) -> Why {
       if (Why w = fused_latent_takes(s, false)) return w;
       return dtype_not_in(d, {RunDtype::fp64});
     },
     &run_fused_forward<double>},
    {Device::cpu, Op::fused_latent_attention_backward, "flash_latent_fp64",
     [](RunDtype d, const OpShape& s) -> Why {
       if (Why w = fused_latent_takes(s, false)) return w;
       return dtype_not_in(d, {RunDtype::fp64});
     },
     &run_fused_backward<double>},
    {Device::cpu, Op::fused_latent_attention_forward, "flash_latent_fp32",
     [](RunDtype d, const OpShape& s) -> Why {
       if (Why w = fused_latent_takes(s, false)) return w;
       return dtype_not_in(d, {RunDtype::fp32, RunDtype::bf16});
     },
     &run_fused_forward<float>, 0, Bf16Operands::fp32_values},
    {Device::cpu, Op::fused_latent_attention_backward, "flash_latent_fp32",
     [](RunDtype d, const OpShape& s) -> Why {
       if (Why w = fused_latent_takes(s, false)) return w;
       return dtype_not_in(d, {RunDtype::fp32, RunDtype::bf16});
     },
     &run_fused_backward<float>, 0, Bf16Operands::fp32_values},
    {Device::cpu, Op::fused_latent_attention_forward, "flash_latent_invariant",
     [](RunDtype, const OpShape& s) { return fused_latent_takes(s, true); },
     [](const OpCall& c) {
       c.dtype == RunDtype::fp64 ? run_fused_forward<double>(c) : run_fused_forward<float>(c);
     },
     0, Bf16Operands::fp32_values},
    {Device::cpu, Op::fused_latent_attention_backward, "flash_latent_invariant",
     [](RunDtype, const OpShape& s) { return fused_latent_takes(s, true); },
     [](const OpCall& c) {
       c.dtype == RunDtype::fp64 ? run_fused_backward<double>(c) : run_fused_backward<float>(c);
     },
     0, Bf16Operands::fp32_values},

    {Device::cpu, Op::sparse_attention_forward, "sparse_gather", &sparse_takes,
     [](const OpCall& c) {
       c.dtype == RunDtype::fp64 ? run_sparse_forward<double>(c) : run_sparse_forward<float>(c);
     }},
    {Device::cpu, Op::sparse_attention_backward, "sparse_gather", &sparse_takes,
     [](const OpCall& c) {
       c.dtype == RunDtype::fp64 ? run_sparse_backward<double>(c) : run_sparse_backward<float>(c);
     }},
    {Device::cpu, Op::sparse_attention_forward, "sparse_gather_bf16", &sparse_bf16_takes,
     &run_sparse_bf16_forward, 0, Bf16Operands::bf16},
    {Device::cpu, Op::sparse_attention_backward, "sparse_gather_bf16", &sparse_bf16_takes,
     &run_sparse_bf16_backward, 0, Bf16Operands::bf16},

    {Device::cpu, Op::layernorm_forward, "layernorm", &indexer_takes,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_layernorm_forward<decltype(t)>(c); }); }},
    {Device::cpu, Op::layernorm_backward, "layernorm", &indexer_takes,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_layernorm_backward<decltype(t)>(c); }); }},
    {Device::cpu, Op::rope_halves_forward, "rope_halves", &indexer_takes,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_rope_halves<decltype(t), false>(c); }); }},
    {Device::cpu, Op::rope_halves_backward, "rope_halves", &indexer_takes,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_rope_halves<decltype(t), true>(c); }); }},
    {Device::cpu, Op::index_topk, "index_topk", &indexer_takes,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_index_topk<decltype(t)>(c); }); }},
    // The selection of every causal key reads no operand: any dtype.
    {Device::cpu, Op::index_all_causal, "index_all_causal",
     [](RunDtype, const OpShape&) -> Why { return std::nullopt; },
     [](const OpCall& c) { dsa_all_causal(indexer_of(c), static_cast<std::int32_t*>(c.out[0])); }},
    {Device::cpu, Op::indexer_kl, "indexer_kl", &indexer_takes,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_indexer_kl<decltype(t)>(c); }); }},
    {Device::cpu, Op::kv_fp8_round_trip, "kv_fp8_round_trip", &f64_f32_bf16,
     [](const OpCall& c) {
       by_dtype(c, [&](auto t) {
         fp8_round_trip(static_cast<decltype(t)*>(c.out[0]), c.shape.rows, c.shape.cols,
                        kActQuantBlock, Fp8ScaleFmt::ue8m0);
       });
     },
     0, Bf16Operands::fp32_values},

    {Device::cpu, Op::lse_merge, "lse_merge", &f64_f32_bf16,
     [](const OpCall& c) {
       c.dtype == RunDtype::fp64 ? run_lse_merge<double>(c) : run_lse_merge<float>(c);
     },
     0, Bf16Operands::fp32_values},
    {Device::cpu, Op::rmsnorm_forward, "rmsnorm", &f64_f32_bf16,
     [](const OpCall& c) {
       c.dtype == RunDtype::fp64 ? run_rmsnorm_forward<double>(c) : run_rmsnorm_forward<float>(c);
     },
     0, Bf16Operands::fp32_values},
    {Device::cpu, Op::rmsnorm_backward, "rmsnorm", &f64_f32_bf16,
     [](const OpCall& c) {
       c.dtype == RunDtype::fp64 ? run_rmsnorm_backward<double>(c) : run_rmsnorm_backward<float>(c);
     },
     0, Bf16Operands::fp32_values},
    {Device::cpu, Op::rope_forward, "rope", &f64_f32_bf16,
     [](const OpCall& c) {
       c.dtype == RunDtype::fp64 ? run_rope<double, false>(c) : run_rope<float, false>(c);
     },
     0, Bf16Operands::fp32_values},
    {Device::cpu, Op::rope_backward, "rope", &f64_f32_bf16,
     [](const OpCall& c) {
       c.dtype == RunDtype::fp64 ? run_rope<double, true>(c) : run_rope<float, true>(c);
     },
     0, Bf16Operands::fp32_values},

    // The forms' data movement (op_table.hpp, copy_rows and fill; issue 52):
    // what were the op layer's host loops, so that a device runs them too.
    {Device::cpu, Op::copy_rows, "copy_rows", &copy_rows_refusal, &run_copy_rows},
    {Device::cpu, Op::fill, "fill", &fill_refusal, &run_fill},

    // The model's ops (embedding, SwiGLU, cross-entropy, AdamW): their rows
    // here, their op-layer functions in mla/ops_model.hpp. A bf16 run's
    // model ops move fp32 containers (ops_model.hpp, "Precision").
    {Device::cpu, Op::embedding_forward, "embedding", &f64_f32_bf16,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_embedding<decltype(t)>(c); }); }, 0,
     Bf16Operands::fp32_values},
    {Device::cpu, Op::embedding_backward, "embedding", &f64_f32_bf16,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_embedding_backward<decltype(t)>(c); }); },
     0, Bf16Operands::fp32_values},
    {Device::cpu, Op::swiglu_forward, "swiglu", &f64_f32_bf16,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_swiglu<decltype(t)>(c); }); }, 0,
     Bf16Operands::fp32_values},
    {Device::cpu, Op::swiglu_backward, "swiglu", &f64_f32_bf16,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_swiglu_backward<decltype(t)>(c); }); }, 0,
     Bf16Operands::fp32_values},
    {Device::cpu, Op::output_gate_forward, "output_gate", &f64_f32_bf16,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_output_gate<decltype(t)>(c); }); }, 0,
     Bf16Operands::fp32_values},
    {Device::cpu, Op::output_gate_backward, "output_gate", &f64_f32_bf16,
     [](const OpCall& c) {
       by_dtype(c, [&](auto t) { run_output_gate_backward<decltype(t)>(c); });
     },
     0, Bf16Operands::fp32_values},
    {Device::cpu, Op::cross_entropy, "cross_entropy", &f64_f32_bf16,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_cross_entropy<decltype(t)>(c); }); }, 0,
     Bf16Operands::fp32_values},
    {Device::cpu, Op::cross_entropy_backward, "cross_entropy", &f64_f32_bf16,
     [](const OpCall& c) {
       by_dtype(c, [&](auto t) { run_cross_entropy_backward<decltype(t)>(c); });
     },
     0, Bf16Operands::fp32_values},
    {Device::cpu, Op::adamw, "adamw", &f64_f32_bf16,
     [](const OpCall& c) { by_dtype(c, [&](auto t) { run_adamw<decltype(t)>(c); }); }, 0,
     Bf16Operands::fp32_values},
};
#undef LAGA_ROW_DTYPE

}  // namespace

std::span<const KernelRow> cpu_kernel_rows() {
  return kRows;
}

}  // namespace laga::ops
