// Eager attention against the reference (forward and backward, causal and
// not, Sq != Sk with fully masked rows, Hk = Hq, Hq/2 and 1, B > 1,
// dqk != dv), the reference against the definition (explicit softmax in the
// test, the head grouping, the bottom-right mask), both backwards against
// finite differences in double, and AttnShape's key ranges, FLOP count and
// validation, with and without packed documents (test_attention_packed.cpp
// runs the kernels on them).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common/check.hpp"
#include "common/threads.hpp"
#include "core/error.hpp"
#include "kernels/attention.hpp"

namespace laga {
namespace {

using test::all_close;
using test::random_vector;

AttnShape make_shape(std::int64_t B, std::int64_t Sq, std::int64_t Sk, std::int64_t Hq,
                     std::int64_t Hk, std::int64_t dqk, std::int64_t dv, bool causal) {
  AttnShape s;
  s.B = B;
  s.Sq = Sq;
  s.Sk = Sk;
  s.Hq = Hq;
  s.Hk = Hk;
  s.dqk = dqk;
  s.dv = dv;
  s.causal = causal;
  s.scale = 1.0 / std::sqrt(static_cast<double>(dqk));
  return s;
}

std::string describe(const AttnShape& s) {
  return testing::PrintToString(
             std::vector<std::int64_t>{s.B, s.Sq, s.Sk, s.Hq, s.Hk, s.dqk, s.dv}) +
         " (B, Sq, Sk, Hq, Hk, dqk, dv)" + (s.causal ? " causal" : " full");
}

std::int64_t q_size(const AttnShape& s) {
  return s.B * s.Sq * s.Hq * s.dqk;
}
std::int64_t k_size(const AttnShape& s) {
  return s.B * s.Sk * s.Hk * s.dqk;
}
std::int64_t v_size(const AttnShape& s) {
  return s.B * s.Sk * s.Hk * s.dv;
}
std::int64_t o_size(const AttnShape& s) {
  return s.B * s.Sq * s.Hq * s.dv;
}
std::int64_t p_size(const AttnShape& s) {
  return s.B * s.Hq * s.Sq * s.Sk;
}

const AttnShape kShapes[] = {
    make_shape(1, 5, 5, 2, 2, 3, 3, true),      // MHA, square, causal
    make_shape(2, 7, 7, 4, 4, 8, 5, false),     // B > 1, full, dqk != dv
    make_shape(2, 6, 9, 4, 1, 5, 3, true),      // Sq < Sk: a visible prefix; Hk = 1
    make_shape(1, 9, 4, 3, 3, 4, 6, true),      // Sq > Sk: rows 0..4 fully masked
    make_shape(2, 11, 13, 6, 3, 7, 2, true),    // Hk = Hq / 2, odd everything
    make_shape(2, 10, 3, 2, 1, 4, 4, true),     // Hk = 1 and masked rows
    make_shape(2, 9, 4, 4, 2, 3, 5, false),     // Sq > Sk without a mask: nothing masked
    make_shape(3, 1, 1, 1, 1, 1, 1, true),      // smallest
    make_shape(1, 33, 33, 4, 2, 24, 16, true),  // larger than a SIMD width
};

// q, k, v, dout in [-1, 1], scale 1/sqrt(dqk): scores |s| <= sqrt(dqk) <= 5.
// Float: the score GEMM has relative error ~dqk eps, softmax adds a few eps
// per entry, and o, dq, dk, dv are sums of <= Sq * (Hq / Hk) <= 66 products of
// O(1) terms; the largest difference seen is 5e-7 (4 ulp of 1). 5e-6 absolute
// + 5e-5 relative leaves 10x margin and is 5 orders below a dropped or
// misplaced term (~0.1). Double: seen 7e-16, bound 1e-13 + 1e-12 relative.
template <class T>
double atol() {
  return std::is_same_v<T, float> ? 5e-6 : 1e-13;
}
template <class T>
double rtol() {
  return std::is_same_v<T, float> ? 5e-5 : 1e-12;
}

template <class T>
struct Inputs {
  std::vector<T> q, k, v, dout;
  explicit Inputs(const AttnShape& s, std::uint64_t seed)
      : q(random_vector<T>(q_size(s), seed)),
        k(random_vector<T>(k_size(s), seed + 1)),
        v(random_vector<T>(v_size(s), seed + 2)),
        dout(random_vector<T>(o_size(s), seed + 3)) {}
};

template <class T>
class AttentionTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(AttentionTest, Types);

TYPED_TEST(AttentionTest, EagerMatchesReference) {
  using T = TypeParam;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  std::uint64_t seed = 1000;
  for (const AttnShape& s : kShapes) {
    SCOPED_TRACE(describe(s));
    const Inputs<T> in(s, seed += 10);
    // Every output buffer starts as NaN: whatever is not written shows.
    std::vector<T> o(o_size(s), nan), probs(p_size(s), nan), o_ref(o_size(s), nan);
    attention_eager_forward<T>(s, o.data(), probs.data(), in.q.data(), in.k.data(), in.v.data());
    attention_reference_forward<T>(s, o_ref.data(), nullptr, in.q.data(), in.k.data(), in.v.data());
    EXPECT_TRUE(all_close("o", o, o_ref, atol<T>(), rtol<T>()));
    ASSERT_TRUE(test::all_finite("probs", probs.data(), p_size(s)));

    // Rows of probs: zero past key_end, summing to 1 (or all zero when masked).
    for (std::int64_t bh = 0; bh < s.B * s.Hq; ++bh)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        const T* row = probs.data() + (bh * s.Sq + i) * s.Sk;
        double sum = 0;
        for (std::int64_t j = 0; j < s.Sk; ++j) {
          if (j >= s.key_end(i)) {
            ASSERT_EQ(row[j], T(0)) << "masked p(" << i << ", " << j << ")";
          }
          sum += row[j];
        }
        ASSERT_NEAR(sum, s.key_end(i) > 0 ? 1.0 : 0.0, 64 * std::numeric_limits<T>::epsilon())
            << "row " << i;
      }

    std::vector<T> dq(q_size(s), nan), dk(k_size(s), nan), dv(v_size(s), nan);
    std::vector<T> dq_ref(q_size(s), nan), dk_ref(k_size(s), nan), dv_ref(v_size(s), nan);
    std::vector<T> scratch(s.Sq * s.Sk, nan);
    attention_eager_backward<T>(s, dq.data(), dk.data(), dv.data(), in.dout.data(), in.q.data(),
                                in.k.data(), in.v.data(), probs.data(), scratch.data());
    attention_reference_backward<T>(s, dq_ref.data(), dk_ref.data(), dv_ref.data(), in.dout.data(),
                                    in.q.data(), in.k.data(), in.v.data());
    EXPECT_TRUE(all_close("dq", dq, dq_ref, atol<T>(), rtol<T>()));
    EXPECT_TRUE(all_close("dk", dk, dk_ref, atol<T>(), rtol<T>()));
    EXPECT_TRUE(all_close("dv", dv, dv_ref, atol<T>(), rtol<T>()));
  }
}

// The lse output equals the reference's, masked rows' 0 included.
TYPED_TEST(AttentionTest, EagerLseMatchesReference) {
  using T = TypeParam;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  std::uint64_t seed = 3000;
  for (const AttnShape& s : kShapes) {
    SCOPED_TRACE(describe(s));
    const Inputs<T> in(s, seed += 10);
    std::vector<T> o(o_size(s)), probs(p_size(s)), o_ref(o_size(s));
    std::vector<T> lse(s.B * s.Hq * s.Sq, nan), lse_ref(s.B * s.Hq * s.Sq, nan);
    attention_eager_forward<T>(s, o.data(), probs.data(), in.q.data(), in.k.data(), in.v.data(),
                               lse.data());
    attention_reference_forward<T>(s, o_ref.data(), lse_ref.data(), in.q.data(), in.k.data(),
                                   in.v.data());
    EXPECT_TRUE(all_close("lse", lse, lse_ref, atol<T>(), rtol<T>()));
  }
}

// What a ring step does with the eager kernel: the keys of a full
// (non-causal) attention split into two calls, their outputs merged by
// their lse, each call's probabilities rescaled to the row's whole
// normalisation, and each call's backward given the row's D = do . o. The
// two calls' dq summed, and dk, dv side by side, are the one call's.
TYPED_TEST(AttentionTest, EagerKeySplitMergedByLseIsTheWholeCall) {
  using T = TypeParam;
  const AttnShape whole = make_shape(2, 6, 9, 4, 2, 5, 3, false);
  const Inputs<T> in(whole, 4242);
  std::vector<T> o_ref(o_size(whole)), dq_ref(q_size(whole)), dk_ref(k_size(whole)),
      dv_ref(v_size(whole));
  attention_reference_forward<T>(whole, o_ref.data(), nullptr, in.q.data(), in.k.data(),
                                 in.v.data());
  attention_reference_backward<T>(whole, dq_ref.data(), dk_ref.data(), dv_ref.data(),
                                  in.dout.data(), in.q.data(), in.k.data(), in.v.data());
  const std::int64_t split = 4, B = whole.B, Sq = whole.Sq, Hq = whole.Hq, Hk = whole.Hk;
  const std::int64_t dqk = whole.dqk, dv = whole.dv, rows = B * Hq * Sq;
  struct Part {
    AttnShape s;
    std::vector<T> k, v, o, probs, lse;
  };
  Part parts[2];
  for (int p = 0; p < 2; ++p) {
    const std::int64_t j0 = p == 0 ? 0 : split, n = p == 0 ? split : whole.Sk - split;
    Part& part = parts[p];
    part.s = whole;
    part.s.Sk = n;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = j0; j < j0 + n; ++j) {
        const T* krow = in.k.data() + (b * whole.Sk + j) * Hk * dqk;
        const T* vrow = in.v.data() + (b * whole.Sk + j) * Hk * dv;
        part.k.insert(part.k.end(), krow, krow + Hk * dqk);
        part.v.insert(part.v.end(), vrow, vrow + Hk * dv);
      }
    part.o.resize(o_size(part.s));
    part.probs.resize(p_size(part.s));
    part.lse.resize(rows);
    attention_eager_forward<T>(part.s, part.o.data(), part.probs.data(), in.q.data(), part.k.data(),
                               part.v.data(), part.lse.data());
  }
  // o = sum_p exp(lse_p - lse) o_p, lse = log sum_p exp(lse_p).
  std::vector<T> o(o_size(whole)), lse(rows), delta(rows);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < Sq; ++i) {
        const std::int64_t r = (b * Hq + h) * Sq + i;
        const T a = parts[0].lse[size_t(r)], c = parts[1].lse[size_t(r)], m = std::max(a, c);
        lse[size_t(r)] = m + std::log(std::exp(a - m) + std::exp(c - m));
        const std::int64_t oo = ((b * Sq + i) * Hq + h) * dv;
        T D = 0;
        for (std::int64_t e = 0; e < dv; ++e) {
          o[size_t(oo + e)] = std::exp(a - lse[size_t(r)]) * parts[0].o[size_t(oo + e)] +
                              std::exp(c - lse[size_t(r)]) * parts[1].o[size_t(oo + e)];
          D += in.dout[size_t(oo + e)] * o[size_t(oo + e)];
        }
        delta[size_t(r)] = D;
      }
  EXPECT_TRUE(all_close("o", o, o_ref, atol<T>(), rtol<T>()));
  std::vector<T> dq(q_size(whole), T(0)), dk, dv_all;
  for (int p = 0; p < 2; ++p) {
    Part& part = parts[p];
    const std::int64_t n = part.s.Sk;
    for (std::int64_t r = 0; r < rows; ++r) {
      const T f = std::exp(part.lse[size_t(r)] - lse[size_t(r)]);
      for (std::int64_t j = 0; j < n; ++j) part.probs[size_t(r * n + j)] *= f;
    }
    std::vector<T> dq_p(q_size(part.s)), dk_p(k_size(part.s)), dv_p(v_size(part.s)),
        scratch(Sq * n);
    attention_eager_backward<T>(part.s, dq_p.data(), dk_p.data(), dv_p.data(), in.dout.data(),
                                in.q.data(), part.k.data(), part.v.data(), part.probs.data(),
                                scratch.data(), delta.data());
    for (size_t e = 0; e < dq.size(); ++e) dq[e] += dq_p[e];
    part.k = dk_p;
    part.v = dv_p;
  }
  for (std::int64_t b = 0; b < B; ++b)
    for (int p = 0; p < 2; ++p) {
      const std::int64_t n = parts[p].s.Sk;
      dk.insert(dk.end(), parts[p].k.begin() + b * n * Hk * dqk,
                parts[p].k.begin() + (b + 1) * n * Hk * dqk);
      dv_all.insert(dv_all.end(), parts[p].v.begin() + b * n * Hk * dv,
                    parts[p].v.begin() + (b + 1) * n * Hk * dv);
    }
  EXPECT_TRUE(all_close("dq", dq, dq_ref, atol<T>(), rtol<T>()));
  EXPECT_TRUE(all_close("dk", dk, dk_ref, atol<T>(), rtol<T>()));
  EXPECT_TRUE(all_close("dv", dv_all, dv_ref, atol<T>(), rtol<T>()));
}

