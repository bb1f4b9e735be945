// The CUDA backend's kernel table rows (mla/op_table.hpp, the seam's
// contract: /docs/architecture.md "The op layer and the kernel table"). Each
// row is a thin adapter from an OpCall's slots to one of this layer's raw
// entry points; every pointer in a call is a device pointer. why_not names
// the refused value in the table's words; a device's own limits (cuDNN's
// check_support, the shared memory per block) are asked at run time, so a
// row that the rules admit can still throw from run() naming the shape.
//
// Scratch: a row that needs some declares it (KernelRow::workspace_bytes:
// attention backward's delta, the sparse attention's selection copy and
// sort) and the op layer hands it as the call's workspace, a pool tensor
// made before it asks whether the call computes (ops::row_workspace), so
// the count-only run holds it too; delta_scratch's own DeviceBuffer is for
// a caller that hands none (a check program calling a row directly). The cuBLASLt handle and
// its workspace, cuDNN's graphs per shape and the RoPE tables on the device
// are kept per thread (one rank per thread or process, one device each), in
// a pool of their own, not the rank's; the op layer's count-only runs never
// call run(), so the rank's prediction has none of them. What of them is
// predicted (the cuBLASLt workspace) and what only measured (cuDNN's) is
// cuda/device_peak.hpp's to say; kept_device_bytes (at the end) reads them.
// Neither counted nor predicted: the staging buffers of the step's host
// index arrays (RoPE positions, packed documents' starts: std::vectors of
// mla::Step, which the rows copy to the device per call, staged_indices).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "core/error.hpp"
#include "cuda/attention.hpp"
#include "cuda/cuda_error.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/device_peak.hpp"
#include "cuda/elementwise.hpp"
#include "cuda/gemm_lt.hpp"
#include "cuda/sdpa_cudnn.hpp"
#include "cuda/sdpa_ragged.hpp"
#include "cuda/sparse_attention.hpp"
#include "mla/form_spec.hpp"  // AttentionKind
#include "mla/op_table.hpp"

namespace laga::ops {

namespace {

using Why = std::optional<std::string>;
using cuda::DeviceBuffer;

Why dtype_not_in(RunDtype d, std::initializer_list<RunDtype> ok) {
  for (RunDtype o : ok)
    if (o == d) return std::nullopt;
  std::string names;
  for (RunDtype o : ok) names += std::string(names.empty() ? "" : " or ") + to_string(o);
  return std::string("dtype ") + to_string(d) + " (it takes " + names + ")";
}

DType wire_dtype(RunDtype d) {
  return d == RunDtype::bf16 ? DType::bf16 : DType::f32;
}

// n int64 indices at `host` on the device: the pointer itself when it is
// device or managed memory already, else a copy in this thread's staging
// buffer `slot` (0: RoPE positions, 1: document starts), grown as needed
// and kept (cudaMalloc'd outside the pool, as the cuBLASLt workspace is).
const std::int64_t* staged_indices(const std::int64_t* host, std::int64_t n, int slot) {
  if (!host || n <= 0) return host;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, host) == cudaSuccess &&
      (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged))
    return host;
  (void)cudaGetLastError();
  struct Staging {
    void* p = nullptr;
    std::int64_t bytes = 0;
    ~Staging() {
      if (p) (void)cudaFree(p);
    }
  };
  thread_local Staging staging[2];
  Staging& st = staging[slot];
  const std::int64_t bytes = 8 * n;
  if (st.bytes < bytes) {
    if (st.p) (void)cudaFree(st.p);
    st.p = nullptr, st.bytes = 0;
    cuda::check_cuda(cudaMalloc(&st.p, static_cast<std::size_t>(bytes)),
                     "cudaMalloc of index staging");
    st.bytes = bytes;
  }
  cuda::check_cuda(cudaMemcpy(st.p, host, static_cast<std::size_t>(bytes), cudaMemcpyHostToDevice),
                   "cudaMemcpy of indices to the device");
  return static_cast<const std::int64_t*>(st.p);
}
// The call's attention shape with its document starts on the device.
AttnShape device_shape(const AttnShape& s) {
  AttnShape d = s;
  d.doc_start = staged_indices(s.doc_start, s.B * s.Sk, 1);
  return d;
}

