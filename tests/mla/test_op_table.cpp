// The kernel table (mla/op_table.hpp), as ggml's test-backend-ops checks its
// backends: every op on every device this build has, on every kernel variant
// the table can pick that this machine runs (each switch's settings:
// LAGA_GEMM_BF16's paths, the flash ISAs, the bf16 flash ISAs), run through
// its row on small random operands against the naive double reference; and
// that supports() names the row it picks and refuses what no row takes,
// naming the refused value.
//
// Tolerances, relative to the reference's largest magnitude: fp64 1e-12 (the
// same sums in another order); fp32 1e-5 (sums of at most 64 terms at
// 2^-24 each, about 4e-6). bf16 calls get bf16 values as inputs, so a row
// that computes in fp32 on them (GEMMs summing exact products in fp32, the
// widening rows, the fused latent kernel, the row-wise ops) meets fp32's;
// the bf16 flash kernels, which round P and dS, meet the elementwise
// bounds of tests/kernels/test_attention_flash_bf16.cpp (bf16_bounds).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "common/naive_dsa.hpp"
#include "core/bf16.hpp"
#include "core/error.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash.hpp"
#include "kernels/attention_flash_bf16.hpp"
#include "kernels/attention_flash_latent.hpp"
#include "kernels/dsa_indexer.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_bf16.hpp"
#include "kernels/lse_merge.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/rope.hpp"
#include "mla/form_spec.hpp"
#include "mla/op_table.hpp"