TYPED_TEST(AttentionTest, FullyMaskedRowsAreZeroAndPassNoGradient) {
  using T = TypeParam;
  const AttnShape s = make_shape(2, 7, 3, 2, 1, 4, 5, true);  // rows 0..3 see no key
  const std::int64_t masked = s.Sq - s.Sk;
  const Inputs<T> in(s, 77);
  std::vector<T> o(o_size(s)), probs(p_size(s)), o_ref(o_size(s)), lse(s.B * s.Hq * s.Sq);
  attention_eager_forward<T>(s, o.data(), probs.data(), in.q.data(), in.k.data(), in.v.data());
  attention_reference_forward<T>(s, o_ref.data(), lse.data(), in.q.data(), in.k.data(),
                                 in.v.data());
  std::vector<T> dq(q_size(s)), dk(k_size(s)), dv(v_size(s)), scratch(s.Sq * s.Sk);
  std::vector<T> dq_ref(q_size(s)), dk_ref(k_size(s)), dv_ref(v_size(s));
  attention_eager_backward<T>(s, dq.data(), dk.data(), dv.data(), in.dout.data(), in.q.data(),
                              in.k.data(), in.v.data(), probs.data(), scratch.data());
  attention_reference_backward<T>(s, dq_ref.data(), dk_ref.data(), dv_ref.data(), in.dout.data(),
                                  in.q.data(), in.k.data(), in.v.data());
  for (const auto* buf : {&o, &o_ref, &dq, &dq_ref, &dk, &dv, &dk_ref, &dv_ref, &probs, &lse})
    ASSERT_TRUE(test::all_finite("output", buf->data(), static_cast<std::int64_t>(buf->size())));
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t i = 0; i < s.Sq; ++i)
      for (std::int64_t h = 0; h < s.Hq; ++h) {
        const bool is_masked = i < masked;
        ASSERT_EQ(is_masked, s.key_end(i) == 0);
        const std::int64_t ot = ((b * s.Sq + i) * s.Hq + h) * s.dv;
        const std::int64_t qt = ((b * s.Sq + i) * s.Hq + h) * s.dqk;
        bool o_zero = true, dq_zero = true;
        for (std::int64_t c = 0; c < s.dv; ++c)
          o_zero &= o[ot + c] == T(0) && o_ref[ot + c] == T(0);
        for (std::int64_t c = 0; c < s.dqk; ++c)
          dq_zero &= dq[qt + c] == T(0) && dq_ref[qt + c] == T(0);
        EXPECT_EQ(o_zero, is_masked) << "o row " << i << " head " << h;
        // A row that sees one key has p = 1 and ds = p (dp - D) = 0: its dq
        // is zero too. Rows seeing two or more keys get a gradient.
        if (is_masked || s.key_end(i) >= 2) {
          EXPECT_EQ(dq_zero, is_masked) << "dq row " << i << " head " << h;
        }
        if (is_masked) {
          EXPECT_EQ(lse[(b * s.Hq + h) * s.Sq + i], T(0));
        }
      }
  EXPECT_TRUE(all_close("dk", dk, dk_ref, atol<T>(), rtol<T>()));
  EXPECT_TRUE(all_close("dv", dv, dv_ref, atol<T>(), rtol<T>()));
}

