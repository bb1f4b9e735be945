// The language model's ops (mla/ops_model.hpp), each held to a naive double
// reference written here from its formula, in double and in float, and each
// run count-only beside its real run: a count-only run touches no storage
// (its tensors have none, and every raw pointer it is given points into a
// page no read or write may touch, so a touch is a crash), counts exactly
// what the real run counts (GEMM FLOPs and calls, elementwise bytes) and
// reaches the same pool peak. The model runs these ops and nothing else, so
// this is what makes its count-only run (laga train's memory prediction)
// allocate as a real one without asking whether it counts.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "core/rng.hpp"
#include "mla/ops_model.hpp"

namespace laga {
namespace {

// A page that may be neither read nor written: a count-only run's raw
// pointers (token ids, targets, routing rows and weights) point here.
template <class P>
P* untouchable() {
  static void* const page =
      mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);  // NOLINT
  EXPECT_NE(page, MAP_FAILED);
  return static_cast<P*>(page);
}

// A raw pointer operand: the data in a real run, the untouchable page in a
// count-only one.
template <class P>
P* raw(std::vector<std::remove_const_t<P>>& v, bool real) {
  return real ? v.data() : untouchable<P>();
}

template <class T>
double tolerance() {
  return std::is_same_v<T, double> ? 1e-12 : 2e-5;
}

// Uniform in [lo, hi) where the tensor has storage (a real run).
template <class T>
void fill(Tensor<T>& t, std::uint64_t stream, double lo = -1, double hi = 1) {
  if (t.data()) fill_uniform(t.data(), t.numel(), 17, stream, 0, lo, hi);
}

template <class T>
void expect_near_all(const Tensor<T>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.numel(), std::int64_t(want.size())) << what;
  double scale = 1e-300;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (std::int64_t i = 0; i < got.numel(); ++i)
    ASSERT_NEAR(double(got[i]), want[size_t(i)], tolerance<T>() * scale) << what << " at " << i;
}

template <class T>
std::vector<double> values(const Tensor<T>& t) {
  return std::vector<double>(t.data(), t.data() + t.numel());
}

// body(real) run on a computing pool and on a count-only one, each under a
// CountOps scope: the same counts (and some), the same pool peak.
template <class Body>
void real_and_counted(Body&& body) {
  ops::OpCounts real_counts, counted;
  std::int64_t real_peak = 0, counted_peak = 0;
  {
    MemoryPool pool;
    PoolScope scope(pool);
    const ops::CountOps count(real_counts);
    body(true);
    real_peak = pool.peak_total();
  }
  {
    MemoryPool pool;
    pool.set_count_only(true);
    PoolScope scope(pool);
    const ops::CountOps count(counted);
    body(false);
    counted_peak = pool.peak_total();
  }
  EXPECT_GT(real_counts.gemm_flops + real_counts.elementwise_bytes, 0);
  EXPECT_EQ(counted.gemm_flops, real_counts.gemm_flops);
  EXPECT_EQ(counted.elementwise_bytes, real_counts.elementwise_bytes);
  EXPECT_EQ(counted.gemm_calls, real_counts.gemm_calls);
  EXPECT_EQ(counted_peak, real_peak);
}

template <class T>
class OpsModel : public ::testing::Test {};
using Types = ::testing::Types<double, float>;
TYPED_TEST_SUITE(OpsModel, Types);

constexpr std::int64_t N = 7, D = 5, V = 11, F = 6;

