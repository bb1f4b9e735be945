// DeepSeek Sparse Attention under sequence parallelism, LAGA's head-sharded
// forms (DsaForm::laga_indices and DsaForm::laga_recompute; docs/forms.md,
// "DeepSeek Sparse Attention (DSA)"). Rank r holds the rows of its
// contiguous shard [s0, s0 + L) (x, dout, out, dx) and attends every query
// of the sequence for its heads [h0, h0 + H_r), per head, over the keys the
// indexer selected (sparse stage) or every causal key (dense warm-up):
//   both:     the latent [c | k_pe] all-gathered ("latent_ag") and each
//             head's K/V up-projected from it; the indexer's keys k_I
//             all-gathered ("index_k_ag"); each rank's heads' share of the
//             head-summed attention distribution reduce-scattered to the
//             queries' owners ("index_target_rs"), who compute the KL loss
//             and its gradient over their own rows; the heads' outputs
//             all-to-all'd back ("out_a2a").
//   laga_indices:   q all-to-all'd to the head owners ("q_a2a"); each query's
//             owner runs the indexer and the top-k for its rows, and the
//             indices of every query are all-gathered ("topk_ag", int32):
//             S K 4 bytes a rank.
//   laga_recompute: the query latent qr all-gathered ("q_latent_ag"), each
//             rank projecting its heads' queries itself; the indexer's
//             weights w all-gathered ("index_w_ag"), and every rank runs
//             the indexer and top-k for every query from the gathered qr,
//             k_I and w (P times the indexer's work): no index moves.
//   backward: each exchange's adjoint (out_a2a, q_a2a or q_latent_ag,
//             latent_ag, index_k_ag); the indices and the KL target carry
//             no gradient.
// In the dense warm-up the main attention reads every causal key, so no
// index moves in either form (no topk_ag, no index_w_ag): each query's owner
// runs the indexer for its own rows, and the KL target spans every causal
// key (S slots a query).
// The ledger is dsa_predict_comm(.., form, .., stage) exactly
// (mla/dsa_model.hpp; tests/mla/test_dsa_laga.cpp holds it to that).
// Semantics are dsa_block's (mla/dsa_block.hpp): the LM gradient through the
// attended keys, the indexer trained by its KL alone, its input detached.
// The selection is the same on every rank and form: the same scores, the
// same tie rule (kernels/dsa_indexer.hpp).
#pragma once

#include <cstdint>

#include "comm/communicator.hpp"
#include "mla/dsa_block.hpp"
#include "mla/dsa_model.hpp"
#include "mla/layout.hpp"

namespace laga {

// x, dout: rank r's rows, (B, L, D) with L = layout.seq_count[r]; dout null:
// forward, the selection and the KL loss only. The result holds r's rows
// (out, dx: (B, L, D); idx: (B, L, index_topk), global key positions) and
// r's partial weight gradients and KL loss: summed over the ranks (the
// gradient all-reduce, not done here) they are dsa_block's. `form` is
// laga_indices or laga_recompute (laga::Error naming any other); the heads
// are the layout's head_count / head_offset (a rank may hold none);
// contiguous layouts only (laga::Error on zigzag).
// doc_start (B, S), every rank's the same, or null: packed documents as
// dsa_latent_gather takes them (mla/dsa_cp.hpp).
template <class T>
DsaBlockResult<T> dsa_laga(const MlaConfig& cfg, const MlaParams<T>& w,
                           const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                           const SpLayout& layout, DsaStage stage, DsaForm form, Communicator& comm,
                           const std::int64_t* doc_start = nullptr);

}  // namespace laga
