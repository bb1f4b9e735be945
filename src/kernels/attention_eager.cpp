#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.hpp"
#include "kernels/attention.hpp"
#include "kernels/gemm.hpp"

namespace laga {

double AttnShape::useful_flops_forward() const {
  double pairs = 0;
  if (doc_start) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < Sq; ++i)
        pairs += static_cast<double>(std::max<std::int64_t>(key_end(i) - key_begin(b, i), 0));
  } else if (!causal) {
    pairs = static_cast<double>(Sq) * static_cast<double>(Sk);
  } else {
    // Without documents every batch row has the same pairs, in closed form
    // (a count-only plan at S = 10^11 must not walk the rows): row i sees
    // key_end(i) = i + Sk - Sq + 1 keys, never more than Sk (i < Sq), and
    // none while that is <= 0, i.e. for i < i0 = max(0, Sq - Sk). The sum of
    // that arithmetic series over i in [i0, Sq) is n (first + last) / 2.
    const std::int64_t i0 = std::max<std::int64_t>(0, Sq - Sk);
    const double n = static_cast<double>(Sq - i0);
    pairs = n * (static_cast<double>(key_end(i0)) + static_cast<double>(key_end(Sq - 1))) / 2;
  }
  const double copies = static_cast<double>(doc_start ? Hq : B * Hq);
  return 2.0 * copies * pairs * static_cast<double>(dqk + dv);
}

void AttnShape::validate() const {
  LAGA_CHECK(B >= 0 && Sq >= 0 && Sk >= 0, "attention: negative batch or sequence extent (B=", B,
             ", Sq=", Sq, ", Sk=", Sk, ")");
  LAGA_CHECK(Hq > 0 && Hk > 0 && Hq % Hk == 0, "attention: query heads (", Hq,
             ") must be a positive multiple of key/value heads (", Hk, ")");
  LAGA_CHECK(dqk > 0 && dv > 0, "attention: head dims must be positive (dqk=", dqk, ", dv=", dv,
             ")");
  if (doc_start == nullptr) return;
  LAGA_CHECK(causal,
             "attention: doc_start (packed documents) needs the causal mask; set causal = true or "
             "leave doc_start null");
  // Documents are contiguous runs of tokens: each token starts one (its own
  // index) or continues the one of the token before it. The kernels rely on
  // that (key_begin non-decreasing), so a bad mask is refused, not guessed at.
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t* row = doc_start + b * Sk;
    for (std::int64_t t = 0; t < Sk; ++t)
      LAGA_CHECK(row[t] == t || (t > 0 && row[t] == row[t - 1]), "attention: doc_start[b=", b,
                 ", t=", t, "] = ", row[t], " must be ", t, " (a document starts there)",
                 t > 0 ? cat(" or ", row[t - 1], " (the document of token ", t - 1, " goes on)")
                       : std::string(" (the first token starts a document)"),
                 "; doc_start[b, t] is the index of the first token of token t's document");
  }
}

