// RMSNorm forward/backward against the reference, a hand-computed row and
// finite differences; rows strided by ldx > C as the latent of wkv_a is.
#include "kernels/rmsnorm.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/check.hpp"
#include "common/threads.hpp"
#include "core/bf16.hpp"

namespace laga {
namespace {

using test::all_close;
using test::random_vector;

template <class T>
class RmsNormTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(RmsNormTest, Types);

constexpr double kEps = 1e-6;  // DeepSeek-V3's kv_norm / q_norm eps

// Rows of C <= 512 values in [-1, 1]: the float kernel's sum of squares has
// relative error <= C eps_f ~ 3e-5 worst case and ~sqrt(C) eps_f ~ 1.3e-6
// typically; rstd and y inherit it, dx adds one more length-C sum. The largest
// differences seen are 2.4e-7 (y, dx) and 1.9e-6 (dw, a sum of 33 rows).
// 3e-5 relative + 3e-6 absolute (for values that cancel to ~0), times N for
// dw, is the worst-case bound and still 4 orders below a wrong term.
// Double: seen 3e-15; 1e-12 relative + 1e-13 absolute.
template <class T>
double rtol() {
  return std::is_same_v<T, float> ? 3e-5 : 1e-12;
}
template <class T>
double atol() {
  return std::is_same_v<T, float> ? 3e-6 : 1e-13;
}

TYPED_TEST(RmsNormTest, HandComputedRow) {
  using T = TypeParam;
  // x = (3, 4): mean square 12.5; with eps = 0, rstd = 1/sqrt(12.5).
  // A zero row gives rstd = 1/sqrt(eps) and y = 0 (eps keeps it finite).
  const std::vector<T> x{3, 4, 0, 0}, w{1, 2};
  std::vector<T> y(4), rstd(2);
  rmsnorm_forward<T>(y.data(), rstd.data(), x.data(), 2, w.data(), 2, 2, 0.0);
  const double r = 1.0 / std::sqrt(12.5);
  const double e = 4 * std::numeric_limits<T>::epsilon();
  EXPECT_NEAR(rstd[0], r, e);
  EXPECT_NEAR(y[0], 3 * r, e);
  EXPECT_NEAR(y[1], 8 * r, e);
  EXPECT_TRUE(std::isinf(double(rstd[1])));  // eps = 0 and a zero row: 1/0 (caller's choice)
  rmsnorm_forward<T>(y.data(), rstd.data(), x.data(), 2, w.data(), 2, 2, 0.25);
  EXPECT_NEAR(rstd[0], 1.0 / std::sqrt(12.75), e);
  EXPECT_NEAR(rstd[1], 2.0, e);
  EXPECT_EQ(y[2], T(0));
  EXPECT_EQ(y[3], T(0));
}

struct Case {
  std::int64_t N, C, ldx;
};
const Case kCases[] = {{1, 1, 1}, {7, 37, 37}, {9, 37, 45}, {33, 512, 576}, {3, 5, 13}};

TYPED_TEST(RmsNormTest, ForwardMatchesReference) {
  using T = TypeParam;
  std::uint64_t seed = 100;
  for (const Case& c : kCases) {
    SCOPED_TRACE(testing::Message() << "N=" << c.N << " C=" << c.C << " ldx=" << c.ldx);
    const auto x = random_vector<T>(c.N * c.ldx, seed++),
               w = random_vector<T>(c.C, seed++, 0.5, 1.5);
    std::vector<T> y(c.N * c.C), r(c.N), y_ref(c.N * c.C), r_ref(c.N);
    rmsnorm_forward<T>(y.data(), r.data(), x.data(), c.ldx, w.data(), c.N, c.C, kEps);
    rmsnorm_forward_reference<T>(y_ref.data(), r_ref.data(), x.data(), c.ldx, w.data(), c.N, c.C,
                                 kEps);
    EXPECT_TRUE(all_close("rstd", r, r_ref, atol<T>(), rtol<T>()));
    EXPECT_TRUE(all_close("y", y, y_ref, atol<T>(), rtol<T>()));
    // The reference itself against the definition, in long double (as
    // accurate as the reference, which sums in it too).
    for (std::int64_t n = 0; n < c.N; ++n) {
      long double ss = 0;
      for (std::int64_t k = 0; k < c.C; ++k)
        ss += static_cast<long double>(x[n * c.ldx + k]) * x[n * c.ldx + k];
      const double rs = static_cast<double>(1.0L / std::sqrt(ss / c.C + kEps));
      EXPECT_NEAR(r_ref[n], rs, 2 * std::numeric_limits<T>::epsilon() * rs);
      for (std::int64_t k = 0; k < c.C; ++k)
        ASSERT_NEAR(y_ref[n * c.C + k], x[n * c.ldx + k] * rs * w[k],
                    4 * std::numeric_limits<T>::epsilon() * std::abs(x[n * c.ldx + k] * rs * w[k]) +
                        1e-300);
    }
  }
}

// RMSNorm is scale-invariant, so a row scaled by any factor its type holds
// gives the same y (eps aside: it is below one ulp at these scales) and dx
// scaled by the inverse. Unscaled, a float row of |x| ~ 1e19 over 512
// columns summed to inf and came out exactly 0 (issue 26); a double row
// of 1e160 the same. Checked against the row at scale 1, not only the
// reference.
TYPED_TEST(RmsNormTest, RowsOfAnyScaleGiveTheScaleInvariantAnswer) {
  using T = TypeParam;
  const std::int64_t N = 3, C = 512;
  const auto x = random_vector<T>(N * C, 301), w = random_vector<T>(C, 302, 0.5, 1.5),
             dy = random_vector<T>(N * C, 303);
  const std::vector<double> scales = std::is_same_v<T, float>
                                         ? std::vector<double>{1e19, 1e30, 1e36, 1e-19}
                                         : std::vector<double>{1e160, 1e300, 1e-160};
  std::vector<T> y1(N * C), r1(N), dx1(N * C), dw1(C, T(0));
  // eps 0: the answer at scale 1 is then the exact one at every scale.
  rmsnorm_forward<T>(y1.data(), r1.data(), x.data(), C, w.data(), N, C, 0.0);
  rmsnorm_backward<T>(dx1.data(), C, dw1.data(), dy.data(), C, x.data(), C, w.data(), r1.data(), N,
                      C);
  for (const double scale : scales) {
    SCOPED_TRACE(testing::Message() << "scale " << scale);
    std::vector<T> xs(x.size());
    for (size_t i = 0; i < x.size(); ++i) xs[i] = static_cast<T>(double(x[i]) * scale);
    std::vector<T> y(N * C), r(N), dx(N * C), dw(C, T(0));
    rmsnorm_forward<T>(y.data(), r.data(), xs.data(), C, w.data(), N, C, 0.0);
    rmsnorm_backward<T>(dx.data(), C, dw.data(), dy.data(), C, xs.data(), C, w.data(), r.data(), N,
                        C);
    EXPECT_TRUE(all_close("y", y, y1, atol<T>(), rtol<T>()));
    EXPECT_TRUE(all_close("dw", dw, dw1, atol<T>() * N, rtol<T>() * N));
    std::vector<T> dx_back(dx.size());  // dx x scale: the unscaled row's gradient
    for (size_t i = 0; i < dx.size(); ++i) dx_back[i] = static_cast<T>(double(dx[i]) * scale);
    EXPECT_TRUE(all_close("dx * scale", dx_back, dx1, atol<T>(), rtol<T>()));
    for (std::int64_t n = 0; n < N; ++n)
      EXPECT_NEAR(double(r[n]) * scale, double(r1[n]), rtol<T>() * double(r1[n]));
  }
  // With eps, at a scale where eps is far below the mean square: the same.
  std::vector<T> xs(x.size()), y(N * C), r(N);
  const double big = std::is_same_v<T, float> ? 1e19 : 1e160;
  for (size_t i = 0; i < x.size(); ++i) xs[i] = static_cast<T>(double(x[i]) * big);
  rmsnorm_forward<T>(y.data(), r.data(), xs.data(), C, w.data(), N, C, kEps);
  EXPECT_TRUE(all_close("y with eps", y, y1, atol<T>(), rtol<T>()));
}

// Rows whose largest |x| spans float's whole range, normal and subnormal,
// forward and backward, against the definition in long double (its range
// holds every float's square). After issue 26's fix (rows summed as
// (x/m)^2, eps carried as eps/m^2) a row whose max was below ~5e-23 came
// out exactly 0 (eps/m^2 was inf), and one with a subnormal max came out
// NaN (1/m was inf) (issue 54, F). The error is measured against each row's
// largest reference value (normwise, as the existing cases' tolerances
// are), plus a few of the smallest subnormals where the outputs are
// subnormal themselves and hold that absolute precision only.
struct LongRef {
  std::vector<long double> y, r, dx, dx_mag, dw, dw_mag;
};

LongRef long_double_reference(const std::vector<float>& x, const std::vector<float>& w,
                              const std::vector<float>& dy, std::int64_t N, std::int64_t C,
                              double eps) {
  LongRef o;
  o.y.resize(size_t(N * C)), o.r.resize(size_t(N)), o.dx.resize(size_t(N * C));
  o.dx_mag.resize(size_t(N * C));
  o.dw.assign(size_t(C), 0), o.dw_mag.assign(size_t(C), 0);
  for (std::int64_t n = 0; n < N; ++n) {
    long double ss = 0;
    for (std::int64_t c = 0; c < C; ++c) ss += (long double)x[n * C + c] * x[n * C + c];
    const long double r = 1.0L / std::sqrt(ss / C + (long double)eps);
    o.r[size_t(n)] = r;
    long double g = 0;
    for (std::int64_t c = 0; c < C; ++c) {
      o.y[size_t(n * C + c)] = x[n * C + c] * r * w[c];
      g += (long double)w[c] * dy[n * C + c] * (x[n * C + c] * r);
    }
    for (std::int64_t c = 0; c < C; ++c) {
      const long double xhat = x[n * C + c] * r;
      o.dx[size_t(n * C + c)] = r * (w[c] * (long double)dy[n * C + c] - xhat * g / C);
      // The terms' size before they cancel (a float sum's error is
      // relative to it: at C = 1 dx = r w dy eps r^2, far below either).
      o.dx_mag[size_t(n * C + c)] =
          r * (std::abs(w[c] * (long double)dy[n * C + c]) + std::abs(xhat * g / C));
      o.dw[size_t(c)] += dy[n * C + c] * xhat;
      o.dw_mag[size_t(c)] += std::abs(dy[n * C + c] * xhat);
    }
  }
  return o;
}

// The largest |x| of the rows: 0 (an all-zero row), every power of two
// float holds, from the least subnormal to 2^127, float's largest value, and
// values at the two failures' edges.
std::vector<double> every_float_magnitude() {
  std::vector<double> m{0.0};  // an all-zero row: rstd 1/sqrt(eps), y 0, dx r w dy
  for (int e = -149; e <= 127; ++e) m.push_back(std::ldexp(1.0, e));
  for (double v : {double(std::numeric_limits<float>::max()), 3e-39, 1e-38, 1e-30, 5e-23, 4e-23,
                   6e-23, 1e-19, 1e19, 3e38})
    m.push_back(double(static_cast<float>(v)));
  return m;
}

// One row per magnitude: C values in [-1, 1] times it, the first exactly
// +-it (so it is the row's max), rounded to float as a float run holds them.
std::vector<float> rows_of(const std::vector<double>& mags, std::int64_t C, std::uint64_t seed) {
  const auto u = random_vector<double>(std::int64_t(mags.size()) * C, seed);
  std::vector<float> x(u.size());
  for (size_t n = 0; n < mags.size(); ++n)
    for (std::int64_t c = 0; c < C; ++c) {
      const double v = c == 0 ? (n % 2 ? -1.0 : 1.0) : u[n * size_t(C) + size_t(c)];
      x[n * size_t(C) + size_t(c)] = static_cast<float>(v * mags[n]);
    }
  return x;
}

TEST(RmsNorm, RowsOfEveryFloatMagnitudeMatchTheDefinition) {
  const double tiny = std::numeric_limits<float>::denorm_min();
  for (const std::int64_t C : {std::int64_t(1), std::int64_t(7), std::int64_t(512)}) {
    // eps: DeepSeek-V3's, the least a config may give, and 0 (where 1/rms
    // stays a float: rows above 2^-120).
    for (const double eps : {1e-6, 1e-30, 0.0}) {
      std::vector<double> mags = every_float_magnitude();
      if (eps == 0)
        mags.erase(std::remove_if(mags.begin(), mags.end(),
                                  [](double m) { return m < std::ldexp(1.0, -120); }),
                   mags.end());
      const std::int64_t N = std::int64_t(mags.size());
      SCOPED_TRACE(testing::Message() << "C=" << C << " eps=" << eps);
      const auto x = rows_of(mags, C, 500 + std::uint64_t(C));
      const auto w = random_vector<float>(C, 502, 0.5, 1.5), dy = random_vector<float>(N * C, 503);
      std::vector<float> y(size_t(N * C)), r(static_cast<size_t>(N)), dx(size_t(N * C)),
          dw(size_t(C), 0.f);
      rmsnorm_forward<float>(y.data(), r.data(), x.data(), C, w.data(), N, C, eps);
      rmsnorm_backward<float>(dx.data(), C, dw.data(), dy.data(), C, x.data(), C, w.data(),
                              r.data(), N, C);
      const LongRef ref = long_double_reference(x, w, dy, N, C, eps);
      int bad = 0;
      for (std::int64_t n = 0; n < N && bad < 5; ++n) {
        long double ymax = 0, dxmax = 0;
        for (std::int64_t c = 0; c < C; ++c) {
          ymax = std::max(ymax, std::abs(ref.y[size_t(n * C + c)]));
          dxmax = std::max(dxmax, ref.dx_mag[size_t(n * C + c)]);
        }
        // y: one rounding to float from a double computation; rstd the
        // same; dx: float sums over C (the tolerance of the cases above),
        // against the size of its terms before they cancel.
        const double rr = double(ref.r[size_t(n)]);
        bool ok = std::abs(double(r[size_t(n)]) - rr) <= 4e-7 * rr + 2 * tiny;
        for (std::int64_t c = 0; c < C; ++c) {
          const size_t i = size_t(n * C + c);
          ok = ok && std::abs(double(y[i]) - double(ref.y[i])) <= 4e-7 * double(ymax) + 2 * tiny;
          ok = ok && std::abs(double(dx[i]) - double(ref.dx[i])) <= 3e-5 * double(dxmax) + 4 * tiny;
        }
        if (!ok) {
          ++bad;
          ADD_FAILURE() << "row max " << mags[size_t(n)] << ": rstd " << r[size_t(n)] << " (want "
                        << rr << "), y[0] " << y[size_t(n * C)] << " (want "
                        << double(ref.y[size_t(n * C)]) << "), dx[0] " << dx[size_t(n * C)]
                        << " (want " << double(ref.dx[size_t(n * C)]) << ")";
        }
      }
      for (std::int64_t c = 0; c < C; ++c)
        EXPECT_LE(std::abs(double(dw[size_t(c)]) - double(ref.dw[size_t(c)])),
                  3e-5 * double(ref.dw_mag[size_t(c)]) + 4 * tiny)
            << "dw[" << c << "]";
    }
  }
}

// The same rows under bf16 mixed precision: the kernel runs in fp32 and its
// y is rounded to bf16 (ops::rmsnorm), where fp32 subnormals become 0. Each
// value is then within one bf16 rounding (2^-8 relative) of the definition's,
// or below float's least normal where bf16 flushes it; the old kernel's
// zero rows (max below ~5e-23: y ~ 1e3 x, normal) and NaN rows failed this.
TEST(RmsNorm, RowsOfEveryFloatMagnitudeRoundedToBf16MatchTheDefinition) {
  const std::int64_t C = 64;
  const double least_normal = std::numeric_limits<float>::min();
  for (const double eps : {1e-6, 1e-30}) {
    const std::vector<double> mags = every_float_magnitude();
    const std::int64_t N = std::int64_t(mags.size());
    auto x = rows_of(mags, C, 600);
    for (float& v : x) {  // bf16 values, where bf16 holds them (not past its largest, not flushed)
      const float b = to_float(to_bf16(v));
      if (std::isfinite(b) && b != 0) v = b;
    }
    const auto w = random_vector<float>(C, 602, 0.5, 1.5), dy = random_vector<float>(N * C, 603);
    std::vector<float> y(size_t(N * C)), r(static_cast<size_t>(N));
    rmsnorm_forward<float>(y.data(), r.data(), x.data(), C, w.data(), N, C, eps);
    const LongRef ref = long_double_reference(x, w, dy, N, C, eps);
    int bad = 0;
    for (std::int64_t i = 0; i < N * C && bad < 5; ++i) {
      const double got = to_float(to_bf16(y[size_t(i)])), want = double(ref.y[size_t(i)]);
      if (std::abs(got - want) <= std::ldexp(std::abs(want), -8) + least_normal) continue;
      ++bad;
      ADD_FAILURE() << "eps " << eps << " row max " << mags[size_t(i / C)] << ": y " << got
                    << " (want " << want << ")";
    }
  }
}

TYPED_TEST(RmsNormTest, BackwardMatchesReferenceAndKeepsPadding) {
  using T = TypeParam;
  std::uint64_t seed = 200;
  for (const Case& c : kCases) {
    SCOPED_TRACE(testing::Message() << "N=" << c.N << " C=" << c.C << " ldx=" << c.ldx);
    const auto x = random_vector<T>(c.N * c.ldx, seed++),
               w = random_vector<T>(c.C, seed++, 0.5, 1.5);
    // dy and dx rows are wider than x's (lddy = C + 1, lddx = ldx + 2), as the
    // block's d[c_hat | k_pe] and d[q | kv_a] are wider than its saved kv_a:
    // each stride must be the one used.
    const std::int64_t lddy = c.C + 1, lddx = c.ldx + 2;
    const auto dy = random_vector<T>(c.N * lddy, seed++);
    std::vector<T> y(c.N * c.C), r(c.N);
    rmsnorm_forward_reference<T>(y.data(), r.data(), x.data(), c.ldx, w.data(), c.N, c.C, kEps);

    // dx padding holds a sentinel that must survive; dw accumulates onto dw0.
    const T sentinel = T(777);
    const auto dw0 = random_vector<T>(c.C, seed++);
    std::vector<T> dx(c.N * lddx, sentinel), dx_ref(c.N * lddx, sentinel);
    std::vector<T> dw = dw0, dw_ref = dw0;
    rmsnorm_backward<T>(dx.data(), lddx, dw.data(), dy.data(), lddy, x.data(), c.ldx, w.data(),
                        r.data(), c.N, c.C);
    rmsnorm_backward_reference<T>(dx_ref.data(), lddx, dw_ref.data(), dy.data(), lddy, x.data(),
                                  c.ldx, w.data(), r.data(), c.N, c.C);
    for (std::int64_t n = 0; n < c.N; ++n)
      for (std::int64_t k = c.C; k < lddx; ++k) {
        ASSERT_EQ(dx[n * lddx + k], sentinel)
            << "rmsnorm_backward wrote padding (" << n << ", " << k << ")";
        ASSERT_EQ(dx_ref[n * lddx + k], sentinel) << "reference wrote padding";
      }
    EXPECT_TRUE(all_close("dx", dx, dx_ref, atol<T>(), rtol<T>()));
    // dw sums N rows: N times the per-element tolerance.
    EXPECT_TRUE(all_close("dw", dw, dw_ref, atol<T>() * double(c.N), rtol<T>()));
  }
}

// Finite differences in double of L = <G, rmsnorm(x, w)> through the kernel
// and through the reference. x is strided (ldx = C + 3) and its padding is
// registered too: the forward must not read it, so its numeric gradient is
// exactly 0, and the backward must leave the zero-initialised dx padding at 0.
// tol 1e-6: central differences with h = 1e-5 have truncation error
// ~h^2 |L'''| ~ 1e-10 here (x, w of order 1, rstd of order 1.7).
TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  const test::ScopedOmpThreads one_thread(1);  // see common/threads.hpp
  const std::int64_t N = 5, C = 11, ldx = C + 3;
  for (bool reference : {false, true}) {
    SCOPED_TRACE(reference ? "reference" : "kernel");
    auto x = random_vector<double>(N * ldx, 301), w = random_vector<double>(C, 302, 0.5, 1.5);
    const auto G = random_vector<double>(N * C, 303);
    std::vector<double> y(N * C), r(N);
    auto fwd = [&] {
      if (reference)
        rmsnorm_forward_reference<double>(y.data(), r.data(), x.data(), ldx, w.data(), N, C, kEps);
      else
        rmsnorm_forward<double>(y.data(), r.data(), x.data(), ldx, w.data(), N, C, kEps);
    };
    fwd();
    std::vector<double> dx(N * ldx, 0.0), dw(C, 0.0);
    if (reference)
      rmsnorm_backward_reference<double>(dx.data(), ldx, dw.data(), G.data(), C, x.data(), ldx,
                                         w.data(), r.data(), N, C);
    else
      rmsnorm_backward<double>(dx.data(), ldx, dw.data(), G.data(), C, x.data(), ldx, w.data(),
                               r.data(), N, C);
    test::GradientCheck gc;
    gc.add("x", x.data(), dx.data(), {N, ldx}).add("w", w.data(), dw.data(), C);
    EXPECT_TRUE(gc.run([&] {
      fwd();
      return test::dot(G.data(), y.data(), N * C);
    }));
  }
}

// A scaled row has the same output (RMSNorm is scale invariant up to eps), so
// its dx is orthogonal to x: sum_c dx_c x_c = 0 when eps = 0.
TEST(RmsNorm, GradientIsOrthogonalToTheRowWithoutEps) {
  const std::int64_t N = 3, C = 16;
  const auto x = random_vector<double>(N * C, 401), w = random_vector<double>(C, 402);
  const auto G = random_vector<double>(N * C, 403);
  std::vector<double> y(N * C), r(N), dx(N * C), dw(C, 0.0);
  rmsnorm_forward<double>(y.data(), r.data(), x.data(), C, w.data(), N, C, 0.0);
  rmsnorm_backward<double>(dx.data(), C, dw.data(), G.data(), C, x.data(), C, w.data(), r.data(), N,
                           C);
  for (std::int64_t n = 0; n < N; ++n)
    EXPECT_NEAR(test::dot(dx.data() + n * C, x.data() + n * C, C), 0.0, 1e-13) << "row " << n;
}

}  // namespace
}  // namespace laga
