#include "plan/pipeline.hpp"

#include <algorithm>
#include <numeric>

#include "core/error.hpp"
#include "model/model.hpp"
#include "model/pipeline.hpp"

namespace laga {

const char* to_string(PipeSchedule s) {
  switch (s) {
    case PipeSchedule::one_f_one_b:
      return "1f1b";
    case PipeSchedule::interleaved:
      return "interleaved";
    case PipeSchedule::dualpipe:
      return "dualpipe";
    case PipeSchedule::one_f_one_b_lockstep:
      return "1f1b-lockstep";
  }
  return "?";
}

PipeSchedule parse_pipe_schedule(const std::string& s) {
  for (PipeSchedule p : {PipeSchedule::one_f_one_b, PipeSchedule::interleaved,
                         PipeSchedule::dualpipe, PipeSchedule::one_f_one_b_lockstep})
    if (s == to_string(p)) return p;
  fail("--schedule: unknown pipeline schedule '", s,
       "'; choose 1f1b, interleaved, dualpipe or 1f1b-lockstep");
}

std::vector<StageSpan> pipeline_stages(const LmConfig& cfg, const PipelineChoice& pp) {
  LAGA_CHECK(pp.stages >= 1, "--pp ", pp.stages, ": need at least 1 pipeline stage");
  const std::int64_t L = cfg.layers;
  std::vector<std::int64_t> units(size_t(pp.stages), 0);  // layers of each stage
  if (!pp.stage_layers.empty()) {
    LAGA_CHECK(int(pp.stage_layers.size()) == pp.stages, "--stage-layers gives ",
               pp.stage_layers.size(), " stages' layers for --pp ", pp.stages,
               "; give one count per stage");
    std::int64_t sum = 0;
    for (size_t s = 0; s < units.size(); ++s) {
      LAGA_CHECK(pp.stage_layers[s] >= 0, "--stage-layers: stage ", s, "'s ", pp.stage_layers[s],
                 " layers; a stage holds 0 or more");
      units[s] = pp.stage_layers[s];
      sum += units[s];
    }
    LAGA_CHECK(sum == L, "--stage-layers sums to ", sum, " layers, and the model has ", L,
               "; give counts summing to ", L,
               " (the MTP module goes on the last stage beside them)");
  } else {
    const std::int64_t total = L + (pp.mtp ? 1 : 0);
    LAGA_CHECK(
        total >= pp.stages, "--pp ", pp.stages, " stages for ", total,
        " layers (the MTP module counted): a stage would hold nothing; give --pp <= ", total);
    for (int s = 0; s < pp.stages; ++s)
      units[size_t(s)] = total / pp.stages + (s < total % pp.stages ? 1 : 0);
    if (pp.mtp) --units.back();  // the last unit is the MTP module, not a layer
  }
  std::vector<StageSpan> spans;
  std::int64_t first = 0;
  for (int s = 0; s < pp.stages; ++s) {
    StageSpan span;
    span.first_layer = first;
    span.layers = units[size_t(s)];
    span.embedding = s == 0;
    span.head = s == pp.stages - 1;
    span.mtp_modules = span.head && pp.mtp ? 1 : 0;
    first += span.layers;
    spans.push_back(span);
  }
  return spans;
}

std::vector<LmStage> lm_stages(const std::vector<StageSpan>& spans) {
  std::vector<LmStage> out;
  for (const StageSpan& s : spans) {
    LAGA_CHECK(s.mtp_modules == 0,
               "laga train has no multi-token-prediction module; plan the stages without --mtp");
    out.push_back({s.first_layer, s.first_layer + s.layers, s.embedding, s.head});
  }
  return out;
}

double pipeline_bubble_s(PipeSchedule s, int pp, int chunks, const PassTimes& t) {
  LAGA_CHECK(pp >= 1, "pipeline_bubble_s: PP ", pp, " must be >= 1");
  if (pp == 1) return 0;
  switch (s) {
    case PipeSchedule::one_f_one_b:
      return double(pp - 1) * (t.f() + t.b());
    case PipeSchedule::interleaved:
      LAGA_CHECK(chunks >= 1, "--chunks ", chunks, ": need at least 1 chunk per device");
      return double(pp - 1) * (t.f() + t.b()) / double(chunks);
    case PipeSchedule::dualpipe:
      LAGA_CHECK(pp % 2 == 0, "--schedule dualpipe needs an even --pp (its micro-batches enter ",
                 "from both ends); got ", pp);
      return std::max(0.0, double(pp / 2 - 1) * (t.f_and_b() + t.b() - 3 * t.weight_grad));
    case PipeSchedule::one_f_one_b_lockstep:
      fail("internal: the lockstep 1F1B's bubble needs every stage's times (lockstep_step_s)");
  }
  return 0;
}

double pipeline_step_s(PipeSchedule s, int pp, int chunks, std::int64_t micro_batches,
                       const PassTimes& t) {
  if (s == PipeSchedule::one_f_one_b_lockstep)
    return lockstep_step_s(std::vector<PassTimes>(size_t(pp), t), micro_batches, 0);
  const double M = double(micro_batches);
  const double steady =
      s == PipeSchedule::dualpipe && pp > 1 ? M * t.f_and_b() : M * (t.f() + t.b());
  return steady + pipeline_bubble_s(s, pp, chunks, t);
}

double shared_makespan(std::vector<double> jobs, int cores) {
  std::sort(jobs.begin(), jobs.end());
  if (cores <= 0) return jobs.empty() ? 0.0 : jobs.back();
  // In order of length: while n jobs are left each gets min(1, c / n) of a
  // core, so the shortest left ends after (its work - the work each has had)
  // / that rate.
  double t = 0, had = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const double rate = std::min(1.0, double(cores) / double(jobs.size() - i));
    t += (jobs[i] - had) / rate;
    had = jobs[i];
  }
  return t;
}

