// One rule for every whole number laga reads from text a user typed (each
// option, each item of a comma list, --doc-lens): decimal digits only, an
// optional leading '-', no leading zeros, within int64. Anything else is
// refused, never guessed: CLI11 reads an integer option with strtoll base 0
// (010 is octal 8, 0x10 is 16) while from_chars reads 010 as 10, so a leading
// zero or a prefix meant different numbers in different options
// (docs/reliability.md, "Options").
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace laga {

inline std::optional<std::int64_t> parse_whole_number(std::string_view s) {
  const bool negative = !s.empty() && s[0] == '-';
  const std::string_view digits = negative ? s.substr(1) : s;
  if (digits.empty() || (digits.size() > 1 && digits[0] == '0')) return std::nullopt;
  // Accumulated as a negative number, so INT64_MIN fits too.
  std::int64_t v = 0;
  constexpr std::int64_t lowest = std::numeric_limits<std::int64_t>::min();
  for (const char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    const int d = c - '0';
    if (v < (lowest + d) / 10) return std::nullopt;
    v = v * 10 - d;
  }
  if (!negative && v == lowest) return std::nullopt;
  return negative ? v : -v;
}

}  // namespace laga
