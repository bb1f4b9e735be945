#include "model/checkpoint.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>
#include <vector>

#include "core/error.hpp"
#include "core/nonfinite.hpp"
#include "io/atomic_file.hpp"
#include "io/safetensors.hpp"

namespace laga {

namespace fs = std::filesystem;

namespace {

std::string step_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

// Names are matched by hand, not std::regex: exact, and GCC 12's
// sanitizer build warns inside <regex> (-Werror).
bool digits(std::string_view s, size_t min_len, size_t max_len) {
  if (s.size() < min_len || s.size() > max_len) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The step of a file named step-<digits><ext> (the manifest's .json, or its
// tensors' .safetensors); -1 for any other name.
std::int64_t step_of(const fs::path& p, std::string_view ext = ".json") {
  const std::string n = p.filename().string();
  const std::string_view v(n);
  if (!v.starts_with("step-") || !v.ends_with(ext)) return -1;
  const std::string_view d = v.substr(5, v.size() - 5 - ext.size());
  return digits(d, 1, 18) ? std::stoll(std::string(d)) : -1;
}

// latest.json, step-<N>.json or step-<N>.safetensors as save_checkpoint
// names them (N: at least 8 digits).
bool is_checkpoint_file_name(std::string_view n) {
  if (n == "latest.json") return true;
  if (!n.starts_with("step-")) return false;
  for (std::string_view ext : {std::string_view(".json"), std::string_view(".safetensors")})
    if (n.ends_with(ext) && digits(n.substr(5, n.size() - 5 - ext.size()), 8, 18)) return true;
  return false;
}

// The pid in a temporary write_file_atomic made for a checkpoint file
// (`<checkpoint file>.tmp.<pid>.<serial>`); -1 for any other name.
long long temporary_owner(std::string_view n) {
  const size_t tmp = n.find(".tmp.");
  if (tmp == std::string_view::npos || !is_checkpoint_file_name(n.substr(0, tmp))) return -1;
  const std::string_view rest = n.substr(tmp + 5);
  const size_t dot = rest.find('.');
  if (dot == std::string_view::npos || !digits(rest.substr(0, dot), 1, 10) ||
      !digits(rest.substr(dot + 1), 1, 20))
    return -1;
  return std::stoll(std::string(rest.substr(0, dot)));
}

// Manifests in dir, sorted by step.
std::vector<fs::path> manifests(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (step_of(e.path()) >= 0) out.push_back(e.path());
  std::sort(out.begin(), out.end(),
            [](const fs::path& a, const fs::path& b) { return step_of(a) < step_of(b); });
  return out;
}

std::string previous_hint(const fs::path& dir, const fs::path& bad) {
  std::string hint;
  for (const auto& m : manifests(dir))
    if (fs::absolute(m) != fs::absolute(bad) && m.stem() != bad.stem()) hint = m.string();
  if (hint.empty()) return "no other checkpoint is in " + dir.string() + "; start without --resume";
  return "resume from the previous checkpoint with --resume " + hint;
}

void remove_checkpoint_files(const fs::path& manifest) {
  std::error_code ec;
  fs::path tensors = manifest;
  tensors.replace_extension(".safetensors");
  fs::remove(tensors, ec);
  fs::remove(manifest, ec);
}

}  // namespace

std::vector<std::string> checkpoint_manifests(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& m : manifests(dir)) out.push_back(m.string());
  return out;
}

int remove_stale_checkpoint_temporaries(const std::string& dir) {
  int removed = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const long long pid = temporary_owner(e.path().filename().string());
    if (pid < 0 || !e.is_regular_file(ec)) continue;
    // Another live process (a concurrent save) may still own it; this
    // process writes checkpoints from one thread, so its own are stale here.
    const bool live_other =
        pid != ::getpid() && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH);
    if (!live_other && fs::remove(e.path(), ec)) ++removed;
  }
  return removed;
}

std::vector<std::string> checkpoint_files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (is_checkpoint_file_name(e.path().filename().string()))
      out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "unknown";
  return host;
}

// The holder a lock file names ("pid <pid> host <host>"); pid -1 when the
// text is not of that form (a damaged lock is not taken over silently).
std::pair<long long, std::string> lock_holder(const std::string& text) {
  std::istringstream in(text);
  std::string pid_word, host_word, host;
  long long pid = -1;
  if (!(in >> pid_word >> pid >> host_word >> host) || pid_word != "pid" || host_word != "host" ||
      pid <= 0)
    return {-1, ""};
  return {pid, host};
}

