// The upfront memory check (docs/reliability.md, "Memory"): before a job
// allocates, laga predicts what this process will hold at its peak (the
// memory prediction of every rank it runs, mla/memory_model.hpp, plus the
// tensors the job itself keeps) and refuses, within the time the prediction
// takes (milliseconds), when that exceeds what the process may use; never an
// OOM kill minutes later with no message.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "mla/block.hpp"
#include "mla/layout.hpp"
#include "model/train.hpp"

namespace laga::tools {

// The memory this process may still use: the tightest of the cgroup's
// memory.max minus memory.current, /proc/meminfo's MemAvailable, and
// RLIMIT_AS minus the address space in use. source names which one.
struct MemoryBudget {
  std::int64_t bytes = INT64_MAX;
  std::string source = "no limit found";
};
MemoryBudget available_memory();

// One block job's peak in this process: for each form variant (they run one after
// another, so the largest), the sum over the ranks this process runs (local:
// all P; MPI: its own, taken as the largest rank's; rank_only >= 0: that
// rank) of their predicted working peak, gradients and shards, plus
// held_per_rank for each and held_shared once (weights, global inputs).
struct JobMemory {
  std::int64_t bytes = 0;
  std::string detail;      // "laga: 4 rank(s) up to 2.61 GB each + 0.21 GB held"
  std::string lower_with;  // "Lower the peak with ...": the options that shrink it
};
// elem_bytes: the job's element type (4: float, 8: `--dtype float64`);
// invariant: the runs' RunSpec::invariant (docs/invariance.md).
JobMemory predict_job_memory(const MlaConfig& cfg, const SpLayout& layout,
                             const std::vector<FormVariant>& forms, AttentionKind attention,
                             Backend backend, int rank_only, std::int64_t held_shared,
                             std::int64_t held_per_rank, std::int64_t elem_bytes = 4,
                             bool invariant = false);

// A `laga compare --count-only` job's peak in this process (--comm local, or
// one MPI rank: ranks_here of P). No tensor has storage and no thread runs a
// rank: the ranks run one after another, one per class of identical ranks
// (rank_classes), so what the job holds is bookkeeping: per form, each run
// rank's serialised record (record_bytes(keys): keys = the collectives the
// closed form predicts, mla/comm_model.hpp), each rank's index into them,
// the layout's four per-rank entries and the report's list of measured ranks.
// Before, all P ranks ran as threads, each with its stack, its ledger and
// O(P) collectives: 3.3 GB at P 512, never checked.
JobMemory predict_count_only_job_memory(
    const MlaConfig& cfg, const SpLayout& layout, const std::vector<FormVariant>& forms,
    int ranks_here, const std::function<std::int64_t(std::size_t keys)>& record_bytes,
    bool invariant = false);

// A `laga train` job's peak in this process (model/train.hpp,
// predict_train_memory): every rank's with --comm local (each holds its own
// copy of the model, its AdamW state and gradients), the largest rank's under
// MPI (one rank per process).
JobMemory predict_train_job_memory(const TrainOptions& o, Backend backend);
// A closed-form floor under it, in time and memory independent of the
// model's size (its parameter counts, model_plan.hpp): the fp32 parameters
// and AdamW moments every rank holds, naming what the model's size is made
// of (an MoE model's routed experts). Checked first, so that a model too
// large to fit is refused before the count-only prediction, whose own
// bookkeeping grows with its tensors (10^5 routed experts: 0.4 GB, 1 s).
JobMemory train_state_lower_bound(const TrainOptions& o, Backend backend);

// The staging rule of a rank on this backend (mpi under MPI, in_process for
// ranks as threads): what a prediction's DryRunCommunicator must stage like.
StagingRule staging_of(Backend backend);

// Throws laga::Error when need.bytes > available_memory().bytes, naming both,
// what the need is made of, how to lower it (need.lower_with) and how to skip
// the check (--no-memory-check).
void check_memory_fits(const JobMemory& need, const std::string& command);

}  // namespace laga::tools