namespace laga::ops {
namespace {

constexpr double kU = 1.0 / 256;

double tolerance(RunDtype d) {
  return d == RunDtype::fp64 ? 1e-12 : 1e-5;
}

// max |a - ref| <= tol max |ref|.
void expect_close(const std::vector<double>& a, const std::vector<double>& ref, double tol,
                  const std::string& what) {
  ASSERT_EQ(a.size(), ref.size()) << what;
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  EXPECT_GT(scale, 0) << what << ": an all-zero reference checks nothing";
  EXPECT_LE(diff, tol * scale) << what << ": max |diff| " << diff << ", max |ref| " << scale;
}

// |a - ref| <= tol_i elementwise.
void expect_within(const std::vector<double>& a, const std::vector<double>& ref,
                   const std::vector<double>& tol, const std::string& what) {
  ASSERT_EQ(a.size(), ref.size()) << what;
  std::size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double r = std::abs(a[i] - ref[i]) / tol[i];
    bad += r > 1;
    if (r > worst_ratio) worst_ratio = r, worst = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements out of bounds, worst " << worst << ": "
                     << a[worst] << " against " << ref[worst] << " (tolerance " << tol[worst]
                     << ")";
}

// The bf16 flash kernels' error bounds, per element, as
// tests/kernels/test_attention_flash_bf16.cpp derives them (bounds_of; its
// comment gives the reasoning): each term of o and dv carries one rounding
// of p, each of dq and dk one of dS plus D's error through o's:
//   A_o = sum_j p |v|,  A_dv = sum_i p |do|,
//   e_ij = scale p_ij (|dP_ij| + |D_i| + sum_n |do_in| A_o[i,n]),
//   A_dq = sum_j e_ij |k_j|,  A_dk = sum_i e_ij |q_i|;
// an output is within u A of the exact one, and the test allows 2 u A (the
// fp32 sums' own error as margin) plus 2^-20 max |ref| where A is 0.
struct AttentionBounds {
  std::vector<double> o, dq, dk, dv;
};
AttentionBounds bf16_bounds(const AttnShape& a, const std::vector<double>& q,
                            const std::vector<double>& k, const std::vector<double>& v,
                            const std::vector<double>& dout, const std::vector<double>& o,
                            const std::vector<double>& lse) {
  AttentionBounds A{std::vector<double>(o.size()), std::vector<double>(q.size()),
                    std::vector<double>(k.size()), std::vector<double>(v.size())};
  const std::int64_t group = a.Hq / a.Hk;
  for (std::int64_t b = 0; b < a.B; ++b)
    for (std::int64_t h = 0; h < a.Hq; ++h)
      for (std::int64_t i = 0; i < a.Sq; ++i) {
        const std::int64_t hk = h / group, qi = ((b * a.Sq + i) * a.Hq + h);
        const std::int64_t kb = a.key_begin(b, i), ke = a.key_end(i);
        auto prob = [&](std::int64_t j) {
          const std::int64_t kj = (b * a.Sk + j) * a.Hk + hk;
          double sc = 0;
          for (std::int64_t e = 0; e < a.dqk; ++e) sc += q[qi * a.dqk + e] * k[kj * a.dqk + e];
          return std::exp(a.scale * sc - lse[(b * a.Hq + h) * a.Sq + i]);
        };
        double D = 0, do_ao = 0;
        for (std::int64_t e = 0; e < a.dv; ++e) D += dout[qi * a.dv + e] * o[qi * a.dv + e];
        for (std::int64_t j = kb; j < ke; ++j) {
          const std::int64_t kj = (b * a.Sk + j) * a.Hk + hk;
          for (std::int64_t e = 0; e < a.dv; ++e)
            A.o[qi * a.dv + e] += prob(j) * std::abs(v[kj * a.dv + e]);
        }
        for (std::int64_t e = 0; e < a.dv; ++e)
          do_ao += std::abs(dout[qi * a.dv + e]) * A.o[qi * a.dv + e];
        for (std::int64_t j = kb; j < ke; ++j) {
          const std::int64_t kj = (b * a.Sk + j) * a.Hk + hk;
          const double p = prob(j);
          double dp = 0;
          for (std::int64_t e = 0; e < a.dv; ++e) dp += dout[qi * a.dv + e] * v[kj * a.dv + e];
          const double eij = a.scale * p * (std::abs(dp) + std::abs(D) + do_ao);
          for (std::int64_t e = 0; e < a.dv; ++e)
            A.dv[kj * a.dv + e] += p * std::abs(dout[qi * a.dv + e]);
          for (std::int64_t e = 0; e < a.dqk; ++e) {
            A.dq[qi * a.dqk + e] += eij * std::abs(k[kj * a.dqk + e]);
            A.dk[kj * a.dqk + e] += eij * std::abs(q[qi * a.dqk + e]);
          }
        }
      }
  return A;
}
std::vector<double> tolerances(const std::vector<double>& A, const std::vector<double>& ref) {
  double m = 0;
  for (double r : ref) m = std::max(m, std::abs(r));
  std::vector<double> t(A.size());
  for (std::size_t i = 0; i < A.size(); ++i) t[i] = 2 * kU * A[i] + 0x1p-20 * m;
  return t;
}

// n random values in [-1, 1], bf16 values when the call is bf16 (so that the
// reference sees exactly what a bf16 kernel reads).
std::vector<double> values(std::int64_t n, std::uint64_t seed, RunDtype d) {
  std::vector<double> v(static_cast<std::size_t>(n));
  test::fill_random(v.data(), n, seed);
  if (d == RunDtype::bf16)
    for (double& x : v) x = double(to_float(to_bf16(float(x))));
  return v;
}

// A kernel's operand storage in the element type its row takes: double,
// float, or bf16 (Bf16Operands::bf16 on a bf16 call).
struct Buffer {
  enum class Kind { f64, f32, b16 } kind;
  std::vector<double> d;
  std::vector<float> f;
  std::vector<bf16> h;
  Buffer(const std::vector<double>& v, Kind k) : kind(k) {
    if (k == Kind::f64) d = v;
    if (k == Kind::f32) f.assign(v.begin(), v.end());
    if (k == Kind::b16)
      for (double x : v) h.push_back(to_bf16(float(x)));
  }
  void* ptr() {
    return kind == Kind::f64   ? static_cast<void*>(d.data())
           : kind == Kind::f32 ? static_cast<void*>(f.data())
                               : static_cast<void*>(h.data());
  }
  std::vector<double> get() const {
    if (kind == Kind::f64) return d;
    if (kind == Kind::f32) return {f.begin(), f.end()};
    std::vector<double> r;
    for (bf16 x : h) r.push_back(to_float(x));
    return r;
  }
};
Buffer::Kind operand_kind(const KernelRow& row, RunDtype d) {
  if (d == RunDtype::fp64) return Buffer::Kind::f64;
  if (d == RunDtype::bf16 && row.operands == Bf16Operands::bf16) return Buffer::Kind::b16;
  return Buffer::Kind::f32;
}
// Outputs: double for fp64, else fp32 (bf16 calls' outputs are fp32 sums).
Buffer::Kind output_kind(RunDtype d) {
  return d == RunDtype::fp64 ? Buffer::Kind::f64 : Buffer::Kind::f32;
}

// 64-byte-aligned scratch for a row's workspace.
struct Workspace {
  void* p = nullptr;
  std::int64_t bytes = 0;
  Workspace(const KernelRow& row, RunDtype d, const OpShape& s) {
    if (!row.workspace_bytes) return;
    bytes = (row.workspace_bytes(d, s) + 63) / 64 * 64;
    if (bytes > 0) p = std::aligned_alloc(64, static_cast<std::size_t>(bytes));
  }
  ~Workspace() { std::free(p); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};

const std::vector<RunDtype> kDtypes{RunDtype::fp64, RunDtype::fp32, RunDtype::bf16};

// The row supports() picks, checked to be one of `names` (the row the
// switches select), or null with the refusal recorded.
const KernelRow* picked(Device dev, Op op, RunDtype d, const OpShape& s) {
  const KernelChoice c = supports(dev, op, d, s);
  if (c) {
    EXPECT_TRUE(c.why_not.empty());
  }
  return c.row;
}

// Every switch setting this machine runs, each a function selecting it; f
// runs once per setting.
template <class F>
void for_each_variant(F&& f) {
  const GemmBf16Path gemm0 = gemm_bf16_path();
  const FlashIsa flash0 = flash_isa();
  const FlashBf16Isa bf0 = flash_bf16_isa();
  std::vector<GemmBf16Path> paths{GemmBf16Path::widened_fp32};
  try {
    set_gemm_bf16_path(GemmBf16Path::onednn_bf16);
    paths.push_back(GemmBf16Path::onednn_bf16);
  } catch (const Error&) {  // no bf16 matmul on this CPU: its row must refuse
  }
  for (GemmBf16Path p : paths)
    for (FlashIsa isa : flash_isas_available())
      for (FlashBf16Isa bisa : flash_bf16_isas_available()) {
        set_gemm_bf16_path(p), set_flash_isa(isa), set_flash_bf16_isa(bisa);
        f(std::string(to_string(p)) + "/" + to_string(isa) + "/" + to_string(bisa));
      }
  set_gemm_bf16_path(gemm0), set_flash_isa(flash0), set_flash_bf16_isa(bf0);
}

// ------------------------------------------------------------------ gemm

void check_gemm(Device dev, RunDtype d, const std::string& tag) {
  for (const bool ta : {false, true}) {
    const bool tb = !ta;
    const std::int64_t m = 7, n = 5, k = 9;
    const double beta = ta ? 1.0 : 0.0;
    OpShape s;
    s.m = m, s.n = n, s.k = k, s.trans_a = ta, s.trans_b = tb;
    s.lda = ta ? m : k, s.ldb = tb ? k : n, s.ldc = n;
    const KernelRow* row = picked(dev, Op::gemm, d, s);
    ASSERT_NE(row, nullptr) << tag << " gemm " << to_string(d);
    if (d == RunDtype::bf16) {
      EXPECT_EQ(std::string(row->name), gemm_bf16_path() == GemmBf16Path::onednn_bf16
                                            ? "gemm_bf16_onednn"
                                            : "gemm_bf16_widened_fp32");
    }
    const std::vector<double> a = values(m * k, 1, d), b = values(k * n, 2, d),
                              c0 = values(m * n, 3, RunDtype::fp64);
    std::vector<double> ref = c0;
    gemm_reference<double>(ta, tb, m, n, k, 0.5, a.data(), s.lda, b.data(), s.ldb, beta, ref.data(),
                           n);
    Buffer A(a, operand_kind(*row, d)), B(b, operand_kind(*row, d)), C(c0, output_kind(d));
    OpCall call;
    call.op = Op::gemm, call.dtype = d, call.shape = s, call.alpha = 0.5, call.beta = beta;
    call.in[0] = A.ptr(), call.in[1] = B.ptr(), call.out[0] = C.ptr();
    row->run(call);
    expect_close(C.get(), ref, tolerance(d), tag + " " + row->name + " " + to_string(d));
  }
}

// ------------------------------------------------------- attention (per-head and latent)

void check_attention(Device dev, RunDtype d, AttentionKind kind, bool latent,
                     const std::string& tag) {
  AttnShape a{2, 9, 9, 3, latent ? 1 : 3, latent ? 7 : 6, 5, 0.4, true};
  OpShape s;
  s.attn = a, s.attention = kind;
  const Op fwd = latent ? Op::latent_attention_forward : Op::attention_forward;
  const Op bwd = latent ? Op::latent_attention_backward : Op::attention_backward;
  const KernelRow* rf = picked(dev, fwd, d, s);
  const KernelRow* rb = picked(dev, bwd, d, s);
  const std::string what = tag + " " + to_string(fwd) + " " + to_string(kind) + " " + to_string(d);
  if (kind == AttentionKind::eager && d == RunDtype::bf16) {  // no bf16 eager kernel
    EXPECT_EQ(rf, nullptr) << what;
    EXPECT_NE(supports(dev, fwd, d, s).why_not.find("bf16"), std::string::npos);
    return;
  }
  ASSERT_NE(rf, nullptr) << what << ": " << supports(dev, fwd, d, s).why_not;
  ASSERT_NE(rb, nullptr) << what;
  EXPECT_EQ(std::string(rf->name), rb->name) << what << ": forward and backward on one kernel";
  if (kind == AttentionKind::flash && d == RunDtype::fp32) {
    EXPECT_EQ(std::string(rf->name), std::string("flash_") + to_string(flash_isa()));
  }
  if (kind == AttentionKind::flash && d == RunDtype::bf16) {
    EXPECT_EQ(std::string(rf->name), flash_bf16_isa() == FlashBf16Isa::avx512_bf16
                                         ? "flash_bf16_avx512_bf16"
                                         : "flash_bf16_widened_fp32");
  }
  const std::int64_t nq = a.B * a.Sq * a.Hq * a.dqk, nk = a.B * a.Sk * a.Hk * a.dqk,
                     nv = a.B * a.Sk * a.Hk * a.dv, no = a.B * a.Sq * a.Hq * a.dv,
                     nl = a.B * a.Hq * a.Sq;
  const std::vector<double> q = values(nq, 4, d), k = values(nk, 5, d), v = values(nv, 6, d),
                            dout = values(no, 7, d);
  std::vector<double> o_ref(no), lse_ref(nl), dq_ref(nq), dk_ref(nk), dv_ref(nv);
  attention_reference_forward<double>(a, o_ref.data(), lse_ref.data(), q.data(), k.data(),
                                      v.data());
  attention_reference_backward<double>(a, dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(),
                                       q.data(), k.data(), v.data());
  const Buffer::Kind in = operand_kind(*rf, d), out = output_kind(d);
  Buffer Q(q, in), K(k, in), V(v, in), DO(dout, in);
  const bool eager = kind == AttentionKind::eager;
  Buffer O(std::vector<double>(no), out), LSE(std::vector<double>(nl), out),
      STATS(std::vector<double>(eager ? nl * a.Sk : nl), out);
  {
    Workspace ws(*rf, d, s);
    OpCall c;
    c.op = fwd, c.dtype = d, c.shape = s, c.workspace = ws.p, c.workspace_bytes = ws.bytes;
    c.in[0] = Q.ptr(), c.in[1] = K.ptr(), c.in[2] = V.ptr();
    c.out[0] = O.ptr(), c.out[1] = STATS.ptr(), c.out[2] = eager ? LSE.ptr() : nullptr;
    rf->run(c);
  }
  const bool bf16 = d == RunDtype::bf16;
  AttentionBounds bounds;
  if (bf16) bounds = bf16_bounds(a, q, k, v, dout, o_ref, lse_ref);
  auto check = [&](const std::vector<double>& got, const std::vector<double>& ref,
                   const std::vector<double>& A, const std::string& name) {
    if (bf16)
      expect_within(got, ref, tolerances(A, ref), what + " " + rf->name + " " + name);
    else
      expect_close(got, ref, tolerance(d), what + " " + rf->name + " " + name);
  };
  check(O.get(), o_ref, bounds.o, "o");
  // lse: fp32 statistics of exact bf16 products (2^-20 relative; the kernel
  // test's 1e-3 (1 + |lse|) holds any ISA's).
  expect_close(eager ? LSE.get() : STATS.get(), lse_ref, bf16 ? 1e-5 : tolerance(d), what + " lse");
  Buffer DQ(std::vector<double>(nq), out), DK(std::vector<double>(nk), out),
      DV(std::vector<double>(nv), out), DP(std::vector<double>(a.Sq * a.Sk), out);
  {
    Workspace ws(*rb, d, s);
    OpCall c;
    c.op = bwd, c.dtype = d, c.shape = s, c.workspace = ws.p, c.workspace_bytes = ws.bytes;
    c.in[0] = DO.ptr(), c.in[1] = Q.ptr(), c.in[2] = K.ptr(), c.in[3] = V.ptr();
    c.in[4] = O.ptr(), c.in[5] = STATS.ptr(), c.in[6] = nullptr;
    c.out[0] = DQ.ptr(), c.out[1] = DK.ptr(), c.out[2] = DV.ptr(), c.out[3] = DP.ptr();
    rb->run(c);
  }
  check(DQ.get(), dq_ref, bounds.dq, "dq");
  check(DK.get(), dk_ref, bounds.dk, "dk");
  check(DV.get(), dv_ref, bounds.dv, "dv");
}

// ------------------------------------------------------- the fused latent attention

// invariant: the invariant mode's call (OpShape::invariant), which the
// flash_latent_invariant rows take (every product on gemm_invariant).
void check_fused(Device dev, RunDtype d, const std::string& tag, bool invariant) {
  const std::int64_t H = 2, C = 6, dn = 4, dr = 2, dvh = 3, W = C + dr;
  AttnShape a{1, 9, 9, H, H, dn + dr, dvh, 0.4, true};
  OpShape s;
  s.attn = a, s.attention = AttentionKind::flash, s.C = C, s.dn = dn;
  s.ld_c = s.ld_k_pe = s.ld_dc = s.ld_dk_pe = W;
  s.invariant = invariant;
  const KernelRow* rf = picked(dev, Op::fused_latent_attention_forward, d, s);
  const KernelRow* rb = picked(dev, Op::fused_latent_attention_backward, d, s);
  const std::string what =
      tag + " fused_latent_attention " + to_string(d) + (invariant ? " invariant" : "");
  ASSERT_NE(rf, nullptr) << what;
  ASSERT_NE(rb, nullptr) << what;
  for (const KernelRow* r : {rf, rb})
    EXPECT_EQ(std::string(r->name) == "flash_latent_invariant", invariant) << what << r->name;
  const std::int64_t nq = a.B * a.Sq * H * a.dqk, nl = a.B * a.Sk * W, nw = H * (dn + dvh) * C,
                     no = a.B * a.Sq * H * dvh;
  const std::vector<double> q = values(nq, 8, d), lat = values(nl, 9, d), w = values(nw, 10, d),
                            dout = values(no, 11, d);
  LatentAttnParams<double> p;
  p.shape = a, p.C = C, p.dn = dn, p.q = q.data(), p.c = lat.data(), p.ld_c = W;
  p.k_pe = lat.data() + C, p.ld_k_pe = W, p.w_kv = w.data();
  std::vector<double> o_ref(no), lse_ref(a.B * H * a.Sq), dq_ref(nq), dlat_ref(nl), dw_ref(nw);
  attention_latent_reference_forward(p, o_ref.data(), lse_ref.data());
  attention_latent_reference_backward<double>(
      p, {dq_ref.data(), dlat_ref.data(), W, dlat_ref.data() + C, W, dw_ref.data()}, dout.data());
  const Buffer::Kind in = operand_kind(*rf, d), out = output_kind(d);
  Buffer Q(q, in), L(lat, in), Wk(w, in), DO(dout, in);
  Buffer O(std::vector<double>(no), out), LSE(std::vector<double>(lse_ref.size()), out);
  OpCall c;
  c.op = Op::fused_latent_attention_forward, c.dtype = d, c.shape = s;
  auto* lp = static_cast<unsigned char*>(L.ptr());
  const std::size_t esz = in == Buffer::Kind::f64 ? 8 : 4;
  c.in[0] = Q.ptr(), c.in[1] = lp, c.in[2] = lp + C * esz, c.in[3] = Wk.ptr();
  c.out[0] = O.ptr(), c.out[1] = LSE.ptr();
  rf->run(c);
  // bf16 calls run the fp32 kernel on bf16 values: fp32's tolerance.
  const double tol = tolerance(d == RunDtype::bf16 ? RunDtype::fp32 : d);
  expect_close(O.get(), o_ref, tol, what + " o");
  expect_close(LSE.get(), lse_ref, tol, what + " lse");
  Buffer DQ(std::vector<double>(nq), out), DL(std::vector<double>(nl), out),
      DW(std::vector<double>(nw), out);
  c.op = Op::fused_latent_attention_backward;
  c.in[4] = DO.ptr(), c.in[5] = O.ptr(), c.in[6] = LSE.ptr();
  auto* dl = static_cast<unsigned char*>(DL.ptr());
  c.out[0] = DQ.ptr(), c.out[1] = dl, c.out[2] = dl + C * esz, c.out[3] = DW.ptr();
  rb->run(c);
  expect_close(DQ.get(), dq_ref, tol, what + " dq");
  expect_close(DL.get(), dlat_ref, tol, what + " dlat");
  expect_close(DW.get(), dw_ref, tol, what + " dw_kv");
}

// ------------------------------------------------------------ row-wise ops

void check_lse_merge(Device dev, RunDtype d, const std::string& tag) {
  for (const bool first : {false, true}) {
    const std::int64_t B = 2, L = 5, H = 2, dvh = 3, Sq = 3, b0 = 1, q_row = 2;
    OpShape s;
    s.attn = AttnShape{1, Sq, 4, H, H, 1, dvh, 1.0, first};
    s.rows = L, s.cols = H, s.b0 = b0, s.q_row = q_row;
    const KernelRow* row = picked(dev, Op::lse_merge, d, s);
    ASSERT_NE(row, nullptr) << tag;
    const std::vector<double> o = values(B * L * H * dvh, 12, d), lse = values(B * H * L, 13, d),
                              op = values(Sq * H * dvh, 14, d), lp = values(H * Sq, 15, d);
    std::vector<double> o_ref = o, lse_ref = lse;
    lse_merge_reference<double>({1, Sq, H, dvh, L, b0, q_row, first}, o_ref.data(), lse_ref.data(),
                                op.data(), lp.data());
    const Buffer::Kind k = output_kind(d);
    Buffer O(o, k), LSE(lse, k), OP(op, k), LP(lp, k);
    OpCall c;
    c.op = Op::lse_merge, c.dtype = d, c.shape = s;
    c.in[0] = OP.ptr(), c.in[1] = LP.ptr(), c.out[0] = O.ptr(), c.out[1] = LSE.ptr();
    row->run(c);
    const double tol = tolerance(d == RunDtype::bf16 ? RunDtype::fp32 : d);
    expect_close(O.get(), o_ref, tol, tag + " lse_merge o");
    expect_close(LSE.get(), lse_ref, tol, tag + " lse_merge lse");
  }
}

void check_rmsnorm(Device dev, RunDtype d, const std::string& tag) {
  const std::int64_t N = 4, C = 8, ldx = 11, lddy = 9, lddx = 10;
  OpShape s;
  s.rows = N, s.cols = C, s.lda = ldx, s.ldb = lddy, s.ldc = lddx;
  const KernelRow* rf = picked(dev, Op::rmsnorm_forward, d, s);
  const KernelRow* rb = picked(dev, Op::rmsnorm_backward, d, s);
  ASSERT_NE(rf, nullptr) << tag;
  ASSERT_NE(rb, nullptr) << tag;
  const std::vector<double> x = values(N * ldx, 16, d), w = values(C, 17, d),
                            dy = values(N * lddy, 18, d);
  std::vector<double> y_ref(N * C), rstd_ref(N), dx_ref(N * lddx), dw_ref(C);
  rmsnorm_forward_reference<double>(y_ref.data(), rstd_ref.data(), x.data(), ldx, w.data(), N, C,
                                    1e-6);
  rmsnorm_backward_reference<double>(dx_ref.data(), lddx, dw_ref.data(), dy.data(), lddy, x.data(),
                                     ldx, w.data(), rstd_ref.data(), N, C);
  const Buffer::Kind k = output_kind(d);
  Buffer X(x, k), Wt(w, k), DY(dy, k), Y(std::vector<double>(N * C), k),
      R(std::vector<double>(N), k), DX(std::vector<double>(N * lddx), k),
      DW(std::vector<double>(C), k);
  OpCall c;
  c.op = Op::rmsnorm_forward, c.dtype = d, c.shape = s, c.alpha = 1e-6;
  c.in[0] = X.ptr(), c.in[1] = Wt.ptr(), c.out[0] = Y.ptr(), c.out[1] = R.ptr();
  rf->run(c);
  const double tol = tolerance(d == RunDtype::bf16 ? RunDtype::fp32 : d);
  expect_close(Y.get(), y_ref, tol, tag + " rmsnorm y");
  OpCall b;
  b.op = Op::rmsnorm_backward, b.dtype = d, b.shape = s;
  b.in[0] = DY.ptr(), b.in[1] = X.ptr(), b.in[2] = Wt.ptr(), b.in[3] = R.ptr();
  b.out[0] = DX.ptr(), b.out[1] = DW.ptr();
  rb->run(b);
  expect_close(DW.get(), dw_ref, tol, tag + " rmsnorm dw");
  std::vector<double> dx = DX.get(), dxr = dx_ref;  // only each row's first C columns are dx
  for (std::int64_t i = 0; i < N; ++i)
    for (std::int64_t j = C; j < lddx; ++j) dx[i * lddx + j] = dxr[i * lddx + j] = 0;
  expect_close(dx, dxr, tol, tag + " rmsnorm dx");
}

void check_rope(Device dev, RunDtype d, const std::string& tag) {
  const std::int64_t B = 2, L = 5, H = 2, dim = 4, ld_head = 6, ld_token = H * ld_head, pos0 = 3;
  RopeParams rp;
  rp.dim = dim, rp.theta = 100;
  const RopeTable table(rp, pos0 + L + 4);
  const std::vector<std::int64_t> positions{0, 1, 2, 0, 1, 7, 8, 2, 3, 4};
  for (const bool at : {false, true})
    for (const bool inverse : {false, true}) {
      OpShape s;
      s.batch = B, s.tokens = L, s.heads = H, s.ld_token = ld_token, s.ld_head = ld_head;
      s.pos0 = pos0;
      const Op op = inverse ? Op::rope_backward : Op::rope_forward;
      const KernelRow* row = picked(dev, op, d, s);
      ASSERT_NE(row, nullptr) << tag;
      const std::vector<double> x = values(B * L * ld_token, 19, d);
      std::vector<double> ref = x;
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t l = 0; l < L; ++l) {
          const std::int64_t pos = at ? positions[std::size_t(b * L + l)] : pos0 + l;
          for (std::int64_t h = 0; h < H; ++h)
            for (std::int64_t i = 0; i < dim / 2; ++i) {
              double* e = ref.data() + (b * L + l) * ld_token + h * ld_head + 2 * i;
              const double cs = table.cos(pos, i), sn = (inverse ? -1 : 1) * table.sin(pos, i);
              const double x0 = e[0], x1 = e[1];
              e[0] = x0 * cs - x1 * sn, e[1] = x0 * sn + x1 * cs;
            }
        }
      Buffer X(x, output_kind(d));
      OpCall c;
      c.op = op, c.dtype = d, c.shape = s, c.context = &table;
      c.in[0] = at ? positions.data() : nullptr, c.out[0] = X.ptr();
      row->run(c);
      const double tol = tolerance(d == RunDtype::bf16 ? RunDtype::fp32 : d);
      expect_close(X.get(), ref, tol, tag + " " + to_string(op) + (at ? " at positions" : ""));
    }
}

// ------------------------------------------------------- sparse attention

// Per-head and latent (one shared key/value head), against the naive
// dense-masked reference (common/naive_dsa.hpp); bf16 on sparse_gather_bf16
// (bf16 q, k, v, dout; fp32 outputs) against the reference on the same bf16
// values, within the fp32 bound (the kernel's arithmetic is the float one's
// on the widened values: kernels/attention_sparse.hpp).
void check_sparse(Device dev, RunDtype d, bool latent, const std::string& tag) {
  const std::int64_t B = 2, S = 6, Hq = 3, Hk = latent ? 1 : 3, dqk = 5, dvh = 4, K = 3;
  OpShape s;
  s.attn = AttnShape{B, S, S, Hq, Hk, dqk, dvh, 0.4, true};
  s.k = K;
  const KernelRow* rf = picked(dev, Op::sparse_attention_forward, d, s);
  const KernelRow* rb = picked(dev, Op::sparse_attention_backward, d, s);
  ASSERT_NE(rf, nullptr) << tag;
  ASSERT_NE(rb, nullptr) << tag;
  EXPECT_EQ(std::string(rf->name), d == RunDtype::bf16 ? "sparse_gather_bf16" : "sparse_gather");
  const std::vector<double> q = values(B * S * Hq * dqk, 31, d),
                            k = values(B * S * Hk * dqk, 32, d),
                            v = values(B * S * Hk * dvh, 33, d),
                            dout = values(B * S * Hq * dvh, 34, d);
  // Up to K earlier keys a row, the latest first, an empty slot in row 0's.
  std::vector<std::int32_t> idx(std::size_t(B * S * K), -1);
  for (std::int64_t r = 0; r < B * S; ++r)
    for (std::int64_t slot = 0; slot < K && slot <= r % S; ++slot)
      idx[std::size_t(r * K + slot)] = std::int32_t(r % S - slot);
  const test::NaiveSparseResult ref =
      test::naive_sparse_attention(B, S, S, Hq, Hk, dqk, dvh, 0.4, K, idx, q, k, v, &dout);
  const Buffer::Kind kd = output_kind(d), ki = operand_kind(*rf, d);
  Buffer Q(q, ki), Kb(k, ki), V(v, ki), DO(dout, ki), O(std::vector<double>(ref.o.size()), kd),
      L(std::vector<double>(ref.lse.size()), kd), DQ(std::vector<double>(q.size()), kd),
      DK(std::vector<double>(k.size()), kd), DV(std::vector<double>(v.size()), kd);
  OpCall c;
  c.op = Op::sparse_attention_forward, c.dtype = d, c.shape = s;
  c.in[0] = Q.ptr(), c.in[1] = Kb.ptr(), c.in[2] = V.ptr(), c.in[3] = idx.data();
  c.out[0] = O.ptr(), c.out[1] = L.ptr();
  rf->run(c);
  const double tol = tolerance(d == RunDtype::bf16 ? RunDtype::fp32 : d);
  const std::string what = tag + (latent ? " latent" : " per-head") + " sparse_attention";
  expect_close(O.get(), ref.o, tol, what + " o");
  expect_close(L.get(), ref.lse, tol, what + " lse");
  OpCall b;
  b.op = Op::sparse_attention_backward, b.dtype = d, b.shape = s;
  b.in[0] = DO.ptr(), b.in[1] = Q.ptr(), b.in[2] = Kb.ptr(), b.in[3] = V.ptr(), b.in[4] = O.ptr();
  b.in[5] = L.ptr(), b.in[6] = idx.data();
  b.out[0] = DQ.ptr(), b.out[1] = DK.ptr(), b.out[2] = DV.ptr();
  rb->run(b);
  expect_close(DQ.get(), ref.dq, tol, what + " dq");
  expect_close(DK.get(), ref.dk, tol, what + " dk");
  expect_close(DV.get(), ref.dv, tol, what + " dv");
}

// DSA's lightning indexer: check_dsa_indexer, in its own file for length
// (it uses this file's helpers above).
#include "op_table_dsa_checks.inc"

// ------------------------------------------------------ copy_rows and fill

// The naive reference for rounding fp32 to bf16 (core/bf16.hpp's rules),
// written from the definition, not the bit trick: the nearer of the two
// bf16 neighbours, ties to the even one; past the largest finite, inf;
// NaN quiet with its top bits; fp32 denormals to signed zero.
std::uint16_t naive_bf16_bits(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if (std::isnan(x)) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  if (std::isinf(x)) return static_cast<std::uint16_t>(u >> 16);
  if (std::fpclassify(x) == FP_SUBNORMAL || x == 0)
    return static_cast<std::uint16_t>(std::signbit(x) ? 0x8000u : 0u);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16), hi = lo + 1;
  auto value = [](std::uint16_t b) {
    if ((b & 0x7FFFu) == 0x7F80u) return (b & 0x8000u ? -1.0 : 1.0) * 0x1p128;  // the next step
    return double(std::bit_cast<float>(std::uint32_t(b) << 16));
  };
  const double dlo = std::abs(double(x) - value(lo)), dhi = std::abs(value(hi) - double(x));
  if (dlo != dhi) return dlo < dhi ? lo : hi;
  return (lo & 1u) == 0 ? lo : hi;
}

// Every copy_rows combination (dst dtype, bf16 source, accumulate) with row
// strides wider than the rows, against a naive loop; exact (a copy, an
// exact widening, one fp32 or fp64 add, one rounding), compared bit for bit
// and the columns between the rows left as they were. The inputs include
// rounding ties, an fp32 denormal, inf, NaN and a value past bf16's range.
void check_copy_rows(Device dev, const std::string& tag) {
  const std::int64_t rows = 3, cols = 7, lda = 9, ldc = 8;
  std::vector<float> f(static_cast<std::size_t>(rows * lda));
  test::fill_random(f.data(), std::int64_t(f.size()), 41);
  const float special[] = {
      1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 0x1p-130f, -0x1p-140f, INFINITY, -INFINITY, NAN,
      3.3895e38f,     -1.0f - 0x1p-8f,    0.0f,      -0.0f};
  for (std::size_t i = 0; i < std::size(special); ++i) f[i * 2] = special[i];
  std::vector<double> fd(f.begin(), f.end());
  std::vector<bf16> fb;
  for (float x : f) fb.push_back(to_bf16(x));
  struct Case {
    RunDtype to;
    bool src_bf16, accumulate;
  };
  const Case cases[] = {{RunDtype::fp64, false, false}, {RunDtype::fp64, false, true},
                        {RunDtype::fp32, false, false}, {RunDtype::fp32, false, true},
                        {RunDtype::fp32, true, false},  {RunDtype::fp32, true, true},
                        {RunDtype::bf16, false, false}, {RunDtype::bf16, true, false}};
  for (const Case& k : cases) {
    OpShape s;
    s.rows = rows, s.cols = cols, s.lda = lda, s.ldc = ldc;
    s.src_bf16 = k.src_bf16, s.accumulate = k.accumulate;
    const std::string what = tag + " copy_rows to " + to_string(k.to) +
                             (k.src_bf16 ? " from bf16" : "") + (k.accumulate ? " adding" : "");
    const KernelRow* row = picked(dev, Op::copy_rows, k.to, s);
    ASSERT_NE(row, nullptr) << what;
    OpCall c;
    c.op = Op::copy_rows, c.dtype = k.to, c.shape = s;
    c.in[0] = k.src_bf16               ? static_cast<const void*>(fb.data())
              : k.to == RunDtype::fp64 ? static_cast<const void*>(fd.data())
                                       : static_cast<const void*>(f.data());
    // The destination starts at other values (added to, or overwritten),
    // its padding columns at a marker that must survive.
    std::vector<double> d0(static_cast<std::size_t>(rows * ldc));
    test::fill_random(d0.data(), std::int64_t(d0.size()), 42);
    // Bits out, and the naive reference's bits, per element of dst.
    std::vector<std::uint64_t> got, want;
    auto src_value = [&](std::int64_t i, std::int64_t j) -> double {
      const std::size_t e = static_cast<std::size_t>(i * lda + j);
      return k.src_bf16 ? double(to_float(fb[e])) : fd[e];
    };
    if (k.to == RunDtype::fp64) {
      std::vector<double> dst = d0;
      c.out[0] = dst.data();
      row->run(c);
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < ldc; ++j) {
          const double d = d0[static_cast<std::size_t>(i * ldc + j)];
          const double r = j >= cols ? d : k.accumulate ? d + src_value(i, j) : src_value(i, j);
          got.push_back(std::bit_cast<std::uint64_t>(dst[static_cast<std::size_t>(i * ldc + j)]));
          want.push_back(std::bit_cast<std::uint64_t>(r));
        }
    } else if (k.to == RunDtype::fp32) {
      std::vector<float> dst(d0.begin(), d0.end());
      const std::vector<float> before = dst;
      c.out[0] = dst.data();
      row->run(c);
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < ldc; ++j) {
          const float d = before[static_cast<std::size_t>(i * ldc + j)];
          const float x = float(src_value(i, j));
          const float r = j >= cols ? d : k.accumulate ? d + x : x;
          got.push_back(std::bit_cast<std::uint32_t>(dst[static_cast<std::size_t>(i * ldc + j)]));
          want.push_back(std::bit_cast<std::uint32_t>(r));
        }
    } else {
      std::vector<bf16> dst;
      for (double d : d0) dst.push_back(to_bf16(float(d)));
      const std::vector<bf16> before = dst;
      c.out[0] = dst.data();
      row->run(c);
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < ldc; ++j) {
          const std::size_t e = static_cast<std::size_t>(i * ldc + j);
          const std::size_t se = static_cast<std::size_t>(i * lda + j);
          const std::uint16_t r = j >= cols    ? before[e].bits
                                  : k.src_bf16 ? fb[se].bits
                                               : naive_bf16_bits(f[se]);
          got.push_back(dst[e].bits);
          want.push_back(r);
        }
    }
    std::size_t bad = 0, first = 0;
    for (std::size_t e = 0; e < got.size(); ++e)
      if (got[e] != want[e] && bad++ == 0) first = e;
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements differ from the reference, the first "
                       << first << ": bits " << std::hex << got[first] << " against "
                       << want[first];
  }
  // A sum into bf16 is refused, naming it.
  OpShape s;
  s.rows = 1, s.cols = 1, s.lda = 1, s.ldc = 1, s.accumulate = true;
  const KernelChoice no = supports(dev, Op::copy_rows, RunDtype::bf16, s);
  EXPECT_FALSE(no) << tag;
  EXPECT_NE(no.why_not.find("a sum into bf16"), std::string::npos) << no.why_not;
}

