// bf16 mixed precision (Precision::bf16, --dtype bf16; mla/ops.hpp,
// "Precision"): every form at P = 1, 2, 3 (uneven sequence and head shards)
// against single-rank explicit in bf16 and against the float64 block, the
// op layer's rounding rules themselves, and that the scope reaches every
// rank thread and changes results.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "common/block_inputs.hpp"
#include "common/variants.hpp"
#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "core/precision.hpp"
#include "core/rng.hpp"
#include "kernels/attention_flash_bf16.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_bf16.hpp"
#include "mla/comm_model.hpp"
#include "mla/documents.hpp"
#include "mla/memory_model.hpp"
#include "mla/ops.hpp"
#include "mla/ops_bf16.hpp"
#include "mla/runner.hpp"
#include "mla/wire.hpp"

namespace laga {
namespace {

constexpr double kU = kBf16UnitRoundoff;

bool is_bf16(float x) {
  return to_float(to_bf16(x)) == x;
}

MlaConfig test_config(std::int64_t rq) {
  return test::block_config(rq);
}

template <class T>
using Inputs = test::BlockInputs<T>;
using test::make_inputs;

TensorD widened(const TensorF& t) {
  TensorD d(t.shape());
  for (std::int64_t i = 0; i < t.numel(); ++i) d[i] = t[i];
  return d;
}

// The same values in double (float -> double is exact).
Inputs<double> widened(const MlaConfig& cfg, const Inputs<float>& in) {
  Inputs<double> d;
  d.w = MlaParams<double>::zeros(cfg, MemCategory::parameters);
  std::vector<const TensorF*> from;
  in.w.for_each([&](const std::string&, const TensorF& t) { from.push_back(&t); });
  std::size_t i = 0;
  d.w.for_each([&](const std::string&, TensorD& t) {
    const TensorF& f = *from[i++];
    for (std::int64_t j = 0; j < t.numel(); ++j) t[j] = f[j];
  });
  d.x = widened(in.x), d.dout = widened(in.dout);
  return d;
}

BlockRun<float> run_bf16(const MlaConfig& cfg, const SpLayout& lay, const Inputs<float>& in,
                         FormVariant v) {
  const UsePrecision bf16(Precision::bf16);
  RunSpec spec;
  spec.variant = v;
  spec.attention = AttentionKind::flash;
  return run_local(cfg, lay, in.w, in.x, in.dout, spec);
}

// Every compared tensor of a run: out, dx, then the gradients in order.
template <class T>
std::vector<std::pair<std::string, const Tensor<T>*>> tensors(const BlockRun<T>& r) {
  std::vector<std::pair<std::string, const Tensor<T>*>> v{{"out", &r.out}, {"dx", &r.dx}};
  r.grads.for_each([&](const std::string& n, const Tensor<T>& t) {
    v.push_back({"grad." + n, &t});
  });
  return v;
}

// max |a - b| <= bound * max |b|, tensor by tensor; `bound` for out, and
// `grad_bound` for dx and the gradients.
template <class T>
void expect_within(const BlockRun<float>& run, const BlockRun<T>& ref, double bound,
                   double grad_bound, const std::string& tag) {
  const auto a = tensors(run);
  const auto b = tensors(ref);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const TensorD ad = widened(*a[i].second);
    TensorD bd(b[i].second->shape());
    for (std::int64_t j = 0; j < bd.numel(); ++j) bd[j] = double((*b[i].second)[j]);
    const Deviation d = deviation(ad, bd);
    const double allowed = i == 0 ? bound : grad_bound;
    EXPECT_LE(d.relative(), allowed)
        << tag << " " << a[i].first << ": max |diff| " << d.max_abs << ", max |ref| " << d.ref_max;
  }
}

// The bounds (mla/ops_bf16.hpp derives them): out, and dx and the gradients.
constexpr double kOutVsExact = bf16_bound_vs_exact(BlockTensor::output),
                 kGradVsExact = bf16_bound_vs_exact(BlockTensor::gradient);
constexpr double kOutVsBf16 = bf16_bound_between_runs(BlockTensor::output),
                 kGradVsBf16 = bf16_bound_between_runs(BlockTensor::gradient);

struct Layout {
  std::vector<std::int64_t> seq, heads;
};

TEST(Bf16, EveryFormAtP1To8AgreesWithExplicitAndFloat64) {
  const std::int64_t B = 2;
  // P 1-8: uneven shards, and at P 8 > H ranks that own no head.
  const std::vector<Layout> layouts{{{13}, {5}},
                                    {{7, 6}, {3, 2}},
                                    {{5, 4, 4}, {2, 2, 1}},
                                    {{4, 3, 3, 3}, {2, 1, 1, 1}},
                                    {{3, 3, 3, 2, 2}, {1, 1, 1, 1, 1}},
                                    {{2, 2, 2, 2, 2, 1, 1, 1}, {1, 1, 1, 1, 1, 0, 0, 0}}};
  for (std::int64_t rq : {0, 7}) {
    const MlaConfig cfg = test_config(rq);
    const std::int64_t S = 13;
    const Inputs<float> in = make_inputs(cfg, B, S);
    const Inputs<double> ind = widened(cfg, in);
    const SpLayout one = SpLayout::even(B, S, cfg.n_heads, 1);
    RunSpec spec;
    spec.attention = AttentionKind::flash;
    const BlockRun<double> exact = run_local(cfg, one, ind.w, ind.x, ind.dout, spec);
    const BlockRun<float> ref = run_bf16(cfg, one, in, Form::explicit_form);
    expect_within(ref, exact, kOutVsExact, kGradVsExact, "explicit P=1 vs float64");
    for (const Layout& l : layouts) {
      const SpLayout lay = SpLayout::custom(B, l.seq, l.heads);
      for (FormVariant v : test::form_variants(cfg, test::WithOverlap::no)) {
        const std::string tag = to_string(v) + " rq" + std::to_string(rq) + " " + lay.describe();
        const BlockRun<float> run = run_bf16(cfg, lay, in, v);
        expect_within(run, ref, kOutVsBf16, kGradVsBf16, tag + " vs bf16 explicit P=1");
        expect_within(run, exact, kOutVsExact, kGradVsExact, tag + " vs float64");
        // out is the output projection's fresh product: a bf16 value.
        std::int64_t not_bf16 = 0;
        for (std::int64_t i = 0; i < run.out.numel(); ++i) not_bf16 += !is_bf16(run.out[i]);
        EXPECT_EQ(not_bf16, 0) << tag << ": out holds values a bf16 tensor cannot";
      }
    }
  }
}

// The scope is not silently ignored: bf16 explicit (and a form whose ranks
// are threads, so the scope must reach them) is further from float64 than
// fp32 can be. fp32's error is within 2^-24 times the same path's
// roundings; bf16's rounding of x alone is of order u, 2^16 times more; so
// an fp32 run is within u / 2^8 of float64, and a bf16 run is not.
TEST(Bf16, ChangesResultsOnEveryRank) {
  const MlaConfig cfg = test_config(7);
  const std::int64_t B = 2, S = 13;
  const Inputs<float> in = make_inputs(cfg, B, S);
  const Inputs<double> ind = widened(cfg, in);
  RunSpec spec;
  spec.attention = AttentionKind::flash;
  const double fp32_scale = kU / 256;
  for (int P : {1, 3}) {
    const SpLayout lay = SpLayout::even(B, S, cfg.n_heads, P);
    const BlockRun<double> exact = run_local(cfg, lay, ind.w, ind.x, ind.dout, spec);
    const BlockRun<float> fp32 = run_local(cfg, lay, in.w, in.x, in.dout, spec);
    const BlockRun<float> bf16 = run_bf16(cfg, lay, in, Form::laga);
    EXPECT_LT(deviation(widened(fp32.out), exact.out).relative(), fp32_scale) << "P " << P;
    // Every rank's rows: each one's out must show bf16's error.
    for (std::int64_t r = 0; r < P; ++r) {
      const Deviation d =
          deviation(widened(shard_of(bf16.out, lay, int(r))), shard_of(exact.out, lay, int(r)));
      EXPECT_GT(d.relative(), fp32_scale) << "P " << P << " rank " << r;
    }
  }
}

// bf16 on the wire (mla/wire.hpp): on every rank of every form and variant
// (overlap on and off, under deferred delivery, uneven, zigzag, packed),
// the ledger of a real bf16 run is the closed form at 2 bytes an activation
// element and fp32's 4 for the gradient all-reduce, byte for byte, and so
// half an fp32 run's for every activation label; the memory model (a
// count-only run at bf16) equals the bf16 run's pool, the wire's bf16
// blocks included; and the counted GEMM and attention work is fp32's.
// With --grad-reduce bf16 the gradient all-reduce moves half fp32's bytes
// too, and every gradient it leaves is a bf16 value (with fp32's, sums of
// bf16 values that bf16 cannot hold).
TEST(Bf16, TheWireMovesBf16) {
  const MlaConfig cfg = test_config(7);
  struct Case {
    SpLayout lay;
    std::string doc_lens;  // empty: one document a row
  };
  const std::vector<Case> cases = {
      {SpLayout::custom(2, {5, 4, 4}, {2, 2, 1}), ""},
      {SpLayout::even(1, 13, 5, 3), ""},  // B 1, contiguous: the gathers land in place
      {SpLayout::even(1, 13, 5, 4, SeqLayout::zigzag), ""},
      {SpLayout::even(2, 13, 5, 2), "4,5,4"}};
  for (const GradReduce reduce : {GradReduce::fp32, GradReduce::bf16})
    for (const Case& c : cases) {
      const Inputs<float> in = make_inputs(cfg, c.lay.batch, c.lay.seq);
      std::optional<Documents> docs;
      if (!c.doc_lens.empty()) docs = Documents::parse_lengths(c.doc_lens, c.lay.batch, c.lay.seq);
      for (FormVariant v : test::form_variants(cfg, test::WithOverlap::yes)) {
        RunSpec spec;
        spec.variant = v;
        spec.attention = AttentionKind::flash;
        spec.documents = docs ? &*docs : nullptr;
        spec.deferred_delivery_for_testing = true;
        const BlockRun<float> fp32 = run_local(cfg, c.lay, in.w, in.x, in.dout, spec);
        const UsePrecision bf16(Precision::bf16, reduce);
        const BlockRun<float> run = run_local(cfg, c.lay, in.w, in.x, in.dout, spec);
        if (c.lay.ranks > 1) {
          std::int64_t not_bf16 = 0;
          run.grads.for_each([&](const std::string&, const TensorF& g) {
            for (std::int64_t i = 0; i < g.numel(); ++i) not_bf16 += !is_bf16(g[i]);
          });
          if (reduce == GradReduce::bf16)
            EXPECT_EQ(not_bf16, 0) << to_string(v) << ": a gradient the bf16 all-reduce left";
          else
            EXPECT_GT(not_bf16, 0) << to_string(v) << ": the fp32 all-reduce's sums";
        }
        for (const RankReport& rep : run.ranks) {
          const std::string tag = to_string(v) + " " + c.lay.describe() + " " + c.doc_lens +
                                  " rank " + std::to_string(rep.rank) + " --grad-reduce " +
                                  to_string(reduce);
          const CommPrediction pred = predict_comm(
              cfg, c.lay, v, rep.rank, wire_element_bytes(Precision::bf16, reduce, 4), true, true);
          const Ledger& as_fp32 = fp32.ranks[size_t(rep.rank)].ledger;
          ASSERT_EQ(rep.ledger.entries().size(), pred.size()) << tag;
          for (const auto& [key, entry] : rep.ledger.entries()) {
            const std::string where = tag + " " + to_string(key.first) + "/" + key.second;
            const auto it = pred.find(key);
            ASSERT_NE(it, pred.end()) << where << " is in the ledger but not in the model";
            EXPECT_EQ(entry.bytes_sent, it->second.sent) << where;
            EXPECT_EQ(entry.bytes_received, it->second.received) << where;
            EXPECT_EQ(entry.calls, it->second.calls) << where;
            const LedgerEntry& e32 = as_fp32.entries().at(key);
            const std::int64_t ratio =
                key.second == "grad_allreduce" && reduce == GradReduce::fp32 ? 1 : 2;
            EXPECT_EQ(entry.bytes_sent * ratio, e32.bytes_sent) << where << " against fp32";
            EXPECT_EQ(entry.bytes_received * ratio, e32.bytes_received) << where << " against fp32";
          }
          ops::OpCounts counted16, counted32;
          MemoryModelOptions options;
          options.op_counts = &counted16;
          const MemoryPrediction p =
              predict_memory(cfg, c.lay, v, AttentionKind::flash, rep.rank, 4, options);
          EXPECT_EQ(rep.memory.peak_activations, p.peak_activations) << tag;
          EXPECT_EQ(rep.memory.peak_comm_buffers, p.peak_comm_buffers) << tag;
          EXPECT_EQ(rep.memory.peak_working, p.peak_working) << tag;
          EXPECT_EQ(rep.memory.after_forward, p.after_forward) << tag;
          {
            const UsePrecision at_fp32(Precision::fp32);
            options.op_counts = &counted32;
            predict_memory(cfg, c.lay, v, AttentionKind::flash, rep.rank, 4, options);
          }
          EXPECT_EQ(counted16.gemm_calls, counted32.gemm_calls) << tag;
          EXPECT_EQ(counted16.attention_calls, counted32.attention_calls) << tag;
        }
      }
    }
}

// The wire's in-place conversions (wire.hpp): an fp32 block narrowed into
// the front of itself, and bf16 values widened from the front of an fp32
// buffer into all of it, across several of their chunks and at an odd
// length, give to_bf16's and to_float's bits for every element.
TEST(Bf16, WireConvertsInPlace) {
  for (const std::int64_t n : {std::int64_t(1), std::int64_t(1023), std::int64_t(2500)}) {
    std::vector<float> x(static_cast<size_t>(n));
    fill_normal(x.data(), n, 3, 1, 0, 5.0);
    std::vector<float> buf = x;
    wire::narrow(buf.data(), buf.data(), n);
    std::vector<bf16> narrowed(static_cast<size_t>(n));
    std::memcpy(narrowed.data(), buf.data(), sizeof(bf16) * size_t(n));
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_EQ(narrowed[size_t(i)], to_bf16(x[size_t(i)])) << "n " << n << " element " << i;
    wire::widen(buf.data(), buf.data(), n);
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(buf[size_t(i)]),
                std::bit_cast<std::uint32_t>(to_float(to_bf16(x[size_t(i)]))))
          << "n " << n << " element " << i;
  }
}

