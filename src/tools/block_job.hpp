// One MLA block run over an SP group on either backend, with the results
// assembled into global tensors on the reporting process. Shared by
// `laga forward`, `laga verify` and `laga compare`.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "mla/runner.hpp"
#include "tools/cli_common.hpp"

namespace laga::tools {

// T: float (the tool's precision) or double (`--dtype float64`, so that
// another implementation, such as the laga_torch package, can be held to the
// forms to double rounding; the kernels are templates on T).
template <class T>
struct BlockJobOf {
  Tensor<T> out, dx;              // global (B, S, D); dx undefined without backward
  MlaParams<T> grads;             // summed over the group
  std::vector<RankReport> ranks;  // every rank's ledger and memory (reporter only)
};
using BlockJob = BlockJobOf<float>;

// Runs spec on `layout.ranks` ranks. Every process calls it; the returned job
// holds data only where is_reporting_process(comm) is true.
// A config with DeepSeek Sparse Attention's keys never reaches this: forward
// and compare run its DSA forms (tools/dsa_job.hpp), the other commands
// refuse it in ModelOptions::load (tools/cli_common.hpp): the dense forms
// would attend every key, a different model (docs/forms.md, "DeepSeek
// Sparse Attention").

template <class T>
BlockJobOf<T> run_block_job(const CommOptions& comm, const MlaConfig& cfg, const SpLayout& layout,
                            const MlaParams<T>& w, const Tensor<T>& x, const Tensor<T>& dout,
                            const RunSpec& spec);

// The upfront memory check (tools/memory_check.hpp) of run_block_job with
// these forms, before the caller allocates weights or inputs; nothing when
// --no-memory-check was given.
// elem_bytes: the job's element type (sizeof(T) of run_block_job);
// invariant: RunSpec::invariant (its canonical sums' buffers counted).
void check_block_job_memory(const CommOptions& comm, const MlaConfig& cfg, const SpLayout& layout,
                            const std::vector<FormVariant>& forms, AttentionKind attention,
                            std::int64_t elem_bytes, bool invariant = false);

// Packed sequences of a (batch, seq) block job (docs/forms.md, "Packed
// sequences"): `doc_lens` (--doc-lens text), or in the input safetensors
// `cu_seqlens` (I32/I64 [n + 1], shared by every row) or `cu_seqlens.<b>` (one
// per row b). Giving both, or a file with both spellings, is an error; neither
// is one document per row (nullopt). `input` is the opened --input (null:
// none), `input_path` its name for messages: the file is opened once per
// job, so every part of it comes from the same file.
std::optional<Documents> load_documents(const std::string& doc_lens, const SafetensorsFile* input,
                                        const std::string& input_path, std::int64_t batch,
                                        std::int64_t seq);

// Weights from a safetensors file, a sharded checkpoint (its index or its
// directory; SafetensorsSet) under DeepSeek inference names (`wkv_b.weight`)
// or Hugging Face names (`kv_b_proj.weight`), either bare or under
// `model.layers.<layer>.self_attn.`; fp8 weights are dequantised with their
// block scales; every shape is checked against the config. The rule
// laga_torch's MLA.load_state_dict follows too (python/laga_torch/names.py):
// a parameter found under more than one of its names is refused, naming them
// (one file, two models); layer < 0 (--layer not given) takes the one
// layer the file's prefixed attention names hold, and refuses a file holding
// several, naming them (pick one with --layer).
template <class T = float>
MlaParams<T> load_weights(const std::string& path, const MlaConfig& cfg, int layer);
template <class T = float>
MlaParams<T> random_weights(const MlaConfig& cfg, std::uint64_t seed);
// x ~ N(0, 1) of shape (B, S, D) from (seed, stream).
template <class T = float>
Tensor<T> random_tensor(const Shape& shape, std::uint64_t seed, std::uint64_t stream);

}  // namespace laga::tools