// ------------------------------------------------------------------ gemm

// The pool of what a thread keeps from call to call (cuBLASLt's workspace,
// cuDNN's per shape, the RoPE tables): their own, not the rank's device
// pool, which ends with the run while they live on with the thread (the
// rank pool is the memory model's; cuda/device_peak.hpp adds the cuBLASLt
// workspace to it). Made before them, so destroyed after them.
MemoryPool& kept_pool() {
  thread_local MemoryPool pool;
  return pool;
}

// The thread's cuBLASLt context (kept_pool() first: the pool outlives it).
std::unique_ptr<cuda::GemmContext>& thread_gemm_context() {
  (void)kept_pool();
  thread_local std::unique_ptr<cuda::GemmContext> ctx;
  return ctx;
}
cuda::GemmContext& gemm_context() {
  MemoryPool& pool = kept_pool();
  std::unique_ptr<cuda::GemmContext>& ctx = thread_gemm_context();
  if (!ctx) {
    const PoolScope in_kept(pool);
    ctx = std::make_unique<cuda::GemmContext>();
  }
  return *ctx;
}

cuda::GemmArgs gemm_args(const OpCall& c) {
  const OpShape& s = c.shape;
  cuda::GemmArgs g;
  g.trans_a = s.trans_a, g.trans_b = s.trans_b, g.M = s.m, g.N = s.n, g.K = s.k;
  g.alpha = static_cast<float>(c.alpha), g.beta = static_cast<float>(c.beta);
  g.A = c.in[0], g.lda = s.lda, g.B = c.in[1], g.ldb = s.ldb, g.C = c.out[0], g.ldc = s.ldc;
  g.dtype = wire_dtype(c.dtype), g.c_dtype = DType::f32;
  return g;
}
Why gemm_takes(RunDtype d, const OpShape&) {
  return dtype_not_in(d, {RunDtype::fp32, RunDtype::bf16});
}
void run_gemm(const OpCall& c) {
  gemm_context().gemm(gemm_args(c));
}

// ------------------------------------------------------------- attention

float* delta_scratch(const OpCall& c, std::int64_t bytes, DeviceBuffer& own) {
  if (c.workspace && c.workspace_bytes >= bytes) return static_cast<float*>(c.workspace);
  own = DeviceBuffer(bytes, "attention delta (device)");
  return own.as<float>();
}
std::int64_t delta_bytes(RunDtype, const OpShape& s) {
  return 4 * s.attn.B * s.attn.Hq * s.attn.Sq;
}

Why flash_only(const OpShape& s) {
  if (s.attention != AttentionKind::flash)
    return std::string(
        "attention eager (the CUDA rows are flash-style: no probabilities kept); "
        "use --attention flash");
  return std::nullopt;
}

Why tiled_takes(RunDtype d, const OpShape& s) {
  if (Why w = dtype_not_in(d, {RunDtype::fp32, RunDtype::bf16})) return w;
  if (Why w = flash_only(s)) return w;
  // The shared memory is checked against the device at run time; here
  // against Hopper's, the architecture this build targets.
  const std::string m =
      cuda::attention_refusal(cuda::AttnKernel::dense, s.attn, wire_dtype(d), 232448);
  if (!m.empty()) return m;
  return std::nullopt;
}
Why latent_tiled_takes(RunDtype d, const OpShape& s) {
  if (s.attn.Hk != 1)
    return "Hk " + std::to_string(s.attn.Hk) + " (latent-space attention has one key head)";
  return tiled_takes(d, s);
}

