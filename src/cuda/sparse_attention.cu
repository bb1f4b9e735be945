// DeepSeek Sparse Attention's main attention on the device (contract:
// cuda/sparse_attention.hpp; the math: kernels/attention_sparse.hpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cub/device/device_radix_sort.cuh>
#include <cub/util_type.cuh>
#include <string>

#include "core/error.hpp"
#include "cuda/cuda_error.hpp"
#include "cuda/sparse_attention.hpp"

namespace laga::cuda {

namespace {

constexpr int kWarps = 4;  // warps a block, one (row, head) or (key, key head) each
constexpr int kThreads = 32 * kWarps;
constexpr int kDq = kSparseMaxDqkSlots;
constexpr int kDv = kSparseMaxDvSlots;

// The shape as the kernels read it (SparseAttnShape's members are host-only).
struct SDims {
  std::int64_t B, Sq, Sk, Hq, Hk, dqk, dv, K;
  float scale;
};
SDims sdims_of(const SparseAttnShape& s) {
  const AttnShape& a = s.attn;
  return SDims{a.B, a.Sq, a.Sk, a.Hq, a.Hk, a.dqk, a.dv, s.K, static_cast<float>(a.scale)};
}

__device__ __forceinline__ float ld(const float* p) {
  return *p;
}
__device__ __forceinline__ float ld(const bf16* p) {  // exact widening
  return __uint_as_float(static_cast<unsigned>(p->bits) << 16);
}

// The warp's sum of x, the same order on every lane and every run.
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Lane `lane`'s head dims e = lane + 32 t of a row of width n, into r.
template <int N, class In>
__device__ __forceinline__ void load_row(float (&r)[N], const In* row, std::int64_t n, int lane) {
#pragma unroll
  for (int t = 0; t < N; ++t) {
    const std::int64_t e = lane + 32 * t;
    r[t] = e < n ? ld(row + e) : 0.0f;
  }
}
template <int N, class In>
__device__ __forceinline__ float dot_row(const float (&r)[N], const In* row, std::int64_t n,
                                         int lane) {
  float d = 0;
#pragma unroll
  for (int t = 0; t < N; ++t) {
    const std::int64_t e = lane + 32 * t;
    if (e < n) d += r[t] * ld(row + e);
  }
  return warp_sum(d);
}

// One warp a (batch row, query row, head): row = (b Sq + i) Hq + h.
template <class In>
__global__ void __launch_bounds__(kThreads)
    sparse_forward_kernel(SDims d, const In* q, const In* k, const In* v, const std::int32_t* idx,
                          float* o, float* lse) {
  const std::int64_t row = std::int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= d.B * d.Sq * d.Hq) return;
  const std::int64_t bi = row / d.Hq, h = row % d.Hq, b = bi / d.Sq, i = bi % d.Sq;
  const std::int64_t g = h / (d.Hq / d.Hk);
  float qr[kDq], acc[kDv];
  load_row(qr, q + row * d.dqk, d.dqk, lane);
#pragma unroll
  for (int t = 0; t < kDv; ++t) acc[t] = 0;
  float m = -INFINITY, sum = 0;
  const std::int32_t* r = idx + bi * d.K;
  for (std::int64_t slot = 0; slot < d.K; ++slot) {
    const std::int32_t j = r[slot];
    if (j < 0) continue;
    const std::int64_t kv = (b * d.Sk + j) * d.Hk + g;
    const float s = dot_row(qr, k + kv * d.dqk, d.dqk, lane) * d.scale;
    const float mn = fmaxf(m, s);
    const float c = expf(m - mn), p = expf(s - mn);  // m = -inf: c = 0
    sum = sum * c + p;
    const In* vr = v + kv * d.dv;
#pragma unroll
    for (int t = 0; t < kDv; ++t) {
      const std::int64_t e = lane + 32 * t;
      if (e < d.dv) acc[t] = acc[t] * c + p * ld(vr + e);
    }
    m = mn;
  }
  const bool empty = m == -INFINITY;  // no slot: o = 0, lse = 0
#pragma unroll
  for (int t = 0; t < kDv; ++t) {
    const std::int64_t e = lane + 32 * t;
    if (e < d.dv) o[row * d.dv + e] = empty ? 0.0f : acc[t] / sum;
  }
  if (lane == 0) lse[(b * d.Hq + h) * d.Sq + i] = empty ? 0.0f : m + logf(sum);
}

// dq and D_i = dO_i . o_i, one warp a (row, head) as forward.
template <class In>
__global__ void __launch_bounds__(kThreads)
    sparse_dq_kernel(SDims d, const In* dout, const In* q, const In* k, const In* v, const float* o,
                     const float* lse, const std::int32_t* idx, float* delta, float* dq) {
  const std::int64_t row = std::int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= d.B * d.Sq * d.Hq) return;
  const std::int64_t bi = row / d.Hq, h = row % d.Hq, b = bi / d.Sq, i = bi % d.Sq;
  const std::int64_t g = h / (d.Hq / d.Hk);
  float qr[kDq], dor[kDv], acc[kDq];
  load_row(qr, q + row * d.dqk, d.dqk, lane);
  load_row(dor, dout + row * d.dv, d.dv, lane);
#pragma unroll
  for (int t = 0; t < kDq; ++t) acc[t] = 0;
  const float D = dot_row(dor, o + row * d.dv, d.dv, lane);
  const std::int64_t li = (b * d.Hq + h) * d.Sq + i;
  const float l = lse[li];
  const std::int32_t* r = idx + bi * d.K;
  for (std::int64_t slot = 0; slot < d.K; ++slot) {
    const std::int32_t j = r[slot];
    if (j < 0) continue;
    const std::int64_t kv = (b * d.Sk + j) * d.Hk + g;
    const In* kr = k + kv * d.dqk;
    const float p = expf(dot_row(qr, kr, d.dqk, lane) * d.scale - l);
    const float ds = p * (dot_row(dor, v + kv * d.dv, d.dv, lane) - D);
#pragma unroll
    for (int t = 0; t < kDq; ++t) {
      const std::int64_t e = lane + 32 * t;
      if (e < d.dqk) acc[t] += ds * ld(kr + e);
    }
  }
#pragma unroll
  for (int t = 0; t < kDq; ++t) {
    const std::int64_t e = lane + 32 * t;
    if (e < d.dqk) dq[row * d.dqk + e] = acc[t] * d.scale;
  }
  if (lane == 0) delta[li] = D;
}

