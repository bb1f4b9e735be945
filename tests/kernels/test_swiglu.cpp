// SwiGLU against its reference (written with a different derivative formula)
// and finite differences in double, including large |a| where sigmoid saturates.
#include "kernels/swiglu.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "common/check.hpp"

namespace laga {
namespace {

using test::all_close;
using test::random_vector;

TEST(SwiGlu, MatchesReference) {
  const std::int64_t n = 1000;
  auto a = random_vector<double>(n, 1, -30, 30), b = random_vector<double>(n, 2),
       dh = random_vector<double>(n, 3);
  std::vector<double> h(n), hr(n), da(n), db(n), dar(n), dbr(n);
  swiglu_forward(h.data(), a.data(), b.data(), n);
  swiglu_forward_reference(hr.data(), a.data(), b.data(), n);
  EXPECT_TRUE(all_close("h", h, hr, 1e-14, 1e-13));
  swiglu_backward(da.data(), db.data(), dh.data(), a.data(), b.data(), n);
  swiglu_backward_reference(dar.data(), dbr.data(), dh.data(), a.data(), b.data(), n);
  EXPECT_TRUE(all_close("da", da, dar, 1e-14, 1e-12));
  EXPECT_TRUE(all_close("db", db, dbr, 1e-14, 1e-12));
  auto af = test::convert<float>(a), bf = test::convert<float>(b), dhf = test::convert<float>(dh);
  std::vector<float> hf(n), daf(n), dbf(n);
  swiglu_forward(hf.data(), af.data(), bf.data(), n);
  swiglu_backward(daf.data(), dbf.data(), dhf.data(), af.data(), bf.data(), n);
  // float inputs differ from the double ones by their rounding (~6e-8 rel).
  EXPECT_TRUE(all_close("h f32", hf, hr, 1e-6, 1e-5));
  EXPECT_TRUE(all_close("da f32", daf, dar, 1e-6, 1e-5));
}

TEST(SwiGlu, FiniteDifferencesDouble) {
  const std::int64_t n = 40;
  auto a = random_vector<double>(n, 4, -6, 6), b = random_vector<double>(n, 5),
       G = random_vector<double>(n, 6);
  std::vector<double> da(n), db(n);
  swiglu_backward(da.data(), db.data(), G.data(), a.data(), b.data(), n);
  auto loss = [&] {
    std::vector<double> h(n);
    swiglu_forward(h.data(), a.data(), b.data(), n);
    return test::dot(h.data(), G.data(), n);
  };
  test::GradientCheck gc;
  gc.add("a", a.data(), da.data(), n).add("b", b.data(), db.data(), n);
  EXPECT_TRUE(gc.run(loss));
}

}  // namespace
}  // namespace laga
