// The memory prediction (the count-only run of the block, memory_model.hpp)
// against the pool, byte for byte:
//  - against real runs of every form on small dims, P ranks as threads, float
//    and double, eager and flash, rq = 0 and > 0 (and then laga with the
//    query-latent exchange too), overlapped too, batch 1 and 2, even and
//    uneven shards (a rank with no head), forward-only too, under deferred
//    delivery (comm/communicator.hpp, "Overlap"): what the counted run
//    allocates is what the computing run allocates;
//  - the activations alive after forward against saved_for_backward_elements,
//    an independent closed form of what each form saves (the paper's Table 2
//    quantity), on real runs and on count-only runs up to DeepSeek-V3 dims;
//  - the prediction's forward+backward stretch against a direct
//    mla_forward/mla_backward under a count-only pool, over a sweep of S, P
//    and H up to DeepSeek-V3 dims, where the real thing would need tens of GiB.
#include <gtest/gtest.h>

#include <cmath>

#include "comm/dry_run_comm.hpp"
#include "common/variants.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "mla/memory_model.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

MlaConfig dims(std::int64_t D, std::int64_t H, std::int64_t C, std::int64_t dn, std::int64_t dr,
               std::int64_t dv, std::int64_t rq) {
  MlaConfig c;
  c.dim = D, c.n_heads = H, c.kv_lora_rank = C, c.qk_nope_head_dim = dn, c.qk_rope_head_dim = dr,
  c.v_head_dim = dv, c.q_lora_rank = rq;
  c.validate();
  return c;
}

std::string tag(const MlaConfig& cfg, const SpLayout& lay, FormVariant f, AttentionKind a, int r) {
  return to_string(f) + " " + to_string(a) + " H=" + std::to_string(cfg.n_heads) +
         " rq=" + std::to_string(cfg.q_lora_rank) + " B=" + std::to_string(lay.batch) + " " +
         lay.describe() + " rank " + std::to_string(r);
}

void expect_matches(const MemoryPrediction& p, const RankMemory& m, const std::string& where) {
  EXPECT_EQ(m.peak_activations, p.peak_activations) << where << " activations";
  EXPECT_EQ(m.peak_comm_buffers, p.peak_comm_buffers) << where << " comm buffers";
  EXPECT_EQ(m.peak_working, p.peak_working)
      << where << " working; model peak at '" << p.forward_backward.where << "'";
  EXPECT_EQ(m.gradients, p.gradients) << where << " gradients";
  EXPECT_EQ(m.parameters, p.parameters) << where << " parameters";
}

template <class T>
void check_real(const MlaConfig& cfg, const SpLayout& lay, bool backward) {
  MlaParams<T> w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
  init_params(w, 11, 0.1);
  Tensor<T> x({lay.batch, lay.seq, cfg.dim}), dout({lay.batch, lay.seq, cfg.dim});
  fill_normal(x.data(), x.numel(), 1, 1, 0, 1.0);
  fill_normal(dout.data(), dout.numel(), 1, 2, 0, 1.0);
  for (FormVariant f : test::form_variants(cfg, test::WithOverlap::yes))
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash}) {
      RunSpec spec;
      spec.variant = FormVariant(f);
      spec.attention = a;
      spec.backward = backward;
      // Its staging is outside the pools: it must change no count, and the
      // overlapped variants keep their buffers to the wait under it.
      spec.deferred_delivery_for_testing = true;
      const BlockRun<T> run = run_local(cfg, lay, w, x, dout, spec);
      MemoryModelOptions opt;
      opt.backward = backward;
      for (const RankReport& rep : run.ranks) {
        const MemoryPrediction p = predict_memory(cfg, lay, f, a, rep.rank, sizeof(T), opt);
        const std::string where = tag(cfg, lay, f, a, rep.rank) + (backward ? "" : " fwd-only");
        expect_matches(p, rep.memory, where);
        EXPECT_EQ(rep.memory.after_forward,
                  saved_for_backward_elements(cfg, lay, f, a, rep.rank) * std::int64_t(sizeof(T)))
            << where << " saved for backward";
      }
    }
}

