// The values options take, each kind by one rule on every command: whole
// numbers (core/whole_number.hpp's rule, with the option's type's range),
// decimal reals, --link's pair, and comma lists (cli_common.hpp).
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "comm/link_bounds.hpp"
#include "core/error.hpp"
#include "core/whole_number.hpp"
#include "tools/cli_common.hpp"

namespace laga::tools {

namespace {
std::string number_text(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// A whole number by core/whole_number.hpp's rule (decimal digits, an
// optional '-', no leading zeros, no "-0"), in [lo, hi]; hi reaches
// 2^64 - 1 (the seeds are uint64). `well_formed`: the text keeps the rule
// (any size); `in_range`: it is a number in [lo, hi].
struct WholeText {
  bool well_formed = false, in_range = false;
};
WholeText read_whole(const std::string& text, std::int64_t lo, std::uint64_t hi) {
  WholeText w;
  const bool negative = !text.empty() && text[0] == '-';
  const std::string digits = negative ? text.substr(1) : text;
  if (digits.empty() || (digits.size() > 1 && digits[0] == '0')) return w;
  std::uint64_t v = 0;
  bool overflow = false;
  for (const char c : digits) {
    if (c < '0' || c > '9') return w;
    const std::uint64_t d = std::uint64_t(c - '0');
    if (v > (std::numeric_limits<std::uint64_t>::max() - d) / 10) overflow = true;
    if (!overflow) v = v * 10 + d;
  }
  if (negative && digits == "0") return w;  // "-0"
  w.well_formed = true;
  if (overflow) return w;
  if (negative) {
    // -v >= lo, i.e. v <= -lo (as unsigned: lo may be INT64_MIN).
    w.in_range = lo < 0 && v <= std::uint64_t(-(lo + 1)) + 1;
  } else {
    w.in_range = (lo <= 0 || v >= std::uint64_t(lo)) && v <= hi;
  }
  return w;
}

}  // namespace

CLI::Validator whole(std::int64_t lo, std::uint64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        if (!read_whole(text, lo, hi).in_range) return whole_number_refusal(text, lo, hi);
        return "";
      },
      cat("INT in [", lo, ", ", hi, "]"));
}

CLI::Validator non_empty(const char* option, const char* fix) {
  return CLI::Validator(
      [option, fix](std::string& text) -> std::string {
        return text.empty() ? cat("an empty ", option, " means nothing; ", fix) : "";
      },
      "TEXT");
}

std::string whole_number_refusal(const std::string& text, std::int64_t lo, std::uint64_t hi) {
  // Every integer option's refusal names its whole range, so a value past
  // the type's end (2^64 - 1 for a seed, 2^31 - 1 for a rank count) reads as
  // what it is rather than "not a whole number" or CLI11's "Could not
  // convert" (issue 54, T).
  return cat(
      "'", text, "' is not a whole number >= ", lo, " and <= ", hi,
      read_whole(text, lo, hi).well_formed ? "" : " (decimal digits only, no leading zeros)");
}

std::optional<double> parse_decimal_real(const std::string& text) {
  // -?(digits[.digits] | .digits)([eE][+-]?digits)?, nothing else: strtod
  // alone also reads hex floats (0x10 is 16, 0x1p-3 is 0.125), "inf",
  // "nan", "infinity" and leading spaces (issue 54, P).
  size_t i = 0;
  const auto digits = [&] {
    const size_t start = i;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i;
    return i - start;
  };
  if (i < text.size() && text[i] == '-') ++i;
  const size_t whole_digits = digits();
  size_t fraction_digits = 0;
  if (i < text.size() && text[i] == '.') {
    ++i;
    fraction_digits = digits();
  }
  if (whole_digits + fraction_digits == 0) return std::nullopt;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
    if (digits() == 0) return std::nullopt;
  }
  if (i != text.size()) return std::nullopt;
  errno = 0;
  const double v = std::strtod(text.c_str(), nullptr);
  // Past double's range either way (1e999 is inf, 1e-999 rounds to 0 or
  // a subnormal): not the number written.
  if (!std::isfinite(v) || errno == ERANGE) return std::nullopt;
  return v;
}

CLI::Validator real(double lo, double hi, const char* bounds) {
  const bool lo_in = bounds[0] == '[', hi_in = bounds[1] == ']';
  const std::string interval =
      cat(lo_in ? "[" : "(", number_text(lo), ", ", number_text(hi), hi_in ? "]" : ")");
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        const std::optional<double> parsed = parse_decimal_real(text);
        if (!parsed)
          return cat("'", text, "' is not a finite number in ", interval,
                     " (decimal only, like 0.001 or 1e-3: no hex, inf or nan; within double's "
                     "range)");
        const double v = *parsed;
        if (v < lo || (v == lo && !lo_in) || v > hi || (v == hi && !hi_in))
          return cat(text, " is outside ", interval);
        return "";
      },
      "REAL in " + interval);
}

