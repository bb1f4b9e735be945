// The block tests' inputs: their small MLA config, and parameters, x and dout
// of one MLA block, drawn from fixed seeds so every test file (and every form
// within one) sees the same values. x, dout are (B, S, D).
#pragma once

#include <cstdint>

#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "mla/config.hpp"
#include "mla/params.hpp"

namespace laga::test {

// The block tests' config: H = 5 by default so that no P > 1 here divides it;
// C > dn as in V3 (the absorbed trap's precondition), dqk != dv; q_lora_rank
// 0 projects the query directly.
inline MlaConfig block_config(std::int64_t q_lora_rank, std::int64_t heads = 5) {
  MlaConfig c;
  c.dim = 32, c.n_heads = heads, c.q_lora_rank = q_lora_rank, c.kv_lora_rank = 16,
  c.qk_nope_head_dim = 8, c.qk_rope_head_dim = 4, c.v_head_dim = 6;
  c.rope_theta = 500, c.original_seq_len = 8, c.max_seq_len = 64, c.rope_factor = 4;
  c.validate();
  return c;
}

template <class T>
struct BlockInputs {
  MlaParams<T> w;
  Tensor<T> x, dout;  // (B, S, D)
};

// fill false: x and dout left unfilled, as under a count-only pool (their
// tensors have no storage to fill).
inline BlockInputs<float> make_inputs(const MlaConfig& cfg, std::int64_t B, std::int64_t S,
                                      bool fill = true) {
  BlockInputs<float> in;
  in.w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
  init_params(in.w, 3, 0.1);
  in.x = TensorF({B, S, cfg.dim});
  in.dout = TensorF({B, S, cfg.dim});
  if (fill) {
    fill_normal(in.x.data(), in.x.numel(), 5, 1, 0, 1.0);
    fill_normal(in.dout.data(), in.dout.numel(), 5, 2, 0, 1.0);
  }
  return in;
}

}  // namespace laga::test
