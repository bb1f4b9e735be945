// DeepSeek Sparse Attention's config keys (index_n_heads, index_head_dim,
// index_topk: DeepSeek-V3.2's names in its ModelArgs JSON and its Hugging
// Face config.json) read by MlaConfig, written back, and refused with one
// message naming the key when they cannot describe an indexer.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>

#include "common/error_of.hpp"
#include "mla/config.hpp"

namespace laga {
namespace {

using nlohmann::json;
using test::error_of;

// DeepSeek-V3.2-Exp's inference/config_671B_v3.2.json, its attention keys.
json v32_model_args() {
  return json{{"dim", 7168},         {"n_heads", 128},          {"q_lora_rank", 1536},
              {"kv_lora_rank", 512}, {"qk_nope_head_dim", 128}, {"qk_rope_head_dim", 64},
              {"v_head_dim", 128},   {"index_n_heads", 64},     {"index_head_dim", 128},
              {"index_topk", 2048}};
}

TEST(DsaConfig, ModelArgsAndHuggingFaceKeysAreRead) {
  const MlaConfig c = MlaConfig::from_json(v32_model_args(), "v3.2");
  EXPECT_TRUE(c.dsa());
  EXPECT_EQ(c.index_n_heads, 64);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, 2048);
  json hf{{"hidden_size", 7168}, {"num_attention_heads", 128}, {"q_lora_rank", 1536},
          {"kv_lora_rank", 512}, {"qk_nope_head_dim", 128},    {"qk_rope_head_dim", 64},
          {"v_head_dim", 128},   {"index_n_heads", 64},        {"index_head_dim", 128},
          {"index_topk", 2048}};
  const MlaConfig h = MlaConfig::from_json(hf, "hf");
  EXPECT_EQ(h.index_n_heads, 64);
  EXPECT_EQ(h.index_topk, 2048);
  // Written back under the same names, and read again to the same config.
  const json back = c.to_json();
  EXPECT_EQ(back.at("index_topk"), 2048);
  EXPECT_EQ(MlaConfig::from_json(back, "back").index_head_dim, 128);
  // A dense config has none of the keys, and writes none.
  json dense = v32_model_args();
  dense.erase("index_n_heads"), dense.erase("index_head_dim"), dense.erase("index_topk");
  const MlaConfig d = MlaConfig::from_json(dense, "dense");
  EXPECT_FALSE(d.dsa());
  EXPECT_FALSE(d.to_json().contains("index_topk"));
}

TEST(DsaConfig, BadIndexerKeysAreRefusedNamingTheKey) {
  json j = v32_model_args();
  j.erase("index_head_dim");
  EXPECT_NE(error_of([&] {
              MlaConfig::from_json(j, "cfg");
            }).find("cfg: 'index_head_dim' is missing; a DSA config gives"),
            std::string::npos);
  j = v32_model_args();
  j["index_topk"] = -1;
  EXPECT_NE(error_of([&] { MlaConfig::from_json(j, "cfg"); }).find("index_topk must be positive"),
            std::string::npos);
  j = v32_model_args();
  j["q_lora_rank"] = 0;
  EXPECT_NE(error_of([&] { MlaConfig::from_json(j, "cfg"); }).find("q_lora_rank is 0"),
            std::string::npos);
  j = v32_model_args();
  j["index_head_dim"] = 32;
  EXPECT_NE(error_of([&] {
              MlaConfig::from_json(j, "cfg");
            }).find("index_head_dim 32 is narrower than qk_rope_head_dim 64"),
            std::string::npos);
  j = v32_model_args();
  j["index_n_heads"] = 2.5;
  EXPECT_NE(error_of([&] { MlaConfig::from_json(j, "cfg"); }).find("index_n_heads"),
            std::string::npos);
}

TEST(DsaConfig, IndexFp8IsReadWrittenAndRefusedWhereItCannotApply) {
  json j = v32_model_args();
  j["index_fp8"] = true;
  const MlaConfig c = MlaConfig::from_json(j, "cfg");
  EXPECT_TRUE(c.index_fp8);
  EXPECT_EQ(c.to_json().at("index_fp8"), true);
  EXPECT_TRUE(MlaConfig::from_json(c.to_json(), "back").index_fp8);
  EXPECT_FALSE(MlaConfig::from_json(v32_model_args(), "cfg").to_json().contains("index_fp8"));
  j["index_fp8"] = 1;
  EXPECT_NE(
      error_of([&] { MlaConfig::from_json(j, "cfg"); }).find("'index_fp8' must be true or false"),
      std::string::npos);
  j["index_fp8"] = true;
  j["index_head_dim"] = 64;
  EXPECT_NE(
      error_of([&] { MlaConfig::from_json(j, "cfg"); }).find("index_fp8 needs index_head_dim 128"),
      std::string::npos);
  json dense = v32_model_args();
  dense.erase("index_n_heads"), dense.erase("index_head_dim"), dense.erase("index_topk");
  dense["index_fp8"] = true;
  EXPECT_NE(error_of([&] {
              MlaConfig::from_json(dense, "cfg");
            }).find("index_fp8 is true but DeepSeek Sparse Attention is off"),
            std::string::npos);
  dense["index_fp8"] = false;  // false on a dense config: nothing to refuse
  EXPECT_FALSE(MlaConfig::from_json(dense, "cfg").index_fp8);
  dense["kv_fp8_round_trip"] = true;
  EXPECT_NE(error_of([&] {
              MlaConfig::from_json(dense, "cfg");
            }).find("kv_fp8_round_trip is true but DeepSeek Sparse Attention is off"),
            std::string::npos);
  j = v32_model_args();
  j["kv_fp8_round_trip"] = true;
  EXPECT_TRUE(MlaConfig::from_json(j, "cfg").to_json().at("kv_fp8_round_trip"));
  j["kv_lora_rank"] = 200;
  EXPECT_NE(error_of([&] {
              MlaConfig::from_json(j, "cfg");
            }).find("kv_fp8_round_trip needs kv_lora_rank a multiple of 128"),
            std::string::npos);
}

}  // namespace
}  // namespace laga
