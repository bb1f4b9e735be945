// Packed documents as cuDNN SDPA's ragged offsets: the host-side half
// (issue 52: "packed documents as ragged offsets"). Host code only; no
// device is needed to compute or test it (cuda_test_sdpa_ragged).
//
// laga packs documents inside each batch row of a (B, S, H, d) tensor and
// says where they start with doc_start (kernels/attention.hpp, AttnShape:
// doc_start[b * S + t] is the first token of token t's document). cuDNN's
// fused SDPA takes the same storage as a ragged ("THD") batch: one cuDNN
// batch entry per document, each with its length (seq_len_q, seq_len_kv)
// and the element offset of its first token in each tensor (the ragged
// offset tensors, docs + 1 entries, the last one the end), so the causal
// mask inside a document is cuDNN's plain causal mask and no document sees
// another's keys. Self-attention only (Sq == Sk): a ring step's queries are
// a suffix of its keys, whose document cuts differ, and stay on laga's
// tiled kernel.
//
// Not done: building cuDNN's graph with these (the Q/K/V/O tensors'
// set_ragged_offset, the padding mask with the lengths) and the stats'
// layout for a ragged batch; until then cudnn_sdpa_refusal refuses
// doc_start and the tiled kernel runs packed documents
// (docs/performance.md, "What has not run on a GPU").
#pragma once

#include <cstdint>
#include <vector>

namespace laga::cuda {

struct RaggedDocuments {
  std::int64_t docs = 0;              // cuDNN's batch: every document of every row
  std::int64_t max_len = 0;           // its sequence extent: the longest document
  std::vector<std::int32_t> seq_len;  // per document (seq_len_q == seq_len_kv)
  // Element offsets of each document's first token, docs + 1 entries: in q
  // and k (H dqk elements a token) and in v and o (H dv a token).
  std::vector<std::int64_t> qk_offset, vo_offset;
};

// The ragged batch of a (B, S) doc_start, for H heads of dqk (q, k) and dv
// (v, o) elements. Throws laga::Error naming the batch row and token where
// doc_start is not a document structure (doc_start[b S] != 0, a start after
// its token, a token whose start is not its predecessor's or itself).
RaggedDocuments ragged_documents(const std::int64_t* doc_start, std::int64_t B, std::int64_t S,
                                 std::int64_t H, std::int64_t dqk, std::int64_t dv);

}  // namespace laga::cuda
