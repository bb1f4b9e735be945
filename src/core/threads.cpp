#include "core/threads.hpp"

#include <omp.h>

#include <algorithm>
#include <thread>

extern "C" void openblas_set_num_threads(int);

namespace laga {

int hardware_cores() {
  return std::max(1u, std::thread::hardware_concurrency());
}

void set_rank_threads(int n) {
  n = std::max(1, n);
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
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
