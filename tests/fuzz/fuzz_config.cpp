// libFuzzer target: MlaConfig::from_json_file, both formats (DeepSeek
// ModelArgs and Hugging Face config.json; the seed corpus has each), then
// what a loaded config computes from its values. A laga::Error is the
// expected answer to a bad config; anything else is a finding.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "fuzz_support.hpp"
#include "mla/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = laga::fuzz::write_input(data, size, ".json");
  try {
    const laga::MlaConfig c = laga::MlaConfig::from_json_file(path);
    // A validated config must give a finite softmax scale and a summary.
    if (!std::isfinite(c.softmax_scale()) || c.summary().empty()) std::abort();
    (void)c.to_json().dump();
  } catch (const laga::Error&) {
    // refused with a message
  }
  return 0;
}
