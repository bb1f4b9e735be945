#include "io/safetensors.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

#include "io/io_test_support.hpp"

namespace laga {
namespace {

using io_test::assemble;
using io_test::expect_error;
using io_test::le_bytes_u16;
using io_test::raw_bytes;
using io_test::read_bytes;
using io_test::scratch_dir;
using io_test::write_bytes;

template <class T>
Tensor<T> iota(Shape shape, T start, T step) {
  Tensor<T> t(std::move(shape), MemCategory::parameters);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = start + step * static_cast<T>(i);
  return t;
}

template <class T>
void expect_same_elements(const Tensor<T>& a, const Tensor<T>& b) {
  ASSERT_EQ(a.shape(), b.shape());
  for (std::int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a[i], b[i]) << "element " << i;
}

std::uint32_t bits_of(float v) {
  return std::bit_cast<std::uint32_t>(v);
}

TEST(SafetensorsRoundTrip, F32AndF64WithMetadata) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "weights.safetensors").string();
  Tensor<float> wq = iota<float>({6, 4}, -1.5f, 0.25f);
  Tensor<double> norm = iota<double>({5}, 1.0 / 3.0, 1e-17);
  Tensor<float> scalar({}, MemCategory::parameters);
  scalar[0] = 42.5f;

  SafetensorsWriter writer;
  writer.add("wq.weight", wq);
  writer.add("kv_norm.weight", norm);
  writer.add("scale", scalar);
  writer.add_metadata("format", "pt");
  writer.add_metadata("laga.config", "{\"H\": 4}");
  EXPECT_EQ(writer.size(), 3u);
  writer.write(path);

  SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"kv_norm.weight", "scale", "wq.weight"}));
  EXPECT_TRUE(file.contains("wq.weight"));
  EXPECT_FALSE(file.contains("wo.weight"));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.metadata().at("laga.config"), "{\"H\": 4}");
  EXPECT_EQ(file.info("wq.weight").dtype, "F32");
  EXPECT_EQ(file.info("kv_norm.weight").dtype, "F64");
  EXPECT_EQ(file.info("wq.weight").shape, (Shape{6, 4}));
  EXPECT_EQ(file.info("scale").shape, Shape{});

  expect_same_elements(file.read<float>("wq.weight"), wq);
  expect_same_elements(file.read<double>("kv_norm.weight", Shape{5}), norm);
  Tensor<float> scalar_back = file.read<float>("scale");
  ASSERT_EQ(scalar_back.numel(), 1);
  EXPECT_EQ(scalar_back[0], 42.5f);
  EXPECT_EQ(file.read<float>("wq.weight").category(), MemCategory::parameters);
  EXPECT_EQ(file.read<float>("wq.weight", MemCategory::activations).category(),
            MemCategory::activations);
}

TEST(SafetensorsRoundTrip, ConvertsBetweenFloatAndDouble) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "mixed.safetensors").string();
  Tensor<float> f = iota<float>({3, 2}, 0.1f, 0.7f);
  Tensor<double> d = iota<double>({4}, 0.1, 1.0 / 7.0);
  SafetensorsWriter writer;
  writer.add("f", f);
  writer.add("d", d);
  writer.write(path);

  SafetensorsFile file = SafetensorsFile::open(path);
  Tensor<double> f_as_double = file.read<double>("f");
  for (std::int64_t i = 0; i < f.numel(); ++i) EXPECT_EQ(f_as_double[i], static_cast<double>(f[i]));
  Tensor<float> d_as_float = file.read<float>("d");
  for (std::int64_t i = 0; i < d.numel(); ++i) EXPECT_EQ(d_as_float[i], static_cast<float>(d[i]));
}

TEST(SafetensorsRoundTrip, FollowsReferenceLayout) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "layout.safetensors").string();
  SafetensorsWriter writer;
  writer.add("b_float", iota<float>({3}, 1.f, 1.f));  // 12 bytes: would misalign what follows
  writer.add("a_float", iota<float>({1}, 1.f, 1.f));
  writer.add("z_double", iota<double>({2}, 1.0, 1.0));
  writer.write(path);

  const std::string bytes = read_bytes(path);
  EXPECT_EQ(bytes, writer.serialize());
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) {
    header_length =
        (header_length << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  }
  EXPECT_EQ(header_length % 8, 0u);
  EXPECT_EQ(bytes[8], '{');

  SafetensorsFile file = SafetensorsFile::open(path);
  // Widest elements first, then by name, back to back from offset 0.
  EXPECT_EQ(file.info("z_double").data_begin, 0u);
  EXPECT_EQ(file.info("z_double").data_end, 16u);
  EXPECT_EQ(file.info("a_float").data_begin, 16u);
  EXPECT_EQ(file.info("a_float").data_end, 20u);
  EXPECT_EQ(file.info("b_float").data_begin, 20u);
  EXPECT_EQ(file.info("b_float").data_end, 32u);
  EXPECT_EQ(bytes.size(), 8 + header_length + 32);
}