// What a lock file says of its holder, and whether it can be taken over.
struct LockHolder {
  bool present = false, stale = false;
  std::string who;  // "pid 12 on host h, which is running"
};

LockHolder read_lock(const std::string& path) {
  LockHolder h;
  std::ifstream in(path, std::ios::binary);
  if (!in) return h;
  h.present = true;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto [pid, host] = lock_holder(text);
  const bool here = pid > 0 && host == host_name();
  h.stale = here && pid != ::getpid() && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
  h.who = pid <= 0 ? std::string("no valid holder")
                   : cat("pid ", pid, " on host ", host,
                         !here               ? ""
                         : pid == ::getpid() ? " (this process)"
                         : h.stale           ? ", which no longer runs"
                                             : ", which is running");
  return h;
}

[[noreturn]] void refuse_in_use(const std::string& dir, const std::string& path,
                                const LockHolder& h) {
  fail("--checkpoint '", dir, "' is in use: its lock '", path, "' names ", h.who,
       ". Two runs in one directory would prune each other's checkpoints; wait for that run, "
       "choose another --checkpoint directory, or, if no run holds it, remove the lock file");
}

}  // namespace

void refuse_checkpoint_directory_in_use(const std::string& dir) {
  const std::string path = (fs::path(dir) / "laga.lock").string();
  const LockHolder h = read_lock(path);
  if (h.present && !h.stale) refuse_in_use(dir, path, h);
}

CheckpointDirectoryLock::CheckpointDirectoryLock(const std::string& dir_s) {
  const fs::path dir(dir_s);
  std::error_code ec;
  fs::create_directories(dir, ec);
  LAGA_CHECK(fs::is_directory(dir), "--checkpoint '", dir_s, "': cannot create the directory (",
             ec ? ec.message() : std::string("a file of that name is in the way"),
             "); choose a writable path (checked before the first step, not at the first save)");
  path_ = (dir / "laga.lock").string();
  holder_ = cat("pid ", ::getpid(), " host ", host_name(), "\n");
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      const bool written =
          ::write(fd, holder_.data(), holder_.size()) == static_cast<ssize_t>(holder_.size());
      ::close(fd);
      if (written) return;
      ::unlink(path_.c_str());
      fail("--checkpoint '", dir_s, "': cannot write its lock '", path_, "' (",
           std::strerror(errno), "); choose a directory with room to write");
    }
    LAGA_CHECK(errno == EEXIST, "--checkpoint '", dir_s, "': cannot create files in it (",
               std::strerror(errno), " creating '", path_,
               "'); choose a writable directory (checked before the first step, not at the "
               "first save)");
    const LockHolder h = read_lock(path_);
    // Taken over once; a second EEXIST means another run took it meanwhile.
    if (h.stale && attempt == 0 && ::unlink(path_.c_str()) == 0) continue;
    refuse_in_use(dir_s, path_, h);
  }
}

CheckpointDirectoryLock::~CheckpointDirectoryLock() {
  // Removed only while it still holds this process's line (never another's).
  std::ifstream in(path_, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text == holder_) ::unlink(path_.c_str());
}

bool is_checkpoint_directory_name(std::string_view n) {
  if (n.starts_with("superseded-after-") || n.starts_with(".laga-probe.")) return true;
  const size_t tmp = n.find(".tmp.");
  if (tmp != std::string_view::npos) n = n.substr(0, tmp);
  if (n == "laga.lock" || n == "latest.json") return true;
  if (!n.starts_with("step-")) return false;
  const std::string_view rest = n.substr(5);
  const size_t dot = rest.find('.');
  return digits(rest.substr(0, dot), 1, 64);
}

namespace {

// `p` absolute, each component's symlink resolved in order as the kernel
// would (`..` after a link climbs from its target), dangling links and a
// tail that does not exist yet included: a --log through a link to a
// --checkpoint directory not created yet is inside it once it is.
fs::path resolved(const fs::path& p) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(p, ec);
  std::deque<fs::path> parts;
  for (const fs::path& part : absolute.relative_path()) parts.push_back(part);
  fs::path out = absolute.root_path();
  for (int hops = 0; !parts.empty();) {
    const fs::path part = parts.front();
    parts.pop_front();
    if (part.empty() || part == ".") continue;
    if (part == "..") {
      out = out.parent_path();
      continue;
    }
    const fs::path next = out / part;
    if (hops < 40 && fs::is_symlink(fs::symlink_status(next, ec))) {
      const fs::path link = fs::read_symlink(next, ec);
      if (!ec) {
        ++hops;
        std::vector<fs::path> inner;
        for (const fs::path& q : link.relative_path()) inner.push_back(q);
        parts.insert(parts.begin(), inner.begin(), inner.end());
        if (link.is_absolute()) out = link.root_path();
        continue;
      }
    }
    out = next;
  }
  return out;
}

