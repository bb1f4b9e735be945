#include "plan/pipeline.hpp"

#include <algorithm>
#include <numeric>

#include "core/error.hpp"
#include "model/model.hpp"

namespace laga {

const char* to_string(PipeSchedule s) {
  switch (s) {
    case PipeSchedule::one_f_one_b:
      return "1f1b";
    case PipeSchedule::interleaved:
      return "interleaved";
    case PipeSchedule::dualpipe:
      return "dualpipe";
  }
  return "?";
}

PipeSchedule parse_pipe_schedule(const std::string& s) {
  for (PipeSchedule p :
       {PipeSchedule::one_f_one_b, PipeSchedule::interleaved, PipeSchedule::dualpipe})
    if (s == to_string(p)) return p;
  fail("--schedule: unknown pipeline schedule '", s, "'; choose 1f1b, interleaved or dualpipe");
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
  }
  return 0;
}

double pipeline_step_s(PipeSchedule s, int pp, int chunks, std::int64_t micro_batches,
                       const PassTimes& t) {
  const double M = double(micro_batches);
  const double steady =
      s == PipeSchedule::dualpipe && pp > 1 ? M * t.f_and_b() : M * (t.f() + t.b());
  return steady + pipeline_bubble_s(s, pp, chunks, t);
}

double in_flight_micro_batches(PipeSchedule s, int pp, int chunks, int stage,
                               std::int64_t micro_batches) {
  LAGA_CHECK(stage >= 0 && stage < pp, "in_flight_micro_batches: stage ", stage, " of PP ", pp);
  const double M = double(micro_batches);
  double n = 1;
  switch (s) {
    case PipeSchedule::one_f_one_b:
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