template <class T>
void attention_eager_forward(const AttnShape& s, T* o, T* probs, const T* q, const T* k,
                             const T* v) {
  s.validate();
  const std::int64_t group = s.Hq / s.Hk;
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h) {
      const std::int64_t hk = h / group;
      T* p = probs + (b * s.Hq + h) * s.Sq * s.Sk;
      const T* qh = q + b * s.Sq * s.Hq * s.dqk + h * s.dqk;
      const T* kh = k + b * s.Sk * s.Hk * s.dqk + hk * s.dqk;
      const T* vh = v + b * s.Sk * s.Hk * s.dv + hk * s.dv;
      gemm<T>(false, true, s.Sq, s.Sk, s.dqk, static_cast<T>(s.scale), qh, s.Hq * s.dqk, kh,
              s.Hk * s.dqk, T(0), p, s.Sk);
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        T* row = p + i * s.Sk;
        const std::int64_t begin = s.key_begin(b, i), end = s.key_end(i);
        if (end <= begin) {
          std::fill(row, row + s.Sk, T(0));
          continue;
        }
        T mx = -std::numeric_limits<T>::infinity();
        for (std::int64_t j = begin; j < end; ++j) mx = std::max(mx, row[j]);
        T sum = 0;
        for (std::int64_t j = begin; j < end; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const T inv = T(1) / sum;
        for (std::int64_t j = begin; j < end; ++j) row[j] *= inv;
        // Masked probabilities are exact zeros: backward needs no mask.
        std::fill(row, row + begin, T(0));
        std::fill(row + end, row + s.Sk, T(0));
      }
      gemm<T>(false, false, s.Sq, s.dv, s.Sk, T(1), p, s.Sk, vh, s.Hk * s.dv, T(0),
              o + b * s.Sq * s.Hq * s.dv + h * s.dv, s.Hq * s.dv);
    }
}

template <class T>
void attention_eager_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q,
                              const T* k, const T* v, const T* probs, T* dp) {
  s.validate();
  const std::int64_t group = s.Hq / s.Hk;
  std::memset(dk, 0, sizeof(T) * static_cast<size_t>(s.B * s.Sk * s.Hk * s.dqk));
  std::memset(dv, 0, sizeof(T) * static_cast<size_t>(s.B * s.Sk * s.Hk * s.dv));
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h) {
      const std::int64_t hk = h / group;
      const T* p = probs + (b * s.Hq + h) * s.Sq * s.Sk;
      const T* qh = q + b * s.Sq * s.Hq * s.dqk + h * s.dqk;
      const T* kh = k + b * s.Sk * s.Hk * s.dqk + hk * s.dqk;
      const T* vh = v + b * s.Sk * s.Hk * s.dv + hk * s.dv;
      const T* doh = dout + b * s.Sq * s.Hq * s.dv + h * s.dv;
      gemm<T>(false, true, s.Sq, s.Sk, s.dv, T(1), doh, s.Hq * s.dv, vh, s.Hk * s.dv, T(0), dp,
              s.Sk);
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        const T* prow = p + i * s.Sk;
        T* drow = dp + i * s.Sk;
        T D = 0;
        for (std::int64_t j = 0; j < s.Sk; ++j) D += prow[j] * drow[j];
        for (std::int64_t j = 0; j < s.Sk; ++j) drow[j] = prow[j] * (drow[j] - D);
      }
      gemm<T>(false, false, s.Sq, s.dqk, s.Sk, static_cast<T>(s.scale), dp, s.Sk, kh, s.Hk * s.dqk,
              T(0), dq + b * s.Sq * s.Hq * s.dqk + h * s.dqk, s.Hq * s.dqk);
      gemm<T>(true, false, s.Sk, s.dqk, s.Sq, static_cast<T>(s.scale), dp, s.Sk, qh, s.Hq * s.dqk,
              T(1), dk + b * s.Sk * s.Hk * s.dqk + hk * s.dqk, s.Hk * s.dqk);
      gemm<T>(true, false, s.Sk, s.dv, s.Sq, T(1), p, s.Sk, doh, s.Hq * s.dv, T(1),
              dv + b * s.Sk * s.Hk * s.dv + hk * s.dv, s.Hk * s.dv);
    }
}

template void attention_eager_forward<float>(const AttnShape&, float*, float*, const float*,
                                             const float*, const float*);
template void attention_eager_forward<double>(const AttnShape&, double*, double*, const double*,
                                              const double*, const double*);
template void attention_eager_backward<float>(const AttnShape&, float*, float*, float*,
                                              const float*, const float*, const float*,
                                              const float*, const float*, float*);
template void attention_eager_backward<double>(const AttnShape&, double*, double*, double*,
                                               const double*, const double*, const double*,
                                               const double*, const double*, double*);

}  // namespace laga
