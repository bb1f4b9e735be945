#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

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

namespace {

// C (M, N) += alpha * sum over k in [lo[m], hi[m]) of A(m, k) B(k, :), with
// A(m, k) = a[m * lda + k], or a[k * lda + m] when trans_a; lo and hi are
// non-decreasing in m and lo <= hi. A pair outside a row's range is left out,
// not multiplied by the zero probability it holds: 0 * NaN is NaN, so a dense
// product would carry a NaN key, value or query row into rows that never see
// it (another document, the causal past). Rows go in blocks of 64: their
// common range [lo[last], hi[first]) is one GEMM, each row's rest a few axpys
// (under the causal mask fewer than 64 keys); a block with no common range
// (a document starts inside it) is halved until it has one. Which GEMMs and
// axpys run depends on the ranges only, never on the values, so a row's
// result is the same bits whether or not another row holds a NaN.
template <class T>
void ranged_gemm(bool trans_a, std::int64_t M, std::int64_t N, T alpha, const T* a,
                 std::int64_t lda, const T* b, std::int64_t ldb, T* c, std::int64_t ldc,
                 const std::vector<std::int64_t>& lo, const std::vector<std::int64_t>& hi) {
  auto at = [&](std::int64_t m, std::int64_t k) {
    return trans_a ? a[k * lda + m] : a[m * lda + k];
  };
  auto axpys = [&](std::int64_t m, std::int64_t k0, std::int64_t k1) {
    T* row = c + m * ldc;
    for (std::int64_t k = k0; k < k1; ++k) {
      const T f = alpha * at(m, k);
      const T* brow = b + k * ldb;
      for (std::int64_t n = 0; n < N; ++n) row[n] += f * brow[n];
    }
  };
  auto block = [&](auto&& self, std::int64_t m0, std::int64_t m1) -> void {
    const std::int64_t k0 = lo[size_t(m1 - 1)], k1 = hi[size_t(m0)];
    // Less than half the block's span in common (the first blocks of a
    // causal triangle, where the rest would be most of the work as axpys):
    // halved too, down to 8 rows.
    const bool thin = k0 < k1 && 2 * (k1 - k0) < hi[size_t(m1 - 1)] - lo[size_t(m0)];
    if ((k0 >= k1 && m1 - m0 > 1) || (thin && m1 - m0 > 8)) {
      const std::int64_t mid = m0 + (m1 - m0) / 2;
      self(self, m0, mid);
      self(self, mid, m1);
      return;
    }
    if (k0 < k1)
      gemm<T>(trans_a, false, m1 - m0, N, k1 - k0, alpha,
              trans_a ? a + k0 * lda + m0 : a + m0 * lda + k0, lda, b + k0 * ldb, ldb, T(1),
              c + m0 * ldc, ldc);
    for (std::int64_t m = m0; m < m1; ++m) {
      const std::int64_t l = lo[size_t(m)], h = hi[size_t(m)];
      if (k0 >= k1) {  // one row, no common range: all of it
        axpys(m, l, h);
        continue;
      }
      axpys(m, l, std::min(h, k0));
      axpys(m, std::max(l, k1), h);
    }
  };
  constexpr std::int64_t kRows = 64;
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t m0 = 0; m0 < M; m0 += kRows) block(block, m0, std::min(M, m0 + kRows));
}

// Query row i of batch row b sees keys [lo[i], hi[i]); key j is seen by the
// rows [first[j], last[j]) (contiguous, as both ends grow with i).
struct EagerRanges {
  std::vector<std::int64_t> lo, hi, first, last;
  EagerRanges(const AttnShape& s, std::int64_t b)
      : lo(size_t(s.Sq)), hi(size_t(s.Sq)), first(size_t(s.Sk)), last(size_t(s.Sk)) {
    for (std::int64_t i = 0; i < s.Sq; ++i) {
      lo[size_t(i)] = s.key_begin(b, i);
      hi[size_t(i)] = std::max(lo[size_t(i)], s.key_end(i));
    }
    std::int64_t f = 0, l = 0;
    for (std::int64_t j = 0; j < s.Sk; ++j) {
      while (f < s.Sq && hi[size_t(f)] <= j) ++f;
      while (l < s.Sq && lo[size_t(l)] <= j) ++l;
      first[size_t(j)] = f;
      last[size_t(j)] = std::max(f, l);
    }
  }
};

