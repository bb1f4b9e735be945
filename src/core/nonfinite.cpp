#include "core/nonfinite.hpp"

#include <cmath>

#include "core/error.hpp"

namespace laga {

template <class T>
NonFinite count_nonfinite(const T* x, std::int64_t n) {
  NonFinite r;
  for (std::int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) {
      if (r.count++ == 0) r.first = i;
    }
  return r;
}
template NonFinite count_nonfinite<float>(const float*, std::int64_t);
template NonFinite count_nonfinite<double>(const double*, std::int64_t);

std::string describe_nonfinite(const std::string& what, const NonFinite& nf, std::int64_t n) {
  return cat(what, " holds ", nf.count, " non-finite value", nf.count == 1 ? "" : "s",
             " (NaN or inf; the first at flat index ", nf.first, " of ", n, ")");
}

}  // namespace laga