// The tensors bf16 runs keep for backward at 2 bytes (ops::keep_narrowed:
// the attention's q, k, v, o_loc and each form's other tensors that hold
// bf16 values or that backward reads only as rounded operands) change no
// bit: every form and variant, overlap on and off, at P 1-4 with uneven
// shards, zigzag and packed, rq 0 and > 0, gives the same out, dx and
// gradients with them held narrowed as with them kept in fp32; and at P 1
// explicit's and laga's activations after forward are smaller by exactly 2
// bytes an element of q_h, k_h, v_h (B, S, H, dqk / dqk / dv) and o_loc
// (B, S, H dv), and laga's by its gathered latent (B, S, C+dr) too, in the
// pool and in the memory model.
TEST(Bf16, KeptTensorsHeldAt2BytesChangeNoBit) {
  const std::int64_t B = 2, S = 13;
  struct Case {
    SpLayout lay;
    std::string doc_lens;  // empty: one document a row
  };
  const std::vector<Case> cases{{SpLayout::custom(B, {13}, {5}), ""},
                                {SpLayout::custom(B, {7, 6}, {3, 2}), ""},
                                {SpLayout::custom(B, {5, 4, 4}, {2, 2, 1}), ""},
                                {SpLayout::custom(B, {4, 3, 3, 3}, {2, 1, 1, 1}), ""},
                                {SpLayout::even(B, S, 5, 4, SeqLayout::zigzag), ""},
                                {SpLayout::even(B, S, 5, 2), "4,5,4"}};
  struct Restore {
    ~Restore() { ops::narrow_kept_tensors = true; }
  } restore;
  for (std::int64_t rq : {0, 7}) {
    const MlaConfig cfg = test_config(rq);
    const Inputs<float> in = make_inputs(cfg, B, S);
    for (const Case& c : cases) {
      std::optional<Documents> docs;
      if (!c.doc_lens.empty()) docs = Documents::parse_lengths(c.doc_lens, B, S);
      for (FormVariant v : test::form_variants(cfg, test::WithOverlap::yes)) {
        const std::string tag =
            to_string(v) + " rq" + std::to_string(rq) + " " + c.lay.describe() + " " + c.doc_lens;
        RunSpec spec;
        spec.variant = v;
        spec.attention = AttentionKind::flash;
        spec.documents = docs ? &*docs : nullptr;
        const UsePrecision bf16(Precision::bf16);
        ops::narrow_kept_tensors = true;
        const BlockRun<float> held = run_local(cfg, c.lay, in.w, in.x, in.dout, spec);
        ops::narrow_kept_tensors = false;
        const BlockRun<float> kept = run_local(cfg, c.lay, in.w, in.x, in.dout, spec);
        const auto a = tensors(held), b = tensors(kept);
        ASSERT_EQ(a.size(), b.size());
        for (std::size_t i = 0; i < a.size(); ++i)
          EXPECT_EQ(std::memcmp(a[i].second->data(), b[i].second->data(),
                                std::size_t(a[i].second->bytes())),
                    0)
              << tag << " " << a[i].first << " differs with the kept tensors held narrowed";
        if (c.lay.ranks != 1 || !(v == Form::explicit_form || v == Form::laga)) continue;
        const std::int64_t H = cfg.n_heads, dqk = cfg.qk_head_dim(), dv = cfg.v_head_dim;
        // laga keeps its gathered latent (B, S, C+dr) at 2 bytes too.
        const std::int64_t latent =
            v == Form::laga ? B * S * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) : 0;
        const std::int64_t narrowed = B * S * H * (2 * dqk + dv) + B * S * H * dv + latent;
        EXPECT_EQ(held.ranks[0].memory.after_forward,
                  kept.ranks[0].memory.after_forward - 2 * narrowed)
            << tag;
        for (bool on : {true, false}) {
          ops::narrow_kept_tensors = on;
          const MemoryPrediction m = predict_memory(cfg, c.lay, v, AttentionKind::flash, 0, 4);
          EXPECT_EQ(m.after_forward, (on ? held : kept).ranks[0].memory.after_forward) << tag;
        }
      }
    }
  }
}

