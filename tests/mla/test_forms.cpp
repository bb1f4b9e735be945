// Every form at P ranks against the single-rank explicit form, in fp32: the
// output, dx and every (all-reduced) parameter gradient, for even and uneven
// sequence and head shards (including ranks that own no head). LAGA at P = 1
// must equal explicit bit for bit. The ledger of every rank must equal the
// closed-form communication model byte for byte.
//
// With rq > 0, laga also runs with the query-latent exchange (--q-latent:
// the normalised query latent all-gathered instead of per-head Q
// all-to-alled) under every one of these checks, P = 1 bit for bit included.
//
// Packed sequences: every form at P ranks with documents equals running each
// document alone through single-rank explicit (out and dx concatenated, the
// gradients summed over documents), the ledger is the unpacked one, and one
// document per row given explicitly is bit for bit the unpacked block.
//
// Overlap: every overlapped variant (laga, laga2d; per-head and latent
// queries) runs in these checks too, and bit for bit against itself not
// overlapped, always under deferred delivery (comm/communicator.hpp,
// "Overlap"): a started collective's result reaches its buffer only at the
// wait, NaN until then, and a send or receive buffer freed or touched before
// the wait throws there. So an overlapped path that reads the latent (or its
// gradient) before the wait, or frees what the collective still reads, fails
// here although the in-process transport has the data at start.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "common/block_inputs.hpp"
#include "common/check.hpp"
#include "common/error_of.hpp"
#include "common/variants.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "mla/comm_model.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

MlaConfig test_config(std::int64_t rq, std::int64_t heads = 5) {
  return test::block_config(rq, heads);
}

using Inputs = test::BlockInputs<float>;
using test::make_inputs;

// max |a - b| <= rel * max |b| over the tensor; exact when rel == 0.
void expect_close(const std::string& what, const TensorF& a, const TensorF& b, double rel) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  const test::DiffStats d = test::diff_stats(a.data(), b.data(), a.numel());
  double ref_max = 0;
  for (std::int64_t i = 0; i < b.numel(); ++i) ref_max = std::max(ref_max, double(std::abs(b[i])));
  EXPECT_EQ(d.nonfinite, 0) << what;
  EXPECT_LE(d.max_abs, rel * ref_max)
      << what << ": max |diff| " << d.max_abs << " at " << d.abs_index << ", max |ref| " << ref_max;
}

void expect_run_matches(const BlockRun<float>& run, const BlockRun<float>& ref, double rel,
                        const std::string& tag) {
  expect_close(tag + " out", run.out, ref.out, rel);
  expect_close(tag + " dx", run.dx, ref.dx, rel);
  std::vector<std::pair<std::string, const TensorF*>> a, b;
  run.grads.for_each([&](const std::string& n, const TensorF& t) { a.push_back({n, &t}); });
  ref.grads.for_each([&](const std::string& n, const TensorF& t) { b.push_back({n, &t}); });
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    expect_close(tag + " grad." + a[i].first, *a[i].second, *b[i].second, rel);
}

void expect_ledger_matches_model(const MlaConfig& cfg, const SpLayout& lay, FormVariant variant,
                                 const BlockRun<float>& run) {
  for (const RankReport& rep : run.ranks) {
    const CommPrediction pred = predict_comm(cfg, lay, variant, rep.rank, 4, true, true);
    std::size_t seen = 0;
    for (const auto& [key, entry] : rep.ledger.entries()) {
      const std::string where = to_string(variant) + " rank " + std::to_string(rep.rank) + " " +
                                to_string(key.first) + "/" + key.second;
      auto it = pred.find(key);
      ASSERT_NE(it, pred.end()) << where << " is in the ledger but not in the model";
      EXPECT_EQ(entry.bytes_sent, it->second.sent) << where;
      EXPECT_EQ(entry.bytes_received, it->second.received) << where;
      EXPECT_EQ(entry.calls, it->second.calls) << where << ": collective calls";
      ++seen;
    }
    EXPECT_EQ(seen, pred.size()) << "the model predicts labels the ledger never saw";
  }
}

// Every run under deferred delivery: only started collectives (the
// overlapped variants') behave differently under it.
RunSpec spec_of(FormVariant v, AttentionKind a) {
  RunSpec spec;
  spec.variant = FormVariant(v);
  spec.attention = a;
  spec.deferred_delivery_for_testing = true;
  return spec;
}

struct FormCase {
  std::int64_t rq;
  std::vector<std::int64_t> seq, heads;  // per-rank shards; sizes give P
  AttentionKind attention;
};

class Forms : public ::testing::TestWithParam<FormCase> {};

