// laga's small device kernels (contract: cuda/elementwise.hpp).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/error.hpp"
#include "cuda/cuda_error.hpp"
#include "cuda/elementwise.hpp"

namespace laga::cuda {

namespace {

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += scratch[w];
  return total;
}

__global__ void rmsnorm_forward_kernel(float* y, float* rstd, const float* x, std::int64_t ldx,
                                       const float* w, std::int64_t C, float eps) {
  __shared__ float scratch[32];
  const std::int64_t n = blockIdx.x;
  const float* xr = x + n * ldx;
  float ss = 0.f;
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) ss = fmaf(xr[c], xr[c], ss);
  const float r = rsqrtf(block_sum(ss, scratch) / static_cast<float>(C) + eps);
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) y[n * C + c] = xr[c] * r * w[c];
  if (threadIdx.x == 0) rstd[n] = r;
}

// dx = rstd g - x rstd^3 sum(g x) / C, g = w dy.
__global__ void rmsnorm_dx_kernel(float* dx, std::int64_t lddx, const float* dy, std::int64_t lddy,
                                  const float* x, std::int64_t ldx, const float* w,
                                  const float* rstd, std::int64_t C) {
  __shared__ float scratch[32];
  const std::int64_t n = blockIdx.x;
  const float* xr = x + n * ldx;
  const float* dyr = dy + n * lddy;
  float gx = 0.f;
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) gx = fmaf(w[c] * dyr[c], xr[c], gx);
  const float r = rstd[n];
  const float k = r * r * r * block_sum(gx, scratch) / static_cast<float>(C);
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x)
    dx[n * lddx + c] = r * w[c] * dyr[c] - xr[c] * k;
}

// dw[c] += sum over rows of dy x rstd, one thread per column, rows in order.
__global__ void rmsnorm_dw_kernel(float* dw, const float* dy, std::int64_t lddy, const float* x,
                                  std::int64_t ldx, const float* rstd, std::int64_t N,
                                  std::int64_t C) {
  const std::int64_t c = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float acc = 0.f;
  for (std::int64_t n = 0; n < N; ++n) acc = fmaf(dy[n * lddy + c] * x[n * ldx + c], rstd[n], acc);
  dw[c] += acc;
}

// One thread per (token, head, pair).
__global__ void rope_kernel(float* x, std::int64_t B, std::int64_t L, std::int64_t H,
                            std::int64_t ld_token, std::int64_t ld_head, std::int64_t pos0,
                            const std::int64_t* positions, DeviceRope t, bool inverse) {
  const std::int64_t half = t.dim / 2;
  const std::int64_t id = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= B * L * H * half) return;
  const std::int64_t i = id % half, h = (id / half) % H, tok = id / (half * H);
  const std::int64_t pos = positions ? positions[tok] : pos0 + tok % L;
  if (pos < 0 || pos >= t.positions) return;
  const float c = t.cos[pos * half + i],
              s = inverse ? -t.sin[pos * half + i] : t.sin[pos * half + i];
  float* p = x + tok * ld_token + h * ld_head + 2 * i;
  const float a = p[0], b = p[1];
  p[0] = a * c - b * s;
  p[1] = a * s + b * c;
}

// One block per (call row i, head h, call batch row bc).
__global__ void lse_merge_kernel(LseMergeShape s, float* o, float* lse, const float* o_p,
                                 const float* lse_p) {
  const std::int64_t i = blockIdx.x, h = blockIdx.y, bc = blockIdx.z, b = s.b0 + bc;
  const std::int64_t li = (b * s.H + h) * s.L + s.q_row + i;
  const float l = lse[li], lp = lse_p[(bc * s.H + h) * s.Sq + i];
  float* orow = o + ((b * s.L + s.q_row + i) * s.H + h) * s.dv;
  const float* prow = o_p + ((bc * s.Sq + i) * s.H + h) * s.dv;
  if (s.first) {
    for (std::int64_t e = threadIdx.x; e < s.dv; e += blockDim.x) orow[e] = prow[e];
    if (threadIdx.x == 0) lse[li] = lp;
    return;
  }
  const float m = fmaxf(l, lp);
  const float merged = m + logf(expf(l - m) + expf(lp - m));
  const float a = expf(l - merged), w = expf(lp - merged);
  for (std::int64_t e = threadIdx.x; e < s.dv; e += blockDim.x) orow[e] = a * orow[e] + w * prow[e];
  __syncthreads();  // every thread has read l before it is replaced
  if (threadIdx.x == 0) lse[li] = merged;
}

template <class T>
__global__ void sum_kernel(T* out, const T* const* parts, int P, std::int64_t n) {
  const std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  T acc = parts[0][i];
  for (int p = 1; p < P; ++p) acc += parts[p][i];
  out[i] = acc;
}
__global__ void sum_bf16_kernel(__nv_bfloat16* out, const __nv_bfloat16* const* parts, int P,
                                std::int64_t n) {
  const std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float acc = __bfloat162float(parts[0][i]);
  for (int p = 1; p < P; ++p) acc += __bfloat162float(parts[p][i]);
  out[i] = __float2bfloat16_rn(acc);
}