// The reference against the definition, computed here with an explicit
// softmax in double: bottom-right causal alignment, query head h reading
// key/value head h / (Hq / Hk), natural-log lse of the scaled scores.
TYPED_TEST(AttentionTest, ReferenceAndEagerFollowTheDefinition) {
  using T = TypeParam;
  for (const AttnShape& s0 :
       {make_shape(2, 3, 5, 4, 2, 3, 2, true), make_shape(1, 6, 4, 3, 1, 2, 3, true),
        make_shape(1, 4, 6, 2, 2, 3, 3, false)}) {
    AttnShape s = s0;
    s.scale = 0.7;  // not 1/sqrt(d): the scale must be taken from the shape
    SCOPED_TRACE(describe(s));
    const Inputs<T> in(s, 500);
    std::vector<T> o(o_size(s)), lse(s.B * s.Hq * s.Sq), o_e(o_size(s)), probs(p_size(s));
    attention_reference_forward<T>(s, o.data(), lse.data(), in.q.data(), in.k.data(), in.v.data());
    attention_eager_forward<T>(s, o_e.data(), probs.data(), in.q.data(), in.k.data(), in.v.data());
    const std::int64_t group = s.Hq / s.Hk;
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t h = 0; h < s.Hq; ++h)
        for (std::int64_t i = 0; i < s.Sq; ++i) {
          const std::int64_t hk = h / group;
          std::vector<double> sc;
          for (std::int64_t j = 0; j < s.Sk; ++j) {
            if (s.causal && j > i + s.Sk - s.Sq) break;  // bottom-right aligned mask
            double d = 0;
            for (std::int64_t c = 0; c < s.dqk; ++c)
              d += double(in.q[((b * s.Sq + i) * s.Hq + h) * s.dqk + c]) *
                   double(in.k[((b * s.Sk + j) * s.Hk + hk) * s.dqk + c]);
            sc.push_back(0.7 * d);
          }
          double z = 0;
          for (double x : sc) z += std::exp(x);
          if (!sc.empty()) {
            EXPECT_NEAR(lse[(b * s.Hq + h) * s.Sq + i], std::log(z), 1e-5);
          }
          for (std::int64_t j = 0; j < s.Sk; ++j) {
            const double p = j < static_cast<std::int64_t>(sc.size()) ? std::exp(sc[j]) / z : 0.0;
            EXPECT_NEAR(probs[((b * s.Hq + h) * s.Sq + i) * s.Sk + j], p, 1e-6);
          }
          for (std::int64_t c = 0; c < s.dv; ++c) {
            double acc = 0;
            for (std::size_t j = 0; j < sc.size(); ++j)
              acc += std::exp(sc[j]) / z * double(in.v[((b * s.Sk + j) * s.Hk + hk) * s.dv + c]);
            EXPECT_NEAR(o[((b * s.Sq + i) * s.Hq + h) * s.dv + c], acc, 1e-6);
            EXPECT_NEAR(o_e[((b * s.Sq + i) * s.Hq + h) * s.dv + c], acc, 1e-5);
          }
        }
  }
}

