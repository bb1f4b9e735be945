// laga's attention kernels on the device (contract: cuda/attention.hpp).
//
// One tile kernel per pass, templated on where a key chunk's K and V come
// from (FlashAttention's kernel + traits split): DenseKv reads them from
// (B, Sk, Hk, d) tensors, LatentKv makes them from the gathered latent and
// wkv_b (laga_fused: per head, per chunk, in shared memory, never stored for
// all keys), with fp32 sums on the CUDA cores (LatentKv, the fp32 kernel) or
// on bf16 tensor cores (LatentKvTensorCore, the bf16 kernel).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "core/error.hpp"
#include "cuda/attention.hpp"
#include "cuda/cuda_error.hpp"
#include "cuda/mma_fragment.hpp"

namespace laga::cuda {

namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMq = 16;  // query rows of a forward / dq block
constexpr int kNk = 32;  // keys of a chunk (one per lane)
constexpr int kRowsPerWarp = kMq / kWarps;
constexpr int kKt = 16;  // keys of a dk/dv block
constexpr int kQc = 16;  // queries of a dk/dv chunk (one per lane of the first half-warp)
constexpr int kKeysPerWarp = kKt / kWarps;

// The shape as the kernels read it (AttnShape's members are host-only).
struct Dims {
  std::int64_t B, Sq, Sk, Hq, Hk, dqk, dv;
  float scale;
  bool causal;
  const std::int64_t* doc_start;  // device, (B, Sk) or null
  __device__ std::int64_t key_end(std::int64_t i) const {
    if (!causal) return Sk;
    const std::int64_t e = i + Sk - Sq + 1;
    return e < 0 ? 0 : (e > Sk ? Sk : e);
  }
  __device__ std::int64_t key_begin(std::int64_t b, std::int64_t i) const {
    const std::int64_t t = i + Sk - Sq;
    return doc_start == nullptr || t < 0 ? 0 : doc_start[b * Sk + t];
  }
};

Dims dims_of(const AttnShape& s) {
  return Dims{s.B,      s.Sq,       s.Sk, s.Hq, s.Hk, s.dqk, s.dv, static_cast<float>(s.scale),
              s.causal, s.doc_start};
}

__device__ __forceinline__ float ld(const float* p) {
  return *p;
}
__device__ __forceinline__ float ld(const bf16* p) {
  return __uint_as_float(static_cast<unsigned>(p->bits) << 16);
}
__device__ __forceinline__ void st(float* p, float v) {
  *p = v;
}
__device__ __forceinline__ void st(bf16* p, float v) {
  p->bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// K and V of keys [j0, j0 + n) of key head hk of batch row b, into shared
// rows sk (stride ldk) and sv (stride ldv), by every thread of the block.
template <class T>
struct DenseKv {
  const T* k;
  const T* v;
  __device__ void load(const Dims& d, float* sk, int ldk, float* sv, int ldv, std::int64_t b,
                       std::int64_t hk, std::int64_t j0, int n) const {
    for (std::int64_t x = threadIdx.x; x < n * d.dqk; x += blockDim.x) {
      const std::int64_t jj = x / d.dqk, e = x % d.dqk;
      sk[jj * ldk + e] = ld(k + ((b * d.Sk + j0 + jj) * d.Hk + hk) * d.dqk + e);
    }
    for (std::int64_t x = threadIdx.x; x < n * d.dv; x += blockDim.x) {
      const std::int64_t jj = x / d.dv, e = x % d.dv;
      sv[jj * ldv + e] = ld(v + ((b * d.Sk + j0 + jj) * d.Hk + hk) * d.dv + e);
    }
  }
};

// laga_fused: head hk's K = [c w_kv[hk][0, dn)^T | k_pe], V = c w_kv[hk][dn, dn + dv)^T.
struct LatentKv {
  const float* c;
  std::int64_t ld_c;
  const float* k_pe;
  std::int64_t ld_k_pe;
  const float* w;  // (H, dn + dv, C)
  std::int64_t C, dn;
  __device__ void load(const Dims& d, float* sk, int ldk, float* sv, int ldv, std::int64_t b,
                       std::int64_t hk, std::int64_t j0, int n) const {
    const std::int64_t rows = dn + d.dv, dr = d.dqk - dn;
    for (std::int64_t x = threadIdx.x; x < n * rows; x += blockDim.x) {
      const std::int64_t jj = x / rows, e = x % rows;
      const float* cr = c + (b * d.Sk + j0 + jj) * ld_c;
      const float* wr = w + (hk * rows + e) * C;
      float acc = 0.f;
      for (std::int64_t q = 0; q < C; ++q) acc = fmaf(cr[q], wr[q], acc);
      if (e < dn)
        sk[jj * ldk + e] = acc;
      else
        sv[jj * ldv + (e - dn)] = acc;
    }
    for (std::int64_t x = threadIdx.x; x < n * dr; x += blockDim.x) {
      const std::int64_t jj = x / dr, r = x % dr;
      sk[jj * ldk + dn + r] = k_pe[(b * d.Sk + j0 + jj) * ld_k_pe + r];
    }
  }
};

// Two fp32 values rounded to bf16, packed as one register of an mma
// fragment: lo in the low half (mma_fragment.hpp). Exact for values that are
// bf16 values already.
__device__ __forceinline__ unsigned bf16_pair(float lo, float hi) {
  return static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         (static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}

// laga_fused under bf16 mixed precision (cuda/attention.hpp,
// fused_latent_forward): LatentKv with the up-projection c w_kv[hk]^T on bf16
// tensor cores, fp32 sums; the rest (k_pe, then the attention) as LatentKv.
// Each warp takes 16-key x 8-row output tiles of the chunk in turn and runs
// over C in steps of 16, its fragments read straight from c and w_kv (fp32
// holding bf16 values, rounded to bf16 in registers: exact), zero past the
// chunk's keys, the head's rows and C. A padded row or column only meets
// zeros and is not stored; a NaN in key j's latent reaches key j's row
// only, as in LatentKv. Below sm_80 (no bf16 mma) it is LatentKv itself:
// the same products of the same bf16 values, fp32 sums.
struct LatentKvTensorCore : LatentKv {
  __device__ void load(const Dims& d, float* sk, int ldk, float* sv, int ldv, std::int64_t b,
                       std::int64_t hk, std::int64_t j0, int n) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    LatentKv::load(d, sk, ldk, sv, ldv, b, hk, j0, n);
#else
    const std::int64_t rows = dn + d.dv, dr = d.dqk - dn;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int mt = (n + mma::kM - 1) / mma::kM;
    const int nt = static_cast<int>((rows + mma::kN - 1) / mma::kN);
    const float* cb = c + (b * d.Sk + j0) * ld_c;           // the chunk's first key
    const float* wb = w + hk * rows * C;                    // the head's first row
    for (int tile = warp; tile < mt * nt; tile += warps) {  // warp-uniform: mma needs every lane
      const int m0 = (tile / nt) * mma::kM, n0 = (tile % nt) * mma::kN;
      float acc[mma::kCElems] = {0.f, 0.f, 0.f, 0.f};
      for (std::int64_t k0 = 0; k0 < C; k0 += mma::kK) {
        const auto a_at = [&](int i) {
          const std::int64_t at = mma::latent_a_offset(lane, i, m0, k0, n, C, ld_c);
          return at < 0 ? 0.f : cb[at];
        };
        const auto b_at = [&](int i) {
          const std::int64_t at = mma::latent_b_offset(lane, i, n0, k0, rows, C);
          return at < 0 ? 0.f : wb[at];
        };
        const unsigned a0 = bf16_pair(a_at(0), a_at(1)), a1 = bf16_pair(a_at(2), a_at(3)),
                       a2 = bf16_pair(a_at(4), a_at(5)), a3 = bf16_pair(a_at(6), a_at(7));
        const unsigned b0 = bf16_pair(b_at(0), b_at(1)), b1 = bf16_pair(b_at(2), b_at(3));
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      }
#pragma unroll
      for (int i = 0; i < mma::kCElems; ++i) {
        const mma::Coord x = mma::c_coord(lane, i);
        const int jj = m0 + x.row;
        const std::int64_t e = n0 + x.col;
        if (jj >= n || e >= rows) continue;
        if (e < dn)
          sk[jj * ldk + e] = acc[i];
        else
          sv[jj * ldv + (e - dn)] = acc[i];
      }
    }
    for (std::int64_t x = threadIdx.x; x < n * dr; x += blockDim.x) {
      const std::int64_t jj = x / dr, r = x % dr;
      sk[jj * ldk + dn + r] = k_pe[(b * d.Sk + j0 + jj) * ld_k_pe + r];
    }
#endif
  }
};

__device__ float dot(const float* a, const float* b, std::int64_t n) {
  float acc = 0.f;
  for (std::int64_t e = 0; e < n; ++e) acc = fmaf(a[e], b[e], acc);
  return acc;
}

// Forward: one block per (16 query rows, query head, batch row).
template <class T, class Kv>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(Dims d, Kv kv, const T* q, T* o, float* lse) {
  extern __shared__ float sm[];
  const std::int64_t b = blockIdx.z, h = blockIdx.y, i0 = std::int64_t(blockIdx.x) * kMq;
  const std::int64_t hk = h / (d.Hq / d.Hk);
  const int ldk = static_cast<int>(d.dqk) + 1, ldv = static_cast<int>(d.dv);
  float* sq = sm;
  float* sk = sq + kMq * d.dqk;
  float* sv = sk + kNk * ldk;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (std::int64_t x = threadIdx.x; x < kMq * d.dqk; x += blockDim.x) {
    const std::int64_t r = x / d.dqk, e = x % d.dqk, i = i0 + r;
    sq[x] = i < d.Sq ? ld(q + ((b * d.Sq + i) * d.Hq + h) * d.dqk + e) : 0.f;
  }
  const std::int64_t last = (i0 + kMq < d.Sq ? i0 + kMq : d.Sq) - 1;
  const std::int64_t lo = d.key_begin(b, i0), hi = d.key_end(last);
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kMaxDvSlots];
  std::int64_t kb[kRowsPerWarp], ke[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const std::int64_t i = i0 + warp * kRowsPerWarp + rr;
    m[rr] = -INFINITY, l[rr] = 0.f;
    kb[rr] = i < d.Sq ? d.key_begin(b, i) : 0;
    ke[rr] = i < d.Sq ? d.key_end(i) : 0;
#pragma unroll
    for (int s = 0; s < kMaxDvSlots; ++s) acc[rr][s] = 0.f;
  }
  for (std::int64_t j0 = lo; j0 < hi; j0 += kNk) {
    const int n = static_cast<int>(hi - j0 < kNk ? hi - j0 : kNk);
    __syncthreads();
    kv.load(d, sk, ldk, sv, ldv, b, hk, j0, n);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const std::int64_t j = j0 + lane;
      const bool valid = lane < n && j >= kb[rr] && j < ke[rr];
      const float s = valid ? d.scale * dot(sq + r * d.dqk, sk + lane * ldk, d.dqk) : -INFINITY;
      const float cmax = warp_max(s);
      if (cmax == -INFINITY) continue;  // no key of this chunk for this row (warp-uniform)
      const float m_new = fmaxf(m[rr], cmax);
      const float alpha = m[rr] == -INFINITY ? 0.f : expf(m[rr] - m_new);
      const float p = valid ? expf(s - m_new) : 0.f;
      l[rr] = l[rr] * alpha + warp_sum(p);
#pragma unroll
      for (int sl = 0; sl < kMaxDvSlots; ++sl) acc[rr][sl] *= alpha;
      for (int jj = 0; jj < n; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, p, jj);
        const int vj = __shfl_sync(0xffffffffu, valid ? 1 : 0, jj);
        if (!vj) continue;  // selected away, not multiplied by 0 (NaN in a masked key stays out)
#pragma unroll
        for (int sl = 0; sl < kMaxDvSlots; ++sl) {
          const std::int64_t e = lane + 32 * sl;
          if (e < d.dv) acc[rr][sl] = fmaf(pj, sv[jj * ldv + e], acc[rr][sl]);
        }
      }
      m[rr] = m_new;
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const std::int64_t i = i0 + warp * kRowsPerWarp + rr;
    if (i >= d.Sq) continue;
    const bool empty = l[rr] == 0.f;
    const float inv = empty ? 0.f : 1.f / l[rr];
#pragma unroll
    for (int sl = 0; sl < kMaxDvSlots; ++sl) {
      const std::int64_t e = lane + 32 * sl;
      if (e < d.dv) st(o + ((b * d.Sq + i) * d.Hq + h) * d.dv + e, acc[rr][sl] * inv);
    }
    if (lane == 0) lse[(b * d.Hq + h) * d.Sq + i] = empty ? 0.f : m[rr] + logf(l[rr]);
  }
}

