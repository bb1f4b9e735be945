#include "io/atomic_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>

#include "core/error.hpp"

namespace laga {
namespace {

std::string system_reason(int err) {
  return std::strerror(err);
}

// Two threads of one process (ranks run as threads) may write the same path;
// the counter keeps their temporaries apart where the pid alone would not.
std::string temporary_path_for(const std::string& path) {
  static std::atomic<unsigned long> next_serial{0};
  return cat(path, ".tmp.", ::getpid(), ".", next_serial.fetch_add(1));
}

std::string parent_directory(const std::string& path) {
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// Owns the temporary file until commit(): on any early exit (exception
// included) the descriptor is closed and the half-written file unlinked.
class TemporaryFile {
 public:
  TemporaryFile(std::string target, std::string temp)
      : target_(std::move(target)), temp_(std::move(temp)) {}
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  ~TemporaryFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temp_.c_str());
  }

  // `preserved_mode`: the permission bits of the file being replaced, if any;
  // a new file gets 0666 narrowed by the umask like any other.
  void create(std::optional<mode_t> preserved_mode) {
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd_ < 0) {
      int err = errno;
      fail("cannot write '", target_, "': creating the temporary file '", temp_,
           "' failed: ", system_reason(err), "; check that the directory exists and is writable");
    }
    // open() applied the umask; the replaced file's bits come back exactly.
    if (preserved_mode && ::fchmod(fd_, *preserved_mode) != 0) {
      int err = errno;
      fail("cannot write '", target_, "': giving the temporary file '", temp_,
           "' the permissions of the file it replaces failed: ", system_reason(err));
    }
  }

  void write_all(std::string_view bytes) {
    const char* next = bytes.data();
    std::size_t left = bytes.size();
    while (left > 0) {
      ssize_t written = ::write(fd_, next, left);
      if (written < 0) {
        if (errno == EINTR) continue;
        int err = errno;
        fail("cannot write '", target_, "': writing the temporary file '", temp_,
             "' failed: ", system_reason(err), "; check free disk space and file size limits");
      }
      next += written;
      left -= static_cast<std::size_t>(written);
    }
  }

  void sync_and_close() {
    if (::fsync(fd_) != 0) {
      int err = errno;
      fail("cannot write '", target_, "': fsync of the temporary file '", temp_,
           "' failed: ", system_reason(err), "; the device may be full or failing");
    }
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      int err = errno;
      fail("cannot write '", target_, "': closing the temporary file '", temp_,
           "' failed: ", system_reason(err));
    }
  }

  void rename_over_target() {
    if (::rename(temp_.c_str(), target_.c_str()) != 0) {
      int err = errno;
      fail("cannot write '", target_, "': renaming '", temp_,
           "' over it failed: ", system_reason(err),
           "; check that the path is not a directory and is writable");
    }
    committed_ = true;
  }

 private:
  std::string target_;
  std::string temp_;
  int fd_ = -1;
  bool committed_ = false;
};

void sync_directory(const std::string& target, const std::string& directory) {
  int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    fail("wrote '", target, "' but could not open its directory '", directory,
         "' to make the rename durable: ", system_reason(err));
  }
  int status = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some filesystems cannot fsync a directory at all; there the rename is as
  // durable as they allow, which is not an error of ours.
  if (status != 0 && err != EINVAL && err != ENOTSUP) {
    fail("wrote '", target, "' but fsync of its directory '", directory,
         "' failed, so the new file may not survive a crash: ", system_reason(err));
  }
}

// The inputs protected by live ProtectedInputs objects, by device and inode.
struct ProtectedEntry {
  unsigned long id;
  dev_t dev;
  ino_t ino;
  std::string path, what;
  std::string missing;  // for a path protected while it does not exist: its resolved name
};

std::string resolved_name(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path absolute = std::filesystem::absolute(path, ec);
  const std::filesystem::path canonical = std::filesystem::weakly_canonical(absolute, ec);
  return (ec ? absolute.lexically_normal() : canonical).string();
}
// Never destroyed: ProtectedInputs held by other statics (the CLI keeps its
// guards until exit) unregister during static destruction, in no set order.
std::mutex& protected_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::vector<ProtectedEntry>& protected_entries() {
  static auto* entries = new std::vector<ProtectedEntry>;
  return *entries;
}

std::string file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

ProtectedInputs::ProtectedInputs(const std::vector<std::pair<std::string, std::string>>& inputs,
                                 bool missing_too) {
  static std::atomic<unsigned long> next_id{1};
  std::lock_guard<std::mutex> lock(protected_mutex());
  for (const auto& [path, what] : inputs) {
    if (path.empty()) continue;
    struct stat st {};
    const bool exists = ::stat(path.c_str(), &st) == 0;
    if (!exists && !missing_too) continue;
    const unsigned long id = next_id.fetch_add(1);
    protected_entries().push_back(ProtectedEntry{id, exists ? st.st_dev : dev_t{},
                                                 exists ? st.st_ino : ino_t{}, path, what,
                                                 exists ? std::string() : resolved_name(path)});
    ids_.push_back(id);
  }
}