TYPED_TEST(OpsModel, EmbeddingAndItsBackward) {
  using T = TypeParam;
  std::vector<std::int32_t> ids{3, 0, 10, 3, 7, 3, 1};  // repeats sum in row order
  real_and_counted([&](bool real) {
    Tensor<T> table({V, D}), out({N, D}), dtable({V, D}), dout({N, D});
    fill(table, 1), fill(dtable, 2), fill(dout, 3);
    const std::vector<double> dtable0 = real ? values(dtable) : std::vector<double>();
    ops::embedding(ops::mat(out), raw<const std::int32_t>(ids, real), table);
    ops::embedding_backward(dtable, ops::mat(dout), raw<const std::int32_t>(ids, real));
    if (!real) return;
    std::vector<double> want(size_t(N * D)), dwant = dtable0;
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t d = 0; d < D; ++d) {
        want[size_t(i * D + d)] = double(table[ids[size_t(i)] * D + d]);
        dwant[size_t(ids[size_t(i)] * D + d)] += double(dout[i * D + d]);
      }
    expect_near_all(out, want, "embedding");
    expect_near_all(dtable, dwant, "embedding_backward");
  });
}

TYPED_TEST(OpsModel, SwigluAndItsBackward) {
  using T = TypeParam;
  real_and_counted([&](bool real) {
    Tensor<T> a({N, F}), b({N, F}), h({N, F}), dh({N, F}), da({N, F}), db({N, F});
    fill(a, 1, -3, 3), fill(b, 2), fill(dh, 3);
    ops::swiglu(ops::mat(h), ops::mat(a), ops::mat(b));
    ops::swiglu_backward(ops::mat(da), ops::mat(db), ops::mat(dh), ops::mat(a), ops::mat(b));
    if (!real) return;
    std::vector<double> hw(size_t(N * F)), daw(hw.size()), dbw(hw.size());
    for (size_t i = 0; i < hw.size(); ++i) {
      const double x = double(a[std::int64_t(i)]), y = double(b[std::int64_t(i)]),
                   g = double(dh[std::int64_t(i)]), s = 1 / (1 + std::exp(-x));
      hw[i] = x * s * y;
      daw[i] = g * y * s * (1 + x * (1 - s));
      dbw[i] = g * x * s;
    }
    expect_near_all(h, hw, "swiglu");
    expect_near_all(da, daw, "swiglu_backward da");
    expect_near_all(db, dbw, "swiglu_backward db");
  });
}

TYPED_TEST(OpsModel, CrossEntropyAndItsBackward) {
  using T = TypeParam;
  std::vector<std::int32_t> targets{4, kIgnoreTarget, 0, 10, 4, 2, kIgnoreTarget};
  const double scale = 1.0 / 5;
  real_and_counted([&](bool real) {
    Tensor<T> logits({N, V}), loss({N}), dlogits({N, V});
    Tensor<double> lse({N});
    fill(logits, 1, -4, 4);
    const double sum =
        ops::cross_entropy(loss, lse, ops::mat(logits), raw<const std::int32_t>(targets, real));
    ops::cross_entropy_backward(ops::mat(dlogits), ops::mat(logits), lse,
                                raw<const std::int32_t>(targets, real), scale);
    // In place, as the model runs it (dlogits over the logits).
    Tensor<T> in_place({N, V});
    ops::copy(ops::mat(in_place), ops::mat(logits));
    ops::cross_entropy_backward(ops::mat(in_place), ops::mat(in_place), lse,
                                raw<const std::int32_t>(targets, real), scale);
    if (!real) {
      EXPECT_EQ(sum, 0.0);
      return;
    }
    std::vector<double> lw(static_cast<size_t>(N)), dw(size_t(N * V));
    double sum_want = 0;
    for (std::int64_t i = 0; i < N; ++i) {
      double z = 0;
      for (std::int64_t v = 0; v < V; ++v) z += std::exp(double(logits[i * V + v]));
      const std::int32_t t = targets[size_t(i)];
      if (t == kIgnoreTarget) continue;  // loss 0, dlogits 0
      lw[size_t(i)] = std::log(z) - double(logits[i * V + t]);
      sum_want += lw[size_t(i)];
      for (std::int64_t v = 0; v < V; ++v)
        dw[size_t(i * V + v)] = scale * (std::exp(double(logits[i * V + v])) / z - (v == t));
    }
    expect_near_all(loss, lw, "cross_entropy loss");
    expect_near_all(dlogits, dw, "cross_entropy_backward");
    EXPECT_NEAR(sum, sum_want, tolerance<T>() * 10 * std::abs(sum_want));
    expect_near_all(in_place, dw, "cross_entropy_backward in place");
  });
}

