// ScopedOmpThreads — sets this thread's OpenMP team size for a scope.
//
// Finite-difference checks call a kernel hundreds of times on tiny inputs;
// each parallel region then costs a wake-up of the team, which on a loaded
// machine (parallel ctest, a build next door) can take milliseconds. Run the
// FD loss single-threaded; compare threaded kernels against references apart.
#pragma once

#include <omp.h>

namespace laga::test {

class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int n) : previous_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ScopedOmpThreads() { omp_set_num_threads(previous_); }
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int previous_;
};

}  // namespace laga::test
