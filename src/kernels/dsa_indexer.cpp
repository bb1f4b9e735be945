#include "kernels/dsa_indexer.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.hpp"
#include "kernels/dsa_indexer_fp8.hpp"

namespace laga {

const char* to_string(IndexScores s) {
  return s == IndexScores::fp8 ? "fp8" : "run_dtype";
}

void IndexerShape::validate() const {
  attn.validate();
  LAGA_CHECK(attn.causal,
             "indexer: the lightning indexer selects among causal keys; causal must "
             "be true");
  LAGA_CHECK(attn.Hk == 1,
             "indexer: the index keys are one head shared by every index head (Hk "
             "1), got Hk ",
             attn.Hk);
  LAGA_CHECK(topk > 0 && topk <= std::numeric_limits<std::int32_t>::max(),
             "indexer: topk (index_topk) must be in [1, 2^31), got ", topk);
  LAGA_CHECK(attn.Sk <= std::numeric_limits<std::int32_t>::max(), "indexer: Sk ", attn.Sk,
             " beyond int32 (the selection's indices are int32)");
}

template <class T>
void rope_halves_apply(T* x, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                       std::int64_t ld_head, std::int64_t pos0, const std::int64_t* positions,
                       const RopeTable& table, bool inverse) {
  const std::int64_t half = table.dim() / 2;
  for (std::int64_t l = 0; l < L; ++l) {
    const std::int64_t pos = positions ? positions[l] : pos0 + l;
    LAGA_CHECK(pos >= 0 && pos < table.positions(), "indexer rope: position ", pos,
               " outside the RoPE table's [0, ", table.positions(), ")");
    for (std::int64_t h = 0; h < H; ++h) {
      T* r = x + l * ld_token + h * ld_head;
      for (std::int64_t e = 0; e < half; ++e) {
        const double c = table.cos(pos, e), sn = inverse ? -table.sin(pos, e) : table.sin(pos, e);
        const double a = double(r[e]), b = double(r[e + half]);
        r[e] = T(a * c - b * sn);
        r[e + half] = T(a * sn + b * c);
      }
    }
  }
}

template <class T>
void layernorm_forward(T* y, T* mean, T* rstd, const T* x, const T* w, const T* b,
                       std::int64_t rows, std::int64_t n, double eps) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    double m = 0, v = 0;
    for (std::int64_t e = 0; e < n; ++e) m += double(xr[e]);
    m /= double(n);
    for (std::int64_t e = 0; e < n; ++e) v += (double(xr[e]) - m) * (double(xr[e]) - m);
    const double rs = 1.0 / std::sqrt(v / double(n) + eps);
    mean[r] = T(m), rstd[r] = T(rs);
    for (std::int64_t e = 0; e < n; ++e)
      y[r * n + e] = T((double(xr[e]) - m) * rs * double(w[e]) + double(b[e]));
  }
}

template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, const T* mean,
                        const T* rstd, std::int64_t rows, std::int64_t n) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * n, *dyr = dy + r * n;
    const double m = double(mean[r]), rs = double(rstd[r]);
    double sum_g = 0, sum_gx = 0;  // g = dy w, over the row; and g xhat
    for (std::int64_t e = 0; e < n; ++e) {
      const double xhat = (double(xr[e]) - m) * rs, g = double(dyr[e]) * double(w[e]);
      sum_g += g, sum_gx += g * xhat;
      dw[e] += T(double(dyr[e]) * xhat);
      db[e] += dyr[e];
    }
    for (std::int64_t e = 0; e < n; ++e) {
      const double xhat = (double(xr[e]) - m) * rs, g = double(dyr[e]) * double(w[e]);
      dx[r * n + e] = T(rs * (g - sum_g / double(n) - xhat * sum_gx / double(n)));
    }
  }
}

namespace {

// I_ij for the keys [j0, j1) of query row (b, i) into out[j - j0], each
// rounded to T (the score a T-precision indexer holds; the same arithmetic
// wherever the row is computed, so every rank and form selects alike).
template <class T>
void row_scores(const IndexerShape& s, std::int64_t b, std::int64_t i, const T* q, const T* k,
                const T* w, std::int64_t j0, std::int64_t j1, T* out) {
  const AttnShape& a = s.attn;
  const std::int64_t bi = b * a.Sq + i;
  const T* qrow = q + bi * a.Hq * a.dqk;
  const T* wrow = w + bi * a.Hq;
  for (std::int64_t j = j0; j < j1; ++j) {
    const T* krow = k + (b * a.Sk + j) * a.dqk;
    double sum = 0;
    for (std::int64_t h = 0; h < a.Hq; ++h) {
      double d = 0;
      for (std::int64_t e = 0; e < a.dqk; ++e) d += double(qrow[h * a.dqk + e]) * double(krow[e]);
      if (d > 0) sum += double(wrow[h]) * d;
    }
    out[j - j0] = T(sum);
  }
}

}  // namespace

