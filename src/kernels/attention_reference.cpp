#include <cmath>
#include <vector>

#include "kernels/attention.hpp"

namespace laga {

namespace {
// Element (b, s, h, i) of a (B, S, H, d) tensor.
inline std::int64_t at(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t i,
                       std::int64_t S, std::int64_t H, std::int64_t d) {
  return ((b * S + t) * H + h) * d + i;
}

// Probabilities of one query row in double, zero outside its key range
// [key_begin, key_end); false when every key is masked.
template <class T>
bool row_probs(const AttnShape& s, const T* q, const T* k, std::int64_t b, std::int64_t h,
               std::int64_t i, std::vector<double>& p, double* lse) {
  const std::int64_t hk = h / (s.Hq / s.Hk), begin = s.key_begin(b, i), end = s.key_end(i);
  p.assign(static_cast<size_t>(s.Sk), 0.0);
  if (end <= begin) {
    if (lse) *lse = 0.0;
    return false;
  }
  double mx = -INFINITY;
  for (std::int64_t j = begin; j < end; ++j) {
    double dot = 0;
    for (std::int64_t c = 0; c < s.dqk; ++c)
      dot += double(q[at(b, i, h, c, s.Sq, s.Hq, s.dqk)]) * k[at(b, j, hk, c, s.Sk, s.Hk, s.dqk)];
    p[static_cast<size_t>(j)] = dot * s.scale;
    mx = std::max(mx, p[static_cast<size_t>(j)]);
  }
  double sum = 0;
  for (std::int64_t j = begin; j < end; ++j) sum += std::exp(p[static_cast<size_t>(j)] - mx);
  for (std::int64_t j = begin; j < end; ++j)
    p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - mx) / sum;
  if (lse) *lse = mx + std::log(sum);
  return true;
}
}  // namespace

template <class T>
void attention_reference_forward(const AttnShape& s, T* o, T* lse, const T* q, const T* k,
                                 const T* v) {
  s.validate();
  std::vector<double> p;
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h) {
      const std::int64_t hk = h / (s.Hq / s.Hk);
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        double l = 0;
        row_probs(s, q, k, b, h, i, p, &l);
        if (lse) lse[(b * s.Hq + h) * s.Sq + i] = static_cast<T>(l);
        // Every sum over the row's keys only: a masked pair is left out, not
        // multiplied by p = 0 (0 * NaN is NaN; attention.hpp).
        const std::int64_t begin = s.key_begin(b, i), end = s.key_end(i);
        for (std::int64_t c = 0; c < s.dv; ++c) {
          double acc = 0;
          for (std::int64_t j = begin; j < end; ++j)
            acc += p[static_cast<size_t>(j)] * v[at(b, j, hk, c, s.Sk, s.Hk, s.dv)];
          o[at(b, i, h, c, s.Sq, s.Hq, s.dv)] = static_cast<T>(acc);
        }
      }
    }
}

template <class T>
void attention_reference_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout,
                                  const T* q, const T* k, const T* v) {
  s.validate();
  std::vector<double> gq(static_cast<size_t>(s.B * s.Sq * s.Hq * s.dqk), 0.0);
  std::vector<double> gk(static_cast<size_t>(s.B * s.Sk * s.Hk * s.dqk), 0.0);
  std::vector<double> gv(static_cast<size_t>(s.B * s.Sk * s.Hk * s.dv), 0.0);
  std::vector<double> p, dp(static_cast<size_t>(s.Sk));
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h) {
      const std::int64_t hk = h / (s.Hq / s.Hk);
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        if (!row_probs(s, q, k, b, h, i, p, nullptr)) continue;
        const std::int64_t begin = s.key_begin(b, i), end = s.key_end(i);
        double D = 0;
        for (std::int64_t j = begin; j < end; ++j) {
          double acc = 0;
          for (std::int64_t c = 0; c < s.dv; ++c)
            acc += double(dout[at(b, i, h, c, s.Sq, s.Hq, s.dv)]) *
                   v[at(b, j, hk, c, s.Sk, s.Hk, s.dv)];
          dp[static_cast<size_t>(j)] = acc;
          D += p[static_cast<size_t>(j)] * acc;
        }
        for (std::int64_t j = begin; j < end; ++j) {
          const double pj = p[static_cast<size_t>(j)];
          const double ds = pj * (dp[static_cast<size_t>(j)] - D) * s.scale;
          for (std::int64_t c = 0; c < s.dqk; ++c) {
            gq[static_cast<size_t>(at(b, i, h, c, s.Sq, s.Hq, s.dqk))] +=
                ds * k[at(b, j, hk, c, s.Sk, s.Hk, s.dqk)];
            gk[static_cast<size_t>(at(b, j, hk, c, s.Sk, s.Hk, s.dqk))] +=
                ds * q[at(b, i, h, c, s.Sq, s.Hq, s.dqk)];
          }
          for (std::int64_t c = 0; c < s.dv; ++c)
            gv[static_cast<size_t>(at(b, j, hk, c, s.Sk, s.Hk, s.dv))] +=
                pj * dout[at(b, i, h, c, s.Sq, s.Hq, s.dv)];
        }
      }
    }
  for (size_t i = 0; i < gq.size(); ++i) dq[i] = static_cast<T>(gq[i]);
  for (size_t i = 0; i < gk.size(); ++i) dk[i] = static_cast<T>(gk[i]);
  for (size_t i = 0; i < gv.size(); ++i) dv[i] = static_cast<T>(gv[i]);
}

#define LAGA_INSTANTIATE(T)                                                                       \
  template void attention_reference_forward<T>(const AttnShape&, T*, T*, const T*, const T*,      \
                                               const T*);                                         \
  template void attention_reference_backward<T>(const AttnShape&, T*, T*, T*, const T*, const T*, \
                                                const T*, const T*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
