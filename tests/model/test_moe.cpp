// DeepSeek-V3's MoE layer and its gate against a plain-loop double reference
// written here (per token, per selected expert, no permutation; the routing
// by stable sorts of whole vectors, the gate's backward through the explicit
// Jacobian of the weights), finite differences in double for dx and every
// weight, and the routing's edge cases: group limiting, the bias, ties.
//
// Finite differences need the selection to stay put under a step of 1e-5:
// the inputs are random with O(1) spread in the scores, and every perturbed
// evaluation is checked to select exactly the experts the unperturbed one
// did (a test whose inputs sat on a routing tie would fail that check, not
// pass by luck).
#include "model/moe.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/dry_run_comm.hpp"
#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "common/error_of.hpp"
#include "core/precision.hpp"
#include "io/safetensors.hpp"
#include "mla/ops_bf16.hpp"

namespace laga {
namespace {

using test::all_close;

double sig(double z) {
  return 1.0 / (1.0 + std::exp(-z));
}

// ------------------------------------------------------------ reference

struct RefRoute {
  std::vector<int> expert;  // k, best biased score first
  std::vector<double> weight;
};

// One token's routing by whole-vector stable sorts (ties keep the lower index).
RefRoute ref_route(const MoeConfig& c, const std::vector<double>& z,
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
Tape swiglu_one(const ExpertParams<double>& p, const double* x, int D) {
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
void swiglu_one_backward(const ExpertParams<double>& p, ExpertParams<double>& g, const double* x,
                         const Tape& t, const std::vector<double>& dy, double* dx, int D) {
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

RefMoe ref_moe(const MoeConfig& c, const MoeParams<double>& w, const std::vector<double>& x,
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
double rounded(double v) {
  return double(float(v));
}

struct Case {
  MoeConfig cfg;
  int N, D;
  MoeParams<double> w;
  std::vector<double> x, dout;
};

Case make_case(const MoeConfig& cfg, int N, int D, std::uint64_t seed) {
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

MoeConfig grouped() {
  MoeConfig c;
  c.n_routed_experts = 8, c.num_experts_per_tok = 3, c.n_group = 4, c.topk_group = 2;
  c.moe_intermediate_size = 8, c.n_shared_experts = 2, c.routed_scaling_factor = 2.5;
  return c;
}

MoeConfig ungrouped_unnormalised() {
  MoeConfig c;
  c.n_routed_experts = 6, c.num_experts_per_tok = 2, c.n_group = 1, c.topk_group = 1;
  c.moe_intermediate_size = 5, c.n_shared_experts = 0, c.routed_scaling_factor = 1.5;
  c.norm_topk_prob = false;
  return c;
}

// ------------------------------------------------------------- routing

TEST(MoeRouting, MatchesReference) {
  MoeConfig c;
  c.n_routed_experts = 16, c.num_experts_per_tok = 4, c.n_group = 4, c.topk_group = 2;
  c.routed_scaling_factor = 2.5;
  const int N = 64, E = 16, k = 4;
  for (const auto& [scores, method, norm] :
       {std::tuple{ScoreFunc::sigmoid, TopkMethod::noaux_tc, true},
        std::tuple{ScoreFunc::sigmoid, TopkMethod::noaux_tc, false},
        std::tuple{ScoreFunc::softmax, TopkMethod::greedy, false},
        std::tuple{ScoreFunc::softmax, TopkMethod::greedy, true},
        std::tuple{ScoreFunc::softmax, TopkMethod::group_limited_greedy, false},
        std::tuple{ScoreFunc::sigmoid, TopkMethod::group_limited_greedy, true}}) {
    c.scoring_func = scores, c.topk_method = method, c.norm_topk_prob = norm;
    const bool biased = method == TopkMethod::noaux_tc;
    const auto zf = test::random_vector<float>(N * E, 11, -3, 3);
    const auto bf = biased ? test::random_vector<float>(E, 12, -0.2, 0.2) : std::vector<float>(E);
    const auto zd = test::convert<double>(zf), bd = test::convert<double>(bf);
    const Routing<double> rd = route(c, zd.data(), bd.data(), N);
    const Routing<float> rf = route(c, zf.data(), bf.data(), N);
    for (int t = 0; t < N; ++t) {
      const RefRoute ref =
          ref_route(c, std::vector<double>(zd.begin() + t * E, zd.begin() + (t + 1) * E), bd);
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(rd.expert[size_t(t * k + j)], ref.expert[j]) << "token " << t << " slot " << j;
        EXPECT_EQ(rf.expert[size_t(t * k + j)], ref.expert[j]) << "float, token " << t;
      }
      EXPECT_TRUE(
          all_close("weight", rd.weight.data() + t * k, ref.weight.data(), k, 1e-15, 1e-14));
      EXPECT_TRUE(
          all_close("weight f32", rf.weight.data() + t * k, ref.weight.data(), k, 1e-7, 1e-6));
    }
  }
}

TEST(MoeRouting, GroupLimitingMasksAGroupWithTheBestExpert) {
  MoeConfig c;
  c.n_routed_experts = 8, c.num_experts_per_tok = 2, c.n_group = 4, c.topk_group = 2;
  // Expert 0 scores best of all (sigmoid(4) = 0.98) but its group's top-2
  // sum is 0.98 + 0.02 = 1.0, below groups 1 (1.46) and 2 (1.25).
  const std::vector<double> z{4, -4, 1, 1, 0.5, 0.5, -1, -1};
  const std::vector<double> bias(8, 0.0);
  Routing<double> r = route(c, z.data(), bias.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{2, 3}));
  // Without group limiting expert 0 is chosen first.
  c.n_group = 1, c.topk_group = 1;
  r = route(c, z.data(), bias.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 2}));
}

TEST(MoeRouting, BiasSelectsButDoesNotWeight) {
  MoeConfig c;
  c.n_routed_experts = 4, c.num_experts_per_tok = 2, c.routed_scaling_factor = 2.5;
  const std::vector<double> z{2, 1, 0, -1};
  std::vector<double> bias(4, 0.0);
  EXPECT_EQ(route(c, z.data(), bias.data(), 1).expert, (std::vector<std::int32_t>{0, 1}));
  // sigmoid(-1) + 0.9 = 1.17 ranks above sigmoid(2) = 0.88: expert 3 first.
  bias[3] = 0.9;
  const Routing<double> r = route(c, z.data(), bias.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{3, 0}));
  // The weights are the unbiased scores, normalised and scaled.
  const double S = sig(-1) + sig(2);
  EXPECT_NEAR(r.weight[0], 2.5 * sig(-1) / S, 1e-15);
  EXPECT_NEAR(r.weight[1], 2.5 * sig(2) / S, 1e-15);
  // A null bias is a zero one.
  EXPECT_EQ(route(c, z.data(), static_cast<const double*>(nullptr), 1).expert,
            (std::vector<std::int32_t>{0, 1}));
}

TEST(MoeRouting, TiesGoToTheLowerIndex) {
  MoeConfig c;
  c.n_routed_experts = 8, c.num_experts_per_tok = 3, c.n_group = 4, c.topk_group = 2;
  const std::vector<double> zero(8, 0.0);
  // Every score equal: groups 0 and 1 kept, experts 0, 1, 2, equal weights.
  Routing<double> r = route(c, zero.data(), zero.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 1, 2}));
  for (double w : r.weight) EXPECT_NEAR(w, 1.0 / 3, 1e-15);
  // Groups 1 and 3 tie for first and groups 0 and 2 for the rest: 1 and 3
  // kept; in them experts 3 and 6 tie for best (3 first), then 2.
  const std::vector<double> z{0, 0, 1, 2, 0, 0, 2, 1};
  r = route(c, z.data(), zero.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{3, 6, 2}));
  // With one group kept, the tie between groups 1 and 3 goes to group 1.
  c.topk_group = 1, c.num_experts_per_tok = 2;
  r = route(c, z.data(), zero.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{3, 2}));
  c.n_group = 1, c.topk_group = 1, c.num_experts_per_tok = 1;
  const std::vector<double> z2{0, 0, 1, 0, 0, 1, 0, 0};
  EXPECT_EQ(route(c, z2.data(), zero.data(), 1).expert, (std::vector<std::int32_t>{2}));
}

