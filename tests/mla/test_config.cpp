// MlaConfig: presets, validation errors, and both JSON formats (DeepSeek
// inference ModelArgs and Hugging Face config.json for DeepSeek-V3).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/error_of.hpp"
#include "core/error.hpp"
#include "mla/config.hpp"
#include "mla/params.hpp"

namespace laga {
namespace {

using nlohmann::json;

using test::expect_error;

TEST(Config, PresetsValidateAndMatchDeepSeekV3) {
  for (const auto& name : MlaConfig::preset_names())
    EXPECT_NO_THROW(MlaConfig::preset(name).validate()) << name;
  const MlaConfig v3 = MlaConfig::preset("deepseek-v3");
  EXPECT_EQ(v3.dim, 7168);
  EXPECT_EQ(v3.n_heads, 128);
  EXPECT_EQ(v3.q_lora_rank, 1536);
  EXPECT_EQ(v3.kv_lora_rank, 512);
  EXPECT_EQ(v3.qk_head_dim(), 192);
  EXPECT_EQ(v3.v_head_dim, 128);
  EXPECT_TRUE(v3.yarn());
  // (192)^-1/2 * (0.1 * 1.0 * ln 40 + 1)^2
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(v3.softmax_scale(), m * m / std::sqrt(192.0));
  EXPECT_EQ(MlaConfig::preset("paper").q_lora_rank, 0);
  expect_error([] { MlaConfig::preset("v4"); }, "unknown preset 'v4'");
}

TEST(Config, ValidationNamesTheField) {
  MlaConfig c;
  c.qk_rope_head_dim = 7;
  expect_error([&] { c.validate(); }, "qk_rope_head_dim must be even");
  c = MlaConfig();
  c.n_heads = 0;
  expect_error([&] { c.validate(); }, "n_heads must be positive");
  c = MlaConfig();
  c.q_lora_rank = -1;
  expect_error([&] { c.validate(); }, "q_lora_rank");
  c = MlaConfig();
  c.max_seq_len = 100000, c.beta_fast = 1, c.beta_slow = 32;
  expect_error([&] { c.validate(); }, "beta_fast > beta_slow");
}

TEST(Config, ModelArgsJson) {
  // DeepSeek-V3 inference configs/config_671B.json (attention keys; others ignored).
  const json j = {{"vocab_size", 129280},   {"dim", 7168},
                  {"inter_dim", 18432},     {"n_layers", 61},
                  {"n_heads", 128},         {"q_lora_rank", 1536},
                  {"kv_lora_rank", 512},    {"qk_nope_head_dim", 128},
                  {"qk_rope_head_dim", 64}, {"v_head_dim", 128},
                  {"mscale", 1.0},          {"dtype", "fp8"}};
  const MlaConfig c = MlaConfig::from_json(j);
  EXPECT_EQ(c.dim, 7168);
  EXPECT_EQ(c.q_lora_rank, 1536);
  // ModelArgs defaults: max_seq_len 16384 > original 4096, so YaRN is on.
  EXPECT_EQ(c.max_seq_len, 16384);
  EXPECT_EQ(c.original_seq_len, 4096);
  EXPECT_DOUBLE_EQ(c.rope_factor, 40);
  EXPECT_TRUE(c.yarn());
  // Round trip through laga's own output.
  const MlaConfig back = MlaConfig::from_json(c.to_json());
  EXPECT_EQ(back.to_json(), c.to_json());
  json missing = j;
  missing.erase("kv_lora_rank");
  expect_error([&] { MlaConfig::from_json(missing); }, "missing 'kv_lora_rank'");
  json wrong = j;
  wrong["n_heads"] = "128";
  expect_error([&] { MlaConfig::from_json(wrong); }, "'n_heads' must be an integer");
}

TEST(Config, HuggingFaceJson) {
  const json j = {{"hidden_size", 7168},
                  {"num_attention_heads", 128},
                  {"q_lora_rank", 1536},
                  {"kv_lora_rank", 512},
                  {"qk_nope_head_dim", 128},
                  {"qk_rope_head_dim", 64},
                  {"v_head_dim", 128},
                  {"rope_theta", 10000},
                  {"rms_norm_eps", 1e-6},
                  {"max_position_embeddings", 163840},
                  {"rope_scaling",
                   {{"type", "yarn"},
                    {"factor", 40},
                    {"beta_fast", 32},
                    {"beta_slow", 1},
                    {"mscale", 1.0},
                    {"mscale_all_dim", 1.0},
                    {"original_max_position_embeddings", 4096}}}};
  const MlaConfig c = MlaConfig::from_json(j);
  EXPECT_EQ(c.to_json(), MlaConfig::preset("deepseek-v3").to_json());
  json lite = j;
  lite["q_lora_rank"] = nullptr;  // V2-Lite style: no q compression
  lite.erase("rope_scaling");
  const MlaConfig l = MlaConfig::from_json(lite);
  EXPECT_EQ(l.q_lora_rank, 0);
  EXPECT_FALSE(l.yarn());
  json bad = j;
  bad["rope_scaling"]["mscale"] = 0.707;
  expect_error([&] { MlaConfig::from_json(bad); }, "mscale_all_dim");
  bad = j;
  bad["rope_scaling"]["type"] = "linear";
  expect_error([&] { MlaConfig::from_json(bad); }, "'linear' is not supported");
}

// Issue 26 items 4-6: a config.json is read by transformers' rules, every key
// of its RoPE block read or refused.
json hf_v3() {
  return {{"hidden_size", 7168}, {"num_attention_heads", 128},       {"q_lora_rank", 1536},
          {"kv_lora_rank", 512}, {"qk_nope_head_dim", 128},          {"qk_rope_head_dim", 64},
          {"v_head_dim", 128},   {"max_position_embeddings", 163840}};
}
json v3_yarn() {
  return {{"factor", 40},  {"beta_fast", 32},       {"beta_slow", 1},
          {"mscale", 1.0}, {"mscale_all_dim", 1.0}, {"original_max_position_embeddings", 4096}};
}

TEST(Config, TransformersFiveRopeParametersAreRead) {
  const MlaConfig want = MlaConfig::preset("deepseek-v3");
  json j = hf_v3();
  j["rope_parameters"] = v3_yarn();
  j["rope_parameters"]["rope_type"] = "yarn";
  j["rope_parameters"]["rope_theta"] = 10000;
  const MlaConfig c = MlaConfig::from_json(j);
  EXPECT_TRUE(c.yarn());
  EXPECT_EQ(c.to_json(), want.to_json());
  EXPECT_EQ(c.softmax_scale(), want.softmax_scale());
  // A different theta inside is read, not the default.
  j["rope_parameters"]["rope_theta"] = 50000;
  EXPECT_EQ(MlaConfig::from_json(j).rope_theta, 50000);
  // Plain RoPE under transformers 5.
  json plain = hf_v3();
  plain["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 20000}};
  const MlaConfig p = MlaConfig::from_json(plain);
  EXPECT_FALSE(p.yarn());
  EXPECT_EQ(p.rope_theta, 20000);
  // Refused, each by name: both blocks, a theta given twice differently, an
  // unread key, a partial rotary factor.
  json both = j;
  both["rope_scaling"] = v3_yarn();
  both["rope_scaling"]["type"] = "yarn";
  expect_error([&] { MlaConfig::from_json(both); }, "both 'rope_scaling' (transformers 4)");
  json theta = j;
  theta["rope_theta"] = 10000;
  expect_error([&] { MlaConfig::from_json(theta); }, "rope_parameters.rope_theta 50000 disagree");
  json unread = j;
  unread["rope_parameters"]["low_freq_factor"] = 1;
  expect_error([&] { MlaConfig::from_json(unread); }, "key 'low_freq_factor' is not read");
  json partial = plain;
  partial["rope_parameters"]["partial_rotary_factor"] = 0.5;
  expect_error([&] { MlaConfig::from_json(partial); }, "partial_rotary_factor 0.5");
}

TEST(Config, HuggingFaceNormsUseTheirPublishedEps) {
  json j = hf_v3();
  j["rms_norm_eps"] = 1e-5;  // the decoder layers' norms, not q_a/kv_a's
  EXPECT_EQ(MlaConfig::from_json(j).norm_eps, 1e-6);
}

TEST(Config, HuggingFaceYarnIsOnWheneverTheTypeIsYarn) {
  json j = hf_v3();
  j["max_position_embeddings"] = 4096;  // not longer than the original context
  j["rope_scaling"] = v3_yarn();
  j["rope_scaling"]["type"] = "yarn";
  const MlaConfig c = MlaConfig::from_json(j);
  EXPECT_TRUE(c.yarn()) << "transformers applies YaRN whenever rope_scaling is yarn";
  EXPECT_GT(c.softmax_scale(), 1.0 / std::sqrt(192.0));
  // It survives laga's own JSON (a checkpoint's or an output's config).
  EXPECT_TRUE(MlaConfig::from_json(c.to_json()).yarn());
  EXPECT_EQ(MlaConfig::from_json(c.to_json()).to_json(), c.to_json());
  // DeepSeek's ModelArgs rule is unchanged: by the lengths.
  json args = MlaConfig::preset("deepseek-v3").to_json();
  args["max_seq_len"] = 4096;
  EXPECT_FALSE(MlaConfig::from_json(args).yarn());
  // Contradictions and what laga does not compute are refused.
  json clash = j;
  clash["rope_scaling"]["rope_type"] = "linear";
  expect_error([&] { MlaConfig::from_json(clash); }, "they contradict each other");
  json zero = j;
  zero["rope_scaling"]["mscale"] = 0.0;
  zero["rope_scaling"]["mscale_all_dim"] = 0.0;
  expect_error([&] { MlaConfig::from_json(zero); }, "transformers then scales cos/sin");
  json factor = j;
  factor["rope_scaling"]["attention_factor"] = 1.2;
  expect_error([&] { MlaConfig::from_json(factor); }, "attention_factor 1.2");
  json trunc = j;
  trunc["rope_scaling"]["truncate"] = false;
  expect_error([&] { MlaConfig::from_json(trunc); }, "truncate false");
}

TEST(Config, ParameterShapesAndHfNames) {
  const MlaConfig c = MlaConfig::preset("deepseek-v3");
  const auto shapes = mla_param_shapes(c);
  ASSERT_EQ(shapes.size(), 7u);
  EXPECT_EQ(shapes[0].first, "wq_a.weight");
  EXPECT_EQ(shapes[0].second, (Shape{1536, 7168}));
  EXPECT_EQ(shapes[3].second, (Shape{576, 7168}));  // wkv_a: latent 512 | k_pe 64
  EXPECT_EQ(shapes[5].second, (Shape{128 * 256, 512}));
  EXPECT_EQ(hf_param_name("wkv_a.weight", 3), "model.layers.3.self_attn.kv_a_proj_with_mqa.weight");
  EXPECT_EQ(hf_param_name("kv_norm.weight", 0), "model.layers.0.self_attn.kv_a_layernorm.weight");
}

// Issue 10 items 12 and 13: values no model has are refused quoting what was
// given; files that are not regular files are named before any open.
std::string write_config(const std::string& name, const std::string& text) {
  const char* t = std::getenv("LAGA_TEST_TMP");
  const std::filesystem::path dir = std::filesystem::path(t ? t : "/tmp") / "mla_config";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / name).string();
  std::ofstream(path) << text;
  return path;
}

const char* kBase = R"("n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, )"
                    R"("qk_rope_head_dim": 4, "v_head_dim": 8)";

TEST(Config, HugeIntegerIsQuotedNotWrapped) {
  // nlohmann prints a float back in its own way (1e300 -> 1e+300).
  const std::pair<std::string, std::string> cases[] = {
      {"1e300", "1e+300"}, {"18446744073709551615", "18446744073709551615"}, {"1e19", "1e+19"}};
  for (const auto& [given, shown] : cases) {
    const std::string p = write_config("huge.json", "{\"dim\": " + given + ", " + kBase + "}");
    expect_error([&] { MlaConfig::from_json_file(p); }, "'dim' is " + shown + ", beyond");
  }
  const std::string p = write_config("frac.json", std::string("{\"dim\": 64.5, ") + kBase + "}");
  expect_error([&] { MlaConfig::from_json_file(p); }, "'dim' must be an integer, got 64.5");
}

TEST(Config, DuplicateKeysAreRefused) {
  const std::string p =
      write_config("dup.json", std::string("{\"dim\": 64, \"dim\": 32, ") + kBase + "}");
  expect_error([&] { MlaConfig::from_json_file(p); }, "key 'dim' appears twice");
  // Nested objects keep their own keys: the same key in two objects is fine.
  const std::string hf =
      write_config("hf_dup.json",
                   R"({"hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 16,
          "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
          "max_position_embeddings": 16384,
          "rope_scaling": {"type": "yarn", "factor": 4, "factor": 40, "mscale": 1,
                           "mscale_all_dim": 1}})");
  expect_error([&] { MlaConfig::from_json_file(hf); }, "key 'factor' appears twice");
}

