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
//        scoring_func            (score_func)           sigmoid (V3) or softmax (V2)
//        topk_method             (the gate's bias)      noaux_tc (V3: a bias), greedy or
//                                                       group_limited_greedy (V2: none)
//        norm_topk_prob          (sigmoid implies it)   weights normalised to sum 1
//        first_k_dense_replace   (n_dense_layers)       leading layers with a dense FFN
//
// DeepSeek-V3 671B: E 256, k 8, I 2048, Ns 1, G 8, Gk 4, c 2.5, 3 dense layers.
// DeepSeek-V2 236B: E 160, k 6, I 1536, Ns 2, G 8, Gk 3, c 16, softmax,
//   group_limited_greedy, not normalised, 1 dense layer (V2-Lite: E 64, greedy).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace laga {

// How gate logits become scores s (N, E): sigmoid(z) each (V3), or the
// softmax of the token's E logits (V2; DeepSeek's Gate with score_func
// "softmax").
enum class ScoreFunc { sigmoid, softmax };
// How experts are selected (docs/moe.md, "The gate"), the three rules of
// DeepSeek's code:
//   noaux_tc  the gate has a bias (e_score_correction_bias, steered by the
//             aux-loss-free balancing): top-k of s + bias; a group scores
//             the sum of its two best biased scores (V3, Gate with a bias).
//   greedy    no bias, no groups: top-k of s (V2-Lite; groups, if the config
//             names any, are ignored, as HF's V2 gate ignores them).
//   group_limited_greedy  no bias: a group scores its best s, the topk_group
//             best groups stay, top-k of their s (V2; DeepSeek's Gate
//             without a bias scores a group by its amax: the same rule).
enum class TopkMethod { noaux_tc, greedy, group_limited_greedy };

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
  // Whether selection adds the gate's bias (and the balancing may move it).
  bool gate_has_bias() const { return topk_method == TopkMethod::noaux_tc; }
  // The groups selection sees: greedy ignores them.
  std::int64_t selection_groups() const { return topk_method == TopkMethod::greedy ? 1 : n_group; }
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
  //   reads these names). Its default score_func is softmax. DeepSeek's Gate
  //   normalises sigmoid weights and never softmax ones (norm_topk_prob =
  //   sigmoid), and has a bias when dim is 7168 (`self.bias = ... if
  //   self.dim == 7168 else None`): noaux_tc then, else greedy (one group)
  //   or group_limited_greedy (its amax group score), unless the config
  //   names its topk_method (laga's key there, as in Hugging Face's).
  //   Hugging Face's V2 gate (topk_method greedy or group_limited_greedy,
  //   softmax only) multiplies by routed_scaling_factor only when it does
  //   not normalise (`if top_k > 1 and norm_topk_prob: w /= sum; else: w *=
  //   scale`): read with norm_topk_prob, its scale is 1. Its V3 gate
  //   (noaux_tc) scores with sigmoid only.
  // Refused as not implemented rather than ignored: a scoring_func that
  // topk_method's gate does not have, other topk methods, moe_layer_freq != 1.
  static std::optional<MoeConfig> from_json(const nlohmann::json& j,
                                            const std::string& source = "config");
  nlohmann::json to_json() const;  // Hugging Face names
  std::string summary() const;     // one line: E=.. k=.. ...
};

}  // namespace laga
