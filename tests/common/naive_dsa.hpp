// Naive references of DeepSeek Sparse Attention's pieces, in double, with
// plain loops and a dense Sq x Sk mask (the shape of DeepSeek's own prefill,
// model.py's MLA: scores for every pair, -inf where the index mask is), so
// they share no structure with laga's kernels, which gather the selected
// keys (kernels/attention_sparse.hpp, kernels/dsa_indexer.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace laga::test {

using I64 = std::int64_t;

// Whether key j is among row r's selection (idx row of K slots).
inline bool naive_selected(const std::int32_t* row, I64 K, I64 j) {
  for (I64 r = 0; r < K; ++r)
    if (row[r] == j) return true;
  return false;
}

// DeepSeek's apply_rotary_emb(x, freqs_cis, interleaved=False), literally:
// view (2, dr/2), transpose to pairs, complex multiply, then
// cat(real parts, imaginary parts). x holds dr values; angle[e] = pos f_e.
inline void naive_rope_halves(double* x, I64 dr, const std::vector<double>& angle) {
  const I64 half = dr / 2;
  std::vector<double> pairs(static_cast<std::size_t>(dr));  // transposed: (half, 2)
  for (I64 e = 0; e < half; ++e) pairs[2 * e] = x[e], pairs[2 * e + 1] = x[half + e];
  std::vector<double> y(static_cast<std::size_t>(dr));
  for (I64 e = 0; e < half; ++e) {
    const double re = pairs[2 * e], im = pairs[2 * e + 1];
    const double c = std::cos(angle[e]), s = std::sin(angle[e]);
    y[2 * e] = re * c - im * s, y[2 * e + 1] = re * s + im * c;
  }
  for (I64 e = 0; e < half; ++e) x[e] = y[2 * e], x[half + e] = y[2 * e + 1];  // y[0::2], y[1::2]
}

// I (B, Sq, Sk): sum_h w relu(q.k) where j is causal for row i (bottom-right
// aligned, within its document when doc_start is given), -inf elsewhere.
inline std::vector<double> naive_index_scores(I64 B, I64 Sq, I64 Sk, I64 HI, I64 dI,
                                              const std::vector<double>& q,
                                              const std::vector<double>& k,
                                              const std::vector<double>& w,
                                              const std::int64_t* doc_start = nullptr) {
  std::vector<double> sc(static_cast<std::size_t>(B * Sq * Sk),
                         -std::numeric_limits<double>::infinity());
  for (I64 b = 0; b < B; ++b)
    for (I64 i = 0; i < Sq; ++i) {
      const I64 t = i + Sk - Sq;
      for (I64 j = 0; j < Sk; ++j) {
        if (j > t) continue;
        if (doc_start && j < doc_start[b * Sk + t]) continue;
        double sum = 0;
        for (I64 h = 0; h < HI; ++h) {
          double d = 0;
          for (I64 e = 0; e < dI; ++e)
            d += q[std::size_t(((b * Sq + i) * HI + h) * dI + e)] *
                 k[std::size_t((b * Sk + j) * dI + e)];
          sum += w[std::size_t((b * Sq + i) * HI + h)] * std::max(d, 0.0);
        }
        sc[std::size_t((b * Sq + i) * Sk + j)] = sum;
      }
    }
  return sc;
}

// The top-k of each row of dense scores by a full stable sort on the score
// (descending; stable, so of equal scores the lower position comes first),
// the causal keys only, written ascending with -1 after (laga's rule,
// kernels/dsa_indexer.hpp).
inline std::vector<std::int32_t> naive_topk(I64 rows, I64 Sk, I64 K,
                                            const std::vector<double>& scores) {
  std::vector<std::int32_t> idx(static_cast<std::size_t>(rows * K), -1);
  for (I64 r = 0; r < rows; ++r) {
    std::vector<std::int32_t> js;
    for (I64 j = 0; j < Sk; ++j)
      if (std::isfinite(scores[std::size_t(r * Sk + j)])) js.push_back(std::int32_t(j));
    std::stable_sort(js.begin(), js.end(), [&](std::int32_t a, std::int32_t b) {
      return scores[std::size_t(r * Sk + a)] > scores[std::size_t(r * Sk + b)];
    });
    if (I64(js.size()) > K) js.resize(std::size_t(K));
    std::sort(js.begin(), js.end());
    std::copy(js.begin(), js.end(), idx.begin() + r * K);
  }
  return idx;
}

