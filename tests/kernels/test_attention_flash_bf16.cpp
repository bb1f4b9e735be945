// bf16 flash attention (kernels/attention_flash_bf16.hpp) against the naive
// reference run in double on the same bf16-rounded inputs: outputs, lse and
// gradients for causal and not, Sq != Sk, packed documents, grouped and
// latent heads, MLA's dims and small odd ones; bitwise independence of the
// thread count; NaN reaching only the rows that see it; the ISA choice. Every
// kernel test runs once per FlashBf16Isa this build and CPU have.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "attention_cases.hpp"
#include "common/error_of.hpp"
#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/threads.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash_bf16.hpp"

namespace laga {
namespace {

using test::Problem;
using test::shape;

// bf16's unit roundoff: 8 significant bits, round to nearest.
constexpr double kU = 1.0 / 256;

struct Bf16Problem {
  AttnShape s;
  std::vector<bf16> q, k, v, dout;
  Problem<double> wide;  // the same bf16 values, exactly, in double
  explicit Bf16Problem(const Problem<float>& p) : s(p.s), wide(p.s) {
    auto round = [](const std::vector<float>& x, std::vector<bf16>& y, std::vector<double>& d) {
      y.resize(x.size());
      d.resize(x.size());
      for (size_t i = 0; i < x.size(); ++i) y[i] = to_bf16(x[i]), d[i] = to_float(y[i]);
    };
    round(p.q, q, wide.q);
    round(p.k, k, wide.k);
    round(p.v, v, wide.v);
    round(p.dout, dout, wide.dout);
    wide.s = s;
    wide.doc_start = p.doc_start;
  }
};

struct Out {
  std::vector<float> o, lse, dq, dk, dv;
};

// 64-byte aligned memory of `bytes`, filled with garbage (a call must not
// read what it did not write).
struct AlignedBuffer {
  explicit AlignedBuffer(std::int64_t bytes) : raw(static_cast<size_t>(bytes) + 64, 0xA5) {
    const auto at = reinterpret_cast<std::uintptr_t>(raw.data());
    data = raw.data() + (64 - at % 64) % 64;
  }
  std::vector<unsigned char> raw;
  unsigned char* data = nullptr;
};

// with_workspace: each call given a workspace of exactly its
// attention_flash_bf16_workspace_bytes (FlashWorkspace), else none.
Out run_bf16(const Bf16Problem& p, bool with_workspace = false) {
  const AttnShape& s = p.s;
  Out r;
  r.o.assign(p.dout.size(), -7.0f);  // garbage: every element must be written
  r.lse.assign(static_cast<size_t>(s.B * s.Hq * s.Sq), -7.0f);
  r.dq.assign(p.q.size(), -7.0f);
  r.dk.assign(p.k.size(), -7.0f);
  r.dv.assign(p.v.size(), -7.0f);
  const std::int64_t fwd = attention_flash_bf16_workspace_bytes(s, false),
                     bwd = attention_flash_bf16_workspace_bytes(s, true);
  AlignedBuffer fwd_ws(fwd), bwd_ws(bwd);
  attention_flash_forward_bf16(
      s, r.o.data(), r.lse.data(), p.q.data(), p.k.data(), p.v.data(),
      with_workspace ? FlashWorkspace{fwd_ws.data, fwd} : FlashWorkspace{});
  attention_flash_backward_bf16(
      s, r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(), p.q.data(), p.k.data(), p.v.data(),
      r.o.data(), r.lse.data(),
      with_workspace ? FlashWorkspace{bwd_ws.data, bwd} : FlashWorkspace{});
  return r;
}

// Error bounds, per output element, of the avx512_bf16 path against exact
// arithmetic on the same bf16 inputs. Each term of the o and dv sums carries
// one bf16 rounding of p (relative error <= u); each term of dq and dk one of
// dS = p (dP - D) (<= u |dS|) plus D's own error: D_i = dO_i . o_i is taken
// from the kernel's o, which is off by at most u A_o (A_o below) per
// element. So, with the sums over each output's unmasked pairs:
//   A_o[i,n]  = sum_j p_ij |v_jn|                      |o err|  <= u A_o
//   A_dv[j,n] = sum_i p_ij |do_in|                     |dv err| <= u A_dv
//   e_ij      = p_ij (|dP_ij| + |D_i| + sum_n |do_in| A_o[i,n])
//   A_dq[i,n] = scale sum_j e_ij |k_jn|                 |dq err| <= u A_dq
//   A_dk[j,n] = scale sum_i e_ij |q_in|                 |dk err| <= u A_dk
// (summed over the query heads that read a shared key head). The fp32 sums,
// exp2's polynomial and the fp32 p add about L * 2^-24 relative for a
// reduction of length L (under 2^-12 here, against u = 2^-8): the test
// allows 2 u A, double the rounding bound, as the margin for those. The
// bound grows with the reduction length through A itself (a sum of L
// terms); the errors, of random sign, typically sit far below it (about
// sqrt(L) u max|term|), so a wrong mask, a dropped tile or a doubled one
// (an error of a whole term, not u of it) fails it. The fp32 path rounds
// neither p nor dS, and meets the same bound with room to spare. (Seen on
// the cases below: avx512_bf16 up to about 0.46 of the tolerance, i.e. 0.9 u A
// where a row sees few keys; fp32 under 2e-4 of it.)
struct Bounds {
  std::vector<double> o, dq, dk, dv;
};

Bounds bounds_of(const Problem<double>& p, const std::vector<double>& o_ref) {
  const AttnShape& s = p.s;
  Bounds bd;
  bd.o.assign(p.dout.size(), 0);
  bd.dq.assign(p.q.size(), 0);
  bd.dk.assign(p.k.size(), 0);
  bd.dv.assign(p.v.size(), 0);
  const std::int64_t g = s.Hq / s.Hk;
  std::vector<double> sc(static_cast<size_t>(s.Sk)), pr(static_cast<size_t>(s.Sk));
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        const std::int64_t hk = h / g, kb = s.key_begin(b, i), ke = s.key_end(i);
        if (ke <= kb) continue;
        const double* qi = &p.q[static_cast<size_t>(((b * s.Sq + i) * s.Hq + h) * s.dqk)];
        const double* doi = &p.dout[static_cast<size_t>(((b * s.Sq + i) * s.Hq + h) * s.dv)];
        const double* oi = &o_ref[static_cast<size_t>(((b * s.Sq + i) * s.Hq + h) * s.dv)];
        auto kj = [&](std::int64_t j) {
          return &p.k[static_cast<size_t>(((b * s.Sk + j) * s.Hk + hk) * s.dqk)];
        };
        auto vj = [&](std::int64_t j) {
          return &p.v[static_cast<size_t>(((b * s.Sk + j) * s.Hk + hk) * s.dv)];
        };
        double mx = -std::numeric_limits<double>::infinity(), l = 0, D = 0;
        for (std::int64_t j = kb; j < ke; ++j) {
          double d = 0;
          for (std::int64_t e = 0; e < s.dqk; ++e) d += qi[e] * kj(j)[e];
          sc[static_cast<size_t>(j)] = s.scale * d;
          mx = std::max(mx, s.scale * d);
        }
        for (std::int64_t j = kb; j < ke; ++j)
          l += pr[static_cast<size_t>(j)] = std::exp(sc[static_cast<size_t>(j)] - mx);
        for (std::int64_t e = 0; e < s.dv; ++e) D += doi[e] * oi[e];
        double* bo = &bd.o[static_cast<size_t>(((b * s.Sq + i) * s.Hq + h) * s.dv)];
        for (std::int64_t j = kb; j < ke; ++j) {
          const double pj = pr[static_cast<size_t>(j)] /= l;
          for (std::int64_t e = 0; e < s.dv; ++e) bo[e] += pj * std::abs(vj(j)[e]);
        }
        double do_ao = 0;
        for (std::int64_t e = 0; e < s.dv; ++e) do_ao += std::abs(doi[e]) * bo[e];
        double* bq = &bd.dq[static_cast<size_t>(((b * s.Sq + i) * s.Hq + h) * s.dqk)];
        for (std::int64_t j = kb; j < ke; ++j) {
          const double pj = pr[static_cast<size_t>(j)];
          double dp = 0;
          for (std::int64_t e = 0; e < s.dv; ++e) dp += doi[e] * vj(j)[e];
          const double eij = s.scale * pj * (std::abs(dp) + std::abs(D) + do_ao);
          double* bk = &bd.dk[static_cast<size_t>(((b * s.Sk + j) * s.Hk + hk) * s.dqk)];
          double* bv = &bd.dv[static_cast<size_t>(((b * s.Sk + j) * s.Hk + hk) * s.dv)];
          for (std::int64_t e = 0; e < s.dqk; ++e) {
            bq[e] += eij * std::abs(kj(j)[e]);
            bk[e] += eij * std::abs(qi[e]);
          }
          for (std::int64_t e = 0; e < s.dv; ++e) bv[e] += pj * std::abs(doi[e]);
        }
      }
  return bd;
}

// |got - ref| <= 2 u bound elementwise (Bounds above), plus 2^-20 max|ref|
// for outputs whose bound is 0 (a row or key that sees nothing); every
// element finite.
::testing::AssertionResult within(const std::vector<float>& got, const std::vector<double>& ref,
                                  const std::vector<double>& bound, const std::string& what) {
  double mref = 0, worst_ratio = 0;
  for (double x : ref) mref = std::max(mref, std::abs(x));
  const double floor = std::ldexp(std::max(mref, 1.0), -20);
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::abs(static_cast<double>(got[i]) - ref[i]);
    const double tol = 2 * kU * bound[i] + floor;
    if (!(d <= tol))  // NaN fails
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << got[i] << ", reference "
                                           << ref[i] << ": |diff| " << d << " > tolerance " << tol;
    worst_ratio = std::max(worst_ratio, d / tol);
  }
  return ::testing::AssertionSuccess() << what << ": worst |diff| / tolerance " << worst_ratio;
}