// The sort keys: pair (b, i, slot) -> (b Sk + j) Sq + i, an empty slot the
// sentinel B Sk Sq (sorted last).
__global__ void sparse_pair_keys_kernel(SDims d, const std::int32_t* idx,
                                        unsigned long long* keys) {
  const std::int64_t n = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= d.B * d.Sq * d.K) return;
  const std::int64_t bi = n / d.K, b = bi / d.Sq, i = bi % d.Sq;
  const std::int32_t j = idx[n];
  keys[n] = j < 0 ? static_cast<unsigned long long>(d.B * d.Sk * d.Sq)
                  : static_cast<unsigned long long>((b * d.Sk + j) * d.Sq + i);
}

// offsets[bj], bj in [0, B Sk]: the first sorted pair of key bj = b Sk + j
// (a lower bound; offsets[B Sk] the count of non-empty slots).
__global__ void sparse_key_offsets_kernel(SDims d, const unsigned long long* sorted, std::int64_t n,
                                          std::int64_t* offsets) {
  const std::int64_t bj = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bj > d.B * d.Sk) return;
  const unsigned long long want = static_cast<unsigned long long>(bj * d.Sq);
  std::int64_t lo = 0, hi = n;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    if (sorted[mid] < want)
      lo = mid + 1;
    else
      hi = mid;
  }
  offsets[bj] = lo;
}

// dk, dv: one warp a (batch row, key, key head), row = (b Sk + j) Hk + g,
// walking the key's pairs in ascending query order, each of the group's
// query heads in ascending order.
template <class In>
__global__ void __launch_bounds__(kThreads)
    sparse_dkdv_kernel(SDims d, const In* dout, const In* q, const In* k, const In* v,
                       const float* lse, const float* delta, const unsigned long long* sorted,
                       const std::int64_t* offsets, float* dk, float* dv) {
  const std::int64_t row = std::int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= d.B * d.Sk * d.Hk) return;
  const std::int64_t bj = row / d.Hk, g = row % d.Hk, b = bj / d.Sk;
  const std::int64_t group = d.Hq / d.Hk;
  float kr[kDq], vr[kDv], dka[kDq], dva[kDv];
  load_row(kr, k + row * d.dqk, d.dqk, lane);
  load_row(vr, v + row * d.dv, d.dv, lane);
