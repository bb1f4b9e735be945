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

// The ranks a call's link cost spans: the group's P, or a ring_shift's ring
// when the ranks form several (Ring, comm/communicator.hpp).
int span(const CollectiveEvent& e, int P) {
  return e.ranks > 0 ? e.ranks : P;
}

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
  return {a.gemm_flops - b.gemm_flops,
          a.attention_flops - b.attention_flops,
          a.elementwise_bytes - b.elementwise_bytes,
          minus(a.gemm_calls, b.gemm_calls),
          minus(a.attention_calls, b.attention_calls),
          a.indexer_flops - b.indexer_flops};
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
                   AttentionKind attention, int rank, PlanDType dtype, GradReduce grad_reduce) {
  const std::int64_t e = element_bytes(dtype);
  const WireElementBytes wire = wire_element_bytes(precision_of(dtype), grad_reduce, 4);
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
    // The count-only run moved fp32 elements (4 bytes) on every label.
    const std::int64_t moved = s.event.phase == Phase::grad_sync ? wire.gradients : e;
    s.event.bytes.sent = s.event.bytes.sent / 4 * moved;
    s.event.bytes.received = s.event.bytes.received / 4 * moved;
    w.timeline.push_back({in_plan_type(minus(s.ops_before, before ? *before : none)), s.event});
    before = &s.ops_before;
  }
  w.compute_after = in_plan_type(minus(upto[2], before ? *before : none));
  w.comm = predict_comm(cfg, layout, variant, rank, wire, true, true);
  w.peak_activation_bytes = full.forward_backward.bytes;
  w.after_forward_bytes = full.after_forward;
  return w;
}

