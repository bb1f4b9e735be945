// Packed sequences (AttnShape::doc_start): several documents in one batch row
// attend causally within their document and not at all across. Checked as
// "packed equals separate": the reference, eager and flash kernels (flash
// once per instruction set) on a packed row equal each document run alone
// (Sq = Sk = its length, no mask) through the reference and concatenated,
// outputs, lse and gradients, over document splits with lengths 1, S - 1,
// many 1-length documents, one document, documents straddling the 64-row
// blocks, multi-head, grouped and latent (Hk = 1, dqk != dv) layouts and
// B > 1 with a different split per row. Also: a mask of one document per row
// is bit for bit no mask; another document's inputs change nothing of this
// one's results; thread-count determinism; Sq != Sk; finite differences of
// every backward in double.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_cases.hpp"
#include "common/check.hpp"
#include "common/threads.hpp"
#include "core/threads.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash.hpp"

namespace laga {
namespace {

using test::IsaScope;
using test::Problem;
using test::Result;
using test::run_eager;
using test::run_flash;
using test::run_reference;
using test::shape;
using Lengths = std::vector<std::vector<std::int64_t>>;  // document lengths, per batch row

// Random document lengths in [1, max_len] summing to S.
std::vector<std::int64_t> random_split(std::int64_t S, std::int64_t max_len, std::uint64_t seed) {
  test::TestRng rng(seed);
  std::vector<std::int64_t> lengths;
  for (std::int64_t left = S; left > 0;) {
    const std::int64_t len =
        std::min(left, 1 + static_cast<std::int64_t>(rng.next_u64() % max_len));
    lengths.push_back(len);
    left -= len;
  }
  return lengths;
}

std::vector<std::int64_t> ones(std::int64_t n) {
  return std::vector<std::int64_t>(static_cast<size_t>(n), 1);
}

std::vector<std::int64_t> join(std::vector<std::int64_t> a, const std::vector<std::int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct PackedCase {
  std::string name;
  AttnShape s;  // Sq = Sk = S, causal
  Lengths docs;
};

// gtest prints a failing parameter with this (else as raw bytes).
void PrintTo(const PackedCase& c, std::ostream* os) {
  *os << c.name;
}

AttnShape square(std::int64_t B, std::int64_t S, std::int64_t Hq, std::int64_t Hk, std::int64_t dqk,
                 std::int64_t dv) {
  return shape(B, S, S, Hq, Hk, dqk, dv, true);
}

// Block boundaries are every 64 virtual rows (tokens x Hq / Hk) and 64 keys;
// the lengths are chosen to start and end documents inside, on and across
// them.
const std::vector<PackedCase> kPackedCases = {
    {"mha_straddling_blocks", square(2, 300, 2, 2, 40, 24), {{50, 100, 64, 86}, {1, 299}}},
    {"mha_one_doc_and_last_one", square(2, 130, 2, 2, 24, 16), {{130}, {129, 1}}},
    {"mha_v3_dims", square(1, 257, 2, 2, 192, 128), {{65, 64, 1, 127}}},
    {"all_ones", square(1, 70, 3, 3, 13, 9), {ones(70)}},
    {"ones_then_long", square(2, 90, 2, 2, 16, 8), {join(ones(20), {70}), join({70}, ones(20))}},
    {"random_b3",
     square(3, 96, 2, 2, 16, 8),
     {random_split(96, 20, 1), random_split(96, 50, 2), random_split(96, 3, 3)}},
    {"latent", square(2, 200, 4, 1, 72, 64), {random_split(200, 60, 4), random_split(200, 9, 5)}},
    {"latent_odd_heads", square(1, 150, 5, 1, 36, 32), {{1, 63, 2, 70, 14}}},
    {"grouped", square(2, 160, 6, 2, 20, 12), {{80, 80}, random_split(160, 40, 6)}},
};

// The packed problem's results computed document by document: each document
// alone (B 1, Sq = Sk = its length, no mask) through the reference, scattered
// back into the packed layout.
template <class T>
Result<T> separately(const Problem<T>& packed, const Lengths& docs) {
  const AttnShape& s = packed.s;
  const std::int64_t S = s.Sk;
  Result<T> r;
  r.o.resize(packed.dout.size()), r.dq.resize(packed.q.size());
  r.dk.resize(packed.k.size()), r.dv.resize(packed.v.size());
  r.lse.resize(static_cast<size_t>(s.B * s.Hq * S));
  // Tokens [t0, t0 + n) of batch row b of a (B, S, width) tensor, from or to
  // a (n, width) one.
  auto rows = [&](std::int64_t b, std::int64_t t0, std::int64_t width) {
    return static_cast<size_t>((b * S + t0) * width);
  };
  for (std::int64_t b = 0; b < s.B; ++b) {
    std::int64_t t0 = 0;
    for (std::int64_t n : docs[static_cast<size_t>(b)]) {
      Problem<T> one(shape(1, n, n, s.Hq, s.Hk, s.dqk, s.dv, true));
      one.s.scale = s.scale;
      auto take = [&](const std::vector<T>& from, std::vector<T>& to, std::int64_t width) {
        std::copy_n(from.begin() + static_cast<std::ptrdiff_t>(rows(b, t0, width)), n * width,
                    to.begin());
      };
      take(packed.q, one.q, s.Hq * s.dqk);
      take(packed.k, one.k, s.Hk * s.dqk);
      take(packed.v, one.v, s.Hk * s.dv);
      take(packed.dout, one.dout, s.Hq * s.dv);
      const Result<T> a = run_reference(one);
      auto put = [&](const std::vector<T>& from, std::vector<T>& to, std::int64_t width) {
        std::copy(from.begin(), from.end(),
                  to.begin() + static_cast<std::ptrdiff_t>(rows(b, t0, width)));
      };
      put(a.o, r.o, s.Hq * s.dv);
      put(a.dq, r.dq, s.Hq * s.dqk);
      put(a.dk, r.dk, s.Hk * s.dqk);
      put(a.dv, r.dv, s.Hk * s.dv);
      for (std::int64_t h = 0; h < s.Hq; ++h)
        std::copy_n(a.lse.begin() + h * n, n, r.lse.begin() + (b * s.Hq + h) * S + t0);
      t0 += n;
    }
  }
  return r;
}

// Per-element tolerances |a - b| <= atol + rtol |b| of a packed kernel against
// the separate reference: the inputs are N(0, 1) with scale 1/sqrt(dqk), so
// scores are O(1) and outputs and gradients O(1) to O(10). Float: 5e-6 + 5e-5
// relative, as the eager tests; the worst element seen used 0.22 of its bound
// (dk of flash and dv of eager, the latent case; largest |diff| 6.7e-6 on a
// dv of 9), orders below a dropped or misplaced key (O(0.1)). Double:
// 1e-14 + 1e-13 relative; the worst seen used 0.21 of it.
template <class T>
test::Tolerance packed_tolerance() {
  return std::is_same_v<T, float> ? test::Tolerance{5e-6, 5e-5} : test::Tolerance{1e-14, 1e-13};
}

// The masked reference against the documents' own reference runs: the same
// sums in the same order, plus exact zeros for the masked keys, so equal but
// for where GCC fuses a * b + c into an FMA (its default -ffp-contract=fast):
// a loop's vectorised body and its scalar remainder fuse differently, and
// which keys fall in the remainder depends on the row's length. Seen: 1 ulp
// in double (2.2e-16 on |o| ~ 0.1), none in float; held to 16 eps.
template <class T>
test::Tolerance rounding_tolerance() {
  const double eps = std::numeric_limits<T>::epsilon();
  return {16 * eps, 16 * eps};
}

template <class T>
::testing::AssertionResult all_close(const char* what, const std::vector<T>& a,
                                     const std::vector<T>& b, test::Tolerance tol) {
  return test::all_close(what, a, b, tol.atol, tol.rtol);
}

// Every output of two runs, bit for bit (memcmp: -0 differs from +0).
template <class T>
::testing::AssertionResult bitwise_equal(const char* what, const std::vector<T>& a,
                                         const std::vector<T>& b) {
  if (a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(T) * a.size()) == 0)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << " differs bitwise";
}

template <class T>
void expect_all_close(const Result<T>& got, const Result<T>& want, bool with_lse,
                      test::Tolerance tol = packed_tolerance<T>()) {
  EXPECT_TRUE(all_close("o", got.o, want.o, tol));
  if (with_lse) {
    EXPECT_TRUE(all_close("lse", got.lse, want.lse, tol));
  }
  EXPECT_TRUE(all_close("dq", got.dq, want.dq, tol));
  EXPECT_TRUE(all_close("dk", got.dk, want.dk, tol));
  EXPECT_TRUE(all_close("dv", got.dv, want.dv, tol));
}

template <class T>
void expect_bitwise_equal(const Result<T>& got, const Result<T>& want, bool with_lse) {
  EXPECT_TRUE(bitwise_equal("o", got.o, want.o));
  if (with_lse) {
    EXPECT_TRUE(bitwise_equal("lse", got.lse, want.lse));
  }
  EXPECT_TRUE(bitwise_equal("dq", got.dq, want.dq));
  EXPECT_TRUE(bitwise_equal("dk", got.dk, want.dk));
  EXPECT_TRUE(bitwise_equal("dv", got.dv, want.dv));
}

template <class T>
Problem<T> packed_problem(const PackedCase& c, std::uint64_t seed) {
  Problem<T> p(c.s, seed);
  p.set_documents(c.docs);
  return p;
}

class PackedVsSeparate : public ::testing::TestWithParam<std::tuple<PackedCase, FlashIsa>> {
 protected:
  const PackedCase& packed_case() const { return std::get<0>(GetParam()); }
  const IsaScope isa_scope_{std::get<1>(GetParam())};
};

TEST_P(PackedVsSeparate, Float) {
  const Problem<float> p = packed_problem<float>(packed_case(), 21);
  const Result<float> want = separately(p, packed_case().docs);
  expect_all_close(run_reference(p), want, true, rounding_tolerance<float>());
  expect_all_close(run_flash(p), want, true);
  expect_all_close(run_eager(p), want, false);
}

INSTANTIATE_TEST_SUITE_P(Cases, PackedVsSeparate,
                         ::testing::Combine(::testing::ValuesIn(kPackedCases),
                                            ::testing::ValuesIn(flash_isas_available())),
                         [](const auto& c) {
                           return std::get<0>(c.param).name + std::string("_") +
                                  to_string(std::get<1>(c.param));
                         });

class PackedVsSeparateDouble : public ::testing::TestWithParam<PackedCase> {};

TEST_P(PackedVsSeparateDouble, Double) {
  const Problem<double> p = packed_problem<double>(GetParam(), 22);
  const Result<double> want = separately(p, GetParam().docs);
  expect_all_close(run_reference(p), want, true, rounding_tolerance<double>());
  expect_all_close(run_flash(p), want, true);
  expect_all_close(run_eager(p), want, false);
}

INSTANTIATE_TEST_SUITE_P(Cases, PackedVsSeparateDouble, ::testing::ValuesIn(kPackedCases),
                         [](const auto& c) { return c.param.name; });

class PackedMask : public ::testing::TestWithParam<FlashIsa> {
 protected:
  const IsaScope isa_scope_{GetParam()};
};

// One document per row (doc_start all 0) is no mask at all, bit for bit, in
// every kernel, also with Sq != Sk and without the causal limit's alignment
// mattering.
TEST_P(PackedMask, OneDocumentPerRowIsBitIdenticalToNoMask) {
  for (const AttnShape& s :
       {shape(2, 130, 130, 2, 2, 40, 24, true), shape(1, 129, 129, 4, 1, 72, 64, true),
        shape(2, 77, 77, 6, 2, 20, 12, true), shape(2, 150, 37, 2, 2, 24, 16, true),
        shape(1, 37, 150, 3, 1, 24, 16, true)}) {
    SCOPED_TRACE(testing::Message() << "Sq " << s.Sq << " Sk " << s.Sk << " Hq " << s.Hq);
    const Problem<float> plain(s, 5);
    Problem<float> one_doc = plain;
    one_doc.set_documents(Lengths(static_cast<size_t>(s.B), {s.Sk}));
    expect_bitwise_equal(run_flash(one_doc), run_flash(plain), true);
    expect_bitwise_equal(run_eager(one_doc), run_eager(plain), false);
    expect_bitwise_equal(run_reference(one_doc), run_reference(plain), true);
  }
}

// Zero across documents: rewriting every input of one document (q, k, v and
// dout of its tokens, finite values) leaves every result of the other
// documents' tokens unchanged, bit for bit, in every kernel.
TEST_P(PackedMask, AnotherDocumentChangesNothing) {
  const AttnShape s = shape(1, 200, 200, 4, 1, 36, 32, true);
  const std::vector<std::int64_t> docs = {70, 65, 65};  // the middle one straddles blocks
  const std::int64_t t0 = 70, t1 = 135;                 // ... and is the one rewritten
  Problem<float> p(s, 9);
  p.set_documents({docs});
  Problem<float> q = p;
  auto rewrite = [&](std::vector<float>& x, std::int64_t width) {
    for (std::int64_t i = t0 * width; i < t1 * width; ++i)
      x[static_cast<size_t>(i)] = 3.0f * x[static_cast<size_t>(i)] + 1.0f;
  };
  rewrite(q.q, s.Hq * s.dqk), rewrite(q.k, s.Hk * s.dqk);
  rewrite(q.v, s.Hk * s.dv), rewrite(q.dout, s.Hq * s.dv);
  auto others_equal = [&](const char* what, const std::vector<float>& a,
                          const std::vector<float>& b, std::int64_t width) {
    for (std::int64_t t = 0; t < s.Sk; ++t) {
      if (t >= t0 && t < t1) continue;
      const size_t at = static_cast<size_t>(t * width);
      if (std::memcmp(a.data() + at, b.data() + at, sizeof(float) * static_cast<size_t>(width)))
        return ::testing::AssertionFailure() << what << " of token " << t << " changed";
    }
    return ::testing::AssertionSuccess();
  };
  using Kernel = Result<float> (*)(const Problem<float>&);
  for (const auto& [name, run] : {std::pair<const char*, Kernel>{"flash", &run_flash<float>},
                                  {"eager", &run_eager<float>},
                                  {"reference", &run_reference<float>}}) {
    SCOPED_TRACE(name);
    const Result<float> a = run(p), b = run(q);
    EXPECT_TRUE(others_equal("o", a.o, b.o, s.Hq * s.dv));
    EXPECT_TRUE(others_equal("dq", a.dq, b.dq, s.Hq * s.dqk));
    EXPECT_TRUE(others_equal("dk", a.dk, b.dk, s.Hk * s.dqk));
    EXPECT_TRUE(others_equal("dv", a.dv, b.dv, s.Hk * s.dv));
    EXPECT_NE(a.o, b.o) << "the rewritten document's own output must change";
  }
}

// Queries that are a suffix of the keys (Sq < Sk: query row i is token
// i + Sk - Sq) and more queries than keys (Sq > Sk: the first Sq - Sk rows see
// nothing): flash and eager against the reference, with documents.
TEST_P(PackedMask, QueriesOffsetFromKeysAgainstReference) {
  struct Offset {
    AttnShape s;
    Lengths docs;
  };
  for (const Offset& c : {Offset{shape(2, 90, 160, 2, 2, 24, 16, true), {{100, 1, 59}, {30, 130}}},
                          Offset{shape(1, 70, 150, 4, 1, 36, 32, true), {{64, 64, 22}}},
                          Offset{shape(1, 150, 37, 2, 2, 24, 16, true), {{10, 27}}}}) {
    SCOPED_TRACE(testing::Message() << "Sq " << c.s.Sq << " Sk " << c.s.Sk);
    Problem<float> p(c.s, 13);
    p.set_documents(c.docs);
    const Result<float> want = run_reference(p);
    expect_all_close(run_flash(p), want, true);
    expect_all_close(run_eager(p), want, false);
  }
}

// The backward's schedules (one head per thread; key blocks and query blocks
// in parallel when there are fewer heads than threads) skip the same masked
// blocks and sum in the same order: bitwise equal for 1, 2 and 3 threads.
TEST_P(PackedMask, BitwiseIndependentOfThreadCount) {
  struct Threaded {
    AttnShape s;
    Lengths docs;
  };
  for (const Threaded& c :
       {Threaded{shape(1, 200, 200, 1, 1, 24, 16, true), {{70, 1, 129}}},
        Threaded{shape(1, 100, 100, 4, 1, 36, 32, true), {{30, 40, 30}}},
        Threaded{shape(3, 90, 90, 2, 2, 16, 16, true), {{90}, ones(90), {45, 45}}}}) {
    Problem<float> p(c.s);
    p.set_documents(c.docs);
    std::vector<Result<float>> runs;
    for (int t : {1, 2, 3}) {
      set_rank_threads(t);
      runs.push_back(run_flash(p));
    }
    set_rank_threads(2);
    for (size_t i = 1; i < runs.size(); ++i) expect_bitwise_equal(runs[i], runs[0], true);
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, PackedMask, ::testing::ValuesIn(flash_isas_available()),
                         [](const auto& c) { return std::string(to_string(c.param)); });

// Central differences in double of L = <dout, attention(q, k, v)> against the
// masked reference, eager and flash backward, over documents of length 1
// and more, a shared key/value head with dqk != dv, and a grouped one. Inputs
// O(1), step 1e-5: the central difference is good to ~1e-10 relative; tol
// 1e-6 (GradCheckOptions' default).
TEST(PackedMaskDouble, BackwardsMatchFiniteDifferences) {
  const test::ScopedOmpThreads one_thread(1);  // see common/threads.hpp
  set_rank_threads(1);
  struct Small {
    AttnShape s;
    Lengths docs;
  };
  for (const Small& c : {Small{shape(2, 6, 6, 2, 1, 3, 2, true), {{2, 4}, {1, 1, 3, 1}}},
                         Small{shape(1, 7, 7, 2, 2, 4, 3, true), {{3, 1, 3}}},
                         Small{shape(1, 5, 5, 4, 2, 3, 3, true), {{1, 4}}}}) {
    for (const char* kernel : {"reference", "eager", "flash"}) {
      SCOPED_TRACE(kernel);
      Problem<double> p(c.s, 17);
      p.set_documents(c.docs);
      const std::string k = kernel;
      auto run = [&] {
        return k == "flash" ? run_flash(p) : k == "eager" ? run_eager(p) : run_reference(p);
      };
      const Result<double> g = run();
      test::GradientCheck gc;
      const AttnShape& s = p.s;
      gc.add("q", p.q.data(), g.dq.data(), {s.B, s.Sq, s.Hq, s.dqk})
          .add("k", p.k.data(), g.dk.data(), {s.B, s.Sk, s.Hk, s.dqk})
          .add("v", p.v.data(), g.dv.data(), {s.B, s.Sk, s.Hk, s.dv});
      EXPECT_TRUE(gc.run([&] {
        const Result<double> r = run();
        return test::dot(p.dout.data(), r.o.data(), static_cast<std::int64_t>(r.o.size()));
      }));
    }
  }
  set_rank_threads(2);
}

}  // namespace
}  // namespace laga
