#include "core/allocator.hpp"

#include <malloc.h>

#include <cstdlib>
#include <cstring>

extern char** environ;

namespace laga {

namespace {
// Whether the environment sets any of malloc's options.
bool user_set_malloc_options() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables && std::strstr(tunables, "glibc.malloc.")) return true;
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "MALLOC_", 7) == 0) return true;
  return false;
}
}  // namespace

std::string keep_freed_memory() {
  if (user_set_malloc_options())
    return "malloc options from the environment kept (GLIBC_TUNABLES / MALLOC_*)";
  constexpr int kOneGiB = 1 << 30;
  const bool ok =
      mallopt(M_MMAP_THRESHOLD, kOneGiB) == 1 && mallopt(M_TRIM_THRESHOLD, kOneGiB) == 1;
  return ok ? "freed memory kept for reuse (mmap and trim thresholds 1 GiB)"
            : "malloc refused the thresholds; freed memory goes back to the kernel";
}

}  // namespace laga
