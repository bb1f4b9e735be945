#include "model/checkpoint_manifest.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "core/error.hpp"

namespace laga {

namespace fs = std::filesystem;

namespace {

constexpr const char* kManifestHashKey = "manifest_fnv1a64";

constexpr std::uint64_t kFnvOffset = 1469598103934665603ull;
std::uint64_t fnv1a64(std::uint64_t h, std::string_view bytes) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Why j's fields cannot be read as a manifest's, or "" when they can: each
// present and of its type and range, so that reading them cannot throw.
std::string field_problem(const nlohmann::json& j) {
  for (const char* key : {kManifestHashKey, "file", "fnv1a64"})
    if (!j.contains(key) || !j.at(key).is_string())
      return cat("'", key, "' is missing or not a string");
  // JSON has one number type, and nlohmann converts a fraction, a negative
  // number or one past int64 silently (a fraction past int64's range is
  // undefined behaviour), so the kind and range are checked here: each is a
  // whole number >= 0 (the parser keeps those as unsigned), and all but the
  // seed (a uint64) fit an int64.
  for (const char* key : {"bytes", "step", "data_cursor", "seed"}) {
    if (!j.contains(key)) return cat("'", key, "' is missing");
    const nlohmann::json& v = j.at(key);
    const bool fits = v.is_number_unsigned() &&
                      (std::string_view(key) == "seed" ||
                       v.get<std::uint64_t>() <=
                           static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
    if (!fits) return cat("'", key, "' is ", v.dump(), ", not a whole number >= 0");
  }
  // The tensors file is written beside its manifest: a name with a directory
  // part would read some other file.
  const std::string file = j.at("file").get<std::string>();
  if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos)
    return cat("'file' is '", file, "', not the name of a file beside the manifest");
  if (!j.contains("model") || !j.at("model").is_object())
    return "'model' is missing or not an object";
  if (!j.contains("options") || !j.at("options").is_object())
    return "'options' is missing or not an object";
  for (const auto& [name, value] : j.at("options").items())
    if (!value.is_string()) return cat("option '", name, "' is ", value.dump(), ", not a string");
  return "";
}

}  // namespace

std::string fnv1a64_hex(std::uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::uint64_t fnv1a64(std::string_view bytes) {
  return fnv1a64(kFnvOffset, bytes);
}

std::uint64_t file_fnv1a64(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LAGA_CHECK(in, "cannot open '", path, "' to hash its contents; check its permissions");
  std::uint64_t h = kFnvOffset;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    h = fnv1a64(h, std::string_view(buf.data(), static_cast<size_t>(in.gcount())));
  }
  return h;
}

std::string checkpoint_manifest_hash(const nlohmann::json& manifest) {
  nlohmann::json j = manifest;
  if (j.is_object()) j.erase(kManifestHashKey);
  return fnv1a64_hex(fnv1a64(kFnvOffset, j.dump()));
}

std::string format_checkpoint_manifest(const CheckpointManifest& m) {
  nlohmann::json j;
  j["format"] = kCheckpointFormat;
  j["step"] = m.step;
  j["data_cursor"] = m.data_cursor;
  j["seed"] = m.seed;
  j["file"] = fs::path(m.tensors).filename().string();
  j["bytes"] = m.tensors_bytes;
  j["fnv1a64"] = m.tensors_fnv1a64;
  j["model"] = nlohmann::json::parse(m.model_json);
  j["options"] = m.options;
  j[kManifestHashKey] = checkpoint_manifest_hash(j);
  return j.dump(2) + "\n";
}

CheckpointManifest parse_checkpoint_manifest(const std::string& text, const std::string& path,
                                             const std::string& if_damaged) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint manifest '", path, "' is not valid JSON (", e.what(),
         "); it is damaged: ", if_damaged);
  }
  const std::string format = j.is_object() && j.contains("format") && j["format"].is_string()
                                 ? j["format"].get<std::string>()
                                 : "";
  LAGA_CHECK(format != "laga-train-checkpoint-1", "checkpoint manifest '", path,
             "' is of format 1, which records neither the run's options nor a hash of itself, so "
             "it cannot be resumed safely; resume it with the laga version that wrote it, or start "
             "a new run");
  LAGA_CHECK(format == kCheckpointFormat, "checkpoint manifest '", path,
             "' is not a laga training checkpoint (format '", format, "')");
  const std::string problem = field_problem(j);
  LAGA_CHECK(problem.empty(), "checkpoint manifest '", path,
             "' lacks a field or has one of the wrong type (", problem,
             "); it is damaged: ", if_damaged);
  const std::string recorded = j.at(kManifestHashKey).get<std::string>();
  const std::string actual = checkpoint_manifest_hash(j);
  LAGA_CHECK(recorded == actual, "checkpoint manifest '", path,
             "' was changed after it was written (its hash is ", actual, ", it records ", recorded,
             "): its step, data cursor or options were edited or damaged; ", if_damaged);
  CheckpointManifest m;
  m.path = path;
  m.tensors = (fs::path(path).parent_path() / j.at("file").get<std::string>()).string();
  m.tensors_bytes = j.at("bytes").get<std::int64_t>();
  m.tensors_fnv1a64 = j.at("fnv1a64").get<std::string>();
  m.step = j.at("step").get<std::int64_t>();
  m.data_cursor = j.at("data_cursor").get<std::int64_t>();
  m.seed = j.at("seed").get<std::uint64_t>();
  m.options = j.at("options").get<CheckpointOptions>();
  m.model_json = j.at("model").dump();
  return m;
}

}  // namespace laga
