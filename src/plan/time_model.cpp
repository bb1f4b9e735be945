#include "plan/time_model.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "core/error.hpp"
#include "mla/memory_model.hpp"
#include "mla/params.hpp"

namespace laga {

namespace {

// The calls of `a` that `b` does not have (b's are a prefix of a's run).
template <class Call>
std::map<Call, ops::CallTally> minus(const std::map<Call, ops::CallTally>& a,
                                     const std::map<Call, ops::CallTally>& b) {
  std::map<Call, ops::CallTally> d;
  for (const auto& [call, t] : a) {
    const auto it = b.find(call);
    const ops::CallTally before = it == b.end() ? ops::CallTally{} : it->second;
    if (t.calls > before.calls) d[call] = {t.calls - before.calls, t.flops - before.flops};
  }
  return d;
}

ops::OpCounts minus(const ops::OpCounts& a, const ops::OpCounts& b) {
  return {a.gemm_flops - b.gemm_flops, a.attention_flops - b.attention_flops,
          a.elementwise_bytes - b.elementwise_bytes, minus(a.gemm_calls, b.gemm_calls),
          minus(a.attention_calls, b.attention_calls)};
}

// Seconds of the calls in `calls`: a measured shape's own time per call, else
// its FLOPs at `flops_per_s`. Adds the FLOPs costed the second way to
// `unmeasured_flops`.
template <class Call>
double calls_seconds(const std::map<Call, ops::CallTally>& calls,
                     const std::map<Call, double>& measured, double flops_per_s,
                     double& unmeasured_flops) {
  double s = 0;
  for (const auto& [call, t] : calls) {
    const auto it = measured.find(call);
    if (it != measured.end()) {
      s += double(t.calls) * it->second;
    } else {
      s += t.flops / flops_per_s;
      unmeasured_flops += t.flops;
    }
  }
  return s;
}

std::int64_t parameter_count(const MlaConfig& cfg) {
  std::int64_t n = 0;
  for (const auto& [name, shape] : mla_param_shapes(cfg)) n += numel(shape);
  return n;
}

}  // namespace

RankWork rank_work(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                   AttentionKind attention, int rank, PlanDType dtype) {
  const std::int64_t e = element_bytes(dtype);
  // Cumulative counts after forward, after backward and after the all-reduce;
  // the last run's events are the step's timeline.
  std::array<ops::OpCounts, 3> upto;
  std::vector<StepEvent> events;
  MemoryPrediction full;
  for (int stage = 0; stage < 3; ++stage) {
    MemoryModelOptions o;
    o.backward = stage >= 1;
    o.grad_sync = stage == 2;
    o.op_counts = &upto[static_cast<size_t>(stage)];
    if (stage == 2) o.timeline = &events;
    const MemoryPrediction m = predict_memory(cfg, layout, variant, attention, rank, e, o);
    if (stage == 2) full = m;
  }
  // Counted in float: every byte scales with the element size (exactly: a
  // float count is a multiple of 4).
  const auto in_plan_type = [e](ops::OpCounts c) {
    c.elementwise_bytes *= double(e) / 4.0;
    return c;
  };
  RankWork w;
  w.ops[0] = in_plan_type(upto[0]);
  w.ops[1] = in_plan_type(minus(upto[1], upto[0]));
  w.ops[2] = in_plan_type(minus(upto[2], upto[1]));
  const ops::OpCounts* before = nullptr;
  static const ops::OpCounts none;
  for (StepEvent& s : events) {
    s.event.bytes.sent = s.event.bytes.sent / 4 * e;
    s.event.bytes.received = s.event.bytes.received / 4 * e;
    w.timeline.push_back({in_plan_type(minus(s.ops_before, before ? *before : none)), s.event});
    before = &s.ops_before;
  }
  w.compute_after = in_plan_type(minus(upto[2], before ? *before : none));
  w.comm = predict_comm(cfg, layout, variant, rank, e, true, true);
  w.peak_activation_bytes = full.forward_backward.bytes;
  w.after_forward_bytes = full.after_forward;
  return w;
}

RankClasses rank_classes(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant) {
  const std::int64_t n = parameter_count(cfg);
  const Placement att = attention_placement(layout, variant);
  using Key =
      std::tuple<std::int64_t, std::int64_t, std::int64_t, std::vector<std::int64_t>, std::int64_t>;
  std::map<Key, int> index;
  RankClasses c;
  for (int r = 0; r < layout.ranks; ++r) {
    const auto u = size_t(r);
    const std::int64_t t0 = layout.seq_offset[u], t1 = t0 + layout.seq_count[u];
    std::vector<std::int64_t> rows;  // the query ranges it attends, flattened
    std::int64_t own = 0;            // of them, rows of its own tokens
    for (const TokenRange& q : att.tokens[u]) {
      rows.insert(rows.end(), {q.begin, q.end});
      own += std::max<std::int64_t>(0, std::min(t1, q.end) - std::max(t0, q.begin));
    }
    const Key key{layout.seq_count[u], own, att.head_count[u], std::move(rows),
                  all_reduce_chunk(n, layout.ranks, r)};
    const auto [it, fresh] = index.try_emplace(key, int(c.representatives.size()));
    if (fresh) c.representatives.push_back(r);
    c.class_of.push_back(it->second);
  }
  return c;
}

PlanLinks plan_links(const HardwareProfile& profile, int P, int nodes,
                     std::optional<double> link_bytes_per_s, std::optional<double> link_latency_s) {
  LAGA_CHECK(P >= 1, "plan: P = ", P, " must be >= 1");
  LAGA_CHECK(nodes >= 0, "--nodes ", nodes, " must be >= 1");
  const int g = profile.devices_per_node;
  PlanLinks l;
  l.nodes = nodes > 0 ? nodes : (P + g - 1) / g;
  LAGA_CHECK(l.nodes <= P, "--nodes ", l.nodes, " is more nodes than the ", P,
             " ranks of --sp; give at most one node per rank");
  const int per_node = (P + l.nodes - 1) / l.nodes;
  LAGA_CHECK(per_node <= g, "--sp ", P, " over --nodes ", l.nodes, " puts ", per_node,
             " ranks on a node, but profile ", profile.name, " has ", g,
             " devices per node; give --nodes of at least ", (P + g - 1) / g);
  l.fabric = Fabric{profile.intra_node, profile.inter_node, l.nodes > 1 ? per_node : P};
  for (LinkModel* link : {&l.fabric.intra, &l.fabric.inter}) {
    if (link_bytes_per_s) link->bytes_per_s = *link_bytes_per_s;
    if (link_latency_s) link->latency_s = *link_latency_s;
  }
  return l;
}

ComputeTime compute_time(const ops::OpCounts& c, const HardwareProfile& profile, PlanDType dtype) {
  const double peak = profile.peak_flops(dtype);
  const DeviceProfile& d = profile.device;
  // Measured shapes are fp32 timings of laga's kernels: they cost fp32 plans only.
  static const ShapeTimes none;
  const ShapeTimes& shapes = dtype == PlanDType::fp32 ? profile.measured_shapes : none;
  ComputeTime t;
  t.gemm_s = calls_seconds(c.gemm_calls, shapes.gemm, peak * d.gemm_efficiency, t.unmeasured_flops);
  t.attention_s = calls_seconds(c.attention_calls, shapes.attention, peak * d.attention_efficiency,
                                t.unmeasured_flops);
  t.elementwise_s = c.elementwise_bytes / d.elementwise_bytes_per_s;
  t.gemm_flops = c.gemm_flops;
  t.attention_flops = c.attention_flops;
  t.flops = c.gemm_flops + c.attention_flops;
  return t;
}

std::array<PhaseTime, 3> rank_time(const RankWork& work, int P, const HardwareProfile& profile,
                                   PlanDType dtype, const Fabric& fabric) {
  std::array<PhaseTime, 3> t;
  for (size_t ph = 0; ph < 3; ++ph) t[ph].compute = compute_time(work.ops[ph], profile, dtype);
  // Each call of the timeline (every call the rank issues, with the closed
  // form's bytes) at its own bytes: the calls under one label need not move
  // the same (a ring pass's steps carry blocks of unequal shards, and a
  // call's time is not linear in its bytes).
  for (const TimelineStep& s : work.timeline)
    if (s.event.what == CollectiveEvent::What::issued)
      t[static_cast<size_t>(s.event.phase)].comm_s +=
          collective_seconds(s.event.kind, P, s.event.bytes, fabric);
  return t;
}

StepTime step_time(const RankWork& work, int P, const HardwareProfile& profile, PlanDType dtype,
                   const Fabric& fabric) {
  double now = 0, link_free = 0;
  double summed = 0;  // every segment's compute and every collective's time, one after another
  std::map<std::int64_t, double> done_at;  // started collectives by id
  for (const TimelineStep& s : work.timeline) {
    const double compute = compute_time(s.compute_before, profile, dtype).seconds();
    now += compute, summed += compute;
    const CollectiveEvent& e = s.event;
    if (e.what == CollectiveEvent::What::waited) {
      const auto it = done_at.find(e.id);
      LAGA_CHECK(it != done_at.end(), "internal: a wait for collective ", e.id,
                 " that the timeline did not start");
      now = std::max(now, it->second);
      continue;
    }
    // One link per rank: a collective waits for the one before it.
    const double link = collective_seconds(e.kind, P, e.bytes, fabric);
    summed += link;
    const double done = std::max(now, link_free) + link;
    link_free = done;
    if (e.started)
      done_at[e.id] = done;
    else
      now = done;
  }
  const double last = compute_time(work.compute_after, profile, dtype).seconds();
  now += last, summed += last;
  // Without started collectives the two agree but for rounding.
  const double hidden = summed - now;
  return {now, hidden > 1e-9 * summed ? hidden : 0.0};
}

double crossing_bytes(const CommPrediction& comm, int P, const Fabric& fabric) {
  double crossing = 0;
  for (const auto& [key, b] : comm)
    crossing += node_crossing_share(b.kind, P, std::min(P, fabric.ranks_per_node)) *
                double(std::max(b.sent, b.received));
  return crossing;
}

}  // namespace laga
