// parse_whole_number: the one rule for every whole number typed on a command
// line (core/whole_number.hpp): decimal digits, an optional '-', no leading
// zeros, within int64; everything else refused rather than read some way.
#include "core/whole_number.hpp"

#include <gtest/gtest.h>

#include <limits>

namespace laga {
namespace {

TEST(WholeNumber, ReadsDecimalDigits) {
  EXPECT_EQ(parse_whole_number("0"), 0);
  EXPECT_EQ(parse_whole_number("10"), 10);
  EXPECT_EQ(parse_whole_number("-7"), -7);
  EXPECT_EQ(parse_whole_number("9223372036854775807"), std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(parse_whole_number("-9223372036854775808"), std::numeric_limits<std::int64_t>::min());
}

TEST(WholeNumber, RefusesWhatOtherReadersGuess) {
  for (const char* s :
       {"010", "08", "00", "-01", "0x10", "0X10", "1e3", "+5", "5 ", " 5", "", "-", "1.0", "1,2",
        "9223372036854775808", "-9223372036854775809", "99999999999999999999"})
    EXPECT_EQ(parse_whole_number(s), std::nullopt) << "'" << s << "'";
}

}  // namespace
}  // namespace laga