// D_i = do_i . o_i: one warp per (row, head, batch row).
template <class T>
__global__ void delta_kernel(Dims d, const T* dout, const T* o, float* delta) {
  const std::int64_t b = blockIdx.z, h = blockIdx.y, i = blockIdx.x;
  const T* dr = dout + ((b * d.Sq + i) * d.Hq + h) * d.dv;
  const T* orow = o + ((b * d.Sq + i) * d.Hq + h) * d.dv;
  float acc = 0.f;
  for (std::int64_t e = threadIdx.x; e < d.dv; e += 32) acc = fmaf(ld(dr + e), ld(orow + e), acc);
  acc = warp_sum(acc);
  if (threadIdx.x == 0) delta[(b * d.Hq + h) * d.Sq + i] = acc;
}

// dq: one block per (16 query rows, query head, batch row).
template <class T, class Kv>
__global__ void __launch_bounds__(kThreads) dq_kernel(Dims d, Kv kv, const T* q, const T* dout,
                                                      const float* lse, const float* delta, T* dq) {
  extern __shared__ float sm[];
  const std::int64_t b = blockIdx.z, h = blockIdx.y, i0 = std::int64_t(blockIdx.x) * kMq;
  const std::int64_t hk = h / (d.Hq / d.Hk);
  const int ldk = static_cast<int>(d.dqk) + 1, ldv = static_cast<int>(d.dv) + 1;
  float* sq = sm;
  float* sdo = sq + kMq * d.dqk;
  float* sk = sdo + kMq * d.dv;
  float* sv = sk + kNk * ldk;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (std::int64_t x = threadIdx.x; x < kMq * d.dqk; x += blockDim.x) {
    const std::int64_t r = x / d.dqk, e = x % d.dqk, i = i0 + r;
    sq[x] = i < d.Sq ? ld(q + ((b * d.Sq + i) * d.Hq + h) * d.dqk + e) : 0.f;
  }
  for (std::int64_t x = threadIdx.x; x < kMq * d.dv; x += blockDim.x) {
    const std::int64_t r = x / d.dv, e = x % d.dv, i = i0 + r;
    sdo[x] = i < d.Sq ? ld(dout + ((b * d.Sq + i) * d.Hq + h) * d.dv + e) : 0.f;
  }
  const std::int64_t last = (i0 + kMq < d.Sq ? i0 + kMq : d.Sq) - 1;
  const std::int64_t lo = d.key_begin(b, i0), hi = d.key_end(last);
  float acc[kRowsPerWarp][kMaxDqkSlots], row_lse[kRowsPerWarp], row_d[kRowsPerWarp];
  std::int64_t kb[kRowsPerWarp], ke[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const std::int64_t i = i0 + warp * kRowsPerWarp + rr;
    const bool in = i < d.Sq;
    kb[rr] = in ? d.key_begin(b, i) : 0;
    ke[rr] = in ? d.key_end(i) : 0;
    row_lse[rr] = in ? lse[(b * d.Hq + h) * d.Sq + i] : 0.f;
    row_d[rr] = in ? delta[(b * d.Hq + h) * d.Sq + i] : 0.f;
#pragma unroll
    for (int s = 0; s < kMaxDqkSlots; ++s) acc[rr][s] = 0.f;
  }
  for (std::int64_t j0 = lo; j0 < hi; j0 += kNk) {
    const int n = static_cast<int>(hi - j0 < kNk ? hi - j0 : kNk);
    __syncthreads();
    kv.load(d, sk, ldk, sv, ldv, b, hk, j0, n);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const std::int64_t j = j0 + lane;
      const bool valid = lane < n && j >= kb[rr] && j < ke[rr];
      float ds = 0.f;
      if (valid) {
        const float p = expf(d.scale * dot(sq + r * d.dqk, sk + lane * ldk, d.dqk) - row_lse[rr]);
        const float dp = dot(sdo + r * d.dv, sv + lane * ldv, d.dv);
        ds = p * (dp - row_d[rr]);
      }
      for (int jj = 0; jj < n; ++jj) {
        const float dsj = __shfl_sync(0xffffffffu, ds, jj);
        const int vj = __shfl_sync(0xffffffffu, valid ? 1 : 0, jj);
        if (!vj) continue;
#pragma unroll
        for (int sl = 0; sl < kMaxDqkSlots; ++sl) {
          const std::int64_t e = lane + 32 * sl;
          if (e < d.dqk) acc[rr][sl] = fmaf(dsj, sk[jj * ldk + e], acc[rr][sl]);
        }
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const std::int64_t i = i0 + warp * kRowsPerWarp + rr;
    if (i >= d.Sq) continue;
#pragma unroll
    for (int sl = 0; sl < kMaxDqkSlots; ++sl) {
      const std::int64_t e = lane + 32 * sl;
      if (e < d.dqk) st(dq + ((b * d.Sq + i) * d.Hq + h) * d.dqk + e, d.scale * acc[rr][sl]);
    }
  }
}

// Where a dk/dv block's sums go: DenseOut writes them (the block owns its
// keys); LatentOut takes them back through the up-projection with atomics.
template <class T>
struct DenseOut {
  T* dk;
  T* dv;
  __device__ void store(const Dims& d, const float* sdk, const float* sdv, std::int64_t b,
                        std::int64_t hk, std::int64_t j0, int n) const {
    for (std::int64_t x = threadIdx.x; x < n * d.dqk; x += blockDim.x) {
      const std::int64_t jj = x / d.dqk, e = x % d.dqk;
      st(dk + ((b * d.Sk + j0 + jj) * d.Hk + hk) * d.dqk + e, d.scale * sdk[jj * d.dqk + e]);
    }
    for (std::int64_t x = threadIdx.x; x < n * d.dv; x += blockDim.x) {
      const std::int64_t jj = x / d.dv, e = x % d.dv;
      st(dv + ((b * d.Sk + j0 + jj) * d.Hk + hk) * d.dv + e, sdv[jj * d.dv + e]);
    }
  }
};

struct LatentOut {
  LatentKv kv;
  float* dc;
  std::int64_t ld_dc;
  float* dk_pe;
  std::int64_t ld_dk_pe;
  float* dw;  // (H, dn + dv, C)
  // g_j = [scale dk_j[0, dn) | dv_j] (dn + dv) of head h:
  //   dc_j += g_j w_kv[h],  dk_pe_j += scale dk_j[dn, dqk),  dw_kv[h] += sum_j g_j^T c_j.
  __device__ void store(const Dims& d, const float* sdk, const float* sdv, std::int64_t b,
                        std::int64_t h, std::int64_t j0, int n) const {
    const std::int64_t dn = kv.dn, rows = dn + d.dv, C = kv.C, dr = d.dqk - dn;
    const auto g = [&](std::int64_t jj, std::int64_t e) {
      return e < dn ? d.scale * sdk[jj * d.dqk + e] : sdv[jj * d.dv + (e - dn)];
    };
    for (std::int64_t x = threadIdx.x; x < n * C; x += blockDim.x) {
      const std::int64_t jj = x / C, q = x % C;
      float acc = 0.f;
      for (std::int64_t e = 0; e < rows; ++e)
        acc = fmaf(g(jj, e), kv.w[(h * rows + e) * C + q], acc);
      atomicAdd(dc + (b * d.Sk + j0 + jj) * ld_dc + q, acc);
    }
    for (std::int64_t x = threadIdx.x; x < n * dr; x += blockDim.x) {
      const std::int64_t jj = x / dr, r = x % dr;
      atomicAdd(dk_pe + (b * d.Sk + j0 + jj) * ld_dk_pe + r, d.scale * sdk[jj * d.dqk + dn + r]);
    }
    for (std::int64_t x = threadIdx.x; x < rows * C; x += blockDim.x) {
      const std::int64_t e = x / C, q = x % C;
      float acc = 0.f;
      for (int jj = 0; jj < n; ++jj)
        acc = fmaf(g(jj, e), kv.c[(b * d.Sk + j0 + jj) * kv.ld_c + q], acc);
      atomicAdd(dw + (h * rows + e) * C + q, acc);
    }
  }
};

// dk, dv: one block per (16 keys, key head, batch row), summing over the
// query heads that read the key head and over query chunks of 16.
template <class T, class Kv, class Out>
__global__ void __launch_bounds__(kThreads)
    dkdv_kernel(Dims d, Kv kv, Out out, const T* q, const T* dout, const float* lse,
                const float* delta) {
  extern __shared__ float sm[];
  const std::int64_t b = blockIdx.z, hk = blockIdx.y, j0 = std::int64_t(blockIdx.x) * kKt;
  const int n = static_cast<int>(d.Sk - j0 < kKt ? d.Sk - j0 : kKt);
  const int ldk = static_cast<int>(d.dqk) + 1, ldv = static_cast<int>(d.dv) + 1;
  float* sk = sm;
  float* sv = sk + kKt * ldk;
  float* sdk = sv + kKt * ldv;
  float* sdv = sdk + kKt * d.dqk;
  float* sq = sdv + kKt * d.dv;
  float* sdo = sq + kQc * ldk;
  float* sl = sdo + kQc * ldv;
  float* sd = sl + kQc;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  kv.load(d, sk, ldk, sv, ldv, b, hk, j0, n);
  for (std::int64_t x = threadIdx.x; x < kKt * (d.dqk + d.dv); x += blockDim.x) sdk[x] = 0.f;
  const std::int64_t G = d.Hq / d.Hk;
  // The first query row that can see key j0 (causal), and the last.
  std::int64_t qlo = d.causal ? j0 - (d.Sk - d.Sq) : 0;
  if (qlo < 0) qlo = 0;
  for (std::int64_t g = 0; g < G; ++g) {
    const std::int64_t h = hk * G + g;
    for (std::int64_t i0 = qlo; i0 < d.Sq; i0 += kQc) {
      const int nq = static_cast<int>(d.Sq - i0 < kQc ? d.Sq - i0 : kQc);
      __syncthreads();
      for (std::int64_t x = threadIdx.x; x < nq * d.dqk; x += blockDim.x) {
        const std::int64_t r = x / d.dqk, e = x % d.dqk;
        sq[r * ldk + e] = ld(q + ((b * d.Sq + i0 + r) * d.Hq + h) * d.dqk + e);
      }
      for (std::int64_t x = threadIdx.x; x < nq * d.dv; x += blockDim.x) {
        const std::int64_t r = x / d.dv, e = x % d.dv;
        sdo[r * ldv + e] = ld(dout + ((b * d.Sq + i0 + r) * d.Hq + h) * d.dv + e);
      }
      for (int r = threadIdx.x; r < nq; r += blockDim.x) {
        sl[r] = lse[(b * d.Hq + h) * d.Sq + i0 + r];
        sd[r] = delta[(b * d.Hq + h) * d.Sq + i0 + r];
      }
      __syncthreads();
      for (int kk = warp * kKeysPerWarp; kk < (warp + 1) * kKeysPerWarp; ++kk) {
        if (kk >= n) break;  // warp-uniform
        const std::int64_t j = j0 + kk, i = i0 + lane;
        const bool valid = lane < nq && j >= d.key_begin(b, i) && j < d.key_end(i);
        float p = 0.f, ds = 0.f;
        if (valid) {
          p = expf(d.scale * dot(sq + lane * ldk, sk + kk * ldk, d.dqk) - sl[lane]);
          ds = p * (dot(sdo + lane * ldv, sv + kk * ldv, d.dv) - sd[lane]);
        }
        for (int ii = 0; ii < nq; ++ii) {
          const float pi = __shfl_sync(0xffffffffu, p, ii);
          const float dsi = __shfl_sync(0xffffffffu, ds, ii);
          const int vi = __shfl_sync(0xffffffffu, valid ? 1 : 0, ii);
          if (!vi) continue;
          for (std::int64_t e = lane; e < d.dv; e += 32)
            sdv[kk * d.dv + e] = fmaf(pi, sdo[ii * ldv + e], sdv[kk * d.dv + e]);
          for (std::int64_t e = lane; e < d.dqk; e += 32)
            sdk[kk * d.dqk + e] = fmaf(dsi, sq[ii * ldk + e], sdk[kk * d.dqk + e]);
        }
      }
    }
  }
  __syncthreads();
  out.store(d, sdk, sdv, b, hk, j0, n);
}

std::int64_t forward_smem(std::int64_t dqk, std::int64_t dv) {
  return 4 * (kMq * dqk + kNk * (dqk + 1) + kNk * dv);
}
std::int64_t dq_smem(std::int64_t dqk, std::int64_t dv) {
  return 4 * (kMq * dqk + kMq * dv + kNk * (dqk + 1) + kNk * (dv + 1));
}
std::int64_t dkdv_smem(std::int64_t dqk, std::int64_t dv) {
  return 4 * (kKt * (dqk + 1) + kKt * (dv + 1) + kKt * dqk + kKt * dv + kQc * (dqk + 1) +
              kQc * (dv + 1) + 2 * kQc);
}

int blocks(std::int64_t n, int per) {
  return static_cast<int>((n + per - 1) / per);
}

// Lets `kernel` take smem bytes of dynamic shared memory (above 48 KiB
// needs the opt-in; attention_refusal has checked the device gives them).
template <class F>
void allow_smem(F kernel, std::int64_t smem, const char* what) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)),
             cat("cudaFuncSetAttribute(", what, ", ", smem, " bytes of shared memory)"));
}

