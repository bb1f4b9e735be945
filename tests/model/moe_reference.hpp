// What model_test_moe's two files share (test_moe.cpp: the routing and the
// layer; test_moe_expert_parallel.cpp: the layer with its experts on ranks,
// and the PyTorch reference): the plain-loop double reference of DeepSeek-V3's
// MoE layer and its gate (per token, per selected expert, no permutation;
// the routing by stable sorts of whole vectors, the gate's backward through
// the explicit Jacobian of the weights), the two configs and the random
// cases both run, a case's weights in another type, and the bf16 bounds'
// measure.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "model/moe.hpp"

namespace laga::test {

inline double sig(double z) {
  return 1.0 / (1.0 + std::exp(-z));
}

// ------------------------------------------------------------ reference

struct RefRoute {
  std::vector<int> expert;  // k, best biased score first
  std::vector<double> weight;
};

// One token's routing by whole-vector stable sorts (ties keep the lower index).
inline RefRoute ref_route(const MoeConfig& c, const std::vector<double>& z,
                          const std::vector<double>& bias) {
  // DeepSeek's three gates (model.py Gate; HF MoEGate's noaux_tc, greedy,
  // group_limited_greedy), written from their code, not from route()'s.
  const bool greedy = c.topk_method == TopkMethod::greedy,
             biased = c.topk_method == TopkMethod::noaux_tc;
  const int E = int(c.n_routed_experts), G = greedy ? 1 : int(c.n_group), per = E / G,
            k = int(c.num_experts_per_tok);
  std::vector<double> s(E), b(E);
  if (c.scoring_func == ScoreFunc::softmax) {
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += std::exp(z[e]);
    for (int e = 0; e < E; ++e) s[e] = std::exp(z[e]) / sum;
  } else {
    for (int e = 0; e < E; ++e) s[e] = sig(z[e]);
  }
  for (int e = 0; e < E; ++e) b[e] = s[e] + (biased ? bias[e] : 0.0);
  std::vector<bool> allowed(E, true);
  if (G > 1) {
    std::vector<double> gs(G);
    for (int q = 0; q < G; ++q) {
      std::vector<double> v(b.begin() + q * per, b.begin() + (q + 1) * per);
      std::sort(v.begin(), v.end(), std::greater<>());
      gs[q] = biased ? v[0] + v[1] : v[0];  // top-2 sum with a bias, amax without
    }
    std::vector<int> gi(G);
    std::iota(gi.begin(), gi.end(), 0);
    std::stable_sort(gi.begin(), gi.end(), [&](int x, int y) { return gs[x] > gs[y]; });
    allowed.assign(E, false);
    for (int i = 0; i < int(c.topk_group); ++i)
      for (int e = gi[i] * per; e < (gi[i] + 1) * per; ++e) allowed[e] = true;
  }
  std::vector<int> cand;
  for (int e = 0; e < E; ++e)
    if (allowed[e]) cand.push_back(e);
  std::stable_sort(cand.begin(), cand.end(), [&](int x, int y) { return b[x] > b[y]; });
  RefRoute r;
  r.expert.assign(cand.begin(), cand.begin() + k);
  double S = 0;
  for (int e : r.expert) S += s[e];
  for (int e : r.expert)
    r.weight.push_back(c.routed_scaling_factor * s[e] / (c.norm_topk_prob ? S : 1.0));
  return r;
}

// One SwiGLU on one token, and its backward (dx and the weights' gradients added to).
struct Tape {
  std::vector<double> a, b, h, y;
};
inline Tape swiglu_one(const ExpertParams<double>& p, const double* x, int D) {
  const int F = int(p.w1.dim(0));
  Tape t{std::vector<double>(F), std::vector<double>(F), std::vector<double>(F),
         std::vector<double>(D, 0.0)};
  for (int f = 0; f < F; ++f) {
    for (int i = 0; i < D; ++i) t.a[f] += p.w1[f * D + i] * x[i], t.b[f] += p.w3[f * D + i] * x[i];
    t.h[f] = t.a[f] * sig(t.a[f]) * t.b[f];
  }
  for (int o = 0; o < D; ++o)
    for (int f = 0; f < F; ++f) t.y[o] += p.w2[o * F + f] * t.h[f];
  return t;
}
inline void swiglu_one_backward(const ExpertParams<double>& p, ExpertParams<double>& g,
                                const double* x, const Tape& t, const std::vector<double>& dy,
                                double* dx, int D) {
  const int F = int(p.w1.dim(0));
  for (int f = 0; f < F; ++f) {
    double dh = 0;
    for (int o = 0; o < D; ++o) dh += p.w2[o * F + f] * dy[o], g.w2[o * F + f] += dy[o] * t.h[f];
    const double sg = sig(t.a[f]);
    const double da = dh * t.b[f] * (sg + t.a[f] * sg * (1 - sg)), db = dh * t.a[f] * sg;
    for (int i = 0; i < D; ++i) {
      g.w1[f * D + i] += da * x[i];
      g.w3[f * D + i] += db * x[i];
      dx[i] += p.w1[f * D + i] * da + p.w3[f * D + i] * db;
    }
  }
}

struct RefMoe {
  std::vector<RefRoute> route;
  std::vector<double> out, dx;
  MoeParams<double> g;
};

inline RefMoe ref_moe(const MoeConfig& c, const MoeParams<double>& w, const std::vector<double>& x,
                      const std::vector<double>& dout, int N, int D) {
  const int E = int(c.n_routed_experts), k = int(c.num_experts_per_tok);
  const double sc = c.routed_scaling_factor;
  RefMoe r;
  r.out.assign(size_t(N * D), 0.0);
  r.dx.assign(size_t(N * D), 0.0);
  r.g = MoeParams<double>::zeros(c, D, MemCategory::gradients);
  const std::vector<double> bias(w.gate_bias.data(), w.gate_bias.data() + E);
  for (int t = 0; t < N; ++t) {
    const double* xt = x.data() + t * D;
    const std::vector<double> go(dout.begin() + t * D, dout.begin() + (t + 1) * D);
    double* ot = r.out.data() + t * D;
    double* dxt = r.dx.data() + t * D;
    std::vector<double> z(E, 0.0);
    for (int e = 0; e < E; ++e)
      for (int i = 0; i < D; ++i) z[e] += w.gate[e * D + i] * xt[i];
    r.route.push_back(ref_route(c, z, bias));
    const RefRoute& rt = r.route.back();
    if (c.n_shared_experts > 0) {
      const Tape tp = swiglu_one(w.shared, xt, D);
      for (int i = 0; i < D; ++i) ot[i] += tp.y[i];
      swiglu_one_backward(w.shared, r.g.shared, xt, tp, go, dxt, D);
    }
    std::vector<double> dw(k, 0.0);
    for (int j = 0; j < k; ++j) {
      const int e = rt.expert[j];
      const Tape tp = swiglu_one(w.experts[e], xt, D);
      std::vector<double> dy(D);
      for (int i = 0; i < D; ++i) {
        ot[i] += rt.weight[j] * tp.y[i];
        dw[j] += go[i] * tp.y[i];
        dy[i] = rt.weight[j] * go[i];
      }
      swiglu_one_backward(w.experts[e], r.g.experts[e], xt, tp, dy, dxt, D);
    }
    // The gate through the Jacobian of w_j = c s_j / S (or c s_j) in s_i.
    double S = 0;
    for (int j = 0; j < k; ++j) S += sig(z[rt.expert[j]]);
    for (int i = 0; i < k; ++i) {
      const int e = rt.expert[i];
      const double si = sig(z[e]);
      double ds = 0;
      for (int j = 0; j < k; ++j) {
        const double sj = sig(z[rt.expert[j]]);
        const double jac =
            c.norm_topk_prob ? sc * ((i == j ? 1.0 / S : 0.0) - sj / (S * S)) : (i == j ? sc : 0.0);
        ds += dw[j] * jac;
      }
      const double dz = ds * si * (1 - si);
      for (int d = 0; d < D; ++d) {
        r.g.gate[e * D + d] += dz * xt[d];
        dxt[d] += w.gate[e * D + d] * dz;
      }
    }
  }
  return r;
}

// -------------------------------------------------------------- cases

// Every value is a float rounded to double, so a float run sees exactly
// the inputs the double reference does (and selects the same experts).
inline double rounded(double v) {
  return double(float(v));
}

struct Case {
  MoeConfig cfg;
  int N, D;
  MoeParams<double> w;
  std::vector<double> x, dout;
};

inline Case make_case(const MoeConfig& cfg, int N, int D, std::uint64_t seed) {
  Case c{cfg, N, D, MoeParams<double>::zeros(cfg, D, MemCategory::parameters), {}, {}};
  std::uint64_t stream = seed;
  c.w.for_each([&](const std::string& name, Tensor<double>& t) {
    // Gate logits with O(1) spread, biases small, SwiGLU weights ~ 1/sqrt(fan_in).
    const double a = name == "gate.weight" ? 0.6
                     : name == "gate.bias" ? 0.1
                                           : 1.5 / std::sqrt(double(t.dim(t.rank() - 1)));
    test::fill_random(t.data(), t.numel(), ++stream, -a, a);
    for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = rounded(t[i]);
  });
  c.x = test::random_vector<double>(N * D, ++stream);
  c.dout = test::random_vector<double>(N * D, ++stream);
  for (auto* v : {&c.x, &c.dout})
    for (double& e : *v) e = rounded(e);
  return c;
}

template <class T>
MoeParams<T> params_as(const MoeConfig& cfg, MoeParams<double>& w, int D) {
  std::vector<const Tensor<double>*> src;
  w.for_each([&](const std::string&, Tensor<double>& t) { src.push_back(&t); });
  MoeParams<T> p = MoeParams<T>::zeros(cfg, D, MemCategory::parameters);
  size_t i = 0;
  p.for_each([&](const std::string&, Tensor<T>& t) {
    const Tensor<double>& s = *src[i++];
    for (std::int64_t j = 0; j < t.numel(); ++j) t[j] = static_cast<T>(s[j]);
  });
  return p;
}

inline MoeConfig grouped() {
  MoeConfig c;
  c.n_routed_experts = 8, c.num_experts_per_tok = 3, c.n_group = 4, c.topk_group = 2;
  c.moe_intermediate_size = 8, c.n_shared_experts = 2, c.routed_scaling_factor = 2.5;
  return c;
}

inline MoeConfig ungrouped_unnormalised() {
  MoeConfig c;
  c.n_routed_experts = 6, c.num_experts_per_tok = 2, c.n_group = 1, c.topk_group = 1;
  c.moe_intermediate_size = 5, c.n_shared_experts = 0, c.routed_scaling_factor = 1.5;
  c.norm_topk_prob = false;
  return c;
}

// max |a - ref| / max |ref|: the bf16 bounds' measure (mla/ops_bf16.hpp).
template <class T>
double relative_to_largest(const T* a, const double* ref, std::int64_t n) {
  double diff = 0, scale = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

}  // namespace laga::test
