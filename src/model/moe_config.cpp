#include "model/moe_config.hpp"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "mla/config.hpp"

namespace laga {

using nlohmann::json;

const char* to_string(ScoreFunc f) {
  switch (f) {
    case ScoreFunc::sigmoid:
      return "sigmoid";
  }
  return "?";
}

const char* to_string(TopkMethod m) {
  switch (m) {
    case TopkMethod::noaux_tc:
      return "noaux_tc";
  }
  return "?";
}

namespace {
constexpr double kLeastRouteScale = 1e-3, kMostRouteScale = 1e3;
}  // namespace

void MoeConfig::validate() const {
  const std::int64_t E = n_routed_experts, k = num_experts_per_tok;
  LAGA_CHECK(E >= 1, "moe: n_routed_experts (n_routed_experts) must be >= 1, got ", E,
             "; a dense FFN has no MoE config");
  LAGA_CHECK(k >= 1 && k <= E, "moe: num_experts_per_tok (n_activated_experts) ", k,
             " must be in [1, n_routed_experts = ", E, "]");
  LAGA_CHECK(moe_intermediate_size >= 1,
             "moe: moe_intermediate_size (moe_inter_dim) must be >= 1, got ",
             moe_intermediate_size);
  LAGA_CHECK(n_shared_experts >= 0, "moe: n_shared_experts must be >= 0 (0: none), got ",
             n_shared_experts);
  LAGA_CHECK(n_group >= 1,
             "moe: n_group (n_expert_groups) must be >= 1 (1: no group limiting), got ", n_group);
  LAGA_CHECK(E % n_group == 0, "moe: n_routed_experts ", E,
             " is not a multiple of n_group (n_expert_groups) ", n_group,
             "; the groups are equal slices of the experts: choose a divisor of ", E);
  LAGA_CHECK(topk_group >= 1 && topk_group <= n_group, "moe: topk_group (n_limited_groups) ",
             topk_group, " must be in [1, n_group = ", n_group, "]");
  // A group's score is the sum of its two best biased scores (noaux_tc).
  LAGA_CHECK(n_group == 1 || E / n_group >= 2, "moe: n_group ", n_group, " leaves ", E / n_group,
             " expert per group; a group's score sums its top 2 experts, so each group needs at "
             "least 2 (use n_group <= ",
             E / 2, ", or 1 for no group limiting)");
  LAGA_CHECK(k <= topk_group * (E / n_group), "moe: num_experts_per_tok (n_activated_experts) ", k,
             " is more than the ", topk_group * (E / n_group),
             " experts of the topk_group = ", topk_group, " groups a token may use (", E / n_group,
             " per group); raise topk_group or lower num_experts_per_tok");
  // It multiplies every routed expert's output: published models use 1 to 16
  // (DeepSeek-V2: 16, V3: 2.5). Far outside that the run does not fail here
  // but later, in the gate or the loss, blaming another tensor (1e300 died
  // "in the gate's input", issue 54).
  LAGA_CHECK(std::isfinite(routed_scaling_factor) && routed_scaling_factor >= kLeastRouteScale &&
                 routed_scaling_factor <= kMostRouteScale,
             "moe: routed_scaling_factor (route_scale) ", routed_scaling_factor, " must be in [",
             kLeastRouteScale, ", ", kMostRouteScale,
             "] (it multiplies every routed expert's output; DeepSeek-V3: 2.5, V2: 16)");
  LAGA_CHECK(first_k_dense_replace >= 0 && first_k_dense_replace < (1ll << 20),
             "moe: first_k_dense_replace (n_dense_layers) must be >= 0 and < 2^20, got ",
             first_k_dense_replace, " (the dense layers before the first MoE; DeepSeek-V3: 3)");
  // Past this, E x I x D weights and (N k, I) activations overflow int32
  // BLAS arguments long before memory runs out; no model is near it.
  // (n_shared_experts is bounded before the product is formed: 2^53 of
  // them times the width wrapped past int64 and passed.)
  LAGA_CHECK(E < (1ll << 20) && moe_intermediate_size < (1ll << 24) &&
                 n_shared_experts < (1ll << 20) && shared_intermediate_size() < (1ll << 24),
             "moe: dimensions too large (n_routed_experts ", E, ", moe_intermediate_size ",
             moe_intermediate_size, ", n_shared_experts ", n_shared_experts, ")");
}

namespace {

std::string read_string(const json& j, const char* key, const std::string& fallback,
                        const std::string& source) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  LAGA_CHECK(it->is_string(), source, ": '", key, "' must be a string, got ", it->dump());
  return it->get<std::string>();
}

ScoreFunc parse_score_func(const std::string& s, const char* key, const std::string& source) {
  LAGA_CHECK(s == "sigmoid", source, ": ", key, " '", s,
             "' is not implemented; laga's MoE is DeepSeek-V3's, whose scores are 'sigmoid' "
             "(softmax is DeepSeek-V2's)");
  return ScoreFunc::sigmoid;
}

}  // namespace

