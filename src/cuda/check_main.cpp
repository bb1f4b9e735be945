// laga_cuda_check: every op of the CUDA backend against the CPU's float64
// reference, with a stated tolerance each, then timings (median after
// warm-up, CUDA events) of attention at DeepSeek-V3's 192/128 heads, of the
// fused latent kernel (bf16 and fp32, a P 8 rank's heads) and of a bf16
// GEMM; one JSON and one markdown table (docs/performance.md, "The CUDA
// backend"; scripts/gpu_check.sh runs it on a lent GPU).
//
//   laga_cuda_check --json OUT.json --table OUT.md [--seqs 4096,8192,...]
//                   [--heads 128] [--budget-s 240] [--dry-run]
//
// --dry-run needs no device: it lists the checks and timings it would run
// and writes the JSON with "ran": false (what ctest runs on CI's machines).
// Exit status: 0 every check within its tolerance, 1 one or more outside,
// 2 the program could not run (no device: the reason is printed).
//
// Tolerances, on max |got - ref| / max(|ref|, 1e-30) over each output:
//   fp32 (cuBLASLt's true fp32, laga's kernels): 1e-4 forward, 1e-3 backward
//     (fp32 sums in another order over K up to 1000: a few ulps each, far
//     below 1e-4; a wrong index or mask is O(1));
//   bf16 operands (inputs rounded to bf16 first, the reference run on the
//     rounded values in double; outputs rounded to bf16): 2e-2, about 2.5
//     bf16 ulps, the rounding of the output plus fp32 sums.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "cuda/attention.hpp"
#include "cuda/check_support.hpp"
#include "cuda/cuda_error.hpp"
#include "cuda/device.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/elementwise.hpp"
#include "cuda/gemm_lt.hpp"
#include "cuda/sdpa_cudnn.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash_latent.hpp"
#include "kernels/gemm.hpp"
#include "kernels/lse_merge.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/rope.hpp"
#include "mla/op_table.hpp"

