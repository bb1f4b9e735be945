// DeepSeek-V3's MoE layer with its experts folded onto ranks (expert
// parallelism, in one group and in EP groups) against the plain-loop double
// reference (moe_reference.hpp) and the closed form of its ledger, in
// double, float and bf16, bit for bit at every thread count; and the layer
// against PyTorch's autograd (python/torch_reference_moe.py), alone and on
// 3 ranks. The second half of model_test_moe; the routing and the layer
// alone are test_moe.cpp.
#include "model/moe.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/dry_run_comm.hpp"
#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "common/error_of.hpp"
#include "core/precision.hpp"
#include "io/safetensors.hpp"
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
using test::RefMoe;
using test::relative_to_largest;
using test::ungrouped_unnormalised;

// ------------------------------------------------- expert parallelism

// One rank's part of an expert-parallel forward + backward: its rows of out
// and dx, its gradients (MoeParams::for_each's order; copied out, since the
// rank's tensors live in its pool), its routing's counts and its ledger.
template <class T>
struct EpRank {
  std::vector<T> out, dx;
  std::vector<std::vector<T>> g;
  std::vector<std::int64_t> count;
  Ledger ledger;
};

// The N tokens split over P ranks as the sequence is (the first N % P one
// more); every rank runs the layer on its rows with the experts folded.
// threads > 0: each rank's OpenMP team size; degree: the EP groups' size
// (0: all P ranks in one).
template <class T>
std::vector<EpRank<T>> run_ep(Case& c, int P, int threads = 0, int degree = 0) {
  const MoeParams<T> w = params_as<T>(c.cfg, c.w, c.D);
  const auto x = test::convert<T>(c.x), go = test::convert<T>(c.dout);
  const size_t ranks_n = static_cast<size_t>(P);
  std::vector<std::int64_t> n(ranks_n), off(ranks_n, 0);
  for (int j = 0; j < P; ++j) n[size_t(j)] = c.N / P + (j < c.N % P ? 1 : 0);
  for (int j = 1; j < P; ++j) off[size_t(j)] = off[size_t(j - 1)] + n[size_t(j - 1)];
  std::vector<EpRank<T>> ranks(ranks_n);
  run_local_ranks(P, [&](Communicator& comm) {
    if (threads > 0) omp_set_num_threads(threads);
    const int r = comm.rank();
    const ExpertParallel ep = ExpertParallel::folded(comm, c.cfg.n_routed_experts, n, degree);
    const T* xr = x.data() + off[size_t(r)] * c.D;
    const MoeForward<T> f = moe_forward(c.cfg, w, xr, n[size_t(r)], c.D, &ep);
    EpRank<T>& me = ranks[size_t(r)];
    MoeParams<T> g = MoeParams<T>::zeros(c.cfg, c.D, MemCategory::gradients);
    const Tensor<T> dx =
        moe_backward(c.cfg, w, xr, f.saved, go.data() + off[size_t(r)] * c.D, g, &ep);
    g.for_each([&](const std::string&, Tensor<T>& t) {
      me.g.emplace_back(t.data(), t.data() + t.numel());
    });
    me.out.assign(f.out.data(), f.out.data() + f.out.numel());
    me.dx.assign(dx.data(), dx.data() + dx.numel());
    me.count = f.saved.dispatch.count;
    me.ledger = comm.ledger();
  });
  return ranks;
}

std::int64_t sent(const Ledger& l, Phase phase, const std::string& label) {
  const auto it = l.entries().find({phase, label});
  return it == l.entries().end() ? 0 : it->second.bytes_sent;
}

// The ranks' rows one after the other (their out and dx), and their
// routing's counts, row i rank i's.
template <class T>
struct Assembled {
  std::vector<T> out, dx;
  std::vector<std::vector<std::int64_t>> counts;
};
template <class T>
Assembled<T> assembled(const std::vector<EpRank<T>>& ranks) {
  Assembled<T> a;
  for (const auto& r : ranks) {
    a.out.insert(a.out.end(), r.out.begin(), r.out.end());
    a.dx.insert(a.dx.end(), r.dx.begin(), r.dx.end());
    a.counts.push_back(r.count);
  }
  return a;
}