TEST(MoeRouting, WeightsSumToTheScaleOrAreScaledScores) {
  MoeConfig c;
  c.n_routed_experts = 8, c.num_experts_per_tok = 3, c.routed_scaling_factor = 2.5;
  const int N = 10;
  const auto z = test::random_vector<double>(N * 8, 21, -2, 2);
  Routing<double> r = route(c, z.data(), static_cast<const double*>(nullptr), N);
  for (int t = 0; t < N; ++t)
    EXPECT_NEAR(r.weight[t * 3] + r.weight[t * 3 + 1] + r.weight[t * 3 + 2], 2.5, 1e-14);
  c.norm_topk_prob = false;
  r = route(c, z.data(), static_cast<const double*>(nullptr), N);
  for (int i = 0; i < N * 3; ++i)
    EXPECT_NEAR(r.weight[i], 2.5 * sig(z[(i / 3) * 8 + r.expert[i]]), 1e-15);
}

TEST(MoeRouting, RefusesNonFiniteLogitsAndBias) {
  MoeConfig c;
  std::vector<double> z(16, 0.0), bias(8, 0.0);
  z[11] = NAN;
  EXPECT_NE(test::error_of([&] {
              route(c, z.data(), bias.data(), 2);
            }).find("gate logit of token 1, expert 3 is nan"),
            std::string::npos);
  z[11] = 0, bias[5] = INFINITY;
  EXPECT_NE(test::error_of([&] {
              route(c, z.data(), bias.data(), 2);
            }).find("e_score_correction_bias[5] is inf"),
            std::string::npos);
}

// L = <G, w(z)> with the selection fixed: dz by route_backward vs central differences.
TEST(MoeRouting, BackwardFiniteDifferences) {
  MoeConfig c;
  c.n_routed_experts = 16, c.num_experts_per_tok = 4, c.n_group = 4, c.topk_group = 2;
  c.routed_scaling_factor = 2.5;
  const int N = 6, E = 16, k = 4;
  for (const bool norm : {true, false}) {
    c.norm_topk_prob = norm;
    auto z = test::random_vector<double>(N * E, 31, -3, 3);
    const auto bias = test::random_vector<double>(E, 32, -0.2, 0.2);
    const auto G = test::random_vector<double>(N * k, 33);
    const Routing<double> r0 = route(c, z.data(), bias.data(), N);
    const std::vector<double> dz = route_backward(c, r0, G.data());
    int moved = 0;
    auto loss = [&] {
      const Routing<double> r = route(c, z.data(), bias.data(), N);
      if (r.expert != r0.expert) ++moved;
      return test::dot(r.weight.data(), G.data(), N * k);
    };
    test::GradientCheck gc;
    gc.add("logits", z.data(), dz.data(), {N, E});
    EXPECT_TRUE(gc.run(loss)) << (norm ? "normalised" : "unnormalised");
    EXPECT_EQ(moved, 0)
        << "a finite-difference step changed the selection: the inputs sit on a tie";
  }
}

// The V2 gates: softmax scores over all E experts, so dz is dense.
TEST(MoeRouting, SoftmaxBackwardFiniteDifferences) {
  MoeConfig c;
  c.n_routed_experts = 16, c.num_experts_per_tok = 4, c.n_group = 4, c.topk_group = 2;
  c.scoring_func = ScoreFunc::softmax, c.routed_scaling_factor = 16;
  const int N = 6, E = 16, k = 4;
  for (const TopkMethod m : {TopkMethod::greedy, TopkMethod::group_limited_greedy})
    for (const bool norm : {true, false}) {
      c.topk_method = m, c.norm_topk_prob = norm;
      auto z = test::random_vector<double>(N * E, 34, -3, 3);
      const auto G = test::random_vector<double>(N * k, 35);
      const Routing<double> r0 = route(c, z.data(), static_cast<const double*>(nullptr), N);
      const std::vector<double> dz = route_backward(c, r0, G.data());
      int moved = 0, zeros = 0;
      for (const double v : dz) zeros += v == 0.0;
      // Unnormalised, every logit moves the selected p's; normalised, p_j / sum
      // of the selected p is exp(z_j) / sum of their exp(z): the others' dz is 0.
      EXPECT_EQ(zeros, norm ? N * (E - k) : 0);
      auto loss = [&] {
        const Routing<double> r = route(c, z.data(), static_cast<const double*>(nullptr), N);
        if (r.expert != r0.expert) ++moved;
        return test::dot(r.weight.data(), G.data(), N * k);
      };
      test::GradientCheck gc;
      gc.add("logits", z.data(), dz.data(), {N, E});
      EXPECT_TRUE(gc.run(loss)) << to_string(m) << (norm ? " normalised" : " unnormalised");
      EXPECT_EQ(moved, 0);
    }
}

