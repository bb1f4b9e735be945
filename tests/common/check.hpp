// Test utilities shared by every layer's tests (header only).
//
//   TestRng / random_vector / fill_random  deterministic data, independent of
//                                          laga's own RNG (which is under test)
//   max_abs_diff / max_rel_error / diff_stats
//   all_close / all_equal / all_finite     gtest predicates whose failure
//                                          message names the worst element
//   dot                                    sum(a * b) in double: the projection
//                                          loss L = <G, y> of backward checks
//   GradientCheck / check_gradient         central finite differences in double
//
// Usage of the gradient checker for a whole block, with every parameter and
// input held in double buffers the loss function reads:
//
//   laga::test::GradientCheck gc;
//   gc.add("x", x.data(), dx.data(), {B, S, D})       // shape: for messages
//     .add("wq.weight", wq.data(), dwq.data(), {H * (dn + dr), D});
//   laga::test::GradCheckOptions opt;
//   opt.max_elements = 64;                            // sample big tensors
//   EXPECT_TRUE(gc.run([&] { return forward_loss(); }, opt));
//
// run() perturbs each checked element in place by +h and -h, calls the loss,
// restores the element bit for bit, and compares
//   numeric  = (L(x + h) - L(x - h)) / 2h,  h = step * max(1, |x|)
//   rel err  = |analytic - numeric| / max(|analytic|, |numeric|, floor)
// against tol. floor keeps gradients that are ~0 from dividing FD noise by ~0;
// by default it is floor_fraction x the largest |numeric| of the whole check.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numbers>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace laga::test {

// ---------------------------------------------------------------- test data

