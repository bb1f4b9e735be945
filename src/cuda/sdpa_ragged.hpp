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
// cuda::CudnnSdpa builds its graphs from these (the Q/K/V/O tensors'
// ragged offsets, the padding mask with the lengths) when a call has
// doc_start; the softmax stats keep laga's (B, Hq, Sq) layout, each
// document's entry offset to its row and first token (ragged_stats_offsets).
// Not run on a GPU yet (docs/performance.md, "What has not run on a GPU").
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
  // The packed token (b S + t) where each document starts, docs + 1
  // entries, the last B S: the offsets of any (B, S, H, d) tensor are these
  // times H d (ragged_offsets).
  std::vector<std::int64_t> first_token;
  std::int64_t S = 0;  // the rows' length, for the stats' offsets
};

// The ragged batch of a (B, S) doc_start, for H heads of dqk (q, k) and dv
// (v, o) elements. Throws laga::Error naming the batch row and token where
// doc_start is not a document structure (doc_start[b S] != 0, a start after
// its token, a token whose start is not its predecessor's or itself).
RaggedDocuments ragged_documents(const std::int64_t* doc_start, std::int64_t B, std::int64_t S,
                                 std::int64_t H, std::int64_t dqk, std::int64_t dv);

// cuDNN's ragged offset tensor (int32, docs + 1 entries) of a (B, S, H, d)
// tensor: first_token times per_token = H d elements. Throws laga::Error
// naming the tensor when an offset is past int32 (cuDNN's offset type here).
std::vector<std::int32_t> ragged_offsets(const RaggedDocuments& r, std::int64_t per_token,
                                         const char* tensor);

// The same for the softmax stats in laga's (B, Hq, S) layout (lse[b][h][t]):
// document i of row b from token t0 starts at b Hq S + t0, and cuDNN steps
// h by S and t by 1 inside it (strides {., S, 1, 1}); the last entry B Hq S.
std::vector<std::int32_t> ragged_stats_offsets(const RaggedDocuments& r, std::int64_t Hq);

}  // namespace laga::cuda