TEST(SafetensorsRoundTrip, EmptyTensorsAndNoMetadata) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "empty.safetensors").string();
  SafetensorsWriter writer;
  writer.add("nothing", Tensor<float>(Shape{0, 4}));
  writer.add("one", iota<float>({1}, 7.f, 0.f));
  writer.write(path);
  SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_TRUE(file.metadata().empty());
  Tensor<float> nothing = file.read<float>("nothing", Shape{0, 4});
  EXPECT_EQ(nothing.numel(), 0);
  EXPECT_EQ(file.read<float>("one")[0], 7.f);

  SafetensorsWriter no_tensors;
  no_tensors.write(path);
  EXPECT_TRUE(SafetensorsFile::open(path).names().empty());
}

TEST(SafetensorsRead, IndicesI32WrittenByHandAndI64RoundTrip) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "cu.safetensors").string();
  // I32 little-endian 0, 5, 7 and -1; then an F32 tensor, which is no index.
  std::string data;
  for (std::int32_t v : {0, 5, 7, -1})
    for (int b = 0; b < 4; ++b) data += char((std::uint32_t(v) >> (8 * b)) & 0xff);
  data += std::string(4, '\0');
  write_bytes(path, assemble(R"({"cu":{"dtype":"I32","shape":[4],"data_offsets":[0,16]},)"
                             R"("f":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}})",
                             data));
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.read_indices("cu"), (std::vector<std::int64_t>{0, 5, 7, -1}));
  expect_error([&] { (void)file.read_indices("f"); },
               {"tensor 'f' has dtype F32 but it holds indices; store it as I32 or I64"});

  SafetensorsWriter w;
  const std::vector<std::int64_t> big{0, std::int64_t(1) << 40, -3, 9};
  w.add_indices("cu", {2, 2}, big);
  const std::string path64 = (dir / "cu64.safetensors").string();
  w.write(path64);
  const SafetensorsFile f64 = SafetensorsFile::open(path64);
  EXPECT_EQ(f64.info("cu").dtype, "I64");
  EXPECT_EQ(f64.info("cu").shape, (Shape{2, 2}));
  EXPECT_EQ(f64.read_indices("cu"), big);
  expect_error([&] { SafetensorsWriter().add_indices("x", {3}, big); },
               {"tensor 'x' has shape [3] but 4 values"});
}

TEST(SafetensorsRead, Bf16WrittenByHand) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "bf16.safetensors").string();
  // 1.0, -2.5, +inf, the smallest positive bf16 subnormal, -0.0, 3.140625
  const std::string data = le_bytes_u16({0x3F80, 0xC020, 0x7F80, 0x0001, 0x8000, 0x4049});
  write_bytes(path,
              assemble(R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}})", data));

  SafetensorsFile file = SafetensorsFile::open(path);
  Tensor<float> w = file.read<float>("w", Shape{2, 3});
  EXPECT_EQ(w[0], 1.0f);
  EXPECT_EQ(w[1], -2.5f);
  EXPECT_EQ(w[2], std::numeric_limits<float>::infinity());
  EXPECT_EQ(bits_of(w[3]), 0x00010000u);
  EXPECT_EQ(bits_of(w[4]), 0x80000000u);
  EXPECT_EQ(w[5], 3.140625f);
  Tensor<double> wd = file.read<double>("w");
  EXPECT_EQ(wd[1], -2.5);
}

TEST(SafetensorsRead, F16WrittenByHand) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "f16.safetensors").string();
  // 1.0, -2.0, 65504 (max), 2^-24 (smallest subnormal), 2^-14 (smallest
  // normal), 0x03FF (largest subnormal), -inf, NaN
  const std::string data =
      le_bytes_u16({0x3C00, 0xC000, 0x7BFF, 0x0001, 0x0400, 0x03FF, 0xFC00, 0x7E00});
  write_bytes(path, assemble(R"({"h":{"dtype":"F16","shape":[8],"data_offsets":[0,16]}})", data));

  Tensor<float> h = SafetensorsFile::open(path).read<float>("h");
  EXPECT_EQ(h[0], 1.0f);
  EXPECT_EQ(h[1], -2.0f);
  EXPECT_EQ(h[2], 65504.0f);
  EXPECT_EQ(h[3], std::ldexp(1.0f, -24));
  EXPECT_EQ(h[4], std::ldexp(1.0f, -14));
  EXPECT_EQ(h[5], std::ldexp(1023.0f, -24));
  EXPECT_EQ(h[6], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(h[7]));
}