template <class T>
void dsa_index_topk(const IndexerShape& s, std::int32_t* idx, const T* q, const T* k, const T* w) {
  const AttnShape& a = s.attn;
  const bool fp8 = s.scores == IndexScores::fp8;
  const DsaFp8Operands op = fp8 ? dsa_fp8_operands(s, q, k) : DsaFp8Operands{};
#pragma omp parallel
  {
    std::vector<T> sc;
    std::vector<std::int32_t> order;
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t bi = 0; bi < a.B * a.Sq; ++bi) {
      const std::int64_t b = bi / a.Sq, i = bi % a.Sq;
      const std::int64_t j0 = a.key_begin(b, i), j1 = a.key_end(i);
      const std::int64_t n = std::max<std::int64_t>(j1 - j0, 0);
      std::int32_t* out = idx + bi * s.topk;
      order.resize(std::size_t(n));
      std::iota(order.begin(), order.end(), std::int32_t(j0));
      if (n > s.topk) {
        sc.resize(std::size_t(n));
        if (fp8)
          dsa_fp8_row_scores(s, op, b, i, w, j0, j1, sc.data());
        else
          row_scores(s, b, i, q, k, w, j0, j1, sc.data());
        // Higher score first; of equal scores, the lower key position.
        auto before = [&](std::int32_t x, std::int32_t y) {
          const T sx = sc[std::size_t(x - j0)], sy = sc[std::size_t(y - j0)];
          return sx > sy || (sx == sy && x < y);
        };
        std::nth_element(order.begin(), order.begin() + s.topk, order.end(), before);
        order.resize(std::size_t(s.topk));
        std::sort(order.begin(), order.end());
      }
      std::copy(order.begin(), order.end(), out);
      std::fill(out + order.size(), out + s.topk, std::int32_t(-1));
    }
  }
}

template <class T>
void dsa_index_scores(const IndexerShape& s, T* scores, const T* q, const T* k, const T* w) {
  const AttnShape& a = s.attn;
  const bool fp8 = s.scores == IndexScores::fp8;
  const DsaFp8Operands op = fp8 ? dsa_fp8_operands(s, q, k) : DsaFp8Operands{};
  for (std::int64_t b = 0; b < a.B; ++b)
    for (std::int64_t i = 0; i < a.Sq; ++i) {
      T* row = scores + (b * a.Sq + i) * a.Sk;
      std::fill(row, row + a.Sk, -std::numeric_limits<T>::infinity());
      const std::int64_t j0 = a.key_begin(b, i), j1 = a.key_end(i);
      if (j1 <= j0) continue;
      if (fp8)
        dsa_fp8_row_scores(s, op, b, i, w, j0, j1, row + j0);
      else
        row_scores(s, b, i, q, k, w, j0, j1, row + j0);
    }
}