// DeepSeek's Gate scores a group by its amax when it has no bias, by the sum
// of its top two only with one: on this token the two rules keep different
// groups (the rule laga had for every gate picked experts 2, 3 here).
TEST(MoeRouting, BiaslessGroupsScoreTheirBest) {
  MoeConfig c;
  c.n_routed_experts = 8, c.num_experts_per_tok = 2, c.n_group = 4, c.topk_group = 2;
  c.scoring_func = ScoreFunc::softmax, c.topk_method = TopkMethod::group_limited_greedy;
  c.norm_topk_prob = false, c.routed_scaling_factor = 16;
  const std::vector<double> z{4, -4, 1, 1, 0.5, 0.5, -1, -1};
  // Group maxima: 0 (e^4), then 1 (e^1): experts 0 and 2 (2 before 3: ties
  // go to the lower index).
  const Routing<double> r = route(c, z.data(), static_cast<const double*>(nullptr), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 2}));
  double sum = 0;
  for (const double v : z) sum += std::exp(v);
  EXPECT_NEAR(r.weight[0], 16 * std::exp(4.0) / sum, 1e-14);  // not normalised: p times 16
  EXPECT_NEAR(r.weight[1], 16 * std::exp(1.0) / sum, 1e-14);
  c.topk_method = TopkMethod::noaux_tc, c.scoring_func = ScoreFunc::sigmoid;
  EXPECT_EQ(route(c, z.data(), static_cast<const double*>(nullptr), 1).expert,
            (std::vector<std::int32_t>{2, 3}));
}

// A gate without a bias refuses a non-zero one rather than ignoring it.
TEST(MoeRouting, BiaslessGateRefusesABias) {
  MoeConfig c;
  c.n_routed_experts = 4, c.num_experts_per_tok = 2;
  c.scoring_func = ScoreFunc::softmax, c.topk_method = TopkMethod::greedy;
  const std::vector<double> z{2, 1, 0, -1};
  std::vector<double> bias(4, 0.0);
  EXPECT_NO_THROW(route(c, z.data(), bias.data(), 1));
  bias[2] = 0.25;
  try {
    route(c, z.data(), bias.data(), 1);
    ADD_FAILURE() << "a bias on a greedy gate was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("e_score_correction_bias[2] is 0.25 but topk_method "
                                         "'greedy' has no bias"),
              std::string::npos)
        << e.what();
  }
}

TEST(MoeRouting, DispatchGroupsCopiesByExpert) {
  MoeConfig c;
  c.n_routed_experts = 16, c.num_experts_per_tok = 4, c.n_group = 4, c.topk_group = 2;
  const int N = 50, E = 16, k = 4;
  const auto z = test::random_vector<double>(N * E, 41, -3, 3);
  const Routing<double> r = route(c, z.data(), static_cast<const double*>(nullptr), N);
  const Dispatch d = make_dispatch(r);
  ASSERT_EQ(d.rows(), N * k);
  std::vector<std::int64_t> hist(E, 0);
  for (std::int32_t e : r.expert) ++hist[size_t(e)];
  EXPECT_EQ(d.count, hist);
  EXPECT_EQ(d.offset.front(), 0);
  EXPECT_EQ(d.offset.back(), N * k);
  for (int e = 0; e < E; ++e) EXPECT_EQ(d.offset[e + 1] - d.offset[e], d.count[e]);
  std::vector<int> hits(size_t(N * k), 0);
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) {
      const std::int64_t p = d.row[size_t(t * k + j)];
      const std::int32_t e = r.expert[size_t(t * k + j)];
      ASSERT_GE(p, d.offset[e]);
      ASSERT_LT(p, d.offset[e + 1]);  // the copy sits in its expert's rows
      EXPECT_EQ(d.token[size_t(p)], t);
      ++hits[size_t(p)];
    }
  for (int h : hits) EXPECT_EQ(h, 1);  // row is a permutation
  for (int e = 0; e < E; ++e)
    for (std::int64_t p = d.offset[e] + 1; p < d.offset[e + 1]; ++p)
      EXPECT_LT(d.token[size_t(p - 1)], d.token[size_t(p)]) << "expert " << e;
}

TEST(MoeRouting, ExpertBiasUpdate) {
  // Mean load 4: expert 0 over (down by gamma), 1 under (up), 2 and 3 even.
  const std::vector<double> b{0.5, -0.25, 0.0, 1.0};
  const std::vector<double> nb = update_expert_bias(b, {5, 3, 4, 4}, 0.01);
  ASSERT_EQ(nb.size(), 4u);
  EXPECT_DOUBLE_EQ(nb[0], 0.5 - 0.01);
  EXPECT_DOUBLE_EQ(nb[1], -0.25 + 0.01);
  EXPECT_EQ(nb[2], 0.0);
  EXPECT_EQ(nb[3], 1.0);
  // Mean 7/3: a load of 2 is under, 3 over.
  EXPECT_EQ(update_expert_bias(std::vector<float>{0, 0, 0}, {2, 2, 3}, 0.5),
            (std::vector<float>{0.5f, 0.5f, -0.5f}));
  EXPECT_NE(test::error_of([&] {
              update_expert_bias(b, {1, 2}, 0.01);
            }).find("4 biases but 2"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] {
              update_expert_bias(b, {1, 2, 3, 4}, -1);
            }).find("gamma"),
            std::string::npos);
}

