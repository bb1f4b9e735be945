// Kimi K3's MLA keys (docs/configs.md): mla_use_nope and mla_use_output_gate
// read from a Hugging Face config.json (top level or under text_config) and
// from laga's ModelArgs JSON under the same names; qk_rope_head_dim 0
// accepted; every inconsistent or malformed value refused naming the key.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <string>

#include "common/error_of.hpp"
#include "core/error.hpp"
#include "mla/config.hpp"
#include "mla/params.hpp"

namespace laga {
namespace {

using nlohmann::json;

using test::expect_error;

// Kimi K3's attention keys as its config.json gives them (its MLA layers:
// 96 heads, q latent 1536, kv latent 512, dn = dv = 128, dr 64 unrotated).
json kimi_k3_text() {
  return {{"model_type", "kimi_k3"},     {"hidden_size", 7168},
          {"num_attention_heads", 96},   {"num_key_value_heads", 96},
          {"q_lora_rank", 1536},         {"kv_lora_rank", 512},
          {"qk_nope_head_dim", 128},     {"qk_rope_head_dim", 64},
          {"v_head_dim", 128},           {"mla_use_nope", true},
          {"mla_use_output_gate", true}, {"rope_theta", 50000.0},
          {"rope_scaling", nullptr},     {"max_position_embeddings", 1048576}};
}

TEST(KimiConfig, ReadsBothKeysAndTheTextConfig) {
  for (const json& j : {kimi_k3_text(), json{{"text_config", kimi_k3_text()}}}) {
    const MlaConfig c = MlaConfig::from_json(j);
    EXPECT_TRUE(c.mla_use_nope);
    EXPECT_TRUE(c.mla_use_output_gate);
    EXPECT_FALSE(c.rotates());
    EXPECT_FALSE(c.yarn());
    EXPECT_EQ(c.rope().dim, 0) << "NoPE: an empty RoPE table";
    EXPECT_DOUBLE_EQ(c.softmax_scale(), 1.0 / std::sqrt(192.0));  // Kimi K3: 192^-1/2
    EXPECT_EQ(c.n_heads, 96);
    // Round trip through laga's own JSON keeps both keys under Kimi's names.
    const json out = c.to_json();
    EXPECT_EQ(out.at("mla_use_nope"), true);
    EXPECT_EQ(out.at("mla_use_output_gate"), true);
    const MlaConfig back = MlaConfig::from_json(out);
    EXPECT_EQ(back.to_json(), out);
  }
  // The gate's weight: Kimi's g_proj, (H dv, D).
  const auto shapes = mla_param_shapes(MlaConfig::from_json(kimi_k3_text()));
  ASSERT_EQ(shapes.back().first, "wg.weight");
  EXPECT_EQ(shapes.back().second, (Shape{96 * 128, 7168}));
  EXPECT_EQ(hf_param_name("wg.weight", 3), "model.layers.3.self_attn.g_proj.weight");
  // Absent keys mean DeepSeek's MLA: both off, and no wg.
  json plain = kimi_k3_text();
  plain.erase("mla_use_nope"), plain.erase("mla_use_output_gate");
  const MlaConfig d = MlaConfig::from_json(plain);
  EXPECT_FALSE(d.mla_use_nope || d.mla_use_output_gate);
  EXPECT_TRUE(d.rotates());
  EXPECT_EQ(mla_param_shapes(d).back().first, "wo.weight");
  EXPECT_EQ(d.to_json().count("mla_use_nope"), 0u);
}

TEST(KimiConfig, RopeHeadDimZeroIsAccepted) {
  // GLM-5.3-Flash-like: no rope part at all, with or without mla_use_nope.
  for (bool nope : {false, true}) {
    json j = kimi_k3_text();
    j["qk_rope_head_dim"] = 0, j["mla_use_nope"] = nope;
    const MlaConfig c = MlaConfig::from_json(j);
    EXPECT_EQ(c.qk_rope_head_dim, 0);
    EXPECT_FALSE(c.rotates());
    EXPECT_EQ(c.rope().dim, 0);
    EXPECT_DOUBLE_EQ(c.softmax_scale(), 1.0 / std::sqrt(128.0));
    EXPECT_EQ(mla_param_shapes(c)[3].second, (Shape{512, 7168})) << "wkv_a: C + 0 rows";
  }
  MlaConfig c;
  c.qk_rope_head_dim = 0;
  EXPECT_NO_THROW(c.validate());
  c.qk_rope_head_dim = -2;
  expect_error([&] { c.validate(); }, "qk_rope_head_dim must be 0 (no rope part) or positive");
}

TEST(KimiConfig, RefusesMalformedAndInconsistentKeys) {
  for (const char* key : {"mla_use_nope", "mla_use_output_gate"}) {
    json j = kimi_k3_text();
    j[key] = 1;
    expect_error([&] { MlaConfig::from_json(j); },
                 std::string("'") + key + "' must be true or false");
    j[key] = "true";
    expect_error([&] { MlaConfig::from_json(j); },
                 std::string("'") + key + "' must be true or false");
  }
  // NoPE with a YaRN block: nothing rotates, yet YaRN would scale the softmax.
  json yarn = kimi_k3_text();
  yarn["rope_scaling"] = {{"type", "yarn"},
                          {"factor", 32.0},
                          {"original_max_position_embeddings", 4096},
                          {"mscale", 1.0},
                          {"mscale_all_dim", 1.0}};
  expect_error([&] { MlaConfig::from_json(yarn); },
               "mla_use_nope is true but 'rope_scaling' asks for \"yarn\" RoPE scaling");
  // ModelArgs JSON: the same keys, the same refusals.
  const json args = {{"dim", 64},
                     {"n_heads", 4},
                     {"kv_lora_rank", 16},
                     {"qk_nope_head_dim", 8},
                     {"qk_rope_head_dim", 4},
                     {"v_head_dim", 8},
                     {"mla_use_nope", true},
                     {"mla_use_output_gate", true}};
  const MlaConfig c = MlaConfig::from_json(args);
  EXPECT_TRUE(c.mla_use_nope && c.mla_use_output_gate);
  EXPECT_FALSE(c.yarn()) << "ModelArgs' default lengths turn YaRN on only where something rotates";
  json bad = args;
  bad["mla_use_output_gate"] = nullptr;
  EXPECT_FALSE(MlaConfig::from_json(bad).mla_use_output_gate) << "null is absent, as for every key";
  bad["yarn_always"] = true;
  expect_error([&] { MlaConfig::from_json(bad); }, "mla_use_nope is true but yarn_always is set");
}

}  // namespace
}  // namespace laga