// SplitMix64: tiny, portable, same numbers on every platform and compiler (the
// <random> distributions are not), and independent of src/core/rng.
class TestRng {
 public:
  explicit TestRng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next_u64() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Standard normal (Box-Muller; 1 - u is in (0, 1]).
  double normal() {
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::uint64_t state_;
};

template <class T>
void fill_random(T* p, std::int64_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  TestRng rng(seed);
  for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(rng.uniform(lo, hi));
}

template <class T>
std::vector<T> random_vector(std::int64_t n, std::uint64_t seed, double lo = -1.0,
                             double hi = 1.0) {
  std::vector<T> v(static_cast<std::size_t>(n));
  fill_random(v.data(), n, seed, lo, hi);
  return v;
}

template <class To, class From>
std::vector<To> convert(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

// sum_i a[i] * b[i], accumulated in double.
template <class A, class B>
double dot(const A* a, const B* b, std::int64_t n) {
  double s = 0.0;
  for (std::int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return s;
}

// ------------------------------------------------------------- comparisons

struct DiffStats {
  double max_abs = 0.0;  // max |actual - expected|
  std::int64_t abs_index = -1;
  double max_rel = 0.0;  // max |actual - expected| / max(|actual|, |expected|, floor)
  std::int64_t rel_index = -1;
  std::int64_t nonfinite = 0;  // elements where either side is NaN or Inf
  std::int64_t first_nonfinite = -1;
};

template <class A, class E>
DiffStats diff_stats(const A* actual, const E* expected, std::int64_t n, double rel_floor = 0.0) {
  DiffStats d;
  for (std::int64_t i = 0; i < n; ++i) {
    const double a = static_cast<double>(actual[i]), e = static_cast<double>(expected[i]);
    if (!std::isfinite(a) || !std::isfinite(e)) {
      if (d.nonfinite++ == 0) d.first_nonfinite = i;
      continue;
    }
    const double diff = std::abs(a - e);
    if (diff > d.max_abs || d.abs_index < 0) {
      d.max_abs = diff;
      d.abs_index = i;
    }
    const double den = std::max({std::abs(a), std::abs(e), rel_floor});
    const double rel = den > 0.0 ? diff / den : 0.0;
    if (rel > d.max_rel || d.rel_index < 0) {
      d.max_rel = rel;
      d.rel_index = i;
    }
  }
  return d;
}

// Max |actual - expected|; +inf when any element is not finite on either side.
template <class A, class E>
double max_abs_diff(const A* actual, const E* expected, std::int64_t n) {
  const DiffStats d = diff_stats(actual, expected, n);
  return d.nonfinite ? std::numeric_limits<double>::infinity() : d.max_abs;
}

// Max |a - e| / max(|a|, |e|, floor); +inf when any element is not finite.
template <class A, class E>
double max_rel_error(const A* actual, const E* expected, std::int64_t n, double floor = 0.0) {
  const DiffStats d = diff_stats(actual, expected, n, floor);
  return d.nonfinite ? std::numeric_limits<double>::infinity() : d.max_rel;
}

namespace detail {
inline std::string fmt(double x) {
  std::ostringstream os;
  os.precision(17);
  os << x;
  return os.str();
}
}  // namespace detail

// Passes iff every element is finite on both sides and
//   |actual[i] - expected[i]| <= atol + rtol * |expected[i]|.
// The failure names the buffer, how many elements fail, the first failing one
// and the worst one, with both values.
template <class A, class E>
::testing::AssertionResult all_close(std::string_view what, const A* actual, const E* expected,
                                     std::int64_t n, double atol, double rtol) {
  std::int64_t bad = 0, first = -1, worst = -1;
  double worst_excess = -1.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double a = static_cast<double>(actual[i]), e = static_cast<double>(expected[i]);
    const double bound = atol + rtol * std::abs(e);
    const bool finite = std::isfinite(a) && std::isfinite(e);
    const double diff = std::abs(a - e);
    if (finite && diff <= bound) continue;
    if (bad++ == 0) first = i;
    const double excess = finite ? diff / std::max(bound, 1e-300) : INFINITY;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  auto at = [&](std::int64_t i) {
    return std::string(what) + "[" + std::to_string(i) + "]: actual " +
           detail::fmt(static_cast<double>(actual[i])) + ", expected " +
           detail::fmt(static_cast<double>(expected[i])) + ", |diff| " +
           detail::fmt(std::abs(static_cast<double>(actual[i]) - static_cast<double>(expected[i])));
  };
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << n << " elements differ by more than atol " << atol
         << " + rtol " << rtol << " * |expected| (or are NaN/Inf); first " << at(first)
         << "; worst " << at(worst);
}

template <class A, class E>
::testing::AssertionResult all_close(std::string_view what, const std::vector<A>& actual,
                                     const std::vector<E>& expected, double atol, double rtol) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure() << what << ": sizes differ, actual " << actual.size()
                                         << " vs expected " << expected.size();
  return all_close(what, actual.data(), expected.data(), static_cast<std::int64_t>(actual.size()),
                   atol, rtol);
}

// The stated tolerance of the whole MLA block (four GEMMs, two RMSNorms, RoPE
// and a softmax, forward and backward) computed in T against an exact
// (float64) reference, on the suite's O(1) data (weights ~ N(0, 1/fan_in),
// inputs ~ U(-1, 1) or N(0, 1); gradients up to ~30): every element must
// satisfy
//   |actual - expected| <= atol + rtol * |expected|.
// rtol bounds each element relative to its own size; atol covers elements
// that are small only by cancellation, whose error is set by the size of the
// terms summed, not by the result. Both are about twice the worst seen over
// the suite's cases (mla_test_torch_reference for float: a gradient element
// needing 8.2e-6 with rtol 3e-6; mla_test_naive_mla for double), so a real
// change shows up at once: a softmax scale off by 1e-4 moves outputs by
// ~1e-5 relative. For float this is tighter, element by element, than the
// former 1e-5 * max |ref| for every tensor whose max |ref| exceeds 2.3 (all
// of the PyTorch cases': the smallest is 2.6).
struct Tolerance {
  double atol, rtol;
};
template <class T>
constexpr Tolerance block_tolerance();
template <>
constexpr Tolerance block_tolerance<float>() {
  return {1.6e-5, 3e-6};
}
template <>
constexpr Tolerance block_tolerance<double>() {
  return {1e-14, 3e-13};
}

template <class A, class E>
::testing::AssertionResult all_close(std::string_view what, const A* actual, const E* expected,
                                     std::int64_t n, Tolerance tol) {
  return all_close(what, actual, expected, n, tol.atol, tol.rtol);
}

// Exact equality (==, so +0 == -0 and NaN never equals): for results that must
// be bit-identical, e.g. laga vs explicit at P = 1.
template <class A, class E>
::testing::AssertionResult all_equal(std::string_view what, const A* actual, const E* expected,
                                     std::int64_t n) {
  std::int64_t bad = 0, first = -1;
  for (std::int64_t i = 0; i < n; ++i)
    if (!(static_cast<double>(actual[i]) == static_cast<double>(expected[i])))
      if (bad++ == 0) first = i;
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << n << " elements are not exactly equal; first " << what
         << "[" << first << "]: actual " << detail::fmt(static_cast<double>(actual[first]))
         << ", expected " << detail::fmt(static_cast<double>(expected[first]));
}

template <class T>
::testing::AssertionResult all_finite(std::string_view what, const T* p, std::int64_t n) {
  std::int64_t bad = 0, first = -1;
  for (std::int64_t i = 0; i < n; ++i)
    if (!std::isfinite(static_cast<double>(p[i])))
      if (bad++ == 0) first = i;
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << n << " elements are NaN or Inf; first " << what << "["
         << first << "] = " << static_cast<double>(p[first]);
}

// ------------------------------------------------------- finite differences

struct GradCheckOptions {
  // Central-difference step h = step * max(1, |x|). 1e-5 balances truncation
  // (~h^2 |L'''| / 6 ~ 1e-10) against cancellation (~eps |L| / h ~ 1e-11 |L|)
  // in double.
  double step = 1e-5;
  // Bound on the relative error of every checked element.
  double tol = 1e-6;
  // Denominator floor: floor if >= 0, else floor_fraction * the largest
  // |numeric gradient| over everything checked (at least 1e-12).
  double floor = -1.0;
  double floor_fraction = 1e-3;
  // With floor < 0: the largest |numeric gradient| is taken per tensor added
  // rather than over the whole check, so a tensor whose gradients are all
  // small (a norm gain, a rope-only path) is still checked relative to its
  // own size, not hidden under the floor of the largest one.
  bool floor_per_tensor = false;
  // Elements checked per tensor: all when 0, else this many spread evenly
  // over the tensor, first and last included (for big whole-block checks).
  std::int64_t max_elements = 0;
  // Failing elements listed in the message (all are counted).
  int max_reported = 8;
};

class GradientCheck {
 public:
  // `values` is the storage the loss reads (perturbed in place, restored);
  // `analytic` holds dloss/dvalues, same length. The tensor's shape, if
  // given, turns element indices in messages into (i, j, ...) coordinates.
  GradientCheck& add(std::string name, double* values, const double* analytic, std::int64_t n) {
    entries_.push_back({std::move(name), values, analytic, n, {}});
    return *this;
  }
  GradientCheck& add(std::string name, double* values, const double* analytic,
                     std::vector<std::int64_t> shape) {
    std::int64_t n = 1;
    for (std::int64_t e : shape) n *= e;
    entries_.push_back({std::move(name), values, analytic, n, std::move(shape)});
    return *this;
  }

  // Runs the check. `loss` is called with no arguments and must recompute the
  // scalar loss from the registered buffers without modifying them.
  ::testing::AssertionResult run(const std::function<double()>& loss,
                                 const GradCheckOptions& opt = {}) {
    struct Point {
      std::size_t entry;
      std::int64_t index;
      double analytic, numeric;
    };
    std::vector<Point> pts;
    for (std::size_t e = 0; e < entries_.size(); ++e) {
      Entry& t = entries_[e];
      for (std::int64_t i : selected(t.n, opt.max_elements)) {
        double& x = t.values[i];
        const double saved = x;
        const double h = opt.step * std::max(1.0, std::abs(saved));
        x = saved + h;
        const double lp = loss();
        x = saved - h;
        const double lm = loss();
        x = saved;
        // (x + h) - (x - h) is not exactly 2h in floating point: divide by
        // the step actually taken.
        const double taken = (saved + h) - (saved - h);
        pts.push_back({e, i, t.analytic[i], (lp - lm) / taken});
      }
    }
    std::vector<double> max_numeric(entries_.size() + 1, 0.0);  // per entry, then overall
    for (const Point& p : pts) {
      max_numeric[p.entry] = std::max(max_numeric[p.entry], std::abs(p.numeric));
      max_numeric.back() = std::max(max_numeric.back(), std::abs(p.numeric));
    }
    auto floor_of = [&](std::size_t entry) {
      if (opt.floor >= 0.0) return opt.floor;
      const double scale = opt.floor_per_tensor ? max_numeric[entry] : max_numeric.back();
      return std::max(1e-12, opt.floor_fraction * scale);
    };
    const double floor = floor_of(entries_.size());
    std::int64_t bad = 0;
    double worst = 0.0;
    std::ostringstream msg;
    for (const Point& p : pts) {
      const double diff = std::abs(p.analytic - p.numeric);
      const double den = std::max({std::abs(p.analytic), std::abs(p.numeric), floor_of(p.entry)});
      const double rel = diff / den;
      const bool ok = std::isfinite(p.analytic) && std::isfinite(p.numeric) && rel <= opt.tol;
      worst = std::max(worst, std::isfinite(rel) ? rel : INFINITY);
      if (ok) continue;
      if (bad++ < opt.max_reported)
        msg << "\n  d loss / d " << element_name(entries_[p.entry], p.index) << ": analytic "
            << detail::fmt(p.analytic) << ", numeric " << detail::fmt(p.numeric) << ", rel err "
            << rel;
    }
    last_max_rel_error_ = worst;
    last_checked_ = static_cast<std::int64_t>(pts.size());
    if (bad == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "gradient check: " << bad << " of " << pts.size()
           << " checked elements have relative error > tol " << opt.tol << " (denominator floor "
           << (opt.floor_per_tensor && opt.floor < 0 ? "per tensor, overall " : "") << floor
           << ", step " << opt.step << " * max(1, |x|)); worst " << worst << msg.str()
           << (bad > opt.max_reported ? "\n  ..." : "");
  }

  // From the last run(): the largest relative error, and the elements checked.
  double last_max_rel_error() const { return last_max_rel_error_; }
  std::int64_t last_checked() const { return last_checked_; }

 private:
  struct Entry {
    std::string name;
    double* values;
    const double* analytic;
    std::int64_t n;
    std::vector<std::int64_t> shape;
  };

  static std::vector<std::int64_t> selected(std::int64_t n, std::int64_t max_elements) {
    std::vector<std::int64_t> idx;
    if (max_elements <= 0 || n <= max_elements) {
      for (std::int64_t i = 0; i < n; ++i) idx.push_back(i);
    } else if (max_elements == 1) {
      idx.push_back(0);
    } else {
      for (std::int64_t k = 0; k < max_elements; ++k) {
        const std::int64_t i = k * (n - 1) / (max_elements - 1);
        if (idx.empty() || idx.back() != i) idx.push_back(i);
      }
    }
    return idx;
  }

  static std::string element_name(const Entry& t, std::int64_t i) {
    std::string s = t.name + "[" + std::to_string(i) + "]";
    if (t.shape.size() > 1) {
      std::vector<std::int64_t> coord(t.shape.size());
      std::int64_t rest = i;
      for (std::size_t d = t.shape.size(); d-- > 0;) {
        coord[d] = t.shape[d] > 0 ? rest % t.shape[d] : 0;
        rest = t.shape[d] > 0 ? rest / t.shape[d] : 0;
      }
      s += " = " + t.name + "(";
      for (std::size_t d = 0; d < coord.size(); ++d)
        s += (d ? ", " : "") + std::to_string(coord[d]);
      s += ")";
    }
    return s;
  }

  std::vector<Entry> entries_;
  double last_max_rel_error_ = 0.0;
  std::int64_t last_checked_ = 0;
};

// One-vector convenience: checks `analytic` against the gradient of
// loss(x) at x (x is copied; the loss receives the perturbed copy).
inline ::testing::AssertionResult check_gradient(
    std::string name, const std::function<double(const std::vector<double>&)>& loss,
    std::vector<double> x, const std::vector<double>& analytic, const GradCheckOptions& opt = {}) {
  if (x.size() != analytic.size())
    return ::testing::AssertionFailure()
           << "check_gradient(" << name << "): " << x.size() << " parameters but "
           << analytic.size() << " analytic gradient entries";
  GradientCheck gc;
  gc.add(std::move(name), x.data(), analytic.data(), static_cast<std::int64_t>(x.size()));
  return gc.run([&] { return loss(x); }, opt);
}

}  // namespace laga::test
