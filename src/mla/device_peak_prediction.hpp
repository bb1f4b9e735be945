// The device peak a rank's count-only run predicts (issue 52: count-only
// predicts the device peak as it predicts the host's; docs/accounting.md,
// "Device memory"): the rank's device pool's working peak (the memory
// model's, equal to the count-only run's byte for byte) plus what the
// device's backend keeps per rank thread in a size laga chooses. Needs no
// CUDA: `laga compare --device cuda` reads it as laga_cuda_forms does.
// cuda/device_peak.hpp says what else a GPU holds (measured only, or
// neither counted nor predicted).
#pragma once

#include <cstdint>

#include "core/device.hpp"

namespace laga {

// The cuBLASLt workspace of one cuda::GemmContext, one per rank thread (a
// size laga chooses: cuda/gemm_lt.hpp allocates it in the thread's kept pool,
// cuda/op_table_cuda.cpp).
inline constexpr std::int64_t kCublasLtWorkspaceBytes = 32ll << 20;

struct DevicePeakPrediction {
  std::int64_t rank_pool = 0;           // the pool's working peak: exact
  std::int64_t cublaslt_workspace = 0;  // cuda: one GemmContext's; other devices none
  std::int64_t predicted() const { return rank_pool + cublaslt_workspace; }
};

// rank_pool_working: a rank's working peak (activations + comm staging, the
// larger of forward+backward's and the gradient all-reduce's), the memory
// model's or a count-only run's.
inline DevicePeakPrediction device_peak_prediction(Device device, std::int64_t rank_pool_working) {
  DevicePeakPrediction p;
  p.rank_pool = rank_pool_working;
  p.cublaslt_workspace = device == Device::cuda ? kCublasLtWorkspaceBytes : 0;
  return p;
}

}  // namespace laga