TYPED_TEST(OpsModel, AdamwAndTheStepsReductions) {
  using T = TypeParam;
  AdamWHyper h;
  h.lr = 0.01, h.beta1 = 0.8, h.beta2 = 0.9, h.eps = 1e-6, h.weight_decay = 0.1;
  const std::int64_t step = 3, n = N * D;
  real_and_counted([&](bool real) {
    Tensor<T> p({N, D}), m({N, D}), v({N, D}), g({N, D});
    fill(p, 1), fill(m, 2), fill(v, 3, 0, 1), fill(g, 4);
    if (real) g[5] = T(NAN), g[9] = T(INFINITY);
    const NonFinite nf = ops::count_nonfinite(g);
    if (real) g[5] = T(0.5), g[9] = T(-0.25);
    const double sq = ops::sum_squares(g);
    const std::vector<double> p0 = real ? values(p) : std::vector<double>(),
                              m0 = real ? values(m) : p0, v0 = real ? values(v) : p0,
                              g0 = real ? values(g) : p0;
    ops::scale(g, T(0.5));
    ops::adamw(p, m, v, g, step, h);
    if (!real) {
      EXPECT_EQ(nf.count, 0);
      EXPECT_EQ(sq, 0.0);
      return;
    }
    EXPECT_EQ(nf.count, 2);
    EXPECT_EQ(nf.first, 5);
    double sq_want = 0;
    std::vector<double> pw(static_cast<size_t>(n)), mw(pw.size()), vw(pw.size()), gw(pw.size());
    for (size_t i = 0; i < pw.size(); ++i) {
      sq_want += g0[i] * g0[i];
      gw[i] = 0.5 * g0[i];
      mw[i] = h.beta1 * m0[i] + (1 - h.beta1) * gw[i];
      vw[i] = h.beta2 * v0[i] + (1 - h.beta2) * gw[i] * gw[i];
      const double mh = mw[i] / (1 - std::pow(h.beta1, step)),
                   vh = vw[i] / (1 - std::pow(h.beta2, step));
      pw[i] = p0[i] - h.lr * (mh / (std::sqrt(vh) + h.eps) + h.weight_decay * p0[i]);
    }
    EXPECT_NEAR(sq, sq_want, tolerance<T>() * sq_want);
    expect_near_all(g, gw, "scale");
    expect_near_all(m, mw, "adamw m");
    expect_near_all(v, vw, "adamw v");
    expect_near_all(p, pw, "adamw p");
  });
}

TYPED_TEST(OpsModel, FillNormalAndHostUpdates) {
  using T = TypeParam;
  int calls = 0;
  real_and_counted([&](bool real) {
    Tensor<T> t({N, D}), bias({D});
    ops::fill_normal(t, 9, 4, 2, 0.5);
    bias.fill(T(1));
    ops::update_on_host<T>(bias, [&](std::vector<T> b) {
      ++calls;
      for (T& x : b) x += T(2);
      return b;
    });
    if (!real) return;
    std::vector<double> want(size_t(N * D));
    for (size_t i = 0; i < want.size(); ++i) want[i] = 0.5 * rng_normal(9, 4, 2 + i);
    expect_near_all(t, want, "fill_normal");
    expect_near_all(bias, std::vector<double>(size_t(D), 3.0), "update_on_host");
  });
  EXPECT_EQ(calls, 1);  // the real run's only
}

