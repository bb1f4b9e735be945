// Step: every extent of one block on one rank (form.hpp), built once per
// step from the block's context.
#include <algorithm>
#include <type_traits>
#include <utility>

#include "core/error.hpp"
#include "mla/exchange.hpp"
#include "mla/form.hpp"
#include "mla/ops_attention.hpp"

namespace laga::detail {

using ops::mat;

Step::Step(const BlockContext& c) : ctx(c) {
  const MlaConfig& m = c.cfg;
  const SpLayout& lay = c.layout;
  const auto r = static_cast<std::size_t>(c.comm.rank());
  LAGA_CHECK(c.comm.size() == lay.ranks, "block: the communicator has ", c.comm.size(),
             " ranks but the layout was made for ", lay.ranks);
  LAGA_CHECK(lay.heads == m.n_heads, "block: the layout splits ", lay.heads,
             " heads but the config has n_heads = ", m.n_heads);
  LAGA_CHECK(c.rope.positions() >= lay.seq, "block: the RoPE table covers ", c.rope.positions(),
             " positions but the sequence has ", lay.seq);
  B = lay.batch, L = lay.seq_count[r], S = lay.seq, N = B * L, NS = B * S;
  D = m.dim, H = m.n_heads;
  dn = m.qk_nope_head_dim, dr = m.qk_rope_head_dim, dqk = dn + dr, dv = m.v_head_dim;
  C = m.kv_lora_rank, rq = m.q_lora_rank, W = C + dr, KV = dn + dv;
  Nq = rq == 0 ? H * dqk : rq;
  pos0 = lay.seq_ranges[r].front().begin;
  check_variant(m, lay, c.variant);
  tokens = Placement::seq_shards(lay);
  attention = attention_placement(lay, c.variant);
  Hr = attention.head_count[r], h0 = attention.head_offset[r];
  query_ranges = attention.tokens[r];
  Sq = attention.rows(c.comm.rank());
  Sk = query_ranges.empty() ? 0 : query_ranges.back().end;
  for (const std::vector<TokenRange>& q : attention.tokens)
    attends_all_queries = attends_all_queries && q == std::vector<TokenRange>{{0, S}};
  // The local tokens: one range, or a zigzag shard's two.
  const std::vector<TokenRange>& own_ranges = lay.seq_ranges[r];
  if (c.documents)
    LAGA_CHECK(c.documents->batch() == B && c.documents->seq() == S,
               "block: the documents are for (B ", c.documents->batch(), ", S ", c.documents->seq(),
               ") but the batch is (B ", B, ", S ", S, ")");
  // The index arrays kernels read (form.hpp, Step), made only where kernels
  // run: a count-only run has no storage to index (and at S = 10^14 they
  // would be its largest allocation). The block's one count-only decision
  // outside the op layer (docs/architecture.md, "One description, three
  // runs").
  if (current_pool().count_only()) return;
  if (const Documents* docs = c.documents) {
    doc_start = docs->doc_starts();
    positions = docs->positions(own_ranges);
    if (c.variant.queries == QueryExchange::latent) seq_positions = docs->positions({{0, S}});
  } else if (own_ranges.size() > 1) {
    // A zigzag shard: its tokens' global positions, the same for every row.
    const std::vector<std::int64_t> own = lay.positions(c.comm.rank());
    for (std::int64_t b = 0; b < B; ++b) positions.insert(positions.end(), own.begin(), own.end());
  }
}

AttnShape Step::sequence_attention(std::int64_t heads, std::int64_t kv_heads, std::int64_t d_qk,
                                   std::int64_t d_v) const {
  AttnShape s{B, S, S, heads, kv_heads, d_qk, d_v, ctx.cfg.softmax_scale(), true};
  s.doc_start = doc_start.empty() ? nullptr : doc_start.data();
  return s;
}

AttnShape Step::head_attention() const {
  return sequence_attention(Hr, Hr, dqk, dv);
}

}  // namespace laga::detail
