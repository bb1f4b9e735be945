// One MLA block run over an SP group on either backend, with the results
// assembled into global tensors on the reporting process. Shared by
// `laga forward`, `laga verify` and `laga compare`.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mla/runner.hpp"
#include "tools/cli_common.hpp"

namespace laga::tools {

struct BlockJob {
  TensorF out, dx;                // global (B, S, D); dx undefined without backward
  MlaParams<float> grads;         // summed over the group
  std::vector<RankReport> ranks;  // every rank's ledger and memory (reporter only)
};

// Runs spec on `layout.ranks` ranks. Every process calls it; the returned job
// holds data only where is_reporting_process(comm) is true.
BlockJob run_block_job(const CommOptions& comm, const MlaConfig& cfg, const SpLayout& layout,
                       const MlaParams<float>& w, const TensorF& x, const TensorF& dout,
                       const RunSpec& spec);

// The upfront memory check (tools/memory_check.hpp) of run_block_job with
// these forms, before the caller allocates weights or inputs; nothing when
// --no-memory-check was given.
void check_block_job_memory(const CommOptions& comm, const MlaConfig& cfg, const SpLayout& layout,
                            const std::vector<Form>& forms, AttentionKind attention);

// Weights from a safetensors file under DeepSeek inference names
// (`wkv_b.weight`) or Hugging Face names (`model.layers.<layer>.self_attn.
// kv_b_proj.weight`); every shape is checked against the config.
MlaParams<float> load_weights(const std::string& path, const MlaConfig& cfg, int layer);
MlaParams<float> random_weights(const MlaConfig& cfg, std::uint64_t seed);
// x ~ N(0, 1) of shape (B, S, D) from (seed, stream).
TensorF random_tensor(const Shape& shape, std::uint64_t seed, std::uint64_t stream);

}  // namespace laga::tools
