#include "tools/memory_check.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include "core/error.hpp"
#include "mla/comm_model.hpp"
#include "mla/memory_model.hpp"
#include "plan/model_plan.hpp"
#include "plan/time_model.hpp"
#include "tools/cli_common.hpp"

namespace laga::tools {

namespace {

// The first integer after `key` in a /proc file of "Key:   value kB" lines.
std::int64_t proc_field(const char* path, const std::string& key) {
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) {
      std::istringstream in(line.substr(key.size()));
      std::int64_t v = -1;
      in >> v;
      return v;
    }
  return -1;
}

std::int64_t read_number(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return -1;
  try {
    return std::stoll(s);
  } catch (const std::exception&) {
    return -1;
  }
}

std::string gb(std::int64_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GB", double(b) / 1e9);
  return s;
}

}  // namespace

MemoryBudget available_memory() {
  MemoryBudget m;
  const auto consider = [&](std::int64_t bytes, std::string source) {
    if (bytes >= 0 && bytes < m.bytes) m.bytes = bytes, m.source = std::move(source);
  };
  // cgroup v2: this process's group ("0::/path" in /proc/self/cgroup).
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line))
    if (line.rfind("0::", 0) == 0) {
      const std::string dir = "/sys/fs/cgroup" + line.substr(3);
      const std::int64_t max = read_number(dir + "/memory.max");
      const std::int64_t cur = read_number(dir + "/memory.current");
      if (max >= 0 && cur >= 0)
        consider(std::max<std::int64_t>(0, max - cur),
                 "the cgroup's memory.max minus memory.current (" + dir + ")");
    }
  const std::int64_t avail_kb = proc_field("/proc/meminfo", "MemAvailable:");
  if (avail_kb >= 0) consider(avail_kb * 1024, "MemAvailable in /proc/meminfo");
  rlimit rl{};
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    const std::int64_t used_kb = proc_field("/proc/self/status", "VmSize:");
    consider(std::max<std::int64_t>(0, static_cast<std::int64_t>(rl.rlim_cur) -
                                           std::max<std::int64_t>(0, used_kb) * 1024),
             "RLIMIT_AS (ulimit -v) minus the address space in use");
  }
  return m;
}

StagingRule staging_of(Backend backend) {
  return process_per_rank(backend) ? StagingRule::mpi : StagingRule::in_process;
}

JobMemory predict_job_memory(const MlaConfig& cfg, const SpLayout& layout,
                             const std::vector<FormVariant>& forms, AttentionKind attention,
                             Backend backend, int rank_only, std::int64_t held_shared,
                             std::int64_t held_per_rank, std::int64_t elem_bytes, bool invariant) {
  MemoryModelOptions opt;
  opt.staging = staging_of(backend);
  opt.invariant = invariant;
  // Local runs every rank in this process; an MPI process or a dry run one.
  const bool all_here = backend == Backend::local && rank_only < 0;
  JobMemory job;
  job.lower_with =
      "Lower the peak with a larger --sp (under mpirun, one rank per process), a shorter --seq, "
      "--attention flash, LAGA_POOL_CACHE=1 (the block cache keeps no more than the live "
      "peak), or --count-only to account without allocating";
  for (FormVariant f : forms) {
    std::int64_t sum = 0, worst = 0, cache = 0;
    // A rank's prediction depends on it only through its class of identical
    // ranks (rank_classes): one count-only run per class, not per rank (P
    // runs of O(P) collectives each would make the check itself super-linear
    // in P).
    const RankClasses classes = rank_classes(cfg, layout, f, invariant);
    std::vector<std::optional<MemoryPrediction>> of_class(classes.representatives.size());
    for (int r = 0; r < layout.ranks; ++r) {
      if (rank_only >= 0 && r != rank_only) continue;
      std::optional<MemoryPrediction>& cached = of_class[size_t(classes.class_of[size_t(r)])];
      if (!cached)
        cached = predict_memory(cfg, layout, f, attention,
                                classes.representatives[size_t(classes.class_of[size_t(r)])],
                                elem_bytes, opt);
      const MemoryPrediction& p = *cached;
      // Its working peak, its gradient accumulators, its x, dout, out and dx
      // shards (B, L_r, D), what the job keeps per rank, and what its pool's
      // block cache may keep on top in any number of steps.
      const std::int64_t shard =
          elem_bytes * layout.batch * layout.seq_count[static_cast<std::size_t>(r)] * cfg.dim;
      const std::int64_t rank_bytes =
          p.peak_working + p.gradients + 4 * shard + held_per_rank + p.cache_allowance;
      sum += rank_bytes;
      worst = std::max(worst, rank_bytes);
      cache = std::max(cache, p.cache_allowance);
    }
    const std::int64_t here = (all_here ? sum : worst) + held_shared;
    if (here > job.bytes) {
      job.bytes = here;
      job.detail = cat(to_string(f), ": ", all_here ? layout.ranks : 1, " rank(s) of up to ",
                       gb(worst), " each (activations, comm staging, gradients, shards, and up to ",
                       gb(cache), " the block cache may keep) + ", gb(held_shared),
                       " held by the job (weights, inputs)");
    }
  }
  return job;
}