void check_launch(const char* what) {
  check_cuda(cudaGetLastError(), cat("launch of ", what));
}

void refuse_unless_supported(AttnKernel kernel, const AttnShape& s, DType dtype) {
  const std::string why = attention_refusal(kernel, s, dtype, device_smem_limit());
  LAGA_CHECK(why.empty(), why);
}

template <class T>
constexpr DType dtype_for() {
  return std::is_same_v<T, float> ? DType::f32 : DType::bf16;
}

template <class T, class Kv>
void run_forward(const AttnShape& s, Kv kv, const T* q, T* o, float* lse, cudaStream_t stream) {
  const Dims d = dims_of(s);
  const dim3 grid(blocks(s.Sq, kMq), static_cast<unsigned>(s.Hq), static_cast<unsigned>(s.B));
  const std::int64_t smem = forward_smem(s.dqk, s.dv);
  allow_smem(forward_kernel<T, Kv>, smem, "attention forward");
  forward_kernel<T, Kv><<<grid, kThreads, smem, stream>>>(d, kv, q, o, lse);
  check_launch("attention forward");
}

template <class T, class Kv, class Out>
void run_backward(const AttnShape& s, Kv kv, Out out, T* dq, const T* dout, const T* q, const T* o,
                  const float* lse, float* delta, cudaStream_t stream) {
  const Dims d = dims_of(s);
  delta_kernel<T>
      <<<dim3(static_cast<unsigned>(s.Sq), static_cast<unsigned>(s.Hq), static_cast<unsigned>(s.B)),
         32, 0, stream>>>(d, dout, o, delta);
  check_launch("attention backward (delta)");
  const dim3 gq(blocks(s.Sq, kMq), static_cast<unsigned>(s.Hq), static_cast<unsigned>(s.B));
  const std::int64_t smq = dq_smem(s.dqk, s.dv);
  allow_smem(dq_kernel<T, Kv>, smq, "attention backward (dq)");
  dq_kernel<T, Kv><<<gq, kThreads, smq, stream>>>(d, kv, q, dout, lse, delta, dq);
  check_launch("attention backward (dq)");
  if (s.Sk == 0) return;
  const dim3 gk(blocks(s.Sk, kKt), static_cast<unsigned>(s.Hk), static_cast<unsigned>(s.B));
  const std::int64_t smk = dkdv_smem(s.dqk, s.dv);
  allow_smem(dkdv_kernel<T, Kv, Out>, smk, "attention backward (dk, dv)");
  dkdv_kernel<T, Kv, Out><<<gk, kThreads, smk, stream>>>(d, kv, out, q, dout, lse, delta);
  check_launch("attention backward (dk, dv)");
}

}  // namespace

