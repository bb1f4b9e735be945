// Token sources for `laga train`.
//
//   random  B fixed sequences of S+1 tokens drawn uniformly from [0, V) by the
//           counter-based RNG (seed, stream "data.random"): the same batch
//           every step, which the model memorises (the LAGA paper's §4.5 task).
//   FILE    a flat binary of token ids, the nanoGPT / llm.c layout:
//             - llm.c: a 256 x int32 header (magic 20240520, version 1 = uint16
//               ids, 2 = uint32 ids, token count) then the ids;
//             - otherwise raw little-endian ids, uint16 unless the dtype says
//               uint32 (--data-dtype u16|u32, or auto: llm.c header if its
//               magic is there, else u32 for *.u32 / *.uint32 names, else u16
//               as nanoGPT writes).
//           Window j (j = 0, 1, ... counting every row of every step, the
//           "data cursor") starts at floor(u * (n - S)), u = uniform(seed,
//           stream "data.window", j): deterministic in (seed, cursor) alone, so
//           resuming at a cursor reproduces the stream exactly.
// A window of S+1 ids gives inputs ids[0..S) and targets ids[1..S].
//
// Packed documents (`laga train --pack-eos ID`): the stream is a
// concatenation of documents, each ending with the end-of-document token, so
// a window is already a packed row of several documents (the first and last
// cut by the window). pack_window finds them: a document ends at every EOS
// among the inputs, the next starts after it; attention stays inside each
// document (mla/documents.hpp), and the target of an EOS input (the next
// document's first token, which nothing in the current document predicts)
// is kIgnoreTarget, left out of the loss and of its token count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mla/documents.hpp"

namespace laga {

// The documents and targets of a window batch (B, S+1).
struct PackedBatch {
  Documents documents;
  std::vector<std::int32_t> targets;  // (B, S): window[t + 1], or kIgnoreTarget after an EOS
  std::int64_t counted = 0;           // targets that count in the loss
};
PackedBatch pack_window(const std::int32_t* window, std::int64_t B, std::int64_t S,
                        std::int32_t eos);

class TokenSource {
 public:
  static TokenSource random(std::int64_t vocab, std::uint64_t seed);
  // Opens and fully validates the file (exists, non-empty, whole ids, at
  // least seq + 1 of them, every id < vocab); errors name the file and the fix.
  // `option` names the file in errors ("--data", "--val-data").
  static TokenSource file(const std::string& path, const std::string& dtype, std::int64_t vocab,
                          std::int64_t seq, std::uint64_t seed,
                          const std::string& option = "--data");

  // out (B, S+1): rows for cursors cursor .. cursor + B - 1.
  void batch(std::int64_t cursor, std::int64_t B, std::int64_t S, std::int32_t* out) const;
  std::string describe() const;
  // How often `id` occurs in a file (random data: -1, not counted).
  std::int64_t occurrences(std::int32_t id) const;
  std::int64_t tokens() const { return static_cast<std::int64_t>(ids_.size()); }

 private:
  bool random_ = true;
  std::int64_t vocab_ = 0;
  std::uint64_t seed_ = 0;
  std::string path_, dtype_;
  std::vector<std::uint32_t> ids_;  // file: all ids (validated once)
};

}  // namespace laga
