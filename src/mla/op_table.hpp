// The kernel table: which kernel runs an op, per backend (issue 52, "the
// seam"; docs/architecture.md, "The op layer and the kernel table", and
// "Adding a kernel"). ggml's supports_op is the model: every backend lists
// its kernels as rows (KernelRow), each row saying which (op, dtype, shape)
// it takes, and the op layer (mla/ops.hpp) asks the table for the row to
// run, never a kernel's own switch. A refusal names the unsupported value,
// flashinfer-style ("rope_backward on cuda: no kernel for dtype fp64").
//
// Closed sets are enums end to end: the op (Op), the element type (RunDtype,
// core/precision.hpp: fp64, fp32, or bf16 mixed precision -- bf16 operands,
// fp32 sums), the backend (Device).
//
// What a row is: its device, op and name; `why_not(dtype, shape)`, null when
// the row takes the call, else a sentence naming what it cannot take; `rank`,
// which of several rows taking a call is picked (the lowest; a CPU row whose
// selection follows an environment switch -- LAGA_GEMM_BF16,
// LAGA_FLASH_ISA, LAGA_FLASH_BF16_ISA -- answers `why_not` with that
// switch's current choice, so the switches keep working as they did); and
// `run`, the kernel behind one signature, void(const OpCall&): the call's
// operands in slots, as ggml's tensors carry src[] (the slot layout of each
// op is below, beside the op). `operands` says in what form the op layer
// hands bf16 operands to the row (as bf16, or as fp32 holding bf16 values,
// where a kernel widens).
//
// How a backend registers its rows: one function returning its rows. The
// CPU's (cpu_kernel_rows, op_table_cpu.cpp) are built in, listed in
// kernel_rows() (op_table.cpp); the CUDA rows (cuda/op_table_cuda.cpp) reach
// it only by register_kernel_rows: `laga --device cuda` loads the module
// liblaga_cuda_backend.so at run time and registers its table's rows
// (mla/cuda_backend.hpp). Adding a kernel = its file plus its row.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "core/bf16.hpp"
#include "core/device.hpp"
#include "core/precision.hpp"
#include "kernels/attention.hpp"

namespace laga {
enum class AttentionKind;  // mla/form_spec.hpp: eager, flash
}

