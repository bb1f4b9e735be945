// Non-finite values (NaN, +-inf) in an array: how many, where the first is,
// and the one sentence that reports them. Every reader that refuses
// non-finite data (`laga forward`'s weights and inputs, a training
// checkpoint's tensors, a training step's gradients) counts and words them
// here, so the messages agree (docs/reliability.md, "Non-finite values").
#pragma once

#include <cstdint>
#include <string>

namespace laga {

struct NonFinite {
  std::int64_t count = 0, first = -1;  // first: flat index of the first one, -1 when none
};

// x (n): every element is looked at (no early exit: the count is reported).
template <class T>
NonFinite count_nonfinite(const T* x, std::int64_t n);

// "<what> holds 3 non-finite values (NaN or inf; the first at flat index 5
// of 2304)"; `n` is the tensor's element count.
std::string describe_nonfinite(const std::string& what, const NonFinite& nf, std::int64_t n);

}  // namespace laga