// Every rank's ledger against moe_ep_bytes of the routing's counts at
// `elem` bytes a row element, per label and phase.
template <class T>
void expect_ledgers_are_the_closed_form(const std::vector<EpRank<T>>& ranks,
                                        const ExpertParallel& ep,
                                        const std::vector<std::vector<std::int64_t>>& counts,
                                        std::int64_t D, std::int64_t elem) {
  for (int r = 0; r < int(ranks.size()); ++r) {
    const Ledger& l = ranks[size_t(r)].ledger;
    const MoeEpBytes b = moe_ep_bytes(ep, counts, r, D, elem);
    EXPECT_EQ(sent(l, Phase::forward, "moe_counts"), b.counts) << "rank " << r;
    EXPECT_EQ(sent(l, Phase::forward, "moe_dispatch"), b.dispatch) << "rank " << r;
    EXPECT_EQ(sent(l, Phase::forward, "moe_combine"), b.combine) << "rank " << r;
    EXPECT_EQ(sent(l, Phase::backward, "dmoe_combine"), b.dispatch) << "rank " << r;
    EXPECT_EQ(sent(l, Phase::backward, "dmoe_dispatch"), b.combine) << "rank " << r;
    EXPECT_EQ(l.bytes_sent(), b.counts + 2 * (b.dispatch + b.combine)) << "rank " << r;
    if (ranks.size() > 1) {
      EXPECT_GT(b.dispatch + b.combine, 0) << "rank " << r;
    }
  }
}

// Folded onto P ranks, with P not dividing E and P > E (a rank with no
// experts), and in EP groups of G < P ranks (each group holding every
// expert: G 2 and 3, E % G != 0), the layer gives the plain-loop
// reference's out and dx, and the gradients summed over ranks are the
// reference's; each rank's gradient of an expert it does not own is
// exactly 0; the ledger is the closed form moe_ep_bytes of the routing's
// counts, byte for byte, per label and phase (nothing sent outside a group).
TEST(MoeExpertParallel, MatchesTheReferenceAndTheClosedFormAtEveryP) {
  const std::vector<std::pair<int, int>> placements = {{1, 0}, {2, 0}, {3, 0}, {5, 0}, {7, 0},
                                                       {9, 0}, {4, 2}, {6, 3}, {6, 2}, {9, 3}};
  for (const MoeConfig& cfg : {grouped(), ungrouped_unnormalised()}) {
    Case c = make_case(cfg, 13, 16, 600);
    RefMoe ref = ref_moe(cfg, c.w, c.x, c.dout, c.N, c.D);
    for (const auto& [P, degree] : placements) {
      SCOPED_TRACE(cfg.summary() + " P " + std::to_string(P) + " EP " +
                   std::to_string(degree == 0 ? P : degree));
      const std::vector<EpRank<double>> ranks = run_ep<double>(c, P, 0, degree);
      const std::vector<std::string> names = [&] {
        std::vector<std::string> v;
        c.w.for_each([&](const std::string& name, Tensor<double>&) { v.push_back(name); });
        return v;
      }();
      const auto [out, dx, counts] = assembled(ranks);
      EXPECT_TRUE(all_close("out", out.data(), ref.out.data(), c.N * c.D, 1e-13, 1e-12));
      EXPECT_TRUE(all_close("dx", dx.data(), ref.dx.data(), c.N * c.D, 1e-13, 1e-12));
      // The gradients: summed over ranks; an expert's only on its owner.
      std::vector<std::vector<double>> sum = ranks[0].g;
      for (int r = 1; r < P; ++r)
        for (size_t i = 0; i < sum.size(); ++i)
          for (size_t j = 0; j < sum[i].size(); ++j) sum[i][j] += ranks[size_t(r)].g[i][j];
      size_t i = 0;
      ref.g.for_each([&](const std::string& name, Tensor<double>& t) {
        EXPECT_TRUE(all_close(name, sum[i].data(), t.data(), t.numel(), 1e-13, 1e-12));
        ++i;
      });
      // The placement by hand: slot s of G owns E / G experts, the first
      // E % G slots one more; rank r is slot r % G.
      const int G = degree == 0 ? P : degree;
      std::vector<std::int64_t> first(size_t(G + 1), 0);
      for (int s = 0; s < G; ++s)
        first[size_t(s + 1)] =
            first[size_t(s)] + cfg.n_routed_experts / G + (s < cfg.n_routed_experts % G ? 1 : 0);
      for (int r = 0; r < P; ++r)
        for (std::int64_t e = 0; e < cfg.n_routed_experts; ++e) {
          if (e >= first[size_t(r % G)] && e < first[size_t(r % G + 1)]) continue;
          const std::string pre = "experts." + std::to_string(e) + ".";
          for (size_t t = 0; t < names.size(); ++t) {
            if (names[t].rfind(pre, 0) != 0) continue;
            for (double v : ranks[size_t(r)].g[t])
              ASSERT_EQ(v, 0.0) << "rank " << r << " " << names[t];
          }
        }
      // The ledger against the closed form, which the counts determine.
      DryRunCommunicator group(0, P);  // only its size
      const ExpertParallel ep = ExpertParallel::folded(
          group, cfg.n_routed_experts, std::vector<std::int64_t>(size_t(P), 1), degree);
      ASSERT_EQ(ep.first, first);
      expect_ledgers_are_the_closed_form(ranks, ep, counts, c.D, 8);
    }
  }
}

