// cuDNN's fused SDPA (contract: cuda/sdpa_cudnn.hpp).
#include "cuda/sdpa_cudnn.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "cuda/sdpa_ragged.hpp"

#ifdef LAGA_HAVE_CUDNN_FRONTEND
#define CUDNN_FRONTEND_SKIP_JSON_LIB 1
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <unordered_map>
#include <utility>
#include <vector>

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
  if (s.doc_start && s.Sq != s.Sk)
    return shape() +
           ": packed documents with Sq != Sk (a ring step's queries, a suffix of its keys, "
           "whose document cuts differ) are not a ragged batch cuDNN takes; laga's own kernel "
           "runs them";
  if (s.doc_start) {
    // The documents as cuDNN's ragged batch, and its int32 offsets: a
    // structure or a size cuDNN cannot take is refused here, by name.
    try {
      const RaggedDocuments r = ragged_documents(s.doc_start, s.B, s.Sq, s.Hq, s.dqk, s.dv);
      (void)ragged_offsets(r, std::max(s.Hq, s.Hk) * std::max(s.dqk, s.dv), "Q/K/V/O");
      (void)ragged_stats_offsets(r, s.Hq);
    } catch (const Error& e) {
      return cat(shape(), ": ", e.what());
    }
  }
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
enum Uid : std::int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  // packed documents (a ragged batch): per document its length, and per
  // tensor the element offset of each document's first token
  kSeqLen,
  kOffQ,
  kOffK,
  kOffV,
  kOffO,
  kOffStats
};

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
// A (n, 1, 1, 1) int32 tensor: the lengths or a ragged offset tensor.
std::shared_ptr<fe::graph::Tensor_attributes> int32_column(fe::graph::Graph& g, const char* name,
                                                           std::int64_t uid, std::int64_t n) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}
}  // namespace

