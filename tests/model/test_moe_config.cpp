// MoeConfig: validation names the bad field, and DeepSeek-V3's MoE block is
// read from both JSON formats (Hugging Face config.json, DeepSeek's inference
// ModelArgs) to the same config; what is not implemented is refused.
#include "model/moe_config.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "common/error_of.hpp"
#include "core/error.hpp"
#include "mla/config.hpp"

namespace laga {
namespace {

using nlohmann::json;
using test::error_of;

// `needle` is in the message of the error fn throws (and it throws one).
::testing::AssertionResult refuses(const std::function<void()>& fn, const std::string& needle) {
  const std::string msg = error_of(fn);
  if (msg.empty()) return ::testing::AssertionFailure() << "no error; expected '" << needle << "'";
  if (msg.find(needle) == std::string::npos)
    return ::testing::AssertionFailure() << "'" << msg << "' does not say '" << needle << "'";
  return ::testing::AssertionSuccess();
}

MoeConfig v3_like() {
  MoeConfig c;
  c.n_routed_experts = 16, c.num_experts_per_tok = 4, c.n_group = 4, c.topk_group = 2;
  return c;
}

TEST(MoeConfig, ValidationNamesTheField) {
  EXPECT_NO_THROW(MoeConfig().validate());
  EXPECT_NO_THROW(v3_like().validate());
  MoeConfig c = v3_like();
  c.topk_group = 5;
  EXPECT_TRUE(refuses([&] { c.validate(); },
                      "topk_group (n_limited_groups) 5 must be in [1, n_group = 4]"));
  c = v3_like();
  c.n_group = 3;
  EXPECT_TRUE(refuses([&] { c.validate(); }, "n_routed_experts 16 is not a multiple of n_group"));
  c = v3_like();
  c.num_experts_per_tok = 9;  // 2 groups of 4 experts hold 8
  EXPECT_TRUE(
      refuses([&] { c.validate(); }, "is more than the 8 experts of the topk_group = 2 groups"));
  c = v3_like();
  c.n_group = 16, c.topk_group = 8;  // one expert per group: no top-2 sum
  EXPECT_TRUE(refuses([&] { c.validate(); }, "each group needs at least 2"));
  c = v3_like();
  c.num_experts_per_tok = 17;
  EXPECT_TRUE(refuses([&] { c.validate(); }, "num_experts_per_tok (n_activated_experts) 17"));
  c = v3_like();
  c.routed_scaling_factor = 0;
  EXPECT_TRUE(refuses([&] { c.validate(); }, "routed_scaling_factor (route_scale)"));
  c = v3_like();
  c.moe_intermediate_size = 0;
  EXPECT_TRUE(refuses([&] { c.validate(); }, "moe_intermediate_size (moe_inter_dim)"));
  c = v3_like();
  c.n_shared_experts = -1;
  EXPECT_TRUE(refuses([&] { c.validate(); }, "n_shared_experts must be >= 0"));
  c = v3_like();
  c.first_k_dense_replace = -1;
  EXPECT_TRUE(refuses([&] { c.validate(); }, "first_k_dense_replace (n_dense_layers)"));
}

// Values of absurd magnitude are refused at load naming the key (issue 54,
// T: route_scale 1e300 was accepted and training died blaming the gate's
// input); the published ones (V2: 16, V3: 2.5, V2-Lite: 1) load.
TEST(MoeConfig, RefusesAbsurdMagnitudesNamingTheKey) {
  for (const double scale : {1e300, 1e4, 1e-4, 1e-300, -2.5}) {
    MoeConfig c = v3_like();
    c.routed_scaling_factor = scale;
    EXPECT_TRUE(refuses([&] { c.validate(); }, "routed_scaling_factor (route_scale) " + cat(scale) +
                                                   " must be in [0.001, 1000]"))
        << scale;
  }
  for (const double scale : {16.0, 2.5, 1.0, 1e-3, 1e3}) {
    MoeConfig c = v3_like();
    c.routed_scaling_factor = scale;
    EXPECT_NO_THROW(c.validate()) << scale;
  }
  // 2^53 shared experts times the width wrapped past int64 and passed the
  // size check.
  MoeConfig c = v3_like();
  c.n_shared_experts = std::int64_t(1) << 53;
  c.moe_intermediate_size = std::int64_t(1) << 11;
  EXPECT_TRUE(refuses([&] { c.validate(); }, "dimensions too large"));
  c = v3_like();
  c.first_k_dense_replace = std::int64_t(1) << 53;
  EXPECT_TRUE(refuses([&] { c.validate(); }, "first_k_dense_replace (n_dense_layers)"));
  // Through the ModelArgs reader: the key as the file spells it.
  json j = {{"n_routed_experts", 16},
            {"n_activated_experts", 2},
            {"moe_inter_dim", 32},
            {"score_func", "sigmoid"},
            {"route_scale", 1e300}};
  EXPECT_TRUE(refuses([&] { (void)MoeConfig::from_json(j, "cfg.json"); },
                      "routed_scaling_factor (route_scale) 1e+300"));
}

// DeepSeek-V3's config.json (the MoE and a few attention keys of it).
json hf_v3() {
  return {{"hidden_size", 7168},
          {"num_attention_heads", 128},
          {"q_lora_rank", 1536},
          {"kv_lora_rank", 512},
          {"qk_nope_head_dim", 128},
          {"qk_rope_head_dim", 64},
          {"v_head_dim", 128},
          {"intermediate_size", 18432},
          {"moe_intermediate_size", 2048},
          {"n_routed_experts", 256},
          {"num_experts_per_tok", 8},
          {"n_shared_experts", 1},
          {"n_group", 8},
          {"topk_group", 4},
          {"routed_scaling_factor", 2.5},
          {"scoring_func", "sigmoid"},
          {"topk_method", "noaux_tc"},
          {"norm_topk_prob", true},
          {"first_k_dense_replace", 3},
          {"moe_layer_freq", 1},
          {"ep_size", 1},
          {"aux_loss_alpha", 0.001},
          {"seq_aux", true}};
}

// DeepSeek-V3's inference/configs/config_671B.json.
json modelargs_v3() {
  return {{"vocab_size", 129280},    {"dim", 7168},
          {"inter_dim", 18432},      {"moe_inter_dim", 2048},
          {"n_layers", 61},          {"n_dense_layers", 3},
          {"n_heads", 128},          {"n_routed_experts", 256},
          {"n_shared_experts", 1},   {"n_activated_experts", 8},
          {"n_expert_groups", 8},    {"n_limited_groups", 4},
          {"route_scale", 2.5},      {"score_func", "sigmoid"},
          {"q_lora_rank", 1536},     {"kv_lora_rank", 512},
          {"qk_nope_head_dim", 128}, {"qk_rope_head_dim", 64},
          {"v_head_dim", 128},       {"dtype", "fp8"}};
}

void expect_v3(const MoeConfig& c) {
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.shared_intermediate_size(), 2048);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.experts_per_group(), 32);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.scoring_func, ScoreFunc::sigmoid);
  EXPECT_EQ(c.topk_method, TopkMethod::noaux_tc);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.first_k_dense_replace, 3);
}

