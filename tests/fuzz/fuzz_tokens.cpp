// libFuzzer target: TokenSource::file (llm.c header or raw uint16/uint32
// ids). The first input byte picks --data-dtype and the file's name (raw
// u32 is chosen by a .u32 name under auto), the second --vocab; the rest
// is the file. Accepted files are then sampled as training windows, which
// must hold ids below the vocabulary.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "core/error.hpp"
#include "fuzz_support.hpp"
#include "model/data.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  static const char* const kDtypes[] = {"auto", "u16", "u32", "auto"};
  const char* dtype = kDtypes[data[0] & 3];
  const char* suffix = (data[0] & 4) ? ".u32" : ".bin";
  const std::int64_t vocab = std::int64_t(1) << (1 + data[1] % 31);
  const std::int64_t seq = 1 + (data[0] >> 3);
  const std::string& path = laga::fuzz::write_input(data + 2, size - 2, suffix);
  try {
    const laga::TokenSource t = laga::TokenSource::file(path, dtype, vocab, seq, 1);
    std::vector<std::int32_t> window(static_cast<size_t>(2 * (seq + 1)));
    t.batch(0, 2, seq, window.data());
    for (std::int32_t id : window)
      if (id < 0 || id >= vocab) std::abort();
  } catch (const laga::Error&) {
    // refused with a message
  }
  return 0;
}