namespace laga::ops {

// Where a kernel runs (core/device.hpp): cpu, cuda, or the emulated device
// (the CPU's kernels over device storage, checked: op_table.cpp).
using laga::Device;

// Every computation a form or the model asks the op layer for. Operand slots
// (OpCall::in, OpCall::out) and the shape fields each reads, per op; element
// type per RunDtype (fp64: double; fp32: float; bf16: see KernelRow::operands,
// outputs fp32 unless said). Row-major, strides in elements.
enum class Op {
  // C (m, n) = alpha op(A) op(B) + beta C; op(A) (m, k). in: A, B; out: C.
  // shape: m, n, k, lda, ldb, ldc, trans_a, trans_b; OpCall alpha, beta.
  // bf16: A and B bf16 (KernelRow::operands), C the fp32 sums; the op layer
  // rounds a fresh product (beta 0) afterwards (mla/ops.hpp, "Precision").
  gemm,
  // Multi-head attention (kernels/attention.hpp), shape.attn, and
  // shape.attention (eager or flash, what --attention asked for).
  // forward  in: q, k, v; out: o, stats (flash: lse (B, Hq, Sq); eager:
  //          probs (B, Hq, Sq, Sk)), eager_lse (eager only, may be null).
  // backward in: dout, q, k, v, o, stats, eager_delta (may be null);
  //          out: dq, dk, dv, eager dp scratch (Sq Sk).
  attention_forward,
  attention_backward,
  // Latent-space (absorbed) attention: one shared key/value head
  // (shape.attn.Hk == 1, keys [c | k_pe], values c). Slots as attention_*.
  latent_attention_forward,
  latent_attention_backward,
  // Flash attention with the latent up-projection inside
  // (kernels/attention_flash_latent.hpp); shape.attn, shape.C, shape.dn.
  // forward  in: q, c (ld shape.ld_c), k_pe (ld shape.ld_k_pe), w_kv;
  //          out: o, lse.
  // backward in: the same four, dout, o, lse;
  //          out: dq, dc (ld shape.ld_dc), dk_pe (ld shape.ld_dk_pe), dw_kv (added to).
  fused_latent_attention_forward,
  fused_latent_attention_backward,
  // A ring step's partial output merged into the rank's by log-sum-exp
  // (kernels/lse_merge.hpp). shape.attn: the step's call (B, Sq, dv; causal:
  // the diagonal, the first, copied); shape.rows: the rank's query rows L,
  // shape.cols: heads H, shape.b0, shape.q_row: where the call's rows sit.
  // in: o_p, lse_p; out: o, lse (updated in place).
  lse_merge,
  // RMSNorm (kernels/rmsnorm.hpp) of shape.rows rows of shape.cols.
  // forward  in: x (ld shape.lda), w; out: y, rstd. OpCall::alpha = eps.
  // backward in: dy (ld shape.ldb), x (ld shape.lda), w, rstd;
  //          out: dx (ld shape.ldc), dw (added to).
  rmsnorm_forward,
  rmsnorm_backward,
  // Interleaved RoPE (kernels/rope.hpp, rope_apply / rope_apply_at) in
  // place: shape.batch rows of shape.tokens tokens of shape.heads heads, the
  // token stride shape.ld_token, the head stride shape.ld_head, positions
  // pos0 .. or (in[0], not null) each token's; context: the RopeTable.
  // out: x. backward is the inverse rotation.
  rope_forward,
  rope_backward,
  // Attention over each query row's selected keys (DeepSeek Sparse
  // Attention; kernels/attention_sparse.hpp, gathering the selected rows,
  // no Sq x Sk mask): shape.attn (Hk == Hq per head, Hk == 1 latent; causal
  // and doc_start not read), shape.k: K, the slots a row.
  // forward  in: q, k, v, idx (int32 (B, Sq, K), -1 an empty slot);
  //          out: o, lse (B, Hq, Sq).
  // backward in: dout, q, k, v, o, lse, idx; out: dq, dk, dv (overwritten).
  sparse_attention_forward,
  sparse_attention_backward,
  // DeepSeek Sparse Attention's lightning indexer (kernels/dsa_indexer.hpp;
  // the op layer's functions in mla/ops_dsa.hpp), fp64 and fp32 (bf16 is
  // refused, as the sparse attention's). Dense rows unless said.
  // layernorm_forward   shape.rows rows of shape.cols; in: x, w, bias;
  //                     out: y, mean, rstd. OpCall::alpha = eps.
  // layernorm_backward  in: dy, x, w, mean, rstd; out: dx (overwritten),
  //                     dw, dbias (added to).
  // rope_halves_forward / rope_halves_backward: the indexer's half-split
  //                     RoPE in place on the first table.dim() dims of each
  //                     head: shape.tokens tokens of shape.heads heads,
  //                     strides shape.ld_token, shape.ld_head, positions
  //                     shape.pos0 .. or (in[0], not null) each token's;
  //                     context: the RopeTable. out: x.
  // index_topk          shape.attn (IndexerShape::attn), shape.k: topk;
  //                     in: q, k, w; out: idx (int32 (B, Sq, topk)).
  // index_all_causal    shape.attn, shape.k: the slots a row (Sk);
  //                     out: idx (int32), every causal key (any dtype).
  // indexer_kl          shape.attn, shape.k: topk, shape.n: K slots a row;
  //                     in: idx (int32), p, q, k, w; out: loss (double, B Sq),
  //                     dq, dk, dw (overwritten).
  // kv_fp8_round_trip   DeepSeek's fp8 kv-cache simulation (mla/dsa_rows.hpp,
  //                     dsa_own_rows): shape.rows rows of shape.cols, each
  //                     block of kActQuantBlock rounded through e4m3 with
  //                     ue8m0 scales and back (kernels/fp8_e4m3.hpp,
  //                     fp8_round_trip); out: x, in place. fp64, fp32 and a
  //                     bf16 run's fp32 tensors.
  layernorm_forward,
  layernorm_backward,
  rope_halves_forward,
  rope_halves_backward,
  index_topk,
  index_all_causal,
  indexer_kl,
  kv_fp8_round_trip,
  // The forms' data movement (ops::copy, ops::add, ops::widen, ops::fill,
  // the exchanges' packing; issue 52: on a device these run there, not as
  // host loops over device memory). OpCall::dtype is the element type
  // stored, not the run's precision (move_dtype<T>: fp64 double, fp32
  // float, bf16 the 2-byte values; a bf16 run's fp32 tensors move as fp32).
  // copy_rows  shape.rows x shape.cols; in: src (row stride shape.lda);
  //            out: dst (row stride shape.ldc). dst = src, or dst += src
  //            when shape.accumulate. shape.src_bf16: src holds bf16
  //            values (dtype fp32: widened exactly; dtype bf16: moved as
  //            they are); dtype bf16 from fp32 src: rounded to nearest even
  //            (core/bf16.hpp). A sum into bf16 is refused (copy_rows_refusal).
  // fill       shape.rows x shape.cols; out: dst (row stride shape.ldc),
  //            every element OpCall::alpha (fp64 or fp32).
  copy_rows,
  fill,
  // The model's ops (mla/ops_model.hpp), dense rows (ld = cols):
  // embedding_forward   in: ids (int32, shape.rows), table (shape.n, shape.cols);
  //                     out: rows of the table.
  // embedding_backward  in: dout (rows, cols), ids; out: dtable (added to).
  // swiglu_forward      shape.rows elements; in: a, b; out: h = silu(a) b.
  // swiglu_backward     in: dh, a, b; out: da, db.
  // output_gate_forward  shape.rows elements; in: o, g; out: y = o sigmoid(g)
  //                     (Kimi K3's MLA output gate, kernels/output_gate.hpp).
  // output_gate_backward in: dy, o, g; out: do, dg.
  // cross_entropy       shape.rows x shape.cols logits; in: logits, targets
  //                     (int32); out: loss (rows), lse (double, rows).
  // cross_entropy_backward  in: logits, lse (double), targets; out: dlogits
  //                     (may be the logits); OpCall::alpha: the loss's scale.
  // adamw               shape.rows parameters; in: g; out: p, m, v;
  //                     shape.k: the step; context: the AdamWHyper.
  embedding_forward,
  embedding_backward,
  swiglu_forward,
  swiglu_backward,
  output_gate_forward,
  output_gate_backward,
  cross_entropy,
  cross_entropy_backward,
  adamw,
};
inline constexpr int kOpCount = int(Op::adamw) + 1;

}  // namespace laga::ops

