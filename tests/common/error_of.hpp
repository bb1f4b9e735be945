// The message of the laga::Error a call throws, "" when it throws none, and
// the expectation that one is thrown naming a given fragment: how the tests
// check that a refusal names what was wrong.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>

#include "core/error.hpp"

namespace laga::test {

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// fn must throw a laga::Error whose message contains needle.
inline void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace laga::test
