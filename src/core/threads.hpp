// Thread budget of one rank. Ranks that run as threads of one process must
// split the cores: BLAS threads x ranks <= cores, or every timing is a lie.
#pragma once

namespace laga {

// The cores this process may run on: its CPU affinity's count (taskset,
// cpusets), else the machine's.
int hardware_cores();
// Threads for this calling thread's OpenMP regions and for OpenBLAS. OpenBLAS'
// count is process-wide, so every rank of one process must ask for the same n.
void set_rank_threads(int n);
// The share of the cores each of `ranks` in-process ranks gets (at least 1).
int threads_per_rank(int ranks);

// OpenBLAS (the double GEMMs' library, kernels/gemm.cpp) maps a buffer of
// this many bytes for each thread that runs a GEMM (its own server threads
// as they start, and a caller on its first call), and where the address
// space cannot hold it (ulimit -v) it retries without end: a thread at
// 100% CPU, and a process that never exits (blas_memory_alloc in OpenBLAS
// 0.3; docs/reliability.md, "Allocation failures"). So laga starts it with
// one thread (tools/blas_preinit.cpp), raises its count only where the
// buffers fit (set_rank_threads), and asks before each thread's first GEMM.
inline constexpr long long kOpenBlasBufferBytes = (128LL << 20) + 4096;
// Whether `bytes` more of address space can be mapped now (a probe: mapped
// without access and unmapped at once).
bool address_space_fits(long long bytes);
// Throws laga::Error (out of memory, naming the buffer, its size and
// ulimit -v) unless this thread's OpenBLAS buffer is mapped or can be.
void check_openblas_buffer();

// This thread's OpenMP thread count set to n while it lives, then restored:
// a count-only run of a rank on another thread sizes what follows the
// rank's thread count (the bf16 flash kernels' workspace, mla/block.cpp) as
// the rank would. OpenBLAS's count is left alone (process-wide; a count-only
// run calls no kernel).
class OmpThreadsScope {
 public:
  explicit OmpThreadsScope(int n);
  ~OmpThreadsScope();
  OmpThreadsScope(const OmpThreadsScope&) = delete;
  OmpThreadsScope& operator=(const OmpThreadsScope&) = delete;

 private:
  int previous_;
};

}  // namespace laga