// Key/value heads hold constant values g + 1 (g the kv head): any softmax
// average of them is g + 1, so head h must output h / (Hq / Hk) + 1.
TYPED_TEST(AttentionTest, QueryHeadsReadTheirGroupsKeyValueHead) {
  using T = TypeParam;
  for (std::int64_t Hk : {6, 3, 1}) {
    const AttnShape s = make_shape(2, 4, 5, 6, Hk, 3, 2, true);
    const Inputs<T> in(s, 600);
    std::vector<T> v(v_size(s));
    for (std::int64_t t = 0; t < s.B * s.Sk; ++t)
      for (std::int64_t g = 0; g < Hk; ++g)
        for (std::int64_t c = 0; c < s.dv; ++c) v[(t * Hk + g) * s.dv + c] = static_cast<T>(g + 1);
    std::vector<T> o(o_size(s)), o_e(o_size(s)), probs(p_size(s));
    attention_reference_forward<T>(s, o.data(), nullptr, in.q.data(), in.k.data(), v.data());
    attention_eager_forward<T>(s, o_e.data(), probs.data(), in.q.data(), in.k.data(), v.data());
    for (std::int64_t t = 0; t < s.B * s.Sq; ++t)
      for (std::int64_t h = 0; h < s.Hq; ++h)
        for (std::int64_t c = 0; c < s.dv; ++c) {
          const double expect = double(h / (s.Hq / Hk) + 1);
          // Probabilities sum to 1 within a few eps per key: 32 eps * value.
          const double tol = 32 * std::numeric_limits<T>::epsilon() * expect;
          EXPECT_NEAR(o[(t * s.Hq + h) * s.dv + c], expect, tol) << "Hk=" << Hk << " head " << h;
          EXPECT_NEAR(o_e[(t * s.Hq + h) * s.dv + c], expect, tol) << "Hk=" << Hk << " head " << h;
        }
  }
}

