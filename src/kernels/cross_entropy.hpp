// Cross-entropy of logits against integer targets, fused with the
// log-softmax so that no (N, V) probability tensor is kept: forward saves one
// log-sum-exp per row, backward rebuilds softmax from the logits and it.
//
//   lse_i   = m_i + log sum_v exp(logits_iv - m_i),  m_i = max_v logits_iv
//   loss_i  = lse_i - logits_i,t_i
//   dlogits = scale * (exp(logits - lse) - onehot(t))
//
// Subtracting the row max keeps exp() in range for any finite logits (the
// stable form); sums run in double so a row of V = 10^5 loses nothing.
//
// A row whose target is kIgnoreTarget (-1) does not count: loss_i = 0 and
// dlogits_i = 0 (packed training ignores the targets that cross a document
// boundary; the caller leaves them out of the mean's token count too).
#pragma once

#include <cstdint>

namespace laga {

inline constexpr std::int32_t kIgnoreTarget = -1;

// loss (N) per row, lse (N) saved for backward (in double even for float
// logits: rounded to float, an lse of 1e4 would be off by 5e-4 and so would
// every probability rebuilt from it); logits (N, V) row-major;
// targets (N) in [0, V) or kIgnoreTarget (any other id throws laga::Error
// naming it).
template <class T>
void cross_entropy_forward(T* loss, double* lse, const T* logits, const std::int32_t* targets,
                           std::int64_t N, std::int64_t V);

// dlogits (N, V) = scale * (softmax(logits) - onehot(targets)); may alias
// logits (each row is read before it is written). `scale` is dL/dloss_i, the
// same for every row (1 / total tokens for a mean).
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const double* lse,
                            const std::int32_t* targets, double scale, std::int64_t N,
                            std::int64_t V);

// The same by the textbook formula in double (softmax, then -log p_t): the
// reference the fused kernel is tested against.
template <class T>
void cross_entropy_forward_reference(T* loss, const T* logits, const std::int32_t* targets,
                                     std::int64_t N, std::int64_t V);
template <class T>
void cross_entropy_backward_reference(T* dlogits, const T* logits, const std::int32_t* targets,
                                      double scale, std::int64_t N, std::int64_t V);

}  // namespace laga