// The ring forms hold their blocks at 2 bytes in bf16 (mla/ring.hpp, the
// top): the own block and q narrowed before the ring, each arriving block
// born narrowed, ring_latent's up-projected K/V narrowed, all read in place
// by the attention (the same bits: KeptTensorsHeldAt2BytesChangeNoBit). At
// a real block's shape (D 2048, H 16, C 512, S 8192, P 4), on every bf16
// flash ISA this machine runs, each form's bf16 peak is below the same bf16
// run keeping every tensor in fp32 (0.69-0.78x on Zen 4). With the
// AVX512_BF16 kernels, which read the bf16 blocks in place, it is also below
// the fp32 peak (0.80-0.85x with oneDNN's bf16 GEMMs, up to 0.94x where they
// widen and their operand copies are fp32), where blocks held in fp32
// containers, with a bf16 copy of each leaving one, put it at 1.00-1.03x.
// The fp32 flash path (auto's choice on Intel CPUs, where VDPBF16PS does not
// pay: flash_bf16_dot_products_pay) widens each call's K and V into its
// workspace, so there the bf16 peak can exceed fp32's (1.00-1.16x on a
// Xeon with AVX512_BF16, 2026-12-06); docs/accounting.md, "The ring forms'
// blocks". Asserting fp32's bound on that path failed on every Intel CPU.
TEST(Bf16, RingFormsHoldTheirBlocksAtTwoBytes) {
  MlaConfig cfg;
  cfg.dim = 2048, cfg.n_heads = 16, cfg.q_lora_rank = 0, cfg.kv_lora_rank = 512;
  cfg.qk_nope_head_dim = 128, cfg.qk_rope_head_dim = 64, cfg.v_head_dim = 128;
  cfg.validate();
  const FlashBf16Isa before = flash_bf16_isa();
  struct Restore {
    FlashBf16Isa isa;
    ~Restore() {
      ops::narrow_kept_tensors = true;
      set_flash_bf16_isa(isa);
    }
  } restore{before};
  const SpLayout lay = SpLayout::even(1, 8192, cfg.n_heads, 4);
  for (FlashBf16Isa isa : flash_bf16_isas_available()) {
    set_flash_bf16_isa(isa);
    for (Form f : {Form::ring_kv, Form::ring_latent, Form::a2a_p2p}) {
      const FormVariant v = f;
      auto peak = [&](Precision p, bool held) {
        const UsePrecision use(p);
        ops::narrow_kept_tensors = held;
        return predict_memory(cfg, lay, v, AttentionKind::flash, 0, 4).peak_working;
      };
      const std::int64_t fp32 = peak(Precision::fp32, true), held = peak(Precision::bf16, true),
                         kept = peak(Precision::bf16, false);
      const std::string tag = std::string(to_string(v)) + " (flash " + to_string(isa) + ")";
      EXPECT_LT(held, kept) << tag << ": the bf16 peak against keeping every tensor fp32";
      if (isa == FlashBf16Isa::avx512_bf16) {
        EXPECT_LT(held, fp32) << tag << ": the bf16 peak against fp32's";
      }
    }
  }
}

