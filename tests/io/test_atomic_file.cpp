#include "io/atomic_file.hpp"

#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <thread>

#include "io/io_test_support.hpp"

namespace laga {
namespace {

using io_test::expect_error;
using io_test::read_bytes;
using io_test::scratch_dir;
using io_test::write_bytes;

std::vector<std::string> entries_of(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(AtomicFile, CreatesNewFile) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "report.json").string();
  write_file_atomic(path, std::string_view("{\"ok\": true}\n"));
  EXPECT_EQ(read_bytes(path), "{\"ok\": true}\n");
  EXPECT_EQ(entries_of(dir), std::vector<std::string>{"report.json"});
}

TEST(AtomicFile, ReplacesExistingFileAndLeavesNoTemporary) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "ckpt.bin").string();
  write_bytes(path, std::string(10000, 'o'));
  write_file_atomic(path, std::string_view("new"));
  EXPECT_EQ(read_bytes(path), "new");
  write_file_atomic(path, std::string_view(""));
  EXPECT_EQ(read_bytes(path), "");
  EXPECT_EQ(entries_of(dir), std::vector<std::string>{"ckpt.bin"});
}

TEST(AtomicFile, PiecesAreConcatenated) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "pieces").string();
  const std::string big(3 << 20, 'x');  // larger than one write() may take
  write_file_atomic(path, std::vector<std::string_view>{"head:", "", big, ":tail"});
  EXPECT_EQ(read_bytes(path), "head:" + big + ":tail");
}

TEST(AtomicFile, KeepsPermissionsOfReplacedFile) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "private").string();
  write_bytes(path, "old");
  std::filesystem::permissions(
      path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  write_file_atomic(path, std::string_view("new"));
  EXPECT_EQ(std::filesystem::status(path).permissions(),
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
}

TEST(AtomicFile, MissingDirectoryFailsClearly) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "no_such_dir" / "out.json").string();
  expect_error([&] { write_file_atomic(path, std::string_view("x")); },
               {path, "No such file or directory", "directory exists"});
  EXPECT_TRUE(entries_of(dir).empty());
}

TEST(AtomicFile, EmptyPathIsRefused) {
  expect_error([] { write_file_atomic("", std::string_view("x")); }, {"empty path"});
}

TEST(AtomicFile, DirectoryInTheWayLeavesEverythingIntact) {
  const auto dir = scratch_dir();
  const auto target = dir / "taken";
  std::filesystem::create_directory(target);
  write_bytes(target / "inside", "keep");
  expect_error([&] { write_file_atomic(target.string(), std::string_view("x")); },
               {target.string(), "directory"});
  EXPECT_EQ(read_bytes(target / "inside"), "keep");
  EXPECT_EQ(entries_of(dir), std::vector<std::string>{"taken"});
}

// A write that fails halfway (here: the file size limit, as a full disk
// would) must leave the old file exactly as it was and no temporary behind.
TEST(AtomicFile, FailureMidwayKeepsOldFile) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "weights").string();
  const std::string old_contents(1000, 'k');
  write_bytes(path, old_contents);

  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  if (saved.rlim_max != RLIM_INFINITY && saved.rlim_max < 4096)
    GTEST_SKIP() << "the hard file-size limit (" << saved.rlim_max
                 << " bytes) is below the 4096 this test sets";
  auto previous_handler = std::signal(SIGXFSZ, SIG_IGN);  // get EFBIG instead of dying
  rlimit small = saved;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message;
  try {
    write_file_atomic(path, std::vector<std::string_view>{"header", std::string(100000, 'n')});
  } catch (const Error& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous_handler);

  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("File too large"), std::string::npos) << message;
  EXPECT_EQ(read_bytes(path), old_contents);
  EXPECT_EQ(entries_of(dir), std::vector<std::string>{"weights"});
}

// Root (as in CI) writes into a read-only directory anyway, through
// CAP_DAC_OVERRIDE. Capabilities belong to a thread, so this thread drops it
// from its effective set for the duration of the test and raises it again
// after (it stays in the permitted set, so that is allowed). Nothing to do
// for a user without the capability.
class WithoutDacOverride {
 public:
  WithoutDacOverride() {
    if (::syscall(SYS_capget, &header_, saved_) != 0) {
      error_ = std::string("capget: ") + std::strerror(errno);
      return;
    }
    constexpr unsigned bit = 1u << (CAP_DAC_OVERRIDE % 32);
    constexpr int word = CAP_DAC_OVERRIDE / 32;
    if (!(saved_[word].effective & bit)) return;  // nothing to drop
    __user_cap_data_struct lowered[2] = {saved_[0], saved_[1]};
    lowered[word].effective &= ~bit;
    if (::syscall(SYS_capset, &header_, lowered) != 0) {
      error_ = std::string("capset without CAP_DAC_OVERRIDE: ") + std::strerror(errno);
      return;
    }
    dropped_ = true;
  }
  ~WithoutDacOverride() {
    if (dropped_) ::syscall(SYS_capset, &header_, saved_);
  }
  WithoutDacOverride(const WithoutDacOverride&) = delete;
  WithoutDacOverride& operator=(const WithoutDacOverride&) = delete;
  const std::string& error() const { return error_; }

 private:
  __user_cap_header_struct header_{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct saved_[2]{};
  bool dropped_ = false;
  std::string error_;
};

TEST(AtomicFile, ReadOnlyDirectoryFailsAndKeepsOldFile) {
  const auto dir = scratch_dir();
  const auto locked = dir / "locked";
  std::filesystem::create_directory(locked);
  write_bytes(locked / "f", "old");
  std::filesystem::permissions(
      locked, std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  {
    const WithoutDacOverride unprivileged;
    // Only a kernel or a seccomp policy that refuses capset gets here; the
    // test is listed in tests/allowed_skips.txt for that.
    if (!unprivileged.error().empty()) {
      std::filesystem::permissions(locked, std::filesystem::perms::owner_all);
      GTEST_SKIP() << "cannot drop CAP_DAC_OVERRIDE, so a read-only directory is writable here ("
                   << unprivileged.error() << ")";
    }
    expect_error([&] { write_file_atomic((locked / "f").string(), std::string_view("new")); },
                 {(locked / "f").string(), "writable"});
  }
  std::filesystem::permissions(locked, std::filesystem::perms::owner_all);
  EXPECT_EQ(read_bytes(locked / "f"), "old");
}

// Ranks run as threads; two of them saving the same path must not share a
// temporary, and the result is one writer's complete contents.
TEST(AtomicFile, ConcurrentWritersOfOnePath) {
  const auto dir = scratch_dir();
  const std::string path = (dir / "shared").string();
  constexpr int kThreads = 8;
  std::vector<std::string> contents;
  for (int t = 0; t < kThreads; ++t) contents.push_back(std::string(50000 + t, 'a' + t));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < 5; ++i) write_file_atomic(path, contents[static_cast<size_t>(t)]);
      } catch (const Error& e) {
        errors[static_cast<size_t>(t)] = e.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const std::string& error : errors) EXPECT_EQ(error, "");
  const std::string result = read_bytes(path);
  EXPECT_NE(std::find(contents.begin(), contents.end(), result), contents.end());
  EXPECT_EQ(entries_of(dir), std::vector<std::string>{"shared"});
}

}  // namespace
}  // namespace laga