// Every form and variant on `lay` against single-rank explicit (eager, on
// the whole sequence), and its ledger against the closed form.
void expect_every_variant_agrees(const MlaConfig& cfg, const SpLayout& lay, AttentionKind a) {
  const Inputs in = make_inputs(cfg, lay.batch, lay.seq);
  RunSpec spec;
  spec.attention = AttentionKind::eager;
  spec.variant.form = Form::explicit_form;
  const BlockRun<float> ref =
      run_local(cfg, SpLayout::even(lay.batch, lay.seq, cfg.n_heads, 1), in.w, in.x, in.dout, spec);
  for (FormVariant v : test::form_variants(cfg, test::WithOverlap::yes)) {
    const BlockRun<float> run = run_local(cfg, lay, in.w, in.x, in.dout, spec_of(v, a));
    // fp32 with other summation orders: 1e-5 of the largest reference value.
    expect_run_matches(run, ref, 1e-5, to_string(v) + " " + lay.describe());
    expect_ledger_matches_model(cfg, lay, v, run);
  }
}

TEST_P(Forms, AgreeWithSingleRankExplicit) {
  const FormCase& fc = GetParam();
  expect_every_variant_agrees(test_config(fc.rq), SpLayout::custom(2, fc.seq, fc.heads),
                              fc.attention);
}

std::vector<FormCase> form_cases() {
  std::vector<FormCase> v;
  for (std::int64_t rq : {0, 7}) {
    v.push_back({rq, {13}, {5}, AttentionKind::eager});
    v.push_back({rq, {7, 6}, {3, 2}, AttentionKind::eager});
    v.push_back({rq, {5, 4, 4}, {2, 2, 1}, AttentionKind::eager});
    v.push_back({rq, {4, 3, 3, 3}, {2, 1, 1, 1}, AttentionKind::eager});
    v.push_back({rq, {2, 2, 2, 2, 2, 1, 1, 1}, {1, 1, 1, 1, 1, 0, 0, 0}, AttentionKind::eager});
  }
  // Hand-made uneven layouts: a rank with one token, a rank with no heads.
  v.push_back({0, {1, 8, 4}, {0, 3, 2}, AttentionKind::eager});
  v.push_back({7, {6, 1}, {5, 0}, AttentionKind::eager});
  v.push_back({0, {4, 3, 3, 3}, {2, 1, 1, 1}, AttentionKind::flash});
  // Flash with rq > 0 (the query-latent exchange too): uneven shards, P > H.
  v.push_back({7, {5, 4, 4}, {2, 2, 1}, AttentionKind::flash});
  v.push_back({7, {2, 2, 2, 2, 2, 1, 1, 1}, {1, 1, 1, 1, 1, 0, 0, 0}, AttentionKind::flash});
  v.push_back({7, {1, 8, 4}, {0, 3, 2}, AttentionKind::flash});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, Forms, ::testing::ValuesIn(form_cases()),
                         [](const ::testing::TestParamInfo<FormCase>& p) {
                           std::string s = "rq" + std::to_string(p.param.rq) + "_P" +
                                           std::to_string(p.param.seq.size()) + "_";
                           for (auto n : p.param.seq) s += std::to_string(n);
                           s += "_";
                           for (auto n : p.param.heads) s += std::to_string(n);
                           return s + "_" + to_string(p.param.attention);
                         });

// The zigzag layout (SpLayout::even's SeqLayout::zigzag; docs/forms.md,
// "The zigzag layout"): rank r holds chunks r and 2P-1-r of 2P. Every form
// and variant, against single-rank explicit on the contiguous sequence, and
// the ledger against the closed form: S not a multiple of 2P (uneven
// chunks), S < 2P (empty chunks), P > H (ranks without heads).
struct ZigzagCase {
  std::int64_t rq, seq;
  int ranks;
  AttentionKind attention;
};

class Zigzag : public ::testing::TestWithParam<ZigzagCase> {};

TEST_P(Zigzag, EveryFormAgreesWithSingleRankExplicit) {
  const ZigzagCase& zc = GetParam();
  const MlaConfig cfg = test_config(zc.rq);
  expect_every_variant_agrees(
      cfg, SpLayout::even(2, zc.seq, cfg.n_heads, zc.ranks, SeqLayout::zigzag), zc.attention);
}

std::vector<ZigzagCase> zigzag_cases() {
  std::vector<ZigzagCase> v;
  for (std::int64_t rq : {0, 7})
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
      v.push_back({rq, 13, 1, a});
      v.push_back({rq, 13, 2, a});  // chunks 4+3+3+3
      v.push_back({rq, 14, 3, a});  // chunks 3+3+2+2+2+2
      v.push_back({rq, 16, 4, a});
      v.push_back({rq, 11, 8, a});  // S < 2P: empty chunks; P > H: ranks without heads
    }
  v.push_back({0, 29, 5, AttentionKind::eager});
  v.push_back({7, 150, 3, AttentionKind::flash});  // chunks over flash's 64-row blocks
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, Zigzag, ::testing::ValuesIn(zigzag_cases()),
                         [](const ::testing::TestParamInfo<ZigzagCase>& p) {
                           std::string s("rq");
                           s += std::to_string(p.param.rq);
                           s += "_S";
                           s += std::to_string(p.param.seq);
                           s += "_P";
                           s += std::to_string(p.param.ranks);
                           s += "_";
                           return s + to_string(p.param.attention);
                         });

