// DeepSeek-V3's MoE layer and its gate against a plain-loop double reference
// (moe_reference.hpp), finite differences in double for dx and every
// weight, and the routing's edge cases: group limiting, the bias, ties.
// The layer with its experts on ranks and against PyTorch's autograd is
// test_moe_expert_parallel.cpp, the other half of this binary.
//
// Finite differences need the selection to stay put under a step of 1e-5:
// the inputs are random with O(1) spread in the scores, and every perturbed
// evaluation is checked to select exactly the experts the unperturbed one
// did (a test whose inputs sat on a routing tie would fail that check, not
// pass by luck).
#include "model/moe.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "common/check.hpp"
#include "common/error_of.hpp"
#include "core/precision.hpp"
#include "mla/ops_bf16.hpp"
#include "moe_reference.hpp"

namespace laga {
namespace {

using test::all_close;
using test::Case;
using test::grouped;
using test::make_case;
using test::params_as;
using test::ref_moe;
using test::ref_route;
using test::RefMoe;
using test::RefRoute;
using test::relative_to_largest;
using test::sig;
using test::ungrouped_unnormalised;

// ------------------------------------------------------------- routing

TEST(MoeRouting, MatchesReference) {
  MoeConfig c;
  c.n_routed_experts = 16, c.num_experts_per_tok = 4, c.n_group = 4, c.topk_group = 2;
  c.routed_scaling_factor = 2.5;
  const int N = 64, E = 16, k = 4;
  for (const auto& [scores, method, norm] :
       {std::tuple{ScoreFunc::sigmoid, TopkMethod::noaux_tc, true},
        std::tuple{ScoreFunc::sigmoid, TopkMethod::noaux_tc, false},
        std::tuple{ScoreFunc::softmax, TopkMethod::greedy, false},
        std::tuple{ScoreFunc::softmax, TopkMethod::greedy, true},
        std::tuple{ScoreFunc::softmax, TopkMethod::group_limited_greedy, false},
        std::tuple{ScoreFunc::sigmoid, TopkMethod::group_limited_greedy, true}}) {
    c.scoring_func = scores, c.topk_method = method, c.norm_topk_prob = norm;
    const bool biased = method == TopkMethod::noaux_tc;
    const auto zf = test::random_vector<float>(N * E, 11, -3, 3);
    const auto bf = biased ? test::random_vector<float>(E, 12, -0.2, 0.2) : std::vector<float>(E);
    const auto zd = test::convert<double>(zf), bd = test::convert<double>(bf);
    const Routing<double> rd = route(c, zd.data(), bd.data(), N);
    const Routing<float> rf = route(c, zf.data(), bf.data(), N);
    for (int t = 0; t < N; ++t) {
      const RefRoute ref =
          ref_route(c, std::vector<double>(zd.begin() + t * E, zd.begin() + (t + 1) * E), bd);
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(rd.expert[size_t(t * k + j)], ref.expert[j]) << "token " << t << " slot " << j;
        EXPECT_EQ(rf.expert[size_t(t * k + j)], ref.expert[j]) << "float, token " << t;
      }
      EXPECT_TRUE(
          all_close("weight", rd.weight.data() + t * k, ref.weight.data(), k, 1e-15, 1e-14));
      EXPECT_TRUE(
          all_close("weight f32", rf.weight.data() + t * k, ref.weight.data(), k, 1e-7, 1e-6));
    }
  }
}

TEST(MoeRouting, GroupLimitingMasksAGroupWithTheBestExpert) {
  MoeConfig c;
  c.n_routed_experts = 8, c.num_experts_per_tok = 2, c.n_group = 4, c.topk_group = 2;
  // Expert 0 scores best of all (sigmoid(4) = 0.98) but its group's top-2
  // sum is 0.98 + 0.02 = 1.0, below groups 1 (1.46) and 2 (1.25).
  const std::vector<double> z{4, -4, 1, 1, 0.5, 0.5, -1, -1};
  const std::vector<double> bias(8, 0.0);
  Routing<double> r = route(c, z.data(), bias.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{2, 3}));
  // Without group limiting expert 0 is chosen first.
  c.n_group = 1, c.topk_group = 1;
  r = route(c, z.data(), bias.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 2}));
}

