// Damaged files must give a laga::Error or correct data, never a crash, an
// out-of-bounds read (the sanitizer build checks) or a foreign exception.
#include <gtest/gtest.h>

#include <cstring>
#include <iostream>
#include <random>

#include "io/io_test_support.hpp"
#include "io/safetensors.hpp"

namespace laga {
namespace {

using io_test::scratch_dir;
using io_test::write_bytes;

// Small but covering every reader path: F32, F64, BF16, an empty tensor, a
// scalar, metadata.
std::string small_valid_file() {
  const std::string header = R"({"__metadata__":{"format":"pt"},)"
                             R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[16,40]},)"
                             R"("b":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
                             R"("c":{"dtype":"BF16","shape":[3],"data_offsets":[40,46]},)"
                             R"("e":{"dtype":"F32","shape":[0,5],"data_offsets":[46,46]},)"
                             R"("s":{"dtype":"F32","shape":[],"data_offsets":[48,52]}})";
  std::string data;
  auto put = [&data](const auto& value) {
    data.append(reinterpret_cast<const char*>(&value), sizeof(value));
  };
  put(-0.125);
  put(1e300);
  for (int i = 0; i < 6; ++i) put(static_cast<float>(i) * 1.5f - 2.f);
  data += io_test::le_bytes_u16({0x3F80, 0xC020, 0x4049});
  data += std::string(2, '\0');  // unused gap before "s"
  put(9.75f);
  return io_test::assemble(header, data);
}

struct Snapshot {
  SafetensorsTensorInfo info;
  std::vector<double> values;
};

std::map<std::string, Snapshot> snapshot(const SafetensorsFile& file) {
  std::map<std::string, Snapshot> result;
  for (const std::string& name : file.names()) {
    Tensor<double> t = file.read<double>(name);
    result[name] = {file.info(name), std::vector<double>(t.data(), t.data() + t.numel())};
  }
  return result;
}

bool same_info(const SafetensorsTensorInfo& a, const SafetensorsTensorInfo& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.data_begin == b.data_begin &&
         a.data_end == b.data_end;
}

enum class Outcome { opened, refused };

struct Result {
  Outcome outcome;
  std::string message;  // the refusal, when refused
};

// Opens `path` and reads every tensor as float and double. When the data
// section starts where it did (`same_data_start`), a tensor whose entry is
// unchanged from `reference` must read back the same values.
Result open_and_check(const std::string& path, const std::map<std::string, Snapshot>& reference,
                      bool same_data_start, const std::string& case_label) {
  try {
    SafetensorsFile file = SafetensorsFile::open(path);
    for (const std::string& name : file.names()) {
      try {
        Tensor<float> as_float = file.read<float>(name);
        Tensor<double> as_double = file.read<double>(name, file.info(name).shape);
        auto original = reference.find(name);
        if (!same_data_start || original == reference.end() ||
            !same_info(original->second.info, file.info(name))) {
          continue;
        }
        const std::vector<double>& expected = original->second.values;
        for (std::size_t i = 0; i < expected.size(); ++i) {
          const auto at = static_cast<std::int64_t>(i);
          if (std::memcmp(&as_double[at], &expected[i], sizeof(double)) != 0) {
            ADD_FAILURE() << case_label << ": tensor '" << name << "' element " << i << " reads "
                          << as_double[at] << ", expected " << expected[i];
            break;
          }
          if (as_float[at] != static_cast<float>(expected[i])) {
            ADD_FAILURE() << case_label << ": tensor '" << name << "' as float differs at " << i;
            break;
          }
        }
      } catch (const Error& e) {
        // Only dtypes the reader cannot convert may fail after a clean open.
        EXPECT_NE(std::string(e.what()).find("cannot convert"), std::string::npos)
            << case_label << ": " << e.what();
      }
    }
    return {Outcome::opened, ""};
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos)
        << case_label << ": error does not name the file: " << e.what();
    return {Outcome::refused, e.what()};
  } catch (const std::exception& e) {
    ADD_FAILURE() << case_label << ": threw a non-laga exception: " << e.what();
    return {Outcome::refused, e.what()};
  }
}

TEST(SafetensorsFuzz, ValidFileReadsBack) {
  const std::string path = (scratch_dir() / "valid.safetensors").string();
  write_bytes(path, small_valid_file());
  std::map<std::string, Snapshot> values = snapshot(SafetensorsFile::open(path));
  ASSERT_EQ(values.size(), 5u);
  EXPECT_EQ(values["a"].values[5], 5.5);
  EXPECT_EQ(values["b"].values[1], 1e300);
  EXPECT_EQ(values["c"].values[1], -2.5);
  EXPECT_TRUE(values["e"].values.empty());
  EXPECT_EQ(values["s"].values[0], 9.75);
}

TEST(SafetensorsFuzz, TruncatedAtEveryByte) {
  const std::string path = (scratch_dir() / "truncated.safetensors").string();
  const std::string full = small_valid_file();
  write_bytes(path, full);
  const std::map<std::string, Snapshot> reference = snapshot(SafetensorsFile::open(path));

  for (std::size_t length = 0; length <= full.size(); ++length) {
    write_bytes(path, full.substr(0, length));
    const Outcome outcome =
        open_and_check(path, reference, true, cat("truncated to ", length, " bytes")).outcome;
    // The last tensor ends at the last byte, so every proper prefix is refused.
    EXPECT_EQ(outcome, length == full.size() ? Outcome::opened : Outcome::refused)
        << "truncated to " << length << " of " << full.size() << " bytes";
  }
}

