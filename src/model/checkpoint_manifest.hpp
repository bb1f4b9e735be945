// The manifest of a training checkpoint (DIR/step-<N>.json and its copy
// DIR/latest.json, checkpoint.hpp): what it records, its text, and the one
// parser every reader of a manifest goes through. Pure functions of text (no
// file is read), so the parser is fuzzed on its own (tests/fuzz/
// fuzz_manifest.cpp) and needs nothing of the model.
//
// The text is JSON: {"format": "laga-train-checkpoint-2", "step", "data_cursor",
// "seed", "file" (the tensors file beside the manifest), "bytes" and
// "fnv1a64" (that file's size and FNV-1a 64), "model" (LmConfig::to_json),
// "options" (CheckpointOptions), "manifest_fnv1a64" (checkpoint_manifest_hash
// of the rest)}.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace laga {

// The format a manifest (and its tensors file's metadata) names. Format 2
// added the run's options and the manifest's own hash; format 1 manifests
// (neither) are refused, since their step and cursor are unverified.
inline constexpr const char* kCheckpointFormat = "laga-train-checkpoint-2";

// The run's options as recorded in a manifest: option name -> value text.
using CheckpointOptions = std::map<std::string, std::string>;

// A verified manifest (format, manifest hash); its tensors file is not read.
struct CheckpointManifest {
  std::string path;     // the manifest read (a step-*.json or latest.json)
  std::string tensors;  // the safetensors file it names, in path's directory
  std::int64_t tensors_bytes = 0;
  std::string tensors_fnv1a64;  // hex
  std::int64_t step = 0, data_cursor = 0;
  std::uint64_t seed = 0;
  CheckpointOptions options;
  std::string model_json;  // LmConfig::to_json().dump() of the run
};

// The manifest's text as save_checkpoint writes it, for m's fields (of
// m.tensors only the file name is kept: the tensors lie beside the manifest;
// m.path is not recorded). m.model_json must be a JSON object's text.
std::string format_checkpoint_manifest(const CheckpointManifest& m);

// Parses `text`, the content of the manifest at `path` (named in every
// message; the tensors file is taken in its directory). Refuses, with a
// laga::Error naming path, text that is not JSON, a manifest of another
// format (format 1 with why), one whose recorded hash is not that of its
// content (edited or damaged), and one lacking a field or holding one of the
// wrong type or range (a negative or fractional step, a tensors file outside
// its directory, ...). `if_damaged` ends the message of a damaged manifest:
// what to do instead (read_checkpoint_manifest names the previous checkpoint).
CheckpointManifest parse_checkpoint_manifest(const std::string& text, const std::string& path,
                                             const std::string& if_damaged);

// The hash a manifest records of itself ("manifest_fnv1a64"): FNV-1a 64, as
// 16 hex digits, of the canonical dump (sorted keys, no spaces) of its JSON
// without that field. It detects edits and damage; it is not a signature.
std::string checkpoint_manifest_hash(const nlohmann::json& manifest);

// FNV-1a 64 of a file's bytes (the manifest's integrity hash of its tensors
// file, and the identity of a --data file, and of every input MPI ranks
// compare), and of bytes in memory.
std::uint64_t file_fnv1a64(const std::string& path);
std::uint64_t fnv1a64(std::string_view bytes);
// h as 16 lower-case hex digits, as a manifest records it.
std::string fnv1a64_hex(std::uint64_t h);

}  // namespace laga