const char* to_string(AttnKernel k) {
  return k == AttnKernel::dense ? "dense" : "fused_latent";
}

std::int64_t attention_smem_bytes(AttnKernel, std::int64_t dqk, std::int64_t dv) {
  const std::int64_t a = forward_smem(dqk, dv), b = dq_smem(dqk, dv), c = dkdv_smem(dqk, dv);
  return a > b ? (a > c ? a : c) : (b > c ? b : c);
}

std::int64_t device_smem_limit() {
  int dev = 0, v = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  return v;
}

std::string attention_refusal(AttnKernel kernel, const AttnShape& s, DType dtype,
                              std::int64_t smem_limit) {
  const std::string who = cat("cuda attention (", to_string(kernel), ")");
  AttnShape host = s;
  host.doc_start = nullptr;  // a device pointer: the host reads none of it
  try {
    host.validate();
  } catch (const Error& e) {
    return cat(who, ": ", e.what());
  }
  if (s.doc_start && !s.causal)
    return cat(who, ": doc_start (packed documents) needs the causal mask; set causal = true");
  if (dtype == DType::f64)
    return cat(who, ": f64 is not run on the device; double runs on the CPU (--device cpu)");
  if (kernel == AttnKernel::fused_latent && s.Hq != s.Hk)
    return cat(who, ": Hq ", s.Hq, " != Hk ", s.Hk, "; the fused kernel is multi-head");
  if (s.dqk > 32 * kMaxDqkSlots)
    return cat(who, ": head dim dqk ", s.dqk, " is above ", 32 * kMaxDqkSlots,
               ", the most a lane holds (kMaxDqkSlots); use --device cpu for this shape");
  if (s.dv > 32 * kMaxDvSlots)
    return cat(who, ": head dim dv ", s.dv, " is above ", 32 * kMaxDvSlots,
               ", the most a lane holds (kMaxDvSlots); use --device cpu for this shape");
  if (s.B > 65535 || s.Hq > 65535)
    return cat(who, ": B ", s.B, " or Hq ", s.Hq, " is above 65535, a grid's y and z limit");
  if (s.Sq >= (std::int64_t(1) << 31) || s.Sk >= (std::int64_t(1) << 31))
    return cat(who, ": Sq ", s.Sq, " or Sk ", s.Sk, " is 2^31 or more; split the sequence");
  const std::int64_t need = attention_smem_bytes(kernel, s.dqk, s.dv);
  if (need > smem_limit)
    return cat(who, ": head dims dqk ", s.dqk, ", dv ", s.dv, " need ", need,
               " bytes of shared memory per block and the device gives ", smem_limit,
               "; use --device cpu for this shape");
  return {};
}

