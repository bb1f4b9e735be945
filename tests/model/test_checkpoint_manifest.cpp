// The checkpoint manifest's parser (model/checkpoint_manifest.hpp), on text:
// a manifest formats and parses back to itself; every field of the wrong
// kind or range is refused naming it, even with a correct self-hash (which
// anyone can recompute), so nothing past the hash is trusted blindly.
#include "model/checkpoint_manifest.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/error_of.hpp"
#include "core/error.hpp"

namespace laga {
namespace {

const char* const kPath = "ck/step-00000004.json";

CheckpointManifest sample() {
  CheckpointManifest m;
  m.tensors = "ck/step-00000004.safetensors";
  m.tensors_bytes = 4096;
  m.tensors_fnv1a64 = "00112233aabbccdd";
  m.step = 4;
  m.data_cursor = 8;
  m.seed = 18446744073709551615ull;  // a uint64 seed uses its whole range
  m.options = {{"lr", "0.001"}, {"seq", "16"}};
  m.model_json = R"({"dim":32,"n_layers":1,"norm_eps":1e-06})";
  return m;
}

using test::error_of;

// The sample's text with `edit` applied, and with the self-hash made right
// again when `reseal`.
std::string edited(const std::function<void(nlohmann::json&)>& edit, bool reseal = true) {
  nlohmann::json j = nlohmann::json::parse(format_checkpoint_manifest(sample()));
  edit(j);
  if (reseal) j["manifest_fnv1a64"] = checkpoint_manifest_hash(j);
  return j.dump();
}

TEST(CheckpointManifest, FormatsAndParsesBack) {
  const CheckpointManifest a = sample();
  const CheckpointManifest b = parse_checkpoint_manifest(format_checkpoint_manifest(a), kPath, "");
  EXPECT_EQ(b.path, kPath);
  EXPECT_EQ(b.tensors, a.tensors);
  EXPECT_EQ(b.tensors_bytes, a.tensors_bytes);
  EXPECT_EQ(b.tensors_fnv1a64, a.tensors_fnv1a64);
  EXPECT_EQ(b.step, a.step);
  EXPECT_EQ(b.data_cursor, a.data_cursor);
  EXPECT_EQ(b.seed, a.seed);
  EXPECT_EQ(b.options, a.options);
  EXPECT_EQ(nlohmann::json::parse(b.model_json), nlohmann::json::parse(a.model_json));
}

TEST(CheckpointManifest, NotJsonForeignAndEditedAreRefused) {
  EXPECT_NE(error_of([] {
              parse_checkpoint_manifest("{ not json", kPath, "resume X");
            }).find("is not valid JSON"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_checkpoint_manifest(R"({"format": "laga-train-checkpoint-1"})", kPath, "");
            }).find("is of format 1"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_checkpoint_manifest("[1, 2]", kPath, "");
            }).find("is not a laga training checkpoint"),
            std::string::npos);
  const std::string text = edited([](nlohmann::json& j) { j["step"] = 2; }, false);
  const std::string e = error_of([&] { parse_checkpoint_manifest(text, kPath, "resume X"); });
  EXPECT_NE(e.find("was changed after it was written"), std::string::npos) << e;
  EXPECT_NE(e.find("resume X"), std::string::npos) << e;
}

// Each was accepted by the parser as it stood inside read_checkpoint_manifest:
// a fraction or a number past int64 read as some integer (past int64's range
// undefined behaviour), a negative seed as 2^64 - 1, and a tensors file with a
// directory part read a file outside the checkpoint's directory (what the
// fuzz target found: tests/fuzz/corpus/manifest/file_with_directory_part.json).
TEST(CheckpointManifest, FieldsOfTheWrongKindOrRangeAreRefusedEvenWhenResealed) {
  struct Edit {
    std::string field;
    std::function<void(nlohmann::json&)> apply;
    bool reseal = true;
  };
  const std::vector<Edit> edits = {
      {"'step'", [](nlohmann::json& j) { j["step"] = 2.5; }},
      {"'step'", [](nlohmann::json& j) { j["step"] = -1; }},
      {"'step'", [](nlohmann::json& j) { j["step"] = 1e300; }},
      {"'step'", [](nlohmann::json& j) { j["step"] = "4"; }},
      {"'data_cursor'", [](nlohmann::json& j) { j["data_cursor"] = 9223372036854775808ull; }},
      {"'bytes'", [](nlohmann::json& j) { j["bytes"] = -4096; }},
      {"'seed'", [](nlohmann::json& j) { j["seed"] = -1; }},
      {"'seed'", [](nlohmann::json& j) { j["seed"] = 0.5; }},
      {"'file'", [](nlohmann::json& j) { j["file"] = "../other/step-00000004.safetensors"; }},
      {"'file'", [](nlohmann::json& j) { j["file"] = "/etc/passwd"; }},
      {"'file'", [](nlohmann::json& j) { j["file"] = ""; }},
      {"'file'", [](nlohmann::json& j) { j["file"] = 7; }},
      {"'fnv1a64'", [](nlohmann::json& j) { j.erase("fnv1a64"); }},
      {"option 'lr'", [](nlohmann::json& j) { j["options"]["lr"] = 0.001; }},
      {"'options'", [](nlohmann::json& j) { j["options"] = "lr=0.001"; }},
      {"'model'", [](nlohmann::json& j) { j["model"] = 32; }},
      {"'manifest_fnv1a64'", [](nlohmann::json& j) { j.erase("manifest_fnv1a64"); }, false},
  };
  for (const Edit& edit : edits) {
    const std::string text = edited(edit.apply, edit.reseal);
    const std::string e = error_of([&] { parse_checkpoint_manifest(text, kPath, "resume X"); });
    EXPECT_NE(e.find("lacks a field or has one of the wrong type"), std::string::npos)
        << text << "\n"
        << e;
    EXPECT_NE(e.find(edit.field), std::string::npos) << text << "\n" << e;
    EXPECT_NE(e.find("resume X"), std::string::npos) << e;
  }
  // The fuzz target's input, resealed as the target does.
  const char* src = std::getenv("LAGA_SOURCE_DIR");
  ASSERT_NE(src, nullptr);
  std::ifstream in(std::string(src) + "/tests/fuzz/corpus/manifest/file_with_directory_part.json");
  std::stringstream found;
  found << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(found.str());
  j["manifest_fnv1a64"] = checkpoint_manifest_hash(j);
  const std::string e = error_of([&] { parse_checkpoint_manifest(j.dump(), kPath, ""); });
  EXPECT_NE(e.find("'file' is 'step-00beta13/safetensors'"), std::string::npos) << e;
}

}  // namespace
}  // namespace laga
