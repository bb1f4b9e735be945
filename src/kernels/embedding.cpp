#include "kernels/embedding.hpp"

#include <cstring>

#include "core/error.hpp"

namespace laga {

namespace {
void check_ids(const std::int32_t* ids, std::int64_t N, std::int64_t V) {
  for (std::int64_t i = 0; i < N; ++i)
    LAGA_CHECK(ids[i] >= 0 && ids[i] < V, "embedding: token id ", ids[i], " at position ", i,
               " is outside the vocabulary [0, ", V, "); raise --vocab or fix the data");
}
}  // namespace

template <class T>
void embedding_forward(T* out, const std::int32_t* ids, const T* table, std::int64_t N,
                       std::int64_t V, std::int64_t D) {
  check_ids(ids, N, V);
  for (std::int64_t i = 0; i < N; ++i)
    std::memcpy(out + i * D, table + static_cast<std::int64_t>(ids[i]) * D,
                sizeof(T) * static_cast<size_t>(D));
}

template <class T>
void embedding_backward(T* dtable, const T* dout, const std::int32_t* ids, std::int64_t N,
                        std::int64_t V, std::int64_t D) {
  check_ids(ids, N, V);
  // Parallel over the D columns, not the N rows: every thread walks all rows
  // in order, so repeated ids never race and the summation order is fixed.
#pragma omp parallel for schedule(static)
  for (std::int64_t d = 0; d < D; ++d)
    for (std::int64_t i = 0; i < N; ++i)
      dtable[static_cast<std::int64_t>(ids[i]) * D + d] += dout[i * D + d];
}

#define LAGA_INSTANTIATE(T)                                                            \
  template void embedding_forward<T>(T*, const std::int32_t*, const T*, std::int64_t,  \
                                     std::int64_t, std::int64_t);                      \
  template void embedding_backward<T>(T*, const T*, const std::int32_t*, std::int64_t, \
                                      std::int64_t, std::int64_t);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