#pragma unroll
  for (int t = 0; t < kDq; ++t) dka[t] = 0;
#pragma unroll
  for (int t = 0; t < kDv; ++t) dva[t] = 0;
  for (std::int64_t n = offsets[bj]; n < offsets[bj + 1]; ++n) {
    const std::int64_t i =
        static_cast<std::int64_t>(sorted[n] % static_cast<unsigned long long>(d.Sq));
    for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
      const std::int64_t qrow = (b * d.Sq + i) * d.Hq + h, li = (b * d.Hq + h) * d.Sq + i;
      const In* qp = q + qrow * d.dqk;
      const In* dop = dout + qrow * d.dv;
      const float p = expf(dot_row(kr, qp, d.dqk, lane) * d.scale - lse[li]);
      const float ds = p * (dot_row(vr, dop, d.dv, lane) - delta[li]);
#pragma unroll
      for (int t = 0; t < kDv; ++t) {
        const std::int64_t e = lane + 32 * t;
        if (e < d.dv) dva[t] += p * ld(dop + e);
      }
#pragma unroll
      for (int t = 0; t < kDq; ++t) {
        const std::int64_t e = lane + 32 * t;
        if (e < d.dqk) dka[t] += ds * ld(qp + e);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kDq; ++t) {
    const std::int64_t e = lane + 32 * t;
    if (e < d.dqk) dk[row * d.dqk + e] = dka[t] * d.scale;
  }
#pragma unroll
  for (int t = 0; t < kDv; ++t) {
    const std::int64_t e = lane + 32 * t;
    if (e < d.dv) dv[row * d.dv + e] = dva[t];
  }
}

unsigned blocks_for(std::int64_t items, std::int64_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

std::int64_t whole_256(std::int64_t bytes) {  // cub's alignment (AliasTemporaries)
  return (bytes + 255) / 256 * 256;
}

// cub's InvokeOnesweep sizes for one tuning policy, keys only, through a
// DoubleBuffer (is_overwrite_okay: no extra key buffer), summed as
// AliasTemporaries sums them; the single-tile path asks 1 byte.
template <class Policy>
std::int64_t onesweep_storage(std::int64_t n, int bits) {
  using Offset = cub::detail::choose_offset_t<std::int64_t>;  // SortKeys' for an int64 count
  constexpr std::int64_t kBits = Policy::ONESWEEP_RADIX_BITS, kDigits = std::int64_t(1) << kBits;
  constexpr std::int64_t kTile = std::int64_t(Policy::OnesweepPolicy::ITEMS_PER_THREAD) *
                                 Policy::OnesweepPolicy::BLOCK_THREADS;
  constexpr std::int64_t kPortion = ((std::int64_t(1) << 28) - 1) / kTile * kTile;
  static_assert(Policy::ONESWEEP, "cub's radix sort policy for 64-bit keys is not onesweep");
  const std::int64_t passes = (bits + kBits - 1) / kBits, portions = (n + kPortion - 1) / kPortion,
                     blocks = (std::min(n, kPortion) + kTile - 1) / kTile;
  return whole_256(portions * passes * kDigits * std::int64_t(sizeof(Offset))) +  // bins
         whole_256(blocks * kDigits * 4) +                                        // lookback
         whole_256(portions * passes * 4) + 255;                                  // counters
}

}  // namespace

std::int64_t sparse_sort_storage_bound(std::int64_t pairs, int bits) {
  using Hub = cub::detail::radix::policy_hub<unsigned long long, cub::NullType,
                                             cub::detail::choose_offset_t<std::int64_t>>;
  if (pairs <= 0) return 256;
  return std::max({std::int64_t(256), onesweep_storage<Hub::Policy800>(pairs, bits),
                   onesweep_storage<Hub::Policy900>(pairs, bits),
                   onesweep_storage<Hub::Policy1000>(pairs, bits)});
}

std::int64_t sparse_sort_storage_queried(std::int64_t pairs, int bits) {
  cub::DoubleBuffer<unsigned long long> none(nullptr, nullptr);
  std::size_t bytes = 0;
  check_cuda(cub::DeviceRadixSort::SortKeys(nullptr, bytes, none, pairs, 0, bits),
             "cub::DeviceRadixSort::SortKeys (size query)");
  return static_cast<std::int64_t>(bytes);
}