TEST(MoeRouting, BiasSelectsButDoesNotWeight) {
  MoeConfig c;
  c.n_routed_experts = 4, c.num_experts_per_tok = 2, c.routed_scaling_factor = 2.5;
  const std::vector<double> z{2, 1, 0, -1};
  std::vector<double> bias(4, 0.0);
  EXPECT_EQ(route(c, z.data(), bias.data(), 1).expert, (std::vector<std::int32_t>{0, 1}));
  // sigmoid(-1) + 0.9 = 1.17 ranks above sigmoid(2) = 0.88: expert 3 first.
  bias[3] = 0.9;
  const Routing<double> r = route(c, z.data(), bias.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{3, 0}));
  // The weights are the unbiased scores, normalised and scaled.
  const double S = sig(-1) + sig(2);
  EXPECT_NEAR(r.weight[0], 2.5 * sig(-1) / S, 1e-15);
  EXPECT_NEAR(r.weight[1], 2.5 * sig(2) / S, 1e-15);
  // A null bias is a zero one.
  EXPECT_EQ(route(c, z.data(), static_cast<const double*>(nullptr), 1).expert,
            (std::vector<std::int32_t>{0, 1}));
}

TEST(MoeRouting, TiesGoToTheLowerIndex) {
  MoeConfig c;
  c.n_routed_experts = 8, c.num_experts_per_tok = 3, c.n_group = 4, c.topk_group = 2;
  const std::vector<double> zero(8, 0.0);
  // Every score equal: groups 0 and 1 kept, experts 0, 1, 2, equal weights.
  Routing<double> r = route(c, zero.data(), zero.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 1, 2}));
  for (double w : r.weight) EXPECT_NEAR(w, 1.0 / 3, 1e-15);
  // Groups 1 and 3 tie for first and groups 0 and 2 for the rest: 1 and 3
  // kept; in them experts 3 and 6 tie for best (3 first), then 2.
  const std::vector<double> z{0, 0, 1, 2, 0, 0, 2, 1};
  r = route(c, z.data(), zero.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{3, 6, 2}));
  // With one group kept, the tie between groups 1 and 3 goes to group 1.
  c.topk_group = 1, c.num_experts_per_tok = 2;
  r = route(c, z.data(), zero.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{3, 2}));
  c.n_group = 1, c.topk_group = 1, c.num_experts_per_tok = 1;
  const std::vector<double> z2{0, 0, 1, 0, 0, 1, 0, 0};
  EXPECT_EQ(route(c, z2.data(), zero.data(), 1).expert, (std::vector<std::int32_t>{2}));
}

TEST(MoeRouting, WeightsSumToTheScaleOrAreScaledScores) {
  MoeConfig c;
  c.n_routed_experts = 8, c.num_experts_per_tok = 3, c.routed_scaling_factor = 2.5;
  const int N = 10;
  const auto z = test::random_vector<double>(N * 8, 21, -2, 2);
  Routing<double> r = route(c, z.data(), static_cast<const double*>(nullptr), N);
  for (int t = 0; t < N; ++t)
    EXPECT_NEAR(r.weight[t * 3] + r.weight[t * 3 + 1] + r.weight[t * 3 + 2], 2.5, 1e-14);
  c.norm_topk_prob = false;
  r = route(c, z.data(), static_cast<const double*>(nullptr), N);
  for (int i = 0; i < N * 3; ++i)
    EXPECT_NEAR(r.weight[i], 2.5 * sig(z[(i / 3) * 8 + r.expert[i]]), 1e-15);
}

TEST(MoeRouting, RefusesNonFiniteLogitsAndBias) {
  MoeConfig c;
  std::vector<double> z(16, 0.0), bias(8, 0.0);
  z[11] = NAN;
  EXPECT_NE(test::error_of([&] {
              route(c, z.data(), bias.data(), 2);
            }).find("gate logit of token 1, expert 3 is nan"),
            std::string::npos);
  z[11] = 0, bias[5] = INFINITY;
  EXPECT_NE(test::error_of([&] {
              route(c, z.data(), bias.data(), 2);
            }).find("e_score_correction_bias[5] is inf"),
            std::string::npos);
}

