#include "io/safetensors_set.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "io/json_repeated_keys.hpp"

namespace laga {

namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// DeepSeek-V3's index is ~9 MB; a larger file is not an index.
constexpr std::uintmax_t kMaxIndexBytes = 100'000'000;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string read_text(const std::string& path) {
  std::error_code ec;
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) fail("index '", path, "': cannot read it: ", ec.message(), "; check the path");
  LAGA_CHECK(size <= kMaxIndexBytes, "index '", path, "' is ", size,
             " bytes, more than the 100 MB an index can be; give model.safetensors.index.json");
  std::ifstream in(path, std::ios::binary);
  LAGA_CHECK(in.good(), "index '", path, "': cannot open it for reading; check its permissions");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A shard path must stay inside the index's directory: the index is data,
// and an index that says "../../etc/x" or "/x" must not choose what we open.
void check_shard_path(const std::string& where, const std::string& tensor,
                      const std::string& shard) {
  const fs::path p(shard);
  bool climbs = false;
  for (const fs::path& part : p) climbs = climbs || part == "..";
  LAGA_CHECK(!shard.empty() && !p.is_absolute() && !climbs, "index '", where, "': tensor '", tensor,
             "' is in shard '", shard,
             "', which is not a path inside the index's directory (empty, absolute or with "
             "'..'); the index is corrupt or not this checkpoint's");
}

}  // namespace

std::map<std::string, std::string> SafetensorsSet::parse_index(const std::string& where,
                                                               const std::string& text) {
  // nlohmann keeps the last of duplicated keys silently: a tensor listed
  // twice would name one of two shards unseen, so duplicates are refused.
  // (io/json_repeated_keys.hpp); the weight_map's keys are at depth 2, and
  // the shards a duplicated tensor is given are kept to name both.
  RepeatedKeys repeated;
  std::string top_key, entry_key;  // the keys at depth 1 and 2
  bool duplicate_is_tensor = false;
  std::map<std::string, std::string> first_shard;
  std::string second_shard;
  auto note_duplicates = [&](int depth, Json::parse_event_t event, Json& parsed) {
    const bool in_map = depth == 2 && top_key == "weight_map";
    const bool none_yet = repeated.first().empty();
    if (repeated.observe(event, parsed) && none_yet) duplicate_is_tensor = in_map;
    const std::string& duplicate = repeated.first();
    if (event == Json::parse_event_t::key) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (depth == 1) top_key = key;
      if (depth == 2) entry_key = key;
    } else if (event == Json::parse_event_t::value && in_map && parsed.is_string()) {
      const std::string& shard = parsed.get_ref<const std::string&>();
      if (entry_key == duplicate && duplicate_is_tensor && second_shard.empty())
        second_shard = shard;
      else
        first_shard.emplace(entry_key, shard);
    }
    return true;
  };
  Json index;
  try {
    index = Json::parse(text, note_duplicates);
  } catch (const Json::exception& e) {
    fail("index '", where, "' is not valid JSON (", e.what(),
         "); download model.safetensors.index.json again");
  }
  LAGA_CHECK(index.is_object(), "index '", where, "' is a JSON ", index.type_name(),
             ", not an object with a \"weight_map\"; give model.safetensors.index.json");
  const std::string& duplicate = repeated.first();
  if (duplicate_is_tensor) {
    fail("index '", where, "': tensor '", duplicate, "' is listed twice, in shard '",
         first_shard[duplicate], "' and in '", second_shard,
         "'; a tensor must be in one shard, download the index again");
  }
  LAGA_CHECK(duplicate.empty(), "index '", where, "': key '", duplicate,
             "' appears twice in one object; the index is corrupt, download it again");
  auto map = index.find("weight_map");
  LAGA_CHECK(map != index.end() && map->is_object(), "index '", where,
             "' has no \"weight_map\" object (tensor name -> shard file); it is not a "
             "safetensors index");
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, shard] : map->items()) {
    LAGA_CHECK(shard.is_string(), "index '", where, "': tensor '", tensor, "' maps to a JSON ",
               shard.type_name(), ", not a shard file name; the index is corrupt");
    check_shard_path(where, tensor, shard.get<std::string>());
    weight_map.emplace(tensor, shard.get<std::string>());
  }
  return weight_map;
}

SafetensorsSet SafetensorsSet::open(const std::string& path) {
  std::error_code ec;
  std::string index = path;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / kIndexName, ec)) {
      index = (dir / kIndexName).string();
    } else {
      std::vector<std::string> files;
      for (const auto& entry : fs::directory_iterator(dir, ec))
        if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
      LAGA_CHECK(!ec, "weights '", path, "': cannot list the directory: ", ec.message());
      std::sort(files.begin(), files.end());
      LAGA_CHECK(!files.empty(), "weights '", path, "': the directory holds neither ", kIndexName,
                 " nor a .safetensors file; give a checkpoint directory or file");
      std::string list;
      for (std::size_t k = 0; k < std::min<std::size_t>(files.size(), 8); ++k)
        list += (k ? ", '" : "'") + files[k] + "'";
      if (files.size() > 8) list += ", ...";
      LAGA_CHECK(files.size() == 1, "weights '", path, "': the directory holds ", files.size(),
                 " .safetensors files (", list, ") but no ", kIndexName,
                 " saying which tensor is where; give the index or one file");
      index = files.front();
    }
  }
  SafetensorsSet set;
  set.path_ = index;
  if (ends_with(index, ".json")) {
    // Built as one path and moved in: GCC 12's -Wrestrict misfires on
    // assigning "." to the string under -O2 with the sanitizers.
    const fs::path parent = fs::path(index).parent_path();
    set.directory_ = (parent.empty() ? fs::path(".") : parent).string();
    set.weight_map_ = parse_index(index, read_text(index));
  } else {
    set.single_ = SafetensorsFile::open(index);
  }
  set.check_scales_have_weights();
  return set;
}

