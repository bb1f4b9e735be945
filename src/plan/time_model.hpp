// The planner's time model of one MLA block step (forward + backward +
// gradient all-reduce) per form on a hardware profile (docs/planning.md).
//
// Per rank and phase:
//   compute = sum over the GEMM and attention kernel calls of
//               the call's measured time, when the profile has its shape
//               (measured_shapes, fp32 plans: `laga plan --measure` times
//               each shape of the plan on this machine), else
//               its FLOPs / (peak x gemm or attention efficiency)
//           + elementwise bytes / elementwise bandwidth
//     read from the form's own count-only run (mla/ops.hpp, "Op counts":
//     the FLOPs, bytes and the calls by shape): the same code that runs,
//     counted, not a second derivation, the exchanges' packing copies
//     included. Not counted: first-touch page faults of new tensors
//     (docs/planning.md gives their size);
//   comm    = sum over the form's collectives of collective_seconds
//     (comm/link_model.hpp) of the closed-form bytes (mla/comm_model.hpp),
//     two levels when the ranks span nodes.
// The step: the rank's count-only run, replayed as a timeline (step_time).
// Its collectives and waits in the order the code issues them
// (CollectiveEvent), the compute between two events at the cost above; the
// rank has one link, on which each collective runs from when it is issued
// or the link frees, whichever is later, for its link-model time. A
// blocking collective holds the rank until it ends; a started one (laga's
// and laga2d's `--overlap on`) only at its wait, so the compute issued
// between start and wait hides it, up to the point where another
// collective queues behind it on the link. Without started collectives the
// timeline is the sum of the phases' compute and communication; the
// predicted step is the slowest rank's.
//
// Exact figures beside it: bytes_sent_per_rank is `laga compare`'s
// bytes_sent_total and peak_activation_bytes its peak_activation_bytes (the
// memory model, mla/memory_model.hpp), the max over ranks of each.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "comm/link_model.hpp"
#include "mla/block.hpp"
#include "mla/comm_model.hpp"
#include "mla/config.hpp"
#include "mla/layout.hpp"
#include "mla/ops.hpp"
#include "plan/hardware_profile.hpp"