void check_fill(Device dev, const std::string& tag) {
  const std::int64_t rows = 3, cols = 5, ldc = 7;
  for (RunDtype d : {RunDtype::fp64, RunDtype::fp32}) {
    OpShape s;
    s.rows = rows, s.cols = cols, s.ldc = ldc;
    const KernelRow* row = picked(dev, Op::fill, d, s);
    ASSERT_NE(row, nullptr) << tag;
    std::vector<double> dst(static_cast<std::size_t>(rows * ldc), 7.0);
    std::vector<float> dstf(dst.begin(), dst.end());
    OpCall c;
    c.op = Op::fill, c.dtype = d, c.shape = s, c.alpha = -0.25;
    c.out[0] = d == RunDtype::fp64 ? static_cast<void*>(dst.data()) : dstf.data();
    row->run(c);
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < ldc; ++j) {
        const std::size_t e = static_cast<std::size_t>(i * ldc + j);
        const double v = d == RunDtype::fp64 ? dst[e] : double(dstf[e]);
        EXPECT_EQ(v, j < cols ? -0.25 : 7.0) << tag << " fill " << to_string(d) << " at " << e;
      }
  }
  OpShape s;
  s.rows = 1, s.cols = 1, s.ldc = 1;
  const KernelChoice no = supports(dev, Op::fill, RunDtype::bf16, s);
  EXPECT_FALSE(no) << tag;
  EXPECT_NE(no.why_not.find("dtype bf16"), std::string::npos) << no.why_not;
}

