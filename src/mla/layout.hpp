// SpLayout — how a (B, S) batch and H heads are split over P ranks.
//
// Rank r holds the tokens seq_ranges[r] of every sequence of the batch (its
// seq shard, seq_count[r] tokens, its ranges' rows one after the other) and
// owns heads [head_offset[r], head_offset[r] + head_count[r]) after the
// seq->head all-to-all (its head shard). Shards may be uneven: the default
// split gives the first S % P ranks one token more, and likewise for heads.
// A rank may own zero heads (H < P) but must hold at least one token.
//
// How the tokens are placed (SeqLayout, docs/forms.md, "The zigzag
// layout"): contiguous, rank r one range, in rank order; or zigzag, the
// load-balanced layout of TransformerEngine's and Megatron's context
// parallelism: the sequence cut into 2P near-equal chunks (the first S % 2P
// one token more), rank r holding chunks r and 2P-1-r, so that under a
// causal mask every rank's queries see nearly the same number of keys
// (rank P-1's two chunks are adjacent: one range). Every token-local
// computation is the same either way; what differs is which tokens a rank
// holds, so RoPE, the masks and the exchanges read seq_ranges.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace laga {

// Tokens [begin, end) of every sequence of the batch.
struct TokenRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
  friend bool operator==(const TokenRange&, const TokenRange&) = default;
};

// Where each block starts when blocks of these sizes lie one after another in
// order (exclusive prefix sums: a layout's shard and head offsets, a
// collective's displacements), and how many elements they hold in all.
std::vector<std::int64_t> offsets_of(const std::vector<std::int64_t>& counts);
std::int64_t total_of(const std::vector<std::int64_t>& counts);

// How many tokens two sets of ranges share (each ascending and disjoint).
std::int64_t tokens_in_common(const std::vector<TokenRange>& a, const std::vector<TokenRange>& b);

enum class SeqLayout { contiguous, zigzag };
const char* to_string(SeqLayout l);
SeqLayout parse_seq_layout(const std::string& s);  // "contiguous" | "zigzag"

// Chunks c and 2 parts - 1 - c of the sequence cut into 2 parts near-equal
// chunks (the first seq % (2 parts) one token more): ascending, empty ones
// dropped, adjacent ones merged into one range (c = parts - 1). The zigzag
// layout's shards and laga2d's context groups' query rows.
std::vector<TokenRange> mirrored_chunks(std::int64_t seq, int parts, int c);

struct SpLayout {
  std::int64_t batch = 1, seq = 1, heads = 1;
  int ranks = 1;
  SeqLayout seq_layout = SeqLayout::contiguous;
  std::vector<std::int64_t> seq_count, head_count, head_offset;
  std::vector<std::vector<TokenRange>> seq_ranges;  // per rank, ascending, seq_count[r] tokens

  // Near-equal split of seq and heads, the tokens placed as `l` says.
  static SpLayout even(std::int64_t batch, std::int64_t seq, std::int64_t heads, int ranks,
                       SeqLayout l = SeqLayout::contiguous);
  // Explicit shard sizes (must sum to seq and heads), contiguous.
  static SpLayout custom(std::int64_t batch, std::vector<std::int64_t> seq_counts,
                         std::vector<std::int64_t> head_counts);
  void validate() const;
  // "seq 5+5+4, heads 3+3+2"; zigzag: "seq 5+5+4 zigzag, heads 3+3+2"
  std::string describe() const;
  // B x the longest seq shard: the most tokens any rank holds.
  std::int64_t largest_shard_tokens() const;
  // The first token of rank r's shard, for a contiguous layout (laga::Error
  // on a zigzag one: its shards are not one range).
  std::int64_t shard_begin(int r) const;
  // Whether the ranks' shards, rank after rank, are the sequence in order:
  // then at B = 1 a gather of them is the (S, .) tensor as it lands.
  bool rank_major_is_sequence() const { return seq_layout == SeqLayout::contiguous; }
  // Each local token's global position, (L_r) in the shard's row order.
  std::vector<std::int64_t> positions(int r) const;
};

// The laga2d form's split of attention (docs/forms.md, "laga2d"): the P ranks
// of an SpLayout form Ph head groups x Pc context groups, P = Ph Pc, rank r in
// head group r / Pc and context group r % Pc. The sequence is cut into 2 Pc
// near-equal chunks (the first S % 2Pc one token more) and context group c
// attends the queries of chunks c and 2Pc-1-c: the causal work of an early
// chunk and its mirror add up to nearly the same for every c. Adjacent chunks
// (Pc = 1, and c = Pc-1) merge into one range. A rank attends its group's
// heads for its query ranges over keys [0, key_end(r)).
//
// The heads: at Ph = P each rank's group is its own SpLayout head shard (so
// laga2d at Ph = P is laga on any layout, uneven or with ranks without
// heads); otherwise H is split near-evenly over the Ph groups (the first
// H % Ph one head more). The input and output stay in the SpLayout's
// contiguous seq shards; only attention uses this grid.
//
// Which rank sits where on the grid (GridOrder): head-major, laga2d's, rank r
// in head group r / Pc and context group r % Pc (a head group's ranks
// consecutive); context-major, a2a_p2p's, rank r in context group r / Ph and
// head group r % Ph (a context group's ranks consecutive, so its all-to-all
// stays inside a node and the ring across context groups crosses nodes, as
// TransformerEngine's a2a+p2p places them).
enum class GridOrder { head_major, context_major };
struct HeadContextGrid {
  int head_groups = 1, context_groups = 1;  // Ph, Pc
  GridOrder order = GridOrder::head_major;
  // Per rank: its group's heads [head_offset, head_offset + head_count) and
  // its query ranges (ascending, disjoint, not adjacent; empty when S < 2Pc
  // leaves its chunks without tokens).
  std::vector<std::int64_t> head_count, head_offset;
  std::vector<std::vector<TokenRange>> queries;

  // Throws laga::Error unless 1 <= head_groups <= P and P % head_groups == 0.
  static HeadContextGrid make(const SpLayout& layout, int head_groups,
                              GridOrder order = GridOrder::head_major);
  int head_group(int rank) const;
  int context_group(int rank) const;
  int rank_at(int head_group, int context_group) const;
  // The rule when --head-groups is not given: Ph = gcd(H, P), the most head
  // groups that split the heads evenly (every rank then attends H / Ph heads
  // over 1 / Pc of the causal work, within the chunks' rounding). At P | H
  // it is P: the laga form.
  static int default_head_groups(std::int64_t heads, int ranks);
  // requested > 0 as given, 0: default_head_groups.
  static int resolve_head_groups(std::int64_t heads, int ranks, int requested);
  std::int64_t query_rows(int rank) const;  // tokens in its query ranges
  std::int64_t key_end(int rank) const;     // end of its last query range, 0 with none
  // "2 head groups x 4 context groups (heads 3+2)", "... (heads 3 per group)"
  std::string describe() const;
};

}  // namespace laga
