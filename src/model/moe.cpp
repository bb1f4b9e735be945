#include "model/moe.hpp"

#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "kernels/gemm.hpp"
#include "kernels/swiglu.hpp"

namespace laga {

template <class T>
MoeParams<T> MoeParams<T>::zeros(const MoeConfig& cfg, std::int64_t D, MemCategory cat) {
  cfg.validate();
  LAGA_CHECK(D >= 1, "moe: the model dim must be >= 1, got ", D);
  const std::int64_t E = cfg.n_routed_experts, I = cfg.moe_intermediate_size,
                     Is = cfg.shared_intermediate_size();
  MoeParams p;
  p.gate = Tensor<T>::zeros({E, D}, cat);
  p.gate_bias = Tensor<T>::zeros({E}, cat);
  for (std::int64_t e = 0; e < E; ++e)
    p.experts.push_back({Tensor<T>::zeros({I, D}, cat), Tensor<T>::zeros({D, I}, cat),
                         Tensor<T>::zeros({I, D}, cat)});
  if (Is > 0)
    p.shared = {Tensor<T>::zeros({Is, D}, cat), Tensor<T>::zeros({D, Is}, cat),
                Tensor<T>::zeros({Is, D}, cat)};
  return p;
}

template <class T>
void MoeParams<T>::for_each(const std::function<void(const std::string&, Tensor<T>&)>& fn,
                            bool with_bias) {
  fn("gate.weight", gate);
  if (with_bias) fn("gate.bias", gate_bias);
  for (size_t e = 0; e < experts.size(); ++e) {
    const std::string pre = "experts." + std::to_string(e) + ".";
    fn(pre + "w1.weight", experts[e].w1);
    fn(pre + "w2.weight", experts[e].w2);
    fn(pre + "w3.weight", experts[e].w3);
  }
  if (shared.w1.defined()) {
    fn("shared_experts.w1.weight", shared.w1);
    fn("shared_experts.w2.weight", shared.w2);
    fn("shared_experts.w3.weight", shared.w3);
  }
}

namespace {

// Under a count-only pool (the model's memory prediction, train.hpp) no
// tensor is backed and no kernel runs: every tensor is still allocated in the
// order and shape of a real run, which does not depend on the routing (N k
// copies in all), so the pool's peak is the real one.
bool counting() {
  return current_pool().count_only();
}

template <class T>
void check_shape(const Tensor<T>& t, const Shape& want, const std::string& name) {
  const bool backed = t.backed() || counting();
  LAGA_CHECK(t.shape() == want && backed, "moe: ", name, " has shape ", to_string(t.shape()),
             backed ? "" : " (unbacked)", " but the config needs ", to_string(want),
             "; build the parameters with MoeParams::zeros for this config");
}

template <class T>
void check_params(const MoeConfig& cfg, const MoeParams<T>& w, std::int64_t D) {
  const std::int64_t E = cfg.n_routed_experts, I = cfg.moe_intermediate_size,
                     Is = cfg.shared_intermediate_size();
  check_shape(w.gate, {E, D}, "gate.weight");
  check_shape(w.gate_bias, {E}, "gate.bias");
  LAGA_CHECK(std::int64_t(w.experts.size()) == E, "moe: ", w.experts.size(),
             " experts' weights for n_routed_experts ", E,
             "; build the parameters with MoeParams::zeros for this config");
  for (std::int64_t e = 0; e < E; ++e) {
    const std::string pre = "experts." + std::to_string(e) + ".";
    check_shape(w.experts[size_t(e)].w1, {I, D}, pre + "w1.weight");
    check_shape(w.experts[size_t(e)].w2, {D, I}, pre + "w2.weight");
    check_shape(w.experts[size_t(e)].w3, {I, D}, pre + "w3.weight");
  }
  if (Is > 0) {
    check_shape(w.shared.w1, {Is, D}, "shared_experts.w1.weight");
    check_shape(w.shared.w2, {D, Is}, "shared_experts.w2.weight");
    check_shape(w.shared.w3, {Is, D}, "shared_experts.w3.weight");
  } else {
    LAGA_CHECK(!w.shared.w1.defined(),
               "moe: shared expert weights given but n_shared_experts is 0");
  }
}

// xp (R, D): row p is x's row token[p] (the dispatch: copies grouped by expert).
template <class T>
Tensor<T> gather_rows(const T* x, const Dispatch& d, std::int64_t D) {
  Tensor<T> xp({d.rows(), D});
  if (!xp.data()) return xp;  // count-only
#pragma omp parallel for schedule(static)
  for (std::int64_t p = 0; p < d.rows(); ++p) {
    const T* src = x + std::int64_t(d.token[size_t(p)]) * D;
    std::copy(src, src + D, xp.data() + p * D);
  }
  return xp;
}

}  // namespace

template <class T>
MoeForward<T> moe_forward(const MoeConfig& cfg, const MoeParams<T>& w, const T* x, std::int64_t N,
                          std::int64_t D) {
  cfg.validate();
  check_params(cfg, w, D);
  const std::int64_t E = cfg.n_routed_experts, k = cfg.num_experts_per_tok,
                     I = cfg.moe_intermediate_size, Is = cfg.shared_intermediate_size();
  const bool real = !counting();
  LAGA_CHECK(!real || x || N == 0, "moe: x is null");
  MoeForward<T> f;
  MoeSaved<T>& s = f.saved;
  // The gate: z = x W_g^T (N, E), then the selection and weights.
  {
    Tensor<T> logits({N, E});
    if (real) {
      linear_forward(logits.data(), x, w.gate.data(), N, D, E);
      s.routing = route(cfg, logits.data(), w.gate_bias.data(), N);
      s.dispatch = make_dispatch(s.routing);
    } else {
      // Count-only: the sizes of a routing with no selection, every count 0.
      s.routing.tokens = s.dispatch.tokens = N;
      s.routing.top_k = s.dispatch.top_k = k;
      s.routing.experts = s.dispatch.experts = E;
      s.dispatch.count.assign(size_t(E), 0);
      s.dispatch.offset.assign(size_t(E + 1), 0);
    }
  }
  const Dispatch& d = s.dispatch;
  const std::int64_t R = d.rows();  // N k routed copies
  // Each expert's SwiGLU on its rows [o, o + c) of the permuted order.
  Tensor<T> xp = gather_rows(x, d, D);
  s.a = Tensor<T>({R, I});
  s.b = Tensor<T>({R, I});
  s.h = Tensor<T>({R, I});
  s.y = Tensor<T>({R, D});
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t o = d.offset[size_t(e)], c = d.count[size_t(e)];
    if (c == 0) continue;
    const ExpertParams<T>& p = w.experts[size_t(e)];
    linear_forward(s.a.data() + o * I, xp.data() + o * D, p.w1.data(), c, D, I);
    linear_forward(s.b.data() + o * I, xp.data() + o * D, p.w3.data(), c, D, I);
    swiglu_forward(s.h.data() + o * I, s.a.data() + o * I, s.b.data() + o * I, c * I);
    linear_forward(s.y.data() + o * D, s.h.data() + o * I, p.w2.data(), c, I, D);
  }
  xp.reset();
  // The shared expert writes out; the combine adds the routed copies to it.
  f.out = Tensor<T>::zeros({N, D});
  if (Is > 0) {
    s.sa = Tensor<T>({N, Is});
    s.sb = Tensor<T>({N, Is});
    s.sh = Tensor<T>({N, Is});
  }
  if (!real) return f;
  if (Is > 0) {
    linear_forward(s.sa.data(), x, w.shared.w1.data(), N, D, Is);
    linear_forward(s.sb.data(), x, w.shared.w3.data(), N, D, Is);
    swiglu_forward(s.sh.data(), s.sa.data(), s.sb.data(), N * Is);
    linear_forward(f.out.data(), s.sh.data(), w.shared.w2.data(), N, Is, D);
  }
  // Combine: out_t += sum_j w_tj y_row(t, j), slots in order.
  T* out = f.out.data();
#pragma omp parallel for schedule(static)
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const T wt = s.routing.weight[size_t(t * k + j)];
      const T* y = s.y.data() + d.row[size_t(t * k + j)] * D;
      for (std::int64_t i = 0; i < D; ++i) out[t * D + i] += wt * y[i];
    }
  return f;
}