void check_launch(const char* what) {
  check_cuda(cudaGetLastError(), cat("launch of ", what));
}

unsigned blocks_of(std::int64_t n, int per) {
  return static_cast<unsigned>((n + per - 1) / per);
}

}  // namespace

void rmsnorm_forward(float* y, float* rstd, const float* x, std::int64_t ldx, const float* w,
                     std::int64_t N, std::int64_t C, double eps, void* stream) {
  LAGA_CHECK(N >= 0 && C > 0 && ldx >= C, "cuda rmsnorm: N ", N, ", C ", C, ", ldx ", ldx,
             "; need N >= 0, C > 0 and ldx >= C");
  if (N == 0) return;
  rmsnorm_forward_kernel<<<static_cast<unsigned>(N), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      y, rstd, x, ldx, w, C, static_cast<float>(eps));
  check_launch("rmsnorm forward");
}

void rmsnorm_backward(float* dx, std::int64_t lddx, float* dw, const float* dy, std::int64_t lddy,
                      const float* x, std::int64_t ldx, const float* w, const float* rstd,
                      std::int64_t N, std::int64_t C, void* stream) {
  LAGA_CHECK(N >= 0 && C > 0 && ldx >= C && lddx >= C && lddy >= C, "cuda rmsnorm backward: N ", N,
             ", C ", C, ", ldx ", ldx, ", lddx ", lddx, ", lddy ", lddy,
             "; need N >= 0, C > 0 and every stride >= C");
  if (N == 0) return;
  auto* st = static_cast<cudaStream_t>(stream);
  rmsnorm_dx_kernel<<<static_cast<unsigned>(N), 256, 0, st>>>(dx, lddx, dy, lddy, x, ldx, w, rstd,
                                                              C);
  check_launch("rmsnorm backward (dx)");
  rmsnorm_dw_kernel<<<blocks_of(C, 256), 256, 0, st>>>(dw, dy, lddy, x, ldx, rstd, N, C);
  check_launch("rmsnorm backward (dw)");
}

void rope_apply(float* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                std::int64_t ld_head, std::int64_t pos0, const std::int64_t* positions,
                const DeviceRope& table, bool inverse, void* stream) {
  LAGA_CHECK(B >= 0 && L >= 0 && H >= 0 && table.dim > 0 && table.dim % 2 == 0, "cuda rope: B ", B,
             ", L ", L, ", H ", H, ", dim ", table.dim,
             "; need extents >= 0 and an even, positive rope dim");
  LAGA_CHECK(positions || pos0 + L <= table.positions, "cuda rope: positions ", pos0, " .. ",
             pos0 + L - 1, " run past the table's ", table.positions,
             "; build the table for the whole sequence");
  const std::int64_t n = B * L * H * (table.dim / 2);
  if (n == 0) return;
  rope_kernel<<<blocks_of(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      x, B, L, H, ld_token, ld_head, pos0, positions, table, inverse);
  check_launch("rope");
}

void lse_merge(const LseMergeShape& s, float* o, float* lse, const float* o_p, const float* lse_p,
               void* stream) {
  LAGA_CHECK(s.Bc >= 0 && s.Sq >= 0 && s.H > 0 && s.dv > 0 && s.Bc <= 65535 && s.H <= 65535 &&
                 s.b0 >= 0 && s.q_row >= 0 && s.q_row + s.Sq <= s.L,
             "cuda lse_merge: Bc ", s.Bc, ", Sq ", s.Sq, ", H ", s.H, ", dv ", s.dv, ", L ", s.L,
             ", b0 ", s.b0, ", q_row ", s.q_row,
             "; need Bc, H in [1, 65535], dv > 0 and the call's rows inside the rank's");
  if (s.Bc == 0 || s.Sq == 0) return;
  lse_merge_kernel<<<dim3(static_cast<unsigned>(s.Sq), static_cast<unsigned>(s.H),
                          static_cast<unsigned>(s.Bc)),
                     128, 0, static_cast<cudaStream_t>(stream)>>>(s, o, lse, o_p, lse_p);
  check_launch("lse_merge");
}

void sum_in_rank_order(void* out, const void* const* parts, int P, std::int64_t n, DType dtype,
                       void* stream) {
  LAGA_CHECK(P >= 1 && n >= 0, "cuda sum_in_rank_order: P ", P, ", n ", n, "; need P >= 1, n >= 0");
  if (n == 0) return;
  auto* st = static_cast<cudaStream_t>(stream);
  const unsigned grid = blocks_of(n, 256);
  if (dtype == DType::f32)
    sum_kernel<float><<<grid, 256, 0, st>>>(static_cast<float*>(out),
                                            reinterpret_cast<const float* const*>(parts), P, n);
  else if (dtype == DType::f64)
    sum_kernel<double><<<grid, 256, 0, st>>>(static_cast<double*>(out),
                                             reinterpret_cast<const double* const*>(parts), P, n);
  else
    sum_bf16_kernel<<<grid, 256, 0, st>>>(static_cast<__nv_bfloat16*>(out),
                                          reinterpret_cast<const __nv_bfloat16* const*>(parts), P,
                                          n);
  check_launch("sum_in_rank_order");
}