TEST(Bf16, DoubleRefusesIt) {
  const MlaConfig cfg = test_config(0);
  const Inputs<double> ind = widened(cfg, make_inputs(cfg, 1, 5));
  const UsePrecision bf16(Precision::bf16);
  RunSpec spec;
  spec.attention = AttentionKind::flash;
  EXPECT_THROW(run_local(cfg, SpLayout::even(1, 5, cfg.n_heads, 1), ind.w, ind.x, ind.dout, spec),
               Error);
}

TEST(Bf16, EagerIsRefused) {
  const MlaConfig cfg = test_config(0);
  const Inputs<float> in = make_inputs(cfg, 1, 5);
  const UsePrecision bf16(Precision::bf16);
  RunSpec spec;
  spec.attention = AttentionKind::eager;
  EXPECT_THROW(run_local(cfg, SpLayout::even(1, 5, cfg.n_heads, 1), in.w, in.x, in.dout, spec),
               Error);
}

TEST(Bf16, PrecisionNames) {
  for (Precision p : {Precision::fp32, Precision::bf16})
    EXPECT_EQ(parse_precision(to_string(p)), p);
  EXPECT_THROW(parse_precision("float16"), Error);
}

// ------------------------------------------------------------ the op layer

struct Gemm {
  std::int64_t M, N, K;
  std::vector<float> a, b;  // (M, K), (K, N) row-major, as given: not bf16 values
};