// At P = 1 the query-latent exchange runs the same GEMMs as per-head queries
// (wq_b over all S tokens and all H heads, its gradient likewise), and its
// collectives are copies: bit for bit too.
TEST(Forms, LagaEqualsExplicitBitForBitOnOneRank) {
  for (std::int64_t rq : {0, 7})
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
      const MlaConfig cfg = test_config(rq);
      const SpLayout lay = SpLayout::even(2, 13, cfg.n_heads, 1);
      const Inputs in = make_inputs(cfg, 2, 13);
      const BlockRun<float> ex =
          run_local(cfg, lay, in.w, in.x, in.dout, spec_of(Form::explicit_form, a));
      for (FormVariant v : test::form_variants(cfg, test::WithOverlap::no)) {
        if (v.form != Form::laga) continue;
        const BlockRun<float> lg = run_local(cfg, lay, in.w, in.x, in.dout, spec_of(v, a));
        expect_run_matches(lg, ex, 0.0,
                           to_string(v) + " P=1 rq" + std::to_string(rq) + " " + to_string(a));
      }
    }
}

TEST(Forms, QueryExchangeNames) {
  for (QueryExchange q : {QueryExchange::heads, QueryExchange::latent})
    EXPECT_EQ(parse_query_exchange(to_string(q)), q);
  EXPECT_THROW(parse_query_exchange("q-latent"), Error);
  EXPECT_EQ(to_string(FormVariant(Form::laga, QueryExchange::latent)), "laga+q-latent");
  EXPECT_EQ(to_string(FormVariant(Form::absorbed)), "absorbed");
}