bool same_directory(const fs::path& a, const fs::path& b) {
  if (a == b) return true;
  struct stat sa {
  }, sb{};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && S_ISDIR(sa.st_mode) &&
         sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// The file of an owned name in dir (or in its superseded-after-* folders)
// that is `st` (a hard link to it), relative to dir; empty if none.
std::string owned_file_linked_to(const fs::path& dir, const struct stat& st) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!is_checkpoint_directory_name(name)) continue;
    if (name.starts_with("superseded-after-") && e.is_directory(ec)) {
      const std::string inner = owned_file_linked_to(e.path(), st);
      if (!inner.empty()) return (fs::path(name) / inner).string();
      continue;
    }
    struct stat other {};
    if (::stat(e.path().c_str(), &other) == 0 && other.st_dev == st.st_dev &&
        other.st_ino == st.st_ino)
      return name;
  }
  return "";
}

}  // namespace

void refuse_checkpoint_directory_file(const std::string& path, const std::string& option,
                                      const std::string& dir_s, const std::string& dir_option,
                                      bool output) {
  if (path.empty() || dir_s.empty()) return;
  const fs::path target = resolved(output ? resolve_output_path(path, option) : path);
  const fs::path dir = resolved(dir_s);
  const fs::path parent = target.parent_path();
  const std::string name = target.filename().string();
  std::string which;  // the owned file, as the user would name it
  bool linked = false;
  if (same_directory(parent, dir) && is_checkpoint_directory_name(name)) {
    which = (fs::path(dir_s) / name).string();
  } else if (same_directory(parent.parent_path(), dir) &&
             parent.filename().string().starts_with("superseded-after-")) {
    which = (fs::path(dir_s) / parent.filename() / name).string();
  } else {
    struct stat st {};
    if (::stat(target.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      const std::string inside = owned_file_linked_to(dir, st);
      if (!inside.empty()) which = (fs::path(dir_s) / inside).string();
    }
    linked = !which.empty();
  }
  if (which.empty()) return;
  const std::string is =
      cat(option, " '", path, "' is ",
          linked          ? cat("the same file (a hard link) as '", which, "', ")
          : which != path ? cat("'", which, "', ")
                          : std::string(),
          "a name the ", dir_option, " directory '", dir_s,
          "' owns (its lock laga.lock, latest.json, the step-N files of its checkpoints, their "
          "temporaries and the superseded-after-* folders, which laga train creates, rewrites, "
          "moves and prunes)");
  if (output)
    fail(is, ": the ", option.substr(2),
         " would be lost or would replace one of them (after which --resume is refused); give ",
         option, " a path outside those names (another name, e.g. '",
         (fs::path(dir_s) / "train.jsonl").string(), "', is fine)");
  fail(is, ": this run could replace, move or delete the file it reads; copy it outside '", dir_s,
       "' and give ", option, " that copy");
}

std::vector<std::string> set_aside_checkpoints_after(const std::string& dir_s, std::int64_t step,
                                                     std::string* folder) {
  const fs::path dir(dir_s);
  std::vector<fs::path> later;
  for (const auto& m : manifests(dir))
    if (step_of(m) > step) later.push_back(m);
  // A tensors file of a later step without its manifest (a save killed
  // between the two, or a file put there by hand): this run would write over
  // it when it reaches that step. It goes aside with the rest.
  std::vector<fs::path> orphans;
  {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      fs::path manifest = e.path();
      manifest.replace_extension(".json");
      if (step_of(e.path(), ".safetensors") > step && !fs::exists(manifest, ec))
        orphans.push_back(e.path());
    }
  }
  std::vector<std::string> moved;
  if (folder) folder->clear();
  if (later.empty() && orphans.empty()) return moved;
  fs::path aside = dir / ("superseded-after-" + step_name(step));
  for (int k = 2; fs::exists(aside); ++k)
    aside = dir / ("superseded-after-" + step_name(step) + "-" + std::to_string(k));
  std::error_code ec;
  fs::create_directory(aside, ec);
  LAGA_CHECK(!ec, "--checkpoint '", dir_s, "': cannot create '", aside.string(),
             "' to keep the checkpoints after step ", step, " (", ec.message(),
             "); move them away yourself or choose another --checkpoint directory");
  auto move = [&](const fs::path& from) {
    if (!fs::exists(fs::symlink_status(from))) return;
    fs::rename(from, aside / from.filename(), ec);
    LAGA_CHECK(!ec, "--checkpoint '", dir_s, "': cannot move '", from.string(), "' into '",
               aside.string(), "' (", ec.message(), ")");
    moved.push_back(from.filename().string());
  };
  const std::string own = (dir / (step_name(step) + ".json")).string();
  const fs::path latest = dir / "latest.json";
  bool latest_is_later = false;
  try {
    latest_is_later = fs::exists(latest) && read_checkpoint_manifest(latest.string()).step > step;
  } catch (const Error&) {
    latest_is_later = true;  // damaged: it is not this run's; keep it aside too
  }
  for (const auto& m : later) {
    fs::path tensors = m;
    tensors.replace_extension(".safetensors");
    move(tensors);
    move(m);
  }
  for (const auto& t : orphans) move(t);
  if (latest_is_later && fs::exists(latest)) {
    move(latest);
    std::ifstream in(own, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in) write_file_atomic(latest.string(), text);
  }
  if (folder) *folder = aside.string();
  return moved;
}

