// The device peak of a rank on CUDA: what is predicted, and what only a
// device can tell (docs/accounting.md, "Device memory"; docs/performance.md,
// "The CUDA backend", says which part of the measured peak is which).
//
// A rank's bytes on the GPU are three parts:
//  1. its device pool (mla/runner.cpp, run_rank): every tensor of the block
//     and every DeviceBuffer a row makes for one call. Predicted exactly: the
//     memory model (mla/memory_model.hpp, predict_memory's peak_working) is
//     the count-only run's peak, equal to the pool's byte for byte.
//  2. what the CUDA rows keep per rank thread in a pool of their own (they
//     outlive the run, cuda/op_table_cuda.cpp): the cuBLASLt workspace, a
//     size laga chooses (kCublasLtWorkspaceBytes, mla/device_peak_prediction.hpp, one GemmContext
//     per rank thread): predicted; cuDNN's SDPA workspace, one buffer per graph pair (the larger of
//     forward's and backward's get_workspace_size, known only after the graphs are built on a
//     device): measured only; RoPE's cos/sin tables and the ragged batches' offsets: counted there,
//     not predicted yet.
//  3. what the libraries and the runtime hold for themselves (the CUDA
//     context, cuBLASLt's and cuDNN's handles and kernels, NCCL's buffers)
//     and the staging of the step's host index arrays (cudaMalloc'd outside
//     any pool): neither predicted nor counted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/gemm_lt.hpp"
#include "mla/device_peak_prediction.hpp"
#include "mla/memory_model.hpp"

namespace laga::cuda {

// Part 1 and part 2's predictable half, for one rank thread
// (mla/device_peak_prediction.hpp: the one description, which laga compare
// reads too).
inline DevicePeakPrediction device_peak_prediction(const MemoryPrediction& model) {
  return laga::device_peak_prediction(Device::cuda, model.peak_working);
}

// One cuDNN SDPA graph pair the calling thread built: its shape and the
// workspace cuDNN asked for each pass.
struct CudnnGraphWorkspace {
  std::string shape;  // "B 1 Sq 4096 Sk 4096 Hq 128 Hk 128 dqk 192 dv 128" (+ " ragged")
  std::int64_t forward = 0, backward = 0;
};

// Part 2 as the calling thread holds it now (cuda/op_table_cuda.cpp): what
// laga_cuda_forms records beside the prediction.
struct KeptDeviceBytes {
  std::int64_t cublaslt_workspace = 0;  // the thread's GemmContext's (0 before its first GEMM)
  std::vector<CudnnGraphWorkspace> cudnn_graphs;
  std::int64_t cudnn_workspace = 0;  // the buffers held: per pair the larger pass's
  std::int64_t total = 0;            // the thread's kept pool: these, RoPE's tables, offsets
};
KeptDeviceBytes kept_device_bytes();

}  // namespace laga::cuda