ProtectedInputs::~ProtectedInputs() {
  std::lock_guard<std::mutex> lock(protected_mutex());
  auto& entries = protected_entries();
  std::erase_if(entries, [&](const ProtectedEntry& e) {
    return std::find(ids_.begin(), ids_.end(), e.id) != ids_.end();
  });
}

std::string resolve_output_path(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  LAGA_CHECK(!path.empty(), "cannot write ", what, ": the path is empty; give a file name");
  // Follow the symlink chain by hand: the target need not exist yet (a link
  // to a file not written so far is written through, as a shell would).
  fs::path target(path);
  std::string via;  // "'link' is a symlink to ": context for the messages
  for (int hops = 0;; ++hops) {
    std::error_code ec;
    const fs::file_status ls = fs::symlink_status(target, ec);
    if (ec || ls.type() != fs::file_type::symlink) break;
    LAGA_CHECK(hops < 40, "cannot write ", what, " '", path,
               "': too many levels of symbolic links; give the path of a regular file");
    const fs::path next = fs::read_symlink(target, ec);
    LAGA_CHECK(!ec, "cannot write ", what, " '", path, "': reading the symbolic link '",
               target.string(), "' failed: ", ec.message());
    target = next.is_absolute() ? next : target.parent_path() / next;
    via = cat(" ('", path, "' is a symbolic link to '", target.string(), "')");
  }
  struct stat st {};
  if (::stat(target.c_str(), &st) != 0) {  // a new file, unless an input names it
    const std::string name = resolved_name(target.string());
    std::lock_guard<std::mutex> lock(protected_mutex());
    for (const ProtectedEntry& e : protected_entries())
      LAGA_CHECK(e.missing.empty() || e.missing != name, "refusing to write ", what, " '", path,
                 "'", via, ": it is the ", e.what, " '", e.path,
                 "' that this run's input names (missing now); writing it would make a file pose "
                 "as that input; choose another path for ",
                 what);
    return target.string();
  }
  LAGA_CHECK(S_ISREG(st.st_mode), "cannot write ", what, " '", path, "'", via, ": it is ",
             file_kind(st.st_mode),
             ", which writing would replace or destroy; give the path of a regular file or a new "
             "one");
  std::lock_guard<std::mutex> lock(protected_mutex());
  for (const ProtectedEntry& e : protected_entries()) {
    // An input since deleted (a pruned checkpoint) protects nothing: its
    // inode may now belong to a new file of ours.
    struct stat now {};
    if (!e.missing.empty() || ::stat(e.path.c_str(), &now) != 0 || now.st_dev != e.dev ||
        now.st_ino != e.ino)
      continue;
    LAGA_CHECK(e.dev != st.st_dev || e.ino != st.st_ino, "refusing to write ", what, " '", path,
               "'", via, ": it is the same file as the ", e.what, " '", e.path,
               "' that this run reads, and writing it would destroy that input; choose another "
               "path for ",
               what);
  }
  return target.string();
}

void probe_writable_directory(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  std::error_code ec;
  LAGA_CHECK(fs::is_directory(dir, ec), "cannot write ", what, " '", path, "': its directory '",
             dir.string(), "' does not exist; create it or choose another path");
  const std::string probe = (dir / cat(".laga-probe.", ::getpid())).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  LAGA_CHECK(fd >= 0 || errno == EEXIST, "cannot write ", what, " '", path,
             "': creating a file in '", dir.string(), "' failed: ", std::strerror(errno),
             "; choose a writable directory (checked before the work, not after it)");
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
  }
}

void write_file_atomic(const std::string& path_given, const std::vector<std::string_view>& pieces) {
  LAGA_CHECK(!path_given.empty(), "cannot write a file with an empty path; give a file name");
  const std::string path = resolve_output_path(path_given, "output");
  std::optional<mode_t> preserved_mode;
  struct stat existing {};
  if (::stat(path.c_str(), &existing) == 0 && S_ISREG(existing.st_mode)) {
    preserved_mode = existing.st_mode & 07777;
  }

  TemporaryFile temp(path, temporary_path_for(path));
  temp.create(preserved_mode);
  for (std::string_view piece : pieces) temp.write_all(piece);
  temp.sync_and_close();
  temp.rename_over_target();
  sync_directory(path, parent_directory(path));
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  write_file_atomic(path, std::vector<std::string_view>{bytes});
}

}  // namespace laga
