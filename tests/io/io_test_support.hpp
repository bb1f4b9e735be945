// Shared by the io tests: a scratch directory per test, raw file helpers, and
// hand-assembly of safetensors bytes (so tests do not trust the writer they
// are testing).
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <string>

#include "core/error.hpp"

namespace laga::io_test {

// A fresh, empty directory under $LAGA_TEST_TMP named after the running test
// (and the pid, so concurrent ctest runs never share one).
inline std::filesystem::path scratch_dir() {
  const char* root = std::getenv("LAGA_TEST_TMP");
  std::filesystem::path base = root ? root : std::filesystem::temp_directory_path();
  const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
  std::filesystem::path dir = base / ("io_" + std::string(test->test_suite_name()) + "_" +
                                      test->name() + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Plain, non-durable writes: the fuzz tests write thousands of files and do
// not need fsync.
inline void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "could not write test file " << path;
}

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline std::string u64_le(std::uint64_t value) {
  std::string bytes(8, '\0');
  for (std::size_t i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return bytes;
}

// A safetensors file from a header text and a data section, the header padded
// with spaces to a multiple of 8 as the reference writer does (or not).
inline std::string assemble(std::string header, const std::string& data, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  return u64_le(header.size()) + header + data;
}

inline std::string le_bytes_u16(std::initializer_list<std::uint16_t> values) {
  std::string bytes;
  for (std::uint16_t v : values) {
    bytes.push_back(static_cast<char>(v & 0xff));
    bytes.push_back(static_cast<char>(v >> 8));
  }
  return bytes;
}

template <class T>
std::string raw_bytes(std::initializer_list<T> values) {
  std::string bytes;
  for (T v : values) bytes.append(reinterpret_cast<const char*>(&v), sizeof(T));
  return bytes;
}

// Runs `action`, which must throw laga::Error whose message contains every
// one of `fragments`.
inline void expect_error(const std::function<void()>& action,
                         std::initializer_list<std::string> fragments) {
  try {
    action();
    ADD_FAILURE() << "expected a laga::Error mentioning '" << *fragments.begin()
                  << "', but nothing was thrown";
  } catch (const laga::Error& e) {
    const std::string message = e.what();
    for (const std::string& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "error message lacks '" << fragment << "':\n  " << message;
    }
  }
}

}  // namespace laga::io_test
