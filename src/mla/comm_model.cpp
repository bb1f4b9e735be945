#include "mla/comm_model.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "mla/canonical_sum.hpp"

namespace laga {

namespace {
std::size_t z(std::int64_t i) {
  return static_cast<std::size_t>(i);
}
}  // namespace

WeightElements::WeightElements(const MlaConfig& c) {
  const std::int64_t D = c.dim, H = c.n_heads, C = c.kv_lora_rank, rq = c.q_lora_rank;
  const std::int64_t dqk = c.qk_head_dim(), dv = c.v_head_dim, W = C + c.qk_rope_head_dim;
  in_proj = (rq == 0 ? H * dqk : rq) * D + W * D;
  q_norm = rq;
  wq_b = rq == 0 ? 0 : H * dqk * rq;
  kv_norm = C;
  wkv_b = H * (c.qk_nope_head_dim + dv) * C;
  wo = D * H * dv;
  wg = c.mla_use_output_gate ? H * dv * D : 0;
}

CommTerms::CommTerms(const MlaConfig& c, const SpLayout& lay, FormVariant v, int r, std::int64_t e,
                     bool bwd, bool inv, std::int64_t t)
    : cfg(c),
      layout(lay),
      variant(v),
      rank(r),
      elem_bytes(e),
      backward(bwd),
      invariant(inv),
      tensor_bytes(t),
      attention(attention_placement(lay, v)),
      weights(c) {}

PredictedBytes CommTerms::seq_to_head(std::int64_t d, bool per_head) const {
  // The tokens of rank i's seq shard that rank j attends as queries.
  auto attended_tokens = [&](int i, int j) {
    return tokens_in_common(layout.seq_ranges[z(i)], attention.tokens[z(j)]);
  };
  auto heads = [&](int j) { return per_head ? attention.head_count[z(j)] : 1; };
  const std::int64_t B = layout.batch, e = elem_bytes;
  PredictedBytes b;
  for (int j = 0; j < layout.ranks; ++j) {
    if (j == rank) continue;
    b.sent += B * attended_tokens(rank, j) * heads(j) * d * e;
    b.received += B * attended_tokens(j, rank) * heads(rank) * d * e;
  }
  return b;
}

PredictedBytes CommTerms::head_to_seq(std::int64_t d, bool per_head) const {
  const PredictedBytes f = seq_to_head(d, per_head);
  return PredictedBytes{f.received, f.sent};
}

PredictedBytes CommTerms::all_gather(std::int64_t w) const {
  const std::int64_t B = layout.batch, e = elem_bytes;
  PredictedBytes b;
  for (int j = 0; j < layout.ranks; ++j)
    if (j != rank)
      b.sent += B * layout.seq_count[z(rank)] * w * e,
          b.received += B * layout.seq_count[z(j)] * w * e;
  return b;
}

PredictedBytes CommTerms::reduce_scatter(std::int64_t w) const {
  const PredictedBytes f = all_gather(w);
  return PredictedBytes{f.received, f.sent};
}

void CommTerms::add(Phase ph, const char* label, PredictedBytes b, CollectiveKind kind) {
  if (layout.ranks == 1) b = {};
  auto& slot = result[{ph, label}];
  slot.kind = kind;
  slot.sent += b.sent;
  slot.received += b.received;
  slot.calls += 1;
}

void CommTerms::add_ring(Phase ph, const char* label, const std::vector<std::int64_t>& blocks,
                         int place, bool home) {
  if (blocks.size() <= 1) return;
  const PredictedBytes b = ring_pass_bytes(blocks, place, elem_bytes, RingDirection::forward, home);
  auto& slot = result[{ph, label}];
  slot.kind = CollectiveKind::ring_shift;
  slot.sent += b.sent;
  slot.received += b.received;
  slot.calls += b.calls;
}

void CommTerms::ring_form(const char* pass, const char* grad_pass, std::int64_t width) {
  std::vector<std::int64_t> blocks;
  for (std::int64_t n : layout.seq_count) blocks.push_back(layout.batch * n * width);
  ring_form(pass, grad_pass, blocks, rank);
}

void CommTerms::ring_form(const char* pass, const char* grad_pass,
                          const std::vector<std::int64_t>& blocks, int place) {
  add_ring(Phase::forward, pass, blocks, place, false);
  if (!backward) return;
  add_ring(Phase::backward, pass, blocks, place, false);
  add_ring(Phase::backward, grad_pass, blocks, place, true);
}

void CommTerms::to_heads(Phase ph, const char* label, std::int64_t d) {
  add(ph, label, ph == Phase::forward ? seq_to_head(d) : head_to_seq(d),
      CollectiveKind::all_to_all);
}

void CommTerms::queries(Phase ph) {
  const bool fwd = ph == Phase::forward;
  const std::int64_t rq = cfg.q_lora_rank;
  if (variant.queries == QueryExchange::heads) return to_heads(ph, "q_a2a", cfg.qk_head_dim());
  // The query latent: all-gathered where every rank attends every row;
  // else sent to the ranks that attend its tokens (each of them a copy),
  // the copies' gradients summed by the tokens' owner.
  bool all_rows = true;
  for (const std::vector<TokenRange>& q : attention.tokens)
    all_rows = all_rows && q == std::vector<TokenRange>{{0, layout.seq}};
  if (all_rows)
    return add(ph, "q_latent_ag", fwd ? all_gather(rq) : reduce_scatter(rq),
               fwd ? CollectiveKind::all_gather : CollectiveKind::reduce_scatter);
  add(ph, "q_latent_a2a", fwd ? seq_to_head(rq, false) : head_to_seq(rq, false),
      CollectiveKind::all_to_all);
}

void CommTerms::latent_gather(Phase ph) {
  latent_gather(ph, cfg.qk_nope_head_dim + cfg.v_head_dim + cfg.qk_rope_head_dim);
}

void CommTerms::latent_gather(Phase ph, std::int64_t head_columns) {
  const std::int64_t W = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
  if (ph == Phase::forward) return add(ph, "latent_ag", all_gather(W), CollectiveKind::all_gather);
  if (invariant) return head_sum_reduce_scatter("latent_ag", head_columns, W);
  add(ph, "latent_ag", reduce_scatter(W), CollectiveKind::reduce_scatter);
}

void CommTerms::token_sum(const char* label, std::int64_t width) {
  if (!invariant || !backward) return;
  const ops::PieceBytes b =
      ops::canonical_token_sum_elements(ops::sequence_shards(layout), rank, width);
  add(Phase::backward, label, {b.sent * tensor_bytes, b.received * tensor_bytes},
      CollectiveKind::all_gather);
}

void CommTerms::head_sum_reduce_scatter(const char* label, std::int64_t head_columns,
                                        std::int64_t n) {
  if (!invariant || !backward) return;
  const ops::PieceBytes b = ops::canonical_reduce_scatter_elements(
      ops::head_column_shards(layout, head_columns), ops::sequence_shards(layout), rank, n);
  add(Phase::backward, label, {b.sent * tensor_bytes, b.received * tensor_bytes},
      CollectiveKind::all_to_all);
}

void CommTerms::query_chunk_sum(const char* label, std::int64_t n) {
  if (!invariant || !backward) return;
  const ops::PieceBytes b = ops::canonical_reduce_scatter_elements(
      ops::query_chunk_shards(layout), ops::sequence_shards(layout), rank, n);
  add(Phase::backward, label, {b.sent * tensor_bytes, b.received * tensor_bytes},
      CollectiveKind::all_to_all);
}

void CommTerms::projection_sums() {
  token_sum("wo_grad", weights.wo);
  if (cfg.mla_use_output_gate) token_sum("wg_grad", weights.wg);
  token_sum("in_proj_grad", weights.in_proj);
  token_sum("kv_norm_grad", weights.kv_norm);
  if (cfg.q_lora_rank == 0) return;
  if (variant.queries == QueryExchange::heads) token_sum("wq_b_grad", weights.wq_b);
  token_sum("q_norm_grad", weights.q_norm);
}

CommPrediction predict_comm(const MlaConfig& c, const SpLayout& lay, FormVariant variant, int r,
                            std::int64_t e, bool backward, bool grad_sync, bool invariant) {
  return predict_comm(c, lay, variant, r, WireElementBytes{e, e, e}, backward, grad_sync,
                      invariant);
}

WireElementBytes wire_element_bytes(Precision p, GradReduce g, std::int64_t tensor_bytes) {
  check_grad_reduce(p, g);
  if (p == Precision::bf16) return {2, g == GradReduce::bf16 ? 2 : 4, tensor_bytes};
  return {tensor_bytes, tensor_bytes, tensor_bytes};
}

CommPrediction predict_comm(const MlaConfig& c, const SpLayout& lay, FormVariant variant, int r,
                            WireElementBytes wire, bool backward, bool grad_sync, bool invariant) {
  check_variant(c, lay, variant);
  LAGA_CHECK(!invariant || form_spec(variant.form).traits.invariant, "predict_comm: form ",
             form_spec(variant.form).name,
             " does not offer the invariant mode (docs/invariance.md, \"Which forms\"); the "
             "forms that do: ",
             names_of_forms_with(&FormTraits::invariant));
  CommTerms t(c, lay, variant, r, wire.activations, backward, invariant, wire.tensors);
  const std::int64_t e = wire.gradients;
  form_spec(variant.form).collectives(t);
  t.projection_sums();  // the invariant mode's, the same for every form
  const int P = lay.ranks;
  if (grad_sync && P > 1) {  // one rank has nothing to sum: mla_sync_gradients returns
    // The block's parameter count (WeightElements).
    const std::int64_t n = t.weights.total();
    // Reduce-scatter: every chunk but the own one out, P-1 copies of it in;
    // all-gather: the own reduced chunk to P-1 peers, every other chunk in.
    const std::int64_t own = all_reduce_chunk(n, P, r);
    const std::int64_t mine = ((n - own) + (P - 1) * own) * e;
    t.add(Phase::grad_sync, "grad_allreduce", {mine, mine}, CollectiveKind::all_reduce);
  }
  return t.result;
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
                               RingDirection direction, bool home) {
  const int P = static_cast<int>(block_elems.size());
  LAGA_CHECK(P >= 1 && r >= 0 && r < P, "ring_pass_bytes: rank ", r, " of ", P,
             " blocks does not exist; pass one block size per rank and 0 <= rank < P");
  std::int64_t all = 0;
  for (std::int64_t b : block_elems) all += b;
  // The block it receives in the last step, which would go on to its home.
  const int last_in = direction == RingDirection::forward ? (r + 1) % P : (r - 1 + P) % P;
  PredictedBytes p;
  p.kind = CollectiveKind::ring_shift;
  p.calls = P == 1 ? 0 : home ? P : P - 1;
  if (P == 1) return p;
  if (home) {
    p.sent = p.received = all * e;
    return p;
  }
  p.sent = (all - block_elems[static_cast<size_t>(last_in)]) * e;
  p.received = (all - block_elems[static_cast<size_t>(r)]) * e;
  return p;
}

}  // namespace laga
