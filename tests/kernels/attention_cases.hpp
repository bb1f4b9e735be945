// Attention test problems shared by the kernels' attention tests
// (test_attention_flash.cpp, test_attention_packed.cpp): inputs, one call of
// each kernel forward and backward, a comparison, the ISA scope.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash.hpp"

namespace laga::test {

// doc_start (B, S) of documents given by their lengths, row by row: each
// row's lengths sum to S (AttnShape::doc_start).
inline std::vector<std::int64_t> doc_start_of(const std::vector<std::vector<std::int64_t>>& lengths,
                                              std::int64_t S) {
  std::vector<std::int64_t> ds;
  for (const std::vector<std::int64_t>& row : lengths) {
    std::int64_t start = 0;
    for (std::int64_t len : row) {
      for (std::int64_t t = 0; t < len; ++t) ds.push_back(start);
      start += len;
    }
    EXPECT_EQ(start, S) << "document lengths of a row must sum to S";
  }
  return ds;
}

// Inputs of one attention call. With documents, s.doc_start points into
// storage that copies of the problem share (it is never written).
template <class T>
struct Problem {
  AttnShape s;
  std::vector<T> q, k, v, dout;
  std::shared_ptr<const std::vector<std::int64_t>> doc_start;  // (B, Sk) or null
  // Packs s.B rows of documents of the given lengths (one list per row).
  void set_documents(const std::vector<std::vector<std::int64_t>>& lengths) {
    doc_start = std::make_shared<const std::vector<std::int64_t>>(doc_start_of(lengths, s.Sk));
    s.doc_start = doc_start->data();
  }
  explicit Problem(const AttnShape& shape, std::uint64_t seed = 7) : s(shape) {
    q.resize(static_cast<size_t>(s.B * s.Sq * s.Hq * s.dqk));
    k.resize(static_cast<size_t>(s.B * s.Sk * s.Hk * s.dqk));
    v.resize(static_cast<size_t>(s.B * s.Sk * s.Hk * s.dv));
    dout.resize(static_cast<size_t>(s.B * s.Sq * s.Hq * s.dv));
    // Unit-variance q and k with scale 1/sqrt(dqk): scores of order 1, so the
    // softmax is neither flat nor one-hot.
    fill_normal(q.data(), static_cast<std::int64_t>(q.size()), seed, 0, 0, 1.0);
    fill_normal(k.data(), static_cast<std::int64_t>(k.size()), seed, 1, 0, 1.0);
    fill_normal(v.data(), static_cast<std::int64_t>(v.size()), seed, 2, 0, 1.0);
    fill_normal(dout.data(), static_cast<std::int64_t>(dout.size()), seed, 3, 0, 1.0);
  }
};

template <class T>
struct Result {
  std::vector<T> o, lse, dq, dk, dv;
};

template <class T>
Result<T> run_flash(const Problem<T>& p) {
  const AttnShape& s = p.s;
  Result<T> r;
  r.o.assign(p.dout.size(), T(-7));  // garbage: every element must be written
  r.lse.assign(static_cast<size_t>(s.B * s.Hq * s.Sq), T(-7));
  r.dq.assign(p.q.size(), T(-7));
  r.dk.assign(p.k.size(), T(-7));
  r.dv.assign(p.v.size(), T(-7));
  attention_flash_forward<T>(s, r.o.data(), r.lse.data(), p.q.data(), p.k.data(), p.v.data());
  attention_flash_backward<T>(s, r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(), p.q.data(),
                              p.k.data(), p.v.data(), r.o.data(), r.lse.data());
  return r;
}

template <class T>
Result<T> run_reference(const Problem<T>& p) {
  const AttnShape& s = p.s;
  Result<T> r;
  r.o.resize(p.dout.size());
  r.lse.resize(static_cast<size_t>(s.B * s.Hq * s.Sq));
  r.dq.resize(p.q.size());
  r.dk.resize(p.k.size());
  r.dv.resize(p.v.size());
  attention_reference_forward<T>(s, r.o.data(), r.lse.data(), p.q.data(), p.k.data(), p.v.data());
  attention_reference_backward<T>(s, r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(),
                                  p.q.data(), p.k.data(), p.v.data());
  return r;
}

template <class T>
Result<T> run_eager(const Problem<T>& p) {
  const AttnShape& s = p.s;
  Result<T> r;
  r.o.resize(p.dout.size());
  r.dq.resize(p.q.size());
  r.dk.resize(p.k.size());
  r.dv.resize(p.v.size());
  std::vector<T> probs(static_cast<size_t>(s.B * s.Hq * s.Sq * s.Sk));
  std::vector<T> dp(static_cast<size_t>(s.Sq * s.Sk));
  attention_eager_forward<T>(s, r.o.data(), probs.data(), p.q.data(), p.k.data(), p.v.data());
  attention_eager_backward<T>(s, r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(), p.q.data(),
                              p.k.data(), p.v.data(), probs.data(), dp.data());
  return r;
}

// max|a - b| <= rel * max|b|, and every element of a finite. A reference that
// is exactly zero (dq, dk with a single visible key: ds = p (dp - D) = 0
// analytically, rounding only in practice) is held to max|a| <= rel, the
// inputs being of unit scale.
template <class T>
::testing::AssertionResult close(const std::vector<T>& a, const std::vector<T>& b, double rel,
                                 const std::string& what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": size differs";
  double diff = 0, ref = 0;
  size_t worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(static_cast<double>(a[i])))
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << a[i];
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (d > diff) diff = d, worst = i;
    ref = std::max(ref, std::abs(static_cast<double>(b[i])));
  }
  if (diff <= rel * (ref > 0 ? ref : 1.0)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": max|diff| " << diff << " at " << worst << " (" << a[worst] << " vs "
         << b[worst] << ") > " << rel << " * max|ref| " << ref;
}

inline AttnShape shape(std::int64_t B, std::int64_t Sq, std::int64_t Sk, std::int64_t Hq,
                       std::int64_t Hk, std::int64_t dqk, std::int64_t dv, bool causal) {
  AttnShape s;
  s.B = B, s.Sq = Sq, s.Sk = Sk, s.Hq = Hq, s.Hk = Hk, s.dqk = dqk, s.dv = dv, s.causal = causal;
  s.scale = 1.0 / std::sqrt(static_cast<double>(dqk));
  return s;
}

// Selects the float kernels of one instruction set for its lifetime.
class IsaScope {
 public:
  explicit IsaScope(FlashIsa isa) : previous_(set_flash_isa(isa)) {}
  ~IsaScope() { set_flash_isa(previous_); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;

 private:
  FlashIsa previous_;
};

}  // namespace laga::test
