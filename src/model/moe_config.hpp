// MoeConfig — DeepSeek-V3's mixture-of-experts FFN (docs/moe.md has the math),
// under Hugging Face's config.json names, with DeepSeek's inference ModelArgs
// names beside them:
//
//   E    n_routed_experts        (n_routed_experts)     routed experts
//   k    num_experts_per_tok     (n_activated_experts)  experts per token
//   I    moe_intermediate_size   (moe_inter_dim)        one expert's SwiGLU width
//   Ns   n_shared_experts        (n_shared_experts)     shared SwiGLU width Ns * I
//   G    n_group                 (n_expert_groups)      expert groups
//   Gk   topk_group              (n_limited_groups)     groups a token may use
//   c    routed_scaling_factor   (route_scale)          scale of the routed weights
//        scoring_func            (score_func)           sigmoid only (V3)
//        topk_method                                    noaux_tc only (V3)
//        norm_topk_prob          (sigmoid implies it)   weights normalised to sum 1
//        first_k_dense_replace   (n_dense_layers)       leading layers with a dense FFN
//
// DeepSeek-V3 671B: E 256, k 8, I 2048, Ns 1, G 8, Gk 4, c 2.5, 3 dense layers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace laga {

// How gate logits become scores. DeepSeek-V2's softmax is not implemented.
enum class ScoreFunc { sigmoid };
// How experts are selected: noaux_tc is V3's group-limited top-k on the
// bias-corrected scores (the bias steered by the aux-loss-free balancing).
enum class TopkMethod { noaux_tc };

const char* to_string(ScoreFunc f);
const char* to_string(TopkMethod m);

struct MoeConfig {
  std::int64_t n_routed_experts = 8;
  std::int64_t num_experts_per_tok = 2;
  std::int64_t moe_intermediate_size = 32;
  std::int64_t n_shared_experts = 1;  // 0: no shared expert
  std::int64_t n_group = 1;           // 1: no group limiting
  std::int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  ScoreFunc scoring_func = ScoreFunc::sigmoid;
  TopkMethod topk_method = TopkMethod::noaux_tc;
  bool norm_topk_prob = true;
  std::int64_t first_k_dense_replace = 0;

  std::int64_t experts_per_group() const { return n_routed_experts / n_group; }
  std::int64_t shared_intermediate_size() const { return n_shared_experts * moe_intermediate_size; }

  // Throws laga::Error naming the first bad field (both of its names) and the fix.
  void validate() const;

  // The MoE block of a DeepSeek-V3 config: Hugging Face's config.json (told
  // apart by `hidden_size`, as MlaConfig::from_json does) or DeepSeek's
  // inference ModelArgs JSON. nullopt when the config has no routed experts
  // (the key absent, null or 0): a dense model.
  //   Hugging Face: every key above must be given (moe_layer_freq may be
  //   left out: 1). The two config classes in use disagree on the defaults
  //   (DeepSeek's configuration_deepseek.py: n_group None, softmax,
  //   norm_topk_prob false; transformers' DeepseekV3Config: 8, sigmoid,
  //   true), so a key left out has no one meaning. transformers skips the
  //   normalisation at k = 1 (`top_k > 1 and norm_topk_prob`): read as that.
  //   ModelArgs: n_routed_experts, n_activated_experts and moe_inter_dim
  //   must be given; the rest take ModelArgs' defaults (the one class that
  //   reads these names). Its default score_func is softmax, so a ModelArgs
  //   MoE without "score_func": "sigmoid" is refused; sigmoid weights are
  //   always normalised there (norm_topk_prob true).
  // Refused as not implemented rather than ignored: softmax scores,
  // topk_method other than noaux_tc, moe_layer_freq != 1.
  static std::optional<MoeConfig> from_json(const nlohmann::json& j,
                                            const std::string& source = "config");
  nlohmann::json to_json() const;  // Hugging Face names
  std::string summary() const;     // one line: E=.. k=.. ...
};

}  // namespace laga
