#include "core/threads.hpp"

#include <omp.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "core/error.hpp"

extern "C" void openblas_set_num_threads(int);

namespace laga {

int hardware_cores() {
  // The cores this process may run on (taskset, a container's cpuset), not
  // the machine's: ranks pinned to one core share that one.
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return std::max(1u, std::thread::hardware_concurrency());
}

bool address_space_fits(long long bytes) {
  void* p = mmap(nullptr, static_cast<std::size_t>(bytes), PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return false;
  munmap(p, static_cast<std::size_t>(bytes));
  return true;
}

namespace {
// The most threads OpenBLAS was given (1 at the start under an address-space
// limit: tools/blas_threads.cpp); every rank of a process sets it.
std::atomic<int> openblas_threads{1};
}  // namespace

void set_rank_threads(int n) {
  n = std::max(1, n);
  omp_set_num_threads(n);
  // New OpenBLAS threads each map a buffer as they start (and a stack): only
  // where all of them fit, else as many as before (the double GEMMs run on
  // fewer threads; the same bits, OpenBLAS splits no sum over threads).
  const int had = openblas_threads.load();
  const bool fit =
      n <= had || address_space_fits((n - had) * (kOpenBlasBufferBytes + (16LL << 20)));
  const int blas = fit ? n : had;
  openblas_set_num_threads(blas);
  int seen = had;
  while (blas > seen && !openblas_threads.compare_exchange_weak(seen, blas)) {
  }
}

void check_openblas_buffer() {
  thread_local bool mapped = false;
  if (mapped) return;
  LAGA_CHECK(address_space_fits(kOpenBlasBufferBytes),
             "out of memory: the double-precision GEMM (OpenBLAS) needs a buffer of ",
             kOpenBlasBufferBytes, " bytes (", double(kOpenBlasBufferBytes) / 1e9,
             " GB) of address space for each thread that runs one, and the address space has "
             "no room for it; raise the limit (ulimit -v), or use a smaller --seq, --batch or "
             "--sp");
  mapped = true;  // the first GEMM maps it, and OpenBLAS keeps it
}

int threads_per_rank(int ranks) {
  return std::max(1, hardware_cores() / std::max(1, ranks));
}

OmpThreadsScope::OmpThreadsScope(int n) : previous_(omp_get_max_threads()) {
  omp_set_num_threads(std::max(1, n));
}

OmpThreadsScope::~OmpThreadsScope() {
  omp_set_num_threads(previous_);
}

}  // namespace laga