TEST(Forms, QueryLatentIsRefusedWhereItDoesNotApply) {
  const Inputs in7 = make_inputs(test_config(7), 1, 6), in0 = make_inputs(test_config(0), 1, 6);
  const SpLayout lay = SpLayout::even(1, 6, 5, 2);
  const auto refusal = [&](const MlaConfig& cfg, const Inputs& in, Form f) {
    RunSpec spec = spec_of({f, QueryExchange::latent}, AttentionKind::eager);
    try {
      run_local(cfg, lay, in.w, in.x, in.dout, spec);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (Form f : all_forms()) {
    if (form_spec(f).traits.query_latent) continue;
    const std::string msg = refusal(test_config(7), in7, f);
    EXPECT_NE(
        msg.find(
            "--q-latent applies to the laga, laga_fused and laga2d forms with q_lora_rank > 0"),
        std::string::npos)
        << msg;
    EXPECT_NE(msg.find(std::string("the ") + to_string(f) + " form"), std::string::npos) << msg;
  }
  for (Form f : forms_with(&FormTraits::query_latent)) {
    const std::string msg = refusal(test_config(0), in0, f);
    EXPECT_NE(msg.find("q_lora_rank 0"), std::string::npos) << msg;
  }
  EXPECT_THROW(
      predict_comm(test_config(0), lay, {Form::laga, QueryExchange::latent}, 0, 4, true, true),
      Error);
}

// ------------------------------------------------------------ packed sequences

// Random document lengths summing to S, at least one token each; `shape`
// forces the edge cases: 0 random short (1 to 6), 1 = [1, S-1], 2 = [S-1, 1],
// 3 = all ones, 4 = random long (1 to 48: documents that straddle flash's
// 64-row blocks).
std::vector<std::int64_t> random_cuts(std::int64_t S, int shape, test::TestRng& rng) {
  std::vector<std::int64_t> cu{0};
  if (shape == 1) cu.push_back(1);
  if (shape == 2) cu.push_back(S - 1);
  if (shape == 3)
    for (std::int64_t t = 1; t < S; ++t) cu.push_back(t);
  if (shape == 0 || shape == 4) {
    const double longest = shape == 0 ? 6 : 48;
    while (cu.back() < S)
      cu.push_back(std::min(S, cu.back() + 1 + std::int64_t(rng.uniform() * longest)));
  }
  if (cu.back() != S) cu.push_back(S);
  return cu;
}

struct PackedCase {
  std::vector<std::int64_t> seq, heads;  // per-rank shards
  int shape0, shape1;                    // random_cuts shapes of rows 0 and 1
};

class Packed : public ::testing::TestWithParam<PackedCase> {};

// Every form and variant on `lay`, eager and flash, rq 0 and 7, with the
// documents: equal to explicit run on each document alone, and its ledger
// to the closed form (the same tensors cross the wire: packing changes no
// byte).
void expect_every_variant_matches_documents(const SpLayout& lay, const Documents& docs) {
  for (std::int64_t rq : {0, 7}) {
    const MlaConfig cfg = test_config(rq);
    const Inputs in = make_inputs(cfg, lay.batch, lay.seq);
    RunSpec spec;
    spec.variant.form = Form::explicit_form, spec.attention = AttentionKind::eager;
    const BlockRun<float> ref = run_documents_alone(cfg, in.w, in.x, in.dout, docs, spec);
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
      for (FormVariant v : test::form_variants(cfg, test::WithOverlap::yes)) {
        RunSpec packed = spec_of(v, a);
        packed.documents = &docs;
        const BlockRun<float> run = run_local(cfg, lay, in.w, in.x, in.dout, packed);
        const std::string tag = to_string(v) + " " + to_string(a) + " rq" + std::to_string(rq) +
                                " " + lay.describe() + " docs " + docs.describe();
        expect_run_matches(run, ref, 1e-5, tag);
        expect_ledger_matches_model(cfg, lay, v, run);
      }
  }
}

TEST_P(Packed, EveryFormEqualsEachDocumentAlone) {
  const PackedCase& pc = GetParam();
  const std::int64_t B = 2;
  const SpLayout lay = SpLayout::custom(B, pc.seq, pc.heads);
  test::TestRng rng(lay.seq * 31 + pc.seq.size());
  expect_every_variant_matches_documents(
      lay, Documents::from_cu_seqlens(
               "test", B, lay.seq,
               {random_cuts(lay.seq, pc.shape0, rng), random_cuts(lay.seq, pc.shape1, rng)}));
}

// Packed documents on zigzag shards: every form equals each document run
// alone; a document may span a rank's two ranges and the chunks between.
TEST(Packed, ZigzagShardsEqualEachDocumentAlone) {
  const std::int64_t B = 2;
  for (const auto& [S, P] : std::vector<std::pair<std::int64_t, int>>{{13, 2}, {20, 3}, {17, 4}}) {
    test::TestRng rng(S * 37 + P);
    expect_every_variant_matches_documents(
        SpLayout::even(B, S, 5, P, SeqLayout::zigzag),
        Documents::from_cu_seqlens("test", B, S, {random_cuts(S, 0, rng), random_cuts(S, 2, rng)}));
  }
}

std::vector<PackedCase> packed_cases() {
  return {
      {{13}, {5}, 0, 1},
      {{7, 6}, {3, 2}, 2, 0},
      {{5, 4, 4}, {2, 2, 1}, 0, 3},
      {{1, 8, 4}, {0, 3, 2}, 1, 0},  // a one-token rank, a rank without heads
      {{4, 3, 3, 3}, {2, 1, 1, 1}, 0, 0},
      {{2, 2, 2, 2, 2, 1, 1, 1}, {1, 1, 1, 1, 1, 0, 0, 0}, 0, 2},
      // Long enough that documents straddle flash's 64-row blocks and a rank's
      // shard lies inside one document.
      {{70, 60, 50}, {2, 2, 1}, 4, 1},
  };
}

INSTANTIATE_TEST_SUITE_P(Layouts, Packed, ::testing::ValuesIn(packed_cases()),
                         [](const ::testing::TestParamInfo<PackedCase>& p) {
                           // Appended piece by piece: GCC 12 -O3 warns falsely
                           // (-Wrestrict) on "literal" + std::string here.
                           std::string s("P");
                           s += std::to_string(p.param.seq.size());
                           for (auto n : p.param.seq) (s += "_") += std::to_string(n);
                           s += "_shapes";
                           s += std::to_string(p.param.shape0 * 10 + p.param.shape1);
                           return s;
                         });

TEST(Packed, OneDocumentPerRowIsTheUnpackedBlockBitForBit) {
  const MlaConfig cfg = test_config(7);
  const SpLayout lay = SpLayout::custom(2, {5, 4, 4}, {2, 2, 1});
  const Inputs in = make_inputs(cfg, 2, lay.seq);
  const Documents whole = Documents::parse_lengths("13", 2, 13);
  for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
    for (FormVariant v : test::form_variants(cfg, test::WithOverlap::no)) {
      RunSpec spec = spec_of(v, a);
      const BlockRun<float> plain = run_local(cfg, lay, in.w, in.x, in.dout, spec);
      spec.documents = &whole;
      const BlockRun<float> packed = run_local(cfg, lay, in.w, in.x, in.dout, spec);
      expect_run_matches(packed, plain, 0.0, to_string(v) + " " + to_string(a));
    }
}

// ---------------------------------------------------------------------- laga2d

// The grid forms (FormTraits::head_groups: laga2d, a2a_p2p) at explicit
// head-group counts against single-rank explicit: P > H
// (H 2, 3, 6 at P 8, where laga leaves ranks idle), uneven head groups
// (H % Ph != 0), uneven sequence shards, ranks whose chunks hold no token
// (S < 2 Pc), rq 0 and > 0, eager and flash, unpacked and packed, overlapped
// and not. The ledger equals the closed form on every rank.
struct GridCase {
  std::int64_t heads;
  std::vector<std::int64_t> seq;  // per-rank shards; the size gives P
  std::vector<int> head_groups;   // 0: the default rule
};

class Laga2d : public ::testing::TestWithParam<GridCase> {};

TEST_P(Laga2d, AgreesWithSingleRankExplicit) {
  const GridCase& gc = GetParam();
  const std::int64_t B = 2;
  const SpLayout lay =
      SpLayout::custom(B, gc.seq, SpLayout::even(B, 64, gc.heads, int(gc.seq.size())).head_count);
  test::TestRng rng(lay.seq * 7 + gc.heads);
  const Documents docs = Documents::from_cu_seqlens(
      "test", B, lay.seq, {random_cuts(lay.seq, 1, rng), random_cuts(lay.seq, 4, rng)});
  for (std::int64_t rq : {0, 7}) {
    const MlaConfig cfg = test_config(rq, gc.heads);
    const Inputs in = make_inputs(cfg, B, lay.seq);
    RunSpec spec = spec_of(Form::explicit_form, AttentionKind::eager);
    const BlockRun<float> ref =
        run_local(cfg, SpLayout::even(B, lay.seq, cfg.n_heads, 1), in.w, in.x, in.dout, spec);
    const BlockRun<float> ref_packed = run_documents_alone(cfg, in.w, in.x, in.dout, docs, spec);
    for (Form f : forms_with(&FormTraits::head_groups))
      for (int groups : gc.head_groups)
        for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
          for (const Documents* d : {static_cast<const Documents*>(nullptr), &docs})
            for (QueryExchange q : {QueryExchange::heads, QueryExchange::latent})
              for (Overlap o : {Overlap::off, Overlap::on}) {
                if (q == QueryExchange::latent && (rq == 0 || !form_spec(f).traits.query_latent))
                  continue;
                FormVariant v{f, q, groups};
                v.overlap = o;
                RunSpec run_spec = spec_of(v, a);
                run_spec.documents = d;
                const BlockRun<float> run = run_local(cfg, lay, in.w, in.x, in.dout, run_spec);
                const std::string tag = describe_variant(v, lay) + " H " +
                                        std::to_string(gc.heads) + " rq" + std::to_string(rq) +
                                        " " + to_string(a) + " " + lay.describe() +
                                        (d ? " docs " + d->describe() : "");
                expect_run_matches(run, d ? ref_packed : ref, 1e-5, tag);
                expect_ledger_matches_model(cfg, lay, v, run);
              }
  }
}

std::vector<GridCase> grid_cases() {
  return {
      {2, {9, 8, 8, 8, 8, 8, 8, 8}, {0, 1, 4}},  // default Ph 2 (3 heads idle at laga)
      {3, {8, 8, 8, 8, 8, 8, 8, 8}, {0, 2}},     // default Ph 1: 16 chunks; 2+1 heads
      {6, {8, 8, 8, 8, 8, 8, 8, 7}, {0, 4}},     // default Ph 2; 4 groups: 2+2+1+1 heads
      {5, {13}, {0}},                            // P 1
      {5, {4, 3, 3, 3}, {2}},                    // uneven shards and groups (3+2)
      {5, {2, 2, 2, 2, 1, 1}, {1, 3}},           // S 10 < 2 Pc 12: empty chunks
      {5, {70, 60, 50}, {1}},                    // long: flash's 64-row blocks, straddling
  };
}

INSTANTIATE_TEST_SUITE_P(Grids, Laga2d, ::testing::ValuesIn(grid_cases()),
                         [](const ::testing::TestParamInfo<GridCase>& p) {
                           std::string s("H");
                           s += std::to_string(p.param.heads);
                           s += "_P";
                           s += std::to_string(p.param.seq.size());
                           s += "_S";
                           s += std::to_string(std::accumulate(p.param.seq.begin(),
                                                               p.param.seq.end(), std::int64_t(0)));
                           return s;
                         });

// At one head group per rank (Ph = P) laga2d is laga: the same collectives
// and bytes on every rank, and the same GEMMs and kernel calls, so the same
// bits, on uneven layouts and with ranks that own no head; with per-head
// and latent queries.
// The same collectives, calls and bytes per rank, phase and label.
void expect_same_ledgers(const BlockRun<float>& a, const BlockRun<float>& b,
                         const std::string& tag) {
  ASSERT_EQ(a.ranks.size(), b.ranks.size()) << tag;
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    const auto& mine = a.ranks[r].ledger.entries();
    const auto& theirs = b.ranks[r].ledger.entries();
    ASSERT_EQ(mine.size(), theirs.size()) << tag << " rank " << r;
    for (auto i = mine.begin(), j = theirs.begin(); i != mine.end(); ++i, ++j) {
      const std::string where = tag + " rank " + std::to_string(r) + " " + i->first.second;
      EXPECT_EQ(i->first, j->first) << where;
      EXPECT_EQ(i->second.calls, j->second.calls) << where;
      EXPECT_EQ(i->second.bytes_sent, j->second.bytes_sent) << where;
      EXPECT_EQ(i->second.bytes_received, j->second.bytes_received) << where;
    }
  }
}

// RMSNorm is scale-invariant, so the latent rows of wkv_a (and, with
// rq > 0, wq_a) scaled by 1e19 must leave out and dx as they were: eps is
// then far below the rows' mean square, and nothing else reads the scaled
// values. Before issue 26 the float sum of squares overflowed, kv_norm
// returned exactly 0 and every form silently dropped k_nope and v (exit 0,
// nothing non-finite). Every variant, P 1 and 3, eager and flash.
TEST(RmsNormScale, LatentRowsScaledBy1e19LeaveOutAndDx) {
  for (std::int64_t rq : {0, 7}) {
    const MlaConfig cfg = test_config(rq);
    const Inputs in = make_inputs(cfg, 2, 13);
    MlaParams<float> big = in.w.clone(MemCategory::parameters);
    float* lat = big.wkv_a.data();  // rows [0, C) of (C + dr, D): the latent's
    for (std::int64_t i = 0; i < cfg.kv_lora_rank * cfg.dim; ++i) lat[i] *= 1e19f;
    if (rq > 0)
      for (std::int64_t i = 0; i < big.wq_a.numel(); ++i) big.wq_a.data()[i] *= 1e19f;
    for (int P : {1, 3})
      for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
        for (FormVariant v : test::form_variants(cfg, test::WithOverlap::no)) {
          const SpLayout lay = SpLayout::even(2, 13, cfg.n_heads, P);
          const RunSpec spec = spec_of(v, a);
          const BlockRun<float> ref = run_local(cfg, lay, in.w, in.x, in.dout, spec),
                                run = run_local(cfg, lay, big, in.x, in.dout, spec);
          const std::string tag = cat(to_string(v), " ", to_string(a), " P ", P, " rq ", rq);
          // eps / mean square ~ 1e-5 at scale 1 moves rstd by ~5e-6.
          expect_close(tag + " out", run.out, ref.out, 2e-5);
          expect_close(tag + " dx", run.dx, ref.dx, 2e-5);
        }
  }
}

// The cases two runs must agree on bit for bit and byte for byte: uneven
// layouts (a rank with one token, ranks without heads, P > H), rq 0 and 7,
// eager and flash, unpacked and packed, at each batch size of `batches`;
// fn(cfg, lay, in, spec, tag) with spec's attention and documents set.
template <class Fn>
void for_each_bitwise_case(Fn&& fn, const std::vector<std::int64_t>& batches = {2}) {
  struct Case {
    std::vector<std::int64_t> seq, heads;
  };
  for (const Case& c : {Case{{13}, {5}}, Case{{5, 4, 4}, {2, 2, 1}}, Case{{1, 8, 4}, {0, 3, 2}},
                        Case{{2, 2, 2, 2, 2, 1, 1, 1}, {1, 1, 1, 1, 1, 0, 0, 0}}})
    for (std::int64_t B : batches)
      for (std::int64_t rq : {0, 7})
        for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
          const MlaConfig cfg = test_config(rq);
          const SpLayout lay = SpLayout::custom(B, c.seq, c.heads);
          const Inputs in = make_inputs(cfg, B, lay.seq);
          const Documents docs = Documents::parse_lengths("3,1,6,3", B, 13);
          for (const Documents* d : {static_cast<const Documents*>(nullptr), &docs}) {
            RunSpec spec;
            spec.attention = a;
            spec.documents = d;
            fn(cfg, lay, in, spec,
               lay.describe() + " B" + std::to_string(B) + " rq" + std::to_string(rq) + " " +
                   to_string(a) + (d ? " packed" : ""));
          }
        }
}