namespace laga::cuda {
namespace {

using json = nlohmann::json;
using namespace check;

void check_gemm_ops(std::vector<Result>& out) {
  GemmContext ctx;
  const std::int64_t M = 67, N = 45, K = 300;
  for (const bool bf : {false, true})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        const std::int64_t lda = (ta ? M : K) + 5, ldb = (tb ? K : N) + 3, ldc = N + 2;
        const Vec a = inputs((ta ? K : M) * lda, 1, bf), b = inputs((tb ? N : K) * ldb, 2, bf);
        std::vector<double> ref(static_cast<std::size_t>(M * ldc), 0.0);
        gemm_reference<double>(ta, tb, M, N, K, 1.0, widen(a).data(), lda, widen(b).data(), ldb,
                               0.0, ref.data(), ldc);
        DeviceBuffer da = up(a, bf, "a"), db = up(b, bf, "b"), dc(4 * M * ldc, "c");
        dc.zero();
        GemmArgs g;
        g.trans_a = ta, g.trans_b = tb, g.M = M, g.N = N, g.K = K, g.A = da.data(), g.lda = lda;
        g.B = db.data(), g.ldb = ldb, g.C = dc.data(), g.ldc = ldc;
        g.dtype = bf ? DType::bf16 : DType::f32;
        ctx.gemm(g);
        out.push_back({"gemm_cublaslt", describe(g), bf ? "bf16" : "fp32",
                       rel_error(down(dc, false), ref), 1e-4});
      }
}

// One attention case through laga's tiled kernel (fp32 or bf16) and, for
// bf16, cuDNN's SDPA (packed documents as its ragged batch) where it takes
// the shape.
void check_attention_case(std::vector<Result>& out, AttnShape s,
                          const std::vector<std::int64_t>& docs, bool bf) {
  const Vec q = inputs(s.B * s.Sq * s.Hq * s.dqk, 3, bf),
            k = inputs(s.B * s.Sk * s.Hk * s.dqk, 4, bf),
            v = inputs(s.B * s.Sk * s.Hk * s.dv, 5, bf),
            dout = inputs(s.B * s.Sq * s.Hq * s.dv, 6, bf);
  AttnShape host = s;
  host.doc_start = docs.empty() ? nullptr : docs.data();
  std::vector<double> o(dout.size()), lse(static_cast<std::size_t>(s.B * s.Hq * s.Sq)),
      dq(q.size()), dk(k.size()), dv(v.size());
  attention_reference_forward<double>(host, o.data(), lse.data(), widen(q).data(), widen(k).data(),
                                      widen(v).data());
  attention_reference_backward<double>(host, dq.data(), dk.data(), dv.data(), widen(dout).data(),
                                       widen(q).data(), widen(k).data(), widen(v).data());
  DeviceBuffer dq_ = up(q, bf, "q"), dk_ = up(k, bf, "k"), dv_ = up(v, bf, "v"),
               ddo = up(dout, bf, "dout");
  DeviceBuffer ddocs(8 * std::int64_t(docs.size()), "doc_start");
  ddocs.upload(docs.data(), ddocs.bytes());
  s.doc_start = docs.empty() ? nullptr : ddocs.as<std::int64_t>();
  const std::int64_t e = bf ? 2 : 4;
  DeviceBuffer o_(e * std::int64_t(o.size()), "o"), lse_(4 * std::int64_t(lse.size()), "lse"),
      gq(e * std::int64_t(q.size()), "dq"), gk(e * std::int64_t(k.size()), "dk"),
      gv(e * std::int64_t(v.size()), "dv"), delta(4 * std::int64_t(lse.size()), "delta");
  const double tf = bf ? 2e-2 : 1e-4, tb = bf ? 2e-2 : 1e-3;
  const char* dt = bf ? "bf16" : "fp32";
  const auto record = [&](const char* kernel) {
    out.push_back({cat(kernel, " forward o"), attn_shape(s), dt, rel_error(down(o_, bf), o), tf});
    out.push_back(
        {cat(kernel, " forward lse"), attn_shape(s), dt, rel_error(down(lse_, false), lse), tf});
    out.push_back(
        {cat(kernel, " backward dq"), attn_shape(s), dt, rel_error(down(gq, bf), dq), tb});
    out.push_back(
        {cat(kernel, " backward dk"), attn_shape(s), dt, rel_error(down(gk, bf), dk), tb});
    out.push_back(
        {cat(kernel, " backward dv"), attn_shape(s), dt, rel_error(down(gv, bf), dv), tb});
  };
  if (bf) {
    attention_forward<bf16>(s, o_.as<bf16>(), lse_.as<float>(), dq_.as<bf16>(), dk_.as<bf16>(),
                            dv_.as<bf16>());
    attention_backward<bf16>(s, gq.as<bf16>(), gk.as<bf16>(), gv.as<bf16>(), ddo.as<bf16>(),
                             dq_.as<bf16>(), dk_.as<bf16>(), dv_.as<bf16>(), o_.as<bf16>(),
                             lse_.as<float>(), delta.as<float>());
  } else {
    attention_forward<float>(s, o_.as<float>(), lse_.as<float>(), dq_.as<float>(), dk_.as<float>(),
                             dv_.as<float>());
    attention_backward<float>(s, gq.as<float>(), gk.as<float>(), gv.as<float>(), ddo.as<float>(),
                              dq_.as<float>(), dk_.as<float>(), dv_.as<float>(), o_.as<float>(),
                              lse_.as<float>(), delta.as<float>());
  }
  record(s.Hk == 1 && s.Hq > 1 ? "latent_attention_cuda_tiled" : "attention_cuda_tiled");
  // cuDNN reads the document structure on the host when it builds the
  // ragged graphs (sdpa_cudnn.hpp), so its shape keeps the host's starts.
  AttnShape on_host_docs = s;
  on_host_docs.doc_start = host.doc_start;
  if (bf && cudnn_sdpa_refusal(on_host_docs, DType::bf16).empty()) {
    CudnnSdpa sdpa(on_host_docs);
    sdpa.forward(o_.as<bf16>(), lse_.as<float>(), dq_.as<bf16>(), dk_.as<bf16>(), dv_.as<bf16>());
    sdpa.backward(gq.as<bf16>(), gk.as<bf16>(), gv.as<bf16>(), ddo.as<bf16>(), dq_.as<bf16>(),
                  dk_.as<bf16>(), dv_.as<bf16>(), o_.as<bf16>(), lse_.as<float>());
    record("attention_cudnn_sdpa");
  }
}

std::vector<std::int64_t> packed_docs(std::int64_t B, std::int64_t S) {
  std::vector<std::int64_t> d(static_cast<std::size_t>(B * S));
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t start = 0;
    for (std::int64_t t = 0; t < S; ++t) {
      if (t == S / 3 + b || t == (2 * S) / 3) start = t;
      d[static_cast<std::size_t>(b * S + t)] = start;
    }
  }
  return d;
}

