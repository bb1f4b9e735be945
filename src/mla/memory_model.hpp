// Predicted activation memory of one MLA block on one rank: the peak bytes
// the rank's MemoryPool sees during one forward + backward (+ gradient
// all-reduce), per form and attention kernel, from the config and the layout
// alone, at any scale, in milliseconds.
//
// How: it is the count-only run of the block itself (docs/architecture.md,
// "One description, three runs"): the rank runs under a count-only pool (every
// tensor has its shape and registers its bytes, none has storage, no kernel
// runs) on a dry-run communicator that stages collectives as the chosen
// backend does, and the pool's peaks and its live list at the peak are the
// prediction. It is exact because it is the same code: nothing restates a
// form's allocation sequence. What the count-only run cannot vouch for on
// its own, tests check apart: that the real run allocates what the counted
// one does (tests/mla/test_memory_model.cpp), and an independent closed form
// of what each form saves for backward (saved_for_backward below, the
// paper's Table 2 quantity), against the pool after forward.
//
// What an op keeps for backward outside its outputs is a pool tensor too,
// made in the count-only run as in the real one, so the prediction has it:
// the bf16 operand copies and attention scratch, and laga_fused's wkv_b
// rows rounded to bf16 values under --dtype bf16 (ops_attention.hpp,
// FusedLatentKept; HeapOutsidePool.Bf16ForwardKeepsNoMoreHeapThanFp32 holds
// every form's bf16 forward to keeping nothing else; docs/accounting.md).
//
// Every figure is in bytes above what is live when forward starts (the
// rank's input and dout shards, parameters, gradient accumulators), as
// laga::run_rank measures it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.hpp"  // StagingRule
#include "core/memory_pool.hpp"
#include "mla/block.hpp"
#include "mla/ops.hpp"

namespace laga {

struct MemoryTerm {
  std::string name;  // "attn_stats eager probs [1, 16, 4096, 4096]"
  MemCategory category = MemCategory::activations;
  std::int64_t bytes = 0;
};

// The largest sum of activations + comm buffers within one stretch of the
// run, where it is reached, and what is live there (largest first).
struct MemoryPeak {
  std::int64_t bytes = 0;
  std::string where;  // "backward: eager dp scratch [4096, 4096]"
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
  // What the rank's pool may hold beyond its tensors' own peak, in any
  // number of steps: page rounding and the blocks its cache keeps for reuse
  // (MemoryPool::held_bound() less the peak of every tensor of the counted
  // run). An upper bound, 0 with the cache off; counted in fp32 and scaled
  // to elem_bytes like the rest (page rounding then approximately).
  std::int64_t cache_allowance = 0;
};

// One collective event of a counted run (CollectiveEvent: issued or waited)
// and the rank's op counts up to it, cumulative (mla/ops.hpp).
struct StepEvent {
  CollectiveEvent event;
  ops::OpCounts ops_before;
};

struct MemoryModelOptions {
  bool backward = true;   // false: forward only (RunSpec::backward)
  bool grad_sync = true;  // the gradient all-reduce after backward
  StagingRule staging = StagingRule::in_process;
  // When set, the counted run's ops are added here (mla/ops.hpp, "Op
  // counts"), elementwise bytes in the counted element type (4 or 8 bytes).
  ops::OpCounts* op_counts = nullptr;
  // When set (with op_counts), each collective and each wait of the counted
  // run, in the rank's order, with the ops counted before it: the step as a
  // timeline (plan/time_model.hpp costs it, overlap included).
  std::vector<StepEvent>* timeline = nullptr;
  // The OpenMP threads the rank runs on; 0: threads_per_rank(layout.ranks),
  // what an in-process or MPI run gives each rank (core/threads.hpp). A bf16
  // run's flash workspace is per thread, so the count follows it.
  int threads = 0;
  // The invariant mode's run (RunSpec::invariant; docs/invariance.md).
  bool invariant = false;
};

// Rank `rank` of layout.ranks running `variant` (a form and its query
// exchange) with `attention`, elements of
// elem_bytes (4 for float, 8 for double; 2 gives what the same allocation
// sequence would cost in bf16: every tensor's bytes are elements times the
// element size, so bf16 is exactly half of fp32).
MemoryPrediction predict_memory(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                                AttentionKind attention, int rank, std::int64_t elem_bytes,
                                const MemoryModelOptions& options = {});

// The independent closed form of what `variant` keeps alive from forward to
// backward on `rank` (the activations live when forward returns, the output
// (B, L_r, D) included), in elements: written from the forms' math
// (docs/forms.md, "What each form saves"), not from their code.
std::int64_t saved_for_backward_elements(const MlaConfig& cfg, const SpLayout& layout,
                                         FormVariant variant, AttentionKind attention, int rank);

// The extents a form's own term of that closed form is written in
// (FormSpec::saved_elements), for one rank: its attention's rows and keys
// where the form places them (FormSpec::attention).
struct SavedShape {
  SavedShape(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
             AttentionKind attention, int rank);
  const MlaConfig& cfg;
  const SpLayout& layout;
  const FormVariant variant;
  const int rank;
  const bool eager;
  const Placement placement;  // where each rank attends
  std::int64_t B, L, S;       // batch, local tokens, sequence
  std::int64_t Hr;            // the heads this rank attends
  std::int64_t Sq, Sk;        // its query rows, and the keys [0, Sk) they see
  std::int64_t dqk, dv, C, W;
  // The head attention's q_h (B, Sq, H_r, dqk), k_h and v_h (B, Sk, H_r, .)
  // and its statistics: eager's probabilities, (B, H_r, n, e) for each
  // query range of n rows ending at e, or flash's lse (B, H_r, Sq) and
  // output (B, Sq, H_r, dv). Over the whole sequence, Sq = Sk = S.
  std::int64_t head_attention() const;
  // Its attention's statistics alone: eager's probabilities, (B, H_r, n, e)
  // for each query range of n rows ending at e (on zigzag shards too: the
  // keys before e are every rank's, whoever holds them), or flash's lse
  // (B, H_r, Sq).
  std::int64_t attention_stats() const;
};

}  // namespace laga
