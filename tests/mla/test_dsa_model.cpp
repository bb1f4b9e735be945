// DSA's closed forms (mla/dsa_model.hpp) against figures worked out by hand
// on a tiny config, where every term is a product of small numbers written
// out below: the wire bytes per (phase, label) of every form, the FLOPs,
// one form's memory terms, the selected-pair counts against a loop, the
// 1 GB of indices at DeepSeek-V3.2 S 128k the issue names, and the presets
// and shipped configs (configs/*.json) reading back as the presets.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "common/error_of.hpp"
#include "mla/dsa_model.hpp"

namespace laga {
namespace {

// tiny (D 48, H 4, C 24, dn 8, dr 4, dv 6) with a query latent rq 8:
// W = C + dr = 28, dqk = 12. The indexer: Hi 2, di 4, K 3.
MlaConfig tiny_q() {
  MlaConfig c = MlaConfig::preset("tiny");
  c.q_lora_rank = 8;
  return c;
}
const DsaConfig kDsa{2, 4, 3};

// Rank 0 of B 1, S 8, P 2: L_r = 4 tokens, heads 2 each; fp32 (e = 4).
struct Fixture {
  MlaConfig cfg = tiny_q();
  SpLayout layout = SpLayout::even(1, 8, 4, 2);
  CommPrediction comm(DsaForm f, bool backward = true) const {
    return dsa_predict_comm(cfg, kDsa, layout, f, 0, {4, 4}, backward, false);
  }
};

std::int64_t sent(const CommPrediction& p, Phase ph, const char* label) {
  const auto it = p.find({ph, label});
  return it == p.end() ? -1 : it->second.sent;
}

TEST(DsaComm, LatentGatherGathersTheLatentAndTheIndexKeysOnly) {
  const CommPrediction p = Fixture{}.comm(DsaForm::latent_gather);
  EXPECT_EQ(sent(p, Phase::forward, "latent_ag"), 1 * 4 * 28 * 4);  // (P-1) L W e = 448
  EXPECT_EQ(sent(p, Phase::forward, "index_k_ag"), 1 * 4 * 4 * 4);  // (P-1) L di e = 64
  EXPECT_EQ(sent(p, Phase::backward, "latent_ag"), 4 * 28 * 4);     // the peer's rows back
  EXPECT_EQ(sent(p, Phase::backward, "index_k_ag"), 4 * 4 * 4);
  EXPECT_EQ(p.size(), 4u);  // no query, output or index traffic
  EXPECT_EQ(predicted_sent(p), 448 + 64 + 448 + 64);
}

TEST(DsaComm, LagaIndicesMovesEveryQuerysTopKAndTheKlTarget) {
  const CommPrediction p = Fixture{}.comm(DsaForm::laga_indices);
  EXPECT_EQ(sent(p, Phase::forward, "q_a2a"), 4 * 2 * 12 * 4);  // L H_1 dqk e = 384
  EXPECT_EQ(sent(p, Phase::forward, "latent_ag"), 448);
  EXPECT_EQ(sent(p, Phase::forward, "index_k_ag"), 64);
  EXPECT_EQ(sent(p, Phase::forward, "topk_ag"), 4 * 3 * 4);          // (P-1) L K 4 = 48, int32
  EXPECT_EQ(sent(p, Phase::forward, "index_target_rs"), 4 * 3 * 4);  // L_1 K 4, fp32
  EXPECT_EQ(sent(p, Phase::forward, "out_a2a"), 4 * 2 * 6 * 4);      // L_1 H_0 dv e = 192
  EXPECT_EQ(sent(p, Phase::backward, "out_a2a"), 192);
  EXPECT_EQ(sent(p, Phase::backward, "q_a2a"), 384);
  EXPECT_EQ(sent(p, Phase::backward, "topk_ag"), -1);  // indices carry no gradient
  EXPECT_EQ(sent(p, Phase::backward, "index_k_ag"), 64);
}

TEST(DsaComm, IndicesStayInt32UnderBf16) {
  Fixture f;
  const CommPrediction p =
      dsa_predict_comm(f.cfg, kDsa, f.layout, DsaForm::laga_indices, 0, {2, 4}, true, false);
  EXPECT_EQ(sent(p, Phase::forward, "topk_ag"), 48);
  EXPECT_EQ(sent(p, Phase::forward, "index_target_rs"), 48);
  EXPECT_EQ(sent(p, Phase::forward, "latent_ag"), 448 / 2);
  // ... and under float64 (a registry row's terms at 8 bytes).
  CommTerms t(f.cfg, f.layout, dsa_placement(DsaForm::laga_indices), 0, 8, false);
  dsa_collectives(t, kDsa, DsaForm::laga_indices);
  EXPECT_EQ(sent(t.result, Phase::forward, "topk_ag"), 48);
  EXPECT_EQ(sent(t.result, Phase::forward, "latent_ag"), 448 * 2);
  // The KL target moves at the run's element when it is wider than fp32: a
  // float64 run's target is not rounded (mla/dsa_laga.cpp moves it so).
  EXPECT_EQ(sent(t.result, Phase::forward, "index_target_rs"), 4 * 3 * 8);
}

// The dense warm-up attends every causal key: the LAGA forms move no
// indices and no w, and the KL target spans S = 8 slots a query; the other
// forms move the same in both stages.
TEST(DsaComm, DenseWarmupMovesNoIndicesAndAWholeRowOfTarget) {
  Fixture f;
  auto warm = [&](DsaForm form) {
    return dsa_predict_comm(f.cfg, kDsa, f.layout, form, 0, {4, 4}, true, false,
                            DsaStage::dense_warmup);
  };
  const CommPrediction ind = warm(DsaForm::laga_indices);
  EXPECT_EQ(sent(ind, Phase::forward, "topk_ag"), -1);
  EXPECT_EQ(sent(ind, Phase::forward, "index_target_rs"), 4 * 8 * 4);  // L_1 S 4 = 128
  EXPECT_EQ(sent(ind, Phase::forward, "q_a2a"), 384);
  const CommPrediction rec = warm(DsaForm::laga_recompute);
  EXPECT_EQ(sent(rec, Phase::forward, "index_w_ag"), -1);
  EXPECT_EQ(sent(rec, Phase::forward, "q_latent_ag"), 128);
  EXPECT_EQ(sent(rec, Phase::forward, "index_target_rs"), 128);
  EXPECT_EQ(predicted_sent(warm(DsaForm::latent_gather)),
            predicted_sent(Fixture{}.comm(DsaForm::latent_gather)));
}

TEST(DsaComm, LagaRecomputeMovesTheQueryLatentAndWeightsNotIndices) {
  const CommPrediction p = Fixture{}.comm(DsaForm::laga_recompute);
  EXPECT_EQ(sent(p, Phase::forward, "q_latent_ag"), 4 * 8 * 4);  // (P-1) L rq e = 128
  EXPECT_EQ(sent(p, Phase::forward, "q_a2a"), -1);
  EXPECT_EQ(sent(p, Phase::forward, "index_w_ag"), 4 * 2 * 4);  // (P-1) L Hi e = 32
  EXPECT_EQ(sent(p, Phase::forward, "topk_ag"), -1);
  EXPECT_EQ(sent(p, Phase::forward, "index_target_rs"), 48);
}

TEST(DsaComm, ExplicitMovesPerHeadKeysAndValues) {
  const CommPrediction p = Fixture{}.comm(DsaForm::explicit_form);
  EXPECT_EQ(sent(p, Phase::forward, "k_a2a"), 4 * 2 * 12 * 4);  // 384
  EXPECT_EQ(sent(p, Phase::forward, "v_a2a"), 4 * 2 * 6 * 4);   // 192
  EXPECT_EQ(sent(p, Phase::forward, "latent_ag"), -1);
  EXPECT_EQ(sent(p, Phase::forward, "topk_ag"), 48);
}

// The dense warm-up attends every causal key: the explicit form moves no
// indices, and the KL target holds S slots a row (the peer's L_1 S = 32
// values); a float64 run moves it at 8 bytes (at fp32 its KL would be off
// by 1e-7; mla_test_dsa_explicit holds the engine's ledger to both).
TEST(DsaComm, ExplicitWarmupMovesNoIndicesAndTheTargetAtEveryKey) {
  Fixture f;
  const CommPrediction w = dsa_predict_comm(f.cfg, kDsa, f.layout, DsaForm::explicit_form, 0,
                                            {4, 4}, true, false, DsaStage::dense_warmup);
  EXPECT_EQ(sent(w, Phase::forward, "topk_ag"), -1);
  EXPECT_EQ(sent(w, Phase::forward, "index_target_rs"), 4 * 8 * 4);  // L_1 S 4 = 128
  EXPECT_EQ(sent(w, Phase::forward, "k_a2a"), 384);
  const CommPrediction d =
      dsa_predict_comm(f.cfg, kDsa, f.layout, DsaForm::explicit_form, 0, {8, 8}, true, false);
  EXPECT_EQ(sent(d, Phase::forward, "index_target_rs"), 4 * 3 * 8);  // L_1 K 8 = 96
  EXPECT_EQ(sent(d, Phase::forward, "topk_ag"), 48);                 // int32 still
}

TEST(DsaComm, RingLatentPassesIndexKeysThenLatentAndBringsGradientsHome) {
  const CommPrediction p = Fixture{}.comm(DsaForm::ring_latent);
  // Blocks of L_j di = 16 and L_j W = 112 elements; P - 1 = 1 shift sends
  // all but the block received last (rank 1's): 16 e and 112 e.
  EXPECT_EQ(sent(p, Phase::forward, "index_k_ring"), 16 * 4);
  EXPECT_EQ(sent(p, Phase::forward, "latent_ring"), 112 * 4);
  EXPECT_EQ(sent(p, Phase::backward, "index_k_ring"), 16 * 4);
  EXPECT_EQ(sent(p, Phase::backward, "dindex_k_ring"), 32 * 4);  // home: every block, P calls
  EXPECT_EQ(sent(p, Phase::backward, "dlatent_ring"), 224 * 4);
  EXPECT_EQ(p.at({Phase::backward, "dlatent_ring"}).calls, 2);
}

TEST(DsaComm, GradientAllReduceAddsTheIndexersParameters) {
  Fixture f;
  // The indexer: wq_b 2*4 x 8 = 64, wk 4 x 48 = 192, k_norm 2*4 = 8,
  // weights_proj 2 x 48 = 96: 360 parameters.
  EXPECT_EQ(kDsa.parameter_count(f.cfg), 360);
  // At P 2 a rank sends (n - c) + c = n elements; the dense block's n is 4640
  // (comm_model.cpp's count: 776 + 1344 + 24 + 1344 + 1152).
  const CommPrediction p =
      dsa_predict_comm(f.cfg, kDsa, f.layout, DsaForm::laga_indices, 0, {4, 4}, true, true);
  EXPECT_EQ(sent(p, Phase::grad_sync, "grad_allreduce"), (4640 + 360) * 4);
  const CommPrediction dense = predict_comm(f.cfg, f.layout, Form::laga, 0, 4, true, true);
  EXPECT_EQ(sent(dense, Phase::grad_sync, "grad_allreduce") + 360 * 4,
            sent(p, Phase::grad_sync, "grad_allreduce"));
}

TEST(DsaComm, UnevenShards) {
  // Ranks of 3 and 5 tokens: rank 0 gathers out 3 rows and back 5.
  const MlaConfig cfg = tiny_q();
  const SpLayout layout = SpLayout::custom(1, {3, 5}, {2, 2});
  const CommPrediction p =
      dsa_predict_comm(cfg, kDsa, layout, DsaForm::latent_gather, 0, {4, 4}, true, false);
  EXPECT_EQ(sent(p, Phase::forward, "latent_ag"), 3 * 28 * 4);
  EXPECT_EQ(p.at({Phase::forward, "latent_ag"}).received, 5 * 28 * 4);
  EXPECT_EQ(sent(p, Phase::backward, "index_k_ag"), 5 * 4 * 4);
  const CommPrediction q =
      dsa_predict_comm(cfg, kDsa, layout, DsaForm::laga_indices, 1, {4, 4}, true, false);
  EXPECT_EQ(sent(q, Phase::forward, "topk_ag"), 5 * 3 * 4);
  EXPECT_EQ(sent(q, Phase::forward, "index_target_rs"), 3 * 3 * 4);  // rank 0's 3 queries
  // Rank 1's rows 3..7 select 3 keys each (K 3): 15 pairs; its indexer
  // pairs 4 + 5 + 6 + 7 + 8 = 30.
  const DsaRankWork w = dsa_work(cfg, kDsa, layout, DsaForm::latent_gather, 1);
  EXPECT_EQ(w.forward.attention_flops, 2.0 * 15 * 4 * 52);
  EXPECT_EQ(w.forward.indexer_flops, 30.0 * 20);
}

TEST(DsaPairs, CountsAgainstALoop) {
  for (std::int64_t K : {1, 3, 5, 100}) {
    const std::vector<TokenRange> rows{{0, 4}, {6, 13}};
    std::int64_t sel = 0, idx = 0;
    for (const TokenRange& r : rows)
      for (std::int64_t t = r.begin; t < r.end; ++t) sel += std::min(K, t + 1), idx += t + 1;
    EXPECT_EQ(dsa_selected_pairs(rows, K), sel) << K;
    EXPECT_EQ(dsa_indexer_pairs(rows), idx);
  }
}

TEST(DsaWork, FlopsOfTheTinyCaseByHand) {
  Fixture f;
  // Rank 0's rows 0..3 select 1 + 2 + 3 + 3 = 9 pairs (K 3); all 8 rows 21.
  // Its indexer pairs: 1 + 2 + 3 + 4 = 10; all rows': 36.
  const DsaRankWork g = dsa_work(f.cfg, kDsa, f.layout, DsaForm::latent_gather, 0);
  EXPECT_EQ(g.forward.attention_flops, 2.0 * 9 * 4 * (28 + 24));  // H (W + C), latent space
  EXPECT_EQ(g.forward.indexer_flops, 10.0 * 2 * (2 * 4 + 2));     // Hi (2 di + 2) a pair
  EXPECT_EQ(g.backward.indexer_flops, 3.0 * 9 * 2 * 2 * 4);       // 3 x selected x Hi 2 di
  EXPECT_EQ(g.backward.attention_flops, g.forward.attention_flops * (3.0 * 28 + 2 * 24) / 52);
  const DsaRankWork l = dsa_work(f.cfg, kDsa, f.layout, DsaForm::laga_indices, 0);
  EXPECT_EQ(l.forward.attention_flops, 2.0 * 21 * 2 * (12 + 6));  // every row, H_r 2
  EXPECT_EQ(l.forward.indexer_flops, 200.0);
  const DsaRankWork r = dsa_work(f.cfg, kDsa, f.layout, DsaForm::laga_recompute, 0);
  EXPECT_EQ(r.forward.indexer_flops, 36.0 * 20);  // every query's indexer
  // GEMMs of latent_gather forward: wq_a + wkv_a 2*4*48*(8+28) = 13824, wo
  // 2*4*4*6*48 = 9216, wk + weights_proj 2*4*48*(4+2) = 2304, wq_b
  // 2*4*8*4*12 = 3072, W_UK 2*4*4*8*24 = 6144, W_UV 2*4*4*24*6 = 4608, the
  // indexer's wq_b 2*4*8*2*4 = 512.
  EXPECT_EQ(g.forward.gemm_flops, 13824.0 + 9216 + 2304 + 3072 + 6144 + 4608 + 512);
  // Backward: the MLA's twice, the indexer's projections once (2304 + 512).
  EXPECT_EQ(g.backward.gemm_flops, 2.0 * (13824 + 9216 + 3072 + 6144 + 4608) + 2304 + 512);
}

TEST(DsaMemory, LatentGatherTermsByHand) {
  Fixture f;
  const DsaMemory m = dsa_memory(f.cfg, kDsa, f.layout, DsaForm::latent_gather, 0, RunDtype::fp32);
  // Rank 0 (L 4, Sk 4) when backward begins, in 4-byte elements: its rows'
  // qa, qr 4*8 each, rstd_q 4, q 4*4*12, kv 4*28, rstd_kv 4; the indexer's
  // k_pre 4*4, its mean and rstd 2*4; the latent 4*28 and values 4*24 up
  // to Sk; the indices 4*3; the absorbed q 4*4*28, latent output 4*4*24,
  // wo input 4*4*6, lse 4*4; the output 4*48; the KL's gradients of q_I
  // 4*2*4, of k_I up to Sk 4*4 and of w 4*2.
  const std::int64_t saved = 32 + 32 + 4 + 192 + 112 + 4 + 16 + 8 + 112 + 96 + 12 + 448 + 384 + 96 +
                             16 + 192 + 32 + 16 + 8;
  EXPECT_EQ(m.saved, 4 * saved);
  // Forward's peak: the KL's gradients made while its target p 4*3, q_I
  // 4*2*4, w 4*2 and k_I up to Sk 4*4 still live.
  EXPECT_EQ(m.forward_peak, 4 * (saved + 12 + 32 + 8 + 16));
  // Backward's: the indexer's tensors gone (-80), dx 4*48 and the latent
  // output's gradient 4*4*24 made, the wo input 4*4*6 gone (and dO), then the
  // attention's gradients d absorbed q 4*4*28, d latent 4*28, d values 4*24.
  EXPECT_EQ(m.peak, 4 * (saved - 80 + 192 - 96 + 384 + 448 + 112 + 96));
  EXPECT_EQ(m.peak_where, "backward: d values (B, Sk, C)");
}

TEST(DsaComm, DeepSeekV32IndicesAreAGigabyteAtS128k) {
  const MlaConfig cfg = MlaConfig::preset("deepseek-v3.2");
  const DsaConfig dsa = *DsaConfig::preset("deepseek-v3.2");
  const SpLayout layout = SpLayout::even(1, 131072, cfg.n_heads, 8);
  const CommPrediction p =
      dsa_predict_comm(cfg, dsa, layout, DsaForm::laga_indices, 0, {2, 4}, false, false);
  // Every rank receives the other 7/8 of S x 2048 int32 indices.
  EXPECT_EQ(p.at({Phase::forward, "topk_ag"}).received, std::int64_t(131072 - 16384) * 2048 * 4);
  // ... 7.3x the bf16 latent it gathers.
  EXPECT_EQ(p.at({Phase::forward, "latent_ag"}).received, std::int64_t(131072 - 16384) * 576 * 2);
}

TEST(DsaConfigTest, PresetsAndJson) {
  const DsaConfig v32 = *DsaConfig::preset("deepseek-v3.2");
  EXPECT_EQ(v32.index_n_heads, 64);
  EXPECT_EQ(v32.index_head_dim, 128);
  EXPECT_EQ(v32.index_topk, 2048);
  EXPECT_EQ(DsaConfig::preset("glm-5-like")->index_n_heads, 32);
  EXPECT_FALSE(DsaConfig::preset("deepseek-v3"));
  EXPECT_FALSE(DsaConfig::from_json(nlohmann::json{{"dim", 8}}, "c"));
  EXPECT_NE(
      test::error_of([] {
        DsaConfig::from_json(nlohmann::json{{"index_topk", 2048}, {"index_n_heads", 64}}, "c.json");
      }).find("c.json: 'index_head_dim' is missing"),
      std::string::npos);
  EXPECT_NE(test::error_of([] {
              DsaConfig{64, 128, 2048}.validate(MlaConfig::preset("paper"));
            }).find("q_lora_rank > 0"),
            std::string::npos);
  EXPECT_NE(test::error_of([] {
              DsaConfig{64, 16, 2048}.validate(MlaConfig::preset("deepseek-v3"));
            }).find("index_head_dim 16 is narrower than qk_rope_head_dim 64"),
            std::string::npos);
}

// configs/*.json are the presets, key for key, in Hugging Face's names.
TEST(DsaConfigTest, ShippedConfigsAreThePresets) {
  const char* src = std::getenv("LAGA_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "LAGA_SOURCE_DIR is set by ctest (tests/CMakeLists.txt)";
  for (const char* name : {"deepseek-v3.2", "glm-5-like"}) {
    const std::string path = std::string(src) + "/configs/" + name + ".json";
    // The MLA's keys (an MlaConfig that reads the index keys itself writes
    // them too; the indexer is compared below).
    auto mla_keys = [](nlohmann::json j) {
      for (const char* k : {"index_n_heads", "index_head_dim", "index_topk"}) j.erase(k);
      return j;
    };
    EXPECT_EQ(mla_keys(MlaConfig::from_json_file(path).to_json()),
              mla_keys(MlaConfig::preset(name).to_json()))
        << name;
    const std::optional<DsaConfig> d = DsaConfig::from_json(read_config_json_file(path), path);
    ASSERT_TRUE(d) << name;
    const DsaConfig want = *DsaConfig::preset(name);
    EXPECT_EQ(d->index_n_heads, want.index_n_heads);
    EXPECT_EQ(d->index_head_dim, want.index_head_dim);
    EXPECT_EQ(d->index_topk, want.index_topk);
  }
  // Kimi K3-like: dense MLA dims (its NoPE and output gate are the kimi
  // work's keys, mla_use_nope and mla_use_output_gate), 96 heads, W 576.
  const MlaConfig k = MlaConfig::from_json_file(std::string(src) + "/configs/kimi-k3-like.json");
  EXPECT_EQ(k.n_heads, 96);
  EXPECT_EQ(k.kv_lora_rank + k.qk_rope_head_dim, 576);
  EXPECT_FALSE(DsaConfig::from_json(
      read_config_json_file(std::string(src) + "/configs/kimi-k3-like.json"), "kimi"));
}

}  // namespace
}  // namespace laga