template <class T>
void run_tiled_forward(const OpCall& c) {
  cuda::attention_forward<T>(device_shape(c.shape.attn), static_cast<T*>(c.out[0]),
                             static_cast<float*>(c.out[1]), static_cast<const T*>(c.in[0]),
                             static_cast<const T*>(c.in[1]), static_cast<const T*>(c.in[2]));
}
template <class T>
void run_tiled_backward(const OpCall& c) {
  DeviceBuffer own;
  float* delta = delta_scratch(c, delta_bytes(c.dtype, c.shape), own);
  cuda::attention_backward<T>(
      device_shape(c.shape.attn), static_cast<T*>(c.out[0]), static_cast<T*>(c.out[1]),
      static_cast<T*>(c.out[2]), static_cast<const T*>(c.in[0]), static_cast<const T*>(c.in[1]),
      static_cast<const T*>(c.in[2]), static_cast<const T*>(c.in[3]),
      static_cast<const T*>(c.in[4]), static_cast<const float*>(c.in[5]), delta);
}
void run_tiled_forward_any(const OpCall& c) {
  c.dtype == RunDtype::bf16 ? run_tiled_forward<bf16>(c) : run_tiled_forward<float>(c);
}
void run_tiled_backward_any(const OpCall& c) {
  c.dtype == RunDtype::bf16 ? run_tiled_backward<bf16>(c) : run_tiled_backward<float>(c);
}

// cuDNN's graphs, one per shape, kept per thread.
// Packed documents: a graph per document structure (its ragged batch's
// first tokens are in the key), as cuDNN's batch is then the documents.
using SdpaKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                           std::int64_t, std::int64_t, double, bool, std::vector<std::int64_t>>;
std::map<SdpaKey, std::unique_ptr<cuda::CudnnSdpa>>& thread_sdpa_graphs() {
  (void)kept_pool();  // the pool outlives the graphs' workspaces
  thread_local std::map<SdpaKey, std::unique_ptr<cuda::CudnnSdpa>> graphs;
  return graphs;
}
cuda::CudnnSdpa& sdpa_for(const AttnShape& s) {
  using Key = SdpaKey;
  MemoryPool& pool = kept_pool();
  auto& graphs = thread_sdpa_graphs();
  const Key key{s.B,
                s.Sq,
                s.Sk,
                s.Hq,
                s.Hk,
                s.dqk,
                s.dv,
                s.scale,
                s.causal,
                s.doc_start ? cuda::ragged_documents(s.doc_start, s.B, s.Sq, 1, 1, 1).first_token
                            : std::vector<std::int64_t>{}};
  auto& g = graphs[key];
  if (!g) {
    const PoolScope in_kept(pool);
    g = std::make_unique<cuda::CudnnSdpa>(s);
  }
  return *g;
}
Why cudnn_takes(RunDtype d, const OpShape& s) {
  if (Why w = flash_only(s)) return w;
  const std::string m = cuda::cudnn_sdpa_refusal(s.attn, wire_dtype(d));
  if (!m.empty()) return m;
  return std::nullopt;
}
void run_cudnn_forward(const OpCall& c) {
  sdpa_for(c.shape.attn)
      .forward(static_cast<bf16*>(c.out[0]), static_cast<float*>(c.out[1]),
               static_cast<const bf16*>(c.in[0]), static_cast<const bf16*>(c.in[1]),
               static_cast<const bf16*>(c.in[2]));
}
void run_cudnn_backward(const OpCall& c) {
  sdpa_for(c.shape.attn)
      .backward(static_cast<bf16*>(c.out[0]), static_cast<bf16*>(c.out[1]),
                static_cast<bf16*>(c.out[2]), static_cast<const bf16*>(c.in[0]),
                static_cast<const bf16*>(c.in[1]), static_cast<const bf16*>(c.in[2]),
                static_cast<const bf16*>(c.in[3]), static_cast<const bf16*>(c.in[4]),
                static_cast<const float*>(c.in[5]));
}

// ------------------------------------------------------ fused latent (laga_fused)