namespace {

// core/bf16.hpp's to_bf16, bit for bit (see cuda/elementwise.hpp, copy_rows).
__device__ __forceinline__ std::uint16_t bf16_bits(float x) {
  const std::uint32_t u = __float_as_uint(x);
  const std::uint32_t exponent = u & 0x7F800000u, fraction = u & 0x007FFFFFu;
  if (exponent == 0) return static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  if (exponent == 0x7F800000u)
    return static_cast<std::uint16_t>(fraction == 0 ? (u >> 16) : ((u >> 16) | 0x0040u));
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float bf16_value(std::uint16_t b) {
  return __uint_as_float(static_cast<std::uint32_t>(b) << 16);
}

// One thread an element of a (rows, cols) block; S, D the element types
// (std::uint16_t: bf16 bits).
template <class S, class D>
__global__ void copy_rows_kernel(D* dst, std::int64_t ldd, const S* src, std::int64_t lds,
                                 std::int64_t rows, std::int64_t cols, bool accumulate) {
  const std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= rows * cols) return;
  const std::int64_t i = e / cols, j = e % cols;
  const S x = src[i * lds + j];
  D& y = dst[i * ldd + j];
  if constexpr (std::is_same_v<S, D>) {
    if (accumulate)
      y = y + x;
    else
      y = x;
  } else if constexpr (std::is_same_v<D, std::uint16_t>) {
    y = bf16_bits(x);
  } else {
    y = accumulate ? y + bf16_value(x) : bf16_value(x);
  }
}
template <class T>
__global__ void fill_kernel(T* dst, std::int64_t ldd, std::int64_t rows, std::int64_t cols,
                            T value) {
  const std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= rows * cols) return;
  dst[(e / cols) * ldd + e % cols] = value;
}

template <class S, class D>
void launch_copy(void* dst, std::int64_t ldd, const void* src, std::int64_t lds, std::int64_t rows,
                 std::int64_t cols, bool accumulate, cudaStream_t st) {
  copy_rows_kernel<S, D><<<blocks_of(rows * cols, 256), 256, 0, st>>>(
      static_cast<D*>(dst), ldd, static_cast<const S*>(src), lds, rows, cols, accumulate);
}

}  // namespace

void copy_rows(void* dst, std::int64_t ldd, const void* src, std::int64_t lds, std::int64_t rows,
               std::int64_t cols, DType to, bool src_bf16, bool accumulate, void* stream) {
  LAGA_CHECK(rows >= 0 && cols >= 0, "cuda copy_rows: rows ", rows, ", cols ", cols);
  LAGA_CHECK(!(to == DType::bf16 && accumulate),
             "cuda copy_rows: a sum into bf16 (bf16 is stored, never added to)");
  LAGA_CHECK(!(to == DType::f64 && src_bf16), "cuda copy_rows: bf16 values into fp64");
  if (rows == 0 || cols == 0) return;
  auto* st = static_cast<cudaStream_t>(stream);
  using B = std::uint16_t;
  if (to == DType::f64)
    launch_copy<double, double>(dst, ldd, src, lds, rows, cols, accumulate, st);
  else if (to == DType::f32)
    src_bf16 ? launch_copy<B, float>(dst, ldd, src, lds, rows, cols, accumulate, st)
             : launch_copy<float, float>(dst, ldd, src, lds, rows, cols, accumulate, st);
  else
    src_bf16 ? launch_copy<B, B>(dst, ldd, src, lds, rows, cols, false, st)
             : launch_copy<float, B>(dst, ldd, src, lds, rows, cols, false, st);
  check_launch("copy_rows");
}

void fill_rows(void* dst, std::int64_t ldd, std::int64_t rows, std::int64_t cols, DType to,
               double value, void* stream) {
  LAGA_CHECK(rows >= 0 && cols >= 0, "cuda fill_rows: rows ", rows, ", cols ", cols);
  LAGA_CHECK(to != DType::bf16, "cuda fill_rows: dtype bf16 (it takes f32 or f64)");
  if (rows == 0 || cols == 0) return;
  auto* st = static_cast<cudaStream_t>(stream);
  const unsigned grid = blocks_of(rows * cols, 256);
  if (to == DType::f64)
    fill_kernel<double><<<grid, 256, 0, st>>>(static_cast<double*>(dst), ldd, rows, cols, value);
  else
    fill_kernel<float><<<grid, 256, 0, st>>>(static_cast<float*>(dst), ldd, rows, cols,
                                             static_cast<float>(value));
  check_launch("fill_rows");
}

}  // namespace laga::cuda