void check_attention_ops(std::vector<Result>& out) {
  AttnShape s;
  s.B = 2, s.Sq = 100, s.Sk = 100, s.Hq = 4, s.Hk = 4, s.dqk = 48, s.dv = 32, s.scale = 0.15;
  for (const bool bf : {false, true}) {
    check_attention_case(out, s, {}, bf);
    AttnShape ring = s;  // a ring step: fewer queries than keys, bottom-right causal
    ring.Sq = 60;
    check_attention_case(out, ring, {}, bf);
    AttnShape full = s;
    full.causal = false;
    check_attention_case(out, full, {}, bf);
    check_attention_case(out, s, packed_docs(s.B, s.Sk), bf);
    AttnShape latent = s;  // latent space: one shared key head
    latent.Hk = 1, latent.dqk = 72, latent.dv = 64;
    check_attention_case(out, latent, {}, bf);
    AttnShape v3 = s;  // DeepSeek-V3's head dims, cuDNN's shape
    v3.B = 1, v3.Sq = v3.Sk = 256, v3.Hq = v3.Hk = 2, v3.dqk = 192, v3.dv = 128;
    check_attention_case(out, v3, {}, bf);
  }
}

// One fused latent case (laga_fused's kernel) in `dtype`, against the
// float64 reference (kernels/attention_flash_latent.hpp,
// attention_latent_reference_*) on the same inputs. bf16: the inputs are
// bf16 values (a bf16 run's q, latent, rounded wkv_b rows and dO), and the
// kernel is also held to the CPU's bf16 fused path, the fp32 kernel
// attention_flash_latent_*<float> on the same values (the flash_latent_fp32
// row a bf16 run picks). Neither rounds anything inside (cuda/attention.hpp,
// fused_latent_forward), so each is within fp32's tolerance of float64
// (1e-4 forward, 1e-3 backward: fp32 sums in other orders) and the two within
// twice it of each other; a bf16 rounding of K, V or P where the CPU has
// none would be ~4e-3, a wrong fragment index O(1).
void check_fused_latent_case(std::vector<Result>& out, const LatentAttnParams<float>& shape,
                             const std::vector<std::int64_t>& docs, DType dtype) {
  const bool bf = dtype == DType::bf16;
  LatentAttnParams<float> p = shape;
  const AttnShape& s = p.shape;
  const std::int64_t dr = s.dqk - p.dn, W = p.C + dr, KV = p.dn + s.dv;
  const Vec q = inputs(s.B * s.Sq * s.Hq * s.dqk, 7, bf), lat = inputs(s.B * s.Sk * W, 8, bf),
            w = inputs(s.Hq * KV * p.C, 9, bf), dout = inputs(s.B * s.Sq * s.Hq * s.dv, 10, bf);
  LatentAttnParams<double> r;
  r.shape = s, r.C = p.C, r.dn = p.dn, r.ld_c = W, r.ld_k_pe = W;
  r.shape.doc_start = docs.empty() ? nullptr : docs.data();
  const auto qd = widen(q), ld = widen(lat), wd = widen(w), dd = widen(dout);
  r.q = qd.data(), r.c = ld.data(), r.k_pe = ld.data() + p.C, r.w_kv = wd.data();
  std::vector<double> o(dout.size()), lse(static_cast<std::size_t>(s.B * s.Hq * s.Sq)),
      dq(q.size()), dlat(lat.size()), dw(w.size(), 0.0);
  attention_latent_reference_forward<double>(r, o.data(), lse.data());
  LatentAttnGrads<double> rg{dq.data(), dlat.data(), W, dlat.data() + p.C, W, dw.data()};
  attention_latent_reference_backward<double>(r, rg, dd.data());
  DeviceBuffer q_ = up(q, false, "q"), l_ = up(lat, false, "latent"), w_ = up(w, false, "wkv_b"),
               do_ = up(dout, false, "dout"), o_(4 * std::int64_t(o.size()), "o"),
               lse_(4 * std::int64_t(lse.size()), "lse"), gq(4 * std::int64_t(q.size()), "dq"),
               gl(4 * std::int64_t(lat.size()), "dlatent"), gw(4 * std::int64_t(w.size()), "dw"),
               delta(4 * std::int64_t(lse.size()), "delta"),
               ddocs(8 * std::int64_t(docs.size()), "doc_start");
  ddocs.upload(docs.data(), ddocs.bytes());
  gw.zero();
  p.shape.doc_start = docs.empty() ? nullptr : ddocs.as<std::int64_t>();
  p.q = q_.as<float>(), p.c = l_.as<float>(), p.ld_c = W, p.k_pe = l_.as<float>() + p.C;
  p.ld_k_pe = W, p.w_kv = w_.as<float>();
  fused_latent_forward(p, o_.as<float>(), lse_.as<float>(), dtype);
  LatentAttnGrads<float> g{gq.as<float>(), gl.as<float>(), W, gl.as<float>() + p.C, W,
                           gw.as<float>()};
  fused_latent_backward(p, g, do_.as<float>(), o_.as<float>(), lse_.as<float>(), delta.as<float>(),
                        dtype);
  const std::string sh = cat(attn_shape(r.shape), " C ", p.C, " dn ", p.dn);
  const char* dt = bf ? "bf16" : "fp32";
  const Vec go = down(o_, false), glse = down(lse_, false), gdq = down(gq, false),
            gdl = down(gl, false), gdw = down(gw, false);
  const auto record = [&](const char* vs, const std::vector<double>& ro,
                          const std::vector<double>& rl, const std::vector<double>& rq,
                          const std::vector<double>& rlat, const std::vector<double>& rw, double tf,
                          double tb) {
    const auto name = [&](const char* what) { return cat("fused_latent_cuda ", what, vs); };
    out.push_back({name("forward o"), sh, dt, rel_error(go, ro), tf});
    out.push_back({name("forward lse"), sh, dt, rel_error(glse, rl), tf});
    out.push_back({name("backward dq"), sh, dt, rel_error(gdq, rq), tb});
    out.push_back({name("backward d[c | k_pe]"), sh, dt, rel_error(gdl, rlat), tb});
    out.push_back({name("backward dw_kv"), sh, dt, rel_error(gdw, rw), tb});
  };
  record("", o, lse, dq, dlat, dw, 1e-4, 1e-3);
  if (!bf) return;
  // The CPU's bf16 fused path on the same values.
  LatentAttnParams<float> c = p;
  c.shape.doc_start = r.shape.doc_start;
  c.q = q.data(), c.c = lat.data(), c.k_pe = lat.data() + p.C, c.w_kv = w.data();
  Vec co(o.size()), cl(lse.size()), cq(q.size()), cdl(lat.size()), cw(w.size(), 0.f);
  attention_flash_latent_forward<float>(c, co.data(), cl.data());
  attention_flash_latent_backward<float>(
      c, LatentAttnGrads<float>{cq.data(), cdl.data(), W, cdl.data() + p.C, W, cw.data()},
      dout.data(), co.data(), cl.data());
  record(" vs CPU bf16 path", widen(co), widen(cl), widen(cq), widen(cdl), widen(cw), 2e-4, 2e-3);
}

