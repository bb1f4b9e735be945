// The C allocator's policy for laga's processes (docs/performance.md,
// "Page faults").
//
// glibc serves every allocation above its mmap threshold (dynamic, up to
// 32 MiB) with a fresh mmap and unmaps it when it is freed. A training step
// frees its large activations and allocates them again the next step, so
// every step maps fresh memory and takes one minor page fault per 4 KiB it
// touches (about 14,000 a step for the D 2048 block, S 2048). Raising the
// mmap and trim thresholds keeps freed memory in the heap for the next step;
// the process's footprint is then its peak, which is what laga predicts and
// checks anyway.
#pragma once

#include <string>

namespace laga {

// Sets glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to 1 GiB, unless the
// user set malloc's own options (GLIBC_TUNABLES naming glibc.malloc, or a
// MALLOC_*_ variable): theirs win. Returns what it did, for a log line.
std::string keep_freed_memory();

}  // namespace laga
