// Real checkpoints (issue 26): F8_E4M3 decoding, DeepSeek's block-scaled
// dequantisation (weight_dequant), and sharded checkpoints read through their
// index. Files are assembled here by hand (not by laga's writer) in the real
// layout: Hugging Face names, DeepSeek-V3 shapes for one layer, fp8 weights
// beside F32 "_scale_inv" of one value per 128x128 block, BF16 norms. The V3
// files are sparse (header and a few written blocks), so they cost little
// disk and time.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "io/safetensors_set.hpp"
#include "io_test_support.hpp"

namespace laga {
namespace {

namespace fs = std::filesystem;
using io_test::expect_error;

// The e4m3fn value of a code, written independently of the library (powers
// by std::pow in double, no bit tricks): (-1)^s · 2^(e-7) · (1 + m/8), or
// 2^-6 · m/8 when e is 0; NaN at e = 15, m = 7.
double reference_e4m3(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double magnitude =
      e == 0 ? std::pow(2.0, -6) * (m / 8.0) : std::pow(2.0, e - 7) * (1 + m / 8.0);
  return s ? -magnitude : magnitude;
}

// One tensor of a hand-built file: `bytes` empty leaves its data a sparse
// hole (zeros) of the size dtype and shape need.
struct Entry {
  std::string name, dtype;
  Shape shape;
  std::string bytes;
  std::vector<std::pair<std::uint64_t, std::string>> patches;  // (offset in tensor, bytes)
};

std::size_t element_size(const std::string& dtype) {
  return dtype == "F32" ? 4 : dtype == "BF16" ? 2 : 1;
}

void write_file(const fs::path& path, const std::vector<Entry>& entries) {
  std::string header = "{";
  std::uint64_t offset = 0;
  std::vector<std::uint64_t> begins;
  for (const Entry& e : entries) {
    std::uint64_t n = element_size(e.dtype);
    for (std::int64_t d : e.shape) n *= static_cast<std::uint64_t>(d);
    std::ostringstream entry;
    entry << (begins.empty() ? "\"" : ",\"") << e.name << "\":{\"dtype\":\"" << e.dtype
          << "\",\"shape\":[";
    for (std::size_t k = 0; k < e.shape.size(); ++k) entry << (k ? "," : "") << e.shape[k];
    entry << "],\"data_offsets\":[" << offset << "," << offset + n << "]}";
    header += entry.str();
    begins.push_back(offset);
    offset += n;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::uint64_t start = 8 + header.size();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << io_test::u64_le(header.size()) << header;
    for (std::size_t k = 0; k < entries.size(); ++k) {
      if (!entries[k].bytes.empty()) {
        out.seekp(static_cast<std::streamoff>(start + begins[k]));
        out << entries[k].bytes;
      }
      for (const auto& [at, bytes] : entries[k].patches) {
        out.seekp(static_cast<std::streamoff>(start + begins[k] + at));
        out << bytes;
      }
    }
    ASSERT_TRUE(out.good()) << path;
  }
  fs::resize_file(path, start + offset);  // the sparse tail, if any
}

std::string f32_bytes(const std::vector<float>& v) {
  std::string b(v.size() * 4, '\0');
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::string index_json(const std::vector<std::pair<std::string, std::string>>& map) {
  std::string text = "{\"metadata\":{\"total_size\":0},\"weight_map\":{";
  for (std::size_t k = 0; k < map.size(); ++k)
    text += (k ? ",\"" : "\"") + map[k].first + "\":\"" + map[k].second + "\"";
  return text + "}}";
}

class SafetensorsSetTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = io_test::scratch_dir(); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string at(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST(F8E4M3, AllCodesExact) {
  for (int code = 0; code < 256; ++code) {
    const float got = f8_e4m3_to_float(static_cast<std::uint8_t>(code));
    const double want = reference_e4m3(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code " << code;
      EXPECT_EQ(std::signbit(got), code >= 128) << "code " << code;
    }
  }
  // Hand-checked: the largest finite, the smallest subnormal, one, zeros.
  EXPECT_EQ(f8_e4m3_to_float(0x7e), 448.f);
  EXPECT_EQ(f8_e4m3_to_float(0xfe), -448.f);
  EXPECT_EQ(f8_e4m3_to_float(0x01), 0x1p-9f);
  EXPECT_EQ(f8_e4m3_to_float(0x07), 7 * 0x1p-9f);
  EXPECT_EQ(f8_e4m3_to_float(0x08), 0x1p-6f);
  EXPECT_EQ(f8_e4m3_to_float(0x38), 1.f);
  EXPECT_EQ(f8_e4m3_to_float(0x00), 0.f);
  EXPECT_TRUE(std::signbit(f8_e4m3_to_float(0x80)));
  EXPECT_TRUE(std::isnan(f8_e4m3_to_float(0x7f)) && std::isnan(f8_e4m3_to_float(0xff)));
}

// [300, 200] → scales [3, 2]: the last block row holds 44 rows, the last
// block column 72 columns.
TEST_F(SafetensorsSetTest, DequantisesRaggedBlocksExactly) {
  const std::int64_t M = 300, N = 200;
  std::mt19937 rng(26);
  std::string codes(M * N, '\0');
  for (char& c : codes) {
    std::uint8_t v = static_cast<std::uint8_t>(rng());
    if ((v & 0x7f) == 0x7f) v = 0x7e;  // no NaN codes in a weight
    c = static_cast<char>(v);
  }
  const std::vector<float> scale = {0.5f, 3.0e-3f, 1.7f, 2.5e-4f, 0.1f, 7.f};
  write_file(at("w.safetensors"), {{"w.weight", "F8_E4M3", {M, N}, codes, {}},
                                   {"w.weight_scale_inv", "F32", {3, 2}, f32_bytes(scale), {}}});
  const SafetensorsSet set = SafetensorsSet::open(at("w.safetensors"));
  Tensor<float> y({M, N});
  set.read_into("w.weight", y);
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) {
      const int code = static_cast<std::uint8_t>(codes[static_cast<std::size_t>(i * N + j)]);
      const float want = static_cast<float>(reference_e4m3(code)) * scale[(i / 128) * 2 + j / 128];
      ASSERT_EQ(y[i * N + j], want) << "at [" << i << ", " << j << "] code " << code;
    }
  // The plain reader still refuses fp8 alone, naming the scale it needs.
  expect_error([&] { (void)SafetensorsFile::open(at("w.safetensors")).read<float>("w.weight"); },
               {"w.weight", "F8_E4M3", "w.weight_scale_inv"});
}

TEST_F(SafetensorsSetTest, RefusesBadScales) {
  const std::string codes(300 * 200, '\x38');
  const auto file_with = [&](const std::string& name, const Entry& scale) {
    write_file(at(name), {{"w.weight", "F8_E4M3", {300, 200}, codes, {}}, scale});
    return SafetensorsSet::open(at(name));
  };
  Tensor<float> y({300, 200});
  // Wrong shapes: [3, 1] and [2, 2] where [3, 2] is needed.
  expect_error(
      [&] {
        file_with("a.st", {"w.weight_scale_inv", "F32", {3, 1}, "", {}}).read_into("w.weight", y);
      },
      {"a.st", "w.weight_scale_inv", "[3, 1]", "[3, 2]"});
  expect_error(
      [&] {
        file_with("b.st", {"w.weight_scale_inv", "F32", {2, 2}, "", {}}).read_into("w.weight", y);
      },
      {"w.weight_scale_inv", "[2, 2]", "[3, 2]"});
  expect_error(
      [&] {
        file_with("c.st", {"w.weight_scale_inv", "BF16", {3, 2}, "", {}}).read_into("w.weight", y);
      },
      {"w.weight_scale_inv", "BF16", "needs F32"});
  std::vector<float> bad = {1, 1, 1, INFINITY, 1, 1};
  expect_error(
      [&] {
        file_with("d.st", {"w.weight_scale_inv", "F32", {3, 2}, f32_bytes(bad), {}})
            .read_into("w.weight", y);
      },
      {"w.weight_scale_inv", "block [1, 1]", "finite"});
  bad[3] = NAN;
  expect_error(
      [&] {
        file_with("e.st", {"w.weight_scale_inv", "F32", {3, 2}, f32_bytes(bad), {}})
            .read_into("w.weight", y);
      },
      {"w.weight_scale_inv", "block [1, 1]", "finite"});
  // Every scale that is not a positive normal float whose block's codes
  // (448 the largest, 2^-9 the least) dequantise to normal floats: 0 (a
  // preallocated, partly downloaded shard: it ran to an all-zero output,
  // exit 0), -0, negative, subnormal, tiny, huge. Each names the file, the
  // scale and the block.
  const struct {
    float value;
    const char* why;
  } hostile[] = {{0.0f, "zero scale"},
                 {-0.0f, "zero scale"},
                 {-1e-3f, "must be positive"},
                 {-INFINITY, "must be finite"},
                 {1e-40f, "subnormal"},
                 {std::numeric_limits<float>::denorm_min(), "subnormal"},
                 {std::numeric_limits<float>::min(), "subnormal"},
                 {0x1p-118f, "subnormal"},
                 {1e36f, "inf"},
                 {0x1p120f, "inf"},
                 {std::numeric_limits<float>::max(), "inf"}};
  int n = 0;
  for (const auto& h : hostile) {
    bad = {1, 1, 1, h.value, 1, 1};
    std::string name = "s";
    name += std::to_string(n++);
    name += ".st";
    SCOPED_TRACE(testing::Message() << "scale " << h.value);
    expect_error(
        [&] {
          file_with(name, {"w.weight_scale_inv", "F32", {3, 2}, f32_bytes(bad), {}})
              .read_into("w.weight", y);
        },
        {name, "w.weight_scale_inv", "block [1, 1]", h.why, "[2^-117, 2^119]"});
  }
  // The bounds themselves are accepted, and dequantise to finite normal
  // floats (code 0x01 is 2^-9, 0x7e is 448).
  for (const float edge : {0x1p-117f, 0x1p119f}) {
    std::string edge_codes(300 * 200, '\x38');
    edge_codes[0] = '\x01', edge_codes[1] = '\x7e';
    write_file(at("edge.st"), {{"w.weight", "F8_E4M3", {300, 200}, edge_codes, {}},
                               {"w.weight_scale_inv",
                                "F32",
                                {3, 2},
                                f32_bytes({edge, edge, edge, edge, edge, edge}),
                                {}}});
    SafetensorsSet::open(at("edge.st")).read_into("w.weight", y);
    EXPECT_TRUE(std::isnormal(y[0]) && std::isnormal(y[1])) << y[0] << " " << y[1];
  }
  // No scale at all.
  write_file(at("f.st"), {{"w.weight", "F8_E4M3", {300, 200}, codes, {}}});
  expect_error([&] { SafetensorsSet::open(at("f.st")).read_into("w.weight", y); },
               {"f.st", "w.weight", "no 'w.weight_scale_inv'"});
  // A scale without its weight: refused at open, by name.
  write_file(at("g.st"), {{"v.weight", "F32", {2}, f32_bytes({1, 2}), {}},
                          {"w.weight_scale_inv", "F32", {3, 2}, "", {}}});
  expect_error([&] { (void)SafetensorsSet::open(at("g.st")); },
               {"g.st", "w.weight_scale_inv", "no weight 'w.weight'"});
  // A scale beside a weight that is not fp8.
  write_file(at("h.st"), {{"w.weight", "BF16", {300, 200}, "", {}},
                          {"w.weight_scale_inv", "F32", {3, 2}, "", {}}});
  expect_error([&] { SafetensorsSet::open(at("h.st")).read_into("w.weight", y); },
               {"w.weight", "BF16", "not F8_E4M3"});
  // Block scales are for matrices: an fp8 vector is refused, whatever its scale.
  write_file(at("j.st"), {{"v.weight", "F8_E4M3", {4}, "\x38\x38\x38\x38", {}},
                          {"v.weight_scale_inv", "F32", {1}, f32_bytes({1}), {}}});
  Tensor<float> v({4});
  expect_error([&] { SafetensorsSet::open(at("j.st")).read_into("v.weight", v); },
               {"v.weight", "F8_E4M3 of shape [4]", "only matrices"});
  // The destination's shape is checked before anything is read.
  Tensor<float> wrong({200, 300});
  expect_error(
      [&] {
        file_with("i.st", {"w.weight_scale_inv", "F32", {3, 2}, "", {}})
            .read_into("w.weight", wrong);
      },
      {"w.weight", "[300, 200]", "[200, 300]"});
}

// One DeepSeek-V3 layer (layer 5) in the real layout over three shards plus
// the index; shard 3 holds layer 6 and is garbage, so reading it would fail.
class V3Layer : public SafetensorsSetTest {
 protected:
  void SetUp() override {
    SafetensorsSetTest::SetUp();
    const std::string p = "model.layers.5.self_attn.";
    // kv_a_proj_with_mqa [576, 7168]: 576 = 4·128 + 64, a ragged last block
    // row. Codes written in it: row 0 col 0, and row 575 col 7167 (the last
    // block [4, 55]); the rest are zeros.
    std::vector<float> kv_scale(5 * 56, 1.f);
    kv_scale[0] = 0.25f;
    kv_scale[4 * 56 + 55] = 3.f;
    const std::uint64_t last = 575ull * 7168 + 7167;
    write_file(
        at("model-00001-of-00003.safetensors"),
        {{p + "q_a_proj.weight", "F8_E4M3", {1536, 7168}, "", {}},
         {p + "q_a_proj.weight_scale_inv", "F32", {12, 56}, "", {}},
         {p + "q_a_layernorm.weight", "BF16", {1536}, "", {{0, io_test::le_bytes_u16({0x3f80})}}},
         {p + "q_b_proj.weight", "F8_E4M3", {24576, 1536}, "", {}},
         {p + "q_b_proj.weight_scale_inv", "F32", {192, 12}, "", {}}});
    write_file(
        at("model-00002-of-00003.safetensors"),
        {{p + "kv_a_proj_with_mqa.weight",
          "F8_E4M3",
          {576, 7168},
          "",
          {{0, "\x38"}, {last, "\x7e"}}},
         {p + "kv_a_proj_with_mqa.weight_scale_inv", "F32", {5, 56}, f32_bytes(kv_scale), {}},
         {p + "kv_a_layernorm.weight",
          "BF16",
          {512},
          "",
          {{1022, io_test::le_bytes_u16({0xc000})}}},
         {p + "kv_b_proj.weight", "F8_E4M3", {32768, 512}, "", {}},
         {p + "kv_b_proj.weight_scale_inv", "F32", {256, 4}, "", {}},
         {p + "o_proj.weight", "F8_E4M3", {7168, 16384}, "", {}},
         {p + "o_proj.weight_scale_inv", "F32", {56, 128}, "", {}}});
    io_test::write_bytes(at("model-00003-of-00003.safetensors"), "not a safetensors file");
    std::vector<std::pair<std::string, std::string>> map;
    for (const char* t : {"q_a_proj.weight", "q_a_proj.weight_scale_inv", "q_a_layernorm.weight",
                          "q_b_proj.weight", "q_b_proj.weight_scale_inv"})
      map.push_back({p + t, "model-00001-of-00003.safetensors"});
    for (const char* t : {"kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.weight_scale_inv",
                          "kv_a_layernorm.weight", "kv_b_proj.weight", "kv_b_proj.weight_scale_inv",
                          "o_proj.weight", "o_proj.weight_scale_inv"})
      map.push_back({p + t, "model-00002-of-00003.safetensors"});
    for (const char* t : {"q_a_proj.weight", "q_a_proj.weight_scale_inv", "o_proj.weight",
                          "o_proj.weight_scale_inv"})
      map.push_back(
          {std::string("model.layers.6.self_attn.") + t, "model-00003-of-00003.safetensors"});
    index_ = index_json(map);
    io_test::write_bytes(at(SafetensorsSet::kIndexName), index_);
  }
  std::string index_;
};

TEST_F(V3Layer, ReadsOneLayerThroughTheIndexOrTheDirectory) {
  const std::string p = "model.layers.5.self_attn.";
  for (const std::string& path : {dir_.string(), at(SafetensorsSet::kIndexName)}) {
    const SafetensorsSet set = SafetensorsSet::open(path);
    EXPECT_EQ(set.path(), at(SafetensorsSet::kIndexName));
    EXPECT_TRUE(set.contains("model.layers.6.self_attn.o_proj.weight"));
    EXPECT_EQ(set.info(p + "o_proj.weight").shape, Shape({7168, 16384}));
    EXPECT_EQ(set.info(p + "q_b_proj.weight_scale_inv").shape, Shape({192, 12}));
    EXPECT_EQ(set.info(p + "kv_b_proj.weight").dtype, "F8_E4M3");

    Tensor<float> kv_a({576, 7168});
    set.read_into(p + "kv_a_proj_with_mqa.weight", kv_a);
    EXPECT_EQ(kv_a[0], 0.25f);                   // 1.0 · s[0, 0]
    EXPECT_EQ(kv_a[575 * 7168 + 7167], 1344.f);  // 448 · s[4, 55], the ragged corner
    EXPECT_EQ(kv_a[575 * 7168 + 7166], 0.f);
    Tensor<float> norm({512});
    set.read_into(p + "kv_a_layernorm.weight", norm);
    EXPECT_EQ(norm[511], -2.f);  // BF16 as it is
    Tensor<float> q_norm({1536});
    set.read_into(p + "q_a_layernorm.weight", q_norm);
    EXPECT_EQ(q_norm[0], 1.f);
    // Layer 6's shard (garbage) was never opened: asking for it now fails.
    expect_error([&] { (void)set.info("model.layers.6.self_attn.o_proj.weight"); },
                 {"model-00003-of-00003.safetensors"});
  }
}

// Issue 54 A: every file of the set, opened or not, for the tools to protect.
TEST_F(V3Layer, ListsTheIndexAndEveryShard) {
  const SafetensorsSet set = SafetensorsSet::open(dir_.string());
  const std::vector<std::pair<std::string, std::string>> want = {
      {at(SafetensorsSet::kIndexName), "index"},
      {at("model-00001-of-00003.safetensors"), "shard"},
      {at("model-00002-of-00003.safetensors"), "shard"},
      {at("model-00003-of-00003.safetensors"), "shard"}};
  EXPECT_EQ(set.files(), want);
}

TEST_F(V3Layer, RefusesAWrongScaleShapeAtV3Dims) {
  const std::string p = "model.layers.5.self_attn.";
  // kv_a_proj_with_mqa's scale without its ragged last block row: [4, 56]
  // (576 / 128 rounded down), not [5, 56].
  write_file(at("model-00002-of-00003.safetensors"),
             {{p + "kv_a_proj_with_mqa.weight", "F8_E4M3", {576, 7168}, "", {}},
              {p + "kv_a_proj_with_mqa.weight_scale_inv", "F32", {4, 56}, "", {}},
              {p + "kv_a_layernorm.weight", "BF16", {512}, "", {}},
              {p + "kv_b_proj.weight", "F8_E4M3", {32768, 512}, "", {}},
              {p + "kv_b_proj.weight_scale_inv", "F32", {256, 4}, "", {}},
              {p + "o_proj.weight", "F8_E4M3", {7168, 16384}, "", {}},
              {p + "o_proj.weight_scale_inv", "F32", {56, 128}, "", {}}});
  Tensor<float> kv_a({576, 7168});
  expect_error(
      [&] { SafetensorsSet::open(dir_.string()).read_into(p + "kv_a_proj_with_mqa.weight", kv_a); },
      {"model-00002-of-00003.safetensors", p + "kv_a_proj_with_mqa.weight_scale_inv", "[4, 56]",
       "[5, 56]"});
}

TEST_F(V3Layer, RefusesInconsistentIndexes) {
  const std::string p = "model.layers.5.self_attn.";
  const std::string shard2 = "model-00002-of-00003.safetensors";
  // Listed twice (a JSON object with a duplicated key names two shards).
  std::string twice = index_;
  twice.insert(twice.find("\"weight_map\":{") + 14,
               "\"" + p + "o_proj.weight\":\"model-00001-of-00003.safetensors\",");
  io_test::write_bytes(at(SafetensorsSet::kIndexName), twice);
  expect_error([&] { (void)SafetensorsSet::open(dir_.string()); },
               {SafetensorsSet::kIndexName, p + "o_proj.weight", "listed twice",
                "'model-00001-of-00003.safetensors'", "'model-00002-of-00003.safetensors'"});
  // A repeated key elsewhere is named as a key, not as a tensor.
  std::string meta = index_;
  meta.replace(meta.find("{\"total_size\":0}"), 16, "{\"total_size\":0,\"total_size\":1}");
  io_test::write_bytes(at(SafetensorsSet::kIndexName), meta);
  expect_error([&] { (void)SafetensorsSet::open(dir_.string()); },
               {"key 'total_size' appears twice"});

  // Listed in a shard that lacks it.
  std::string moved = index_;
  const std::string entry = "\"" + p + "kv_a_layernorm.weight\":\"" + shard2 + "\"";
  moved.replace(moved.find(entry), entry.size(),
                "\"" + p + "kv_a_layernorm.weight\":\"model-00001-of-00003.safetensors\"");
  io_test::write_bytes(at(SafetensorsSet::kIndexName), moved);
  {
    const SafetensorsSet set = SafetensorsSet::open(dir_.string());
    Tensor<float> norm({512});
    // Shard 1 is opened first (q_a_layernorm), then kv_a_layernorm is missing from it.
    Tensor<float> q_norm({1536});
    set.read_into(p + "q_a_layernorm.weight", q_norm);
    expect_error(
        [&] { set.read_into(p + "kv_a_layernorm.weight", norm); },
        {p + "kv_a_layernorm.weight", "model-00001-of-00003.safetensors", "does not hold it"});
    // And shard 2, opened for another tensor, holds it although the index
    // places it in shard 1: present in two places.
    expect_error(
        [&] { (void)set.info(p + "kv_b_proj.weight"); },
        {p + "kv_a_layernorm.weight", shard2, "model-00001-of-00003.safetensors", "one shard"});
  }

  // Shard paths that leave the directory.
  for (const std::string& shard :
       {std::string("../outside.safetensors"), std::string("/etc/passwd"),
        std::string("sub/../../x.safetensors"), std::string("")}) {
    io_test::write_bytes(at(SafetensorsSet::kIndexName),
                         index_json({{p + "o_proj.weight", shard}}));
    expect_error([&] { (void)SafetensorsSet::open(dir_.string()); },
                 {p + "o_proj.weight", "'" + shard + "'", "inside the index's directory"});
  }
  // Malformed.
  for (const auto& [text, fragment] : std::vector<std::pair<std::string, std::string>>{
           {"{\"weight_map\": {", "not valid JSON"},
           {"[1]", "not an object"},
           {"{\"metadata\": {}}", "no \"weight_map\""},
           {"{\"weight_map\": {\"a\": 3}}", "'a' maps to a JSON number"}}) {
    io_test::write_bytes(at(SafetensorsSet::kIndexName), text);
    expect_error([&] { (void)SafetensorsSet::open(dir_.string()); },
                 {SafetensorsSet::kIndexName, fragment});
  }
}

TEST_F(SafetensorsSetTest, DirectoryWithoutAnIndex) {
  expect_error([&] { (void)SafetensorsSet::open(dir_.string()); },
               {dir_.string(), "neither", SafetensorsSet::kIndexName});
  write_file(at("only.safetensors"), {{"w.weight", "F32", {2}, f32_bytes({1, 2}), {}}});
  const SafetensorsSet set = SafetensorsSet::open(dir_.string());
  EXPECT_EQ(set.path(), at("only.safetensors"));
  const std::vector<std::pair<std::string, std::string>> one = {{at("only.safetensors"), "file"}};
  EXPECT_EQ(set.files(), one);
  Tensor<float> w({2});
  set.read_into("w.weight", w);
  EXPECT_EQ(w[1], 2.f);
  write_file(at("other.safetensors"), {{"v.weight", "F32", {2}, f32_bytes({1, 2}), {}}});
  expect_error([&] { (void)SafetensorsSet::open(dir_.string()); },
               {"2 .safetensors files", at("only.safetensors"), at("other.safetensors"),
                "give the index or one file"});
}

}  // namespace
}  // namespace laga