RankClasses rank_classes(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                         bool invariant) {
  const std::int64_t n = parameter_count(cfg);
  const Placement att = attention_placement(layout, variant);
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::vector<std::int64_t>,
                         std::int64_t, std::vector<std::int64_t>>;
  std::map<Key, int> index;
  RankClasses c;
  for (int r = 0; r < layout.ranks; ++r) {
    const auto u = size_t(r);
    std::vector<std::int64_t> rows;  // the query ranges it attends, flattened
    for (const TokenRange& q : att.tokens[u]) rows.insert(rows.end(), {q.begin, q.end});
    // Of them, rows of its own tokens.
    const std::int64_t own = tokens_in_common(att.tokens[u], layout.seq_ranges[u]);
    std::vector<std::int64_t> where;  // the invariant mode's: where its tokens and heads start
    if (invariant) where = {layout.shard_begin(r), layout.head_offset[u]};
    const Key key{layout.seq_count[u],
                  own,
                  att.head_count[u],
                  std::move(rows),
                  all_reduce_chunk(n, layout.ranks, r),
                  std::move(where)};
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
  // Ranks sharing one host's cores are one node, however many there are.
  const int g =
      profile.shared_cores > 0 ? std::max(P, profile.devices_per_node) : profile.devices_per_node;
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
  // Measured shapes cost only plans of the element type they were timed in
  // (laga's CPU kernels time fp32; a GPU's bf16 timings cost bf16 plans).
  static const ShapeTimes none;
  const ShapeTimes& shapes =
      dtype == profile.measured_shapes.dtype ? profile.measured_shapes : none;
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
          collective_seconds(s.event.kind, span(s.event, P), s.event.bytes, fabric);
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
    const double link = collective_seconds(e.kind, span(e, P), e.bytes, fabric);
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

GroupStepTime group_step_time(const std::vector<const RankWork*>& ranks,
                              const HardwareProfile& profile, PlanDType dtype,
                              const Fabric& fabric) {
  const int P = int(ranks.size());
  LAGA_CHECK(P >= 1, "internal: group_step_time of no ranks");
  // One rank's program: segment k computes for seconds[k], then meets
  // timeline event k (none after the last segment).
  struct Rank {
    const RankWork* work = nullptr;
    std::vector<double> seconds;
    size_t segment = 0;   // the segment it computes or, blocked, has finished
    double left = 0;      // seconds of its segment still to compute, at a core of its own
    int blocked_on = -1;  // the collective (issue order) it waits for, or -1
    int issued = 0;       // collectives it has issued
    std::map<std::int64_t, int> started;  // a started call's id -> its collective
    std::vector<size_t> issues;           // its timeline's issued events, in order
    double link_free = 0;
    double comm_s = 0;        // its collectives' link time
    double core_share_s = 0;  // its compute's wall time beyond a core of its own
    double blocked_since = 0, blocked_s = 0, peer_wait_s = 0;
    double done_s = -1;  // when it ended; -1 while it runs
  };
  std::vector<Rank> rs;
  for (const RankWork* w : ranks) {
    Rank r;
    r.work = w;
    for (size_t k = 0; k < w->timeline.size(); ++k) {
      const TimelineStep& s = w->timeline[k];
      r.seconds.push_back(compute_time(s.compute_before, profile, dtype).seconds());
      if (s.event.what == CollectiveEvent::What::issued) r.issues.push_back(k);
    }
    r.seconds.push_back(compute_time(w->compute_after, profile, dtype).seconds());
    r.left = r.seconds[0];
    rs.push_back(std::move(r));
  }
  // Per collective (the n-th issued by every rank): when each rank issued
  // it, and, once all have, when it starts (its last issue), when each
  // rank's link was free for it and when it completes there.
  std::vector<std::vector<double>> arrived, done, link_was_free;
  std::vector<double> start_at;
  const double cores = profile.shared_cores > 0 ? profile.shared_cores : double(P);
  double now = 0;
  // The rank meets its segment's event (or ends) at `now`; false when blocked.
  auto meet_event = [&](Rank& r, int index) {
    if (r.segment + 1 == r.seconds.size()) {
      r.done_s = now;
      return false;
    }
    const CollectiveEvent& e = r.work->timeline[r.segment].event;
    int n;
    if (e.what == CollectiveEvent::What::waited) {
      const auto it = r.started.find(e.id);
      LAGA_CHECK(it != r.started.end(), "internal: a wait for collective ", e.id,
                 " that the timeline did not start");
      n = it->second;
    } else {
      n = r.issued++;
      if (size_t(n) >= arrived.size()) {
        arrived.emplace_back(size_t(P), -1.0);
        done.emplace_back();
        link_was_free.emplace_back(size_t(P), 0.0);
        start_at.push_back(0);
      }
      arrived[size_t(n)][size_t(index)] = now;
      if (e.started) r.started[e.id] = n;
      if (e.started) n = -1;  // it goes on computing
    }
    r.blocked_on = n;
    r.blocked_since = now;
    return n < 0;
  };
  auto next_segment = [&](Rank& r) {
    if (r.blocked_on >= 0) {
      // Of the time it was blocked, the part before the call could run on a
      // free link of its own: it waited for a peer to issue it.
      const auto n = size_t(r.blocked_on), i = size_t(&r - rs.data());
      r.blocked_s += now - r.blocked_since;
      r.peer_wait_s += std::max(0.0, start_at[n] - std::max(r.blocked_since, link_was_free[n][i]));
    }
    ++r.segment;
    r.left = r.seconds[r.segment];
    r.blocked_on = -1;
  };
  for (int guard = 0;; ++guard) {
    LAGA_CHECK(guard < 1 << 26, "internal: group_step_time did not finish");
    // Settle everything that happens at `now`: finished segments meet their
    // events, collectives every rank has issued get their completion times,
    // ranks whose collective has completed go on.
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t i = 0; i < rs.size(); ++i) {
        Rank& r = rs[i];
        if (r.done_s >= 0) continue;
        if (r.blocked_on < 0 && r.left <= 0) {
          if (meet_event(r, int(i))) next_segment(r);
          changed = true;
        }
      }
      for (size_t n = 0; n < arrived.size(); ++n) {
        if (!done[n].empty()) continue;
        const auto& a = arrived[n];
        if (std::any_of(a.begin(), a.end(), [](double t) { return t < 0; })) continue;
        // It runs once every rank has issued it, on each rank's link after
        // the call before it there, for that rank's link-model time.
        const double start = *std::max_element(a.begin(), a.end());
        start_at[n] = start;
        done[n].resize(size_t(P));
        for (size_t i = 0; i < rs.size(); ++i) {
          Rank& r = rs[i];
          const CollectiveEvent& e = r.work->timeline[r.issues[n]].event;
          const double link = collective_seconds(e.kind, span(e, P), e.bytes, fabric);
          link_was_free[n][i] = r.link_free;
          done[n][i] = std::max(start, r.link_free) + link;
          r.link_free = done[n][i];
          r.comm_s += link;
        }
        changed = true;
      }
      for (size_t i = 0; i < rs.size(); ++i) {
        Rank& r = rs[i];
        if (r.done_s >= 0 || r.blocked_on < 0) continue;
        const auto& d = done[size_t(r.blocked_on)];
        if (!d.empty() && d[i] <= now) {
          next_segment(r);
          changed = true;
        }
      }
    }
    if (std::all_of(rs.begin(), rs.end(), [](const Rank& r) { return r.done_s >= 0; })) break;
    // The next moment something happens: a computing rank ends its segment
    // (the computing ranks share the cores: each at min(1, cores / n) of
    // one) or a collective a rank waits for completes.
    int computing = 0;
    for (const Rank& r : rs) computing += r.done_s < 0 && r.blocked_on < 0;
    const double rate = computing > cores ? cores / computing : 1.0;
    double dt = INFINITY;
    for (size_t i = 0; i < rs.size(); ++i) {
      const Rank& r = rs[i];
      if (r.done_s >= 0) continue;
      if (r.blocked_on < 0) {
        dt = std::min(dt, r.left / rate);
      } else if (!done[size_t(r.blocked_on)].empty()) {
        dt = std::min(dt, done[size_t(r.blocked_on)][i] - now);
      }
    }
    LAGA_CHECK(std::isfinite(dt),
               "internal: the ranks' timelines deadlock (a collective "
               "some rank never issues)");
    now += dt;
    for (Rank& r : rs)
      if (r.done_s < 0 && r.blocked_on < 0) {
        r.left = std::max(0.0, r.left - dt * rate);
        r.core_share_s += dt * (1 - rate);  // exactly 0 unshared
      }
  }
  GroupStepTime g;
  for (const Rank& r : rs) {
    g.step_s = std::max(g.step_s, r.done_s);
    // Its end = its compute at a core of its own + what sharing the cores
    // added + its collectives' link time - what of that ran under compute +
    // its waits for peers: blocked, it waits for its links or its peers.
    const double exposed = r.blocked_s - r.peer_wait_s;
    const double hidden = r.comm_s - exposed;
    g.ranks.push_back(
        {r.done_s, hidden > 1e-9 * r.comm_s ? hidden : 0.0, r.peer_wait_s, r.core_share_s});
  }
  return g;
}

double crossing_bytes(const CommPrediction& comm, int P, const Fabric& fabric) {
  double crossing = 0;
  for (const auto& [key, b] : comm)
    crossing += node_crossing_share(b.kind, P, std::min(P, fabric.ranks_per_node)) *
                double(std::max(b.sent, b.received));
  return crossing;
}

}  // namespace laga
