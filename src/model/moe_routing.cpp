#include "model/moe_routing.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.hpp"

namespace laga {

namespace {

// In double whatever T is: 1 / (1 + e^-z) is exact enough and stays > 0 down
// to z = -745, so S = sum of the selected scores is 0 only past that.
inline double sigmoid(double z) {
  return 1.0 / (1.0 + std::exp(-z));
}

// s (E) from one token's logits z (E), in double whatever T is. Softmax
// subtracts the largest logit first (exp never overflows; the largest term
// is 1, so the sum is in [1, E]).
template <class T>
void scores(ScoreFunc f, const T* z, std::int64_t E, double* s) {
  if (f == ScoreFunc::sigmoid) {
    for (std::int64_t e = 0; e < E; ++e) s[e] = sigmoid(double(z[e]));
    return;
  }
  double m = -INFINITY, sum = 0.0;
  for (std::int64_t e = 0; e < E; ++e) m = std::max(m, double(z[e]));
  for (std::int64_t e = 0; e < E; ++e) sum += s[e] = std::exp(double(z[e]) - m);
  for (std::int64_t e = 0; e < E; ++e) s[e] /= sum;
}

// The one ranking of the gate: larger first, of equals the lower index.
inline bool ranks_before(double va, std::int64_t a, double vb, std::int64_t b) {
  return va > vb || (va == vb && a < b);
}

}  // namespace

template <class T>
Routing<T> route(const MoeConfig& cfg, const T* logits, const T* bias, std::int64_t N) {
  cfg.validate();
  const std::int64_t E = cfg.n_routed_experts, k = cfg.num_experts_per_tok,
                     G = cfg.selection_groups(), per = E / G, Gk = G == 1 ? 1 : cfg.topk_group;
  const bool use_bias = bias && cfg.gate_has_bias(),
             top_two = cfg.topk_method == TopkMethod::noaux_tc;
  LAGA_CHECK(N >= 0, "route: N must be >= 0, got ", N);
  // Refused before the parallel loop (no exception may leave it): a NaN has
  // no rank, so its selection would depend on the sort's internals.
  for (std::int64_t e = 0; bias && e < E; ++e) {
    LAGA_CHECK(std::isfinite(double(bias[e])), "route: e_score_correction_bias[", e, "] is ",
               double(bias[e]), "; the gate's bias must be finite");
    // A gate without a bias (V2's) would ignore it: refused, not dropped.
    LAGA_CHECK(cfg.gate_has_bias() || bias[e] == T(0), "route: e_score_correction_bias[", e,
               "] is ", double(bias[e]), " but topk_method '", to_string(cfg.topk_method),
               "' has no bias (only noaux_tc's gate adds one); drop the bias or use noaux_tc");
  }
  for (std::int64_t i = 0; i < N * E; ++i)
    LAGA_CHECK(std::isfinite(double(logits[i])), "route: gate logit of token ", i / E, ", expert ",
               i % E, " is ", double(logits[i]), "; the gate's input or weight is not finite");
  Routing<T> r;
  r.tokens = N, r.top_k = k, r.experts = E;
  r.expert.resize(size_t(N * k));
  r.weight.resize(size_t(N * k));
  r.score.resize(size_t(N * k));
  if (cfg.scoring_func == ScoreFunc::softmax) r.prob.resize(size_t(N * E));
#pragma omp parallel
  {
    std::vector<double> s(static_cast<size_t>(E)), biased(static_cast<size_t>(E)),
        group(static_cast<size_t>(G));
    std::vector<std::int64_t> order(size_t(std::max(E, G)));
    std::vector<char> kept(static_cast<size_t>(G));
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < N; ++t) {
      scores(cfg.scoring_func, logits + t * E, E, s.data());
      for (std::int64_t e = 0; e < E; ++e)
        biased[size_t(e)] = s[size_t(e)] + (use_bias ? double(bias[e]) : 0.0);
      // Group limiting: only the topk_group best groups' experts may be
      // chosen. A group scores the sum of its two best biased scores
      // (noaux_tc) or its best score (group_limited_greedy).
      std::fill(kept.begin(), kept.end(), char(1));
      if (G > 1) {
        for (std::int64_t q = 0; q < G; ++q) {
          double m1 = -INFINITY, m2 = -INFINITY;
          for (std::int64_t e = q * per; e < (q + 1) * per; ++e) {
            const double v = biased[size_t(e)];
            if (v > m1) {
              m2 = m1;
              m1 = v;
            } else if (v > m2) {
              m2 = v;
            }
          }
          group[size_t(q)] = top_two ? m1 + m2 : m1;
        }
        std::iota(order.begin(), order.begin() + G, std::int64_t{0});
        std::partial_sort(order.begin(), order.begin() + Gk, order.begin() + G,
                          [&](std::int64_t a, std::int64_t b) {
                            return ranks_before(group[size_t(a)], a, group[size_t(b)], b);
                          });
        std::fill(kept.begin(), kept.end(), char(0));
        for (std::int64_t i = 0; i < Gk; ++i) kept[size_t(order[size_t(i)])] = 1;
      }
      // Top-k of the kept experts by biased score.
      std::int64_t n = 0;
      for (std::int64_t e = 0; e < E; ++e)
        if (kept[size_t(e / per)]) order[size_t(n++)] = e;
      std::partial_sort(order.begin(), order.begin() + k, order.begin() + n,
                        [&](std::int64_t a, std::int64_t b) {
                          return ranks_before(biased[size_t(a)], a, biased[size_t(b)], b);
                        });
      // Weights from the unbiased scores: the bias selects, it never weights.
      double sum = 0.0;
      for (std::int64_t j = 0; j < k; ++j) sum += s[size_t(order[size_t(j)])];
      const double scale = cfg.routed_scaling_factor / (cfg.norm_topk_prob ? sum : 1.0);
      if (!r.prob.empty()) std::copy(s.begin(), s.end(), r.prob.begin() + t * E);
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t e = order[size_t(j)];
        r.expert[size_t(t * k + j)] = std::int32_t(e);
        r.score[size_t(t * k + j)] = s[size_t(e)];
        r.weight[size_t(t * k + j)] = static_cast<T>(s[size_t(e)] * scale);
      }
    }
  }
  if (cfg.norm_topk_prob)
    for (std::int64_t t = 0; t < N; ++t) {
      double sum = 0.0;
      for (std::int64_t j = 0; j < k; ++j) sum += r.score[size_t(t * k + j)];
      LAGA_CHECK(sum > 0, "route: token ", t,
                 ": every selected expert's score underflows to 0 (gate logits below -745, or "
                 "745 below the token's best under softmax), so the weights' normalisation "
                 "divides by 0; the gate's input is far out of range");
    }
  return r;
}

