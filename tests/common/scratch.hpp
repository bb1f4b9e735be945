// A fresh, empty scratch directory for one test: $LAGA_TEST_TMP (or /tmp)
// / <prefix><name>, emptied first so a test never reads a previous run's files.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace laga::test {

inline std::filesystem::path scratch_dir(const std::string& prefix, const std::string& name) {
  const char* t = std::getenv("LAGA_TEST_TMP");
  std::filesystem::path p = std::filesystem::path(t ? t : "/tmp") / (prefix + name);
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

}  // namespace laga::test
