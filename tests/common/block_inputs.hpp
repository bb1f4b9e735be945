// The block tests' inputs: parameters, x and dout of one MLA block, drawn
// from fixed seeds so every test file (and every form within one) sees the
// same values. x, dout are (B, S, D).
#pragma once

#include <cstdint>

#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "mla/config.hpp"
#include "mla/params.hpp"

namespace laga::test {

template <class T>
struct BlockInputs {
  MlaParams<T> w;
  Tensor<T> x, dout;  // (B, S, D)
};

inline BlockInputs<float> make_inputs(const MlaConfig& cfg, std::int64_t B, std::int64_t S) {
  BlockInputs<float> in;
  in.w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
  init_params(in.w, 3, 0.1);
  in.x = TensorF({B, S, cfg.dim});
  in.dout = TensorF({B, S, cfg.dim});
  fill_normal(in.x.data(), in.x.numel(), 5, 1, 0, 1.0);
  fill_normal(in.dout.data(), in.dout.numel(), 5, 2, 0, 1.0);
  return in;
}

}  // namespace laga::test
