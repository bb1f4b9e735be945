// laga_cuda_check's checks of DeepSeek Sparse Attention's CUDA rows and of the
// forms' data movement (copy_rows, fill), against the CPU's; split from
// check_main.cpp, which runs them (tolerances: its header comment).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/bf16.hpp"
#include "core/error.hpp"
#include "cuda/check_support.hpp"
#include "cuda/cuda_error.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/elementwise.hpp"
#include "cuda/sparse_attention.hpp"
#include "kernels/attention_sparse.hpp"
#include "mla/op_table.hpp"

namespace laga::cuda::check {
namespace {

// DeepSeek Sparse Attention's rows (cuda/sparse_attention.hpp) against the
// CPU kernel in double (kernels/attention_sparse.hpp) on the same operands
// (bf16: rounded first; the outputs are fp32 in both rows, so bf16 keeps
// fp32's bounds). Each row picks up to K distinct earlier keys (causal, as
// the indexer's top-k), in shuffled slots, -1 in the rest, and one row of
// each batch picks none. The backward runs twice: dk and dv must be the same
// bits (the scatter is a sort, not atomics).
std::vector<std::int32_t> sparse_selection(const SparseAttnShape& s, std::uint32_t seed) {
  const AttnShape& a = s.attn;
  std::vector<std::int32_t> idx(static_cast<std::size_t>(a.B * a.Sq * s.K), -1);
  std::vector<std::int32_t> keys;
  std::uint32_t x = seed * 2654435761u + 777u;
  const auto next = [&x] { return x ^= x << 13, x ^= x >> 17, x ^= x << 5, x; };
  for (std::int64_t b = 0; b < a.B; ++b)
    for (std::int64_t i = 0; i < a.Sq; ++i) {
      if (i == 3 + b) continue;  // a row with no slot
      const std::int64_t t = i + a.Sk - a.Sq, n = std::min<std::int64_t>(s.K, t + 1);
      keys.resize(static_cast<std::size_t>(t + 1));
      for (std::int64_t j = 0; j <= t; ++j) keys[std::size_t(j)] = std::int32_t(j);
      for (std::int64_t r = 0; r < n; ++r)  // partial Fisher-Yates: n distinct keys
        std::swap(keys[std::size_t(r)], keys[std::size_t(r + next() % (t + 1 - r))]);
      std::int32_t* row = idx.data() + (b * a.Sq + i) * s.K;
      for (std::int64_t r = 0; r < n; ++r) row[r] = keys[std::size_t(r)];
      for (std::int64_t r = s.K - 1; r > 0; --r)  // the slots in any order
        std::swap(row[r], row[next() % (r + 1)]);
    }
  return idx;
}

void check_sparse_case(std::vector<Result>& out, const SparseAttnShape& s, bool bf) {
  const AttnShape& a = s.attn;
  const Vec q = inputs(a.B * a.Sq * a.Hq * a.dqk, 21, bf),
            k = inputs(a.B * a.Sk * a.Hk * a.dqk, 22, bf),
            v = inputs(a.B * a.Sk * a.Hk * a.dv, 23, bf),
            dout = inputs(a.B * a.Sq * a.Hq * a.dv, 24, bf);
  const std::vector<std::int32_t> idx = sparse_selection(s, 25);
  laga::sparse_attention_check_indices(s, idx.data());
  std::vector<double> o(dout.size()), lse(static_cast<std::size_t>(a.B * a.Hq * a.Sq)),
      dq(q.size()), dk(k.size()), dv(v.size());
  laga::sparse_attention_forward<double>(s, o.data(), lse.data(), widen(q).data(), widen(k).data(),
                                         widen(v).data(), idx.data());
  laga::sparse_attention_backward<double>(s, dq.data(), dk.data(), dv.data(), widen(dout).data(),
                                          widen(q).data(), widen(k).data(), widen(v).data(),
                                          o.data(), lse.data(), idx.data());
  DeviceBuffer q_ = up(q, bf, "q"), k_ = up(k, bf, "k"), v_ = up(v, bf, "v"),
               do_ = up(dout, bf, "dout"), idx_(4 * std::int64_t(idx.size()), "idx"),
               o_(4 * std::int64_t(o.size()), "o"), lse_(4 * std::int64_t(lse.size()), "lse"),
               gq(4 * std::int64_t(q.size()), "dq"), gk(4 * std::int64_t(k.size()), "dk"),
               gv(4 * std::int64_t(v.size()), "dv");
  idx_.upload(idx.data(), idx_.bytes());
  // The backward's scratch as the row's workspace carves it (from delta on).
  DeviceBuffer scratch(cuda::sparse_attention_scratch(s, true).backward_part(),
                       "sparse attention scratch");
  const auto run = [&]<class In>(In*) {
    cuda::sparse_attention_forward<In>(s, o_.as<float>(), lse_.as<float>(), q_.as<In>(),
                                       k_.as<In>(), v_.as<In>(), idx_.as<std::int32_t>());
    cuda::sparse_attention_backward<In>(s, gq.as<float>(), gk.as<float>(), gv.as<float>(),
                                        do_.as<In>(), q_.as<In>(), k_.as<In>(), v_.as<In>(),
                                        o_.as<float>(), lse_.as<float>(), idx_.as<std::int32_t>(),
                                        scratch.data(), scratch.bytes());
  };
  bf ? run(static_cast<bf16*>(nullptr)) : run(static_cast<float*>(nullptr));
  const std::string sh = cat(attn_shape(a), " K ", s.K);
  const char* dt = bf ? "bf16" : "fp32";
  out.push_back({"sparse_gather_cuda forward o", sh, dt, rel_error(down(o_, false), o), 1e-4});
  out.push_back(
      {"sparse_gather_cuda forward lse", sh, dt, rel_error(down(lse_, false), lse), 1e-4});
  out.push_back({"sparse_gather_cuda backward dq", sh, dt, rel_error(down(gq, false), dq), 1e-3});
  out.push_back({"sparse_gather_cuda backward dk", sh, dt, rel_error(down(gk, false), dk), 1e-3});
  out.push_back({"sparse_gather_cuda backward dv", sh, dt, rel_error(down(gv, false), dv), 1e-3});
  if (!bf && a.Hk == a.Hq) {
    // Through the kernel table's row, as the op layer calls it: the DSA
    // forms hand the selection in a host vector, which the row copies.
    const ops::KernelRow* fwd = nullptr;
    for (const ops::KernelRow& r : ops::cuda_kernel_rows())
      if (r.op == ops::Op::sparse_attention_forward) fwd = &r;
    LAGA_CHECK(fwd, "no CUDA row for sparse_attention_forward");
    ops::OpCall c;
    c.op = ops::Op::sparse_attention_forward, c.dtype = RunDtype::fp32;
    c.shape.attn = a, c.shape.k = s.K;
    c.in[0] = q_.data(), c.in[1] = k_.data(), c.in[2] = v_.data(), c.in[3] = idx.data();
    c.out[0] = o_.data(), c.out[1] = lse_.data();
    DeviceBuffer ws(fwd->workspace_bytes(c.dtype, c.shape), "sparse attention scratch");
    c.workspace = ws.data(), c.workspace_bytes = ws.bytes();
    fwd->run(c);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize after sparse_gather_cuda's row");
    out.push_back({"sparse_gather_cuda row, host selection: forward o", sh, dt,
                   rel_error(down(o_, false), o), 1e-4});
  }
  const Vec k1 = down(gk, false), v1 = down(gv, false);
  bf ? run(static_cast<bf16*>(nullptr)) : run(static_cast<float*>(nullptr));
  const Vec k2 = down(gk, false), v2 = down(gv, false);
  const bool same = std::memcmp(k1.data(), k2.data(), 4 * k1.size()) == 0 &&
                    std::memcmp(v1.data(), v2.data(), 4 * v1.size()) == 0;
  out.push_back(
      {"sparse_gather_cuda backward dk, dv bits on a second run", sh, dt, same ? 0.0 : 1.0, 0});
}

}  // namespace

void check_sparse_attention(std::vector<Result>& out) {
  SparseAttnShape heads;  // per head, fewer queries than keys (a rank's rows)
  heads.attn.B = 2, heads.attn.Sq = 60, heads.attn.Sk = 90, heads.attn.Hq = heads.attn.Hk = 4;
  heads.attn.dqk = 48, heads.attn.dv = 32, heads.attn.scale = 0.15, heads.K = 16;
  SparseAttnShape latent = heads;  // latent space: one shared key head
  latent.attn.Hk = 1, latent.attn.dqk = 72, latent.attn.dv = 64;
  SparseAttnShape v32 = latent;  // DeepSeek-V3.2's latent widths, [c | k_pe] 576, c 512
  v32.attn.B = 1, v32.attn.Sq = 48, v32.attn.Sk = 96, v32.attn.Hq = 8;
  v32.attn.dqk = 576, v32.attn.dv = 512, v32.attn.scale = 0.04, v32.K = 32;
  SparseAttnShape wide = heads;  // 192/128 heads, more slots than keys
  wide.attn.B = 1, wide.attn.Sq = wide.attn.Sk = 40, wide.attn.Hq = wide.attn.Hk = 2;
  wide.attn.dqk = 192, wide.attn.dv = 128, wide.attn.scale = 0.07, wide.K = 64;
  for (const bool bf : {false, true})
    for (const SparseAttnShape& s : {heads, latent, v32, wide}) check_sparse_case(out, s, bf);
  // cub's sort storage against the bound the scratch holds
  // (sparse_sort_storage_bound): error = cub's / the bound, passing at <= 1;
  // the shapes above, and V3.2's latent S 32k and 128k (size queries only).
  SparseAttnShape s32 = v32;
  s32.attn.Sq = s32.attn.Sk = 32768, s32.attn.Hq = 128, s32.K = 2048;
  SparseAttnShape s128 = s32;
  s128.attn.Sq = s128.attn.Sk = 131072;
  for (const SparseAttnShape& s : {heads, latent, v32, wide, s32, s128}) {
    const std::int64_t pairs = s.attn.B * s.attn.Sq * s.K;
    const int bits = cuda::sparse_sort_key_bits(s);
    const std::int64_t bound = cuda::sparse_sort_storage_bound(pairs, bits),
                       cub = cuda::sparse_sort_storage_queried(pairs, bits);
    out.push_back({cat("sparse_gather_cuda sort storage: cub ", cub, " bytes, bound ", bound),
                   cat(attn_shape(s.attn), " K ", s.K), "u64", double(cub) / double(bound), 1.0});
  }
}

// The forms' data movement (Op::copy_rows, Op::fill; issue 52) against the
// CPU's: exact, so the error is the count of elements whose bits differ from
// the CPU row's (core/bf16.hpp's rounding for the narrowing, including
// ties, an fp32 denormal, inf and NaN), tolerance 0.
void check_moves(std::vector<Result>& out) {
  const std::int64_t rows = 33, cols = 100, lds = 130, ldd = 120;
  Vec src = inputs(rows * lds, 21, false), dst0 = inputs(rows * ldd, 22, false);
  const float special[] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 0x1p-130f, -0x1p-140f,
                           INFINITY,       -INFINITY,          NAN,       3.3895e38f};
  for (std::size_t i = 0; i < std::size(special); ++i) src[i * 3] = special[i];
  std::vector<bf16> src_b(src.size());
  for (std::size_t i = 0; i < src.size(); ++i) src_b[i] = to_bf16(src[i]);
  const std::string sh = cat("rows ", rows, " cols ", cols, " lds ", lds, " ldd ", ldd);
  auto differing = [](const void* a, const void* b, std::size_t n, std::size_t size) {
    double bad = 0;
    for (std::size_t i = 0; i < n; ++i)
      bad += std::memcmp(static_cast<const char*>(a) + i * size,
                         static_cast<const char*>(b) + i * size, size) != 0;
    return bad;
  };
  for (const bool add : {false, true})
    for (const bool from_bf16 : {false, true}) {  // into fp32
      Vec want = dst0;
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j) {
          const std::size_t e = std::size_t(i * lds + j);
          const float x = from_bf16 ? to_float(src_b[e]) : src[e];
          float& y = want[std::size_t(i * ldd + j)];
          y = add ? y + x : x;
        }
      DeviceBuffer s_ = from_bf16 ? up(src, true, "src") : up(src, false, "src");
      DeviceBuffer d_ = up(dst0, false, "dst");
      copy_rows(d_.data(), ldd, s_.data(), lds, rows, cols, DType::f32, from_bf16, add);
      check_cuda(cudaDeviceSynchronize(), "copy_rows");
      Vec got(want.size());
      d_.download(got.data(), d_.bytes());
      out.push_back(
          {cat("copy_rows_cuda ", from_bf16 ? "bf16 -> fp32" : "fp32", add ? " adding" : ""), sh,
           "fp32", differing(got.data(), want.data(), got.size(), 4), 0});
    }
  {  // fp32 -> bf16, the wire's narrowing
    std::vector<bf16> want(static_cast<std::size_t>(rows * ldd), to_bf16(7.0f)), got(want.size());
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j)
        want[std::size_t(i * ldd + j)] = to_bf16(src[std::size_t(i * lds + j)]);
    DeviceBuffer s_ = up(src, false, "src"), d_ = up(Vec(want.size(), 7.0f), true, "dst");
    copy_rows(d_.data(), ldd, s_.data(), lds, rows, cols, DType::bf16, false, false);
    check_cuda(cudaDeviceSynchronize(), "copy_rows");
    d_.download(got.data(), d_.bytes());
    out.push_back({"copy_rows_cuda fp32 -> bf16", sh, "bf16",
                   differing(got.data(), want.data(), got.size(), 2), 0});
  }
  {  // fill, the padding columns kept
    Vec want = dst0;
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) want[std::size_t(i * ldd + j)] = -0.5f;
    DeviceBuffer d_ = up(dst0, false, "dst");
    fill_rows(d_.data(), ldd, rows, cols, DType::f32, -0.5);
    check_cuda(cudaDeviceSynchronize(), "fill_rows");
    Vec got(want.size());
    d_.download(got.data(), d_.bytes());
    out.push_back({"fill_cuda", sh, "fp32", differing(got.data(), want.data(), got.size(), 4), 0});
  }
}

}  // namespace laga::cuda::check