template <class T>
std::string save_checkpoint(const std::string& dir_s, const LmConfig& cfg, const TrainState<T>& st,
                            const CheckpointOptions& options, int keep) {
  const fs::path dir(dir_s);
  std::error_code ec;
  fs::create_directories(dir, ec);
  LAGA_CHECK(fs::is_directory(dir), "--checkpoint '", dir_s, "': cannot create the directory (",
             ec.message(), "); choose a writable path");
  remove_stale_checkpoint_temporaries(dir_s);
  SafetensorsWriter w;
  st.params.for_each([&](const std::string& n, const Tensor<T>& t) { w.add("param." + n, t); });
  st.m.for_each([&](const std::string& n, const Tensor<T>& t) { w.add("adam_m." + n, t); });
  st.v.for_each([&](const std::string& n, const Tensor<T>& t) { w.add("adam_v." + n, t); });
  w.add_metadata("format", kCheckpointFormat);
  w.add_metadata("step", std::to_string(st.step));
  w.add_metadata("data_cursor", std::to_string(st.data_cursor));
  w.add_metadata("seed", std::to_string(st.seed));
  const std::string base = step_name(st.step);
  const fs::path tensors = dir / (base + ".safetensors");
  w.write(tensors.string());

  CheckpointManifest record;
  record.tensors = tensors.string();
  record.tensors_bytes = static_cast<std::int64_t>(fs::file_size(tensors));
  record.tensors_fnv1a64 = fnv1a64_hex(file_fnv1a64(tensors.string()));
  record.step = st.step;
  record.data_cursor = st.data_cursor;
  record.seed = st.seed;
  record.options = options;
  record.model_json = cfg.to_json().dump();
  const std::string text = format_checkpoint_manifest(record);
  const fs::path manifest = dir / (base + ".json");
  write_file_atomic(manifest.string(), text);
  write_file_atomic((dir / "latest.json").string(), text);

  // Only now, with the new checkpoint complete, drop the oldest ones: only
  // checkpoints of lower steps are candidates, so neither this one (which
  // latest.json names) nor any later one can be removed.
  std::vector<fs::path> older;
  for (const auto& m : manifests(dir))
    if (step_of(m) < st.step) older.push_back(m);
  const size_t kept_older = static_cast<size_t>(std::max(2, keep) - 1);
  for (size_t i = 0; i + kept_older < older.size(); ++i) remove_checkpoint_files(older[i]);
  return manifest.string();
}

