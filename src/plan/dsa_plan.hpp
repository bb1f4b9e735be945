// `laga plan` for a DSA config (DeepSeek-V3.2, GLM-5): every DSA form of
// mla/dsa_model.hpp at each (S, P), its exact-by-construction closed-form
// bytes, its activation memory, its FLOPs (the indexer's included) and a
// predicted step on a hardware profile (docs/planning.md, "DSA").
//
// The step: the slowest rank's compute (GEMM FLOPs at the profile's GEMM
// efficiency, attention and indexer FLOPs at its attention efficiency)
// plus the slowest rank's collectives, each at the link model
// (comm/link_model.hpp) one after another, none hidden. Elementwise work
// (norms, RoPE, the top-k selection itself, copies) is not costed: the
// forms differ in it by little next to the GEMMs and the indexer.
#pragma once

#include <optional>
#include <vector>

#include "mla/dsa_model.hpp"
#include "plan/time_model.hpp"

namespace laga {

struct DsaPlanRequest {
  MlaConfig cfg;
  DsaConfig dsa;
  std::int64_t batch = 1;
  std::vector<std::int64_t> seqs;
  std::vector<int> sps;
  std::vector<DsaForm> forms;
  SeqLayout seq_layout = SeqLayout::contiguous;
  PlanDType dtype = PlanDType::bf16;
  GradReduce grad_reduce = GradReduce::fp32;
  HardwareProfile profile;
  int nodes = 0;
  std::optional<double> link_bytes_per_s, link_latency_s;
};

struct DsaFormPlan {
  DsaForm form = DsaForm::latent_gather;
  // Max over ranks: every phase, forward, backward, and of those the
  // indexer's own traffic (index_k_ag, index_w_ag, topk_ag,
  // index_target_rs and the k_I rings).
  std::int64_t bytes_sent_per_rank = 0, bytes_sent_forward = 0, bytes_sent_backward = 0;
  std::int64_t index_bytes_sent = 0;
  std::int64_t peak_activation_bytes = 0, saved_bytes = 0;  // max over ranks
  std::string peak_where;
  std::int64_t resident_bytes = 0;  // the block's and the indexer's parameters + gradients
  // The slowest rank's FLOPs (forward + backward) by kind.
  double gemm_flops = 0, attention_flops = 0, indexer_flops = 0;
  double compute_s = 0, comm_s = 0, step_s = 0, tokens_per_s = 0, comm_fraction = 0;
  bool fits = false;
};

struct DsaPlanCase {
  std::int64_t seq = 0;
  int sp = 1;
  PlanLinks links;
  std::vector<DsaFormPlan> forms;
  int winner = -1;  // the fastest form that fits; -1: none fits
};

std::vector<DsaPlanCase> make_dsa_plans(const DsaPlanRequest& request);

// The labels of dsa_predict_comm that are the indexer's own traffic.
bool dsa_index_label(const std::string& label);

}  // namespace laga