LatentAttnParams<float> latent_params(const OpCall& c) {
  LatentAttnParams<float> p;
  p.shape = device_shape(c.shape.attn);
  p.C = c.shape.C, p.dn = c.shape.dn;
  p.q = static_cast<const float*>(c.in[0]);
  p.c = static_cast<const float*>(c.in[1]), p.ld_c = c.shape.ld_c;
  p.k_pe = static_cast<const float*>(c.in[2]), p.ld_k_pe = c.shape.ld_k_pe;
  p.w_kv = static_cast<const float*>(c.in[3]);
  return p;
}
// bf16: the kernel's bf16 variant (tensor-core up-projection, the CPU bf16
// path's rounding points: cuda/attention.hpp), on the fp32 containers of
// bf16 values the op layer hands a fused call (Bf16Operands::fp32_values,
// as the CPU's flash_latent_fp32 row takes them).
Why fused_takes(RunDtype d, const OpShape& s) {
  if (Why w = dtype_not_in(d, {RunDtype::fp32, RunDtype::bf16})) return w;
  const std::string m =
      cuda::attention_refusal(cuda::AttnKernel::fused_latent, s.attn, wire_dtype(d), 232448);
  if (!m.empty()) return m;
  return std::nullopt;
}
void run_fused_forward(const OpCall& c) {
  cuda::fused_latent_forward(latent_params(c), static_cast<float*>(c.out[0]),
                             static_cast<float*>(c.out[1]), wire_dtype(c.dtype));
}
void run_fused_backward(const OpCall& c) {
  LatentAttnGrads<float> g;
  g.dq = static_cast<float*>(c.out[0]);
  g.dc = static_cast<float*>(c.out[1]), g.ld_dc = c.shape.ld_dc;
  g.dk_pe = static_cast<float*>(c.out[2]), g.ld_dk_pe = c.shape.ld_dk_pe;
  g.dw_kv = static_cast<float*>(c.out[3]);
  DeviceBuffer own;
  float* delta = delta_scratch(c, delta_bytes(c.dtype, c.shape), own);
  cuda::fused_latent_backward(latent_params(c), g, static_cast<const float*>(c.in[4]),
                              static_cast<const float*>(c.in[5]),
                              static_cast<const float*>(c.in[6]), delta, wire_dtype(c.dtype));
}

// ------------------------------------------------- merge, norm, rope (fp32 data)

Why fp32_data(RunDtype d, const OpShape&) {
  return dtype_not_in(d, {RunDtype::fp32, RunDtype::bf16});  // bf16 runs keep these in fp32
}
void run_lse_merge(const OpCall& c) {
  const OpShape& s = c.shape;
  LseMergeShape m;
  m.Bc = s.attn.B, m.Sq = s.attn.Sq, m.H = s.cols, m.dv = s.attn.dv, m.L = s.rows, m.b0 = s.b0;
  m.q_row = s.q_row, m.first = s.attn.causal;
  cuda::lse_merge(m, static_cast<float*>(c.out[0]), static_cast<float*>(c.out[1]),
                  static_cast<const float*>(c.in[0]), static_cast<const float*>(c.in[1]));
}
void run_rmsnorm_forward(const OpCall& c) {
  const OpShape& s = c.shape;
  cuda::rmsnorm_forward(static_cast<float*>(c.out[0]), static_cast<float*>(c.out[1]),
                        static_cast<const float*>(c.in[0]), s.lda,
                        static_cast<const float*>(c.in[1]), s.rows, s.cols, c.alpha);
}
void run_rmsnorm_backward(const OpCall& c) {
  const OpShape& s = c.shape;
  cuda::rmsnorm_backward(
      static_cast<float*>(c.out[0]), s.ldc, static_cast<float*>(c.out[1]),
      static_cast<const float*>(c.in[0]), s.ldb, static_cast<const float*>(c.in[1]), s.lda,
      static_cast<const float*>(c.in[2]), static_cast<const float*>(c.in[3]), s.rows, s.cols);
}

