// Pipeline-parallel forward + backward (docs/planning.md, "Pipeline stages,
// node-limited routing and FP8"; the plan's 1F1B is plan/pipeline.hpp): the
// ranks of `pp` are the stages, rank s runs stage s's layers
// (lm_stage_forward / lm_stage_backward, model.hpp) on each of M
// micro-batches in 1F1B order, and the stage boundaries pass each
// micro-batch's activation forward and its gradient back over the
// Communicator, recorded in its ledger:
//
//   pp_activation   forward phase: (B/M S, D) elements to the next stage
//   pp_gradient     backward phase: (B/M S, D) elements to the previous one
//   loss_allreduce  the last stage's loss sum to every stage (8 bytes)
//
// The Communicator has collectives only, so the schedule runs in lockstep
// ticks: every tick each stage runs its next pass if what it needs arrived in
// an earlier tick (pipeline_ticks, the same table on every rank), then every
// rank takes part in one ring_shift forward (activations) and one backward
// (gradients), sending nothing where it has nothing to send. Within a stage
// P = 1 (no sequence parallelism, no data parallelism, experts on the rank);
// every row's targets count in the loss.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "comm/communicator.hpp"
#include "model/model.hpp"

namespace laga {

struct PipelinePass {
  bool forward = true;  // else backward
  int micro_batch = 0;
  friend bool operator==(const PipelinePass&, const PipelinePass&) = default;
};

// Stage s's passes in 1F1B order: min(PP - s - 1, M) warm-up forwards, then
// a forward and a backward in turn, then the remaining backwards.
std::vector<PipelinePass> one_f_one_b_order(int stages, int stage, int micro_batches);

// Per tick, per stage, the pass it runs (none: idle): each stage's next pass
// in one_f_one_b_order once its input arrived (a forward's from the previous
// stage's forward, a backward's from the next stage's backward, each in an
// earlier tick).
std::vector<std::vector<std::optional<PipelinePass>>> pipeline_ticks(int stages, int micro_batches);

// One training step's forward + backward of the (B, S) batch `tokens`,
// `targets` (whole, on every rank) in M micro-batches of B / M rows: this
// rank's stage's gradients of the mean loss over all B S targets are ADDED to
// grads (the other stages' stay as they are); returns the mean loss, the
// same on every rank. pp.size() must be stages.size(), B a multiple of M.
// Which layers each stage holds is the plan's description
// (plan/pipeline.hpp: pipeline_stages, lm_stages), not this file's.
// routing (optional): the step's routing of this stage's MoE layers, every
// micro-batch's counts summed and selections in row order (the other
// stages' MoE layers: E zero counts each), so group_expert_load over `pp`
// sums each layer's load from the one stage that ran it. variant: the
// blocks' form (`laga train --form`), on the stage's one rank.
template <class T>
double pipeline_forward_backward(Communicator& pp, const LmConfig& cfg,
                                 const std::vector<LmStage>& stages, const LmParams<T>& w,
                                 const std::int32_t* tokens, const std::int32_t* targets,
                                 std::int64_t B, std::int64_t S, int micro_batches,
                                 AttentionKind attention, LmParams<T>& grads,
                                 ExpertRouting* routing = nullptr,
                                 FormVariant variant = Form::explicit_form);

}  // namespace laga