// L = <G, w(z)> with the selection fixed: dz by route_backward vs central differences.
TEST(MoeRouting, BackwardFiniteDifferences) {
  MoeConfig c;
  c.n_routed_experts = 16, c.num_experts_per_tok = 4, c.n_group = 4, c.topk_group = 2;
  c.routed_scaling_factor = 2.5;
  const int N = 6, E = 16, k = 4;
  for (const bool norm : {true, false}) {
    c.norm_topk_prob = norm;
    auto z = test::random_vector<double>(N * E, 31, -3, 3);
    const auto bias = test::random_vector<double>(E, 32, -0.2, 0.2);
    const auto G = test::random_vector<double>(N * k, 33);
    const Routing<double> r0 = route(c, z.data(), bias.data(), N);
    const std::vector<double> dz = route_backward(c, r0, G.data());
    int moved = 0;
    auto loss = [&] {
      const Routing<double> r = route(c, z.data(), bias.data(), N);
      if (r.expert != r0.expert) ++moved;
      return test::dot(r.weight.data(), G.data(), N * k);
    };
    test::GradientCheck gc;
    gc.add("logits", z.data(), dz.data(), {N, E});
    EXPECT_TRUE(gc.run(loss)) << (norm ? "normalised" : "unnormalised");
    EXPECT_EQ(moved, 0)
        << "a finite-difference step changed the selection: the inputs sit on a tie";
  }
}

// The V2 gates: softmax scores over all E experts, so dz is dense.
TEST(MoeRouting, SoftmaxBackwardFiniteDifferences) {
  MoeConfig c;
  c.n_routed_experts = 16, c.num_experts_per_tok = 4, c.n_group = 4, c.topk_group = 2;
  c.scoring_func = ScoreFunc::softmax, c.routed_scaling_factor = 16;
  const int N = 6, E = 16, k = 4;
  for (const TopkMethod m : {TopkMethod::greedy, TopkMethod::group_limited_greedy})
    for (const bool norm : {true, false}) {
      c.topk_method = m, c.norm_topk_prob = norm;
      auto z = test::random_vector<double>(N * E, 34, -3, 3);
      const auto G = test::random_vector<double>(N * k, 35);
      const Routing<double> r0 = route(c, z.data(), static_cast<const double*>(nullptr), N);
      const std::vector<double> dz = route_backward(c, r0, G.data());
      int moved = 0, zeros = 0;
      for (const double v : dz) zeros += v == 0.0;
      // Unnormalised, every logit moves the selected p's; normalised, p_j / sum
      // of the selected p is exp(z_j) / sum of their exp(z): the others' dz is 0.
      EXPECT_EQ(zeros, norm ? N * (E - k) : 0);
      auto loss = [&] {
        const Routing<double> r = route(c, z.data(), static_cast<const double*>(nullptr), N);
        if (r.expert != r0.expert) ++moved;
        return test::dot(r.weight.data(), G.data(), N * k);
      };
      test::GradientCheck gc;
      gc.add("logits", z.data(), dz.data(), {N, E});
      EXPECT_TRUE(gc.run(loss)) << to_string(m) << (norm ? " normalised" : " unnormalised");
      EXPECT_EQ(moved, 0);
    }
}

// DeepSeek's Gate scores a group by its amax when it has no bias, by the sum
// of its top two only with one: on this token the two rules keep different
// groups (the rule laga had for every gate picked experts 2, 3 here).
TEST(MoeRouting, BiaslessGroupsScoreTheirBest) {
  MoeConfig c;
  c.n_routed_experts = 8, c.num_experts_per_tok = 2, c.n_group = 4, c.topk_group = 2;
  c.scoring_func = ScoreFunc::softmax, c.topk_method = TopkMethod::group_limited_greedy;
  c.norm_topk_prob = false, c.routed_scaling_factor = 16;
  const std::vector<double> z{4, -4, 1, 1, 0.5, 0.5, -1, -1};
  // Group maxima: 0 (e^4), then 1 (e^1): experts 0 and 2 (2 before 3: ties
  // go to the lower index).
  const Routing<double> r = route(c, z.data(), static_cast<const double*>(nullptr), 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 2}));
  double sum = 0;
  for (const double v : z) sum += std::exp(v);
  EXPECT_NEAR(r.weight[0], 16 * std::exp(4.0) / sum, 1e-14);  // not normalised: p times 16
  EXPECT_NEAR(r.weight[1], 16 * std::exp(1.0) / sum, 1e-14);
  c.topk_method = TopkMethod::noaux_tc, c.scoring_func = ScoreFunc::sigmoid;
  EXPECT_EQ(route(c, z.data(), static_cast<const double*>(nullptr), 1).expert,
            (std::vector<std::int32_t>{2, 3}));
}