// A RopeTable's cos/sin on the device, uploaded at its first use on this
// thread and kept while the table lives at the same address and extents.
const cuda::DeviceRope& device_rope(const RopeTable& t) {
  struct Uploaded {
    std::int64_t dim = 0, positions = 0;
    DeviceBuffer cos, sin;
    cuda::DeviceRope view;
  };
  MemoryPool& pool = kept_pool();
  thread_local std::map<const RopeTable*, Uploaded> tables;
  const PoolScope in_kept(pool);
  Uploaded& u = tables[&t];
  if (!u.view.cos || u.dim != t.dim() || u.positions != t.positions()) {
    LAGA_CHECK(t.backed(),
               "cuda rope: the RopeTable has no cos/sin (a count-only table); "
               "build it with its values");
    const std::int64_t half = t.dim() / 2, n = t.positions() * half;
    std::vector<float> c(static_cast<std::size_t>(n)), s(static_cast<std::size_t>(n));
    for (std::int64_t p = 0; p < t.positions(); ++p)
      for (std::int64_t i = 0; i < half; ++i) {
        c[static_cast<std::size_t>(p * half + i)] = static_cast<float>(t.cos(p, i));
        s[static_cast<std::size_t>(p * half + i)] = static_cast<float>(t.sin(p, i));
      }
    u.cos = DeviceBuffer(4 * n, "rope cos (device)", MemCategory::parameters);
    u.sin = DeviceBuffer(4 * n, "rope sin (device)", MemCategory::parameters);
    u.cos.upload(c.data(), 4 * n);
    u.sin.upload(s.data(), 4 * n);
    u.dim = t.dim(), u.positions = t.positions();
    u.view = cuda::DeviceRope{u.cos.as<float>(), u.sin.as<float>(), t.dim(), t.positions()};
  }
  return u.view;
}
template <bool Inverse>
void run_rope(const OpCall& c) {
  const OpShape& s = c.shape;
  LAGA_CHECK(c.context, "cuda rope: the call has no RopeTable (OpCall::context)");
  cuda::rope_apply(static_cast<float*>(c.out[0]), s.batch, s.tokens, s.heads, s.ld_token, s.ld_head,
                   s.pos0,
                   staged_indices(static_cast<const std::int64_t*>(c.in[0]), s.batch * s.tokens, 0),
                   device_rope(*static_cast<const RopeTable*>(c.context)), Inverse);
}