TEST(MoeConfig, BothFormatsReadDeepSeekV3Alike) {
  const auto hf = MoeConfig::from_json(hf_v3(), "hf");
  ASSERT_TRUE(hf.has_value());
  expect_v3(*hf);
  const auto ma = MoeConfig::from_json(modelargs_v3(), "modelargs");
  ASSERT_TRUE(ma.has_value());
  expect_v3(*ma);
  EXPECT_EQ(hf->to_json(), ma->to_json());
  // MLA's reader still reads the attention block of the same files and
  // ignores the MoE keys, as before.
  EXPECT_EQ(MlaConfig::from_json(hf_v3()).dim, 7168);
  EXPECT_EQ(MlaConfig::from_json(modelargs_v3()).n_heads, 128);
}

TEST(MoeConfig, DenseConfigHasNoMoe) {
  json hf = hf_v3();
  hf.erase("n_routed_experts");
  EXPECT_FALSE(MoeConfig::from_json(hf).has_value());
  hf["n_routed_experts"] = nullptr;  // HF's DeepseekV2/V3 dense spelling
  EXPECT_FALSE(MoeConfig::from_json(hf).has_value());
  json ma = modelargs_v3();
  ma["n_routed_experts"] = 0;
  EXPECT_FALSE(MoeConfig::from_json(ma).has_value());
}

TEST(MoeConfig, HuggingFaceRefusals) {
  for (const char* key : {"num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                          "n_group", "topk_group", "routed_scaling_factor", "scoring_func",
                          "topk_method", "norm_topk_prob", "first_k_dense_replace"}) {
    json j = hf_v3();
    j.erase(key);
    EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j, "cfg.json"); },
                        std::string("cfg.json: missing '") + key + "'"))
        << key;
  }
  // Hugging Face's V3 gate scores with sigmoid only, its V2 gates with
  // softmax only: each other pairing is refused, naming both values.
  json j = hf_v3();
  j["scoring_func"] = "softmax";
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j); },
                      "scoring_func 'softmax' with topk_method 'noaux_tc'"));
  j = hf_v3();
  j["topk_method"] = "group_limited_greedy";
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j); },
                      "scoring_func 'sigmoid' with topk_method 'group_limited_greedy'"));
  j["scoring_func"] = "tanh";
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j); }, "scoring_func 'tanh' is not implemented"));
  j = hf_v3();
  j["topk_method"] = "aux_tc";
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j); }, "topk_method 'aux_tc' is not implemented"));
  j = hf_v3();
  j["moe_layer_freq"] = 2;
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j); }, "moe_layer_freq 2 is not implemented"));
  j = hf_v3();
  j["norm_topk_prob"] = 1;
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j); }, "'norm_topk_prob' must be true or false"));
  j = hf_v3();
  j["n_group"] = 2.5;
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j); }, "'n_group' must be an integer"));
  // Validation's refusals carry the file's name.
  j = hf_v3();
  j["topk_group"] = 9;
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j, "cfg.json"); }, "cfg.json: moe: topk_group"));
  // transformers skips the normalisation at k = 1 whatever norm_topk_prob says.
  j = hf_v3();
  j["num_experts_per_tok"] = 1;
  EXPECT_FALSE(MoeConfig::from_json(j)->norm_topk_prob);
  j["num_experts_per_tok"] = 2;
  j["norm_topk_prob"] = false;
  EXPECT_FALSE(MoeConfig::from_json(j)->norm_topk_prob);
}