TEST(MemoryModel, ExactOnRealRuns) {
  const MlaConfig c0 = dims(32, 5, 16, 8, 4, 6, 0), c7 = dims(32, 5, 16, 8, 4, 6, 7);
  for (const MlaConfig* cfg : {&c0, &c7}) {
    check_real<float>(*cfg, SpLayout::even(1, 13, 5, 1), true);
    check_real<float>(*cfg, SpLayout::even(2, 13, 5, 3), true);
    check_real<float>(*cfg, SpLayout::custom(1, {6, 1, 5}, {0, 3, 2}), true);
    check_real<float>(*cfg, SpLayout::custom(2, {4, 3, 3, 3}, {2, 1, 1, 1}), false);
    // Zigzag shards (two ranges a rank, uneven chunks; P 4 at S 13).
    check_real<float>(*cfg, SpLayout::even(2, 13, 5, 3, SeqLayout::zigzag), true);
    check_real<float>(*cfg, SpLayout::even(1, 13, 5, 4, SeqLayout::zigzag), true);
  }
  // Another element size: the sequence is dtype-independent, bytes scale with e.
  check_real<double>(c7, SpLayout::even(2, 11, 5, 2), true);
}

// One rank of any size without storage: the rank alone, on a dry-run
// communicator, under a count-only pool. Checks the whole run (run_rank) and
// the forward+backward stretch apart (what `laga compare` reports).
void check_count_only(const MlaConfig& cfg, const SpLayout& lay, const RopeTable& rope, int r,
                      FormVariant f, AttentionKind a) {
  MemoryPool pool;
  pool.set_count_only(true);
  PoolScope scope(pool);
  const MlaParams<float> w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
  const TensorF x({lay.batch, lay.seq, cfg.dim}), dout({lay.batch, lay.seq, cfg.dim});
  const MemoryPrediction p = predict_memory(cfg, lay, f, a, r, 4);
  const std::string where = tag(cfg, lay, f, a, r) + " S=" + std::to_string(lay.seq);
  EXPECT_EQ(p.after_forward, 4 * saved_for_backward_elements(cfg, lay, f, a, r))
      << where << " saved for backward";
  {
    DryRunCommunicator comm(r, lay.ranks);
    RunSpec spec;
    spec.variant = FormVariant(f);
    spec.attention = a;
    const RankResult<float> res = run_rank(comm, cfg, lay, rope, w, x, dout, spec);
    expect_matches(p, res.report.memory, where);
  }
  {
    // forward + backward alone, as cmd_compare measures it
    DryRunCommunicator comm(r, lay.ranks);
    const BlockContext ctx{cfg, lay, comm, rope, f, a, nullptr};
    const TensorF x_loc = shard_of(x, lay, r), dout_loc = shard_of(dout, lay, r);
    MlaParams<float> grads = MlaParams<float>::zeros(cfg, MemCategory::gradients);
    const std::int64_t base =
        pool.current(MemCategory::activations) + pool.current(MemCategory::comm_buffers);
    pool.reset_peaks();
    MlaSaved<float> saved;
    TensorF out, dx;
    mla_forward(ctx, w, x_loc, out, saved);
    mla_backward(ctx, w, x_loc, dout_loc, saved, dx, grads);
    EXPECT_EQ(pool.peak_working() - base, p.forward_backward.bytes)
        << where << " forward+backward; model peak at '" << p.forward_backward.where << "'";
  }
}

TEST(MemoryModel, ExactOnCountOnlySweepToDeepSeekV3Dims) {
  // The paper's dims (D 7168, C 512, dn = dv = 128, dr 64, rq 0) with H and S
  // swept; P up to 16 with uneven S; first and last rank of each group.
  for (std::int64_t H : {16, 32, 64, 128}) {
    const MlaConfig cfg = dims(7168, H, 512, 128, 64, 128, 0);
    for (std::int64_t S : {1024, 4096, 16384, 16383}) {
      const RopeTable rope(cfg.rope(), S);  // the one costly object here: build it once
      for (int P : {1, 2, 4, 8, 16}) {
        const SpLayout lay = SpLayout::even(1, S, H, P);
        for (Form f : all_forms())
          for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
            for (int r : {0, P - 1}) check_count_only(cfg, lay, rope, r, f, a);
      }
    }
  }
  // DeepSeek-V3 as shipped (rq = 1536), batch 2, H % P != 0; P = 256 > H
  // (ranks without heads) for the query-latent exchange.
  const MlaConfig v3 = MlaConfig::preset("deepseek-v3");
  const RopeTable rope(v3.rope(), 4096);
  for (int P : {3, 8})
    for (FormVariant f : test::form_variants(v3, test::WithOverlap::yes))
      for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
        for (SeqLayout l : {SeqLayout::contiguous, SeqLayout::zigzag})
          check_count_only(v3, SpLayout::even(2, 4096, v3.n_heads, P, l), rope, P - 1, f, a);
  for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
    for (int r : {0, 255})
      for (FormVariant v : {FormVariant{Form::laga, QueryExchange::latent},
                            FormVariant{Form::laga2d, QueryExchange::latent, 16}})
        check_count_only(v3, SpLayout::even(1, 4096, v3.n_heads, 256), rope, r, v, a);
}