void check_fused_latent(std::vector<Result>& out) {
  LatentAttnParams<float> p;
  AttnShape& s = p.shape;
  s.B = 2, s.Sq = 70, s.Sk = 70, s.Hq = s.Hk = 3, s.dqk = 24, s.dv = 16, s.scale = 0.2;
  p.C = 32, p.dn = 16;
  check_fused_latent_case(out, p, {}, DType::f32);
  // bf16: C 40 (a tensor-core step of 16 half past the end), 70 keys (a
  // partial key chunk), packed documents; then DeepSeek-V3's heads (dn 128,
  // dr 64, dv 128, C 512) on a ring step's shape (Sq < Sk).
  p.C = 40;
  check_fused_latent_case(out, p, packed_docs(s.B, s.Sk), DType::bf16);
  s.B = 1, s.Sq = 96, s.Sk = 160, s.Hq = s.Hk = 2, s.dqk = 192, s.dv = 128, s.scale = 0.07;
  p.C = 512, p.dn = 128;
  check_fused_latent_case(out, p, {}, DType::bf16);
}

void check_small_ops(std::vector<Result>& out) {
  {  // RMSNorm, x a slice of wider rows
    const std::int64_t N = 37, C = 512, ldx = 576;
    const Vec x = inputs(N * ldx, 11, false), w = inputs(C, 12, false),
              dy = inputs(N * C, 13, false);
    std::vector<double> y(static_cast<std::size_t>(N * C)), rstd(N), dx(y.size()), dw(C, 0.0);
    rmsnorm_forward_reference<double>(y.data(), rstd.data(), widen(x).data(), ldx, widen(w).data(),
                                      N, C, 1e-6);
    rmsnorm_backward_reference<double>(dx.data(), C, dw.data(), widen(dy).data(), C,
                                       widen(x).data(), ldx, widen(w).data(), rstd.data(), N, C);
    DeviceBuffer x_ = up(x, false, "x"), w_ = up(w, false, "w"), dy_ = up(dy, false, "dy"),
                 y_(4 * N * C, "y"), r_(4 * N, "rstd"), dx_(4 * N * C, "dx"), dw_(4 * C, "dw");
    dw_.zero();
    rmsnorm_forward(y_.as<float>(), r_.as<float>(), x_.as<float>(), ldx, w_.as<float>(), N, C,
                    1e-6);
    rmsnorm_backward(dx_.as<float>(), C, dw_.as<float>(), dy_.as<float>(), C, x_.as<float>(), ldx,
                     w_.as<float>(), r_.as<float>(), N, C);
    const std::string sh = cat("N ", N, " C ", C, " ldx ", ldx);
    out.push_back({"rmsnorm_cuda forward", sh, "fp32", rel_error(down(y_, false), y), 1e-5});
    out.push_back({"rmsnorm_cuda backward dx", sh, "fp32", rel_error(down(dx_, false), dx), 1e-4});
    out.push_back({"rmsnorm_cuda backward dw", sh, "fp32", rel_error(down(dw_, false), dw), 1e-4});
  }
  {  // RoPE forward and inverse, against the CPU's rope_apply in double
    RopeParams rp;
    rp.dim = 64, rp.yarn = true, rp.original_seq_len = 64;
    const std::int64_t B = 2, L = 50, H = 3, ld_head = 192, ld_token = H * ld_head, pos0 = 30;
    const RopeTable table(rp, pos0 + L);
    const Vec x = inputs(B * L * ld_token, 14, false);
    const std::int64_t half = rp.dim / 2;
    Vec c(static_cast<std::size_t>(table.positions() * half)), sn(c.size());
    for (std::int64_t p = 0; p < table.positions(); ++p)
      for (std::int64_t i = 0; i < half; ++i)
        c[std::size_t(p * half + i)] = float(table.cos(p, i)),
                                 sn[std::size_t(p * half + i)] = float(table.sin(p, i));
    DeviceBuffer c_ = up(c, false, "cos"), s_ = up(sn, false, "sin");
    const DeviceRope dr{c_.as<float>(), s_.as<float>(), rp.dim, table.positions()};
    for (const bool inv : {false, true}) {
      std::vector<double> ref = widen(x);
      rope_apply<double>(ref.data() + 128, B, L, H, ld_token, ld_head, pos0, table, inv);
      DeviceBuffer x_ = up(x, false, "x");
      rope_apply(x_.as<float>() + 128, B, L, H, ld_token, ld_head, pos0, nullptr, dr, inv);
      out.push_back({inv ? "rope_cuda backward" : "rope_cuda forward",
                     cat("B ", B, " L ", L, " H ", H, " dim 64 at column 128, pos0 ", pos0), "fp32",
                     rel_error(down(x_, false), ref), 1e-5});
    }
  }
  {  // lse merge: a later ring step into the rank's rows
    LseMergeShape m;
    m.Bc = 2, m.Sq = 20, m.H = 3, m.dv = 16, m.L = 50, m.b0 = 0, m.q_row = 13;
    const Vec o = inputs(m.Bc * m.L * m.H * m.dv, 15, false),
              l = inputs(m.Bc * m.H * m.L, 16, false),
              op = inputs(m.Bc * m.Sq * m.H * m.dv, 17, false),
              lp = inputs(m.Bc * m.H * m.Sq, 18, false);
    std::vector<double> ro = widen(o), rl = widen(l);
    lse_merge_reference<double>(m, ro.data(), rl.data(), widen(op).data(), widen(lp).data());
    DeviceBuffer o_ = up(o, false, "o"), l_ = up(l, false, "lse"), op_ = up(op, false, "o_p"),
                 lp_ = up(lp, false, "lse_p");
    lse_merge(m, o_.as<float>(), l_.as<float>(), op_.as<float>(), lp_.as<float>());
    const std::string sh = "Bc 2 Sq 20 H 3 dv 16 into L 50 at row 13";
    out.push_back({"lse_merge_cuda o", sh, "fp32", rel_error(down(o_, false), ro), 1e-5});
    out.push_back({"lse_merge_cuda lse", sh, "fp32", rel_error(down(l_, false), rl), 1e-5});
  }
}