// ------------------------------------------------- sparse attention (DSA)
// DeepSeek Sparse Attention's main attention over each query's selected keys
// (cuda/sparse_attention.hpp), per head or latent (any Hk dividing Hq): fp32,
// and bf16 operands with fp32 o, lse and gradients, as the CPU's
// sparse_gather and sparse_gather_bf16 rows. The backward's dk, dv are a
// deterministic scatter (sorted pairs, no atomics), so the row takes the
// invariant mode's calls too. Its scratch is the call's workspace, sized by
// cuda::sparse_attention_scratch (the row's workspace_bytes; the op layer
// makes it a pool tensor, so the count-only run and the memory model count
// it): the selection's device copy first, then the backward's sort.
//
// The selection idx (B, Sq, K) int32 is copied into the workspace on every
// call, from wherever it is (cudaMemcpyDefault): the DSA forms keep it in a
// host std::vector, which the op layer checks on the host
// (sparse_attention_check_indices), so each pass uploads it (268 MB at
// V3.2's S 32k); a selection kept on the device would be copied there.
std::int64_t sparse_forward_workspace(RunDtype, const OpShape& s) {
  return cuda::sparse_attention_scratch({s.attn, s.k}, false).total();
}
std::int64_t sparse_backward_workspace(RunDtype, const OpShape& s) {
  return cuda::sparse_attention_scratch({s.attn, s.k}, true).total();
}
const std::int32_t* device_selection(const OpCall& c, int slot, bool backward) {
  const auto* idx = static_cast<const std::int32_t*>(c.in[slot]);
  const cuda::SparseAttnScratch w =
      cuda::sparse_attention_scratch({c.shape.attn, c.shape.k}, backward);
  LAGA_CHECK(c.workspace && c.workspace_bytes >= w.total(), "sparse_gather_cuda: a workspace of ",
             c.workspace_bytes, " bytes where the call needs ", w.total(),
             " (cuda/sparse_attention.hpp, sparse_attention_scratch; the op layer makes it)");
  const std::int64_t n = c.shape.attn.B * c.shape.attn.Sq * c.shape.k;
  if (!idx || n <= 0) return idx;
  cuda::check_cuda(cudaMemcpy(c.workspace, idx, static_cast<std::size_t>(4 * n), cudaMemcpyDefault),
                   "cudaMemcpy of the sparse attention selection into its workspace");
  return static_cast<const std::int32_t*>(c.workspace);
}
Why sparse_cuda_takes(RunDtype d, const OpShape& s) {
  if (Why w = dtype_not_in(d, {RunDtype::fp32, RunDtype::bf16})) return w;
  const std::string m = cuda::sparse_attention_refusal({s.attn, s.k});
  if (!m.empty()) return m;
  return std::nullopt;
}
template <class In>
void run_sparse_cuda_forward(const OpCall& c) {
  const std::int32_t* idx = device_selection(c, 3, false);
  cuda::sparse_attention_forward<In>({c.shape.attn, c.shape.k}, static_cast<float*>(c.out[0]),
                                     static_cast<float*>(c.out[1]), static_cast<const In*>(c.in[0]),
                                     static_cast<const In*>(c.in[1]),
                                     static_cast<const In*>(c.in[2]), idx);
}
template <class In>
void run_sparse_cuda_backward(const OpCall& c) {
  const std::int32_t* idx = device_selection(c, 6, true);
  const std::int64_t copy = cuda::sparse_attention_scratch({c.shape.attn, c.shape.k}, true).idx;
  cuda::sparse_attention_backward<In>(
      {c.shape.attn, c.shape.k}, static_cast<float*>(c.out[0]), static_cast<float*>(c.out[1]),
      static_cast<float*>(c.out[2]), static_cast<const In*>(c.in[0]),
      static_cast<const In*>(c.in[1]), static_cast<const In*>(c.in[2]),
      static_cast<const In*>(c.in[3]), static_cast<const float*>(c.in[4]),
      static_cast<const float*>(c.in[5]), idx, static_cast<unsigned char*>(c.workspace) + copy,
      c.workspace_bytes - copy);
}
void run_sparse_cuda_forward_any(const OpCall& c) {
  c.dtype == RunDtype::bf16 ? run_sparse_cuda_forward<bf16>(c) : run_sparse_cuda_forward<float>(c);
}
void run_sparse_cuda_backward_any(const OpCall& c) {
  c.dtype == RunDtype::bf16 ? run_sparse_cuda_backward<bf16>(c)
                            : run_sparse_cuda_backward<float>(c);
}
// --------------------------------------------- data movement (copy_rows, fill)

DType move_type(RunDtype d) {
  return d == RunDtype::fp64 ? DType::f64 : d == RunDtype::bf16 ? DType::bf16 : DType::f32;
}
void run_copy_rows(const OpCall& c) {
  const OpShape& s = c.shape;
  cuda::copy_rows(c.out[0], s.ldc, c.in[0], s.lda, s.rows, s.cols, move_type(c.dtype), s.src_bf16,
                  s.accumulate);
}
void run_fill(const OpCall& c) {
  cuda::fill_rows(c.out[0], c.shape.ldc, c.shape.rows, c.shape.cols, move_type(c.dtype), c.alpha);
}