// A gate without a bias refuses a non-zero one rather than ignoring it.
TEST(MoeRouting, BiaslessGateRefusesABias) {
  MoeConfig c;
  c.n_routed_experts = 4, c.num_experts_per_tok = 2;
  c.scoring_func = ScoreFunc::softmax, c.topk_method = TopkMethod::greedy;
  const std::vector<double> z{2, 1, 0, -1};
  std::vector<double> bias(4, 0.0);
  EXPECT_NO_THROW(route(c, z.data(), bias.data(), 1));
  bias[2] = 0.25;
  try {
    route(c, z.data(), bias.data(), 1);
    ADD_FAILURE() << "a bias on a greedy gate was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("e_score_correction_bias[2] is 0.25 but topk_method "
                                         "'greedy' has no bias"),
              std::string::npos)
        << e.what();
  }
}

TEST(MoeRouting, DispatchGroupsCopiesByExpert) {
  MoeConfig c;
  c.n_routed_experts = 16, c.num_experts_per_tok = 4, c.n_group = 4, c.topk_group = 2;
  const int N = 50, E = 16, k = 4;
  const auto z = test::random_vector<double>(N * E, 41, -3, 3);
  const Routing<double> r = route(c, z.data(), static_cast<const double*>(nullptr), N);
  const Dispatch d = make_dispatch(r);
  ASSERT_EQ(d.rows(), N * k);
  std::vector<std::int64_t> hist(E, 0);
  for (std::int32_t e : r.expert) ++hist[size_t(e)];
  EXPECT_EQ(d.count, hist);
  EXPECT_EQ(d.offset.front(), 0);
  EXPECT_EQ(d.offset.back(), N * k);
  for (int e = 0; e < E; ++e) EXPECT_EQ(d.offset[e + 1] - d.offset[e], d.count[e]);
  std::vector<int> hits(size_t(N * k), 0);
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) {
      const std::int64_t p = d.row[size_t(t * k + j)];
      const std::int32_t e = r.expert[size_t(t * k + j)];
      ASSERT_GE(p, d.offset[e]);
      ASSERT_LT(p, d.offset[e + 1]);  // the copy sits in its expert's rows
      EXPECT_EQ(d.token[size_t(p)], t);
      ++hits[size_t(p)];
    }
  for (int h : hits) EXPECT_EQ(h, 1);  // row is a permutation
  for (int e = 0; e < E; ++e)
    for (std::int64_t p = d.offset[e] + 1; p < d.offset[e + 1]; ++p)
      EXPECT_LT(d.token[size_t(p - 1)], d.token[size_t(p)]) << "expert " << e;
}

TEST(MoeRouting, ExpertBiasUpdate) {
  // Mean load 4: expert 0 over (down by gamma), 1 under (up), 2 and 3 even.
  const std::vector<double> b{0.5, -0.25, 0.0, 1.0};
  const std::vector<double> nb = update_expert_bias(b, {5, 3, 4, 4}, 0.01);
  ASSERT_EQ(nb.size(), 4u);
  EXPECT_DOUBLE_EQ(nb[0], 0.5 - 0.01);
  EXPECT_DOUBLE_EQ(nb[1], -0.25 + 0.01);
  EXPECT_EQ(nb[2], 0.0);
  EXPECT_EQ(nb[3], 1.0);
  // Mean 7/3: a load of 2 is under, 3 over.
  EXPECT_EQ(update_expert_bias(std::vector<float>{0, 0, 0}, {2, 2, 3}, 0.5),
            (std::vector<float>{0.5f, 0.5f, -0.5f}));
  EXPECT_NE(test::error_of([&] {
              update_expert_bias(b, {1, 2}, 0.01);
            }).find("4 biases but 2"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] {
              update_expert_bias(b, {1, 2, 3, 4}, -1);
            }).find("gamma"),
            std::string::npos);
}

