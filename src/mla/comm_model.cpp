#include "mla/comm_model.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace laga {

CommPrediction predict_comm(const MlaConfig& c, const SpLayout& lay, FormVariant variant, int r,
                            std::int64_t e, bool backward, bool grad_sync) {
  check_query_exchange(c, variant);
  check_head_groups(lay, variant);
  const Form form = variant.form;
  const bool q_latent = variant.queries == QueryExchange::latent;
  auto z = [](std::int64_t i) { return static_cast<size_t>(i); };
  const int P = lay.ranks;
  const std::int64_t B = lay.batch, Lr = lay.seq_count[z(r)];
  const std::int64_t dqk = c.qk_head_dim(), dv = c.v_head_dim,
                     W = c.kv_lora_rank + c.qk_rope_head_dim;
  // The attention's rows: every form but laga2d attends all S tokens for its
  // SpLayout head shard; laga2d its query ranges for its head group's heads
  // (HeadContextGrid).
  const bool grid = form == Form::laga2d;
  const HeadContextGrid g = grid ? laga2d_grid(lay, variant) : HeadContextGrid{};
  auto attended_heads = [&](int j) { return grid ? g.head_count[z(j)] : lay.head_count[z(j)]; };
  // The tokens of rank i's seq shard that rank j attends as queries.
  auto attended_tokens = [&](int i, int j) {
    if (!grid) return lay.seq_count[z(i)];
    const std::int64_t s0 = lay.seq_offset[z(i)], s1 = s0 + lay.seq_count[z(i)];
    std::int64_t n = 0;
    for (const TokenRange& q : g.queries[z(j)])
      n += std::max<std::int64_t>(0, std::min(s1, q.end) - std::max(s0, q.begin));
    return n;
  };
  // seq->head all-to-all of width d: this rank sends every peer its tokens
  // that the peer attends, for the peer's heads (per_head; else the one row
  // of width d, laga2d's query latent), and receives its own heads of the
  // tokens it attends from every peer.
  auto seq_to_head = [&](std::int64_t d, bool per_head = true) {
    auto heads = [&](int j) { return per_head ? attended_heads(j) : 1; };
    PredictedBytes b;
    for (int j = 0; j < P; ++j) {
      if (j == r) continue;
      b.sent += B * attended_tokens(r, j) * heads(j) * d * e;
      b.received += B * attended_tokens(j, r) * heads(r) * d * e;
    }
    return b;
  };
  auto head_to_seq = [&](std::int64_t d, bool per_head = true) {
    const PredictedBytes f = seq_to_head(d, per_head);
    return PredictedBytes{f.received, f.sent};
  };
  auto all_gather = [&](std::int64_t w) {
    PredictedBytes b;
    for (int j = 0; j < P; ++j)
      if (j != r) b.sent += B * Lr * w * e, b.received += B * lay.seq_count[z(j)] * w * e;
    return b;
  };
  auto reduce_scatter = [&](std::int64_t w) {
    const PredictedBytes f = all_gather(w);
    return PredictedBytes{f.received, f.sent};
  };

  CommPrediction p;
  auto add = [&](Phase ph, const char* label, PredictedBytes b, CollectiveKind kind) {
    if (P == 1) b = {};  // a single rank sends nothing, but the call is still made
    auto& slot = p[{ph, label}];
    slot.kind = kind;
    slot.sent += b.sent;
    slot.received += b.received;
    slot.calls += 1;
  };
  // The queries: per head seq->head, or (--q-latent) the rq-wide normalised
  // query latent all-gathered, or (laga2d with Pc > 1) sent to the ranks
  // that attend its tokens (each head group of the context group a copy).
  const std::int64_t rq = c.q_lora_rank;
  const bool q_latent_a2a = q_latent && grid && g.context_groups > 1;
  if (q_latent_a2a)
    add(Phase::forward, "q_latent_a2a", seq_to_head(rq, false), CollectiveKind::all_to_all);
  else if (q_latent)
    add(Phase::forward, "q_latent_ag", all_gather(rq), CollectiveKind::all_gather);
  else
    add(Phase::forward, "q_a2a", seq_to_head(dqk), CollectiveKind::all_to_all);
  if (form == Form::explicit_form) {
    add(Phase::forward, "k_a2a", seq_to_head(dqk), CollectiveKind::all_to_all);
    add(Phase::forward, "v_a2a", seq_to_head(dv), CollectiveKind::all_to_all);
  } else {
    add(Phase::forward, "latent_ag", all_gather(W), CollectiveKind::all_gather);
  }
  add(Phase::forward, "out_a2a", head_to_seq(dv), CollectiveKind::all_to_all);
  if (backward) {
    add(Phase::backward, "out_a2a", seq_to_head(dv), CollectiveKind::all_to_all);
    if (q_latent_a2a)
      add(Phase::backward, "q_latent_a2a", head_to_seq(rq, false), CollectiveKind::all_to_all);
    else if (q_latent)
      add(Phase::backward, "q_latent_ag", reduce_scatter(rq), CollectiveKind::reduce_scatter);
    else
      add(Phase::backward, "q_a2a", head_to_seq(dqk), CollectiveKind::all_to_all);
    if (form == Form::explicit_form) {
      add(Phase::backward, "k_a2a", head_to_seq(dqk), CollectiveKind::all_to_all);
      add(Phase::backward, "v_a2a", head_to_seq(dv), CollectiveKind::all_to_all);
    } else {
      add(Phase::backward, "latent_ag", reduce_scatter(W), CollectiveKind::reduce_scatter);
    }
  }
  if (grad_sync && P > 1) {  // one rank has nothing to sum: mla_sync_gradients returns
    // The block's parameter count from DeepSeek-V3's shapes, written out here
    // rather than taken from mla_param_shapes (which also allocates and
    // reduces the gradients), so that this term is a check on that code:
    //   wq (H dqk, D) | wq_a (rq, D) + q_norm (rq) + wq_b (H dqk, rq)
    //   wkv_a (C + dr, D), kv_norm (C), wkv_b (H (dn + dv), C), wo (D, H dv)
    const std::int64_t D = c.dim, H = c.n_heads, C = c.kv_lora_rank;
    const std::int64_t q = rq == 0 ? H * dqk * D : rq * D + rq + H * dqk * rq;
    const std::int64_t n = q + W * D + C + H * (c.qk_nope_head_dim + dv) * C + D * H * dv;
    // Reduce-scatter: every chunk but the own one out, P-1 copies of it in;
    // all-gather: the own reduced chunk to P-1 peers, every other chunk in.
    const std::int64_t own = all_reduce_chunk(n, P, r);
    const std::int64_t mine = ((n - own) + (P - 1) * own) * e;
    add(Phase::grad_sync, "grad_allreduce", {mine, mine}, CollectiveKind::all_reduce);
  }
  return p;
}

