#include "model/checkpoint.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.hpp"
#include "io/atomic_file.hpp"
#include "io/safetensors.hpp"

namespace laga {

namespace fs = std::filesystem;

namespace {

std::string hex64(std::uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string step_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

// Manifests in dir, sorted by step (the file names sort numerically).
std::vector<fs::path> manifests(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step-", 0) == 0 && e.path().extension() == ".json") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string previous_hint(const fs::path& dir, const fs::path& bad) {
  std::string hint;
  for (const auto& m : manifests(dir))
    if (fs::absolute(m) != fs::absolute(bad) && m.stem() != bad.stem()) hint = m.string();
  if (hint.empty()) return "no other checkpoint is in " + dir.string() + "; start without --resume";
  return "resume from the previous checkpoint with --resume " + hint;
}

}  // namespace

std::uint64_t file_fnv1a64(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LAGA_CHECK(in, "checkpoint: cannot open '", path, "' to verify it");
  std::uint64_t h = 1469598103934665603ull;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize n = in.gcount();
    for (std::streamsize i = 0; i < n; ++i) {
      h ^= static_cast<unsigned char>(buf[static_cast<size_t>(i)]);
      h *= 1099511628211ull;
    }
  }
  return h;
}

template <class T>
std::string save_checkpoint(const std::string& dir_s, const LmConfig& cfg, const TrainState<T>& st,
                            int keep) {
  const fs::path dir(dir_s);
  std::error_code ec;
  fs::create_directories(dir, ec);
  LAGA_CHECK(fs::is_directory(dir), "--checkpoint '", dir_s, "': cannot create the directory (",
             ec.message(), "); choose a writable path");
  SafetensorsWriter w;
  st.params.for_each([&](const std::string& n, const Tensor<T>& t) { w.add("param." + n, t); });
  st.m.for_each([&](const std::string& n, const Tensor<T>& t) { w.add("adam_m." + n, t); });
  st.v.for_each([&](const std::string& n, const Tensor<T>& t) { w.add("adam_v." + n, t); });
  w.add_metadata("format", "laga-train-checkpoint-1");
  w.add_metadata("step", std::to_string(st.step));
  w.add_metadata("data_cursor", std::to_string(st.data_cursor));
  w.add_metadata("seed", std::to_string(st.seed));
  const std::string base = step_name(st.step);
  const fs::path tensors = dir / (base + ".safetensors");
  w.write(tensors.string());

  nlohmann::json j;
  j["format"] = "laga-train-checkpoint-1";
  j["step"] = st.step;
  j["data_cursor"] = st.data_cursor;
  j["seed"] = st.seed;
  j["file"] = tensors.filename().string();
  j["bytes"] = static_cast<std::int64_t>(fs::file_size(tensors));
  j["fnv1a64"] = hex64(file_fnv1a64(tensors.string()));
  j["model"] = cfg.to_json();
  const std::string text = j.dump(2) + "\n";
  const fs::path manifest = dir / (base + ".json");
  write_file_atomic(manifest.string(), text);
  write_file_atomic((dir / "latest.json").string(), text);

  // Only now, with the new checkpoint complete, drop the oldest ones.
  auto all = manifests(dir);
  const size_t k = static_cast<size_t>(std::max(2, keep));
  for (size_t i = 0; i + k < all.size(); ++i) {
    fs::remove(all[i], ec);
    fs::path st_file = all[i];
    st_file.replace_extension(".safetensors");
    fs::remove(st_file, ec);
  }
  return manifest.string();
}

template <class T>
void load_checkpoint(const std::string& where, const LmConfig& cfg, TrainState<T>& st) {
  fs::path manifest(where);
  if (fs::is_directory(manifest)) manifest /= "latest.json";
  const fs::path dir = manifest.parent_path().empty() ? fs::path(".") : manifest.parent_path();
  LAGA_CHECK(fs::is_regular_file(manifest), "--resume '", where, "': no checkpoint manifest '",
             manifest.string(),
             "'; point --resume at a --checkpoint directory or a step-*.json in it");
  nlohmann::json j;
  try {
    std::ifstream in(manifest);
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    fail("checkpoint manifest '", manifest.string(), "' is not valid JSON (", e.what(),
         "); it is damaged: ", previous_hint(dir, manifest));
  }
  LAGA_CHECK(j.value("format", "") == "laga-train-checkpoint-1", "checkpoint manifest '",
             manifest.string(), "' is not a laga training checkpoint (format '",
             j.value("format", ""), "')");
  const fs::path tensors = dir / j.at("file").get<std::string>();
  const fs::path bad_manifest = dir / (tensors.stem().string() + ".json");
  LAGA_CHECK(fs::is_regular_file(tensors), "checkpoint '", tensors.string(), "' named by '",
             manifest.string(), "' is missing; ", previous_hint(dir, bad_manifest));
  const auto bytes = static_cast<std::int64_t>(fs::file_size(tensors));
  const std::int64_t want = j.at("bytes").get<std::int64_t>();
  LAGA_CHECK(bytes == want, "checkpoint '", tensors.string(), "' is ", bytes,
             " bytes but its manifest '", manifest.string(), "' records ", want,
             ": it is truncated or was overwritten; ", previous_hint(dir, bad_manifest));
  const std::string hash = hex64(file_fnv1a64(tensors.string()));
  LAGA_CHECK(hash == j.at("fnv1a64").get<std::string>(), "checkpoint '", tensors.string(),
             "' is corrupted: its FNV-1a hash is ", hash, " but the manifest records ",
             j.at("fnv1a64").get<std::string>(), "; ", previous_hint(dir, bad_manifest));
  const nlohmann::json model = cfg.to_json();
  LAGA_CHECK(j.at("model") == model, "checkpoint '", manifest.string(),
             "' was written for a different model (", j.at("model").dump(),
             "); pass the same --layers/--d-model/--heads/--vocab/... as the run that wrote it");

  const SafetensorsFile f = SafetensorsFile::open(tensors.string());
  auto load = [&](const char* prefix, LmParams<T>& p) {
    p.for_each([&](const std::string& n, Tensor<T>& t) { f.read_into(prefix + n, t); });
  };
  load("param.", st.params);
  load("adam_m.", st.m);
  load("adam_v.", st.v);
  st.step = j.at("step").get<std::int64_t>();
  st.data_cursor = j.at("data_cursor").get<std::int64_t>();
  st.seed = j.at("seed").get<std::uint64_t>();
}

#define LAGA_INSTANTIATE(T)                                                    \
  template std::string save_checkpoint<T>(const std::string&, const LmConfig&, \
                                          const TrainState<T>&, int);          \
  template void load_checkpoint<T>(const std::string&, const LmConfig&, TrainState<T>&);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