Gemm random_gemm(std::int64_t M, std::int64_t N, std::int64_t K) {
  Gemm g{M, N, K, std::vector<float>(std::size_t(M * K)), std::vector<float>(std::size_t(K * N))};
  fill_normal(g.a.data(), M * K, 9, 1, 0, 1.0);
  fill_normal(g.b.data(), K * N, 9, 2, 0, 1.0);
  return g;
}

// ops::gemm under bf16 = the bf16 value of the exact product of the rounded
// operands: the fp32 sum of K exact products (each of two 8-bit
// significands: exact in fp32) errs by at most K 2^-24 of sum |a b|, far
// below the final rounding's u; so the result is the rounded exact sum or
// its neighbour, within 2u of it. Against the unrounded operands' product
// it is not: the operands' rounding moves the sum by order u / sqrt(K) of
// sum |a b|, tens of times fp32's rounding.
// round_in_place (the vectorised conversions, a chunk at a time) gives
// to_bf16's bits for every element of a strided view, rows longer than its
// chunk included, and leaves the columns outside the view as they were.
TEST(Bf16, RoundInPlaceIsToBf16OnTheViewOnly) {
  const std::int64_t rows = 3, cols = 2050, ld = 2053;
  std::vector<float> x(size_t(rows * ld));
  fill_normal(x.data(), std::int64_t(x.size()), 0, 7, 0, 3.0);
  x[5] = std::numeric_limits<float>::infinity(), x[6] = -0.0f, x[7] = 1e-40f;  // inf, -0, denormal
  x[8] = std::numeric_limits<float>::quiet_NaN(), x[9] = 3.0e38f;  // NaN, rounds past bf16's max
  const std::vector<float> before = x;
  ops::bf16_path::round_in_place(ops::Mat<float>{x.data(), rows, cols, ld});
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < ld; ++j) {
      const float b = before[size_t(i * ld + j)], got = x[size_t(i * ld + j)];
      const float want = j < cols ? to_float(to_bf16(b)) : b;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(want))
          << "row " << i << " col " << j << " of " << b;
    }
}

