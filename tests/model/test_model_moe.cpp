// The language model with DeepSeek-V3's MoE FFN in its layers >=
// first_k_dense_replace (docs/moe.md, "In the model"): finite differences in
// double of the loss for every parameter tensor (gate, experts, shared
// experts), P = 2 against P = 1, a config whose MoE starts past the last
// layer is the dense model bit for bit, the checkpoint round trip, the
// config's refusals, training (the loss falls, the expert bias moves only by
// the balancing rule, resume is exact) and the memory prediction.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "common/error_of.hpp"
#include "common/lm_batch.hpp"
#include "common/scratch.hpp"
#include "core/memory_pool.hpp"
#include "mla/ops.hpp"
#include "model/checkpoint.hpp"
#include "model/model.hpp"
#include "model/train.hpp"

namespace laga {
namespace {

using test::Batch;
using test::batch;
using test::losses;
using test::shard;

namespace fs = std::filesystem;
using test::error_of;

LmConfig dense_tiny() {
  LmConfig c = LmConfig::derive(24, 3, 3, 13, 64);  // dn = dv = 8, dr = 4, C = 32
  c.ffn_hidden = 20;
  return c;
}

// 6 experts in 2 groups of 3, a token may use 1 group and 2 experts of it,
// one shared expert, scale 1.5, normalised: every part of V3's gate. Layer 0
// dense, layers 1 and 2 MoE, so layer 2's routing depends on layer 1's.
MoeConfig tiny_moe() {
  MoeConfig m;
  m.n_routed_experts = 6;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = 8;
  m.n_shared_experts = 1;
  m.n_group = 2;
  m.topk_group = 1;
  m.routed_scaling_factor = 1.5;
  m.norm_topk_prob = true;
  m.first_k_dense_replace = 1;
  return m;
}

LmConfig moe_tiny() {
  LmConfig c = dense_tiny();
  c.moe = tiny_moe();
  return c;
}

// Seeded parameters with every 1-D tensor moved off its initial value (norm
// gains off 1, the expert biases off 0), so a gain the backward ignores shows
// up and the biases take part in the selection.
LmParams<double> test_params(const LmConfig& cfg) {
  LmParams<double> w = LmParams<double>::zeros(cfg, MemCategory::parameters);
  init_lm_params(w, 5);
  w.for_each([](const std::string&, Tensor<double>& t) {
    if (t.rank() == 1)
      for (std::int64_t i = 0; i < t.numel(); ++i) t[i] += 0.1 * std::sin(double(i) + 1.0);
  });
  return w;
}

std::vector<std::string> names_of(const LmParams<double>& w) {
  std::vector<std::string> n;
  w.for_each([&](const std::string& name, const Tensor<double>&) { n.push_back(name); });
  return n;
}

// The MoE layers' moe_dispatch all-to-alls of a run, over every rank: the
// calls and the bytes sent (the folded placement's token copies to their
// experts' ranks; every_rank issues none).
struct Dispatched {
  std::int64_t calls = 0, bytes = 0;
};

// (loss, every gradient by name) of one forward+backward on P local ranks;
// with `dispatched`, what its moe_dispatch calls moved.
test::LossAndGrads run(const LmConfig& cfg, int P, const Batch& bt, Form form = Form::laga,
                       ExpertPlacement experts = ExpertPlacement::every_rank, int expert_degree = 0,
                       Dispatched* dispatched = nullptr) {
  std::mutex mu;
  return test::loss_and_grads(
      cfg, form, AttentionKind::eager, P, bt, test_params, [&](LmContext& ctx) {
        ctx.experts = experts;
        ctx.expert_degree = expert_degree;
        if (!dispatched) return;
        ctx.comm.set_observer([&mu, dispatched](const CollectiveEvent& e) {
          if (e.what != CollectiveEvent::What::issued || e.label != "moe_dispatch") return;
          std::lock_guard<std::mutex> lock(mu);
          ++dispatched->calls, dispatched->bytes += e.bytes.sent;
        });
      });
}

TEST(ModelMoe, ParametersNamesShapesAndCounts) {
  const LmConfig cfg = moe_tiny();
  const LmParams<double> w = test_params(cfg);
  const std::vector<std::string> names = names_of(w);
  const auto has = [&](const std::string& n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  EXPECT_TRUE(has("layers.0.ffn.w1.weight"));
  EXPECT_FALSE(has("layers.0.ffn.gate.weight"));
  for (const std::string l : {"1", "2"}) {
    const std::string p = "layers." + l + ".ffn.";
    EXPECT_FALSE(has(p + "w1.weight"));
    for (const std::string n :
         {"gate.weight", "gate.bias", "experts.0.w1.weight", "experts.5.w2.weight",
          "experts.5.w3.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
          "shared_experts.w3.weight"})
      EXPECT_TRUE(has(p + n)) << p + n;
  }
  // The count: the dense model's, with layers 1 and 2's FFN (3 F D) replaced
  // by gate (E D) + bias (E) + E experts (3 I D) + the shared one (3 I D).
  const LmConfig dense = dense_tiny();
  const std::int64_t D = 24, F = 20, E = 6, I = 8;
  const std::int64_t moe_ffn = E * D + E + E * 3 * I * D + 3 * I * D;
  EXPECT_EQ(
      LmParams<double>::zeros(cfg, MemCategory::parameters).numel(),
      LmParams<double>::zeros(dense, MemCategory::parameters).numel() + 2 * (moe_ffn - 3 * F * D));
  // init: the expert bias starts at 0 (no correction), the gate is N(0, 1/D).
  LmParams<double> fresh = LmParams<double>::zeros(cfg, MemCategory::parameters);
  init_lm_params(fresh, 5);
  for (std::int64_t e = 0; e < E; ++e) EXPECT_EQ(fresh.layers[1].moe.gate_bias[e], 0.0);
  EXPECT_NE(fresh.layers[1].moe.gate[0], 0.0);
  EXPECT_FALSE(lm_param_trains("layers.1.ffn.gate.bias"));
  EXPECT_FALSE(lm_param_decays("layers.1.ffn.gate.bias"));
  EXPECT_TRUE(lm_param_trains("layers.1.ffn.gate.weight"));
  EXPECT_TRUE(lm_param_decays("layers.1.ffn.experts.3.w2.weight"));
}

// Central differences in double for every parameter tensor, the gate, the
// routed and shared experts and the expert bias included.
//
// The selection of experts is piecewise constant in the parameters, and the
// loss jumps where two experts' (or two groups') biased scores cross, so a
// difference taken across such a tie is meaningless. The inputs are chosen
// away from ties: the gate's logits z = x W_g^T are O(1) (W_g is N(0, 1/D) on
// RMS-normalised rows), the biases are 0.1 sin(.), so the scores of 14 tokens
// over 6 experts are spread over (0.2, 0.8). The gap between the k-th and
// (k+1)-th kept biased score of a token was measured at 0.032 at least, and
// between its topk_group-th and next group score at 0.0099 at least, while a
// step of h = 1e-5 in one parameter moves any score by ~1e-5 (the scores'
// derivatives are O(1)). That is asserted, not assumed: every perturbed forward records its
// routing (LmContext::routing) and must select exactly the experts of the
// unperturbed one, so every difference below is taken where the selection is
// locally constant. The expert bias's gradient is then 0 on both sides.
TEST(ModelMoe, FiniteDifferencesEveryParameterDouble) {
  const LmConfig cfg = moe_tiny();
  const Batch bt = batch(cfg);
  auto comm = make_self_communicator();
  const SpLayout layout = SpLayout::even(bt.B, bt.S, cfg.mla.n_heads, 1);
  const RopeTable rope(cfg.mla.rope(), bt.S);
  ExpertRouting base, probe;
  LmContext ctx{cfg, layout, *comm, rope, Form::laga, AttentionKind::eager};
  LmParams<double> w = test_params(cfg);
  LmParams<double> g = LmParams<double>::zeros(cfg, MemCategory::gradients);
  ctx.routing = &base;
  const double loss = lm_forward_backward(ctx, w, bt.tok.data(), bt.tgt.data(), g);
  EXPECT_TRUE(std::isfinite(loss));
  ASSERT_EQ(base.expert.size(), 3u);
  EXPECT_TRUE(base.expert[0].empty());  // the dense layer
  ASSERT_EQ(base.expert[1].size(), size_t(bt.B * bt.S * 2));
  ASSERT_EQ(base.expert[2].size(), size_t(bt.B * bt.S * 2));
  // Some expert of each MoE layer gets no token and another several: the
  // check covers experts with and without rows.
  for (size_t l : {1u, 2u}) {
    std::int64_t sum = 0;
    for (std::int64_t c : base.count[l]) sum += c;
    EXPECT_EQ(sum, bt.B * bt.S * 2);
  }
  test::GradientCheck gc;
  std::vector<Tensor<double>*> gs;
  g.for_each([&](const std::string&, Tensor<double>& t) { gs.push_back(&t); });
  size_t k = 0;
  std::vector<std::string> checked;
  w.for_each([&](const std::string& n, Tensor<double>& t) {
    gc.add(n, t.data(), gs[k++]->data(), t.shape());
    checked.push_back(n);
  });
  ASSERT_EQ(checked, names_of(w));
  test::GradCheckOptions opt;
  opt.max_elements = 12;
  opt.tol = 1e-5;
  opt.floor_per_tensor = true;
  int evaluations = 0, reroutes = 0;
  ctx.routing = &probe;
  EXPECT_TRUE(gc.run(
      [&] {
        const double l = lm_loss(ctx, w, bt.tok.data(), bt.tgt.data());
        ++evaluations;
        reroutes += probe.expert != base.expert;
        return l;
      },
      opt));
  EXPECT_EQ(reroutes, 0) << "of " << evaluations << " perturbed forwards";
  EXPECT_GT(gc.last_checked(), 500);
  // The gate's gradient is not 0: the weights' path through the scores is in.
  double gate = 0;
  for (std::int64_t i = 0; i < g.layers[2].moe.gate.numel(); ++i)
    gate += std::abs(g.layers[2].moe.gate[i]);
  EXPECT_GT(gate, 1e-6);
  for (std::int64_t e = 0; e < 6; ++e) EXPECT_EQ(g.layers[1].moe.gate_bias[e], 0.0);
}

// The MoE is token-local, so the sequence-parallel model with MoE layers has
// the gradients of one rank, in every form: with every expert on every rank
// at P 2, and with the experts folded onto the ranks (expert parallelism) at
// P 2, 3 and 4 (6 experts: 3, 2 and 1 or 2 per rank; uneven shards of S 7),
// and in EP groups of 2 at P 4 (two groups, each holding all 6 experts).
// Every placement gives the same numbers, so the placement is checked as
// run, not ignored: folded runs dispatch tokens (moe_dispatch bytes), every
// rank runs none, and EP 2 at P 4 moves other bytes than EP 4 (its tokens go
// to the 2 ranks of their group only).
TEST(ModelMoe, EveryFormAndPlacementMatchesP1) {
  const LmConfig cfg = moe_tiny();
  const Batch bt = batch(cfg);
  const auto ref = run(cfg, 1, bt, Form::explicit_form);
  struct Placement {
    ExpertPlacement experts;
    int P, degree;
  };
  const std::vector<Placement> cases = {{ExpertPlacement::every_rank, 2, 0},
                                        {ExpertPlacement::folded, 2, 0},
                                        {ExpertPlacement::folded, 3, 0},
                                        {ExpertPlacement::folded, 4, 0},
                                        {ExpertPlacement::folded, 4, 2}};
  std::map<int, std::int64_t> dispatched_at_p4;  // by EP degree (0: 4)
  for (const auto& [experts, P, degree] : cases)
    for (Form f : all_forms()) {
      if (P == 4 && f != Form::laga) continue;  // 4 ranks: one form is enough
      SCOPED_TRACE(cat(to_string(f), " P ", P, " experts ", to_string(experts), " EP ",
                       degree == 0 ? P : degree));
      Dispatched moved;
      const auto got = run(cfg, P, bt, f, experts, degree, &moved);
      EXPECT_NEAR(got.first, ref.first, 1e-13);
      for (const auto& [name, v] : ref.second)
        EXPECT_TRUE(test::all_close(name, got.second.at(name), v, 1e-12, 1e-9));
      if (experts == ExpertPlacement::every_rank) {
        EXPECT_EQ(moved.calls, 0) << "every rank runs every expert: nothing to dispatch";
      } else {
        EXPECT_GT(moved.calls, 0) << "folded experts, and no token was dispatched to them";
        EXPECT_GT(moved.bytes, 0);
      }
      if (P == 4) dispatched_at_p4[degree] = moved.bytes;
    }
  EXPECT_NE(dispatched_at_p4.at(2), dispatched_at_p4.at(0))
      << "EP 2 at P 4 moved what EP 4 moves: the EP degree was not run";
}

// The paper's "temporally separated, never contending" (§3.4): with laga's
// started collectives on (--overlap on) and the experts folded onto the
// ranks, no MoE collective is issued while an attention collective is in
// flight, on any rank, in forward or backward. Read from each rank's own
// order of events (the communicator's observer); the run must issue both
// kinds, or the statement would hold vacuously.
TEST(ModelMoe, ExpertParallelCollectivesNeverOverlapAttentionOnes) {
  const LmConfig cfg = moe_tiny();
  const Batch bt = batch(cfg);
  const int P = 3;
  std::mutex mu;
  std::vector<std::string> violations;
  std::int64_t moe_calls = 0, started_calls = 0;
  run_local_ranks(P, [&](Communicator& comm) {
    std::set<std::int64_t> in_flight;
    std::int64_t moe = 0, started = 0;
    std::vector<std::string> bad;
    comm.set_observer([&](const CollectiveEvent& e) {
      if (e.what == CollectiveEvent::What::waited) {
        in_flight.erase(e.id);
        return;
      }
      const bool is_moe = e.label.rfind("moe_", 0) == 0 || e.label.rfind("dmoe_", 0) == 0;
      if (is_moe) {
        ++moe;
        if (!in_flight.empty())
          bad.push_back(cat("rank ", comm.rank(), ": ", e.label, " issued with ", in_flight.size(),
                            " attention collective(s) in flight"));
      }
      if (e.started) ++started, in_flight.insert(e.id);
    });
    const SpLayout layout = SpLayout::even(bt.B, bt.S, cfg.mla.n_heads, P);
    const RopeTable rope(cfg.mla.rope(), bt.S);
    LmContext ctx{cfg,
                  layout,
                  comm,
                  rope,
                  FormVariant(Form::laga, QueryExchange::heads, 0, Overlap::on),
                  AttentionKind::flash};
    ctx.experts = ExpertPlacement::folded;
    const LmParams<double> w = test_params(cfg);
    LmParams<double> g = LmParams<double>::zeros(cfg, MemCategory::gradients);
    const auto off = layout.shard_begin(comm.rank());
    const auto L = layout.seq_count[size_t(comm.rank())];
    auto tok = shard(bt.tok, bt.B, bt.S, off, L), tgt = shard(bt.tgt, bt.B, bt.S, off, L);
    lm_forward_backward(ctx, w, tok.data(), tgt.data(), g);
    comm.set_observer({});
    std::lock_guard<std::mutex> lock(mu);
    violations.insert(violations.end(), bad.begin(), bad.end());
    moe_calls += moe, started_calls += started;
  });
  EXPECT_TRUE(violations.empty()) << violations.front();
  EXPECT_EQ(moe_calls, P * 2 * 5);  // 2 MoE layers x (counts, dispatch, combine, 2 backward)
  EXPECT_GT(started_calls, 0);      // laga's overlap did start its collectives
}

// An MoE whose first_k_dense_replace is at or past the last layer leaves
// every layer dense: the same parameters, loss and gradients as the model
// without an MoE, bit for bit. One MoE layer fewer dense changes them.
TEST(ModelMoe, DenseOnlyConfigIsTheDenseModelBitForBit) {
  const LmConfig dense = dense_tiny();
  const Batch bt = batch(dense);
  const auto ref = run(dense, 1, bt);
  for (std::int64_t k : {dense.layers, dense.layers + 4}) {
    LmConfig cfg = dense_tiny();
    cfg.moe = tiny_moe();
    cfg.moe->first_k_dense_replace = k;
    SCOPED_TRACE(cat("first_k_dense_replace ", k));
    EXPECT_EQ(names_of(test_params(cfg)), names_of(test_params(dense)));
    const auto got = run(cfg, 1, bt);
    EXPECT_EQ(got.first, ref.first);
    ASSERT_EQ(got.second.size(), ref.second.size());
    for (const auto& [name, v] : ref.second)
      EXPECT_TRUE(
          test::all_equal(name, got.second.at(name).data(), v.data(), std::int64_t(v.size())));
  }
  LmConfig last = dense_tiny();
  last.moe = tiny_moe();
  last.moe->first_k_dense_replace = dense.layers - 1;
  const auto moe = run(last, 1, bt);
  EXPECT_NE(moe.first, ref.first);
  EXPECT_EQ(moe.second.count("layers.2.ffn.gate.weight"), 1u);
  EXPECT_EQ(moe.second.count("layers.1.ffn.w1.weight"), 1u);
}

template <class T>
std::map<std::string, std::vector<T>> contents(const LmParams<T>& p) {
  std::map<std::string, std::vector<T>> out;
  p.for_each([&](const std::string& n, const Tensor<T>& t) {
    out[n].assign(t.data(), t.data() + t.numel());
  });
  return out;
}

// Parameters (the expert biases, set off 0, included) and both AdamW moments
// of every MoE tensor survive save and load bit for bit.
TEST(ModelMoe, CheckpointRoundTripIsBitwise) {
  const fs::path dir = test::scratch_dir("model_moe_", "checkpoint");
  LmConfig cfg = moe_tiny();
  cfg.bias_update_speed = 1e-3;
  TrainState<float> st;
  st.params = LmParams<float>::zeros(cfg, MemCategory::parameters);
  st.m = LmParams<float>::zeros(cfg, MemCategory::optimizer);
  st.v = LmParams<float>::zeros(cfg, MemCategory::optimizer);
  init_lm_params(st.params, 7);
  init_lm_params(st.m, 8);
  init_lm_params(st.v, 9);
  int salt = 0;
  for (LmParams<float>* p : {&st.params, &st.m, &st.v})
    p->for_each([&](const std::string&, Tensor<float>& t) {
      for (std::int64_t i = 0; i < t.numel(); ++i) t[i] += float(0.01 * std::sin(i + ++salt));
    });
  st.step = 3;
  st.data_cursor = 6;
  st.seed = 4;
  save_checkpoint(dir.string(), cfg, st, CheckpointOptions{{"seq", "7"}});
  TrainState<float> back;
  back.params = LmParams<float>::zeros(cfg, MemCategory::parameters);
  back.m = LmParams<float>::zeros(cfg, MemCategory::optimizer);
  back.v = LmParams<float>::zeros(cfg, MemCategory::optimizer);
  load_checkpoint(dir.string(), cfg, back);
  EXPECT_EQ(back.step, 3);
  EXPECT_EQ(back.data_cursor, 6);
  const auto want = contents(st.params), got = contents(back.params);
  EXPECT_EQ(got.at("layers.2.ffn.gate.bias"), want.at("layers.2.ffn.gate.bias"));
  EXPECT_NE(want.at("layers.2.ffn.gate.bias")[0], 0.0f);
  EXPECT_EQ(got, want);
  EXPECT_EQ(contents(back.m), contents(st.m));
  EXPECT_EQ(contents(back.v), contents(st.v));
  // The MoE settings are the model's: a checkpoint of this model does not
  // load into another MoE.
  LmConfig other = cfg;
  other.moe->num_experts_per_tok = 3;
  TrainState<float> wrong;
  wrong.params = LmParams<float>::zeros(other, MemCategory::parameters);
  wrong.m = LmParams<float>::zeros(other, MemCategory::optimizer);
  wrong.v = LmParams<float>::zeros(other, MemCategory::optimizer);
  const std::string e = error_of([&] { load_checkpoint(dir.string(), other, wrong); });
  EXPECT_NE(e.find("num_experts_per_tok: 2 -> 3"), std::string::npos) << e;
}

TEST(ModelMoe, BadSettingsAreRefusedNamingTheField) {
  LmConfig c = moe_tiny();
  c.bias_update_speed = -1;
  std::string e = error_of([&] { c.validate(); });
  EXPECT_NE(e.find("bias_update_speed must be finite and >= 0"), std::string::npos) << e;
  c = dense_tiny();
  c.bias_update_speed = 1e-3;
  e = error_of([&] { c.validate(); });
  EXPECT_NE(e.find("bias_update_speed 0.001 steers the biases of MoE experts"), std::string::npos)
      << e;
  c = moe_tiny();
  c.moe->n_group = 4;
  e = error_of([&] { c.validate(); });
  EXPECT_NE(e.find("n_routed_experts 6 is not a multiple of n_group (n_expert_groups) 4"),
            std::string::npos)
      << e;
  c = moe_tiny();
  c.moe->first_k_dense_replace = -1;
  e = error_of([&] { c.validate(); });
  EXPECT_NE(e.find("first_k_dense_replace (n_dense_layers) must be >= 0"), std::string::npos) << e;
  EXPECT_NO_THROW(moe_tiny().validate());
}

// One model in both config formats reads to one LmConfig; a dense model's
// JSON (what a checkpoint records) has no MoE key, as before the MoE.
TEST(ModelMoe, ConfigFromBothFormats) {
  const nlohmann::json hf = {{"hidden_size", 24},
                             {"num_attention_heads", 3},
                             {"q_lora_rank", nullptr},
                             {"kv_lora_rank", 32},
                             {"qk_nope_head_dim", 8},
                             {"qk_rope_head_dim", 4},
                             {"v_head_dim", 8},
                             {"max_position_embeddings", 4096},
                             {"num_hidden_layers", 3},
                             {"vocab_size", 13},
                             {"intermediate_size", 20},
                             {"rms_norm_eps", 1e-5},
                             {"n_routed_experts", 6},
                             {"num_experts_per_tok", 2},
                             {"moe_intermediate_size", 8},
                             {"n_shared_experts", 1},
                             {"n_group", 2},
                             {"topk_group", 1},
                             {"routed_scaling_factor", 1.5},
                             {"scoring_func", "sigmoid"},
                             {"topk_method", "noaux_tc"},
                             {"norm_topk_prob", true},
                             {"first_k_dense_replace", 1},
                             {"bias_update_speed", 0.25}};
  const nlohmann::json args = {{"dim", 24},
                               {"n_heads", 3},
                               {"kv_lora_rank", 32},
                               {"qk_nope_head_dim", 8},
                               {"qk_rope_head_dim", 4},
                               {"v_head_dim", 8},
                               {"original_seq_len", 4096},
                               {"max_seq_len", 4096},
                               {"n_layers", 3},
                               {"vocab_size", 13},
                               {"inter_dim", 20},
                               {"lm_norm_eps", 1e-5},
                               {"n_routed_experts", 6},
                               {"n_activated_experts", 2},
                               {"moe_inter_dim", 8},
                               {"n_shared_experts", 1},
                               {"n_expert_groups", 2},
                               {"n_limited_groups", 1},
                               {"route_scale", 1.5},
                               {"score_func", "sigmoid"},
                               {"topk_method", "noaux_tc"},  // a bias at dim 24 (laga's key)
                               {"n_dense_layers", 1},
                               {"bias_update_speed", 0.25}};
  const LmConfig a = LmConfig::from_json(hf), b = LmConfig::from_json(args);
  EXPECT_EQ(a.to_json(), b.to_json());
  EXPECT_EQ(a.layers, 3);
  EXPECT_EQ(a.vocab, 13);
  EXPECT_EQ(a.hidden(), 20);
  EXPECT_EQ(a.norm_eps, 1e-5);
  EXPECT_EQ(a.bias_update_speed, 0.25);
  ASSERT_TRUE(a.moe.has_value());
  EXPECT_EQ(a.moe->to_json(), tiny_moe().to_json());
  EXPECT_FALSE(a.is_moe_layer(0));
  EXPECT_TRUE(a.is_moe_layer(1));
  // Without experts, a dense model, and its JSON has no MoE key.
  nlohmann::json dense = hf;
  dense["n_routed_experts"] = 0;
  dense.erase("bias_update_speed");
  const LmConfig d = LmConfig::from_json(dense);
  EXPECT_FALSE(d.moe.has_value());
  EXPECT_FALSE(d.to_json().contains("n_routed_experts"));
  EXPECT_FALSE(d.to_json().contains("bias_update_speed"));
  EXPECT_EQ(d.to_json(),
            [] {
              LmConfig c = LmConfig::derive(24, 3, 3, 13, 64);
              c.ffn_hidden = 20;
              c.norm_eps = 1e-5;
              return c;
            }()
                .to_json());
  // Refusals name the source and the key.
  nlohmann::json j = hf;
  j.erase("num_hidden_layers");
  EXPECT_NE(error_of([&] {
              LmConfig::from_json(j, "cfg.json");
            }).find("cfg.json: missing 'num_hidden_layers'"),
            std::string::npos);
  j = hf;
  j["vocab_size"] = 1;
  EXPECT_NE(error_of([&] {
              LmConfig::from_json(j, "cfg.json");
            }).find("cfg.json: 'vocab_size' 1 must be in [2, 2^31 - 1]"),
            std::string::npos);
  j = hf;
  j.erase("intermediate_size");
  EXPECT_NE(error_of([&] {
              LmConfig::from_json(j, "cfg.json");
            }).find("cfg.json: missing 'intermediate_size'"),
            std::string::npos);
  j["first_k_dense_replace"] = 0;  // every layer MoE: no dense width needed
  EXPECT_NO_THROW(LmConfig::from_json(j, "cfg.json"));
  j = hf;
  j["bias_update_speed"] = -0.5;
  EXPECT_NE(error_of([&] {
              LmConfig::from_json(j, "cfg.json");
            }).find("cfg.json: model: bias_update_speed must be finite and >= 0"),
            std::string::npos);
  j = args;
  j["n_expert_groups"] = 4;
  EXPECT_NE(error_of([&] {
              LmConfig::from_json(j, "cfg.json");
            }).find("cfg.json: moe: n_routed_experts 6 is not a multiple of n_group"),
            std::string::npos);
}

TrainOptions moe_train(int sp, std::int64_t steps) {
  TrainOptions o;
  o.model = LmConfig::derive(32, 4, 2, 64, 32);
  o.model.moe = tiny_moe();
  o.model.moe->moe_intermediate_size = 16;
  o.variant.form = Form::laga;
  o.sp = sp;
  o.batch = 2;
  o.seq = 32;
  o.steps = steps;
  o.seed = 3;
  o.adam.lr = 3e-3;
  return o;
}

TEST(ModelMoe, TrainingLowersTheLoss) {
  const auto a = train_local(moe_train(2, 12));
  ASSERT_EQ(a.size(), 12u);
  EXPECT_NEAR(a[0].loss, std::log(64.0), 1.0);  // ~ln V at init
  EXPECT_LT(a.back().loss, a[0].loss - 1.0);    // memorising the fixed batch
}

// The expert bias moves only by the balancing rule: after n steps at speed
// gamma each bias is an integer multiple of gamma in [-n gamma, n gamma],
// and not all are 0; at speed 0 it stays exactly 0. Its gradient slot is
// poisoned with 1 after every backward (and weight decay is on): an AdamW
// step on the bias would move it off those multiples and fill its moments.
TEST(ModelMoe, ExpertBiasMovesByTheBalancingRuleOnly) {
  const std::int64_t steps = 10;
  const double gamma = 1.0 / 64;  // a power of 2: the multiples are exact in float
  for (const double speed : {gamma, 0.0}) {
    SCOPED_TRACE(cat("bias_update_speed ", speed));
    const fs::path dir = test::scratch_dir("model_moe_", speed > 0 ? "bias" : "bias0");
    TrainOptions o = moe_train(2, steps);
    o.model.bias_update_speed = speed;
    o.adam.weight_decay = 0.1;
    o.checkpoint_dir = dir.string();
    // Every rank's replica of the bias, seen at each step: the load the rule
    // reads is the whole group's, so all ranks move theirs alike.
    std::mutex mu;
    std::map<std::int64_t, std::vector<std::vector<float>>> seen;
    o.after_backward = [&](std::int64_t step, const LmParams<float>& p, LmParams<float>& g) {
      g.layers[1].moe.gate_bias.fill(1.0f);
      const Tensor<float>& b = p.layers[1].moe.gate_bias;
      const std::lock_guard<std::mutex> lock(mu);
      seen[step].emplace_back(b.data(), b.data() + b.numel());
    };
    train_local(o);
    ASSERT_EQ(seen.size(), size_t(steps));
    for (const auto& [step, replicas] : seen) {
      ASSERT_EQ(replicas.size(), 2u);
      EXPECT_EQ(replicas[0], replicas[1]) << "step " << step;
    }
    if (speed > 0) {
      EXPECT_NE(seen.at(steps)[0], seen.at(1)[0]);
    }
    TrainState<float> st;
    st.params = LmParams<float>::zeros(o.model, MemCategory::parameters);
    st.m = LmParams<float>::zeros(o.model, MemCategory::optimizer);
    st.v = LmParams<float>::zeros(o.model, MemCategory::optimizer);
    load_checkpoint(dir.string(), o.model, st);
    int nonzero = 0;
    const Tensor<float>& b = st.params.layers[1].moe.gate_bias;
    for (std::int64_t e = 0; e < b.numel(); ++e) {
      if (speed == 0) {
        EXPECT_EQ(b[e], 0.0f);
        continue;
      }
      const double q = double(b[e]) / gamma;
      EXPECT_EQ(q, std::round(q)) << "expert " << e;
      EXPECT_LE(std::abs(q), double(steps));
      nonzero += b[e] != 0;
    }
    if (speed > 0) {
      EXPECT_GT(nonzero, 0);
    }
    // Its AdamW moments are never touched.
    for (std::int64_t e = 0; e < b.numel(); ++e) {
      EXPECT_EQ(st.m.layers[1].moe.gate_bias[e], 0.0f);
      EXPECT_EQ(st.v.layers[1].moe.gate_bias[e], 0.0f);
    }
  }
}

// A resumed MoE run continues exactly: the biases the balancing moved are in
// the checkpoint (a run that lost them would route differently).
TEST(ModelMoe, ResumeIsBitIdentical) {
  const fs::path dir = test::scratch_dir("model_moe_", "resume");
  TrainOptions o = moe_train(2, 12);
  o.model.bias_update_speed = 1.0 / 64;
  const auto straight = train_local(o);
  TrainOptions first = o;
  first.steps = 6;
  first.checkpoint_dir = dir.string();
  const auto a = train_local(first);
  TrainOptions second = o;
  second.resume = dir.string();
  const auto b = train_local(second);
  ASSERT_EQ(b.size(), 6u);
  std::vector<double> joined = losses(a), tail = losses(b);
  joined.insert(joined.end(), tail.begin(), tail.end());
  EXPECT_EQ(joined, losses(straight));
  // And the bias update changed the run (so the resume had something to keep).
  TrainOptions still = o;
  still.model.bias_update_speed = 0;
  EXPECT_NE(losses(train_local(still)), losses(straight));
}

// bf16 training holds the layers' kept tensors at 2 bytes (the norms'
// outputs, the dense FFN's and the experts' activations, the attention's q,
// k, v and o_loc: mla/ops.hpp, keep_narrowed), which changes no bit: the
// same losses and gradient norms step after step with them held narrowed and
// with them kept in fp32, at P 1-3, every rank running every expert and
// experts folded onto the ranks, for laga and explicit; and every rank's
// pool holds fewer activations at its peak.
TEST(ModelMoe, Bf16KeptTensorsHeldAt2BytesChangeNoBit) {
  struct Restore {
    ~Restore() { ops::narrow_kept_tensors = true; }
  } restore;
  for (int sp : {1, 2, 3})
    for (ExpertPlacement experts : {ExpertPlacement::every_rank, ExpertPlacement::folded})
      for (Form form : {Form::laga, Form::explicit_form}) {
        TrainOptions o = moe_train(sp, 3);
        o.model.bias_update_speed = 1.0 / 64;
        o.variant.form = form;
        o.experts = experts;
        o.attention = AttentionKind::flash;
        o.precision = Precision::bf16;
        SCOPED_TRACE(cat(to_string(form), " P=", sp, " ", to_string(experts)));
        // Every rank's losses, and its pool's peak of activations.
        const auto run = [&](bool narrow) {
          ops::narrow_kept_tensors = narrow;
          std::vector<MemoryPool> pools(static_cast<size_t>(sp));
          LocalRunOptions r;
          r.pools = &pools;
          std::vector<StepRecord> logs;
          run_local_ranks(
              sp,
              [&](Communicator& comm) {
                train_rank(comm, o, [&](const StepRecord& s) { logs.push_back(s); });
              },
              r);
          std::vector<std::int64_t> peaks;
          for (const MemoryPool& p : pools) peaks.push_back(p.peak(MemCategory::activations));
          return std::pair{logs, peaks};
        };
        const auto [held, held_peaks] = run(true);
        const auto [kept, kept_peaks] = run(false);
        ASSERT_EQ(held.size(), kept.size());
        EXPECT_EQ(losses(held), losses(kept));
        for (size_t i = 0; i < held.size(); ++i) EXPECT_EQ(held[i].grad_norm, kept[i].grad_norm);
        for (int r = 0; r < sp; ++r)
          EXPECT_LT(held_peaks[size_t(r)], kept_peaks[size_t(r)]) << "rank " << r;
      }
}

// Each rank's pool after a real in-process run of o (flash attention, which
// bf16 needs, at o's precision).
std::vector<MemoryPool> pools_of_a_real_run(TrainOptions o, Precision precision) {
  o.precision = precision;
  o.attention = AttentionKind::flash;
  std::vector<MemoryPool> pools(size_t(o.sp));
  LocalRunOptions run;
  run.pools = &pools;
  run_local_ranks(
      o.sp, [&](Communicator& comm) { train_rank(comm, o, nullptr); }, run);
  return pools;
}
std::vector<TrainMemory> predicted_memory(TrainOptions o, Precision precision) {
  o.precision = precision;
  o.attention = AttentionKind::flash;
  return predict_train_memory(o, StagingRule::in_process);
}

// The count-only run (laga train's memory check) allocates what a real MoE
// step does: its prediction is the measured peak exactly, fp32 and bf16.
TEST(ModelMoe, MemoryPredictionEqualsTheMeasuredPeak) {
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(to_string(precision));
    TrainOptions o = moe_train(2, 2);
    o.model.bias_update_speed = 1.0 / 64;
    const std::vector<TrainMemory> predicted = predicted_memory(o, precision);
    const std::vector<MemoryPool> pools = pools_of_a_real_run(o, precision);
    for (size_t r = 0; r < pools.size(); ++r) {
      EXPECT_EQ(predicted[r].step_peak, pools[r].peak_total()) << "rank " << r;
      EXPECT_EQ(predicted[r].state, pools[r].peak(MemCategory::parameters) +
                                        pools[r].peak(MemCategory::optimizer) +
                                        pools[r].peak(MemCategory::gradients));
    }
  }
}

// Under expert parallelism a rank's receive buffers hold what the routing
// sends it, which a count-only run cannot know: it sizes them by the uniform
// expectation (ExpertParallel::expected_rows). With every token routed to
// every expert (k = E) the routing is that expectation exactly, and the
// prediction is the measured peak, byte for byte, at P 3 (4 experts: 2, 1, 1).
TEST(ModelMoe, ExpertParallelMemoryPredictionIsExactUnderBalancedRouting) {
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(to_string(precision));
    TrainOptions o = moe_train(3, 2);
    MoeConfig& m = *o.model.moe;
    m.n_routed_experts = 4, m.num_experts_per_tok = 4, m.n_group = 1, m.topk_group = 1;
    o.experts = ExpertPlacement::folded;
    const std::vector<TrainMemory> predicted = predicted_memory(o, precision);
    const std::vector<MemoryPool> pools = pools_of_a_real_run(o, precision);
    for (size_t r = 0; r < pools.size(); ++r)
      EXPECT_EQ(predicted[r].step_peak, pools[r].peak_total()) << "rank " << r;
  }
}

}  // namespace
}  // namespace laga