// The MoE's permutations: R = N k copies, copy t k + j of token t at
// permuted row row[t k + j]; index[p] the token of permuted row p.
TYPED_TEST(OpsModel, GatherCombineAndItsBackward) {
  using T = TypeParam;
  constexpr std::int64_t k = 2, R = N * k;
  std::vector<std::int64_t> row(static_cast<size_t>(R));
  std::iota(row.begin(), row.end(), 0);
  std::reverse(row.begin(), row.end());  // a permutation
  std::vector<std::int32_t> index(static_cast<size_t>(R));
  for (std::int64_t c = 0; c < R; ++c) index[size_t(row[size_t(c)])] = std::int32_t(c / k);
  std::vector<T> weight(static_cast<size_t>(R)), dweight(static_cast<size_t>(R));
  for (std::int64_t c = 0; c < R; ++c) weight[size_t(c)] = T(0.25 + 0.125 * double(c % 5));
  real_and_counted([&](bool real) {
    Tensor<T> x({N, D}), xp({R, D}), y({R, D}), out({N, D}), sum({N, D}), dout({N, D}), dy({R, D});
    fill(x, 1), fill(y, 2), fill(out, 3), fill(dout, 4);
    const std::vector<double> out0 = real ? values(out) : std::vector<double>();
    ops::gather_rows(ops::mat(xp), ops::mat(x), raw<const std::int32_t>(index, real));
    ops::combine_rows(ops::mat(out), ops::mat(y), raw<const std::int64_t>(row, real),
                      raw<const T>(weight, real), k);
    sum.fill(T(0));
    ops::combine_rows<T>(ops::mat(sum), ops::mat(y), raw<const std::int64_t>(row, real), nullptr,
                         k);
    ops::combine_rows_backward(ops::mat(dy), raw<T>(dweight, real), ops::mat(dout), ops::mat(y),
                               raw<const std::int64_t>(row, real), raw<const T>(weight, real), k);
    if (!real) return;
    std::vector<double> xpw(size_t(R * D)), outw = out0, sumw(size_t(N * D)), dyw(size_t(R * D)),
                                            dww(static_cast<size_t>(R));
    for (std::int64_t p = 0; p < R; ++p)
      for (std::int64_t d = 0; d < D; ++d)
        xpw[size_t(p * D + d)] = double(x[std::int64_t(index[size_t(p)]) * D + d]);
    for (std::int64_t c = 0; c < R; ++c) {
      const std::int64_t t = c / k, p = row[size_t(c)];
      for (std::int64_t d = 0; d < D; ++d) {
        outw[size_t(t * D + d)] += double(weight[size_t(c)]) * double(y[p * D + d]);
        sumw[size_t(t * D + d)] += double(y[p * D + d]);
        dyw[size_t(p * D + d)] = double(weight[size_t(c)]) * double(dout[t * D + d]);
        dww[size_t(c)] += double(dout[t * D + d]) * double(y[p * D + d]);
      }
    }
    expect_near_all(xp, xpw, "gather_rows");
    expect_near_all(out, outw, "combine_rows");
    expect_near_all(sum, sumw, "combine_rows unweighted");
    expect_near_all(dy, dyw, "combine_rows_backward dsrc");
    double scale = 0;
    for (double w : dww) scale = std::max(scale, std::abs(w));
    for (size_t c = 0; c < dww.size(); ++c)
      EXPECT_NEAR(double(dweight[c]), dww[c], tolerance<T>() * scale) << "dweight " << c;
  });
}