template <class T>
void attention_forward(const AttnShape& s, T* o, float* lse, const T* q, const T* k, const T* v,
                       void* stream) {
  refuse_unless_supported(AttnKernel::dense, s, dtype_for<T>());
  if (s.B == 0 || s.Sq == 0) return;
  run_forward(s, DenseKv<T>{k, v}, q, o, lse, static_cast<cudaStream_t>(stream));
}

template <class T>
void attention_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q,
                        const T* k, const T* v, const T* o, const float* lse, float* delta,
                        void* stream) {
  refuse_unless_supported(AttnKernel::dense, s, dtype_for<T>());
  if (s.B == 0) return;
  auto* st = static_cast<cudaStream_t>(stream);
  if (s.Sq == 0) {  // no query reads a key: dk and dv are 0
    check_cuda(cudaMemsetAsync(dk, 0, sizeof(T) * s.B * s.Sk * s.Hk * s.dqk, st), "cudaMemset dk");
    check_cuda(cudaMemsetAsync(dv, 0, sizeof(T) * s.B * s.Sk * s.Hk * s.dv, st), "cudaMemset dv");
    return;
  }
  run_backward(s, DenseKv<T>{k, v}, DenseOut<T>{dk, dv}, dq, dout, q, o, lse, delta, st);
}

