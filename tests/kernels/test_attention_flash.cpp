// Flash attention against the naive reference and the eager kernel: outputs,
// lse and gradients, odd sizes, every masking corner, multi-head, grouped and
// latent (one shared key/value head) layouts; determinism across thread
// counts; a finite-difference check of the backward in double. Every float
// test runs once per instruction set this build and CPU have (double runs one
// scalar code whatever the choice); the choice itself and LAGA_FLASH_ISA's
// errors are tested at the end.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "attention_cases.hpp"
#include "common/error_of.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/threads.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash.hpp"

namespace laga {
namespace {

using test::close;
using test::IsaScope;
using test::Problem;
using test::Result;
using test::run_eager;
using test::run_flash;
using test::run_reference;
using test::shape;

struct Case {
  const char* name;
  AttnShape s;
};

// Sizes are deliberately not multiples of any block (64) or vector width.
const Case kCases[] = {
    {"one_token", shape(1, 1, 1, 2, 2, 8, 8, true)},
    {"seven_odd_dims", shape(1, 7, 7, 3, 3, 5, 3, true)},
    {"seven_noncausal", shape(2, 7, 7, 2, 2, 13, 9, false)},
    {"v3_dims_377_causal", shape(1, 377, 377, 2, 2, 192, 128, true)},
    {"v3_dims_377_noncausal", shape(1, 377, 377, 1, 1, 192, 128, false)},
    {"batch2_130", shape(2, 130, 130, 2, 2, 40, 24, true)},
    {"more_queries_than_keys", shape(2, 150, 37, 2, 2, 24, 16, true)},  // 113 rows fully masked
    {"more_keys_than_queries", shape(2, 37, 150, 2, 2, 24, 16, true)},
    {"more_queries_noncausal", shape(1, 150, 37, 2, 2, 24, 16, false)},
    {"latent_causal", shape(2, 129, 129, 4, 1, 72, 64, true)},  // V3's 576/512 in small
    {"latent_sq_gt_sk", shape(1, 70, 33, 5, 1, 36, 32, true)},
    {"latent_noncausal", shape(1, 65, 90, 3, 1, 36, 32, false)},
    {"grouped_heads", shape(2, 77, 77, 6, 2, 20, 12, true)},  // g = 3: rows not equally spaced
};

class FlashVsReference : public ::testing::TestWithParam<std::tuple<Case, FlashIsa>> {
 protected:
  const AttnShape& shape_under_test() const { return std::get<0>(GetParam()).s; }
  FlashIsa isa() const { return std::get<1>(GetParam()); }
  const IsaScope isa_scope_{isa()};
};

TEST_P(FlashVsReference, Float) {
  ASSERT_EQ(flash_isa(), isa());
  const Problem<float> p(shape_under_test());
  const Result<float> f = run_flash(p), r = run_reference(p);
  const double tol = 1e-5;
  EXPECT_TRUE(close(f.o, r.o, tol, "o"));
  EXPECT_TRUE(close(f.lse, r.lse, tol, "lse"));
  EXPECT_TRUE(close(f.dq, r.dq, tol, "dq"));
  EXPECT_TRUE(close(f.dk, r.dk, tol, "dk"));
  EXPECT_TRUE(close(f.dv, r.dv, tol, "dv"));
}

TEST_P(FlashVsReference, FloatVsEager) {
  ASSERT_EQ(flash_isa(), isa());
  const Problem<float> p(shape_under_test(), 11);
  const Result<float> f = run_flash(p), e = run_eager(p);
  const double tol = 1e-5;
  EXPECT_TRUE(close(f.o, e.o, tol, "o"));
  EXPECT_TRUE(close(f.dq, e.dq, tol, "dq"));
  EXPECT_TRUE(close(f.dk, e.dk, tol, "dk"));
  EXPECT_TRUE(close(f.dv, e.dv, tol, "dv"));
}

INSTANTIATE_TEST_SUITE_P(Shapes, FlashVsReference,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::ValuesIn(flash_isas_available())),
                         [](const auto& c) {
                           return std::get<0>(c.param).name + std::string("_") +
                                  to_string(std::get<1>(c.param));
                         });

class FlashVsReferenceDouble : public ::testing::TestWithParam<Case> {};

TEST_P(FlashVsReferenceDouble, Double) {
  const Problem<double> p(GetParam().s, 3);
  const Result<double> f = run_flash(p), r = run_reference(p);
  const double tol = 1e-12;
  EXPECT_TRUE(close(f.o, r.o, tol, "o"));
  EXPECT_TRUE(close(f.lse, r.lse, tol, "lse"));
  EXPECT_TRUE(close(f.dq, r.dq, tol, "dq"));
  EXPECT_TRUE(close(f.dk, r.dk, tol, "dk"));
  EXPECT_TRUE(close(f.dv, r.dv, tol, "dv"));
}

INSTANTIATE_TEST_SUITE_P(Shapes, FlashVsReferenceDouble, ::testing::ValuesIn(kCases),
                         [](const auto& c) { return std::string(c.param.name); });

class FlashAttention : public ::testing::TestWithParam<FlashIsa> {
 protected:
  const IsaScope isa_scope_{GetParam()};
};

// Rows whose every key is masked (causal, Sq > Sk: the first Sq - Sk tokens)
// must come out exactly o = 0, lse = 0, dq = 0, and add nothing to dk, dv.
TEST_P(FlashAttention, FullyMaskedRowsAreExactZeros) {
  for (const AttnShape& s : {shape(1, 9, 4, 2, 2, 5, 3, true), shape(1, 9, 4, 3, 1, 5, 3, true)}) {
    const Problem<float> p(s);
    const Result<float> f = run_flash(p);
    for (std::int64_t i = 0; i < s.Sq - s.Sk; ++i)
      for (std::int64_t h = 0; h < s.Hq; ++h) {
        EXPECT_EQ(f.lse[static_cast<size_t>(h * s.Sq + i)], 0.0f);
        for (std::int64_t c = 0; c < s.dv; ++c)
          EXPECT_EQ(f.o[static_cast<size_t>((i * s.Hq + h) * s.dv + c)], 0.0f);
        for (std::int64_t c = 0; c < s.dqk; ++c)
          EXPECT_EQ(f.dq[static_cast<size_t>((i * s.Hq + h) * s.dqk + c)], 0.0f);
      }
    // Changing the masked rows' dout changes no gradient.
    Problem<float> p2 = p;
    for (std::int64_t i = 0; i < (s.Sq - s.Sk) * s.Hq * s.dv; ++i)
      p2.dout[static_cast<size_t>(i)] = 1e3f;
    const Result<float> f2 = run_flash(p2);
    EXPECT_EQ(f.dk, f2.dk);
    EXPECT_EQ(f.dv, f2.dv);
  }
}

TEST_P(FlashAttention, NoKeysAtAll) {
  const AttnShape s = shape(1, 3, 0, 2, 1, 4, 4, false);
  const Problem<float> p(s);
  const Result<float> f = run_flash(p);
  for (float x : f.o) EXPECT_EQ(x, 0.0f);
  for (float x : f.lse) EXPECT_EQ(x, 0.0f);
  for (float x : f.dq) EXPECT_EQ(x, 0.0f);
}

// The backward's reductions run in a fixed block order whatever the thread
// count or schedule (one (head, row set) per thread, or the two-pass schedule
// when there are fewer of those than threads): results are bitwise equal.
// One head (two row sets): 1 and 2 threads per head, 3 two passes; 4 threads
// per head on the batch of 6 heads (12 units), where row set 1's threads may
// wait for set 0's.
TEST_P(FlashAttention, BitwiseIndependentOfThreadCount) {
  for (const AttnShape& s :
       {shape(1, 200, 200, 1, 1, 24, 16, true), shape(1, 100, 100, 4, 1, 36, 32, true),
        shape(3, 90, 90, 2, 2, 16, 16, true)}) {
    const Problem<float> p(s);
    std::vector<Result<float>> runs;
    for (int t : {1, 2, 3, 4}) {
      set_rank_threads(t);
      runs.push_back(run_flash(p));
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

// A NaN or infinity in the inputs reaches the output exactly as in the eager
// kernel: the same elements of o come out non-finite. (Before, the AVX2 and
// AVX-512 exp2 clamped a NaN score to p = 0 and a row of -inf scores took the
// fully-masked convention o = 0, so one NaN in wq.weight gave a finite out.)
// Also with packed documents, where a poisoned key must reach its own
// document's rows only (eager leaves other documents' scores out of the
// softmax; flash sets them to -inf whatever they were). Poison in v, and
// which elements stay bit for bit the clean run's in every kernel, forward
// and backward: test_attention_nonfinite.cpp.
TEST_P(FlashAttention, NonFiniteInputsPropagateAsInEager) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Poison {
    const char* what;
    void (*apply)(Problem<float>&, float, float);
  };
  const Poison poisons[] = {
      {"one NaN in q", [](Problem<float>& p, float n, float) { p.q[p.q.size() / 2 + 1] = n; }},
      {"+inf in q", [](Problem<float>& p, float, float i) { p.q[p.q.size() / 3] = i; }},
      {"NaN in k", [](Problem<float>& p, float n, float) { p.k[p.k.size() / 2] = n; }},
      {"every q NaN",
       [](Problem<float>& p, float n, float) { std::fill(p.q.begin(), p.q.end(), n); }},
      // Every visible score of a row -inf: q[row][0] = -inf against k[.][0] > 0.
      {"a row of -inf scores",
       [](Problem<float>& p, float, float i) {
         for (std::int64_t j = 0; j < p.s.B * p.s.Sk * p.s.Hk; ++j)
           p.k[static_cast<size_t>(j * p.s.dqk)] = 1.0f;
         p.q[static_cast<size_t>((p.s.Sq / 2) * p.s.Hq * p.s.dqk)] = -i;
       }},
  };
  struct Poisoned {
    AttnShape s;
    std::vector<std::vector<std::int64_t>> docs;  // document lengths per row; none: no mask
  };
  for (const auto& [s, docs] : {Poisoned{shape(1, 130, 130, 2, 2, 24, 16, true), {}},
                                Poisoned{shape(1, 70, 70, 4, 1, 36, 32, true), {}},
                                Poisoned{shape(2, 77, 77, 6, 2, 20, 12, true), {}},
                                Poisoned{shape(1, 40, 40, 2, 2, 16, 8, false), {}},
                                Poisoned{shape(1, 130, 130, 2, 2, 24, 16, true), {{40, 1, 89}}},
                                Poisoned{shape(1, 70, 70, 4, 1, 36, 32, true), {{35, 35}}},
                                Poisoned{shape(2, 77, 77, 6, 2, 20, 12, true), {{77}, {10, 67}}}}) {
    for (const Poison& poison : poisons) {
      Problem<float> p(s);
      if (!docs.empty()) p.set_documents(docs);
      poison.apply(p, nan, inf);
      const Result<float> f = run_flash(p);
      const Result<float> e = run_eager(p);
      size_t nonfinite = 0, differ = 0;
      for (size_t i = 0; i < e.o.size(); ++i) {
        nonfinite += !std::isfinite(e.o[i]);
        differ += std::isfinite(f.o[i]) != std::isfinite(e.o[i]);
      }
      EXPECT_GT(nonfinite, 0u) << poison.what << ": the poison must reach eager's output";
      EXPECT_EQ(differ, 0u) << poison.what << ", Sq " << s.Sq << " Hq " << s.Hq << " Hk " << s.Hk
                            << (docs.empty() ? "" : " with documents")
                            << ": elements of o finite in one kernel and not the other (of "
                            << nonfinite << " non-finite in eager)";
      // The backward sees it too: some dq is non-finite wherever o is.
      size_t dq_bad = 0;
      for (float x : f.dq) dq_bad += !std::isfinite(x);
      EXPECT_GT(dq_bad, 0u) << poison.what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, FlashAttention, ::testing::ValuesIn(flash_isas_available()),
                         [](const auto& c) { return std::string(to_string(c.param)); });

// Central differences of L = sum(o * dout) in double against the flash
// backward, on a tiny problem with a fully masked row, a shared key head and
// unequal head dims.
TEST(FlashAttentionDouble, FiniteDifference) {
  // Hundreds of tiny forwards: thread wake-ups on a loaded machine would
  // dominate, and the schedules are covered above.
  set_rank_threads(1);
  for (const AttnShape& s : {shape(1, 5, 4, 2, 1, 3, 2, true), shape(2, 3, 4, 2, 2, 4, 3, false)}) {
    Problem<double> p(s, 5);
    const Result<double> f = run_flash(p);
    auto loss = [&](const Problem<double>& x) {
      std::vector<double> o(x.dout.size()), lse(static_cast<size_t>(s.B * s.Hq * s.Sq));
      attention_flash_forward<double>(s, o.data(), lse.data(), x.q.data(), x.k.data(), x.v.data());
      double l = 0;
      for (size_t i = 0; i < o.size(); ++i) l += o[i] * x.dout[i];
      return l;
    };
    const double eps = 1e-6;
    auto check = [&](std::vector<double> Problem<double>::*field, const std::vector<double>& grad,
                     const char* what) {
      std::vector<double> fd(grad.size());
      for (size_t i = 0; i < grad.size(); ++i) {
        Problem<double> x = p;
        const double x0 = (x.*field)[i];
        (x.*field)[i] = x0 + eps;
        const double lp = loss(x);
        (x.*field)[i] = x0 - eps;
        const double lm = loss(x);
        fd[i] = (lp - lm) / (2 * eps);
      }
      EXPECT_TRUE(close(grad, fd, 1e-6, what));
    };
    check(&Problem<double>::q, f.dq, "dq");
    check(&Problem<double>::k, f.dk, "dk");
    check(&Problem<double>::v, f.dv, "dv");
  }
  set_rank_threads(2);
}

using test::error_of;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

bool available(FlashIsa isa) {
  const std::vector<FlashIsa> isas = flash_isas_available();
  return std::find(isas.begin(), isas.end(), isa) != isas.end();
}

// What the AVX-512 kernels need, asked of the CPU here rather than of the
// library or the build, so that a build or a check that loses the AVX-512
// path fails this test instead of silently testing AVX2 alone. A compiler
// that cannot build the AVX-512 copy (docs/build.md: clang) fails it too on an
// AVX-512 CPU, on purpose: the build then tests less than it should.
TEST(FlashIsa, AvailableIsWhatTheCpuHas) {
  const std::vector<FlashIsa> isas = flash_isas_available();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), FlashIsa::avx2);
  __builtin_cpu_init();
  const bool cpu_has_avx512 =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  EXPECT_EQ(available(FlashIsa::avx512), cpu_has_avx512)
      << "this CPU " << (cpu_has_avx512 ? "has" : "lacks")
      << " avx512f/vl/bw/dq, but the library's AVX-512 flash kernels are "
      << (available(FlashIsa::avx512) ? "available" : "missing")
      << " (was LAGA_FLASH_HAVE_AVX512 lost from src/kernels/CMakeLists.txt?)";
}

TEST(FlashIsa, SetReturnsThePreviousAndTakesEffect) {
  const FlashIsa initial = flash_isa();
  for (FlashIsa isa : flash_isas_available()) {
    const FlashIsa before = flash_isa();
    EXPECT_EQ(set_flash_isa(isa), before);
    EXPECT_EQ(flash_isa(), isa);
  }
  set_flash_isa(initial);
  if (!available(FlashIsa::avx512)) {  // a CPU or build without it
    const std::string e = error_of([] { set_flash_isa(FlashIsa::avx512); });
    EXPECT_TRUE(contains(e, "set_flash_isa(avx512)")) << e;
    EXPECT_TRUE(contains(e, "avx512f, avx512vl, avx512bw and avx512dq")) << e;
    EXPECT_EQ(flash_isa(), initial);  // unchanged
  }
}

// LAGA_FLASH_ISA's rule, on every value and on a machine without AVX-512
// (which this one may not be).
TEST(FlashIsa, EnvironmentValues) {
  using detail::resolve_flash_isa;
  const char* no_bw = "this CPU (or its OS) has no avx512bw";
  EXPECT_EQ(resolve_flash_isa(nullptr, nullptr), FlashIsa::avx512);
  EXPECT_EQ(resolve_flash_isa("", nullptr), FlashIsa::avx512);
  EXPECT_EQ(resolve_flash_isa("auto", nullptr), FlashIsa::avx512);
  EXPECT_EQ(resolve_flash_isa(nullptr, no_bw), FlashIsa::avx2);
  EXPECT_EQ(resolve_flash_isa("auto", no_bw), FlashIsa::avx2);
  EXPECT_EQ(resolve_flash_isa("avx2", nullptr), FlashIsa::avx2);
  EXPECT_EQ(resolve_flash_isa("avx2", no_bw), FlashIsa::avx2);
  EXPECT_EQ(resolve_flash_isa("avx512", nullptr), FlashIsa::avx512);

  const std::string missing = error_of([&] { resolve_flash_isa("avx512", no_bw); });
  EXPECT_TRUE(contains(missing, "LAGA_FLASH_ISA=avx512, but " + std::string(no_bw))) << missing;
  EXPECT_TRUE(contains(missing, "set it to avx2 or auto")) << missing;
  for (const char* bad : {"avx3", "AVX512", "avx-512", " avx2"}) {
    const std::string e = error_of([&] { resolve_flash_isa(bad, nullptr); });
    EXPECT_TRUE(contains(e, "LAGA_FLASH_ISA='" + std::string(bad) + "'")) << e;
    EXPECT_TRUE(contains(e, "use avx2, avx512 or auto")) << e;
  }
}

// The variable read by the library itself: ctest runs this test again with
// LAGA_FLASH_ISA set to avx2, avx512, auto and avx3 (tests/kernels/CMakeLists.txt);
// in the plain run, unset, it must behave as auto.
TEST(FlashIsaEnvironment, IsFollowed) {
  const char* env = std::getenv("LAGA_FLASH_ISA");
  const std::string value = env ? env : "auto";
  const Problem<float> p(shape(1, 7, 7, 2, 2, 8, 8, true));
  if (value == "avx2" || (value == "avx512" && available(FlashIsa::avx512))) {
    EXPECT_EQ(to_string(flash_isa()), value);
    EXPECT_TRUE(close(run_flash(p).o, run_reference(p).o, 1e-5, "o"));
  } else if (value == "auto") {
    EXPECT_EQ(flash_isa(), flash_isas_available().back());
  } else {
    // Every call fails, the kernels' first of all, with the value in the text.
    const std::string prefix =
        value == "avx512" ? "LAGA_FLASH_ISA=avx512, but " : "LAGA_FLASH_ISA='" + value + "'";
    const std::string e = error_of([&] { run_flash(p); });
    EXPECT_TRUE(contains(e, prefix)) << e;
    EXPECT_TRUE(contains(error_of([] { flash_isa(); }), prefix));
  }
}

}  // namespace
}  // namespace laga