// Rows [0, M) of c (stride ldc, n wide) set to 0.
template <class T>
void zero_rows(T* c, std::int64_t M, std::int64_t n, std::int64_t ldc) {
  for (std::int64_t m = 0; m < M; ++m) std::fill_n(c + m * ldc, n, T(0));
}

}  // namespace

template <class T>
void attention_eager_forward(const AttnShape& s, T* o, T* probs, const T* q, const T* k, const T* v,
                             T* lse) {
  s.validate();
  const std::int64_t group = s.Hq / s.Hk;
  for (std::int64_t b = 0; b < s.B; ++b) {
    const EagerRanges ranges(s, b);
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
        T* row_lse = lse ? lse + (b * s.Hq + h) * s.Sq + i : nullptr;
        if (end <= begin) {
          std::fill(row, row + s.Sk, T(0));
          if (row_lse) *row_lse = T(0);  // a fully masked row's convention
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
        if (row_lse) *row_lse = mx + std::log(sum);
        // Masked probabilities are exact zeros: backward needs no mask.
        std::fill(row, row + begin, T(0));
        std::fill(row + end, row + s.Sk, T(0));
      }
      T* oh = o + b * s.Sq * s.Hq * s.dv + h * s.dv;
      zero_rows(oh, s.Sq, s.dv, s.Hq * s.dv);
      ranged_gemm<T>(false, s.Sq, s.dv, T(1), p, s.Sk, vh, s.Hk * s.dv, oh, s.Hq * s.dv, ranges.lo,
                     ranges.hi);
    }
  }
}

template <class T>
void attention_eager_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q,
                              const T* k, const T* v, const T* probs, T* dp, const T* delta) {
  s.validate();
  const std::int64_t group = s.Hq / s.Hk;
  std::memset(dk, 0, sizeof(T) * static_cast<size_t>(s.B * s.Sk * s.Hk * s.dqk));
  std::memset(dv, 0, sizeof(T) * static_cast<size_t>(s.B * s.Sk * s.Hk * s.dv));
  for (std::int64_t b = 0; b < s.B; ++b) {
    const EagerRanges ranges(s, b);
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
        // Over the row's keys only (ranged_gemm says why); ds is not read
        // outside them.
        const T* prow = p + i * s.Sk;
        T* drow = dp + i * s.Sk;
        const std::int64_t lo = ranges.lo[size_t(i)], hi = ranges.hi[size_t(i)];
        T D = 0;
        if (delta)
          D = delta[(b * s.Hq + h) * s.Sq + i];
        else
          for (std::int64_t j = lo; j < hi; ++j) D += prow[j] * drow[j];
        for (std::int64_t j = lo; j < hi; ++j) drow[j] = prow[j] * (drow[j] - D);
      }
      const T sc = static_cast<T>(s.scale);
      T* dqh = dq + b * s.Sq * s.Hq * s.dqk + h * s.dqk;
      zero_rows(dqh, s.Sq, s.dqk, s.Hq * s.dqk);
      ranged_gemm<T>(false, s.Sq, s.dqk, sc, dp, s.Sk, kh, s.Hk * s.dqk, dqh, s.Hq * s.dqk,
                     ranges.lo, ranges.hi);
      ranged_gemm<T>(true, s.Sk, s.dqk, sc, dp, s.Sk, qh, s.Hq * s.dqk,
                     dk + b * s.Sk * s.Hk * s.dqk + hk * s.dqk, s.Hk * s.dqk, ranges.first,
                     ranges.last);
      ranged_gemm<T>(true, s.Sk, s.dv, T(1), p, s.Sk, doh, s.Hq * s.dv,
                     dv + b * s.Sk * s.Hk * s.dv + hk * s.dv, s.Hk * s.dv, ranges.first,
                     ranges.last);
    }
  }
}

template void attention_eager_forward<float>(const AttnShape&, float*, float*, const float*,
                                             const float*, const float*, float*);
template void attention_eager_forward<double>(const AttnShape&, double*, double*, const double*,
                                              const double*, const double*, double*);
template void attention_eager_backward<float>(const AttnShape&, float*, float*, float*,
                                              const float*, const float*, const float*,
                                              const float*, const float*, float*, const float*);
template void attention_eager_backward<double>(const AttnShape&, double*, double*, double*,
                                               const double*, const double*, const double*,
                                               const double*, const double*, double*,
                                               const double*);

}  // namespace laga
