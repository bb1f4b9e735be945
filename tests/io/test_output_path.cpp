// Output safety (issue 10 item 2): every writer goes through
// resolve_output_path, which writes a symlink's target and leaves the link,
// refuses anything that is not a regular file (FIFO, device node, socket,
// directory) and refuses a file this process reads as an input.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "io/atomic_file.hpp"
#include "io/io_test_support.hpp"

namespace laga {
namespace {

namespace fs = std::filesystem;
using io_test::expect_error;
using io_test::read_bytes;
using io_test::scratch_dir;
using io_test::write_bytes;

TEST(OutputPath, FifoIsRefusedAndStaysAFifo) {
  const auto dir = scratch_dir();
  const fs::path fifo = dir / "pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  expect_error([&] { write_file_atomic(fifo.string(), std::string_view("x")); },
               {fifo.string(), "FIFO"});
  EXPECT_TRUE(fs::is_fifo(fifo));
  // Through a symlink too: the link and the FIFO both survive.
  fs::create_symlink(fifo, dir / "link");
  expect_error([&] { write_file_atomic((dir / "link").string(), std::string_view("x")); },
               {"link", "FIFO"});
  EXPECT_TRUE(fs::is_symlink(dir / "link"));
  EXPECT_TRUE(fs::is_fifo(fifo));
}

TEST(OutputPath, SymlinkIsWrittenThroughAndKept) {
  const auto dir = scratch_dir();
  write_bytes(dir / "real.json", "old");
  fs::create_symlink("real.json", dir / "rel_link");         // relative target
  fs::create_symlink(dir / "rel_link", dir / "chain_link");  // a chain of two
  write_file_atomic((dir / "chain_link").string(), std::string_view("new"));
  EXPECT_TRUE(fs::is_symlink(dir / "chain_link"));
  EXPECT_TRUE(fs::is_symlink(dir / "rel_link"));
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(dir / "real.json")));
  EXPECT_EQ(read_bytes(dir / "real.json"), "new");
  EXPECT_EQ(resolve_output_path((dir / "chain_link").string()), (dir / "real.json").string());
  // A link to a file that does not exist yet creates that file.
  fs::create_symlink(dir / "later.json", dir / "dangling");
  write_file_atomic((dir / "dangling").string(), std::string_view("made"));
  EXPECT_TRUE(fs::is_symlink(dir / "dangling"));
  EXPECT_EQ(read_bytes(dir / "later.json"), "made");
}

TEST(OutputPath, DeviceNodeIsRefused) {
  const auto dir = scratch_dir();
  // A link to /dev/null: safe even if the check were missing (the link, not
  // the device, would be replaced).
  fs::create_symlink("/dev/null", dir / "null_link");
  expect_error([&] { write_file_atomic((dir / "null_link").string(), std::string_view("x")); },
               {"null_link", "/dev/null", "character device"});
  EXPECT_TRUE(fs::is_symlink(dir / "null_link"));
  expect_error([] { (void)resolve_output_path("/dev/null", "--output"); },
               {"--output '/dev/null'", "character device"});
  if (::geteuid() != 0) GTEST_SKIP() << "mknod of a device node needs root; checked via /dev/null";
  const fs::path node = dir / "null_node";
  ASSERT_EQ(::mknod(node.c_str(), S_IFCHR | 0666, makedev(1, 3)), 0) << std::strerror(errno);
  expect_error([&] { write_file_atomic(node.string(), std::string_view("x")); },
               {node.string(), "character device"});
  EXPECT_TRUE(fs::is_character_file(node));
}

TEST(OutputPath, SocketAndDirectoryAreRefused) {
  const auto dir = scratch_dir();
  const fs::path sock = dir / "s";
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(sock.string().size(), sizeof addr.sun_path);
  std::strcpy(addr.sun_path, sock.c_str());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  expect_error([&] { write_file_atomic(sock.string(), std::string_view("x")); }, {"socket"});
  EXPECT_TRUE(fs::is_socket(sock));
  ::close(fd);
  fs::create_directory(dir / "d");
  expect_error([&] { (void)resolve_output_path((dir / "d").string(), "--log"); },
               {"--log", "directory"});
}

TEST(OutputPath, ProtectedInputIsRefusedThroughLinksAndFreedAfter) {
  const auto dir = scratch_dir();
  const fs::path input = dir / "weights.safetensors";
  write_bytes(input, "precious");
  fs::create_symlink(input, dir / "sym");
  fs::create_hard_link(input, dir / "hard");
  {
    ProtectedInputs guard({{input.string(), "--weights"}, {(dir / "missing").string(), "--input"}});
    for (const char* name : {"weights.safetensors", "sym", "hard"})
      expect_error([&] { write_file_atomic((dir / name).string(), std::string_view("x")); },
                   {"same file as the --weights", input.string()});
    EXPECT_EQ(read_bytes(input), "precious");
    EXPECT_TRUE(fs::is_symlink(dir / "sym"));
    // A different file is fine while the guard lives.
    write_file_atomic((dir / "out").string(), std::string_view("ok"));
    EXPECT_EQ(read_bytes(dir / "out"), "ok");
  }
  write_file_atomic(input.string(), std::string_view("replaced"));
  EXPECT_EQ(read_bytes(input), "replaced");
}

// The registry protects the file at the input's path: once that path is gone
// (a pruned checkpoint), its inode may be reused by a new file of ours, which
// must stay writable. Renaming the input away stands in for inode reuse.
TEST(OutputPath, InputNoLongerAtItsPathProtectsNothing) {
  const auto dir = scratch_dir();
  write_bytes(dir / "ckpt", "old");
  ProtectedInputs guard({{(dir / "ckpt").string(), "--resume checkpoint"}});
  expect_error([&] { write_file_atomic((dir / "ckpt").string(), std::string_view("x")); },
               {"same file as the --resume checkpoint"});
  fs::rename(dir / "ckpt", dir / "latest.json");
  write_file_atomic((dir / "latest.json").string(), std::string_view("new"));
  EXPECT_EQ(read_bytes(dir / "latest.json"), "new");
}

// Issue 54 A: a file a set of inputs names but lacks (a shard not
// downloaded), protected with missing_too, may not be created by an output,
// by its path or another spelling of it; without missing_too it protects
// nothing, as before.
TEST(OutputPath, AMissingInputProtectedByNameIsNotCreated) {
  const auto dir = scratch_dir();
  fs::create_directory(dir / "sub");
  fs::create_directory_symlink(dir, dir / "here");
  {
    ProtectedInputs guard({{(dir / "shard-2.safetensors").string(), "--weights shard"}},
                          /*missing_too=*/true);
    for (const fs::path& p :
         {dir / "shard-2.safetensors", dir / "sub" / ".." / "shard-2.safetensors",
          dir / "here" / "shard-2.safetensors"})
      expect_error([&] { write_file_atomic(p.string(), std::string_view("x")); },
                   {"--weights shard", "names (missing now)"});
    EXPECT_FALSE(fs::exists(dir / "shard-2.safetensors"));
  }
  ProtectedInputs by_inode_only({{(dir / "shard-3.safetensors").string(), "--weights shard"}});
  write_file_atomic((dir / "shard-3.safetensors").string(), std::string_view("x"));
  EXPECT_EQ(read_bytes(dir / "shard-3.safetensors"), "x");
}

}  // namespace
}  // namespace laga