// cuDNN's rows rank first (0): where they take a call they are picked.
const KernelRow kRows[] = {
    {Device::cuda, Op::gemm, "gemm_cublaslt", &gemm_takes, &run_gemm, 0},
    {Device::cuda, Op::attention_forward, "attention_cudnn_sdpa", &cudnn_takes, &run_cudnn_forward,
     0},
    {Device::cuda, Op::attention_forward, "attention_cuda_tiled", &tiled_takes,
     &run_tiled_forward_any, 1},
    {Device::cuda, Op::attention_backward, "attention_cudnn_sdpa", &cudnn_takes,
     &run_cudnn_backward, 0},
    {Device::cuda, Op::attention_backward, "attention_cuda_tiled", &tiled_takes,
     &run_tiled_backward_any, 1, Bf16Operands::bf16, &delta_bytes},
    {Device::cuda, Op::latent_attention_forward, "latent_attention_cuda_tiled", &latent_tiled_takes,
     &run_tiled_forward_any, 0},
    {Device::cuda, Op::latent_attention_backward, "latent_attention_cuda_tiled",
     &latent_tiled_takes, &run_tiled_backward_any, 0, Bf16Operands::bf16, &delta_bytes},
    {Device::cuda, Op::fused_latent_attention_forward, "fused_latent_cuda", &fused_takes,
     &run_fused_forward, 0, Bf16Operands::fp32_values},
    {Device::cuda, Op::fused_latent_attention_backward, "fused_latent_cuda", &fused_takes,
     &run_fused_backward, 0, Bf16Operands::fp32_values, &delta_bytes},
    {Device::cuda, Op::lse_merge, "lse_merge_cuda", &fp32_data, &run_lse_merge, 0},
    {Device::cuda, Op::rmsnorm_forward, "rmsnorm_cuda", &fp32_data, &run_rmsnorm_forward, 0},
    {Device::cuda, Op::rmsnorm_backward, "rmsnorm_cuda", &fp32_data, &run_rmsnorm_backward, 0},
    {Device::cuda, Op::rope_forward, "rope_cuda", &fp32_data, &run_rope<false>, 0},
    {Device::cuda, Op::rope_backward, "rope_cuda", &fp32_data, &run_rope<true>, 0},
    {Device::cuda, Op::sparse_attention_forward, "sparse_gather_cuda", &sparse_cuda_takes,
     &run_sparse_cuda_forward_any, 0, Bf16Operands::bf16, &sparse_forward_workspace},
    {Device::cuda, Op::sparse_attention_backward, "sparse_gather_cuda", &sparse_cuda_takes,
     &run_sparse_cuda_backward_any, 0, Bf16Operands::bf16, &sparse_backward_workspace},
    // The forms' copies, sums, conversions and zeroing (issue 52), on the
    // device; the rules are every backend's (op_table.hpp).
    {Device::cuda, Op::copy_rows, "copy_rows_cuda", &copy_rows_refusal, &run_copy_rows, 0},
    {Device::cuda, Op::fill, "fill_cuda", &fill_refusal, &run_fill, 0},
};

}  // namespace

std::span<const KernelRow> cuda_kernel_rows() {
  return kRows;
}

}  // namespace laga::ops

namespace laga::cuda {

KeptDeviceBytes kept_device_bytes() {
  KeptDeviceBytes k;
  k.total = ops::kept_pool().current_total();
  if (const auto& ctx = ops::thread_gemm_context()) k.cublaslt_workspace = ctx->workspace_bytes();
  for (const auto& [key, g] : ops::thread_sdpa_graphs()) {
    if (!g) continue;
    const auto& [B, Sq, Sk, Hq, Hk, dqk, dv, scale, causal, docs] = key;
    (void)scale, (void)causal;
    CudnnGraphWorkspace w;
    w.shape = cat("B ", B, " Sq ", Sq, " Sk ", Sk, " Hq ", Hq, " Hk ", Hk, " dqk ", dqk, " dv ", dv,
                  docs.empty() ? "" : cat(" ragged (", docs.size(), " documents)"));
    w.forward = g->forward_workspace_bytes(), w.backward = g->backward_workspace_bytes();
    k.cudnn_workspace += std::max(w.forward, w.backward);
    k.cudnn_graphs.push_back(std::move(w));
  }
  return k;
}

}  // namespace laga::cuda
