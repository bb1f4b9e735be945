// The message of the laga::Error a call throws, "" when it throws none: how
// the tests check that a refusal names what was wrong.
#pragma once

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

}  // namespace laga::test
