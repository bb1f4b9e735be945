#include "kernels/attention_sparse.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/bf16.hpp"
#include "core/error.hpp"

namespace laga {

void SparseAttnShape::validate() const {
  attn.validate();
  LAGA_CHECK(K > 0, "sparse attention: K (slots per query row, index_topk) must be positive, got ",
             K);
  LAGA_CHECK(K <= std::numeric_limits<std::int32_t>::max() &&
                 attn.Sk <= std::numeric_limits<std::int32_t>::max(),
             "sparse attention: Sk ", attn.Sk, " or K ", K,
             " beyond int32 (the indices are int32, as DeepSeek's topk_indices in its kernels)");
}

void sparse_attention_check_indices(const SparseAttnShape& s, const std::int32_t* idx) {
  const std::int64_t Sk = s.attn.Sk;
  std::vector<std::int64_t> seen(static_cast<std::size_t>(Sk), -1);
  for (std::int64_t b = 0; b < s.attn.B; ++b)
    for (std::int64_t i = 0; i < s.attn.Sq; ++i) {
      const std::int64_t row = b * s.attn.Sq + i;
      const std::int32_t* r = idx + row * s.K;
      for (std::int64_t slot = 0; slot < s.K; ++slot) {
        const std::int32_t j = r[slot];
        if (j == -1) continue;
        LAGA_CHECK(j >= 0 && j < Sk, "sparse attention: idx[b=", b, ", i=", i, ", slot=", slot,
                   "] = ", j, " is not a key position in [0, ", Sk, ") nor -1 (an empty slot)");
        LAGA_CHECK(seen[std::size_t(j)] != row, "sparse attention: idx[b=", b, ", i=", i,
                   "] lists key ", j, " twice (slot ", slot,
                   "); a selection names each key at most once");
        seen[std::size_t(j)] = row;
      }
    }
}

namespace {

// An operand's value in the sums: bf16 widened exactly (core/bf16.hpp), so
// that the bf16 entry points run the fp32 kernel's arithmetic on the same
// values, bit for bit.
inline double val(double x) {
  return x;
}
inline double val(float x) {
  return double(x);
}
inline double val(bf16 x) {
  return double(to_float(x));
}

// The row's scaled scores of head h over its slots in s_row (empty slots
// -inf), and their maximum (-inf when the row has no slot).
template <class In>
double row_scores(const SparseAttnShape& s, const In* qrow, const In* kb, std::int64_t g,
                  const std::int32_t* r, double* s_row) {
  const AttnShape& a = s.attn;
  double m = -std::numeric_limits<double>::infinity();
  for (std::int64_t slot = 0; slot < s.K; ++slot) {
    const std::int32_t j = r[slot];
    if (j < 0) {
      s_row[slot] = -std::numeric_limits<double>::infinity();
      continue;
    }
    const In* krow = kb + (std::int64_t(j) * a.Hk + g) * a.dqk;
    double d = 0;
    for (std::int64_t e = 0; e < a.dqk; ++e) d += val(qrow[e]) * val(krow[e]);
    s_row[slot] = d * a.scale;
    m = std::max(m, s_row[slot]);
  }
  return m;
}

// The kernels over operands of type In (double, float, bf16) with outputs
// of type T (double, float); the public entry points below pick the pair.
template <class T, class In>
void forward_impl(const SparseAttnShape& s, T* o, T* lse, const In* q, const In* k, const In* v,
                  const std::int32_t* idx) {
  const AttnShape& a = s.attn;
  const std::int64_t group = a.Hq / a.Hk;
#pragma omp parallel
  {
    std::vector<double> sc(static_cast<std::size_t>(s.K)), acc(static_cast<std::size_t>(a.dv));
#pragma omp for schedule(static)
    for (std::int64_t bi = 0; bi < a.B * a.Sq; ++bi) {
      const std::int64_t b = bi / a.Sq, i = bi % a.Sq;
      const std::int32_t* r = idx + bi * s.K;
      const In* kb = k + b * a.Sk * a.Hk * a.dqk;
      const In* vb = v + b * a.Sk * a.Hk * a.dv;
      for (std::int64_t h = 0; h < a.Hq; ++h) {
        const std::int64_t g = h / group;
        const double m = row_scores(s, q + (bi * a.Hq + h) * a.dqk, kb, g, r, sc.data());
        T* orow = o + (bi * a.Hq + h) * a.dv;
        T& l = lse[(b * a.Hq + h) * a.Sq + i];
        if (m == -std::numeric_limits<double>::infinity()) {  // no slot: o = 0, lse = 0
          std::fill(orow, orow + a.dv, T(0));
          l = T(0);
          continue;
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double sum = 0;
        for (std::int64_t slot = 0; slot < s.K; ++slot) {
          if (r[slot] < 0) continue;
          const double p = std::exp(sc[std::size_t(slot)] - m);
          sum += p;
          const In* vrow = vb + (std::int64_t(r[slot]) * a.Hk + g) * a.dv;
          for (std::int64_t e = 0; e < a.dv; ++e) acc[std::size_t(e)] += p * val(vrow[e]);
        }
        for (std::int64_t e = 0; e < a.dv; ++e) orow[e] = T(acc[std::size_t(e)] / sum);
        l = T(m + std::log(sum));
      }
    }
  }
}

template <class T, class In>
void backward_impl(const SparseAttnShape& s, T* dq, T* dk, T* dv, const In* dout, const In* q,
                   const In* k, const In* v, const T* o, const T* lse, const std::int32_t* idx) {
  const AttnShape& a = s.attn;
  const std::int64_t group = a.Hq / a.Hk;
  std::fill(dk, dk + a.B * a.Sk * a.Hk * a.dqk, T(0));
  std::fill(dv, dv + a.B * a.Sk * a.Hk * a.dv, T(0));
  // One task per (batch row, key/value head): the keys it scatters into
  // (dk, dv of that head) and the query heads it reads are its own, so no
  // two tasks write one element.
#pragma omp parallel
  {
    std::vector<double> sc(static_cast<std::size_t>(s.K)), dqa(static_cast<std::size_t>(a.dqk));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t bg = 0; bg < a.B * a.Hk; ++bg) {
      const std::int64_t b = bg / a.Hk, g = bg % a.Hk;
      const In* kb = k + b * a.Sk * a.Hk * a.dqk;
      const In* vb = v + b * a.Sk * a.Hk * a.dv;
      T* dkb = dk + b * a.Sk * a.Hk * a.dqk;
      T* dvb = dv + b * a.Sk * a.Hk * a.dv;
      for (std::int64_t i = 0; i < a.Sq; ++i) {
        const std::int64_t bi = b * a.Sq + i;
        const std::int32_t* r = idx + bi * s.K;
        for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
          const In* qrow = q + (bi * a.Hq + h) * a.dqk;
          const In* dorow = dout + (bi * a.Hq + h) * a.dv;
          const T* orow = o + (bi * a.Hq + h) * a.dv;
          T* dqrow = dq + (bi * a.Hq + h) * a.dqk;
          std::fill(dqa.begin(), dqa.end(), 0.0);
          const double m = row_scores(s, qrow, kb, g, r, sc.data());
          if (m != -std::numeric_limits<double>::infinity()) {
            const double l = double(lse[(b * a.Hq + h) * a.Sq + i]);
            double D = 0;
            for (std::int64_t e = 0; e < a.dv; ++e) D += val(dorow[e]) * double(orow[e]);
            for (std::int64_t slot = 0; slot < s.K; ++slot) {
              const std::int32_t j = r[slot];
              if (j < 0) continue;
              const double p = std::exp(sc[std::size_t(slot)] - l);
              const In* vrow = vb + (std::int64_t(j) * a.Hk + g) * a.dv;
              T* dvrow = dvb + (std::int64_t(j) * a.Hk + g) * a.dv;
              double dp = 0;
              for (std::int64_t e = 0; e < a.dv; ++e) {
                dp += val(dorow[e]) * val(vrow[e]);
                dvrow[e] += T(p * val(dorow[e]));
              }
              const double ds = p * (dp - D) * a.scale;
              const In* krow = kb + (std::int64_t(j) * a.Hk + g) * a.dqk;
              T* dkrow = dkb + (std::int64_t(j) * a.Hk + g) * a.dqk;
              for (std::int64_t e = 0; e < a.dqk; ++e) {
                dqa[std::size_t(e)] += ds * val(krow[e]);
                dkrow[e] += T(ds * val(qrow[e]));
              }
            }
          }
          for (std::int64_t e = 0; e < a.dqk; ++e) dqrow[e] = T(dqa[std::size_t(e)]);
        }
      }
    }
  }
}

template <class T, class In>
void head_summed_probs_impl(const SparseAttnShape& s, T* p, const In* q, const In* k, const T* lse,
                            const std::int32_t* idx) {
  const AttnShape& a = s.attn;
  const std::int64_t group = a.Hq / a.Hk;
#pragma omp parallel
  {
    std::vector<double> sc(static_cast<std::size_t>(s.K)), acc(static_cast<std::size_t>(s.K));
#pragma omp for schedule(static)
    for (std::int64_t bi = 0; bi < a.B * a.Sq; ++bi) {
      const std::int64_t b = bi / a.Sq, i = bi % a.Sq;
      const std::int32_t* r = idx + bi * s.K;
      const In* kb = k + b * a.Sk * a.Hk * a.dqk;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t h = 0; h < a.Hq; ++h) {
        const std::int64_t g = h / group;
        const double m = row_scores(s, q + (bi * a.Hq + h) * a.dqk, kb, g, r, sc.data());
        if (m == -std::numeric_limits<double>::infinity()) continue;
        const double l = double(lse[(b * a.Hq + h) * a.Sq + i]);
        for (std::int64_t slot = 0; slot < s.K; ++slot)
          if (r[slot] >= 0) acc[std::size_t(slot)] += std::exp(sc[std::size_t(slot)] - l);
      }
      for (std::int64_t slot = 0; slot < s.K; ++slot)
        p[bi * s.K + slot] = T(acc[std::size_t(slot)] / double(a.Hq));
    }
  }
}

}  // namespace

