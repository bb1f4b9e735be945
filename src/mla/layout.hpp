// SpLayout — how a (B, S) batch and H heads are split over P ranks.
//
// Rank r holds tokens [seq_offset[r], seq_offset[r] + seq_count[r]) of every
// sequence of the batch (its seq shard) and owns heads
// [head_offset[r], head_offset[r] + head_count[r]) after the seq->head
// all-to-all (its head shard). Shards may be uneven: the default split gives
// the first S % P ranks one token more, and likewise for heads. A rank may own
// zero heads (H < P) but must hold at least one token.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace laga {

struct SpLayout {
  std::int64_t batch = 1, seq = 1, heads = 1;
  int ranks = 1;
  std::vector<std::int64_t> seq_count, seq_offset, head_count, head_offset;

  // Near-equal split of seq and heads.
  static SpLayout even(std::int64_t batch, std::int64_t seq, std::int64_t heads, int ranks);
  // Explicit shard sizes (must sum to seq and heads).
  static SpLayout custom(std::int64_t batch, std::vector<std::int64_t> seq_counts,
                         std::vector<std::int64_t> head_counts);
  void validate() const;
  std::string describe() const;  // "seq 5+5+4, heads 3+3+2"
};

}  // namespace laga
