// The op layer's attention (ops_attention.hpp). Moved from mla/block.cpp
// (Pieces::attend, attend_backward, attention_scratch and the bf16
// plumbing), form_laga_fused.cpp (the fused kernel's counting and operands)
// and ring.hpp (merge_partial); the kernel each runs is the table's
// (op_table.hpp), where the flash ISA switches used to be asked here.
#include "mla/ops_attention.hpp"

#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "kernels/attention_flash_bf16.hpp"
#include "kernels/attention_flash_latent.hpp"
#include "mla/form_spec.hpp"
#include "mla/op_table.hpp"
#include "mla/ops_bf16.hpp"

namespace laga::ops {

namespace {

Op attention_op(const AttnShape& s, AttentionPass pass) {
  const bool latent = s.Hk != s.Hq;
  if (pass == AttentionPass::forward)
    return latent ? Op::latent_attention_forward : Op::attention_forward;
  return latent ? Op::latent_attention_backward : Op::attention_backward;
}

template <class T>
const KernelRow& attention_row(AttentionKind kind, const AttnShape& s, AttentionPass pass) {
  OpShape shape;
  shape.attn = s, shape.attention = kind;
  return pick(op_device, attention_op(s, pass), op_dtype<T>(), shape);
}

// One bf16 attention call's scratch (attention_forward, _backward): the
// copies of its operands the kernel reads -- bf16 for the VDPBF16PS kernels,
// fp32 holding bf16 values where the table's row widens -- and the
// bf16 kernel's workspace (FlashWorkspace), carved from one pool tensor, so
// that the pool and the memory model count them (they were malloc'd and
// thread scratch outside both, 147 MB beside a 160 MB pool peak at D 2048,
// S 2048: docs/accounting.md, "bf16 operand copies and attention
// scratch"). Each part's bytes are a multiple of 64 (the workspace must be
// 64-byte aligned). The workspace follows this thread's OpenMP thread
// count, which a count-only run sets to the rank's (memory_model.hpp).
struct Bf16AttentionParts {
  std::int64_t q = 0, k = 0, v = 0, dout = 0, workspace = 0;
  std::int64_t bytes() const { return q + k + v + dout + workspace; }
};

std::int64_t whole_lines(std::int64_t bytes) {
  return (bytes + 63) / 64 * 64;
}

// kept: q, k, v, dout held narrowed (their bf16 values are the bf16
// kernel's operands as they are). bound: the workspace of every call with
// extents no larger than s's (a caller sizing one scratch for several such
// calls).
Bf16AttentionParts bf16_attention_parts(const KernelRow& row, const AttnShape& s,
                                        AttentionPass pass, const std::array<bool, 4>& kept,
                                        bool bound) {
  const bool backward = pass == AttentionPass::backward;
  const bool widens = row.operands == Bf16Operands::fp32_values;
  const std::int64_t e = widens ? 4 : 2;
  const auto copy = [&](std::int64_t n, bool is_kept) {
    return is_kept && !widens ? 0 : whole_lines(e * n);
  };
  Bf16AttentionParts p;
  p.q = copy(s.B * s.Sq * s.Hq * s.dqk, kept[0]);
  p.k = copy(s.B * s.Sk * s.Hk * s.dqk, kept[1]);
  p.v = copy(s.B * s.Sk * s.Hk * s.dv, kept[2]);
  p.dout = backward ? copy(s.B * s.Sq * s.Hq * s.dv, kept[3]) : 0;
  if (!widens) {
    // The row's own scratch (KernelRow::workspace_bytes): the CPU's bf16
    // flash rows declare the bf16 flash workspace, and a scratch sized for
    // every call up to s's extents takes that workspace's bound; a CUDA row
    // declares its own (the tiled rows' D, 4 B Hq Sq, monotone in the
    // extents; cuDNN's none: its workspace is the graph's, kept per thread),
    // not the CPU kernel's, so a device holds no CPU scratch.
    OpShape os;
    os.attn = s, os.attention = AttentionKind::flash;
    const std::int64_t own = row.workspace_bytes ? row.workspace_bytes(RunDtype::bf16, os) : 0;
    p.workspace = whole_lines(bound && row.device != Device::cuda
                                  ? attention_flash_bf16_workspace_bound(s, backward)
                                  : own);
  }
  return p;
}

Tensor<bf16> bf16_attention_scratch(const Bf16AttentionParts& p) {
  return Tensor<bf16>({p.bytes() / 2}, "bf16 attention scratch");
}

// The operands a call was given held narrowed (none: null), refused
// outside a bf16 run; and what the call reads of one operand, as runs()
// checks it: the held bf16 values, else x.
template <class T>
HeldOperands held_operands(const HeldOperands* narrowed) {
  LAGA_CHECK(!narrowed || in_bf16<T>(), "internal: narrowed attention operands outside a bf16 run");
  return narrowed ? *narrowed : HeldOperands{};
}
template <class T>
const void* read_ptr(bool held, const bf16* values, const T* x) {
  return held ? static_cast<const void*>(values) : static_cast<const void*>(x);
}

// One attention operand of n values as the row takes it, in `dst`, its
// place in the call's scratch: bf16 (a tensor held narrowed gives its bf16
// values as they are; another's are rounded), or fp32 holding the bf16
// values (widened exactly, or rounded).
const void* bf16_operand(const KernelRow& row, void* dst, const float* x, bool held,
                         const bf16* values, std::int64_t n) {
  if (row.operands == Bf16Operands::fp32_values) {
    if (held)
      bf16_path::to_float_threaded(values, static_cast<float*>(dst), n);
    else
      bf16_path::round_threaded(x, static_cast<float*>(dst), n);
    return dst;
  }
  if (held) return values;
  bf16_path::to_bf16_threaded(x, static_cast<bf16*>(dst), n);
  return dst;
}

// The FLOPs one call counts (ops.hpp, "Op counts"): per (query, key) pair
// and head, forward does q.k (dqk) and p.v (dv). Eager's backward: dv =
// p^T do and dp = do v^T (dv each), dq = ds k and dk = ds^T q (dqk each):
// twice forward. Flash recomputes q.k as well.
void count_call(AttentionKind kind, const AttnShape& s, AttentionPass pass) {
  const double per_pair_forward = double(s.dqk + s.dv);
  const double per_pair =
      pass == AttentionPass::forward
          ? per_pair_forward
          : (kind == AttentionKind::eager ? 2 * per_pair_forward : 3.0 * s.dqk + 2.0 * s.dv);
  count_attention(s, kind, pass,
                  [&] { return s.useful_flops_forward() * per_pair / per_pair_forward; });
}

}  // namespace

template <class T>
void attention_forward(AttentionKind kind, const AttnShape& s, T* o, T* stats, Src<T> q, Src<T> k,
                       Src<T> v, T* eager_lse, const HeldOperands* narrowed,
                       Tensor<bf16>* scratch) {
  const bool eager = kind == AttentionKind::eager;
  count_call(kind, s, AttentionPass::forward);
  // Eager writes the scores, reads them back and writes the probabilities.
  if (eager) count_elementwise<T>(s.B * s.Hq * s.Sq * s.Sk, 3);
  const HeldOperands held = held_operands<T>(narrowed);
  const void* qp = read_ptr(held.q_held, held.q, q);
  const void* kp = read_ptr(held.k_held, held.k, k);
  const void* vp = read_ptr(held.v_held, held.v, v);
  if (in_bf16<T>()) {
    // q, k, v rounded to bf16 (or, held narrowed, read as the bf16 values
    // they are), their products summed in fp32; o and lse come back fp32
    // (attention_flash_bf16.hpp says why), and o is rounded where it enters
    // the output projection's GEMM. The copies and the kernel's workspace
    // are pool tensors, made before runs() so that a count-only run
    // registers them too (ops_bf16.hpp).
    check_precision_supports(Precision::bf16, kind);
    if constexpr (std::is_same_v<T, float>) {
      if (s.B * s.Hq * s.Sq == 0) return;
      const KernelRow& row = attention_row<T>(kind, s, AttentionPass::forward);
      const Bf16AttentionParts parts =
          bf16_attention_parts(row, s, AttentionPass::forward, held.flags(), false);
      Tensor<bf16> own;
      if (!scratch) own = bf16_attention_scratch(parts);
      Tensor<bf16>& buf = scratch ? *scratch : own;
      LAGA_CHECK(buf.bytes() >= parts.bytes(), "internal: a bf16 attention scratch of ",
                 buf.bytes(), " bytes for a call that needs ", parts.bytes());
      if (!runs(s.B * s.Hq * s.Sq, {stats, o, qp, kp, vp})) return;
      const std::int64_t nq = s.B * s.Sq * s.Hq * s.dqk, nk = s.B * s.Sk * s.Hk * s.dqk,
                         nv = s.B * s.Sk * s.Hk * s.dv;
      auto* at = reinterpret_cast<unsigned char*>(buf.data());
      OpCall c;
      c.op = row.op, c.dtype = RunDtype::bf16, c.shape.attn = s, c.shape.attention = kind;
      c.in[0] = bf16_operand(row, at, q, held.q_held, held.q, nq);
      c.in[1] = bf16_operand(row, at + parts.q, k, held.k_held, held.k, nk);
      c.in[2] = bf16_operand(row, at + parts.q + parts.k, v, held.v_held, held.v, nv);
      c.out[0] = o, c.out[1] = stats;
      c.workspace = at + parts.q + parts.k + parts.v, c.workspace_bytes = parts.workspace;
      run_row(row, c);
    }
    return;
  }
  if (!runs(s.B * s.Hq * s.Sq, {stats, o, q, k, v})) return;
  OpCall c;
  const KernelRow& row = attention_row<T>(kind, s, AttentionPass::forward);
  c.op = row.op, c.dtype = op_dtype<T>(), c.shape.attn = s, c.shape.attention = kind;
  c.in[0] = q, c.in[1] = k, c.in[2] = v;
  c.out[0] = o, c.out[1] = stats, c.out[2] = eager ? eager_lse : nullptr;
  run_row(row, c);
}

template <class T>
void attention_backward(AttentionKind kind, const AttnShape& shape, T* dq, T* dk, T* dv,
                        Src<T> dout, Src<T> q, Src<T> k, Src<T> v, Src<T> o, Src<T> stats, T* dp,
                        Src<T> eager_delta, const HeldOperands* narrowed, Tensor<bf16>* scratch) {
  AttnShape s = shape;
  s.one_row_set = op_invariant;  // docs/invariance.md: a head's sums whatever the heads
  const bool eager = kind == AttentionKind::eager;
  count_call(kind, s, AttentionPass::backward);
  // Eager reads the saved probabilities, writes dp and reads it back.
  if (eager) count_elementwise<T>(s.B * s.Hq * s.Sq * s.Sk, 3);
  const HeldOperands held = held_operands<T>(narrowed);
  const void* qp = read_ptr(held.q_held, held.q, q);
  const void* kp = read_ptr(held.k_held, held.k, k);
  const void* vp = read_ptr(held.v_held, held.v, v);
  const void* doutp = read_ptr(held.dout_held, held.dout, dout);
  if (in_bf16<T>()) {
    // dO, q, k, v rounded (the operands of dP = dO V^T, dV = P^T dO and
    // the recomputed scores), or, held narrowed, read as the bf16 values
    // they are; dq, dk, dv are the kernel's fp32 sums. Copies and workspace
    // as in forward: pool tensors made before runs().
    check_precision_supports(Precision::bf16, kind);
    if constexpr (std::is_same_v<T, float>) {
      if (s.B * s.Hq * s.Sq == 0) return;
      const KernelRow& row = attention_row<T>(kind, s, AttentionPass::backward);
      const Bf16AttentionParts parts =
          bf16_attention_parts(row, s, AttentionPass::backward, held.flags(), false);
      Tensor<bf16> own;
      if (!scratch) own = bf16_attention_scratch(parts);
      Tensor<bf16>& buf = scratch ? *scratch : own;
      LAGA_CHECK(buf.bytes() >= parts.bytes(), "internal: a bf16 attention scratch of ",
                 buf.bytes(), " bytes for a call that needs ", parts.bytes());
      if (!runs(s.B * s.Hq * s.Sq, {stats, dq, dk, dv, doutp, qp, kp, vp, o})) return;
      const std::int64_t nq = s.B * s.Sq * s.Hq * s.dqk, nk = s.B * s.Sk * s.Hk * s.dqk,
                         nv = s.B * s.Sk * s.Hk * s.dv, nd = s.B * s.Sq * s.Hq * s.dv;
      auto* at = reinterpret_cast<unsigned char*>(buf.data());
      OpCall c;
      c.op = row.op, c.dtype = RunDtype::bf16, c.shape.attn = s, c.shape.attention = kind;
      c.in[0] =
          bf16_operand(row, at + parts.q + parts.k + parts.v, dout, held.dout_held, held.dout, nd);
      c.in[1] = bf16_operand(row, at, q, held.q_held, held.q, nq);
      c.in[2] = bf16_operand(row, at + parts.q, k, held.k_held, held.k, nk);
      c.in[3] = bf16_operand(row, at + parts.q + parts.k, v, held.v_held, held.v, nv);
      c.in[4] = o, c.in[5] = stats;
      c.out[0] = dq, c.out[1] = dk, c.out[2] = dv;
      c.workspace = at + parts.q + parts.k + parts.v + parts.dout;
      c.workspace_bytes = parts.workspace;
      run_row(row, c);
    }
    return;
  }
  OpCall c;
  const KernelRow& row = attention_row<T>(kind, s, AttentionPass::backward);
  c.op = row.op, c.dtype = op_dtype<T>(), c.shape.attn = s, c.shape.attention = kind;
  // The row's own scratch (the CUDA rows' D), before runs(): ops.hpp.
  const Tensor<bf16> scratch_of_row = row_workspace(row, c, "attention backward scratch");
  if (!runs(s.B * s.Hq * s.Sq, {stats, dq, dk, dv, doutp, qp, kp, vp, eager ? dp : o})) return;
  c.in[0] = dout, c.in[1] = q, c.in[2] = k, c.in[3] = v, c.in[4] = o, c.in[5] = stats;
  c.in[6] = eager ? eager_delta : nullptr;
  c.out[0] = dq, c.out[1] = dk, c.out[2] = dv, c.out[3] = eager ? dp : nullptr;
  run_row(row, c);
}

template <class T>
Tensor<bf16> attention_scratch(AttentionKind kind, const AttnShape& shape, AttentionPass pass,
                               const HeldOperands* held) {
  if (!in_bf16<T>()) return {};
  AttnShape s = shape;
  s.one_row_set = op_invariant && pass == AttentionPass::backward;  // as attention_backward's

  check_precision_supports(Precision::bf16, kind);
  return bf16_attention_scratch(bf16_attention_parts(attention_row<T>(kind, s, pass), s, pass,
                                                     held ? held->flags() : std::array<bool, 4>{},
                                                     true));
}

// ------------------------------------------------ the fused latent attention

namespace {

// Counts what the kernel does (ops.hpp, "Op counts"): its attention as the
// flash kernel's of the same shape (the same tile products), and its chunk
// GEMMs, `passes` up-projection-shaped products per key chunk (1 in
// forward; 3 in backward: the recomputation, dc and dw_kv). Per chunk
// shape, in bulk: a count-only run at S = 10^14 must not walk the chunks.
template <class T>
void count_fused(const FusedLatentOperands<T>& a, AttentionPass pass) {
  if (!op_counter) return;
  const AttnShape& s = a.shape;
  count_call(AttentionKind::flash, s, pass);
  const std::int64_t full = s.Sk / kLatentKeyChunk, rest = s.Sk % kLatentKeyChunk;
  const std::int64_t dr = s.dqk - a.dn, W = a.C + dr, ldkv = s.Hq * (a.dn + s.dv);
  for (const auto& [rows, chunks] : {std::pair{kLatentKeyChunk, full}, std::pair{rest, 1L}}) {
    if (rows == 0 || chunks == 0 || ldkv == 0) continue;
    std::vector<GemmCall> calls{{false, true, rows, ldkv, a.C, W, a.C, ldkv, false}};
    if (pass == AttentionPass::backward) {
      calls.push_back({false, false, rows, a.C, ldkv, ldkv, a.C, W, false});  // dc
      calls.push_back({true, false, ldkv, a.C, rows, ldkv, W, a.C, true});    // dw_kv
    }
    for (const GemmCall& g : calls) op_counter->add_gemm(g, s.B * chunks * op_repeat);
  }
}

template <class T>
OpCall fused_call(const KernelRow& row, const FusedLatentOperands<T>& a) {
  const std::int64_t W = a.C + a.shape.dqk - a.dn;
  OpCall c;
  c.op = row.op, c.dtype = op_dtype<T>();
  c.shape.attn = a.shape, c.shape.attention = AttentionKind::flash;
  c.shape.C = a.C, c.shape.dn = a.dn, c.shape.invariant = op_invariant;
  c.shape.ld_c = W, c.shape.ld_k_pe = W, c.shape.ld_dc = W, c.shape.ld_dk_pe = W;
  return c;
}
template <class T>
OpCall fused_call(const KernelRow& row, const FusedLatentOperands<T>& a, const T* w_kv) {
  OpCall c = fused_call(row, a);
  c.in[0] = a.q, c.in[1] = a.lat, c.in[2] = a.lat + a.C, c.in[3] = w_kv;
  return c;
}

template <class T>
const KernelRow& fused_row(const FusedLatentOperands<T>& a, Op op) {
  OpShape shape;
  shape.attn = a.shape, shape.attention = AttentionKind::flash, shape.C = a.C, shape.dn = a.dn;
  shape.invariant = op_invariant;  // the flash_latent_invariant rows' (op_table_cpu.cpp)
  return pick(op_device, op, op_dtype<T>(), shape);
}

}  // namespace

// Under bf16 the fp32 kernel runs on bf16 values: q and the latent are bf16
// already (GEMM, RMSNorm and RoPE outputs, moved unchanged), and w_kv's rows
// are read from their rounded copy, kept for backward; so its in-kernel K/V
// up-projection and P are fp32, not rounded as explicit's bf16 k_h, v_h and
// the bf16 flash kernel's P are.
template <class T>
void fused_latent_attention_forward(const FusedLatentOperands<T>& a, T* o, T* lse,
                                    FusedLatentKept<T>& kept) {
  const AttnShape& s = a.shape;
  count_fused(a, AttentionPass::forward);
  const KernelRow& row = fused_row(a, Op::fused_latent_attention_forward);
  const std::int64_t w_rows = s.Hq * (a.dn + s.dv);
  if (in_bf16<T>()) {
    // Counted as no op (the rounding is the operand's, as a GEMM's operand
    // copies are not counted either).
    kept.w_kv_rounded = Tensor<T>({w_rows, a.C}, "laga_fused wkv_b rows as bf16 values");
    if constexpr (std::is_same_v<T, float>)
      if (runs(w_rows * a.C, {kept.w_kv_rounded.data(), a.w_kv}))
        bf16_path::round_threaded(a.w_kv, kept.w_kv_rounded.data(), w_rows * a.C);
  }
  const T* w_kv = kept.w_kv_rounded.defined() ? kept.w_kv_rounded.data() : a.w_kv;
  if (!runs(s.B * s.Sq * s.Hq, {o, lse, a.q, a.lat, w_kv})) return;
  OpCall c = fused_call(row, a, w_kv);
  c.out[0] = o, c.out[1] = lse;
  run_row(row, c);
}

template <class T>
void fused_latent_attention_backward(const FusedLatentOperands<T>& a, T* dq, T* dlat, T* dw_kv,
                                     Src<T> dout, Src<T> o, Src<T> lse, FusedLatentKept<T>& kept) {
  const AttnShape& s = a.shape;
  count_fused(a, AttentionPass::backward);
  const KernelRow& row = fused_row(a, Op::fused_latent_attention_backward);
  LAGA_CHECK(kept.w_kv_rounded.defined() == in_bf16<T>(),
             "internal: the fused latent attention's backward at another precision than its "
             "forward");
  const T* w_kv = kept.w_kv_rounded.defined() ? kept.w_kv_rounded.data() : a.w_kv;
  // The row's own scratch (the CUDA row's D), before runs(): ops.hpp.
  OpCall sized = fused_call(row, a);
  const Tensor<bf16> scratch_of_row = row_workspace(row, sized, "fused latent backward scratch");
  if (runs(s.B * s.Sq * s.Hq, {dq, dlat, dout, o, lse, a.q, a.lat, w_kv, dw_kv})) {
    OpCall c = fused_call(row, a, w_kv);
    c.workspace = sized.workspace, c.workspace_bytes = sized.workspace_bytes;
    c.in[4] = dout, c.in[5] = o, c.in[6] = lse;
    c.out[0] = dq, c.out[1] = dlat, c.out[2] = dlat + a.C, c.out[3] = dw_kv;
    run_row(row, c);
  }
  kept.w_kv_rounded.reset();
}

// ------------------------------------------------------------ lse merge

template <class T>
void lse_merge(const AttnShape& s, std::int64_t L, std::int64_t H, std::int64_t b0,
               std::int64_t q_row, T* o, T* lse, Src<T> o_p, Src<T> lse_p) {
  count_elementwise<T>(s.B * s.Sq * H * (s.dv + 1), 3);
  if (!runs(s.B * s.Sq * H, {o, lse, o_p, lse_p})) return;
  OpCall c;
  c.op = Op::lse_merge, c.dtype = op_dtype<T>();
  c.shape.attn = s, c.shape.rows = L, c.shape.cols = H, c.shape.b0 = b0, c.shape.q_row = q_row;
  c.in[0] = o_p, c.in[1] = lse_p;
  c.out[0] = o, c.out[1] = lse;
  run_row(pick(op_device, Op::lse_merge, c.dtype, c.shape), c);
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template void attention_forward<T>(AttentionKind, const AttnShape&, T*, T*, Src<T>, Src<T>,      \
                                     Src<T>, T*, const HeldOperands*, Tensor<bf16>*);              \
  template void attention_backward<T>(AttentionKind, const AttnShape&, T*, T*, T*, Src<T>, Src<T>, \
                                      Src<T>, Src<T>, Src<T>, Src<T>, T*, Src<T>,                  \
                                      const HeldOperands*, Tensor<bf16>*);                         \
  template Tensor<bf16> attention_scratch<T>(AttentionKind, const AttnShape&, AttentionPass,       \
                                             const HeldOperands*);                                 \
  template void fused_latent_attention_forward<T>(const FusedLatentOperands<T>&, T*, T*,           \
                                                  FusedLatentKept<T>&);                            \
  template void fused_latent_attention_backward<T>(const FusedLatentOperands<T>&, T*, T*, T*,      \
                                                   Src<T>, Src<T>, Src<T>, FusedLatentKept<T>&);   \
  template void lse_merge<T>(const AttnShape&, std::int64_t, std::int64_t, std::int64_t,           \
                             std::int64_t, T*, T*, Src<T>, Src<T>);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::ops
