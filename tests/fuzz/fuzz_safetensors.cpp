// libFuzzer target: SafetensorsFile::open and reading every tensor it lists
// as float. A laga::Error is the expected answer to a bad file; anything else
// (a crash, a sanitizer report, another exception) is a finding.
#include <cstddef>
#include <cstdint>

#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "fuzz_support.hpp"
#include "io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = laga::fuzz::write_input(data, size, ".safetensors");
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
  } catch (const laga::Error&) {
    // refused with a message: what should happen to most inputs
  }
  return 0;
}