// Under --dtype bf16 the dispatch and combine (and their backward) move
// the routed rows as bf16 (mla/wire.hpp): each rank's ledger is
// moe_ep_bytes at 2 bytes an element (the counts stay f64), and out and dx
// stay within the bf16 bounds of the double reference at P 2 and 3.
TEST(MoeExpertParallel, Bf16MovesTheRowsAsBf16) {
  // MoeLayer.Bf16WithinItsBoundOfTheDoubleReference's case: its gate margins
  // are wider than bf16's rounding, so every rank routes as the reference.
  Case c = make_case(grouped(), 24, 16, 300);
  const RefMoe ref = ref_moe(c.cfg, c.w, c.x, c.dout, c.N, c.D);
  for (int P : {2, 3}) {
    SCOPED_TRACE("P " + std::to_string(P));
    const UsePrecision bf16(Precision::bf16);
    const std::vector<EpRank<float>> ranks = run_ep<float>(c, P);
    const auto [out, dx, counts] = assembled(ranks);
    EXPECT_LE(relative_to_largest(out.data(), ref.out.data(), c.N * c.D),
              bf16_bound_vs_exact(BlockTensor::output));
    EXPECT_LE(relative_to_largest(dx.data(), ref.dx.data(), c.N * c.D),
              bf16_bound_vs_exact(BlockTensor::gradient));
    DryRunCommunicator group(0, P);  // only its size
    const ExpertParallel ep = ExpertParallel::folded(group, c.cfg.n_routed_experts,
                                                     std::vector<std::int64_t>(size_t(P), 1));
    expect_ledgers_are_the_closed_form(ranks, ep, counts, c.D, 2);
  }
}

// In float: at P 1 expert parallelism is the local layer bit for bit; at P 3
// the owners' GEMMs see other rows beside each copy and the weight
// gradients sum in another order, so it agrees to float rounding only.
TEST(MoeExpertParallel, FloatIsTheLocalLayerAtOneRankAndCloseAtThree) {
  Case c = make_case(grouped(), 13, 16, 700);
  const MoeParams<float> wf = params_as<float>(c.cfg, c.w, c.D);
  const auto xf = test::convert<float>(c.x), gof = test::convert<float>(c.dout);
  const MoeForward<float> f = moe_forward(c.cfg, wf, xf.data(), c.N, c.D);
  MoeParams<float> g = MoeParams<float>::zeros(c.cfg, c.D, MemCategory::gradients);
  const Tensor<float> dx = moe_backward(c.cfg, wf, xf.data(), f.saved, gof.data(), g);
  const std::vector<EpRank<float>> one = run_ep<float>(c, 1);
  EXPECT_EQ(one[0].out, std::vector<float>(f.out.data(), f.out.data() + f.out.numel()));
  EXPECT_EQ(one[0].dx, std::vector<float>(dx.data(), dx.data() + dx.numel()));
  size_t i = 0;
  g.for_each([&](const std::string& n, Tensor<float>& t) {
    EXPECT_EQ(one[0].g[i++], std::vector<float>(t.data(), t.data() + t.numel())) << n;
  });
  const RefMoe ref = ref_moe(c.cfg, c.w, c.x, c.dout, c.N, c.D);
  const std::vector<EpRank<float>> three = run_ep<float>(c, 3);
  std::vector<float> out;
  for (const auto& r : three) out.insert(out.end(), r.out.begin(), r.out.end());
  EXPECT_TRUE(all_close("out f32 P 3", out.data(), ref.out.data(), c.N * c.D, 2e-6, 2e-5));
}

// Deterministic: the same inputs give the same bits whatever each rank's
// thread count (the permutations are counting sorts, the combine adds each
// token's copies in slot order, the owners' rows arrive in rank order).
TEST(MoeExpertParallel, BitwiseTheSameAtEveryThreadCount) {
  Case c = make_case(grouped(), 29, 16, 900);
  const std::vector<EpRank<float>> one = run_ep<float>(c, 3, 1);
  for (int threads : {2, 3}) {
    const std::vector<EpRank<float>> many = run_ep<float>(c, 3, threads);
    for (size_t r = 0; r < one.size(); ++r) {
      EXPECT_EQ(many[r].out, one[r].out) << "rank " << r << ", " << threads << " threads";
      EXPECT_EQ(many[r].dx, one[r].dx) << "rank " << r << ", " << threads << " threads";
      EXPECT_EQ(many[r].g, one[r].g) << "rank " << r << ", " << threads << " threads";
    }
  }
}