// Median seconds of fn() over reps after one warm-up, by CUDA events.
double median_seconds(const std::function<void()>& fn, int reps) {
  fn();
  check_cuda(cudaDeviceSynchronize(), "warm-up");
  std::vector<double> t;
  cudaEvent_t a, b;
  check_cuda(cudaEventCreate(&a), "cudaEventCreate");
  check_cuda(cudaEventCreate(&b), "cudaEventCreate");
  for (int r = 0; r < reps; ++r) {
    check_cuda(cudaEventRecord(a), "cudaEventRecord (start)");
    fn();
    check_cuda(cudaEventRecord(b), "cudaEventRecord (end)");
    check_cuda(cudaEventSynchronize(b), "timed call");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(ms / 1e3);
  }
  (void)cudaEventDestroy(a), (void)cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Timing {
  std::string kernel, pass;
  std::int64_t S = 0, H = 0;
  double seconds = 0, tflops = 0;
};

void time_attention(std::vector<Timing>& out, const std::vector<std::int64_t>& seqs, std::int64_t H,
                    double budget_s) {
  const auto start = std::chrono::steady_clock::now();
  const auto spent = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (const std::string kernel : {"attention_cudnn_sdpa", "attention_cuda_tiled"}) {
    double last_call = 0;  // seconds of the last S's slowest pass
    for (const std::int64_t S : seqs) {
      // Each doubling of S quadruples the work: skip what would not fit the budget.
      if (last_call > 0 && spent() + 4 * last_call * 8 > budget_s) {
        std::cerr << "laga_cuda_check: " << kernel << " at S " << S << " skipped (budget)\n";
        continue;
      }
      AttnShape s;
      s.B = 1, s.Sq = s.Sk = S, s.Hq = s.Hk = H, s.dqk = 192, s.dv = 128, s.scale = 0.07;
      if (kernel == "attention_cudnn_sdpa" && !cudnn_sdpa_refusal(s, DType::bf16).empty()) break;
      const std::int64_t nq = S * H * 192, nv = S * H * 128;
      DeviceBuffer q(2 * nq, "q"), k(2 * nq, "k"), v(2 * nv, "v"), o(2 * nv, "o"),
          dout(2 * nv, "dout"), lse(4 * H * S, "lse"), dq(2 * nq, "dq"), dk(2 * nq, "dk"),
          dv(2 * nv, "dv"), delta(4 * H * S, "delta");
      for (DeviceBuffer* d : {&q, &k, &v, &dout})
        check_cuda(cudaMemset(d->data(), 0x3c, d->bytes()), "fill");
      const double fwd_flops = s.useful_flops_forward();
      std::function<void()> fwd, bwd;
      std::unique_ptr<CudnnSdpa> sdpa;
      if (kernel == "attention_cudnn_sdpa") {
        sdpa = std::make_unique<CudnnSdpa>(s);
        fwd = [&] {
          sdpa->forward(o.as<bf16>(), lse.as<float>(), q.as<bf16>(), k.as<bf16>(), v.as<bf16>());
        };
        bwd = [&] {
          sdpa->backward(dq.as<bf16>(), dk.as<bf16>(), dv.as<bf16>(), dout.as<bf16>(), q.as<bf16>(),
                         k.as<bf16>(), v.as<bf16>(), o.as<bf16>(), lse.as<float>());
        };
      } else {
        fwd = [&] {
          attention_forward<bf16>(s, o.as<bf16>(), lse.as<float>(), q.as<bf16>(), k.as<bf16>(),
                                  v.as<bf16>());
        };
        bwd = [&] {
          attention_backward<bf16>(s, dq.as<bf16>(), dk.as<bf16>(), dv.as<bf16>(), dout.as<bf16>(),
                                   q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), o.as<bf16>(),
                                   lse.as<float>(), delta.as<float>());
        };
      }
      fwd();
      check_cuda(cudaDeviceSynchronize(), "first forward");
      const double tf = median_seconds(fwd, 5);
      const double tb = median_seconds(bwd, 3);
      // Backward does 2.5x forward's multiply-adds (QK^T again, dP, dV, dQ, dK).
      out.push_back({kernel, "forward", S, H, tf, fwd_flops / tf / 1e12});
      out.push_back({kernel, "backward", S, H, tb, 2.5 * fwd_flops / tb / 1e12});
      last_call = std::max(tf, tb);
    }
  }
}