namespace {
AttnShape fused_refusal_shape(const LatentAttnParams<float>& p) {
  LatentAttnParams<float> host = p;
  host.shape.doc_start = nullptr;
  host.validate();
  return p.shape;
}
LatentKv latent_kv(const LatentAttnParams<float>& p) {
  return LatentKv{p.c, p.ld_c, p.k_pe, p.ld_k_pe, p.w_kv, p.C, p.dn};
}
}  // namespace

void fused_latent_forward(const LatentAttnParams<float>& p, float* o, float* lse, DType dtype,
                          void* stream) {
  const AttnShape s = fused_refusal_shape(p);
  refuse_unless_supported(AttnKernel::fused_latent, s, dtype);
  if (s.B == 0 || s.Sq == 0) return;
  auto* st = static_cast<cudaStream_t>(stream);
  const LatentKv kv = latent_kv(p);
  if (dtype == DType::bf16)
    run_forward(s, LatentKvTensorCore{kv}, p.q, o, lse, st);
  else
    run_forward(s, kv, p.q, o, lse, st);
}

void fused_latent_backward(const LatentAttnParams<float>& p, const LatentAttnGrads<float>& g,
                           const float* dout, const float* o, const float* lse, float* delta,
                           DType dtype, void* stream) {
  const AttnShape s = fused_refusal_shape(p);
  refuse_unless_supported(AttnKernel::fused_latent, s, dtype);
  if (s.B == 0) return;
  auto* st = static_cast<cudaStream_t>(stream);
  const std::int64_t rows = s.B * s.Sk;
  if (rows > 0) {
    check_cuda(cudaMemset2DAsync(g.dc, sizeof(float) * g.ld_dc, 0, sizeof(float) * p.C,
                                 static_cast<std::size_t>(rows), st),
               "cudaMemset2D dc");
    check_cuda(cudaMemset2DAsync(g.dk_pe, sizeof(float) * g.ld_dk_pe, 0, sizeof(float) * p.dr(),
                                 static_cast<std::size_t>(rows), st),
               "cudaMemset2D dk_pe");
  }
  if (s.Sq == 0) return;
  const LatentKv kv = latent_kv(p);
  // dc and dw_kv (LatentOut) are products of the fp32 gradients [dk | dv]:
  // fp32 in both dtypes, as the CPU's bf16 path computes them.
  const LatentOut out{kv, g.dc, g.ld_dc, g.dk_pe, g.ld_dk_pe, g.dw_kv};
  if (dtype == DType::bf16)
    run_backward(s, LatentKvTensorCore{kv}, out, g.dq, dout, p.q, o, lse, delta, st);
  else
    run_backward(s, kv, out, g.dq, dout, p.q, o, lse, delta, st);
}

template void attention_forward<float>(const AttnShape&, float*, float*, const float*, const float*,
                                       const float*, void*);
template void attention_forward<bf16>(const AttnShape&, bf16*, float*, const bf16*, const bf16*,
                                      const bf16*, void*);
template void attention_backward<float>(const AttnShape&, float*, float*, float*, const float*,
                                        const float*, const float*, const float*, const float*,
                                        const float*, float*, void*);
template void attention_backward<bf16>(const AttnShape&, bf16*, bf16*, bf16*, const bf16*,
                                       const bf16*, const bf16*, const bf16*, const bf16*,
                                       const float*, float*, void*);

}  // namespace laga::cuda
