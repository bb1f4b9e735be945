// OpenBLAS starts its server threads when it is loaded, one per core, and
// each maps a 128 MB buffer; where the address space cannot hold them
// (ulimit -v) it retries without end (blas_memory_alloc, OpenBLAS 0.3), so
// `laga --version` under `ulimit -v 200000` never exited and `compare
// --count-only` spun at 100% CPU after its report (issue 54 item W). laga
// sets every rank's thread count itself (core/threads.hpp,
// set_rank_threads, which raises OpenBLAS's only where its buffers fit), so
// under an address-space limit laga runs itself again, at once, with
// OPENBLAS_NUM_THREADS=1: the library is loaded with no server thread. The
// variable cannot be set earlier in this process: libc's initializer, which
// runs after the executable's preinit array, resets the environment, and
// OpenBLAS reads it in its own initializer. So this runs as the
// executable's constructor: after the libraries' initializers (OpenBLAS's
// threads exist, and die with the exec) and before main.
#include <execinfo.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace {

// glibc passes an ELF constructor argc, argv and envp.
__attribute__((constructor)) void ready_for_memory_running_out(int, char** argv, char**) {
  // An exception thrown through a C frame (pthread_once in a library: a
  // failed allocation in oneDNN's first GEMM) needs glibc's link to the
  // unwinder, which it opens on first use and keeps: opened with no memory
  // left, the process aborts ("libgcc_s.so.1 must be installed for unwinding
  // to work") instead of reporting the allocation. backtrace() opens it now.
  void* frame = nullptr;
  backtrace(&frame, 1);
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) != 0 || as.rlim_cur == RLIM_INFINITY) return;
  const char* now = std::getenv("OPENBLAS_NUM_THREADS");
  if (now != nullptr && std::strcmp(now, "1") == 0) return;
  if (setenv("OPENBLAS_NUM_THREADS", "1", 1) != 0) return;
  execv("/proc/self/exe", argv);
  // Not run again (no /proc): go on as loaded; set_rank_threads and the
  // GEMM's check still keep OpenBLAS from a buffer that cannot be mapped.
}

}  // namespace