template <class T>
Tensor<T> moe_backward(const MoeConfig& cfg, const MoeParams<T>& w, const T* x,
                       const MoeSaved<T>& s, const T* dout, MoeParams<T>& g) {
  cfg.validate();
  const Dispatch& d = s.dispatch;
  const std::int64_t N = d.tokens, D = w.gate.dim(1);
  check_params(cfg, w, D);
  check_params(cfg, g, D);
  const std::int64_t E = cfg.n_routed_experts, k = cfg.num_experts_per_tok,
                     I = cfg.moe_intermediate_size, Is = cfg.shared_intermediate_size();
  const std::int64_t R = d.rows();
  const bool real = !counting();
  Tensor<T> dx = Tensor<T>::zeros({N, D});
  // Shared expert: out += w2 h, h = silu(a) b, a = w1 x, b = w3 x.
  if (Is > 0) {
    Tensor<T> dh({N, Is}), da({N, Is}), db({N, Is});
    if (real) {
      linear_backward(dh.data(), false, g.shared.w2.data(), dout, s.sh.data(), w.shared.w2.data(),
                      N, Is, D);
      swiglu_backward(da.data(), db.data(), dh.data(), s.sa.data(), s.sb.data(), N * Is);
      linear_backward(dx.data(), true, g.shared.w1.data(), da.data(), x, w.shared.w1.data(), N, D,
                      Is);
      linear_backward(dx.data(), true, g.shared.w3.data(), db.data(), x, w.shared.w3.data(), N, D,
                      Is);
    }
  }
  // Combine: out_t += sum_j w_tj y_p, p = row(t, j):
  //   dw_tj = <dout_t, y_p>,  dy_p = w_tj dout_t.
  std::vector<T> dweight(size_t(N * k));
  Tensor<T> dy({R, D});
  if (!real) {
    // Count-only: what the rest allocates (the gate's dz is a std::vector).
    Tensor<T> xp({R, D}), dxp({R, D});
    Tensor<T> dh({R, I}), da({R, I}), db({R, I});
    return dx;
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t p = d.row[size_t(t * k + j)];
      const T wt = s.routing.weight[size_t(t * k + j)];
      const T* y = s.y.data() + p * D;
      const T* go = dout + t * D;
      T* gy = dy.data() + p * D;
      double dot = 0.0;
      for (std::int64_t i = 0; i < D; ++i) {
        dot += double(go[i]) * double(y[i]);
        gy[i] = wt * go[i];
      }
      dweight[size_t(t * k + j)] = static_cast<T>(dot);
    }
  // Each expert's SwiGLU backward on its rows; dxp (R, D) in permuted order.
  Tensor<T> xp = gather_rows(x, d, D);
  Tensor<T> dxp({R, D});
  {
    Tensor<T> dh({R, I}), da({R, I}), db({R, I});
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t o = d.offset[size_t(e)], c = d.count[size_t(e)];
      if (c == 0) continue;
      const ExpertParams<T>& p = w.experts[size_t(e)];
      ExpertParams<T>& gp = g.experts[size_t(e)];
      linear_backward(dh.data() + o * I, false, gp.w2.data(), dy.data() + o * D, s.h.data() + o * I,
                      p.w2.data(), c, I, D);
      swiglu_backward(da.data() + o * I, db.data() + o * I, dh.data() + o * I, s.a.data() + o * I,
                      s.b.data() + o * I, c * I);
      linear_backward(dxp.data() + o * D, false, gp.w1.data(), da.data() + o * I, xp.data() + o * D,
                      p.w1.data(), c, D, I);
      linear_backward(dxp.data() + o * D, true, gp.w3.data(), db.data() + o * I, xp.data() + o * D,
                      p.w3.data(), c, D, I);
    }
  }
  xp.reset();
  dy.reset();
  // The permutation reversed: each token's k copies added back, slots in order.
  T* gx = dx.data();
#pragma omp parallel for schedule(static)
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const T* src = dxp.data() + d.row[size_t(t * k + j)] * D;
      for (std::int64_t i = 0; i < D; ++i) gx[t * D + i] += src[i];
    }
  dxp.reset();
  // The gate: dz from the weights (the selection is locally constant), then
  // z = x W_g^T.
  const std::vector<T> dlogits = route_backward(cfg, s.routing, dweight.data());
  linear_backward(dx.data(), true, g.gate.data(), dlogits.data(), x, w.gate.data(), N, D, E);
  return dx;
}

#define LAGA_INSTANTIATE(T)                                                              \
  template struct MoeParams<T>;                                                          \
  template MoeForward<T> moe_forward<T>(const MoeConfig&, const MoeParams<T>&, const T*, \
                                        std::int64_t, std::int64_t);                     \
  template Tensor<T> moe_backward<T>(const MoeConfig&, const MoeParams<T>&, const T*,    \
                                     const MoeSaved<T>&, const T*, MoeParams<T>&);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
