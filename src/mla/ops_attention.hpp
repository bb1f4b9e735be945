// The op layer's attention (mla/ops.hpp's contract: counting, the count-only
// decision and precision handled here, the kernel the kernel table's,
// mla/op_table.hpp): per-head and latent-space attention, the fused latent
// up-projection + attention, and a ring step's lse merge. Forms and the
// block's pieces (form.hpp) call these; none of them asks which kernel or
// ISA runs, or whether the run computes.
//
// Under bf16 mixed precision (T = float, Precision::bf16) q, k, v (and dO)
// are rounded to bf16 (or, held narrowed, read as the bf16 values they are)
// into copies the kernel reads -- bf16, or fp32 holding bf16 values where
// the row the table picked widens -- and the bf16 flash kernel's
// workspace, one pool tensor per call ("bf16 attention scratch"), so that
// the pool and the memory model count them (docs/accounting.md, "bf16
// operand copies and attention scratch"). The copies follow this thread's
// OpenMP thread count, which a count-only run sets to the rank's.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/bf16.hpp"
#include "core/tensor.hpp"
#include "kernels/attention.hpp"
#include "mla/ops.hpp"

namespace laga::ops {

// A read-only operand that does not take part in deducing T (a T* given
// for it converts).
template <class T>
using Src = std::type_identity_t<const T>*;

// Attention operands held narrowed (ops::keep_narrowed, or a ring block
// born narrowed; bf16 runs only): their bf16 values, read in place of the
// fp32 pointers (null then).
struct HeldOperands {
  const bf16 *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr;    // null: count-only
  bool q_held = false, k_held = false, v_held = false, dout_held = false;  // which are held
  std::array<bool, 4> flags() const { return {q_held, k_held, v_held, dout_held}; }
  bool any() const { return q_held || k_held || v_held || dout_held; }
};

// One attention kernel call on raw pointers (s's extents; kind: what
// --attention asked for; stats: eager probabilities (B, Hq, Sq, Sk), flash
// lse (B, Hq, Sq)), and its backward (dq, dk, dv overwritten; dp: eager's
// Sq Sk scratch). Per-head when s.Hk == s.Hq, else latent-space (the
// absorbed form's one shared key/value head): the table's op. A ring step
// asks eager for the lse (eager_lse) and gives its backward the rows'
// D = do . o (eager_delta; kernels/attention.hpp says why).
// scratch: a bf16 run's memory for the call, made by attention_scratch for
// calls no larger than its shape (a caller whose calls' extents follow the
// data makes one for all of them, so that a count-only run, which has no
// documents, allocates what the real one does). Null: the call makes its
// own, exactly its size.
template <class T>
void attention_forward(AttentionKind kind, const AttnShape& s, T* o, T* stats, Src<T> q, Src<T> k,
                       Src<T> v, T* eager_lse = nullptr, const HeldOperands* held = nullptr,
                       Tensor<bf16>* scratch = nullptr);
template <class T>
void attention_backward(AttentionKind kind, const AttnShape& s, T* dq, T* dk, T* dv, Src<T> dout,
                        Src<T> q, Src<T> k, Src<T> v, Src<T> o, Src<T> stats, T* dp,
                        Src<T> eager_delta = nullptr, const HeldOperands* held = nullptr,
                        Tensor<bf16>* scratch = nullptr);
// The scratch of every bf16 attention call (pass) with extents no larger
// than s's and what `held`'s flags say held narrowed (null: none); an empty
// tensor outside bf16 runs.
template <class T>
Tensor<bf16> attention_scratch(AttentionKind kind, const AttnShape& s, AttentionPass pass,
                               const HeldOperands* held = nullptr);

// laga_fused's kernel (kernels/attention_flash_latent.hpp, through the
// table): flash attention with the latent up-projection of the key chunks
// inside. q (B, Sq, H, dn + dr); lat (B, Sk, C + dr) = [c | k_pe] rows;
// w_kv: the heads' rows of wkv_b, (H (dn + dv), C).
template <class T>
struct FusedLatentOperands {
  AttnShape shape;
  std::int64_t C = 0, dn = 0;
  const T* q = nullptr;
  const T* lat = nullptr;  // row stride C + dr
  const T* w_kv = nullptr;
};
// What forward keeps for backward beside its outputs: under bf16 mixed
// precision, w_kv's rows rounded to bf16 values (the fp32 kernel reads them:
// there is no bf16 latent kernel), a pool tensor, so that the pool and the
// memory model count it (made in a count-only run too); empty otherwise.
template <class T>
struct FusedLatentKept {
  Tensor<T> w_kv_rounded;
};
// o (B, Sq, H, dv), lse (B, H, Sq) written.
template <class T>
void fused_latent_attention_forward(const FusedLatentOperands<T>& a, T* o, T* lse,
                                    FusedLatentKept<T>& kept);
// dq (B, Sq, H, dqk), dlat (B, Sk, C + dr) = [dc | dk_pe] overwritten, dw_kv
// (H (dn + dv), C) added to; frees `kept`.
template <class T>
void fused_latent_attention_backward(const FusedLatentOperands<T>& a, T* dq, T* dlat, T* dw_kv,
                                     Src<T> dout, Src<T> o, Src<T> lse, FusedLatentKept<T>& kept);

// A ring step's partial output merged into the rank's (kernels/lse_merge.hpp,
// through the table): o (B, L, H, dv), lse (B, H, L); the call's o_p
// (s.B, s.Sq, H, dv), lse_p (s.B, H, s.Sq), at batch row b0 and query row
// q_row; s.causal: the first (diagonal) call, copied.
template <class T>
void lse_merge(const AttnShape& s, std::int64_t L, std::int64_t H, std::int64_t b0,
               std::int64_t q_row, T* o, T* lse, Src<T> o_p, Src<T> lse_p);

// A ring of eager steps (mla/ring.hpp): a call's probabilities (compact for
// its shape s, at batch row b0 and query row q_row of the rank's L rows and
// H heads) were normalised over its own keys; times e^(lse_p - lse) they
// are the row's over all its keys, which backward reads.
template <class T>
void rescale_probs(const AttnShape& s, std::int64_t L, std::int64_t H, std::int64_t b0,
                   std::int64_t q_row, T* probs, Src<T> lse_p, Src<T> lse) {
  count_elementwise<T>(s.B * H * s.Sq * s.Sk, 2);
  if (!runs(s.B * H * s.Sq, {probs, lse_p, lse})) return;
  for (std::int64_t bb = 0; bb < s.B; ++bb)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        const std::int64_t row = (bb * H + h) * s.Sq + i;
        const T f = std::exp(lse_p[row] - lse[((b0 + bb) * H + h) * L + q_row + i]);
        for (T* p = probs + row * s.Sk; p != probs + (row + 1) * s.Sk; ++p) *p *= f;
      }
}
// The call's rows of a (B, H, L) statistic, compact for its shape (the
// kernels read lse and D that way). Not counted (a gather of a statistic).
template <class T>
void gather_stat_rows(const AttnShape& s, std::int64_t L, std::int64_t H, std::int64_t b0,
                      std::int64_t q_row, Src<T> full, T* part) {
  if (!runs(s.B * s.Sq * H, {full, part})) return;
  for (std::int64_t bb = 0; bb < s.B; ++bb)
    for (std::int64_t h = 0; h < H; ++h)
      std::copy_n(full + ((b0 + bb) * H + h) * L + q_row, s.Sq, part + (bb * H + h) * s.Sq);
}
// D = do . o of every row (B, H, L) from dout and o (B, L, H, dv): what the
// eager backward of a step that holds part of a row's keys needs
// (kernels/attention.hpp, eager_delta).
template <class T>
void attention_delta(std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t dv, T* delta,
                     Src<T> dout, Src<T> o) {
  count_elementwise<T>(B * L * H * dv, 2);
  if (!runs(B * L * H, {delta, dout, o})) return;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < L; ++i)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t off = ((b * L + i) * H + h) * dv;
        T D = 0;
        for (std::int64_t e = 0; e < dv; ++e) D += dout[off + e] * o[off + e];
        delta[(b * H + h) * L + i] = D;
      }
}

// Batch rows issued one call each in a real run, or, in a count-only run
// (every row alike, no documents), row 0's call standing for all B
// (ops::RepeatCounts): how many calls to issue and what each stands for.
struct BatchCalls {
  std::int64_t issued, repeat;
};
inline BatchCalls batch_calls(std::int64_t B) {
  if (current_pool().count_only()) return {B > 0 ? 1 : 0, B};
  return {B, 1};
}

}  // namespace laga::ops
