// Thread budget of one rank. Ranks that run as threads of one process must
// split the cores: BLAS threads x ranks <= cores, or every timing is a lie.
#pragma once

namespace laga {

int hardware_cores();
// Threads for this calling thread's OpenMP regions and for OpenBLAS. OpenBLAS'
// count is process-wide, so every rank of one process must ask for the same n.
void set_rank_threads(int n);
// The share of the cores each of `ranks` in-process ranks gets (at least 1).
int threads_per_rank(int ranks);

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
