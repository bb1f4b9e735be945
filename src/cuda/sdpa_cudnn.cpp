// cuDNN's fused SDPA (contract: cuda/sdpa_cudnn.hpp).
#include "cuda/sdpa_cudnn.hpp"

#include "core/error.hpp"

#ifdef LAGA_HAVE_CUDNN_FRONTEND
#define CUDNN_FRONTEND_SKIP_JSON_LIB 1
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <unordered_map>

#include "cuda/cuda_error.hpp"
#include "cuda/device_buffer.hpp"
#endif

namespace laga::cuda {

bool cudnn_sdpa_built() {
#ifdef LAGA_HAVE_CUDNN_FRONTEND
  return true;
#else
  return false;
#endif
}

std::string cudnn_sdpa_refusal(const AttnShape& s, DType dtype) {
  const auto shape = [&] {
    return cat("cudnn sdpa (B ", s.B, ", Sq ", s.Sq, ", Sk ", s.Sk, ", Hq ", s.Hq, ", Hk ", s.Hk,
               ", dqk ", s.dqk, ", dv ", s.dv, s.causal ? ", causal" : "", ")");
  };
  if (!cudnn_sdpa_built())
    return shape() +
           ": this build has no cudnn-frontend headers; run scripts/setup.sh --cuda "
           "BUILD_DIR and configure again (laga's own kernels run meanwhile)";
  AttnShape host = s;
  host.doc_start = nullptr;
  try {
    host.validate();
  } catch (const Error& e) {
    return cat(shape(), ": ", e.what());
  }
  if (dtype != DType::bf16)
    return cat(shape(), ": dtype ", dtype == DType::f32 ? "f32" : "f64",
               " is not taken by cuDNN's fused SDPA (bf16 here); laga's own kernel runs f32");
  if (s.doc_start)
    return shape() +
           ": packed documents (doc_start) are not routed to cuDNN's ragged offsets "
           "yet; laga's own kernel runs them";
  for (const auto& [name, d] : {std::pair<const char*, std::int64_t>{"dqk", s.dqk}, {"dv", s.dv}})
    if (d > 256 || d % 8 != 0)
      return cat(shape(), ": head dim ", name, " ", d,
                 " is not one cuDNN's fused SDPA takes (a multiple of 8, at most 256); laga's own "
                 "kernel runs it");
  return {};
}

#ifdef LAGA_HAVE_CUDNN_FRONTEND
namespace fe = cudnn_frontend;

namespace {
enum Uid : std::int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

void check_fe(fe::error_t e, const std::string& what) {
  LAGA_CHECK(e.is_good(), what, ": cuDNN says: ", e.get_message(),
             "; laga's own kernel (cuda/attention.hpp) runs this shape");
}

std::shared_ptr<fe::graph::Tensor_attributes> bhsd(fe::graph::Graph& g, const char* name,
                                                   std::int64_t uid, std::int64_t B, std::int64_t H,
                                                   std::int64_t S, std::int64_t d) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({B, H, S, d})
                      .set_stride({S * H * d, d, H * d, 1}));
}
}  // namespace

struct CudnnSdpa::Impl {
  AttnShape s;
  cudnnHandle_t handle = nullptr;
  fe::graph::Graph fwd, bwd;
  DeviceBuffer workspace;
};