TEST(AttnShape, KeyEndIsBottomRightAligned) {
  auto ends = [](const AttnShape& s) {
    std::vector<std::int64_t> e;
    for (std::int64_t i = 0; i < s.Sq; ++i) e.push_back(s.key_end(i));
    return e;
  };
  EXPECT_EQ(ends(make_shape(1, 4, 4, 1, 1, 1, 1, true)), (std::vector<std::int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(ends(make_shape(1, 2, 4, 1, 1, 1, 1, true)), (std::vector<std::int64_t>{3, 4}));
  EXPECT_EQ(ends(make_shape(1, 4, 2, 1, 1, 1, 1, true)), (std::vector<std::int64_t>{0, 0, 1, 2}));
  EXPECT_EQ(ends(make_shape(1, 3, 5, 1, 1, 1, 1, false)), (std::vector<std::int64_t>{5, 5, 5}));
}

TEST(AttnShape, UsefulFlopsCountUnmaskedPairs) {
  // Causal 4x4: 1 + 2 + 3 + 4 = 10 pairs, each dqk + dv multiply-adds, x2.
  EXPECT_DOUBLE_EQ(make_shape(2, 4, 4, 3, 1, 5, 7, true).useful_flops_forward(),
                   2.0 * 2 * 3 * 10 * (5 + 7));
  EXPECT_DOUBLE_EQ(make_shape(1, 4, 2, 1, 1, 5, 7, true).useful_flops_forward(), 2.0 * 3 * (5 + 7));
  EXPECT_DOUBLE_EQ(make_shape(1, 3, 5, 2, 2, 4, 4, false).useful_flops_forward(), 2.0 * 2 * 15 * 8);
  // The causal closed form against counting key_end row by row, for query
  // ranges shorter than, equal to and longer than the keys (empty rows), and
  // empty extents.
  for (std::int64_t Sq : {0, 1, 2, 5, 17, 64})
    for (std::int64_t Sk : {0, 1, 3, 17, 100}) {
      const AttnShape s = make_shape(3, Sq, Sk, 2, 1, 5, 7, true);
      double pairs = 0;
      for (std::int64_t i = 0; i < Sq; ++i) pairs += double(s.key_end(i));
      EXPECT_DOUBLE_EQ(s.useful_flops_forward(), 2.0 * 3 * 2 * pairs * 12)
          << "Sq " << Sq << " Sk " << Sk;
    }
  // And at a length no loop would finish: (S^2 + S) / 2 pairs, in double.
  const double S = 1e11;
  EXPECT_DOUBLE_EQ(
      make_shape(1, std::int64_t(S), std::int64_t(S), 1, 1, 1, 1, true).useful_flops_forward(),
      2.0 * 2 * (S * S + S) / 2);
}

TEST(AttnShape, ValidateNamesTheBadExtent) {
  EXPECT_NO_THROW(make_shape(1, 2, 2, 4, 2, 3, 3, true).validate());
  try {
    make_shape(1, 2, 2, 3, 2, 3, 3, true).validate();
    FAIL() << "Hq % Hk != 0 must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("(3)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_shape(1, 2, 2, 2, 0, 3, 3, true).validate(), Error);
  EXPECT_THROW(make_shape(1, 2, 2, 2, 2, 0, 3, true).validate(), Error);
  EXPECT_THROW(make_shape(1, 2, 2, 2, 2, 3, 0, true).validate(), Error);
  EXPECT_THROW(make_shape(1, -1, 2, 2, 2, 3, 3, true).validate(), Error);
  // The kernels validate before touching memory.
  const AttnShape bad = make_shape(1, 2, 2, 3, 2, 3, 3, true);
  EXPECT_THROW(attention_eager_forward<float>(bad, nullptr, nullptr, nullptr, nullptr, nullptr),
               Error);
  EXPECT_THROW(
      attention_reference_forward<double>(bad, nullptr, nullptr, nullptr, nullptr, nullptr), Error);
}

// Documents: doc_start[b * Sk + t] is the first token of token t's document.
// Row b = 0 holds documents [0, 2) and [2, 5); row 1 [0, 1), [1, 2), [2, 5).
const std::vector<std::int64_t> kDocStart = {0, 0, 2, 2, 2, 0, 1, 2, 2, 2};

TEST(AttnShape, KeyBeginIsTheStartOfTheRowsDocument) {
  auto begins = [](const AttnShape& s, std::int64_t b) {
    std::vector<std::int64_t> v;
    for (std::int64_t i = 0; i < s.Sq; ++i) v.push_back(s.key_begin(b, i));
    return v;
  };
  AttnShape s = make_shape(2, 5, 5, 1, 1, 1, 1, true);
  EXPECT_EQ(begins(s, 1), (std::vector<std::int64_t>{0, 0, 0, 0, 0}));  // no documents
  s.doc_start = kDocStart.data();
  EXPECT_EQ(begins(s, 0), (std::vector<std::int64_t>{0, 0, 2, 2, 2}));
  EXPECT_EQ(begins(s, 1), (std::vector<std::int64_t>{0, 1, 2, 2, 2}));
  // Queries the last 3 tokens (Sq < Sk), and 2 rows before the first key
  // (Sq > Sk), which see nothing: [0, 0).
  AttnShape suffix = make_shape(2, 3, 5, 1, 1, 1, 1, true),
            prefix = make_shape(2, 7, 5, 1, 1, 1, 1, true);
  suffix.doc_start = prefix.doc_start = kDocStart.data();
  EXPECT_EQ(begins(suffix, 1), (std::vector<std::int64_t>{2, 2, 2}));
  EXPECT_EQ(begins(prefix, 1), (std::vector<std::int64_t>{0, 0, 0, 1, 2, 2, 2}));
  EXPECT_EQ(prefix.key_end(1), 0);
}

TEST(AttnShape, UsefulFlopsCountOnlyPairsInsideDocuments) {
  AttnShape s = make_shape(2, 5, 5, 3, 1, 5, 7, true);
  s.doc_start = kDocStart.data();
  // Row 0: 1 + 2 (first document) + 1 + 2 + 3 = 9 pairs; row 1: 1 + 1 + 6 = 8.
  EXPECT_DOUBLE_EQ(s.useful_flops_forward(), 2.0 * 3 * (9 + 8) * (5 + 7));
  // One document per row counts what no mask does.
  const std::vector<std::int64_t> one_doc(10, 0);
  s.doc_start = one_doc.data();
  EXPECT_DOUBLE_EQ(s.useful_flops_forward(),
                   make_shape(2, 5, 5, 3, 1, 5, 7, true).useful_flops_forward());
}

TEST(AttnShape, ValidateRefusesBadDocStart) {
  auto error_of = [](const AttnShape& s) -> std::string {
    try {
      s.validate();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  AttnShape s = make_shape(2, 5, 5, 1, 1, 1, 1, true);
  s.doc_start = kDocStart.data();
  EXPECT_EQ(error_of(s), "");
  s.causal = false;
  EXPECT_NE(error_of(s).find("needs the causal mask"), std::string::npos) << error_of(s);
  s.causal = true;
  struct Bad {
    std::vector<std::int64_t> doc_start;
    std::string names;
  };
  for (const Bad& bad : {Bad{{0, 0, 1, 1, 1, 0, 1, 2, 2, 2}, "doc_start[b=0, t=2] = 1 must be 2"},
                         Bad{{0, 0, 2, 2, 2, 1, 1, 2, 2, 2}, "doc_start[b=1, t=0] = 1 must be 0"},
                         Bad{{0, 0, 2, 2, 2, 0, 1, 2, 3, 2}, "doc_start[b=1, t=4] = 2 must be 4"},
                         Bad{{0, 0, 2, 2, 5, 0, 1, 2, 2, 2}, "doc_start[b=0, t=4] = 5"}}) {
    s.doc_start = bad.doc_start.data();
    const std::string e = error_of(s);
    EXPECT_NE(e.find(bad.names), std::string::npos) << e;
  }
  // The kernels validate before touching memory (s.doc_start pointed into a
  // loop temporary: point it at one that lives).
  const std::vector<std::int64_t> bad = {0, 1, 0, 3, 3, 0, 1, 2, 2, 2};
  s.doc_start = bad.data();
  EXPECT_THROW(attention_eager_forward<float>(s, nullptr, nullptr, nullptr, nullptr, nullptr),
               Error);
  EXPECT_THROW(attention_reference_backward<double>(s, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                    nullptr, nullptr),
               Error);
}

// Finite differences in double of L = <G, attention(q, k, v)> for the
// reference and the eager backward, over shapes with masked rows, shared
// key/value heads and dqk != dv. With inputs O(1) and h = 1e-5 the central
// difference is accurate to ~1e-10 relative; tol 1e-6 (GradCheckOptions
// default) is the brief's bound.
TEST(Attention, BackwardsMatchFiniteDifferences) {
  const test::ScopedOmpThreads one_thread(1);  // see common/threads.hpp
  for (const AttnShape& s :
       {make_shape(2, 5, 7, 4, 2, 3, 2, true), make_shape(1, 6, 3, 2, 1, 3, 4, true),
        make_shape(2, 3, 3, 2, 2, 2, 3, false)}) {
    for (bool eager : {false, true}) {
      SCOPED_TRACE(describe(s) + (eager ? " eager" : " reference"));
      Inputs<double> in(s, 900);
      std::vector<double> o(o_size(s)), probs(p_size(s));
      auto forward = [&] {
        if (eager)
          attention_eager_forward<double>(s, o.data(), probs.data(), in.q.data(), in.k.data(),
                                          in.v.data());
        else
          attention_reference_forward<double>(s, o.data(), nullptr, in.q.data(), in.k.data(),
                                              in.v.data());
      };
      forward();
      std::vector<double> dq(q_size(s)), dk(k_size(s)), dv(v_size(s)), scratch(s.Sq * s.Sk);
      if (eager)
        attention_eager_backward<double>(s, dq.data(), dk.data(), dv.data(), in.dout.data(),
                                         in.q.data(), in.k.data(), in.v.data(), probs.data(),
                                         scratch.data());
      else
        attention_reference_backward<double>(s, dq.data(), dk.data(), dv.data(), in.dout.data(),
                                             in.q.data(), in.k.data(), in.v.data());
      test::GradientCheck gc;
      gc.add("q", in.q.data(), dq.data(), {s.B, s.Sq, s.Hq, s.dqk})
          .add("k", in.k.data(), dk.data(), {s.B, s.Sk, s.Hk, s.dqk})
          .add("v", in.v.data(), dv.data(), {s.B, s.Sk, s.Hk, s.dv});
      EXPECT_TRUE(gc.run([&] {
        forward();
        return test::dot(in.dout.data(), o.data(), o_size(s));
      }));
    }
  }
}

}  // namespace
}  // namespace laga