TEST(OpTable, EveryOpOnEveryBackendAgainstTheReference) {
  for (Device dev : devices_built()) {
    if (dev != Device::cpu) continue;  // a device's rows need its storage: its own test
    for_each_variant([&](const std::string& variant) {
      const std::string tag = std::string(to_string(dev)) + " " + variant;
      for (RunDtype d : kDtypes) {
        check_gemm(dev, d, tag);
        for (AttentionKind kind : {AttentionKind::eager, AttentionKind::flash})
          for (bool latent : {false, true}) check_attention(dev, d, kind, latent, tag);
        for (bool invariant : {false, true}) check_fused(dev, d, tag, invariant);
        check_lse_merge(dev, d, tag);
        check_rmsnorm(dev, d, tag);
        check_rope(dev, d, tag);
        for (bool latent : {false, true}) check_sparse(dev, d, latent, tag);
        check_dsa_indexer(dev, d, tag);
        check_kv_fp8_round_trip(dev, d, tag);
      }
    });
    // No switch selects a data-movement row: once per device.
    check_copy_rows(dev, to_string(dev));
    check_fill(dev, to_string(dev));
  }
}

// Every op the forms ask for has a CPU row (the test above runs each for
// every dtype); the model's ops (mla/ops_model.hpp fills their rows) are not
// asked here. Every row names its device, kernel and refusals.
TEST(OpTable, EveryBlockOpHasACpuRow) {
  for (int i = 0; i <= int(Op::fill); ++i) {
    const Op op = Op(i);
    bool any = false;
    for (const KernelRow& r : kernel_rows(Device::cpu)) any = any || (r.op == op);
    EXPECT_TRUE(any) << to_string(op) << " has no CPU row";
  }
  for (const KernelRow& r : kernel_rows(Device::cpu)) {
    EXPECT_EQ(r.device, Device::cpu) << r.name;
    EXPECT_NE(r.run, nullptr) << r.name;
    EXPECT_NE(r.why_not, nullptr) << r.name;
  }
}

