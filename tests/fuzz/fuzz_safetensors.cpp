// libFuzzer target: SafetensorsFile::open and reading every tensor it lists
// as float; SafetensorsSet over the same file, dequantising every F8_E4M3
// weight with its scale; and, for an input that starts with '{', the
// sharded-checkpoint index parser (SafetensorsSet::parse_index). A
// laga::Error is the expected answer to a bad file; anything else (a crash,
// a sanitizer report, another exception) is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "fuzz_support.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_set.hpp"

namespace {

void fuzz_index(const std::uint8_t* data, std::size_t size) {
  try {
    const auto map = laga::SafetensorsSet::parse_index(
        "fuzz.index.json", std::string(reinterpret_cast<const char*>(data), size));
    (void)map.size();
  } catch (const laga::Error&) {
    // refused with a message
  }
}

void fuzz_file(const std::string& path) {
  try {
    const laga::SafetensorsFile file = laga::SafetensorsFile::open(path);
    for (const std::string& name : file.names()) {
      // Huge shapes are legal headers; read only what fits the input.
      if (file.info(name).bytes() > 1 << 20) continue;
      try {
        (void)file.read<float>(name, laga::MemCategory::parameters);
      } catch (const laga::Error&) {
        // an unreadable dtype or a short file: refused, fine
      }
    }
    (void)file.metadata();
    const laga::SafetensorsSet set = laga::SafetensorsSet::open(path);
    for (const std::string& name : file.names()) {
      const laga::SafetensorsTensorInfo& info = file.info(name);
      if (info.dtype != "F8_E4M3" || info.bytes() > 1 << 20) continue;
      try {
        laga::Tensor<float> y(info.shape);
        set.read_into(name, y);
      } catch (const laga::Error&) {
        // no scale, a scale of the wrong shape or dtype, non-finite: refused
      }
    }
  } catch (const laga::Error&) {
    // refused with a message: what should happen to most inputs
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > 0 && data[0] == '{') {
    fuzz_index(data, size);
    return 0;
  }
  fuzz_file(laga::fuzz::write_input(data, size, ".safetensors"));
  return 0;
}