std::optional<MoeConfig> MoeConfig::from_json(const json& j, const std::string& source) {
  LAGA_CHECK(j.is_object(), source, ": expected a JSON object with the model's dimensions");
  MoeConfig c;
  std::int64_t experts = 0;
  read_config_key(j, "n_routed_experts", experts, source);
  if (experts == 0) return std::nullopt;  // dense
  c.n_routed_experts = experts;
  const auto need_int = [&](const char* key, std::int64_t& out) {
    LAGA_CHECK(read_config_key(j, key, out, source), source, ": missing '", key,
               "' (the MoE layer needs it; see docs/moe.md)");
  };
  if (j.contains("hidden_size")) {  // Hugging Face config.json
    need_int("num_experts_per_tok", c.num_experts_per_tok);
    need_int("moe_intermediate_size", c.moe_intermediate_size);
    need_int("n_shared_experts", c.n_shared_experts);
    need_int("n_group", c.n_group);
    need_int("topk_group", c.topk_group);
    need_int("first_k_dense_replace", c.first_k_dense_replace);
    LAGA_CHECK(read_config_key(j, "routed_scaling_factor", c.routed_scaling_factor, source), source,
               ": missing 'routed_scaling_factor' (the MoE layer needs it; see docs/moe.md)");
    for (const char* key : {"scoring_func", "topk_method"})
      LAGA_CHECK(j.contains(key) && !j.at(key).is_null(), source, ": missing '", key,
                 "' (the MoE layer needs it; see docs/moe.md)");
    c.scoring_func =
        parse_score_func(read_string(j, "scoring_func", "", source), "scoring_func", source);
    const std::string method = read_string(j, "topk_method", "", source);
    LAGA_CHECK(method == "noaux_tc", source, ": topk_method '", method,
               "' is not implemented; laga's MoE routes as DeepSeek-V3 does ('noaux_tc': "
               "group-limited top-k on bias-corrected sigmoid scores)");
    c.topk_method = TopkMethod::noaux_tc;
    const auto norm = j.find("norm_topk_prob");
    LAGA_CHECK(norm != j.end() && !norm->is_null(), source,
               ": missing 'norm_topk_prob' (the MoE layer needs it; see docs/moe.md)");
    LAGA_CHECK(norm->is_boolean(), source, ": 'norm_topk_prob' must be true or false, got ",
               norm->dump());
    c.norm_topk_prob = norm->get<bool>() && c.num_experts_per_tok > 1;
    std::int64_t freq = 1;
    read_config_key(j, "moe_layer_freq", freq, source);
    LAGA_CHECK(freq == 1, source, ": moe_layer_freq ", freq,
               " is not implemented; laga puts an MoE in every layer after the first "
               "first_k_dense_replace, as DeepSeek-V3 does (moe_layer_freq 1)");
  } else {  // DeepSeek's inference ModelArgs
    need_int("n_activated_experts", c.num_experts_per_tok);
    need_int("moe_inter_dim", c.moe_intermediate_size);
    // ModelArgs' defaults for the rest.
    c.n_shared_experts = 2;
    c.n_group = 1;
    c.topk_group = 1;
    c.routed_scaling_factor = 1.0;
    c.first_k_dense_replace = 1;
    read_config_key(j, "n_shared_experts", c.n_shared_experts, source);
    read_config_key(j, "n_expert_groups", c.n_group, source);
    read_config_key(j, "n_limited_groups", c.topk_group, source);
    read_config_key(j, "route_scale", c.routed_scaling_factor, source);
    read_config_key(j, "n_dense_layers", c.first_k_dense_replace, source);
    c.scoring_func =
        parse_score_func(read_string(j, "score_func", "softmax", source), "score_func", source);
    c.norm_topk_prob = true;  // Gate.forward: sigmoid weights /= their sum
  }
  try {
    c.validate();
  } catch (const Error& e) {
    fail(source, ": ", e.what());
  }
  return c;
}

json MoeConfig::to_json() const {
  return json{{"n_routed_experts", n_routed_experts},
              {"num_experts_per_tok", num_experts_per_tok},
              {"moe_intermediate_size", moe_intermediate_size},
              {"n_shared_experts", n_shared_experts},
              {"n_group", n_group},
              {"topk_group", topk_group},
              {"routed_scaling_factor", routed_scaling_factor},
              {"scoring_func", to_string(scoring_func)},
              {"topk_method", to_string(topk_method)},
              {"norm_topk_prob", norm_topk_prob},
              {"first_k_dense_replace", first_k_dense_replace}};
}

std::string MoeConfig::summary() const {
  return cat("E=", n_routed_experts, " k=", num_experts_per_tok, " I=", moe_intermediate_size,
             " shared=", n_shared_experts, " groups=", topk_group, "/", n_group,
             " scale=", routed_scaling_factor, norm_topk_prob ? " norm" : "",
             " dense_layers=", first_k_dense_replace);
}

}  // namespace laga