namespace laga {
// In laga, not laga::ops, so that they do not hide laga's other to_string
// overloads inside laga::ops.
const char* to_string(ops::Op op);  // the enumerator's name
}  // namespace laga

namespace laga::ops {

// An op's extents: the fields its row of Op reads (the others stay 0).
struct OpShape {
  // gemm; rmsnorm's strides (lda: x, ldb: dy, ldc: dx)
  std::int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  bool trans_a = false, trans_b = false;
  // the attention ops
  AttnShape attn{};
  AttentionKind attention{};  // attention_*: eager or flash (value-initialised: eager)
  // the fused latent attention: latent width, nope width and operand strides
  std::int64_t C = 0, dn = 0, ld_c = 0, ld_k_pe = 0, ld_dc = 0, ld_dk_pe = 0;
  // row-wise ops (rmsnorm, lse_merge, the model's)
  std::int64_t rows = 0, cols = 0, b0 = 0, q_row = 0;
  // rope
  std::int64_t batch = 0, tokens = 0, heads = 0, ld_token = 0, ld_head = 0, pos0 = 0;
  // gemm and the fused latent attention: the invariant mode's call
  // (op_invariant below): every element summed in the one order of
  // kernels/gemm_invariant.hpp, whatever M (the fused kernel's products too).
  bool invariant = false;
  // copy_rows: the source holds bf16 values; the destination is added to
  bool src_bf16 = false, accumulate = false;
};

// One call as a kernel receives it.
struct OpCall {
  Op op{};
  RunDtype dtype = RunDtype::fp32;
  OpShape shape{};
  const void* in[8] = {};
  void* out[4] = {};
  double alpha = 1, beta = 0;  // gemm; rmsnorm: alpha is eps
  // Scratch the op layer made for the call (a pool tensor, so that the pool
  // and the memory model count it): KernelRow::workspace_bytes of it.
  void* workspace = nullptr;
  std::int64_t workspace_bytes = 0;
  const void* context = nullptr;  // op-specific (rope: the RopeTable; see Op)
};

using KernelFn = void (*)(const OpCall&);

// How a row takes a bf16 call's operands: as bf16, or as fp32 containers
// holding bf16 values (a kernel that widens; the op layer's copies are then
// 4 bytes an element).
enum class Bf16Operands { bf16, fp32_values };

struct KernelRow {
  Device device{};
  Op op{};
  const char* name = "";  // names the kernel in reports: "flash_avx512", "gemm_bf16_onednn"
  // Null when the row takes (dtype, shape) on this machine now; else why not,
  // naming the value (dtype, extent, ISA, switch) it refuses.
  std::optional<std::string> (*why_not)(RunDtype, const OpShape&) = nullptr;
  KernelFn run = nullptr;
  int rank = 0;  // among rows that take a call, the lowest is picked
  Bf16Operands operands = Bf16Operands::bf16;
  // Scratch one call needs besides its operands (null: none).
  std::int64_t (*workspace_bytes)(RunDtype, const OpShape&) = nullptr;
};

// What the table answers: the row it picked, or why none takes the call
// (every row's refusal, joined, or that the device has no row for the op).
struct KernelChoice {
  const KernelRow* row = nullptr;
  std::string why_not;  // empty when row is set
  explicit operator bool() const { return row != nullptr; }
  const char* name() const { return row ? row->name : "none"; }
};

// Each backend's rows (op_table_cpu.cpp; the CUDA backend's file). The
// emulated device's are the CPU's, each with device emulated: the same
// kernels, so a form on it gives the CPU's bits (op_table.cpp).
std::span<const KernelRow> cpu_kernel_rows();
std::span<const KernelRow> emulated_kernel_rows();
#if defined(LAGA_HAVE_CUDA)
std::span<const KernelRow> cuda_kernel_rows();  // for programs linking laga_cuda
#endif
// The CUDA rows for kernel_rows(Device::cuda): the loaded module's (`laga
// --device cuda`, cuda_backend.hpp) or a linking program's (laga_cuda_forms).
void register_kernel_rows(Device device, std::span<const KernelRow> rows);
// Every row of `device` (empty for a device this process has no backend for).
std::span<const KernelRow> kernel_rows(Device device);
// Every device this process has a backend for: cpu, emulated, and cuda once
// its rows are registered.
std::vector<Device> devices_built();

// The row that runs (op, dtype, shape) on `device`, or why none does.
KernelChoice supports(Device device, Op op, RunDtype dtype, const OpShape& shape);
// As supports(), throwing laga::Error with its why_not when none does.
const KernelRow& pick(Device device, Op op, RunDtype dtype, const OpShape& shape);
// Runs `row` on c: on a device whose memory checks operands (the emulated
// one), first refuses an operand that is not that device's memory, naming
// the op and the slot; after a device's kernel, waits for it (the host may
// read what it wrote next: the CUDA pool's memory is managed).
void run_row(const KernelRow& row, const OpCall& c);
// How many kernels run_row has run on `device` in this process (all
// threads): what shows a run went through a device's rows.
std::int64_t kernel_calls(Device device);

// The device this thread's ops run on: cpu unless a UseDevice scope says
// (the CUDA backend's runs; a thread-local as op_precision is).
inline thread_local Device op_device = Device::cpu;
class UseDevice {
 public:
  explicit UseDevice(Device d) : previous_(op_device) { op_device = d; }
  ~UseDevice() { op_device = previous_; }
  UseDevice(const UseDevice&) = delete;
  UseDevice& operator=(const UseDevice&) = delete;

