// laga::Error, cat(), fail() and LAGA_CHECK.
#include "core/error.hpp"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <type_traits>

namespace laga {
namespace {

TEST(Error, IsARuntimeError) {
  static_assert(std::is_base_of_v<std::runtime_error, Error>);
  try {
    throw Error("boom");
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "boom");
  }
}

TEST(Error, CatConcatenatesStreamables) {
  EXPECT_EQ(cat("H=", 16, " heads, scale ", 0.5, ' ', std::string("ok")),
            "H=16 heads, scale 0.5 ok");
}

TEST(Error, FailThrowsWithTheMessage) {
  try {
    fail("tensor '", "wo.weight", "' has ", 3, " dims");
    FAIL() << "fail() returned";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "tensor 'wo.weight' has 3 dims");
  }
}

TEST(Error, CheckPassesSilentlyAndBuildsTheMessageOnlyOnFailure) {
  int built = 0;
  auto part = [&] {
    ++built;
    return "expensive";
  };
  EXPECT_NO_THROW(LAGA_CHECK(1 + 1 == 2, "never: ", part()));
  EXPECT_EQ(built, 0);
  try {
    const int heads = 7;
    LAGA_CHECK(heads % 2 == 0, "heads (", heads, ") must be even; ", part());
    FAIL() << "LAGA_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "heads (7) must be even; expensive");
  }
  EXPECT_EQ(built, 1);
}

TEST(Error, CheckEvaluatesTheConditionOnceAndIsOneStatement) {
  int evaluated = 0;
  // An if/else without braces compiles to what it reads only if the macro is
  // a single statement (do { } while (0)).
  if (evaluated == 0)
    LAGA_CHECK(++evaluated == 1, "x");
  else
    FAIL();
  EXPECT_EQ(evaluated, 1);
}

}  // namespace
}  // namespace laga