// --------------------------------------------------------------- layer

void expect_matches_reference(Case& c, double atol, double rtol) {
  const MoeForward<double> f = moe_forward(c.cfg, c.w, c.x.data(), c.N, c.D);
  MoeParams<double> g = MoeParams<double>::zeros(c.cfg, c.D, MemCategory::gradients);
  const Tensor<double> dx = moe_backward(c.cfg, c.w, c.x.data(), f.saved, c.dout.data(), g);
  RefMoe ref = ref_moe(c.cfg, c.w, c.x, c.dout, c.N, c.D);
  const int k = int(c.cfg.num_experts_per_tok);
  for (int t = 0; t < c.N; ++t)
    for (int j = 0; j < k; ++j)
      ASSERT_EQ(f.saved.routing.expert[size_t(t * k + j)], ref.route[t].expert[j]) << "token " << t;
  EXPECT_TRUE(all_close("out", f.out.data(), ref.out.data(), c.N * c.D, atol, rtol));
  EXPECT_TRUE(all_close("dx", dx.data(), ref.dx.data(), c.N * c.D, atol, rtol));
  std::vector<std::pair<std::string, const Tensor<double>*>> want;
  ref.g.for_each([&](const std::string& n, Tensor<double>& t) { want.push_back({n, &t}); });
  size_t i = 0;
  g.for_each([&](const std::string& n, Tensor<double>& t) {
    const Tensor<double>& r = *want[i++].second;
    EXPECT_TRUE(all_close(n, t.data(), r.data(), t.numel(), atol, rtol));
  });
}

TEST(MoeLayer, MatchesPlainLoopReferenceDouble) {
  Case a = make_case(grouped(), 24, 16, 100);
  a.w.gate_bias[7] = -5;  // expert 7 never chosen: its rows are empty, its gradients 0
  expect_matches_reference(a, 1e-13, 1e-12);
  const MoeForward<double> f = moe_forward(a.cfg, a.w, a.x.data(), a.N, a.D);
  EXPECT_EQ(f.saved.dispatch.count[7], 0);
  Case b = make_case(ungrouped_unnormalised(), 24, 16, 200);
  expect_matches_reference(b, 1e-13, 1e-12);
}

TEST(MoeLayer, FloatMatchesDoubleReference) {
  for (const MoeConfig& cfg : {grouped(), ungrouped_unnormalised()}) {
    Case c = make_case(cfg, 24, 16, 300);
    const MoeParams<float> wf = params_as<float>(cfg, c.w, c.D);
    const auto xf = test::convert<float>(c.x), gof = test::convert<float>(c.dout);
    const MoeForward<float> f = moe_forward(cfg, wf, xf.data(), c.N, c.D);
    MoeParams<float> g = MoeParams<float>::zeros(cfg, c.D, MemCategory::gradients);
    const Tensor<float> dx = moe_backward(cfg, wf, xf.data(), f.saved, gof.data(), g);
    RefMoe ref = ref_moe(cfg, c.w, c.x, c.dout, c.N, c.D);
    const int k = int(cfg.num_experts_per_tok);
    for (int t = 0; t < c.N; ++t)
      for (int j = 0; j < k; ++j)
        ASSERT_EQ(f.saved.routing.expert[size_t(t * k + j)], ref.route[t].expert[j]);
    EXPECT_TRUE(all_close("out f32", f.out.data(), ref.out.data(), c.N * c.D, 2e-6, 2e-5));
    EXPECT_TRUE(all_close("dx f32", dx.data(), ref.dx.data(), c.N * c.D, 2e-6, 2e-5));
    std::vector<const Tensor<double>*> want;
    ref.g.for_each([&](const std::string&, Tensor<double>& t) { want.push_back(&t); });
    size_t i = 0;
    g.for_each([&](const std::string& n, Tensor<float>& t) {
      EXPECT_TRUE(all_close(n + " f32", t.data(), want[i++]->data(), t.numel(), 2e-6, 2e-5));
    });
  }
}