struct Case {
  const char* name;
  AttnShape s;
  std::vector<std::vector<std::int64_t>> docs;  // empty: one document per row
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

const Case kCases[] = {
    {"one_token", shape(1, 1, 1, 2, 2, 8, 8, true), {}},
    {"odd_dims_causal", shape(1, 7, 7, 3, 3, 5, 3, true), {}},
    {"odd_dims_noncausal", shape(2, 7, 9, 2, 2, 13, 9, false), {}},
    {"mla_dims_causal", shape(1, 203, 203, 2, 2, 192, 128, true), {}},
    {"mla_dims_noncausal", shape(1, 131, 131, 1, 1, 192, 128, false), {}},
    {"more_queries_than_keys", shape(2, 150, 37, 2, 2, 24, 16, true), {}},  // fully masked rows
    {"more_keys_than_queries", shape(2, 37, 150, 2, 2, 24, 16, true), {}},
    {"more_queries_noncausal", shape(1, 150, 37, 2, 2, 24, 17, false), {}},
    {"latent_causal", shape(2, 129, 129, 4, 1, 72, 64, true), {}},
    {"latent_sq_gt_sk", shape(1, 70, 33, 5, 1, 36, 32, true), {}},
    {"grouped_heads", shape(2, 77, 77, 6, 2, 20, 12, true), {}},
    {"packed_documents", shape(2, 150, 150, 2, 2, 40, 24, true), {{37, 50, 63}, {1, 149}}},
    {"packed_latent_odd", shape(1, 133, 133, 3, 1, 33, 31, true), {{3, 64, 1, 65}}},
    {"packed_mla_dims", shape(1, 300, 300, 2, 2, 192, 128, true), {{70, 130, 100}}},
};

class FlashBf16VsReference : public ::testing::TestWithParam<std::tuple<Case, FlashBf16Isa>> {
 protected:
  void SetUp() override { previous_ = set_flash_bf16_isa(std::get<1>(GetParam())); }
  void TearDown() override { set_flash_bf16_isa(previous_); }
  FlashBf16Isa previous_ = FlashBf16Isa::fp32;
};

TEST_P(FlashBf16VsReference, WithinBf16Bound) {
  const Case& c = std::get<0>(GetParam());
  Problem<float> pf(c.s);
  if (!c.docs.empty()) pf.set_documents(c.docs);
  const Bf16Problem p(pf);
  const Out got = run_bf16(p);
  const test::Result<double> ref = test::run_reference(p.wide);
  const Bounds bd = bounds_of(p.wide, ref.o);
  EXPECT_TRUE(within(got.o, ref.o, bd.o, "o"));
  // lse: fp32 statistics of exact bf16 products, no bf16 rounding in it;
  // held to 2 u 1e-3 (1 + |lse|), about 8e-6 relative: fp32 rounding of the
  // scores' dot products (L = dqk terms) and of exp2's polynomial. (Seen:
  // under 3% of that.)
  std::vector<double> lse_bound(ref.lse.size());
  for (size_t i = 0; i < lse_bound.size(); ++i) lse_bound[i] = 1e-3 * (1 + std::abs(ref.lse[i]));
  EXPECT_TRUE(within(got.lse, ref.lse, lse_bound, "lse"));
  EXPECT_TRUE(within(got.dq, ref.dq, bd.dq, "dq"));
  EXPECT_TRUE(within(got.dk, ref.dk, bd.dk, "dk"));
  EXPECT_TRUE(within(got.dv, ref.dv, bd.dv, "dv"));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FlashBf16VsReference,
    ::testing::Combine(::testing::ValuesIn(kCases),
                       ::testing::ValuesIn(flash_bf16_isas_available())),
    [](const ::testing::TestParamInfo<std::tuple<Case, FlashBf16Isa>>& param_info) {
      return std::string(std::get<0>(param_info.param).name) + "_" +
             to_string(std::get<1>(param_info.param));
    });

class FlashBf16 : public ::testing::TestWithParam<FlashBf16Isa> {
 protected:
  void SetUp() override { previous_ = set_flash_bf16_isa(GetParam()); }
  void TearDown() override { set_flash_bf16_isa(previous_); }
  FlashBf16Isa previous_ = FlashBf16Isa::fp32;
};

// Every sum in a fixed block order by one thread: bitwise the same results
// on 1-4 threads (multi-head, latent with packed documents, batch), which
// take both backward schedules: per (head, row set) and two passes (one
// head, two row sets, at 3 threads).
TEST_P(FlashBf16, BitwiseIndependentOfThreadCount) {
  struct Shape {
    AttnShape s;
    std::vector<std::vector<std::int64_t>> docs;
  };
  for (const Shape& c : {Shape{shape(1, 200, 200, 2, 2, 192, 128, true), {}},
                         Shape{shape(1, 130, 130, 4, 1, 36, 32, true), {{50, 17, 63}}},
                         Shape{shape(3, 90, 90, 2, 2, 16, 15, false), {}}}) {
    Problem<float> pf(c.s);
    if (!c.docs.empty()) pf.set_documents(c.docs);
    const Bf16Problem p(pf);
    std::vector<Out> runs;
    for (int t : {1, 2, 3, 4}) {
      set_rank_threads(t);
      runs.push_back(run_bf16(p));
    }
    set_rank_threads(2);
    for (size_t i = 1; i < runs.size(); ++i) {
      EXPECT_EQ(runs[0].o, runs[i].o);
      EXPECT_EQ(runs[0].lse, runs[i].lse);
      EXPECT_EQ(runs[0].dq, runs[i].dq);
      EXPECT_EQ(runs[0].dk, runs[i].dk);
      EXPECT_EQ(runs[0].dv, runs[i].dv);
    }
  }
}

// attention_flash_bf16_workspace_bytes, computed from the shape, is what a
// call holds: on avx512_bf16 every byte its buffers held at once (counted as
// they are allocated), on fp32 the widened copies of q, k, v (and dout).
// Thread counts 1-3 take both backward schedules (one thread per head, and
// two passes); the high water is the largest call's.
TEST_P(FlashBf16, WorkspaceIsWhatTheCallsHold) {
  for (const AttnShape& s :
       {shape(1, 200, 200, 2, 2, 192, 128, true), shape(1, 130, 130, 4, 1, 36, 32, true),
        shape(3, 90, 70, 2, 2, 16, 15, false), shape(1, 3, 0, 2, 1, 4, 4, false)}) {
    const Bf16Problem p{Problem<float>(s)};
    for (int t : {1, 2, 3}) {
      set_rank_threads(t);
      std::vector<float> o(p.dout.size()), lse(static_cast<size_t>(s.B * s.Hq * s.Sq));
      std::vector<float> dq(p.q.size()), dk(p.k.size()), dv(p.v.size());
      const std::int64_t fwd = attention_flash_bf16_workspace_bytes(s, false);
      const std::int64_t bwd = attention_flash_bf16_workspace_bytes(s, true);
      reset_attention_flash_bf16_workspace_high_water();
      detail::reset_flash_bf16_allocated_peak();
      attention_flash_forward_bf16(s, o.data(), lse.data(), p.q.data(), p.k.data(), p.v.data());
      const std::int64_t fwd_held = detail::flash_bf16_allocated_peak();
      EXPECT_EQ(attention_flash_bf16_workspace_high_water(), fwd);
      detail::reset_flash_bf16_allocated_peak();
      attention_flash_backward_bf16(s, dq.data(), dk.data(), dv.data(), p.dout.data(), p.q.data(),
                                    p.k.data(), p.v.data(), o.data(), lse.data());
      const std::int64_t bwd_held = detail::flash_bf16_allocated_peak();
      EXPECT_EQ(attention_flash_bf16_workspace_high_water(), std::max(fwd, bwd));
      const std::string where = cat("S ", s.Sq, "/", s.Sk, " H ", s.Hq, "/", s.Hk, " threads ", t);
      if (GetParam() == FlashBf16Isa::avx512_bf16) {
        EXPECT_EQ(fwd_held, fwd) << where;
        EXPECT_EQ(bwd_held, bwd) << where;
      } else {
        const std::int64_t q = s.B * s.Sq * s.Hq * s.dqk, k = s.B * s.Sk * s.Hk * s.dqk,
                           v = s.B * s.Sk * s.Hk * s.dv, d = s.B * s.Sq * s.Hq * s.dv;
        EXPECT_EQ(fwd, 4 * (q + k + v)) << where;
        EXPECT_EQ(bwd, 4 * (q + k + v + d)) << where;
      }
    }
    set_rank_threads(2);
  }
}

// A caller's workspace (FlashWorkspace: the op layer gives a pool tensor)
// of exactly attention_flash_bf16_workspace_bytes gives the same bits as
// the call's own buffers, at 1-3 threads (both backward schedules; a
// workspace too small for what the call takes would abort the run); one a
// byte short is refused. attention_flash_bf16_workspace_bound covers every
// smaller shape, at every thread count: at 4 threads B 3 of one key/value
// head takes the two-pass backward and B 2 the per-head one, whose head
// buffers make its workspace the larger of the two.
TEST_P(FlashBf16, CallersWorkspaceGivesTheSameBitsAndBoundsSmallerCalls) {
  for (const AttnShape& s :
       {shape(1, 200, 200, 2, 2, 192, 128, true), shape(1, 130, 130, 4, 1, 36, 32, true),
        shape(3, 90, 70, 2, 2, 16, 15, false), shape(3, 16, 200, 2, 1, 36, 32, false)}) {
    const Bf16Problem p{Problem<float>(s)};
    for (int t : {1, 2, 3, 4}) {
      set_rank_threads(t);
      const std::string where = cat("S ", s.Sq, "/", s.Sk, " H ", s.Hq, "/", s.Hk, " threads ", t);
      const Out own = run_bf16(p), given = run_bf16(p, true);
      EXPECT_EQ(own.o, given.o) << where;
      EXPECT_EQ(own.lse, given.lse) << where;
      EXPECT_EQ(own.dq, given.dq) << where;
      EXPECT_EQ(own.dk, given.dk) << where;
      EXPECT_EQ(own.dv, given.dv) << where;
      const std::int64_t fwd = attention_flash_bf16_workspace_bytes(s, false);
      AlignedBuffer short_ws(fwd);
      std::vector<float> o(p.dout.size()), lse(static_cast<size_t>(s.B * s.Hq * s.Sq));
      EXPECT_THROW(attention_flash_forward_bf16(s, o.data(), lse.data(), p.q.data(), p.k.data(),
                                                p.v.data(), {short_ws.data, fwd - 1}),
                   Error)
          << where;
      for (std::int64_t B : {std::int64_t(1), std::min<std::int64_t>(2, s.B), s.B})
        for (std::int64_t Sq : {std::int64_t(1), s.Sq / 3, s.Sq})
          for (std::int64_t Sk : {std::int64_t(1), s.Sk / 2, s.Sk})
            for (bool backward : {false, true}) {
              AttnShape small = s;
              small.B = B, small.Sq = Sq, small.Sk = Sk;
              if (s.causal && Sk < Sq) small.Sk = Sq;  // the causal mask wants Sk >= Sq
              if (small.Sk > s.Sk) continue;
              EXPECT_GE(attention_flash_bf16_workspace_bound(s, backward),
                        attention_flash_bf16_workspace_bytes(small, backward))
                  << where << " against B " << B << " S " << small.Sq << "/" << small.Sk
                  << (backward ? " backward" : " forward");
            }
    }
    set_rank_threads(2);
  }
}

// No keys at all (Sk = 0): every row fully masked, o = 0, lse = 0, dq = 0.
TEST_P(FlashBf16, NoKeysAtAll) {
  const Bf16Problem p(Problem<float>(shape(1, 3, 0, 2, 1, 4, 4, false)));
  const Out r = run_bf16(p);
  for (float x : r.o) EXPECT_EQ(x, 0.0f);
  for (float x : r.lse) EXPECT_EQ(x, 0.0f);
  for (float x : r.dq) EXPECT_EQ(x, 0.0f);
}

// A NaN in the value row of one token reaches its own document's later rows
// and nothing else: the next document's rows share that token's key block
// (so the AVX512_BF16 path must leave the masked pair out, not multiply it
// by p = 0) and stay what they are without the NaN. Not bit for bit, unlike
// the fp32 kernels: a masked tile with a non-finite operand takes the scalar
// path, whose fp32 sums run in another order than VDPBF16PS's pairs, so the
// other rows of that tile move by fp32 rounding (about 2^-24 relative) --
// and a leaked NaN, or a term that should be left out, fails by far more.
TEST_P(FlashBf16, NanReachesOnlyTheRowsThatSeeIt) {
  auto same = [](float x, float y) {
    return std::isfinite(x) && std::abs(x - y) <= 1e-5f * std::max(1.0f, std::abs(y));
  };
  const AttnShape s = shape(1, 150, 150, 2, 2, 24, 16, true);
  Problem<float> pf(s);
  pf.set_documents({{30, 40, 80}});
  const Bf16Problem clean(pf);
  Bf16Problem poisoned(pf);
  const std::int64_t token = 25, hk = 1;
  poisoned.v[static_cast<size_t>((token * s.Hk + hk) * s.dv + 3)] = to_bf16(std::nanf(""));
  poisoned.k[static_cast<size_t>((token * s.Hk + 0) * s.dqk + 5)] = to_bf16(std::nanf(""));
  const Out a = run_bf16(clean), b = run_bf16(poisoned);
  for (std::int64_t i = 0; i < s.Sq; ++i)
    for (std::int64_t h = 0; h < s.Hq; ++h) {
      const bool sees = i >= token && i < 30;
      for (std::int64_t e = 0; e < s.dv; ++e) {
        const size_t x = static_cast<size_t>((i * s.Hq + h) * s.dv + e);
        if (sees && h == hk && e == 3) {
          EXPECT_TRUE(std::isnan(b.o[x])) << "row " << i << " head " << h;
        }
        if (!sees) {
          EXPECT_PRED2(same, b.o[x], a.o[x]) << "row " << i << " head " << h << " elem " << e;
        }
      }
      if (i >= 30)
        for (std::int64_t e = 0; e < s.dqk; ++e) {
          const size_t x = static_cast<size_t>((i * s.Hq + h) * s.dqk + e);
          EXPECT_PRED2(same, b.dq[x], a.dq[x]) << "dq row " << i << " head " << h;
        }
    }
  for (std::int64_t j = 30; j < s.Sk; ++j)
    for (std::int64_t e = 0; e < s.dv; ++e) {
      const size_t x = static_cast<size_t>((j * s.Hk + hk) * s.dv + e);
      EXPECT_PRED2(same, b.dv[x], a.dv[x]) << "dv key " << j;
    }
}

INSTANTIATE_TEST_SUITE_P(Isas, FlashBf16, ::testing::ValuesIn(flash_bf16_isas_available()),
                         [](const ::testing::TestParamInfo<FlashBf16Isa>& param_info) {
                           return std::string(to_string(param_info.param));
                         });

// The CPU, not the build, says whether avx512_bf16 must be there: a build
// that loses the AVX512_BF16 kernels fails here on a CPU that has the feature.
TEST(FlashBf16Isa, AvailableWhereTheCpuHasIt) {
  const std::vector<FlashBf16Isa> isas = flash_bf16_isas_available();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), FlashBf16Isa::fp32);
  __builtin_cpu_init();
  const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("avx512bf16");
  const bool has = std::find(isas.begin(), isas.end(), FlashBf16Isa::avx512_bf16) != isas.end();
  EXPECT_EQ(has, cpu) << (flash_bf16_why_no_avx512_bf16() ? flash_bf16_why_no_avx512_bf16() : "");
  EXPECT_EQ(flash_bf16_why_no_avx512_bf16() == nullptr, has);
  if (!has) {
    EXPECT_THROW(set_flash_bf16_isa(FlashBf16Isa::avx512_bf16), Error);
    std::printf("[ note ] bf16 flash runs the fp32 fallback here: %s\n",
                flash_bf16_why_no_avx512_bf16());
  }
}