JobMemory predict_count_only_job_memory(
    const MlaConfig& cfg, const SpLayout& layout, const std::vector<FormVariant>& forms,
    int ranks_here, const std::function<std::int64_t(std::size_t keys)>& record_bytes,
    bool invariant) {
  const std::int64_t P = layout.ranks;
  std::int64_t records = 0, runs = 0;
  for (FormVariant f : forms) {
    const RankClasses classes = rank_classes(cfg, layout, f, invariant);
    const std::int64_t n = ranks_here < P ? 1 : std::int64_t(classes.representatives.size());
    runs = std::max(runs, n);
    const std::size_t keys = predict_comm(cfg, layout, f, 0, 4, true, true, invariant).size();
    records += n * record_bytes(keys);
  }
  // Per rank: its record index per form, its measured-rank entry, and the
  // layout's seq_count, head_count, head_offset and seq_ranges (a vector of
  // at most two ranges: its header and their heap).
  const std::int64_t per_rank = std::int64_t(forms.size() + 1) * std::int64_t(sizeof(int)) +
                                3 * std::int64_t(sizeof(std::int64_t)) +
                                std::int64_t(sizeof(std::vector<TokenRange>)) +
                                2 * std::int64_t(sizeof(TokenRange));
  JobMemory job;
  job.bytes = records + P * per_rank;
  job.detail = cat("count-only: no tensor storage; ", runs, " rank run(s) per form (one per class ",
                   "of identical ranks), their records ", gb(records), ", and ", gb(P * per_rank),
                   " of per-rank bookkeeping for ", P, " ranks");
  job.lower_with = "Lower it with a smaller --sp, or fewer --forms";
  return job;
}

namespace {

// The model's size in words, for messages: its parameters and, for an MoE
// model, what its routed experts hold.
std::string model_size_words(const TrainOptions& o, const ModelParamCounts& n) {
  const LmConfig& cfg = o.model;
  std::string words = cat(n.total(), " parameters");
  if (cfg.moe)
    words += cat(", of which the routed experts hold ", n.routed_experts, " (n_routed_experts ",
                 cfg.moe->n_routed_experts, " x 3 x moe_intermediate_size ",
                 cfg.moe->moe_intermediate_size, " x ", cfg.dim(), " in each of ",
                 cfg.layers - cfg.moe->first_k_dense_replace, " MoE layers)");
  return words;
}

std::string train_lower_with(const TrainOptions& o) {
  // A DSA model's attention is the DSA block's, --attention refused
  // (cmd_train's check_dsa_cli); its dense warm-up attends every causal key.
  const bool dsa = o.model.mla.dsa();
  return cat("Lower the peak with a smaller --batch or --seq, ",
             !dsa ? std::string("--attention flash")
             : o.index_warmup > 0
                 ? cat("no dense warm-up (--index-warmup 0, not ", o.index_warmup,
                       ": a warm-up step attends every causal key, a sparse one index_topk ",
                       o.model.mla.index_topk, " of them, so any warm-up step sets the peak)")
                 : std::string("a smaller index_topk"),
             ", or a smaller model (--layers, --d-model, --vocab, --ffn-hidden",
             o.model.moe
                 ? "; for this MoE model fewer or smaller routed experts (n_routed_experts, "
                   "moe_intermediate_size in --config), or --expert-parallel, which gives each "
                   "rank E / --ep of them"
                 : "",
             "), LAGA_POOL_CACHE=1 (the block cache keeps no more than the live peak); with --comm "
             "local every --sp rank runs in this process with its own copy of the model, optimizer "
             "state and gradients, so under mpirun (one rank per process) each process holds one");
}

}  // namespace

