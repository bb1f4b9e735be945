// DeepSeek Sparse Attention under sequence parallelism, the query-local
// latent gather (DsaForm::latent_gather; docs/forms.md, "DeepSeek Sparse
// Attention (DSA)"): the field's context-parallel form for DSA (Megatron-Core,
// hyper-parallel, PaddleFleet, prime-rl). Rank r holds the query rows of its
// contiguous shard [s0, s0 + L) with every head and
//   forward:  all-gathers the latent [c | k_pe] ("latent_ag") and the
//             indexer's keys k_I ("index_k_ag") of every rank, runs the
//             indexer and the top-k for its own rows against every key
//             before s0 + L, and attends in latent space (q_nope W_UK
//             against [c | k_pe], values c, o_lat W_UV^T);
//   backward: reduce-scatters the latent's and k_I's gradients to their
//             owners (the same labels, Phase::backward); everything else is
//             the rank's own rows.
// The ledger is dsa_predict_comm(.., DsaForm::latent_gather, ..) exactly
// (mla/dsa_model.hpp; tests/mla/test_dsa_cp.cpp holds it to that).
// Semantics are dsa_block's (mla/dsa_block.hpp): the KL loss over each
// rank's own rows, the indexer's input detached.
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
// layouts only (laga::Error on zigzag).
// doc_start (B, S), every rank's the same, or null (one document per row):
// packed documents as AttnShape::doc_start gives them (kernels/
// attention.hpp); a token's RoPE position restarts at its document's start,
// and its indexer and attention read only its document's keys.
template <class T>
DsaBlockResult<T> dsa_latent_gather(const MlaConfig& cfg, const MlaParams<T>& w,
                                    const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                                    const SpLayout& layout, DsaStage stage, Communicator& comm,
                                    const std::int64_t* doc_start = nullptr);

}  // namespace laga