// Attention over (B, Sq, Hq, dqk) queries and (B, Sk, Hk, .) keys and values
// with a dense mask that keeps exactly the selected keys of each row:
// o (B, Sq, Hq, dv), lse (B, Hq, Sq); and, with dout, the gradients.
struct NaiveSparseResult {
  std::vector<double> o, lse, dq, dk, dv;
};
inline NaiveSparseResult naive_sparse_attention(
    I64 B, I64 Sq, I64 Sk, I64 Hq, I64 Hk, I64 dqk, I64 dv, double scale, I64 K,
    const std::vector<std::int32_t>& idx, const std::vector<double>& q,
    const std::vector<double>& k, const std::vector<double>& v, const std::vector<double>* dout) {
  NaiveSparseResult r;
  r.o.assign(std::size_t(B * Sq * Hq * dv), 0.0);
  r.lse.assign(std::size_t(B * Hq * Sq), 0.0);
  r.dq.assign(q.size(), 0.0), r.dk.assign(k.size(), 0.0), r.dv.assign(v.size(), 0.0);
  const I64 g = Hq / Hk;
  std::vector<double> s(static_cast<std::size_t>(Sk)), p(static_cast<std::size_t>(Sk)),
      mask(static_cast<std::size_t>(Sk));
  for (I64 b = 0; b < B; ++b)
    for (I64 i = 0; i < Sq; ++i)
      for (I64 h = 0; h < Hq; ++h) {
        const I64 kh = h / g;
        const std::int32_t* row = idx.data() + (b * Sq + i) * K;
        double m = -std::numeric_limits<double>::infinity();
        for (I64 j = 0; j < Sk; ++j) {
          double d = 0;
          for (I64 e = 0; e < dqk; ++e)
            d += q[std::size_t(((b * Sq + i) * Hq + h) * dqk + e)] *
                 k[std::size_t(((b * Sk + j) * Hk + kh) * dqk + e)];
          mask[std::size_t(j)] = naive_selected(row, K, j) ? 0.0 : 1.0;
          s[std::size_t(j)] = d * scale;
          if (mask[std::size_t(j)] == 0.0) m = std::max(m, s[std::size_t(j)]);
        }
        if (!std::isfinite(m)) continue;
        double z = 0;
        for (I64 j = 0; j < Sk; ++j)
          z += p[std::size_t(j)] =
              mask[std::size_t(j)] == 0.0 ? std::exp(s[std::size_t(j)] - m) : 0;
        for (I64 j = 0; j < Sk; ++j) p[std::size_t(j)] /= z;
        r.lse[std::size_t((b * Hq + h) * Sq + i)] = m + std::log(z);
        double* o = r.o.data() + ((b * Sq + i) * Hq + h) * dv;
        for (I64 j = 0; j < Sk; ++j)
          for (I64 e = 0; e < dv; ++e)
            o[e] += p[std::size_t(j)] * v[std::size_t(((b * Sk + j) * Hk + kh) * dv + e)];
        if (!dout) continue;
        const double* dO = dout->data() + ((b * Sq + i) * Hq + h) * dv;
        double D = 0;
        for (I64 e = 0; e < dv; ++e) D += dO[e] * o[e];
        for (I64 j = 0; j < Sk; ++j) {
          if (mask[std::size_t(j)] != 0.0) continue;
          double dp = 0;
          for (I64 e = 0; e < dv; ++e) {
            dp += dO[e] * v[std::size_t(((b * Sk + j) * Hk + kh) * dv + e)];
            r.dv[std::size_t(((b * Sk + j) * Hk + kh) * dv + e)] += p[std::size_t(j)] * dO[e];
          }
          const double ds = p[std::size_t(j)] * (dp - D);
          for (I64 e = 0; e < dqk; ++e) {
            r.dq[std::size_t(((b * Sq + i) * Hq + h) * dqk + e)] +=
                scale * ds * k[std::size_t(((b * Sk + j) * Hk + kh) * dqk + e)];
            r.dk[std::size_t(((b * Sk + j) * Hk + kh) * dqk + e)] +=
                scale * ds * q[std::size_t(((b * Sq + i) * Hq + h) * dqk + e)];
          }
        }
      }
  return r;
}

// The indexer's KL loss summed over rows (kernels/dsa_indexer.hpp,
// dsa_indexer_kl) from dense scores and a target p (B, Sq, K) on the slots.
inline double naive_indexer_kl(I64 rows, I64 Sk, I64 K, const std::vector<std::int32_t>& idx,
                               const std::vector<double>& p, const std::vector<double>& scores) {
  double total = 0;
  for (I64 r = 0; r < rows; ++r) {
    double m = -std::numeric_limits<double>::infinity();
    for (I64 s = 0; s < K; ++s)
      if (idx[std::size_t(r * K + s)] >= 0)
        m = std::max(m, scores[std::size_t(r * Sk + idx[std::size_t(r * K + s)])]);
    if (!std::isfinite(m)) continue;
    double z = 0;
    for (I64 s = 0; s < K; ++s)
      if (idx[std::size_t(r * K + s)] >= 0)
        z += std::exp(scores[std::size_t(r * Sk + idx[std::size_t(r * K + s)])] - m);
    for (I64 s = 0; s < K; ++s) {
      const std::int32_t j = idx[std::size_t(r * K + s)];
      const double pr = p[std::size_t(r * K + s)];
      if (j < 0 || pr <= 0) continue;
      total += pr * (std::log(pr) - (scores[std::size_t(r * Sk + j)] - m - std::log(z)));
    }
  }
  return total;
}

}  // namespace laga::test