namespace laga {

// What one rank of one form does per phase (forward, backward, grad_sync).
// One collective event of the step's timeline and the ops the rank ran
// since the previous event.
struct TimelineStep {
  ops::OpCounts compute_before;
  CollectiveEvent event;  // bytes in the element type of the plan
};

struct RankWork {
  std::array<ops::OpCounts, 3> ops;        // per Phase, in the element type of the plan
  CommPrediction comm;                     // the closed form's collectives (mla/comm_model.hpp)
  std::int64_t peak_activation_bytes = 0;  // forward + backward, the memory model
  // Live when forward returns (the memory model's after_forward): what the
  // block keeps for backward and its output; a whole model holds it per layer.
  std::int64_t after_forward_bytes = 0;
  std::vector<TimelineStep> timeline;  // the whole step in issue order
  ops::OpCounts compute_after;         // the ops after the last event
};

// The count-only run of rank `rank` of `layout` (three of them: forward,
// + backward, + gradient all-reduce; each phase's counts are the
// difference), the closed-form bytes and the memory model's peak, in
// elements of `dtype`; the gradient all-reduce's in gradient_bytes(dtype,
// grad_reduce).
RankWork rank_work(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                   AttentionKind attention, int rank, PlanDType dtype,
                   GradReduce grad_reduce = GradReduce::fp32);

// Ranks whose work under `variant` is the same. Every figure above depends
// on the rank only through what the form makes it do (attention_placement,
// mla/block.hpp): its tokens L, the heads H_r and query rows Q_r it
// attends, how many of Q_r are its own tokens, and its all-reduce chunk.
// Why the last but one: an all-to-all to the attention's placement sends
// each of the rank's tokens to every rank attending it, so rank r sends
// L H d less what stays home, |shard_r ∩ Q_r| H_r d, and receives
// (|Q_r| - |shard_r ∩ Q_r|) H_r d (the Q of one context group tile the
// sequence, and its ranks' heads sum to H). Every form but laga2d attends
// every row (Q_r = [0, S), so the overlap is L); under laga2d with more
// than one context group ranks of equal shards differ there (at
// DeepSeek-V3, S 4096, P 8, one head group: rank 0 sends 50.2 MB forward,
// rank 3 92.1 MB). Returns one representative rank per class and, per
// rank, the index of its class.
// invariant (RunSpec::invariant): the canonical sums' pieces follow where a
// rank's tokens and heads lie, not only how many it has (ranks of equal
// shards at S 100, P 4 hold 3 and 5 pieces: mla/canonical_sum.hpp), so
// the class also keys the shard's first token and the first head: every
// rank of a contiguous layout is its own class.
struct RankClasses {
  std::vector<int> representatives;
  std::vector<int> class_of;  // size P
};
RankClasses rank_classes(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                         bool invariant = false);

// The links a plan runs on: the profile's, or every link overridden by
// --link (bandwidth, and latency when given).
struct PlanLinks {
  Fabric fabric;
  int nodes = 1;
};
// `nodes`: 0 lets the profile decide (ceil(P / devices_per_node)); else the
// ranks spread over that many nodes, ceil(P / nodes) per node, which must fit
// devices_per_node.
PlanLinks plan_links(const HardwareProfile& profile, int P, int nodes,
                     std::optional<double> link_bytes_per_s, std::optional<double> link_latency_s);

struct ComputeTime {
  double gemm_s = 0, attention_s = 0, elementwise_s = 0;
  double gemm_flops = 0, attention_flops = 0;
  double flops = 0;             // GEMM + attention FLOPs
  double unmeasured_flops = 0;  // of those, costed at the profile's efficiency
  double seconds() const { return gemm_s + attention_s + elementwise_s; }
};
// The ops of `c` on `profile`: each GEMM and attention call at its shape's
// measured time when the profile has it (fp32 plans), else at its FLOPs over
// peak x efficiency; elementwise bytes at the elementwise bandwidth.
ComputeTime compute_time(const ops::OpCounts& c, const HardwareProfile& profile, PlanDType dtype);

struct PhaseTime {
  ComputeTime compute;
  double comm_s = 0;  // the phase's collectives one after another (none hidden)
  double compute_s() const { return compute.seconds(); }
};

// A rank's predicted compute and communication per phase on `profile` and
// `fabric` (compute_time; every collective of the timeline, whose bytes
// are the closed form's, at the link model).
std::array<PhaseTime, 3> rank_time(const RankWork& work, int P, const HardwareProfile& profile,
                                   PlanDType dtype, const Fabric& fabric);

// A rank's predicted step: its timeline replayed (above). hidden_comm_s is
// the communication time that ran under compute: the phases' compute and
// communication summed, less the step (0 without started collectives).
struct StepTime {
  double step_s = 0, hidden_comm_s = 0;
};
StepTime step_time(const RankWork& work, int P, const HardwareProfile& profile, PlanDType dtype,
                   const Fabric& fabric);

// The step of all the ranks together (docs/planning.md, "The time model",
// "The ranks run together"): each rank's timeline replayed as step_time does, but a
// collective runs only once every rank has issued it (a rank that arrives
// early waits for the last), and, on a profile with shared_cores, the ranks
// computing at one moment share the cores: n of them on c cores each
// compute at min(1, c / n) of a core's rate (processor sharing). Every
// collective is taken to involve every rank (so a ring shift waits for the
// whole ring, not only its neighbour). `ranks`: each rank's work, in rank
// order. Without shared cores and with ranks whose waits line up (every
// form's, balanced) it equals the slowest rank's step_time.
// Per rank, its end = the compute and link time of its phases (rank_time)
// - hidden_comm_s + peer_wait_s + core_share_s.
struct RankStepTime {
  double end_s = 0;
  double hidden_comm_s = 0;  // its collectives' time that ran under its compute
  double peer_wait_s = 0;    // blocked on a collective some peer had not issued yet
  double core_share_s = 0;   // its compute's wall time beyond its own-core time (shared_cores)
};
struct GroupStepTime {
  double step_s = 0;                // the last rank's end
  std::vector<RankStepTime> ranks;  // in rank order
};
GroupStepTime group_step_time(const std::vector<const RankWork*>& ranks,
                              const HardwareProfile& profile, PlanDType dtype,
                              const Fabric& fabric);

// The share of a rank's collective bytes (max of sent, received per call)
// that crosses nodes under `fabric`.
double crossing_bytes(const CommPrediction& comm, int P, const Fabric& fabric);

}  // namespace laga