// DeepSeek-V2's Hugging Face configs: softmax scores, greedy (V2-Lite) or
// group_limited_greedy (V2) selection, no bias; a normalised V2 gate is not
// scaled (`if top_k > 1 and norm_topk_prob: ... else: w * scale`).
TEST(MoeConfig, HuggingFaceV2Gates) {
  json j = hf_v3();
  j["scoring_func"] = "softmax", j["topk_method"] = "group_limited_greedy";
  j["norm_topk_prob"] = false, j["routed_scaling_factor"] = 16.0;
  auto c = MoeConfig::from_json(j);
  EXPECT_EQ(c->scoring_func, ScoreFunc::softmax);
  EXPECT_EQ(c->topk_method, TopkMethod::group_limited_greedy);
  EXPECT_FALSE(c->gate_has_bias());
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 16.0);
  json back = j;  // to_json writes the MoE keys only: read them in the whole config
  back.update(c->to_json());
  EXPECT_EQ(MoeConfig::from_json(back)->to_json(), c->to_json());
  j["norm_topk_prob"] = true;
  c = MoeConfig::from_json(j);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 1.0);
  back = j;
  back.update(c->to_json());
  EXPECT_EQ(MoeConfig::from_json(back)->to_json(), c->to_json());
  // greedy ignores the groups, so k may exceed the topk_group groups' experts.
  j["topk_method"] = "greedy", j["n_group"] = 8, j["topk_group"] = 1;
  j["num_experts_per_tok"] = 40;  // more than one group's 32
  EXPECT_EQ(MoeConfig::from_json(j)->selection_groups(), 1);
  j["topk_method"] = "group_limited_greedy";
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j); }, "num_experts_per_tok"));
}

TEST(MoeConfig, ModelArgsDefaultsAndRefusals) {
  // ModelArgs' defaults: 2 shared experts, no groups, route_scale 1, 1 dense
  // layer; its default score_func is softmax (V2).
  const json minimal = {{"dim", 64},
                        {"n_routed_experts", 8},
                        {"n_activated_experts", 2},
                        {"moe_inter_dim", 32},
                        {"score_func", "sigmoid"}};
  const auto c = MoeConfig::from_json(minimal);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->n_shared_experts, 2);
  EXPECT_EQ(c->n_group, 1);
  EXPECT_EQ(c->topk_group, 1);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 1.0);
  EXPECT_EQ(c->first_k_dense_replace, 1);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->topk_method, TopkMethod::greedy);  // no bias: dim is not 7168
  json j = minimal;
  j.erase("score_func");  // ModelArgs' default: softmax, never normalised
  EXPECT_EQ(MoeConfig::from_json(j)->scoring_func, ScoreFunc::softmax);
  EXPECT_FALSE(MoeConfig::from_json(j)->norm_topk_prob);
  j["score_func"] = "relu";
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j); }, "score_func 'relu' is not implemented"));
  // Gate.__init__ gives the gate a bias at dim 7168 only; without one a group
  // scores its amax (group_limited_greedy), with one its top-2 sum.
  j = minimal;
  j["n_expert_groups"] = 4, j["n_limited_groups"] = 2;
  EXPECT_EQ(MoeConfig::from_json(j)->topk_method, TopkMethod::group_limited_greedy);
  j["dim"] = 7168;
  EXPECT_EQ(MoeConfig::from_json(j)->topk_method, TopkMethod::noaux_tc);
  j["dim"] = 64, j["topk_method"] = "noaux_tc";  // laga's key says it at any dim
  EXPECT_EQ(MoeConfig::from_json(j)->topk_method, TopkMethod::noaux_tc);
  j = minimal;
  j.erase("moe_inter_dim");
  EXPECT_TRUE(refuses([&] { MoeConfig::from_json(j); }, "missing 'moe_inter_dim'"));
  j = minimal;
  j["n_expert_groups"] = 4, j["n_limited_groups"] = 1;  // 1 group of 2 experts, k 2: fine
  EXPECT_NO_THROW(MoeConfig::from_json(j));
  j["n_activated_experts"] = 3;
  EXPECT_TRUE(
      refuses([&] { MoeConfig::from_json(j); }, "num_experts_per_tok (n_activated_experts) 3"));
}

}  // namespace
}  // namespace laga