 private:
  Device previous_;
};

// Whether this thread's GEMMs run in the invariant mode (docs/invariance.md):
// every output element summed in one fixed order whatever the row count, the
// thread count or the ISA, so that a row's bits do not depend on how many
// rows its rank holds. The op layer copies it into OpShape::invariant; only
// the gemm_invariant row takes such a call. Off unless a UseInvariant scope
// says (a thread-local, as op_device is).
inline thread_local bool op_invariant = false;
class UseInvariant {
 public:
  explicit UseInvariant(bool on) : previous_(op_invariant) { op_invariant = on; }
  ~UseInvariant() { op_invariant = previous_; }
  UseInvariant(const UseInvariant&) = delete;
  UseInvariant& operator=(const UseInvariant&) = delete;

 private:
  bool previous_;
};

// Why no row takes a copy_rows or fill call (dtype and conversion rules
// every backend shares), null when the call is well formed. Inline: the CUDA
// backend's rows use them without linking laga_mla (src/cuda/CMakeLists.txt).
inline std::optional<std::string> copy_rows_refusal(RunDtype dtype, const OpShape& s) {
  if (s.rows < 0 || s.cols < 0 || s.lda < s.cols || s.ldc < s.cols)
    return "rows " + std::to_string(s.rows) + " x cols " + std::to_string(s.cols) +
           " with row strides lda " + std::to_string(s.lda) + ", ldc " + std::to_string(s.ldc) +
           " (a stride is at least the row)";
  if (s.src_bf16 && dtype == RunDtype::fp64)
    return std::string("bf16 values into fp64 (a bf16 source widens into fp32)");
  // A bf16 destination stores values, never a sum (wire.hpp: a sum is
  // rounded once, where it lands in fp32).
  if (dtype == RunDtype::bf16 && s.accumulate)
    return std::string("a sum into bf16 (bf16 is stored, never added to: add in fp32)");
  return std::nullopt;
}

inline std::optional<std::string> fill_refusal(RunDtype dtype, const OpShape& s) {
  if (dtype == RunDtype::bf16) return std::string("dtype bf16 (fill takes fp32 or fp64)");
  if (s.rows < 0 || s.cols < 0 || s.ldc < s.cols)
    return "rows " + std::to_string(s.rows) + " x cols " + std::to_string(s.cols) +
           " with row stride ldc " + std::to_string(s.ldc) + " (a stride is at least the row)";
  return std::nullopt;
}

// The element type T is stored as, for the data-movement ops (Op::copy_rows,
// Op::fill): what moves, whatever the run's precision.
template <class T>
constexpr RunDtype move_dtype() {
  if constexpr (std::is_same_v<T, double>) {
    return RunDtype::fp64;
  } else if constexpr (std::is_same_v<T, float>) {
    return RunDtype::fp32;
  } else {
    // Anything else would move as bf16: an int32 selection copied through
    // copy_rows came back as -65536 for -1 (ops::cast moves integers).
    static_assert(std::is_same_v<T, laga::bf16>,
                  "move_dtype: the data-movement ops move double, float or bf16; use ops::cast "
                  "for other element types");
    return RunDtype::bf16;
  }
}

// This thread's dtype for T: fp64 for double, else bf16 or fp32 by
// op_precision (core/precision.hpp).
template <class T>
RunDtype op_dtype() {
  if constexpr (std::is_same_v<T, double>) return RunDtype::fp64;
  return op_precision == Precision::bf16 ? RunDtype::bf16 : RunDtype::fp32;
}

}  // namespace laga::ops
