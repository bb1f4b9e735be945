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

}  // namespace laga
