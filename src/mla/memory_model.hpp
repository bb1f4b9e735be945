// Closed-form activation memory of one MLA block on one rank: the peak bytes
// the rank's MemoryPool sees during one forward + backward (+ gradient
// all-reduce), per form and attention kernel, from the config and the layout
// alone. Written apart from the block code on purpose: tests require the two
// to agree (docs/compare.md, "memory model").
//
// How: the block's allocation sequence (form_*.cpp, block.cpp, exchange.cpp,
// the backends' staging) is written out here as a list of allocations and
// frees of named tensors with closed-form sizes; the peak is the largest
// running sum, taken at the step where it occurs. That is exact — the model
// predicts the pool's peaks to the byte, not approximately — as long as the
// sequence here matches the code, which tests/mla/test_memory_model.cpp
// checks over sweeps of B, S, P, H, rq, uneven shards, both attention kernels
// and both element sizes. It also says WHAT is live at the peak, which is the
// explanation the paper's memory table needs (e.g. eager probs
// (B, H_r, S, S) during attention backward).
//
// Every figure is in bytes above what is live when forward starts (the
// rank's input and dout shards, parameters, gradient accumulators), as
// laga::run_rank measures it. Under the eager kernel the dominant term is the
// saved probability matrix B H_r S^2 e; absorbed adds its H_r (C + dr)- and
// H_r C-wide intermediates (q_abs, o_lat and their gradients) over the full
// sequence.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.hpp"  // StagingRule
#include "core/memory_pool.hpp"
#include "mla/block.hpp"

namespace laga {

struct MemoryTerm {
  std::string name;  // "saved.attn_stats (B, H_r, S, S)"
  MemCategory category = MemCategory::activations;
  std::int64_t bytes = 0;
};

// The largest sum of activations + comm buffers within one stretch of the
// run, where it is reached, and what is live there (largest first).
struct MemoryPeak {
  std::int64_t bytes = 0;
  std::string where;  // "backward: attention_backward eager dp scratch (S, S)"
  std::vector<MemoryTerm> live;
};

struct MemoryPrediction {
  // Over the whole run (forward, backward, gradient all-reduce), as
  // RankMemory::peak_activations / peak_comm_buffers / peak_working.
  std::int64_t peak_activations = 0;   // MemCategory::activations alone
  std::int64_t peak_comm_buffers = 0;  // MemCategory::comm_buffers alone
  std::int64_t peak_working = 0;       // the two together
  // activations + comm buffers during forward + backward only: the
  // "peak activation memory" `laga compare` reports (the gradient all-reduce
  // buffer is gradient traffic, reported apart as grad_sync).
  MemoryPeak forward_backward;
  MemoryPeak grad_sync;  // during mla_sync_gradients (0 when not run)
  // Activations live when forward returns: what is saved for backward, plus
  // the output (B, L_r, D).
  std::int64_t after_forward = 0;
  std::int64_t parameters = 0;  // every parameter, all ranks hold all of them
  std::int64_t gradients = 0;   // the gradient accumulators, same size
};

struct MemoryModelOptions {
  bool backward = true;   // false: forward only (RunSpec::backward)
  bool grad_sync = true;  // the gradient all-reduce after backward
  StagingRule staging = StagingRule::in_process;
};

// Rank `rank` of layout.ranks running `form` with `attention`, elements of
// elem_bytes (4 for float, 8 for double; 2 gives what the same allocation
// sequence would cost in bf16).
MemoryPrediction predict_memory(const MlaConfig& cfg, const SpLayout& layout, Form form,
                                AttentionKind attention, int rank, std::int64_t elem_bytes,
                                const MemoryModelOptions& options = {});

}  // namespace laga