std::vector<std::pair<std::string, std::string>> SafetensorsSet::files() const {
  std::vector<std::pair<std::string, std::string>> out;
  if (single_) {
    out.emplace_back(path_, "file");
    return out;
  }
  out.emplace_back(path_, "index");
  std::set<std::string> shards;
  for (const auto& entry : weight_map_) shards.insert(entry.second);
  for (const std::string& shard : shards)
    out.emplace_back((fs::path(directory_) / shard).string(), "shard");
  return out;
}

void SafetensorsSet::check_scales_have_weights() const {
  const auto check = [&](const std::string& name) {
    if (!ends_with(name, kScaleSuffix)) return;
    const std::string weight = name.substr(0, name.size() - std::strlen(kScaleSuffix));
    LAGA_CHECK(contains(weight), "weights '", path_, "': scale '", name, "' has no weight '",
               weight, "' beside it; the checkpoint is incomplete, download it again");
  };
  if (single_) {
    for (const std::string& name : single_->names()) check(name);
  } else {
    for (const auto& entry : weight_map_) check(entry.first);
  }
}

bool SafetensorsSet::contains(const std::string& name) const {
  return single_ ? single_->contains(name) : weight_map_.count(name) != 0;
}

std::vector<std::string> SafetensorsSet::names() const {
  if (single_) return single_->names();
  std::vector<std::string> out;
  out.reserve(weight_map_.size());
  for (const auto& entry : weight_map_) out.push_back(entry.first);
  return out;
}

const SafetensorsFile& SafetensorsSet::file_of(const std::string& name) const {
  if (single_) return *single_;
  auto listed = weight_map_.find(name);
  LAGA_CHECK(listed != weight_map_.end(), "weights '", path_, "': the index lists no tensor '",
             name, "'; check the name and that this is the right checkpoint");
  const std::string& shard = listed->second;
  auto open = shards_.find(shard);
  if (open == shards_.end()) {
    SafetensorsFile file = SafetensorsFile::open((fs::path(directory_) / shard).string());
    // A tensor this shard holds that the index places elsewhere is in two
    // shards: which copy is meant is unknowable, so neither is read.
    for (const std::string& held : file.names()) {
      auto placed = weight_map_.find(held);
      LAGA_CHECK(placed == weight_map_.end() || placed->second == shard, "weights '", path_,
                 "': tensor '", held, "' is in shard '", shard, "' and, per the index, in '",
                 placed->second, "'; a tensor must be in one shard, download the checkpoint again");
    }
    open = shards_.emplace(shard, std::move(file)).first;
  }
  LAGA_CHECK(open->second.contains(name), "weights '", path_, "': the index puts tensor '", name,
             "' in shard '", shard,
             "', which does not hold it; the index and the shards "
             "disagree, download the checkpoint again");
  return open->second;
}

const SafetensorsTensorInfo& SafetensorsSet::info(const std::string& name) const {
  return file_of(name).info(name);
}

void SafetensorsSet::read_into(const std::string& name, Tensor<float>& destination) const {
  const SafetensorsFile& file = file_of(name);
  const bool scaled = contains(name + kScaleSuffix);
  if (file.info(name).dtype == "F8_E4M3") return read_fp8_into(file, name, destination);
  LAGA_CHECK(!scaled, "weights '", file.path(), "': tensor '", name, "' has a scale '", name,
             kScaleSuffix, "' but dtype ", file.info(name).dtype,
             ", not F8_E4M3; a scale belongs to an fp8 weight, re-export the checkpoint");
  file.read_into(name, destination);
}

void SafetensorsSet::read_into(const std::string& name, Tensor<double>& destination) const {
  const SafetensorsFile& file = file_of(name);
  if (file.info(name).dtype != "F8_E4M3") {
    LAGA_CHECK(!contains(name + kScaleSuffix), "weights '", file.path(), "': tensor '", name,
               "' has a scale '", name, kScaleSuffix, "' but dtype ", file.info(name).dtype,
               ", not F8_E4M3; a scale belongs to an fp8 weight, re-export the checkpoint");
    return file.read_into(name, destination);
  }
  Tensor<float> narrow(destination.shape(), destination.category());
  read_fp8_into(file, name, narrow);
  if (!destination.data()) return;  // count-only: checked, not read
  for (std::int64_t i = 0; i < narrow.numel(); ++i) destination[i] = narrow[i];
}

