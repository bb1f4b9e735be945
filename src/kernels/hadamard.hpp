// DeepSeek's rotate_activation (DeepSeek-V3.2-Exp inference/model.py: the
// fast_hadamard_transform package's hadamard_transform(x, scale=d^-1/2)),
// applied to the indexer's q and k before the fp8 quantization (docs/forms.md,
// "The fp8 indexer"): y = H_d x / sqrt(d) over each row of d values, H_d the
// Sylvester-ordered Hadamard matrix (H_1 = [1], H_2n = [[H_n, H_n],
// [H_n, -H_n]]). Orthogonal and symmetric: applying it twice is the
// identity, and q.k is unchanged by rotating both; it spreads an outlier over
// the row so the block's fp8 scale fits the rest better.
#pragma once

#include <cstdint>

namespace laga {

// In place over `rows` rows of d values (d a power of two; throws otherwise):
// the fast Walsh-Hadamard transform (d log2 d additions a row), in double,
// then the d^-1/2 scale.
template <class T>
void hadamard_rotate(T* x, std::int64_t rows, std::int64_t d);

}  // namespace laga
