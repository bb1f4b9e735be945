// Per-head attention through cuDNN's fused SDPA (cuDNN 9's graph API, built
// with cudnn-frontend's headers: docs/build.md, "The CUDA backend").
//
// The math, layout and masking are kernels/attention.hpp's: q (B, Sq, Hq,
// dqk), k (B, Sk, Hk, dqk), v (B, Sk, Hk, dv), o (B, Sq, Hq, dv) as bf16 on
// the device (given to cuDNN as (B, H, S, d) with strides), causal aligned at
// the bottom right (cuDNN's DiagonalAlignment_t::BOTTOM_RIGHT), lse (B, Hq,
// Sq) fp32: cuDNN's softmax stats, the natural log of the scaled scores' sum,
// which the ring merges read. Packed documents (doc_start, Sq == Sk) are a
// ragged batch, one cuDNN batch entry per document (cuda/sdpa_ragged.hpp):
// the graphs are built for that document structure, which the refusal and
// the constructor read from s.doc_start on the host (host or managed
// memory; the tiled kernel's device copy will not do). Backward gives dq, dk, dv (a shared key
// head's summed over the query heads that read it, as cuDNN does for GQA).
//
// What is refused, by name (cudnn_sdpa_refusal, before any device work):
// a build without cudnn-frontend's headers, f32/f64 (cuDNN's fused SDPA
// takes bf16 or fp16; laga's own kernels run f32: cuda/attention.hpp),
// packed documents where Sq != Sk (a ring step's queries: laga's tiled
// kernel runs them) or whose offsets pass cuDNN's int32, head dims cuDNN's
// SDPA does not take (above 256,
// or not a multiple of 8). What the device cannot run is cuDNN's to say:
// CudnnSdpa's constructor builds both graphs and throws its
// check_support message, naming the shape.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/communicator.hpp"  // DType
#include "core/bf16.hpp"
#include "kernels/attention.hpp"

namespace laga::cuda {

// Whether this build has the cuDNN SDPA path (cudnn-frontend's headers).
bool cudnn_sdpa_built();

// Empty when the rules above let cuDNN try this shape; otherwise one
// sentence naming the value and what to do. Needs no device.
std::string cudnn_sdpa_refusal(const AttnShape& s, DType dtype);

// The forward and backward graphs of one shape, built on the current device
// (throws laga::Error with cudnn_sdpa_refusal's words, or cuDNN's own
// is-supported message naming the shape), and their workspace, a
// DeviceBuffer the pool counts.
class CudnnSdpa {
 public:
  CudnnSdpa(const AttnShape& s, void* stream = nullptr);
  ~CudnnSdpa();
  CudnnSdpa(const CudnnSdpa&) = delete;
  CudnnSdpa& operator=(const CudnnSdpa&) = delete;

  // The workspace cuDNN asked for each graph (get_workspace_size after
  // build_plans): graph-dependent and known only once built on a device, so
  // it is measured, not predicted (laga_cuda_forms records it per graph;
  // docs/performance.md, "The CUDA backend"). The buffer held is the larger.
  std::int64_t forward_workspace_bytes() const;
  std::int64_t backward_workspace_bytes() const;

  void forward(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v);
  void backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                const bf16* v, const bf16* o, const float* lse);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace laga::cuda
