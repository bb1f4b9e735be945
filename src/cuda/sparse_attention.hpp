// DeepSeek Sparse Attention's main attention on the device (sparse_attention.cu):
// each query row attends only its selected keys, gathered by index, never an
// Sq x Sk mask. The math, layout, empty-slot convention and the bf16 mixed
// precision are the CPU kernel's (kernels/attention_sparse.hpp: read it
// first); every pointer here is a device pointer, idx included.
//
//   q (B, Sq, Hq, dqk)  k (B, Sk, Hk, dqk)  v (B, Sk, Hk, dv)  o (B, Sq, Hq, dv)
//   idx (B, Sq, K) int32, -1 an empty slot (any negative slot is skipped, as
//   the CPU kernel skips them); lse (B, Hq, Sq) fp32. Hk = Hq per head,
//   Hk = 1 the latent (absorbed) form; any divisor of Hq works.
//
// In is float (the fp32 row) or laga::bf16 (the bf16 row: bf16 q, k, v, dO,
// widened exactly); o, lse and the gradients are fp32 either way, as the CPU
// rows' are. The CPU sums in double, these kernels in fp32: the difference
// is fp32 rounding over K slots (the check's bound, cuda/check_sparse.cpp).
//
// Kernels (simple and correct first; nothing here has run on a GPU yet,
// docs/performance.md "The CUDA backend"): one warp a (query row, head):
//   forward  online softmax over the row's slots, lanes holding strided head
//            dims, each q.k a warp reduction in one fixed order;
//   dq       recomputes p from lse, D_i = dO_i . o_i (kept for dk/dv), dq;
//   dk, dv   a deterministic scatter, no atomics: the (key, query) pairs of
//            every non-empty slot are sorted by key then query (cub's radix
//            sort, deterministic), and one warp a (key, key head) walks its
//            pairs in ascending query order, recomputing p and dS, summing
//            into registers, writing each dk, dv element once. So the
//            backward's bits do not vary from run to run and the rows need
//            no refusal of the invariant mode (docs/invariance.md).
// Scratch (SparseAttnScratch below, the one description): the rows'
// workspace (KernelRow::workspace_bytes reads it, so the op layer makes it a
// pool tensor before it asks whether the call computes, and the count-only
// run and the memory model count it) and what the kernels carve it into:
// both passes the selection's device copy (4 B Sq K); backward D (B, Hq, Sq)
// fp32, the sort's two (B Sq K) uint64 key buffers (cub's DoubleBuffer: cub
// then needs no key buffer of its own), (B Sk + 1) int64 offsets and cub's
// temporary storage, bounded from cub's own tuning (sparse_sort_storage_bound;
// the kernel checks cub's size query against it and refuses a larger one).
// At V3.2's latent S 32k (B 1, Hq 128, K 2048): 1.38 GB backward (cub 18 MB of it), 268 MB
// forward.
// The dk/dv walk's weakness: a key every query selects (the first tokens,
// under a causal top-k) is one warp's serial walk over Sq x (Hq / Hk)
// pairs -- in latent space at S 32k, 4M pairs on one warp. Splitting a long
// key's pairs into fixed chunks summed in a fixed order would keep the bits
// and the balance; not done.
#pragma once

#include <cstdint>
#include <string>

#include "core/bf16.hpp"
#include "kernels/attention_sparse.hpp"

namespace laga::cuda {

// The most head dims a lane holds in registers: dqk <= 32 x 18 = 576,
// dv <= 32 x 16 = 512 (DeepSeek-V3.2's latent keys [c | k_pe] and values c).
constexpr int kSparseMaxDqkSlots = 18;
constexpr int kSparseMaxDvSlots = 16;

// The device scratch of one call, each part a multiple of 256 bytes, laid
// out in this order from the workspace's start.
struct SparseAttnScratch {
  std::int64_t idx = 0;      // the selection's device copy, (B, Sq, K) int32: both passes
  std::int64_t delta = 0;    // backward: D (B, Hq, Sq) fp32
  std::int64_t keys = 0;     // backward: each of the sort's two (B Sq K) uint64 key buffers
  std::int64_t offsets = 0;  // backward: (B Sk + 1) int64, each key's first sorted pair
  std::int64_t sort = 0;     // backward: cub's temporary storage, its bound
  std::int64_t backward_part() const { return delta + 2 * keys + offsets + sort; }
  std::int64_t total() const { return idx + backward_part(); }
};
// Needs no device. backward false: the forward's (the selection copy only).
SparseAttnScratch sparse_attention_scratch(const SparseAttnShape& s, bool backward);
// cub::DeviceRadixSort::SortKeys' temporary storage for `pairs` uint64 keys
// of `bits` bits through a DoubleBuffer, bounded over the tuning policies
// this build's cub has for the architectures laga targets (sm_80, sm_90,
// sm_100): the sizes of cub's dispatch (dispatch_radix_sort.cuh,
// InvokeOnesweep) from each policy's constants. Needs no device.
std::int64_t sparse_sort_storage_bound(std::int64_t pairs, int bits);
// The bits the sort orders: enough for the sentinel key B Sk Sq.
int sparse_sort_key_bits(const SparseAttnShape& s);
// cub's own answer for that storage (its size query on the current device:
// needs one). laga_cuda_check holds it to the bound at small and at V3.2's
// sizes, so the first GPU run shows how close the bound is.
std::int64_t sparse_sort_storage_queried(std::int64_t pairs, int bits);

// Empty when these kernels take the shape; else one sentence naming the
// value out of range and what to do. Needs no device.
std::string sparse_attention_refusal(const SparseAttnShape& s);

// o (B, Sq, Hq, dv) and lse written. Throws laga::Error with the refusal's
// words when refused.
template <class In>
void sparse_attention_forward(const SparseAttnShape& s, float* o, float* lse, const In* q,
                              const In* k, const In* v, const std::int32_t* idx,
                              void* stream = nullptr);
// dq, dk, dv overwritten (a key no row selected gets 0). scratch: device
// memory of scratch_bytes >= sparse_attention_scratch(s, true).backward_part()
// (laid out as SparseAttnScratch from delta on); a smaller one is refused.
template <class In>
void sparse_attention_backward(const SparseAttnShape& s, float* dq, float* dk, float* dv,
                               const In* dout, const In* q, const In* k, const In* v,
                               const float* o, const float* lse, const std::int32_t* idx,
                               void* scratch, std::int64_t scratch_bytes, void* stream = nullptr);

}  // namespace laga::cuda
