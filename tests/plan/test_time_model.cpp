// The time model's inputs: op counts from the count-only run equal those of
// a run with storage (so the planner reads what really runs), a linear's
// count is its GEMM's 2 M N K and its call the kernel's shape, the call list
// holds every counted FLOP, ranks fall into the right classes, a rank's
// compute is the sum of its calls' measured times where the profile has them,
// and its communication time is the link model's, collective by collective.
#include <gtest/gtest.h>

#include "comm/dry_run_comm.hpp"
#include "common/error_of.hpp"
#include "common/variants.hpp"
#include "mla/memory_model.hpp"
#include "mla/runner.hpp"
#include "plan/time_model.hpp"

namespace laga {
namespace {

MlaConfig tiny() {
  MlaConfig c = MlaConfig::preset("tiny");
  c.q_lora_rank = 16;  // the query latent's ops too
  return c;
}

TEST(OpCounts, ALinearCountsItsGemm) {
  MemoryPool pool;
  pool.set_count_only(true);
  PoolScope scope(pool);
  TensorF x({5, 7}), y({5, 3}), w({3, 7});
  ops::OpCounts c;
  {
    const ops::CountOps counting(c);
    ops::linear(ops::mat(y), ops::mat(x), w);
  }
  EXPECT_EQ(c.gemm_flops, 2.0 * 5 * 7 * 3);
  ops::linear(ops::mat(y), ops::mat(x), w);  // no counter: nothing added
  EXPECT_EQ(c.gemm_flops, 2.0 * 5 * 7 * 3);
  // linear_forward's gemm: (5, 7) by (3, 7)^T into (5, 3), contiguous.
  const ops::GemmCall forward{false, true, 5, 3, 7, 7, 7, 3, false};
  ASSERT_EQ(c.gemm_calls.size(), 1u);
  EXPECT_EQ(c.gemm_calls.at(forward), (ops::CallTally{1, 2.0 * 5 * 7 * 3}));
  {
    const ops::CountOps counting(c);
    TensorF dx({5, 7}), dw({3, 7});
    ops::Mat<float> dxm = ops::mat(dx);
    ops::linear_backward(&dxm, true, dw, ops::mat(y), ops::mat(x), w);
    ops::linear(ops::mat(y), ops::mat(x), w);
  }
  // laga::linear_backward's: dw (3, 7) += dy^T x, dx (5, 7) (+)= dy w.
  EXPECT_EQ(c.gemm_calls.at(forward).calls, 2);
  EXPECT_EQ(c.gemm_calls.at({true, false, 3, 7, 5, 3, 7, 7, true}).calls, 1);
  EXPECT_EQ(c.gemm_calls.at({false, false, 5, 7, 3, 3, 7, 7, true}).calls, 1);
  EXPECT_EQ(c.gemm_calls.size(), 3u);
}

// A strided view's GEMM is listed with its strides; an empty product runs no
// kernel and is not listed.
TEST(OpCounts, AGemmListsItsStrides) {
  MemoryPool pool;
  pool.set_count_only(true);
  PoolScope scope(pool);
  TensorF a({6, 4, 8}), b({10, 8}), c({6, 10}), e({6, 0}), f({10, 0});
  ops::OpCounts n;
  {
    const ops::CountOps counting(n);
    // Head 1 of a (6, 4 heads, 8): a (6, 8) view with row stride 32.
    ops::gemm(ops::mat(c), 0.f, ops::mat(a, 6, 32).col_range(8, 8), false, ops::mat(b), true);
    ops::gemm(ops::mat(c), 1.f, ops::mat(e), false, ops::mat(f), true);  // K = 0
  }
  ASSERT_EQ(n.gemm_calls.size(), 1u);
  EXPECT_EQ(n.gemm_calls.begin()->first, (ops::GemmCall{false, true, 6, 10, 8, 32, 8, 10, false}));
}

// Every FLOP the counter counts is in its call list, with each call's own.
void expect_calls_hold_the_flops(const ops::OpCounts& c, const std::string& where) {
  double gemm = 0, attention = 0;
  for (const auto& [g, t] : c.gemm_calls) {
    EXPECT_EQ(t.flops, 2.0 * double(g.m) * double(g.n) * double(g.k) * double(t.calls)) << where;
    gemm += t.flops;
  }
  for (const auto& [a, t] : c.attention_calls) attention += t.flops;
  EXPECT_DOUBLE_EQ(gemm, c.gemm_flops) << where;
  EXPECT_DOUBLE_EQ(attention, c.attention_flops) << where;
}

// The count-only run counts exactly what a run with storage does, for every
// form and attention kernel, on uneven shards.
TEST(OpCounts, CountOnlyEqualsARealRun) {
  const MlaConfig cfg = tiny();
  const SpLayout lay = SpLayout::even(2, 11, cfg.n_heads, 3);
  const RopeTable rope(cfg.rope(), lay.seq);
  // Every variant in the registry; laga2d's default at P 3 is one head group
  // of three context groups, each rank attending its two query chunks.
  for (FormVariant f : test::form_variants(cfg, test::WithOverlap::yes))
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
      for (int r = 0; r < lay.ranks; ++r) {
        ops::OpCounts counted, real;
        MemoryModelOptions o;
        o.op_counts = &counted;
        predict_memory(cfg, lay, f, a, r, 4, o);
        {
          MemoryPool pool;
          PoolScope scope(pool);
          const MlaParams<float> w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
          const TensorF x({lay.batch, lay.seq, cfg.dim}), dout({lay.batch, lay.seq, cfg.dim});
          DryRunCommunicator comm(r, lay.ranks);
          RunSpec spec;
          spec.variant = FormVariant(f);
          spec.attention = a;
          const ops::CountOps counting(real);
          run_rank(comm, cfg, lay, rope, w, x, dout, spec);
        }
        const std::string where = to_string(f) + " rank " + std::to_string(r);
        EXPECT_GT(counted.gemm_flops, 0) << where;
        EXPECT_GT(counted.attention_flops, 0) << where;
        EXPECT_EQ(counted.gemm_flops, real.gemm_flops) << where;
        EXPECT_EQ(counted.attention_flops, real.attention_flops) << where;
        EXPECT_EQ(counted.elementwise_bytes, real.elementwise_bytes) << where;
        // The same kernel calls, shape by shape, and they hold every FLOP.
        EXPECT_EQ(counted.gemm_calls, real.gemm_calls) << where;
        EXPECT_EQ(counted.attention_calls, real.attention_calls) << where;
        expect_calls_hold_the_flops(counted, where);
        // Attention runs once forward and once backward, at the rank's heads.
        int forward = 0, backward = 0;
        for (const auto& [call, t] : counted.attention_calls) {
          EXPECT_EQ(call.kernel, a) << where;
          EXPECT_FALSE(call.documents) << where;
          (call.pass == ops::AttentionPass::forward ? forward : backward) += int(t.calls);
        }
        EXPECT_GE(forward, 1) << where;
        EXPECT_EQ(forward, backward) << where;
      }
}

// A phase's calls are those its run added: the three phases' lists sum to
// the whole run's.
TEST(TimeModel, PhasesSplitTheCallList) {
  const MlaConfig cfg = tiny();
  const SpLayout lay = SpLayout::even(1, 16, cfg.n_heads, 2);
  for (FormVariant f : test::form_variants(cfg, test::WithOverlap::yes)) {
    const RankWork w = rank_work(cfg, lay, f, AttentionKind::flash, 0, PlanDType::fp32);
    ops::OpCounts whole;
    MemoryModelOptions o;
    o.backward = o.grad_sync = true;
    o.op_counts = &whole;
    predict_memory(cfg, lay, f, AttentionKind::flash, 0, 4, o);
    std::map<ops::GemmCall, std::int64_t> sum;
    for (const ops::OpCounts& c : w.ops) {
      expect_calls_hold_the_flops(c, to_string(f));
      for (const auto& [g, t] : c.gemm_calls) sum[g] += t.calls;
    }
    std::map<ops::GemmCall, std::int64_t> want;
    for (const auto& [g, t] : whole.gemm_calls) want[g] = t.calls;
    EXPECT_EQ(sum, want) << to_string(f);
    for (const auto& [a, t] : w.ops[0].attention_calls)
      EXPECT_EQ(a.pass, ops::AttentionPass::forward) << to_string(f);
    for (const auto& [a, t] : w.ops[1].attention_calls)
      EXPECT_EQ(a.pass, ops::AttentionPass::backward) << to_string(f);
  }
}

// With every shape measured, compute is the sum of the calls' measured times
// (+ the elementwise bytes at the profile's bandwidth); with none, FLOPs at
// peak x efficiency; bf16 plans never read the fp32 measurements.
TEST(TimeModel, MeasuredShapesCostTheirCalls) {
  const MlaConfig cfg = tiny();
  const SpLayout lay = SpLayout::even(1, 32, cfg.n_heads, 2);
  const RankWork w =
      rank_work(cfg, lay, FormVariant(Form::laga), AttentionKind::flash, 0, PlanDType::fp32);
  const Fabric fabric = single_level({10e9, 20e-6, Topology::switched});
  HardwareProfile prof = load_profile("h100");
  const DeviceProfile& d = prof.device;
  const double peak = prof.peak_flops(PlanDType::fp32);
  const auto efficiency = rank_time(w, 2, prof, PlanDType::fp32, fabric);
  for (size_t ph = 0; ph < 3; ++ph) {
    const ops::OpCounts& c = w.ops[ph];
    EXPECT_DOUBLE_EQ(efficiency[ph].compute_s(),
                     c.gemm_flops / (peak * d.gemm_efficiency) +
                         c.attention_flops / (peak * d.attention_efficiency) +
                         c.elementwise_bytes / d.elementwise_bytes_per_s)
        << ph;
    EXPECT_EQ(efficiency[ph].compute.unmeasured_flops, efficiency[ph].compute.flops) << ph;
  }
  // Every GEMM shape at 1 ms per call, every attention shape at 5 ms.
  for (const ops::OpCounts& c : w.ops) {
    for (const auto& [g, t] : c.gemm_calls) prof.measured_shapes.gemm[g] = 1e-3;
    for (const auto& [a, t] : c.attention_calls) prof.measured_shapes.attention[a] = 5e-3;
  }
  const auto measured = rank_time(w, 2, prof, PlanDType::fp32, fabric);
  const auto bf16 = rank_time(
      rank_work(cfg, lay, FormVariant(Form::laga), AttentionKind::flash, 0, PlanDType::bf16), 2,
      prof, PlanDType::bf16, fabric);
  for (size_t ph = 0; ph < 3; ++ph) {
    const ops::OpCounts& c = w.ops[ph];
    double want = c.elementwise_bytes / d.elementwise_bytes_per_s;
    for (const auto& [g, t] : c.gemm_calls) want += 1e-3 * double(t.calls);
    for (const auto& [a, t] : c.attention_calls) want += 5e-3 * double(t.calls);
    EXPECT_DOUBLE_EQ(measured[ph].compute_s(), want) << ph;
    EXPECT_EQ(measured[ph].compute.unmeasured_flops, 0) << ph;
    EXPECT_EQ(measured[ph].comm_s, efficiency[ph].comm_s) << ph;
    EXPECT_EQ(bf16[ph].compute.unmeasured_flops, bf16[ph].compute.flops) << ph;
  }
  // One shape left out: its calls fall back to the efficiency.
  const auto [left_out, tally] = *w.ops[0].gemm_calls.begin();
  prof.measured_shapes.gemm.erase(left_out);
  const auto partial = rank_time(w, 2, prof, PlanDType::fp32, fabric);
  EXPECT_DOUBLE_EQ(partial[0].compute.unmeasured_flops, tally.flops);
  EXPECT_DOUBLE_EQ(partial[0].compute_s(), measured[0].compute_s() - 1e-3 * double(tally.calls) +
                                               tally.flops / (peak * d.gemm_efficiency));
}

TEST(TimeModel, MeasuredShapesCostPlansOfTheirDtypeOnly) {
  // A GPU's bf16 timings (scripts/time_shapes_torch.py) cost bf16 plans and
  // leave fp32 plans at the efficiency: the reverse of laga's fp32 CPU timings.
  const MlaConfig cfg = tiny();
  const SpLayout lay = SpLayout::even(1, 32, cfg.n_heads, 2);
  const Fabric fabric = single_level({10e9, 20e-6, Topology::switched});
  HardwareProfile prof = load_profile("h200");
  prof.measured_shapes.dtype = PlanDType::bf16;
  const auto work = [&](PlanDType t) {
    return rank_work(cfg, lay, FormVariant(Form::laga), AttentionKind::flash, 0, t);
  };
  const RankWork bf16 = work(PlanDType::bf16), fp32 = work(PlanDType::fp32);
  for (const ops::OpCounts& c : bf16.ops) {
    for (const auto& [g, t] : c.gemm_calls) prof.measured_shapes.gemm[g] = 2e-3;
    for (const auto& [a, t] : c.attention_calls) prof.measured_shapes.attention[a] = 7e-3;
  }
  const auto b = rank_time(bf16, 2, prof, PlanDType::bf16, fabric);
  const auto f = rank_time(fp32, 2, prof, PlanDType::fp32, fabric);
  for (size_t ph = 0; ph < 3; ++ph) {
    const ops::OpCounts& c = bf16.ops[ph];
    double want = c.elementwise_bytes / prof.device.elementwise_bytes_per_s;
    for (const auto& [g, t] : c.gemm_calls) want += 2e-3 * double(t.calls);
    for (const auto& [a, t] : c.attention_calls) want += 7e-3 * double(t.calls);
    EXPECT_DOUBLE_EQ(b[ph].compute_s(), want) << ph;
    EXPECT_EQ(b[ph].compute.unmeasured_flops, 0) << ph;
    EXPECT_EQ(f[ph].compute.unmeasured_flops, f[ph].compute.flops) << ph;
  }
}

TEST(TimeModel, RankClassesGroupRanksWithTheSameWork) {
  const MlaConfig cfg = tiny();  // 4 heads
  // S 10 over 4 ranks: tokens 3+3+2+2, heads 1 each.
  const RankClasses c =
      rank_classes(cfg, SpLayout::even(1, 10, cfg.n_heads, 4), FormVariant(Form::laga));
  ASSERT_EQ(c.class_of.size(), 4u);
  EXPECT_EQ(c.class_of[0], c.class_of[1]);
  EXPECT_EQ(c.class_of[2], c.class_of[3]);
  EXPECT_NE(c.class_of[0], c.class_of[2]);
  EXPECT_EQ(c.representatives, (std::vector<int>{0, 2}));
}

// What the planner costs of a class is its representative's work, so every
// rank of the class must do exactly that work: the same bytes per
// collective, peak, ops per phase and timeline. Checked for every variant
// on layouts where ranks of equal shards do different work: laga2d's
// context groups send each rank's tokens to the chunks they fall in, so at
// P 8 with one head group rank 0 sends 50.2 MB forward at DeepSeek-V3 dims
// and rank 3 92.1 MB (issue 29's bug: the classes keyed on the shards only).
void expect_same_work(const RankWork& a, const RankWork& b, const std::string& where) {
  EXPECT_EQ(a.peak_activation_bytes, b.peak_activation_bytes) << where;
  ASSERT_EQ(a.comm.size(), b.comm.size()) << where;
  for (const auto& [key, x] : a.comm) {
    const auto it = b.comm.find(key);
    ASSERT_NE(it, b.comm.end()) << where << " " << key.second;
    EXPECT_EQ(x.sent, it->second.sent) << where << " " << key.second;
    EXPECT_EQ(x.received, it->second.received) << where << " " << key.second;
    EXPECT_EQ(x.calls, it->second.calls) << where << " " << key.second;
  }
  for (size_t ph = 0; ph < 3; ++ph) {
    EXPECT_EQ(a.ops[ph].gemm_calls, b.ops[ph].gemm_calls) << where << " phase " << ph;
    EXPECT_EQ(a.ops[ph].attention_calls, b.ops[ph].attention_calls) << where << " phase " << ph;
    EXPECT_EQ(a.ops[ph].elementwise_bytes, b.ops[ph].elementwise_bytes) << where << " phase " << ph;
  }
  ASSERT_EQ(a.timeline.size(), b.timeline.size()) << where;
  for (size_t i = 0; i < a.timeline.size(); ++i) {
    EXPECT_EQ(a.timeline[i].event.bytes.sent, b.timeline[i].event.bytes.sent) << where << " " << i;
    EXPECT_EQ(a.timeline[i].event.bytes.received, b.timeline[i].event.bytes.received)
        << where << " " << i;
  }
}

TEST(TimeModel, EveryRankOfAClassDoesItsRepresentativesWork) {
  struct Case {
    const char* name;
    MlaConfig cfg;
    std::int64_t seq;
    int ranks;
    int head_groups;       // laga2d's; 0: the default rule
    int classes_at_least;  // laga2d's classes: more than the shards' 1 or 2
  };
  const Case cases[] = {
      {"tiny S 96 P 6", MlaConfig::preset("tiny"), 96, 6, 0, 3},
      {"small S 1024 P 8, 2 head groups", MlaConfig::preset("small"), 1024, 8, 2, 4},
      {"deepseek-v3 S 4096 P 8, 1 head group", MlaConfig::preset("deepseek-v3"), 4096, 8, 1, 4},
      {"tiny+rq S 37 P 4 (uneven)", tiny(), 37, 4, 1, 4},
  };
  for (const Case& k : cases) {
    const SpLayout lay = SpLayout::even(1, k.seq, k.cfg.n_heads, k.ranks);
    for (FormVariant v : test::form_variants(k.cfg, test::WithOverlap::yes)) {
      if (v.form == Form::laga2d) v.head_groups = k.head_groups;
      const RankClasses c = rank_classes(k.cfg, lay, v);
      ASSERT_EQ(c.class_of.size(), size_t(k.ranks));
      if (v.form == Form::laga2d) {
        EXPECT_GE(int(c.representatives.size()), k.classes_at_least) << k.name;
      }
      std::vector<RankWork> rep;
      for (int r : c.representatives)
        rep.push_back(rank_work(k.cfg, lay, v, AttentionKind::flash, r, PlanDType::fp32));
      for (int r = 0; r < k.ranks; ++r) {
        const int cls = c.class_of[size_t(r)];
        ASSERT_EQ(c.class_of[size_t(c.representatives[size_t(cls)])], cls);
        expect_same_work(rank_work(k.cfg, lay, v, AttentionKind::flash, r, PlanDType::fp32),
                         rep[size_t(cls)],
                         cat(k.name, ", ", to_string(v), ": rank ", r, " against rank ",
                             c.representatives[size_t(cls)]));
      }
    }
  }
}

TEST(TimeModel, CommunicationIsTheLinkModelPerCollective) {
  const MlaConfig cfg = tiny();
  const SpLayout lay = SpLayout::even(1, 64, cfg.n_heads, 2);
  const HardwareProfile prof = load_profile("h100");
  for (FormVariant f : {FormVariant(Form::explicit_form), FormVariant(Form::laga)}) {
    const RankWork w = rank_work(cfg, lay, f, AttentionKind::flash, 0, PlanDType::fp32);
    const Fabric fabric = single_level({10e9, 20e-6, Topology::switched});
    const auto t = rank_time(w, 2, prof, PlanDType::fp32, fabric);
    std::array<double, 3> want{};
    for (const auto& [key, b] : w.comm)
      want[size_t(key.first)] += collective_seconds(b.kind, 2, {b.sent, b.received}, fabric);
    for (size_t ph = 0; ph < 3; ++ph) EXPECT_DOUBLE_EQ(t[ph].comm_s, want[ph]) << ph;
    // bf16 counts the same FLOPs and half the bytes, but for the gradient
    // all-reduce's, which stay fp32's unless it is reduced in bf16; the
    // timeline's events carry the same bytes as the closed form.
    const RankWork h = rank_work(cfg, lay, f, AttentionKind::flash, 0, PlanDType::bf16);
    const RankWork hb =
        rank_work(cfg, lay, f, AttentionKind::flash, 0, PlanDType::bf16, GradReduce::bf16);
    for (size_t ph = 0; ph < 3; ++ph) {
      EXPECT_EQ(h.ops[ph].gemm_flops, w.ops[ph].gemm_flops);
      EXPECT_EQ(2 * h.ops[ph].elementwise_bytes, w.ops[ph].elementwise_bytes);
    }
    ASSERT_EQ(h.comm.size(), w.comm.size());
    for (const auto& [key, b] : w.comm) {
      const bool grads = key.first == Phase::grad_sync;
      EXPECT_EQ(h.comm.at(key).sent, grads ? b.sent : b.sent / 2) << key.second;
      EXPECT_EQ(hb.comm.at(key).sent, b.sent / 2) << key.second;
    }
    int grad_events = 0;
    for (const RankWork* x : {&h, &hb})
      for (const TimelineStep& s : x->timeline) {
        if (s.event.what != CollectiveEvent::What::issued || s.event.phase != Phase::grad_sync)
          continue;
        EXPECT_EQ(s.event.bytes.sent, x->comm.at({Phase::grad_sync, s.event.label}).sent);
        ++grad_events;
      }
    EXPECT_EQ(grad_events, 2);
  }
}

// The timeline holds every collective of the step in order, with the
// closed form's bytes; without started collectives it is the phases'
// compute and communication summed, for every form and uneven shards.
TEST(TimeModel, WithoutOverlapTheTimelineIsThePhasesSummed) {
  const MlaConfig cfg = tiny();
  const HardwareProfile prof = load_profile("h100");
  const Fabric fabric = single_level({2e9, 30e-6, Topology::switched});
  for (int P : {2, 3})
    for (Form f : all_forms()) {
      const SpLayout lay = SpLayout::even(1, 40, cfg.n_heads, P);
      const RankWork w =
          rank_work(cfg, lay, FormVariant(f), AttentionKind::flash, P - 1, PlanDType::bf16);
      std::int64_t issued = 0, sent = 0;
      for (const TimelineStep& s : w.timeline) {
        EXPECT_FALSE(s.event.started) << to_string(f);
        issued += s.event.what == CollectiveEvent::What::issued;
        sent += s.event.bytes.sent;
      }
      std::int64_t calls = 0;
      for (const auto& [key, b] : w.comm) calls += b.calls;
      EXPECT_EQ(issued, calls) << to_string(f) << " P " << P;
      EXPECT_EQ(sent, predicted_sent(w.comm)) << to_string(f) << " P " << P;
      double summed = 0;
      for (const PhaseTime& p : rank_time(w, P, prof, PlanDType::bf16, fabric))
        summed += p.compute_s() + p.comm_s;
      const StepTime t = step_time(w, P, prof, PlanDType::bf16, fabric);
      EXPECT_NEAR(t.step_s, summed, 1e-12 * summed) << to_string(f) << " P " << P;
      EXPECT_EQ(t.hidden_comm_s, 0) << to_string(f) << " P " << P;
    }
}

// laga --overlap on starts the latent's all-gather (forward) and its
// gradient's reduce-scatter (backward) and waits later: the timeline hides
// part of their link time under the compute issued between start and wait,
// never more than the started calls take, and nothing when there is no
// compute to hide under.
TEST(TimeModel, OverlapHidesStartedCollectivesUnderCompute) {
  const MlaConfig cfg = tiny();
  const SpLayout lay = SpLayout::even(1, 64, cfg.n_heads, 2);
  HardwareProfile prof = load_profile("h100");
  for (Form f : forms_with(&FormTraits::overlap)) {
    FormVariant on(f);
    on.overlap = Overlap::on;
    const RankWork plain =
        rank_work(cfg, lay, FormVariant(f), AttentionKind::flash, 0, PlanDType::fp32);
    const RankWork w = rank_work(cfg, lay, on, AttentionKind::flash, 0, PlanDType::fp32);
    int started = 0, waited = 0;
    for (const TimelineStep& s : w.timeline) {
      started += s.event.started;
      waited += s.event.what == CollectiveEvent::What::waited;
    }
    // laga's and laga2d's latent gather and its reduce-scatter; a ring
    // form starts every shift of its passes (at P 2: one forward, one
    // backward and the accumulators' two).
    std::int64_t ring_calls = 0;
    for (const auto& [key, b] : w.comm)
      if (b.kind == CollectiveKind::ring_shift) ring_calls += b.calls;
    const std::int64_t expected = ring_calls > 0 ? ring_calls : 2;
    EXPECT_EQ(started, expected) << to_string(f);
    EXPECT_EQ(waited, expected) << to_string(f);
    // At a slow link the started calls outlast the compute between start
    // and wait: some is hidden, less than the started calls' time and the
    // compute; the step is the sum less what is hidden, and shorter than
    // without overlap.
    for (double bw : {1e6, 1e8, 1e10}) {
      const Fabric fabric = single_level({bw, 50e-6, Topology::switched});
      double started_s = 0;
      for (const TimelineStep& s : w.timeline)
        if (s.event.started)
          started_s += collective_seconds(s.event.kind, 2, s.event.bytes, fabric);
      double compute = 0, summed = 0;
      for (const PhaseTime& p : rank_time(w, 2, prof, PlanDType::fp32, fabric))
        compute += p.compute_s(), summed += p.compute_s() + p.comm_s;
      const StepTime t = step_time(w, 2, prof, PlanDType::fp32, fabric);
      EXPECT_GT(t.hidden_comm_s, 0) << to_string(f) << " at " << bw;
      EXPECT_LE(t.hidden_comm_s, std::min(started_s, compute) * (1 + 1e-12))
          << to_string(f) << " at " << bw;
      EXPECT_NEAR(t.step_s, summed - t.hidden_comm_s, 1e-12 * summed);
      EXPECT_LT(t.step_s, step_time(plain, 2, prof, PlanDType::fp32, fabric).step_s)
          << to_string(f) << " at " << bw;
    }
    // No compute (an absurd peak and bandwidth): nothing to hide under.
    HardwareProfile instant = prof;
    instant.device.peak_flops_fp32 = 1e30;
    instant.device.elementwise_bytes_per_s = 1e30;
    const Fabric fabric = single_level({1e9, 50e-6, Topology::switched});
    EXPECT_LT(step_time(w, 2, instant, PlanDType::fp32, fabric).hidden_comm_s, 1e-15)
        << to_string(f);
  }
}

// A hand-made timeline: each segment `seconds` of elementwise work (at 1
// byte/s), then a blocking all-reduce of `bytes` (or, for the last, the end).
RankWork hand_timeline(const std::vector<double>& seconds, std::int64_t bytes) {
  RankWork w;
  for (size_t k = 0; k + 1 < seconds.size(); ++k) {
    TimelineStep s;
    s.compute_before.elementwise_bytes = seconds[k];
    s.event.kind = CollectiveKind::all_reduce;
    s.event.bytes = {bytes, bytes};
    w.timeline.push_back(s);
  }
  w.compute_after.elementwise_bytes = seconds.back();
  return w;
}

HardwareProfile one_byte_per_second(int shared_cores) {
  HardwareProfile p = load_profile("h100");
  p.device.elementwise_bytes_per_s = 1;
  p.shared_cores = shared_cores;
  return p;
}

// The ranks together: a collective runs once its last rank issues it, so
// the early rank waits for it (peer_wait_s), and the step is the critical
// path's; each rank's end is its phases' time - hidden + its waits.
TEST(GroupStepTime, ACollectiveWaitsForItsLastRank) {
  const Fabric fabric = single_level({1e9, 0.5, Topology::switched});  // 0.5 s a call
  const RankWork fast = hand_timeline({1, 2}, 8), slow = hand_timeline({3, 1}, 8);
  const HardwareProfile prof = one_byte_per_second(0);
  const double link = collective_seconds(CollectiveKind::all_reduce, 2, {8, 8}, fabric);
  const GroupStepTime g = group_step_time({&fast, &slow}, prof, PlanDType::fp32, fabric);
  EXPECT_DOUBLE_EQ(g.ranks[0].end_s, 3 + link + 2);
  EXPECT_DOUBLE_EQ(g.ranks[1].end_s, 3 + link + 1);
  EXPECT_DOUBLE_EQ(g.step_s, 3 + link + 2);
  EXPECT_DOUBLE_EQ(g.ranks[0].peer_wait_s, 2);
  EXPECT_DOUBLE_EQ(g.ranks[1].peer_wait_s, 0);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(g.ranks[r].hidden_comm_s, 0);
    EXPECT_EQ(g.ranks[r].core_share_s, 0);
  }
  // Each alone (step_time) knows no peers: the fast rank would end at 3 + link.
  EXPECT_DOUBLE_EQ(step_time(fast, 2, prof, PlanDType::fp32, fabric).step_s, 1 + link + 2);
}

// Ranks sharing a host's cores: two ranks computing at once on one core
// each run at half a core's rate; alone (the other waiting), at a whole one.
TEST(GroupStepTime, RanksComputingAtOnceShareTheCores) {
  const Fabric fabric = single_level({1e9, 0.5, Topology::switched});
  const double link = collective_seconds(CollectiveKind::all_reduce, 2, {8, 8}, fabric);
  const RankWork a = hand_timeline({1, 2}, 8), b = hand_timeline({3, 1}, 8);
  const GroupStepTime g =
      group_step_time({&a, &b}, one_byte_per_second(1), PlanDType::fp32, fabric);
  // Both compute for 2 s of wall time (1 s each of their own), then b
  // alone for its remaining 2 s; the all-reduce; then both again: a's 2 s
  // and b's 1 s share the core for 2 s, and a alone does its last 1 s.
  EXPECT_DOUBLE_EQ(g.ranks[1].end_s, 4 + link + 2);
  EXPECT_DOUBLE_EQ(g.ranks[0].end_s, 4 + link + 3);
  EXPECT_DOUBLE_EQ(g.ranks[0].core_share_s, 1 + 1);
  EXPECT_DOUBLE_EQ(g.ranks[1].core_share_s, 1 + 1);
  EXPECT_DOUBLE_EQ(g.ranks[0].peer_wait_s, 2);
  // As many cores as ranks: nothing shared, the unshared timeline.
  const GroupStepTime two =
      group_step_time({&a, &b}, one_byte_per_second(2), PlanDType::fp32, fabric);
  const GroupStepTime none =
      group_step_time({&a, &b}, one_byte_per_second(0), PlanDType::fp32, fabric);
  EXPECT_EQ(two.step_s, none.step_s);
  EXPECT_EQ(two.ranks[0].core_share_s, 0);
}

// Every form's real timelines, every rank: with a device per rank the
// group's step is the slowest rank's own (a form's ranks meet each
// collective after the same work, or the slowest is slowest before each),
// and every rank's end is its phases - hidden + waits.
TEST(GroupStepTime, EveryFormsRanksAddUp) {
  const MlaConfig cfg = tiny();
  const HardwareProfile prof = load_profile("h100");
  const Fabric fabric = single_level({2e9, 30e-6, Topology::switched});
  for (int P : {2, 3})
    for (Form f : all_forms())
      for (Overlap o : {Overlap::off, Overlap::on}) {
        FormVariant v(f);
        if (o == Overlap::on && !form_spec(f).traits.overlap) continue;
        v.overlap = o;
        const SpLayout lay = SpLayout::even(1, 40, cfg.n_heads, P);
        std::vector<RankWork> works;
        for (int r = 0; r < P; ++r)
          works.push_back(rank_work(cfg, lay, v, AttentionKind::flash, r, PlanDType::bf16));
        std::vector<const RankWork*> ranks;
        for (const RankWork& w : works) ranks.push_back(&w);
        const GroupStepTime g = group_step_time(ranks, prof, PlanDType::bf16, fabric);
        double slowest = 0;
        for (int r = 0; r < P; ++r) {
          const RankWork& w = works[size_t(r)];
          const RankStepTime& t = g.ranks[size_t(r)];
          double summed = 0;
          for (const PhaseTime& p : rank_time(w, P, prof, PlanDType::bf16, fabric))
            summed += p.compute_s() + p.comm_s;
          EXPECT_NEAR(t.end_s, summed - t.hidden_comm_s + t.peer_wait_s, 1e-9 * summed)
              << to_string(v) << " P " << P << " rank " << r;
          EXPECT_EQ(t.core_share_s, 0);
          slowest = std::max(slowest, step_time(w, P, prof, PlanDType::bf16, fabric).step_s);
        }
        EXPECT_GE(g.step_s, slowest * (1 - 1e-12)) << to_string(v) << " P " << P;
      }
}

// A profile whose ranks share a host's cores puts them on one node, however
// many; it round-trips through the profile's JSON.
TEST(TimeModel, SharedCoresAreOneNode) {
  HardwareProfile prof = load_profile("h100");
  prof.shared_cores = 2;
  prof.devices_per_node = 2;
  EXPECT_EQ(plan_links(prof, 4, 0, {}, {}).nodes, 1);
  EXPECT_EQ(parse_profile(profile_json(prof), "round trip").shared_cores, 2);
  EXPECT_EQ(parse_profile(profile_json(load_profile("h100")), "round trip").shared_cores, 0);
}

TEST(TimeModel, NodesMustHoldTheRanks) {
  const HardwareProfile prof = load_profile("h100");  // 8 per node
  EXPECT_EQ(plan_links(prof, 8, 0, {}, {}).nodes, 1);
  EXPECT_EQ(plan_links(prof, 64, 0, {}, {}).nodes, 8);
  EXPECT_EQ(plan_links(prof, 64, 0, {}, {}).fabric.ranks_per_node, 8);
  EXPECT_EQ(plan_links(prof, 16, 4, {}, {}).fabric.ranks_per_node, 4);
  const PlanLinks over = plan_links(prof, 16, 0, 1e9, 2e-6);
  EXPECT_EQ(over.fabric.intra.bytes_per_s, 1e9);
  EXPECT_EQ(over.fabric.inter.latency_s, 2e-6);
  EXPECT_NE(test::error_of([&] {
              plan_links(prof, 16, 1, {}, {});
            }).find("puts 16 ranks on a node, but profile h100 has 8 devices per node"),
            std::string::npos);
}

}  // namespace
}  // namespace laga