JobMemory train_state_lower_bound(const TrainOptions& o, Backend backend) {
  const ModelParamCounts n = model_param_counts(o.model);
  // Per rank at least its fp32 parameters and AdamW m and v (12 bytes a
  // parameter; the gradients' precision varies): every expert, or with
  // --expert-parallel the most any rank owns.
  const int ep = o.experts == ExpertPlacement::folded
                     ? (o.expert_degree > 0 ? o.expert_degree : o.sp * o.dp)
                     : 1;
  const double per_rank = 12.0 * double(n.replicated() + n.routed_experts_on_device(ep));
  const double ranks = backend == Backend::local ? double(o.ranks()) : 1.0;
  JobMemory job;
  job.bytes = static_cast<std::int64_t>(std::min(per_rank * ranks, 9e18));
  job.detail = cat(backend == Backend::local ? o.ranks() : 1,
                   " rank(s) holding at least their fp32 parameters and AdamW moments, ",
                   gb(static_cast<std::int64_t>(std::min(per_rank, 9e18))),
                   " each, before any activation: the model has ", model_size_words(o, n));
  job.lower_with = train_lower_with(o);
  return job;
}

JobMemory predict_train_job_memory(const TrainOptions& o, Backend backend) {
  std::vector<TrainMemory> ranks;
  try {
    ranks = predict_train_memory(o, staging_of(backend));
  } catch (const std::bad_alloc&) {
    // The prediction's own bookkeeping (a tensor object per parameter
    // tensor) found no memory: the run, which holds the same and more, would not fit.
    throw Error(cat("out of memory while predicting laga train's memory: the model has ",
                    model_size_words(o, model_param_counts(o.model)),
                    ", whose tensors alone do not fit in what this process may use. ",
                    train_lower_with(o)));
  }
  const bool all_here = backend == Backend::local;
  std::int64_t sum = 0;
  const TrainMemory* worst = &ranks.front();
  for (const TrainMemory& m : ranks) {
    sum += m.peak;
    if (m.peak > worst->peak) worst = &m;
  }
  JobMemory job;
  job.bytes = all_here ? sum : worst->peak;
  job.detail = cat(all_here ? ranks.size() : 1, " rank(s) of up to ", gb(worst->peak),
                   " each: parameters, AdamW moments and gradients ", gb(worst->state),
                   ", activations and comm staging up to ", gb(worst->step_peak - worst->state),
                   ", what the block cache may keep ", gb(worst->cache),
                   ", token data, batch and RoPE buffers ",
                   gb(worst->rope + worst->token_ids + worst->batch_ids + worst->packing),
                   worst->checkpoint > 0 ? ", a checkpoint's copy " + gb(worst->checkpoint) : "",
                   "; the model has ", model_size_words(o, model_param_counts(o.model)));
  job.lower_with = train_lower_with(o);
  return job;
}

void check_memory_fits(const JobMemory& need, const std::string& command) {
  const MemoryBudget avail = available_memory();
  LAGA_CHECK(need.bytes <= avail.bytes, command, " would need about ", gb(need.bytes),
             " in this process at its peak (predicted: ", need.detail, ") but ", gb(avail.bytes),
             " are available (", avail.source, "). ", need.lower_with,
             "; or pass --no-memory-check to run anyway");
}

}  // namespace laga::tools
