// `laga compare`: the registered forms (--forms, every one by default) on the
// same weights and input, side by side: bytes on the wire, peak activation
// memory, throughput and agreement with the reference form (reference_form(),
// mla/form_registry.hpp: explicit), each measured figure beside its
// closed-form prediction.
// docs/compare.md explains every column; docs/paper-comparison.md puts the
// numbers beside the paper's.
//
//   compare_run.cpp     runs the forms (all ranks, or one rank dry) and
//                       collects per-rank measurements
//   compare_report.cpp  table, JSON and CSV
//   cmd_compare.cpp     the subcommand's options
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/precision.hpp"
#include "mla/block.hpp"
#include "mla/config.hpp"
#include "mla/layout.hpp"
#include "mla/memory_model.hpp"
#include "tools/cli_common.hpp"

namespace laga::tools {

struct CompareOptions {
  ModelOptions model;
  Fp8Options fp8;  // --index-fp8 (and --kv-fp8-round-trip, refused: compare runs backward)
  CommOptions comm;
  std::int64_t batch = 1, seq = 1024;
  int sp = 4;
  std::string forms = "all", attention = "flash";
  std::string doc_lens;  // packed sequences (--doc-lens); empty: one document per row
  int steps = 3, warmup = 1;
  std::string json, csv;
  int rank_only = -1;  // >= 0: run only this rank, on a DryRunCommunicator
  bool count_only = false;
  bool invariant = false;  // --invariant: every form in the invariant mode (docs/invariance.md)
  bool quiet = false;      // no progress on stderr
  bool q_latent = false;   // also +q-latent after each query_latent form (--q-latent)
  std::string overlap = "off";  // --overlap off|on|both (form_variants)
  std::string link;     // --link BW[,LAT]: every collective on the modelled link; empty: none
  int head_groups = 0;  // laga2d's head groups (--head-groups); 0: its default rule
  std::string seq_layout = "contiguous";  // --seq-layout contiguous|zigzag
  std::uint64_t seed = 0;
  // --dtype: fp32, or bf16 mixed precision (core/precision.hpp; flash only),
  // its tensors fp32 containers (the memory figures are fp32's), its
  // activation collectives bf16 on the wire (mla/wire.hpp).
  Precision precision = Precision::fp32;
  // --grad-reduce: the gradient all-reduce's wire under bf16.
  GradReduce grad_reduce = GradReduce::fp32;
  // --device: where the blocks run (their memory figures are then the
  // device pool's).
  Device device = Device::cpu;
};

// One (phase, label) of one form: max over the measured ranks.
struct LabelRow {
  Phase phase = Phase::forward;
  std::string label;
  std::int64_t calls = 0, bytes_sent = 0, bytes_received = 0;
  std::int64_t predicted_sent = 0, predicted_received = 0;
  bool match = true;  // every measured rank equals its own prediction
};

struct Agreement {  // max |a - explicit| over the group, and the reference scale
  double out = 0, dx = 0, grads = 0;
  double out_ref = 0, dx_ref = 0, grads_ref = 0;
  std::string worst_grad;
};

struct FormResult {
  FormVariant form = Form::laga;
  // Bytes sent per rank, each the max over the measured ranks (they may be
  // different ranks for different columns), and the model's max.
  std::int64_t sent_forward = 0, sent_backward = 0, sent_grad_sync = 0, sent_total = 0;
  std::int64_t predicted_forward = 0, predicted_backward = 0, predicted_grad_sync = 0,
               predicted_total = 0;
  std::int64_t received_total = 0;
  bool bytes_match = true;  // every rank, every (phase, label), sent and received
  std::vector<LabelRow> by_label;

  // Memory per rank in bytes, max over the measured ranks.
  std::int64_t peak = 0, predicted_peak = 0;  // activations + comm buffers, forward+backward
  std::int64_t peak_activations = 0, predicted_peak_activations = 0;  // whole run
  std::int64_t peak_comm_buffers = 0, predicted_peak_comm_buffers = 0;
  std::int64_t peak_grad_sync = 0, predicted_peak_grad_sync = 0;
  std::int64_t saved_after_forward = 0;  // model: activations held between forward and backward
  std::int64_t parameters = 0, gradients = 0;
  int peak_rank = 0;
  bool memory_match = true;     // every rank equals its prediction, every figure
  double memory_rel_error = 0;  // max over ranks of |measured - model| / model, fwd+bwd peak
  MemoryPeak model_peak;        // where the model's peak is, on peak_rank
  // The device peak per rank (mla/device_peak_prediction.hpp), max over the
  // measured ranks: the pool's working peak (forward+backward's or the
  // gradient all-reduce's, whichever is larger; count-only: the model's)
  // plus what the backend keeps per rank thread in a size laga chooses
  // (--device cuda: the cuBLASLt workspace, predicted; cpu and emulated:
  // none); and the same from the memory model.
  std::int64_t device_peak = 0, predicted_device_peak = 0, device_kept_predicted = 0;

  // Attention work per rank (closed form, mla/work_model.hpp): forward FLOPs
  // of the masked attention over the rank's heads, max and min over the
  // group (every rank, also under --rank-only: it is computed, not measured).
  double attention_flops_max = 0, attention_flops_min = 0;

  // Time: per step the slowest rank's, then the median over steps.
  double forward_ms = 0, backward_ms = 0, sync_ms = 0, step_ms = 0;
  // The slowest rank's wall ms inside collectives and their waits in its
  // step (RankReport::comm_ms), median over steps.
  double comm_ms = 0;
  std::vector<double> step_ms_all;  // slowest rank per measured step
  std::optional<double> tokens_per_s;
  std::optional<Agreement> agreement;  // against explicit at the same P
};

struct CompareResult {
  CompareOptions options;
  MlaConfig cfg;
  SpLayout layout;
  std::vector<FormVariant> forms;  // --forms, and laga+q-latent with --q-latent
  AttentionKind attention = AttentionKind::eager;
  std::optional<Documents> documents;  // --doc-lens
  std::vector<int> measured_ranks;     // all ranks, or the --rank-only one
  int threads_per_rank = 1;
  bool values_meaningful = true;  // false under --rank-only (P > 1) and --count-only
  std::vector<std::string> notes;
  std::vector<FormResult> results;
  double wall_s = 0;
};

// Runs on every process of the job; returns the result on the reporting one
// (std::nullopt elsewhere).
std::optional<CompareResult> run_compare(const CompareOptions& options);

std::string compare_table(const CompareResult& r);
std::string compare_json(const CompareResult& r);
std::string compare_csv(const CompareResult& r);

}  // namespace laga::tools