int sparse_sort_key_bits(const SparseAttnShape& s) {
  const auto top = static_cast<unsigned long long>(s.attn.B * s.attn.Sk * s.attn.Sq);
  int bits = 1;
  while (bits < 64 && (top >> bits) != 0) ++bits;
  return bits;
}

SparseAttnScratch sparse_attention_scratch(const SparseAttnShape& s, bool backward) {
  const AttnShape& a = s.attn;
  const std::int64_t pairs = a.B * a.Sq * s.K;
  SparseAttnScratch w;
  w.idx = whole_256(4 * pairs);
  if (!backward || a.B * a.Sq * a.Hq == 0) return w;
  w.delta = whole_256(4 * a.B * a.Hq * a.Sq);
  w.keys = whole_256(8 * pairs);
  w.offsets = whole_256(8 * (a.B * a.Sk + 1));
  w.sort = whole_256(sparse_sort_storage_bound(pairs, sparse_sort_key_bits(s)));
  return w;
}

namespace {

void refuse_or_run(const SparseAttnShape& s) {
  s.validate();
  const std::string why = sparse_attention_refusal(s);
  LAGA_CHECK(why.empty(), why);
}

}  // namespace

std::string sparse_attention_refusal(const SparseAttnShape& s) {
  const AttnShape& a = s.attn;
  if (a.dqk > 32 * kSparseMaxDqkSlots)
    return cat("cuda sparse attention: head dim dqk ", a.dqk, " is above ", 32 * kSparseMaxDqkSlots,
               " (a lane holds ", kSparseMaxDqkSlots,
               " dims in registers); run it on the CPU (--device cpu)");
  if (a.dv > 32 * kSparseMaxDvSlots)
    return cat("cuda sparse attention: head dim dv ", a.dv, " is above ", 32 * kSparseMaxDvSlots,
               " (a lane holds ", kSparseMaxDvSlots,
               " dims in registers); run it on the CPU (--device cpu)");
  if (a.Hk <= 0 || a.Hq % a.Hk != 0)
    return cat("cuda sparse attention: query heads (", a.Hq,
               ") must be a positive multiple of key/value heads (", a.Hk, ")");
  // The sort keys (b Sk + j) Sq + i and the grids of warps.
  const double pairs = double(a.B) * double(a.Sk) * double(a.Sq);
  if (pairs >= 9.0e18)
    return cat("cuda sparse attention: B ", a.B, " x Sk ", a.Sk, " x Sq ", a.Sq,
               " does not fit the 64-bit sort key; split the batch");
  // Blocks a launch: warps of rows or keys, kWarps a block; 256 pairs or keys a block.
  const double warps = std::max(double(a.B) * double(a.Sq) * double(a.Hq),
                                double(a.B) * double(a.Sk) * double(a.Hk));
  const double items =
      std::max(double(a.B) * double(a.Sq) * double(s.K), double(a.B) * double(a.Sk));
  if (warps / kWarps >= double(INT_MAX) || items / 256 >= double(INT_MAX))
    return cat("cuda sparse attention: B ", a.B, " Sq ", a.Sq, " Sk ", a.Sk, " K ", s.K,
               " is beyond one launch's grid; split the batch");
  return "";
}

template <class In>
void sparse_attention_forward(const SparseAttnShape& s, float* o, float* lse, const In* q,
                              const In* k, const In* v, const std::int32_t* idx, void* stream) {
  refuse_or_run(s);
  const AttnShape& a = s.attn;
  const std::int64_t rows = a.B * a.Sq * a.Hq;
  if (rows == 0) return;
  sparse_forward_kernel<In>
      <<<blocks_for(rows, kWarps), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          sdims_of(s), q, k, v, idx, o, lse);
  check_cuda(cudaGetLastError(), "launch of sparse_forward_kernel");
}