namespace {

// What a block scale may be: one that dequantises every code of its block
// to a normal float. The least non-zero E4M3 magnitude is 2^-9 and the
// largest 448, so the scale must lie in [2^-117, 2^119] (~[6.0e-36,
// 6.6e35]; 448 x 2^119 is 1.75 x 2^127, below FLT_MAX); DeepSeek-V3's are
// ~1e-5 to 1e-1. Outside it: 0
// (what a preallocated, partly downloaded shard holds: every weight 0,
// the run finite and wrong), negative (every weight's sign flipped),
// subnormal or tiny (weights flushed or rounded to a few bits), huge (448 x
// scale overflows to inf), NaN or inf. Each is refused naming the file,
// the scale and its block; none is a checkpoint anyone exported.
void check_fp8_scales(const std::vector<float>& scale, std::int64_t R, std::int64_t C,
                      const std::string& path, const std::string& scale_name) {
  constexpr float kLeast = 0x1p-117f;
  constexpr float kMost = 0x1p119f;
  for (std::int64_t k = 0; k < R * C; ++k) {
    const float v = scale[static_cast<std::size_t>(k)];
    if (v >= kLeast && v <= kMost) continue;
    const char* why = !std::isfinite(v) ? "a scale must be finite"
                      : v == 0.0f
                          ? "a zero scale makes every weight of the block 0 (a preallocated or "
                            "partly downloaded shard holds zeros)"
                      : v < 0.0f ? "a scale must be positive (a negative one flips every weight's "
                                   "sign)"
                      : v < kLeast ? "a scale this small dequantises the block's weights to "
                                     "subnormal floats or 0"
                                   : "a scale this large dequantises the block's largest codes "
                                     "(448) to inf";
    fail("weights '", path, "': scale '", scale_name, "' block [", k / C, ", ", k % C, "] is ", v,
         "; ", why, "; a block scale must lie in [2^-117, 2^119] = [", kLeast, ", ", kMost,
         "]: the checkpoint is corrupt or incomplete, download it again");
  }
}

}  // namespace

void SafetensorsSet::read_fp8_into(const SafetensorsFile& file, const std::string& name,
                                   Tensor<float>& destination) const {
  const SafetensorsTensorInfo& w = file.info(name);
  LAGA_CHECK(w.shape == destination.shape(), "weights '", file.path(), "': tensor '", name,
             "' has shape ", to_string(w.shape), " but ", to_string(destination.shape()),
             " is expected; check that the checkpoint matches the model config");
  LAGA_CHECK(w.shape.size() == 2, "weights '", file.path(), "': tensor '", name,
             "' is F8_E4M3 of shape ", to_string(w.shape),
             "; laga dequantises only matrices [M, N] with 128x128 block scales");
  const std::string scale_name = name + kScaleSuffix;
  LAGA_CHECK(contains(scale_name), "weights '", file.path(), "': tensor '", name,
             "' is F8_E4M3 but there is no '", scale_name,
             "' to dequantise it with; the checkpoint is incomplete, download it again");
  const std::int64_t M = w.shape[0], N = w.shape[1];
  const std::int64_t R = (M + kFp8BlockSize - 1) / kFp8BlockSize;
  const std::int64_t C = (N + kFp8BlockSize - 1) / kFp8BlockSize;
  const SafetensorsFile& scale_file = file_of(scale_name);
  const SafetensorsTensorInfo& s = scale_file.info(scale_name);
  LAGA_CHECK(s.dtype == "F32" && s.shape == Shape({R, C}), "weights '", scale_file.path(),
             "': scale '", scale_name, "' is ", s.dtype, " of shape ", to_string(s.shape),
             " but weight '", name, "' ", to_string(w.shape), " needs F32 of shape [", R, ", ", C,
             "] (one per 128x128 block, the last ones ragged); re-export the checkpoint");
  if (!destination.data()) return;  // count-only: checked, not read

  std::vector<float> scale(static_cast<std::size_t>(R * C));
  scale_file.read_raw(scale_name, 0, s.bytes(), scale.data());
  check_fp8_scales(scale, R, C, scale_file.path(), scale_name);
  // One block row (128 rows of N codes) at a time, so the fp8 bytes are
  // never held whole beside the floats.
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(std::min(M, kFp8BlockSize) * N));
  float decode[256];
  for (int c = 0; c < 256; ++c) decode[c] = f8_e4m3_to_float(static_cast<std::uint8_t>(c));
  float* y = destination.data();  // [M, N] row-major
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t i0 = r * kFp8BlockSize, rows = std::min(kFp8BlockSize, M - i0);
    file.read_raw(name, static_cast<std::uint64_t>(i0 * N), static_cast<std::uint64_t>(rows * N),
                  codes.data());
    for (std::int64_t i = 0; i < rows; ++i) {
      const float* s_row = scale.data() + r * C;  // s[(i0 + i) / 128, :]
      for (std::int64_t j = 0; j < N; ++j)
        y[(i0 + i) * N + j] =
            decode[codes[static_cast<std::size_t>(i * N + j)]] * s_row[j / kFp8BlockSize];
    }
  }
}

}  // namespace laga