TEST(FlashBf16Isa, ResolvesTheSetting) {
  using detail::resolve_flash_bf16_isa;
  EXPECT_EQ(resolve_flash_bf16_isa(nullptr, nullptr), FlashBf16Isa::avx512_bf16);
  EXPECT_EQ(resolve_flash_bf16_isa("", "no cpu"), FlashBf16Isa::fp32);
  EXPECT_EQ(resolve_flash_bf16_isa("auto", "no cpu"), FlashBf16Isa::fp32);
  EXPECT_EQ(resolve_flash_bf16_isa("fp32", nullptr), FlashBf16Isa::fp32);
  EXPECT_EQ(resolve_flash_bf16_isa("avx512_bf16", nullptr), FlashBf16Isa::avx512_bf16);
  // auto leaves it where its dot products do not pay; asked for, it runs.
  EXPECT_EQ(resolve_flash_bf16_isa("auto", nullptr, false), FlashBf16Isa::fp32);
  EXPECT_EQ(resolve_flash_bf16_isa("avx512_bf16", nullptr, false), FlashBf16Isa::avx512_bf16);
  EXPECT_THROW(resolve_flash_bf16_isa("avx512_bf16", "this CPU has no avx512bf16"), Error);
  EXPECT_THROW(resolve_flash_bf16_isa("bf16", nullptr), Error);
}

