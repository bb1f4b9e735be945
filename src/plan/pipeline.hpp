// Pipeline parallelism and DeepSeek's expert placement in the model plan
// (docs/planning.md, "Pipeline stages, node-limited routing and FP8"): the
// closed forms `laga plan --model --pp` composes a step from. Each is one
// function; model_plan.cpp plans each stage's layers with them.
//
//   stages          pipeline_stages: which layers each of PP stages holds
//                   (even by layer, the MTP module counted as one more
//                   layer on the last stage), or as --stage-layers says
//   bubble          pipeline_bubble_s: the idle time of the schedule's
//                   warm-up and drain, as the DeepSeek-V3 report's Table 2
//                   gives it (1F1B, DualPipe) and Megatron's interleaved
//                   schedule (Narayanan et al. 2021, section 2.2.2)
//   in flight       in_flight_micro_batches: the micro-batches whose
//                   activations a stage holds at its peak
//   node-limited    node_limited_copies: the copies of a token that cross
//                   nodes and that stay on one, under DeepSeek-V3's
//                   group-limited routing with its groups as the nodes and
//                   its dispatch sending a token once per node
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace laga {

struct LmConfig;
struct LmStage;

// The schedule of micro-batches over the stages:
//   one_f_one_b   PipeDream-flush / Megatron's 1F1B: warm-up, one forward
//                 and one backward in turn, drain;
//   interleaved   Megatron's interleaved 1F1B: every device holds `chunks`
//                 non-adjacent chunks of layers, the bubble divided by it;
//   dualpipe      DeepSeek-V3's DualPipe: micro-batches fed from both ends,
//                 every device holding two stages (its own and the mirror
//                 one), a forward chunk's compute overlapped with a backward
//                 chunk's communication and back;
//   one_f_one_b_lockstep  `laga train --pp`'s own 1F1B (model/pipeline.hpp):
//                 the same order, but in lockstep ticks (each tick every
//                 stage runs its next pass whose input arrived, then every
//                 rank takes part in one exchange), so a tick lasts as long
//                 as its slowest pass: priced by lockstep_step_s from every
//                 stage's times, not by a bubble formula.
enum class PipeSchedule { one_f_one_b, interleaved, dualpipe, one_f_one_b_lockstep };
// "1f1b", "interleaved", "dualpipe", "1f1b-lockstep"
const char* to_string(PipeSchedule s);
// One of to_string's names; anything else is a laga::Error naming it.
PipeSchedule parse_pipe_schedule(const std::string& s);

struct PipelineChoice {
  int stages = 1;  // PP; 1: no pipeline
  PipeSchedule schedule = PipeSchedule::one_f_one_b;
  int chunks = 2;                 // interleaved: chunks per device (v)
  std::vector<int> stage_layers;  // empty: pipeline_stages' even split; else the layers of each
  bool mtp = false;               // plan the multi-token-prediction module (on the last stage)
  // DualPipe: the share of the SMs its communication kernels take while
  // they overlap compute (PassTimes::comm_unit_share). DeepSeek-V3's report,
  // section 3.2.2: 20 of the H800's 132 SMs (--comm-sms 20/132).
  double comm_unit_share = 20.0 / 132.0;
};

// One stage's share of the model: layers [first_layer, first_layer + layers)
// of the main model, whether it holds the embedding (the first stage) and
// the head (the last), and the MTP modules it runs (DeepSeek-V3: one, D = 1,
// a transformer layer with the MoE FFN, a projection of 2 D to D and the
// shared head, on the last stage, as the report's section 3.2.3 puts the
// output head and MTP module with the shallowest layers under DualPipe).
struct StageSpan {
  std::int64_t first_layer = 0, layers = 0;
  bool embedding = false, head = false;
  int mtp_modules = 0;
};

// The stages of `cfg` under `pp`: with stage_layers given (one count per
// stage, each >= 0, summing to cfg.layers, the MTP module counted on the last
// stage beside them), those; else the layers and the MTP module (one more
// unit) split as evenly as counts allow, the first stages one more where
// they do not divide. DeepSeek-V3 at PP 16: 61 layers + MTP = 62 units, 14
// stages of 4 and 2 of 3: stage 0 is layers 0-3 (three dense, one MoE),
// stage 15 layers 59-60 and the MTP module. The report does not say how its
// 61 layers are split; this is the even split, an assumption. A bad count is
// a laga::Error naming it and what to give.
std::vector<StageSpan> pipeline_stages(const LmConfig& cfg, const PipelineChoice& pp);

// The same stages as the model's pipeline execution runs them
// (model/pipeline.hpp, `laga train --pp`): one placement, read by the plan
// and by the run. A stage with the MTP module is refused (laga's model has
// none).
std::vector<LmStage> lm_stages(const std::vector<StageSpan>& spans);

// Per micro-batch, on one device, seconds of:
struct PassTimes {
  double forward = 0;       // forward compute (the recompute of backward is in backward)
  double backward = 0;      // backward compute: input and weight gradients
  double weight_grad = 0;   // of which the weight gradients' GEMMs (W)
  double forward_comm = 0;  // forward communication: EP all-to-alls, SP collectives, the
                            // activation to the next stage
  double backward_comm = 0;
  // The share of the device's compute units the overlapped communication
  // takes while a pair runs (DualPipe: its all-to-all kernels' SMs), which
  // the pair's compute runs without.
  double comm_unit_share = 0;
  double f() const { return forward + forward_comm; }
  double b() const { return backward + backward_comm; }
  // DualPipe's F&B: a forward chunk and a backward chunk mutually overlapped,
  // each one's compute hiding the other's communication (the report's
  // figure 4): the longer of the two computes, on the units the
  // communication leaves, and the two communications.
  double f_and_b() const {
    const double compute = (forward + backward) / (1.0 - comm_unit_share),
                 comm = forward_comm + backward_comm;
    return compute > comm ? compute : comm;
  }
};

// The schedule's bubble, seconds per step, from the slowest device's pass
// times (every stage taken as slow as it: the bubble of a balanced pipeline):
//   1F1B          (PP - 1)(F + B)                     report Table 2
//   interleaved   (PP - 1)(F + B) / v                 Narayanan et al. 2021
//   DualPipe      (PP/2 - 1)(F&B + B - 3W)            report Table 2
// PP 1 has none. DualPipe needs an even PP (a laga::Error otherwise). The
// lockstep 1F1B has no closed form: every stage's times, lockstep_step_s.
double pipeline_bubble_s(PipeSchedule s, int pp, int chunks, const PassTimes& t);

// The step's time of M micro-batches on the slowest device, bubble included:
// 1F1B and interleaved M (F + B) + bubble; DualPipe M F&B + bubble (each
// device runs M forward and M backward chunks, half on each of its stages,
// paired in the steady state).
double pipeline_step_s(PipeSchedule s, int pp, int chunks, std::int64_t micro_batches,
                       const PassTimes& t);

// The step of M micro-batches through stages.size() stages as `laga train
// --pp` runs them (PipeSchedule::one_f_one_b_lockstep): over the ticks of
// pipeline_ticks (model/pipeline.hpp, the table the run follows), each tick
// the stages' passes (F or B compute of their PassTimes) run at once, then
// the tick's two exchanges (the activations on, then the gradients back),
// each as long as the longest of its passes' communication. With shared_cores c > 0 the stages are
// threads of one host: n computing at once each run at min(1, c / n) of a
// core (processor sharing, as group_step_time shares the cores among the
// ranks of a block, plan/time_model.hpp), so a tick's compute lasts until
// its longest pass ends under that sharing. Every stage ends with the last
// tick.
double lockstep_step_s(const std::vector<PassTimes>& stages, std::int64_t micro_batches,
                       int shared_cores);
// The makespan of jobs of the given seconds started together on c cores under
// processor sharing (n jobs left each run at min(1, c / n)); c 0: no sharing
// (the longest job).
double shared_makespan(std::vector<double> jobs, int cores);

// The micro-batches whose activations stage `stage` (0-based) of PP holds at
// its peak, of M per step (never more than M):
//   1F1B          PP - stage                           (warm-up forwards + 1)
//   interleaved   (2 (PP - stage - 1) + (v - 1) PP + 1) / v  stage's worth of
//                 activations: Megatron's warm-up count of chunk forwards
//   DualPipe      PP + 1                               report Table 2, every device
double in_flight_micro_batches(PipeSchedule s, int pp, int chunks, int stage,
                               std::int64_t micro_batches);

// Expected copies of one token's k routed copies that its dispatch sends,
// per token, split by the link they cross. EP devices, devices_per_node of
// them a node, E experts (E / EP a device, E / nodes a node).
//   per copy (laga's dispatch, node_limit 0: every copy to its expert's
//     owner, the copies uniform over the E experts): inter = k (1 - g / EP),
//     intra = k (g - 1) / EP, g = devices_per_node;
//   node-limited (DeepSeek-V3: the experts' groups are the nodes, a token's
//     k experts in at most node_limit of them, and the dispatch sends a token
//     ONCE over IB to each target node's device of its own in-node index,
//     which forwards it over NVLink to the devices holding its experts,
//     report section 3.2.2): the node_limit nodes uniform among the nodes,
//     the k experts uniform among their experts;
//       inter = (node_limit - node_limit / nodes) (1 - C(X (L - 1), k) / C(X L, k))
//       intra = L (g - 1) (1 - C(X L - x, k) / C(X L, k))
//     with X the experts of a node, x of a device, L node_limit: the remote
//     target nodes that get a copy, and the devices of the target nodes but
//     the one a token lands on that hold one of its experts. DeepSeek's router
//     picks the nodes by their two best experts' scores, not uniformly; under
//     uniform scores this is its mean.
struct LinkCopies {
  double inter = 0, intra = 0;
};
LinkCopies node_limited_copies(std::int64_t experts, std::int64_t k, int ep, int devices_per_node,
                               int node_limit);

}  // namespace laga
