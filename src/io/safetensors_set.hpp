// SafetensorsSet — the tensors of a checkpoint as --weights names it: one
// .safetensors file, a Hugging Face sharded checkpoint (its
// model.safetensors.index.json, or the directory holding it), or a directory
// holding exactly one .safetensors file.
//
// A sharded checkpoint (DeepSeek-V3's is ~700 GB in 163 shards) is read
// lazily: open() parses only the index; a shard is opened (its header only,
// SafetensorsFile::open) the first time a tensor it holds is asked for, and
// reads are positional, so loading one layer touches only that layer's bytes.
//
// read_into() reads what SafetensorsFile::read_into does (F32, F64, BF16,
// F16) and also DeepSeek's block-scaled fp8: a weight X [M, N] stored as
// F8_E4M3 beside an F32 X_scale_inv [ceil(M/128), ceil(N/128)] reads as
// y[i, j] = float(x[i, j]) · s[i / 128, j / 128], which is what DeepSeek's
// weight_dequant (inference/kernel.py) computes in float32.
//
// Refused, each naming the file, the tensor and what to do: a malformed
// index; a shard path that is absolute or climbs out of the index's directory;
// a tensor listed twice in the index, or held by an opened shard the index
// does not attribute it to (present in two shards); a tensor the index lists
// but whose shard lacks it; an fp8 weight without its scale, a scale without
// its weight (checked over every name at open), a scale of the wrong dtype or
// shape, a non-finite scale, a scale beside a weight that is not fp8.
//
// Not for concurrent use: the shards opened so far are cached in the object.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.hpp"

namespace laga {

// DeepSeek-V3's quantisation block (config.json "weight_block_size").
inline constexpr std::int64_t kFp8BlockSize = 128;

class SafetensorsSet {
 public:
  static constexpr const char* kIndexName = "model.safetensors.index.json";
  static constexpr const char* kScaleSuffix = "_scale_inv";

  // A .safetensors file, an index (*.json), or a directory (see above).
  static SafetensorsSet open(const std::string& path);

  // The index's weight_map (tensor name → shard path relative to the index's
  // directory), validated; `where` names the index in errors. Public for the
  // fuzzer.
  static std::map<std::string, std::string> parse_index(const std::string& where,
                                                        const std::string& text);

  // The index, or the single file.
  const std::string& path() const { return path_; }
  // Every file the set is made of: the single file, or the index and each
  // shard it names (opened or not), as (path, "index" | "shard" | "file").
  // What a tool protects from its outputs (issue 54 A).
  std::vector<std::pair<std::string, std::string>> files() const;
  bool contains(const std::string& name) const;
  // Every tensor name the file or the index lists, sorted.
  std::vector<std::string> names() const;
  // Opens the shard holding `name` if it is not open yet.
  const SafetensorsTensorInfo& info(const std::string& name) const;
  // The stored shape must equal destination's; an F8_E4M3 weight is
  // dequantised with its scale. Under a count-only pool everything is
  // checked but nothing is read.
  void read_into(const std::string& name, Tensor<float>& destination) const;
  // The same into double: F64 exactly, other dtypes widened (an fp8 weight
  // dequantised in float first, as the float read does, then widened).
  void read_into(const std::string& name, Tensor<double>& destination) const;

 private:
  SafetensorsSet() = default;
  const SafetensorsFile& file_of(const std::string& name) const;
  void check_scales_have_weights() const;
  void read_fp8_into(const SafetensorsFile& file, const std::string& name,
                     Tensor<float>& destination) const;

  std::string path_;
  std::string directory_;                                  // the index's; empty for one file
  std::map<std::string, std::string> weight_map_;          // empty for one file
  std::optional<SafetensorsFile> single_;                  // set for one file
  mutable std::map<std::string, SafetensorsFile> shards_;  // opened so far, by shard path
};

}  // namespace laga
