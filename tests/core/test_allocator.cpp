// The allocator policy: set unless the user set malloc's own options.
#include "core/allocator.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace laga {
namespace {

// Under AddressSanitizer malloc is ASan's, whose mallopt accepts nothing.
#if defined(__SANITIZE_ADDRESS__)
constexpr const char* kDefault =
    "malloc refused the thresholds; freed memory goes back to the kernel";
#else
constexpr const char* kDefault = "freed memory kept for reuse (mmap and trim thresholds 1 GiB)";
#endif

TEST(Allocator, KeepsFreedMemoryUnlessTheUserSetMallocOptions) {
  ::unsetenv("GLIBC_TUNABLES");
  ::unsetenv("MALLOC_ARENA_MAX");
  EXPECT_EQ(keep_freed_memory(), kDefault);
  ::setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000", 1);
  EXPECT_NE(keep_freed_memory().find("from the environment kept"), std::string::npos);
  ::setenv("GLIBC_TUNABLES", "glibc.rtld.nns=2", 1);  // not malloc's
  EXPECT_EQ(keep_freed_memory(), kDefault);
  ::unsetenv("GLIBC_TUNABLES");
  ::setenv("MALLOC_ARENA_MAX", "2", 1);
  EXPECT_NE(keep_freed_memory().find("from the environment kept"), std::string::npos);
  ::unsetenv("MALLOC_ARENA_MAX");
}

}  // namespace
}  // namespace laga