CudnnSdpa::CudnnSdpa(const AttnShape& s, void* stream) : impl_(std::make_unique<Impl>()) {
  const std::string why = cudnn_sdpa_refusal(s, DType::bf16);
  LAGA_CHECK(why.empty(), why);
  Impl& m = *impl_;
  m.s = s;
  const std::string what = cat("cudnn sdpa (B ", s.B, ", Sq ", s.Sq, ", Sk ", s.Sk, ", Hq ", s.Hq,
                               ", Hk ", s.Hk, ", dqk ", s.dqk, ", dv ", s.dv, ")");
  LAGA_CHECK(cudnnCreate(&m.handle) == CUDNN_STATUS_SUCCESS, what,
             ": cudnnCreate failed; check the device and that libcudnn 9 is on the library path");
  cudnnSetStream(m.handle, static_cast<cudaStream_t>(stream));
  const auto setup = [&](fe::graph::Graph& g) {
    g.set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
  };
  {
    auto& g = m.fwd;
    setup(g);
    auto q = bhsd(g, "Q", kQ, s.B, s.Hq, s.Sq, s.dqk), k = bhsd(g, "K", kK, s.B, s.Hk, s.Sk, s.dqk),
         v = bhsd(g, "V", kV, s.B, s.Hk, s.Sk, s.dv);
    auto opts =
        fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(
            static_cast<float>(s.scale));
    if (s.causal) opts.set_causal_mask_bottom_right(true);
    auto [o, stats] = g.sdpa(q, k, v, opts);
    o->set_output(true)
        .set_uid(kO)
        .set_dim({s.B, s.Hq, s.Sq, s.dv})
        .set_stride({s.Sq * s.Hq * s.dv, s.dv, s.Hq * s.dv, 1});
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
  }
  {
    auto& g = m.bwd;
    setup(g);
    auto q = bhsd(g, "Q", kQ, s.B, s.Hq, s.Sq, s.dqk), k = bhsd(g, "K", kK, s.B, s.Hk, s.Sk, s.dqk),
         v = bhsd(g, "V", kV, s.B, s.Hk, s.Sk, s.dv), o = bhsd(g, "O", kO, s.B, s.Hq, s.Sq, s.dv),
         dout = bhsd(g, "dO", kDO, s.B, s.Hq, s.Sq, s.dv);
    auto stats = g.tensor(fe::graph::Tensor_attributes()
                              .set_name("Stats")
                              .set_uid(kStats)
                              .set_dim({s.B, s.Hq, s.Sq, 1})
                              .set_stride({s.Hq * s.Sq, s.Sq, 1, 1})
                              .set_data_type(fe::DataType_t::FLOAT));
    auto opts = fe::graph::SDPA_backward_attributes()
                    .set_name("sdpa_backward")
                    .set_attn_scale(static_cast<float>(s.scale));
    if (s.causal) opts.set_causal_mask_bottom_right(true);
    auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, opts);
    dq->set_output(true)
        .set_uid(kDQ)
        .set_dim({s.B, s.Hq, s.Sq, s.dqk})
        .set_stride({s.Sq * s.Hq * s.dqk, s.dqk, s.Hq * s.dqk, 1});
    dk->set_output(true)
        .set_uid(kDK)
        .set_dim({s.B, s.Hk, s.Sk, s.dqk})
        .set_stride({s.Sk * s.Hk * s.dqk, s.dqk, s.Hk * s.dqk, 1});
    dv->set_output(true)
        .set_uid(kDV)
        .set_dim({s.B, s.Hk, s.Sk, s.dv})
        .set_stride({s.Sk * s.Hk * s.dv, s.dv, s.Hk * s.dv, 1});
  }
  std::int64_t ws = 0;
  for (auto* g : {&m.fwd, &m.bwd}) {
    const char* pass = g == &m.fwd ? " forward" : " backward";
    check_fe(g->validate(), what + pass + " (validate)");
    check_fe(g->build_operation_graph(m.handle), what + pass + " (build_operation_graph)");
    check_fe(g->create_execution_plans({fe::HeurMode_t::A}), what + pass + " (execution plans)");
    check_fe(g->check_support(m.handle), what + pass + " (is supported on this device)");
    check_fe(g->build_plans(m.handle), what + pass + " (build_plans)");
    std::int64_t w = 0;
    check_fe(g->get_workspace_size(w), what + pass + " (workspace)");
    ws = w > ws ? w : ws;
  }
  m.workspace = DeviceBuffer(ws, "cudnn_sdpa_workspace", MemCategory::comm_buffers);
}

CudnnSdpa::~CudnnSdpa() {
  if (impl_ && impl_->handle) cudnnDestroy(impl_->handle);
}

void CudnnSdpa::forward(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v) {
  std::unordered_map<std::int64_t, void*> pack = {{kQ, const_cast<bf16*>(q)},
                                                  {kK, const_cast<bf16*>(k)},
                                                  {kV, const_cast<bf16*>(v)},
                                                  {kO, o},
                                                  {kStats, lse}};
  check_fe(impl_->fwd.execute(impl_->handle, pack, impl_->workspace.data()), "cudnn sdpa forward");
}

void CudnnSdpa::backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                         const bf16* k, const bf16* v, const bf16* o, const float* lse) {
  std::unordered_map<std::int64_t, void*> pack = {{kQ, const_cast<bf16*>(q)},
                                                  {kK, const_cast<bf16*>(k)},
                                                  {kV, const_cast<bf16*>(v)},
                                                  {kO, const_cast<bf16*>(o)},
                                                  {kDO, const_cast<bf16*>(dout)},
                                                  {kStats, const_cast<float*>(lse)},
                                                  {kDQ, dq},
                                                  {kDK, dk},
                                                  {kDV, dv}};
  check_fe(impl_->bwd.execute(impl_->handle, pack, impl_->workspace.data()), "cudnn sdpa backward");
}

#else  // no cudnn-frontend: the class exists and refuses, with the reason

struct CudnnSdpa::Impl {};
CudnnSdpa::CudnnSdpa(const AttnShape& s, void*) {
  fail(cudnn_sdpa_refusal(s, DType::bf16));
}
CudnnSdpa::~CudnnSdpa() = default;
void CudnnSdpa::forward(bf16*, float*, const bf16*, const bf16*, const bf16*) {}
void CudnnSdpa::backward(bf16*, bf16*, bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                         const bf16*, const float*) {}
#endif

}  // namespace laga::cuda