template <class In>
void sparse_attention_backward(const SparseAttnShape& s, float* dq, float* dk, float* dv,
                               const In* dout, const In* q, const In* k, const In* v,
                               const float* o, const float* lse, const std::int32_t* idx,
                               void* scratch, std::int64_t scratch_bytes, void* stream) {
  refuse_or_run(s);
  const AttnShape& a = s.attn;
  auto* st = static_cast<cudaStream_t>(stream);
  const SDims d = sdims_of(s);
  const std::int64_t rows = a.B * a.Sq * a.Hq, pairs = a.B * a.Sq * s.K, keys = a.B * a.Sk;
  if (keys * a.Hk > 0 && rows == 0) {  // no query: every key's gradient is 0
    check_cuda(cudaMemsetAsync(dk, 0, sizeof(float) * keys * a.Hk * a.dqk, st), "cudaMemset dk");
    check_cuda(cudaMemsetAsync(dv, 0, sizeof(float) * keys * a.Hk * a.dv, st), "cudaMemset dv");
    return;
  }
  if (rows == 0) return;
  // The scratch as SparseAttnScratch lays it out (from delta on).
  const SparseAttnScratch w = sparse_attention_scratch(s, true);
  LAGA_CHECK(scratch && scratch_bytes >= w.backward_part(),
             "cuda sparse attention backward: a scratch of ", scratch_bytes,
             " bytes where the shape needs ", w.backward_part(),
             " (cuda/sparse_attention.hpp, sparse_attention_scratch)");
  auto* at = static_cast<unsigned char*>(scratch);
  auto* delta = reinterpret_cast<float*>(at);
  auto* unsorted = reinterpret_cast<unsigned long long*>(at + w.delta);
  auto* alternate = reinterpret_cast<unsigned long long*>(at + w.delta + w.keys);
  auto* offsets = reinterpret_cast<std::int64_t*>(at + w.delta + 2 * w.keys);
  void* sort_storage = at + w.delta + 2 * w.keys + w.offsets;
  sparse_dq_kernel<In>
      <<<blocks_for(rows, kWarps), kThreads, 0, st>>>(d, dout, q, k, v, o, lse, idx, delta, dq);
  check_cuda(cudaGetLastError(), "launch of sparse_dq_kernel");
  sparse_pair_keys_kernel<<<blocks_for(pairs, 256), 256, 0, st>>>(d, idx, unsorted);
  check_cuda(cudaGetLastError(), "launch of sparse_pair_keys_kernel");
  const int bits = sparse_sort_key_bits(s);
  cub::DoubleBuffer<unsigned long long> sort_keys(unsorted, alternate);
  std::size_t temp_bytes = 0;
  check_cuda(cub::DeviceRadixSort::SortKeys(nullptr, temp_bytes, sort_keys, pairs, 0, bits, st),
             "cub::DeviceRadixSort::SortKeys (size query)");
  LAGA_CHECK(static_cast<std::int64_t>(temp_bytes) <= w.sort,
             "cuda sparse attention backward: cub's radix sort asks ", temp_bytes,
             " bytes of temporary storage for ", pairs, " keys of ", bits,
             " bits, above the bound sparse_sort_storage_bound gives (", w.sort,
             "): this cub's tuning for the device is not one the bound reads "
             "(cuda/sparse_attention.cu); report it with the device and the CUDA version");
  temp_bytes = static_cast<std::size_t>(w.sort);
  check_cuda(
      cub::DeviceRadixSort::SortKeys(sort_storage, temp_bytes, sort_keys, pairs, 0, bits, st),
      "cub::DeviceRadixSort::SortKeys");
  const unsigned long long* sorted = sort_keys.Current();  // either buffer, by the passes
  sparse_key_offsets_kernel<<<blocks_for(keys + 1, 256), 256, 0, st>>>(d, sorted, pairs, offsets);
  check_cuda(cudaGetLastError(), "launch of sparse_key_offsets_kernel");
  sparse_dkdv_kernel<In><<<blocks_for(keys * a.Hk, kWarps), kThreads, 0, st>>>(
      d, dout, q, k, v, lse, delta, sorted, offsets, dk, dv);
  check_cuda(cudaGetLastError(), "launch of sparse_dkdv_kernel");
  // The scratch is the caller's: a pool tensor freed after the op layer's
  // run_row synchronises (mla/op_table.cpp), so the kernels have finished.
}

#define LAGA_INSTANTIATE(In)                                                                      \
  template void sparse_attention_forward<In>(const SparseAttnShape&, float*, float*, const In*,   \
                                             const In*, const In*, const std::int32_t*, void*);   \
  template void sparse_attention_backward<In>(                                                    \
      const SparseAttnShape&, float*, float*, float*, const In*, const In*, const In*, const In*, \
      const float*, const float*, const std::int32_t*, void*, std::int64_t, void*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(bf16)
#undef LAGA_INSTANTIATE

}  // namespace laga::cuda