// Under --dtype bf16 the gate's, the shared and the routed experts' GEMMs
// round their operands (ops::linear, ops::RoutedLinears): out within the
// block's bound of the double reference, dx and every gradient within the
// gradients' (their paths are no longer than the attention block's:
// x, W1/W3, a and b, h, W2, y forward, as many again backward), and not
// fp32's result, which would mean the MoE's GEMMs stayed fp32.
// The experts' rows run whole (slice 512 > 24 rows) and in slices of 5 rows
// (moe_bf16_row_slice: RowSlicedLinears' loop, dW summed over the slices).
struct RowSlice {
  explicit RowSlice(std::int64_t rows) { moe_bf16_row_slice = rows; }
  ~RowSlice() { moe_bf16_row_slice = 512; }
};

TEST(MoeLayer, Bf16WithinItsBoundOfTheDoubleReference) {
  for (std::int64_t slice : {512, 5})
    for (const MoeConfig& cfg : {grouped(), ungrouped_unnormalised()}) {
      const RowSlice rows(slice);
      SCOPED_TRACE(cat("slice ", slice));
      Case c = make_case(cfg, 24, 16, 300);
      const MoeParams<float> wf = params_as<float>(cfg, c.w, c.D);
      const auto xf = test::convert<float>(c.x), gof = test::convert<float>(c.dout);
      RefMoe ref = ref_moe(cfg, c.w, c.x, c.dout, c.N, c.D);
      const MoeForward<float> f32 = moe_forward(cfg, wf, xf.data(), c.N, c.D);
      const UsePrecision bf16(Precision::bf16);
      const MoeForward<float> f = moe_forward(cfg, wf, xf.data(), c.N, c.D);
      MoeParams<float> g = MoeParams<float>::zeros(cfg, c.D, MemCategory::gradients);
      const Tensor<float> dx = moe_backward(cfg, wf, xf.data(), f.saved, gof.data(), g);
      // The case's gate margins are wider than bf16's rounding of the
      // logits: the same experts are chosen, so the values compare.
      const int k = int(cfg.num_experts_per_tok);
      for (int t = 0; t < c.N; ++t)
        for (int j = 0; j < k; ++j)
          ASSERT_EQ(f.saved.routing.expert[size_t(t * k + j)], ref.route[t].expert[j]);
      const double out_bound = bf16_bound_vs_exact(BlockTensor::output);
      const double grad_bound = bf16_bound_vs_exact(BlockTensor::gradient);
      const double out_err = relative_to_largest(f.out.data(), ref.out.data(), c.N * c.D);
      EXPECT_LE(out_err, out_bound);
      std::vector<double> out_f32(f32.out.data(), f32.out.data() + c.N * c.D);
      EXPECT_GT(relative_to_largest(f.out.data(), out_f32.data(), c.N * c.D), 1e-5)
          << "bf16 out equals fp32's to fp32 rounding: the MoE's GEMMs did not run bf16";
      EXPECT_LE(relative_to_largest(dx.data(), ref.dx.data(), c.N * c.D), grad_bound);
      std::vector<const Tensor<double>*> want;
      ref.g.for_each([&](const std::string&, Tensor<double>& t) { want.push_back(&t); });
      size_t i = 0;
      g.for_each([&](const std::string& n, Tensor<float>& t) {
        const Tensor<double>& r = *want[i++];
        EXPECT_LE(relative_to_largest(t.data(), r.data(), t.numel()), grad_bound) << n;
      });
    }
}