// At Ph = P laga2d has one context group: its grid must put each rank's
// attention where laga's does (its own head shard of the layout, every query
// row), which HeadContextGrid::make decides apart from SpLayout's shards, so
// that is checked first and can fail on its own. Given that placement the
// two forms run the same shared pieces (LagaInputs, the head attention), so
// the bits and bytes that follow agree by construction: this guards the
// placement rule and the laga2d file's use of the pieces, not the kernels.
TEST(Laga2dAtPhEqualsP, TakesLagasPlacementSoItsBitsAndBytes) {
  for_each_bitwise_case([](const MlaConfig& cfg, const SpLayout& lay, const Inputs& in,
                           RunSpec spec, const std::string& tag) {
    const Placement at_ph_p =
        attention_placement(lay, {Form::laga2d, QueryExchange::heads, lay.ranks});
    const Placement shards = attention_placement(lay, Form::laga);
    EXPECT_EQ(at_ph_p.head_offset, shards.head_offset) << tag;
    EXPECT_EQ(at_ph_p.head_count, shards.head_count) << tag;
    EXPECT_EQ(at_ph_p.tokens, shards.tokens) << tag;
    for (QueryExchange q : {QueryExchange::heads, QueryExchange::latent}) {
      if (q == QueryExchange::latent && cfg.q_lora_rank == 0) continue;
      spec.variant = FormVariant{Form::laga, q};
      const BlockRun<float> laga = run_local(cfg, lay, in.w, in.x, in.dout, spec);
      spec.variant = FormVariant{Form::laga2d, q, lay.ranks};
      const BlockRun<float> grid = run_local(cfg, lay, in.w, in.x, in.dout, spec);
      expect_run_matches(grid, laga, 0.0, std::string(to_string(q)) + " " + tag);
      expect_same_ledgers(grid, laga, std::string(to_string(q)) + " " + tag);
    }
  });
}

