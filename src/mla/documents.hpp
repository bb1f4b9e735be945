// Packed sequences: the documents of each batch row (docs/forms.md,
// "Packed sequences"; the math in docs/mla-math.md).
//
// Row b of a (B, S) batch is cut into documents by cu_seqlens_b =
// [0, e_1, ..., e_n = S], strictly increasing: document k holds tokens
// [e_k, e_{k+1}). Attention is causal within a document and zero across
// documents, and RoPE positions restart at 0 at each document start. No
// Documents (a null pointer where one is taken) is one document per row,
// which is exactly the unpacked block.
//
// The cut points are all a Documents holds: per-token arrays (a token's
// document start, its position in its document) are made on demand for the
// tokens a kernel is about to read, so a count-only run at any S costs
// nothing per token.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mla/layout.hpp"

namespace laga {

class Documents {
 public:
  // rows: one cu_seqlens shared by every row, or one per row. `source` names
  // where they came from ("--doc-lens", "cu_seqlens in in.safetensors") for
  // the error (laga::Error) a bad list gets: not starting at 0, not ending at
  // `seq`, not strictly increasing (a zero or negative length), more
  // documents than tokens, or a row count other than 1 or `batch`.
  static Documents from_cu_seqlens(const std::string& source, std::int64_t batch, std::int64_t seq,
                                   const std::vector<std::vector<std::int64_t>>& rows);
  // `--doc-lens` text: document lengths separated by ',', rows by '/':
  // "5,7/12" is row 0 = 5 + 7 tokens, row 1 = 12; a list without '/' is
  // shared by every row. Each row's lengths must sum to `seq`.
  static Documents parse_lengths(const std::string& text, std::int64_t batch, std::int64_t seq);

  std::int64_t batch() const { return batch_; }
  std::int64_t seq() const { return seq_; }
  // Row b's cut points [0, ..., S].
  const std::vector<std::int64_t>& cu_seqlens(std::int64_t b) const;
  std::int64_t count(std::int64_t b) const { return std::int64_t(cu_seqlens(b).size()) - 1; }
  // Whether every row has the same cut points (one list given for all):
  // what is summed over rows is then one row's times the batch.
  bool shared() const { return rows_.size() == 1; }
  std::string describe() const;  // "5,7/12": the --doc-lens spelling

  // (B, S): doc_start[b * S + t] = the first token of token t's document,
  // as AttnShape::doc_start takes it.
  std::vector<std::int64_t> doc_starts() const;
  // (B, L): the in-document position of the tokens `ranges` (L in all, one
  // range after the other: a rank's seq shard) of every row, as
  // rope_apply_at takes them.
  std::vector<std::int64_t> positions(const std::vector<TokenRange>& ranges) const;
  // (query, key) pairs a causal packed attention computes, summed over rows:
  // sum over documents of len (len + 1) / 2.
  double causal_pairs() const;

 private:
  std::int64_t batch_ = 1, seq_ = 1;
  std::vector<std::vector<std::int64_t>> rows_;  // size 1 (shared) or batch_
};

}  // namespace laga
