// `laga plan`'s work: for each (S, P) and form, the exact bytes and peak
// memory and the predicted step time on a hardware profile, the winner, and
// the link bandwidth where laga starts to beat explicit (docs/planning.md).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "plan/time_model.hpp"

namespace laga {

struct PlanRequest {
  MlaConfig cfg;
  std::int64_t batch = 1;
  std::vector<std::int64_t> seqs;
  std::vector<int> sps;
  std::vector<FormVariant> forms;
  SeqLayout seq_layout = SeqLayout::contiguous;  // every form's shards (--seq-layout)
  AttentionKind attention = AttentionKind::flash;
  PlanDType dtype = PlanDType::bf16;
  // The gradients' element (held and all-reduced): fp32 unless a bf16 plan
  // says bf16 (gradient_bytes, plan/hardware_profile.hpp).
  GradReduce grad_reduce = GradReduce::fp32;
  HardwareProfile profile;
  int nodes = 0;                                           // 0: ceil(P / devices_per_node)
  std::optional<double> link_bytes_per_s, link_latency_s;  // --link: every link
  // Told what is being planned, for progress on long sweeps (may be empty).
  std::function<void(const std::string&)> progress;
};

struct FormPlan {
  FormVariant form = Form::laga;
  std::int64_t bytes_sent_per_rank = 0;  // max over ranks, all phases (compare's bytes_sent_total)
  // The same per phase, each its own max over ranks (compare's
  // bytes_sent_forward and the backward's own share).
  std::int64_t bytes_sent_forward = 0, bytes_sent_backward = 0;
  std::int64_t peak_activation_bytes = 0;  // max over ranks (compare's peak_activation_bytes)
  std::int64_t after_forward_bytes = 0;    // max over ranks: saved for backward + the output
  double flops_all_ranks = 0;              // GEMM + attention FLOPs of the step, every rank summed
  std::int64_t resident_bytes = 0;         // parameters + gradients of the block, on each rank
  // The rank on the step's critical path (plan/time_model.hpp,
  // group_step_time): its phases, summed, - hidden_comm_s + peer_wait_s +
  // core_share_s are the step.
  int critical_rank = 0;            // that rank (the JSON's critical_rank)
  double crossing_bytes = 0;        // what crosses nodes
  std::array<PhaseTime, 3> phases;  // per phase, its compute and collectives
  double hidden_comm_s = 0;         // comm under compute (overlap)
  double peer_wait_s = 0;           // blocked on collectives a peer had not issued yet
  double core_share_s = 0;          // what sharing the host's cores added (shared_cores)
  double step_s = 0, tokens_per_s = 0;
  double comm_fraction = 0;  // exposed communication (not hidden) / step
  bool fits = false;         // peak + resident <= device memory
};

// Where laga and explicit take the same time with every link at one
// bandwidth (latencies as planned).
struct Crossover {
  FormVariant laga = Form::laga;  // the laga variant compared (the first planned)
  bool found = false;
  double bytes_per_s = 0;             // when found
  bool laga_wins_above = true;        // when found: laga is faster at higher bandwidth
  bool laga_wins_throughout = false;  // when not found: over the whole range scanned
  double scanned_low = 1e6, scanned_high = 1e14;
};

struct PlanCase {
  std::int64_t seq = 0;
  int sp = 1;
  PlanLinks links;
  std::vector<FormPlan> forms;
  int winner = -1;                     // the fastest form that fits; -1: none fits
  std::optional<Crossover> crossover;  // with both laga and explicit among the forms
};

std::vector<PlanCase> make_plans(const PlanRequest& request);

// Every GEMM and attention call the plans of `request` cost, over each S, P,
// form and rank class (each phase's calls, counts summed): what `laga plan
// --measure` and `--profile this` time (plan/measure.hpp).
ops::OpCounts plan_calls(const PlanRequest& request);

}  // namespace laga