TEST(Laga2dRefusals, HeadGroupsNameTheFix) {
  const MlaConfig cfg = test_config(7, 6);
  const SpLayout lay = SpLayout::even(1, 16, 6, 8);
  const Inputs in = make_inputs(cfg, 1, 16);
  auto refusal = [&](FormVariant v) {
    try {
      run_local(cfg, lay, in.w, in.x, in.dout, spec_of(v, AttentionKind::eager));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string e = refusal({Form::laga, QueryExchange::heads, 2});
  EXPECT_NE(e.find("--head-groups applies to the laga2d and a2a_p2p forms only, not to laga"),
            std::string::npos)
      << e;
  e = refusal({Form::laga2d, QueryExchange::heads, 3});
  EXPECT_NE(e.find("--head-groups 3 does not divide --sp 8"), std::string::npos) << e;
  EXPECT_THROW(
      predict_comm(cfg, lay, {Form::explicit_form, QueryExchange::heads, 2}, 0, 4, true, true),
      Error);
}

// Overlap changes when the latent's collectives are waited for, and the
// order of independent work around them, nothing else: out, dx and every
// gradient bit for bit, the same collectives and bytes, for per-head and
// latent queries, packed or not, eager and flash, uneven layouts and P > H,
// B 1 (the collectives send the latent and its gradient themselves) and 2
// (packed copies of them); laga, and laga2d at its default grid and at one
// head group (Pc = P). The overlapped run is under deferred delivery, so a
// result read before its wait, or a buffer freed before it, fails.
TEST(Overlap, IsBitIdenticalAndSendsTheSameBytes) {
  for_each_bitwise_case(
      [](const MlaConfig& cfg, const SpLayout& lay, const Inputs& in, RunSpec spec,
         const std::string& tag) {
        std::vector<FormVariant> vs;
        for (QueryExchange q : {QueryExchange::heads, QueryExchange::latent}) {
          if (q == QueryExchange::latent && cfg.q_lora_rank == 0) continue;
          for (Form f : forms_with(&FormTraits::overlap)) {
            if (q == QueryExchange::latent && !form_spec(f).traits.query_latent) continue;
            vs.push_back({f, q});
            // A grid form also at one head group (Pc = P).
            if (form_spec(f).traits.head_groups) vs.push_back({f, q, 1});
          }
        }
        for (FormVariant v : vs) {
          spec.variant = FormVariant(v);
          spec.deferred_delivery_for_testing = false;
          const BlockRun<float> off = run_local(cfg, lay, in.w, in.x, in.dout, spec);
          spec.variant.overlap = Overlap::on;
          spec.deferred_delivery_for_testing = true;
          const BlockRun<float> on = run_local(cfg, lay, in.w, in.x, in.dout, spec);
          expect_run_matches(on, off, 0.0, to_string(v) + " " + tag);
          expect_same_ledgers(on, off, to_string(v) + " " + tag);
        }
      },
      {1, 2});
}

TEST(Overlap, IsRefusedForFormsWithoutAnOverlappedPath) {
  const MlaConfig cfg = test_config(0);
  const SpLayout lay = SpLayout::even(2, 13, cfg.n_heads, 2);
  const Inputs in = make_inputs(cfg, 2, lay.seq);
  for (Form f : all_forms()) {
    if (form_spec(f).traits.overlap) continue;
    RunSpec spec = spec_of(f, AttentionKind::eager);
    spec.variant.overlap = Overlap::on;
    const std::string e = test::error_of([&] { run_local(cfg, lay, in.w, in.x, in.dout, spec); });
    EXPECT_NE(e.find(cat("--overlap on applies to the ", names_of_forms_with(&FormTraits::overlap),
                         " forms (they overlap their collectives with compute); the ", to_string(f),
                         " form has no overlapped path")),
              std::string::npos)
        << e;
  }
  EXPECT_EQ(parse_overlap("on"), Overlap::on);
  EXPECT_NE(test::error_of([] { parse_overlap("yes"); }).find("choose on or off"),
            std::string::npos);
  FormVariant v(Form::laga, QueryExchange::latent);
  v.overlap = Overlap::on;
  EXPECT_EQ(to_string(v), "laga+q-latent+overlap");
}

// ------------------------------------------------------------ non-finite input

// One NaN in one token's input (x of token 5 of row 1, inside the document
// [4, 10) of "3,1,6,3") stays where the math puts it: out is non-finite
// exactly at the tokens that see it (5 .. 9 of row 1, every element) and
// bit-for-bit the clean run's everywhere else (other documents, the other
// row, the earlier positions 4 of its own document); dx outside the document
// is the clean run's too (in backward the NaN reaches, through D and dS, every
// key its document's later rows see, so the whole document). Every variant,
// even and uneven layouts, eager and flash, which report the same counts.
// Before issue 26 the masked zeros of the P V product (and of dq, dk, dv)
// multiplied the NaN into other documents and the causal past (eager: every
// row; flash: the rows of its tile), and flash and eager counted differently.
TEST(NonFinite, OneNanTokenStaysInTheRowsThatSeeIt) {
  const std::int64_t B = 2, S = 13, bad_b = 1, bad_t = 5, doc0 = 4, doc1 = 10;
  const Documents docs = Documents::parse_lengths("3,1,6,3", B, S);
  struct Layout {
    std::vector<std::int64_t> seq, heads;
  };
  for (std::int64_t rq : {0, 7}) {
    const MlaConfig cfg = test_config(rq);
    const Inputs in = make_inputs(cfg, B, S);
    TensorF x_bad = in.x.clone();
    x_bad.data()[(bad_b * S + bad_t) * cfg.dim + 3] = std::numeric_limits<float>::quiet_NaN();
    for (const Layout& l :
         {Layout{{5, 4, 4}, {2, 2, 1}}, Layout{{1, 8, 4}, {0, 3, 2}}, Layout{{7, 6}, {3, 2}}})
      for (const Documents* d : {&docs, static_cast<const Documents*>(nullptr)})
        for (FormVariant v : test::form_variants(cfg, test::WithOverlap::yes)) {
          const SpLayout lay = SpLayout::custom(B, l.seq, l.heads);
          // Unpacked, the document is the whole row [0, S).
          const std::int64_t lo = d ? doc0 : 0, hi = d ? doc1 : S;
          std::int64_t counts[2][2] = {};  // [eager, flash][out, dx]
          for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
            RunSpec spec = spec_of(v, a);
            spec.documents = d;
            const BlockRun<float> clean = run_local(cfg, lay, in.w, in.x, in.dout, spec),
                                  bad = run_local(cfg, lay, in.w, x_bad, in.dout, spec);
            const std::string tag = cat(to_string(v), " ", to_string(a), " rq ", rq, " ",
                                        lay.describe(), d ? " packed" : "");
            std::int64_t wrong_out = 0, wrong_dx = 0, nf_out = 0, nf_dx = 0;
            for (std::int64_t i = 0; i < bad.out.numel(); ++i) {
              const std::int64_t t = (i / cfg.dim) % S, b = i / (cfg.dim * S);
              const bool sees = b == bad_b && t >= bad_t && t < hi;
              const bool in_doc = b == bad_b && t >= lo && t < hi;
              nf_out += !std::isfinite(bad.out[i]);
              nf_dx += !std::isfinite(bad.dx[i]);
              // A NaN never equals anything: a leaked one is wrong here.
              wrong_out += sees ? std::isfinite(bad.out[i]) : !(bad.out[i] == clean.out[i]);
              wrong_dx += !in_doc && !(bad.dx[i] == clean.dx[i]);
            }
            EXPECT_EQ(wrong_out, 0) << tag << ": elements of out not where the math puts them";
            EXPECT_EQ(wrong_dx, 0) << tag << ": elements of dx outside the poisoned document "
                                   << "differ from the clean run";
            EXPECT_GT(nf_dx, 0) << tag;
            counts[a == AttentionKind::flash][0] = nf_out;
            counts[a == AttentionKind::flash][1] = nf_dx;
          }
          EXPECT_EQ(counts[0][0], counts[1][0]) << to_string(v) << ": out non-finite counts";
          EXPECT_EQ(counts[0][1], counts[1][1]) << to_string(v) << ": dx non-finite counts";
        }
  }
}

}  // namespace
}  // namespace laga