// The fused latent kernel at DeepSeek-V3's heads (192/128, dn 128, C 512)
// with a P 8 rank's heads (H / 8), forward and backward, bf16 (its
// up-projection on tensor cores) beside fp32, S up to what fits the budget.
// TFLOP/s counts the attention's useful FLOPs only (as the attention rows
// do), not the up-projection's, so the rows compare with the attention
// kernels' time for the same attention.
void time_fused_latent(std::vector<Timing>& out, const std::vector<std::int64_t>& seqs,
                       std::int64_t H, double budget_s) {
  const auto start = std::chrono::steady_clock::now();
  const auto spent = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (const DType dt : {DType::bf16, DType::f32}) {
    const std::string kernel = cat("fused_latent_cuda ", dt == DType::bf16 ? "bf16" : "fp32");
    double last_call = 0;
    for (const std::int64_t S : seqs) {
      if (last_call > 0 && spent() + 4 * last_call * 8 > budget_s) {
        std::cerr << "laga_cuda_check: " << kernel << " at S " << S << " skipped (budget)\n";
        continue;
      }
      LatentAttnParams<float> p;
      AttnShape& s = p.shape;
      s.B = 1, s.Sq = s.Sk = S, s.Hq = s.Hk = H, s.dqk = 192, s.dv = 128, s.scale = 0.07;
      p.C = 512, p.dn = 128;
      const std::int64_t W = p.C + s.dqk - p.dn, KV = p.dn + s.dv;
      DeviceBuffer q(4 * S * H * s.dqk, "q"), lat(4 * S * W, "latent"), w(4 * H * KV * p.C, "w_kv"),
          o(4 * S * H * s.dv, "o"), dout(4 * S * H * s.dv, "dout"), lse(4 * H * S, "lse"),
          dq(4 * S * H * s.dqk, "dq"), dlat(4 * S * W, "dlatent"), dw(4 * H * KV * p.C, "dw_kv"),
          delta(4 * H * S, "delta");
      for (DeviceBuffer* d : {&q, &lat, &w, &dout})
        check_cuda(cudaMemset(d->data(), 0x3c, d->bytes()), "fill");
      dw.zero();
      p.q = q.as<float>(), p.c = lat.as<float>(), p.ld_c = W, p.k_pe = lat.as<float>() + p.C;
      p.ld_k_pe = W, p.w_kv = w.as<float>();
      const LatentAttnGrads<float> g{dq.as<float>(), dlat.as<float>(), W, dlat.as<float>() + p.C, W,
                                     dw.as<float>()};
      const std::function<void()> fwd = [&] {
        fused_latent_forward(p, o.as<float>(), lse.as<float>(), dt);
      };
      const std::function<void()> bwd = [&] {
        fused_latent_backward(p, g, dout.as<float>(), o.as<float>(), lse.as<float>(),
                              delta.as<float>(), dt);
      };
      const double fwd_flops = s.useful_flops_forward();
      const double tf = median_seconds(fwd, 3);
      const double tb = median_seconds(bwd, 3);
      out.push_back({kernel, "forward", S, H, tf, fwd_flops / tf / 1e12});
      out.push_back({kernel, "backward", S, H, tb, 2.5 * fwd_flops / tb / 1e12});
      last_call = std::max(tf, tb);
    }
  }
}

