// Shared by the libFuzzer targets (scripts/fuzz.sh builds and runs them;
// docs/reliability.md, "Fuzzing"): the readers under test take a path, so
// each input is written to one file per process, on tmpfs when there is one.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

namespace laga::fuzz {

// A path of this process ending in `suffix`, holding exactly data[0, size).
inline const std::string& write_input(const std::uint8_t* data, std::size_t size,
                                      const std::string& suffix = ".bin") {
  static std::string dir = [] {
    const char* shm = "/dev/shm";
    return std::string(access(shm, W_OK) == 0 ? shm : "/tmp");
  }();
  // One file per suffix; all removed when the fuzzer exits (-runs,
  // -max_total_time). A crash leaves them, beside the artifact it saves.
  static std::set<std::string> written;
  static const bool cleanup = [] {
    std::atexit([] {
      for (const std::string& p : written) std::remove(p.c_str());
    });
    return true;
  }();
  (void)cleanup;
  const std::string& path =
      *written.insert(dir + "/laga_fuzz_" + std::to_string(getpid()) + suffix).first;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();  // the harness, not the reader, failed
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace laga::fuzz
