// DeepSeek Sparse Attention in bf16 mixed precision (docs/forms.md, "DSA in
// bf16"): the DSA forms at P 2, 3 and 4 (uneven shards and heads) under
// UsePrecision(bf16) -- the latent gather, explicit, LAGA with indices
// moved and recomputed -- against single-rank dsa_block in bf16: every
// rank's out, dx and selection, the summed weight gradients and the
// indexer's KL and its gradients, and every rank's ledger against
// dsa_predict_comm at bf16's wire ("On the wire": bf16 activations, the
// indices and the KL target at 4 bytes), also on a case (S 48) where the
// selection turns on bf16's rounding of the indexer's values, which every
// form and the block round where they are made; explicit's selection past bf16's
// integers (S 300) attended as selected; the block in bf16 against fp32 in
// the dense warm-up (no selection to differ);
// and the indexer's top-k on bf16 values: two keys that differ in fp32 below
// bf16's resolution tie in bf16, and the tie rule gives the lower key, the
// same for every split of the query rows.
//
// The bounds are the block's (mla/ops_bf16.hpp, "what a bf16 block run
// meets", relative to each tensor's largest element): a form at P > 1 against
// the block, two bf16 runs that round at different places (a form rounds
// its own operands: per-head k and v or the latent c, and its GEMMs' rows
// differ with the rank's row count), within bf16_bound_between_runs: out
// 20 u, dx, every gradient and the KL 40 u (u = 2^-8); the block in bf16
// against fp32 (exact to bf16's scale) within bf16_bound_vs_exact, 10 u and
// 20 u. The DSA block's roundings are the dense block's plus the indexer's,
// which runs beside the attention's path, not after it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "core/bf16.hpp"
#include "core/precision.hpp"
#include "dsa_form_cases.hpp"
#include "kernels/dsa_indexer.hpp"
#include "mla/dsa_block.hpp"
#include "mla/dsa_cp.hpp"
#include "mla/dsa_explicit.hpp"
#include "mla/dsa_laga.hpp"
#include "mla/dsa_model.hpp"
#include "mla/ops_bf16.hpp"
#include "mla/ops_sparse.hpp"

