// laga's own attention kernels on the device (attention.cu): the per-head
// and latent-space (absorbed) attention, forward and backward, and the
// laga_fused kernel with the latent up-projection inside its loops. The
// math, layout and masking are the CPU kernels' (kernels/attention.hpp and
// kernels/attention_flash_latent.hpp: read them first); every pointer here
// is a device pointer, the shape's doc_start included ((B, Sk) int64 on the
// device). lse is fp32 (B, Hq, Sq): the natural log of the scaled scores'
// sum, 0 for a fully masked row, what the ring merges read (lse_merge,
// norm_rope.hpp).
//
// Tiles (simple and correct first, docs/performance.md "CUDA backend"): a
// block of 4 warps holds 16 query rows (forward, dq) or 16 keys (dk, dv);
// key chunks of 32 (forward, dq) and query chunks of 16 (dk, dv) stream
// through shared memory in fp32; each lane owns one key of a chunk for the
// scores and a strided set of head dims for the sums, so every sum over keys
// runs in ascending chunk order and each output element is written by one
// thread: no atomics, deterministic, except the fused backward's dc, dk_pe
// and dw_kv, which sum over heads and key tiles with fp32 atomicAdd (their
// order, and so their last bits, vary from run to run). Masked pairs are
// selected away, never multiplied by p = 0 (kernels/attention.hpp).
//
// T is float or laga::bf16 (bf16 storage, fp32 sums). The fused kernel's
// operands are fp32 in both of its dtypes (below): a bf16 run's hold bf16
// values, as the CPU's fused path takes them (mla/ops_attention.hpp,
// FusedLatentKept).
#pragma once

#include <cstdint>
#include <string>

#include "comm/communicator.hpp"  // DType
#include "core/bf16.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash_latent.hpp"

namespace laga::cuda {

// Which kernel: the per-head / latent-space one (Hk = Hq or Hk = 1, or any
// divisor) or the fused latent one.
enum class AttnKernel { dense, fused_latent };
const char* to_string(AttnKernel k);  // "dense", "fused_latent"

// The most head dims a lane holds in registers: dqk <= 32 x kMaxDqkSlots,
// dv <= 32 x kMaxDvSlots (576 and 512: the latent-space keys [c | k_pe] and
// values c of DeepSeek-V3).
constexpr int kMaxDqkSlots = 18;
constexpr int kMaxDvSlots = 16;

// Dynamic shared memory one block of `kernel` needs for these head dims, in
// bytes: the largest of its forward, dq and dk/dv kernels.
std::int64_t attention_smem_bytes(AttnKernel kernel, std::int64_t dqk, std::int64_t dv);

// Empty when these kernels run this shape and dtype on a device that gives a
// block `smem_limit` bytes of shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin:
// 232448 on H100 and H200); otherwise one sentence naming the value that is
// out of range and what to do. Needs no device.
std::string attention_refusal(AttnKernel kernel, const AttnShape& s, DType dtype,
                              std::int64_t smem_limit);

// o (B, Sq, Hq, dv) and lse written. Throws laga::Error with
// attention_refusal's words (read on the current device) when refused.
template <class T>
void attention_forward(const AttnShape& s, T* o, float* lse, const T* q, const T* k, const T* v,
                       void* stream = nullptr);
// dq, dk, dv overwritten; delta: (B, Hq, Sq) fp32 scratch (D_i = do_i . o_i).
template <class T>
void attention_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q,
                        const T* k, const T* v, const T* o, const float* lse, float* delta,
                        void* stream = nullptr);

// laga_fused: LatentAttnParams' operands (device pointers, fp32), o (B, Sq,
// H, dv) and lse fp32. dtype f32: every product fp32 on the CUDA cores.
// dtype bf16 (a bf16 mixed-precision run; docs/performance.md, "The CUDA
// backend"): the rounding points of the CPU's bf16 fused path
// (mla/ops_attention.cpp, fused_latent_attention_forward): q, c, k_pe and
// w_kv hold bf16 values, and the key chunk's up-projection c w_kv^T runs on
// bf16 tensor cores (mma.sync m16n8k16, fp32 sums), c and w_kv rounded to
// bf16 as they are read (exact for bf16 values; an fp32 operand that is not
// one is rounded there); K, V, the scores, P and every gradient stay fp32,
// unrounded, as the CPU path keeps them. So the two differ only by fp32
// summation order (and the tensor cores' fp32 accumulation).
void fused_latent_forward(const LatentAttnParams<float>& p, float* o, float* lse,
                          DType dtype = DType::f32, void* stream = nullptr);
// g.dq overwritten; g.dc and g.dk_pe overwritten (the call zeroes them
// first); g.dw_kv added to. delta: (B, H, Sq) fp32 scratch. dtype as
// forward's: bf16 recomputes the chunks' K and V on tensor cores; dc and
// dw_kv are products of the fp32 [dk | dv] and stay fp32 in both.
void fused_latent_backward(const LatentAttnParams<float>& p, const LatentAttnGrads<float>& g,
                           const float* dout, const float* o, const float* lse, float* delta,
                           DType dtype = DType::f32, void* stream = nullptr);

// The opt-in shared memory per block of the current device (throws without
// one): what attention_refusal's limit is at run time.
std::int64_t device_smem_limit();

}  // namespace laga::cuda
