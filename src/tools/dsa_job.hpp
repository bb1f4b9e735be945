// One DSA block (DeepSeek Sparse Attention; docs/forms.md, "DeepSeek Sparse
// Attention (DSA)") run over an SP group by one of the engine's DSA forms,
// on either backend, the results assembled into global tensors on the
// reporting process: what `laga forward` and `laga compare` run on a config
// with the index keys (MlaConfig::dsa()). The form is named by DsaForm and
// its registry row (dsa_form_traits, mla/dsa_model.hpp): a form without an
// engine runner (ring_latent) is refused, naming the ones that run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mla/documents.hpp"
#include "mla/dsa_block.hpp"
#include "mla/dsa_model.hpp"
#include "mla/layout.hpp"
#include "mla/params.hpp"
#include "tools/cli_common.hpp"

namespace laga::tools {

// A rank's ledger after the form (before the results are gathered) beside
// its closed form, dsa_predict_comm(cfg, dsa, layout, form, rank, {e, e},
// backward, /*grad_sync=*/false, stage): bytes both ways over every label,
// and the labels whose bytes or calls differ (0: the ledger is the closed
// form, label for label).
struct DsaRankLedger {
  std::int64_t sent = 0, received = 0;
  std::int64_t predicted_sent = 0, predicted_received = 0;
  std::int64_t labels = 0, labels_differing = 0;
  // The rank's pool peak of MemCategory::activations while the form ran,
  // above what was live before it (dsa_memory's quantity, mla/dsa_model.hpp).
  std::int64_t pool_peak = 0;
};

template <class T>
struct DsaJobOf {
  Tensor<T> out, dx;                   // global (B, S, D); dx undefined without dout
  std::vector<std::int64_t> idx;       // global (B, S, index_topk): key positions, -1 unused
  MlaParams<T> grads;                  // the LM gradient, summed over the ranks
  DsaIndexerParams<T> indexer_grads;   // the KL's gradient, summed over the ranks
  double kl_loss = 0;                  // the indexer's KL, summed over every query row
  std::vector<DsaRankLedger> ledgers;  // every rank's (reporter only)
};

// The MLA block's random weights are random_weights' (tools/block_job.hpp);
// the indexer's: uniform in +-sqrt(3 / fan_in) (fan_in q_lora_rank for
// wq_b, dim otherwise), k_norm's weight 1 + U(-0.2, 0.2) and bias
// U(-0.2, 0.2), from (seed, one stream per tensor).
template <class T>
DsaIndexerParams<T> random_indexer_weights(const MlaConfig& cfg, std::uint64_t seed);
// The indexer's tensors from a weights file (a SafetensorsSet path), under
// DeepSeek's names (indexer.wq_b.weight, ...) bare or under Hugging Face's
// model.layers.<layer>.self_attn.; each shape checked against the config.
template <class T>
DsaIndexerParams<T> load_indexer_weights(const std::string& path, const MlaConfig& cfg, int layer);

// Every way a DSA job's arguments can be wrong, refused before anything
// runs with one laga::Error naming the field (the same on every MPI rank:
// it reads only the options): the form has no engine runner, the layout is
// not contiguous.
void check_dsa_job(const MlaConfig& cfg, const SpLayout& layout, DsaForm form);

// The upfront memory check of run_dsa_job (tools/memory_check.hpp), before
// the caller allocates weights or inputs; nothing with --no-memory-check.
// A lower bound: dsa_memory's closed form per rank (the ranks this process
// runs: P in-process, one under MPI) plus the weights (the MLA's and the
// indexer's) and the global x, dout, out and dx the job holds.
void check_dsa_job_memory(const CommOptions& comm, const MlaConfig& cfg, const SpLayout& layout,
                          DsaForm form, std::int64_t elem_bytes);

// Runs the form on layout.ranks ranks (every process calls it); x and dout
// global (B, S, D), dout undefined: forward only. doc_start (B, S) or null.
// The job holds data only where is_reporting_process(comm) is true.
template <class T>
DsaJobOf<T> run_dsa_job(const CommOptions& comm, const MlaConfig& cfg, const SpLayout& layout,
                        const MlaParams<T>& w, const DsaIndexerParams<T>& iw, const Tensor<T>& x,
                        const Tensor<T>& dout, DsaStage stage, DsaForm form,
                        const std::int64_t* doc_start);

// Rank `rank` of the form alone, on a DryRunCommunicator under a count-only
// pool (MemoryPool::set_count_only; no weights, inputs or results, fp32
// tensors, bf16's operand copies under a UsePrecision(bf16) scope): its
// ledger against dsa_predict_comm at `wire` and its pool peak, at any
// size. Only a form the engine runs (dsa_form_runs, mla/dsa_model.hpp: each
// is on pool tensors); laga::Error naming any other (check_dsa_job).
DsaRankLedger run_dsa_rank_count_only(const MlaConfig& cfg, const SpLayout& layout, DsaStage stage,
                                      DsaForm form, int rank, WireElementBytes wire);

// The single-rank explicit DSA run (dsa_explicit at P 1, in this process):
// the reference every form is held to.
template <class T>
DsaJobOf<T> run_dsa_reference(const MlaConfig& cfg, const MlaParams<T>& w,
                              const DsaIndexerParams<T>& iw, const Tensor<T>& x,
                              const Tensor<T>& dout, DsaStage stage, const std::int64_t* doc_start);

// The forms that run (dsa_form_runs), comma-separated.
std::string dsa_runnable_form_names();
DsaStage parse_dsa_stage(const std::string& s);  // "sparse" | "dense_warmup"

}  // namespace laga::tools