TEST(SafetensorsRead, FileInPythonConventions) {
  // What `safetensors.torch.save_file({"norm.weight": f32[2], "embed.weight":
  // bf16[3]}, metadata={"format": "pt"})` writes: compact JSON, metadata
  // first, fields in the order dtype/shape/data_offsets, the wider dtype
  // first in the data section, space padding to 8 bytes.
  const auto dir = scratch_dir();
  const std::string path = (dir / "python.safetensors").string();
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"embed.weight":{"dtype":"BF16","shape":[3],)"
      R"("data_offsets":[8,14]},"norm.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data = raw_bytes<float>({0.5f, -8.0f}) + le_bytes_u16({0x3F80, 0x4000, 0xBF80});
  const std::string bytes = assemble(header, data);
  ASSERT_EQ((bytes.size() - data.size()) % 8, 0u);
  write_bytes(path, bytes);

  SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"embed.weight", "norm.weight"}));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  Tensor<float> norm = file.read<float>("norm.weight", Shape{2});
  EXPECT_EQ(norm[0], 0.5f);
  EXPECT_EQ(norm[1], -8.0f);
  Tensor<float> embed = file.read<float>("embed.weight", Shape{3});
  EXPECT_EQ(embed[0], 1.0f);
  EXPECT_EQ(embed[1], 2.0f);
  EXPECT_EQ(embed[2], -1.0f);
}

TEST(SafetensorsRead, UnpaddedHeaderAndGapsAreAccepted) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "gaps.safetensors").string();
  const std::string data = raw_bytes<float>({1.f, 99.f, 3.f});
  write_bytes(path, assemble(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                             R"("c":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                             data, /*pad=*/false));
  SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.read<float>("a")[0], 1.f);
  EXPECT_EQ(file.read<float>("c")[0], 3.f);
}

TEST(SafetensorsRead, ReadIntoExistingTensor) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "into.safetensors").string();
  SafetensorsWriter writer;
  writer.add("wo.weight", iota<float>({2, 3}, 1.f, 1.f));
  writer.write(path);
  SafetensorsFile file = SafetensorsFile::open(path);

  Tensor<float> wo = Tensor<float>::zeros({2, 3}, MemCategory::parameters);
  file.read_into("wo.weight", wo);
  EXPECT_EQ(wo[5], 6.f);
  Tensor<float> wrong({3, 2}, MemCategory::parameters);
  expect_error([&] { file.read_into("wo.weight", wrong); },
               {path, "'wo.weight'", "[2, 3]", "[3, 2]"});
}

TEST(SafetensorsRead, CountOnlyPoolAccountsWithoutReading) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "count.safetensors").string();
  SafetensorsWriter writer;
  writer.add("w", iota<float>({4, 8}, 0.f, 1.f));
  writer.write(path);
  SafetensorsFile file = SafetensorsFile::open(path);

  MemoryPool pool;
  pool.set_count_only(true);
  PoolScope scope(pool);
  Tensor<float> w = file.read<float>("w", MemCategory::parameters);
  EXPECT_EQ(w.shape(), (Shape{4, 8}));
  EXPECT_EQ(w.data(), nullptr);
  EXPECT_EQ(pool.current(MemCategory::parameters), 4 * 8 * 4);
}

TEST(SafetensorsRead, KeepsReadingTheFileItOpenedAfterReplacement) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "replaced.safetensors").string();
  SafetensorsWriter first;
  first.add("w", iota<float>({3}, 1.f, 1.f));
  first.write(path);
  SafetensorsFile file = SafetensorsFile::open(path);

  SafetensorsWriter second;
  second.add("w", iota<double>({3}, -1.0, -1.0));
  second.add("extra", iota<float>({100}, 0.f, 1.f));
  second.write(path);

  Tensor<float> w = file.read<float>("w");
  EXPECT_EQ(w[0], 1.f);
  EXPECT_EQ(w[2], 3.f);
  EXPECT_EQ(SafetensorsFile::open(path).read<float>("w")[2], -3.f);
}