// Run by CTest under each value of LAGA_FLASH_BF16_ISA, one of them wrong
// (tests/kernels/CMakeLists.txt): the variable picks the path, and a bad or
// unavailable value fails every call, naming itself.
TEST(FlashBf16IsaEnvironment, IsFollowed) {
  const char* env = std::getenv("LAGA_FLASH_BF16_ISA");
  const std::string value = env ? env : "auto";
  const std::vector<FlashBf16Isa> isas = flash_bf16_isas_available();
  const bool fast = std::find(isas.begin(), isas.end(), FlashBf16Isa::avx512_bf16) != isas.end();
  const Bf16Problem p(Problem<float>(shape(1, 7, 7, 2, 2, 8, 8, true)));
  if (value == "fp32" || (value == "avx512_bf16" && fast)) {
    EXPECT_EQ(to_string(flash_bf16_isa()), value);
    const test::Result<double> ref = test::run_reference(p.wide);
    EXPECT_TRUE(within(run_bf16(p).o, ref.o, bounds_of(p.wide, ref.o).o, "o"));
  } else if (value == "auto") {
    EXPECT_EQ(flash_bf16_isa(), flash_bf16_dot_products_pay() ? isas.back() : FlashBf16Isa::fp32);
  } else {
    const std::string prefix = value == "avx512_bf16" ? "LAGA_FLASH_BF16_ISA=avx512_bf16, but "
                                                      : "LAGA_FLASH_BF16_ISA='" + value + "'";
    const std::string e = test::error_of([&] { run_bf16(p); });
    EXPECT_NE(e.find(prefix), std::string::npos) << e;
    EXPECT_NE(test::error_of([] { flash_bf16_isa(); }).find(prefix), std::string::npos);
  }
}

}  // namespace

void PrintTo(FlashBf16Isa isa, std::ostream* os) {
  *os << to_string(isa);
}

}  // namespace laga
