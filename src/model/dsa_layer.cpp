#include "model/dsa_layer.hpp"

#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "mla/dsa_cp.hpp"
#include "mla/ops.hpp"

namespace laga {

template <class T>
LmIndexerParams<T> LmIndexerParams<T>::zeros(const MlaConfig& cfg, MemCategory cat) {
  LmIndexerParams p;
  if (!cfg.dsa()) return p;
  const std::int64_t D = cfg.dim, rq = cfg.q_lora_rank, HI = cfg.index_n_heads,
                     dI = cfg.index_head_dim;
  p.wq_b = Tensor<T>::zeros({HI * dI, rq}, cat);
  p.wk = Tensor<T>::zeros({dI, D}, cat);
  p.k_norm_weight = Tensor<T>::zeros({dI}, cat);
  p.k_norm_bias = Tensor<T>::zeros({dI}, cat);
  p.weights_proj = Tensor<T>::zeros({HI, D}, cat);
  return p;
}

template <class T>
void LmIndexerParams<T>::for_each(const std::function<void(const std::string&, Tensor<T>&)>& fn) {
  if (!defined()) return;
  fn("indexer.wq_b.weight", wq_b);
  fn("indexer.wk.weight", wk);
  fn("indexer.k_norm.weight", k_norm_weight);
  fn("indexer.k_norm.bias", k_norm_bias);
  fn("indexer.weights_proj.weight", weights_proj);
}

bool lm_param_is_indexer(const std::string& name) {
  return name.find(".attn.indexer.") != std::string::npos;
}

namespace {

// A (1, n) view of n contiguous host values (a DsaIndexerParams vector, a
// DsaBlockResult row), for the op layer's copy, add and scale beside a
// tensor's ops::mat.
template <class T>
ops::Mat<T> row_of(T* p, std::int64_t n) {
  return {p, 1, n, n};
}

// The block takes the indexer's weights as host vectors (DsaIndexerParams),
// each its tensor's size; under a count-only run (no storage to copy) they
// stay zeros, which the block's count-only run never reads.
template <class T>
DsaIndexerParams<T> host_copy(const LmIndexerParams<T>& iw) {
  auto& w = const_cast<LmIndexerParams<T>&>(iw);  // for_each is non-const; nothing is written
  DsaIndexerParams<T> h;
  std::vector<std::vector<T>*> dst;
  for (auto& [name, v] : h.named()) dst.push_back(v);
  std::size_t k = 0;
  w.for_each([&](const std::string&, Tensor<T>& t) {
    std::vector<T>& v = *dst[k++];
    v.assign(static_cast<std::size_t>(t.numel()), T{});
    ops::copy(row_of(v.data(), t.numel()), ops::Mat<const T>(ops::mat(t, 1, t.numel())));
  });
  return h;
}

// The block at --sp 1, the query-local latent gather at --sp > 1. dout:
// null for forward only, else the block's backward input (a stand-in under
// count-only: ops::backward_input).
template <class T>
DsaBlockResult<T> run_block(const DsaLayerContext& c, const MlaParams<T>& w,
                            const LmIndexerParams<T>& iw, const Tensor<T>& x, const T* dout) {
  const DsaIndexerParams<T> h = host_copy(iw);
  if (c.comm.size() == 1)
    return dsa_block(c.cfg, w, h, x.data(), dout, c.layout.batch, c.layout.seq, c.stage);
  return dsa_latent_gather(c.cfg, w, h, x.data(), dout, c.layout, c.stage, c.comm);
}

// dst += src over dst's n values (the op layer's add: nothing under count-only).
template <class T>
void add_into(Tensor<T>& dst, const T* src) {
  ops::add(ops::mat(dst, 1, dst.numel()), row_of(src, dst.numel()));
}

}  // namespace

template <class T>
double dsa_layer_forward(const DsaLayerContext& c, const MlaParams<T>& w,
                         const LmIndexerParams<T>& iw, const Tensor<T>& x, Tensor<T>& out) {
  DsaBlockResult<T> r = run_block(c, w, iw, x, static_cast<const T*>(nullptr));
  out = Tensor<T>(x.shape());
  std::copy(r.out.begin(), r.out.end(), out.data());
  return r.kl_loss;
}

template <class T>
void dsa_layer_backward(const DsaLayerContext& c, const MlaParams<T>& w,
                        const LmIndexerParams<T>& iw, const Tensor<T>& x, const Tensor<T>& dout,
                        double kl_scale, Tensor<T>& dx, MlaParams<T>& g, LmIndexerParams<T>& gi) {
  DsaBlockResult<T> r = run_block(c, w, iw, x, ops::backward_input(dout));
  dx = Tensor<T>(x.shape());
  std::copy(r.dx.begin(), r.dx.end(), dx.data());
  // The MLA weights' LM gradient, tensor by tensor in for_each's order.
  std::vector<const Tensor<T>*> from;
  r.grads.for_each(std::function<void(const std::string&, Tensor<T>&)>(
      [&](const std::string&, Tensor<T>& t) { from.push_back(&t); }));
  std::size_t k = 0;
  g.for_each(std::function<void(const std::string&, Tensor<T>&)>(
      [&](const std::string& name, Tensor<T>& t) {
        LAGA_CHECK(k < from.size() && from[k]->numel() == t.numel(), "DSA layer: the gradient of '",
                   name, "' does not match the block's");
        add_into(t, from[k++]->data());
      }));
  // The indexer's KL gradient, scaled to the mean over query rows.
  k = 0;
  std::vector<std::vector<T>*> kl;
  for (auto& [name, v] : r.indexer_grads.named()) kl.push_back(v);
  gi.for_each([&](const std::string&, Tensor<T>& t) {
    std::vector<T>& v = *kl[k++];
    ops::scale(row_of(v.data(), std::int64_t(v.size())), kl_scale);
    add_into(t, v.data());
  });
}

#define LAGA_INSTANTIATE(T)                                                                      \
  template struct LmIndexerParams<T>;                                                            \
  template double dsa_layer_forward<T>(const DsaLayerContext&, const MlaParams<T>&,              \
                                       const LmIndexerParams<T>&, const Tensor<T>&, Tensor<T>&); \
  template void dsa_layer_backward<T>(                                                           \
      const DsaLayerContext&, const MlaParams<T>&, const LmIndexerParams<T>&, const Tensor<T>&,  \
      const Tensor<T>&, double, Tensor<T>&, MlaParams<T>&, LmIndexerParams<T>&);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