CLI::Validator real_at_least(double lo) {
  return real(lo, std::numeric_limits<double>::infinity(), "[)");
}

CLI::Validator real_above(double lo) {
  return real(lo, std::numeric_limits<double>::infinity(), "()");
}

LinkSpec parse_link(const std::string& text) {
  // The bounds are comm/link_bounds.hpp's, in GB/s: [1e-06, 1e+06].
  constexpr double kMinGbps = kLeastLinkBytesPerS / 1e9, kMaxGbps = kMostLinkBytesPerS / 1e9;
  constexpr double kMaxLatencyUs = kMostLinkLatencyUs;
  const std::string usage =
      "; give --link BW[,LAT]: BW in GB/s (10^9 bytes/s per direction) in [1e-06, 1e+06], LAT in "
      "microseconds in [0, 1e+07], e.g. --link 25,5";
  const size_t comma = text.find(',');
  const std::string bw = text.substr(0, comma);
  auto number = [&](const std::string& t, const char* what) {
    const std::optional<double> v = parse_decimal_real(t);
    LAGA_CHECK(v, "--link: ", what, " '", t,
               "' is not a finite number (decimal only: no hex, inf or nan)", usage);
    return *v;
  };
  LinkSpec spec;
  const double gbps = number(bw, "bandwidth");
  LAGA_CHECK(gbps > 0, "--link: bandwidth ", bw, " GB/s is not positive", usage);
  LAGA_CHECK(gbps >= kMinGbps && gbps <= kMaxGbps, "--link: bandwidth ", bw,
             " GB/s is beyond what the link model holds a rank for", usage);
  spec.bytes_per_s = gbps * 1e9;
  if (comma != std::string::npos) {
    const std::string lat = text.substr(comma + 1);
    const double us = number(lat, "latency");
    LAGA_CHECK(us >= 0, "--link: latency ", lat, " us is negative", usage);
    LAGA_CHECK(us <= kMaxLatencyUs, "--link: latency ", lat,
               " us is beyond what the link model holds a rank for", usage);
    spec.latency_s = us * 1e-6;
  }
  return spec;
}

CLI::Validator link_spec() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          parse_link(text);
        } catch (const Error& e) {
          // CLI11 prefixes the option's name itself.
          const std::string m = e.what();
          return m.rfind("--link: ", 0) == 0 ? m.substr(8) : m;
        }
        return "";
      },
      "BW_GBPS[,LATENCY_US]");
}

std::vector<std::string> split_list(const std::string& s, const std::string& option,
                                    const std::string& example) {
  // One rule for every comma list: no empty item anywhere. getline dropped a
  // trailing one, so "--sp 2," ran while "--sp 1,,2" was refused (issue 54,
  // P).
  std::vector<std::string> items;
  std::string::size_type begin = 0;
  for (;;) {
    const auto end = s.find(',', begin);
    items.push_back(s.substr(begin, end == std::string::npos ? end : end - begin));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  LAGA_CHECK(!s.empty(), option, ": empty list; give a comma-separated list like ", example);
  for (size_t i = 0; i < items.size(); ++i)
    LAGA_CHECK(!items[i].empty(), option, ": '", s, "' has an empty item (",
               i == 0                  ? "before the first comma"
               : i + 1 == items.size() ? "after the last comma"
                                       : "between two commas",
               "); give a comma-separated list like ", example, " with no empty items");
  // A repeated item would plan or run the same thing twice: a typo.
  for (size_t i = 0; i < items.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      LAGA_CHECK(items[i] != items[j], option, ": '", items[i], "' appears twice in '", s,
                 "'; give each item once");
  return items;
}

std::vector<std::int64_t> parse_whole_list(const std::string& s, const std::string& option,
                                           const std::string& example, std::int64_t max) {
  std::vector<std::int64_t> v;
  for (const std::string& tok : split_list(s, option, example)) {
    const std::optional<std::int64_t> x = parse_whole_number(tok);
    LAGA_CHECK(x && *x >= 1 && *x <= max, option, ": ",
               whole_number_refusal(tok, 1, std::uint64_t(max)),
               "; give a comma-separated list like ", example);
    v.push_back(*x);
  }
  // No value twice: split_list refuses a repeated item, and a whole number
  // has one spelling (parse_whole_number: no leading zeros, sign or "-0").
  return v;
}

std::vector<int> parse_int_list(const std::string& s, const std::string& option) {
  const std::vector<std::int64_t> v =
      parse_whole_list(s, option, "1,2,4", std::numeric_limits<int>::max());
  return std::vector<int>(v.begin(), v.end());
}

std::vector<Form> parse_form_list(const std::string& s) {
  if (s == "all") return all_forms();  // every registered form (mla/form.cpp)
  std::vector<Form> v;
  for (const std::string& tok : split_list(s, "--forms", "laga,explicit (or all)"))
    v.push_back(parse_form(tok));
  return v;
}

}  // namespace laga::tools