namespace laga {
namespace {

constexpr double kOutBetween = bf16_bound_between_runs(BlockTensor::output),
                 kGradBetween = bf16_bound_between_runs(BlockTensor::gradient),
                 kOutVsFp32 = bf16_bound_vs_exact(BlockTensor::output),
                 kGradVsFp32 = bf16_bound_vs_exact(BlockTensor::gradient);

MlaConfig bf16_config() {
  return test::dsa_small_config(4);
}

// max |a - ref| <= bound max |ref|, naming the worst element.
template <class A, class B>
::testing::AssertionResult within(const std::string& what, const A& a, const B& ref, double bound) {
  if (a.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": " << a.size() << " vs " << ref.size();
  double scale = 0, worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::abs(double(ref[i])));
    const double d = std::abs(double(a[i]) - double(ref[i]));
    if (!(d <= worst)) worst = d, at = i;  // NaN too
  }
  if (worst <= bound * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": |diff| " << worst << " at " << at << " beyond "
                                       << bound << " x max|ref| " << scale;
}
template <class T>
std::vector<T> as_vector(const Tensor<T>& t) {
  return std::vector<T>(t.data(), t.data() + t.numel());
}

// Summed gradients and KL against the reference, each within `bound`.
void expect_sum_within(const std::string& what, const DsaBlockResult<float>& sum,
                       const DsaBlockResult<float>& want, double bound) {
  EXPECT_LE(std::abs(sum.kl_loss - want.kl_loss), bound * std::abs(want.kl_loss)) << what << " KL";
  sum.grads.for_each([&](const std::string& name, const Tensor<float>& t) {
    want.grads.for_each([&](const std::string& n2, const Tensor<float>& ref) {
      if (n2 != name) return;
      EXPECT_TRUE(within(what + " d" + name, as_vector(t), as_vector(ref), bound));
    });
  });
  DsaIndexerParams<float> mine_p = sum.indexer_grads, ref_p = want.indexer_grads;
  auto mine = mine_p.named();
  auto ref = ref_p.named();
  for (std::size_t k = 0; k < mine.size(); ++k)
    EXPECT_TRUE(within(what + " d" + mine[k].first, *mine[k].second, *ref[k].second, bound));
}

enum class Form { latent_gather, explicit_heads, laga_indices, laga_recompute };
const char* name_of(Form f) {
  return f == Form::latent_gather    ? "latent_gather"
         : f == Form::explicit_heads ? "explicit"
         : f == Form::laga_indices   ? "laga_indices"
                                     : "laga_recompute";
}

struct Inputs {
  MlaConfig cfg = bf16_config();
  MlaParams<float> w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
  DsaIndexerParams<float> iw;
  std::vector<float> x, dout;
  std::int64_t B = 2, S = 11;
  std::uint64_t x_seed = 7;  // x's; dout's is the next
  explicit Inputs(std::int64_t batch = 2, std::int64_t seq = 11, std::uint64_t seed = 7)
      : B(batch), S(seq), x_seed(seed) {
    init_params(w, 5, 0.1);
    iw = test::dsa_indexer_weights<float>(cfg, 40);
    x = test::random_vector<float>(B * S * cfg.dim, x_seed);
    dout = test::random_vector<float>(B * S * cfg.dim, x_seed + 1);
  }
  DsaBlockResult<float> block(DsaStage stage) const {
    return dsa_block(cfg, w, iw, x.data(), dout.data(), B, S, stage, DsaAttend::per_head);
  }
};

DsaForm dsa_form_of(Form f) {
  return f == Form::latent_gather    ? DsaForm::latent_gather
         : f == Form::explicit_heads ? DsaForm::explicit_form
         : f == Form::laga_indices   ? DsaForm::laga_indices
                                     : DsaForm::laga_recompute;
}

// The uneven splits (S 11, H 4) the forms run at: P 2, 3 and 4 (a rank of
// one token, and one with no head).
struct Split {
  std::vector<std::int64_t> tokens, heads;
};
const std::vector<Split> kSplits = {
    {{6, 5}, {3, 1}}, {{5, 2, 4}, {2, 1, 1}}, {{3, 3, 1, 4}, {1, 2, 1, 0}}};

void check_form_bf16(Form form, DsaStage stage, const Split& split, const Inputs& in = Inputs()) {
  const MlaConfig& cfg = in.cfg;
  const std::int64_t B = in.B, S = in.S, D = cfg.dim, K = cfg.index_topk;
  const UsePrecision bf16(Precision::bf16);
  const DsaBlockResult<float> want = in.block(stage);
  const SpLayout lay = SpLayout::custom(B, split.tokens, split.heads);
  const int P = lay.ranks;
  std::vector<MemoryPool> pools;
  std::vector<DsaBlockResult<float>> got(static_cast<std::size_t>(P));
  const std::vector<std::unique_ptr<Communicator>> comms = test::dsa_run_ranks(
      lay, in.x, in.dout, pools, [&](Communicator& comm, const float* xr, const float* dr) {
        DsaBlockResult<float>& g = got[std::size_t(comm.rank())];
        if (form == Form::latent_gather)
          g = dsa_latent_gather(cfg, in.w, in.iw, xr, dr, lay, stage, comm);
        else if (form == Form::explicit_heads)
          g = dsa_explicit(cfg, in.w, in.iw, xr, dr, lay, stage, comm);
        else
          g = dsa_laga(cfg, in.w, in.iw, xr, dr, lay, stage, dsa_form_of(form), comm);
      });
  const std::string what = std::string(name_of(form)) + " bf16 B " + std::to_string(B) + " S " +
                           std::to_string(S) + " x seed " + std::to_string(in.x_seed) + " P " +
                           std::to_string(P) + " " + lay.describe() + " " + to_string(stage);
  DsaBlockResult<float> sum;
  sum.grads = MlaParams<float>::zeros(cfg, MemCategory::gradients);
  sum.indexer_grads = DsaIndexerParams<float>::zeros(cfg);
  for (int r = 0; r < P; ++r) {
    const DsaBlockResult<float>& g = got[std::size_t(r)];
    const std::int64_t s0 = lay.shard_begin(r), L = lay.seq_count[std::size_t(r)];
    const std::string wr = what + " rank " + std::to_string(r);
    EXPECT_TRUE(within(wr + " out", g.out, test::dsa_rows(want.out, B, S, D, s0, L), kOutBetween));
    EXPECT_TRUE(within(wr + " dx", g.dx, test::dsa_rows(want.dx, B, S, D, s0, L), kGradBetween));
    EXPECT_EQ(g.idx, test::dsa_rows(want.idx, B, S, K, s0, L)) << wr << " selection";
    test::dsa_add_grads(sum, g);
    // The ledger: dsa_predict_comm at bf16's wire, label for label (bf16
    // activations and their gradients, the indices and the KL target at 4
    // bytes: docs/forms.md, "bf16 on the wire for the DSA forms").
    const CommPrediction p = dsa_predict_comm(
        cfg, *DsaConfig::of(cfg), lay, dsa_form_of(form), r,
        wire_element_bytes(Precision::bf16, GradReduce::fp32, sizeof(float)), true, false, stage);
    test::dsa_expect_ledger(wr, comms[std::size_t(r)]->ledger(), p);
  }
  expect_sum_within(what, sum, want, kGradBetween);
}

TEST(DsaBf16, FormsAtP2To4EqualSingleRankBf16Sparse) {
  for (Form f :
       {Form::latent_gather, Form::explicit_heads, Form::laga_indices, Form::laga_recompute})
    for (const Split& split : kSplits) check_form_bf16(f, DsaStage::sparse, split);
}
TEST(DsaBf16, FormsAtP2To4EqualSingleRankBf16DenseWarmup) {
  for (Form f :
       {Form::latent_gather, Form::explicit_heads, Form::laga_indices, Form::laga_recompute})
    for (const Split& split : kSplits) check_form_bf16(f, DsaStage::dense_warmup, split);
}

// Where rounding decides the selection: S 48, B 1, inputs of seeds 41 and
// 61, at P 2, 3 and 4 (uneven tokens and heads), sparse. Here two keys'
// scores lie within bf16's rounding of q_I, k_I or w: scored from
// unrounded values (the block's own rows) and from the values the bf16 wire
// delivered (a form's gathered k_I, laga_recompute's gathered query latent
// and w), they select differently -- on the code before the indexer's values
// were rounded where made, seed 41 moved every form's selection off the
// block's (out 1.02 of max|out| 2.40 away), seed 61 laga_recompute's alone.
// With them bf16 values at their source (dsa_index_values_as_stored,
// mla/dsa_rows.hpp), every form equals the block: the selection exactly,
// the rest within the bounds above (check_form_bf16).
TEST(DsaBf16, FormsSelectAsTheBlockWhereRoundingDecides) {
  const std::vector<Split> splits = {
      {{20, 28}, {3, 1}}, {{17, 5, 26}, {2, 1, 1}}, {{9, 14, 1, 24}, {1, 2, 1, 0}}};
  for (std::uint64_t seed : {41, 61}) {
    const Inputs in(1, 48, seed);
    for (Form f :
         {Form::latent_gather, Form::explicit_heads, Form::laga_indices, Form::laga_recompute})
      for (const Split& split : splits) check_form_bf16(f, DsaStage::sparse, split, in);
  }
}

// The selection crosses intact past bf16's integers (exact to 256): at S 300
// explicit gathers every rank's top-k indices (topk_ag, as 4-byte words)
// and attends what they name; rounded to bf16 on the wire, key 257 would
// come back as 256. Its output equals laga_indices' (whose indices move as
// int32) within the bound between two bf16 runs, and the two select alike
// (both score their rows against the same gathered k_I).
TEST(DsaBf16, ExplicitSelectionPastBf16IntegersArrivesIntact) {
  const MlaConfig cfg = bf16_config();
  MlaParams<float> w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
  init_params(w, 5, 0.1);
  const DsaIndexerParams<float> iw = test::dsa_indexer_weights<float>(cfg, 40);
  const std::int64_t B = 1, S = 300, D = cfg.dim;
  const std::vector<float> x = test::random_vector<float>(B * S * D, 7);
  const UsePrecision bf16(Precision::bf16);
  const SpLayout lay = SpLayout::custom(B, {140, 160}, {3, 1});
  std::vector<MemoryPool> pools;
  std::vector<DsaBlockResult<float>> ex(2), li(2);
  test::dsa_run_ranks(lay, x, std::vector<float>(), pools,
                      [&](Communicator& comm, const float* xr, const float* no_dout) {
                        const std::size_t r = std::size_t(comm.rank());
                        ex[r] = dsa_explicit(cfg, w, iw, xr, no_dout, lay, DsaStage::sparse, comm);
                        li[r] = dsa_laga(cfg, w, iw, xr, no_dout, lay, DsaStage::sparse,
                                         DsaForm::laga_indices, comm);
                      });
  bool past_256 = false;
  for (int r = 0; r < 2; ++r) {
    const std::string what = "S 300 rank " + std::to_string(r);
    EXPECT_EQ(ex[std::size_t(r)].idx, li[std::size_t(r)].idx) << what << " selection";
    for (std::int32_t j : ex[std::size_t(r)].idx) past_256 |= j > 256 && (j & 1);
    EXPECT_TRUE(within(what + " explicit out", ex[std::size_t(r)].out, li[std::size_t(r)].out,
                       kOutBetween));
  }
  EXPECT_TRUE(past_256) << "no selected key that bf16 cannot hold: the case tests nothing";
}

// The block in bf16 against fp32, in the dense warm-up (every causal key, so
// no selection can differ): within bf16_bound_vs_exact, and not equal to fp32 within
// fp32's own bound (the bf16 path ran: q, k, v were rounded).
TEST(DsaBf16, BlockFollowsFp32WithinTheBf16Bound) {
  const Inputs in;
  for (DsaAttend attend : {DsaAttend::per_head, DsaAttend::latent}) {
    const auto run = [&](Precision p) {
      const UsePrecision at(p);
      return dsa_block(in.cfg, in.w, in.iw, in.x.data(), in.dout.data(), in.B, in.S,
                       DsaStage::dense_warmup, attend);
    };
    const DsaBlockResult<float> f32 = run(Precision::fp32), b16 = run(Precision::bf16);
    const std::string what = std::string("bf16 block ") + to_string(attend);
    EXPECT_TRUE(within(what + " out", b16.out, f32.out, kOutVsFp32));
    EXPECT_TRUE(within(what + " dx", b16.dx, f32.dx, kGradVsFp32));
    expect_sum_within(what, b16, f32, kGradVsFp32);
    EXPECT_FALSE(within(what + " out (rounded)", b16.out, f32.out, 1e-5));
  }
}

// The op layer under bf16 (mla/ops_sparse.hpp): forward and backward equal
// the float kernel on q, k, v, dO rounded to bf16, bit for bit; the
// head-summed target reads the same rounded q, k, so every row with a slot
// sums to 1 within fp32 rounding -- on the unrounded q, k it would be off by
// the scores' rounding, about u |s| (1e-3 here).
TEST(DsaBf16, OpLayerRoundsTheOperandsAndTheTargetSumsToOne) {
  for (std::int64_t Hk : {4, 1}) {
    SparseAttnShape s;
    s.attn = AttnShape{2, 7, 7, 4, Hk, 6, 5, 0.9, true};
    s.K = 3;
    const AttnShape& a = s.attn;
    std::vector<float> q = test::random_vector<float>(a.B * a.Sq * a.Hq * a.dqk, 11, -2.0, 2.0),
                       k = test::random_vector<float>(a.B * a.Sk * a.Hk * a.dqk, 12, -2.0, 2.0),
                       v = test::random_vector<float>(a.B * a.Sk * a.Hk * a.dv, 13),
                       dout = test::random_vector<float>(a.B * a.Sq * a.Hq * a.dv, 14);
    std::vector<std::int32_t> idx(std::size_t(a.B * a.Sq * s.K), -1);
    for (std::int64_t r = 0; r < a.B * a.Sq; ++r)  // the latest keys first
      for (std::int64_t slot = 0; slot < s.K && slot <= r % a.Sq; ++slot)
        idx[std::size_t(r * s.K + slot)] = std::int32_t(r % a.Sq - slot);
    const auto rounded = [](std::vector<float> x) {
      for (float& e : x) e = to_float(to_bf16(e));
      return x;
    };
    const std::vector<float> qr = rounded(q), kr = rounded(k), vr = rounded(v), dr = rounded(dout);
    const std::size_t no = dout.size(), nl = std::size_t(a.B * a.Hq * a.Sq), np = idx.size();
    std::vector<float> o(no), lse(nl), dq(q.size()), dk(k.size()), dv(v.size()), p(np);
    {
      const UsePrecision bf16(Precision::bf16);
      ops::sparse_attention_forward<float>(s, o.data(), lse.data(), q.data(), k.data(), v.data(),
                                           idx.data());
      ops::sparse_attention_backward<float>(s, dq.data(), dk.data(), dv.data(), dout.data(),
                                            q.data(), k.data(), v.data(), o.data(), lse.data(),
                                            idx.data());
      ops::sparse_attention_head_summed_probs<float>(s, p.data(), q.data(), k.data(), lse.data(),
                                                     idx.data());
    }
    std::vector<float> o2(no), lse2(nl), dq2(q.size()), dk2(k.size()), dv2(v.size());
    sparse_attention_forward<float>(s, o2.data(), lse2.data(), qr.data(), kr.data(), vr.data(),
                                    idx.data());
    sparse_attention_backward<float>(s, dq2.data(), dk2.data(), dv2.data(), dr.data(), qr.data(),
                                     kr.data(), vr.data(), o2.data(), lse2.data(), idx.data());
    const std::string what = "Hk " + std::to_string(Hk);
    EXPECT_EQ(o, o2) << what;
    EXPECT_EQ(lse, lse2) << what;
    EXPECT_EQ(dq, dq2) << what;
    EXPECT_EQ(dk, dk2) << what;
    EXPECT_EQ(dv, dv2) << what;
    for (std::int64_t r = 0; r < a.B * a.Sq; ++r) {
      double sum = 0;
      for (std::int64_t slot = 0; slot < s.K; ++slot) sum += p[std::size_t(r * s.K + slot)];
      EXPECT_NEAR(sum, 1.0, 1e-6) << what << " row " << r;
    }
  }
}

// The indexer on bf16 values (what its bf16 projections deliver): keys 1 and
// 3 differ in fp32 only below bf16's resolution, key 3 scoring higher; in
// bf16 they are one value, the scores tie exactly, and the lower key wins
// (kernels/dsa_indexer.hpp's rule). The selection of every query row is the
// same whether a rank computes all rows or only its own (the rule reads only
// scores and key positions).
TEST(DsaBf16, IndexerTopkOnBf16ValuesBreaksTiesToTheLowerKey) {
  const std::int64_t S = 6, HI = 2, dI = 4, topk = 2;
  std::vector<float> q = test::random_vector<float>(S * HI * dI, 3, 0.5, 1.0);
  std::vector<float> k = test::random_vector<float>(S * dI, 4, 0.1, 0.4);
  std::vector<float> w = test::random_vector<float>(S * HI, 5, 0.5, 1.0);
  for (std::int64_t e = 0; e < dI; ++e) {
    k[std::size_t(1 * dI + e)] = 1.0f;
    k[std::size_t(3 * dI + e)] = 1.0f + 1.0f / 1024;  // rounds to 1.0 in bf16 (u = 2^-8)
  }
  const auto round = [](std::vector<float> v) {
    for (float& e : v) e = to_float(to_bf16(e));
    return v;
  };
  const auto topk_of = [&](const std::vector<float>& qq, const std::vector<float>& kk,
                           const std::vector<float>& ww, std::int64_t Sq) {
    IndexerShape is;
    is.attn = AttnShape{1, Sq, S, HI, 1, dI, 1, 1.0, true};
    is.topk = topk;
    is.validate();
    std::vector<std::int32_t> idx(std::size_t(Sq * topk), -1);
    const std::int64_t q0 = S - Sq;  // the last Sq query rows
    dsa_index_topk(is, idx.data(), qq.data() + q0 * HI * dI, kk.data(), ww.data() + q0 * HI);
    return idx;
  };
  const std::vector<float> qb = round(q), kb = round(k), wb = round(w);
  const std::vector<std::int32_t> b16 = topk_of(qb, kb, wb, S);
  // query 5: keys 1 and 3 score highest (k = 1 against k <= 0.4)
  EXPECT_EQ((std::vector<std::int32_t>{b16[10], b16[11]}), (std::vector<std::int32_t>{1, 3}));
  // With one slot, fp32 takes key 3 (its k is larger) and bf16 key 1 (a tie).
  const auto top1 = [&](const std::vector<float>& qq, const std::vector<float>& kk,
                        const std::vector<float>& ww) {
    IndexerShape is;
    is.attn = AttnShape{1, S, S, HI, 1, dI, 1, 1.0, true};
    is.topk = 1;
    std::vector<std::int32_t> idx(std::size_t(S), -1);
    dsa_index_topk(is, idx.data(), qq.data(), kk.data(), ww.data());
    return idx;
  };
  const std::vector<std::int32_t> f32_1 = top1(q, k, w), b16_1 = top1(qb, kb, wb);
  EXPECT_EQ(f32_1[5], 3) << "fp32: key 3 scores higher";
  EXPECT_EQ(b16_1[5], 1) << "bf16: keys 1 and 3 tie; the lower key wins";
  // A rank holding only the last 2 query rows selects as the whole does.
  const std::vector<std::int32_t> tail = topk_of(qb, kb, wb, 2);
  EXPECT_EQ(tail, std::vector<std::int32_t>(b16.end() - 4, b16.end()));
}

}  // namespace
}  // namespace laga