// --------------------------------------------------------------- layer

void expect_matches_reference(Case& c, double atol, double rtol) {
  const MoeForward<double> f = moe_forward(c.cfg, c.w, c.x.data(), c.N, c.D);
  MoeParams<double> g = MoeParams<double>::zeros(c.cfg, c.D, MemCategory::gradients);
  const Tensor<double> dx = moe_backward(c.cfg, c.w, c.x.data(), f.saved, c.dout.data(), g);
  RefMoe ref = ref_moe(c.cfg, c.w, c.x, c.dout, c.N, c.D);
  const int k = int(c.cfg.num_experts_per_tok);
  for (int t = 0; t < c.N; ++t)
    for (int j = 0; j < k; ++j)
      ASSERT_EQ(f.saved.routing.expert[size_t(t * k + j)], ref.route[t].expert[j]) << "token " << t;
  EXPECT_TRUE(all_close("out", f.out.data(), ref.out.data(), c.N * c.D, atol, rtol));
  EXPECT_TRUE(all_close("dx", dx.data(), ref.dx.data(), c.N * c.D, atol, rtol));
  std::vector<std::pair<std::string, const Tensor<double>*>> want;
  ref.g.for_each([&](const std::string& n, Tensor<double>& t) { want.push_back({n, &t}); });
  size_t i = 0;
  g.for_each([&](const std::string& n, Tensor<double>& t) {
    const Tensor<double>& r = *want[i++].second;
    EXPECT_TRUE(all_close(n, t.data(), r.data(), t.numel(), atol, rtol));
  });
}

TEST(MoeLayer, MatchesPlainLoopReferenceDouble) {
  Case a = make_case(grouped(), 24, 16, 100);
  a.w.gate_bias[7] = -5;  // expert 7 never chosen: its rows are empty, its gradients 0
  expect_matches_reference(a, 1e-13, 1e-12);
  const MoeForward<double> f = moe_forward(a.cfg, a.w, a.x.data(), a.N, a.D);
  EXPECT_EQ(f.saved.dispatch.count[7], 0);
  Case b = make_case(ungrouped_unnormalised(), 24, 16, 200);
  expect_matches_reference(b, 1e-13, 1e-12);
}