TEST(SafetensorsRead, CopiesShareTheOpenFile) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "copy.safetensors").string();
  SafetensorsWriter writer;
  writer.add("w", iota<float>({2}, 5.f, 1.f));
  writer.write(path);
  SafetensorsFile copy = [&] {
    SafetensorsFile original = SafetensorsFile::open(path);
    return original;
  }();
  SafetensorsFile second = copy;
  EXPECT_EQ(second.read<float>("w")[1], 6.f);
  EXPECT_EQ(copy.read<float>("w")[0], 5.f);
}

// ---------------------------------------------------------------------------
// Every malformed file gives a laga::Error naming the file and, where there is
// one, the tensor.

class SafetensorsErrors : public ::testing::Test {
 protected:
  void SetUp() override { path_ = (scratch_dir() / "bad.safetensors").string(); }

  // Writes a file with one entry "w" whose JSON body is `entry`, and
  // `data_bytes` zero bytes of data.
  void write_entry(const std::string& entry, std::size_t data_bytes) {
    write_bytes(path_, assemble(R"({"w":)" + entry + "}", std::string(data_bytes, '\0')));
  }
  void expect_open_error(std::initializer_list<std::string> fragments) {
    expect_error([&] { (void)SafetensorsFile::open(path_); }, fragments);
  }

  std::string path_;
};

TEST_F(SafetensorsErrors, MissingFileAndDirectory) {
  expect_error([&] { (void)SafetensorsFile::open(path_ + ".absent"); },
               {path_ + ".absent", "check the path"});
  const std::string dir = std::filesystem::path(path_).parent_path().string();
  expect_error([&] { (void)SafetensorsFile::open(dir); }, {dir, "not a regular file"});
}

TEST_F(SafetensorsErrors, ShorterThanLengthPrefix) {
  for (std::size_t size = 0; size < 8; ++size) {
    write_bytes(path_, std::string(size, '\x01'));
    expect_open_error({path_, "shorter than the 8-byte"});
  }
}

TEST_F(SafetensorsErrors, HeaderLongerThanFile) {
  write_bytes(path_, io_test::u64_le(1000) + "{}");
  expect_open_error({path_, "1000", "truncated"});
}

TEST_F(SafetensorsErrors, AbsurdHeaderLength) {
  write_bytes(path_, io_test::u64_le(std::uint64_t{1} << 40) + "{}");
  expect_open_error({path_, "100 MB"});
  write_bytes(path_, io_test::u64_le(~std::uint64_t{0}) + "{}");
  expect_open_error({path_, "100 MB"});
}

TEST_F(SafetensorsErrors, HeaderNotJson) {
  write_bytes(path_, assemble("{\"w\": {\"dtype\": ", ""));
  expect_open_error({path_, "not valid JSON"});
  write_bytes(path_, assemble("{\"w\xff\": 1}", ""));  // invalid UTF-8
  expect_open_error({path_, "not valid JSON"});
}

TEST_F(SafetensorsErrors, HeaderNotAnObject) {
  write_bytes(path_, assemble("[1, 2, 3]", ""));
  expect_open_error({path_, "not an object"});
  write_bytes(path_, assemble("\"w\"", ""));
  expect_open_error({path_, "not an object"});
}

TEST_F(SafetensorsErrors, EntryNotAnObject) {
  write_entry("[0, 4]", 4);
  expect_open_error({path_, "'w'", "instead of an object"});
}

TEST_F(SafetensorsErrors, MissingFields) {
  write_entry(R"({"shape":[1],"data_offsets":[0,4]})", 4);
  expect_open_error({path_, "'w'", "\"dtype\""});
  write_entry(R"({"dtype":"F32","data_offsets":[0,4]})", 4);
  expect_open_error({path_, "'w'", "\"shape\""});
  write_entry(R"({"dtype":"F32","shape":[1]})", 4);
  expect_open_error({path_, "'w'", "\"data_offsets\""});
}