TEST(Bf16, GemmRoundsOperandsAndFreshOutputs) {
  const Gemm g = random_gemm(17, 23, 40);
  std::vector<float> c(std::size_t(g.M * g.N), 0.0f), acc(c.size(), 1.0f);
  const ops::Mat<const float> A{g.a.data(), g.M, g.K, g.K}, B{g.b.data(), g.K, g.N, g.N};
  {
    const UsePrecision bf16(Precision::bf16);
    ops::gemm(ops::Mat<float>{c.data(), g.M, g.N, g.N}, 0.0f, A, false, B, false);
    ops::gemm(ops::Mat<float>{acc.data(), g.M, g.N, g.N}, 1.0f, A, false, B, false);
  }
  std::int64_t fresh_not_bf16 = 0, acc_not_bf16 = 0;
  double worst = 0, unrounded_gap = 0, sum_abs = 0;
  for (std::int64_t i = 0; i < g.M; ++i)
    for (std::int64_t j = 0; j < g.N; ++j) {
      double rounded = 0, unrounded = 0, row_abs = 0;
      for (std::int64_t k = 0; k < g.K; ++k) {
        row_abs += std::abs(double(g.a[i * g.K + k]) * double(g.b[k * g.N + j]));
        rounded += double(to_float(to_bf16(g.a[i * g.K + k]))) *
                   double(to_float(to_bf16(g.b[k * g.N + j])));
        unrounded += double(g.a[i * g.K + k]) * double(g.b[k * g.N + j]);
      }
      sum_abs = std::max(sum_abs, row_abs);
      const float got = c[std::size_t(i * g.N + j)];
      fresh_not_bf16 += !is_bf16(got);
      acc_not_bf16 += !is_bf16(acc[std::size_t(i * g.N + j)]);
      worst = std::max(worst, std::abs(got - rounded) / std::abs(rounded));
      unrounded_gap =
          std::max(unrounded_gap, std::abs(acc[std::size_t(i * g.N + j)] - 1.0 - unrounded));
    }
  EXPECT_EQ(fresh_not_bf16, 0) << "a fresh product is stored as bf16";
  EXPECT_GT(acc_not_bf16, 0) << "an accumulated product stays an fp32 sum";
  EXPECT_LE(worst, 2 * kU);
  // The operands were rounded: the accumulated (unrounded-output) product
  // is away from the fp32 operands' product by more than an fp32 GEMM of
  // them can err (K + 1 roundings of 2^-24 of sum |a b|, the + 1 the add).
  EXPECT_GT(unrounded_gap, double(g.K + 1) * std::pow(2.0, -24) * (sum_abs + 1));
}