TEST(SafetensorsFuzz, TruncatedAfterOpenAtEveryByte) {
  const std::string path = (scratch_dir() / "shrinking.safetensors").string();
  const std::string full = small_valid_file();
  write_bytes(path, full);
  const std::map<std::string, Snapshot> reference = snapshot(SafetensorsFile::open(path));

  for (std::size_t length = 0; length < full.size(); ++length) {
    write_bytes(path, full);
    SafetensorsFile file = SafetensorsFile::open(path);
    std::filesystem::resize_file(path, length);
    for (const std::string& name : file.names()) {
      try {
        Tensor<double> t = file.read<double>(name);
        const std::vector<double>& expected = reference.at(name).values;
        for (std::size_t i = 0; i < expected.size(); ++i) {
          ASSERT_EQ(t[static_cast<std::int64_t>(i)], expected[i])
              << name << " after truncating to " << length;
        }
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("'" + name + "'"), std::string::npos) << e.what();
      }
    }
  }
}

// Corrupts 1-3 header bytes (length prefix included) per case, in three
// ways: random XOR, which mostly breaks the JSON; JSON-significant
// characters, which often keep it parseable; and digit-for-digit swaps, which
// keep it parseable and change shapes and offsets, reaching the entry checks.
TEST(SafetensorsFuzz, RandomHeaderCorruption) {
  const std::string path = (scratch_dir() / "flipped.safetensors").string();
  const std::string original = small_valid_file();
  write_bytes(path, original);
  const std::map<std::string, Snapshot> reference = snapshot(SafetensorsFile::open(path));
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) {
    header_length =
        (header_length << 8) | static_cast<unsigned char>(original[static_cast<size_t>(i)]);
  }
  const std::size_t header_end = 8 + static_cast<std::size_t>(header_length);
  const std::string significant = "0123456789-[]{},:\" .eE";
  std::vector<std::size_t> digit_positions;
  for (std::size_t i = 8; i < header_end; ++i) {
    if (original[i] >= '0' && original[i] <= '9') digit_positions.push_back(i);
  }

  std::mt19937_64 rng(20240917);
  constexpr int kCases = 4500;
  int opened = 0;
  std::map<std::string, int> refusals_by_check;
  const std::vector<std::string> checks = {"not valid JSON",  "100 MB",        "truncated",
                                           "unknown dtype",   "negative",      "need",
                                           "overlaps",        "not an",        "has no",
                                           "begin after end", "appears twice", "must be strings"};
  for (int c = 0; c < kCases; ++c) {
    std::string damaged = original;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      if (c % 3 == 0) {
        const std::size_t at = static_cast<std::size_t>(rng() % header_end);
        damaged[at] = static_cast<char>(damaged[at] ^ static_cast<char>(1 + rng() % 255));
      } else if (c % 3 == 1) {
        const std::size_t at = static_cast<std::size_t>(rng() % header_end);
        damaged[at] = significant[static_cast<std::size_t>(rng() % significant.size())];
      } else {
        const std::size_t at = digit_positions[rng() % digit_positions.size()];
        damaged[at] = static_cast<char>('0' + rng() % 10);
      }
    }
    write_bytes(path, damaged);
    const bool same_data_start = damaged.compare(0, 8, original, 0, 8) == 0;
    const Result result = open_and_check(path, reference, same_data_start, cat("case ", c));
    if (result.outcome == Outcome::opened) ++opened;
    for (const std::string& check : checks) {
      if (result.message.find(check) != std::string::npos) ++refusals_by_check[check];
    }
  }
  // Both outcomes occur, and the refusals come from many different checks,
  // so the cases reach well past the JSON parser.
  EXPECT_GT(opened, 50);
  EXPECT_LT(opened, kCases);
  int checks_hit = 0;
  for (const std::string& check : checks) {
    if (refusals_by_check[check] > 0) ++checks_hit;
  }
  EXPECT_GE(checks_hit, 8) << "opened " << opened;
  for (const auto& [check, count] : refusals_by_check) {
    std::cout << "  refused by '" << check << "': " << count << "\n";
  }
  std::cout << "  opened: " << opened << " of " << kCases << "\n";
}

// Same for the data section: any bytes are valid data, so every case opens
// and the unchanged tensors read back unchanged.
TEST(SafetensorsFuzz, RandomDataCorruption) {
  const std::string path = (scratch_dir() / "data.safetensors").string();
  const std::string original = small_valid_file();
  write_bytes(path, original);
  SafetensorsFile clean = SafetensorsFile::open(path);
  const std::map<std::string, Snapshot> reference = snapshot(clean);
  const std::size_t data_start = original.size() - 52;

  std::mt19937_64 rng(7);
  for (int c = 0; c < 300; ++c) {
    std::string damaged = original;
    const std::size_t at = data_start + static_cast<std::size_t>(rng() % 52);
    damaged[at] = static_cast<char>(damaged[at] ^ static_cast<char>(1 + rng() % 255));
    write_bytes(path, damaged);
    SafetensorsFile file = SafetensorsFile::open(path);
    for (const std::string& name : file.names()) {
      const SafetensorsTensorInfo& info = file.info(name);
      Tensor<double> t = file.read<double>(name);
      const std::size_t begin = data_start + info.data_begin;
      const std::size_t end = data_start + info.data_end;
      if (at >= begin && at < end) continue;
      for (std::int64_t i = 0; i < t.numel(); ++i) {
        const double expected = reference.at(name).values[static_cast<std::size_t>(i)];
        ASSERT_EQ(std::memcmp(&t[i], &expected, sizeof(double)), 0) << name << " case " << c;
      }
    }
  }
}

}  // namespace
}  // namespace laga
