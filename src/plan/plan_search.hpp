// The grid `laga plan --model --search` plans (docs/planning.md, "The
// search: the fewest devices that fit, as a team would lay them out"): what
// a team training an MoE model chooses among, described once, here; the
// command fills every option the user did not give from it.
//
//   --sp 1,2,..,128      sequence parallelism (none at 1)
//   --dp 1,2,..,128      data-parallel replicas of a stage's SP group
//   --pp 1,2,4,8,16      pipeline stages (DeepSeek-V3: 16)
//   --ep max             EP = gcd(P x DP, E): the experts over the replicas too
//   --zero1              the optimizer state sharded over the replicas
//   --global-batch T     a fixed batch of T tokens a step: DeepSeek-V3's
//                        15360 sequences of 4K (62,914,560 tokens; its 32K and
//                        128K stages keep it: 1920 x 32K, 480 x 128K), one
//                        sequence a micro-batch, so a case of DP replicas runs
//                        T / (S x DP) micro-batches (a DP that leaves no whole
//                        number is not planned)
//
// make_model_plans then picks, per S, the fewest P x DP x PP devices at which
// a form fits and, among the fitting plans there, the most tokens a second a
// device (fewest_devices). What the grid leaves to the user: the schedule,
// --recompute, --fp8, --node-limit, --mtp (each changes what fits and how fast:
// the tables in docs/planning.md plan 1F1B and DualPipe, each without and with
// recompute).
#pragma once

#include <cstdint>
#include <vector>

#include "plan/model_plan.hpp"

namespace laga {

struct TeamGrid {
  std::vector<int> sps{1, 2, 4, 8, 16, 32, 64, 128};
  std::vector<int> dps{1, 2, 4, 8, 16, 32, 64, 128};
  std::vector<int> pps{1, 2, 4, 8, 16};
  EpChoice ep{EpRule::max, 0};
  bool zero1 = true;
  std::int64_t global_batch_tokens = 15360LL * 4096;
};
inline const TeamGrid kTeamGrid{};

// `q` with the team grid in place of its sps, dps, pps, ep, zero1 and global batch.
inline ModelPlanRequest with_team_grid(ModelPlanRequest q, const TeamGrid& g = kTeamGrid) {
  q.block.sps = g.sps;
  q.dps = g.dps;
  q.pps = g.pps;
  q.ep = g.ep;
  q.zero1 = g.zero1;
  q.global_batch_tokens = g.global_batch_tokens;
  return q;
}

}  // namespace laga