// linear's y and linear_backward's fresh dx are bf16 values; dW is an fp32
// accumulation (1 + a sum: not a bf16 value in general).
TEST(Bf16, LinearRoundsActivationsNotWeightGradients) {
  const std::int64_t N = 9, in = 24, out = 14;
  TensorF x({N, in}), w({out, in}), y({N, out}), dy({N, out}), dx({N, in}), dw({out, in});
  fill_normal(x.data(), x.numel(), 4, 1, 0, 1.0);
  fill_normal(w.data(), w.numel(), 4, 2, 0, 1.0);
  fill_normal(dy.data(), dy.numel(), 4, 3, 0, 1.0);
  for (std::int64_t i = 0; i < dw.numel(); ++i) dw[i] = 1.0f;
  {
    const UsePrecision bf16(Precision::bf16);
    ops::linear(ops::mat(y), ops::mat(std::as_const(x)), w);
    ops::Mat<float> dxm = ops::mat(dx);
    ops::linear_backward(&dxm, false, dw, ops::mat(std::as_const(dy)), ops::mat(std::as_const(x)),
                         w);
  }
  auto count_bf16 = [](const TensorF& t) {
    std::int64_t n = 0;
    for (std::int64_t i = 0; i < t.numel(); ++i) n += is_bf16(t[i]);
    return n;
  };
  EXPECT_EQ(count_bf16(y), y.numel());
  EXPECT_EQ(count_bf16(dx), dx.numel());
  EXPECT_LT(count_bf16(dw), dw.numel());
}