template <class T>
void dsa_indexer_kl(const IndexerShape& s, std::int64_t K, const std::int32_t* idx, const T* p,
                    const T* q, const T* k, const T* w, double* loss, T* dq, T* dk, T* dw) {
  const AttnShape& a = s.attn;
  const std::int64_t HI = a.Hq, dI = a.dqk;
  // dL/dI of every slot, kept for the keys' pass (a key's gradient gathers
  // from every row that selected it).
  std::vector<double> g(static_cast<std::size_t>(a.B * a.Sq * K), 0.0);
#pragma omp parallel
  {
    std::vector<T> one(1);
    std::vector<double> sc(static_cast<std::size_t>(K)), dqa(static_cast<std::size_t>(HI * dI));
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t bi = 0; bi < a.B * a.Sq; ++bi) {
      const std::int64_t b = bi / a.Sq, i = bi % a.Sq;
      const std::int32_t* r = idx + bi * K;
      const T* prow = p + bi * K;
      double m = -std::numeric_limits<double>::infinity(), psum = 0;
      for (std::int64_t slot = 0; slot < K; ++slot) {
        if (r[slot] < 0) continue;
        row_scores(s, b, i, q, k, w, r[slot], r[slot] + 1, one.data());
        sc[std::size_t(slot)] = double(one[0]);
        m = std::max(m, sc[std::size_t(slot)]);
        psum += double(prow[slot]);
      }
      double* grow = g.data() + bi * K;
      double l = 0;
      if (m != -std::numeric_limits<double>::infinity()) {
        double z = 0;
        for (std::int64_t slot = 0; slot < K; ++slot)
          if (r[slot] >= 0) z += std::exp(sc[std::size_t(slot)] - m);
        const double lz = m + std::log(z);
        for (std::int64_t slot = 0; slot < K; ++slot) {
          if (r[slot] < 0) continue;
          const double pr = double(prow[slot]), logq = sc[std::size_t(slot)] - lz;
          if (pr > 0) l += pr * (std::log(pr) - logq);
          // d/dI_r of -sum_r' p_r' log softmax_r'(I) = softmax_r sum p - p_r
          grow[slot] = std::exp(logq) * psum - pr;
        }
      }
      loss[bi] = l;
      // dq and dw of this row.
      std::fill(dqa.begin(), dqa.end(), 0.0);
      const T* qrow = q + bi * HI * dI;
      const T* wrow = w + bi * HI;
      T* dwrow = dw + bi * HI;
      std::vector<double> dwa(static_cast<std::size_t>(HI), 0.0);
      for (std::int64_t slot = 0; slot < K; ++slot) {
        if (r[slot] < 0 || grow[slot] == 0) continue;
        const T* krow = k + (b * a.Sk + r[slot]) * dI;
        for (std::int64_t h = 0; h < HI; ++h) {
          double d = 0;
          for (std::int64_t e = 0; e < dI; ++e) d += double(qrow[h * dI + e]) * double(krow[e]);
          if (d <= 0) continue;
          dwa[std::size_t(h)] += grow[slot] * d;
          const double gw = grow[slot] * double(wrow[h]);
          for (std::int64_t e = 0; e < dI; ++e)
            dqa[std::size_t(h * dI + e)] += gw * double(krow[e]);
        }
      }
      for (std::int64_t h = 0; h < HI; ++h) dwrow[h] = T(dwa[std::size_t(h)]);
      for (std::int64_t e = 0; e < HI * dI; ++e) dq[bi * HI * dI + e] = T(dqa[std::size_t(e)]);
    }
  }
  // dk: one task per batch row (its keys are read by its own rows only).
  std::fill(dk, dk + a.B * a.Sk * dI, T(0));
#pragma omp parallel
  {
    std::vector<double> dka;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t b = 0; b < a.B; ++b) {
      dka.assign(static_cast<std::size_t>(a.Sk * dI), 0.0);
      for (std::int64_t i = 0; i < a.Sq; ++i) {
        const std::int64_t bi = b * a.Sq + i;
        const std::int32_t* r = idx + bi * K;
        const T* qrow = q + bi * HI * dI;
        const T* wrow = w + bi * HI;
        for (std::int64_t slot = 0; slot < K; ++slot) {
          const double gr = g[std::size_t(bi * K + slot)];
          if (r[slot] < 0 || gr == 0) continue;
          const T* krow = k + (b * a.Sk + r[slot]) * dI;
          double* dkrow = dka.data() + std::int64_t(r[slot]) * dI;
          for (std::int64_t h = 0; h < HI; ++h) {
            double d = 0;
            for (std::int64_t e = 0; e < dI; ++e) d += double(qrow[h * dI + e]) * double(krow[e]);
            if (d <= 0) continue;
            const double gw = gr * double(wrow[h]);
            for (std::int64_t e = 0; e < dI; ++e) dkrow[e] += gw * double(qrow[h * dI + e]);
          }
        }
      }
      for (std::int64_t e = 0; e < a.Sk * dI; ++e) dk[b * a.Sk * dI + e] = T(dka[std::size_t(e)]);
    }
  }
}

void dsa_all_causal(const IndexerShape& s, std::int32_t* idx) {
  const AttnShape& a = s.attn;
  for (std::int64_t b = 0; b < a.B; ++b)
    for (std::int64_t i = 0; i < a.Sq; ++i) {
      std::int32_t* out = idx + (b * a.Sq + i) * a.Sk;
      std::int64_t n = 0;
      for (std::int64_t j = a.key_begin(b, i); j < a.key_end(i); ++j) out[n++] = std::int32_t(j);
      std::fill(out + n, out + a.Sk, std::int32_t(-1));
    }
}

#define LAGA_INSTANTIATE(T)                                                                      \
  template void rope_halves_apply<T>(T*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, \
                                     std::int64_t, const std::int64_t*, const RopeTable&, bool); \
  template void layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, std::int64_t,     \
                                     std::int64_t, double);                                      \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,        \
                                      const T*, std::int64_t, std::int64_t);                     \
  template void dsa_index_topk<T>(const IndexerShape&, std::int32_t*, const T*, const T*,        \
                                  const T*);                                                     \
  template void dsa_index_scores<T>(const IndexerShape&, T*, const T*, const T*, const T*);      \
  template void dsa_indexer_kl<T>(const IndexerShape&, std::int64_t, const std::int32_t*,        \
                                  const T*, const T*, const T*, const T*, double*, T*, T*, T*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