// The count-only run (the memory prediction) allocates what a real forward
// and backward do, event for event, whatever the routing: with the routing
// spread and with every token sent to the same two experts (24 rows each,
// more than a 5-row slice), fp32 and bf16 (whose operand copies are pool
// tensors: an expert's would follow its rows, RowSlicedLinears' do not).
TEST(MoeLayer, CountOnlyAllocatesWhatARealPassDoes) {
  for (Precision precision : {Precision::fp32, Precision::bf16})
    for (std::int64_t slice : {512, 5})
      for (bool skewed : {false, true}) {
        SCOPED_TRACE(cat(to_string(precision), " slice ", slice, skewed ? " skewed" : " spread"));
        const RowSlice rows(slice);
        const MoeConfig cfg = grouped();
        Case c = make_case(cfg, 24, 16, 400);
        if (skewed) {
          for (std::int64_t e = 0; e < cfg.n_routed_experts; ++e) c.w.gate_bias[e] = -50;
          c.w.gate_bias[0] = c.w.gate_bias[1] = 50;  // group 0 wins, its two experts take all
        }
        const MoeParams<float> wf = params_as<float>(cfg, c.w, c.D);
        MoeParams<float> g = MoeParams<float>::zeros(cfg, c.D, MemCategory::gradients);
        const auto xf = test::convert<float>(c.x), gof = test::convert<float>(c.dout);
        const UsePrecision use(precision);
        const auto pass = [&](bool count_only, std::int64_t* top_rows) {
          std::vector<MemoryPool::Event> trace;
          MemoryPool pool;
          pool.set_count_only(count_only);
          pool.set_trace(&trace);
          {
            const PoolScope scope(pool);
            MoeForward<float> f = moe_forward(cfg, wf, xf.data(), c.N, c.D);
            const Tensor<float> dx = moe_backward(cfg, wf, xf.data(), f.saved, gof.data(), g);
            if (top_rows)
              *top_rows =
                  *std::max_element(f.saved.dispatch.count.begin(), f.saved.dispatch.count.end());
          }
          pool.set_trace(nullptr);
          return trace;
        };
        std::int64_t top = 0;
        const auto real = pass(false, &top);
        const auto counted = pass(true, nullptr);
        EXPECT_EQ(top, skewed ? c.N : top) << "the skewed routing did not concentrate the rows";
        ASSERT_EQ(real.size(), counted.size());
        for (size_t i = 0; i < real.size(); ++i) {
          EXPECT_EQ(real[i].category, counted[i].category) << "event " << i;
          ASSERT_EQ(real[i].delta, counted[i].delta) << "event " << i;
        }
      }
}

TEST(MoeLayer, FiniteDifferencesDouble) {
  for (const MoeConfig& cfg : {grouped(), ungrouped_unnormalised()}) {
    Case c = make_case(cfg, 10, 8, 400);
    const MoeForward<double> f0 = moe_forward(cfg, c.w, c.x.data(), c.N, c.D);
    MoeParams<double> g = MoeParams<double>::zeros(cfg, c.D, MemCategory::gradients);
    const Tensor<double> dx = moe_backward(cfg, c.w, c.x.data(), f0.saved, c.dout.data(), g);
    int moved = 0;
    auto loss = [&] {
      const MoeForward<double> f = moe_forward(cfg, c.w, c.x.data(), c.N, c.D);
      if (f.saved.routing.expert != f0.saved.routing.expert) ++moved;
      return test::dot(f.out.data(), c.dout.data(), c.N * c.D);
    };
    test::GradientCheck gc;
    gc.add("x", c.x.data(), dx.data(), {c.N, c.D});
    std::vector<Tensor<double>*> grads;
    g.for_each([&](const std::string&, Tensor<double>& t) { grads.push_back(&t); }, false);
    size_t i = 0;
    c.w.for_each([&](const std::string& n,
                     Tensor<double>& t) { gc.add(n, t.data(), grads[i++]->data(), t.shape()); },
                 false);
    test::GradCheckOptions opt;
    opt.floor_per_tensor = true;
    EXPECT_TRUE(gc.run(loss, opt)) << cfg.summary();
    EXPECT_EQ(moved, 0)
        << "a finite-difference step changed the selection: the inputs sit on a tie";
    // The bias has no gradient: it is not a function of the loss's slope.
    for (std::int64_t e = 0; e < g.gate_bias.numel(); ++e) EXPECT_EQ(g.gate_bias[e], 0.0);
  }
}

TEST(MoeLayer, RefusesParamsOfAnotherShape) {
  Case c = make_case(grouped(), 4, 16, 500);
  MoeParams<double> w = MoeParams<double>::zeros(grouped(), 12, MemCategory::parameters);
  EXPECT_NE(test::error_of([&] {
              moe_forward(c.cfg, w, c.x.data(), 4, 16);
            }).find("gate.weight has shape [8, 12] but the config needs [8, 16]"),
            std::string::npos);
  MoeConfig more = grouped();
  more.n_shared_experts = 3;
  EXPECT_NE(test::error_of([&] {
              moe_forward(more, c.w, c.x.data(), 4, 16);
            }).find("shared_experts.w1.weight has shape [16, 16] but the config needs [24, 16]"),
            std::string::npos);
}

}  // namespace
}  // namespace laga