TEST_F(SafetensorsErrors, WrongFieldTypes) {
  write_entry(R"({"dtype":32,"shape":[1],"data_offsets":[0,4]})", 4);
  expect_open_error({path_, "'w'", "dtype", "not a string"});
  write_entry(R"({"dtype":"F32","shape":"1","data_offsets":[0,4]})", 4);
  expect_open_error({path_, "'w'", "shape", "not an array"});
  write_entry(R"({"dtype":"F32","shape":[1.0],"data_offsets":[0,4]})", 4);
  expect_open_error({path_, "'w'", "shape entry 0", "not an integer"});
  write_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0]})", 4);
  expect_open_error({path_, "'w'", "two integers"});
  write_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4,8]})", 4);
  expect_open_error({path_, "'w'", "two integers"});
  write_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0,"4"]})", 4);
  expect_open_error({path_, "'w'", "two integers"});
  write_entry(R"({"dtype":"F32","shape":[1],"data_offsets":{"begin":0}})", 4);
  expect_open_error({path_, "'w'", "two integers"});
}

TEST_F(SafetensorsErrors, UnknownDtype) {
  write_entry(R"({"dtype":"F33","shape":[1],"data_offsets":[0,4]})", 4);
  expect_open_error({path_, "'w'", "'F33'", "F32, F64, BF16"});
}

TEST_F(SafetensorsErrors, NegativeExtent) {
  write_entry(R"({"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]})", 16);
  expect_open_error({path_, "'w'", "negative extent -2"});
}

TEST_F(SafetensorsErrors, OverflowingShape) {
  write_entry(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]})", 4);
  expect_open_error({path_, "'w'", "overflows"});
  write_entry(R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]})", 8);
  expect_open_error({path_, "'w'", "overflows"});
  write_entry(R"({"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]})", 8);
  expect_open_error({path_, "'w'", "too large"});
}

TEST_F(SafetensorsErrors, BadOffsets) {
  write_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[8,4]})", 8);
  expect_open_error({path_, "'w'", "begin after end"});
  write_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[-4,0]})", 8);
  expect_open_error({path_, "'w'", "negative data_offsets begin"});
  write_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0,-4]})", 8);
  expect_open_error({path_, "'w'", "negative data_offsets end"});
}

TEST_F(SafetensorsErrors, EndBeyondDataSection) {
  write_entry(R"({"dtype":"F32","shape":[4],"data_offsets":[0,16]})", 12);
  expect_open_error({path_, "'w'", "holds only 12 bytes", "truncated"});
  write_entry(
      R"({"dtype":"F32","shape":[1],"data_offsets":[18446744073709551611,18446744073709551615]})",
      12);
  expect_open_error({path_, "'w'", "holds only 12 bytes"});
}

TEST_F(SafetensorsErrors, ByteCountDisagreesWithShape) {
  write_entry(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0,12]})", 16);
  expect_open_error({path_, "'w'", "need 16 bytes", "span 12"});
  write_entry(R"({"dtype":"BF16","shape":[3],"data_offsets":[0,12]})", 16);
  expect_open_error({path_, "'w'", "need 6 bytes"});
}

TEST_F(SafetensorsErrors, OverlappingTensors) {
  write_bytes(path_, assemble(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                              std::string(12, '\0')));
  expect_open_error({path_, "'a'", "'b'", "overlaps"});
  // Identical ranges overlap as well; empty tensors overlap nothing.
  write_bytes(path_, assemble(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},)"
                              R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                              std::string(8, '\0')));
  expect_open_error({path_, "'a'", "'b'", "overlaps"});
}

TEST_F(SafetensorsErrors, DuplicateTensorName) {
  write_bytes(path_, assemble(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                              std::string(8, '\0')));
  expect_open_error({path_, "'w'", "appears twice"});
}

// Issue 10 item 13: bytes that belong to no tensor, and a field given twice.
TEST_F(SafetensorsErrors, BytesAfterTheLastTensor) {
  write_entry(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 9);
  expect_open_error({path_, "holds 9 bytes but its tensors end at byte 8", "1 bytes after"});
  write_bytes(path_, assemble(R"({"__metadata__":{"a":"b"}})", std::string(4, '\0')));
  expect_open_error({path_, "holds 4 bytes but its tensors end at byte 0"});
  write_entry(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8);
  EXPECT_NO_THROW((void)SafetensorsFile::open(path_));
}

TEST_F(SafetensorsErrors, DuplicateFieldInAnEntry) {
  write_entry(R"({"dtype":"F32","shape":[2],"shape":[1],"data_offsets":[0,4]})", 4);
  expect_open_error({path_, "key 'shape' appears twice in one object"});
}

TEST_F(SafetensorsErrors, BadMetadata) {
  write_bytes(path_, assemble(R"({"__metadata__":{"format":1}})", ""));
  expect_open_error({path_, "'format'", "must be strings"});
  write_bytes(path_, assemble(R"({"__metadata__":["pt"]})", ""));
  expect_open_error({path_, "__metadata__", "not an object"});
}

