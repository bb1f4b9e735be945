#include "kernels/lse_merge.hpp"

#include <algorithm>
#include <cmath>

namespace laga {

// The max-shifted form: exp of a difference <= 0 never overflows.
template <class T>
void lse_merge(const LseMergeShape& s, T* o, T* lse, const T* o_p, const T* lse_p) {
  for (std::int64_t bb = 0; bb < s.Bc; ++bb) {
    const std::int64_t b = s.b0 + bb;
    for (std::int64_t h = 0; h < s.H; ++h)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        T& l = lse[(b * s.H + h) * s.L + s.q_row + i];
        const T lp = lse_p[(bb * s.H + h) * s.Sq + i];
        T* orow = o + ((b * s.L + s.q_row + i) * s.H + h) * s.dv;
        const T* prow = o_p + ((bb * s.Sq + i) * s.H + h) * s.dv;
        if (s.first) {
          l = lp;
          std::copy(prow, prow + s.dv, orow);
          continue;
        }
        const T m = std::max(l, lp);
        const T merged = m + std::log(std::exp(l - m) + std::exp(lp - m));
        const T a = std::exp(l - merged), w = std::exp(lp - merged);
        for (std::int64_t e = 0; e < s.dv; ++e) orow[e] = a * orow[e] + w * prow[e];
        l = merged;
      }
  }
}

template <class T>
void lse_merge_reference(const LseMergeShape& s, T* o, T* lse, const T* o_p, const T* lse_p) {
  for (std::int64_t bb = 0; bb < s.Bc; ++bb)
    for (std::int64_t h = 0; h < s.H; ++h)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        const std::int64_t b = s.b0 + bb;
        T& l = lse[(b * s.H + h) * s.L + s.q_row + i];
        const double lp = double(lse_p[(bb * s.H + h) * s.Sq + i]);
        T* orow = o + ((b * s.L + s.q_row + i) * s.H + h) * s.dv;
        const T* prow = o_p + ((bb * s.Sq + i) * s.H + h) * s.dv;
        const double lo = s.first ? -INFINITY : double(l);
        const double merged = s.first ? lp : std::log(std::exp(lo) + std::exp(lp));
        for (std::int64_t e = 0; e < s.dv; ++e)
          orow[e] = T((s.first ? 0.0 : std::exp(lo - merged) * double(orow[e])) +
                      std::exp(lp - merged) * double(prow[e]));
        l = T(merged);
      }
}

template void lse_merge<float>(const LseMergeShape&, float*, float*, const float*, const float*);
template void lse_merge<double>(const LseMergeShape&, double*, double*, const double*,
                                const double*);
template void lse_merge_reference<float>(const LseMergeShape&, float*, float*, const float*,
                                         const float*);
template void lse_merge_reference<double>(const LseMergeShape&, double*, double*, const double*,
                                          const double*);

}  // namespace laga
