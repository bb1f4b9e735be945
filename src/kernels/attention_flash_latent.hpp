// Flash attention with the latent up-projection fused in (the paper's §4.7
// future work; docs/forms.md, "laga_fused"). The laga form up-projects the
// gathered latent to its own heads' K_nope and V for every key and stores them
// (B, Sk, H, dn + dr) and (B, Sk, H, dv) before attending; this kernel takes
// the latent itself and computes each key chunk's K_nope and V inside the
// flash loop, so per-head keys and values exist only for kKeyChunk keys at a
// time, in forward and in backward (which recomputes them).
//
// Layout and masking are kernels/attention.hpp's (read it first), multi-head
// (Hq = Hk = H): query row i of batch row b is token i + Sk - Sq, sees keys
// [key_begin(b, i), key_end(i)), causal with packed documents or not causal.
// Per head h and key j (docs/mla-math.md):
//   kv_j   = c_j w_kv[h]^T                        (dn + dv), w_kv[h] (dn + dv, C)
//   k_hj   = [kv_j[0, dn) | k_pe_j]               (dn + dr), k_pe shared by every head
//   v_hj   = kv_j[dn, dn + dv)                    (dv)
// and then attention over q (B, Sq, H, dn + dr), k, v exactly as
// attention_flash_forward / _backward compute it; lse as there (natural log of
// the scaled scores' sum, 0 for a fully masked row).
//
// Backward, with dk_hj, dv_hj the attention's key and value gradients:
//   dc_j    = sum_h [dk_hj[0, dn) | dv_hj] w_kv[h]        (C)
//   dk_pe_j = sum_h dk_hj[dn, dn + dr)  (in head order)   (dr)
//   dw_kv[h] += sum_j [dk_hj[0, dn) | dv_hj]^T c_j         (dn + dv, C)
//
// Products are laga::gemm calls on the chunk (the up-projection and its two
// transposes, all heads at once) and on one (query block, key chunk) tile
// (scores, P V, dP, dQ, dK, dV; on a tile that the mask cuts, one GEMM per
// group of 8 rows or keys over their common range and a loop over the few
// pairs left, attention_flash_latent.cpp). Each sum over keys (o, dq) runs in ascending
// chunk order and each sum over queries (dk, dv) in ascending query-block
// order, each by one thread, and the chunk GEMMs run on the calling thread's
// team: the attention part is bitwise independent of how the threads share
// the tiles; the chunk GEMMs are as deterministic as laga::gemm is (tested
// across thread counts).
//
// Masked pairs are left out by selection, never multiplied by p = 0 (as in
// the flash kernel: a NaN in one token's latent reaches exactly the rows that
// see that token).
#pragma once

#include <cstdint>

#include "kernels/attention.hpp"

namespace laga {

// One call's operands (flashinfer-style: every pointer with its shape).
// shape: B, Sq, Sk, Hq = Hk = H heads, dqk = dn + dr, dv, scale, causal,
// doc_start (B, Sk), all as AttnShape says.
template <class T>
struct LatentAttnParams {
  AttnShape shape;
  std::int64_t C = 0;       // kv_lora_rank: the latent's width
  std::int64_t dn = 0;      // qk_nope_head_dim; dr = shape.dqk - dn is the rope width
  const T* q = nullptr;     // (B, Sq, H, dn + dr), q_pe rotated
  const T* c = nullptr;     // (B, Sk, C), row j of batch b at c + (b Sk + j) ld_c
  std::int64_t ld_c = 0;    // >= C (the gathered latent [c | k_pe]: C + dr)
  const T* k_pe = nullptr;  // (B, Sk, dr) rotated, row stride ld_k_pe
  std::int64_t ld_k_pe = 0;
  const T* w_kv = nullptr;  // (H, dn + dv, C): the heads' rows of wkv_b, k_nope rows then v rows
  // Every product by gemm_invariant (kernels/gemm_invariant.hpp) instead of
  // the library's GEMM: the invariant mode's rows (docs/invariance.md). Its
  // bits then follow neither the thread count nor the shapes beside a
  // product; a head's own bits still follow the heads in the call (dc and
  // dk_pe are sums over them), so the mode calls it one head at a time.
  bool invariant = false;
  std::int64_t dr() const { return shape.dqk - dn; }
  // Throws laga::Error naming the bad extent, stride or null operand
  // (AttnShape::validate's checks included; Hq must equal Hk).
  void validate() const;
};

// Where backward writes: dq (B, Sq, H, dn + dr) and dc (B, Sk, C) and dk_pe
// (B, Sk, dr) (strides ld_dc, ld_dk_pe: one (B, Sk, C + dr) buffer takes both)
// overwritten; dw_kv (H, dn + dv, C) added to (a weight's gradient sums).
template <class T>
struct LatentAttnGrads {
  T* dq = nullptr;
  T* dc = nullptr;
  std::int64_t ld_dc = 0;
  T* dk_pe = nullptr;
  std::int64_t ld_dk_pe = 0;
  T* dw_kv = nullptr;
};

// Keys up-projected at a time: the per-head K_nope and V the kernel holds are
// (kKeyChunk, H (dn + dv)) for forward and as much again for their gradients.
constexpr std::int64_t kLatentKeyChunk = 128;

// o (B, Sq, H, dv) and lse (B, H, Sq) written.
template <class T>
void attention_flash_latent_forward(const LatentAttnParams<T>& p, T* o, T* lse);
// dout (B, Sq, H, dv); o and lse forward's.
template <class T>
void attention_flash_latent_backward(const LatentAttnParams<T>& p, const LatentAttnGrads<T>& g,
                                     const T* dout, const T* o, const T* lse);

// The naive reference: every key's k and v up-projected into (B, Sk, H, .)
// tensors (gemm_reference), attention_reference_forward / _backward on them,
// and the backward's dk, dv taken back through the up-projection by
// gemm_reference. What the fused kernel is tested against.
template <class T>
void attention_latent_reference_forward(const LatentAttnParams<T>& p, T* o, T* lse);
template <class T>
void attention_latent_reference_backward(const LatentAttnParams<T>& p, const LatentAttnGrads<T>& g,
                                         const T* dout);

}  // namespace laga
