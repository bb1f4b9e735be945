// A NaN in one token's q, k or v stays where the math puts it, in every
// attention kernel (eager, flash on each ISA, the reference; float and
// double), forward and backward: a masked pair is left out of every sum,
// never multiplied by its zero probability (kernels/attention.hpp). So every
// element that does not depend on the poisoned token is finite and
// bit-for-bit that of the clean run -- other batch rows, other documents,
// other key/value heads, and (for o, dq) the earlier positions of its own
// document -- and the kernels agree on how many elements are non-finite.
// Before issue 26 eager's dense P V (and D, dq, dk, dv) and flash's masked
// tiles multiplied 0 by the NaN, so it reached other documents and the
// causal past, a tile at a time in flash, and the counts differed.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "attention_cases.hpp"
#include "core/error.hpp"

namespace laga {
namespace {

using test::Problem;
using test::Result;

enum class Operand { q, k, v };
const char* name_of(Operand o) {
  return o == Operand::q ? "q" : o == Operand::k ? "k" : "v";
}

// Token t of batch row b, head h (a query head for q, a key/value head for
// k and v), element c: where the NaN goes.
struct Poison {
  Operand operand;
  std::int64_t b, t, h, c;
};

enum class Tensor { o, dq, dk, dv };

// Whether element (b, token, head) of tensor `which` may depend on the
// poisoned token: false means the math leaves it exactly as in the clean run.
// Conservative (a true may still come out finite).
bool may_depend(const AttnShape& s, const Poison& p, Tensor which, std::int64_t b,
                std::int64_t token, std::int64_t head) {
  if (b != p.b) return false;
  const std::int64_t g = s.Hq / s.Hk;
  // The key/value head involved: the poisoned one, or the poisoned query's.
  const std::int64_t hk = p.operand == Operand::q ? p.h / g : p.h;
  const bool query_side = which == Tensor::o || which == Tensor::dq;
  if ((query_side ? head / g : head) != hk) return false;
  // Token positions: queries and keys share one sequence when Sq == Sk.
  const std::int64_t doc = s.doc_start ? s.doc_start[b * s.Sk + p.t] : 0;
  const std::int64_t doc_of = s.doc_start ? s.doc_start[b * s.Sk + token] : 0;
  if (doc_of != doc) return false;
  if (!query_side) return true;  // a key of its document: some row seeing t may see it
  // o and dq of a query row depend on q of that row alone, and on the keys
  // and values it sees: under the causal mask, not on a later token's.
  if (p.operand == Operand::q) return token == p.t && head == p.h;
  return token >= p.t;
}

template <class T>
void poison(Problem<T>& pr, const Poison& p) {
  const AttnShape& s = pr.s;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  if (p.operand == Operand::q) pr.q[size_t(((p.b * s.Sq + p.t) * s.Hq + p.h) * s.dqk + p.c)] = nan;
  if (p.operand == Operand::k) pr.k[size_t(((p.b * s.Sk + p.t) * s.Hk + p.h) * s.dqk + p.c)] = nan;
  if (p.operand == Operand::v) pr.v[size_t(((p.b * s.Sk + p.t) * s.Hk + p.h) * s.dv + p.c)] = nan;
}

struct Counts {
  size_t o = 0, dq = 0, dk = 0, dv = 0;
  bool operator==(const Counts&) const = default;
};

// Checks the elements that cannot depend on the poison against the clean
// run, bit for bit; returns the non-finite counts.
template <class T>
Counts check(const AttnShape& s, const Poison& p, const Result<T>& bad, const Result<T>& clean,
             const std::string& tag) {
  Counts n;
  auto walk = [&](Tensor which, const std::vector<T>& x, const std::vector<T>& ref, std::int64_t S,
                  std::int64_t H, std::int64_t d, size_t& count) {
    size_t wrong = 0, first = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      count += !std::isfinite(x[i]);
      const std::int64_t e = std::int64_t(i) / d, head = e % H, token = (e / H) % S,
                         b = e / (H * S);
      if (may_depend(s, p, which, b, token, head)) continue;
      // Bit for bit: the same value (NaN never equals, so a leaked NaN fails).
      if (!(x[i] == ref[i]) && wrong++ == 0) first = i;
    }
    const char* names[] = {"o", "dq", "dk", "dv"};
    EXPECT_EQ(wrong, 0u) << tag << ": " << wrong << " elements of " << names[int(which)]
                         << " that do not depend on the poisoned token differ from the clean run"
                         << " (the first at flat index " << first << ": " << x[first] << " vs "
                         << ref[first] << ")";
  };
  walk(Tensor::o, bad.o, clean.o, s.Sq, s.Hq, s.dv, n.o);
  walk(Tensor::dq, bad.dq, clean.dq, s.Sq, s.Hq, s.dqk, n.dq);
  walk(Tensor::dk, bad.dk, clean.dk, s.Sk, s.Hk, s.dqk, n.dk);
  walk(Tensor::dv, bad.dv, clean.dv, s.Sk, s.Hk, s.dv, n.dv);
  EXPECT_GT(n.o, 0u) << tag << ": the poison must reach o";
  return n;
}

struct Case {
  AttnShape s;
  std::vector<std::vector<std::int64_t>> docs;  // lengths per row; empty: causal only
};

// Shapes with a flash tile (64) cut by the causal diagonal and by document
// starts; multi-head, grouped and latent (Hk = 1) heads.
std::vector<Case> cases() {
  using test::shape;
  return {
      {shape(2, 77, 77, 4, 2, 20, 12, true), {}},
      {shape(1, 130, 130, 4, 1, 24, 16, true), {}},
      {shape(2, 77, 77, 4, 2, 20, 12, true), {{30, 47}, {10, 1, 66}}},
      {shape(1, 150, 150, 6, 3, 16, 8, true), {{40, 1, 89, 20}}},
      {shape(1, 130, 130, 4, 1, 24, 16, true), {{5, 60, 65}}},
  };
}

std::vector<Poison> poisons_for(const Case& c) {
  // The second document of the last row (or the middle of the sequence),
  // a few tokens in, so that documents before and after it and earlier
  // positions of its own exist.
  const AttnShape& s = c.s;
  const std::int64_t b = s.B - 1;
  std::int64_t t = s.Sk / 2 + 3;
  if (!c.docs.empty()) {
    const std::vector<std::int64_t>& row = c.docs.back();
    t = row[0] + std::min<std::int64_t>(3, row[1] - 1);
  }
  return {{Operand::q, b, t, s.Hq - 1, 1},
          {Operand::k, b, t, s.Hk - 1, 2},
          {Operand::v, b, t, 0, s.dv - 1}};
}

template <class T>
void run_all(const Case& c) {
  Problem<T> clean_problem(c.s);
  if (!c.docs.empty()) clean_problem.set_documents(c.docs);
  const Result<T> clean_eager = test::run_eager(clean_problem);
  const Result<T> clean_flash = test::run_flash(clean_problem);
  const Result<T> clean_ref = test::run_reference(clean_problem);
  for (const Poison& p : poisons_for(c)) {
    Problem<T> pr = clean_problem;
    poison(pr, p);
    const std::string tag =
        cat(sizeof(T) == 4 ? "float" : "double", " Sq ", c.s.Sq, " Hq ", c.s.Hq, " Hk ", c.s.Hk,
            c.docs.empty() ? "" : " packed", ", NaN in ", name_of(p.operand), " of token ", p.t);
    const Counts e = check(c.s, p, test::run_eager(pr), clean_eager, tag + ", eager");
    const Counts f = check(c.s, p, test::run_flash(pr), clean_flash, tag + ", flash");
    const Counts r = check(c.s, p, test::run_reference(pr), clean_ref, tag + ", reference");
    auto show = [](const Counts& n) {
      return cat("o ", n.o, " dq ", n.dq, " dk ", n.dk, " dv ", n.dv);
    };
    EXPECT_TRUE(e == f) << tag << ": non-finite counts, eager " << show(e) << ", flash " << show(f);
    EXPECT_TRUE(e == r) << tag << ": non-finite counts, eager " << show(e) << ", reference "
                        << show(r);
  }
}

class NonFinite : public ::testing::TestWithParam<FlashIsa> {};

TEST_P(NonFinite, StaysInTheRowsThatSeeItFloat) {
  const test::IsaScope isa(GetParam());
  for (const Case& c : cases()) run_all<float>(c);
}

INSTANTIATE_TEST_SUITE_P(Isa, NonFinite, ::testing::ValuesIn(flash_isas_available()),
                         [](const auto& c) { return std::string(to_string(c.param)); });

// double runs flash's scalar copy.
TEST(NonFiniteDouble, StaysInTheRowsThatSeeIt) {
  for (const Case& c : cases()) run_all<double>(c);
}

}  // namespace
}  // namespace laga