struct CudnnSdpa::Impl {
  AttnShape s;
  cudnnHandle_t handle = nullptr;
  fe::graph::Graph fwd, bwd;
  DeviceBuffer workspace;
  std::int64_t forward_ws = 0, backward_ws = 0;  // what cuDNN asked for each graph
  // Packed documents: cuDNN's batch is every document (sdpa_ragged.hpp);
  // the lengths and offsets live on the device with the graphs (uid -> its
  // buffer), added to every call's variant pack.
  bool ragged = false;
  std::vector<std::pair<std::int64_t, DeviceBuffer>> ragged_columns;
  void add_ragged(std::unordered_map<std::int64_t, void*>& pack) {
    for (auto& [uid, buf] : ragged_columns) pack[uid] = buf.data();
  }
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
  LAGA_CHECK(cudnnSetStream(m.handle, static_cast<cudaStream_t>(stream)) == CUDNN_STATUS_SUCCESS,
             what, ": cudnnSetStream failed; check the device and the stream");
  const auto setup = [&](fe::graph::Graph& g) {
    g.set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
  };
  // The batch cuDNN sees: the B rows, or with packed documents every
  // document (a ragged batch of Bg entries up to Sg tokens, each tensor's
  // entry starting at its ragged offset: sdpa_ragged.hpp). Self-attention
  // only there (the refusal), so each document's causal mask is the plain
  // top-left one, and the padding mask with the lengths keeps a document
  // from reading past its end.
  m.ragged = s.doc_start != nullptr;
  RaggedDocuments docs;
  if (m.ragged) docs = ragged_documents(s.doc_start, s.B, s.Sq, s.Hq, s.dqk, s.dv);
  const std::int64_t Bg = m.ragged ? docs.docs : s.B;
  const std::int64_t Sqg = m.ragged ? docs.max_len : s.Sq, Skg = m.ragged ? docs.max_len : s.Sk;
  if (m.ragged) {
    const auto column = [&](std::int64_t uid, const std::vector<std::int32_t>& v) {
      DeviceBuffer b(std::int64_t(4 * v.size()), "cudnn_sdpa_ragged", MemCategory::comm_buffers);
      b.upload(v.data(), b.bytes());
      m.ragged_columns.emplace_back(uid, std::move(b));
    };
    column(kSeqLen, docs.seq_len);
    column(kOffQ, ragged_offsets(docs, s.Hq * s.dqk, "Q"));
    column(kOffK, ragged_offsets(docs, s.Hk * s.dqk, "K"));
    column(kOffV, ragged_offsets(docs, s.Hk * s.dv, "V"));
    column(kOffO, ragged_offsets(docs, s.Hq * s.dv, "O"));
    column(kOffStats, ragged_stats_offsets(docs, s.Hq));
  }
  struct Offsets {
    std::shared_ptr<fe::graph::Tensor_attributes> q, k, v, o, stats, len;
  };
  const auto offsets = [&](fe::graph::Graph& g) {
    Offsets r;
    if (!m.ragged) return r;
    r.q = int32_column(g, "ragged_q", kOffQ, Bg + 1);
    r.k = int32_column(g, "ragged_k", kOffK, Bg + 1);
    r.v = int32_column(g, "ragged_v", kOffV, Bg + 1);
    r.o = int32_column(g, "ragged_o", kOffO, Bg + 1);
    r.stats = int32_column(g, "ragged_stats", kOffStats, Bg + 1);
    r.len = int32_column(g, "seq_len", kSeqLen, Bg);
    return r;
  };
  // laga's lse (B, Hq, Sq): h steps by Sq and t by 1, packed or not (a
  // document's entry starts at its stats offset; the batch stride is then
  // not used).
  const std::int64_t stats_stride_b = s.Hq * s.Sq;
  const auto ragged_to = [&](const std::shared_ptr<fe::graph::Tensor_attributes>& t,
                             const std::shared_ptr<fe::graph::Tensor_attributes>& off) {
    if (off) t->set_ragged_offset(off);
  };
  {
    auto& g = m.fwd;
    setup(g);
    const Offsets off = offsets(g);
    auto q = bhsd(g, "Q", kQ, Bg, s.Hq, Sqg, s.dqk), k = bhsd(g, "K", kK, Bg, s.Hk, Skg, s.dqk),
         v = bhsd(g, "V", kV, Bg, s.Hk, Skg, s.dv);
    ragged_to(q, off.q), ragged_to(k, off.k), ragged_to(v, off.v);
    auto opts =
        fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(
            static_cast<float>(s.scale));
    if (m.ragged) {
      opts.set_padding_mask(true).set_seq_len_q(off.len).set_seq_len_kv(off.len);
      opts.set_max_total_seq_len_q(s.B * s.Sq).set_max_total_seq_len_kv(s.B * s.Sk);
      if (s.causal) opts.set_causal_mask(true);
    } else if (s.causal) {
      opts.set_causal_mask_bottom_right(true);
    }
    auto [o, stats] = g.sdpa(q, k, v, opts);
    o->set_output(true)
        .set_uid(kO)
        .set_dim({Bg, s.Hq, Sqg, s.dv})
        .set_stride({Sqg * s.Hq * s.dv, s.dv, s.Hq * s.dv, 1});
    ragged_to(o, off.o);
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
    if (m.ragged) {
      stats->set_dim({Bg, s.Hq, Sqg, 1}).set_stride({stats_stride_b, s.Sq, 1, 1});
      ragged_to(stats, off.stats);
    }
  }
  {
    auto& g = m.bwd;
    setup(g);
    const Offsets off = offsets(g);
    auto q = bhsd(g, "Q", kQ, Bg, s.Hq, Sqg, s.dqk), k = bhsd(g, "K", kK, Bg, s.Hk, Skg, s.dqk),
         v = bhsd(g, "V", kV, Bg, s.Hk, Skg, s.dv), o = bhsd(g, "O", kO, Bg, s.Hq, Sqg, s.dv),
         dout = bhsd(g, "dO", kDO, Bg, s.Hq, Sqg, s.dv);
    ragged_to(q, off.q), ragged_to(k, off.k), ragged_to(v, off.v), ragged_to(o, off.o),
        ragged_to(dout, off.o);
    auto stats = g.tensor(fe::graph::Tensor_attributes()
                              .set_name("Stats")
                              .set_uid(kStats)
                              .set_dim({Bg, s.Hq, Sqg, 1})
                              .set_stride({stats_stride_b, s.Sq, 1, 1})
                              .set_data_type(fe::DataType_t::FLOAT));
    ragged_to(stats, off.stats);
    auto opts = fe::graph::SDPA_backward_attributes()
                    .set_name("sdpa_backward")
                    .set_attn_scale(static_cast<float>(s.scale));
    if (m.ragged) {
      opts.set_padding_mask(true).set_seq_len_q(off.len).set_seq_len_kv(off.len);
      opts.set_max_total_seq_len_q(s.B * s.Sq).set_max_total_seq_len_kv(s.B * s.Sk);
      if (s.causal) opts.set_causal_mask(true);
    } else if (s.causal) {
      opts.set_causal_mask_bottom_right(true);
    }
    auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, opts);
    dq->set_output(true)
        .set_uid(kDQ)
        .set_dim({Bg, s.Hq, Sqg, s.dqk})
        .set_stride({Sqg * s.Hq * s.dqk, s.dqk, s.Hq * s.dqk, 1});
    dk->set_output(true)
        .set_uid(kDK)
        .set_dim({Bg, s.Hk, Skg, s.dqk})
        .set_stride({Skg * s.Hk * s.dqk, s.dqk, s.Hk * s.dqk, 1});
    dv->set_output(true)
        .set_uid(kDV)
        .set_dim({Bg, s.Hk, Skg, s.dv})
        .set_stride({Skg * s.Hk * s.dv, s.dv, s.Hk * s.dv, 1});
    ragged_to(dq, off.q), ragged_to(dk, off.k), ragged_to(dv, off.v);
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
    (g == &m.fwd ? m.forward_ws : m.backward_ws) = w;
    ws = w > ws ? w : ws;
  }
  m.workspace = DeviceBuffer(ws, "cudnn_sdpa_workspace", MemCategory::comm_buffers);
}