TEST(MoeExpertParallel, RefusesAPlacementOfAnotherGroup) {
  Case c = make_case(grouped(), 4, 16, 800);
  run_local_ranks(2, [&](Communicator& comm) {
    const ExpertParallel wrong = ExpertParallel::folded(comm, 6, {2, 2});  // 6 experts, not 8
    const double* x = c.x.data() + comm.rank() * 2 * c.D;
    EXPECT_NE(test::error_of([&] {
                moe_forward(c.cfg, c.w, x, 2, c.D, &wrong);
              }).find("expert-parallel placement is not this group's"),
              std::string::npos);
  });
  run_local_ranks(2, [&](Communicator& comm) {
    EXPECT_NE(test::error_of([&] {
                ExpertParallel::folded(comm, 8, {4});
              }).find("given the token counts of 1"),
              std::string::npos);
  });
  DryRunCommunicator three(0, 3);
  EXPECT_NE(test::error_of([&] {
              ExpertParallel::folded(three, 8, {1, 1, 1}, 2);
            }).find("--ep 2 must divide the 3 ranks of --sp"),
            std::string::npos);
}

// ------------------------------------------------ the PyTorch reference

// python/torch_reference_moe.py: DeepSeek-V3's Gate/Expert/MoE in PyTorch
// autograd, float64, written from DeepSeek's model.py (fixture
// model_torch_moe_data). The C++ layer in double selects the same experts
// and gives its out, dx and every gradient to rounding (1e-13 absolute,
// 1e-12 relative); so does the layer with its experts folded onto 3 ranks.
class MoeTorchReference : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeTorchReference, LayerMatchesAutograd) {
  const char* tmp = std::getenv("LAGA_TEST_TMP");
  const std::string path =
      std::string(tmp ? tmp : ".") + "/torch_moe/moe_" + GetParam() + ".safetensors";
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing: ctest runs model_torch_moe_data first (needs /usr/bin/python3 "
      << "with torch: scripts/setup.sh installs python3-torch)";
  const SafetensorsFile f = SafetensorsFile::open(path);
  const nlohmann::json meta = nlohmann::json::parse(f.metadata().at("config"));
  const MoeConfig cfg = *MoeConfig::from_json(meta, path);
  const int N = std::stoi(f.metadata().at("tokens")), D = std::stoi(f.metadata().at("dim"));
  Case c{cfg, N, D, MoeParams<double>::zeros(cfg, D, MemCategory::parameters), {}, {}};
  c.w.for_each([&](const std::string& name, Tensor<double>& t) { f.read_into(name, t); });
  const auto vec = [&](const std::string& name) {
    const Tensor<double> t = f.read<double>(name, MemCategory::activations);
    return std::vector<double>(t.data(), t.data() + t.numel());
  };
  c.x = vec("x");
  c.dout = vec("dout");
  const std::vector<double> out = vec("out"), dx_ref = vec("dx"), idx = vec("indices");
  const MoeForward<double> fw = moe_forward(cfg, c.w, c.x.data(), N, D);
  MoeParams<double> g = MoeParams<double>::zeros(cfg, D, MemCategory::gradients);
  const Tensor<double> dx = moe_backward(cfg, c.w, c.x.data(), fw.saved, c.dout.data(), g);
  // torch.topk lists the experts best first, as Routing::expert does.
  for (size_t i = 0; i < idx.size(); ++i)
    ASSERT_EQ(fw.saved.routing.expert[i], std::int32_t(idx[i])) << "copy " << i;
  EXPECT_TRUE(all_close("out", fw.out.data(), out.data(), N * D, 1e-13, 1e-12));
  EXPECT_TRUE(all_close("dx", dx.data(), dx_ref.data(), N * D, 1e-13, 1e-12));
  std::vector<std::vector<double>> want;
  g.for_each(
      [&](const std::string& name, Tensor<double>& t) {
        const std::vector<double> r = vec("grad." + name);
        EXPECT_TRUE(all_close(name, t.data(), r.data(), t.numel(), 1e-13, 1e-12));
        want.push_back(r);
      },
      false);
  const std::vector<EpRank<double>> ranks = run_ep<double>(c, 3);
  std::vector<double> ep_out;
  for (const auto& r : ranks) ep_out.insert(ep_out.end(), r.out.begin(), r.out.end());
  EXPECT_TRUE(all_close("out, experts on 3 ranks", ep_out.data(), out.data(), N * D, 1e-13, 1e-12));
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeTorchReference,
                         ::testing::Values("grouped", "ungrouped_unnormalised", "v2_grouped",
                                           "v2_greedy", "v2_greedy_normalised"));

}  // namespace
}  // namespace laga
