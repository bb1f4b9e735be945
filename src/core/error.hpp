// laga::Error — the one exception type of the library.
//
// Every message names what was wrong and what to do about it, e.g.
//   "safetensors 'w.st': tensor 'wo.weight' has shape [64, 32] but the config
//    needs [64, 64]; check that the weights match --config".
// LAGA_CHECK(cond, parts...) builds such a message from streamable parts only
// when the check fails.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace laga {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Concatenates streamable values into a string: cat("H=", 16, " heads").
template <class... Parts>
std::string cat(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}

template <class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw Error(cat(std::forward<Parts>(parts)...));
}

}  // namespace laga

#define LAGA_CHECK(cond, ...)               \
  do {                                      \
    if (!(cond)) ::laga::fail(__VA_ARGS__); \
  } while (0)
