// MlaParams — the weights of one MLA block under DeepSeek-V3's inference
// names, stored [out, in] and applied as y = x W^T:
//
//   wq.weight        (H*(dn+dr), D)     when rq == 0
//   wq_a.weight      (rq, D)            when rq > 0
//   q_norm.weight    (rq)
//   wq_b.weight      (H*(dn+dr), rq)
//   wkv_a.weight     (C+dr, D)          output [latent (C) | k_pe (dr)]
//   kv_norm.weight   (C)
//   wkv_b.weight     (H*(dn+dv), C)     head h: rows h(dn+dv)..+dn are K, next dv are V
//   wo.weight        (D, H*dv)
//   wg.weight        (H*dv, D)          mla_use_output_gate (Kimi K3's g_proj):
//                                       o_heads * sigmoid(x wg^T) feeds wo
//
// The same struct holds gradients (grad.<name> in files).
//
// wq (or wq_a) and wkv_a both read the block's input x, so they are stored
// as one matrix in_proj (Nq + C + dr, D), Nq = H*(dn+dr) (rq == 0) or rq:
// rows [0, Nq) are wq (wq_a), rows [Nq, Nq + C + dr) are wkv_a, and the
// block applies both in one GEMM (docs/forms.md, "The input projections").
// wq, wq_a and wkv_a are row views of it (Tensor::view_rows); in_proj is
// storage only, not a named parameter: for_each, files and every consumer
// see wq/wq_a and wkv_a by name, as if they were stored apart.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "mla/config.hpp"

namespace laga {

template <class T>
struct MlaParams {
  Tensor<T>
      in_proj;  // (Nq + C + dr, D): [wq or wq_a | wkv_a]; declared first, as the views need it
  Tensor<T> wq, wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo;
  Tensor<T> wg;  // mla_use_output_gate only

  // Allocates every tensor the config uses (zeros), under `cat`.
  static MlaParams zeros(const MlaConfig& cfg, MemCategory cat);
  // A deep copy registered with the current pool (tensors made on a rank
  // thread must move to a pool that outlives it), its views onto its own
  // in_proj.
  MlaParams clone(MemCategory cat) const;

  // Visits the tensors the config uses, in a fixed order, with their names.
  void for_each(const std::function<void(const std::string&, Tensor<T>&)>& fn);
  void for_each(const std::function<void(const std::string&, const Tensor<T>&)>& fn) const;
  std::int64_t numel() const;
};

// The parameter names a config uses, in for_each order, with their shapes.
std::vector<std::pair<std::string, Shape>> mla_param_shapes(const MlaConfig& cfg);

// Deterministic initialisation: every element depends only on (seed, name,
// index). Linear weights ~ N(0, 1/fan_in); norm weights 1 + norm_jitter * N(0,1)
// (jitter 0 gives DeepSeek's ones; tests use 0.1 so a norm weight that is
// ignored shows up).
template <class T>
void init_params(MlaParams<T>& p, std::uint64_t seed, double norm_jitter = 0.0);

// The Hugging Face name of a DeepSeek inference name for layer `layer`
// (wkv_a.weight -> model.layers.N.self_attn.kv_a_proj_with_mqa.weight).
std::string hf_param_name(const std::string& deepseek_name, int layer);

// A stable 64-bit stream id for a name (FNV-1a), so each tensor has its own
// Philox stream.
std::uint64_t name_stream(const std::string& name);

}  // namespace laga