double lockstep_step_s(const std::vector<PassTimes>& stages, std::int64_t micro_batches,
                       int shared_cores) {
  const int pp = int(stages.size());
  LAGA_CHECK(pp >= 1 && micro_batches >= 1 && micro_batches <= 1000000, "lockstep_step_s: ", pp,
             " stages, ", micro_batches, " micro-batches");
  double step = 0;
  for (const auto& tick : pipeline_ticks(pp, int(micro_batches))) {
    std::vector<double> compute;
    double forward_comm = 0, backward_comm = 0;  // the tick's two exchanges, one after the other
    for (int s = 0; s < pp; ++s) {
      const std::optional<PipelinePass>& p = tick[size_t(s)];
      if (!p) continue;
      const PassTimes& t = stages[size_t(s)];
      compute.push_back(p->forward ? t.forward : t.backward);
      if (p->forward)
        forward_comm = std::max(forward_comm, t.forward_comm);
      else
        backward_comm = std::max(backward_comm, t.backward_comm);
    }
    step += shared_makespan(compute, shared_cores) + forward_comm + backward_comm;
  }
  return step;
}

double in_flight_micro_batches(PipeSchedule s, int pp, int chunks, int stage,
                               std::int64_t micro_batches) {
  LAGA_CHECK(stage >= 0 && stage < pp, "in_flight_micro_batches: stage ", stage, " of PP ", pp);
  const double M = double(micro_batches);
  double n = 1;
  switch (s) {
    case PipeSchedule::one_f_one_b:
    case PipeSchedule::one_f_one_b_lockstep:
      n = double(pp - stage);
      break;
    case PipeSchedule::interleaved:
      n = (2.0 * (pp - stage - 1) + double(chunks - 1) * pp + 1) / double(chunks);
      break;
    case PipeSchedule::dualpipe:
      n = pp > 1 ? double(pp + 1) : 1.0;
      break;
  }
  return std::min(n, M);
}

namespace {

// C(n - m, k) / C(n, k): none of k distinct picks of n lands in a given m.
double none_of(double n, double m, double k) {
  double p = 1;
  for (int i = 0; i < int(k); ++i) p *= std::max(0.0, (n - m - i) / (n - i));
  return p;
}

}  // namespace

LinkCopies node_limited_copies(std::int64_t experts, std::int64_t k, int ep, int devices_per_node,
                               int node_limit) {
  LAGA_CHECK(experts >= 1 && k >= 1 && ep >= 1 && devices_per_node >= 1 && node_limit >= 0,
             "node_limited_copies(E ", experts, ", k ", k, ", EP ", ep, ", devices/node ",
             devices_per_node, ", node limit ", node_limit, "): sizes must be >= 1");
  const int g = std::min(devices_per_node, ep);
  const double K = double(k), E = double(experts);
  if (node_limit == 0) return {K * (1.0 - double(g) / ep), K * double(g - 1) / ep};
  const int nodes = ep / g;
  LAGA_CHECK(ep % g == 0 && experts % ep == 0, "node-limited routing: EP ", ep,
             " must be whole nodes of ", g, " devices and divide the ", experts, " experts");
  LAGA_CHECK(node_limit <= nodes, "--node-limit ", node_limit, " exceeds the EP group's ", nodes,
             " nodes; give at most ", nodes);
  const double X = E / nodes, x = E / ep, Lm = double(node_limit);
  LAGA_CHECK(K <= X * Lm, "node-limited routing: k ", k, " experts cannot fit in ", node_limit,
             " nodes of ", X, " experts");
  LinkCopies c;
  c.inter = (Lm - Lm / nodes) * (1.0 - none_of(X * Lm, X, K));
  c.intra = Lm * double(g - 1) * (1.0 - none_of(X * Lm, x, K));
  return c;
}

}  // namespace laga