CheckpointManifest read_checkpoint_manifest(const std::string& where) {
  fs::path manifest(where);
  if (fs::is_directory(manifest)) manifest /= "latest.json";
  const fs::path dir = manifest.parent_path().empty() ? fs::path(".") : manifest.parent_path();
  LAGA_CHECK(fs::is_regular_file(manifest), "--resume '", where, "': no checkpoint manifest '",
             manifest.string(),
             "'; point --resume at a --checkpoint directory or a step-*.json in it");
  std::ifstream in(manifest, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  LAGA_CHECK(in || in.eof(), "checkpoint manifest '", manifest.string(),
             "': cannot read it; check its permissions");
  return parse_checkpoint_manifest(text, manifest.string(), previous_hint(dir, manifest));
}

std::vector<std::string> model_changes(const CheckpointManifest& m, const LmConfig& cfg) {
  const nlohmann::json old = nlohmann::json::parse(m.model_json), now = cfg.to_json();
  std::vector<std::string> out;
  if (old == now) return out;
  auto text = [](const nlohmann::json& o, const std::string& k) {
    return o.contains(k) ? o.at(k).dump() : std::string("(absent)");
  };
  std::vector<std::string> keys;
  for (const auto& [k, v] : old.items()) keys.push_back(k);
  for (const auto& [k, v] : now.items())
    if (!old.contains(k)) keys.push_back(k);
  for (const auto& k : keys)
    if (!old.contains(k) || !now.contains(k) || old.at(k) != now.at(k))
      out.push_back("model " + k + ": " + text(old, k) + " -> " + text(now, k));
  if (out.empty()) out.push_back("model: " + old.dump() + " -> " + now.dump());
  return out;
}

template <class T>
CheckpointManifest load_checkpoint(const std::string& where, const LmConfig& cfg, TrainState<T>& st,
                                   bool allow_nonfinite, std::vector<std::string>* nonfinite) {
  const CheckpointManifest m = read_checkpoint_manifest(where);
  const fs::path tensors(m.tensors);
  const fs::path dir = tensors.parent_path();
  const fs::path bad_manifest = dir / (tensors.stem().string() + ".json");
  LAGA_CHECK(fs::is_regular_file(tensors), "checkpoint '", tensors.string(), "' named by '", m.path,
             "' is missing; ", previous_hint(dir, bad_manifest));
  const auto bytes = static_cast<std::int64_t>(fs::file_size(tensors));
  LAGA_CHECK(bytes == m.tensors_bytes, "checkpoint '", tensors.string(), "' is ", bytes,
             " bytes but its manifest '", m.path, "' records ", m.tensors_bytes,
             ": it is truncated or was overwritten; ", previous_hint(dir, bad_manifest));
  const std::string hash = fnv1a64_hex(file_fnv1a64(tensors.string()));
  LAGA_CHECK(hash == m.tensors_fnv1a64, "checkpoint '", tensors.string(),
             "' is corrupted: its FNV-1a hash is ", hash, " but the manifest records ",
             m.tensors_fnv1a64, "; ", previous_hint(dir, bad_manifest));
  const std::vector<std::string> changed = model_changes(m, cfg);
  if (!changed.empty()) {
    std::string list;
    for (const auto& c : changed) list += (list.empty() ? "" : "; ") + c;
    fail("checkpoint '", m.path, "' was written for a different model (", list,
         "); pass the same --layers/--d-model/--heads/--vocab/... as the run that wrote it");
  }

  const SafetensorsFile f = SafetensorsFile::open(tensors.string());
  // A checkpoint saved by a run that had already diverged (or damaged in a
  // way its hash cannot see: written so) would resume into NaN at once.
  auto load = [&](const char* prefix, LmParams<T>& p) {
    p.for_each([&](const std::string& n, Tensor<T>& t) {
      f.read_into(prefix + n, t);
      const NonFinite nf = count_nonfinite(t.data(), t.numel());
      if (nf.count == 0) return;
      const std::string found = describe_nonfinite(
          cat("checkpoint '", tensors.string(), "': tensor '", prefix, n, "'"), nf, t.numel());
      LAGA_CHECK(allow_nonfinite, found,
                 "; the run that wrote it had already diverged, so it would resume into NaN: ",
                 previous_hint(dir, bad_manifest), ", or pass --allow-nonfinite to load it anyway");
      if (nonfinite) nonfinite->push_back(found);
    });
  };
  load("param.", st.params);
  load("adam_m.", st.m);
  load("adam_v.", st.v);
  st.step = m.step;
  st.data_cursor = m.data_cursor;
  st.seed = m.seed;
  return m;
}

#define LAGA_INSTANTIATE(T)                                                                     \
  template std::string save_checkpoint<T>(const std::string&, const LmConfig&,                  \
                                          const TrainState<T>&, const CheckpointOptions&, int); \
  template CheckpointManifest load_checkpoint<T>(const std::string&, const LmConfig&,           \
                                                 TrainState<T>&, bool, std::vector<std::string>*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