void time_gemm(std::vector<Timing>& out) {
  GemmContext ctx;
  const std::int64_t M = 16384, N = 1536, K = 7168;  // x (S, D) by wq_a^T at S 16384
  DeviceBuffer a(2 * M * K, "a"), b(2 * N * K, "b"), c(4 * M * N, "c");
  check_cuda(cudaMemset(a.data(), 0x3c, a.bytes()), "fill");
  check_cuda(cudaMemset(b.data(), 0x3c, b.bytes()), "fill");
  GemmArgs g;
  g.trans_b = true, g.M = M, g.N = N, g.K = K, g.A = a.data(), g.lda = K, g.B = b.data(), g.ldb = K;
  g.C = c.data(), g.ldc = N, g.dtype = DType::bf16;
  const double t = median_seconds([&] { ctx.gemm(g); }, 10);
  out.push_back({"gemm_cublaslt bf16 (M 16384, N 1536, K 7168)", "forward", M, 0, t,
                 2.0 * M * N * K / t / 1e12});
}

int run(int argc, char** argv) {
  CLI::App app("laga_cuda_check: the CUDA backend's ops against the CPU, and their times");
  std::string json_path = "cuda_check.json", table_path;
  std::vector<std::int64_t> seqs{4096, 8192, 16384, 32768};
  std::int64_t heads = 128;
  double budget = 240;
  bool dry = false;
  app.add_option("--json", json_path, "where the JSON goes");
  app.add_option("--table", table_path, "where the markdown table goes");
  app.add_option("--seqs", seqs, "sequence lengths timed")->delimiter(',');
  app.add_option("--heads", heads, "heads timed");
  app.add_option("--budget-s", budget, "seconds the timings may take, about");
  app.add_flag("--dry-run", dry, "list what would run; no device needed");
  CLI11_PARSE(app, argc, argv);
  json j;
  j["seqs"] = seqs, j["heads"] = heads, j["cudnn_sdpa_built"] = cudnn_sdpa_built();
  j["checks"] = {"gemm_cublaslt fp32/bf16 x 4 transposes",
                 "attention_cuda_tiled fp32/bf16: causal, ring step Sq < Sk, full, packed, latent "
                 "Hk 1, 192/128",
                 "attention_cudnn_sdpa bf16 where it takes the shape",
                 "fused_latent_cuda fp32; bf16 vs float64 and vs the CPU's bf16 fused path "
                 "(packed, and 192/128 C 512 on a ring step)",
                 "rmsnorm_cuda",
                 "rope_cuda",
                 "lse_merge_cuda",
                 "sparse_gather_cuda fp32/bf16: per head, latent Hk 1, 576/512, 192/128 K > Sk; "
                 "dk, dv bits on a second run; cub's sort storage within the scratch's bound "
                 "(up to V3.2's latent S 128k)",
                 "copy_rows_cuda and fill_cuda, bit for bit"};
  if (dry) {
    j["ran"] = false;
    std::ofstream(json_path) << j.dump(2) << "\n";
    std::cout << "laga_cuda_check --dry-run: " << j["checks"].size()
              << " check groups; timings at S";
    for (auto s : seqs) std::cout << " " << s;
    std::cout << ", H " << heads << "; wrote " << json_path << "\n";
    return 0;
  }
  const std::string why = device_unavailable_reason();
  if (!why.empty()) {
    std::cerr << "laga_cuda_check: " << why << "\n";
    return 2;
  }
  const DeviceInfo d = current_device();
  j["device"] = {{"name", d.name},
                 {"sm", d.sm_major * 10 + d.sm_minor},
                 {"memory_bytes", d.memory_bytes},
                 {"driver", d.driver_version},
                 {"runtime", d.runtime_version}};
  MemoryPool pool;
  PoolScope scope(pool);
  std::vector<Result> results;
  const auto guarded = [&](const char* what, const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      results.push_back({what, e.what(), "-", INFINITY, 0});
    }
  };
  guarded("gemm", [&] { check_gemm_ops(results); });
  guarded("attention", [&] { check_attention_ops(results); });
  guarded("fused latent", [&] { check_fused_latent(results); });
  guarded("rmsnorm/rope/lse_merge", [&] { check_small_ops(results); });
  guarded("sparse attention", [&] { check_sparse_attention(results); });
  guarded("copy_rows/fill", [&] { check_moves(results); });
  std::vector<Timing> times;
  guarded("timing gemm", [&] { time_gemm(times); });
  // The fused kernel first, in a quarter of the budget; attention in what is left.
  const auto timing_start = std::chrono::steady_clock::now();
  guarded("timing fused latent", [&] {
    time_fused_latent(times, seqs, std::max<std::int64_t>(1, heads / 8), budget / 4);
  });
  const double fused_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - timing_start).count();
  guarded("timing attention", [&] { time_attention(times, seqs, heads, budget - fused_s); });
  int failed = 0;
  for (const Result& r : results) {
    failed += !r.pass();
    j["results"].push_back({{"op", r.name},
                            {"shape", r.shape},
                            {"dtype", r.dtype},
                            {"error", std::isfinite(r.error) ? json(r.error) : json("inf")},
                            {"tol", r.tol},
                            {"pass", r.pass()}});
  }
  for (const Timing& t : times)
    j["timings"].push_back({{"kernel", t.kernel},
                            {"pass", t.pass},
                            {"S", t.S},
                            {"H", t.H},
                            {"seconds", t.seconds},
                            {"tflops", t.tflops}});
  j["ran"] = true, j["failed"] = failed, j["peak_device_bytes"] = pool.peak_total();
  std::ofstream(json_path) << j.dump(2) << "\n";
  std::ostringstream md;
  md << "device: " << d.name << " (sm_" << d.sm_major << d.sm_minor << "), driver "
     << d.driver_version << ", CUDA runtime " << d.runtime_version
     << "\n\n| op | shape | dtype | error | tol | |\n|---|---|---|---|---|---|\n";
  for (const Result& r : results)
    md << "| " << r.name << " | " << r.shape << " | " << r.dtype << " | " << r.error << " | "
       << r.tol << " | " << (r.pass() ? "pass" : "FAIL") << " |\n";
  md << "\n| kernel | pass | S | H | ms | TFLOP/s |\n|---|---|---|---|---|---|\n";
  for (const Timing& t : times)
    md << "| " << t.kernel << " | " << t.pass << " | " << t.S << " | " << t.H << " | "
       << t.seconds * 1e3 << " | " << t.tflops << " |\n";
  std::cout << md.str();
  if (!table_path.empty()) std::ofstream(table_path) << md.str();
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace laga::cuda

int main(int argc, char** argv) {
  try {
    return laga::cuda::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "laga_cuda_check: " << e.what() << "\n";
    return 2;
  }
}