template <class T>
std::vector<T> route_backward(const MoeConfig& cfg, const Routing<T>& r, const T* dweight) {
  const std::int64_t N = r.tokens, k = r.top_k, E = r.experts;
  const double c = cfg.routed_scaling_factor;
  const bool softmax = cfg.scoring_func == ScoreFunc::softmax;
  LAGA_CHECK(!softmax || r.prob.size() == size_t(N * E),
             "internal: a softmax routing without its probabilities");
  std::vector<T> dlogits(size_t(N * E), T(0));
#pragma omp parallel for schedule(static)
  for (std::int64_t t = 0; t < N; ++t) {
    const double* s = r.score.data() + t * k;
    const T* dw = dweight + t * k;
    double S = 0.0, dot = 0.0;  // S = sum s_j, dot = sum dw_j s_j
    for (std::int64_t j = 0; j < k; ++j) {
      S += s[j];
      dot += double(dw[j]) * s[j];
    }
    // Softmax: every score depends on every logit, dz_i = p_i (g_i - gp) with
    // g = ds (non-zero on the selection only) and gp = sum_j ds_j p_j, so the
    // unselected experts' logits get -p_i gp. Normalised, w_j = c p_j / sum
    // of the selected p = c e^z_j / sum of their e^z: the softmax's
    // denominator cancels and gp is 0 (in exact arithmetic; taken so, not as
    // its rounding residue): only the selected logits get a gradient.
    double gp = 0.0;
    if (softmax) {
      for (std::int64_t j = 0; !cfg.norm_topk_prob && j < k; ++j) gp += c * double(dw[j]) * s[j];
      const double* p = r.prob.data() + t * E;
      for (std::int64_t e = 0; e < E; ++e) dlogits[size_t(t * E + e)] = static_cast<T>(-p[e] * gp);
    }
    for (std::int64_t j = 0; j < k; ++j) {
      // w_j = c s_j / S: dw_j reaches s_j directly (c / S) and through S
      // (-c s_j / S^2 summed over j, the same for every i).
      const double ds = cfg.norm_topk_prob ? c * (double(dw[j]) - dot / S) / S : c * double(dw[j]);
      // ds/dz: sigmoid's s (1 - s); softmax's p_j (ds_j - gp), gp below.
      dlogits[size_t(t * E + r.expert[size_t(t * k + j)])] =
          static_cast<T>(softmax ? s[j] * (ds - gp) : ds * s[j] * (1.0 - s[j]));
    }
  }
  return dlogits;
}

