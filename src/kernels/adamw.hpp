// AdamW (Loshchilov & Hutter, decoupled weight decay), gradient clipping by
// global norm, and the learning-rate schedule (linear warm-up, then constant
// or cosine decay).
//
// One step on a tensor, t = 1, 2, ... the step number:
//   m = b1 m + (1 - b1) g
//   v = b2 v + (1 - b2) g^2
//   p -= lr * ( (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * p )
// Weight decay is applied to the parameter directly (decoupled), scaled by lr
// as in PyTorch's AdamW; wd = 0 is Adam. The caller chooses which tensors get
// wd (the model decays linear weights only, not norms or embeddings).
#pragma once

#include <cstdint>

namespace laga {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// p, m, v updated in place from g (n elements each); `step` >= 1. The
// element-wise update has no reduction, so it is bit-identical for any thread
// count.
template <class T>
void adamw_step(T* p, T* m, T* v, const T* g, std::int64_t n, std::int64_t step,
                const AdamWHyper& h);

// The same in double by the formula above, for tests.
template <class T>
void adamw_step_reference(T* p, T* m, T* v, const T* g, std::int64_t n, std::int64_t step,
                          const AdamWHyper& h);

// sum g^2 over n elements in double, sequentially (a fixed order, so every
// rank and backend gets the same bits).
template <class T>
double sum_squares(const T* g, std::int64_t n);

// The factor that clips a gradient of global norm `norm` to `max_norm`
// (torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6) when that is < 1,
// else 1). max_norm <= 0 disables clipping (factor 1).
double clip_factor(double norm, double max_norm);

// Learning rate at `step` (1-based) of `total`: linear warm-up from lr/warmup
// to lr over the first `warmup` steps, then constant, or cosine from lr down
// to min_lr at step `total`.
struct LrSchedule {
  double lr = 1e-3;
  std::int64_t warmup = 0;
  std::int64_t total = 1;
  bool cosine = false;
  double min_lr = 0.0;
  double at(std::int64_t step) const;
};

}  // namespace laga
