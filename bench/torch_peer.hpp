// A PyTorch process that runs the same workload as a laga benchmark row, one
// step per request, so that laga and PyTorch steps alternate in one run.
//
// Why alternate: this machine's speed drifts by 1.5x over minutes (other
// tenants on the host's cores, invisible to busy%). Timing PyTorch in a
// separate process before or after laga compares two different machines;
// alternating step by step exposes both to the same drift. The table reports
// the ratio of the two medians, and bench_block.cpp also the median ratio
// within adjacent (PyTorch, laga) pairs.
//
// Protocol (python/bench_torch_block.py --serve): the peer builds its inputs,
// runs its warm-up steps, prints one JSON line {"ready": true, "torch": ver};
// then for each line "step" on its stdin it runs one timed step and prints
// {"ms": wall-ms}. Closing its stdin ends it.
#pragma once

#include <sys/types.h>
#include <cstdio>
#include <string>

namespace laga::bench {

class TorchPeer {
 public:
  // Starts `command` (run by /bin/sh) and waits for its ready line; throws
  // laga::Error naming the command when it fails (its stderr, untouched,
  // says why).
  explicit TorchPeer(const std::string& command);
  ~TorchPeer();
  TorchPeer(const TorchPeer&) = delete;
  TorchPeer& operator=(const TorchPeer&) = delete;

  // One timed step in the peer; its wall time in ms as the peer measured it.
  double step();
  const std::string& torch_version() const { return version_; }

 private:
  std::string read_line();
  std::string command_, version_;
  pid_t pid_ = -1;
  std::FILE* to_ = nullptr;    // the peer's stdin
  std::FILE* from_ = nullptr;  // the peer's stdout
};

}  // namespace laga::bench