template <class T>
Dispatch make_dispatch(const Routing<T>& r) {
  const std::int64_t N = r.tokens, k = r.top_k, E = r.experts;
  Dispatch d;
  d.tokens = N, d.top_k = k, d.experts = E;
  d.count.assign(size_t(E), 0);
  for (const std::int32_t e : r.expert) ++d.count[size_t(e)];
  d.offset.assign(size_t(E + 1), 0);
  for (std::int64_t e = 0; e < E; ++e)
    d.offset[size_t(e + 1)] = d.offset[size_t(e)] + d.count[size_t(e)];
  // Counting sort, token-major: each expert's rows come out in token order.
  std::vector<std::int64_t> next(d.offset.begin(), d.offset.end() - 1);
  d.token.resize(size_t(N * k));
  d.row.resize(size_t(N * k));
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t p = next[size_t(r.expert[size_t(t * k + j)])]++;
      d.token[size_t(p)] = std::int32_t(t);
      d.row[size_t(t * k + j)] = p;
    }
  return d;
}

template <class T>
std::vector<T> update_expert_bias(const std::vector<T>& bias,
                                  const std::vector<std::int64_t>& tokens_per_expert,
                                  double gamma) {
  LAGA_CHECK(bias.size() == tokens_per_expert.size(), "update_expert_bias: ", bias.size(),
             " biases but ", tokens_per_expert.size(),
             " expert loads; give one of each per expert");
  LAGA_CHECK(std::isfinite(gamma) && gamma >= 0,
             "update_expert_bias: gamma must be finite and >= 0, got ", gamma,
             " (DeepSeek-V3: 0.001, then 0 for the last 500B tokens)");
  std::int64_t total = 0;
  for (const std::int64_t c : tokens_per_expert) total += c;
  const std::int64_t E = std::int64_t(bias.size());
  std::vector<T> out(bias);
  // Compare c_e with the mean total / E as c_e E vs total: exact in integers.
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t load = tokens_per_expert[size_t(e)] * E;
    if (load > total) out[size_t(e)] = static_cast<T>(double(bias[size_t(e)]) - gamma);
    if (load < total) out[size_t(e)] = static_cast<T>(double(bias[size_t(e)]) + gamma);
  }
  return out;
}

#define LAGA_INSTANTIATE(T)                                                                 \
  template Routing<T> route<T>(const MoeConfig&, const T*, const T*, std::int64_t);         \
  template std::vector<T> route_backward<T>(const MoeConfig&, const Routing<T>&, const T*); \
  template Dispatch make_dispatch<T>(const Routing<T>&);                                    \
  template std::vector<T> update_expert_bias<T>(const std::vector<T>&,                      \
                                                const std::vector<std::int64_t>&, double);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
