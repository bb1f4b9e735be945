// libFuzzer target: parse_checkpoint_manifest, the parser of a training
// checkpoint's manifest (model/checkpoint_manifest.hpp). Each input is parsed
// as it is, and, when it is a JSON object, once more with its self-hash made
// right: a mutation almost never keeps the recorded FNV-1a of the rest, so
// without the second parse the field checks behind the hash check would
// hardly run. A laga::Error is the expected answer to a bad manifest; an
// accepted one must format back to text that parses to the same manifest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.hpp"
#include "model/checkpoint_manifest.hpp"

namespace {

void parse_and_check(const std::string& text) {
  const std::string path = "run/step-00000001.json";
  try {
    const laga::CheckpointManifest m = laga::parse_checkpoint_manifest(text, path, "fuzz");
    const laga::CheckpointManifest again =
        laga::parse_checkpoint_manifest(laga::format_checkpoint_manifest(m), path, "fuzz");
    if (again.tensors != m.tensors || again.tensors_bytes != m.tensors_bytes ||
        again.tensors_fnv1a64 != m.tensors_fnv1a64 || again.step != m.step ||
        again.data_cursor != m.data_cursor || again.seed != m.seed || again.options != m.options ||
        again.model_json != m.model_json)
      std::abort();
  } catch (const laga::Error&) {
    // refused with a message
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  parse_and_check(text);
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_object()) {
    j["manifest_fnv1a64"] = laga::checkpoint_manifest_hash(j);
    parse_and_check(j.dump());
  }
  return 0;
}