// The routed experts' linears on a block of rows of a larger tensor, as an
// expert runs its rows [o, o + c) of the permuted order; fp32 and double,
// and (float) under bf16 mixed precision, whose row-sliced scratch a
// count-only run makes too (the same peak).
TYPED_TEST(OpsModel, RoutedLinears) {
  using T = TypeParam;
  constexpr std::int64_t rows = 9, o = 2, c = 6, in = 5, out = 4;
  for (Precision prec : {Precision::fp32, Precision::bf16}) {
    if (prec == Precision::bf16 && !std::is_same_v<T, float>) continue;
    SCOPED_TRACE(prec == Precision::bf16 ? "bf16" : "fp32");
    const UsePrecision at(prec);
    real_and_counted([&](bool real) {
      Tensor<T> x({rows, in}), w({out, in}), y({rows, out}), dy({rows, out}), dx({rows, in}),
          dw({out, in});
      fill(x, 1), fill(w, 2), fill(dy, 3), fill(dw, 4);
      y.fill(T(7)), dx.fill(T(7));
      const std::vector<double> dw0 = real ? values(dw) : std::vector<double>();
      {
        ops::RoutedLinears<T> fwd(4, rows, {{in, out}}, false);  // slices of 4: two here
        fwd.forward(ops::mat(y).row_range(o, c), ops::mat(x).row_range(o, c), w);
      }
      {
        ops::RoutedLinears<T> bwd(4, rows, {{in, out}}, true);
        bwd.backward(ops::mat(dx).row_range(o, c), false, dw, ops::mat(dy).row_range(o, c),
                     ops::mat(x).row_range(o, c), w);
      }
      if (!real) return;
      const auto r = [&](double v) {
        return prec == Precision::bf16 ? to_float(to_bf16(float(v))) : v;
      };
      std::vector<double> yw(size_t(rows * out), 7.0), dxw(size_t(rows * in), 7.0), dww = dw0;
      for (std::int64_t i = o; i < o + c; ++i) {
        for (std::int64_t j = 0; j < out; ++j) {
          double s = 0;
          for (std::int64_t q = 0; q < in; ++q) s += r(x[i * in + q]) * r(w[j * in + q]);
          yw[size_t(i * out + j)] = s;
        }
        for (std::int64_t q = 0; q < in; ++q) {
          double s = 0;
          for (std::int64_t j = 0; j < out; ++j) {
            s += r(dy[i * out + j]) * r(w[j * in + q]);
            dww[size_t(j * in + q)] += r(dy[i * out + j]) * r(x[i * in + q]);
          }
          dxw[size_t(i * in + q)] = s;
        }
      }
      // bf16: exact products of bf16 values summed in fp32, and a fresh
      // output rounded once to bf16 (y, dx): within one bf16 rounding.
      const double tol = prec == Precision::bf16 ? kBf16UnitRoundoff : tolerance<T>();
      for (const auto& [got, want] :
           {std::pair(&y, &yw), std::pair(&dx, &dxw), std::pair(&dw, &dww)}) {
        double scale = 0;
        for (double v : *want) scale = std::max(scale, std::abs(v));
        for (std::int64_t i = 0; i < got->numel(); ++i)
          ASSERT_NEAR(double((*got)[i]), (*want)[size_t(i)], tol * scale) << i;
      }
    });
  }
}

// The op layer's answers to the model: whether an operand is usable here,
// and which of a value and its stand-in runs.
TEST(OpsModel, UsableAndDataDependentAnswerForTheRun) {
  MemoryPool counting;
  counting.set_count_only(true);
  std::optional<Tensor<float>> unbacked;
  {
    PoolScope scope(counting);
    unbacked.emplace(Shape{3});
    EXPECT_TRUE(ops::usable(*unbacked));
    EXPECT_TRUE(ops::usable(nullptr, 3));
    EXPECT_EQ(ops::data_dependent([] { return 1; }, [] { return 2; }), 2);
  }
  Tensor<float> backed({3});
  EXPECT_FALSE(ops::usable(*unbacked));  // made count-only, met by a computing run
  EXPECT_TRUE(ops::usable(backed));
  EXPECT_FALSE(ops::usable(nullptr, 3));
  EXPECT_TRUE(ops::usable(nullptr, 0));
  EXPECT_EQ(ops::data_dependent([] { return 1; }, [] { return 2; }), 1);
  unbacked.reset();  // given back to its own pool
}

}  // namespace
}  // namespace laga