CudnnSdpa::~CudnnSdpa() {
  if (impl_ && impl_->handle) cudnnDestroy(impl_->handle);
}
std::int64_t CudnnSdpa::forward_workspace_bytes() const {
  return impl_->forward_ws;
}
std::int64_t CudnnSdpa::backward_workspace_bytes() const {
  return impl_->backward_ws;
}

void CudnnSdpa::forward(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v) {
  std::unordered_map<std::int64_t, void*> pack = {{kQ, const_cast<bf16*>(q)},
                                                  {kK, const_cast<bf16*>(k)},
                                                  {kV, const_cast<bf16*>(v)},
                                                  {kO, o},
                                                  {kStats, lse}};
  impl_->add_ragged(pack);
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
  impl_->add_ragged(pack);
  check_fe(impl_->bwd.execute(impl_->handle, pack, impl_->workspace.data()), "cudnn sdpa backward");
}

#else  // no cudnn-frontend: the class exists and refuses, with the reason

struct CudnnSdpa::Impl {};
CudnnSdpa::CudnnSdpa(const AttnShape& s, void*) {
  fail(cudnn_sdpa_refusal(s, DType::bf16));
}
CudnnSdpa::~CudnnSdpa() = default;
std::int64_t CudnnSdpa::forward_workspace_bytes() const {
  return 0;
}
std::int64_t CudnnSdpa::backward_workspace_bytes() const {
  return 0;
}
void CudnnSdpa::forward(bf16*, float*, const bf16*, const bf16*, const bf16*) {}
void CudnnSdpa::backward(bf16*, bf16*, bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                         const bf16*, const float*) {}
#endif

}  // namespace laga::cuda