template <class T>
void sparse_attention_forward(const SparseAttnShape& s, T* o, T* lse, const T* q, const T* k,
                              const T* v, const std::int32_t* idx) {
  forward_impl(s, o, lse, q, k, v, idx);
}
template <class T>
void sparse_attention_backward(const SparseAttnShape& s, T* dq, T* dk, T* dv, const T* dout,
                               const T* q, const T* k, const T* v, const T* o, const T* lse,
                               const std::int32_t* idx) {
  backward_impl(s, dq, dk, dv, dout, q, k, v, o, lse, idx);
}
template <class T>
void sparse_attention_head_summed_probs(const SparseAttnShape& s, T* p, const T* q, const T* k,
                                        const T* lse, const std::int32_t* idx) {
  head_summed_probs_impl(s, p, q, k, lse, idx);
}

void sparse_attention_forward_bf16(const SparseAttnShape& s, float* o, float* lse, const bf16* q,
                                   const bf16* k, const bf16* v, const std::int32_t* idx) {
  forward_impl(s, o, lse, q, k, v, idx);
}
void sparse_attention_backward_bf16(const SparseAttnShape& s, float* dq, float* dk, float* dv,
                                    const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                                    const float* o, const float* lse, const std::int32_t* idx) {
  backward_impl(s, dq, dk, dv, dout, q, k, v, o, lse, idx);
}
void sparse_attention_head_summed_probs_bf16(const SparseAttnShape& s, float* p, const bf16* q,
                                             const bf16* k, const float* lse,
                                             const std::int32_t* idx) {
  head_summed_probs_impl(s, p, q, k, lse, idx);
}

#define LAGA_INSTANTIATE(T)                                                                     \
  template void sparse_attention_forward<T>(const SparseAttnShape&, T*, T*, const T*, const T*, \
                                            const T*, const std::int32_t*);                     \
  template void sparse_attention_backward<T>(const SparseAttnShape&, T*, T*, T*, const T*,      \
                                             const T*, const T*, const T*, const T*, const T*,  \
                                             const std::int32_t*);                              \
  template void sparse_attention_head_summed_probs<T>(const SparseAttnShape&, T*, const T*,     \
                                                      const T*, const T*, const std::int32_t*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