QueryExchangeCost query_exchange_cost(const MlaConfig& c, const SpLayout& lay, int r) {
  LAGA_CHECK(r >= 0 && r < lay.ranks, "query_exchange_cost: rank ", r, " is outside a layout of ",
             lay.ranks, " ranks");
  const std::int64_t Hr = lay.head_count[static_cast<std::size_t>(r)];
  return {(c.n_heads - Hr) * c.qk_head_dim(), (lay.ranks - 1) * c.q_lora_rank};
}

std::int64_t query_latent_crossover(const MlaConfig& c) {
  if (c.q_lora_rank == 0) return 0;
  const std::int64_t per_head_width = c.n_heads * c.qk_head_dim();
  return (per_head_width + c.q_lora_rank - 1) / c.q_lora_rank;
}

std::int64_t predicted_sent(const CommPrediction& p, Phase phase) {
  std::int64_t s = 0;
  for (auto& [key, b] : p)
    if (phase == Phase::count || key.first == phase) s += b.sent;
  return s;
}

PredictedBytes ring_pass_bytes(const std::vector<std::int64_t>& block_elems, int r, std::int64_t e,
                               RingDirection direction) {
  const int P = static_cast<int>(block_elems.size());
  LAGA_CHECK(P >= 1 && r >= 0 && r < P, "ring_pass_bytes: rank ", r, " of ", P,
             " blocks does not exist; pass one block size per rank and 0 <= rank < P");
  std::int64_t all = 0;
  for (std::int64_t b : block_elems) all += b;
  // The block it receives in the last step, which would go on to its home.
  const int last_in = direction == RingDirection::forward ? (r + 1) % P : (r - 1 + P) % P;
  PredictedBytes p;
  p.kind = CollectiveKind::ring_shift;
  p.calls = P - 1;
  if (P == 1) return p;
  p.sent = (all - block_elems[static_cast<size_t>(last_in)]) * e;
  p.received = (all - block_elems[static_cast<size_t>(r)]) * e;
  return p;
}

}  // namespace laga