TEST(Config, QLoraRankAboveDimAndAbsurdRopeFactorAreRefused) {
  MlaConfig c;
  c.q_lora_rank = c.dim + 1;
  expect_error([&] { c.validate(); },
               "q_lora_rank " + std::to_string(c.dim + 1) + " is larger than dim");
  c = MlaConfig::preset("deepseek-v3");
  c.rope_factor = 1e308;
  expect_error([&] { c.validate(); }, "rope_factor 1e+308 is beyond");
  const std::string p =
      write_config("rf.json", std::string("{\"dim\": 64, \"rope_factor\": 1e308, ") + kBase + "}");
  expect_error([&] { MlaConfig::from_json_file(p); }, "rope_factor");
}

// The real-valued keys have ranges as the integers do (issue 54, T): a
// value past them is refused naming the key, the bounds themselves load.
TEST(Config, RealKeysOfAbsurdMagnitudeAreRefusedNamingTheKey) {
  const auto refused = [](void (*change)(MlaConfig&), const std::string& words) {
    MlaConfig c = MlaConfig::preset("deepseek-v3");  // YaRN on
    change(c);
    expect_error([&] { c.validate(); }, words);
  };
  refused([](MlaConfig& c) { c.rope_theta = 1e300; }, "rope_theta 1e+300 is beyond 1e+12");
  refused([](MlaConfig& c) { c.norm_eps = 1e-300; }, "norm_eps 1e-300 must be in [1e-30, 1)");
  refused([](MlaConfig& c) { c.norm_eps = 1; }, "norm_eps 1 must be in [1e-30, 1)");
  refused([](MlaConfig& c) { c.mscale = 1e300; }, "mscale 1e+300 is beyond 100");
  refused([](MlaConfig& c) { c.beta_fast = 1e300; }, "beta_fast 1e+300 is beyond 1e+06");
  MlaConfig c = MlaConfig::preset("deepseek-v3");
  c.rope_theta = 1e12, c.norm_eps = 1e-30, c.mscale = 100, c.beta_fast = 1e6;
  EXPECT_NO_THROW(c.validate());
  const std::string p = write_config(
      "theta.json", std::string("{\"dim\": 64, \"rope_theta\": 1e300, ") + kBase + "}");
  expect_error([&] { MlaConfig::from_json_file(p); }, "rope_theta 1e+300");
}

TEST(Config, DirectoryAndFifoConfigsAreNamedAndNeverOpened) {
  const std::string p = write_config("x.json", "{}");
  const std::string dir = std::filesystem::path(p).parent_path().string();
  expect_error([&] { MlaConfig::from_json_file(dir); }, "is a directory");
  const std::string fifo = dir + "/fifo.json";
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // With no writer, opening would block forever: this returns only if it
  // refuses first.
  expect_error([&] { MlaConfig::from_json_file(fifo); }, "is not a regular file");
}

}  // namespace
}  // namespace laga
