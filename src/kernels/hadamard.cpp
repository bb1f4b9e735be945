#include "kernels/hadamard.hpp"

#include <cmath>
#include <vector>

#include "core/error.hpp"

namespace laga {

template <class T>
void hadamard_rotate(T* x, std::int64_t rows, std::int64_t d) {
  LAGA_CHECK(d > 0 && (d & (d - 1)) == 0, "hadamard_rotate: the row width ", d,
             " must be a power of two (DeepSeek's rotate_activation runs on index_head_dim "
             "128)");
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> r(static_cast<std::size_t>(d));
  for (std::int64_t row = 0; row < rows; ++row) {
    T* xr = x + row * d;
    for (std::int64_t e = 0; e < d; ++e) r[std::size_t(e)] = double(xr[e]);
    // Butterflies of span h: (a, b) -> (a + b, a - b), the Sylvester order.
    for (std::int64_t h = 1; h < d; h *= 2)
      for (std::int64_t i = 0; i < d; i += 2 * h)
        for (std::int64_t j = i; j < i + h; ++j) {
          const double a = r[std::size_t(j)], b = r[std::size_t(j + h)];
          r[std::size_t(j)] = a + b, r[std::size_t(j + h)] = a - b;
        }
    for (std::int64_t e = 0; e < d; ++e) xr[e] = T(r[std::size_t(e)] * scale);
  }
}

template void hadamard_rotate<float>(float*, std::int64_t, std::int64_t);
template void hadamard_rotate<double>(double*, std::int64_t, std::int64_t);

}  // namespace laga