// RowSlicedLinears (the MoE's routed experts' GEMMs, model/moe.cpp): a call
// of no more rows than its slice gives bf16_path::linear's and
// linear_backward's bits; a call of more runs slice by slice, y and dx rows
// independent (within one bf16 rounding of the whole call's: the GEMM's
// blocking may follow M) and dW summed over the slices in fp32; its scratch
// is one pool tensor of the size its widest shape needs, whether or not
// it computes; and a run made for forward refuses a backward.
TEST(Bf16, RowSlicedLinearsAreTheLinearsSliceBySlice) {
  const std::int64_t N = 23, in = 24, out = 14;
  TensorF x({N, in}), w({out, in}), dy({N, out});
  fill_normal(x.data(), x.numel(), 5, 1, 0, 1.0);
  fill_normal(w.data(), w.numel(), 5, 2, 0, 1.0);
  fill_normal(dy.data(), dy.numel(), 5, 3, 0, 1.0);
  const UsePrecision bf16(Precision::bf16);
  struct Out {
    std::vector<float> y, dx, dw;
  };
  const auto fresh = [&] {
    return Out{std::vector<float>(size_t(N * out)), std::vector<float>(size_t(N * in)),
               std::vector<float>(size_t(out * in), 0.5f)};
  };
  Out whole = fresh();
  ops::bf16_path::linear(whole.y.data(), x.data(), w.data(), N, in, out);
  ops::bf16_path::linear_backward(whole.dx.data(), false, whole.dw.data(), dy.data(), x.data(),
                                  w.data(), N, in, out);
  const auto sliced = [&](std::int64_t rows) {
    Out r = fresh();
    ops::bf16_path::RowSlicedLinears fwd(rows, {{in, out}, {out, in}}, false);
    fwd.forward(r.y.data(), x.data(), w.data(), N, in, out);
    ops::bf16_path::RowSlicedLinears bwd(rows, {{in, out}}, true);
    bwd.backward(r.dx.data(), false, r.dw.data(), dy.data(), x.data(), w.data(), N, in, out);
    return r;
  };
  const Out one = sliced(N);
  EXPECT_EQ(one.y, whole.y);
  EXPECT_EQ(one.dx, whole.dx);
  EXPECT_EQ(one.dw, whole.dw);
  const Out five = sliced(5);
  const auto near = [](const std::vector<float>& a, const std::vector<float>& b, double rel) {
    double worst = 0, scale = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
      scale = std::max(scale, std::abs(double(b[i])));
    }
    return worst <= rel * scale;
  };
  EXPECT_TRUE(near(five.y, whole.y, kU));
  EXPECT_TRUE(near(five.dx, whole.dx, kU));
  EXPECT_TRUE(near(five.dw, whole.dw, 1e-5));  // fp32 sums in another grouping
  EXPECT_NE(five.dw, std::vector<float>(size_t(out * in), 0.5f)) << "dW was not summed into";
  // The scratch: one pool tensor, its size from the widest shape and the
  // slice (w, then x's slice, each from a 64-byte line), in count-only too.
  const std::int64_t e = gemm_bf16_path() == GemmBf16Path::widened_fp32 ? 4 : 2;
  const auto line = [](std::int64_t b) { return (b + 63) / 64 * 64; };
  for (bool count_only : {false, true}) {
    MemoryPool pool;
    pool.set_count_only(count_only);
    const PoolScope scope(pool);
    const ops::bf16_path::RowSlicedLinears run(5, {{in, out}, {out, in}}, true);
    EXPECT_EQ(pool.current(MemCategory::activations),
              line(e * out * in) + line(e * 5 * in) + line(e * 5 * out))
        << (count_only ? "count-only" : "real");
  }
  ops::bf16_path::RowSlicedLinears forward_only(5, {{in, out}}, false);
  EXPECT_THROW(forward_only.backward(whole.dx.data(), false, whole.dw.data(), dy.data(), x.data(),
                                     w.data(), N, in, out),
               Error);
}

}  // namespace
}  // namespace laga
