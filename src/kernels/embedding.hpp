// Token embedding lookup: out[i] = table[ids[i]], and its backward, a
// scatter-add of the rows of dout into the table's gradient.
#pragma once

#include <cstdint>

namespace laga {

// out (N, D) = rows ids (N) of table (V, D). An id outside [0, V) throws
// laga::Error naming the id, its position and V.
template <class T>
void embedding_forward(T* out, const std::int32_t* ids, const T* table, std::int64_t N,
                       std::int64_t V, std::int64_t D);

// dtable (V, D) += scatter of dout (N, D) to rows ids (N). Rows are added in
// the order i = 0..N-1, so a repeated id sums in the same order on every run
// (the result is deterministic, not just close).
template <class T>
void embedding_backward(T* dtable, const T* dout, const std::int32_t* ids, std::int64_t N,
                        std::int64_t V, std::int64_t D);

}  // namespace laga
