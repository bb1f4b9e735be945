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
    case ScoreFunc::softmax:
      return "softmax";
  }
  return "?";
}

const char* to_string(TopkMethod m) {
  switch (m) {
    case TopkMethod::noaux_tc:
      return "noaux_tc";
    case TopkMethod::greedy:
      return "greedy";
    case TopkMethod::group_limited_greedy:
      return "group_limited_greedy";
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
  // noaux_tc: a group's score is the sum of its two best biased scores.
  LAGA_CHECK(topk_method != TopkMethod::noaux_tc || n_group == 1 || E / n_group >= 2,
             "moe: n_group ", n_group, " leaves ", E / n_group,
             " expert per group; a noaux_tc group's score sums its top 2 experts, so each group "
             "needs at least 2 (use n_group <= ",
             E / 2, ", or 1 for no group limiting)");
  const std::int64_t G = selection_groups(), Gk = G == 1 ? 1 : topk_group;
  LAGA_CHECK(k <= Gk * (E / G), "moe: num_experts_per_tok (n_activated_experts) ", k,
             " is more than the ", Gk * (E / G), " experts of the topk_group = ", Gk,
             " groups a token may use (", E / G,
             " per group); raise topk_group or lower num_experts_per_tok");
  // The gates DeepSeek's code has: Hugging Face's V3 gate scores with sigmoid
  // only, its V2 gates with softmax only; DeepSeek's Gate has any pairing
  // (ModelArgs configs), so only the to_json/from_json round trip of a
  // Hugging Face config is held to these.
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
  if (s == "sigmoid") return ScoreFunc::sigmoid;
  LAGA_CHECK(s == "softmax", source, ": ", key, " '", s,
             "' is not implemented; DeepSeek's gates score with 'sigmoid' (V3) or 'softmax' (V2)");
  return ScoreFunc::softmax;
}

TopkMethod parse_topk_method(const std::string& s, const std::string& source) {
  for (const TopkMethod m :
       {TopkMethod::noaux_tc, TopkMethod::greedy, TopkMethod::group_limited_greedy})
    if (s == to_string(m)) return m;
  fail(source, ": topk_method '", s,
       "' is not implemented; DeepSeek's gates select with 'noaux_tc' (V3: top-k of the "
       "bias-corrected sigmoid scores in the best groups), 'greedy' or 'group_limited_greedy' "
       "(V2: top-k of the softmax scores, overall or in the groups of best maximum)");
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
    c.topk_method = parse_topk_method(read_string(j, "topk_method", "", source), source);
    // Hugging Face's DeepSeek gates: V3's (noaux_tc) is sigmoid's, V2's
    // (greedy, group_limited_greedy) softmax's; each raises on the other.
    const ScoreFunc gate_scores =
        c.topk_method == TopkMethod::noaux_tc ? ScoreFunc::sigmoid : ScoreFunc::softmax;
    LAGA_CHECK(c.scoring_func == gate_scores, source, ": scoring_func '", to_string(c.scoring_func),
               "' with topk_method '", to_string(c.topk_method),
               "': Hugging Face's DeepSeek gate for ", to_string(c.topk_method), " scores with '",
               to_string(gate_scores), "' only; set scoring_func to '", to_string(gate_scores),
               "', or give the config in DeepSeek's ModelArgs names, whose Gate takes any pairing");
    const auto norm = j.find("norm_topk_prob");
    LAGA_CHECK(norm != j.end() && !norm->is_null(), source,
               ": missing 'norm_topk_prob' (the MoE layer needs it; see docs/moe.md)");
    LAGA_CHECK(norm->is_boolean(), source, ": 'norm_topk_prob' must be true or false, got ",
               norm->dump());
    c.norm_topk_prob = norm->get<bool>() && c.num_experts_per_tok > 1;
    // V2's gate scales only what it does not normalise.
    if (c.norm_topk_prob && c.topk_method != TopkMethod::noaux_tc) c.routed_scaling_factor = 1.0;
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
    // Gate.forward: `if self.score_func == "sigmoid": weights /= weights.sum(...)`.
    c.norm_topk_prob = c.scoring_func == ScoreFunc::sigmoid && c.num_experts_per_tok > 1;
    // Gate.__init__: `self.bias = nn.Parameter(...) if self.dim == 7168 else None`;
    // without one, a group scores its amax (Gate.forward).
    // laga's own key "topk_method" (as in Hugging Face's configs) says it
    // outright: a ModelArgs config for a small model trained with the bias
    // balancing (bias_update_speed) needs noaux_tc at any dim.
    std::int64_t dim = 2048;  // ModelArgs.dim's default
    read_config_key(j, "dim", dim, source);
    const std::string method = read_string(j, "topk_method", "", source);
    c.topk_method = !method.empty()  ? parse_topk_method(method, source)
                    : dim == 7168    ? TopkMethod::noaux_tc
                    : c.n_group == 1 ? TopkMethod::greedy
                                     : TopkMethod::group_limited_greedy;
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