TEST_F(SafetensorsErrors, MissingTensorListsAvailableNames) {
  write_bytes(path_, assemble(R"({"wq.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("wo.weight":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                              std::string(8, '\0')));
  SafetensorsFile file = SafetensorsFile::open(path_);
  for (auto action : std::vector<std::function<void()>>{
           [&] { (void)file.read<float>("wkv_b.weight"); },
           [&] { (void)file.read<double>("wkv_b.weight", Shape{1}); },
           [&] { (void)file.info("wkv_b.weight"); }}) {
    expect_error(action, {path_, "no tensor 'wkv_b.weight'", "'wo.weight'", "'wq.weight'"});
  }
}

TEST_F(SafetensorsErrors, ManyNamesAreAbbreviated) {
  std::string header = "{";
  for (int i = 0; i < 20; ++i) {
    if (i) header += ",";
    header += cat("\"layer", 10 + i, "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[",
                  4 * i, ",", 4 * i + 4, "]}");
  }
  header += "}";
  write_bytes(path_, assemble(header, std::string(80, '\0')));
  expect_error([&] { (void)SafetensorsFile::open(path_).read<float>("x"); },
               {"20 tensors", "'layer10'", ", ..."});
}

TEST_F(SafetensorsErrors, ShapeMismatch) {
  write_entry(R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})", 24);
  SafetensorsFile file = SafetensorsFile::open(path_);
  expect_error(
      [&] {
        (void)file.read<float>("w", Shape{3, 2});
      },
      {path_, "'w'", "shape [2, 3]", "[3, 2] is expected"});
  expect_error([&] { (void)file.read<float>("w", Shape{2, 3, 1}); }, {path_, "'w'"});
}

TEST_F(SafetensorsErrors, UnreadableDtypeOpensButDoesNotRead) {
  write_bytes(path_, assemble(R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
                              R"("w":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}})",
                              std::string(20, '\0')));
  SafetensorsFile file = SafetensorsFile::open(path_);
  EXPECT_EQ(file.read<float>("w")[0], 0.f);
  expect_error([&] { (void)file.read<float>("ids"); }, {path_, "'ids'", "I64", "F32, F64, BF16"});
  Tensor<double> destination({2});
  expect_error([&] { file.read_into("ids", destination); }, {path_, "'ids'", "I64"});
}

TEST_F(SafetensorsErrors, FileTruncatedAfterOpen) {
  write_entry(R"({"dtype":"F32","shape":[4],"data_offsets":[0,16]})", 16);
  SafetensorsFile file = SafetensorsFile::open(path_);
  std::filesystem::resize_file(path_, std::filesystem::file_size(path_) - 6);
  expect_error([&] { (void)file.read<float>("w"); }, {path_, "'w'", "changed after it was opened"});
  expect_error([&] { (void)file.read<double>("w"); },
               {path_, "'w'", "changed after it was opened"});
}

// ---------------------------------------------------------------------------

TEST(SafetensorsWriterErrors, RefusesBadNamesAndTensors) {
  SafetensorsWriter writer;
  Tensor<float> w = iota<float>({2}, 0.f, 1.f);
  writer.add("w", w);
  expect_error([&] { writer.add("w", w); }, {"'w'", "already added"});
  expect_error([&] { writer.add("", w); }, {"must not be empty"});
  expect_error([&] { writer.add("__metadata__", w); }, {"reserved"});
  expect_error([&] { writer.add("bad\xff", w); }, {"UTF-8"});
  expect_error([&] { writer.add("unset", Tensor<float>()); }, {"'unset'", "empty"});
  expect_error([&] { writer.add_metadata("k", "\xfe"); }, {"'k'", "UTF-8"});

  MemoryPool pool;
  pool.set_count_only(true);
  PoolScope scope(pool);
  Tensor<double> unbacked({3});
  expect_error([&] { writer.add("unbacked", unbacked); }, {"'unbacked'", "count-only"});
  EXPECT_EQ(writer.size(), 1u);
}

TEST(SafetensorsWriterErrors, WriteIntoMissingDirectoryNamesThePath) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "missing" / "w.safetensors").string();
  SafetensorsWriter writer;
  writer.add("w", iota<float>({2}, 0.f, 1.f));
  expect_error([&] { writer.write(path); }, {path, "directory exists"});
  EXPECT_FALSE(std::filesystem::exists(dir / "missing"));
}

}  // namespace
}  // namespace laga