TEST(MoeLayer, FloatMatchesDoubleReference) {
  for (const MoeConfig& cfg : {grouped(), ungrouped_unnormalised()}) {
    Case c = make_case(cfg, 24, 16, 300);
    const MoeParams<float> wf = params_as<float>(cfg, c.w, c.D);
    const auto xf = test::convert<float>(c.x), gof = test::convert<float>(c.dout);
    const MoeForward<float> f = moe_forward(cfg, wf, xf.data(), c.N, c.D);
    MoeParams<float> g = MoeParams<float>::zeros(cfg, c.D, MemCategory::gradients);
    const Tensor<float> dx = moe_backward(cfg, wf, xf.data(), f.saved, gof.data(), g);
    RefMoe ref = ref_moe(cfg, c.w, c.x, c.dout, c.N, c.D);
    const int k = int(cfg.num_experts_per_tok);
    for (int t = 0; t < c.N; ++t)
      for (int j = 0; j < k; ++j)
        ASSERT_EQ(f.saved.routing.expert[size_t(t * k + j)], ref.route[t].expert[j]);
    EXPECT_TRUE(all_close("out f32", f.out.data(), ref.out.data(), c.N * c.D, 2e-6, 2e-5));
    EXPECT_TRUE(all_close("dx f32", dx.data(), ref.dx.data(), c.N * c.D, 2e-6, 2e-5));
    std::vector<const Tensor<double>*> want;
    ref.g.for_each([&](const std::string&, Tensor<double>& t) { want.push_back(&t); });
    size_t i = 0;
    g.for_each([&](const std::string& n, Tensor<float>& t) {
      EXPECT_TRUE(all_close(n + " f32", t.data(), want[i++]->data(), t.numel(), 2e-6, 2e-5));
    });
  }
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

// Under --dtype bf16 the gate's, the shared and the routed experts' GEMMs
// round their operands (ops::linear, ops::RoutedLinears): out within the
// block's bound of the double reference, dx and every gradient within the
// gradients' (their paths are no longer than the attention block's:
// x, W1/W3, a and b, h, W2, y forward, as many again backward), and not
// fp32's result, which would mean the MoE's GEMMs stayed fp32.
// The experts' rows run whole (slice 512 > 24 rows) and in slices of 5 rows
// (moe_bf16_row_slice: RowSlicedLinears' loop, dW summed over the slices).
struct RowSlice {
  explicit RowSlice(std::int64_t rows) { moe_bf16_row_slice = rows; }
  ~RowSlice() { moe_bf16_row_slice = 512; }
};

TEST(MoeLayer, Bf16WithinItsBoundOfTheDoubleReference) {
  for (std::int64_t slice : {512, 5})
    for (const MoeConfig& cfg : {grouped(), ungrouped_unnormalised()}) {
      const RowSlice rows(slice);
      SCOPED_TRACE(cat("slice ", slice));
      Case c = make_case(cfg, 24, 16, 300);
      const MoeParams<float> wf = params_as<float>(cfg, c.w, c.D);
      const auto xf = test::convert<float>(c.x), gof = test::convert<float>(c.dout);
      RefMoe ref = ref_moe(cfg, c.w, c.x, c.dout, c.N, c.D);
      const MoeForward<float> f32 = moe_forward(cfg, wf, xf.data(), c.N, c.D);
      const UsePrecision bf16(Precision::bf16);
      const MoeForward<float> f = moe_forward(cfg, wf, xf.data(), c.N, c.D);
      MoeParams<float> g = MoeParams<float>::zeros(cfg, c.D, MemCategory::gradients);
      const Tensor<float> dx = moe_backward(cfg, wf, xf.data(), f.saved, gof.data(), g);
      // The case's gate margins are wider than bf16's rounding of the
      // logits: the same experts are chosen, so the values compare.
      const int k = int(cfg.num_experts_per_tok);
      for (int t = 0; t < c.N; ++t)
        for (int j = 0; j < k; ++j)
          ASSERT_EQ(f.saved.routing.expert[size_t(t * k + j)], ref.route[t].expert[j]);
      const double out_bound = bf16_bound_vs_exact(BlockTensor::output);
      const double grad_bound = bf16_bound_vs_exact(BlockTensor::gradient);
      const double out_err = relative_to_largest(f.out.data(), ref.out.data(), c.N * c.D);
      EXPECT_LE(out_err, out_bound);
      std::vector<double> out_f32(f32.out.data(), f32.out.data() + c.N * c.D);
      EXPECT_GT(relative_to_largest(f.out.data(), out_f32.data(), c.N * c.D), 1e-5)
          << "bf16 out equals fp32's to fp32 rounding: the MoE's GEMMs did not run bf16";
      EXPECT_LE(relative_to_largest(dx.data(), ref.dx.data(), c.N * c.D), grad_bound);
      std::vector<const Tensor<double>*> want;
      ref.g.for_each([&](const std::string&, Tensor<double>& t) { want.push_back(&t); });
      size_t i = 0;
      g.for_each([&](const std::string& n, Tensor<float>& t) {
        const Tensor<double>& r = *want[i++];
        EXPECT_LE(relative_to_largest(t.data(), r.data(), t.numel()), grad_bound) << n;
      });
    }
}

// The count-only run (the memory prediction) allocates what a real forward
// and backward do, event for event, whatever the routing: with the routing
// spread and with every token sent to the same two experts (24 rows each,
// more than a 5-row slice), fp32 and bf16 (whose operand copies are pool
// tensors: an expert's would follow its rows, RowSlicedLinears' do not).
TEST(MoeLayer, CountOnlyAllocatesWhatARealPassDoes) {
  for (Precision precision : {Precision::fp32, Precision::bf16})
    for (std::int64_t slice : {512, 5})
      for (bool skewed : {false, true}) {
        SCOPED_TRACE(cat(to_string(precision), " slice ", slice, skewed ? " skewed" : " spread"));
        const RowSlice rows(slice);
        const MoeConfig cfg = grouped();
        Case c = make_case(cfg, 24, 16, 400);
        if (skewed) {
          for (std::int64_t e = 0; e < cfg.n_routed_experts; ++e) c.w.gate_bias[e] = -50;
          c.w.gate_bias[0] = c.w.gate_bias[1] = 50;  // group 0 wins, its two experts take all
        }
        const MoeParams<float> wf = params_as<float>(cfg, c.w, c.D);
        MoeParams<float> g = MoeParams<float>::zeros(cfg, c.D, MemCategory::gradients);
        const auto xf = test::convert<float>(c.x), gof = test::convert<float>(c.dout);
        const UsePrecision use(precision);
        const auto pass = [&](bool count_only, std::int64_t* top_rows) {
          std::vector<MemoryPool::Event> trace;
          MemoryPool pool;
          pool.set_count_only(count_only);
          pool.set_trace(&trace);
          {
            const PoolScope scope(pool);
            MoeForward<float> f = moe_forward(cfg, wf, xf.data(), c.N, c.D);
            const Tensor<float> dx = moe_backward(cfg, wf, xf.data(), f.saved, gof.data(), g);
            if (top_rows)
              *top_rows =
                  *std::max_element(f.saved.dispatch.count.begin(), f.saved.dispatch.count.end());
          }
          pool.set_trace(nullptr);
          return trace;
        };
        std::int64_t top = 0;
        const auto real = pass(false, &top);
        const auto counted = pass(true, nullptr);
        EXPECT_EQ(top, skewed ? c.N : top) << "the skewed routing did not concentrate the rows";
        ASSERT_EQ(real.size(), counted.size());
        for (size_t i = 0; i < real.size(); ++i) {
          EXPECT_EQ(real[i].category, counted[i].category) << "event " << i;
          ASSERT_EQ(real[i].delta, counted[i].delta) << "event " << i;
        }
      }
}

TEST(MoeLayer, FiniteDifferencesDouble) {
  for (const MoeConfig& cfg : {grouped(), ungrouped_unnormalised()}) {
    Case c = make_case(cfg, 10, 8, 400);
    const MoeForward<double> f0 = moe_forward(cfg, c.w, c.x.data(), c.N, c.D);
    MoeParams<double> g = MoeParams<double>::zeros(cfg, c.D, MemCategory::gradients);
    const Tensor<double> dx = moe_backward(cfg, c.w, c.x.data(), f0.saved, c.dout.data(), g);
    int moved = 0;
    auto loss = [&] {
      const MoeForward<double> f = moe_forward(cfg, c.w, c.x.data(), c.N, c.D);
      if (f.saved.routing.expert != f0.saved.routing.expert) ++moved;
      return test::dot(f.out.data(), c.dout.data(), c.N * c.D);
    };
    test::GradientCheck gc;
    gc.add("x", c.x.data(), dx.data(), {c.N, c.D});
    std::vector<Tensor<double>*> grads;
    g.for_each([&](const std::string&, Tensor<double>& t) { grads.push_back(&t); }, false);
    size_t i = 0;
    c.w.for_each([&](const std::string& n,
                     Tensor<double>& t) { gc.add(n, t.data(), grads[i++]->data(), t.shape()); },
                 false);
    test::GradCheckOptions opt;
    opt.floor_per_tensor = true;
    EXPECT_TRUE(gc.run(loss, opt)) << cfg.summary();
    EXPECT_EQ(moved, 0)
        << "a finite-difference step changed the selection: the inputs sit on a tie";
    // The bias has no gradient: it is not a function of the loss's slope.
    for (std::int64_t e = 0; e < g.gate_bias.numel(); ++e) EXPECT_EQ(g.gate_bias[e], 0.0);
  }
}

TEST(MoeLayer, RefusesParamsOfAnotherShape) {
  Case c = make_case(grouped(), 4, 16, 500);
  MoeParams<double> w = MoeParams<double>::zeros(grouped(), 12, MemCategory::parameters);
  EXPECT_NE(test::error_of([&] {
              moe_forward(c.cfg, w, c.x.data(), 4, 16);
            }).find("gate.weight has shape [8, 12] but the config needs [8, 16]"),
            std::string::npos);
  MoeConfig more = grouped();
  more.n_shared_experts = 3;
  EXPECT_NE(test::error_of([&] {
              moe_forward(more, c.w, c.x.data(), 4, 16);
            }).find("shared_experts.w1.weight has shape [16, 16] but the config needs [24, 16]"),
            std::string::npos);
}

// ------------------------------------------------- expert parallelism

// One rank's part of an expert-parallel forward + backward: its rows of out
// and dx, its gradients (MoeParams::for_each's order; copied out, since the
// rank's tensors live in its pool), its routing's counts and its ledger.
template <class T>
struct EpRank {
  std::vector<T> out, dx;
  std::vector<std::vector<T>> g;
  std::vector<std::int64_t> count;
  Ledger ledger;
};

// The N tokens split over P ranks as the sequence is (the first N % P one
// more); every rank runs the layer on its rows with the experts folded.
// threads > 0: each rank's OpenMP team size; degree: the EP groups' size
// (0: all P ranks in one).
template <class T>
std::vector<EpRank<T>> run_ep(Case& c, int P, int threads = 0, int degree = 0) {
  const MoeParams<T> w = params_as<T>(c.cfg, c.w, c.D);
  const auto x = test::convert<T>(c.x), go = test::convert<T>(c.dout);
  const size_t ranks_n = static_cast<size_t>(P);
  std::vector<std::int64_t> n(ranks_n), off(ranks_n, 0);
  for (int j = 0; j < P; ++j) n[size_t(j)] = c.N / P + (j < c.N % P ? 1 : 0);
  for (int j = 1; j < P; ++j) off[size_t(j)] = off[size_t(j - 1)] + n[size_t(j - 1)];
  std::vector<EpRank<T>> ranks(ranks_n);
  run_local_ranks(P, [&](Communicator& comm) {
    if (threads > 0) omp_set_num_threads(threads);
    const int r = comm.rank();
    const ExpertParallel ep = ExpertParallel::folded(comm, c.cfg.n_routed_experts, n, degree);
    const T* xr = x.data() + off[size_t(r)] * c.D;
    const MoeForward<T> f = moe_forward(c.cfg, w, xr, n[size_t(r)], c.D, &ep);
    EpRank<T>& me = ranks[size_t(r)];
    MoeParams<T> g = MoeParams<T>::zeros(c.cfg, c.D, MemCategory::gradients);
    const Tensor<T> dx =
        moe_backward(c.cfg, w, xr, f.saved, go.data() + off[size_t(r)] * c.D, g, &ep);
    g.for_each([&](const std::string&, Tensor<T>& t) {
      me.g.emplace_back(t.data(), t.data() + t.numel());
    });
    me.out.assign(f.out.data(), f.out.data() + f.out.numel());
    me.dx.assign(dx.data(), dx.data() + dx.numel());
    me.count = f.saved.dispatch.count;
    me.ledger = comm.ledger();
  });
  return ranks;
}

std::int64_t sent(const Ledger& l, Phase phase, const std::string& label) {
  const auto it = l.entries().find({phase, label});
  return it == l.entries().end() ? 0 : it->second.bytes_sent;
}

// The ranks' rows one after the other (their out and dx), and their
// routing's counts, row i rank i's.
template <class T>
struct Assembled {
  std::vector<T> out, dx;
  std::vector<std::vector<std::int64_t>> counts;
};
template <class T>
Assembled<T> assembled(const std::vector<EpRank<T>>& ranks) {
  Assembled<T> a;
  for (const auto& r : ranks) {
    a.out.insert(a.out.end(), r.out.begin(), r.out.end());
    a.dx.insert(a.dx.end(), r.dx.begin(), r.dx.end());
    a.counts.push_back(r.count);
  }
  return a;
}

// Every rank's ledger against moe_ep_bytes of the routing's counts at
// `elem` bytes a row element, per label and phase.
template <class T>
void expect_ledgers_are_the_closed_form(const std::vector<EpRank<T>>& ranks,
                                        const ExpertParallel& ep,
                                        const std::vector<std::vector<std::int64_t>>& counts,
                                        std::int64_t D, std::int64_t elem) {
  for (int r = 0; r < int(ranks.size()); ++r) {
    const Ledger& l = ranks[size_t(r)].ledger;
    const MoeEpBytes b = moe_ep_bytes(ep, counts, r, D, elem);
    EXPECT_EQ(sent(l, Phase::forward, "moe_counts"), b.counts) << "rank " << r;
    EXPECT_EQ(sent(l, Phase::forward, "moe_dispatch"), b.dispatch) << "rank " << r;
    EXPECT_EQ(sent(l, Phase::forward, "moe_combine"), b.combine) << "rank " << r;
    EXPECT_EQ(sent(l, Phase::backward, "dmoe_combine"), b.dispatch) << "rank " << r;
    EXPECT_EQ(sent(l, Phase::backward, "dmoe_dispatch"), b.combine) << "rank " << r;
    EXPECT_EQ(l.bytes_sent(), b.counts + 2 * (b.dispatch + b.combine)) << "rank " << r;
    if (ranks.size() > 1) {
      EXPECT_GT(b.dispatch + b.combine, 0) << "rank " << r;
    }
  }
}

// Folded onto P ranks, with P not dividing E and P > E (a rank with no
// experts), and in EP groups of G < P ranks (each group holding every
// expert: G 2 and 3, E % G != 0), the layer gives the plain-loop
// reference's out and dx, and the gradients summed over ranks are the
// reference's; each rank's gradient of an expert it does not own is
// exactly 0; the ledger is the closed form moe_ep_bytes of the routing's
// counts, byte for byte, per label and phase (nothing sent outside a group).
TEST(MoeExpertParallel, MatchesTheReferenceAndTheClosedFormAtEveryP) {
  const std::vector<std::pair<int, int>> placements = {{1, 0}, {2, 0}, {3, 0}, {5, 0}, {7, 0},
                                                       {9, 0}, {4, 2}, {6, 3}, {6, 2}, {9, 3}};
  for (const MoeConfig& cfg : {grouped(), ungrouped_unnormalised()}) {
    Case c = make_case(cfg, 13, 16, 600);
    RefMoe ref = ref_moe(cfg, c.w, c.x, c.dout, c.N, c.D);
    for (const auto& [P, degree] : placements) {
      SCOPED_TRACE(cfg.summary() + " P " + std::to_string(P) + " EP " +
                   std::to_string(degree == 0 ? P : degree));
      const std::vector<EpRank<double>> ranks = run_ep<double>(c, P, 0, degree);
      const std::vector<std::string> names = [&] {
        std::vector<std::string> v;
        c.w.for_each([&](const std::string& name, Tensor<double>&) { v.push_back(name); });
        return v;
      }();
      const auto [out, dx, counts] = assembled(ranks);
      EXPECT_TRUE(all_close("out", out.data(), ref.out.data(), c.N * c.D, 1e-13, 1e-12));
      EXPECT_TRUE(all_close("dx", dx.data(), ref.dx.data(), c.N * c.D, 1e-13, 1e-12));
      // The gradients: summed over ranks; an expert's only on its owner.
      std::vector<std::vector<double>> sum = ranks[0].g;
      for (int r = 1; r < P; ++r)
        for (size_t i = 0; i < sum.size(); ++i)
          for (size_t j = 0; j < sum[i].size(); ++j) sum[i][j] += ranks[size_t(r)].g[i][j];
      size_t i = 0;
      ref.g.for_each([&](const std::string& name, Tensor<double>& t) {
        EXPECT_TRUE(all_close(name, sum[i].data(), t.data(), t.numel(), 1e-13, 1e-12));
        ++i;
      });
      // The placement by hand: slot s of G owns E / G experts, the first
      // E % G slots one more; rank r is slot r % G.
      const int G = degree == 0 ? P : degree;
      std::vector<std::int64_t> first(size_t(G + 1), 0);
      for (int s = 0; s < G; ++s)
        first[size_t(s + 1)] =
            first[size_t(s)] + cfg.n_routed_experts / G + (s < cfg.n_routed_experts % G ? 1 : 0);
      for (int r = 0; r < P; ++r)
        for (std::int64_t e = 0; e < cfg.n_routed_experts; ++e) {
          if (e >= first[size_t(r % G)] && e < first[size_t(r % G + 1)]) continue;
          const std::string pre = "experts." + std::to_string(e) + ".";
          for (size_t t = 0; t < names.size(); ++t) {
            if (names[t].rfind(pre, 0) != 0) continue;
            for (double v : ranks[size_t(r)].g[t])
              ASSERT_EQ(v, 0.0) << "rank " << r << " " << names[t];
          }
        }
      // The ledger against the closed form, which the counts determine.
      DryRunCommunicator group(0, P);  // only its size
      const ExpertParallel ep = ExpertParallel::folded(
          group, cfg.n_routed_experts, std::vector<std::int64_t>(size_t(P), 1), degree);
      ASSERT_EQ(ep.first, first);
      expect_ledgers_are_the_closed_form(ranks, ep, counts, c.D, 8);
    }
  }
}

// Under --dtype bf16 the dispatch and combine (and their backward) move
// the routed rows as bf16 (mla/wire.hpp): each rank's ledger is
// moe_ep_bytes at 2 bytes an element (the counts stay f64), and out and dx
// stay within the bf16 bounds of the double reference at P 2 and 3.
TEST(MoeExpertParallel, Bf16MovesTheRowsAsBf16) {
  // MoeLayer.Bf16WithinItsBoundOfTheDoubleReference's case: its gate margins
  // are wider than bf16's rounding, so every rank routes as the reference.
  Case c = make_case(grouped(), 24, 16, 300);
  const RefMoe ref = ref_moe(c.cfg, c.w, c.x, c.dout, c.N, c.D);
  for (int P : {2, 3}) {
    SCOPED_TRACE("P " + std::to_string(P));
    const UsePrecision bf16(Precision::bf16);
    const std::vector<EpRank<float>> ranks = run_ep<float>(c, P);
    const auto [out, dx, counts] = assembled(ranks);
    EXPECT_LE(relative_to_largest(out.data(), ref.out.data(), c.N * c.D),
              bf16_bound_vs_exact(BlockTensor::output));
    EXPECT_LE(relative_to_largest(dx.data(), ref.dx.data(), c.N * c.D),
              bf16_bound_vs_exact(BlockTensor::gradient));
    DryRunCommunicator group(0, P);  // only its size
    const ExpertParallel ep = ExpertParallel::folded(group, c.cfg.n_routed_experts,
                                                     std::vector<std::int64_t>(size_t(P), 1));
    expect_ledgers_are_the_closed_form(ranks, ep, counts, c.D, 2);
  }
}

// In float: at P 1 expert parallelism is the local layer bit for bit; at P 3
// the owners' GEMMs see other rows beside each copy and the weight
// gradients sum in another order, so it agrees to float rounding only.
TEST(MoeExpertParallel, FloatIsTheLocalLayerAtOneRankAndCloseAtThree) {
  Case c = make_case(grouped(), 13, 16, 700);
  const MoeParams<float> wf = params_as<float>(c.cfg, c.w, c.D);
  const auto xf = test::convert<float>(c.x), gof = test::convert<float>(c.dout);
  const MoeForward<float> f = moe_forward(c.cfg, wf, xf.data(), c.N, c.D);
  MoeParams<float> g = MoeParams<float>::zeros(c.cfg, c.D, MemCategory::gradients);
  const Tensor<float> dx = moe_backward(c.cfg, wf, xf.data(), f.saved, gof.data(), g);
  const std::vector<EpRank<float>> one = run_ep<float>(c, 1);
  EXPECT_EQ(one[0].out, std::vector<float>(f.out.data(), f.out.data() + f.out.numel()));
  EXPECT_EQ(one[0].dx, std::vector<float>(dx.data(), dx.data() + dx.numel()));
  size_t i = 0;
  g.for_each([&](const std::string& n, Tensor<float>& t) {
    EXPECT_EQ(one[0].g[i++], std::vector<float>(t.data(), t.data() + t.numel())) << n;
  });
  const RefMoe ref = ref_moe(c.cfg, c.w, c.x, c.dout, c.N, c.D);
  const std::vector<EpRank<float>> three = run_ep<float>(c, 3);
  std::vector<float> out;
  for (const auto& r : three) out.insert(out.end(), r.out.begin(), r.out.end());
  EXPECT_TRUE(all_close("out f32 P 3", out.data(), ref.out.data(), c.N * c.D, 2e-6, 2e-5));
}

// Deterministic: the same inputs give the same bits whatever each rank's
// thread count (the permutations are counting sorts, the combine adds each
// token's copies in slot order, the owners' rows arrive in rank order).
TEST(MoeExpertParallel, BitwiseTheSameAtEveryThreadCount) {
  Case c = make_case(grouped(), 29, 16, 900);
  const std::vector<EpRank<float>> one = run_ep<float>(c, 3, 1);
  for (int threads : {2, 3}) {
    const std::vector<EpRank<float>> many = run_ep<float>(c, 3, threads);
    for (size_t r = 0; r < one.size(); ++r) {
      EXPECT_EQ(many[r].out, one[r].out) << "rank " << r << ", " << threads << " threads";
      EXPECT_EQ(many[r].dx, one[r].dx) << "rank " << r << ", " << threads << " threads";
      EXPECT_EQ(many[r].g, one[r].g) << "rank " << r << ", " << threads << " threads";
    }
  }
}

TEST(MoeExpertParallel, RefusesAPlacementOfAnotherGroup) {
  Case c = make_case(grouped(), 4, 16, 800);
  run_local_ranks(2, [&](Communicator& comm) {
    const ExpertParallel wrong = ExpertParallel::folded(comm, 6, {2, 2});  // 6 experts, not 8
    const double* x = c.x.data() + comm.rank() * 2 * c.D;
    EXPECT_NE(test::error_of([&] {
                moe_forward(c.cfg, c.w, x, 2, c.D, &wrong);
              }).find("expert-parallel placement is not this group's"),
              std::string::npos);
  });
  run_local_ranks(2, [&](Communicator& comm) {
    EXPECT_NE(test::error_of([&] {
                ExpertParallel::folded(comm, 8, {4});
              }).find("given the token counts of 1"),
              std::string::npos);
  });
  DryRunCommunicator three(0, 3);
  EXPECT_NE(test::error_of([&] {
              ExpertParallel::folded(three, 8, {1, 1, 1}, 2);
            }).find("--ep 2 must divide the 3 ranks of --sp"),
            std::string::npos);
}

// ------------------------------------------------ the PyTorch reference

// python/torch_reference_moe.py: DeepSeek-V3's Gate/Expert/MoE in PyTorch
// autograd, float64, written from DeepSeek's model.py (fixture
// model_torch_moe_data). The C++ layer in double selects the same experts
// and gives its out, dx and every gradient to rounding (1e-13 absolute,
// 1e-12 relative); so does the layer with its experts folded onto 3 ranks.
class MoeTorchReference : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeTorchReference, LayerMatchesAutograd) {
  const char* tmp = std::getenv("LAGA_TEST_TMP");
  const std::string path =
      std::string(tmp ? tmp : ".") + "/torch_moe/moe_" + GetParam() + ".safetensors";
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing: ctest runs model_torch_moe_data first (needs /usr/bin/python3 "
      << "with torch: scripts/setup.sh installs python3-torch)";
  const SafetensorsFile f = SafetensorsFile::open(path);
  const nlohmann::json meta = nlohmann::json::parse(f.metadata().at("config"));
  const MoeConfig cfg = *MoeConfig::from_json(meta, path);
  const int N = std::stoi(f.metadata().at("tokens")), D = std::stoi(f.metadata().at("dim"));
  Case c{cfg, N, D, MoeParams<double>::zeros(cfg, D, MemCategory::parameters), {}, {}};
  c.w.for_each([&](const std::string& name, Tensor<double>& t) { f.read_into(name, t); });
  const auto vec = [&](const std::string& name) {
    const Tensor<double> t = f.read<double>(name, MemCategory::activations);
    return std::vector<double>(t.data(), t.data() + t.numel());
  };
  c.x = vec("x");
  c.dout = vec("dout");
  const std::vector<double> out = vec("out"), dx_ref = vec("dx"), idx = vec("indices");
  const MoeForward<double> fw = moe_forward(cfg, c.w, c.x.data(), N, D);
  MoeParams<double> g = MoeParams<double>::zeros(cfg, D, MemCategory::gradients);
  const Tensor<double> dx = moe_backward(cfg, c.w, c.x.data(), fw.saved, c.dout.data(), g);
  // torch.topk lists the experts best first, as Routing::expert does.
  for (size_t i = 0; i < idx.size(); ++i)
    ASSERT_EQ(fw.saved.routing.expert[i], std::int32_t(idx[i])) << "copy " << i;
  EXPECT_TRUE(all_close("out", fw.out.data(), out.data(), N * D, 1e-13, 1e-12));
  EXPECT_TRUE(all_close("dx", dx.data(), dx_ref.data(), N * D, 1e-13, 1e-12));
  std::vector<std::vector<double>> want;
  g.for_each(
      [&](const std::string& name, Tensor<double>& t) {
        const std::vector<double> r = vec("grad." + name);
        EXPECT_TRUE(all_close(name, t.data(), r.data(), t.numel(), 1e-13, 1e-12));
        want.push_back(r);
      },
      false);
  const std::vector<EpRank<double>> ranks = run_ep<double>(c, 3);
  std::vector<double> ep_out;
  for (const auto& r : ranks) ep_out.insert(ep_out.end(), r.out.begin(), r.out.end());
  EXPECT_TRUE(all_close("out, experts on 3 ranks", ep_out.data(), out.data(), N * D, 1e-13, 1e-12));
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeTorchReference,
                         ::testing::Values("grouped", "ungrouped_unnormalised", "v2_grouped",
                                           "v2_greedy", "v2_greedy_normalised"));

}  // namespace
}  // namespace laga