// The paper's claims, through the model: laga within 1% of explicit, absorbed
// above both, at DeepSeek-V3 dims (P = 8, eager, rq = 0).
TEST(MemoryModel, PaperShapeAtDeepSeekV3Dims) {
  const MlaConfig cfg = MlaConfig::preset("paper");
  for (std::int64_t S : {4096, 8192, 16384}) {
    const SpLayout lay = SpLayout::even(1, S, cfg.n_heads, 8);
    auto peak = [&](Form f) {
      return predict_memory(cfg, lay, f, AttentionKind::eager, 0, 4).forward_backward.bytes;
    };
    const double ex = double(peak(Form::explicit_form)), lg = double(peak(Form::laga)),
                 ab = double(peak(Form::absorbed));
    EXPECT_LT(std::abs(lg - ex) / ex, 0.01) << "S=" << S;
    EXPECT_GT(ab, ex) << "S=" << S;
    EXPECT_GT(ab, lg) << "S=" << S;
  }
}

TEST(MemoryModel, NamesWhatIsLiveAtThePeak) {
  const MlaConfig cfg = MlaConfig::preset("paper");
  const SpLayout lay = SpLayout::even(1, 16384, cfg.n_heads, 8);
  const MemoryPrediction p =
      predict_memory(cfg, lay, Form::explicit_form, AttentionKind::eager, 0, 4);
  ASSERT_FALSE(p.forward_backward.live.empty());
  // The eager probability matrix (B, H_r, S, S) dominates at long S.
  EXPECT_NE(p.forward_backward.live[0].name.find("probs"), std::string::npos)
      << p.forward_backward.live[0].name;
  EXPECT_EQ(p.forward_backward.live[0].bytes, 16 * 16384ll * 16384 * 4);
  std::int64_t sum = 0;
  for (const MemoryTerm& t : p.forward_backward.live) sum += t.bytes;
  EXPECT_EQ(sum, p.forward_backward.bytes);
}

// Kimi K3's gated NoPE MLA (mla_use_nope, mla_use_output_gate; dr 0 and dr
// unrotated): the model is exact on real runs (every form and variant, P 1
// to 3, uneven) and count-only at Kimi K3's attention dims (D 7168, H 96,
// C 512, dn = dv = 128, dr 64 unrotated, rq 1536), the gate's logits in the
// saved-for-backward closed form.
TEST(MemoryModel, ExactForGatedNope) {
  for (std::int64_t dr : {0, 4})
    for (std::int64_t rq : {0, 7}) {
      MlaConfig c = dims(32, 5, 16, 8, dr, 6, rq);
      c.mla_use_nope = true, c.mla_use_output_gate = true;
      check_real<float>(c, SpLayout::even(2, 13, 5, 3), true);
      check_real<float>(c, SpLayout::custom(1, {6, 1, 5}, {0, 3, 2}), true);
      check_real<float>(c, SpLayout::custom(2, {4, 3, 3, 3}, {2, 1, 1, 1}), false);
    }
  MlaConfig k3 = dims(7168, 96, 512, 128, 64, 128, 1536);
  k3.mla_use_nope = true, k3.mla_use_output_gate = true;
  const RopeTable rope = RopeTable::unbacked(k3.rope(), 4096);
  for (int P : {3, 8})
    for (FormVariant f : test::form_variants(k3, test::WithOverlap::yes))
      for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
        check_count_only(k3, SpLayout::even(1, 4096, k3.n_heads, P), rope, P - 1, f, a);
}

TEST(MemoryModel, RejectsBadArguments) {
  const MlaConfig cfg = dims(32, 5, 16, 8, 4, 6, 0);
  const SpLayout lay = SpLayout::even(1, 8, 5, 2);
  EXPECT_THROW(predict_memory(cfg, lay, Form::laga, AttentionKind::eager, 2, 4), Error);
  EXPECT_THROW(
      predict_memory(cfg, SpLayout::even(1, 8, 4, 2), Form::laga, AttentionKind::eager, 0, 4),
      Error);
}

}  // namespace
}  // namespace laga
