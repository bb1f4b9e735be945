// DeepSeek Sparse Attention under sequence parallelism, the explicit form
// (DsaForm::explicit_form; docs/forms.md, "DSA: the explicit form"):
// Megatron-Core's head-sharded layout (mla/form_explicit.cpp) with the
// lightning indexer and the top-k as DSA needs them. Rank r holds the rows
// of its contiguous shard [s0, s0 + L) and, in the attention, every row of
// its heads [h0, h0 + H_r), and
//   forward:  projects its own rows (q, the latent, per-head K = [k_nope |
//             k_pe] and V up-projected from it: every head), all-gathers
//             the indexer's keys k_I ("index_k_ag"), runs the indexer and
//             the top-k for its own rows, all-gathers the selection
//             ("topk_ag", int32 as 4-byte words, dsa_gather_indices,
//             mla/dsa_rows.hpp; the sparse stage only: the dense
//             warm-up attends every causal key), moves Q, K, V seq->head
//             ("q_a2a", "k_a2a", "v_a2a"), attends every row for its heads
//             over the selected keys (or every causal key), sends the output
//             back ("out_a2a"), and reduce-scatters its heads' share of the
//             KL target -- the attention's head-summed distribution over
//             each row's key set -- to the rows' owners ("index_target_rs":
//             K slots a row in the sparse stage, S in the warm-up, at the
//             tensors' element);
//   backward: the adjoints of out_a2a, q_a2a, k_a2a, v_a2a, and k_I's
//             gradient reduce-scattered to its owners ("index_k_ag").
// The ledger is dsa_predict_comm(.., DsaForm::explicit_form, .., stage)
// exactly (mla/dsa_model.hpp; tests/mla/test_dsa_explicit.cpp holds it to
// that). Semantics are dsa_block's (mla/dsa_block.hpp): the KL loss over
// each rank's own rows, the indexer's input detached.
#pragma once

#include <cstdint>

#include "comm/communicator.hpp"
#include "mla/dsa_block.hpp"
#include "mla/layout.hpp"

namespace laga {

// x, dout: rank r's rows, (B, L, D) with L = layout.seq_count[r]; dout null:
// forward, the selection and the KL loss only. The result holds r's rows
// (out, dx: (B, L, D); idx: (B, L, index_topk), global key positions) and
// r's partial weight gradients and KL loss: summed over the ranks (the
// gradient all-reduce, not done here) they are dsa_block's. Contiguous
// layouts only (laga::Error on zigzag); layout.heads must be cfg.n_heads.
// doc_start (B, S), every rank's the same, or null: packed documents as
// dsa_latent_gather takes them (mla/dsa_cp.hpp).
template <class T>
DsaBlockResult<T> dsa_explicit(const MlaConfig& cfg, const MlaParams<T>& w,
                               const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                               const SpLayout& layout, DsaStage stage, Communicator& comm,
                               const std::int64_t* doc_start = nullptr);

}  // namespace laga