// What no row takes is refused, naming the value.
TEST(OpTable, RefusalsNameTheUnsupportedValue) {
  OpShape s;
  s.attn = AttnShape{1, 4, 4, 4, 2, 8, 8, 1.0, true};
  s.attention = AttentionKind::flash;
  const KernelChoice latent =
      supports(Device::cpu, Op::latent_attention_forward, RunDtype::fp32, s);
  EXPECT_FALSE(latent);
  EXPECT_NE(latent.why_not.find("Hk 2"), std::string::npos) << latent.why_not;
  EXPECT_EQ(std::string(latent.name()), "none");

  s.attention = AttentionKind::eager;
  const KernelChoice eager = supports(Device::cpu, Op::attention_forward, RunDtype::bf16, s);
  EXPECT_FALSE(eager);
  EXPECT_NE(eager.why_not.find("dtype bf16"), std::string::npos) << eager.why_not;
  EXPECT_NE(eager.why_not.find("attention_forward bf16 on cpu"), std::string::npos)
      << eager.why_not;
  try {
    pick(Device::cpu, Op::attention_forward, RunDtype::bf16, s);
    ADD_FAILURE() << "pick took what supports refused";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find(eager.why_not) != std::string::npos, true) << e.what();
  }

  // Where this CPU lacks AVX512_BF16, its row refuses naming what is missing;
  // where it has it, the fp32 switch setting makes it refuse naming the switch.
  s.attention = AttentionKind::flash;
  s.attn.Hk = 4;
  const FlashBf16Isa before = set_flash_bf16_isa(FlashBf16Isa::fp32);
  const KernelChoice bf = supports(Device::cpu, Op::attention_forward, RunDtype::bf16, s);
  ASSERT_TRUE(bf) << bf.why_not;
  EXPECT_EQ(std::string(bf.name()), "flash_bf16_widened_fp32");
  set_flash_bf16_isa(before);

  if (std::find(devices_built().begin(), devices_built().end(), Device::cuda) ==
      devices_built().end()) {
    const KernelChoice cuda = supports(Device::cuda, Op::gemm, RunDtype::fp32, OpShape{});
    EXPECT_FALSE(cuda);
    EXPECT_NE(cuda.why_not.find("no CUDA backend"), std::string::npos) << cuda.why_not;
  }
}

}  // namespace
}  // namespace laga::ops
